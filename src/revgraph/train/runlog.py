"""A record of a training run that users can look at: the per-step records of :meth:`revgraph.Trainer.fit`'s
``callbacks=`` written as JSON lines (:class:`JsonlLog`), CSV (:class:`CsvLog`), TensorBoard event files
(:class:`TensorBoardLog`, through tensorboardX) or an SVG loss curve (:class:`LossCurve`).

**The record** (one dict per optimizer step, on rank 0; :data:`FIELDS`): ``step`` (int, the trainer's step count
after the step, from 1, continuing across a resumed snapshot), ``epoch`` (int, from 1), ``loss`` (float, the
step's loss over the global batch), ``lr`` (float, the learning rate the step used, schedule applied),
``grad_norm`` (float, the global L2 norm of the gradients before clipping, ``None`` when the run does not
compute it), ``samples_per_s`` (float), ``samples`` (int, the samples of the step's global batch), and, after a
step that an evaluation followed (``--eval-every``), ``eval_loss`` and ``eval_accuracy`` (float or ``None``).

**Each writer** is a callable taking the record, with ``close()`` and ``with`` support; it opens its file at
the first record (a run that stops before its first step writes nothing) and raises :class:`RevgraphError`
(one line) when writing fails (a full disk). **A file that exists** is continued from the run's first step:
the records of the steps before it are kept and the rest replaced. So a run that resumes from a snapshot at
step 100 (``--snapshot-dir``) keeps steps 1..100 of the log and writes 101.. again (those its first attempt
wrote after the snapshot are dropped, they are computed anew), and a run from step 1 replaces the file whole,
as ``-o`` replaces the model. TensorBoard does the same with ``SummaryWriter(purge_step=first step)``: its
reader hides the events of earlier attempts from that step on.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import time
from collections.abc import Mapping

from ..errors import RevgraphError
from ..onnx_io.atomic import atomic_path, write_error

#: The record's fields, in the order of :class:`CsvLog`'s header.
FIELDS = ("step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "samples", "eval_loss", "eval_accuracy")
#: The TensorBoard tag of each numeric field :class:`TensorBoardLog` writes.
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "samples_per_s": "train/samples_per_s", "eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy"}
#: The file formats of :func:`log_writer`, by suffix.
SUFFIXES = (".jsonl", ".csv")
TENSORBOARD_HINT = 'pip install "revgraph[tensorboard]"'


class _Writer:
    """What the writers share: ``with`` support and an idempotent :meth:`close`."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - each writer has its own
        raise NotImplementedError


class _FileLog(_Writer):
    """A text log with one line per record, opened at the first record and continued from its step (module
    doc); each line is flushed as it is written, so a run that crashes keeps the lines of its steps."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fsdecode(os.fspath(path))
        self._file = None
        self.kept: list[dict] = []  # the records of earlier steps the file was continued after (a resumed run)

    def __call__(self, record: Mapping) -> None:
        try:
            if self._file is None:
                self._file = self._open(int(record["step"]))
            self._file.write(self._line(record).encode("utf-8"))
            self._file.flush()
        except OSError as exc:
            raise RevgraphError(write_error(exc, repr(self.path))) from None

    def close(self) -> None:
        """Close the file (nothing to do before the first record, or when closed already)."""
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError as exc:
                raise RevgraphError(write_error(exc, repr(self.path))) from None

    def _open(self, first: int):
        f = open(self.path, "ab+")  # noqa: SIM115 (kept open until close())  created if missing, not truncated
        try:
            keep = 0
            if first > 1:  # (a run from step 1 replaces the file: nothing in it is read)
                f.seek(0)
                keep = self._kept(f, first)
            f.truncate(keep)
            if keep == 0:
                f.write(self._header().encode("utf-8"))
            return f
        except BaseException:
            f.close()
            raise

    def _kept(self, f, first: int) -> int:
        """The length in bytes of the file's leading complete records of steps before ``first`` (0 when the file
        is not such a log)."""
        offset = self._start(f)
        if offset is None:
            return 0
        kept = []
        for line in f:
            record = self._record(line) if line.endswith(b"\n") else None  # (a torn last line: the crash's)
            step = record.get("step") if record is not None else None
            if not isinstance(step, int) or isinstance(step, bool) or step >= first:
                break
            kept.append(record)
            offset += len(line)
        self.kept = kept
        return offset

    def _start(self, f) -> int | None:
        """The offset of the first record (after a header), ``None`` when the file does not start as this log."""
        return 0

    def _header(self) -> str:
        return ""

    def _record(self, line: bytes) -> dict | None:
        """The record a line of the file holds, ``None`` when it holds none."""
        raise NotImplementedError

    def _line(self, record: Mapping) -> str:
        raise NotImplementedError


class JsonlLog(_FileLog):
    """Write each record to ``path`` as one JSON object on a line (JSON Lines), its keys in the record's order;
    a NaN or infinite value (the loss of a ``--allow-nonfinite`` run) is ``null``, as strict JSON has no
    NaN. Raises :class:`RevgraphError` (one line) when the file cannot be written."""

    def _record(self, line: bytes) -> dict | None:
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None

    def _line(self, record: Mapping) -> str:
        return json.dumps({str(k): _plain(v) for k, v in record.items()}, allow_nan=False) + "\n"


class CsvLog(_FileLog):
    """Write each record to ``path`` as a CSV row under the fixed header :data:`FIELDS` (written once, at the
    top); ``None`` and absent fields are empty cells, floats are written with all their digits (``repr``:
    they read back equal), NaN and infinities as ``nan``, ``inf``, ``-inf``. Fields not in :data:`FIELDS` are
    not written. Raises :class:`RevgraphError` (one line) when the file cannot be written."""

    def _header(self) -> str:
        return _csv_row(FIELDS)

    def _start(self, f) -> int | None:
        head = f.readline()
        return len(head) if head.decode("utf-8", "replace") == self._header() else None

    def _record(self, line: bytes) -> dict | None:
        try:
            row = next(csv.reader([line.decode("utf-8")]))
            if len(row) != len(FIELDS):
                return None
            return {k: (int(v) if k in ("step", "epoch", "samples") else float(v)) if v else None
                    for k, v in zip(FIELDS, row, strict=True)}
        except (ValueError, UnicodeDecodeError, StopIteration):
            return None

    def _line(self, record: Mapping) -> str:
        return _csv_row(["" if (v := _plain(record.get(k), finite=False)) is None else repr(v) for k in FIELDS])


class TensorBoardLog(_Writer):
    """Write each record's numeric fields as TensorBoard scalars (:data:`TAGS`: ``train/loss``, ``train/lr``,
    ``train/grad_norm``, ``train/samples_per_s``, ``eval/loss``, ``eval/accuracy``; ``global_step`` = the
    record's ``step``) to an event file in ``logdir`` (made if missing), through tensorboardX's
    ``SummaryWriter``, with ``purge_step`` = the first step written (module doc). Events are flushed every
    ``flush_secs`` seconds, after each evaluation and at :meth:`close`. Raises :class:`RevgraphError` when
    tensorboardX is not installed (naming ``pip install "revgraph[tensorboard]"``) or the directory cannot
    be written."""

    def __init__(self, logdir: str | os.PathLike, flush_secs: int = 10):
        self.logdir = os.fsdecode(os.fspath(logdir))
        self._make = summary_writer_class()
        # a --allow-nonfinite run's NaN loss is written as such; tensorboardX would warn on stderr at each one
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        self._flush_secs = flush_secs
        self._writer = None

    def __call__(self, record: Mapping) -> None:
        step = int(record["step"])
        try:
            if self._writer is None:  # TensorBoard reads a directory's event files in the order of their names,
                # whose time is in seconds: the nanoseconds after it keep two runs of one second in order
                self._writer = self._make(self.logdir, purge_step=step, flush_secs=self._flush_secs,
                                          filename_suffix=f".{time.time_ns()}.{os.getpid()}")
            for key, tag in TAGS.items():
                value = record.get(key)
                if value is not None:
                    self._writer.add_scalar(tag, float(value), global_step=step)
            if record.get("eval_loss") is not None or record.get("eval_accuracy") is not None:
                self._writer.flush()
        except OSError as exc:
            raise RevgraphError(write_error(exc, f"the TensorBoard directory {self.logdir!r}")) from None

    def close(self) -> None:
        """Flush and close the event file (nothing to do before the first record, or when closed already)."""
        w, self._writer = self._writer, None
        if w is not None:
            try:
                w.close()
            except OSError as exc:
                raise RevgraphError(write_error(exc, f"the TensorBoard directory {self.logdir!r}")) from None


class LossCurve(_Writer):
    """Collect each record's ``(step, loss)`` and, after evaluations, ``(step, eval_loss)``, and write them to
    ``path`` at :meth:`close` as an SVG chart against the step (:func:`revgraph.train.svg_curve.chart`: one
    polyline per curve, the training loss thin and per step, the evaluation loss thick with a dot per
    evaluation), atomically; nothing is written when no record came. ``title`` heads the chart."""

    def __init__(self, path: str | os.PathLike, title: str = "training loss"):
        self.path = os.fsdecode(os.fspath(path))
        self.title = title
        self.train: list[tuple[int, float]] = []
        self.eval: list[tuple[int, float]] = []
        self._closed = False

    def __call__(self, record: Mapping) -> None:
        step = int(record["step"])
        self.train.append((step, float(record["loss"])))
        if record.get("eval_loss") is not None:
            self.eval.append((step, float(record["eval_loss"])))

    def prepend(self, records) -> None:
        """Add the points of ``records`` (dicts as :meth:`__call__` takes) of the steps before the first recorded
        one: a resumed run's earlier steps, read back from the run's ``--log`` file (:attr:`JsonlLog.kept`; a
        snapshot does not hold the per-step losses)."""
        first = self.train[0][0] if self.train else None
        earlier = [r for r in records if first is None or int(r["step"]) < first]
        self.train[:0] = [(int(r["step"]), float(r["loss"])) for r in earlier if r.get("loss") is not None]
        self.eval[:0] = [(int(r["step"]), float(r["eval_loss"])) for r in earlier if r.get("eval_loss") is not None]

    def svg(self) -> str:
        """The chart's SVG text."""
        from .svg_curve import COLORS, Line, chart

        lines = [Line(self.train, COLORS[0], width=1.5, label="training loss (per step)")]
        if self.eval:
            lines.append(Line(self.eval, COLORS[1], label="evaluation loss", markers=True))
        return chart(lines, self.title, "step", "loss")

    def close(self) -> None:
        """Write the SVG (once; nothing without records). Raises :class:`RevgraphError` when it cannot be
        written, the file left as it was."""
        if self._closed:
            return
        self._closed = True
        if self.train:
            text = self.svg()
            with atomic_path(self.path, ".svg", special=False) as tmp, open(tmp, "w", encoding="utf-8") as f:
                f.write(text)


def log_writer(path: str | os.PathLike, option: str = "the log") -> JsonlLog | CsvLog:
    """The writer of ``path`` by its suffix (any case): :class:`JsonlLog` for ``.jsonl``, :class:`CsvLog` for
    ``.csv``. Raises :class:`RevgraphError` naming ``option`` for any other suffix."""
    suffix = os.path.splitext(os.fsdecode(os.fspath(path)))[1].lower()
    if suffix not in SUFFIXES:
        raise RevgraphError(f"{option} {os.fspath(path)!r}: give a file ending in .jsonl (JSON lines) or .csv; the "
                            "suffix picks the format")
    return JsonlLog(path) if suffix == ".jsonl" else CsvLog(path)


def summary_writer_class():
    """tensorboardX's ``SummaryWriter``; :class:`RevgraphError` naming the install command without it."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise RevgraphError(f"TensorBoard logs (--tensorboard) need tensorboardX: {TENSORBOARD_HINT}") from None
    return SummaryWriter


def _plain(value, finite: bool = True):
    """``value`` as a JSON/CSV scalar: numpy scalars as Python numbers, and with ``finite`` NaN and infinities
    as ``None``."""
    if hasattr(value, "item") and not isinstance(value, int | float):  # a numpy scalar or 0-d array
        value = value.item()
    if isinstance(value, float) and finite and not math.isfinite(value):
        return None
    return value


def _csv_row(cells) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(cells)
    return buf.getvalue()
