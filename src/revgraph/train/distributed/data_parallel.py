"""Data-parallel training on PyTorch's distributed engine (``torch.distributed`` collectives under ``torchrun``).

Each process (rank) of a world of ``W`` processes holds a full copy of the parameters and the optimizer state
and trains on its share of every global batch (:func:`revgraph.train.trainer.shard`). A step is the fused step
graph cut in two (:func:`revgraph.train.split_step`):

1. the **grad graph** runs on the rank's ``n_r`` samples and writes the loss and the gradients (means over
   those samples);
2. the gradients are exchanged: every gradient is scaled by ``n_r / N`` (``N`` the global batch, the sum of
   the ``n_r``) and **dense** gradients are all-reduced (summed) in buckets of at most ``bucket_mb`` MiB (25 by
   default, as ``torch.nn.parallel.DistributedDataParallel``; :mod:`revgraph.train.distributed.exchange`), so each rank
   gets the mean gradient over the global batch, exact also when the last batch of an epoch does not split evenly. With
   several buckets the grad graph runs in segments and each bucket's all-reduce starts while the next segment
   runs (:mod:`revgraph.train.distributed.overlap`). **Sparse** gradients of embedding tables (the ``(indices, rows)``
   pairs of ``revgraph.gradient(..., sparse=True)``) are all-gathered as rows (all tables in one packed buffer, their
   counts riding in the last bucket) and concatenated in rank order, never densified (Caffe2's
   ``data_parallel_model`` exchanged them the same way). With gradient accumulation, the micro-batches'
   gradients are summed into the buckets first (each weighted by its count over ``N``);
3. the **update graph** applies the optimizer to the exchanged gradients. Its inputs are identical on every
   rank, so parameters and optimizer state stay identical (:meth:`Collective.check_replicas` verifies it).

Gradient buffers are torch tensors on the device that onnxruntime reads and writes in place through DLPack
(``OrtValue.from_dlpack``): no copies between the two. Backends: ``gloo`` on CPU, ``nccl`` on CUDA. torch is
imported only here, and this module only when ``distributed=True``.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager

import numpy as np

from ...errors import RevgraphError
from ...runtime import _first_line
from ...runtime.devices import Device, ortvalue_from_dlpack, torch_from_ortvalue
from ...runtime.options import RuntimeOptions
from ...warn import warn
from ..engines import SplitEngine
from ..graphs import TrainingGraph
from .exchange import (
    BUCKET_MB,
    EXACT_COUNTS,
    bucket_bytes,
    check_reduce_dtype,
    make_buckets,
    pack_rows,
    packed_size,
    torch_dtype,
    unpack_rows,
)
from .join import CollectiveError  # (re-exported: raised by every collective here)
from .overlap import Segments, cut, inferred_types

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def collective(what: str):
    """Turn a failed collective into a one-line :class:`CollectiveError`: it fails when another rank died or
    cannot be reached, or gave no answer within the process group's timeout (torchrun then stops this worker,
    and restarts all of them if ``--max-restarts`` allows)."""
    try:
        yield
    except RevgraphError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.distributed's errors, one line
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
    ``nccl`` for CUDA, with ``timeout`` seconds (default :data:`revgraph.train.distributed.launch.DEFAULT_TIMEOUT`) for
    the join and every collective. Before joining, the worker is set to die with its torchrun agent and the
    loopback-hostname trap is checked (:mod:`revgraph.train.distributed.launch`). Raises :class:`RevgraphError` (one
    line) without torch, outside torchrun, for that trap, and :class:`CollectiveError` when the group cannot be joined
    in time.
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
            from .join import join_store

            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            # every rank checks in through torchrun's store first: one that refused before joining is named at once
            store = join_store(rank, world, self.timeout)
            try:
                # the timeout bounds the join and every collective: a stopped peer fails the others in that time
                dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                                        timeout=timedelta(seconds=self.timeout))
            except Exception as exc:  # noqa: BLE001 - torch.distributed's errors, one line
                raise CollectiveError(f"cannot join the process group within {self.timeout:g} s (--timeout): "
                                      f"{_first_line(exc)[:300]}") from None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tdevice = torch.device(device.torch())
        if self.rank == 0 and stale_store_on_restart():
            warn("torchrun restarts workers (--max-restarts) but shares its rendezvous store with them: "
                 "restarted workers may read the addresses of the failed attempt and fail to connect "
                 "(pytorch/pytorch#135712); use the c10d rendezvous (--rdzv-backend c10d) with "
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (revgraph train --nproc sets it)")

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
            a = arrays[name] if isinstance(arrays[name], np.ndarray) else np.asarray(arrays[name])
            h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
            for i in range(0, max(len(a), 1) if a.ndim else 1, 1 << 16):  # in blocks: a memmap is never read whole
                h.update(np.ascontiguousarray(a[i:i + (1 << 16)] if a.ndim else a).tobytes())
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
        from ...errors import InputError

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


class DistributedEngine(SplitEngine):
    """A data-parallel training step (module doc): grad graph, gradient exchange, update graph. Parameters and
    state are held in one buffer set where the update may overwrite them (:class:`revgraph.train.engines.SplitEngine`;
    ``one_set=False``: two sets); the dense gradients live in the all-reduce buckets
    (:mod:`revgraph.train.distributed.exchange`) of at most ``bucket_mb`` MiB, exchanged in ``reduce_dtype``
    (``"fp32"``: the gradients' own dtype; ``"bf16"``). ``overlap``: with more than one bucket, run the grad graph in
    segments (:mod:`revgraph.train.distributed.overlap`) and start each bucket's all-reduce as soon as its segment has
    produced it.

    The phases a subclass may override: :meth:`_backward` (one micro-batch's grad graph run, calling back as
    buckets become ready), :meth:`_bucket_ready` (accumulate a bucket; start its exchange after the last
    micro-batch), :meth:`_start_exchange` / :meth:`_finish_exchange` (one bucket's collective),
    :meth:`_exchange_rows` (the sparse rows) and :meth:`_run_update` (the update graph).

    Raises :class:`RevgraphError` (one line) when onnxruntime refuses a graph or the process group fails.
    """

    def __init__(self, spec: TrainingGraph, threads: int, device: Device, comm: Collective,
                 runtime: RuntimeOptions | None = None, one_set: bool = True, *, bucket_mb: float = BUCKET_MB,
                 reduce_dtype: str = "fp32", overlap: bool = True, offload=None):
        self.comm = comm
        self.bucket_cap = bucket_bytes(bucket_mb)
        self.reduce_dtype = check_reduce_dtype(reduce_dtype)
        self.overlap = overlap
        self.segments: Segments | None = None
        self._scratch_values: dict | None = None
        torch = comm.torch
        super().__init__(spec, threads, device, runtime, one_set, offload)  # (offload: revgraph.train.offload)
        self._empty_rows = [torch.zeros((0, *spec.initial[p].shape[1:]), device=comm.tdevice,
                                        dtype=torch_dtype(torch, spec.initial[p].dtype)) for p in spec.sparse]

    # ------------------------------------------------------------------------------------------ buffers

    def _make_gradient_buffers(self) -> dict:
        """The dense gradients as views of the all-reduce buckets (shared with onnxruntime through DLPack)."""
        spec, torch = self.spec, self.comm.torch
        dense = [p for p in spec.params if p not in spec.sparse]
        like = {spec.grads[p][0]: spec.initial[p] for p in dense}
        # the tail: the loss and every rank's count of sparse rows per table (module doc of
        # revgraph.train.distributed.exchange)
        self._tail_size = 1 + self.comm.world_size * len(spec.sparse)
        last = like[spec.grads[dense[0]][0]].dtype if dense else None
        rides = self.reduce_dtype == "fp32" and last in (np.float32, np.float64)
        self.buckets = make_buckets(torch, like, [spec.grads[p][0] for p in dense], self.bucket_cap,
                                    self._tail_size if rides else 0, self.comm.tdevice, self.reduce_dtype == "bf16")
        self._tail = self.buckets[-1].tail if rides else torch.zeros(self._tail_size, dtype=torch.float64,
                                                                     device=self.comm.tdevice)
        self._tail_alone = not rides
        return {g: ortvalue_from_dlpack(v) for b in self.buckets for g, v in b.views.items()}

    def _make_grad_session(self):
        """The grad graph as one session, or (``overlap``, more than one bucket) cut into segments."""
        if self.overlap and len(self.buckets) > 1:
            segments = self._cut()
            if segments is not None and len(segments) > 1:
                self.segments = Segments(segments, self.grad_graph.output_names, self.session, self.device)
                return None
        return super()._make_grad_session()

    def _cut(self):
        """The segments of the grad graph, one per bucket (:func:`revgraph.train.distributed.overlap.cut`); the last
        bucket also waits for the loss and the sparse gradients, which ride in its tail. ``None`` when it cannot be
        cut."""
        spec = self.spec
        groups = [list(b.views) for b in self.buckets]
        groups[-1] += [spec.loss.loss, *(g for p in spec.sparse for g in spec.grads[p])]
        try:
            return cut(self.grad_graph, groups)
        except RevgraphError:
            try:
                return cut(self.grad_graph, groups, inferred_types(self.grad_graph))
            except RevgraphError as exc:
                warn(f"the gradient exchange does not overlap the backward pass: {exc}")
                return None

    def _scratch(self) -> dict:
        """Buffers of the buckets' layout that micro-batches after the first write their gradients into."""
        if self._scratch_values is None:
            torch = self.comm.torch
            values = {}
            for b in self.buckets:
                b.scratch = torch.zeros_like(b.flat)
                at = 0
                for g, v in b.views.items():
                    values[g] = ortvalue_from_dlpack(b.scratch[at:at + v.numel()].view(v.shape))
                    at += v.numel()
            self._scratch_values = values
            self._rebind()
        return self._scratch_values

    def _rebind(self) -> None:
        super()._rebind()
        self._scratch_bindings = [self._bind_grad(k, self._scratch_values) for k in range(2)] \
            if self._scratch_values is not None and self._grad is not None else None

    # ------------------------------------------------------------------------------------------ the step

    def _gradients(self, micro: list[tuple[dict, int]], total: int) -> tuple[float, dict]:
        """Every micro-batch's gradients weighted by ``count / total`` and summed into the buckets, which are
        exchanged after the last one (each as soon as the backward pass has produced it); returns the global
        batch's loss and the update graph's sparse inputs (the exchanged rows)."""
        times = self.times
        start = times.now() if times is not None else 0.0
        runs = [(f, n) for f, n in micro if n]
        self._pending: list = []
        self._loss_sum = 0.0
        self._rows: list[list] = [[] for _ in self._sparse]
        self._tail.zero_()
        if not runs:  # this rank has no sample in the global batch's last piece: it contributes zeros
            for j, b in enumerate(self.buckets):
                b.grads.zero_()
                self._start_exchange(j)
        for m, (feeds, n) in enumerate(runs):
            if m:
                self._synchronize()  # the last micro-batch's sums (torch) must be done before onnxruntime writes
            self._backward(feeds, n / total, first=m == 0, last=m == len(runs) - 1)
        if not self.buckets or self._tail_alone:
            self._fill_tail()
            self._pending.append((None, self._all_reduce(self._tail, "tail")))
        if times is not None:
            times.add("forward+backward", start)
            start = times.now()
        with collective("the gradient exchange"):
            for j, work in self._pending:
                self._finish_exchange(j, work)
            inputs = self._exchange_rows()
        if times is not None:
            times.add("exchange", start)
            times.event("phase", "exchange (waited)", start)
        return float(self._tail[0].item()), inputs

    def _backward(self, feeds: dict, weight: float, first: bool, last: bool) -> None:
        """Run the grad graph on one micro-batch (``weight``: its share ``count / total`` of the global batch),
        writing the first micro-batch's dense gradients into the buckets and later ones into the scratch
        buffers, and call :meth:`_bucket_ready` for each bucket as it is produced."""
        into = self._grad_values if first else self._scratch()
        sparse: dict = {}

        def ready(js, fresh):
            sparse.update(fresh)
            if last and len(self.buckets) - 1 in js:  # the tail rides in the last bucket: fill it first
                self._take(weight, sparse)
            for j in js:
                self._bucket_ready(j, weight, first, last)

        if self.segments is not None:
            values = {p: self._compute(self._current, p) for p in self.spec.backward_reads()}  # (+ fp16 loss scale)
            outs = self.segments.run(values, feeds, {**into, self.spec.loss.loss: self._loss[self._current]},
                                     lambda k, seg, fresh: ready(seg.buckets, fresh), self.times)
            sparse.update(outs)
        else:
            _, outs = self._run_grad(feeds, None if first else self._scratch_bindings)
            ready(range(len(self.buckets)), outs)
        if not (last and self.buckets):
            self._take(weight, sparse)

    def _take(self, weight: float, sparse: dict) -> None:
        """Add this micro-batch's loss and sparse rows (weighted) to the step's; after the last one, the tail."""
        torch = self.comm.torch
        self._loss_sum += float(self._loss[self._current].numpy()) * weight
        for t, (_, idx, rows) in enumerate(self._sparse):
            self._rows[t].append((torch_from_ortvalue(torch, sparse[idx]),
                                  torch_from_ortvalue(torch, sparse[rows]) * weight))
        self._fill_tail()

    def _fill_tail(self) -> None:
        """Write the tail (:mod:`revgraph.train.distributed.exchange`): the step's loss so far and this rank's row count
        per table in its own slot. Raises :class:`RevgraphError` when a count is too large for float32 to hold
        exactly."""
        counts = [sum(int(i.shape[0]) for i, _ in parts) for parts in self._rows]
        if self._tail.dtype != self.comm.torch.float64 and max(counts, default=0) >= EXACT_COUNTS:
            raise RevgraphError(f"a step has {max(counts)} sparse gradient rows on one rank, more than the float32 "
                                "counts of the exchange hold exactly; use a smaller batch")
        self._tail[0] = self._loss_sum
        t, r = len(self._rows), self.comm.rank
        for k, c in enumerate(counts):
            self._tail[1 + r * t + k] = c

    def _bucket_ready(self, j: int, weight: float, first: bool, last: bool) -> None:
        """Bucket ``j``'s gradients of one micro-batch are written: weight them into the bucket; after the last
        micro-batch start the bucket's exchange."""
        b = self.buckets[j]
        if first:
            b.grads.mul_(weight)
        else:
            b.grads.add_(b.scratch[:b.grads.numel()], alpha=weight)
        if last:
            self._start_exchange(j)

    def _start_exchange(self, j: int) -> None:
        """Start the all-reduce of bucket ``j`` (asynchronous; :meth:`_finish_exchange` waits for it)."""
        b = self.buckets[j]
        if b.low is not None:
            b.low.copy_(b.grads)
        self._pending.append((j, self._all_reduce(b.low if b.low is not None else b.flat, f"bucket {j}")))

    def _all_reduce(self, tensor, name: str):
        times = self.times
        with collective("the gradient exchange"):
            event = times.event("all-reduce", name, times.now()) if times is not None else None
            work = self.comm.dist.all_reduce(tensor, async_op=True)
        if event is not None:
            try:  # the end: when the collective completes, not when the step gets round to waiting for it
                work.get_future().then(lambda _: times.finish(event))
            except Exception:  # noqa: BLE001 - a backend without futures: no end time
                event["end"] = None
        return work

    def _finish_exchange(self, j: int | None, work) -> None:
        """Wait for bucket ``j``'s all-reduce (``None``: the tail's) and, in bfloat16, cast it back."""
        work.wait()
        if j is not None and self.buckets[j].low is not None:
            self.buckets[j].grads.copy_(self.buckets[j].low)

    def _exchange_rows(self) -> dict:
        """Every rank's sparse rows of each table, concatenated in rank order, as the update graph's inputs:
        the row counts came with the tail, so one all-gather of all tables' rows packed into bytes is left."""
        if not self._sparse:
            return {}
        torch, world, comm = self.comm.torch, self.comm.world_size, self.comm
        tables = len(self._sparse)
        counts = self._tail[1:].to(torch.int64).view(world, tables).tolist()
        mine = [(torch.cat([i for i, _ in parts]) if parts else torch.zeros(0, dtype=torch.int64, device=comm.tdevice),
                 torch.cat([v for _, v in parts]) if parts else empty)
                for parts, empty in zip(self._rows, self._empty_rows, strict=True)]
        row_bytes = [e.element_size() * int(np.prod(e.shape[1:], dtype=np.int64)) for e in self._empty_rows]
        size = max(packed_size(c, row_bytes) for c in counts)
        buf = pack_rows(torch, mine, size, comm.tdevice)
        every = [torch.empty_like(buf) for _ in range(world)]
        comm.dist.all_gather(every, buf)
        gathered = unpack_rows(torch, every, counts, self._empty_rows)
        inputs = {}
        for (_, idx, rows_name), (i_all, r_all) in zip(self._sparse, gathered, strict=True):
            inputs[idx], inputs[rows_name] = ortvalue_from_dlpack(i_all), ortvalue_from_dlpack(r_all)
        return inputs

    def _synchronize(self) -> None:
        self.device.synchronize(self.comm.torch)  # onnxruntime's CUDA stream does not wait for torch's collectives
