"""Data-parallel training on PyTorch's distributed engine (``torch.distributed`` collectives under ``torchrun``).

Each process (rank) of a world of ``W`` processes holds a full copy of the parameters and the optimizer state
and trains on its share of every global batch (:func:`revgraph.trainer.shard`). A step is the fused step
graph cut in two (:func:`revgraph.train.split_step`):

1. the **grad graph** runs on the rank's ``n_r`` samples and writes the loss and the gradients (means over
   those samples);
2. the gradients are exchanged: every gradient is scaled by ``n_r / N`` (``N`` the global batch, the sum of
   the ``n_r``) and **dense** gradients are all-reduced (summed) in buckets of about 25 MiB (the default of
   ``torch.nn.parallel.DistributedDataParallel``), so each rank gets the mean gradient over the global batch,
   exact also when the last batch of an epoch does not split evenly. **Sparse** gradients of embedding tables
   (the ``(indices, rows)`` pairs of ``revgraph.gradient(..., sparse=True)``) are all-gathered as rows and
   concatenated in rank order, never densified (Caffe2's ``data_parallel_model`` exchanged them the same way);
3. the **update graph** applies the optimizer to the exchanged gradients. Its inputs are identical on every
   rank, so parameters and optimizer state stay identical (:meth:`Collective.check_replicas` verifies it).

Gradient buffers are torch tensors on the device that onnxruntime reads and writes in place through DLPack
(``OrtValue.from_dlpack``): no copies between the two. Backends: ``gloo`` on CPU, ``nccl`` on CUDA. torch is
imported only here, and this module only when ``distributed=True``.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .devices import Device, ortvalue_from_dlpack, torch_from_ortvalue
from .errors import RevgraphError
from .runtime import _first_line
from .runtime_options import RuntimeOptions
from .steps import SplitEngine
from .train import TrainingGraph

BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class CollectiveError(RevgraphError):
    """A collective failed: another rank died, stopped (``--timeout``) or cannot be reached. Unlike other
    :class:`RevgraphError` failures it is not deterministic, so it is not recorded against torchrun's restarts
    (:func:`revgraph.launch.record_failure`)."""


@contextmanager
def collective(what: str):
    """Turn a failed collective into a one-line :class:`CollectiveError`: it fails when another rank died or
    cannot be reached, or gave no answer within the process group's timeout (torchrun then stops this worker,
    and restarts all of them if ``--max-restarts`` allows)."""
    try:
        yield
    except RevgraphError:
        raise
    except Exception as exc:
        text = _first_line(exc)
        late = " within the timeout (--timeout, Trainer(timeout=))" if "timed out" in text.lower() else ""
        raise CollectiveError(f"{what} with the other training processes failed; one of them stopped or cannot be "
                              f"reached{late} ({text[:200]})") from None


def stale_store_on_restart() -> bool:
    """True when torchrun may restart the workers and shares its TCP store with them, the setting in which
    restarted gloo and NCCL groups may connect to the failed attempt's addresses (pytorch/pytorch#135712; seen
    with torch 2.13 under ``--standalone``, and always so with the static rendezvous, which cannot opt out)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    return restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def threads_per_process() -> int:
    """The machine's cores divided among the processes torchrun started on it (``LOCAL_WORLD_SIZE``), at
    least 1: onnxruntime's default of one thread per core in every process would oversubscribe the cores."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, (os.cpu_count() or 1) // max(local, 1))


def under_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (or another launcher that sets its variables)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise RevgraphError('distributed training needs PyTorch: pip install "revgraph[distributed]"') from None
    return torch, dist


class Collective:
    """The process group of this run: ``rank``, ``world_size`` and the collectives a training step needs.

    Joins the default ``torch.distributed`` process group, initialising it from torchrun's environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when nobody has: backend ``gloo`` for the CPU,
    ``nccl`` for CUDA, with ``timeout`` seconds (default :data:`revgraph.launch.DEFAULT_TIMEOUT`) for the join and
    every collective. Before joining, the worker is set to die with its torchrun agent and the loopback-hostname
    trap is checked (:mod:`revgraph.launch`). Raises :class:`RevgraphError` (one line) without torch, outside
    torchrun, for that trap, and :class:`CollectiveError` when the group cannot be joined in time.
    """

    def __init__(self, device: Device, timeout: float | None = None):
        from datetime import timedelta

        from .launch import DEFAULT_TIMEOUT, die_with_parent, network_problem

        torch, dist = _torch()
        self.torch, self.dist, self.device = torch, dist, device
        self.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        if not self.timeout > 0:
            raise RevgraphError(f"the timeout must be a positive number of seconds, got {timeout}")
        if not dist.is_initialized():
            if not under_torchrun():
                raise RevgraphError("distributed training runs under torchrun: torchrun --nproc-per-node N -m revgraph "
                                    "train ... (or revgraph train --nproc N); RANK, WORLD_SIZE, MASTER_ADDR and "
                                    "MASTER_PORT are not set")
            die_with_parent()  # a killed torchrun agent must not leave this worker training on
            backend = "nccl" if device.kind == "cuda" else "gloo"
            trap = network_problem(backend)  # before the first collective: it would fail or hang
            if trap:
                raise RevgraphError(trap)
            if device.kind == "cuda":
                torch.cuda.set_device(device.index)
            try:
                # the timeout bounds the join and every collective: a stopped peer fails the others in that time
                dist.init_process_group(backend=backend, timeout=timedelta(seconds=self.timeout))
            except Exception as exc:
                raise CollectiveError(f"cannot join the process group within {self.timeout:g} s (--timeout): "
                                      f"{_first_line(exc)[:300]}") from None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tdevice = torch.device(device.torch())
        if self.rank == 0 and stale_store_on_restart():
            warnings.warn("torchrun restarts workers (--max-restarts) but shares its rendezvous store with them: "
                          "restarted workers may read the addresses of the failed attempt and fail to connect "
                          "(pytorch/pytorch#135712); use the c10d rendezvous (--rdzv-backend c10d) with "
                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (revgraph train --nproc sets it)",
                          stacklevel=2)

    # ------------------------------------------------------------------------------------------ small values

    def sum(self, values) -> np.ndarray:
        """The element-wise sum over ranks of a float64 vector (losses, counts, correct answers)."""
        t = self.torch.tensor(np.asarray(values, dtype=np.float64), device=self.tdevice)
        with collective("an all-reduce"):
            self.dist.all_reduce(t)
        return t.cpu().numpy()

    def broadcast_arrays(self, arrays: dict[str, np.ndarray] | None, names: list[str], like: dict) -> dict:
        """Rank 0's ``arrays`` (of the dtypes and shapes of ``like``) on every rank, in the order of ``names``."""
        out = {}
        for n in names:
            ref = np.asarray(like[n])
            src = arrays[n] if self.rank == 0 else np.empty_like(ref)
            t = self.torch.from_numpy(np.array(src, order="C")).to(self.tdevice)  # (ascontiguousarray makes 0-d 1-d)
            with collective("a broadcast"):
                self.dist.broadcast(t, 0)
            out[n] = t.cpu().numpy()
        return out

    def broadcast_text(self, text: str | None) -> str | None:
        """Rank 0's ``text`` on every rank (a checkpoint's metadata)."""
        box = [text]
        with collective("a broadcast"):
            self.dist.broadcast_object_list(box, 0, device=self.tdevice if self.device.kind == "cuda" else None)
        return box[0]

    def check_replicas(self, arrays: dict[str, np.ndarray], what: str,
                       hint: str = "every rank must load the same model and run the same revgraph and onnxruntime "
                                   "versions") -> None:
        """Raise :class:`RevgraphError` (``"the <what> of rank r differ from rank 0's; <hint>"``) unless
        ``arrays`` are bitwise identical on every rank (SHA-256 of their names, dtypes, shapes and bytes,
        compared through one all-gather)."""
        h = hashlib.sha256()
        for name in sorted(arrays):
            a = np.asarray(arrays[name])
            h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
        mine = self.torch.tensor(list(h.digest()), dtype=self.torch.uint8, device=self.tdevice)
        every = [self.torch.empty_like(mine) for _ in range(self.world_size)]
        with collective("an all-gather"):
            self.dist.all_gather(every, mine)
        bad = [r for r, d in enumerate(every) if not self.torch.equal(d, every[0])]
        if bad:
            raise RevgraphError(f"the {what} of rank {bad[0]} differ from rank 0's; {hint}")

    def gather_objects(self, value) -> list:
        """Every rank's ``value`` (picklable), in rank order."""
        every = [None] * self.world_size
        with collective("an all-gather"):
            self.dist.all_gather_object(every, value)
        return every

    def refuse_together(self, message: str | None, what: str) -> None:
        """Raise :class:`InputError` on every rank when any rank passes a ``message`` (its one-line refusal of
        ``what``, e.g. its data), which the other ranks would otherwise wait for in their next collective: that
        rank raises its message, the others ``"rank r refused <what>: <message>"``."""
        from .errors import InputError

        bad = next(((r, m) for r, m in enumerate(self.gather_objects(message)) if m), None)
        if bad:
            raise InputError(bad[1] if bad[0] == self.rank else f"rank {bad[0]} refused {what}: {bad[1]}")

    def check_same(self, values: dict, what: str, hint: str) -> None:
        """Raise :class:`RevgraphError` (``"the <what> differ across ranks: rank r has <key> <value>, rank 0 has
        <value>; <hint>"``, naming the first key that differs) unless ``values`` (a dict of small picklable
        values: arguments, settings) are equal on every rank. One all-gather, before any step."""
        every = self.gather_objects(values)
        for r, theirs in enumerate(every):
            for key in values:
                if theirs.get(key) != every[0].get(key):
                    raise RevgraphError(f"the {what} differ across ranks: rank {r} has {key} {theirs.get(key)!r}, "
                                        f"rank 0 has {every[0].get(key)!r}; {hint}")

    def barrier(self) -> None:
        with collective("a barrier"):
            self.dist.barrier()

    def close(self) -> None:
        """Leave the process group (when this object created it)."""
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


@dataclass
class _Bucket:
    """A flat device tensor holding several dense gradients back to back (``views`` by gradient name)."""

    flat: object
    views: dict = field(default_factory=dict)


class DistributedEngine(SplitEngine):
    """A data-parallel training step (module doc): grad graph, gradient exchange, update graph. Parameters and
    state are held in one buffer set where the update may overwrite them (:class:`revgraph.steps.SplitEngine`;
    ``one_set=False``: two sets); the dense gradients live in the all-reduce buckets.

    Raises :class:`RevgraphError` (one line) when onnxruntime refuses a graph or the process group fails.
    """

    def __init__(self, spec: TrainingGraph, threads: int, device: Device, comm: Collective,
                 runtime: RuntimeOptions | None = None, one_set: bool = True):
        self.comm = comm
        torch = comm.torch
        super().__init__(spec, threads, device, runtime, one_set)
        self._empty_rows = {p: torch.zeros((0, *spec.initial[p].shape[1:]), dtype=_torch_dtype(torch, spec.initial[p]),
                                           device=comm.tdevice) for p in spec.sparse}

    def _make_gradient_buffers(self) -> dict:
        """The dense gradients as views of the all-reduce buckets (shared with onnxruntime through DLPack)."""
        spec = self.spec
        self.buckets = self._make_buckets([spec.grads[p][0] for p in spec.params if p not in spec.sparse])
        return {g: ortvalue_from_dlpack(v) for b in self.buckets for g, v in b.views.items()}

    def _make_buckets(self, grads: list[str]) -> list[_Bucket]:
        """Dense gradients packed, in reverse parameter order as DDP packs them, into flat tensors of at most
        :data:`BUCKET_BYTES` each (one dtype per bucket). A gradient has its parameter's shape and dtype."""
        torch = self.comm.torch
        like = {self.spec.grads[p][0]: self.spec.initial[p] for p in self.spec.params if p not in self.spec.sparse}
        groups: list[tuple[np.dtype, list[str], int]] = []
        for g in reversed(grads):
            a = like[g]
            if not groups or groups[-1][0] != a.dtype or groups[-1][2] + a.nbytes > BUCKET_BYTES:
                groups.append((a.dtype, [], 0))
            dt, names, used = groups[-1]
            groups[-1] = (dt, [*names, g], used + a.nbytes)
        buckets = []
        for j, (dt, names, _) in enumerate(groups):
            # the last bucket has one more element: the rank's share of the loss rides along (one collective less)
            extra = int(j == len(groups) - 1)
            flat = torch.zeros(sum(like[g].size for g in names) + extra, dtype=_torch_dtype(torch, like[names[0]]),
                               device=self.comm.tdevice)
            bucket, at = _Bucket(flat), 0
            for g in names:
                bucket.views[g] = flat[at:at + like[g].size].view(like[g].shape)
                at += like[g].size
            buckets.append(bucket)
        return buckets

    def _gradients(self, feeds: dict[str, np.ndarray], count: int, total: int) -> tuple[float, dict]:
        """This rank's gradients weighted by ``count / total`` and exchanged: the global batch's loss and the
        gathered sparse rows (the dense gradients are summed in their buckets)."""
        torch, dist = self.comm.torch, self.comm.dist
        rows: dict[str, tuple] = {}
        if count:
            loss, sparse = self._run_grad(feeds)
            for p, idx, rows_name in self._sparse:
                rows[p] = (torch_from_ortvalue(torch, sparse[idx]), torch_from_ortvalue(torch, sparse[rows_name]))
        else:  # this rank has no sample in the global batch's last piece: it contributes zeros
            loss = 0.0
            for b in self.buckets:
                b.flat.zero_()
            for p in self.spec.sparse:
                rows[p] = (torch.zeros(0, dtype=torch.int64, device=self.comm.tdevice), self._empty_rows[p])
        scale = count / total
        with collective("the gradient exchange"):
            pending = []
            for b in self.buckets:
                b.flat.mul_(scale)
            loss_t = self.buckets[-1].flat[-1:] if self.buckets else torch.zeros(1, dtype=torch.float64,
                                                                                 device=self.comm.tdevice)
            loss_t.fill_(loss * scale)
            for b in self.buckets or [_Bucket(loss_t)]:
                pending.append(dist.all_reduce(b.flat, async_op=True))
            gathered = self._gather_rows(rows, scale)
            for work in pending:
                work.wait()
        inputs = {}
        for p, idx, rows_name in self._sparse:
            i_all, r_all = gathered[p]
            inputs[idx], inputs[rows_name] = ortvalue_from_dlpack(i_all), ortvalue_from_dlpack(r_all)
        return float(loss_t.item()), inputs

    def _synchronize(self) -> None:
        self.device.synchronize(self.comm.torch)  # onnxruntime's CUDA stream does not wait for torch's collectives

    def _gather_rows(self, rows: dict[str, tuple], scale: float) -> dict[str, tuple]:
        """Every rank's sparse rows of each table (scaled by ``scale``), concatenated in rank order: the sizes
        go first (one all-gather), then the rows padded to the largest size, then each piece is cut to size."""
        if not rows:
            return {}
        torch, dist, world = self.comm.torch, self.comm.dist, self.comm.world_size
        names = [p for p, _, _ in self._sparse]
        sizes = torch.tensor([rows[p][0].shape[0] for p in names], dtype=torch.int64, device=self.comm.tdevice)
        every = [torch.empty_like(sizes) for _ in range(world)]
        dist.all_gather(every, sizes)
        out = {}
        for j, p in enumerate(names):
            idx, vals = rows[p]
            counts = [int(s[j]) for s in every]
            top = max(counts)
            pad_i = torch.zeros(top, dtype=torch.int64, device=self.comm.tdevice)
            pad_v = torch.zeros((top, *vals.shape[1:]), dtype=vals.dtype, device=self.comm.tdevice)
            pad_i[:idx.shape[0]] = idx
            pad_v[:vals.shape[0]] = vals * scale
            all_i = [torch.empty_like(pad_i) for _ in range(world)]
            all_v = [torch.empty_like(pad_v) for _ in range(world)]
            dist.all_gather(all_i, pad_i)
            dist.all_gather(all_v, pad_v)
            out[p] = (torch.cat([t[:c] for t, c in zip(all_i, counts, strict=True)]).contiguous(),
                      torch.cat([t[:c] for t, c in zip(all_v, counts, strict=True)]).contiguous())
        return out


def _torch_dtype(torch, like: np.ndarray):
    return torch.from_numpy(np.zeros(1, dtype=np.asarray(like).dtype)).dtype
