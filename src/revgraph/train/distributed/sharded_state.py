"""The state of sharded data-parallel training as full arrays (:class:`ShardedState`, a part of
:class:`revgraph.train.distributed.sharding.ShardedEngine`): reads gather the shards (a collective), loads keep the
rank's shard, and :meth:`ShardedState.held` counts the bytes of the buffers the engine keeps."""

from __future__ import annotations

import numpy as np

from ...errors import RevgraphError
from .data_parallel import collective
from .exchange import read_from
from .shard_plan import Unit
from .swap import all_gather_tensor


class ShardedState:
    """Reading, loading and counting the units of a :class:`~revgraph.train.distributed.sharding.ShardedEngine`
    (``units``, ``_where``: each name's unit, slot and offset, ``_tensors``: the replicated values, ``comm``)."""

    def read(self, names, root_only: bool = False) -> dict[str, np.ndarray]:
        """Full host copies of ``names``; optimizer state of the units is all-gathered (a collective: every
        rank calls it with the same names), one unit and slot at a time, so that besides the copies returned
        at most one unit's full state exists at once. ``root_only``: ranks other than 0 take part in the
        collectives but keep no copy and return ``{}`` (a checkpoint, which rank 0 writes)."""
        if root_only and self.comm.rank != 0:
            for (j, slot) in sorted({self._where[n][:2] for n in names if n in self._where and
                                     self._sharded(self._where[n][1])}, key=_slot_order):
                self._gather(self.units[j], slot)
            return {}
        out, wanted = {}, {}
        for n in names:
            if n not in self._where:
                out[n] = (self._tensors[n].cpu().numpy().copy() if n in self._tensors
                          else np.array(self.value(n).numpy()))
                continue
            j, slot, o = self._where[n]
            wanted.setdefault((j, slot), []).append((n, o))
        for (j, slot), items in sorted(wanted.items(), key=lambda kv: _slot_order(kv[0])):
            u = self.units[j]
            flat = self._gather(u, slot) if self._sharded(slot) else u.param
            for n, o in items:
                shape = u.shapes[u.offsets.index(o)]
                out[n] = flat[o:o + int(np.prod(shape, dtype=np.int64))].reshape(shape).cpu().numpy().copy()
            del flat
        return {n: out[n] for n in names}

    def _sharded(self, slot: int | None) -> bool:
        """Whether values of ``slot`` (``None``: the parameters) exist only as shards (read gathers them)."""
        return slot is not None

    def _gather(self, u: Unit, slot: int | None):
        """Unit ``u``'s full flat values of ``slot`` (``None``: parameters), all-gathered from the shards."""
        shard = self._own(u) if slot is None else u.state[slot]
        flat = self.comm.torch.empty(u.length, dtype=shard.dtype, device=shard.device)
        with collective("an all-gather of the optimizer state" if slot is not None else "a parameter all-gather"):
            all_gather_tensor(self.comm.dist)(flat, shard)
        return flat

    def load(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite parameters, state and step with full host arrays; each rank keeps its shard of the state.
        Raises :class:`RevgraphError` for an unknown name or an array of another dtype or shape."""
        torch = self.comm.torch
        for name, arr in values.items():
            a = np.asarray(arr)
            if name not in self._where and name not in self._tensors:
                raise RevgraphError(f"{name!r} is not a parameter, optimizer state or step of this training run")
            like = self._tensors.get(name)
            shape, dtype = (tuple(like.shape), like.cpu().numpy().dtype) if like is not None else (None, None)
            if like is None:
                j, slot, o = self._where[name]
                u = self.units[j]
                p = u.names[u.offsets.index(o)]
                shape, dtype = self.spec.initial[p].shape, self.spec.initial[p].dtype
            if tuple(a.shape) != tuple(shape) or a.dtype != dtype:
                raise RevgraphError(f"{name!r} has shape {list(a.shape)} and dtype {a.dtype}; this training run "
                                    f"needs shape {list(shape)} and dtype {dtype}")
            src = read_from(torch, a).reshape(-1)
            if like is not None:
                like.copy_(src.reshape(like.shape))
                continue
            if not self._sharded(slot):
                u.param[o:o + src.numel()].copy_(src)
            else:
                into_shard(self._own(u) if slot is None else u.state[slot], u, o, src)

    def held(self) -> dict[str, int]:
        """Bytes of the device buffers kept from step to step, counted from the tensors: ``"parameters"``
        (the units, padding included, and the sparse tables), ``"optimizer"`` (the state shards and the
        sparse tables' state), ``"state"`` (those, the step and scratch, and values kept by ``keep_previous``),
        ``"gradients"`` (ZeRO-1: the unit gradients, reduce-scattered in place; ZeRO-2: the shards and the one
        bucket)
        and ``"gradients_peak"`` (``"gradients"`` plus the most bytes of gradients finished out of their
        unit's segment alive at once, :attr:`plan`; without a cut, every gradient)."""
        spec = self.spec
        params = sum(_nbytes(t) for t in self._held_parameters()) + sum(_nbytes(self._tensors[p]) for p in spec.sparse)
        opt = sum(_nbytes(t) for u in self.units for t in u.state)
        opt += sum(_nbytes(self._tensors[s]) for p in spec.sparse for s in spec.state[p])
        other = _nbytes(self._tensors[spec.step]) + sum(_nbytes(t) for t in self._update_scratch.values())
        other += sum(_nbytes(t) for _, t in self._previous or [])
        grads, peak = self._held_gradients()
        return {"state": params + opt + other, "parameters": params, "optimizer": opt, "gradients": grads,
                "gradients_peak": peak}

    def _held_parameters(self) -> list:
        """The parameter tensors :meth:`held` counts (ZeRO-1/2: the whole units, with the element after each that
        the pairwise exchange's loss may use, :mod:`.swap`)."""
        return [_allocated(u.param) for u in self.units]

    def _held_gradients(self) -> tuple[int, int]:
        """``(gradients, gradients_peak)`` of :meth:`held`."""
        if self.mode == "optimizer":  # (the shards are views of the unit gradients, each with its spare element)
            grads = sum(_nbytes(_allocated(u.grad)) for u in self.units)
        else:
            # (the last unit's shard is a view of the bucket: _base is not None)
            grads = sum(_nbytes(u.gshard) for u in self.units if u.gshard._base is None) + _nbytes(self.bucket)
        peak = grads
        if self.mode == "gradients":  # gradients alive inside a step, besides the bucket (the plan's count)
            peak += self.plan.carried_peak if self.plan else sum(u.used * u.gshard.element_size() for u in self.units)
        return grads, peak


def into_shard(shard, u: Unit, o: int, src) -> None:
    """Copy the part of the flat values ``src`` (unit ``u``'s elements ``[o, o + len)``; a tensor, or a numpy
    vector, of which only that part is copied) that falls in this rank's shard ``[u.lo, u.lo + u.k)`` into
    ``shard`` (a ``[k]`` tensor)."""
    lo, hi = max(o, u.lo), min(o + len(src), u.lo + u.k)
    if lo < hi:
        part = src[lo - o:hi - o]
        shard[lo - u.lo:hi - u.lo].copy_(shard.new_tensor(part) if isinstance(part, np.ndarray) else part)


def _slot_order(key: tuple) -> tuple:
    """``(unit, slot)`` in the order every rank gathers them (parameters, ``None``, first)."""
    return key[0], -1 if key[1] is None else key[1]


def _allocated(t):
    """The tensor ``t`` was made as a view of (its ``_base``), else ``t``."""
    return t._base if t._base is not None else t


def _nbytes(t) -> int:
    return t.numel() * t.element_size()
