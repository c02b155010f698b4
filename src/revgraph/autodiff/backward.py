"""The backward pass: prune, seed, walk the nodes in reverse, accumulate (DESIGN.md sections 1 to 3).

This is Caffe2's ``GradientRegistry``/``IR.GetBackwardPass`` done on an SSA graph: every value version has one
producer, so the gradient of a version is complete once every node after its producer has been visited;
contributions from several readers are added by :class:`Accumulator`, one ``Sum`` per version (or a running
``Add`` chain), and sparse rows from ``Gather`` are concatenated instead.
"""

from __future__ import annotations

import difflib
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping

import numpy as np

from ..errors import GraphError, RevgraphError
from ..ir import Graph, NameSet, Node, ValueInfo, fresh_name, is_float_dtype, require_graph
from ..lift import lift_constants as lift
from ..onnx_io import infer_types
from ..ssa import captured_names, is_ssa, to_ssa
from . import sparse as sp
from .finite import nonfinite_cotangents, nonfinite_values
from .loops.loop import parse_policy
from .loops.lower import lower_to_loops
from .registry import NOT_DIFFERENTIABLE, Emitter, get_rule
from .simplify import simplify
from .sparse import SparseGrad

ACCUMULATE = ("sum", "running")
Grad = str | SparseGrad


class Accumulator:
    """The one place where gradient contributions to a value version are added up.

    ``mode="sum"``: contributions are kept until :meth:`total` is asked for the version (when its producer is
    reached in the reverse walk, or at the end for inputs), then added by one ``Sum`` node. ``mode="running"``:
    each new dense contribution is added to the partial sum at once with ``Add``, so earlier terms can be freed
    sooner. Sparse contributions concatenate; a mix of sparse and dense adds the rows into the dense sum with
    :func:`~revgraph.autodiff.sparse.add_rows` (``ScatterElements`` on flat views: onnxruntime's reducing
    ``ScatterND`` races on repeated indices when it runs on several threads).
    """

    def __init__(self, e: Emitter, mode: str = "sum"):
        if mode not in ACCUMULATE:
            raise RevgraphError(f"unknown accumulation {mode!r}; choose one of {', '.join(ACCUMULATE)}")
        self.e = e
        self.mode = mode
        self.dense: dict[str, list[str]] = defaultdict(list)
        self.sparse: dict[str, list[SparseGrad]] = defaultdict(list)
        self.done: dict[str, Grad | None] = {}

    def add(self, value: str, grad: Grad) -> None:
        if value in self.done:
            raise AssertionError(f"gradient of {value!r} used before all its contributions arrived")
        if isinstance(grad, SparseGrad):
            self.sparse[value].append(grad)
            return
        parts = self.dense[value]
        if self.mode == "running" and parts:
            parts[:] = [self._emit(value, "Add", [parts[0], grad])]
        else:
            parts.append(grad)

    def total(self, value: str) -> Grad | None:
        """The complete gradient of ``value`` (``None`` if nothing contributed); emits the accumulation once."""
        if value in self.done:
            return self.done[value]
        dense, rows = self.dense.pop(value, []), self.sparse.pop(value, [])
        result: Grad | None = None
        if len(dense) == 1:
            result = dense[0]
        elif dense:
            result = self._emit(value, "Sum", dense)
        if rows:
            saved, self.e.prefix = self.e.prefix, f"accum/{value}"
            merged = sp.concat(self.e, rows)
            result = merged if result is None else sp.scatter_add(self.e, result, merged)
            self.e.prefix = saved
        self.done[value] = result
        return result

    def dense_total(self, value: str) -> str | None:
        """:meth:`total`, densified (what rules and graph outputs take)."""
        g = self.total(value)
        if isinstance(g, SparseGrad):
            saved, self.e.prefix = self.e.prefix, f"accum/{value}"
            g = sp.densify(self.e, g)
            self.e.prefix = saved
            self.done[value] = g
        return g

    def _emit(self, value: str, op: str, inputs: list[str]) -> str:
        saved, self.e.prefix = self.e.prefix, f"accum/{value}"
        out = self.e.op(op, inputs, like=inputs[0])
        self.e.prefix = saved
        return out


def _captures(node: Node) -> list[str]:
    names: list[str] = []
    for sub in node.subgraphs.values():
        names.extend(captured_names(sub))
    return names


def _differentiable(types: dict[str, ValueInfo], name: str) -> bool:
    vi = types.get(name)
    return vi is None or vi.dtype is None or (vi.kind == "tensor" and is_float_dtype(vi.dtype))


def prune(graph: Graph, ys: Iterable[str], wrt: Iterable[str], types: dict[str, ValueInfo]) -> list[Node]:
    """The nodes on a path from a ``wrt`` value to a ``ys`` value through floating-point values, in order.

    Integer and boolean values, and operators declared not differentiable, cut paths. A path through an ONNX
    sequence raises :class:`GraphError` (revgraph does not differentiate sequences, and cutting the path
    would give a silently wrong gradient).
    """
    reach = {w for w in wrt}
    reached_nodes = []
    sequences: dict[str, Node] = {}
    for node in graph.nodes:
        if node.op_type in NOT_DIFFERENTIABLE and node.domain in ("", "ai.onnx"):
            continue
        if any(i in reach for i in node.inputs) or any(c in reach for c in _captures(node)):
            reached_nodes.append(node)
            reach.update(o for o in node.outputs if o and _differentiable(types, o))
            sequences.update({o: node for o in node.outputs if o and _is_sequence(types, o)})
    if sequences:
        _refuse_sequence_paths(graph, ys, sequences)
    wanted = set(ys)
    needed = []
    for node in reversed(reached_nodes):
        if any(o in wanted for o in node.outputs if o):
            needed.append(node)
            wanted.update(i for i in [*node.inputs, *_captures(node)] if i in reach)
    needed.reverse()
    return needed


def _is_sequence(types: dict[str, ValueInfo], name: str) -> bool:
    vi = types.get(name)
    return vi is not None and vi.kind == "sequence"


def _refuse_sequence_paths(graph: Graph, ys: Iterable[str], sequences: dict[str, Node]) -> None:
    ancestors = set(ys)
    for node in reversed(graph.nodes):
        if any(o in ancestors for o in node.outputs if o):
            ancestors.update(i for i in [*node.inputs, *_captures(node)] if i)
    for name, node in sequences.items():
        if name in ancestors:
            raise GraphError(
                f"{node.label()} puts a value that needs a gradient into the sequence {name!r}, and the loss depends "
                "on it; revgraph does not differentiate ONNX sequences (a gradient graph built with checkpoint="
                "'sqrt' or K keeps its checkpoints in sequences: build it with 'store' or 'recompute' to "
                "differentiate it again)"
            )


def backward(
    graph: Graph,
    ys: Mapping[str, str | None] | Iterable[str],
    wrt: Iterable[str] | None = None,
    *,
    accumulate: str = "sum",
    types: dict[str, ValueInfo] | None = None,
    emitter: Emitter | None = None,
) -> tuple[list[Node], dict[str, Grad]]:
    """The Caffe2-style backward pass of ``graph`` (which must be in SSA form, see :func:`revgraph.to_ssa`).

    ``ys`` maps each differentiated value to its seed: ``None`` for ones of the value's shape (so a
    non-scalar y is differentiated as the sum of its elements), or the name of a value holding the cotangent.
    ``wrt`` lists the values gradients are wanted for (default: every floating-point input and initializer);
    only nodes on a path from them to ``ys`` are differentiated. Returns the emitted backward nodes and
    ``grad_map``: every value that received a gradient mapped to it (a value name, or a :class:`SparseGrad`
    for a table read only through ``Gather``).

    Raises :class:`GraphError` for a graph not in SSA form, an unknown name, or operators without a VJP rule
    on a needed path (all of them named in one message).
    """
    require_graph(graph, "backward")
    if not is_ssa(graph):
        raise GraphError("backward needs a graph in SSA form; convert it with revgraph.to_ssa first")
    ys = _seeds_argument(ys)
    types = types if types is not None else infer_types(graph)
    known = known_names(graph) | set(captured_names(graph))  # a subgraph may output an enclosing value
    for name in ys:
        if name not in known:
            raise GraphError(f"no value named {name!r} to differentiate{_suggest(name, known)}")
        refuse_integer_loss(name, types)
    wrt = default_wrt(graph, types) if wrt is None else _names_argument(wrt, "wrt")
    e = emitter or Emitter(types, used_names(graph), graph.opset)
    lower_to_loops(graph, types, e.used)
    e.learn_constants(graph)
    e.graph = graph
    acc = Accumulator(e, accumulate)
    nodes = prune(graph, ys, wrt, types)

    missing = [n for n in nodes if get_rule(n) is None]
    if missing:
        listed = ", ".join(n.label() for n in missing)
        raise GraphError(f"no VJP rule for {len(missing)} node(s) on the path to the loss: {listed}")

    for y, seed in ys.items():
        if seed is None:
            e.prefix = f"seed/{y}"
            seed = e.ones_like(y)
        acc.add(y, seed)

    reach = set(wrt)
    for node in nodes:
        reach.update(o for o in node.outputs if o and _differentiable(types, o))
    e.reach = reach
    unsafe = nonfinite_cotangents(nodes, ys, e.values, nonfinite_values(graph.nodes, e.values, types), types)
    producers = {o: n for n in graph.nodes for o in n.outputs if o}
    grad_map: dict[str, Grad] = {}
    for node in reversed(nodes):
        out_grads = [acc.dense_total(o) if o else None for o in node.outputs]
        for o, g in zip(node.outputs, out_grads, strict=True):
            if g is not None:
                grad_map[o] = g
        if all(g is None for g in out_grads):
            continue
        e.prefix = f"grad/{node.name or node.op_type}"
        e.finite = not any(o in unsafe for o in node.outputs if o)
        e.producers = producers
        e.need = [bool(i) and i in reach and _differentiable(types, i) for i in node.inputs]
        in_grads = get_rule(node)(e, node, out_grads)
        captured: dict[str, Grad] = {}
        if isinstance(in_grads, tuple):  # control flow: gradients of values its subgraphs capture, too
            in_grads, captured = in_grads
        if len(in_grads) != len(node.inputs):
            raise AssertionError(f"VJP rule of {node.op_type} returned {len(in_grads)} gradients for {len(node.inputs)} inputs")
        e.finite = False
        for name, g in [*zip(node.inputs, in_grads, strict=True), *captured.items()]:
            if g is not None and name and name in reach and _differentiable(types, name):
                acc.add(name, g)
    for w in wrt:
        g = acc.total(w)
        if g is not None:
            grad_map[w] = g
    return e.nodes, grad_map


def used_names(graph: Graph) -> set[str]:
    """Every value and node name of ``graph`` and its subgraphs (fresh names must avoid them all)."""
    return NameSet(graph.all_names() | {n.name for _, n in graph.walk() if n.name})


def known_names(graph: Graph) -> set[str]:
    names = set(graph.input_names) | set(graph.initializers)
    for node in graph.nodes:
        names.update(o for o in node.outputs if o)
    return names


def default_wrt(graph: Graph, types: dict[str, ValueInfo]) -> list[str]:
    """Every floating-point graph input and initializer, in declaration order."""
    names = [*graph.input_names, *graph.initializers]
    return [n for n in dict.fromkeys(names) if _is_float(types.get(n))]


def _is_float(vi: ValueInfo | None) -> bool:
    return vi is not None and vi.is_float


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


# ---------------------------------------------------------------------------------------------- gradient


def gradient(
    graph: Graph,
    loss: str | None = None,
    wrt: Iterable[str] | str | None = None,
    *,
    seed: str = "ones",
    unconnected: str = "zero",
    sparse: bool = False,
    accumulate: str = "sum",
    checkpoint: str = "store",
    lift_constants: bool = False,
) -> Graph:
    """A graph computing ``graph``'s outputs and the gradient of ``loss`` with respect to each ``wrt`` value.

    ``loss`` defaults to the only graph output; a non-scalar loss is differentiated as the sum of its
    elements (``seed="ones"``), or ``seed="input"`` adds a graph input ``<loss>_grad`` holding the output
    cotangent (a VJP). ``wrt`` defaults to every floating-point input and initializer; a name may also be an
    intermediate value (of a name written twice, its first version). The result has one more output per wrt
    name, ``<name>_grad``, of the value's shape and dtype; with ``sparse=True`` a table read only through
    ``Gather`` gets ``<name>_grad_indices`` (int64 [K]) and ``<name>_grad_values`` ([K, ...]) instead.
    A wrt value with no path to the loss gets zeros and a ``UserWarning`` (``unconnected="zero"``) or raises
    (``unconnected="error"``). ``accumulate`` is ``"sum"`` or ``"running"`` (see :class:`Accumulator`).
    ``checkpoint`` is the residual policy of loops: ``"store"``, ``"recompute"``, ``"sqrt"`` or a segment
    length K (see :mod:`.loops`). ``lift_constants=True`` first turns floating-point ``Constant`` and
    ``ConstantOfShape`` values with more than one element into initializers (:func:`revgraph.lift.lift_constants`),
    so that they are differentiated by default.

    Raises :class:`RevgraphError` (one line) for an unknown, ambiguous or non-floating name, and
    :class:`GraphError` for operators without a VJP rule on the path.
    """
    require_graph(graph, "gradient")
    if loss is not None and not isinstance(loss, str):
        raise RevgraphError(f"loss must be a value name (a str) or None, got {type(loss).__name__}")
    wrt = None if wrt is None else _names_argument(wrt, "wrt")
    if not isinstance(seed, str) or seed not in ("ones", "input"):
        raise RevgraphError(f"unknown seed {seed!r}; choose 'ones' or 'input'")
    if not isinstance(unconnected, str) or unconnected not in ("zero", "error"):
        raise RevgraphError(f"unknown unconnected policy {unconnected!r}; choose 'zero' or 'error'")
    g = graph if is_ssa(graph) else to_ssa(graph)
    g = lift(g)[0] if lift_constants else g.copy()
    lower_to_loops(g, None, used_names(g))
    types = infer_types(g)
    loss = resolve_loss(g, loss)
    refuse_integer_loss(loss, types)
    wrt_names = resolve_wrt(g, wrt, types)
    ys: dict[str, str | None] = {loss: None}
    used = used_names(g)
    if seed == "input":
        seed_name = fresh_name(f"{loss}_grad", used)
        vi = types.get(loss) or ValueInfo(loss)
        g.inputs.append(ValueInfo(seed_name, vi.dtype, vi.shape))
        types[seed_name] = ValueInfo(seed_name, vi.dtype, vi.shape)
        ys[loss] = seed_name
    e = Emitter(types, used, g.opset)
    e.options["checkpoint"] = parse_policy(checkpoint)
    _, grad_map = backward(g, ys, wrt_names, accumulate=accumulate, types=types, emitter=e)

    missing = [w for w in wrt_names if w not in grad_map]
    if missing and unconnected == "error":
        raise RevgraphError(
            f"no path from {', '.join(map(repr, missing))} to the loss {loss!r} (use unconnected='zero' for zero gradients)"
        )
    if missing:
        warnings.warn(f"no path from {', '.join(map(repr, missing))} to the loss {loss!r}; their gradients are zero", stacklevel=2)
    tail: list[Node] = []
    for w in wrt_names:
        vi = types.get(w) or ValueInfo(w)
        grad = grad_map.get(w)
        e.prefix = f"grad/{w}"
        if isinstance(grad, SparseGrad) and sparse:
            for part, src, dtype, shape in (
                ("indices", grad.indices, np.dtype(np.int64), ("K",)),
                ("values", grad.values, vi.dtype, None if vi.shape is None else ("K", *vi.shape[1:])),
            ):
                out = fresh_name(f"{w}_grad_{part}", used)
                tail.append(Node("Identity", [src], [out], name=fresh_name(f"grad/{w}/{part}", used)))
                g.outputs.append(ValueInfo(out, dtype, shape))
            continue
        if grad is None:
            grad = e.zeros_like(w)
        elif isinstance(grad, SparseGrad):
            grad = sp.densify(e, grad)
        out = fresh_name(f"{w}_grad", used)
        tail.append(Node("Identity", [grad], [out], name=fresh_name(f"grad/{w}/output", used)))
        g.outputs.append(ValueInfo(out, vi.dtype, vi.shape))
    g.nodes.extend(e.nodes)
    g.nodes.extend(tail)
    simplify(g)
    keep_types(g, e.types)
    return g


def keep_types(g: Graph, types: dict[str, ValueInfo]) -> None:
    """Record the types the pass tracked as ``value_info``, so a later pass (gradients of gradients) has them."""
    declared = set(g.input_names) | set(g.output_names) | set(g.initializers)
    for node in g.nodes:
        for o in node.outputs:
            vi = types.get(o)
            if o and o not in declared and vi is not None and vi.dtype is not None and vi.shape is not None:
                g.value_info[o] = ValueInfo(o, vi.dtype, vi.shape, vi.kind)


def _names_argument(names: object, what: str) -> list[str]:
    """``names`` (a str or an iterable of str) as a list without repeats; :class:`RevgraphError` otherwise."""
    if isinstance(names, str):
        return [names]
    if isinstance(names, (bytes, Mapping)) or not isinstance(names, Iterable):
        raise RevgraphError(f"{what} must be a value name or a list of names, got {type(names).__name__}")
    names = list(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise RevgraphError(f"{what} holds {bad[0]!r} ({type(bad[0]).__name__}); value names are str")
    return list(dict.fromkeys(names))


def _seeds_argument(ys: object) -> dict[str, str | None]:
    """``ys`` of :func:`backward` as ``{name: seed name or None}``; :class:`RevgraphError` for other types."""
    if isinstance(ys, Mapping):
        names = _names_argument(list(ys), "ys")
        bad = [(k, v) for k, v in ys.items() if v is not None and not isinstance(v, str)]
        if bad:
            raise RevgraphError(f"the seed of {bad[0][0]!r} is {type(bad[0][1]).__name__}; give None (ones) or the "
                                "name of a value holding the cotangent")
        return {n: ys[n] for n in names}
    return dict.fromkeys(_names_argument(ys, "ys"))


def refuse_integer_loss(loss: str, types: dict[str, ValueInfo]) -> None:
    """Raise :class:`RevgraphError` if ``loss`` is known to be an integer or boolean value: it has no gradient
    (a ``Cast`` to an integer is piecewise constant), and differentiating it would give zeros, or gradients
    of the float value before the cast, silently."""
    vi = types.get(loss)
    if vi is not None and vi.dtype is not None and vi.kind == "tensor" and not is_float_dtype(vi.dtype):
        raise RevgraphError(f"the loss {loss!r} is {vi.describe()}, not floating point: an integer or boolean value "
                            "has no gradient; differentiate the floating-point value it is computed from")


def resolve_loss(graph: Graph, loss: str | None) -> str:
    """The loss name: ``loss`` if it names a value, else the only graph output; one-line errors otherwise."""
    outputs = graph.output_names
    if loss is None:
        if len(outputs) == 1:
            return outputs[0]
        raise RevgraphError(
            f"the model has {len(outputs)} outputs ({', '.join(outputs)}); choose the loss with --loss NAME"
        )
    known = known_names(graph)
    if loss not in known:
        raise RevgraphError(f"no value named {loss!r} to use as the loss{_suggest(loss, known)}")
    return loss


def resolve_wrt(graph: Graph, wrt: Iterable[str] | str | None, types: dict[str, ValueInfo]) -> list[str]:
    """The wrt names: the default (every floating input and initializer) or the given ones, checked."""
    if wrt is None:
        names = default_wrt(graph, types)
        if not names:
            raise RevgraphError("the model has no floating-point inputs or initializers to differentiate; name values with --wrt")
        return names
    names = _names_argument(wrt, "wrt")
    known = known_names(graph)
    for n in names:
        if n not in known:
            raise RevgraphError(f"no value named {n!r} to differentiate with respect to{_suggest(n, known)}")
        vi = types.get(n)
        if vi is not None and vi.dtype is not None and not _is_float(vi):
            raise RevgraphError(f"{n!r} is {vi.describe()}; only floating-point values have gradients")
    return names
