"""``revgraph train``'s run length, data order and evaluation: ``--epochs N`` or ``--max-steps N``,
``--no-shuffle``, ``--eval-data FILE``, ``--eval-every N`` and ``--eval-batch-size B`` (:meth:`revgraph.Trainer.fit`'s
``epochs``, ``max_steps``, ``shuffle``, ``eval_data``, ``eval_every``, ``eval_batch_size``).

The training set is evaluated only when asked (give its file as ``--eval-data``): before issue 38 every run
evaluated it whole before and after training at batch 512, which took a small LLaMA from 380 MB to 3.47 GB.
Evaluation reads batches of the training batch size unless told otherwise, so it needs no more memory than a
training step.
"""

from __future__ import annotations

import argparse

from ..errors import RevgraphError
from . import numeric as N


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the run's length, order and evaluation (module doc)."""
    parser.add_argument("--epochs", type=N.POSITIVE_INT, metavar="N", help="passes over the training data")
    parser.add_argument("--max-steps", type=N.POSITIVE_INT, metavar="N",
                        help="train this many optimizer steps instead of whole epochs (as many epochs as they need, "
                             "the last cut short; give --epochs or --max-steps)")
    parser.add_argument("--no-shuffle", action="store_true",
                        help="visit the samples in their order every epoch (default: a permutation from --seed and "
                             "the epoch)")
    parser.add_argument("--eval-data", metavar="EVAL.npz|DIR",
                        help="evaluate the loss (and accuracy) on these arrays at the end, and every --eval-every "
                             "steps (give the training file itself to evaluate the training set)")
    parser.add_argument("--eval-every", type=N.POSITIVE_INT, metavar="N",
                        help="with --eval-data: also evaluate every N steps (printed, and in --log)")
    parser.add_argument("--eval-batch-size", type=N.POSITIVE_INT, metavar="B",
                        help="the batch size of evaluation (--eval-data, --test-data; default: --batch-size)")


def check_fit_arguments(args: argparse.Namespace) -> None:
    """Raise :class:`RevgraphError` (one line, before any worker starts or the model is read) for a run with
    neither or both of ``--epochs`` and ``--max-steps``, and ``--eval-every`` without ``--eval-data``."""
    if args.epochs is None and args.max_steps is None:
        raise RevgraphError("give the run's length: --epochs N (passes over the data) or --max-steps N (optimizer "
                            "steps)")
    if args.epochs is not None and args.max_steps is not None:
        raise RevgraphError("give --epochs or --max-steps, not both: --max-steps trains that many steps, over as many "
                            "epochs as they need")
    if args.eval_every is not None and args.eval_data is None:
        raise RevgraphError("--eval-every has no effect without --eval-data FILE: add it, or leave --eval-every out")
    if args.eval_batch_size is not None and args.eval_data is None and args.test_data is None:
        raise RevgraphError("--eval-batch-size has no effect without --eval-data or --test-data: add one, or leave "
                            "--eval-batch-size out")


def fit_arguments(args: argparse.Namespace, eval_data) -> dict:
    """:meth:`revgraph.Trainer.fit`'s keyword arguments of these options (``eval_data``: the arrays read)."""
    return {"epochs": args.epochs, "max_steps": args.max_steps, "shuffle": not args.no_shuffle,
            "eval_data": eval_data, "eval_every": args.eval_every if eval_data is not None else None,
            "eval_batch_size": args.eval_batch_size if eval_data is not None else None}


def eval_batch(args: argparse.Namespace) -> int:
    """The batch size of evaluation: ``--eval-batch-size``, else ``--batch-size``."""
    return args.eval_batch_size or args.batch_size


def eval_printer(console, every: int | None):
    """A ``fit`` callback that prints each evaluation of ``--eval-every`` (``every``) in one line on ``console``
    (the one after the last step is printed once, as the run's result)."""
    def show(record: dict) -> None:
        if "eval_loss" in record and every and record["step"] % every == 0:
            accuracy = record.get("eval_accuracy")
            console.print(f"step {record['step']}: eval loss {record['eval_loss']:.4g}"
                          + ("" if accuracy is None else f", accuracy {accuracy:.2%}"), soft_wrap=True, markup=False)
    return show
