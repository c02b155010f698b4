"""Parameter-sharded data-parallel training (``shard="parameters"``, ``--shard parameters``): ZeRO stage 3, as
FSDP2's ``fully_shard`` and DeepSpeed's ZeRO-3.

Built on :class:`revgraph.train.distributed.sharding.ShardedEngine` (ZeRO-1/2: flat units padded to a multiple of
the world size ``W``, rank ``r`` owning shard ``r`` of each, optimizer state of the shards only). Here the rank also
keeps **only its shard of the parameters** between steps: ``P / W`` parameter bytes, ``G / W`` gradient bytes and
``S / W`` optimizer state, plus a few unit-sized buffers during a step.

A step (one micro-batch; with accumulation, each in turn): the grad graph (forward and backward) runs cut into
segments by the units they read (:mod:`revgraph.train.distributed.param_schedule`). Before a segment runs, the units
it reads are **all-gathered** (``all_gather_into_tensor`` of the rank's shards) into gather buffers; the units the
next segment reads are gathered asynchronously while it computes (prefetch); a unit no longer read by the next
segment is dropped, and gathered again if a later segment (the backward) reads it. Every parameter a segment reads
is bound as an ``OrtValue`` view (DLPack) of its unit in its gather buffer. As soon as a segment has produced the
last gradient of a unit, the unit's gradient is copied into one bucket, weighted by the micro-batch's share of the
global batch and **reduce-scattered** into the rank's gradient shard (summed over micro-batches). Then the update
graph of :class:`ShardedEngine` runs on the shards (schedules, clipping and weight decay as there) and the step
ends: no all-gather of the new parameters, the next forward gathers them.

Sparse embedding tables stay replicated (their rows all-gathered), as in ZeRO-1/2. Reads all-gather parameters and
state, so snapshots hold full arrays and resume at any world size and shard mode. Evaluation gathers every
unit at once (:meth:`ParameterShardedEngine.gather_for_evaluation`, which ``Trainer.evaluate`` calls on every rank):
its memory is the whole model's parameters, until the next step.

No rank keeps a full host copy of the parameters it does not own: once the engine holds its shards, the trainer
replaces the initial values (``spec.initial`` and the model's initializers of the parameters) by placeholders of
their dtype and shape (:func:`drop_initial_values`); every read of the values is a gather. At the end of ``fit``
the trained parameters are gathered to rank 0 alone (:meth:`ParameterShardedEngine.keep_for_writing`, a
collective), which writes the model from them (:meth:`ParameterShardedEngine.written`) until the next step; the
other ranks keep nothing. The check for non-finite parameters after the last step runs on the shards
(:meth:`ParameterShardedEngine.nonfinite`), without a gather.
"""

from __future__ import annotations

import numpy as np

from ...errors import RevgraphError
from ...runtime.devices import Device, ortvalue_from_dlpack, torch_from_ortvalue
from ...runtime.options import RuntimeOptions
from ..graphs import TrainingGraph
from .data_parallel import Collective, collective
from .overlap import reads_of
from .param_schedule import schedule
from .shard_plan import Unit, plan_units
from .sharded_state import _nbytes, into_shard
from .sharding import ShardedEngine
from .swap import all_gather_tensor, reduce_scatter_tensor


class ParameterShardedEngine(ShardedEngine):
    """ZeRO-3 (module doc): a data-parallel step whose ranks keep only their shards of the parameters, gradients
    and optimizer state. ``bucket_bytes``: the largest unit (each unit is gathered whole, so it bounds the gather
    memory); ``prefetch``: gather the next segment's units while a segment computes. Raises
    :class:`RevgraphError` (one line) when onnxruntime refuses a segment or a collective fails."""

    def __init__(self, spec: TrainingGraph, threads: int, device: Device, comm: Collective,
                 runtime: RuntimeOptions | None = None, bucket_bytes: int | None = None, reduce_dtype: str = "fp32",
                 prefetch: bool = True):
        self.prefetch = prefetch
        # rank 0: the trained parameters gathered at the end of fit, for writing, until the next step; other ranks
        # {} (keep_for_writing); None before it
        self._cache: dict | None = None
        self._full: dict | None = None  # the gathered parameters for evaluation, until the next step
        self._full_units: list = []
        super().__init__(spec, threads, device, comm, runtime, mode="parameters", bucket_bytes=bucket_bytes,
                         reduce_dtype=reduce_dtype)

    # ------------------------------------------------------------------------------------------ building

    def _plan_units(self, cap: int) -> list[Unit]:
        """Units of whole layers, as FSDP wraps modules: the dense parameters grouped by the node that first reads
        them (a ``Gemm``'s weight and bias together), the groups in the order the grad graph reaches them (the
        forward's), consecutive groups packed up to ``cap`` bytes (a larger group is a unit of its own), so that
        a node's parameters are gathered together and the forward gathers the units one after the other."""
        spec = self.spec
        first: dict[str, int] = {}
        for k, node in enumerate(self.grad_graph.nodes):
            for r in reads_of(node):
                first.setdefault(r, k)
        dense = [p for p in spec.params if p not in spec.sparse]
        layers: dict[tuple, list[str]] = {}
        for p in sorted(dense, key=lambda p: first.get(p, len(self.grad_graph.nodes))):
            layers.setdefault((first.get(p, -1), spec.initial[p].dtype.str), []).append(p)
        groups: list[list[str]] = []
        used = 0
        for names in layers.values():
            size = sum(spec.initial[p].nbytes for p in names)
            same = groups and spec.initial[groups[-1][0]].dtype == spec.initial[names[0]].dtype
            if same and used + size <= cap:
                groups[-1] += names
                used += size
            else:
                groups.append(list(names))
                used = size
        return plan_units(spec, self.comm.world_size, self.comm.rank, cap, groups=groups)

    def _place(self, u: Unit, tdt, values: dict) -> None:
        """Only the rank's shard of the unit: its part of the initial values (no full unit is allocated)."""
        torch = self.comm.torch
        u.param = None
        u.pshard = torch.zeros(u.k, dtype=tdt, device=self.comm.tdevice)
        for n, o in zip(u.names, u.offsets, strict=True):
            into_shard(u.pshard, u, o, np.asarray(self.spec.initial[n]).reshape(-1))

    def _own(self, u: Unit):
        return u.pshard

    def _sharded(self, slot: int | None) -> bool:
        return True

    def _build_backward(self) -> None:
        """The schedule (:func:`revgraph.train.distributed.param_schedule.schedule`), one session per segment (one
        shared CPU arena between them where onnxruntime allows), the gather buffers with each segment's parameter
        views, the gradient bucket and the shard-sized receive buffer for micro-batches after the first."""
        from ...warn import warn

        torch, dev, spec = self.comm.torch, self.comm.tdevice, self.spec
        self.plan = None
        self.schedule = schedule(self.grad_graph, [u.names for u in self.units],
                                 [[spec.grads[p][0] for p in u.names] for u in self.units], prefetch=self.prefetch,
                                 warn=warn)
        unit_bytes = max([u.length * u.gshard.element_size() for u in self.units] or [0])
        self.gathered = [torch.zeros(unit_bytes, dtype=torch.uint8, device=dev) for _ in range(self.schedule.slots)]
        self.bucket = torch.zeros(unit_bytes, dtype=torch.uint8, device=dev)
        self._recv = None  # (allocated by the first accumulated micro-batch)
        self._wanted = set(self.grad_graph.output_names) - {spec.loss.loss}
        self._read_later = {n for st in self.schedule.stages for n in st.segment.release}
        self._views = []  # per stage: parameter name -> OrtValue view into its unit's gather buffer
        for st in self.schedule.stages:
            views = {}
            for j in st.units:
                views.update((n, ortvalue_from_dlpack(v)) for n, v in self.units[j].views(self._slot(j, st.slots[j]))
                             .items())
            self._views.append(views)
        self._stage_sessions = self._segment_sessions_of([st.segment.graph for st in self.schedule.stages],
                                                         "step graph segment")
        # the first unit a stage reduces, when the stage writes all of its gradients and no later one reads them:
        # written straight into the bucket (its views), not carried (as ZeRO-2's direct gradients)
        self._direct = []
        for st in self.schedule.stages:
            u = self.units[st.reduce[0]] if st.reduce else None
            views = {spec.grads[p][0]: v for p, v in u.views(self._bucket(u)).items()} if u else {}
            ok = all(g in st.segment.outputs and g not in self._read_later for g in views)
            self._direct.append({g: ortvalue_from_dlpack(v) for g, v in views.items()} if ok else {})
        # gradient bytes a segment's outputs keep alive until their unit is reduce-scattered (held()'s peak)
        sizes = {spec.grads[p][0]: spec.initial[p].nbytes for u in self.units for p in u.names}
        alive, self._carried_peak = 0, 0
        for st, direct in zip(self.schedule.stages, self._direct, strict=True):
            alive += sum(sizes[g] for g in st.segment.outputs if g in sizes and g not in direct)
            self._carried_peak = max(self._carried_peak, alive)
            alive -= sum(sizes[g] for j in st.reduce for p in self.units[j].names
                         if (g := spec.grads[p][0]) not in direct)

    def _slot(self, j: int, b: int):
        """Gather buffer ``b`` as unit ``j``'s flat parameters."""
        u = self.units[j]
        return self.gathered[b][:u.length * u.pshard.element_size()].view(u.pshard.dtype)

    def _bucket(self, u: Unit):
        return self.bucket[:u.length * u.gshard.element_size()].view(u.gshard.dtype)

    # ------------------------------------------------------------------------------------------ state

    def keep_for_writing(self) -> None:
        """Gather the parameters to rank 0 alone (a collective: every rank calls it, as ``Trainer.fit`` does at
        its end) and keep them there until the next step or load, for :meth:`written`; the other ranks keep
        nothing (writing the model is rank 0's)."""
        self._cache = self.read(self.spec.params, root_only=True)

    def written(self, names) -> dict[str, np.ndarray]:
        """The parameters ``names`` to write the model from: on rank 0 after :meth:`keep_for_writing`, read-only
        views of the kept arrays (no collective, no copy); before it, :meth:`read` (a collective). Raises
        :class:`RevgraphError` on another rank after it (the others do not enter a collective then: rank 0
        alone holds the trained parameters)."""
        names = list(names)
        if self._cache is None:
            return self.read(names)
        if self.comm.rank != 0:
            raise RevgraphError("under shard='parameters' the trained parameters are gathered on rank 0 alone at the "
                                "end of fit: write the model on rank 0 (if trainer.is_main: ...), or read "
                                "trainer.parameters on every rank")
        out = {}
        for n in names:
            out[n] = self._cache[n].view()
            out[n].flags.writeable = False
        return out

    def nonfinite(self) -> str | None:
        """The first parameter (in ``spec.params`` order) with a NaN or infinite element, or ``None``; each rank
        tests its shards (and the replicated sparse tables), one all-reduce of the flags (a collective)."""
        spec = self.spec
        index = {p: i for i, p in enumerate(spec.params)}
        flags = np.zeros(len(spec.params))
        for u in self.units:
            bad = ~self.comm.torch.isfinite(u.pshard)
            if not bool(bad.any()):
                continue
            for p, o, shape in zip(u.names, u.offsets, u.shapes, strict=True):  # the slice of p in this shard
                lo, hi = max(o, u.lo) - u.lo, min(o + int(np.prod(shape, dtype=np.int64)), u.lo + u.k) - u.lo
                flags[index[p]] += lo < hi and bool(bad[lo:hi].any())
        for p in spec.sparse:
            flags[index[p]] += not bool(self.comm.torch.isfinite(self._tensors[p]).all())
        flags = self.comm.sum(flags)
        return next((p for p, f in zip(spec.params, flags, strict=True) if f), None)

    def _forget(self) -> None:
        """Drop the kept whole parameters (read's and evaluation's): they change with the next step or load."""
        self._cache, self._full, self._full_units = None, None, []

    def load(self, values: dict[str, np.ndarray]) -> None:
        self._forget()
        super().load(values)

    def undo(self) -> None:
        self._forget()
        super().undo()

    def held(self) -> dict[str, int]:
        """Bytes of the device buffers: ``"parameters"`` (the parameter shards and the replicated sparse tables),
        ``"optimizer"`` (the state shards and the sparse tables' state), ``"state"`` (those, the step, scratch and
        kept previous values), ``"gathered"`` (the gather buffers, each of the largest unit), ``"gradients"``
        (the gradient shards, the bucket and the receive buffer) and ``"gradients_peak"`` (``"gradients"`` plus the
        most bytes of gradients alive at once before their unit's reduce-scatter)."""
        return {**super().held(), "gathered": sum(_nbytes(b) for b in self.gathered)}

    def _held_parameters(self) -> list:
        return [u.pshard for u in self.units]

    def _held_gradients(self) -> tuple[int, int]:
        grads = sum(_nbytes(u.gshard) for u in self.units) + _nbytes(self.bucket)
        grads += _nbytes(self._recv) if self._recv is not None else 0
        return grads, grads + self._carried_peak

    # ------------------------------------------------------------------------------------------ running

    def gather_for_evaluation(self) -> None:
        """All-gather every unit (a collective: every rank calls it) and keep the full parameters for
        :meth:`evaluate` until the next step or load, so that ranks may then evaluate different numbers of
        batches. Evaluation memory is then the whole model's parameters."""
        self._full_units = [self._gather(u, None) for u in self.units]  # (the views' memory, kept with them)
        self._full = {n: ortvalue_from_dlpack(v) for u, flat in zip(self.units, self._full_units, strict=True)
                      for n, v in u.views(flat).items()}

    def _compute(self, k: int, name: str):
        """The value evaluation reads: the gathered parameters (:meth:`gather_for_evaluation`), or a replicated one."""
        return self._full[name] if self._full is not None and name in self._full else self._sets[0][name]

    def evaluate(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``(loss, model output)`` on ``feeds`` with the parameters :meth:`gather_for_evaluation` gathered (without
        it, gathered for this run: a collective, every rank evaluates)."""
        if self._full is None:
            self.gather_for_evaluation()
        return super().evaluate(feeds)

    def _sharded_gradients(self, feeds, count: int, total: int) -> tuple[float, dict]:
        """Every micro-batch's forward and backward, unit by unit (module doc), gradients reduce-scattered into
        the shards weighted by ``count / total``; then the loss and the sparse rows exchanged. A rank without
        samples in a micro-batch takes part in its gathers and reduce-scatters with zero gradients."""
        self._forget()
        micro = feeds if isinstance(feeds, list) else [(feeds, count)]
        times = self.times
        start = times.now() if times is not None else 0.0
        self._loss_sum, self._rows = 0.0, [[] for _ in self._sparse]
        self._tail.zero_()
        sparse, ran = {}, False
        with collective("the parameter all-gather or the gradient reduce-scatter"):
            for m, (f, n) in enumerate(micro):
                sparse = self._micro_batch(f, n, n / total, first=m == 0)
                if n:
                    self._take(n / total, sparse)
                    ran = True
            if times is not None:
                times.add("forward+backward", start)
                start = times.now()
            if not ran:
                self._fill_tail()
            self.comm.dist.all_reduce(self._tail)
            inputs = self._exchange_rows()
        if times is not None:
            times.add("exchange", start)
        return float(self._tail[0].item()), inputs

    def _micro_batch(self, feeds: dict, count: int, weight: float, first: bool) -> dict:
        """One micro-batch through the schedule; returns the grad graph's other outputs (sparse rows) by name.
        ``first``: its gradients are reduce-scattered straight into the shards (later ones added to them)."""
        import onnxruntime as ort

        stages = self.schedule.stages
        live = {n: ort.OrtValue.ortvalue_from_numpy(a, self.device.ort_type, self.device.index)
                for n, a in feeds.items()} if count else {}  # once on the device, however many segments read it
        works, fresh = {}, {}
        for s, st in enumerate(stages):
            for j in st.gather:
                works[j] = self._start_gather(j, st.slots[j])
            for j in st.units:
                if j in works:
                    works.pop(j).wait()
            for j in st.prefetch:  # the next stage's units, gathered while this one computes
                works[j] = self._start_gather(j, stages[s + 1].slots[j])
            if count:
                self._synchronize()  # (CUDA) the gathers are done before onnxruntime reads the buffers
                self._run_stage(s, live, fresh)
            for j in st.reduce:
                self._reduce(j, fresh if count else None, weight, first)
            for n in st.segment.release:
                live.pop(n, None)
        for w in works.values():  # (none: the last stage prefetches nothing)
            w.wait()
        return fresh

    def _start_gather(self, j: int, b: int):
        u = self.units[j]
        return all_gather_tensor(self.comm.dist)(self._slot(j, b), u.pshard, async_op=True)

    def _run_stage(self, s: int, live: dict, fresh: dict) -> None:
        """Run stage ``s``'s segment: inputs from ``live`` (the batch, earlier segments' outputs), its units' views
        and the replicated values; its outputs (allocated by onnxruntime, the loss into its buffer) into ``live``,
        or, for the grad graph's outputs (gradients, sparse rows), ``fresh``."""
        seg, views = self.schedule.stages[s].segment, self._views[s]
        out = self._run_segment(self._stage_sessions[s], seg.inputs, seg.outputs, {},
                                lambda n: live[n] if n in live else views[n] if n in views else self._sets[0][n],
                                {**self._direct[s], self.spec.loss.loss: self._loss[0]})
        for n, v in out.items():
            if n in self._wanted:
                fresh[n] = v
            if n in self._read_later:  # (a gradient no later segment reads lives in fresh alone, to its reduce)
                live[n] = v

    def _reduce(self, j: int, fresh: dict | None, weight: float, first: bool) -> None:
        """Unit ``j``'s gradient (taken out of ``fresh``; ``None``: zeros) weighted and reduce-scattered into its
        shard."""
        torch, spec = self.comm.torch, self.spec
        u = self.units[j]
        flat = self._bucket(u)
        if fresh is None:
            flat.zero_()
        else:
            for p, v in u.views(flat).items():
                if spec.grads[p][0] in fresh:  # (else written in place: the stage's direct unit)
                    v.copy_(torch_from_ortvalue(torch, fresh.pop(spec.grads[p][0])))
            flat[u.used:].zero_()  # the padding (an earlier, larger unit wrote there)
        flat.mul_(weight)
        self._synchronize()
        if first:
            reduce_scatter_tensor(self.comm.dist)(u.gshard, flat)
            return
        if self._recv is None:
            self._recv = torch.zeros(max(v.k for v in self.units) * u.gshard.element_size(), dtype=torch.uint8,
                                     device=self.comm.tdevice)
        recv = self._recv[:u.k * u.gshard.element_size()].view(u.gshard.dtype)
        reduce_scatter_tensor(self.comm.dist)(recv, flat)
        u.gshard.add_(recv)


def placeholder(a) -> np.ndarray:
    """A read-only array of ``a``'s dtype and shape that holds one element (zero strides): what metadata reads
    (``shape``, ``dtype``, ``size``, ``nbytes``) see of a value that is not kept."""
    a = np.asarray(a)
    return np.broadcast_to(np.zeros((), a.dtype), a.shape)


def drop_initial_values(spec: TrainingGraph) -> None:
    """Replace the initial values of ``spec``'s parameters, ``spec.initial`` and the initializers of
    ``spec.model`` (a copy of it: the caller's graph keeps its arrays), by :func:`placeholder` s, once a
    :class:`ParameterShardedEngine` has taken its shards of them (module doc). The graphs the engine runs read
    the parameters as inputs: they hold no copy."""
    for p in spec.params:
        spec.initial[p] = placeholder(spec.initial[p])
    model = spec.model.copy()
    for p in spec.params:
        if p in model.initializers:
            model.initializers[p] = spec.initial[p]
    spec.model = model
