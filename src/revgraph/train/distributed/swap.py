"""The exchanges of ZeRO-1/2 (:mod:`revgraph.train.distributed.sharding`): the gradient reduce-scatter and the
parameter all-gather, on the CPU sent pairwise and received into memory the step does not read at that moment.

Why pairwise: on gloo a collective costs more than the same bytes sent between pairs. Measured on this project's
2-core machine at 2 processes (``bench/gloo_collectives.py``, median and mean ms per call): 4.5 MB, ``all_reduce``
2.57 and 3.54, ``reduce_scatter_tensor`` 4.85 and 5.18, ``all_gather_into_tensor`` 1.75 and 2.57, a swap of half of
it each way by one ``all_to_all_single`` 1.05 and 1.81; 19 KB, 0.29 and 1.82, 3.41 and 2.71, 0.18 and 1.17, 0.15
and 0.38. Sharded training used to all-reduce each unit (gloo's reduce-scatter costs more) and then all-gather the
parameters: two collectives a step against the unsharded engine's one, and ZeRO-2 took 1.0-1.8x unsharded's time
per sample on the bench models (issue 43, item 6; docs/benchmarks.md). Sent pairwise, the
reduce-scatter and the all-gather together move the bytes of one all-reduce (a ring all-reduce is a reduce-scatter
and an all-gather) at about its cost. With one peer each exchange is one ``all_to_all_single`` (a send and a receive
in one call: per call, not per byte, is what small models pay), and the last unit carries the two ranks' losses in
the same call (:func:`reduce_scatter_and_loss`), so a step makes two calls where unsharded training makes one
all-reduce; with more peers, ``isend``/``irecv`` per peer, the losses in messages of their own. The all-gather is
left in flight when the step returns, and waited for when something next needs the parameters (:class:`Settling`):
its latency overlaps the trainer's work between steps (on the RNN bench model, whose step computes least, that
made the second call's cost disappear: docs/benchmarks.md).

Where the reduce-scatter receives (:func:`receivers`): rank ``r`` receives from each peer ``j`` its gradient of chunk
``r`` of the unit (``k`` elements), ``W - 1`` chunks in all. The unit's parameter chunks ``j != r`` have exactly that
size, and nothing reads them between the last graph that reads the unit's parameters and the all-gather that
overwrites them with the peers' new shards; so they are the receive buffers, and the exchange needs no memory
beyond the unsharded engine's. That holds for every unit after one grad graph run (ZeRO-1, or ZeRO-2 uncut), and
for the ZeRO-2 unit no later segment of the backward reads (its last: a deeper layer's weights are read by the
next segment, for the input's gradient). Otherwise, with one peer, the gradient shard (``k`` elements, apart from the
bucket) receives; with more, the unit is all-reduced in place. Until the all-gather ran, parameter chunks may hold
gradients: a step that is not applied (a non-finite loss) or undone gathers the parameters again.

Every rank posts its sends and receives in the same order and tags them by unit, so that gloo pairs them; the sum
of a shard is taken by its owner alone, and the all-gather hands every rank the owner's result, so every rank
holds the same parameters.
"""

from __future__ import annotations

import functools
import inspect


class Settling:
    """A part of :class:`~revgraph.train.distributed.sharding.ShardedEngine`: every public method of the class and
    its subclasses, inherited or not, first calls ``settle`` (which waits for the parameter all-gather a step left
    in flight). Why every one: a step's all-gather is waited for only when something next needs the parameters,
    so that its latency overlaps what the trainer does between steps (slicing the next batch, the step's
    bookkeeping); whatever reads them (the next step, a read, a load, an evaluation, an undo) must wait for it
    first, and a method added later waits without anyone having to remember it."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in dir(cls):
            fn = inspect.getattr_static(cls, name)
            if name.startswith("_") or name == "settle" or not inspect.isfunction(fn) or hasattr(fn, "settles"):
                continue
            setattr(cls, name, _settling(fn))

    def settle(self) -> None:
        """Wait for work left in flight (the subclass's)."""


def _settling(fn):
    @functools.wraps(fn)
    def settled(self, *args, **kwargs):
        if getattr(self, "_gathering", None):
            self.settle()
        return fn(self, *args, **kwargs)

    settled.settles = True
    return settled


class Exchange:
    """Work in flight; :meth:`wait` waits for all of it, then runs ``finish`` (a shard's sum), whose value it keeps
    in :attr:`result`."""

    def __init__(self, works: list, finish=None):
        self._works, self._finish = works, finish
        self.result = None

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        if self._finish is not None:
            self.result = self._finish()


def _swap(dist, out, send, peer: int, tag: int) -> list:
    """Send ``send`` to ``peer`` and receive its ``out`` (the same size): with one peer one ``all_to_all_single``,
    else a tagged ``isend`` and ``irecv``. Returns the works."""
    if dist.get_world_size() == 2:
        sizes = [0, 0]
        sizes[peer] = out.numel()
        return [dist.all_to_all_single(out, send, sizes, sizes, async_op=True)]
    return [dist.isend(send, peer, tag=tag), dist.irecv(out, peer, tag=tag)]


def reduce_scatter(dist, flat, receive: dict, shard, rank: int, k: int, tag: int, losses=None) -> Exchange:
    """Start the sum over the ranks of chunk ``rank`` of ``flat`` into ``shard`` (module doc).

    ``flat``: this rank's ``[world * k]`` gradient of a unit; ``receive``: for each peer ``j``, the ``[k]`` tensor its
    chunk ``rank`` lands in (:func:`receivers`); ``shard``: ``[k]``, the result (it may be ``flat``'s own chunk or a
    ``receive`` tensor). ``losses``: ``None``, or a float64 ``[world]`` tensor whose element ``rank`` is sent to every
    peer and whose other elements receive theirs. ``tag``: the unit's index (tags ``2 * tag`` and ``2 * tag + 1``).
    Returns the work; its ``wait`` leaves the sum in ``shard``. Errors are ``torch.distributed``'s (the caller names
    the exchange)."""
    works = []
    for j, into in receive.items():
        works += _swap(dist, into, flat[j * k:(j + 1) * k], j, 2 * tag)
        if losses is not None:
            works += _swap(dist, losses[j:j + 1], losses[rank:rank + 1], j, 2 * tag + 1)

    def finish() -> None:
        mine = flat[rank * k:(rank + 1) * k]
        parts = [receive[j] for j in sorted(receive)]
        if any(p.data_ptr() == shard.data_ptr() for p in parts):  # received into the shard: add this rank's
            shard.add_(mine)
        elif shard.data_ptr() != mine.data_ptr():
            shard.copy_(mine)
        for p in parts:
            if p.data_ptr() != shard.data_ptr():
                shard.add_(p)

    return Exchange(works, finish)


def reduce_scatter_and_loss(dist, flat_ext, param_ext, shard, rank: int, k: int, loss: float) -> Exchange:
    """With one peer: the reduce-scatter of a unit whose parameter chunks receive (:func:`reduce_scatter`) and the
    sum of the two ranks' losses, in ONE ``all_to_all_single`` (per call, not per byte, is what small models pay).

    ``flat_ext`` and ``param_ext``: ``[2k + 1]``, the unit's gradient and parameters and one element after each.
    Each rank sends the peer's chunk and one more element holding its ``loss``; it receives into the peer's
    parameter chunk and one more element. For rank 0 the element after the peer's chunk is the one after the unit;
    for rank 1 it is the first of its own chunk (of the gradient and of the parameters), kept aside and written
    back when the exchange is done. The losses travel in the gradient's dtype; both ranks sum the same two rounded
    values in rank order. Returns the work; after its ``wait``, ``shard`` holds the sum and the work's ``result`` is
    the losses' sum."""
    peer = 1 - rank
    send, recv = flat_ext[peer * k:peer * k + k + 1], param_ext[peer * k:peer * k + k + 1]
    kept = send[k].clone(), recv[k].clone()
    send[k] = loss
    mine = float(send[k])  # (rounded as the peer receives it)
    works = _swap(dist, recv, send, peer, 0)  # (one peer: one all_to_all_single)

    def finish() -> float:
        theirs = float(recv[k])
        send[k], recv[k] = kept
        own = flat_ext[rank * k:(rank + 1) * k]
        if shard.data_ptr() != own.data_ptr():
            shard.copy_(own)
        shard.add_(recv[:k])
        return mine + theirs if rank == 0 else theirs + mine

    return Exchange(works, finish)


def all_gather(dist, param, rank: int, world: int, k: int, tag: int) -> Exchange:
    """Start sending chunk ``rank`` of ``param`` (``[world * k]``, a unit's parameters) to every peer and receiving
    each peer's chunk into its place (tag ``2 * tag``: pass one above the reduce-scatters' unit indices). Returns
    the work."""
    works = []
    for j in range(world):
        if j != rank:
            works += _swap(dist, param[j * k:(j + 1) * k], param[rank * k:(rank + 1) * k], j, 2 * tag)
    return Exchange(works)


def receivers(u, rank: int, world: int, plan, j: int, bucket) -> dict | None:
    """Where unit ``u`` (the ``j``-th, :class:`~revgraph.train.distributed.shard_plan.Unit`) receives its peers'
    chunks in :func:`reduce_scatter` (module doc): its parameter chunks of the other ranks when no graph reads its
    parameters after its reduction (``plan``, the ZeRO-2 segments, is ``None``: one grad graph run; or no segment
    after the one that reduces it reads them), else with one peer its gradient shard when apart from ``bucket``;
    ``None``: all-reduce it."""
    if plan is not None:
        reduced = next(s for s, seg in enumerate(plan.segments) if j in seg.reduce)
        later = {n for seg in plan.segments[reduced + 1:] for n in seg.inputs}
        if later.intersection(u.names):
            apart = u.gshard.untyped_storage().data_ptr() != bucket.untyped_storage().data_ptr()
            return {1 - rank: u.gshard} if world == 2 and apart else None
    return {i: u.param[i * u.k:(i + 1) * u.k] for i in range(world) if i != rank}


def reduce_scatter_tensor(dist):
    """``reduce_scatter_tensor`` under its current name (torch 2.13 renamed it ``reduce_scatter_single``)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_tensor(dist):
    """``all_gather_into_tensor`` under its current name (torch 2.13: ``all_gather_single``)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
