"""The command line's ``--precision`` and fp16 loss-scaling options (GradScaler's names), read into a
:class:`revgraph.train.precision.Precision` (the formulas and their checks are there)."""

from __future__ import annotations

import argparse

from ..errors import RevgraphError
from ..train.precision import PRECISIONS, Precision
from . import numeric as N


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    """``--precision`` (choices :data:`PRECISIONS`) and the fp16 loss-scaling options (GradScaler's names)."""
    d = Precision()
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="mixed precision: matrix products and convolutions in bfloat16 or float16 with float32 "
                             "master weights (torch.autocast); fp16 scales the loss dynamically (GradScaler; "
                             "default fp32)")
    parser.add_argument("--init-scale", type=N.LOSS_SCALE, metavar="S",
                        help=f"fp16: the initial loss scale (default {d.init_scale:g})")
    parser.add_argument("--growth-factor", type=N.GROWTH_FACTOR, metavar="F",
                        help=f"fp16: the scale's factor after --growth-interval good steps (default "
                             f"{d.growth_factor:g})")
    parser.add_argument("--backoff-factor", type=N.BACKOFF_FACTOR, metavar="F",
                        help=f"fp16: the scale's factor after a non-finite gradient (default {d.backoff_factor:g})")
    parser.add_argument("--growth-interval", type=N.POSITIVE_INT, metavar="N",
                        help=f"fp16: good steps in a row before the scale grows (default {d.growth_interval})")


def precision_from_args(args: argparse.Namespace) -> Precision:
    """The :class:`Precision` of ``--precision`` and the loss-scaling options; :class:`RevgraphError` for a
    scaling option without ``--precision fp16``."""
    names = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
    given = {k: getattr(args, k, None) for k in names if getattr(args, k, None) is not None}
    if given and args.precision != "fp16":
        raise RevgraphError(f"--{next(iter(given)).replace('_', '-')} sets the fp16 loss scaling: it goes with "
                            "--precision fp16")
    return Precision(args.precision, **given)
