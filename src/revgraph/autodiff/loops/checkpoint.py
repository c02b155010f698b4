"""Checkpointed loop VJPs: policies ``sqrt`` and an integer K (Griewank and Walther, "Algorithm 799: revolve";
Chen et al. 2016, "Training deep nets with sublinear memory cost").

Once the forward loop has run (and T is known), a checkpoint loop recomputes it segment by segment and stacks
the loop-carried values at each segment's start (S tensors of the carried values' shapes). The backward loop
runs over the segments, last first: it reads the segment's checkpoint, recomputes the segment as a loop of its
own, and differentiates that loop with the ``store`` policy, so only one segment's residuals exist at a time.
Everything stays tensors and loops, so a checkpointed gradient graph can be differentiated again.

Boundaries: every K iterations for a policy K; for ``sqrt``, the perfect squares 0, 1, 4, 9, ..., so that
segments grow as 1, 3, 5, ... and a loop of T iterations keeps about sqrt(T) checkpoints and segments of at
most about 2 sqrt(T) iterations. Memory is O(sqrt(T)) for two extra forward passes (the checkpoint loop and
the segments' recomputation).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...ir import Graph, Node, ValueInfo
from ..context import Ctx, ForwardPatch, PatchedVJP
from ..emitter import Emitter
from ..policies import Boundary, Segments, Store
from .reverse import I64, LoopParts, body_seeds, close_loop, count_trips, open_body, take_apart


def checkpointed_loop(ctx: Ctx, node: Node, cts: list, policy: Segments) -> PatchedVJP:
    """VJP of ``Loop`` under a :class:`Segments` policy (see the module doc)."""
    template = node.attrs["body"].copy()  # the body as the user wrote it, to recompute segments with
    p = take_apart(ctx, node)
    patch = ForwardPatch()
    trips = count_trips(ctx.e, p, patch)
    bounds = policy.boundary
    n_segments = bounds.count(ctx.e, trips)
    checkpoints = _checkpoint_loop(ctx.e, p, template, trips, n_segments, bounds)

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
                  eb.op("Unsqueeze", [end, eb.ints([0])]), eb.ints([0])]))
    wrt = [v_start[j] for j in p.carried] + p.captured
    body_vjp = ctx.backward(seg_graph, seeds, wrt, types=eb.types, options=replace(ctx.options, checkpoint=Store()))
    eb.nodes += seg_graph.nodes  # the segment's loop, extended by its own VJP's patch
    eb.nodes += body_vjp.nodes
    carried = {j: body_vjp.grads.get(v_start[j]) for j in p.carried}
    return close_loop(ctx, p, bb, n_segments, cts, carried, {c: body_vjp.grads.get(c) for c in p.captured}, patch)


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
