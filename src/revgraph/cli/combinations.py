"""Options that have no effect in the combination given are refused in one line (issue 40, item 4; ``train``'s
here, :func:`given` also for ``run --seed`` and the forward-mode commands' ``--checkpoint``): ``--snapshot-every 1``
without ``--snapshot-dir`` exited 0 with no snapshot, ``--snapshot-dir A
--checkpoint-dir B`` wrote only B (the old spelling of the same option won), and the data-parallel options did
nothing in one process. What an option needs is a row of :data:`NEEDS`; whether it was given is read from the
command line itself (``args.argv``), so an option given at its default value counts as given."""

from __future__ import annotations

import argparse

from ..errors import RevgraphError

#: (options, whether they have an effect, what they need): checked in order, the first refusal is reported
NEEDS = [
    (("--snapshot-every", "--checkpoint-every"), lambda a: a.checkpoint_dir is not None, "--snapshot-dir DIR"),
    (("--sync-batchnorm", "--bucket-mb", "--reduce-dtype", "--overlap", "--timeout"),
     lambda a: a.nproc is not None or a.distributed, "--nproc N (data-parallel training)"),
]
#: the old spellings of options, kept working: the two may not be given together
SPELLINGS = [("--snapshot-dir", "--checkpoint-dir"), ("--snapshot-every", "--checkpoint-every")]


def given(args: argparse.Namespace, option: str) -> bool:
    """Was ``option`` written on the command line (``--opt VALUE`` or ``--opt=VALUE``; argparse takes no
    abbreviations here)?"""
    return any(t == option or t.startswith(option + "=") for t in getattr(args, "argv", ()))


def check_train_combinations(args: argparse.Namespace, distributed: bool) -> None:
    """Raise :class:`RevgraphError` (one line) for the first option of ``args`` that has no effect with the others
    (:data:`NEEDS`) or is given under both its spellings (:data:`SPELLINGS`). ``distributed``: running under
    torchrun (its workers get the launcher's options)."""
    for new, old in SPELLINGS:
        if given(args, new) and given(args, old):
            raise RevgraphError(f"{new} and {old} are the same option ({old} is its old name): give one")
    view = argparse.Namespace(**vars(args), distributed=distributed)
    for options, effective, needs in NEEDS:
        found = [o for o in options if given(args, o)]
        if found and not effective(view):
            raise RevgraphError(f"{found[0]} has no effect without {needs}: add it, or leave {found[0]} out")


def check_decay_options(args: argparse.Namespace, weight_decay: float) -> None:
    """``--no-decay`` and ``--decay-all`` choose which parameters weight decay reaches: refused (one line) when
    the optimizer's weight decay is 0 (``weight_decay``: its value after the optimizer's defaults)."""
    for option in ("--no-decay", "--decay-all"):
        if given(args, option) and not weight_decay:
            raise RevgraphError(f"{option} has no effect with a weight decay of 0 ({args.optimizer}'s default): give "
                                f"--weight-decay WD, or leave {option} out")
