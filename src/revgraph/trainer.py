"""Run a training-step graph step after step: :class:`Trainer` (``rg.Trainer``).

The parameters and the optimizer state live in onnxruntime ``OrtValue`` buffers between steps, never copied
through numpy: there are two sets of buffers, and one IO binding per direction. Binding A reads the current
set and writes the new parameters, state and step straight into the other set; binding B does the reverse.
Each step rebinds only the batch and runs one of the two bindings; the sets swap roles. Only the loss (a
scalar) is copied out per step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import onnx

from .errors import InputError, RevgraphError
from .ir import Graph
from .onnx_io import save, to_onnx
from .runtime import _first_line
from .train import Optimizer, TrainingGraph, eval_graph, training_graph

Data = Mapping[str, np.ndarray] | tuple


class Trainer:
    """Train ``model`` with ``loss`` and ``optimizer`` (see :mod:`revgraph.train` for the formulas).

    ``model`` is a :class:`Graph`, an ``onnx.ModelProto`` or a path; ``loss`` one of ``"cross-entropy"``,
    ``"mse"``, ``"bce"``; ``optimizer`` an :class:`revgraph.train.Optimizer` or a name (``"sgd"``,
    ``"adam"``, ``"adamw"`` with PyTorch's defaults). ``output`` picks the model output the loss reads (default:
    the only one), ``params`` the initializers to train (default: every floating-point one). ``threads`` is
    onnxruntime's intra-op thread count (0: its default). Raises :class:`RevgraphError` (one line) for bad
    names or a model revgraph cannot differentiate.

    Data (for :meth:`step`, :meth:`fit`, :meth:`evaluate`): a mapping with an array per model input (by
    name) and ``"labels"``, or ``{"x": ..., "y": ...}`` / a tuple ``(x, y)`` for a model with one input.
    Arrays share their first (sample) axis. Float inputs are cast to the declared dtype; labels are int64
    class indices for cross-entropy and floats of the output's shape for ``mse`` and ``bce``.
    """

    def __init__(self, model: Graph | onnx.ModelProto | str | os.PathLike, loss: str = "cross-entropy",
                 optimizer: Optimizer | str = "adam", *, output: str | None = None, params: Iterable[str] | None = None,
                 threads: int = 0, checkpoint: str = "store"):
        import onnxruntime as ort

        self.spec: TrainingGraph = training_graph(model, loss, optimizer, output=output, params=params,
                                                  checkpoint=checkpoint)
        self.losses: list[float] = []  # one per step, in order
        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.intra_op_num_threads = threads
        try:
            self._sess = ort.InferenceSession(to_onnx(self.spec.graph).SerializeToString(), options,
                                              providers=["CPUExecutionProvider"])
            self._eval = ort.InferenceSession(to_onnx(eval_graph(self.spec)).SerializeToString(), options,
                                              providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise RevgraphError(f"onnxruntime refuses the training graph: {_first_line(exc)}") from None
        pairs = self.spec.carried()
        start = self.spec.initial_state()
        # Two buffer sets; OrtValue.ortvalue_from_numpy wraps the array's memory (and keeps the array alive).
        self._sets = [
            {i: ort.OrtValue.ortvalue_from_numpy(np.array(start[i], order="C")) for i, _ in pairs},
            {i: ort.OrtValue.ortvalue_from_numpy(np.empty_like(start[i])) for i, _ in pairs},
        ]
        self._loss = [ort.OrtValue.ortvalue_from_numpy(np.zeros((), self._loss_dtype())) for _ in range(2)]
        self._bindings = []
        for k in range(2):
            binding = self._sess.io_binding()
            for i, o in pairs:
                binding.bind_ortvalue_input(i, self._sets[k][i])
                binding.bind_ortvalue_output(o, self._sets[1 - k][i])
            binding.bind_ortvalue_output(self.spec.loss.loss, self._loss[k])
            self._bindings.append(binding)
        self._current = 0

    def _loss_dtype(self) -> np.dtype:
        return self.spec.graph.outputs[0].dtype

    # ------------------------------------------------------------------------------------------ state

    @property
    def steps(self) -> int:
        """How many optimizer steps have been taken."""
        return int(self._sets[self._current][self.spec.step].numpy())

    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """The current parameters (copies), by initializer name."""
        return {p: np.array(self._sets[self._current][p].numpy()) for p in self.spec.params}

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The current optimizer state (copies), by state input name (``<param>.momentum``, ``.m``, ``.v``)."""
        names = [s for p in self.spec.params for s in self.spec.state[p]]
        return {s: np.array(self._sets[self._current][s].numpy()) for s in names}

    # ------------------------------------------------------------------------------------------ data

    def arrays(self, data: Data) -> dict[str, np.ndarray]:
        """``data`` as ``{model input: array, labels: array}`` with checked lengths and cast dtypes.

        Raises :class:`InputError` (one line) for missing arrays, different lengths, or labels that do not
        fit the loss (non-integer class indices, out-of-range classes, wrong shapes).
        """
        spec = self.spec
        names = spec.inputs
        if isinstance(data, tuple) and len(data) == 2:
            x, y = data
            data = {**x, "labels": y} if isinstance(x, Mapping) else {"x": x, "y": y}
        if not isinstance(data, Mapping):
            raise InputError("training data must be a mapping of arrays or a tuple (x, y)")
        data = dict(data)
        if "labels" not in data and {"x", "y"} <= set(data) and len(names) == 1:
            data = {names[0]: data["x"], "labels": data["y"]}
        missing = [n for n in [*names, "labels"] if n not in data]
        if missing:
            have = ", ".join(sorted(data)) or "none"
            raise InputError(f"the data lacks {', '.join(map(repr, missing))} (it has {have}); give an array per "
                             f"model input ({', '.join(names)}) plus 'labels', or 'x' and 'y' for a one-input model")
        types = {v.name: v for v in spec.graph.inputs}
        out: dict[str, np.ndarray] = {}
        for n in [*names, "labels"]:
            vi = types[spec.labels if n == "labels" else n]
            a = np.asarray(data[n])
            if a.dtype.kind not in "fiub":
                raise InputError(f"array {n!r} has dtype {a.dtype}; expected numbers")
            if n == "labels" and vi.dtype.kind == "i":
                if a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
                    raise InputError("cross-entropy labels must be integer class indices; 'labels' holds fractions")
            elif vi.dtype.kind != a.dtype.kind and not (vi.dtype.kind == "f" and a.dtype.kind in "iub"):
                raise InputError(f"array {n!r} has dtype {a.dtype}; the model declares {vi.describe()}")
            a = np.ascontiguousarray(a.astype(vi.dtype, copy=False))
            if vi.shape is not None and (a.ndim != len(vi.shape) or any(
                    isinstance(d, int) and d != s for d, s in zip(vi.shape[1:], a.shape[1:], strict=False))):
                what = "the labels" if n == "labels" else f"input {n!r}"
                raise InputError(f"array {n!r} has shape {list(a.shape)}; {what} must be {vi.describe()} "
                                 "(first axis: samples)")
            out[n] = a
        lengths = {n: len(a) for n, a in out.items()}
        if len(set(lengths.values())) != 1:
            raise InputError(f"arrays differ in length: {', '.join(f'{k} {v}' for k, v in lengths.items())}")
        if spec.loss.kind == "cross-entropy":
            c, labels = self._classes(), out["labels"]
            bad = labels[(labels < 0) | (labels >= c)] if c else labels[labels < 0]
            if bad.size:
                raise InputError(f"label {int(bad[0])} is not a class index in [0, {c or '?'})")
        return out

    @property
    def fixed_batch(self) -> int | None:
        """The batch size the model's inputs declare as a static first dimension (models exported with a
        fixed batch), or ``None`` when it is symbolic."""
        dims = [v.shape[0] for v in self.spec.model.inputs if v.shape and isinstance(v.shape[0], int)]
        return dims[0] if dims else None

    def _check_fixed_batch(self, batch_size: int, n: int) -> None:
        d = self.fixed_batch
        if d is not None and (batch_size != d or n % d):
            raise InputError(f"the model's inputs have a fixed first dimension {d}: train with batch size {d} "
                             f"(--batch-size {d}) on a multiple of {d} samples (got batch size {batch_size}, "
                             f"{n} samples)")

    def _classes(self) -> int | None:
        """The number of classes (the logits' last dimension) when it is static."""
        vi = next((v for v in self.spec.model.outputs if v.name == self.spec.loss.output), None)
        d = vi.shape[-1] if vi is not None and vi.shape else None
        return d if isinstance(d, int) else None

    def _feeds(self, arrays: dict[str, np.ndarray], rows) -> dict[str, np.ndarray]:
        labels = self.spec.labels
        return {labels if k == "labels" else k: np.ascontiguousarray(a[rows]) for k, a in arrays.items()}

    # ------------------------------------------------------------------------------------------ training

    def step(self, batch: Data) -> float:
        """One optimizer step on ``batch`` (all of it); returns the loss before the update."""
        return self._step(self._feeds(self.arrays(batch), slice(None)))

    def _step(self, feeds: dict[str, np.ndarray]) -> float:
        binding = self._bindings[self._current]
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        try:
            self._sess.run_with_iobinding(binding)
        except Exception as exc:
            raise RevgraphError(f"the training step failed: {_first_line(exc)}") from None
        loss = float(self._loss[self._current].numpy())
        self._current = 1 - self._current  # the new values are in the other set: it becomes current
        self.losses.append(loss)
        return loss

    def fit(self, data: Data, epochs: int = 1, batch_size: int = 32, *, shuffle: bool = True, seed: int = 0,
            progress: bool = True, console=None, description: str = "training") -> list[float]:
        """Train for ``epochs`` passes over ``data`` in batches of ``batch_size`` (the last batch of an epoch
        may be smaller). ``shuffle``: each epoch visits the samples in the order of
        ``numpy.random.default_rng(seed + epoch).permutation(n)`` (epochs counted from 0 per call), else in
        order. ``progress`` shows a rich progress bar with the loss and the throughput (samples/s) on
        ``console`` (a ``rich.console.Console``). Returns the mean loss of each epoch. Raises
        :class:`InputError` for bad data or sizes.
        """
        if epochs < 1 or batch_size < 1:
            raise InputError(f"epochs and batch size must be positive, got {epochs} and {batch_size}")
        arrays = self.arrays(data)
        n = len(arrays["labels"])
        if n == 0:
            raise InputError("the training data holds no samples")
        self._check_fixed_batch(batch_size, n)
        per_epoch = -(-n // batch_size)
        means: list[float] = []
        bar = _Bar(progress, console, description, epochs * per_epoch)
        with bar:
            seen, started = 0, time.perf_counter()
            for epoch in range(epochs):
                total = 0.0
                for rows in batches(n, batch_size, shuffle, seed + epoch):
                    loss = self._step(self._feeds(arrays, rows))
                    total += loss * len(rows)
                    seen += len(rows)
                    rate = seen / max(time.perf_counter() - started, 1e-9)
                    bar.advance(f"{description} epoch {epoch + 1}/{epochs}", loss, rate)
                means.append(total / n)
        return means

    def evaluate(self, data: Data, batch_size: int = 512) -> dict[str, float | None]:
        """The mean loss over ``data`` with the current parameters, and the accuracy for classification:
        ``argmax(logits) == label`` for cross-entropy, ``(logit > 0) == (label > 0.5)`` for bce, ``None``
        for mse. Returns ``{"loss": float, "accuracy": float | None, "samples": int}``."""
        arrays = self.arrays(data)
        n = len(arrays["labels"])
        batch_size = self.fixed_batch or batch_size
        self._check_fixed_batch(batch_size, n)
        total, correct = 0.0, 0
        for rows in batches(n, batch_size, False, 0):
            feeds = self._feeds(arrays, rows)
            loss, out = self._run_eval(feeds)
            total += float(loss) * len(rows)
            labels = feeds[self.spec.labels]
            if self.spec.loss.kind == "cross-entropy":
                correct += int(np.sum(np.argmax(out, axis=-1) == labels))
            elif self.spec.loss.kind == "bce":
                correct += int(np.sum((out > 0) == (labels > 0.5)))
        accuracy = None if self.spec.loss.kind == "mse" else correct / max(arrays["labels"].size, 1)
        return {"loss": total / max(n, 1), "accuracy": accuracy, "samples": n}

    def predict(self, inputs: Mapping[str, np.ndarray] | np.ndarray) -> np.ndarray:
        """The model output the loss reads, for ``inputs`` (an array for a one-input model, or arrays by
        input name), with the current parameters. Raises :class:`RevgraphError` if onnxruntime fails."""
        from .runtime import Session

        if not isinstance(inputs, Mapping):
            inputs = {self.spec.inputs[0]: inputs}
        model = self.spec.model.copy()
        model.initializers.update(self.parameters)
        types = {v.name: v.dtype for v in model.inputs}
        feeds = {k: np.asarray(v).astype(types.get(k), copy=False) for k, v in inputs.items()}
        return Session(model).run(feeds, [self.spec.loss.output])[self.spec.loss.output]

    def _run_eval(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        binding = self._eval.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for p in self.spec.params:
            binding.bind_ortvalue_input(p, self._sets[self._current][p])
        binding.bind_output(self.spec.loss.loss)
        binding.bind_output(self.spec.loss.output)
        try:
            self._eval.run_with_iobinding(binding)
        except Exception as exc:
            raise RevgraphError(f"evaluation failed: {_first_line(exc)}") from None
        loss, out = binding.copy_outputs_to_cpu()
        return loss, out

    # ------------------------------------------------------------------------------------------ output

    def export(self, path: str | os.PathLike) -> Graph:
        """Write the inference model with the current parameters as its initializers; return that graph."""
        model = self.spec.model.copy()
        model.initializers.update(self.parameters)
        save(model, path)
        return model

    def save_training_graph(self, path: str | os.PathLike) -> None:
        """Write the training-step graph (module doc of :mod:`revgraph.train`), with no initial values."""
        save(self.spec.graph, path)


def batches(n: int, batch_size: int, shuffle: bool, seed: int) -> Iterator[np.ndarray]:
    """Row indices of each batch: ``default_rng(seed).permutation(n)`` (or ``arange(n)``) cut into pieces of
    ``batch_size``; the last one may be smaller."""
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


class _Bar:
    """A rich progress bar over steps with the loss and throughput, or nothing when ``enabled`` is false."""

    def __init__(self, enabled: bool, console, description: str, total: int):
        self.progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:,.0f} samples/s"),
                TimeElapsedColumn(), console=console,
            )
            self.task = self.progress.add_task(description, total=total, loss=float("nan"), rate=0.0)

    def __enter__(self):
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def advance(self, description: str, loss: float, rate: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, description=description, loss=loss, rate=rate)
