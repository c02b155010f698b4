"""The plan of sharded data-parallel training (:mod:`revgraph.train.distributed.sharding`): the flat units the dense
parameters are packed into (:class:`Unit`, :func:`plan_units`), the order the backward finishes their gradients
(:func:`ready_order`), and the update graph over one rank's shards (:func:`shard_update_graph`: the optimizer
formulas of :mod:`revgraph.train.optimizers` on flat vectors, with the schedule, clipping and weight-decay exclusions
of :mod:`revgraph.train.schedules`)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

from ...ir import Graph, ValueInfo
from ..graphbuild import Builder, name_outputs
from ..graphs import TrainingGraph
from ..optimizers import Scalars, sparse_update, update
from .exchange import bucket_groups


@dataclass
class Unit:
    """A flat unit of dense parameters of one ``dtype``: ``names`` at element ``offsets`` with ``shapes``;
    ``length`` elements (padded to a multiple of the world size), of which the rank owns ``[lo, lo + k)``.
    ``param`` is the flat parameter tensor, ``grad`` the flat gradient (ZeRO-1; ``None`` for ZeRO-2, whose
    gradients go through the shared bucket buffer), ``gshard`` the reduce-scattered gradient shard (ZeRO-1:
    the view ``grad[lo:lo + k]``, reduce-scattered in place as FSDP and NCCL allow) and
    ``state`` the optimizer state of the shard (one ``[k]`` tensor per slot)."""

    names: list[str]
    offsets: list[int]
    shapes: list[tuple]
    dtype: np.dtype
    length: int
    lo: int
    k: int
    param: object = None
    grad: object = None
    gshard: object = None
    state: list = field(default_factory=list)

    @property
    def used(self) -> int:
        """Elements holding parameters (the rest of ``length`` is zero padding)."""
        return self.offsets[-1] + int(np.prod(self.shapes[-1], dtype=np.int64))

    def views(self, flat) -> dict:
        """Each parameter's view (of its shape) into ``flat``, a tensor of at least :attr:`used` elements."""
        return {n: flat[o:o + int(np.prod(s, dtype=np.int64))].view(s)
                for n, o, s in zip(self.names, self.offsets, self.shapes, strict=True)}


def plan_units(spec: TrainingGraph, world: int, rank: int, bucket_bytes: int,
               order: list[str] | None = None, groups: list[list[str]] | None = None) -> list[Unit]:
    """The flat units of ``spec``'s dense parameters (module doc): in ``order`` (default: reverse parameter
    order, as DDP first buckets them), one dtype per unit, at most ``bucket_bytes`` each (a larger parameter is a
    unit of its own), padded to a multiple of ``world``; or, given, the parameter names of each unit (``groups``,
    one dtype each)."""
    if groups is None:
        order = order or list(reversed([p for p in spec.params if p not in spec.sparse]))
        groups = bucket_groups({p: spec.initial[p] for p in order}, order, bucket_bytes, in_order=True, first=None)
    units = []
    for names in groups:
        offsets, at = [], 0
        for p in names:
            offsets.append(at)
            at += spec.initial[p].size
        length = -(-max(at, 1) // world) * world
        k = length // world
        units.append(Unit(names, offsets, [spec.initial[p].shape for p in names], spec.initial[names[0]].dtype,
                          length, rank * k, k))
    return units


def zero2_gradient_bytes(units: list[Unit]) -> int:
    """Bytes of gradients ZeRO-2 keeps for ``units`` (in the order they are reduce-scattered): one bucket of the
    largest unit's bytes, the gradient shard (``k`` elements) of every unit but the last, and nothing for the last
    one, reduce-scattered in place in the bucket (its shard is a view of the bucket, which no later unit
    overwrites before the update reads it)."""
    size = [np.dtype(u.dtype).itemsize for u in units]
    return (sum(u.k * b for u, b in zip(units[:-1], size, strict=False))
            + max([u.length * b for u, b in zip(units, size, strict=True)] or [0]))


def carried_bytes(groups: list[list[str]], finish: dict[str, int], like: dict[str, np.ndarray]) -> int:
    """Bytes of the gradients that the cut of :mod:`revgraph.train.distributed.grad_segments` carries (kept apart
    from the bucket until their unit is reduced) for units ``groups``, ``finish[p]`` the index of the grad graph's
    node that writes ``p``'s gradient: those finished before their unit's segment, and every gradient of a unit
    that is not the first one its segment reduces (a ``Loop`` writing all gradients at once). An upper bound of
    their peak: all of them counted alive at once."""
    ends = sorted({max(finish[p] for p in g) for g in groups})
    first, total = {}, 0
    for j, g in enumerate(groups):
        s = bisect_left(ends, max(finish[p] for p in g))
        lead = first.setdefault(s, j) == j
        total += sum(like[p].nbytes for p in g if not (lead and bisect_left(ends, finish[p]) == s))
    return total


def default_unit_groups(spec: TrainingGraph, world: int, order: list[str], limit: int,
                        finish: dict[str, int]) -> list[list[str]]:
    """The parameter names of each ZeRO-2 unit when ``bucket_mb`` is not given (in ``order``, the order the backward
    finishes the gradients, ``finish`` as :func:`carried_bytes`): units that keep at most the bytes of all dense
    gradients, ``G``, which unsharded training holds (:func:`zero2_gradient_bytes`: about ``G / W`` of shards plus
    the largest unit, and :func:`carried_bytes`), and of those the
    fewest units (each is a segment of the backward and a collective), at most ``limit`` bytes each (a larger
    gradient is a unit of its own). Candidates: for each cap of ``limit``, ``limit / 2``, ... (down to 1 KiB) and
    each suffix of ``order`` no larger than ``limit``, the gradients packed up to the cap from the first one and
    from the last one (filling the last unit, reduced in place, first). When none keeps ``G`` or less (a gradient
    finished before the last unit that takes most of ``G``: the bucket must hold it whole), the candidate keeping
    the fewest bytes. A small model gets one unit: DDP's 25 MiB would hold more than all its gradients."""
    like = {p: spec.initial[p] for p in order}
    full = sum(a.nbytes for a in like.values())
    caps, cap = [], int(limit)
    while cap > 1024:
        caps.append(cap)
        cap //= 2
    suffix = 0
    for p in reversed(order):
        suffix += like[p].nbytes
        if suffix <= limit:
            caps.append(suffix)
    best = None
    for cap in [*caps, 1024]:
        backward = [list(reversed(g)) for g in reversed(bucket_groups(like, order[::-1], cap, in_order=True,
                                                                       first=None))]
        for groups in (bucket_groups(like, order, cap, in_order=True, first=None), backward):
            held = zero2_gradient_bytes(plan_units(spec, world, 0, cap, groups=groups))
            held += carried_bytes(groups, finish, like)
            key = (held > full, len(groups) if held <= full else held)
            if best is None or key < best[0]:
                best = (key, groups)
    return best[1]


def ready_order(grad_graph: Graph, spec: TrainingGraph) -> list[str]:
    """The dense parameters in the order the grad graph's nodes finish their gradients (ties, e.g. the gradients
    a ``Loop``'s backward writes together, in reverse parameter order)."""
    producer = {o: k for k, n in enumerate(grad_graph.nodes) for o in n.outputs if o}
    dense = list(reversed([p for p in spec.params if p not in spec.sparse]))
    return sorted(dense, key=lambda p: producer.get(spec.grads[p][0], -1))


def shard_update_graph(spec: TrainingGraph, units: list[Unit]) -> tuple[Graph, list[tuple[str, str]], dict]:
    """The update graph of a rank: the optimizer (:mod:`revgraph.train` formulas) over each unit's shard, the
    lazy row update of each sparse table (whole, replicated) and ``step + 1``.

    Returns ``(graph, carried pairs (input, output), names)``: unit ``j``'s inputs are ``names[j]`` =
    ``(param shard, gradient shard, [state shards])``, all float ``[k]`` of the unit's dtype; the sparse tables
    keep the names of ``spec`` (parameter, state, gradient indices and rows), the step and a schedule's total
    too. Weight decay skips the shard elements of excluded parameters (a mask,
    :func:`revgraph.train.schedules.flat_decay`). With
    clipping, ``names["clip"]`` is the float64 scalar input of the dense gradients' squared norm summed over
    every rank's shards (the sparse tables, replicated, add theirs in the graph): the clipping of
    :mod:`revgraph.train.schedules` over the whole model."""
    from ..schedules import clipped_shards, flat_decay

    b = Builder(spec.graph.names_in_use())
    opt = spec.optimizer
    scalars = Scalars(b, opt, spec.step, spec.total)
    inputs, outputs, pairs, names = [], [], [], {}
    slots = opt.slots
    for j in range(len(units)):
        p, g = b.fresh(f"shard{j}/param"), b.fresh(f"shard{j}/grad")
        names[j] = (p, g, [b.fresh(f"shard{j}/{s}") for s in slots])
    grads, rows = {j: names[j][1] for j in range(len(units))}, {p: spec.grads[p] for p in spec.sparse}
    if opt.clip_grad_norm:
        names["clip"] = b.fresh("clip/dense_squares")
        inputs.append(ValueInfo(names["clip"], np.float64, ()))
        grads, rows = clipped_shards(b, spec, names["clip"], grads, {j: u.dtype for j, u in enumerate(units)})
    for j, u in enumerate(units):
        p, g, state = names[j]
        inputs += [ValueInfo(n, u.dtype, (u.k,)) for n in (p, g, *state)]
        b.prefix, start = f"optim/shard{j}", len(b.nodes)
        new_p, new_s = update(b, scalars, p, grads[j], state, u.dtype, decay=flat_decay(u, spec.no_decay))
        news = name_outputs(b, start, [(new_p, f"{p}.new"),
                                       *((v, f"{s}.new") for s, v in zip(state, new_s, strict=True))])
        pairs += list(zip([p, *state], news, strict=True))
        outputs += [ValueInfo(n, u.dtype, (u.k,)) for n in news]
    for p in spec.sparse:
        a = spec.initial[p]
        idx, grad_rows = spec.grads[p]
        inputs += [ValueInfo(n, a.dtype, a.shape) for n in (p, *spec.state[p])]
        inputs += [spec.grad_types[idx], spec.grad_types[grad_rows]]
        b.prefix, start = f"optim/{p}", len(b.nodes)
        new_p, new_s = sparse_update(b, scalars, p, *rows[p], spec.state[p], a.dtype, unique=bool(opt.clip_grad_norm),
                                     decay=p not in spec.no_decay)
        news = name_outputs(b, start, [(new_p, f"{p}.new"), *((v, f"{s}.new") for s, v in zip(spec.state[p], new_s,
                                                                                         strict=True))])
        pairs += list(zip([p, *spec.state[p]], news, strict=True))
        outputs += [ValueInfo(n, a.dtype, a.shape) for n in news]
    b.prefix, start = "optim/step", len(b.nodes)
    new_step = name_outputs(b, start, [(b.op("Add", [spec.step, b.const(1, np.int64)]), f"{spec.step}.new")])[0]
    inputs.append(ValueInfo(spec.step, np.int64, ()))
    outputs.append(ValueInfo(new_step, np.int64, ()))
    pairs.append((spec.step, new_step))
    if spec.total:  # the schedule's total steps, carried unchanged
        start = len(b.nodes)
        new_total = name_outputs(b, start, [(spec.total, f"{spec.total}.new")])[0]
        inputs.append(ValueInfo(spec.total, np.int64, ()))
        outputs.append(ValueInfo(new_total, np.int64, ()))
        pairs.append((spec.total, new_total))
    graph = Graph(b.nodes, inputs, outputs, name="sharded update", opsets=dict(spec.graph.opsets))
    return graph, pairs, names
