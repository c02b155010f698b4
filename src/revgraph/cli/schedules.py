"""The ``revgraph train`` options of :mod:`revgraph.train.schedules` and :mod:`revgraph.train.run_record`: learning-rate
schedule, warmup, clipping, weight-decay exclusions and ``--override`` (choices read from the registries); and
``--embedding-update``, the optimizer's update of embedding tables (:mod:`revgraph.train.optimizers`)."""

from __future__ import annotations

import argparse

from ..errors import RevgraphError
from .numeric import NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lr-schedule``, ``--warmup-steps``, ``--min-lr``, ``--clip-grad-norm``, ``--decay-all``, ``--no-decay``
    and ``--override`` (module doc of :mod:`revgraph.train.schedules` for the formulas)."""
    from ..train.schedules import SCHEDULES

    kinds = "; ".join(f"{k}: {v.help}" for k, v in SCHEDULES.items() if v.help)
    parser.add_argument("--lr-schedule", choices=list(SCHEDULES), default="constant",
                        help=f"the learning rate over the run ({kinds}; transformers' schedules; default "
                             "constant)")
    parser.add_argument("--warmup-steps", type=NON_NEGATIVE_INT, default=0, metavar="N",
                        help="raise the learning rate linearly from 0 to --lr over the first N steps (default 0)")
    parser.add_argument("--min-lr", type=NON_NEGATIVE, default=0.0, metavar="LR",
                        help=f"with --lr-schedule {'|'.join(k for k, v in SCHEDULES.items() if v.reads_min_lr)}: "
                             "the rate the decay ends at (default 0)")
    parser.add_argument("--clip-grad-norm", type=POSITIVE, metavar="C",
                        help="scale the gradients so that their global L2 norm over all trained parameters is at "
                             "most C (torch.nn.utils.clip_grad_norm_; default: no clipping)")
    parser.add_argument("--decay-all", action="store_true",
                        help="apply weight decay to every parameter (default: not to biases and 1-D parameters)")
    parser.add_argument("--no-decay", nargs="+", metavar="GLOB",
                        help="apply no weight decay to the parameters matching these patterns (instead of the "
                             "default: biases and 1-D parameters)")
    parser.add_argument("--override", action="append", default=[], metavar="NAME",
                        help="resume from --snapshot-dir although the recorded setting NAME differs (lr, "
                             "weight_decay, lr_schedule, total_steps, clip_grad_norm, ...; repeatable)")


def add_embedding_update_argument(parser: argparse.ArgumentParser) -> None:
    """``--embedding-update dense|lazy``: how a table read only through Gather is updated from its gradient rows
    (:attr:`revgraph.train.optimizers.Optimizer.embedding_update`)."""
    from ..train.optimizers import EMBEDDING_UPDATES

    parser.add_argument("--embedding-update", choices=EMBEDDING_UPDATES, default="dense",
                        help="how an embedding table (a parameter read only through Gather, its gradient built as "
                             "rows) is updated: dense, exactly torch.optim's update of the dense gradient (the rows "
                             "a batch misses decay their moments and get weight decay too), or lazy, the batch's "
                             "rows only, as torch.optim.SparseAdam (cheaper for a large table; default dense)")


def schedule_settings(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`revgraph.train.optimizers.make_optimizer` for these options (and
    ``--embedding-update``'s, :func:`add_embedding_update_argument`). Raises
    :class:`RevgraphError` (one line) for bad values."""
    from ..train.schedules import Schedule

    if args.override and args.checkpoint_dir is None:
        raise RevgraphError("--override goes with --snapshot-dir: it lets a run resume with another setting")
    if args.decay_all and args.no_decay:
        raise RevgraphError("--decay-all and --no-decay contradict each other; give one")
    out: dict = {"embedding_update": getattr(args, "embedding_update", None)}  # (None: the optimizer's default)
    if args.lr_schedule != "constant" or args.warmup_steps or args.min_lr:
        out["schedule"] = Schedule(args.lr_schedule, args.warmup_steps, args.min_lr)
    if args.clip_grad_norm is not None:
        out["clip_grad_norm"] = args.clip_grad_norm
    if args.decay_all:
        out["no_decay"] = "none"
    elif args.no_decay:
        out["no_decay"] = tuple(args.no_decay)
    return out


def decay_line(trainer) -> str | None:
    """``"weight decay 0.01 on 2 parameters, not on 2 (biases and 1-D parameters): b1, b2"`` (``None``
    without weight decay)."""
    spec = trainer.spec
    wd = spec.optimizer.weight_decay
    if not wd:
        return None
    rule = spec.optimizer.no_decay
    why = {"default": " (biases and 1-D parameters)", "none": ""}.get(rule, " (--no-decay)") \
        if isinstance(rule, str | tuple) else ""
    excluded = spec.no_decay
    names = ", ".join(excluded[:10]) + (" ..." if len(excluded) > 10 else "")
    return (f"weight decay {wd:g} on {len(spec.params) - len(excluded)} parameters"
            + (f", not on {len(excluded)}{why}: {names}" if excluded else " (all of them)"))
