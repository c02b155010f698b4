"""The grad graph cut into segments by gradient bucket, so that the all-reduce of a bucket overlaps with the rest
of the backward pass (issue 25, item 5), as ``torch.nn.parallel.DistributedDataParallel`` starts a bucket's
all-reduce as soon as autograd has produced its last gradient.

:func:`cut` takes the grad graph (forward and backward, a topologically ordered node list) and the buckets'
gradient names in the order the buckets are exchanged (reverse parameter order, as DDP packs them, so the
first bucket holds the gradients the backward pass produces first). Segment ``j`` is every node that the
gradients of bucket ``j`` depend on and that no earlier segment holds (the closure over node inputs, including
the values that ``Loop``/``If``/``Scan`` bodies capture from the enclosing graph), in the original node order;
the nodes nothing asked for form a last segment. So segment 0 holds the forward pass and the backward pass down
to the last layer's gradients, and every later segment only the part of the backward that its bucket needs.
A segment's node order is the grad graph's order restricted to it, so every value a segment reads is a graph
input, an initializer, or an output of an earlier segment (:func:`check_cut` verifies it).

:class:`Segments` runs the segments one after another, one onnxruntime session each; values that cross a
segment boundary stay on the device as ``OrtValue`` outputs of one run bound as inputs of the next, and are
dropped after the last segment reading them. The cost: onnxruntime optimises each segment on its own, so a
fusion across a boundary (``MatMul`` + ``Add`` into ``Gemm``, a shared constant folded once) is lost, and each
segment is one more session run (a few microseconds of fixed cost); bench/ddp.py measures both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import RevgraphError
from ...ir import Graph, Node, ValueInfo
from ...ir.inplace import captured


@dataclass
class Segment:
    """One piece of the grad graph: its ``graph`` (own inputs, initializers and outputs), the names it reads
    from outside (``inputs``: graph inputs or earlier segments' outputs), the names it writes that the grad
    graph outputs or later segments read (``outputs``), the buckets whose last gradient it produces
    (``buckets``) and the crossing values whose last reader it is (``release``)."""

    graph: Graph
    inputs: list[str]
    outputs: list[str]
    buckets: list[int] = field(default_factory=list)
    release: list[str] = field(default_factory=list)


def reads_of(node: Node) -> list[str]:
    """The names a node reads: its inputs and what its subgraphs capture from the enclosing graph."""
    names = [i for i in node.inputs if i]
    if node.subgraphs:
        names += sorted(captured(node))
    return names


#: Segments of fewer nodes join the next segment (:func:`cut`): each segment costs a session run and the
#: onnxruntime optimisations across its boundary, more than a few small nodes' head start is worth.
MIN_NODES = 8


def cut(graph: Graph, groups: list[list[str]], types: dict[str, ValueInfo] | None = None,
        min_nodes: int = MIN_NODES) -> list[Segment]:
    """The segments of ``graph`` (module doc) for ``groups``: lists of names (gradients, and with the last
    group whatever must be known when it is exchanged) in exchange order. ``types``: declared types of
    intermediate values that ``graph.value_info`` lacks. A segment of fewer than ``min_nodes`` nodes joins
    the next one (its buckets start after that one). Raises :class:`RevgraphError` when the graph writes a
    name twice (not SSA) or a crossing value has no known type; callers then run the graph uncut."""
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for o in node.outputs:
            if o:
                if o in producer:
                    raise RevgraphError(f"the grad graph writes {o!r} twice; it cannot be cut into segments")
                producer[o] = i
    owner = [-1] * len(graph.nodes)
    members: list[list[int]] = []
    for j, names in enumerate(groups):
        stack = [producer[n] for n in names if n in producer]
        mine = []
        while stack:
            i = stack.pop()
            if owner[i] != -1:
                continue
            owner[i] = j
            mine.append(i)
            stack.extend(producer[r] for r in reads_of(graph.nodes[i]) if r in producer and owner[producer[r]] == -1)
        members.append(sorted(mine))
    rest = [i for i, o in enumerate(owner) if o == -1]
    if rest:
        members.append(rest)
    # a bucket whose gradients an earlier segment already produced is ready at the end of that segment
    ready: list[list[int]] = [[] for _ in members]
    last_nonempty = None
    for j in range(len(groups)):
        if members[j]:
            last_nonempty = j
        ready[j if members[j] else (last_nonempty if last_nonempty is not None else 0)].append(j)
    keep = [j for j, m in enumerate(members) if m]
    if ready and not members[0] and keep:  # buckets ready before any node ran: at the end of the first segment
        ready[keep[0]] = sorted({*ready[keep[0]], *ready[0]})
    members, ready = [members[j] for j in keep], [ready[j] for j in keep]
    # a segment of a few nodes (a bias gradient's ReduceSum) is not worth a session run of its own: it joins
    # the next segment, and its buckets start with that one's
    j = 0
    while j < len(members) - 1:
        if len(members[j]) < min_nodes:
            members[j + 1] = sorted(members[j] + members[j + 1])
            ready[j + 1] = sorted(ready[j] + ready[j + 1])
            del members[j], ready[j]
        else:
            j += 1
    return segments_of(graph, members, ready, types or {})


def segments_of(graph: Graph, members: list[list[int]], ready: list[list[int]], types: dict) -> list[Segment]:
    """The :class:`Segment` of each list of node indices ``members`` (a partition of ``graph``'s nodes, each in graph
    order, the lists in running order; ``ready[s]``: the buckets that segment ``s`` finishes); ``types`` as
    :func:`cut`'s. Raises :class:`RevgraphError` when a crossing value has no known type."""
    where: dict[str, int] = {}  # value name -> the segment producing it
    for s, idx in enumerate(members):
        for i in idx:
            for o in graph.nodes[i].outputs:
                if o:
                    where[o] = s
    outside = set(graph.input_names)
    wanted = set(graph.output_names)
    reads = [[r for i in idx for r in reads_of(graph.nodes[i])] for idx in members]
    last_reader: dict[str, int] = {}
    for s, names in enumerate(reads):
        for r in names:
            if r in where and where[r] != s:
                last_reader[r] = s
    out = []
    for s, idx in enumerate(members):
        nodes = [graph.nodes[i] for i in idx]
        mine = {o for n in nodes for o in n.outputs if o}
        inputs = list(dict.fromkeys(r for r in reads[s] if r not in mine and (r in outside or r in where)))
        inits = {r: graph.initializers[r] for r in dict.fromkeys(reads[s]) if r not in mine and r in graph.initializers
                 and r not in outside}
        outputs = [o for n in nodes for o in n.outputs if o and (o in wanted or last_reader.get(o, -1) > s)]
        seg = Graph(nodes, [_type(graph, n, types) for n in inputs], [_type(graph, n, types) for n in outputs],
                    inits, {k: v for k, v in graph.value_info.items() if k in mine}, name=f"{graph.name}/segment{s}",
                    opsets=dict(graph.opsets))
        release = sorted(n for n, last in last_reader.items() if last == s)
        out.append(Segment(seg, inputs, outputs, ready[s], release))
    return out


def _type(graph: Graph, name: str, types: dict) -> ValueInfo:
    vi = graph.type_of(name) or types.get(name)
    if vi is None or vi.dtype is None:
        raise RevgraphError(f"the type of {name!r} in the grad graph is unknown; it cannot cross a segment boundary")
    return ValueInfo(name, vi.dtype, vi.shape, vi.kind)


def inferred_types(graph: Graph) -> dict[str, ValueInfo]:
    """Types of ``graph``'s intermediate values from ONNX shape inference (for those ``value_info`` lacks)."""
    import onnx

    from ...onnx_io import to_onnx, value_info_from_proto

    try:
        model = onnx.shape_inference.infer_shapes(to_onnx(graph))
    except Exception:  # noqa: BLE001 - inference is a help: no types without it
        return {}
    return {vi.name: value_info_from_proto(vi) for vi in model.graph.value_info}


def check_cut(graph: Graph, segments: list[Segment]) -> None:
    """Raise :class:`AssertionError` unless every node of ``graph`` is in exactly one segment and every name a
    segment reads is a graph input, an initializer, produced inside it, or an output of an earlier segment."""
    seen = [id(n) for s in segments for n in s.graph.nodes]
    assert sorted(seen) == sorted(id(n) for n in graph.nodes) and len(set(seen)) == len(seen), "nodes lost or doubled"
    available = set(graph.input_names) | set(graph.initializers)
    for k, s in enumerate(segments):
        local = set(available) | set(s.graph.initializers)
        for n in s.graph.nodes:
            missing = [r for r in reads_of(n) if r not in local]
            assert not missing, f"segment {k}: {n.label()} reads {missing} before it is produced"
            local.update(o for o in n.outputs if o)
        assert set(s.inputs) <= available, f"segment {k} reads {set(s.inputs) - available} from nowhere"
        available |= set(s.outputs)
    assert set(graph.output_names) <= available, "a graph output is produced by no segment"


def run_bound(session, inputs, outputs, value, into: dict, device, what: str = "the gradient step failed") -> list:
    """Run ``session`` through an IO binding: each of ``inputs`` from ``value(name)`` (a host ``np.ndarray``,
    bound as a CPU input, or an ``OrtValue``), each of ``outputs`` into ``into[name]`` (an ``OrtValue``) where
    ``into`` has it, else allocated by onnxruntime on ``device``. Returns every output's ``OrtValue``, in the
    order of ``outputs``. Raises :class:`RevgraphError` ``"<what>: <onnxruntime's first line>"`` when the run
    fails. The one binding loop of the segmented engines (this module, ZeRO-2/3, SyncBatchNorm's stages)."""
    from ...runtime import _first_line

    binding = session.io_binding()
    for name in inputs:
        v = value(name)
        if isinstance(v, np.ndarray):
            binding.bind_cpu_input(name, v)
        else:
            binding.bind_ortvalue_input(name, v)
    for name in outputs:
        if name in into:
            binding.bind_ortvalue_output(name, into[name])
        else:
            binding.bind_output(name, device.ort_type, device.index)
    try:
        session.run_with_iobinding(binding)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
        raise RevgraphError(f"{what}: {_first_line(exc)}") from None
    return binding.get_outputs()


class Segments:
    """Run ``segments`` (:func:`cut`) of a graph with outputs ``outputs`` as one onnxruntime session each
    (``make_session(graph, what)``), on ``device`` (:class:`revgraph.runtime.devices.Device`)."""

    def __init__(self, segments: list[Segment], outputs: list[str], make_session, device):
        self.segments, self.device, self.wanted = segments, device, set(outputs)
        self.sessions = [make_session(s.graph, f"gradient graph segment {k}") for k, s in enumerate(segments)]

    def run(self, values: dict, feeds: dict[str, np.ndarray], into: dict, after, times=None) -> dict:
        """Run every segment: ``values`` holds ``OrtValue`` inputs by name (parameters), ``feeds`` host arrays
        (the batch), ``into`` the ``OrtValue`` buffers that outputs of those names are written to (dense
        gradients, the loss); other outputs are allocated by onnxruntime on the device. ``after(k, segment,
        outputs)`` is called when segment ``k`` has finished (``outputs``: the grad graph outputs not in
        ``into`` produced so far). ``times``: a :class:`revgraph.train.steptimes.StepTimes` recording each run.
        Returns the grad graph outputs not in ``into`` (sparse gradients), by name. Raises
        :class:`RevgraphError` (one line) when a run fails."""
        import onnxruntime as ort

        live = {n: ort.OrtValue.ortvalue_from_numpy(a, self.device.ort_type, self.device.index)
                for n, a in feeds.items()}  # once on the device, however many segments read it
        live.update(values)
        fresh = {}
        for k, (seg, sess) in enumerate(zip(self.segments, self.sessions, strict=True)):
            start = times.now() if times is not None else 0.0
            outs = run_bound(sess, seg.inputs, seg.outputs, live.__getitem__, into, self.device)
            if times is not None:
                times.event("segment", f"segment {k}", start)
            for name, v in zip(seg.outputs, outs, strict=True):
                live[name] = v  # (a later segment may read it too)
                if name not in into and name in self.wanted:
                    fresh[name] = v
            for name in seg.release:  # its last reader has run: free it now
                live.pop(name, None)
            after(k, seg, fresh)
        return fresh
