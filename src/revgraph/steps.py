"""Run training-step graphs step after step, with the parameters and optimizer state kept on the device.

:class:`Engine` holds the parameters, the optimizer state and the step counter in two sets of onnxruntime
``OrtValue`` buffers on the device (:mod:`revgraph.devices`), never copied through numpy between steps: one
step reads the current set and writes the new values straight into the other set, and the sets swap roles.
Each step rebinds only the batch; only the loss (a scalar) is copied out per step.

:class:`FusedEngine` runs the fused step graph of :func:`revgraph.train.training_graph` (forward, backward and
update in one graph), the single-process path. The data-parallel engine of :mod:`revgraph.distributed` runs
the same graph cut in two (:func:`revgraph.train.split_step`) with an all-reduce between the halves.
"""

from __future__ import annotations

import numpy as np

from .devices import Device
from .errors import RevgraphError
from .external_data import session_source
from .onnx_io import to_onnx
from .runtime import _first_line
from .train import TrainingGraph, eval_graph


class Engine:
    """The device-resident training state of ``spec`` and the sessions that update it.

    ``threads`` is onnxruntime's intra-op thread count (0: its default); ``device`` a :class:`Device`.
    Raises :class:`RevgraphError` (one line) when onnxruntime refuses a graph or the device is missing.
    """

    def __init__(self, spec: TrainingGraph, threads: int, device: Device):
        import onnxruntime as ort

        self.spec, self.device = spec, device
        self.options = ort.SessionOptions()
        self.options.log_severity_level = 4
        self.options.intra_op_num_threads = threads
        self._eval = self.session(eval_graph(spec), "evaluation graph")
        start = spec.initial_state()
        self.names = [i for i, _ in spec.carried()]
        self._sets = [{i: device.ortvalue(start[i]) for i in self.names},
                      {i: device.ortvalue(np.empty_like(start[i])) for i in self.names}]
        self._loss = [ort.OrtValue.ortvalue_from_numpy(np.zeros((), spec.graph.outputs[0].dtype)) for _ in range(2)]
        self._current = 0

    def session(self, graph, what: str):
        """An onnxruntime session of ``graph`` on the device; :class:`RevgraphError` if onnxruntime refuses it."""
        import onnxruntime as ort

        providers = self.device.providers()
        try:
            with session_source(to_onnx(graph)) as source:  # a file for a model over 2 GiB (external data)
                sess = ort.InferenceSession(source, self.options, providers=providers)
        except Exception as exc:
            raise RevgraphError(f"onnxruntime refuses the {what}: {_first_line(exc)}") from None
        self.device.check_session(sess)
        return sess

    # ------------------------------------------------------------------------------------------ state

    def value(self, name: str):
        """The current ``OrtValue`` of a carried name (a parameter, a state tensor, the step)."""
        return self._sets[self._current][name]

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

    @property
    def steps(self) -> int:
        return int(self.value(self.spec.step).numpy())

    # ------------------------------------------------------------------------------------------ running

    def step(self, feeds: dict[str, np.ndarray], count: int, total: int) -> float:
        """One optimizer step: ``feeds`` is this process's share (``count`` samples) of a global batch of
        ``total`` samples. Returns the loss of the global batch (its mean over the ``total`` samples)."""
        raise NotImplementedError

    def _swap(self) -> None:
        self._current = 1 - self._current  # the new values are in the other set: it becomes current

    def undo(self) -> None:
        """Return to the values before the last step (they are still in the other buffer set)."""
        self._swap()

    def evaluate(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``(loss, model output)`` of the loss graph on ``feeds`` with the current parameters."""
        binding = self._eval.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for p in self.spec.params:
            binding.bind_ortvalue_input(p, self.value(p))
        binding.bind_output(self.spec.loss.loss)
        binding.bind_output(self.spec.loss.output)
        try:
            self._eval.run_with_iobinding(binding)
        except Exception as exc:
            raise RevgraphError(f"evaluation failed: {_first_line(exc)}") from None
        loss, out = binding.copy_outputs_to_cpu()
        return loss, out


class FusedEngine(Engine):
    """One process: the fused step graph, with one IO binding per direction between the two buffer sets."""

    def __init__(self, spec: TrainingGraph, threads: int, device: Device):
        super().__init__(spec, threads, device)
        self._sess = self.session(spec.graph, "training graph")
        self._bindings = []
        for k in range(2):
            binding = self._sess.io_binding()
            for i, o in spec.carried():
                binding.bind_ortvalue_input(i, self._sets[k][i])
                binding.bind_ortvalue_output(o, self._sets[1 - k][i])
            binding.bind_ortvalue_output(spec.loss.loss, self._loss[k])
            self._bindings.append(binding)

    def step(self, feeds: dict[str, np.ndarray], count: int, total: int) -> float:
        binding = self._bindings[self._current]
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        try:
            self._sess.run_with_iobinding(binding)
        except Exception as exc:
            raise RevgraphError(f"the training step failed: {_first_line(exc)}") from None
        loss = float(self._loss[self._current].numpy())
        self._swap()
        return loss
