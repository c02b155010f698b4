"""Which engine runs a :class:`revgraph.Trainer`'s steps, and the settings that pick it: :class:`EngineSettings`
and :func:`create_engine` (the one place an engine is created).

One process (or a world of one): :func:`revgraph.train.engines.make_engine` (the fused step graph, one or two buffer
sets). Data-parallel: :class:`~revgraph.train.distributed.data_parallel.data_parallel.DistributedEngine` (gradients
all-reduced between the backward and the update), its sharded form (ZeRO-1/2:
:mod:`revgraph.train.distributed.sharding`), or the synchronized-BatchNormalization engine
(:mod:`revgraph.train.distributed.sync_batchnorm_engine`). The settings are checked here before any graph is built, and
the data-parallel ranks compare them (:meth:`EngineSettings.agreement`) before any step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError, RevgraphError
from .distributed.exchange import BUCKET_MB, bucket_bytes, check_reduce_dtype, refused_combination
from .distributed.sharding import SHARDS
from .engines import BUFFERS, make_engine
from .offload import host_update, refused_offload


@dataclass
class EngineSettings:
    """How the steps run: ``buffers`` (``"one"``/``"two"``), the gradient exchange (``bucket_mb``,
    ``reduce_dtype``, ``overlap``: ``True``/``False``/``"auto"``), ``shard`` (``"none"``, ``"optimizer"``,
    ``"gradients"``), ``sync_batchnorm``, ``distributed`` and ``offload`` (``"none"``, ``"optimizer"``:
    :mod:`revgraph.train.offload`) (the Trainer's arguments of the same names).
    Raises :class:`RevgraphError` / :class:`InputError` (one line) for values out of range and combinations
    that are refused (:func:`revgraph.train.distributed.exchange.refused_combination`)."""

    buffers: str = "one"
    bucket_mb: float | None = None  # (None: BUCKET_MB; ZeRO-2: shard_plan.default_unit_groups)
    reduce_dtype: str = "fp32"
    overlap: bool | str = "auto"
    shard: str = "none"
    sync_batchnorm: bool = False
    distributed: bool = False
    offload: str = "none"

    def __post_init__(self) -> None:
        if self.buffers not in BUFFERS:
            raise RevgraphError(f"buffers must be one of {', '.join(BUFFERS)}, got {self.buffers!r}")
        # (checked in one process too: nothing to exchange there)
        self.bucket_bytes = None if self.bucket_mb is None else bucket_bytes(self.bucket_mb)
        check_reduce_dtype(self.reduce_dtype)
        if self.overlap not in (True, False, "auto"):
            raise InputError(f"overlap must be True, False or 'auto', got {self.overlap!r}")
        if self.shard not in SHARDS:
            raise RevgraphError(f"shard must be one of {', '.join(SHARDS)}, got {self.shard!r}")
        self.sync_batchnorm = bool(self.sync_batchnorm)
        problem = refused_offload(self.offload, self.buffers, self.shard, self.sync_batchnorm)
        if problem:
            raise InputError(problem)
        self.refuse()
        if self.shard != "none" and not self.distributed:
            raise RevgraphError(f"shard={self.shard!r} (--shard {self.shard}) shards across data-parallel processes: "
                                "train with distributed=True under torchrun (revgraph train --nproc N), "
                                "or leave it out")

    def refuse(self, accumulate: int = 1, precision: str = "fp32", world_size: int | None = None) -> None:
        """Raise :class:`InputError` for a combination of these settings with ``accumulate`` micro-batches,
        ``precision`` and ``world_size`` processes that is not available."""
        problem = refused_combination(self.shard, self.sync_batchnorm, self.reduce_dtype, accumulate, self.buffers,
                                      **({"precision": precision, "world_size": world_size} if world_size else {}))
        if problem:
            raise InputError(problem)

    def resolve_overlap(self, device_kind: str) -> bool:
        """``overlap`` with ``"auto"`` decided: on GPUs, where NCCL moves the bytes beside the compute; not on
        the CPU, where gloo's thread sums and copies on the cores the next segment needs (measured slower:
        docs/benchmarks.md)."""
        self.overlap = device_kind == "cuda" if self.overlap == "auto" else bool(self.overlap)
        return self.overlap

    def agreement(self) -> dict:
        """What every data-parallel rank must agree on besides the training graph's record: other buckets or
        dtypes on some rank would pair collectives of different sizes."""
        return {"buffers": self.buffers, "shard": self.shard, "sync batchnorm": self.sync_batchnorm,
                "bucket MiB": None if self.bucket_mb is None else float(self.bucket_mb),
                "reduce dtype": self.reduce_dtype, "overlap": self.overlap,
                "offload": self.offload}


def create_engine(spec, settings: EngineSettings, threads: int, device, runtime, comm=None, synced=None):
    """The engine that runs ``spec``'s steps (module doc) on ``device`` with onnxruntime's ``threads`` and
    ``runtime`` options; ``comm`` the data-parallel
    :class:`~revgraph.train.distributed.data_parallel.data_parallel.Collective` (or ``None``), ``synced`` the
    synchronized-BatchNormalization rewrite (:func:`revgraph.train.distributed.sync_batchnorm.synchronized`). Raises
    :class:`InputError` for ZeRO sharding of a model with training-mode BatchNormalization."""
    exchange = {"bucket_mb": BUCKET_MB if settings.bucket_mb is None else settings.bucket_mb,
                "reduce_dtype": settings.reduce_dtype, "overlap": settings.overlap}
    one_set = settings.buffers == "one"
    offload = host_update(settings.offload, spec, device)  # (None without offload, and on a CPU device)
    if synced:
        from .distributed.sync_batchnorm_engine import SyncBatchNormEngine

        return SyncBatchNormEngine(spec, threads, device, comm, synced, runtime, one_set=one_set, **exchange)
    if comm and comm.world_size > 1 and settings.shard != "none":
        from .distributed.sharding import ShardedEngine
        from .distributed.sync_batchnorm import running_statistics

        if running_statistics(spec.model, spec.params):
            raise InputError(f"--shard {settings.shard} (shard=) is not available for a model with training-mode "
                             "BatchNormalization: train unsharded (with --sync-batchnorm)")
        if settings.shard == "parameters":
            from .distributed.param_sharding import ParameterShardedEngine

            return ParameterShardedEngine(spec, threads, device, comm, runtime, bucket_bytes=settings.bucket_bytes,
                                          reduce_dtype=settings.reduce_dtype)
        sharded = {"mode": settings.shard, "bucket_bytes": settings.bucket_bytes, "reduce_dtype": settings.reduce_dtype}
        if offload is not None:  # (ZeRO-Offload: revgraph.train.offload_sharded)
            from .offload_sharded import OffloadedShardedEngine

            return OffloadedShardedEngine(spec, threads, device, comm, runtime, offload=offload, **sharded)
        return ShardedEngine(spec, threads, device, comm, runtime, **sharded)
    if comm and comm.world_size > 1:
        from .distributed.data_parallel import DistributedEngine
        from .distributed.sync_batchnorm_engine import engine_class

        return engine_class(spec, DistributedEngine)(spec, threads, device, comm, runtime, one_set=one_set, **exchange,
                                                     offload=offload)
    # one process (also a world of one, where there is nothing to exchange or shard)
    return make_engine(spec, threads, device, runtime, settings.buffers, offload)
