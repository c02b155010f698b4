"""The backward pass: prune, seed, walk the nodes in reverse, accumulate (DESIGN.md sections 1 to 3).

This is Caffe2's ``GradientRegistry``/``IR.GetBackwardPass`` done on an SSA graph: every value version has one
producer, so the gradient of a version is complete once every node after its producer has been visited;
contributions from several readers are added by the :class:`~.accumulate.Accumulator`, one ``Sum`` per
version (or a running ``Add`` chain), and sparse rows from ``Gather`` are concatenated instead. ONNX sequences
of floating-point tensors carry gradients too: the cotangent of a sequence is a sequence (the reads of its
``SequenceAt`` readers until a rule needs it dense, :mod:`.accumulate`).

For each node the pass builds the rule's immutable :class:`~.context.Ctx`, calls the rule, emits the
cotangents of the inputs that need one (a rule returns functions for them, :mod:`.context`), checks each
against its primal (dtype and rank, as JAX's ``ct_check``), and applies a control-flow rule's forward patch.
Subgraphs (loop bodies, branches) are differentiated by the same pass through ``ctx.backward``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from .. import validate as V
from ..errors import GraphError, InternalError
from ..ir import Graph, Node, ValueInfo, require_graph
from ..ir.arguments import GRAPH
from ..ir.ssa import captured_names, is_ssa
from ..onnx_io.value_types import differentiable, infer_types
from ..warn import warn
from .accumulate import Accumulator, Grad, SeqGrad, sequence_types, zeros_sequence
from .algebra import name_of
from .arguments import (
    default_wrt,
    known_names,
    names_argument,
    refuse_integer_loss,
    seeds_argument,
    suggest,
    used_names,
)
from .context import BodyVJP, Ctx, Options, PatchedVJP, apply_patch
from .emitter import Emitter
from .finite import nonfinite_cotangents, nonfinite_values
from .loops.lower import lower_to_loops
from .node_checks import check_nodes
from .ranges import refined_nodes
from .registry import NOT_DIFFERENTIABLE, get_rule, unsupported_message
from .rules.quant import QUANTIZERS
from .sparse import SparseGrad


def _captures(node: Node) -> list[str]:
    names: list[str] = []
    for sub in node.subgraphs.values():
        names.extend(captured_names(sub))
    return names


def _other_reads(node: Node, writers: Mapping[str, Node]) -> list[str]:
    """What ``node`` reads besides its inputs: the values its subgraphs capture, and :func:`_pair_reads`."""
    if not node.attrs and node.op_type != "DequantizeLinear":  # (most nodes: neither applies)
        return []
    return [*_captures(node), *_pair_reads(node, writers)]


def _pair_reads(node: Node, writers: Mapping[str, Node]) -> list[str]:
    """The inputs of the QuantizeLinear (DynamicQuantizeLinear: its input and scale) that writes a
    DequantizeLinear's quantized input: the pair is
    differentiated as one function by the DequantizeLinear rule (the straight-through estimator,
    rules/quant.py), which gives them gradients through ``PatchedVJP.captured``; so the pair reads them."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return []
    q = writers.get(node.inputs[0])
    if q is None or q.op_type not in QUANTIZERS or q.domain not in ("", "ai.onnx"):
        return []
    if q.op_type == "DynamicQuantizeLinear":  # its scale is an output, which the estimator differentiates too
        return [q.inputs[0], q.outputs[1]] if q.outputs[0] == node.inputs[0] else []
    return [i for i in q.inputs if i]


#: operators whose integer result, from a float input, is a cut the user may not expect (DESIGN section 5):
#: comparisons and other operators declared not differentiable make their bool and integer results on purpose
_CASTS = frozenset({"Cast", "CastLike", "Pow"})


def prune(graph: Graph, ys: Iterable[str], wrt: Iterable[str], types: dict[str, ValueInfo],
          writers: Mapping[str, Node] | None = None, casts: list[Node] | None = None) -> list[Node]:
    """The nodes on a path from a ``wrt`` value to a ``ys`` value through floating-point values (tensors, and
    sequences of them: :func:`~.accumulate.differentiable`), in order. Integer and boolean values, and
    operators declared not differentiable, cut paths. ``writers``: the node writing each value, if known.
    ``casts``: where given, receives the reached nodes that cut a path by casting to an integer
    (:func:`warn_integer_cuts`)."""
    reach = set(wrt)
    reached_nodes = []
    if writers is None:
        writers = {o: n for n in graph.nodes for o in n.outputs if o}
    for node in graph.nodes:
        if node.op_type in NOT_DIFFERENTIABLE and node.domain in ("", "ai.onnx"):
            continue
        if not reach.isdisjoint(node.inputs) or not reach.isdisjoint(_other_reads(node, writers)):
            reached_nodes.append(node)
            reach.update(o for o in node.outputs if o and differentiable(types.get(o)))
            if casts is not None and node.op_type in _CASTS and not node.domain and node.outputs \
                    and _is_integer(types.get(node.outputs[0])):
                casts.append(node)
    wanted = set(ys)
    wanted.discard("")
    needed = []
    for node in reversed(reached_nodes):
        if not wanted.isdisjoint(node.outputs):  # ("" is never in wanted)
            needed.append(node)
            wanted.update(i for i in [*node.inputs, *_other_reads(node, writers)] if i in reach)
    needed.reverse()
    return needed


def warn_integer_cuts(graph: Graph, ys: Iterable[str], cuts: list[Node], types: Mapping[str, ValueInfo]) -> None:
    """Warn, naming the node, where a path from a ``wrt`` value to a ``ys`` value passes a ``Cast``/``CastLike``
    to an integer type (or a ``Pow`` with an integer result) from a floating-point value: the gradient along
    that path is 0, as through any integer value, and :func:`prune` cuts it, so no rule sees the node and says
    so (DESIGN section 5: "zeros, with a warning naming the node"). ``cuts``: such nodes that a wrt value
    reaches (what :func:`prune` collects); one backward pass over the graph only when there is one."""
    if not cuts:
        return
    wanted = {y for y in ys if y}
    for node in reversed(graph.nodes):
        if not wanted.isdisjoint(node.outputs):
            wanted.update(i for i in [*node.inputs, *_captures(node)] if i)
    for node in cuts:
        if node.outputs[0] in wanted:
            floats = [i for i in node.inputs if i and differentiable(types.get(i))]
            warn(f"{node.label()}: its output {node.outputs[0]!r} is {types[node.outputs[0]].dtype}, an integer, so "
                 f"no gradient flows to {', '.join(map(repr, floats))} through it")


def _is_integer(vi: ValueInfo | None) -> bool:
    return vi is not None and vi.kind == "tensor" and vi.dtype is not None and vi.dtype.kind in "iub"


@V.arguments(graph=GRAPH, wrt=V.NAMES, accumulate=V.nullable(V.one_of, choices=("sum", "running")))
def backward(
    graph: Graph,
    ys: Mapping[str, str | None] | Iterable[str],
    wrt: Iterable[str] | None = None,
    *,
    accumulate: str | None = None,
    types: dict[str, ValueInfo] | None = None,
    emitter: Emitter | None = None,
    options: Options | None = None,
) -> tuple[list[Node], dict[str, Grad]]:
    """The Caffe2-style backward pass of ``graph`` (which must be in SSA form, see :func:`revgraph.to_ssa`).

    ``ys`` maps each differentiated value to its seed: ``None`` for ones of the value's shape (so a
    non-scalar y is differentiated as the sum of its elements), or the name of a value holding the cotangent.
    ``wrt`` lists the values gradients are wanted for (default: every floating-point input and initializer);
    only nodes on a path from them to ``ys`` are differentiated. ``options``: what rules read (the loops'
    checkpoint policy, the accumulation). ``accumulate``: ``"sum"`` or ``"running"`` (:class:`Accumulator`),
    taking the place of ``options.accumulate`` (``None``: the options', ``"sum"`` by default). Returns the emitted
    backward nodes and ``grad_map``: every value that received a gradient mapped to it (a value name, a
    :class:`SparseGrad` for a table read only through ``Gather``, or a
    :class:`~.accumulate.SeqGrad` for a sequence read through ``SequenceAt``).
    A loop on the path is extended in place (its trip counter and stacked residuals, :class:`ForwardPatch`).

    Raises :class:`GraphError` for a graph not in SSA form, an unknown name, operators without a VJP rule
    on a needed path (all of them named in one message), or a cotangent whose dtype or rank differs from its
    primal's; :class:`InternalError` for a rule that returns the wrong number of cotangents.
    """
    require_graph(graph, "backward")
    if not is_ssa(graph):
        raise GraphError("backward needs a graph in SSA form; convert it with revgraph.to_ssa first")
    ys = seeds_argument(ys)
    types = types if types is not None else infer_types(graph)
    known = known_names(graph) | set(captured_names(graph))  # a subgraph may output an enclosing value
    for name in ys:
        if name not in known:
            raise GraphError(f"no value named {name!r} to differentiate{suggest(name, known)}")
        refuse_integer_loss(name, types)
    wrt = default_wrt(graph, types) if wrt is None else names_argument(wrt, "wrt")
    e = emitter or Emitter(types, used_names(graph), graph.opset)
    options = options or Options()
    if accumulate is not None and accumulate != options.accumulate:
        options = replace(options, accumulate=accumulate)
    lower_to_loops(graph, types, e.used)
    e.learn_constants(graph)
    check_nodes(graph, types, e.values)  # inconsistent constants and shapes: one line, before any rule builds
    sequence_types(graph.nodes, types, e.values, graph.opset)
    _type_seeds(graph, ys, types)
    acc = Accumulator(e, options.accumulate)
    producers = {o: n for n in graph.nodes for o in n.outputs if o}
    casts: list[Node] = []
    nodes = prune(graph, ys, wrt, types, producers, casts)
    warn_integer_cuts(graph, ys, casts, types)

    missing = [n for n in nodes if get_rule(n) is None]
    if missing:
        raise GraphError(unsupported_message(missing))

    for y, seed in ys.items():
        if seed is None:
            with e.scope(f"seed/{y}"):
                # a sequence loss is the sum of its elements' sums: its seed is a sequence of ones (an ONNX
                # Shape of a sequence is not defined)
                vi = types.get(y)
                seed = zeros_sequence(e, y, 1.0) if vi is not None and vi.kind == "sequence" else e.ones_like(y)
        acc.add(y, seed)

    reach = set(wrt)
    for node in nodes:
        reach.update(o for o in node.outputs if o and differentiable(types.get(o)))
    # the forward values that may be inf or NaN, also without strong zeros: rules mask such values by what the
    # forward selects (a loss reads only labelled log-probabilities), which is linear in the cotangent, and
    # forward mode transposes that VJP (issue 27: its JVP was NaN where the gradient was not)
    refined = refined_nodes(graph.nodes, e.values)  # Sqrt, Div, Pow, ... kept away from their singular points
    inputs = [i for i in graph.input_names if i not in options.finite_inputs]
    risky = nonfinite_values(graph.nodes, e.values, types, inputs=inputs, refined=refined)
    seeds = dict.fromkeys(ys) if options.tangents else ys
    unsafe, singular = set(), set()
    if options.strong_zeros:
        unsafe = nonfinite_cotangents(nodes, seeds, e.values, risky, types, refined)
        # infinite even where every forward value is finite (Sqrt's at 0): where a zero partial stops them
        singular = unsafe if options.tangents else _singular(nodes, ys, wrt, e.values, types, options.seeds_singular,
                                                             refined)
    shared = {"risky": frozenset(risky), "reach": frozenset(reach), "options": options, "refined": refined,
              "backward": _subgraph_pass(e), "producers": MappingProxyType(producers)}
    grad_map: dict[str, Grad] = {}
    for node in reversed(nodes):
        out_grads = [acc.rule_total(o) if o else None for o in node.outputs]
        for o, g in zip(node.outputs, out_grads, strict=True):
            if g is not None:
                grad_map[o] = g
        if all(g is None for g in out_grads):
            continue
        need = tuple(bool(i) and i in reach and differentiable(types.get(i)) for i in node.inputs)
        if not any(need) and not node.subgraphs and not any(i in reach for i in _pair_reads(node, shared["producers"])):
            continue
        outs = [o for o in node.outputs if o]
        ctx = Ctx(e, node, need, not any(o in unsafe for o in outs), any(o in singular for o in outs), **shared)
        with e.scope(f"grad/{node.name or node.op_type}"):
            in_grads, captured = _run_rule(ctx, node, out_grads, graph)
        if len(in_grads) != len(node.inputs):
            raise InternalError(f"the VJP rule of {node.op_type} returned {len(in_grads)} cotangents for "
                                f"{len(node.inputs)} inputs ({node.label()})")
        for name, g in [*zip(node.inputs, in_grads, strict=True), *captured.items()]:
            if g is not None and name and name in reach and differentiable(types.get(name)):
                check_cotangent(e.types, node, name, g)
                acc.add(name, g)
    for w in wrt:
        g = acc.total(w)
        if g is not None:
            grad_map[w] = g
    return e.nodes, grad_map


def _singular(nodes: list[Node], ys: Mapping[str, str | None], wrt: list[str], values: Mapping, types: dict,
              seeds_singular: bool, refined: frozenset[int]) -> set[str]:
    """The values whose cotangents may be infinite at finite forward values (:func:`nonfinite_cotangents` without
    the forward values' risk). Seeds that are not may still become so in a loop body: a body whose VJP makes
    the cotangent of a wrt value (a carried value) singular feeds it back as the next iteration's seed."""
    found = nonfinite_cotangents(nodes, ys if seeds_singular else dict.fromkeys(ys), values, frozenset(), types,
                                 refined)
    if not seeds_singular and not found.isdisjoint(wrt):
        found = nonfinite_cotangents(nodes, ys, values, frozenset(), types, refined)
    return found


def _type_seeds(graph: Graph, ys: Mapping[str, str | None], types: dict[str, ValueInfo]) -> None:
    """A seed that is a graph input declared without a dtype (declared before the loss's type was known: a loss
    computed from sequences, which node by node inference does not follow) takes the type of its value."""
    for y, seed in ys.items():
        vi = types.get(y)
        for k, inp in enumerate(graph.inputs):
            if seed and inp.name == seed and inp.dtype is None and vi is not None and vi.dtype is not None:
                graph.inputs[k] = types[seed] = ValueInfo(seed, vi.dtype, vi.shape)


def _run_rule(ctx: Ctx, node: Node, out_grads: list, graph: Graph) -> tuple[list, dict[str, Grad]]:
    """Call ``node``'s rule; emit the cotangents of the inputs that need one; apply a forward patch."""
    result = get_rule(node)(ctx, node, out_grads)
    if isinstance(result, PatchedVJP):
        grads, captured, patch = list(result.inputs), result.captured, result.patch
    else:
        grads, captured, patch = list(result), {}, None
    if len(grads) != len(node.inputs):
        return grads, {}  # reported by the caller
    grads = [name_of(g() if callable(g) else g) if needed else None for needed, g in zip(ctx.need, grads, strict=True)]
    if patch is not None:  # after the lazy cotangents, which may add to it
        apply_patch(graph, node, patch)  # new inputs (a counter's initial value) get no gradient
        grads += [None] * (len(node.inputs) - len(grads))
    return grads, dict(captured)


def check_cotangent(types: Mapping[str, ValueInfo], node: Node, name: str, g: Grad) -> None:
    """Raise :class:`GraphError` when the cotangent ``g`` that ``node``'s rule gives input ``name`` has another
    dtype or rank than ``name`` (where both are known), or is a sequence where ``name`` is a tensor or the
    other way round: a cotangent lives in its primal's space (JAX's ``ct_check``). A :class:`SparseGrad`'s rows
    have the primal's rank; a :class:`SeqGrad`'s reads the type of the primal sequence's elements."""
    primal = types.get(name)
    if primal is None:
        return
    if isinstance(g, SeqGrad):
        if primal.kind != "sequence":
            _mismatch(types, node, name, primal, "a sequence")
        for _, read in g.reads:
            _check_type(types, node, name, primal, types.get(read))
        return
    ct = types.get(g.values if isinstance(g, SparseGrad) else g)
    if ct is not None and (ct.kind == "sequence") != (primal.kind == "sequence") and ct.dtype is not None:
        _mismatch(types, node, name, primal, "a sequence" if ct.kind == "sequence" else "a tensor")
    _check_type(types, node, name, primal, ct)


def _check_type(types: Mapping[str, ValueInfo], node: Node, name: str, primal: ValueInfo,
                ct: ValueInfo | None) -> None:
    if ct is None:
        return
    if primal.dtype is not None and ct.dtype is not None and primal.dtype != ct.dtype:
        what = f"dtype {ct.dtype}"
    elif primal.shape is not None and ct.shape is not None and len(primal.shape) != len(ct.shape):
        what = f"rank {len(ct.shape)}"
    else:
        return
    _mismatch(types, node, name, primal, f"{what} ({ct.describe()})")


def _mismatch(types: Mapping[str, ValueInfo], node: Node, name: str, primal: ValueInfo, what: str) -> None:
    raise GraphError(f"{node.label()}: the VJP of {node.op_type} gives input {name!r} ({primal.describe()}) a "
                     f"cotangent of {what}; the declared types of the model may be inconsistent (check it "
                     "with onnx.checker and shape inference), or this is a revgraph bug worth reporting")


def _subgraph_pass(parent: Emitter):
    """``ctx.backward``: the backward pass of a subgraph (a loop body, a branch), emitted apart."""

    def run(body: Graph, seeds: Mapping[str, str], wrt: list[str], *, types: dict[str, ValueInfo],
            options: Options, singular: bool = True) -> BodyVJP:
        sub = parent.child(types, "grad")
        # the seeds are the cotangents of the body's outputs: singular where the enclosing node's (``singular``:
        # its ``ctx.singular``) are, or where the body feeds its own back (_singular); not tangents
        inner = replace(options, tangents=False, seeds_singular=singular, finite_inputs=frozenset())
        _, grads = backward(body, seeds, wrt, types=types, emitter=sub, options=inner)
        return BodyVJP(sub.nodes, grads)

    return run
