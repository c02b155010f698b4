"""``revgraph train --log FILE.jsonl|FILE.csv --tensorboard DIR --loss-curve FILE.svg``: the run's per-step records
(:mod:`revgraph.train.runlog`) written by rank 0, their paths checked before training."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import RevgraphError
from ..train.runlog import FIELDS, LossCurve, TensorBoardLog, log_writer, summary_writer_class

#: The labels of the files these options write (regular files, checked with the command's other outputs).
RUNLOG_FILES = ("--log", "--loss-curve")


def add_runlog_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log``, ``--tensorboard`` and ``--loss-curve``."""
    fields = ", ".join(FIELDS[:-2])
    parser.add_argument("--log", metavar="FILE.jsonl|FILE.csv",
                        help=f"write a record per optimizer step ({fields}; eval_loss and eval_accuracy after an "
                             "evaluation) as JSON lines or CSV, by the suffix, flushed line by line; a file that "
                             "exists is continued from the run's first step (a run resumed from --snapshot-dir keeps "
                             "the steps before it), so a run from step 1 replaces it")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="write the records as TensorBoard scalars (train/loss, train/lr, train/grad_norm, "
                             "train/samples_per_s, eval/loss, eval/accuracy) to an event file in DIR, made if "
                             'missing (tensorboardX: pip install "revgraph[tensorboard]")')
    parser.add_argument("--loss-curve", metavar="FILE.svg",
                        help="draw the training loss per step (and the evaluation loss) as an SVG chart, written "
                             "when training ends or stops")


def runlog_outputs(args: argparse.Namespace) -> dict[str, str | None]:
    """The files of ``--log`` and ``--loss-curve`` by label, for the command's output checks."""
    return {"--log": args.log, "--loss-curve": args.loss_curve}


def check_runlog_arguments(args: argparse.Namespace, inputs: dict, outputs: dict) -> None:
    """Before training: ``--log``'s suffix, ``--loss-curve``'s, and ``--tensorboard``: tensorboardX installed
    and the directory one that exists or can be made, neither a file nor the place of another output, nor an
    input. Raises :class:`RevgraphError` (one line; the CLI exits 2). The files themselves are checked with the
    command's other outputs (:func:`revgraph.cli.common.check_command_outputs`, labels :data:`RUNLOG_FILES`)."""
    if args.log is not None:
        log_writer(args.log, "--log")
    if args.loss_curve is not None and os.path.splitext(args.loss_curve)[1].lower() != ".svg":
        raise RevgraphError(f"--loss-curve {args.loss_curve!r}: give a file ending in .svg (the chart is SVG)")
    if args.tensorboard is not None:
        summary_writer_class()
        _check_directory(args.tensorboard, inputs, outputs)


def _check_directory(path: str, inputs: dict, outputs: dict) -> None:
    """``--tensorboard DIR``: a writable directory, or a path under a writable one where it can be made."""
    where = f"--tensorboard {path!r}"
    if not path:
        raise RevgraphError("--tensorboard is empty; give a directory")
    real = os.path.realpath(path)
    for label, other in {**inputs, **outputs}.items():
        if other and os.path.realpath(str(other)) == real:
            raise RevgraphError(f"{where} is {label} {str(other)!r}; choose another directory")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise RevgraphError(f"{where} is not a directory; give a directory for the event files")
        if not os.access(path, os.W_OK | os.X_OK):
            raise RevgraphError(f"cannot write {where}: the directory is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise RevgraphError(f"cannot make {where}: {parent!r} is not a writable directory")


@contextmanager
def run_logs(args: argparse.Namespace, trainer) -> Iterator[list]:
    """The writers of ``--log``, ``--tensorboard`` and ``--loss-curve`` as ``fit``'s callbacks (none on a rank
    other than 0), closed when the block ends: the loss curve gets a resumed run's earlier steps from the
    ``--log`` file it continued (:meth:`LossCurve.prepend`; the snapshot holds no per-step losses) and is written, also
    when training stopped with an error (that error is the one raised then, not one of closing)."""
    writers: list = []
    if trainer.is_main:
        if args.log is not None:
            writers.append(log_writer(args.log, "--log"))
        if args.tensorboard is not None:
            writers.append(TensorBoardLog(args.tensorboard))
        if args.loss_curve is not None:
            writers.append(LossCurve(args.loss_curve, f"{os.path.basename(args.model)}: training loss ({args.loss})"))
    try:
        yield writers
    except BaseException:
        _close(writers, trainer, quiet=True)
        raise
    _close(writers, trainer)


def _close(writers: list, trainer, quiet: bool = False) -> None:
    failed = None
    for w in writers:
        try:
            if isinstance(w, LossCurve):  # a resumed run's earlier steps: from the log it continued, if any
                w.prepend(next((log.kept for log in writers if hasattr(log, "kept")), []))
            w.close()
        except RevgraphError as exc:
            failed = failed or exc
    if failed is not None and not quiet:
        raise failed
