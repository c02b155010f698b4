"""VJPs of control flow: ``Loop`` (and ``Scan``, lowered to ``Loop``) and ``If`` (DESIGN.md section 4).

The gradient of a loop is a loop that runs the iterations backwards (MegEngine's ``LoopGrad``):

* the forward loop gets one more scan output, its iteration numbers, so the backward loop knows the trip
  count T also when the condition stopped the forward loop early (T may be 0);
* a **carried** value's cotangent is a carried value of the backward loop, starting from the cotangent of the
  loop's final output; the gradient of its initial value is what the last backward iteration produces;
* a **captured** (loop-invariant) value's gradient is summed over the iterations in an accumulator carried by
  the backward loop, starting at zero; a sparse contribution is added with ``ScatterND(reduction="add")``;
* backward iteration k works on forward iteration t = T - 1 - k: it reads slice t of each scan output's
  cotangent and of each stacked residual.

The body's VJP is the same backward pass (:func:`revgraph.autodiff.backward.backward`) run on the body graph.
Residual policies (``checkpoint``): ``store`` stacks, as extra scan outputs of the forward loop, exactly the
body values that the body's VJP reads; ``recompute`` stacks only the loop-carried inputs and recomputes the
rest of the body inside the backward loop.
"""

from __future__ import annotations

import numpy as np

from ..errors import GraphError
from ..ir import Graph, Node, ValueInfo
from ..onnx_io import infer_types
from ..ssa import captured_names
from .registry import Emitter, vjp
from .sparse import SparseGrad, densify, scatter_add

POLICIES = ("store", "recompute")


def _is_float(e: Emitter, name: str, fallback: ValueInfo | None = None) -> bool:
    dt = e.dtype(name)
    if dt is None and fallback is not None:
        dt = fallback.dtype
    return dt is None or dt.kind == "f"


def body_types(body: Graph, outer: dict[str, ValueInfo]) -> dict[str, ValueInfo]:
    """Types of a subgraph's values, inferred with its captured values declared from ``outer``."""
    captured = [outer.get(c) or ValueInfo(c) for c in captured_names(body)]
    probe = Graph(body.nodes, [*body.inputs, *captured], body.outputs, body.initializers, body.value_info)
    types = infer_types(probe)
    for c in captured:
        types.setdefault(c.name, c)
    return types


def _fresh_vi(e: Emitter, base: str, like: ValueInfo | None) -> ValueInfo:
    name = e.fresh(base)
    vi = ValueInfo(name, like.dtype if like else None, like.shape if like else None)
    e.types[name] = vi
    return vi


def _reads(nodes: list[Node]) -> list[str]:
    """Names the nodes read (subgraph captures included) that they do not write themselves."""
    written = {o for n in nodes for o in n.outputs if o}
    seen: dict[str, None] = {}
    for n in nodes:
        for i in n.inputs:
            if i and i not in written:
                seen.setdefault(i)
        for sub in n.subgraphs.values():
            for c in captured_names(sub):
                if c not in written:
                    seen.setdefault(c)
    return list(seen)


def _slice(ctx: Emitter, stacked: str, t: str, out: str | None = None, like: ValueInfo | None = None) -> str:
    """Slice ``t`` of a stacked value (a ``Gather`` on axis 0, named ``out`` when given)."""
    name = out or ctx.fresh(f"{ctx.prefix}/slice")
    ctx.nodes.append(Node("Gather", [stacked, t], [name], {"axis": 0}, ctx.fresh(f"{ctx.prefix}/Gather")))
    if like is not None:
        ctx.types[name] = ValueInfo(name, like.dtype, like.shape)
    return name


@vjp("Loop")
def loop(e: Emitter, node: Node, out_grads: list) -> tuple[list, dict]:
    """VJP of ONNX ``Loop`` (operator spec "Loop", opset 21): see the module doc."""
    policy = e.options.get("checkpoint", "store")
    if policy not in POLICIES:
        raise GraphError(f"unknown checkpoint policy {policy!r}; choose one of {', '.join(POLICIES)}")
    body: Graph = node.attrs["body"]
    n_carried = len(node.inputs) - 2
    iter_in, cond_in = body.inputs[0].name, body.inputs[1].name
    v_in = [v.name for v in body.inputs[2:]]
    v_out = body.output_names[1 : 1 + n_carried]
    scan_out = body.output_names[1 + n_carried :]
    n_scan = len(scan_out)
    btypes = body_types(body, e.types)
    for j, name in enumerate(v_in):  # carried inputs take the types of the initial values when undeclared
        if btypes.get(name) is None or btypes[name].dtype is None:
            src = e.types.get(node.inputs[2 + j])
            if src is not None:
                btypes[name] = ValueInfo(name, src.dtype, src.shape)
    carried = [j for j in range(n_carried) if _is_float(e, node.inputs[2 + j], btypes.get(v_in[j]))]
    captured = [c for c in captured_names(body) if c in e.reach and _is_float(e, c)]

    # 1. the forward loop stacks its iteration numbers: T = their count, also when cond stops it early
    iters_out = e.fresh(f"{node.name}/iteration")
    body.nodes.append(Node("Identity", [iter_in], [iters_out], name=iters_out))
    body.outputs.append(ValueInfo(iters_out, np.dtype(np.int64), ()))
    iters = e.fresh(f"{node.name}/iterations")
    node.outputs.append(iters)
    e.types[iters] = ValueInfo(iters, np.dtype(np.int64), ("T",))
    trips = e.op("Size", [iters], shape=(), dtype=np.dtype(np.int64))

    # 2. the backward body: inputs k, cond, the carried cotangents and the accumulators of captured values
    eb = Emitter(btypes, e.used, e.opset)
    eb.options = e.options
    eb.prefix = f"grad/{node.name}/body"
    k_vi = _fresh_vi(eb, f"grad/{node.name}/k", ValueInfo("", np.dtype(np.int64), ()))
    c_vi = _fresh_vi(eb, f"grad/{node.name}/cond", ValueInfo("", np.dtype(bool), ()))
    cot_in = {j: _fresh_vi(eb, f"grad/{node.name}/cot_{v_in[j]}", btypes.get(v_in[j])) for j in carried}
    acc_in = {c: _fresh_vi(eb, f"grad/{node.name}/acc_{c}", e.types.get(c)) for c in captured}
    t = eb.op("Sub", [eb.op("Sub", [trips, eb.const(np.array(1, np.int64))]), k_vi.name], shape=(), dtype=np.dtype(np.int64))
    head = list(eb.nodes)  # t; residual slices go right after it
    eb.nodes.clear()

    seeds: dict[str, list[str]] = {}
    for j in carried:
        seeds.setdefault(v_out[j], []).append(cot_in[j].name)
    for s in range(n_scan):
        g = out_grads[n_carried + s]
        if g is not None and _is_float(eb, scan_out[s]):
            seeds.setdefault(scan_out[s], []).append(_slice(eb, g, t, like=btypes.get(scan_out[s])))
    head += eb.nodes
    eb.nodes.clear()
    ys = {}
    for y, parts in seeds.items():
        ys[y] = parts[0] if len(parts) == 1 else eb.op("Sum", parts, like=parts[0])
    head += eb.nodes
    eb.nodes.clear()

    from .backward import _keep_types, backward  # late: backward imports the rules package

    wrt = [v_in[j] for j in carried] + captured
    nodes_b, gmap = backward(body, ys, wrt, types=btypes, emitter=eb)
    outs: list[ValueInfo] = [ValueInfo(eb.op("Identity", [eb.const(np.array(True))]), np.dtype(bool), ())]
    for j in carried:
        g = gmap.get(v_in[j])
        g = eb.zeros_like(v_in[j]) if g is None else densify(eb, g) if isinstance(g, SparseGrad) else g
        outs.append(ValueInfo(eb.op("Identity", [g]), *(_dt_shape(btypes.get(v_in[j])))))
    for c in captured:
        g = gmap.get(c)
        if g is None:
            total = eb.op("Identity", [acc_in[c].name])
        elif isinstance(g, SparseGrad):
            total = scatter_add(eb, acc_in[c].name, g)
        else:
            total = eb.op("Add", [acc_in[c].name, g])
        outs.append(ValueInfo(eb.op("Identity", [total]), *(_dt_shape(e.types.get(c)))))
    backward_nodes = eb.nodes

    # 3. residuals: body values the backward nodes read, stacked by the forward loop or recomputed
    body_scope = set(body.input_names) | {o for n in body.nodes for o in n.outputs if o}
    needed = [r for r in _reads(backward_nodes) if r in body_scope]
    prologue: list[Node] = []
    bound = {iter_in: t, cond_in: eb.const(np.array(True))}  # an iteration that ran had cond_in true
    stacked, recompute = plan_residuals(body, needed, policy)
    stacked = [r for r in stacked if r not in bound]
    for r in stacked:
        prologue += _stack_residual(e, node, body, btypes.get(r), r, t)
    for name, value in bound.items():
        if name in needed or name in _reads(recompute):
            prologue.append(Node("Identity", [value], [name], name=e.fresh(f"grad/{node.name}/bind/{name}")))
    copies = [Node(n.op_type, list(n.inputs), list(n.outputs), dict(n.attrs), n.name, n.domain) for n in recompute]
    bwd_body = Graph(
        nodes=[*head, *prologue, *copies, *backward_nodes],
        inputs=[k_vi, c_vi, *(cot_in[j] for j in carried), *(acc_in[c] for c in captured)],
        outputs=outs,
        initializers=dict(body.initializers),
        name=f"grad_{node.name}_body",
    )
    _keep_types(bwd_body, eb.types)
    _keep_types(body, btypes)

    # 4. the backward loop
    initial = []
    for j in carried:
        g = out_grads[j]
        initial.append(g if g is not None else e.zeros_like(node.outputs[j]))
    initial += [e.zeros_like(c) for c in captured]
    results = e.op("Loop", [trips, e.const(np.array(True)), *initial], n_out=len(carried) + len(captured), body=bwd_body)
    results = [results] if isinstance(results, str) else results
    for name, src in zip(results, [node.inputs[2 + j] for j in carried] + captured, strict=True):
        vi = e.types.get(src)
        e.types[name] = ValueInfo(name, *(_dt_shape(vi)))
    in_grads: list = [None] * len(node.inputs)
    for j, name in zip(carried, results, strict=False):
        in_grads[2 + j] = name
    return in_grads, dict(zip(captured, results[len(carried):], strict=True))


def _stack_residual(e: Emitter, node: Node, body: Graph, vi: ValueInfo | None, r: str, t: str) -> list[Node]:
    """Make the forward ``Loop`` stack body value ``r`` per iteration; return the backward-body nodes that
    read it back at iteration ``t`` under the same name.

    Residuals are stacked flattened to 1-D, so that every runtime stacks them the same way (the reference
    evaluator's ``Loop`` concatenates scan outputs of rank >= 2 instead of stacking them); their shape is a
    constant when static, else stacked too."""
    flat = e.fresh(f"{node.name}/residual/{r}")
    minus_one = e.fresh(f"{node.name}/residual/{r}/minus_one")
    body.nodes.append(Node("Constant", [], [minus_one], {"value": np.array([-1], np.int64)}, minus_one))
    body.nodes.append(Node("Reshape", [r, minus_one], [flat], name=flat))
    static = vi is not None and vi.shape is not None and all(isinstance(d, int) for d in vi.shape)
    size = int(np.prod(vi.shape)) if static else None
    body.outputs.append(ValueInfo(flat, vi.dtype if vi else None, (size,)))
    stack = e.fresh(f"{node.name}/stacked/{r}")
    node.outputs.append(stack)
    e.types[stack] = ValueInfo(stack, vi.dtype if vi else None, (None, size))
    out: list[Node] = []
    sliced = e.fresh(f"grad/{node.name}/residual/{r}")
    out.append(Node("Gather", [stack, t], [sliced], {"axis": 0}, sliced))
    if static:
        shape = e.fresh(f"grad/{node.name}/residual/{r}/shape")
        out.append(Node("Constant", [], [shape], {"value": np.array(vi.shape, np.int64)}, shape))
    else:
        shape_out = e.fresh(f"{node.name}/residual/{r}/shape")
        body.nodes.append(Node("Shape", [r], [shape_out], name=shape_out))
        rank = None if vi is None or vi.shape is None else len(vi.shape)
        body.outputs.append(ValueInfo(shape_out, np.dtype(np.int64), (rank,)))
        shapes = e.fresh(f"{node.name}/stacked/{r}/shape")
        node.outputs.append(shapes)
        e.types[shapes] = ValueInfo(shapes, np.dtype(np.int64), (None, rank))
        shape = e.fresh(f"grad/{node.name}/residual/{r}/shape")
        out.append(Node("Gather", [shapes, t], [shape], {"axis": 0}, shape))
    out.append(Node("Reshape", [sliced, shape], [r], name=e.fresh(f"grad/{node.name}/residual/{r}/reshape")))
    return out


def _dt_shape(vi: ValueInfo | None):
    return (None, None) if vi is None else (vi.dtype, vi.shape)


def plan_residuals(body: Graph, needed: list[str], policy: str) -> tuple[list[str], list[Node]]:
    """Which body values the forward loop stacks, and which body nodes the backward loop recomputes, so that
    every value in ``needed`` is available in the backward body.

    ``recompute`` stacks only body inputs (the loop-carried values and the iteration number) and recomputes
    every other needed value. ``store`` stacks needed values, except scan outputs of inner loops: their
    leading dimension is the inner trip count, which may change from one outer iteration to the next, so the
    inner loop is recomputed from its (stacked) inputs instead."""
    producer = {o: nd for nd in body.nodes for o in nd.outputs if o}
    inputs = set(body.input_names)
    stacked: dict[str, None] = {}
    rerun: set[int] = set()
    want = list(needed)
    seen: set[str] = set()
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
        inner_scan = nd.op_type in ("Loop", "Scan") and nd.outputs.index(v) >= _n_carried(nd)
        if policy == "store" and not inner_scan and nd.op_type != "Constant":
            stacked.setdefault(v)
            continue
        if id(nd) not in rerun:
            rerun.add(id(nd))
            want.extend(i for i in nd.inputs if i)
            for sub in nd.subgraphs.values():
                want.extend(captured_names(sub))
    return list(stacked), [nd for nd in body.nodes if id(nd) in rerun]


def _n_carried(node: Node) -> int:
    """The number of loop-carried (state) outputs of a ``Loop`` or ``Scan`` node."""
    if node.op_type == "Loop":
        return len(node.inputs) - 2
    return len(node.inputs) - int(node.attrs.get("num_scan_inputs", 0))
