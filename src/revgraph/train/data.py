"""Training data: the checks of what :class:`revgraph.Trainer` is given, static inputs, and memory-mapped
directories of ``.npy`` files.

Per-sample arrays share their first (sample) axis; a batch is the rows of the epoch's order gathered from each
(``array[rows]``), so an array memory-mapped from a ``.npy`` file (:func:`read_dir`, ``np.load(mmap_mode="r")``)
is read batch by batch and never whole: data larger than memory trains with the same shuffling and sharding.

Static inputs (``static={name: array}``, ``--static NAME=FILE``) have no sample axis, or are fed whole: a GNN's
``edge_index`` ``[2, E]``, a scalar trip count, a constant mask, or (a full-graph GNN) the node features and
labels. They are given once and fed unchanged to every step, on every data-parallel rank. When every input
(and the labels, where the loss has them) is static, each step is the whole data: one sample per epoch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..onnx_io.archive import read_archive
from .losses import loss_kind, loss_weight

#: rows read at a time when a check runs over a whole (possibly memory-mapped) array
CHUNK_ROWS = 1 << 16


class Dataset:
    """Checked data: ``arrays`` by data name (model input names and ``"labels"``; memmaps stay memmaps),
    ``static`` by graph input name, ``n`` the number of samples (1 when everything is static)."""

    def __init__(self, spec, arrays: dict, static: dict, dtypes: dict):
        self.spec, self.arrays, self.static, self._dtypes = spec, arrays, static, dtypes
        #: the ``static`` mapping :func:`prepare` was given (the object itself: passed again, it is not re-checked)
        self.given_static: Mapping | None = None
        lengths = {k: len(a) for k, a in arrays.items()}
        self.n = next(iter(lengths.values())) if lengths else 1

    def graph_name(self, key: str) -> str:
        """The training graph's input fed by the data array ``key`` (``"labels"`` is the loss's labels input)."""
        return self.spec.labels if key == "labels" else key

    def feeds(self, rows) -> dict[str, np.ndarray]:
        """The feeds of the samples ``rows`` (an index array or a slice) by graph input, static inputs whole.
        With everything static, every non-empty ``rows`` is the whole data and an empty one feeds no rows."""
        if not self.arrays:
            return dict(self.static) if len(np.arange(self.n)[rows]) else {}
        out = {self.graph_name(k): np.ascontiguousarray(a[rows], dtype=self._dtypes[k]) for k, a in self.arrays.items()}
        return {**out, **self.static} if len(next(iter(out.values()))) else out

    def weight(self, rows) -> float:
        """What the loss of ``rows`` is a mean over (:func:`revgraph.train.losses.loss_weight`): samples, or counted
        targets (``ignore_index``, class weights); only the targets are gathered."""
        count = len(np.arange(self.n)[rows])
        spec = self.spec.loss
        if not count or not loss_kind(spec.kind).classes:
            return count
        key = "labels" if spec.targets == self.spec.labels else spec.targets
        targets = self.arrays[key][rows] if key in self.arrays else self.static[spec.targets]
        return loss_weight(spec, {spec.targets: np.asarray(targets)}, count)

    def fixed_batch(self) -> int | None:
        """The static first dimension the model's per-sample inputs declare (a model exported with a fixed
        batch), or ``None``; static inputs do not count."""
        dims = [v.shape[0] for v in self.spec.model.inputs
                if v.name not in self.static and v.shape and isinstance(v.shape[0], int)]
        return dims[0] if dims and self.arrays else None

    def hashed(self) -> dict[str, np.ndarray]:
        """Every array by name, for comparing ranks (memmaps included; they are hashed in chunks)."""
        return {**self.arrays, **{f"static:{k}": v for k, v in self.static.items()}}


def prepare(spec, data, static: Mapping | None = None, classes: int | None = None) -> Dataset:
    """``data`` (a mapping of arrays by model input and ``"labels"``, ``{"x", "y"}`` or ``(x, y)`` for a one-input
    model, or a directory of ``.npy`` files) and ``static`` (arrays by model input, or ``"labels"``) checked
    against the training graph ``spec``: dtypes cast to the declared ones, shapes, lengths, label values.

    Raises :class:`InputError` (one line) for missing arrays, different lengths, an unknown static name, a
    static array that does not match its input's declared shape, or labels that do not fit the loss
    (non-integer class indices, out-of-range classes, wrong shapes).

    A :class:`Dataset` that this function made for the same ``spec`` and ``static`` is returned as it is (with
    other ones, its arrays are checked again): the
    data is checked once per run (the CLI checks it before anything runs and hands the Dataset to
    :meth:`revgraph.Trainer.fit` and ``evaluate``, which would otherwise re-read and re-scan the labels)."""
    if isinstance(data, Dataset):  # checked already: as it is, or its arrays checked again against other ones
        if data.spec is spec and (static is None or static is data.given_static):
            return data
        data = dict(data.arrays)
    if isinstance(data, (str, os.PathLike)):  # a directory of .npy files, or an .npz (issue 38: it was refused)
        data = read_dir(data) if os.path.isdir(data) or not os.fspath(data).lower().endswith(".npz") else \
            _read_npz(spec, data)
    if isinstance(data, tuple) and len(data) == 2:
        x, y = data
        data = {**x, "labels": y} if isinstance(x, Mapping) else {"x": x, "y": y}
    if not isinstance(data, Mapping):
        raise InputError("training data must be a mapping of arrays, a tuple (x, y), an .npz file or a directory of "
                         ".npy files")
    if static is not None and not isinstance(static, Mapping):  # dict() of a list or a string fails obscurely
        raise InputError(f"static= must be a mapping of arrays by input name, got {type(static).__name__}")
    given_static = static  # (what a later call passes again with this Dataset)
    data, static = dict(data), dict(static or {})
    has_labels = spec.labels is not None
    names = list(spec.inputs)
    types = {v.name: v for v in spec.graph.inputs}
    for k in static:
        if k not in names and not (k == "labels" and has_labels):
            raise InputError(f"--static {k}: the model has no input {k!r} (its inputs are {', '.join(names)})")
        if k in data:
            raise InputError(f"{k!r} is given both as data and as a static input (--static); give it once")
    loss = getattr(spec, "loss", None)
    if getattr(loss, "kind", None) == "causal-lm" and not has_labels and "labels" in data and "labels" not in names:
        # Hugging Face data carries 'labels' with its padding masked; reading input_ids instead would train on
        # the padding without a word
        raise InputError(f"the data holds 'labels', but --loss-fn causal-lm reads its targets from the input "
                         f"{loss.targets or 'input_ids'!r}: give --labels-from labels (labels_from=) to use them, "
                         "or leave them out of the data")
    sample = [n for n in names if n not in static]
    if "labels" not in data and {"x", "y"} <= set(data) and len(sample) == 1:
        data = {sample[0]: data["x"], "labels": data["y"]}
    elif "x" in data and len(sample) == 1 and sample[0] not in data:
        data = {sample[0]: data.pop("x"), **data}
    wanted = [*sample, *(["labels"] if has_labels and "labels" not in static else [])]
    missing = [n for n in wanted if n not in data]
    if missing:
        have = ", ".join(sorted(data)) or "none"
        extra = " plus 'labels'" if has_labels else " (this loss takes no labels)"
        raise InputError(f"the data lacks {', '.join(map(repr, missing))} (it has {have}); give an array per "
                         f"model input not given as static ({', '.join(sample) or 'none'}){extra}, or 'x' and 'y' for "
                         "a one-input model")
    arrays, dtypes = {}, {}
    for n in wanted:
        vi = types[spec.labels if n == "labels" else n]
        a = _checked(n, data[n], vi, first_axis=True)
        # in memory: cast once; a memmap is cast batch by batch (a cast here would read it whole)
        arrays[n] = a if isinstance(a, np.memmap) else np.ascontiguousarray(a.astype(vi.dtype, copy=False))
        dtypes[n] = vi.dtype
    # a static array whose first axis is declared with the same symbol as a per-sample array's is that sample
    # axis: fed whole beside a batch it breaks the step (static labels [N] beside batches of x [N, ...])
    batch_axes = {types[spec.labels if n == "labels" else n].shape[0]: n for n in wanted
                  if types[spec.labels if n == "labels" else n].shape}
    for n in static:
        shape = types[spec.labels if n == "labels" else n].shape
        if shape and isinstance(shape[0], str) and shape[0] in batch_axes:
            raise InputError(f"--static {n}: its first axis {shape[0]!r} is the sample axis of "
                             f"{batch_axes[shape[0]]!r}, which the data gives per sample; give {n!r} in the data "
                             "instead, or every input and the labels as --static (full-batch training)")
    fixed = {}
    for n, a in static.items():
        vi = types[spec.labels if n == "labels" else n]
        fixed[spec.labels if n == "labels" else n] = np.ascontiguousarray(
            np.asarray(_checked(n, a, vi, first_axis=False)).astype(vi.dtype, copy=False))
    lengths = {n: len(a) for n, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise InputError(f"arrays differ in length: {', '.join(f'{k} {v}' for k, v in lengths.items())}")
    ds = Dataset(spec, arrays, fixed, dtypes)
    _check_targets(ds, classes)
    ds.given_static = given_static
    return ds


def _checked(n: str, a, vi, first_axis: bool):
    """``a`` with a dtype that fits the declared ``vi`` and its declared shape (every static dimension; the
    first too for a static input)."""
    a = a if isinstance(a, np.ndarray) else np.asarray(a)
    if a.dtype.kind not in "fiub":
        raise InputError(f"array {n!r} has dtype {a.dtype}; expected numbers")
    if n == "labels" and vi.dtype.kind == "i":
        if a.dtype.kind == "f" and not all(np.array_equal(c, np.round(c)) for c in _chunks(a)):
            raise InputError("labels must be integer class indices (or token ids); 'labels' holds fractions")
    elif vi.dtype.kind != a.dtype.kind and not (vi.dtype.kind == "f" and a.dtype.kind in "iub"):
        raise InputError(f"array {n!r} has dtype {a.dtype}; the model declares {vi.describe()}")
    what = "the labels" if n == "labels" else f"input {n!r}"
    if vi.shape is not None and (a.ndim != len(vi.shape) or any(
            isinstance(d, int) and d != s for d, s in zip(vi.shape[first_axis:], a.shape[first_axis:], strict=False))):
        if first_axis:
            raise InputError(f"array {n!r} has shape {list(a.shape)}; {what} must be {vi.describe()} "
                             "(first axis: samples; give an input without one with --static NAME=FILE, static=)")
        raise InputError(f"static array {n!r} has shape {list(a.shape)}; {what} is declared {vi.describe()}")
    if first_axis and a.ndim == 0:
        raise InputError(f"array {n!r} is a scalar; per-sample arrays have a first (sample) axis "
                         "(give a scalar input with --static NAME=FILE, static=)")
    return a


def _chunks(a):
    """``a`` in blocks of :data:`CHUNK_ROWS` rows (a memmap is read block by block)."""
    if a.ndim == 0:
        yield np.asarray(a)
        return
    for i in range(0, len(a), CHUNK_ROWS):
        yield np.asarray(a[i:i + CHUNK_ROWS])


def _check_targets(ds: Dataset, classes: int | None) -> None:
    """Class indices (cross-entropy) and token ids (causal-lm) in ``[0, classes)`` or equal to ``ignore_index``."""
    loss = ds.spec.loss
    kind = loss_kind(loss.kind)
    if not kind.classes:
        return
    key = "labels" if loss.targets == ds.spec.labels else loss.targets
    targets = ds.arrays.get(key, ds.static.get(loss.targets))
    ii = loss.settings.get("ignore_index")
    for c in _chunks(targets):
        c = c[:, 1:] if kind.shifted and c.ndim == 2 else c
        bad = c[((c < 0) | (c >= classes) if classes else c < 0) & (c != ii if ii is not None else True)]
        if bad.size:
            what = f"target token id {int(bad[0])} in {key!r}" if kind.shifted else f"label {int(bad[0])}"
            also = f" or the ignore index {ii}" if ii is not None else ""
            raise InputError(f"{what} is not a class index in [0, {classes or '?'}){also}")


def _read_npz(spec, path) -> dict[str, np.ndarray]:
    """The members of the ``.npz`` ``path`` that training reads (each model input, ``labels``, ``x``, ``y``),
    each bounded before it is decompressed (:func:`revgraph.onnx_io.archive.read_archive`), as ``revgraph train
    --data`` reads them."""
    wanted = dict.fromkeys([*spec.inputs, "labels", "x", "y"])
    return read_archive(path, wanted, samples=True)


def npy_files(directory) -> list[Path]:
    """The ``.npy`` files of ``directory`` that :func:`read_dir` reads, sorted (other files are not looked at)."""
    return sorted(f for f in Path(directory).iterdir() if f.suffix == ".npy")


def read_dir(path) -> dict[str, np.ndarray]:
    """A directory of ``.npy`` files as ``{stem: memmap}`` (``np.load(mmap_mode="r")``; nothing is read yet).
    Raises :class:`InputError` for a path that is not a directory, a directory without ``.npy`` files, or a
    ``.npy`` that numpy cannot read (other files are not looked at)."""
    d = Path(path)
    if not d.is_dir():
        raise InputError(f"--data {str(path)!r} is not a directory of .npy files")
    files = npy_files(d)
    if not files:
        raise InputError(f"--data {str(path)!r} holds no .npy files; give one per model input (plus labels.npy)")
    return {f.stem: load_npy(f) for f in files}


def load_npy(path, mmap: bool = True) -> np.ndarray:
    """One ``.npy`` file, memory-mapped (``mmap``) or read; :class:`InputError` naming the file if numpy cannot
    read it, or if it holds Python objects."""
    p = Path(path)
    if not p.is_file():
        # say what it is: "no such file" for a directory or a FIFO named x.npy sends the user looking elsewhere
        what = "is a directory" if p.is_dir() else "is not a regular file" if p.exists() else "no such file"
        raise InputError(f"cannot read {str(path)!r}: {what}" + ("; give a .npy file" if p.exists() else ""))
    from ..onnx_io.archive import check_npy_file

    check_npy_file(p, whole=not mmap)  # the header's declared size against the file and the limit, first
    try:
        a = np.load(p, mmap_mode="r" if mmap else None, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001  (numpy raises ValueError, OSError, EOFError, ... for a bad file)
        # an object array (its items pickled) is never loaded: untrusted input; a file without numpy's magic
        # (numpy guesses a pickle) keeps the generic message
        if "Object arrays" in str(exc) or "Python objects" in str(exc):
            raise InputError(f"{str(path)!r} holds an array of Python objects (dtype object, pickled), which is "
                             "not read; save it as a numeric array") from None
        raise InputError(f"{str(path)!r} is not a readable .npy file ({type(exc).__name__})") from None
    if not isinstance(a, np.ndarray):
        raise InputError(f"{str(path)!r} is an .npz archive; give a .npy file (or FILE.npz:member for --static)")
    return a


def read_static(specs: list[str], shapes: Mapping | None = None) -> dict[str, np.ndarray]:
    """``--static NAME=FILE`` arguments as arrays: ``FILE`` a ``.npy`` file, or ``FILE.npz:member`` (one member of
    an ``.npz``, the only one decompressed, bounded first by ``shapes[NAME]``, the shape the model declares for
    it, :func:`revgraph.onnx_io.archive.read_archive`). Raises :class:`InputError` (one line) for a malformed argument,
    a name given twice, or a file or member that cannot be read."""
    out: dict[str, np.ndarray] = {}
    for s in specs or []:
        name, eq, file = s.partition("=")
        if not eq or not name or not file:
            raise InputError(f"--static {s!r}: write NAME=FILE.npy or NAME=FILE.npz:member")
        if name in out:
            raise InputError(f"--static {name}: given twice")
        base, colon, member = file.rpartition(":")
        if colon and base.endswith(".npz"):
            from ..onnx_io.archive import member_names

            arrays = read_archive(base, {member: (shapes or {}).get(name)})
            if member not in arrays:
                raise InputError(f"--static {name}: {base!r} has no member {member!r} (it has "
                                 f"{', '.join(sorted(member_names(base))) or 'none'})")
            out[name] = arrays[member]
        else:
            try:
                out[name] = load_npy(file, mmap=False)
            except InputError as exc:
                raise InputError(f"--static {name}: {exc}") from None
    return out


def score(spec, feeds: dict, loss, out, count: float) -> np.ndarray:
    """One evaluation batch's sums: ``[loss * weight, weight, correct answers, answers, non-finite outputs]``
    (accuracy: argmax against the label for cross-entropy, the next token for causal-lm, over counted targets;
    the sign against ``label > 0.5`` for bce; none for mse and ``output:NAME``)."""
    kind = loss_kind(spec.loss.kind)
    sums = np.array([float(loss) * count, count, 0.0, 0.0, np.size(out) - np.isfinite(out).sum()])
    if kind.accuracy is not None:
        targets = feeds.get(spec.loss.targets) if spec.loss.targets else None
        labels = feeds.get(spec.labels) if spec.labels else None
        sums[2:4] = kind.accuracy(out, targets, labels, spec.loss.settings.get("ignore_index"))
    return sums
