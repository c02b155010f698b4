"""The command line of the Hugging Face formats: ``revgraph train --save-safetensors FILE.safetensors`` (the
trained weights as a PyTorch state dict, :mod:`revgraph.train.hf_io`) and ``revgraph lora extract --format peft``
/ ``revgraph lora apply BASE.onnx PEFT_DIR`` (PEFT's adapter directory, :mod:`revgraph.train.peft_io`)."""

from __future__ import annotations

import argparse
import os

from ..errors import RevgraphError
from .common import check_command_outputs, out


def add_safetensors_arguments(parser: argparse.ArgumentParser) -> None:
    """``train --save-safetensors FILE.safetensors``."""
    parser.add_argument("--save-safetensors", metavar="FILE.safetensors",
                        help="also write the trained weights as the PyTorch state dict of the exported module "
                             "(module.load_state_dict(safetensors.torch.load_file(FILE)); LoRA adapters merged in; "
                             "names from rg.export_torch's record, else the initializers' own)")


def check_safetensors_output(args: argparse.Namespace) -> None:
    """Refuse (one line, before training) a ``--save-safetensors`` path that does not end in ``.safetensors``."""
    from ..train.hf_io import check_path

    if getattr(args, "save_safetensors", None) is not None:
        check_path(args.save_safetensors, "--save-safetensors")


def write_safetensors_output(trainer, args: argparse.Namespace) -> None:
    """Write ``--save-safetensors`` (when given) after training: :meth:`Trainer.save_state_dict`."""
    if getattr(args, "save_safetensors", None) is None:
        return
    tensors, elements = trainer.save_state_dict(args.save_safetensors)
    out.print(f"wrote {args.save_safetensors}: the PyTorch state dict ({tensors} tensors, {elements:,} elements)",
              soft_wrap=True, markup=False)


# ------------------------------------------------------------------------------------------------- PEFT


def add_peft_arguments(extract: argparse.ArgumentParser) -> None:
    """``lora extract --format npz|onnx|peft [--task-type T]``."""
    from ..train.peft_io import TASK_TYPES

    extract.add_argument("--format", choices=("npz", "onnx", "peft"),
                         help="npz or onnx: revgraph's adapter file (default: from -o's suffix); peft: a directory "
                              "that peft.PeftModel.from_pretrained(base, DIR) loads (adapter_config.json, "
                              "adapter_model.safetensors)")
    extract.add_argument("--task-type", choices=TASK_TYPES, metavar="|".join(TASK_TYPES),
                         help="with --format peft: PEFT's task_type (default none: a plain PeftModel)")


def is_peft(args: argparse.Namespace) -> bool:
    """Whether ``lora extract`` writes PEFT's format; refuses (one line) a ``--format`` that contradicts the
    suffix of ``-o`` and ``--task-type`` without ``--format peft``."""
    peft = args.format == "peft"
    suffix = os.path.splitext(args.output)[1].lower()
    if args.format not in (None, "peft") and suffix != "." + args.format:
        raise RevgraphError(f"-o {args.output!r} does not end in .{args.format}, the --format given")
    if args.task_type is not None and not peft:
        raise RevgraphError("--task-type goes with --format peft")
    return peft


def extract_peft(args: argparse.Namespace) -> int:
    """``lora extract TRAINED.onnx --format peft -o DIR``."""
    from ..onnx_io import load
    from ..train import lora
    from ..train.peft_io import CONFIG, WEIGHTS, save_peft

    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise RevgraphError(f"-o {args.output!r} is a file; --format peft writes a directory ({CONFIG}, {WEIGHTS})")
    files = {f"-o's {name}": os.path.join(args.output, name) for name in (WEIGHTS, CONFIG)}
    check_command_outputs(args, files, creatable=tuple(files), regular=tuple(files))
    g = load(args.model)
    tensors, elements = save_peft(args.output, g, args.task_type)
    c = lora.config(g)
    out.print(f"wrote {args.output}: {len(c['adapters'])} adapters in PEFT's format ({tensors} tensors, "
              f"{elements:,} elements; r {c['rank']}, lora_alpha {c['alpha']:g})", soft_wrap=True, markup=False)
    return 0


def apply_peft(args: argparse.Namespace) -> int:
    """``lora apply BASE.onnx PEFT_DIR -o OUT.onnx [--merge]``."""
    from ..onnx_io import load
    from ..train import lora, peft_io
    from .write import write_graph

    check_command_outputs(args, {"-o": args.output}, models=("-o",))
    base = load(args.model)
    g = peft_io.apply_peft(base, args.adapters)
    c = lora.config(g)
    write_graph(lora.merge_adapters(g) if args.merge else g, args.output, None, "adapted model", base)
    how = "merged into the weights" if args.merge else "as separate nodes and initializers"
    out.print(f"wrote {args.output}: {len(c['adapters'])} PEFT adapters (r {c['rank']}, scaling {c['scaling']:g}) "
              f"{how}", soft_wrap=True, markup=False)
    return 0
