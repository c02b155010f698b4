"""Checkpointed loop VJPs: policies ``sqrt`` and an integer K (Griewank and Walther, "Algorithm 799: revolve";
Chen et al. 2016, "Training deep nets with sublinear memory cost").

The forward loop keeps its loop-carried values at segment boundaries only, in one ONNX sequence per carried
value (``SequenceInsert`` under an ``If`` in the body). The backward loop runs over the segments, last first:
it reads the segment's checkpoint, recomputes the segment as a loop of its own, and differentiates that loop
with the ``store`` policy, so only one segment's residuals exist at a time.

Boundaries: every K iterations for a policy K; for ``sqrt``, the perfect squares 0, 1, 4, 9, ..., so that
segments grow as 1, 3, 5, ... and a loop of T iterations keeps about sqrt(T) checkpoints and segments of at
most about 2 sqrt(T) iterations, without knowing T in advance (a while loop's T is known only at its end).
Memory is O(sqrt(T)) for about one extra forward pass.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo
from ..registry import Emitter
from .loop import I64, add_carried, count_trips, reverse_loop, seeds_of, take_apart


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

    # forward: one sequence of checkpoints per loop-carried value
    is_start = _boundary_test(e, p.body, p.iter_in, policy)
    checkpoints = []
    for j in range(n):
        vi = p.types.get(p.v_in[j])
        if vi is None or vi.dtype is None:
            raise GraphError(f"{node.label()}: the dtype of loop-carried {p.v_in[j]!r} is unknown; declare it to checkpoint")
        empty, seq_in, seq_out, seq = (e.fresh(f"{node.name}/checkpoints/{p.v_in[j]}/{s}") for s in ("empty", "in", "out", "all"))
        e.insert_before(node, [Node("SequenceEmpty", [], [empty], {"dtype": onnx.helper.np_dtype_to_tensor_dtype(vi.dtype)}, empty)])
        kept, same = e.fresh(f"{seq_out}/insert"), e.fresh(f"{seq_out}/same")
        seq_vi = lambda name: ValueInfo(name, vi.dtype, vi.shape, kind="sequence")  # noqa: E731
        then = Graph([Node("SequenceInsert", [seq_in, p.v_in[j]], [kept], name=kept)], [], [seq_vi(kept)], name=f"{kept}_then")
        other = Graph([Node("Identity", [seq_in], [same], name=same)], [], [seq_vi(same)], name=f"{same}_else")
        p.body.nodes.append(Node("If", [is_start], [seq_out], {"then_branch": then, "else_branch": other}, seq_out))
        add_carried(node, p.body, empty, seq_vi(seq_in), seq_vi(seq_out), seq)
        e.types[seq] = seq_vi(seq)
        checkpoints.append(seq)
    n_segments = _segments(e, trips, policy)
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
            v_start.append(eb.op("SequenceAt", [checkpoints[j], s], dtype=vi.dtype, shape=vi.shape))
        seg_body = template.copy()
        local = eb.fresh(f"{node.name}/segment/i")
        seg_body.nodes.insert(0, Node("Add", [local, start], [p.iter_in], name=eb.fresh(f"{node.name}/segment/offset")))
        seg_body.inputs[0] = ValueInfo(local, I64, ())
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


def _dt(e: Emitter, name: str) -> tuple:
    vi = e.types.get(name)
    return (None, None) if vi is None else (vi.dtype, vi.shape)

