"""The grad graph cut into segments by gradient unit, for ZeRO-2 (:mod:`revgraph.train.distributed.sharding`).

A minimal cut, enough to bound gradient memory: the nodes of the grad graph (in their topological order)
are cut right after the node that finishes the last gradient of a unit (units in the order the backward
finishes them), so that after segment ``s`` the units it finishes can be reduce-scattered and their gradient
buffer reused by the next segment. Each segment is an ONNX graph of its nodes: its inputs are the values it
reads (also inside subgraphs, :func:`revgraph.ir.inplace.captured`) that earlier segments or the grad graph's
inputs hold, its outputs the values it computes that later segments read or the grad graph returns; the
types of crossing values come from :func:`revgraph.onnx_io.value_types.infer_types`. Initializers go to the segments
that read them. The segments run one after the other; the values they pass on are kept only until their last
reader. No overlap with communication: that is the segmented backward of the overlap work (issue 25, item 5).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from ...ir import Graph
from ...ir.inplace import captured


@dataclass
class Segment:
    """One segment: its ``graph``, the names it reads (``inputs``) and returns (``outputs``), the units to
    reduce-scatter after it (``reduce``, indices into the cut's units) and the values to drop then (``free``)."""

    graph: Graph
    inputs: list[str]
    outputs: list[str]
    reduce: list[int] = field(default_factory=list)
    free: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """The segments in running order; ``direct``: the gradients a segment writes straight into the bucket
    (those finished in the segment that reduces their unit, as the first unit it reduces, and read by no
    later segment); the others are ``carried`` (kept as separate values until their unit is reduced), at most
    ``carried_peak`` bytes of them alive at once."""

    segments: list[Segment]
    direct: set[str]
    carried: set[str]
    carried_peak: int


def cut(graph: Graph, units: list[list[str]], nbytes: dict[str, int]) -> Plan | None:
    """Cut ``graph`` (a grad graph) after each unit of gradients ``units`` (lists of output names) is finished;
    ``nbytes[g]``: the size of gradient ``g`` (for :attr:`Plan.carried_peak`). Returns ``None`` when it cannot
    be cut here: a gradient computed by no node or listed twice, or a crossing value of unknown dtype or a
    sequence."""
    nodes = graph.nodes
    producer = {o: k for k, n in enumerate(nodes) for o in n.outputs if o}
    grads = [g for gs in units for g in gs]
    if not grads or len(set(grads)) != len(grads) or any(g not in producer for g in grads):
        return None
    finish = [max(producer[g] for g in gs) for gs in units]
    ends = sorted({f + 1 for f in finish})
    ends[-1] = len(nodes)  # the last segment takes the rest of the graph (sparse rows, what follows)
    starts = [0, *ends[:-1]]
    seg_of = lambda k: bisect_right(ends, k)  # the segment holding node k
    reads = [list(dict.fromkeys([*(i for i in n.inputs if i), *sorted(captured(n))])) for n in nodes]
    last_reader: dict[str, int] = {}
    for k, names in enumerate(reads):
        for name in names:
            last_reader[name] = max(last_reader.get(name, -1), seg_of(k))
    outputs = set(graph.output_names)
    reduce_at = {j: seg_of(finish[j]) for j in range(len(units))}
    by_segment: dict[int, list[int]] = {}
    for j in sorted(range(len(units)), key=lambda j: finish[j]):
        by_segment.setdefault(reduce_at[j], []).append(j)
    direct, carried = set(), set()
    for j, gs in enumerate(units):
        s = reduce_at[j]
        for g in gs:
            if seg_of(producer[g]) == s and by_segment[s][0] == j and last_reader.get(g, -1) <= s:
                direct.add(g)
            else:
                carried.add(g)
    unit_of = {g: j for j, gs in enumerate(units) for g in gs}
    types = None
    segments = []
    inits = graph.initializers
    declared = {v.name: v for v in [*graph.inputs, *graph.outputs]}
    for s, (a, b) in enumerate(zip(starts, ends, strict=True)):
        made = {o for n in nodes[a:b] for o in n.outputs if o}
        wanted = list(dict.fromkeys(name for k in range(a, b) for name in reads[k]))
        ins = [n for n in wanted if n not in made and n not in inits]
        outs = [o for n in nodes[a:b] for o in n.outputs if o and (o in outputs or last_reader.get(o, -1) > s)]
        infos = []
        for name in [*ins, *outs]:
            vi = declared.get(name)
            if vi is None or vi.dtype is None:
                if types is None:
                    from ...onnx_io.value_types import infer_types

                    types = infer_types(graph)
                vi = types.get(name)
            if vi is None or vi.dtype is None or vi.kind != "tensor":  # (sequences are not bound across runs)
                return None
            infos.append(vi)
        g = Graph(list(nodes[a:b]), infos[:len(ins)], infos[len(ins):],
                  {n: inits[n] for n in wanted if n in inits and n not in made}, name=f"{graph.name} segment {s + 1}",
                  opsets=dict(graph.opsets))
        segments.append(Segment(g, ins, outs, by_segment.get(s, [])))
    # what to drop after segment s (its run and its reductions): values passed on to segments up to s, and
    # carried gradients whose unit is reduced and which no later segment reads
    for s, seg in enumerate(segments):
        for name in seg.outputs:
            if name in carried:
                end = max(reduce_at[unit_of[name]], last_reader.get(name, -1))
            elif name in outputs:
                continue  # returned by the grad graph (the loss, sparse rows): kept to the end of the step
            else:
                end = last_reader.get(name, s)
            segments[end].free.append(name)
    peak = 0
    for s in range(len(segments)):
        alive = sum(nbytes[g] for g in carried if seg_of(producer[g]) <= s <= max(reduce_at[unit_of[g]],
                                                                                  last_reader.get(g, -1)))
        peak = max(peak, alive)
    return Plan(segments, direct, carried, peak)


_ARENA: list = []


def shared_cpu_arena() -> bool:
    """Register (once per process) a CPU arena in onnxruntime's environment that sessions with
    ``session.use_env_allocators`` share: the ZeRO-2 segments then hold one arena between them, as the whole
    grad graph would, instead of one each. False when this onnxruntime cannot."""
    if not _ARENA:
        import onnxruntime as ort

        try:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
            _ARENA.append(True)
        except Exception:  # noqa: BLE001 - an onnxruntime without it: the segments keep their own arenas
            _ARENA.append(False)
    return _ARENA[0]
