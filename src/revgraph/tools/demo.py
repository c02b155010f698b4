"""``revgraph demo``: train a recurrent classifier (an ONNX ``Loop``) and an MLP on scikit-learn's digits.

The data set is ``sklearn.datasets.load_digits`` (1,797 8x8 images of handwritten digits, shipped inside
scikit-learn, no download), scaled to [0, 1] and split 80/20 into training and test samples with a fixed
seed. Both models read ``x`` float32 ``[N, 8, 8]`` and write ``logits`` float32 ``[N, 10]``:

- ``rnn``: ``h_0 = 0``; ``h_{t+1} = tanh(x[:, t, :] W + h_t U + b)`` for the 8 rows ``t`` of an image, an ONNX
  ``Loop`` whose body reads ``W``, ``U``, ``b`` from the enclosing graph; then ``logits = h_8 V + c`` (``Gemm``).
- ``mlp``: ``logits = relu(flatten(x) W1 + b1) W2 + b2``.

For each: the gradient of the cross-entropy loss is checked against float64 central differences
(:func:`revgraph.check_gradients`), the training-step graph is built (:mod:`revgraph.train`) and run by
:class:`revgraph.train.trainer.Trainer` with Adam, and the test accuracy is measured. The training graphs, the
trained models and a loss-curve SVG (written by hand, no plotting library) go to the output directory, with
:data:`MANIFEST`, the size and SHA-256 of each file the demo wrote there (written before each file takes its
name, so that a run stopped by a full disk leaves only recorded files): a rerun replaces those files, and
refuses (before any work, unless ``force``) to replace a file of the same name that the demo did not write or
that was changed since (the user's own ``loss.svg``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ir import Graph, Node, ValueInfo
from ..train.svg_curve import COLORS, Line, chart

F32 = np.dtype(np.float32)

#: The files the demo writes into its directory.
FILES = ("rnn.train.onnx", "rnn.onnx", "mlp.train.onnx", "mlp.onnx", "loss.svg")
#: The record of what the demo wrote there: ``{"format": ..., "files": {name: [size, sha256]}}``.
MANIFEST = ".revgraph-demo.json"
_FORMAT = "revgraph-demo-1"


@dataclass(frozen=True)
class Settings:
    """Sizes and schedule of the demo (the defaults were tuned on 2 cores: see README, ``revgraph demo``)."""

    hidden: int = 128
    epochs: int = 30
    batch_size: int = 32
    lr: float = 0.003
    mlp_hidden: int = 64
    mlp_epochs: int = 20
    seed: int = 0


#: A smoke test: a few epochs at a higher learning rate (about 85-90% for the recurrent classifier).
QUICK = Settings(hidden=32, epochs=3, lr=0.01, mlp_hidden=32, mlp_epochs=2)


def memory_needed(settings: Settings, rows: int = 8, width: int = 8, classes: int = 10) -> int:
    """A lower bound of the bytes the demo needs at its peak, from the sizes: every weight of the two models as
    float32 four times over while training (the parameter, its gradient and Adam's two moments), the recurrent
    matrix ``U`` (``hidden x hidden``) dominating; ``revgraph demo`` refuses a ``--hidden`` above the machine's
    memory with this figure instead of a ``MemoryError`` after the allocation (``--hidden 100000``: 149 GiB)."""
    h, m, d = settings.hidden, settings.mlp_hidden, rows * width
    rnn = width * h + h * h + h + h * classes + classes
    mlp = d * m + m + m * classes + classes
    return 16 * (rnn + mlp)


def digits(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(train, test)``, each ``{"x": float32 [N, 8, 8] in [0, 1], "labels": int64 [N]}`` (80/20 split)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # a dependency of revgraph, but an environment may lack it
        from ..errors import RevgraphError

        raise RevgraphError("the demo needs scikit-learn for its data set: pip install scikit-learn") from None

    d = load_digits()
    x = (d.images / 16.0).astype(F32)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = round(0.8 * len(y))
    tr, te = order[:cut], order[cut:]
    return {"x": x[tr], "labels": y[tr]}, {"x": x[te], "labels": y[te]}


def _n(op: str, ins: list[str], outs: str | list[str], name: str, **attrs) -> Node:
    return Node(op, ins, outs if isinstance(outs, list) else [outs], attrs, name)


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], bound: float) -> np.ndarray:
    return rng.uniform(-bound, bound, shape).astype(F32)


def rnn_model(hidden: int = 64, rows: int = 8, width: int = 8, classes: int = 10, seed: int = 0) -> Graph:
    """The recurrent classifier (module doc) as a :class:`Graph`: input ``x`` float32 ``["N", rows, width]``,
    output ``logits`` float32 ``["N", classes]``. Initial weights as ``torch.nn.RNN`` and ``torch.nn.Linear``
    draw them (uniform in +-1/sqrt(fan)), from ``seed``."""
    rng = np.random.default_rng(seed)
    k = 1 / np.sqrt(hidden)
    inits = {
        "W": _uniform(rng, (width, hidden), k), "U": _uniform(rng, (hidden, hidden), k),
        "b": _uniform(rng, (hidden,), k),
        "V": _uniform(rng, (hidden, classes), k), "c": _uniform(rng, (classes,), k),
        "trips": np.array(rows, np.int64), "go": np.array(True), "hidden_dim": np.array([hidden], np.int64),
    }
    body = Graph(
        [
            _n("Gather", ["x", "t"], "row", "rnn/row", axis=1),          # [N, width]: row t of every image
            _n("MatMul", ["row", "W"], "xw", "rnn/xW"),
            _n("MatMul", ["h_in", "U"], "hu", "rnn/hU"),
            _n("Add", ["xw", "hu"], "pre", "rnn/add"),
            _n("Add", ["pre", "b"], "pre_b", "rnn/bias"),
            _n("Tanh", ["pre_b"], "h_out", "rnn/tanh"),
            _n("Identity", ["go_in"], "go_out", "rnn/cond"),
        ],
        [ValueInfo("t", np.int64, ()), ValueInfo("go_in", np.bool_, ()), ValueInfo("h_in", F32, ("N", hidden))],
        [ValueInfo("go_out", np.bool_, ()), ValueInfo("h_out", F32, ("N", hidden))],
        name="rnn_step",
    )
    nodes = [
        _n("Shape", ["x"], "batch", "h0/batch", start=0, end=1),
        _n("Concat", ["batch", "hidden_dim"], "h0_shape", "h0/shape", axis=0),
        _n("ConstantOfShape", ["h0_shape"], "h0", "h0/zeros", value=np.zeros(1, F32)),
        _n("Loop", ["trips", "go", "h0"], "h", "rnn/loop", body=body),
        _n("Gemm", ["h", "V", "c"], "logits", "head/linear"),  # ONNX infers no shape for Loop outputs: Gemm is 2-D
    ]
    return Graph(nodes, [ValueInfo("x", F32, ("N", rows, width))], [ValueInfo("logits", F32, ("N", classes))],
                 inits, name="digits_rnn")


def mlp_model(hidden: int = 64, rows: int = 8, width: int = 8, classes: int = 10, seed: int = 0) -> Graph:
    """The MLP (module doc): input ``x`` float32 ``["N", rows, width]``, output ``logits`` float32
    ``["N", classes]``; weights uniform in +-1/sqrt(fan in), as ``torch.nn.Linear`` draws them."""
    rng = np.random.default_rng(seed)
    d = rows * width
    inits = {
        "W1": _uniform(rng, (d, hidden), 1 / np.sqrt(d)), "b1": _uniform(rng, (hidden,), 1 / np.sqrt(d)),
        "W2": _uniform(rng, (hidden, classes), 1 / np.sqrt(hidden)),
        "b2": _uniform(rng, (classes,), 1 / np.sqrt(hidden)),
    }
    nodes = [
        _n("Flatten", ["x"], "flat", "mlp/flatten", axis=1),
        _n("MatMul", ["flat", "W1"], "a1", "mlp/matmul1"),
        _n("Add", ["a1", "b1"], "z1", "mlp/bias1"),
        _n("Relu", ["z1"], "h1", "mlp/relu"),
        _n("MatMul", ["h1", "W2"], "a2", "mlp/matmul2"),
        _n("Add", ["a2", "b2"], "logits", "mlp/bias2"),
    ]
    return Graph(nodes, [ValueInfo("x", F32, ("N", rows, width))], [ValueInfo("logits", F32, ("N", classes))],
                 inits, name="digits_mlp")


# ------------------------------------------------------------------------------------------------ SVG


def loss_svg(curves: dict[str, tuple[list[float], int]], title: str = "training loss") -> str:
    """An SVG line chart of per-step losses: ``curves`` maps a label to ``(losses, steps per epoch)``.

    Each curve is drawn against epochs (step / steps per epoch), so models with different batch counts
    share the x axis, thin per step and thick as each epoch's mean; the y axis is linear from 0 to the largest
    loss. Written by hand, no plotting library: :func:`revgraph.train.svg_curve.chart`.
    """
    lines = []
    for k, (label, (losses, per)) in enumerate(curves.items()):
        color, per = COLORS[k % len(COLORS)], max(per, 1)
        means = [float(np.mean(losses[j:j + per])) for j in range(0, len(losses), per)]
        lines.append(Line([((i + 1) / per, v) for i, v in enumerate(losses)], color, width=1, opacity=0.35))
        lines.append(Line([(j + 1, v) for j, v in enumerate(means)], color, label=label))
    return chart(lines, title, "epoch", "cross-entropy loss", notes=("thin: per step", "thick: epoch mean"))


# ------------------------------------------------------------------------------------ the output directory


def _fingerprint(path: Path) -> list | None:
    """``[size, sha256]`` of a regular file (through links), ``None`` for anything else."""
    try:
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            return [os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()]
    except OSError:
        return None


def _recorded(out: Path) -> dict | None:
    """The files the manifest in ``out`` records as the demo's (``{name: [fingerprint, ...]}``; ``{}`` without a
    manifest), ``None`` for a file of that name that is not the demo's manifest. A name may have two fingerprints:
    the file the demo wrote before and the one it was writing when it stopped (:func:`_write`)."""
    manifest = out / MANIFEST
    if not os.path.lexists(manifest):
        return {}
    try:
        data = json.loads(manifest.read_text(encoding="utf-8")) if manifest.is_file() else None
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == _FORMAT else None
    writing = data.get("writing", {}) if isinstance(files, dict) else None
    if not isinstance(files, dict) or not isinstance(writing, dict):
        return None
    return {name: [fp for fp in (files.get(name), writing.get(name)) if fp is not None]
            for name in {*files, *writing}}


def check_output_directory(out: str | Path, force: bool = False) -> dict:
    """Refuse, before any work (:class:`revgraph.RevgraphError`, one line), an output directory the demo cannot
    write, or (unless ``force``) one holding a file of a name the demo writes (:data:`FILES`, :data:`MANIFEST`)
    that the demo did not write or that changed since. Returns the manifest's records to keep."""
    from ..errors import RevgraphError
    from ..onnx_io.atomic import output_target

    out = Path(out)
    if os.path.lexists(out) and not out.is_dir():
        raise RevgraphError(f"demo -o {str(out)!r}: it is not a directory; give a directory (made if missing)")
    if not out.is_dir():
        return {}
    recorded = _recorded(out)
    if recorded is None and not force:
        raise RevgraphError(f"demo -o {str(out)!r}: {str(out / MANIFEST)!r} exists and is not the demo's record; "
                            "choose a new directory, move the file away, or pass --force")
    recorded = recorded or {}
    for name in (*FILES, MANIFEST):
        path = out / name
        if (not force and name != MANIFEST and os.path.lexists(path)
                and _fingerprint(path) not in recorded.get(name, [])):
            raise RevgraphError(f"demo -o {str(out)!r}: {str(path)!r} exists and the demo did not write it (or it "
                                "changed since); choose a new directory, move the file away, or pass --force")
        if os.path.lexists(path):
            output_target(path)  # a directory, a socket, a dangling link of that name: refused now
    # what is there now, of what the demo recorded (one fingerprint per file; a file gone is no longer its)
    present = {name: _fingerprint(out / name) for name in recorded}
    return {name: [fp] for name, fp in present.items() if fp is not None and fp in recorded[name]}


def _save_manifest(out: Path, files: dict, writing: dict) -> None:
    from ..onnx_io.atomic import atomic_path

    text = json.dumps({"format": _FORMAT, "files": files, "writing": writing}, indent=1)
    with atomic_path(out / MANIFEST) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def _write(out: Path, recorded: dict, name: str, write) -> None:
    """Write the file ``out/name`` through ``write(tmp)`` (a temporary file in ``out``), recording it in the
    manifest *before* it takes its name: the manifest lists its new fingerprint beside the one it had (under
    ``"writing"``), the file is renamed into place, and then the manifest keeps the new one alone. Wherever a
    full disk or a signal stops this, what the directory holds under ``name`` (the old file, the new one, or
    none) is recorded as the demo's, and a rerun replaces it without ``--force``. ``recorded``: the demo's
    records (:func:`_recorded`), updated in place."""
    from ..errors import RevgraphError
    from ..onnx_io.atomic import atomic_path

    files = {k: v[0] for k, v in recorded.items() if v}  # (the demo's file under ``name`` now, if any, too)
    with atomic_path(out / name, suffix=Path(name).suffix) as tmp:
        try:
            write(tmp)
        except RevgraphError as exc:  # (a full disk: named by the file the user asked for, not the temporary)
            raise RevgraphError(str(exc).replace(repr(str(tmp)), repr(str(out / name)))) from None
        new = _fingerprint(Path(tmp))
        _save_manifest(out, files, {name: new})  # before the rename: a failure here leaves the old file
    recorded[name] = [new]
    files[name] = new
    _save_manifest(out, files, {})  # (a full disk here leaves "writing": the new file is still recorded)


# ------------------------------------------------------------------------------------------------ run


def run(out_dir: str | Path = "revgraph-demo", settings: Settings = Settings(), console=None,
        force: bool = False, progress: bool = True) -> dict:
    """Run the demo (module doc), printing to ``console`` (a rich Console; ``progress``: with the training
    progress bars, which ``revgraph demo --quiet`` leaves out); return what it measured:
    ``{"rnn": {...}, "mlp": {...}, "seconds": float, "svg": path}``, each model with ``accuracy``,
    ``loss``, ``train_graph`` (path), ``model`` (path), ``size`` ((nodes, in subgraphs, initializers, bytes))
    and ``check_ok``. Raises :class:`revgraph.RevgraphError` if the output directory cannot be made or holds
    files the demo did not write (unless ``force``: :func:`check_output_directory`), or a file cannot be
    written."""
    from rich.console import Console
    from rich.table import Table

    from ..errors import RevgraphError
    from ..train.graphs import adam, graph_size, loss_graph
    from ..train.trainer import Trainer
    from .check import check_gradients

    console = console or Console(highlight=False)
    started = time.perf_counter()
    out = Path(out_dir)
    recorded = check_output_directory(out, force)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RevgraphError(f"cannot create the output directory {str(out)!r}: {exc.strerror}") from None
    train, test = digits(settings.seed)
    console.print(f"digits (scikit-learn): {len(train['labels'])} training and {len(test['labels'])} test images, "
                  "8x8, 10 classes", markup=False, soft_wrap=True)
    models = {
        "rnn": (rnn_model(settings.hidden, seed=settings.seed), settings.epochs,
                f"recurrent (ONNX Loop over 8 rows, hidden {settings.hidden})"),
        "mlp": (mlp_model(settings.mlp_hidden, seed=settings.seed), settings.mlp_epochs,
                f"MLP (64-{settings.mlp_hidden}-10, ReLU)"),
    }

    console.print("gradient check: the cross-entropy loss on 8 images against float64 central differences",
                  markup=False, soft_wrap=True)
    table = Table(show_edge=False)
    for col in ("model", "parameter", "shape", "max abs error", "max rel error", "ok"):
        table.add_column(col, justify="right" if "error" in col else "left")
    sample = {"x": train["x"][:8], "labels": train["labels"][:8]}
    checks = {}
    for key, (model, _, _) in models.items():
        lg, spec = loss_graph(model, "cross-entropy")
        params = [k for k, a in model.initializers.items() if a.dtype.kind == "f"]
        rep = check_gradients(lg, spec.loss, params, inputs={"x": sample["x"], spec.labels: sample["labels"]},
                              seed=settings.seed)
        checks[key] = rep.ok
        for row in rep.rows:
            shape = "x".join(map(str, model.initializers[row.name].shape))
            table.add_row(key, row.name, shape, f"{row.max_abs:.2g}", f"{row.max_rel:.2g}",
                          "yes" if row.ok else "[red]NO[/red]")
    console.print(table)

    results: dict = {}
    curves: dict[str, tuple[list[float], int]] = {}
    for key, (model, epochs, label) in models.items():
        t0 = time.perf_counter()
        trainer = Trainer(model, "cross-entropy", adam(lr=settings.lr))
        trainer.fit(train, epochs=epochs, batch_size=settings.batch_size, seed=settings.seed, console=console,
                    description=key, progress=progress)
        seconds = time.perf_counter() - t0
        ev = trainer.evaluate(test)
        graph_path, model_path = out / f"{key}.train.onnx", out / f"{key}.onnx"
        _write(out, recorded, graph_path.name, trainer.save_training_graph)
        _write(out, recorded, model_path.name, trainer.export)
        size = graph_size(trainer.spec.graph)
        per_epoch = -(-len(train["labels"]) // settings.batch_size)
        curves[f"{key}: test {ev['accuracy']:.1%}"] = (trainer.losses, per_epoch)
        results[key] = {"accuracy": ev["accuracy"], "loss": ev["loss"], "train_graph": str(graph_path),
                        "model": str(model_path), "size": size, "check_ok": checks[key], "seconds": seconds}
        console.print(f"{label}: test accuracy {ev['accuracy']:.2%} (loss {ev['loss']:.4f}) after {epochs} epochs "
                      f"in {seconds:.1f} s", markup=False, soft_wrap=True)
        console.print(f"  training graph {graph_path}: {size[0]} nodes ({size[1]} in loop bodies), "
                      f"{size[2]} initializers, {size[3]:,} bytes; trained model {model_path}",
                      markup=False, soft_wrap=True)
    svg = out / "loss.svg"
    text = loss_svg(curves, "revgraph demo: cross-entropy on the digits training set (Adam)")
    _write(out, recorded, svg.name, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    results["svg"] = str(svg)
    results["seconds"] = time.perf_counter() - started
    console.print(f"loss curves: {svg}", markup=False, soft_wrap=True)
    console.print(f"done in {results['seconds']:.1f} s", markup=False, soft_wrap=True)
    return results
