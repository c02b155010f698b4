"""The data-parallel engines of models with training-mode ``BatchNormalization``
(:mod:`revgraph.train.distributed.sync_batchnorm` has the graph side): :class:`RankZeroStatisticsEngine` without
``sync_batchnorm``, :class:`SyncBatchNormEngine` with it."""

from __future__ import annotations

import numpy as np

from ...runtime.devices import ortvalue_from_dlpack, torch_from_ortvalue
from .data_parallel import DistributedEngine, collective
from .exchange import torch_dtype
from .graph_collectives import cut, is_collective
from .overlap import run_bound
from .sync_batchnorm import running_statistics


class RankZeroStatisticsEngine(DistributedEngine):
    """:class:`~revgraph.train.distributed.data_parallel.DistributedEngine` for a model with training-mode
    ``BatchNormalization`` trained without ``sync_batchnorm``: each rank normalizes with its own batch statistics, and
    after the grad graph has written each rank's running statistics into its parameter buffers (module doc), rank 0's
    are broadcast to every rank before the update (``DistributedDataParallel(broadcast_buffers=True)`` broadcasts
    rank 0's buffers before each forward), so the ranks stay replicas.
    Raises :class:`RevgraphError` (one line) when the broadcast fails."""

    def __init__(self, spec, threads, device, comm, runtime=None, one_set: bool = True, **exchange):
        super().__init__(spec, threads, device, comm, runtime, one_set, **exchange)
        self.statistics = running_statistics(spec.model, spec.params)

    def _gradients(self, *args, **kwargs):
        out = super()._gradients(*args, **kwargs)  # (whatever the phases of the exchange: then the broadcast)
        torch = self.comm.torch
        views = [torch_from_ortvalue(torch, self.value(p)) for p in self.statistics]
        if views:
            flat = torch.cat([v.reshape(-1) for v in views])  # one broadcast for all of them (one dtype: float)
            with collective("the broadcast of rank 0's running statistics"):
                self.comm.dist.broadcast(flat, 0)
            at = 0
            for v in views:
                v.copy_(flat[at:at + v.numel()].view(v.shape))
                at += v.numel()
        return out


def engine_class(spec, default: type) -> type:
    """The data-parallel engine class for ``spec``: :class:`RankZeroStatisticsEngine` when the model has
    running statistics among the parameters, else ``default``."""
    return RankZeroStatisticsEngine if running_statistics(spec.model, spec.params) else default


class SyncBatchNormEngine(DistributedEngine):
    """The data-parallel step with ``sync_batchnorm`` (:func:`revgraph.train.distributed.sync_batchnorm.rewrite`): the
    grad graph holds ``AllReduceSum`` placeholders (forward: each BatchNormalization's sums; backward: their
    cotangents'), and runs as the segments of :func:`revgraph.train.distributed.graph_collectives.cut`, one onnxruntime
    session each, with the all-reduces (``torch.distributed``, one per stage and dtype) between them. Each node's shift
    input is bound to its running mean's buffer (identical on every rank).

    The loss's cotangent is seeded with the rank's share ``n_r / N`` (``TrainingGraph.seed``), so every
    cotangent entering a backward all-reduce carries its rank's weight and the gradients come out already
    weighted: they are all-reduced without the ``n_r / N`` scaling of
    :class:`~revgraph.train.distributed.data_parallel.DistributedEngine`. A rank without samples in the last global
    batch runs no segment but takes part in every collective with zeros (sums over no sample). After the segments, the
    running statistics that are parameters get ``input * momentum + batch * (1 - momentum)`` from the global
    sums (the batch's population variance), as onnxruntime's kernel writes them in one process; the update
    graph then runs as in :class:`~revgraph.train.distributed.data_parallel.DistributedEngine`.
    Raises :class:`RevgraphError` (one line) when onnxruntime refuses a segment or a collective fails."""

    def __init__(self, spec, threads, device, comm, synced, runtime=None, one_set: bool = True, **exchange):
        self.synced = list(synced)
        self._shifts = {s.shift: s for s in synced}
        # the stages are cut at the collectives, not at the buckets: no bucket overlap (the stages wait anyway)
        super().__init__(spec, threads, device, comm, runtime, one_set, **{**exchange, "overlap": False})
        have = {v.name for v in self.grad_graph.inputs}  # the shifts are inputs the engine feeds (not the batch)
        self.grad_graph.inputs += [v for v in spec.graph.inputs if v.name in self._shifts and v.name not in have]
        self.stages = cut(self.grad_graph)
        self._stages = [None if s.graph is None else self.session(s.graph, f"gradient graph (stage {j + 1})")
                        for j, s in enumerate(self.stages.stages)]
        self._seed_dtype = next(v.dtype for v in self.grad_graph.inputs if v.name == spec.seed)
        self._fixed_shifts: dict = {}

    def session(self, graph, what: str, device=None):
        """:meth:`~revgraph.train.engines.Engine.session`, or ``None`` for a graph holding placeholders."""
        if any(is_collective(n) for n in graph.nodes):  # the uncut grad graph: only its segments run
            return None
        return super().session(graph, what, device)

    def _make_grad_session(self):
        """No session of the whole grad graph: only its stages run (bound at each run: their inputs change)."""
        return

    def _gradients(self, micro, total: int):
        """The stages and their all-reduces, the running statistics, then the gradient exchange (summed as they
        are: the seed weighted them); returns the global batch's loss and the update's sparse inputs. One
        micro-batch (``Trainer.fit`` refuses accumulation with ``sync_batchnorm``)."""
        (feeds, count), = micro
        torch = self.comm.torch
        sums = self._run_segments(feeds, count, total)
        self._update_running_statistics(sums)
        self._pending, self._rows = [], [[] for _ in self._sparse]
        self._tail.zero_()
        # the loss is the rank's own mean: weighted here; gradients and rows carry their weight already (the seed)
        self._loss_sum = float(self._loss[self._current].numpy()) * count / total if count else 0.0
        for t, (_, idx, rows) in enumerate(self._sparse):
            if count:
                self._rows[t].append((torch_from_ortvalue(torch, sums[idx]), torch_from_ortvalue(torch, sums[rows])))
        if not count:  # no sample here: zero gradients (the segments did not run)
            for b in self.buckets:
                b.grads.zero_()
        self._fill_tail()  # (before the last bucket's all-reduce, which carries the tail)
        for j in range(len(self.buckets)):
            self._start_exchange(j)
        if not self.buckets or self._tail_alone:
            self._pending.append((None, self._all_reduce(self._tail, "tail")))
        with collective("the gradient exchange"):
            for j, work in self._pending:
                self._finish_exchange(j, work)
            inputs = self._exchange_rows()
        return float(self._tail[0].item()), inputs

    def _run_segments(self, feeds, count: int, total: int) -> dict:
        """Run the stages in order (segments only when this rank has samples) with the all-reduces between
        them. Returns the values that crossed between stages: ``OrtValue`` segment outputs and torch tensors
        of the collectives' sums, by name."""
        spec, k = self.spec, self._current
        host = {**feeds, spec.seed: np.array(count / total, dtype=self._seed_dtype)} if count else {}
        values: dict = {}
        for j, (stage, sess) in enumerate(zip(self.stages.stages, self._stages, strict=True)):
            if count and sess is not None:
                self._synchronize()  # onnxruntime's CUDA stream does not wait for torch's all-reduces
                def value(n):
                    if n in host:
                        return host[n]
                    if n in self._shifts:
                        return self._shift(self._shifts[n])
                    return values[n] if n in values else self._sets[k][n]

                names = [vi.name for vi in stage.graph.outputs]
                into = {n: self._grad_values[n] for n in names if n in self._grad_values}
                into[spec.loss.loss] = self._loss[k]
                values.update(zip(names, run_bound(sess, [vi.name for vi in stage.graph.inputs], names, value, into,
                                                   self.device, f"the gradient step failed (stage {j + 1})"),
                                  strict=True))
            if stage.collectives:
                self._all_reduce_stage(stage.collectives, values, count)
        return values

    def _all_reduce_stage(self, nodes, values: dict, count: int) -> None:
        """Sum the inputs of the collectives ``nodes`` over the ranks (one all-reduce per dtype; zeros from a
        rank without samples) and put each sum into ``values`` (a torch tensor, its OrtValue under the name)."""
        torch, dist = self.comm.torch, self.comm.dist
        by_dtype: dict = {}
        for c in nodes:
            by_dtype.setdefault(self.stages.types[c.inputs[0]].dtype, []).append(c)
        for dt, group in by_dtype.items():
            parts = [torch_from_ortvalue(torch, values[c.inputs[0]]).reshape(-1) if count else
                     torch.zeros(int(c.attrs["size"]), dtype=torch_dtype(torch, dt),
                                 device=self.comm.tdevice) for c in group]
            flat = torch.cat(parts)
            with collective("the all-reduce of the batch-normalization statistics"):
                dist.all_reduce(flat)
            at = 0
            for c in group:
                size = int(c.attrs["size"])
                piece = flat[at:at + size].clone()
                at += size
                values[c.outputs[0] + "#torch"] = piece
                values[c.outputs[0]] = ortvalue_from_dlpack(piece)

    def _update_running_statistics(self, values: dict) -> None:
        """``running = input * momentum + batch * (1 - momentum)`` in the parameter buffers of the running
        statistics (those that are parameters), from the global sums of :func:`rewrite`: with ``m = sum d /
        n``, the batch mean is ``shift + m`` and its population variance ``sum d^2 / n - m^2``."""
        torch = self.comm.torch
        params = set(self.spec.params)
        for s in self.synced:
            t, c = values[s.sums + "#torch"], s.channels
            n = t[2 * c]
            m = t[:c] / n
            shift = torch_from_ortvalue(torch, self._shift(s))
            batch = {s.running_mean: shift + m, s.running_var: (t[c:2 * c] / n - m * m).clamp_min(0)}
            for name, current in batch.items():  # (both computed before either buffer changes)
                if name in params:
                    buf = torch_from_ortvalue(torch, self.value(name))
                    buf.copy_(buf * s.momentum + current.to(buf.dtype) * (1.0 - s.momentum))

    def _shift(self, s):
        """The ``OrtValue`` fed as ``s.shift``: the running mean's current buffer (a parameter), or its
        initializer (constant)."""
        if s.running_mean in self.spec.params:
            return self.value(s.running_mean)
        if s.shift not in self._fixed_shifts:
            self._fixed_shifts[s.shift] = self.device.ortvalue(
                np.asarray(self.spec.model.initializers[s.running_mean], dtype=self.stages.types[s.sums].dtype))
        return self._fixed_shifts[s.shift]
