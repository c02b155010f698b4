"""Sharded data-parallel training: ZeRO-1 (``shard="optimizer"``) and ZeRO-2 (``shard="gradients"``).

Unsharded (:class:`revgraph.train.distributed.data_parallel.DistributedEngine`), every rank of a world of ``W`` holds
all of the parameters, the gradients and the optimizer state, and runs the whole update. Here, as in
``torch.distributed.optim.ZeroRedundancyOptimizer``, DeepSpeed's ZeRO stages 1 and 2 and FSDP2's flat
parameters:

- the dense parameters are packed into **flat units**: consecutive parameters of one dtype, in reverse
  parameter order as DDP first buckets them (ZeRO-2: in the order the backward finishes their gradients, as
  DDP rebuilds its buckets), up to :data:`revgraph.train.distributed.exchange.BUCKET_MB` each, every unit a flat
  device tensor padded with zeros to a multiple of ``W`` elements. Each parameter is a view of its unit that
  onnxruntime reads in place (an ``OrtValue`` of the same memory, through DLPack). Rank ``r`` **owns** the
  contiguous shard ``r`` of every unit (``length / W`` elements);
- the optimizer state of a unit exists only for the rank's shard (``W`` times less: Adam's ``m`` and ``v`` of
  ``P`` parameters take ``2P / W`` per rank instead of ``2P``);
- a step: the grad graph writes the gradients; each unit's gradient is scaled by ``n_r / N`` (the rank's
  share of the global batch, so that uneven last batches stay exact) and **reduce-scattered**
  (``torch.distributed.reduce_scatter_tensor``: rank ``r`` receives the sum over ranks of shard ``r``); each
  rank runs the update graph over its shards only (the optimizer formulas of :mod:`revgraph.train`,
  :func:`revgraph.train.optimizers.update`, on flat vectors: they are elementwise, so a flat update is the per-tensor
  one), writing the new shard into its place in the unit; then every unit is **all-gathered**
  (``all_gather_into_tensor``, the rank's shard read in place) so that every rank holds all the new parameters
  (on the CPU left in flight until something needs them: :class:`.swap.Settling`);
- ``"gradients"`` (ZeRO-2) also keeps no full gradient: the grad graph is cut into one segment per unit
  (:mod:`revgraph.train.distributed.grad_segments`), each segment writes its unit's gradients into **one** bucket-sized
  buffer that is reduce-scattered into the rank's gradient shard before the next segment runs. Gradient memory per
  rank: the shards (``1 / W``) plus that one buffer, plus, transiently, any gradient the backward finishes in an
  earlier unit's segment (:attr:`ShardedEngine.plan`). When the grad graph cannot be cut (no types for the
  values crossing a cut), the whole grad graph runs at once: the full gradients then exist during the
  backward, and only the shards and one bucket are kept between steps. The last unit's shard is its slice of
  the bucket. The default unit size keeps shards + bucket within the unsharded gradient bytes
  (:func:`~revgraph.train.distributed.shard_plan.default_unit_groups`);
- on the CPU (gloo) the reduce-scatter and the all-gather go **pairwise** (:mod:`revgraph.train.distributed.swap`:
  gloo's collectives cost several times the same bytes sent between pairs), received into parameter chunks nothing
  reads then; a unit whose parameters a later segment still reads is all-reduced in place with more than one peer.

ZeRO-3 (``shard="parameters"``, every rank also keeping only its shard of the parameters) is
:mod:`revgraph.train.distributed.param_sharding`, a subclass.

Sparse embedding tables (``TrainingGraph.sparse``: gradients as rows, updated by
:func:`~revgraph.train.optimizers.sparse_update`) stay replicated and updated on every rank as in the unsharded engine
(their rows are all-gathered); the step counter too.

Checkpoints and reads: :meth:`ShardedEngine.read` all-gathers the state shards (a collective: every rank calls
it, the trainer saves on rank 0 only), so checkpoints hold full arrays in the format of unsharded runs and load
at any world size, sharded or not; :meth:`ShardedEngine.load` takes full arrays and keeps the rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...errors import InputError, InternalError, RevgraphError
from ...ir.inplace import inplace_pairs
from ...runtime import _first_line
from ...runtime.devices import Device, ortvalue_from_dlpack, torch_from_ortvalue
from ...runtime.options import ENV_ALLOCATORS, RuntimeOptions, config_entry, session_options
from ..graphs import TrainingGraph, split_step
from . import swap
from .data_parallel import Collective, DistributedEngine, collective
from .exchange import BUCKET_MB, read_from, torch_dtype
from .exchange import bucket_bytes as _bucket_bytes
from .overlap import run_bound
from .shard_plan import Unit, default_unit_groups, plan_units, ready_order, shard_update_graph
from .sharded_state import ShardedState
from .swap import all_gather_tensor, reduce_scatter_tensor

#: ``shard=`` of :class:`revgraph.Trainer` and ``--shard`` of ``revgraph train``.
SHARDS = ("none", "optimizer", "gradients", "parameters")


class ShardedEngine(swap.Settling, ShardedState, DistributedEngine):
    """A data-parallel step with sharded optimizer state (``mode="optimizer"``, ZeRO-1) or sharded optimizer
    state and gradients (``mode="gradients"``, ZeRO-2); module doc. ``bucket_bytes``: the largest unit (default
    :data:`revgraph.train.distributed.exchange.BUCKET_MB`, DDP's 25 MiB; ZeRO-2: no more than keeps its gradient
    memory within the unsharded engine's, :func:`~revgraph.train.distributed.shard_plan.default_unit_groups`).

    Parameters, gradients and state are torch tensors on ``comm.tdevice`` (gloo on CPU, NCCL on CUDA), shared
    with onnxruntime through DLPack. :meth:`read` and :meth:`load` see full arrays; :meth:`read` of optimizer
    state is a collective (every rank must call it, in the same order). Raises :class:`RevgraphError` (one line)
    when onnxruntime refuses a graph or a collective fails."""

    #: reads gather from every rank: the trainer calls :meth:`read` on every rank (and writes on rank 0)
    gathers = True

    def __init__(self, spec: TrainingGraph, threads: int, device: Device, comm: Collective,
                 runtime: RuntimeOptions | None = None, mode: str = "optimizer", bucket_bytes: int | None = None,
                 reduce_dtype: str = "fp32"):
        import onnxruntime as ort

        if mode not in SHARDS[1:]:
            raise RevgraphError(f"shard must be one of {', '.join(SHARDS)}, got {mode!r}")
        if reduce_dtype != "fp32":  # (Trainer refuses it first: revgraph.cli.exchange.refused_combination)
            raise InputError(f"reduce_dtype={reduce_dtype!r} does not combine with sharding")
        torch = comm.torch
        self.comm, self.mode = comm, mode
        self.times = None  # per-phase timings, when profiled (revgraph.train.steptimes)
        # (not Engine.__init__: it would allocate full optimizer state, which is what sharding avoids)
        self.spec, self.device, self.runtime = spec, device, runtime
        self.options = session_options(runtime, threads)
        self.names = [i for i, _ in spec.carried()]
        self.shared = frozenset(self.names)
        self._loss = [ort.OrtValue.ortvalue_from_numpy(np.zeros((), spec.graph.outputs[0].dtype))]
        self._current, self._previous, self._gathering = 0, None, None
        dev, world = comm.tdevice, comm.world_size
        self.grad_graph, _ = split_step(spec)
        # ZeRO-2 packs the units in the order the backward finishes the gradients (DDP rebuilds its buckets in
        # that order after the first step), so that each segment of the cut finishes whole units
        cap = bucket_bytes or _bucket_bytes(BUCKET_MB)
        if bucket_bytes is None and mode == "gradients":  # no more gradient memory than unsharded
            made = {o: k for k, n in enumerate(self.grad_graph.nodes) for o in n.outputs if o}
            finish = {p: made.get(spec.grads[p][0], -1) for p in spec.params if p not in spec.sparse}
            groups = default_unit_groups(spec, world, ready_order(self.grad_graph, spec), cap, finish)
            self.units = plan_units(spec, world, comm.rank, cap, groups=groups)
        else:
            self.units = self._plan_units(cap)
        self._fold, self._folded = 0, None
        values, self._tensors, self._where = {}, {}, {}
        for j, u in enumerate(self.units):
            tdt = torch_dtype(torch, spec.initial[u.names[0]].dtype)
            self._place(u, tdt, values)
            u.state = [self._state_zeros(u.k, tdt) for _ in spec.optimizer.slots]
            if j == len(self.units) - 1:  # on the CPU the loss rides along in one more element after the last unit,
                # as in the unsharded last bucket (gloo's latency per call dominates small steps: docs/benchmarks.md)
                self._fold = (dev.type == "cpu" and mode != "parameters" and not spec.sparse
                              and u.dtype in (np.float32, np.float64)) * 1
            if mode == "optimizer":  # reduce-scattered in place: the shard is the rank's slice of the unit
                u.grad = torch.zeros(u.length + 1, dtype=tdt, device=dev)[:u.length]  # (+1: the loss's element)
                u.gshard = u.grad[u.lo:u.lo + u.k]
            elif mode == "gradients" and j == len(self.units) - 1:  # reduce-scattered last: in place in the bucket
                self.bucket = torch.zeros(max([v.length * v.dtype.itemsize for v in self.units[:-1]]
                                              + [(u.length + self._fold) * tdt.itemsize]), dtype=torch.uint8,
                                          device=dev)
                u.gshard = self.bucket[:u.length * tdt.itemsize].view(tdt)[u.lo:u.lo + u.k]
            else:
                u.gshard = torch.zeros(u.k, dtype=tdt, device=dev)
            for p, o in zip(u.names, u.offsets, strict=True):
                self._where[p] = (j, None, o)
                for i, s in enumerate(spec.state[p]):
                    self._where[s] = (j, i, o)
        for p in spec.sparse:  # replicated, as unsharded
            self._tensors[p] = torch.from_numpy(np.array(spec.initial[p])).to(dev)
            self._tensors.update((s, self._state_zeros(self._tensors[p].shape, self._tensors[p].dtype))
                                 for s in spec.state[p])
        self._tensors[spec.step] = self._state_zeros((), torch.int64)
        if spec.total:  # a schedule's total steps (revgraph.train.schedules), set by fit
            self._tensors[spec.total] = self._state_zeros((), torch.int64)
        values.update((n, ortvalue_from_dlpack(t)) for n, t in self._tensors.items())
        self._sets = [values, values]  # one set: every name is updated in place (or copied back)
        self._empty_rows = [torch.zeros((0, *spec.initial[p].shape[1:]),
                                        dtype=torch_dtype(torch, spec.initial[p].dtype), device=dev)
                            for p in spec.sparse]
        # the loss and every rank's count of sparse rows, all-reduced in float64 (revgraph.train.distributed.exchange's
        # tail)
        self._tail = torch.zeros(1 + world * len(spec.sparse), dtype=torch.float64, device=dev)
        self._sparse = [(p, *spec.grads[p]) for p in spec.sparse]
        self._build_update()
        self._build_backward()
        pairwise = self.device.kind == "cpu" and not self._sharded(None)  # (where each unit receives: .swap's doc)
        self._receive = [swap.receivers(u, comm.rank, world, self.plan, j, self.bucket) if pairwise else None
                         for j, u in enumerate(self.units)]
        self._losses = torch.zeros(world, dtype=torch.float64, device=dev)  # (each rank's loss, exchanged pairwise)

    def _plan_units(self, cap: int) -> list[Unit]:
        """The flat units of at most ``cap`` bytes (:func:`plan_units`): ZeRO-1 in reverse parameter order, ZeRO-2 in
        the order the backward finishes the gradients."""
        order = ready_order(self.grad_graph, self.spec) if self.mode == "gradients" else None
        return plan_units(self.spec, self.comm.world_size, self.comm.rank, cap, order)

    def _place(self, u: Unit, tdt, values: dict) -> None:
        """Allocate unit ``u``'s full flat parameter from the initial values; ``values``: each view's ``OrtValue``."""
        # (one element more than the unit: the last unit's pairwise exchange receives the peer's loss there, .swap)
        u.param = self.comm.torch.zeros(u.length + 1, dtype=tdt, device=self.comm.tdevice)[:u.length]
        for n, view in u.views(u.param).items():
            view.copy_(read_from(self.comm.torch, self.spec.initial[n]))
            values[n] = ortvalue_from_dlpack(view)

    def _own(self, u: Unit):
        """This rank's shard of unit ``u``'s parameters (what the update graph writes)."""
        return u.param[u.lo:u.lo + u.k]

    def _build_backward(self) -> None:
        """The sessions and buffers of the backward: ZeRO-1 one grad graph run, ZeRO-2 its segments."""
        mode, spec = self.mode, self.spec
        self.plan = None
        if mode == "gradients":  # (the bucket, made with the units: the largest unit's bytes, viewed as each unit's)
            self._build_segments()
        else:
            self.bucket = None
        if self.plan is None:  # ZeRO-1, or a grad graph that cannot be cut: one run writes every gradient
            self._grad = self.session(self.grad_graph, "gradient graph")
            self._grad_values = {spec.grads[p][0]: ortvalue_from_dlpack(v) for u in self.units
                                 for p, v in u.views(u.grad).items()} if mode == "optimizer" else {}
            self._rebind()

    def _gather_parameters(self, defer: bool = False) -> None:
        """Every rank's new parameter shards into every rank's units (ZeRO-1/2, after the update, or after a step
        not applied): pairwise on the CPU (:func:`.swap.all_gather`), else ``all_gather_into_tensor``. ``defer``
        (the CPU, after a step): leave it in flight; :meth:`settle` waits for it, and every public method calls
        :meth:`settle` first (:class:`.swap.Settling`)."""
        dist, n = self.comm.dist, len(self.units)
        with collective("the parameter all-gather"):
            if self.device.kind == "cpu":
                works = [swap.all_gather(dist, u.param, self.comm.rank, self.comm.world_size, u.k, n + j)
                         for j, u in enumerate(self.units)]
                if defer:
                    self._gathering = works
                    return
            else:
                works = [all_gather_tensor(dist)(u.param, self._own(u), async_op=True) for u in self.units]
            for w in works:
                w.wait()

    def settle(self) -> None:
        """Wait for the parameter all-gather the last step left in flight, if any (a collective's wait: raises
        :class:`~revgraph.train.distributed.data_parallel.CollectiveError`, one line, when a peer is lost)."""
        pending, self._gathering = self._gathering, None
        if pending:
            with collective("the parameter all-gather"):
                for w in pending:
                    w.wait()

    def _bucket(self, u: Unit):
        """The bucket as unit ``u``'s flat gradient (ZeRO-2)."""
        return self.bucket[:u.length * u.gshard.element_size()].view(u.gshard.dtype)

    # ------------------------------------------------------------------------------------------ building

    def _state_zeros(self, shape, dtype):
        """A zero tensor of optimizer state or the step: on the device (in host memory when offloaded,
        :mod:`revgraph.train.offload_sharded`)."""
        return self.comm.torch.zeros(shape, dtype=dtype, device=self.comm.tdevice)

    def _for_update(self, t, back: bool = False):
        """The tensor the update graph reads for ``t`` (``back``: and writes, a parameter shard): ``t`` itself
        (a host copy when offloaded)."""
        return t

    def _build_update(self, home: Device | None = None) -> None:
        """The update graph's session (on ``home``, default the device) and its binding to the shards."""
        graph, pairs, self._unit_names = shard_update_graph(self.spec, self.units)
        self._update = self.session(graph, "sharded update graph", home)
        unsafe = inplace_pairs(graph, pairs)
        self._in_tensors = {}  # torch tensor of each carried input, for values written to scratch and copied back
        grads = {}
        for j, u in enumerate(self.units):
            p, g, state = self._unit_names[j]
            self._in_tensors[p] = self._for_update(self._own(u), back=True)
            self._in_tensors.update(zip(state, u.state, strict=True))
            grads[g] = self._for_update(u.gshard)
        # (the sparse tables are parameters; their state and the step are already where _state_zeros put them)
        self._in_tensors.update((n, self._for_update(t, True) if n in self.spec.sparse else t)
                                for n, t in self._tensors.items())
        ort_in = {n: ortvalue_from_dlpack(t) for n, t in {**self._in_tensors, **grads}.items()}
        # a pair that may not share a buffer (inplace_pairs: the step, read twice) writes a scratch tensor,
        # copied back after the run
        self._update_scratch = {i: self._in_tensors[i].clone() for i, _ in pairs if i in unsafe}
        ub = self._update.io_binding()
        self._clip_squares = None  # clipping: the dense gradients' squared norm over all ranks' shards
        if "clip" in self._unit_names:
            self._clip_squares = self.comm.torch.zeros((), dtype=self.comm.torch.float64, device=self.comm.tdevice)
            ub.bind_ortvalue_input(self._unit_names["clip"], ortvalue_from_dlpack(self._for_update(self._clip_squares)))
        for j in range(len(self.units)):
            g = self._unit_names[j][1]
            ub.bind_ortvalue_input(g, ort_in[g])
        for i, o in pairs:
            ub.bind_ortvalue_input(i, ort_in[i])
            scratch = self._update_scratch.get(i)
            ub.bind_ortvalue_output(o, ortvalue_from_dlpack(scratch) if scratch is not None else ort_in[i])
        self._ub = ub

    def _copy_for_update(self, down: bool) -> None:
        """Copy the update's inputs to the tensors it reads (``down``), or its new parameters back (nothing to
        copy unless offloaded)."""

    def _build_segments(self) -> None:
        """ZeRO-2: cut the grad graph into one segment per unit (:mod:`revgraph.train.distributed.grad_segments`);
        ``plan`` stays ``None`` when it cannot be cut."""
        from .grad_segments import cut

        spec = self.spec
        grads = [[spec.grads[p][0] for p in u.names] for u in self.units]
        sizes = {spec.grads[p][0]: spec.initial[p].nbytes for u in self.units for p in u.names}
        self.plan = cut(self.grad_graph, grads, sizes)
        if self.plan is None:
            return
        self._flats = [self._bucket(u) for u in self.units]  # (made once: a step's Python is part of its time)
        views = [{spec.grads[p][0]: v for p, v in u.views(f).items()}
                 for u, f in zip(self.units, self._flats, strict=True)]
        direct = self.plan.direct
        self._direct_views = {g: ortvalue_from_dlpack(v) for vs in views for g, v in vs.items() if g in direct}
        self._copied = [[(g, v) for g, v in vs.items() if g not in direct] for vs in views]
        self._segment_sessions = self._segment_sessions_of([s.graph for s in self.plan.segments],
                                                           "gradient graph segment")

    def _segment_sessions_of(self, graphs: list, what: str) -> list:
        """One session per segment graph, all sharing one CPU arena where onnxruntime allows (not one each)."""
        from .grad_segments import shared_cpu_arena

        options = self.options
        if self.device.kind == "cpu" and shared_cpu_arena() and config_entry(options, ENV_ALLOCATORS) != "1":
            self.options = session_options(self.runtime, options.intra_op_num_threads)
            self.options.add_session_config_entry(ENV_ALLOCATORS, "1")  # (set twice, onnxruntime warns)
        try:
            return [self.session(g, f"{what} {k + 1}/{len(graphs)}") for k, g in enumerate(graphs)]
        finally:
            self.options = options

    def _rebind(self) -> None:
        """The grad graph's binding for ZeRO-1 (one run writing the unit gradients in place)."""
        spec = self.spec
        gb = self._grad.io_binding()
        for p in spec.params:
            gb.bind_ortvalue_input(p, self._sets[0][p])
        gb.bind_ortvalue_output(spec.loss.loss, self._loss[0])
        for g, value in self._grad_values.items():
            gb.bind_ortvalue_output(g, value)
        self._grad_bindings = [gb]

    # ------------------------------------------------------------------------------------------ undo

    @property
    def can_undo(self) -> bool:
        return self._previous is not None

    def undo(self) -> None:
        """Return to the values a ``keep_previous`` step kept: every rank its own shards, then the parameters are
        gathered again (a collective: every rank undoes the same step, the loss being global). Raises
        :class:`InternalError` when the last step kept none."""
        if self._previous is None:
            raise InternalError("the last sharded training step kept no previous values (step with "
                                "keep_previous=True to undo it)")
        for t, saved in self._previous:
            t.copy_(saved)
        self._previous = None
        if not self._sharded(None):  # every rank restored its own shards (the others may hold gradients: .swap)
            self._gather_parameters()

    def _snapshot(self) -> list:
        kept = [self._own(u) for u in self.units] + [t for u in self.units for t in u.state]
        return [(t, t.clone()) for t in kept + list(self._tensors.values())]

    # ------------------------------------------------------------------------------------------ running

    def step(self, feeds, count: int, total: int, *,
             accept: Callable[[float], bool] | None = None, keep_previous: bool = False) -> float:
        self._previous = None
        times = self.times
        if times is not None:
            times.begin()
        loss, inputs = self._sharded_gradients(feeds, count, total)
        if accept is not None and not accept(loss):
            if not self._sharded(None):  # (every rank declines alike: the loss is global) the chunks that received
                self._gather_parameters()
            return loss
        start = times.now() if times is not None else 0.0
        if keep_previous:
            self._previous = self._snapshot()
        if self._clip_squares is not None:  # every shard's squares (padding is zero), summed over the ranks
            torch = self.comm.torch
            self._clip_squares.copy_(sum((torch.sum(u.gshard.double() ** 2) for u in self.units),
                                         torch.zeros((), dtype=torch.float64, device=self.comm.tdevice)))
            with collective("the all-reduce of the gradient norm"):
                self.comm.dist.all_reduce(self._clip_squares)
        for name, value in inputs.items():
            self._ub.bind_ortvalue_input(name, value)
        self._synchronize()
        self._copy_for_update(True)  # (offloaded: the shards to the host)
        try:
            self._update.run_with_iobinding(self._ub)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
            raise RevgraphError(f"the update step failed: {_first_line(exc)}") from None
        for i, t in self._update_scratch.items():
            self._in_tensors[i].copy_(t)
        self._copy_for_update(False)  # (offloaded: the new parameter shards back to the device)
        self._synchronize()  # onnxruntime's writes are done before the collective reads the shards
        if not self._sharded(None):  # (on the CPU left in flight until the next step, or any other call, needs it)
            self._gather_parameters(defer=True)
            self._synchronize()
        if times is not None:  # the update of the rank's shards and the all-gather of the new parameters
            times.add("update", start)
        return loss

    def _sharded_gradients(self, feeds: dict[str, np.ndarray], count: int, total: int) -> tuple[float, dict]:
        """Backward, gradients reduce-scattered into the shards (scaled by ``count / total``), sparse rows
        all-gathered: the loss of the global batch and the update's sparse inputs."""
        if isinstance(feeds, list):  # micro-batches (Trainer.fit refuses more than one with ZeRO-1/2)
            feeds, count = feeds[0]
        dist, times = self.comm.dist, self.times
        scale = count / total
        start = times.now() if times is not None else 0.0
        self._loss_sum, self._rows = 0.0, [[] for _ in self._sparse]
        self._tail.zero_()
        self._folded = None
        with collective("the gradient reduce-scatter"):
            if self.plan is not None:
                _, sparse = self._run_segments(feeds, count, scale)
            elif self.mode == "gradients":
                _, sparse = self._run_whole(feeds, count, scale)
            else:
                _, sparse = self._run_grad(feeds) if count else (0.0, {})
                works = []
                for j, u in enumerate(self.units):
                    if not count:
                        u.grad.zero_()
                    u.grad.mul_(scale)
                    works.append(self._reduce_unit(j, u.grad, async_op=True,
                                                   loss=float(self._loss[0].numpy()) * scale if count else 0.0))
                for w in works:
                    if w is not None:  # (the unit carrying the loss is reduced at once)
                        w.wait()
            if times is not None:
                times.add("forward+backward", start)
                start = times.now()
            if count:
                self._take(scale, sparse)  # this rank's weighted loss and rows, and the counts in the tail
            else:
                self._fill_tail()
            if self._folded is not None:  # the loss summed with the last unit's gradients
                self._tail[0] = self._folded
            else:
                dist.all_reduce(self._tail)
            inputs = self._exchange_rows()
        if times is not None:
            times.add("exchange", start)
        return float(self._tail[0].item()), inputs

    def _run_whole(self, feeds: dict[str, np.ndarray], count: int, scale: float) -> tuple[float, dict]:
        """ZeRO-2 when the grad graph could not be cut: one run writes every gradient (onnxruntime allocates
        them); each unit is copied into the bucket and reduce-scattered, and its gradients are dropped."""
        torch, spec = self.comm.torch, self.spec
        dense = [spec.grads[p][0] for u in self.units for p in u.names]
        out: dict[str, object] = {}
        if count:
            b = self._grad.io_binding()
            for name, arr in feeds.items():
                b.bind_cpu_input(name, arr)
            for p in spec.params:
                b.bind_ortvalue_input(p, self._sets[0][p])
            b.bind_ortvalue_output(spec.loss.loss, self._loss[0])
            names = [*dense, *(n for _, idx, rows in self._sparse for n in (idx, rows))]
            for n in names:
                b.bind_output(n, self.device.ort_type, self.device.index)
            try:
                self._grad.run_with_iobinding(b)
            except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
                raise RevgraphError(f"the gradient step failed: {_first_line(exc)}") from None
            out = dict(zip(names, b.get_outputs()[1:], strict=True))
            del b
        for j, u in enumerate(self.units):
            flat = self._bucket(u)
            flat.zero_()
            if count:
                for p, v in u.views(flat).items():
                    v.copy_(torch_from_ortvalue(torch, out.pop(spec.grads[p][0])))
            flat.mul_(scale)
            self._synchronize()
            self._reduce_unit(j, flat, loss=float(self._loss[0].numpy()) * scale if count else 0.0)
        return (float(self._loss[0].numpy()) if count else 0.0), out

    def _run_segments(self, feeds: dict[str, np.ndarray], count: int, scale: float) -> tuple[float, dict]:
        """ZeRO-2 with a cut: run the segments in order; after each, reduce-scatter the units it finishes
        (:attr:`plan`) from the bucket into their shards, before the next segment writes the bucket again.
        Values crossing a cut are ``OrtValue``s onnxruntime allocated, dropped after their last reader."""
        torch, plan, spec = self.comm.torch, self.plan, self.spec
        live: dict[str, object] = {}
        for k, seg in enumerate(plan.segments):
            if count:
                fixed = {n: self._direct_views[n] for n in seg.outputs if n in self._direct_views}
                live.update(self._run_segment(self._segment_sessions[k], seg.inputs, seg.outputs, feeds,
                                              lambda n: live[n] if n in live else self._sets[0][n],
                                              {**fixed, spec.loss.loss: self._loss[0]}))
            for j in seg.reduce:
                u, flat = self.units[j], self._flats[j]
                if count:
                    for g, v in self._copied[j]:  # finished apart from its unit: copied in
                        v.copy_(torch_from_ortvalue(torch, live[g]))
                    flat[u.used:].zero_()  # the padding (an earlier, larger unit wrote there)
                else:
                    flat.zero_()
                flat.mul_(scale)
                self._synchronize()
                self._reduce_unit(j, flat, loss=float(self._loss[0].numpy()) * scale if count else 0.0)
            self._synchronize()  # (CUDA) the next segment writes the bucket on onnxruntime's stream
            for n in seg.free:
                live.pop(n, None)
        loss = float(self._loss[0].numpy()) if count else 0.0
        return loss, {n: live[n] for _, idx, rows in self._sparse for n in (idx, rows)} if count else {}

    def _reduce_unit(self, j: int, flat, async_op: bool = False, loss: float = 0.0):
        """Sum unit ``j``'s gradient ``flat`` over the ranks into its ``gshard`` (module doc): a reduce-scatter, on
        the CPU pairwise (:mod:`.swap`) or an all-reduce in place (and a copy unless the shard is the slice);
        ``async_op``: the work, only then. The last unit there carries ``loss`` (the rank's, weighted), whose sum is
        left in ``_folded`` (that unit is reduced at once)."""
        dist, u = self.comm.dist, self.units[j]
        if self.device.kind != "cpu":
            return reduce_scatter_tensor(dist)(u.gshard, flat, async_op=async_op)
        fold = self._fold and j == len(self.units) - 1
        into, rank = self._receive[j], self.comm.rank
        # the unit's gradient and the element after it (ZeRO-2: in the bucket; ZeRO-1: its gradient's spare element)
        ext = (self.bucket[:(u.length + 1) * flat.element_size()].view(flat.dtype) if self.mode == "gradients"
               else u.grad._base) if fold else None
        if fold and self.comm.world_size == 2 and into is not None and into[1 - rank].data_ptr() != u.gshard.data_ptr():
            work = swap.reduce_scatter_and_loss(dist, ext, u.param._base, u.gshard, rank, u.k, loss)
            work.wait()
            self._folded = work.result
            return None
        if into is not None:
            if fold:
                self._losses[rank] = loss
            work = swap.reduce_scatter(dist, flat, into, u.gshard, rank, u.k, j, self._losses if fold else None)
            if async_op and not fold:
                return work
            work.wait()
            if fold:
                self._folded = float(self._losses.sum())
            return None
        if fold:  # the loss in the element after it
            ext[u.length] = loss
            dist.all_reduce(ext)
            self._folded = float(ext[u.length])
            return None
        work = dist.all_reduce(flat, async_op=async_op)
        if u.gshard.data_ptr() != flat.data_ptr() + u.lo * flat.element_size():
            u.gshard.copy_(flat[u.lo:u.lo + u.k])
        return work

    def _run_segment(self, session, inputs: list[str], outputs: list[str], feeds: dict, value, fixed: dict) -> dict:
        """Run one segment's ``session``: ``inputs`` from ``feeds`` (host arrays) or ``value(name)`` (``OrtValue``),
        ``outputs`` into ``fixed`` (name -> ``OrtValue``) or allocated by onnxruntime on the device. Returns the
        allocated outputs by name; :class:`RevgraphError` (one line) when the run fails."""
        outs = run_bound(session, inputs, outputs, lambda n: feeds[n] if n in feeds else value(n), fixed, self.device)
        return {n: v for n, v in zip(outputs, outs, strict=True) if n not in fixed}
