"""``revgraph train`` options of the data-parallel gradient exchange and of step timing: ``--bucket-mb``,
``--reduce-dtype``, ``--overlap``, ``--accumulate-steps`` and ``--profile`` (:mod:`revgraph.train.distributed.exchange`,
:mod:`revgraph.train.distributed.overlap`, :mod:`revgraph.train.steptimes`), and ``--offload`` (the optimizer's
state and update in host memory, :mod:`revgraph.train.offload`)."""

from __future__ import annotations

import argparse
import os

from ..errors import RevgraphError
from ..train.distributed.exchange import BUCKET_MB, REDUCE_DTYPES, refused_combination
from ..train.offload import OFFLOADS, refused_offload
from . import numeric as N


def add_exchange_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options to the ``train`` parser."""
    parser.add_argument("--bucket-mb", type=N.BUCKET_MB, default=None, metavar="MB",
                        help="data-parallel: all-reduce dense gradients in buckets of at most MB MiB, packed in "
                             f"reverse parameter order as DDP's bucket_cap_mb (default {BUCKET_MB:g}; with --shard "
                             "gradients, no larger than keeps the gradient memory within the unsharded one)")
    parser.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default="fp32",
                        help="data-parallel: the dtype gradient buckets are all-reduced in; bf16 halves the bytes and "
                             "rounds each gradient to 8 significant bits, as DDP's bf16_compress_hook (default fp32)")
    parser.add_argument("--overlap", choices=("on", "off", "auto"), default="auto",
                        help="data-parallel: run the backward pass in segments, one per bucket, and all-reduce each "
                             "bucket while the next segment runs (with one bucket nothing is cut); auto (default): on "
                             "with --device cuda, off on the CPU, where gloo competes with the backward for the cores")
    parser.add_argument("--accumulate-steps", type=N.POSITIVE_INT, default=1, metavar="K",
                        help="sum the gradients of K micro-batches of --batch-size (per process) before one exchange "
                             "and one update: a step equals one of batch size K x --batch-size (default 1)")
    parser.add_argument("--offload", choices=OFFLOADS, default="none",
                        help="optimizer: keep the optimizer state (Adam's m and v, fp32 master parameters) in host "
                             "memory and run the update on the CPU, while the forward and backward run on --device; "
                             "a GPU then holds only parameters and gradients (on --device cpu it changes nothing; "
                             "default none)")
    parser.add_argument("--profile", action="store_true",
                        help="time each step's phases (forward+backward, the wait for the gradient exchange, update) "
                             "and print their medians on rank 0 at the end")


def check_exchange_arguments(args: argparse.Namespace) -> None:
    """Bad values fail in one line before any worker starts."""
    if args.accumulate_steps < 1:
        raise RevgraphError(f"--accumulate-steps must be at least 1, got {args.accumulate_steps}")
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        raise RevgraphError(f"--bucket-mb must be a positive number of MiB, got {args.bucket_mb:g}")
    # with the precision and the world size: --precision fp16 --shard ... --nproc 2 was refused only inside the
    # workers, after torchrun started (its traceback lines around the refusal)
    world = max(args.nproc or 1, int(os.environ.get("WORLD_SIZE", "1"))) * max(getattr(args, "nnodes", 1) or 1, 1)
    combination_problem = refused_combination(args.shard, args.sync_batchnorm, args.reduce_dtype,
                                              args.accumulate_steps, args.buffers,
                                              precision=getattr(args, "precision", "fp32"), world_size=world)
    if combination_problem:
        raise RevgraphError(combination_problem)
    offload_problem = refused_offload(args.offload, args.buffers, args.shard, args.sync_batchnorm,
                                      getattr(args, "precision", "fp32"))
    if offload_problem:
        raise RevgraphError(offload_problem)


def trainer_arguments(args: argparse.Namespace) -> dict:
    """The :class:`revgraph.Trainer` keywords of the options."""
    return {"bucket_mb": args.bucket_mb, "reduce_dtype": args.reduce_dtype,
            "overlap": {"on": True, "off": False, "auto": "auto"}[args.overlap],
            "profile": args.profile, "offload": args.offload}


def profile_line(trainer) -> str | None:
    """What ``--profile`` prints: the median of each phase over the steps of this run."""
    if trainer.times is None:
        return None
    who = "rank 0" if trainer.comm else "one process"
    return f"profile ({who}): {trainer.times.summary()}"
