"""The command line of LoRA and frozen weights: ``revgraph train --lora R [--lora-alpha A] [--lora-targets GLOB ...]
[--merge-adapters] [--train GLOB ...] [--freeze GLOB ...]`` (hooks called by :mod:`revgraph.cli.train`) and
``revgraph lora extract|apply`` (:mod:`revgraph.train.lora`; PEFT directories: :mod:`.hf`)."""

from __future__ import annotations

import argparse
import math
import os

from ..errors import RevgraphError
from ..ir import Graph
from .common import check_command_outputs, out
from .hf import add_peft_arguments, apply_peft, extract_peft, is_peft
from .numeric import NONZERO, POSITIVE_INT


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` options that choose what trains: ``--train``/``--freeze`` globs and the LoRA options."""
    parser.add_argument("--train", nargs="+", metavar="GLOB",
                        help="train only the initializers these names or fnmatch globs match (default: the "
                             "module's parameters, not its buffers nor one-element constants, by the record "
                             "rg.export_torch or the dynamo exporter wrote, else by name: docs/training.md; or the "
                             "LoRA adapters of a model that has them)")
    parser.add_argument("--freeze", nargs="+", metavar="GLOB",
                        help="do not train the initializers these names or globs match")
    parser.add_argument("--lora", type=POSITIVE_INT, metavar="RANK",
                        help="add LoRA adapters of this rank to the MatMul/Gemm weights (2-D float initializers, or "
                             "DequantizeLinear of int8/int4 ones) and com.microsoft.MatMulNBits (packed int4, a frozen "
                             "base) and train only them")
    parser.add_argument("--lora-alpha", type=NONZERO, metavar="A",
                        help="with --lora: the adapters' update is scaled by A / RANK (default A = RANK: scaling 1)")
    parser.add_argument("--lora-targets", nargs="+", metavar="GLOB",
                        help="with --lora: adapt only the weights (initializer names) or nodes these globs match, "
                             "e.g. '*q_proj*' '*v_proj*' (default: every eligible weight)")
    parser.add_argument("--merge-adapters", action="store_true",
                        help="write the trained model with W + (A/RANK) x lora_A x lora_B folded into the weights "
                             "(a quantized or MatMulNBits base becomes a float weight; default: the adapters stay "
                             "separate nodes and initializers)")


def lora_model(args: argparse.Namespace, model: Graph) -> tuple[Graph, dict]:
    """The model to train (with the adapters of ``--lora``) and the Trainer's ``params``/``freeze`` arguments.
    Raises :class:`RevgraphError` (one line, before training) for bad LoRA options or patterns."""
    from ..train import lora

    if args.lora is None:
        given = [o for o, v in [("--lora-alpha", args.lora_alpha is not None),
                                ("--lora-targets", args.lora_targets is not None)] if v]
        if given:
            raise RevgraphError(f"{given[0]} goes with --lora RANK")
    else:
        if args.lora <= 0:
            raise RevgraphError(f"--lora {args.lora}: give a rank >= 1")
        if args.lora_alpha is not None and (not math.isfinite(args.lora_alpha) or args.lora_alpha == 0):
            raise RevgraphError(f"--lora-alpha {args.lora_alpha}: give a finite non-zero number")
        model = lora.add_adapters(model, args.lora, args.lora_alpha, args.lora_targets, seed=args.seed)
    if args.merge_adapters and lora.config(model) is None:
        raise RevgraphError("--merge-adapters goes with --lora RANK (or a model that has LoRA adapters)")
    from ..train.selection import select

    select(model, args.train, args.freeze)  # a pattern that matches nothing fails here, naming it
    return model, {"params": args.train, "freeze": args.freeze}


def selection_line(args: argparse.Namespace, trainer) -> str:
    """The count of trainable and frozen parameters, always (issue 38: say what trains), and where the default
    set left float initializers out (no ``--train``/``--freeze``/``--lora``, no adapters in the model), which
    and why, grouped by why, a few names of each."""
    from ..train.lora import config
    from ..train.selection import count_line, left_out

    line = count_line(trainer.spec.model, trainer.spec.params)
    chosen = args.train or args.freeze or args.lora is not None or config(trainer.spec.model) is not None
    trained = set(trainer.spec.params)
    skipped: dict[str, list[str]] = {}
    for k, why in ({} if chosen else left_out(trainer.spec.model)).items():
        if k not in trained:
            skipped.setdefault(why, []).append(k)
    if skipped:
        line += "; left out by default (--train NAME trains one): " + "; ".join(
            f"{why}: {_names(names)}" for why, names in skipped.items())
    return line


def _names(names: list[str], shown: int = 4, width: int = 48) -> str:
    """A few of ``names`` (each cut to ``width`` characters), and how many in all where there are more."""
    cut = [n if len(n) <= width else n[: width - 3] + "..." for n in names[:shown]]
    return ", ".join(cut) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def export_trained(trainer, args: argparse.Namespace) -> None:
    """Write ``-o``: the trained model, its adapters merged into the weights with ``--merge-adapters``."""
    from ..onnx_io import save
    from ..train.lora import merge_adapters

    model = trainer.spec.model.copy()
    model.initializers.update(trainer._written())  # (rank 0)
    save(merge_adapters(model) if args.merge_adapters else model, args.output)


def written(args: argparse.Namespace, trainer) -> str:
    """What ``-o`` holds, for the last line of ``revgraph train``."""
    from ..train.lora import config

    if args.merge_adapters:
        return "trained LoRA adapters merged into the weights"
    if config(trainer.spec.model) is not None:
        return "trained LoRA adapters as separate nodes and initializers; revgraph lora extract writes them alone"
    return "trained weights as initializers"


# ------------------------------------------------------------------------------------------------ lora


def add_lora_parser(sub) -> None:
    """``revgraph lora extract|apply``."""
    from ..train.lora import ADAPTER_FORMATS

    lora = sub.add_parser("lora", help="LoRA adapters: extract them from a trained model, apply them to a base model")
    actions = lora.add_subparsers(dest="lora_command", metavar="ACTION", parser_class=type(lora))
    actions.required = True
    extract = actions.add_parser("extract", help="write the adapters of a model trained with --lora alone, with "
                                 "their configuration")
    extract.add_argument("model", metavar="TRAINED.onnx")
    extract.add_argument("-o", "--output", required=True, metavar="ADAPTERS" + "|".join(ADAPTER_FORMATS) + "|DIR",
                         help="an .npz file (arrays by name + the configuration), a small .onnx file, or with "
                              "--format peft a PEFT adapter directory")
    add_peft_arguments(extract)
    apply = actions.add_parser("apply", help="add adapters to the base model they were trained on")
    apply.add_argument("model", metavar="BASE.onnx")
    apply.add_argument("adapters", metavar="ADAPTERS", help="written by revgraph lora extract (.npz or .onnx), a "
                       "model trained with --lora, or a PEFT adapter directory (save_pretrained)")
    apply.add_argument("-o", "--output", required=True, metavar="OUT.onnx")
    apply.add_argument("--merge", action="store_true", help="fold the adapters into the weights")


def cmd_lora(args: argparse.Namespace) -> int:
    """``revgraph lora extract|apply``: write the adapters of a trained model alone, or apply them to a base model
    (merged with ``--merge``); returns the exit code."""
    from ..onnx_io import load
    from ..train import lora
    from .write import write_graph

    if args.lora_command == "extract":
        if is_peft(args):
            return extract_peft(args)
        suffix = os.path.splitext(args.output)[1].lower()
        if suffix not in lora.ADAPTER_FORMATS:
            raise RevgraphError(f"-o {args.output!r}: give a file name ending in {' or '.join(lora.ADAPTER_FORMATS)}")
        check_command_outputs(args, {"-o": args.output})
        g = load(args.model)
        tensors, elements = lora.save_adapters(args.output, g)
        c = lora.config(g)
        out.print(f"wrote {args.output}: {len(c['adapters'])} adapters ({tensors} tensors, {elements:,} elements; "
                  f"rank {c['rank']}, alpha {c['alpha']:g})", soft_wrap=True, markup=False)
        return 0
    if os.path.isdir(args.adapters):
        return apply_peft(args)
    check_command_outputs(args, {"-o": args.output}, {"ADAPTERS": args.adapters}, models=("-o",))
    arrays, configuration = lora.load_adapters(args.adapters)
    base = load(args.model)
    g = lora.apply(base, arrays, configuration, merge=args.merge, source=args.adapters)
    write_graph(g, args.output, None, "adapted model", base)
    how = "merged into the weights" if args.merge else "as separate nodes and initializers"
    out.print(f"wrote {args.output}: {len(configuration['adapters'])} adapters (rank {configuration['rank']}, alpha "
              f"{configuration['alpha']:g}) {how}", soft_wrap=True, markup=False)
    return 0
