"""Forward mode: Jacobian-vector products (JVPs) as ONNX graphs, by transposing VJPs (DESIGN.md section 4b).

There is no second rule table. A VJP graph ``u -> J^T u`` is linear in the output cotangent ``u``, so
differentiating ``<J^T u, t>`` with respect to ``u`` (a second backward pass over the VJP graph) gives the JVP
``J t``: the transposition trick (Griewank and Walther, "Evaluating Derivatives", 2nd ed., section 3.1; JAX's
``linear_transpose``; Townsend's "A new trick for calculating Jacobian vector products", 2017).
:func:`tangent_pass` does this for each straight run of nodes between control-flow nodes (a *segment*):

1. the VJP of the segment, seeded with a fresh cotangent ``u_y`` per value ``y`` that later nodes read, with
   strong-zero guards off (:class:`~.context.Options` ``strong_zeros``): the guards test the cotangent, which
   would make the VJP non-linear in ``u`` and keep ``u`` alive after the transposition;
2. the VJP of that VJP with respect to each ``u_y``, seeded with the tangents of the segment's inputs: the
   tangent of each ``y``. The transposed graph reads the forward values and the tangents only; the values of
   the first VJP (which would need ``u``) are dead and :func:`~.simplify.simplify` removes them. Each ``u_y``
   is defined as zeros where the tangents still read it (a rule whose VJP is not linear in ``u``).

``Loop`` and ``If`` are not transposed: their JVP is the same control flow carrying tangents forward
(:func:`_loop`, :func:`_if`), so a loop's JVP stores no residuals. Tangents of loop-carried values are
carried values (found by a fixpoint, as a carried value may gain a tangent in an iteration), tangents of scan
outputs are scan outputs, and tangents of captured values are captured. ``Scan`` and the recurrent
operators are lowered to ``Loop`` first, as for the VJP.

Finally :func:`schedule` moves each tangent node next to the forward values it reads, so that the forward
values are not all kept alive until the tangent pass runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from .. import validate as V
from ..ir import Graph, Node, ValueInfo, fresh_name, require_graph
from ..ir.ssa import captured_names, is_ssa, to_ssa
from ..onnx_io.arguments import AS_GRAPH, ModelLike
from ..onnx_io.value_types import constant_values, differentiable, infer_types, keep_types
from ..warn import warn
from .accumulate import densify, zeros_like
from .arguments import resolve_outputs, resolve_wrt, used_names
from .backward import _pair_reads, backward
from .context import Options
from .emitter import Emitter
from .loops.lower import complete_types, lower_to_loops
from .loops.reverse import body_types, loop_body_types
from .node_checks import check_nodes
from .registry import NOT_DIFFERENTIABLE
from .simplify import simplify

CONTROL_FLOW = ("Loop", "If")


@V.arguments(graph=AS_GRAPH, outputs=V.NAMES, inputs=V.NAMES, tangent_names=V.OPTIONAL_MAPPING,
             output_names=V.OPTIONAL_MAPPING)
def jvp(graph: ModelLike, outputs: Iterable[str] | str | None = None, inputs: Iterable[str] | str | None = None,
        *, tangent_names: dict[str, str] | None = None, output_names: dict[str, str] | None = None) -> Graph:
    """A graph computing ``graph``'s outputs and the Jacobian-vector product ``J t`` (forward mode).

    For each value ``x`` in ``inputs`` (default: every floating-point graph input and initializer; a name may
    also be an intermediate value, whose tangent then replaces the one its producer would give it) the result
    has a graph input ``<x>_tangent`` of ``x``'s shape and dtype (the tangent ``t_x``), and for each ``y`` in
    ``outputs`` (default: every floating-point graph output) an output ``<y>_tangent`` of ``y``'s shape and
    dtype holding ``sum_x dy/dx t_x``, without forming a Jacobian. ``tangent_names``/``output_names`` map
    names to other bases for those names (:func:`~.transforms.hvp` uses them). Taken names get ``_1``, ``_2``...

    The math: the transposition of each segment's VJP (module doc); loops and branches carry tangents
    forward. An output with no path from ``inputs`` gets a zero tangent and a ``UserWarning``.

    Raises :class:`RevgraphError` (one line) for an unknown, repeated-kind or non-floating name and
    :class:`GraphError` for an operator without a VJP rule on a path from ``inputs`` to ``outputs``.
    """
    require_graph(graph, "jvp")
    g = graph.copy() if is_ssa(graph) else to_ssa(graph)
    used = used_names(g)
    lower_to_loops(g, None, used)
    types = infer_types(g)
    complete_types(g, types)  # loops' outputs that the model declares without a shape
    check_nodes(g, types, constant_values(g, types))  # before the tangents' graph is built (backward checks again)
    outputs = resolve_outputs(g, outputs, types)
    inputs = resolve_wrt(g, inputs, types)
    e = Emitter(types, used, g.opset, prefix="jvp")
    tangents: dict[str, str] = {}
    for x in inputs:
        vi = types.get(x) or ValueInfo(x)
        name = fresh_name((tangent_names or {}).get(x, f"{x}_tangent"), used)
        g.inputs.append(ValueInfo(name, vi.dtype, vi.shape))
        types[name] = ValueInfo(name, vi.dtype, vi.shape)
        tangents[x] = name
    seeds = [tangents[x] for x in inputs]
    public = {y: fresh_name((output_names or {}).get(y, f"{y}_tangent"), used) for y in outputs}  # before inner names
    g.nodes = tangent_pass(g, tangents, types, e, set(outputs), given=set(inputs))
    unconnected, tail = [], []
    for y in outputs:
        t = tangents.get(y)
        if t is None:
            unconnected.append(y)
            with e.scope(f"jvp/{y}"):
                t = zeros_like(e, y)
        vi = types.get(y) or ValueInfo(y)
        out = public[y]
        tail.append(Node("Identity", [t], [out], name=fresh_name(f"jvp/{y}/output", used)))
        g.outputs.append(ValueInfo(out, vi.dtype, vi.shape))
    if unconnected:
        warn(f"no path from the inputs to {', '.join(map(repr, unconnected))}; their tangents are zero")
    g.nodes += e.nodes + tail
    simplify(g)
    g.nodes = schedule(g.nodes, seeds)
    keep_types(g, types)
    return g


# ---------------------------------------------------------------------------------------------- the pass


def tangent_pass(graph: Graph, tangents: dict[str, str], types: dict[str, ValueInfo], e: Emitter,
                 wanted: set[str], given: set[str] = frozenset()) -> list[Node]:
    """``graph``'s nodes with the nodes computing tangents placed after each segment (module doc); control-flow
    nodes that read a tangent are replaced by their JVPs. ``tangents`` maps each value with a tangent to the
    tangent's name and gains the new ones; ``wanted``: values whose tangents are needed besides those later
    nodes read; ``given``: values whose tangents are given (not computed from their producer's)."""
    last_read = _last_reads(graph)
    out: list[Node] = []
    seg: list[Node] = []
    for pos, node in enumerate(graph.nodes):
        if node.op_type in CONTROL_FLOW and node.domain in ("", "ai.onnx"):
            out += _segment(graph, seg, pos - 1, tangents, types, e, wanted, last_read)
            seg = []
            out += _control_flow(node, tangents, types, e)
            continue
        seg.append(node)
        if any(o in given for o in node.outputs if o):  # a given tangent overrides the producer's
            out += _segment(graph, seg, pos, tangents, types, e, wanted, last_read)
            seg = []
    out += _segment(graph, seg, len(graph.nodes) - 1, tangents, types, e, wanted, last_read)
    return out


def _last_reads(graph: Graph) -> dict[str, int]:
    """The position of the last node reading each value (directly or from a subgraph)."""
    last: dict[str, int] = {}
    for pos, node in enumerate(graph.nodes):
        for name in [*node.inputs, *(c for sg in node.subgraphs.values() for c in captured_names(sg))]:
            if name:
                last[name] = pos
    return last


def reached_nodes(nodes: list[Node], seeds: Iterable[str], types: dict[str, ValueInfo]) -> tuple[list[Node], set[str]]:
    """The nodes reading (directly or from a subgraph) a value with a tangent, and the values that then have
    one: floating-point outputs of differentiable operators (the forward reach of ``prune``). A DequantizeLinear
    reads what its QuantizeLinear reads (``backward._pair_reads``): the pair is one function, whose rule refuses
    the rounding without the straight-through estimator, where skipping the QuantizeLinear as not
    differentiable gave a zero tangent with only a "no path" warning."""
    reach = set(seeds)
    hit = []
    writers = {o: n for n in nodes for o in n.outputs if o}
    for node in nodes:
        if node.op_type in NOT_DIFFERENTIABLE and node.domain in ("", "ai.onnx"):
            continue
        reads = [*node.inputs, *(c for sg in node.subgraphs.values() for c in captured_names(sg)),
                 *_pair_reads(node, writers)]
        if any(i in reach for i in reads if i):
            hit.append(node)
            reach.update(o for o in node.outputs if o and differentiable(types.get(o)))
    return hit, reach


def _segment(graph: Graph, seg: list[Node], end: int, tangents: dict[str, str], types: dict[str, ValueInfo],
             e: Emitter, wanted: set[str], last_read: dict[str, int]) -> list[Node]:
    """``seg`` followed by the transposition of its VJP (module doc, steps 1 and 2)."""
    hit, _ = reached_nodes(seg, tangents, types)
    ys = [o for n in hit for o in n.outputs
          if o and o not in tangents and differentiable(types.get(o)) and (o in wanted or last_read.get(o, -1) > end)]
    if not ys:
        return seg
    writers = {o: n for n in seg for o in n.outputs if o}
    reads = {i for n in hit for i in [*n.inputs, *(c for sg in n.subgraphs.values() for c in captured_names(sg)),
                                      *_pair_reads(n, writers)]}
    xs = [x for x in tangents if x in reads]
    # what the segment reads from outside (graph inputs, earlier loops' outputs) may be inf or NaN: its inputs
    outside = _outside_reads(seg, graph.initializers, types)
    sub = Graph(list(seg), outside, initializers=graph.initializers, opsets=dict(graph.opsets))
    # 1. the VJP, linear in the cotangents u
    e1 = e.child(types, "jvp/vjp")
    us = {}
    for y in ys:
        vi = types.get(y) or ValueInfo(y)
        us[y] = e1.fresh(f"jvp/cotangent/{y}")
        types[us[y]] = ValueInfo(us[y], vi.dtype, vi.shape, vi.kind)
    _, vjps = backward(sub, us, xs, types=types, emitter=e1, options=Options(strong_zeros=False))
    ct = {}
    for x in xs:
        if vjps.get(x) is not None:
            ct[x] = e1.op("Identity", [densify(e1, vjps[x])], like=x)  # distinct names: the seeds of step 2
    if not ct:
        return seg
    # 2. its transposition: the VJP of x -> <vjp(x), t_x> with respect to u
    both = Graph([*seg, *e1.nodes], outside, initializers=graph.initializers, opsets=dict(graph.opsets))
    e2 = e.child(types, "jvp/tangent")
    _, tans = backward(both, {ct[x]: tangents[x] for x in ct}, list(us.values()), types=types, emitter=e2,
                       options=Options(tangents=True))
    new = []
    for y, u in us.items():
        if tans.get(u) is not None:
            tangents[y] = densify(e2, tans[u])
            new.append(tangents[y])
    # zeros for each u the tangents still read (only a VJP rule not linear in u leaves one: named so that
    # tests can find it); none for the others, whose dead zeros simplify() could merge with live nodes
    _shape_reads([*e1.nodes, *e2.nodes], {u: y for y, u in us.items()}, types)
    zeros = e.child(types, "jvp/zero_cotangent")
    read = _needed([*both.nodes, *e2.nodes], new)
    for y, u in us.items():
        if u in read:  # a sequence's too (zeros of its structure: a transposed SequenceAt reads it)
            zeros.nodes.append(Node("Identity", [zeros_like(zeros, y)], [u],
                                    name=zeros.fresh(f"jvp/zero_cotangent/{y}")))
    # both.nodes, not e1.nodes: step 2 may have added nodes to it (the trip counter's start of a Loop in the VJP)
    ids = {id(n) for n in seg}
    cut = max((k + 1 for k, n in enumerate(both.nodes) if id(n) in ids), default=0)
    return [*both.nodes[:cut], *zeros.nodes, *both.nodes[cut:], *e2.nodes]


def _outside_reads(seg: list[Node], initializers: dict, types: dict[str, ValueInfo]) -> list[ValueInfo]:
    """The values ``seg`` reads (directly or from a subgraph) that it does not compute and that are not
    initializers, typed: the inputs of the segment as a graph of its own."""
    made = {o for n in seg for o in n.outputs if o}
    names: dict[str, None] = {}
    for n in seg:
        for i in [*n.inputs, *(c for sg in n.subgraphs.values() for c in captured_names(sg))]:
            if i and i not in made and i not in initializers:
                names.setdefault(i)
    return [types.get(i) or ValueInfo(i) for i in names]


#: operators whose output has the shape of their first input
SAME_SHAPE = frozenset({"Identity", "Neg", "Abs", "Cast", "CastLike", "Exp", "Log", "Sqrt", "Reciprocal", "Sign",
                        "Tanh", "Sigmoid", "Relu", "Softmax", "LogSoftmax", "Not", "IsNaN", "IsInf"})
#: elementwise operators with multidirectional broadcasting (ONNX "Broadcasting in ONNX")
BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sum", "Max", "Min", "Mean", "Where", "Equal", "Less",
                       "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or"})


def _shape_reads(nodes: list[Node], proxy: dict[str, str], types: dict[str, ValueInfo]) -> None:
    """Let ``Shape``/``Size`` nodes and ``CastLike``'s type input read, instead of a value computed from a
    cotangent ``u``, a forward value of the same shape (``proxy``: each ``u`` to its primal ``y``, then along
    ``nodes`` through shape-keeping operators: :data:`SAME_SHAPE`, and :data:`BROADCAST` ones whose other
    inputs are scalars). With unknown dimensions a transposed VJP reads such shapes (to undo a broadcast, to
    reshape back), which kept ``u`` (zeros) and the VJP nodes computing from it alive. Edits ``nodes``."""
    def rank(name: str) -> int | None:
        vi = types.get(name)
        return None if vi is None or vi.shape is None else len(vi.shape)

    for node in nodes:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in ("Shape", "Size") and node.inputs[0] in proxy:
            node.inputs[0] = proxy[node.inputs[0]]
        elif node.op_type == "CastLike" and len(node.inputs) > 1 and node.inputs[1] in proxy:
            node.inputs[1] = proxy[node.inputs[1]]
        ins = [i for i in node.inputs if i]
        if not ins or not node.outputs or not node.outputs[0]:
            continue
        if node.op_type in SAME_SHAPE and ins[0] in proxy:
            proxy[node.outputs[0]] = proxy[ins[0]]
        elif node.op_type in BROADCAST:
            ps = {proxy[i] for i in ins if i in proxy}
            if len(ps) == 1 and all(i in proxy or rank(i) == 0 for i in ins):
                proxy[node.outputs[0]] = ps.pop()


def _needed(nodes: list[Node], targets: Iterable[str]) -> set[str]:
    """The values that computing ``targets`` from ``nodes`` reads (a reverse walk, subgraph captures too)."""
    needed = set(targets)
    for node in reversed(nodes):
        if any(o in needed for o in node.outputs if o):
            needed.update(i for i in node.inputs if i)
            for sg in node.subgraphs.values():
                needed.update(captured_names(sg))
    return needed


# ---------------------------------------------------------------------------------------------- control flow


def _control_flow(node: Node, tangents: dict[str, str], types: dict[str, ValueInfo], e: Emitter) -> list[Node]:
    """The JVP of a ``Loop`` or ``If`` node: the node itself when it reads no value with a tangent."""
    captured = [c for sg in node.subgraphs.values() for c in captured_names(sg) if c in tangents]
    if node.op_type == "Loop":
        carried = [i for i in node.inputs[2:] if i in tangents]
        if not carried and not captured:
            return [node]
        return _loop(node, tangents, types, e)
    if not captured:
        return [node]
    return _if(node, tangents, types, e)


def _loop(node: Node, tangents: dict[str, str], types: dict[str, ValueInfo], e: Emitter) -> list[Node]:
    """A ``Loop`` carrying the tangents of its carried values next to them and writing the tangents of its
    scan outputs as scan outputs (ONNX spec "Loop"); no residual is stored."""
    body: Graph = node.attrs["body"]
    n = len(node.inputs) - 2
    v_in, v_out = body.input_names[2:], body.output_names[1 : 1 + n]
    scans = body.output_names[1 + n :]
    btypes = loop_body_types(body, types, node)  # (carried inputs declared without a shape: what they keep)
    for j, name in enumerate(v_in):  # carried inputs take the types of the initial values when undeclared
        if (btypes.get(name) is None or btypes[name].dtype is None) and types.get(node.inputs[2 + j]) is not None:
            src = types[node.inputs[2 + j]]
            btypes[name] = ValueInfo(name, src.dtype, src.shape, src.kind)
    outer = {c: tangents[c] for c in captured_names(body) if c in tangents}
    _capture_types(btypes, types, outer)
    has = {j for j in range(n) if node.inputs[2 + j] in tangents}
    while True:  # a carried value gains a tangent when an iteration computes it from one
        _, reach = reached_nodes(body.nodes, [*outer, *(v_in[j] for j in has)], btypes)
        grown = {j for j in range(n) if v_out[j] in reach and differentiable(btypes.get(v_in[j]))} - has
        if not grown:
            break
        has |= grown
    has_t = sorted(has)
    eb = e.child(btypes, f"jvp/{node.name or 'Loop'}")
    bt = dict(outer)
    t_in = []
    for j in has_t:
        vi = btypes.get(v_in[j]) or ValueInfo(v_in[j])
        t_in.append(ValueInfo(eb.fresh(f"{v_in[j]}_tangent"), vi.dtype, vi.shape, vi.kind))
        bt[v_in[j]] = t_in[-1].name
        btypes[t_in[-1].name] = t_in[-1]
    nodes = tangent_pass(body, bt, btypes, eb, {*(v_out[j] for j in has_t), *scans})
    t_scans = [k for k, s in enumerate(scans) if s in bt]
    outs = [_tangent_output(eb, v_out[j], bt, btypes) for j in has_t] + [
        _tangent_output(eb, scans[k], bt, btypes) for k in t_scans]
    new_body = Graph([*nodes, *eb.nodes], [*body.inputs, *t_in],
                     [*body.outputs[: 1 + n], *outs[: len(has_t)], *body.outputs[1 + n :], *outs[len(has_t):]],
                     body.initializers, name=body.name)
    simplify(new_body)
    before = []
    inits = []
    for j in has_t:
        x = node.inputs[2 + j]
        if x in tangents:
            inits.append(tangents[x])
        else:
            with e.scope(f"jvp/{node.name or 'Loop'}/init"):
                start = len(e.nodes)
                inits.append(zeros_like(e, x))
                before += e.nodes[start:]
                del e.nodes[start:]
    finals = [e.fresh(f"{node.outputs[j] or v_out[j]}_tangent") for j in has_t]
    stacked = [e.fresh(f"{node.outputs[n + k] or scans[k]}_tangent") for k in t_scans]
    outputs = [*node.outputs[:n], *finals, *node.outputs[n:], *stacked]
    loop = Node("Loop", [*node.inputs, *inits], outputs, {**node.attrs, "body": new_body}, node.name, node.domain)
    for j, t in zip(has_t, finals, strict=True):
        _record(types, t, _with_shape(types.get(node.outputs[j]), btypes.get(v_out[j]), btypes.get(v_in[j])))
        if node.outputs[j]:
            tangents[node.outputs[j]] = t
    for k, t in zip(t_scans, stacked, strict=True):
        src = types.get(node.outputs[n + k]) if node.outputs[n + k] else None
        _record(types, t, src)
        if node.outputs[n + k]:
            tangents[node.outputs[n + k]] = t
    return [*before, loop]


def _if(node: Node, tangents: dict[str, str], types: dict[str, ValueInfo], e: Emitter) -> list[Node]:
    """An ``If`` whose branches also return the tangents of their outputs (zeros from a branch where an output
    has none)."""
    keys = ("then_branch", "else_branch")
    built = {}
    for key in keys:
        branch: Graph = node.attrs[key]
        btypes = body_types(branch, types)
        eb = e.child(btypes, f"jvp/{node.name or 'If'}/{key}")
        bt = {c: tangents[c] for c in captured_names(branch) if c in tangents}
        _capture_types(btypes, types, bt)
        nodes = tangent_pass(branch, bt, btypes, eb, set(branch.output_names))
        built[key] = (branch, btypes, eb, bt, nodes)
    has = [k for k, o in enumerate(node.outputs) if any(b.output_names[k] in bt for b, _, _, bt, _ in built.values())]
    attrs = dict(node.attrs)
    for key, (branch, btypes, eb, bt, nodes) in built.items():
        outs = [_tangent_output(eb, branch.output_names[k], bt, btypes) for k in has]
        new = Graph([*nodes, *eb.nodes], [], [*branch.outputs, *outs], branch.initializers, name=branch.name)
        attrs[key] = simplify(new)
    extra = [e.fresh(f"{node.outputs[k] or 'If'}_tangent") for k in has]
    for k, t in zip(has, extra, strict=True):
        _record(types, t, types.get(node.outputs[k]))
        if node.outputs[k]:
            tangents[node.outputs[k]] = t
    return [Node("If", list(node.inputs), [*node.outputs, *extra], attrs, node.name, node.domain)]


def _tangent_output(eb: Emitter, value: str, bt: dict[str, str], btypes: dict[str, ValueInfo]) -> ValueInfo:
    """A subgraph output holding the tangent of ``value`` (zeros when it has none)."""
    vi = btypes.get(value) or ValueInfo(value)
    t = bt.get(value)
    if t is None:
        t = zeros_like(eb, value)
    name = eb.op("Identity", [t], like=value)
    return ValueInfo(name, vi.dtype, vi.shape, vi.kind)


def _capture_types(btypes: dict[str, ValueInfo], types: dict[str, ValueInfo], captured: dict[str, str]) -> None:
    """A subgraph reads the tangents of the values it captures from the enclosing graph: give them the
    primals' types there (rules read static shapes, e.g. to undo broadcasting without ``Shape`` chains)."""
    for primal, tangent in captured.items():
        src = types.get(tangent) or types.get(primal)
        if src is not None:
            btypes.setdefault(tangent, ValueInfo(tangent, src.dtype, src.shape, src.kind))


def _with_shape(*candidates: ValueInfo | None) -> ValueInfo | None:
    """The first of ``candidates`` with a known shape, else the first known one (the outer type of a loop's
    output may lack the shape that its body output and carried input have)."""
    known = [c for c in candidates if c is not None]
    return next((c for c in known if c.shape is not None), known[0] if known else None)


def _record(types: dict[str, ValueInfo], name: str, src: ValueInfo | None) -> None:
    if src is not None:
        types[name] = ValueInfo(name, src.dtype, src.shape, src.kind)


# ---------------------------------------------------------------------------------------------- order


def schedule(nodes: list[Node], seeds: Iterable[str]) -> list[Node]:
    """``nodes`` (in a valid order) reordered so that each node reading a tangent (directly or through other
    such nodes) runs right after the last forward node it depends on: the tangent pass then walks next to
    the forward pass instead of after it, and a runtime can free each forward value early. Stable sort by
    (that forward node's position, forward first, original position), which keeps the order valid."""
    tangent = set(seeds)
    key: dict[str, int] = {}
    order = []
    for pos, node in enumerate(nodes):
        reads = [i for i in [*node.inputs, *(c for sg in node.subgraphs.values() for c in captured_names(sg))] if i]
        is_t = any(i in tangent for i in reads)
        k = max((key.get(i, -1) for i in reads), default=-1) if is_t else pos
        for o in node.outputs:
            if o:
                key[o] = k
                if is_t:
                    tangent.add(o)
        order.append((k, is_t, pos))
    return [nodes[pos] for _, _, pos in sorted(order)]
