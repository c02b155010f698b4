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

import numpy as np
import onnx

from ...ir import Graph, Node, ValueInfo
from ..registry import Emitter
from .loop import I64, count_trips, reverse_loop, seeds_of, take_apart


def _boundary_test(e: Emitter, body: Graph, i: str, policy) -> str:
    """Body nodes computing "iteration i starts a segment"; returns the boolean's name."""
    def add(op, ins, **attrs):
        out = e.fresh(f"{body.name}/checkpoint/{op}")
        body.nodes.append(Node(op, ins, [out], attrs, out))
        return out

    def const(v):
        return add("Constant", [], value=np.array(v, np.int64))

    if policy == "sqrt":
        root = add("Cast", [add("Floor", [add("Sqrt", [add("Cast", [i], to=onnx.TensorProto.DOUBLE)])])], to=onnx.TensorProto.INT64)
        return add("Equal", [add("Mul", [root, root]), i])
    return add("Equal", [add("Mod", [i, const(policy)]), const(0)])


def _boundary(e: Emitter, s: str, policy) -> str:
    """The first iteration of segment ``s``: s*K, or s*s for ``sqrt``."""
    return e.op("Mul", [s, s if policy == "sqrt" else e.const(np.array(policy, np.int64))], shape=(), dtype=I64)


def _segments(e: Emitter, trips: str, policy) -> str:
    """The number of segments of a loop of ``trips`` iterations (of boundaries below it)."""
    if policy == "sqrt":
        real = e.op("Sqrt", [e.op("Cast", [trips], to=onnx.TensorProto.DOUBLE)])
        return e.op("Cast", [e.op("Ceil", [real])], to=onnx.TensorProto.INT64, shape=(), dtype=I64)
    k = e.const(np.array(policy, np.int64))
    return e.op("Div", [e.op("Add", [trips, e.const(np.array(policy - 1, np.int64))]), k], shape=(), dtype=I64)


def checkpointed_loop(e: Emitter, node: Node, out_grads: list, policy) -> tuple[list, dict]:
    """VJP of ``Loop`` under policy ``sqrt`` or K (see the module doc)."""
    template = node.attrs["body"].copy()  # the body as the user wrote it, to recompute segments with
    p = take_apart(e, node)
    n = p.n_carried
    trips = count_trips(e, p)

    n_segments = _segments(e, trips, policy)
    checkpoints = _checkpoint_loop(e, node, p, template, trips, n_segments, policy)
    scan_grads = out_grads[n:]

    def build(eb: Emitter, k: str, cot_in: dict, acc_in: dict) -> tuple[dict, dict]:
        from ..backward import backward

        one = eb.const(np.array(1, np.int64))
        s = eb.op("Sub", [eb.op("Sub", [n_segments, one]), k], shape=(), dtype=I64)
        start = _boundary(eb, s, policy)
        end = eb.op("Min", [_boundary(eb, eb.op("Add", [s, one], shape=(), dtype=I64), policy), trips], shape=(), dtype=I64)
        length = eb.op("Sub", [end, start], shape=(), dtype=I64)
        v_start = []
        for j in range(n):
            vi = p.types.get(p.v_in[j])
            v_start.append(eb.op("Gather", [checkpoints[j], s], axis=0, dtype=vi.dtype, shape=vi.shape))
        seg_body = _offset_body(eb, template, start, f"{node.name}/segment")
        outs = [eb.fresh(f"{node.name}/segment/out") for _ in range(n + len(p.scan_out))]
        for pos, (name, src) in enumerate(zip(outs, [*p.v_out, *p.scan_out], strict=True)):
            vi = p.types.get(src)
            eb.types[name] = ValueInfo(name, vi.dtype if vi else None, vi.shape if vi and pos < n else None)
        segment = Node("Loop", [length, eb.const(np.array(True)), *v_start], outs,
                       {"body": seg_body}, eb.fresh(f"{node.name}/segment"))
        seg_graph = Graph([segment], [ValueInfo(v, *(_dt(eb, v))) for v in v_start], [], opsets={"": e.opset})
        parts = type(p)(**{**p.__dict__, "v_out": outs[:n], "scan_out": outs[n:]})
        seeds = seeds_of(eb, parts, cot_in, lambda i, name: None if scan_grads[i] is None else eb.op(
            "Slice", [scan_grads[i], eb.op("Unsqueeze", [start, eb.ints([0])]), eb.op("Unsqueeze", [end, eb.ints([0])]),
                      eb.ints([0])]))
        head = list(eb.nodes)
        eb.nodes.clear()
        saved = eb.options
        eb.options = {**saved, "checkpoint": "store"}
        _, gmap = backward(seg_graph, seeds, [v_start[j] for j in p.carried] + p.captured, types=eb.types, emitter=eb)
        eb.options = saved
        eb.nodes[:] = [*head, *seg_graph.nodes, *eb.nodes]
        return {j: gmap.get(v_start[j]) for j in p.carried}, {c: gmap.get(c) for c in p.captured}

    return reverse_loop(e, p, n_segments, out_grads, build)


def _offset_body(e: Emitter, template: Graph, start: str, base: str, keep_scans: bool = True) -> Graph:
    """A copy of the loop body whose iteration number counts from ``start`` (an enclosing value)."""
    body = template.copy()
    local = e.fresh(f"{base}/i")
    body.nodes.insert(0, Node("Add", [local, start], [template.inputs[0].name], name=e.fresh(f"{base}/offset")))
    body.inputs[0] = ValueInfo(local, I64, ())
    if not keep_scans:
        body.outputs = body.outputs[: len(body.inputs) - 1]
    return body


def _checkpoint_loop(e: Emitter, node: Node, p, template: Graph, trips: str, n_segments: str, policy) -> list[str]:
    """Emit the loop that recomputes the forward loop segment by segment and stacks the loop-carried values
    at each segment's start (the checkpoints, ``[S, ...]`` tensors); return their names.

    It runs after the forward loop, once T is known: one more forward pass, all in tensors and loops, so the
    gradient graph stays differentiable (gradients of gradients through checkpointed loops)."""
    n = p.n_carried
    if n == 0:  # no state: a segment recomputes from its iteration numbers alone
        return []
    ec = Emitter(p.types, e.used, e.opset)
    ec.prefix = f"{node.name}/checkpoints"
    seg = ec.fresh(f"{node.name}/checkpoints/segment")
    cond = ec.fresh(f"{node.name}/checkpoints/cond")
    state = [ValueInfo(ec.fresh(f"{node.name}/checkpoints/{p.v_in[j]}"), *_vi(p.types.get(p.v_in[j]))) for j in range(n)]
    one = ec.const(np.array(1, np.int64))
    start = _boundary(ec, seg, policy)
    end = ec.op("Min", [_boundary(ec, ec.op("Add", [seg, one], shape=(), dtype=I64), policy), trips], shape=(), dtype=I64)
    length = ec.op("Sub", [end, start], shape=(), dtype=I64)
    inner = _offset_body(ec, template, start, f"{node.name}/checkpoints/recompute", keep_scans=False)
    ends = [ec.fresh(f"{node.name}/checkpoints/end") for _ in range(n)]
    ec.nodes.append(Node("Loop", [length, ec.const(np.array(True)), *(v.name for v in state)], ends, {"body": inner},
                         ec.fresh(f"{node.name}/checkpoints/recompute")))
    outs = [ValueInfo(ec.op("Identity", [ec.const(np.array(True))]), np.dtype(bool), ())]
    outs += [ValueInfo(ec.op("Identity", [end_j]), v.dtype, v.shape) for end_j, v in zip(ends, state, strict=True)]
    outs += [ValueInfo(ec.op("Identity", [v.name]), v.dtype, v.shape) for v in state]
    body = Graph(ec.nodes, [ValueInfo(seg, I64, ()), ValueInfo(cond, np.dtype(bool), ()), *state], outs,
                 name=f"{node.name}_checkpoints")
    results = e.op("Loop", [n_segments, e.const(np.array(True)), *node.inputs[2 : 2 + n]], n_out=2 * n, body=body)
    results = [results] if 2 * n == 1 else results
    stacks = results[n:]
    for name, v in zip(stacks, state, strict=True):
        e.types[name] = ValueInfo(name, v.dtype, None if v.shape is None else (None, *v.shape))
    return stacks


def _vi(vi: ValueInfo | None) -> tuple:
    return (None, None) if vi is None else (vi.dtype, vi.shape)


def _dt(e: Emitter, name: str) -> tuple:
    vi = e.types.get(name)
    return (None, None) if vi is None else (vi.dtype, vi.shape)

