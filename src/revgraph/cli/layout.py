"""How the ``revgraph`` subcommands present themselves (issue 44, item 5): the argument groups of each ``--help``
(:data:`LAYOUT`, one table instead of a ``group=`` in every module that adds options, so that the modules keep
adding what they own and the layout is read in one place), the examples at its end
(:mod:`revgraph.cli.examples`), ``--quiet``/``--verbose`` on every command, the old spellings of renamed options
(:func:`add_renamed`: accepted, hidden from ``--help`` and from shell completion) and ``--print-completion``
(shell completion scripts written by shtab from the parsers themselves)."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

from .examples import epilog

#: the groups' descriptions, by title; a group appears in a command's help in the order of :data:`LAYOUT`
GROUPS = {
    "data": "what the model is fed, and in what order",
    "loss": "what is minimized",
    "differentiation": "what is differentiated, with respect to what",
    "model": "what trains",
    "optimizer": "the update",
    "schedule": "the learning rate over the run",
    "precision": "mixed precision and the fp16 loss scaling",
    "memory": "what is stored, recomputed or allocated",
    "runtime": "where and how onnxruntime runs",
    "distributed": "data-parallel training (--nproc N, or under torchrun)",
    "tolerance": "when a gradient agrees",
    "output": "what is written and reported",
}
_RUNTIME = ("--arena", "--arena-extend", "--memory-pattern", "--memory-reuse", "--execution-order",
            "--graph-optimization")
_LOSS_WRT = ("--loss", "--wrt")
_FORWARD_OUT = ("-o", "--opset")

#: command (as typed after ``revgraph``) -> group title -> its options, in help order; every option a command
#: shows in --help is placed (:func:`finish` refuses a parser with one left over, so a new option needs a row)
LAYOUT: dict[str, dict[str, tuple[str, ...]]] = {
    "info": {},
    "run": {"data": ("--inputs", "--seed"), "runtime": ("--backend", "--device", *_RUNTIME), "output": ("-o",)},
    "grad": {
        "differentiation": (*_LOSS_WRT, "--cotangent", "--unconnected", "--sparse", "--lift-constants",
                            "--straight-through"),
        "memory": ("--checkpoint", "--memory-budget", "--accumulate"),
        "output": _FORWARD_OUT,
    },
    "check": {"differentiation": (*_LOSS_WRT, "--lift-constants"), "data": ("--inputs", "--seed"),
              "tolerance": ("--rtol", "--atol")},
    "show": {"differentiation": ("--grad", *_LOSS_WRT), "memory": ("--checkpoint",), "output": ("-o",)},
    "jvp": {"differentiation": ("--outputs", "--wrt"), "memory": ("--checkpoint",), "output": _FORWARD_OUT},
    "hvp": {"differentiation": _LOSS_WRT, "memory": ("--checkpoint", "--memory-budget"), "output": _FORWARD_OUT},
    "jacobian": {"differentiation": ("--outputs", "--wrt", "--mode"), "memory": ("--checkpoint", "--memory-budget"),
                 "output": _FORWARD_OUT},
    "hessian": {"differentiation": _LOSS_WRT, "memory": ("--checkpoint", "--memory-budget"), "output": _FORWARD_OUT},
    "train": {
        "data": ("--data", "--static", "--batch-size", "--epochs", "--max-steps", "--no-shuffle", "--seed",
                 "--eval-data", "--eval-every", "--eval-batch-size", "--test-data"),
        "loss": ("--loss-fn", "--model-output", "--labels-from", "--ignore-index", "--label-smoothing",
                 "--class-weights", "--loss-chunk", "--allow-nonfinite"),
        "model": ("--train", "--freeze", "--lora", "--lora-alpha", "--lora-targets", "--merge-adapters",
                  "--lift-constants", "--straight-through"),
        "optimizer": ("--optimizer", "--lr", "--momentum", "--weight-decay", "--decay-all", "--no-decay",
                      "--embedding-update", "--clip-grad-norm", "--accumulate-steps"),
        "schedule": ("--lr-schedule", "--warmup-steps", "--min-lr"),
        "precision": ("--precision", "--init-scale", "--growth-factor", "--backoff-factor", "--growth-interval"),
        "memory": ("--memory-budget", "--buffers", "--offload", "--arena", "--arena-extend",
                   "--memory-pattern", "--memory-reuse", "--frozen-weights"),
        "runtime": ("--device", "--threads", "--execution-order", "--graph-optimization"),
        "distributed": ("--nproc", "--shard", "--sync-batchnorm", "--bucket-mb", "--reduce-dtype", "--overlap",
                        "--timeout", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--local-addr",
                        "--max-restarts"),
        "output": ("-o", "--save-training-graph", "--save-safetensors", "--snapshot-dir", "--snapshot-every",
                   "--override", "--log", "--tensorboard", "--loss-curve", "--profile"),
    },
    "demo": {"data": ("--seed", "--quick", "--epochs", "--hidden"), "output": ("-o", "--force")},
    "lora": {},
    "lora extract": {"output": ("-o", "--format", "--task-type")},
    "lora apply": {"output": ("-o", "--merge")},
}


#: a usage line of the required options and "[options]", for the commands whose full list fills a screen
USAGE = {"train": "%(prog)s MODEL.onnx --data DATA.npz|DIR --loss-fn LOSS\n"
                  "       (--epochs N | --max-steps N) -o TRAINED.onnx [options]"}


class Formatter(argparse.HelpFormatter):
    """argparse's formatter, except that the ``examples:`` epilog keeps its lines (one command per line)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return text
        return super()._fill_text(text, width, indent)


def add_renamed(parser, new: str, old: str, **kwargs) -> argparse.Action:
    """Add option ``new`` to ``parser`` with ``kwargs``, and its old spelling ``old`` as a second option of the
    same ``dest`` that ``--help`` and shell completion leave out (``help=SUPPRESS``): a command written with
    ``old`` keeps working, and an error names the spelling the user wrote. A ``required`` option is satisfied by
    either spelling (:func:`required_unless_renamed`). Returns ``new``'s action."""
    visible = parser.add_argument(new, **kwargs)
    parser.add_argument(old, **{**kwargs, "dest": visible.dest, "help": argparse.SUPPRESS, "required": False})
    visible.renamed_from = old
    return visible


def _renamed(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if getattr(a, "renamed_from", None)]


def _written(strings) -> list[str]:
    return [s.split("=", 1)[0] for s in strings or () if s.startswith("--")]


@contextmanager
def required_unless_renamed(parser: argparse.ArgumentParser, strings):
    """While ``parser`` parses ``strings``: a required option of :func:`add_renamed` given under its old
    spelling is not required under the new one (argparse counts only the action it saw)."""
    written = _written(strings)
    relaxed = [a for a in _renamed(parser) if a.required and a.renamed_from in written]
    for action in relaxed:
        action.required = False
    try:
        yield
    finally:
        for action in relaxed:
            action.required = True


def spelling_problem(parser: argparse.ArgumentParser, strings) -> str | None:
    """The usage error of an option of ``parser`` given under both its spellings (:func:`add_renamed`) in the
    command line ``strings`` (the last would silently win), else ``None``."""
    written = _written(strings)
    for action in _renamed(parser):
        new, old = action.option_strings[0], action.renamed_from
        if new in written and old in written:
            return f"{new} and {old} are the same option ({old} is its old name): give one"
    return None


def finish(root: argparse.ArgumentParser) -> None:
    """Lay out every subcommand of ``root`` (:data:`LAYOUT`), add its examples and ``--quiet``/``--verbose``
    (leaf commands), and ``--print-completion`` to ``root``."""
    root.add_argument("--print-completion", choices=("bash", "zsh", "tcsh"), action=_Completion,
                      help="print a shell completion script and exit: eval \"$(revgraph --print-completion bash)\" "
                           "in ~/.bashrc; for zsh, save it as _revgraph in a directory of $fpath")
    root.formatter_class = Formatter
    root.epilog = epilog("") + "\n\nevery command takes -q/--quiet (errors, warnings, results) and -v/--verbose"
    for command, parser in _commands(root):
        parser.formatter_class = Formatter
        parser.epilog = epilog(command)
        parser.usage = USAGE.get(command, parser.usage)
        if not _subcommands(parser):
            _add_verbosity(parser)
        _arrange(parser, LAYOUT[command], command)


def _commands(root: argparse.ArgumentParser):
    """(``"lora extract"``, parser) for every subcommand under ``root``, depth first (iterative)."""
    stack = [("", root)]
    while stack:
        prefix, parser = stack.pop()
        for name, sub in reversed(list(_subcommands(parser).items())):
            command = f"{prefix} {name}".strip()
            yield command, sub
            stack.append((command, sub))


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _add_verbosity(parser: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` and ``-v/--verbose`` (one of them): ``args.verbosity`` -1, 0 or 1 (:mod:`revgraph.cli.common`)."""
    both = parser.add_mutually_exclusive_group()
    both.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1, default=0,
                      help="print only errors, warnings and the results (no progress bar, notes or per-step lines)")
    both.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1, default=0,
                      help="also print the settings in effect (defaults included), every name added, and the time "
                           "taken, on standard error")


def _arrange(parser: argparse.ArgumentParser, layout: dict[str, tuple[str, ...]], command: str) -> None:
    """Move ``parser``'s options into the groups of ``layout`` (help display only: parsing is unchanged)."""
    for title, options in layout.items():
        group = parser.add_argument_group(title, GROUPS[title])
        for option in options:
            action = parser._option_string_actions[option]
            for other in parser._action_groups:
                if action in other._group_actions:
                    other._group_actions.remove(action)
            group._group_actions.append(action)
    loose = [a.option_strings[0] for a in parser._optionals._group_actions
             if a.help != argparse.SUPPRESS and a.dest not in ("help", "verbosity")]
    if loose:
        raise AssertionError(f"revgraph {command}: options without a group in cli/layout.py's LAYOUT: {loose}")


def settings(args: argparse.Namespace) -> str:
    """``--verbose``'s first line: every option of the command as parsed, defaults included (``-`` where an
    option left out means "the library's choice"), by its ``dest``."""
    internal = {"argv", "command", "lora_command", "verbosity", "traceback", "print_completion"}
    shown = {k: ("-" if v is None else v) for k, v in sorted(vars(args).items()) if k not in internal}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


class _Completion(argparse.Action):
    """``--print-completion SHELL``: shtab's script for the whole parser (subcommands, options, choices; files
    where a path is expected), written to standard output; shtab is imported only here."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import shtab

        for _, sub in _commands(parser):
            for action in sub._actions:
                metavar = str(action.metavar or "")
                if action.choices is None and any(k in metavar for k in (".", "FILE", "DIR", "ADAPTERS")):
                    action.complete = shtab.DIRECTORY if metavar == "DIR" else shtab.FILE
        sys.stdout.write(shtab.complete(parser, values))
        parser.exit(0)
