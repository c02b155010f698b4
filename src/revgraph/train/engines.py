"""Run training-step graphs step after step, with the parameters and optimizer state kept on the device.

:class:`Engine` holds the parameters, the optimizer state and the step counter in onnxruntime ``OrtValue``
buffers on the device (:mod:`revgraph.runtime.devices`), never copied through numpy between steps; each step rebinds
only the batch, and only the loss (a scalar) is copied out per step. Two layouts:

- **two buffer sets** (:class:`FusedEngine`): one step reads the current set and writes the new values straight
  into the other set, and the sets swap roles. It runs the fused step graph of
  :func:`revgraph.train.training_graph` (forward, backward and update in one graph). Parameters and state take
  twice their size (6P for Adam's parameters, first and second moments).
- **one buffer set** (:class:`SplitEngine`): the step graph cut in two (:func:`revgraph.train.split_step`): the
  grad graph writes the loss and the gradients (into buffers kept from step to step), then the update graph
  writes each new value into the buffer of the old one: its output ``p.new`` is bound to the ``OrtValue`` of
  its input ``p``. That is done for each pair that :func:`revgraph.ir.inplace.inplace_pairs` finds safe (every node
  that may read the old value runs before the node writing the new one); the other pairs (the int64 step,
  read twice by the update) keep two buffers that swap. Parameters, state and gradients take 4P for Adam.
  onnxruntime writes the bound buffers themselves (their data pointers do not change) and the numbers equal the
  fused engine's bitwise: the same nodes run on the same values.

Undoing a step (:meth:`Engine.undo`, which the trainer uses to reject a step that left a parameter NaN or
infinite): two sets still hold the values from before the last step. One set holds them only when the step was
asked to keep them (``keep_previous=True``: the update then writes a fresh set, and the old one is kept until
:meth:`Engine.release` or the next step). A step whose loss fails ``accept`` is not applied at all (the split
engine runs no update; the fused engine swaps back).

The data-parallel engine of :mod:`revgraph.train.distributed.data_parallel` is a :class:`SplitEngine` with an all-reduce
between the halves.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from ..errors import InternalError, RevgraphError
from ..ir.inplace import inplace_pairs
from ..onnx_io import to_onnx
from ..onnx_io.external_data import session_source
from ..runtime import _first_line
from ..runtime.devices import Device
from ..runtime.options import RuntimeOptions, disabled_optimizers, exact_products, refusal, session_options
from ..runtime.shared_initializers import FrozenInputs, SharedInitializers
from .graphs import TrainingGraph, eval_graph, split_step
from .steptimes import StepTimes

#: ``buffers=`` of :class:`revgraph.Trainer`: one set (:class:`SplitEngine`), two (:class:`FusedEngine`).
BUFFERS = ("one", "two")


@contextmanager
def failing(what: str):
    """onnxruntime's failure of a run inside the block as :class:`RevgraphError`: ``<what> failed: <its first
    line>``. (A context manager, not a function around the run: the run stays in its caller's frame.)"""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
        raise RevgraphError(f"{what} failed: {_first_line(exc)}") from None


class Engine:
    """The device-resident training state of ``spec`` and the sessions that update it.

    ``threads`` is onnxruntime's intra-op thread count (0: its default); ``device`` a :class:`Device`;
    ``runtime`` onnxruntime's memory settings (:class:`RuntimeOptions`; ``None``: onnxruntime's defaults);
    ``shared``: the carried names whose old and new values share one buffer (the others get two that swap);
    ``offload``: a :class:`revgraph.train.offload.HostUpdate` keeping the buffer sets in host memory (``None``: on
    the device). Raises :class:`RevgraphError` (one line) when onnxruntime refuses a graph or the device is missing.
    """

    offload = None  # (engines that do not run this __init__, such as the sharded ones, have no HostUpdate)

    def __init__(self, spec: TrainingGraph, threads: int, device: Device, runtime: RuntimeOptions | None = None,
                 shared: frozenset[str] = frozenset(), offload=None):
        import onnxruntime as ort

        self.spec, self.device, self.runtime = spec, device, runtime
        self.offload = offload
        self.home = offload.home if offload is not None else device  # where the buffer sets live
        self.options = session_options(runtime, threads)
        start = spec.initial_state()
        self.names = [i for i, _ in spec.carried()]
        self.shared = frozenset(shared)
        first = {i: self.home.ortvalue(start[i]) for i in self.names}
        self._sets = [first, {i: first[i] if i in self.shared else self.home.ortvalue(np.empty_like(start[i]))
                              for i in self.names}]
        self._loss = [ort.OrtValue.ortvalue_from_numpy(np.zeros((), spec.graph.outputs[0].dtype)) for _ in range(2)]
        # with clipping, the gradients' global norm before clipping, read after each step (None: not computed)
        self._norm = [ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.float64)) for _ in range(2)] \
            if spec.grad_norm else None
        self.grad_norm: float | None = None
        self._current = 0
        self._previous: dict | None = None  # the shared buffers from before the last step, when it kept them
        self.times: StepTimes | None = None  # per-phase timings of each step, when profiled
        if offload is not None:
            offload.attach(self)

    def session(self, graph, what: str, device: Device | None = None):
        """An onnxruntime session of ``graph`` on ``device`` (default the engine's); :class:`RevgraphError` if
        onnxruntime refuses it. On the CPU the graph's large float initializers are not copied into the session:
        they are inputs bound to the graph's own arrays in every IO binding the session hands out, so every session
        of the engine reads one copy (:mod:`revgraph.runtime.shared_initializers`)."""
        import onnxruntime as ort

        device = device or self.device
        providers = device.providers()
        written, shared = graph, {}
        if device.kind == "cpu" and (self.runtime is None or self.runtime.frozen_weights != "constants"):
            if getattr(self, "_initializers", None) is None:  # (engines that skip Engine.__init__ come here too)
                self._initializers = SharedInitializers()
            written, shared = self._initializers.split(graph)
        try:
            with session_source(to_onnx(written)) as source:  # a file for a model over 2 GiB (external data)
                sess = ort.InferenceSession(source, exact_products(self.options, graph), providers=providers,
                                            disabled_optimizers=disabled_optimizers(graph))
        except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
            raise RevgraphError(refusal(str(exc)) or f"onnxruntime refuses the {what}: {_first_line(exc)}") from None
        device.check_session(sess)
        return FrozenInputs(sess, shared) if shared else sess

    @property
    def _eval(self):
        """The evaluation graph's session, made on first use (a run that never evaluates holds none)."""
        if getattr(self, "_eval_session", None) is None:
            self._eval_session = self.session(eval_graph(self.spec), "evaluation graph")
        return self._eval_session

    # ------------------------------------------------------------------------------------------ state

    def value(self, name: str):
        """The current ``OrtValue`` of a carried name (a parameter, a state tensor, the step)."""
        return self._sets[self._current][name]

    def _compute(self, k: int, name: str):
        """The buffer of set ``k``'s ``name`` that the grad and evaluation graphs read: the device mirror of the
        current host value when offloaded (:mod:`revgraph.train.offload`)."""
        return self.offload.mirror[name] if self.offload is not None else self._sets[k][name]

    def read(self, names) -> dict[str, np.ndarray]:
        """Host copies of the current values of ``names``."""
        return {n: np.array(self.value(n).numpy()) for n in names}

    def load(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite current values (parameters, state, step) with host arrays of the same dtype and shape.
        Raises :class:`RevgraphError` for an unknown name or a mismatching array."""
        for name, arr in values.items():
            if name not in self._sets[self._current]:
                raise RevgraphError(f"{name!r} is not a parameter, optimizer state or step of this training run")
            cur = self.value(name)
            a = np.asarray(arr)
            if tuple(a.shape) != tuple(cur.shape()) or a.dtype != cur.numpy().dtype:
                raise RevgraphError(f"{name!r} has shape {list(a.shape)} and dtype {a.dtype}; this training run "
                                    f"needs shape {list(cur.shape())} and dtype {cur.numpy().dtype}")
            cur.update_inplace(np.ascontiguousarray(a))
        if self.offload is not None:
            self.offload.push(self)

    def _read_norm(self) -> None:
        """:attr:`grad_norm` of the step just run (its output is in the current set's buffer)."""
        if self._norm:
            self.grad_norm = float(self._norm[self._current].numpy())

    @property
    def steps(self) -> int:
        return int(self.value(self.spec.step).numpy())

    def held(self) -> dict[str, int]:
        """Bytes of the device buffers this engine keeps from step to step: ``"state"`` (parameters, optimizer
        state and step, each buffer counted once, the kept previous values included) and ``"gradients"``."""
        values = {id(v): v for s in self._sets for v in s.values()}
        values.update((id(v), v) for v in (self._previous or {}).values())
        grads = {id(v): v for v in self._gradient_buffers()}
        held = {"state": sum(_nbytes(v) for v in values.values()), "gradients": sum(_nbytes(v) for v in grads.values())}
        return self.offload.held(held) if self.offload is not None else held

    def _gradient_buffers(self) -> list:
        return []

    # ------------------------------------------------------------------------------------------ running

    def step(self, feeds: dict[str, np.ndarray] | list[tuple[dict[str, np.ndarray], int]], count: int, total: int,
             *, accept: Callable[[float], bool] | None = None, keep_previous: bool = False) -> float:
        """One optimizer step: ``feeds`` is this process's share (``count`` samples) of a global batch of
        ``total`` samples, or a list of micro-batches ``[(feeds, count), ...]`` whose gradients are summed
        (weighted by their sample counts) before the one exchange and update (gradient accumulation).
        Returns the loss of the global batch (its mean over the ``total`` samples).

        ``accept``: when given and ``accept(loss)`` is false, the step is not applied (parameters, state and
        step stay as they were). ``keep_previous``: keep the values from before the step, so that
        :meth:`undo` can return to them (two buffer sets always keep them)."""
        raise NotImplementedError

    def _swap(self) -> None:
        self._current = 1 - self._current  # the new values are in the other set: it becomes current

    @property
    def can_undo(self) -> bool:
        """Whether :meth:`undo` can return to the values before the last step."""
        return self._previous is not None or not self.shared

    def undo(self) -> None:
        """Return to the values before the last step (the other buffer set, or the values the last step kept
        with ``keep_previous``). Raises :class:`InternalError` when one buffer set was overwritten in place."""
        if self._previous is not None:
            for name, value in self._previous.items():
                self._sets[0][name] = self._sets[1][name] = value
            self._previous = None
            self._rebind()
        elif self.shared:
            raise InternalError("the last training step overwrote its buffers in place and kept no previous values "
                                "(step with keep_previous=True to undo it)")
        self._swap()

    def release(self) -> None:
        """Forget the values a ``keep_previous`` step kept (their memory is freed)."""
        self._previous = None

    def _rebind(self) -> None:
        """Bind the current buffers again after they changed (a kept or restored set)."""

    def evaluate(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``(loss, model output)`` of the loss graph on ``feeds`` with the current parameters."""
        binding = self._eval.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for p in self.spec.params:
            binding.bind_ortvalue_input(p, self._compute(self._current, p))
        binding.bind_output(self.spec.loss.loss)
        binding.bind_output(self.spec.loss.output)
        try:
            self._eval.run_with_iobinding(binding)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
            raise RevgraphError(f"evaluation failed: {_first_line(exc)}") from None
        loss, out = binding.copy_outputs_to_cpu()
        return loss, out


class FusedEngine(Engine):
    """One process, two buffer sets: the fused step graph, with one IO binding per direction between the sets."""

    def __init__(self, spec: TrainingGraph, threads: int, device: Device, runtime: RuntimeOptions | None = None):
        super().__init__(spec, threads, device, runtime)
        self._sess = self.session(spec.graph, "training graph")
        self._bindings = []
        for k in range(2):
            binding = self._sess.io_binding()
            for i, o in spec.carried():
                binding.bind_ortvalue_input(i, self._sets[k][i])
                binding.bind_ortvalue_output(o, self._sets[1 - k][i])
            binding.bind_ortvalue_output(spec.loss.loss, self._loss[k])
            if self._norm:
                binding.bind_ortvalue_output(spec.grad_norm, self._norm[k])
            self._bindings.append(binding)

    def step(self, feeds, count: int, total: int, *,
             accept: Callable[[float], bool] | None = None, keep_previous: bool = False) -> float:
        if isinstance(feeds, list):
            if len(feeds) != 1:
                raise RevgraphError("gradient accumulation (accumulate_steps > 1) needs buffers='one' (--buffers one): "
                                    "the fused step graph of two buffer sets updates after every batch")
            feeds = feeds[0][0]
        if self.times is not None:
            self.times.begin()
            start = self.times.now()
        binding = self._bindings[self._current]
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        try:
            self._sess.run_with_iobinding(binding)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
            raise RevgraphError(f"the training step failed: {_first_line(exc)}") from None
        if self.times is not None:  # one graph: the whole step counts as forward+backward
            self.times.add("forward+backward", start)
        loss = float(self._loss[self._current].numpy())
        self._read_norm()
        if accept is None or accept(loss):
            self._swap()
        return loss


class SplitEngine(Engine):
    """The step cut in two (module doc): the grad graph, then the update graph writing over its inputs where
    :func:`~revgraph.ir.inplace.inplace_pairs` finds it safe (``one_set=False``: nowhere, two buffer sets).

    Subclasses change what happens between the halves (:meth:`_gradients`) and where the gradients live
    (:meth:`_make_gradient_buffers`)."""

    def __init__(self, spec: TrainingGraph, threads: int, device: Device, runtime: RuntimeOptions | None = None,
                 one_set: bool = True, offload=None):
        self.grad_graph, self.update_graph = split_step(spec)
        self.unsafe = inplace_pairs(self.update_graph, spec.carried()) if one_set else {}
        shared = frozenset(i for i, _ in spec.carried() if one_set and i not in self.unsafe)
        super().__init__(spec, threads, device, runtime, shared, offload)
        self._sparse = [(p, *spec.grads[p]) for p in spec.sparse]
        self._grad_values = self._make_gradient_buffers()
        # the gradients the update reads: host copies when offloaded (revgraph.train.offload)
        self._update_grads = self._grad_values if offload is None else offload.gradients(
            self._grad_values, {spec.grads[p][0]: spec.initial[p] for p in spec.params})
        self._grad = self._make_grad_session()
        self._update = self.session(self.update_graph, "update graph", self.home)
        self._rebind()

    def _make_grad_session(self):
        """The session of the whole grad graph (``None`` when a subclass runs it otherwise, in segments)."""
        return self.session(self.grad_graph, "gradient graph")

    def _make_gradient_buffers(self) -> dict:
        """Device buffers of the dense gradients, by gradient name (a gradient has its parameter's shape)."""
        return {self.spec.grads[p][0]: self.device.ortvalue(np.empty_like(self.spec.initial[p]))
                for p in self.spec.params if p not in self.spec.sparse}

    def _gradient_buffers(self) -> list:
        return list(self._grad_values.values())

    def _rebind(self) -> None:
        spec = self.spec
        self._grad_bindings, self._update_bindings = [], []
        for k in range(2):
            if self._grad is not None:
                self._grad_bindings.append(self._bind_grad(k, self._grad_values))
            ub = self._update.io_binding()
            for i, o in spec.carried():
                ub.bind_ortvalue_input(i, self._sets[k][i])
                ub.bind_ortvalue_output(o, self._sets[1 - k][i])
            for g, value in self._update_grads.items():
                ub.bind_ortvalue_input(g, value)
            if self._norm:
                ub.bind_ortvalue_output(spec.grad_norm, self._norm[k])
            self._update_bindings.append(ub)

    def _bind_grad(self, k: int, into: dict):
        """An IO binding of the grad graph reading buffer set ``k`` and writing the dense gradients to ``into``."""
        gb = self._grad.io_binding()
        for p in self.spec.backward_reads():  # the parameters (and the fp16 loss scale)
            gb.bind_ortvalue_input(p, self._compute(k, p))
        gb.bind_ortvalue_output(self.spec.loss.loss, self._loss[k])
        for g, value in into.items():
            gb.bind_ortvalue_output(g, value)
        return gb

    def _run_grad(self, feeds: dict[str, np.ndarray], bindings: list | None = None) -> tuple[float, dict]:
        """Run the grad graph on ``feeds``: the loss, and the sparse gradients ``{name: OrtValue}`` (the dense
        ones are in their buffers: those of ``bindings``, one per buffer set, default the gradient buffers)."""
        gb = self._bind_batch(feeds, bindings)
        with self._grad_run():
            self._grad.run_with_iobinding(gb)
        return self._grad_outputs(gb)

    @contextmanager
    def _grad_run(self):
        """Around a run of the grad graph: its failure in one line, its time a segment of the timeline."""
        start = self.times.now() if self.times is not None else 0.0
        with failing("the gradient step"):
            yield
        if self.times is not None:
            self.times.event("segment", "grad graph", start)

    def _bind_batch(self, feeds: dict[str, np.ndarray], bindings: list | None = None):
        """The grad graph's binding of the current buffer set (from ``bindings``, default the gradient buffers'),
        with ``feeds`` bound and fresh outputs for the sparse rows (they change size from run to run)."""
        gb = (bindings or self._grad_bindings)[self._current]
        for name, arr in feeds.items():
            gb.bind_cpu_input(name, arr)
        for _, idx, rows in self._sparse:
            gb.bind_output(idx, self.device.ort_type, self.device.index)
            gb.bind_output(rows, self.device.ort_type, self.device.index)
        return gb

    def _grad_outputs(self, gb) -> tuple[float, dict]:
        """The loss and the sparse gradients ``{name: OrtValue}`` of the grad graph's run on ``gb``."""
        sparse = {}
        if self._sparse:
            outs = gb.get_outputs()[1 + len(self._grad_values):]  # bound after the loss and the dense gradients
            for j, (_, idx, rows) in enumerate(self._sparse):
                sparse[idx], sparse[rows] = outs[2 * j], outs[2 * j + 1]
        return float(self._loss[self._current].numpy()), sparse

    def _gradients(self, micro: list[tuple[dict, int]], total: int) -> tuple[float, dict]:
        """The loss of the global batch and the update graph's per-step inputs (sparse gradients by name), from
        the micro-batches ``micro`` (``(feeds, count)``; one without accumulation). The data-parallel engines
        override it (what happens between the halves of the step)."""
        start = self.times.now() if self.times is not None else 0.0
        if len(micro) > 1:
            out = self._accumulate(micro, total)
        else:  # (:meth:`_run_grad` written out: one call frame fewer on every batch's path to the session)
            gb = self._bind_batch(micro[0][0])
            with self._grad_run():
                self._grad.run_with_iobinding(gb)
            out = self._grad_outputs(gb)
        if self.times is not None:
            self.times.add("forward+backward", start)
        return out

    def _accumulate(self, micro: list[tuple[dict, int]], total: int) -> tuple[float, dict]:
        """Gradient accumulation in one process: each micro-batch's mean gradients weighted by ``count /
        total`` and summed (so the sum is the mean over all ``total`` samples), sparse rows weighted and
        concatenated. The sums are formed on the host (numpy): one process has no collective to overlap, and
        torch stays optional."""
        dense = dict(self._grad_values)
        acc: dict[str, np.ndarray] = {}
        pieces: dict[str, list] = {n: [] for _, idx, rows in self._sparse for n in (idx, rows)}
        loss = 0.0
        scaling, gb = self.spec.scaling, self._grad_bindings[self._current]
        if scaling is not None:  # the fp16 loss scale, read once (it is the update's to change)
            scale = self._sets[self._current][scaling.scale]
            scale_value = scale.numpy()
        for feeds, n in micro:
            if not n:
                continue
            w = n / total
            if scaling is not None:
                # GradScaler's accumulation, scaler.scale(loss * w).backward(): the weight goes into the backward's
                # seed (scale * w), not onto its result, so a micro-batch overflows (and its step is skipped) as in
                # PyTorch; weighting after a backward seeded with the whole scale overflowed K times sooner
                gb.bind_ortvalue_input(scaling.scale, self.device.ortvalue(
                    np.asarray(scale_value * scale_value.dtype.type(w), dtype=scale_value.dtype)))
                w = 1.0
            part, sparse = self._run_grad(feeds)
            loss += part * (n / total)
            for g, value in dense.items():
                a = value.numpy()
                with np.errstate(over="ignore", invalid="ignore"):  # (fp16: an overflow is the skip's signal)
                    if g in acc:
                        acc[g] += a * a.dtype.type(w)
                    else:
                        acc[g] = a * a.dtype.type(w)
            for _, idx, rows in self._sparse:
                r = sparse[rows].numpy()
                pieces[idx].append(sparse[idx].numpy())
                pieces[rows].append(r * r.dtype.type(w))
        if scaling is not None:
            gb.bind_ortvalue_input(scaling.scale, scale)  # (the carried buffer again)
        for g, value in dense.items():
            value.update_inplace(np.ascontiguousarray(acc[g]))
        inputs = {n: self.device.ortvalue(np.concatenate(parts)) for n, parts in pieces.items()}
        return loss, inputs

    def step(self, feeds, count: int, total: int, *,
             accept: Callable[[float], bool] | None = None, keep_previous: bool = False) -> float:
        self._previous = None
        micro = feeds if isinstance(feeds, list) else [(feeds, count)]
        times = self.times
        if times is not None:
            times.begin()
        loss, inputs = self._gradients(micro, total)
        if accept is not None and not accept(loss):
            return loss
        start = times.now() if times is not None else 0.0
        self._run_update(inputs, keep_previous)
        if times is not None:
            times.add("update", start)
            times.event("phase", "update", start)
        return loss

    def _run_update(self, inputs: dict, keep_previous: bool) -> None:
        """Run the update graph (``inputs``: OrtValues of this step's sparse gradients) and make the new values
        current; with ``keep_previous`` the shared names are written into fresh buffers, the old ones kept."""
        ub = self._update_bindings[self._current]
        fresh = self._fresh_shared() if keep_previous and self.shared else None
        if fresh is not None:
            ub = self._update.io_binding()
            k = self._current
            for i, o in self.spec.carried():
                ub.bind_ortvalue_input(i, self._sets[k][i])
                ub.bind_ortvalue_output(o, fresh[i] if i in fresh else self._sets[1 - k][i])
            for g, value in self._update_grads.items():
                ub.bind_ortvalue_input(g, value)
            if self._norm:
                ub.bind_ortvalue_output(self.spec.grad_norm, self._norm[k])
        self._synchronize()
        if self.offload is not None:  # this step's gradients to the host, where the update runs
            inputs = self.offload.pull(inputs)
        for name, value in inputs.items():
            ub.bind_ortvalue_input(name, value)
        try:
            self._update.run_with_iobinding(ub)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
            raise RevgraphError(f"the update step failed: {_first_line(exc)}") from None
        self._read_norm()
        if fresh is not None:
            self._previous = {n: self._sets[0][n] for n in fresh}
            for n, value in fresh.items():
                self._sets[0][n] = self._sets[1][n] = value
            self._rebind()
        self._swap()

    def _swap(self) -> None:
        super()._swap()
        if self.offload is not None:  # the new current parameters to the device mirror the grad graph reads
            self.offload.push(self)

    def _synchronize(self) -> None:
        """Wait for writes of other libraries to the update's inputs (nothing to wait for in one process)."""

    def _fresh_shared(self) -> dict:
        """New buffers for the shared names (written by a step that keeps the previous values)."""
        like = {self.spec.step: np.zeros((), np.int64), self.spec.total: np.zeros((), np.int64)}
        if self.spec.scaling is not None:
            like.update(self.spec.scaling.initial())
        for p in self.spec.params:
            like.update(dict.fromkeys([p, *self.spec.state[p]], self.spec.initial[p]))
        return {n: self.home.ortvalue(np.empty_like(like[n])) for n in self.shared}


def make_engine(spec: TrainingGraph, threads: int, device: Device, runtime: RuntimeOptions | None,
                buffers: str, offload=None) -> Engine:
    """The single-process engine for ``buffers`` (:data:`BUFFERS`); ``offload`` a
    :class:`revgraph.train.offload.HostUpdate` (one buffer set only)."""
    if buffers == "two":
        return FusedEngine(spec, threads, device, runtime)
    return SplitEngine(spec, threads, device, runtime, offload=offload)


def _nbytes(value) -> int:
    """Bytes of an ``OrtValue``'s tensor (read from its type: a device buffer is not copied to learn it)."""
    return int(np.prod(value.shape(), dtype=np.int64)) * _ITEMSIZE.get(value.data_type(), 4)


#: bytes per element of onnxruntime's tensor types
_ITEMSIZE = {"tensor(float)": 4, "tensor(double)": 8, "tensor(float16)": 2, "tensor(bfloat16)": 2,
             "tensor(int64)": 8, "tensor(int32)": 4, "tensor(int8)": 1, "tensor(uint8)": 1, "tensor(bool)": 1}
