"""Checkpointed loop VJPs: policies ``sqrt`` and an integer K (Griewank and Walther, "Algorithm 799: revolve";
Chen et al. 2016, "Training deep nets with sublinear memory cost").

Once the forward loop has run (and T is known), a checkpoint loop recomputes it segment by segment and stacks
the loop-carried values at each segment's start (S tensors of the carried values' shapes). The backward loop
runs over the segments, last first: it reads the segment's checkpoint, recomputes the segment as a loop of its
own, and differentiates that loop with the ``store`` policy, so only one segment's residuals exist at a time.
Everything stays tensors and loops, so a checkpointed gradient graph can be differentiated again.

When the segments start at iterations known before T is (:class:`Squares`, :class:`EveryK`: the boundary is
``online``) and the loop has no scan outputs, the forward loop itself keeps the checkpoints: it is rewritten
into a loop over segments whose body runs one segment as an inner loop and stacks the carried values at the
segment's start as a scan output (:func:`_checkpointing_forward`), so the checkpoints cost no extra forward
pass. Otherwise (scan outputs, whose rows segments of different lengths could not stack; a boundary that
reads T) a second loop recomputes them after the forward loop (:func:`_checkpoint_loop`).

Boundaries: every K iterations for a policy K; for ``sqrt``, the perfect squares 0, 1, 4, 9, ..., so that
segments grow as 1, 3, 5, ... and a loop of T iterations keeps about sqrt(T) checkpoints and segments of at
most about 2 sqrt(T) iterations. Memory is O(sqrt(T)) for two extra forward passes (the checkpoint loop and
the segments' recomputation), one when the forward loop keeps the checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ...ir import Graph, Node, ValueInfo
from ..context import Ctx, ForwardPatch, PatchedVJP
from ..emitter import Emitter
from ..policies import Boundary, EveryK, Segments, Squares, Store
from .residuals import declare_outputs, static_trips
from .reverse import BOOL, I64, LoopParts, body_seeds, close_loop, count_trips, open_body, take_apart


def checkpointed_loop(ctx: Ctx, node: Node, cts: list, policy: Segments) -> PatchedVJP:
    """VJP of ``Loop`` under a :class:`Segments` policy (see the module doc)."""
    template = node.attrs["body"].copy()  # the body as the user wrote it, to recompute segments with
    p = take_apart(ctx, node)
    declare_outputs(ctx.e, p)
    patch = ForwardPatch()
    bounds = policy.boundary
    rows = _static_segments(bounds, static_trips(ctx.e, p))
    if getattr(bounds, "online", False) and not p.scan_out:
        trips, checkpoints = _checkpointing_forward(ctx.e, p, template, bounds, patch)
        n_segments = bounds.count(ctx.e, trips)
    else:
        trips = count_trips(ctx.e, p, patch)
        n_segments = bounds.count(ctx.e, trips)
        checkpoints = _checkpoint_loop(ctx.e, p, template, trips, n_segments, bounds)
    for stack in checkpoints:  # [S, ...]: S known before running when T is
        vi = ctx.e.types[stack]
        if vi.shape is not None:
            ctx.e.types[stack] = ValueInfo(stack, vi.dtype, (rows, *vi.shape[1:]))

    bb = open_body(ctx, p)
    eb = bb.e
    one = eb.const(np.array(1, np.int64))
    s = eb.op("Sub", [eb.op("Sub", [n_segments, one]), bb.k.name], shape=(), dtype=I64)
    start, end = _segment(eb, bounds, s, trips)
    v_start = [eb.op("Gather", [checkpoints[j], s], axis=0, dtype=_carried(p, j).dtype, shape=_carried(p, j).shape)
               for j in range(p.n_carried)]
    seg_graph, parts = _segment_graph(eb, p, template, start, end, v_start)
    seeds = body_seeds(eb, parts, bb.cot, lambda i, name: None if cts[p.n_carried + i] is None else eb.op(
        "Slice", [cts[p.n_carried + i], eb.op("Unsqueeze", [start, eb.ints([0])]),
                  eb.op("Unsqueeze", [end, eb.ints([0])]), eb.ints([0])]), ctx.options.accumulate)
    wrt = [v_start[j] for j in p.carried] + p.captured
    body_vjp = ctx.backward(seg_graph, seeds, wrt, types=eb.types, options=replace(ctx.options, checkpoint=Store()),
                            singular=ctx.singular)
    eb.nodes += seg_graph.nodes  # the segment's loop, extended by its own VJP's patch
    eb.nodes += body_vjp.nodes
    carried = {j: body_vjp.grads.get(v_start[j]) for j in p.carried}
    return close_loop(ctx, p, bb, n_segments, cts, carried, {c: body_vjp.grads.get(c) for c in p.captured}, patch)


def _static_segments(bounds: Boundary, trips: int | None) -> int | None:
    """The number of segments of a loop of ``trips`` iterations for the boundaries revgraph defines (``None``
    when ``trips`` is, or for a user's boundary, whose count is only known as graph nodes)."""
    if trips is None:
        return None
    if isinstance(bounds, EveryK):
        return -(-trips // bounds.k)
    if isinstance(bounds, Squares):
        root = math.isqrt(trips)
        return root + (root * root < trips)
    return None


def _carried(p: LoopParts, j: int) -> ValueInfo:
    return p.types.get(p.v_in[j]) or ValueInfo(p.v_in[j])


def _segment(e: Emitter, bounds: Boundary, s: str, trips: str) -> tuple[str, str]:
    """The first iteration of segment ``s`` and the first one after it (at most ``trips``)."""
    after = e.op("Add", [s, e.const(np.array(1, np.int64))], shape=(), dtype=I64)
    return bounds.start(e, s, trips), e.op("Min", [bounds.start(e, after, trips), trips], shape=(), dtype=I64)


def _segment_graph(eb: Emitter, p: LoopParts, template: Graph, start: str, end: str,
                   v_start: list[str]) -> tuple[Graph, LoopParts]:
    """A graph holding one ``Loop`` that recomputes iterations [start, end) from the carried values ``v_start``,
    and its parts (outputs named afresh) for seeding."""
    n, name = p.n_carried, p.node.name
    length = eb.op("Sub", [end, start], shape=(), dtype=I64)
    seg_body = _offset_body(eb, template, start, f"{name}/segment")
    outs = [eb.fresh(f"{name}/segment/out") for _ in range(n + len(p.scan_out))]
    for pos, (out, src) in enumerate(zip(outs, [*p.v_out, *p.scan_out], strict=True)):
        vi = p.types.get(src)
        eb.types[out] = ValueInfo(out, vi.dtype if vi else None, vi.shape if vi and pos < n else None)
    segment = Node("Loop", [length, eb.const(np.array(True)), *v_start], outs, {"body": seg_body},
                   eb.fresh(f"{name}/segment"))
    graph = Graph([segment], [ValueInfo(v, *eb.types[v].dtype_shape) for v in v_start], [], opsets={"": eb.opset})
    return graph, replace(p, v_out=outs[:n], scan_out=outs[n:])


def _offset_body(e: Emitter, template: Graph, start: str, base: str, keep_scans: bool = True) -> Graph:
    """A copy of the loop body whose iteration number counts from ``start`` (an enclosing value)."""
    body = template.copy()
    local = e.fresh(f"{base}/i")
    body.nodes.insert(0, Node("Add", [local, start], [template.inputs[0].name], name=e.fresh(f"{base}/offset")))
    body.inputs[0] = ValueInfo(local, I64, ())
    if not keep_scans:
        body.outputs = body.outputs[: len(body.inputs) - 1]
    return body


def _checkpoint_loop(e: Emitter, p: LoopParts, template: Graph, trips: str, n_segments: str,
                     bounds: Boundary) -> list[str]:
    """Emit the loop that recomputes the forward loop segment by segment and stacks the loop-carried values
    at each segment's start (the checkpoints, ``[S, ...]`` tensors); return their names.

    It runs after the forward loop, once T is known: one more forward pass, all in tensors and loops, so the
    gradient graph stays differentiable (gradients of gradients through checkpointed loops)."""
    n, name = p.n_carried, p.node.name
    if n == 0:  # no state: a segment recomputes from its iteration numbers alone
        return []
    ec = e.child(p.types, f"{name}/checkpoints")
    seg = ec.fresh(f"{name}/checkpoints/segment")
    cond = ec.fresh(f"{name}/checkpoints/cond")
    state = [ValueInfo(ec.fresh(f"{name}/checkpoints/{p.v_in[j]}"), *_carried(p, j).dtype_shape) for j in range(n)]
    start, end = _segment(ec, bounds, seg, trips)
    length = ec.op("Sub", [end, start], shape=(), dtype=I64)
    inner = _offset_body(ec, template, start, f"{name}/checkpoints/recompute", keep_scans=False)
    ends = [ec.fresh(f"{name}/checkpoints/end") for _ in range(n)]
    ec.nodes.append(Node("Loop", [length, ec.const(np.array(True)), *(v.name for v in state)], ends, {"body": inner},
                         ec.fresh(f"{name}/checkpoints/recompute")))
    outs = [ValueInfo(ec.op("Identity", [ec.const(np.array(True))]), np.dtype(bool), ())]
    outs += [ValueInfo(ec.op("Identity", [end_j]), v.dtype, v.shape) for end_j, v in zip(ends, state, strict=True)]
    outs += [ValueInfo(ec.op("Identity", [v.name]), v.dtype, v.shape) for v in state]
    body = Graph(ec.nodes, [ValueInfo(seg, I64, ()), ValueInfo(cond, np.dtype(bool), ()), *state], outs,
                 name=f"{name}_checkpoints")
    results = e.op("Loop", [n_segments, e.const(np.array(True)), *p.node.inputs[2 : 2 + n]], n_out=2 * n, body=body)
    results = [results] if 2 * n == 1 else results
    stacks = results[n:]
    for stack, v in zip(stacks, state, strict=True):
        e.types[stack] = ValueInfo(stack, v.dtype, None if v.shape is None else (None, *v.shape))
    return stacks


def _checkpointing_forward(e: Emitter, p: LoopParts, template: Graph, bounds: Boundary,
                           patch: ForwardPatch) -> tuple[str, list[str]]:
    """Make ``patch`` replace the forward loop by a loop over segments that keeps the checkpoints as it runs:
    segment ``s`` runs iterations ``[start(s), start(s + 1))`` (fewer when the condition stops the loop or the
    trip count ``M`` is reached) as an inner loop of the user's body, and stacks the loop-carried values at
    its start as a scan output. The outer loop stops when the inner one's last condition is false or the next
    segment would start at ``M``. It writes the forward loop's outputs, then the trip count T, then the
    checkpoints (``[S, ...]`` each); return the names of these two."""
    node, n, name = p.node, p.n_carried, p.node.name
    m, cond = [*node.inputs[:2], "", ""][:2]
    eo = e.child(e.types, f"{name}/segments")  # the nodes before the forward loop
    m = m and eo.op("Reshape", [m, eo.ints([])], shape=(), dtype=I64)  # M may be written with shape [1]
    zero = eo.const(np.array(0, np.int64))

    ob = e.child(p.types, f"{name}/segments")
    s, c_in = ob.fresh(f"{name}/segments/s"), ob.fresh(f"{name}/segments/cond")
    state = [ValueInfo(ob.fresh(f"{name}/segments/{p.v_in[j]}"), *_carried(p, j).dtype_shape) for j in range(n)]
    count = ValueInfo(ob.fresh(f"{name}/segments/count"), I64, ())
    start = bounds.start(ob, s, "")
    after = bounds.start(ob, ob.op("Add", [s, ob.const(np.array(1, np.int64))], shape=(), dtype=I64), "")
    length = ob.op("Sub", [after, start], shape=(), dtype=I64)
    if m:
        length = ob.op("Min", [length, ob.op("Sub", [m, start], shape=(), dtype=I64)], shape=(), dtype=I64)
    inner = _offset_body(ob, template, start, f"{name}/segments/run")
    # Two more carried values in the inner loop: an iteration counter, and its last condition (the outer
    # loop's own condition).
    k_in, k_out, c_i, c_o, k_one = (ob.fresh(f"{name}/segments/{x}") for x in ("k_in", "k_out", "c_in", "c_out", "one"))
    inner.inputs += [ValueInfo(k_in, I64, ()), ValueInfo(c_i, BOOL, ())]
    inner.outputs[1 + n : 1 + n] = [ValueInfo(k_out, I64, ()), ValueInfo(c_o, BOOL, ())]
    inner.nodes += [Node("Constant", [], [k_one], {"value": np.array(1, np.int64)}, k_one),
                    Node("Add", [k_in, k_one], [k_out], name=k_out),
                    Node("Identity", [inner.outputs[0].name], [c_o], name=c_o)]
    ends = [ob.fresh(f"{name}/segments/end") for _ in range(n)]
    k_end, c_end = ob.fresh(f"{name}/segments/count_out"), ob.fresh(f"{name}/segments/cond_out")
    ob.nodes.append(Node("Loop", [length, c_in, *(v.name for v in state), count.name, c_in], [*ends, k_end, c_end],
                         {"body": inner}, ob.fresh(f"{name}/segments/run")))
    go = c_end if not m else ob.op("And", [c_end, ob.op("Less", [after, m], shape=(), dtype=BOOL)],
                                   shape=(), dtype=BOOL)
    outs = [ValueInfo(go, BOOL, ()), *(ValueInfo(v, w.dtype, w.shape) for v, w in zip(ends, state, strict=True)),
            ValueInfo(k_end, I64, ())]
    outs += [ValueInfo(ob.op("Identity", [v.name]), v.dtype, v.shape) for v in state]
    body = Graph(ob.nodes, [ValueInfo(s, I64, ()), ValueInfo(c_in, BOOL, ()), *state, count], outs,
                 name=f"{name}_segments")

    m_outer = bounds.count(eo, m) if m else ""
    cond0 = cond or eo.const(np.array(True))
    trips = e.fresh(f"{name}/trip_count")
    stacks = [e.fresh(f"{name}/checkpoint") for _ in range(n)]
    e.types[trips] = ValueInfo(trips, I64, ())
    for stack, v in zip(stacks, state, strict=True):
        e.types[stack] = ValueInfo(stack, v.dtype, None if v.shape is None else (None, *v.shape))
    patch.before += eo.nodes
    patch.replace = Node("Loop", [m_outer, cond0, *node.inputs[2 : 2 + n], zero], [*node.outputs[:n], trips, *stacks],
                         {"body": body}, node.name)
    return trips, stacks
