"""VJP of ``Loop``: a loop that runs the iterations backwards (DESIGN.md section 4, MegEngine's ``LoopGrad``).

* The forward loop gets one more loop-carried value, an iteration counter, so the backward loop knows the trip
  count T also when the condition stopped the forward loop early (T may be 0).
* A **carried** value's cotangent is a carried value of the backward loop, starting from the cotangent of the
  loop's final output; the gradient of its initial value is what the last backward iteration produces.
* A **captured** (loop-invariant) value's gradient is summed over the iterations in an accumulator carried by
  the backward loop, starting at zero; a sparse contribution is added with ``sparse.scatter_add`` (a
  race-free ``ScatterElements``).
* Backward iteration k works on forward iteration t = T - 1 - k: it reads slice t of each scan output's
  cotangent and of each stacked residual.

The body's VJP is the same backward pass (:func:`revgraph.autodiff.backward.backward`) run on the body graph.
Residual policies (``checkpoint``): ``store`` stacks, as extra scan outputs of the forward loop, exactly the
body values that the body's VJP reads; ``recompute`` stacks only the loop-carried inputs and recomputes the
rest of the body inside the backward loop; ``sqrt`` and an integer K checkpoint segments
(:mod:`.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo, is_float_dtype
from ...onnx_io import infer_types
from ...ssa import captured_names
from ..registry import Emitter, vjp
from ..sparse import SparseGrad, densify, scatter_add

I64, BOOL = np.dtype(np.int64), np.dtype(bool)


def parse_policy(policy) -> str | int:
    """``"store"``, ``"recompute"``, ``"sqrt"`` or a positive segment length K (an int or a digit string)."""
    if isinstance(policy, str) and policy.isdigit():
        policy = int(policy)
    if isinstance(policy, int) and not isinstance(policy, bool) and policy > 0:
        return policy
    if policy in ("store", "recompute", "sqrt"):
        return policy
    raise GraphError(f"unknown checkpoint policy '{policy}'; choose store, recompute, sqrt or a positive integer K")


@dataclass
class LoopParts:
    """A ``Loop`` node taken apart: body names by role, body types, and which values need cotangents."""

    node: Node
    body: Graph
    n_carried: int
    iter_in: str
    cond_in: str
    v_in: list[str]
    v_out: list[str]
    scan_out: list[str]
    types: dict[str, ValueInfo]
    carried: list[int]  # positions of floating-point carried values
    captured: list[str]  # floating-point captured values on a path from a wrt value


def body_types(body: Graph, outer: dict[str, ValueInfo]) -> dict[str, ValueInfo]:
    """Types of a subgraph's values, inferred with its captured values declared from ``outer``."""
    captured = [outer.get(c) or ValueInfo(c) for c in captured_names(body)]
    probe = Graph(body.nodes, [*body.inputs, *captured], body.outputs, body.initializers, body.value_info)
    types = infer_types(probe)
    for c in captured:
        types.setdefault(c.name, c)
    return types


def is_float(vi: ValueInfo | None) -> bool:
    return vi is None or vi.dtype is None or is_float_dtype(vi.dtype)


def take_apart(e: Emitter, node: Node) -> LoopParts:
    body: Graph = node.attrs["body"]
    n = len(node.inputs) - 2
    types = body_types(body, e.types)
    v_in = body.input_names[2:]
    for j, name in enumerate(v_in):  # carried inputs take the types of the initial values when undeclared
        if types.get(name) is None or types[name].dtype is None:
            src = e.types.get(node.inputs[2 + j])
            if src is not None:
                types[name] = ValueInfo(name, src.dtype, src.shape)
    for j, (a, b) in enumerate(zip(v_in, body.output_names[1 : 1 + n], strict=True)):
        sa, sb = (types.get(x).shape if types.get(x) else None for x in (a, b))
        if _changes_shape(sa, sb):
            raise GraphError(
                f"{node.label()}: loop-carried value {a!r} enters an iteration with shape {list(sa)} and leaves it as "
                f"{b!r} with shape {list(sb)}; revgraph differentiates loops whose carried values keep their shape"
            )
    carried = [j for j in range(n) if is_float(e.types.get(node.inputs[2 + j]) or types.get(v_in[j]))]
    captured = [c for c in captured_names(body) if c in e.reach and is_float(e.types.get(c))]
    return LoopParts(node, body, n, body.input_names[0], body.input_names[1], v_in, body.output_names[1 : 1 + n],
                     body.output_names[1 + n :], types, carried, captured)


def _changes_shape(before: tuple | None, after: tuple | None) -> bool:
    """True when two declared shapes certainly differ (rank, or a static dimension)."""
    if before is None or after is None:
        return False
    if len(before) != len(after):
        return True
    return any(isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(before, after, strict=True))


def add_carried(node: Node, body: Graph, initial: str, body_in: ValueInfo, body_out: ValueInfo, out: str) -> None:
    """Append one loop-carried value to a ``Loop`` node and its body (carried values precede scan outputs)."""
    n = len(node.inputs) - 2
    body.inputs.insert(2 + n, body_in)
    body.outputs.insert(1 + n, body_out)
    node.inputs.append(initial)
    node.outputs.insert(n, out)


def count_trips(e: Emitter, p: LoopParts) -> str:
    """Make the forward loop count its iterations (a carried counter); return the trip count's name."""
    name = p.node.name
    zero, one = e.fresh(f"{name}/count_init"), e.fresh(f"{name}/one")
    e.insert_before(p.node, [Node("Constant", [], [zero], {"value": np.array(0, np.int64)}, zero)])
    count_in, count_out, trips = e.fresh(f"{name}/count_in"), e.fresh(f"{name}/count_out"), e.fresh(f"{name}/trip_count")
    p.body.nodes.append(Node("Constant", [], [one], {"value": np.array(1, np.int64)}, one))
    p.body.nodes.append(Node("Add", [p.iter_in, one], [count_out], name=count_out))
    add_carried(p.node, p.body, zero, ValueInfo(count_in, I64, ()), ValueInfo(count_out, I64, ()), trips)
    e.types[trips] = ValueInfo(trips, I64, ())
    return trips


BodyBuilder = Callable[[Emitter, str, dict, dict], tuple[dict, dict]]


def reverse_loop(e: Emitter, p: LoopParts, count: str, out_grads: list, build: BodyBuilder) -> tuple[list, dict]:
    """Emit the backward ``Loop`` of ``count`` iterations and return the node's input and captured gradients.

    ``build(eb, k, cot_in, acc_in)`` appends the body's work to ``eb`` (``k`` names the backward iteration
    number, ``cot_in`` maps carried positions and ``acc_in`` captured names to the body's input names) and
    returns the gradients of the carried inputs and of the captured values for that iteration.
    """
    from ..backward import keep_types

    node = p.node
    eb = Emitter(p.types, e.used, e.opset)  # shared: types the body's rules record are residual types
    eb.options = e.options
    eb.prefix = f"grad/{node.name}/body"
    k = _input(eb, f"grad/{node.name}/k", I64, ())
    cond = _input(eb, f"grad/{node.name}/cond", BOOL, ())
    cot_in = {j: _input(eb, f"grad/{node.name}/cot_{p.v_in[j]}", *_dt_shape(p.types.get(p.v_in[j]))) for j in p.carried}
    acc_in = {c: _input(eb, f"grad/{node.name}/acc_{c}", *_dt_shape(e.types.get(c))) for c in p.captured}
    cot_out, captured = build(eb, k.name, {j: v.name for j, v in cot_in.items()}, {c: v.name for c, v in acc_in.items()})

    outs = [ValueInfo(eb.op("Identity", [eb.const(np.array(True))]), BOOL, ())]
    for j in p.carried:
        g = cot_out.get(j)
        g = eb.zeros_like(p.v_in[j]) if g is None else densify(eb, g) if isinstance(g, SparseGrad) else g
        outs.append(ValueInfo(eb.op("Identity", [g]), *_dt_shape(p.types.get(p.v_in[j]))))
    for c in p.captured:
        g, acc = captured.get(c), acc_in[c].name
        total = acc if g is None else scatter_add(eb, acc, g) if isinstance(g, SparseGrad) else eb.op("Add", [acc, g])
        outs.append(ValueInfo(eb.op("Identity", [total]), *_dt_shape(e.types.get(c))))
    bwd_body = Graph(eb.nodes, [k, cond, *cot_in.values(), *acc_in.values()], outs, name=f"grad_{node.name}_body")
    keep_types(bwd_body, eb.types)

    initial = [out_grads[j] if out_grads[j] is not None else e.zeros_like(node.outputs[j]) for j in p.carried]
    initial += [e.zeros_like(c) for c in p.captured]
    n_out = len(p.carried) + len(p.captured)
    results = e.op("Loop", [count, e.const(np.array(True)), *initial], n_out=n_out, body=bwd_body)
    results = [results] if n_out == 1 else results
    for name, src in zip(results, [node.inputs[2 + j] for j in p.carried] + p.captured, strict=True):
        e.types[name] = ValueInfo(name, *_dt_shape(e.types.get(src)))
    in_grads: list = [None] * len(node.inputs)
    for j, name in zip(p.carried, results, strict=False):
        in_grads[2 + j] = name
    return in_grads, dict(zip(p.captured, results[len(p.carried):], strict=True))


def _input(eb: Emitter, base: str, dtype, shape) -> ValueInfo:
    name = eb.fresh(base)
    vi = ValueInfo(name, dtype, shape)
    eb.types[name] = vi
    return vi


def _dt_shape(vi: ValueInfo | None) -> tuple:
    return (None, None) if vi is None else (vi.dtype, vi.shape)


def seeds_of(eb: Emitter, p: LoopParts, cot_in: dict, scan_seed: Callable[[int, str], str | None]) -> dict[str, str]:
    """The cotangent seeds of the body outputs: the carried cotangents and ``scan_seed(s, grad)`` per scan
    output; a body output listed twice gets the sum of its seeds."""
    parts: dict[str, list[str]] = {}
    for j in p.carried:
        parts.setdefault(p.v_out[j], []).append(cot_in[j])
    for s, name in enumerate(p.scan_out):
        if is_float(p.types.get(name)):
            seed = scan_seed(s, name)
            if seed is not None:
                parts.setdefault(name, []).append(seed)
    return {y: ps[0] if len(ps) == 1 else eb.op("Sum", ps, like=ps[0]) for y, ps in parts.items()}


@vjp("Loop")
def loop(e: Emitter, node: Node, out_grads: list) -> tuple[list, dict]:
    """VJP of ONNX ``Loop`` (operator spec "Loop", opset 21): see the module doc."""
    policy = parse_policy(e.options.get("checkpoint", "store"))
    if policy not in ("store", "recompute"):
        from .checkpoint import checkpointed_loop

        return checkpointed_loop(e, node, out_grads, policy)
    p = take_apart(e, node)
    trips = count_trips(e, p)
    n_scan_grads = out_grads[p.n_carried :]

    def build(eb: Emitter, k: str, cot_in: dict, acc_in: dict) -> tuple[dict, dict]:
        from ..backward import backward, keep_types

        t = eb.op("Sub", [eb.op("Sub", [trips, eb.const(np.array(1, np.int64))]), k], shape=(), dtype=I64)
        seeds = seeds_of(eb, p, cot_in, lambda s, name: None if n_scan_grads[s] is None else eb.op(
            "Gather", [n_scan_grads[s], t], axis=0, like=name))
        head = list(eb.nodes)
        eb.nodes.clear()
        _, gmap = backward(p.body, seeds, [p.v_in[j] for j in p.carried] + p.captured, types=eb.types, emitter=eb)
        grad_nodes = list(eb.nodes)
        eb.nodes.clear()
        needed = [r for r in reads(grad_nodes) if r in scope(p.body)]
        stacked, rerun = plan_residuals(p.body, needed, policy, p.types)
        bound = {p.iter_in: t, p.cond_in: eb.const(np.array(True))}  # an iteration that ran had cond_in true
        prologue = list(eb.nodes)
        for r in stacked:
            if r not in bound:
                prologue += stack_residual(e, node, p.body, p.types.get(r), r, t)
        wanted = set(needed) | set(reads(rerun))
        prologue += [Node("Identity", [v], [name], name=e.fresh(f"grad/{node.name}/bind/{name}"))
                     for name, v in bound.items() if name in wanted]
        eb.nodes[:] = [*head, *prologue, *(nd.copy() for nd in rerun), *grad_nodes]
        keep_types(p.body, p.types)
        return {j: gmap.get(p.v_in[j]) for j in p.carried}, {c: gmap.get(c) for c in p.captured}

    return reverse_loop(e, p, trips, out_grads, build)


def scope(body: Graph) -> set[str]:
    """The names a body defines: its inputs and its nodes' outputs."""
    return set(body.input_names) | {o for n in body.nodes for o in n.outputs if o}


def reads(nodes: list[Node]) -> list[str]:
    """Names the nodes read (subgraph captures included) that they do not write themselves."""
    written = {o for n in nodes for o in n.outputs if o}
    seen: dict[str, None] = {}
    for n in nodes:
        for name in [*n.inputs, *(c for sub in n.subgraphs.values() for c in captured_names(sub))]:
            if name and name not in written:
                seen.setdefault(name)
    return list(seen)


def plan_residuals(body: Graph, needed: list[str], policy: str,
                   types: dict[str, ValueInfo] | None = None) -> tuple[list[str], list[Node]]:
    """Which body values the forward loop stacks, and which body nodes the backward loop recomputes, so that
    every value in ``needed`` is available in the backward body.

    ``recompute`` stacks only body inputs (the loop-carried values and the iteration number) and recomputes
    every other needed value. ``store`` stacks needed values, except values whose shape may change from one
    iteration to the next (scan outputs of inner loops, whose length is the inner trip count, and values with
    dimensions that shape inference could not name): those are recomputed from what can be stacked.
    Constants are always recomputed."""
    types = types or {}
    producer = {o: nd for nd in body.nodes for o in nd.outputs if o}
    inputs = set(body.input_names)
    stacked: dict[str, None] = {}
    rerun: set[int] = set()
    want, seen = list(needed), set()
    while want:
        v = want.pop()
        if v in seen or v in body.initializers:
            continue
        seen.add(v)
        nd = producer.get(v)
        if nd is None:
            if v in inputs:
                stacked.setdefault(v)
            continue  # captured from the enclosing graph: visible in the backward body as it is
        inner_scan = nd.op_type in ("Loop", "Scan") and nd.outputs.index(v) >= _n_state(nd)
        if policy == "store" and not inner_scan and nd.op_type != "Constant" and _fixed_shape(types.get(v)):
            stacked.setdefault(v)
            continue
        if id(nd) not in rerun:
            rerun.add(id(nd))
            want.extend(i for i in nd.inputs if i)
            want.extend(c for sub in nd.subgraphs.values() for c in captured_names(sub))
    return list(stacked), [nd for nd in body.nodes if id(nd) in rerun]


def _fixed_shape(vi: ValueInfo | None) -> bool:
    """Is the value's shape the same in every iteration? Static dimensions and symbols that name a graph
    input's dimension are; unknown dimensions (and the ``unk__`` symbols ONNX inference makes up) may not be."""
    if vi is None or vi.shape is None:
        return False
    return all(isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__")) for d in vi.shape)


def _n_state(node: Node) -> int:
    """The number of loop-carried (state) outputs of a ``Loop`` or ``Scan`` node."""
    if node.op_type == "Loop":
        return len(node.inputs) - 2
    return len(node.inputs) - int(node.attrs.get("num_scan_inputs", 0))


def stack_residual(e: Emitter, node: Node, body: Graph, vi: ValueInfo | None, r: str, t: str) -> list[Node]:
    """Make the forward ``Loop`` stack body value ``r`` per iteration (one more scan output); return the
    backward-body node that reads slice ``t`` of it back under the same name."""
    out = e.fresh(f"{node.name}/residual/{r}")
    body.nodes.append(Node("Identity", [r], [out], name=out))
    body.outputs.append(ValueInfo(out, vi.dtype if vi else None, vi.shape if vi else None))
    stack = e.fresh(f"{node.name}/stacked/{r}")
    node.outputs.append(stack)
    e.types[stack] = ValueInfo(stack, vi.dtype if vi else None, None if vi is None or vi.shape is None else (None, *vi.shape))
    return [Node("Gather", [stack, t], [r], {"axis": 0}, e.fresh(f"grad/{node.name}/residual/{r}"))]
