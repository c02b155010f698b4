"""``--offload optimizer`` with ``--shard optimizer|gradients``: ZeRO-1/2 whose optimizer state and update are in
host memory, ZeRO-Offload's layout (Ren et al., 2021: ZeRO-2 with the fp32 master weights, Adam's moments and the
update on the CPU).

:class:`OffloadedShardedEngine` is :class:`revgraph.train.distributed.sharding.ShardedEngine` with its hooks
turned to the host: the rank's shard of the optimizer state of every unit (Adam's ``m`` and ``v``, ``P / W`` each),
the sparse tables' state and the step are host tensors (pinned on CUDA); the update graph runs in a CPU
onnxruntime session on host copies of the rank's parameter shards (the fp32 master copy) and of its gradient
shards (and of the clipping norm's sum of squares). A step: the backward and the reduce-scatter on the device as
unsharded by offload; the gradient shards and the parameter shards copied to the host; the update; the new
parameter shards copied back into their units, which the all-gather then spreads to every rank. The device keeps
the full parameters and the gradients (ZeRO-1) or their shards and one bucket (ZeRO-2), no optimizer state.

Reads and checkpoints are the sharded engine's: the state shards are all-gathered (through a device copy on
NCCL, which gathers device tensors only). On the CPU it runs when forced (:data:`revgraph.train.offload.FORCE_ENV`),
for the tests.
"""

from __future__ import annotations

from .distributed.data_parallel import collective
from .distributed.sharded_state import _nbytes
from .distributed.sharding import ShardedEngine
from .distributed.swap import all_gather_tensor
from .offload import HostUpdate, host_values


class OffloadedShardedEngine(ShardedEngine):
    """ZeRO-1/2 with the optimizer offloaded (module doc); the arguments of :class:`ShardedEngine`, and
    ``offload``: the :class:`~revgraph.train.offload.HostUpdate` whose home (pinned or not) holds the host tensors.
    :meth:`held` counts the device's bytes as the sharded engine does and adds ``"host_state"`` (state, step and
    the update's host copies); ``"optimizer"`` on the device is 0."""

    def __init__(self, *args, offload: HostUpdate, **kwargs):
        self.host = offload
        self._pairs: list = []  # (device tensor, its host copy, copied back after the update)
        super().__init__(*args, **kwargs)

    def _state_zeros(self, shape, dtype):
        t = self.comm.torch.zeros(shape, dtype=dtype)  # (host memory)
        return t.pin_memory() if self.host.home.pinned else t

    def _for_update(self, t, back: bool = False):
        h = self._state_zeros(tuple(t.shape), t.dtype)
        h.copy_(t)
        self._pairs.append((t, h, back))
        return h

    def _build_update(self, home=None) -> None:
        super()._build_update(self.host.home)

    def _copy_for_update(self, down: bool) -> None:
        for t, h, back in self._pairs:
            if down:
                h.copy_(t)  # (the gradient shards, the parameter shards, the norm's squares: to the host)
            elif back:
                t.copy_(h)

    def _exchange_rows(self) -> dict:
        return host_values(super()._exchange_rows())  # (the sparse rows: inputs of the host's update)

    def _gather(self, u, slot):
        if slot is None or self.device.kind != "cuda":
            return super()._gather(u, slot)
        shard = u.state[slot].to(self.comm.tdevice)  # NCCL gathers device tensors: one shard at a time on the GPU
        flat = self.comm.torch.empty(u.length, dtype=shard.dtype, device=self.comm.tdevice)
        with collective("an all-gather of the optimizer state"):
            all_gather_tensor(self.comm.dist)(flat, shard)
        return flat

    def held(self) -> dict[str, int]:
        held = super().held()
        spec = self.spec
        # what the sharded engine counts in "state" and is in host memory here: state shards, the sparse tables'
        # state, the step, the scratch copies of host inputs
        home = sum(_nbytes(t) for u in self.units for t in u.state)
        home += sum(_nbytes(self._tensors[s]) for p in spec.sparse for s in spec.state[p])
        home += _nbytes(self._tensors[spec.step]) + sum(_nbytes(t) for t in self._update_scratch.values())
        copies = sum(_nbytes(h) for _, h, _ in self._pairs)
        return {**held, "state": held["state"] - home, "optimizer": 0, "host_state": home + copies}
