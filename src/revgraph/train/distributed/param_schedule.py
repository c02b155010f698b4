"""The schedule of a parameter-sharded step (ZeRO-3, :mod:`revgraph.train.distributed.param_sharding`): the grad graph
(forward and backward, one topologically ordered node list) cut into segments by the parameter units they read,
and for each segment which units to all-gather before it, which to prefetch while it runs, which gather buffer
holds each, and which units' gradients are complete after it (to reduce-scatter at once).

The cut (:func:`schedule`) walks the nodes in graph order and starts a new segment when a node reads a parameter of a
unit the current segment does not read and the segment already reads ``width`` units; so the forward runs unit by
unit in the order the units are first read, and the backward in about the reverse order. A segment of fewer than
:data:`revgraph.train.distributed.overlap.MIN_NODES` nodes joins the next when the two read at most ``width`` units
together (a session run costs more than a few small nodes' head start). The segments' graphs, inputs, outputs and
the values each one releases come from :func:`revgraph.train.distributed.overlap.segments_of`, as for the overlapped
exchange.

Gather buffers (:attr:`Schedule.slots`): while segment ``s`` runs, the units it reads and, prefetched, those segment
``s + 1`` reads are held, each in a buffer of the largest unit's bytes; a unit no longer read by the next segment
is freed (its buffer reused) after ``s``. The assignment is static (decided here, once), so each segment binds the
same parameter views every step; the buffers needed are the most units held at once, ``max |R(s) ∪ R(s + 1)|``,
typically two or three. A unit read again later (a tied embedding, the backward's reads of the forward's weights)
is gathered again then, as FSDP2 re-gathers for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import RevgraphError
from ...ir import Graph
from .overlap import MIN_NODES, Segment, inferred_types, reads_of, segments_of


@dataclass
class Stage:
    """One segment of the schedule: ``segment`` (:class:`revgraph.train.distributed.overlap.Segment`), the units it
    reads (``units``) and the gather buffer of each (``slots``: unit -> buffer), the units to gather before it
    runs that no earlier stage prefetched (``gather``), those of the next stage to start gathering before it runs
    (``prefetch``: they arrive while it computes) and the units whose gradients are complete after it
    (``reduce``)."""

    segment: Segment
    units: list[int]
    slots: dict[int, int]
    gather: list[int] = field(default_factory=list)
    prefetch: list[int] = field(default_factory=list)
    reduce: list[int] = field(default_factory=list)


@dataclass
class Schedule:
    """The stages in running order, the number of gather buffers (``slots``) and of unit gathers per
    micro-batch (``gathers``)."""

    stages: list[Stage]
    slots: int
    gathers: int


def cut_by_units(graph: Graph, units: list[list[str]], width: int = 1, min_nodes: int = MIN_NODES) -> list[list[int]]:
    """The node indices of each segment of ``graph`` (module doc): a new segment where a node reads a parameter of
    a unit (``units``: parameter names per unit) the current segment does not read while it reads ``width``
    already; a segment of fewer than ``min_nodes`` nodes joins the next if together they read at most ``width``
    units."""
    unit_of = {p: j for j, names in enumerate(units) for p in names}
    members: list[list[int]] = []
    reading: list[set[int]] = []
    for k, node in enumerate(graph.nodes):
        mine = {unit_of[r] for r in reads_of(node) if r in unit_of}
        if not members or (mine and not mine <= reading[-1] and len(reading[-1] | mine) > width):
            members.append([])
            reading.append(set())
        members[-1].append(k)
        reading[-1] |= mine
    j = 0
    while j < len(members) - 1:  # (iteratively: a small segment joins its successor, within the width)
        if len(members[j]) < min_nodes and len(reading[j] | reading[j + 1]) <= width:
            members[j + 1] = members[j] + members[j + 1]
            reading[j + 1] |= reading[j]
            del members[j], reading[j]
        else:
            j += 1
    return members


def schedule(graph: Graph, units: list[list[str]], grads: list[list[str]], width: int = 1,
             prefetch: bool = True, warn=None) -> Schedule:
    """The :class:`Schedule` of ``graph`` (a grad graph) for parameter ``units`` and their dense gradient names
    ``grads`` (the same nesting). ``prefetch``: gather the next stage's units while a stage runs (else just
    before it). When a value crossing a cut has no known type, the graph runs as one segment reading every unit
    (``warn(message)`` says so). Raises :class:`RevgraphError` when a gradient is computed by no node."""
    producer = {o: k for k, n in enumerate(graph.nodes) for o in n.outputs if o}
    missing = [g for gs in grads for g in gs if g not in producer]
    if missing:
        raise RevgraphError(f"the grad graph computes no {missing[0]!r} with a node; it cannot run parameter-sharded")
    members = cut_by_units(graph, units, width)
    ready: list[list[int]] = [[] for _ in members]
    try:
        try:
            segments = segments_of(graph, members, ready, {})
        except RevgraphError:
            segments = segments_of(graph, members, ready, inferred_types(graph))
    except RevgraphError as exc:
        if warn is not None:
            warn(f"--shard parameters gathers every unit at once for the whole step: {exc}")
        members = [list(range(len(graph.nodes)))]
        segments = segments_of(graph, members, [[]], {})
    seg_of = {k: s for s, idx in enumerate(members) for k in idx}
    unit_of = {p: j for j, names in enumerate(units) for p in names}
    reads = [sorted({unit_of[n] for n in seg.inputs if n in unit_of}) for seg in segments]
    done = [max(seg_of[producer[g]] for g in gs) if gs else 0 for gs in grads]
    stages = []
    held: dict[int, int] = {}  # unit -> buffer, before the stage runs
    most, gathers = 0, 0
    for s, seg in enumerate(segments):
        stage = Stage(seg, reads[s], {}, reduce=[j for j in range(len(units)) if done[j] == s])
        for j in reads[s]:
            if j not in held:
                held[j] = min(set(range(len(held) + 1)) - set(held.values()))
                stage.gather.append(j)
        nxt = reads[s + 1] if prefetch and s + 1 < len(segments) else []
        for j in nxt:
            if j not in held:
                held[j] = min(set(range(len(held) + 1)) - set(held.values()))
                stage.prefetch.append(j)
        stage.slots = {j: held[j] for j in reads[s]}
        most, gathers = max(most, len(held)), gathers + len(stage.gather) + len(stage.prefetch)
        following = set(reads[s + 1]) if s + 1 < len(segments) else set()
        held = {j: b for j, b in held.items() if j in following}
        stages.append(stage)
    return Schedule(stages, most, gathers)
