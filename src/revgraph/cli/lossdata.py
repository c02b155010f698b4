"""``revgraph train`` options of the loss and of the data layout: ``--loss`` (from :data:`revgraph.train.losses.LOSSES`,
``output:NAME`` included), ``--labels-from``, ``--ignore-index``, ``--label-smoothing``, ``--class-weights``,
``--loss-chunk`` (:mod:`revgraph.train.chunked_loss`), ``--data DATA.npz|DIR``, ``--test-data`` and ``--static
NAME=FILE`` (:mod:`revgraph.train.losses`, :mod:`revgraph.train.data`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from ..errors import RevgraphError
from .layout import add_renamed
from .numeric import FRACTION_CLOSED, INT64, text_type


def _loss(text: str) -> str:
    """``--loss``: a name of :data:`LOSSES` or ``output:NAME`` (checked by :func:`revgraph.train.losses.parse_loss`)."""
    from ..train.losses import LOSSES, parse_loss

    try:
        parse_loss(text)
    except RevgraphError as exc:  # argparse's own words for a choice, or the reason (output: without a name)
        reason = (str(exc) if text.startswith("output:")
                  else f"invalid choice: {text!r} (choose from {', '.join(LOSSES)})")
        raise argparse.ArgumentTypeError(reason) from None
    return text


def _chunk(text: str) -> int | str:
    """``--loss-chunk``: a whole number of tokens, ``auto`` or ``off``
    (:func:`revgraph.train.chunked_loss.check_chunk`)."""
    from ..train.chunked_loss import check_chunk

    try:
        return check_chunk(text)
    except RevgraphError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--loss-chunk (chunk_tokens=) ", "")) from None


def add_loss_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the loss and data options to the ``train`` parser; the losses and their help come from the registry."""
    from ..train.losses import LOSSES

    parser.add_argument("--data", metavar="DATA.npz|DIR", help="an array per model input (by name) plus 'labels' "
                        "(where the loss has labels), or 'x' and 'y' for a one-input model: an .npz file, or a "
                        "directory of NAME.npy files read memory-mapped (data larger than memory); may be left out "
                        "when every input is --static")
    # "--loss NAME" names a value of the model in grad, check, show, hvp and hessian: train's loss function is
    # --loss-fn (the old spelling stays accepted)
    add_renamed(parser, "--loss-fn", "--loss", dest="loss", type=text_type(_loss, "loss"), required=True,
                metavar="|".join(LOSSES), help="; ".join(f"{k}: {v.help}" for k, v in LOSSES.items()))
    parser.add_argument("--labels-from", metavar="NAME",
                        help="causal-lm: the model input holding the token ids (default: the only int64 input of "
                             "rank 2, else input_ids), or 'labels' for a labels array in the data, shifted inside "
                             "(Hugging Face's convention)")
    parser.add_argument("--ignore-index", type=INT64, metavar="I",
                        help="cross-entropy, causal-lm: targets equal to I are not counted (padding; default -100 "
                             "for causal-lm, none for cross-entropy)")
    parser.add_argument("--label-smoothing", type=FRACTION_CLOSED, metavar="S",
                        help="cross-entropy, causal-lm: (1-S) x nll + S x mean over classes of -log p, as torch's "
                             "label_smoothing (default 0)")
    parser.add_argument("--class-weights", metavar="FILE.npy",
                        help="cross-entropy, causal-lm: a .npy of C floats, torch's weight= (the weighted mean)")
    parser.add_argument("--loss-chunk", type=text_type(_chunk, "loss chunk"), metavar="C|auto|off",
                        help="cross-entropy, causal-lm: compute the output projection (a MatMul/Gemm making the "
                             "logits) and the loss together in chunks of C tokens, so that the [tokens, classes] "
                             "logits never exist whole (fused linear cross-entropy); auto (default): chunked only "
                             "under --memory-budget; off: never")
    parser.add_argument("--static", action="append", default=[], metavar="NAME=FILE",
                        help="an input without a sample axis (edge_index, a trip count, a mask), fed whole to every "
                             "step: FILE.npy or FILE.npz:member; repeat for several ('labels' too, for full-batch "
                             "training)")


def loss_options(args: argparse.Namespace) -> dict:
    """The Trainer's ``loss_options`` from the arguments (the class weights read from their file)."""
    from ..errors import InputError
    from ..train.data import load_npy

    try:
        weights = load_npy(args.class_weights, mmap=False) if args.class_weights else None
    except InputError as exc:
        raise InputError(f"--class-weights: {exc}") from None
    return {"labels_from": args.labels_from, "ignore_index": args.ignore_index,
            "label_smoothing": args.label_smoothing, "class_weights": weights,
            "chunk_tokens": getattr(args, "loss_chunk", None)}


def read_data(path: str | None, option: str = "--data", graph=None) -> dict:
    """``--data`` / ``--test-data``: an .npz file, or a directory of .npy files memory-mapped
    (:func:`revgraph.train.data.read_dir`); ``{}`` when not given. Of an .npz only the members training reads are
    decompressed (:func:`data_members` of ``graph``, the model; all without one), each bounded first."""
    from ..errors import InputError
    from ..train.data import read_dir
    from .common import read_npz

    if path is None:
        return {}
    if Path(path).is_dir():
        try:
            arrays = read_dir(path)
        except InputError as exc:
            raise InputError(str(exc).replace("--data", option, 1)) from None
        extra = [f"{k}.npy" for k in arrays if graph is not None and k not in data_members(graph)]
        if extra:  # (issue 40: they were ignored without a word)
            _note(f"{option} {path}: ignored {', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''}: no model "
                  "input nor labels of that name")
            arrays = {k: v for k, v in arrays.items() if f"{k}.npy" not in extra}
    else:
        arrays = read_npz(path, None if graph is None else data_members(graph), samples=True)
    labels = arrays.get("labels")
    if labels is not None and labels.dtype == np.bool_:
        _note(f"{option} {path}: the labels are booleans, read as the classes 0 (False) and 1 (True)")
    return arrays


def _note(text: str) -> None:
    """One ``note:`` line on stderr (what the run does with something the user may not expect), from the first
    process only where torchrun started several (each reads the same data)."""
    from .common import err, quiet

    if os.environ.get("RANK", "0") != "0" or quiet():
        return
    err.print(f"note: {text}", soft_wrap=True, markup=False, highlight=False)


def data_members(graph) -> dict:
    """The members of a ``--data`` .npz that training reads, with the shape the model declares for each: an
    array per model input (its first axis the samples: any length), ``labels``, and ``x`` / ``y`` (a one-input
    model's data)."""
    def per_sample(vi):
        return None if vi.kind != "tensor" or not vi.shape else (None, *vi.shape[1:])

    wanted = {vi.name: per_sample(vi) for vi in graph.inputs}
    wanted.setdefault("labels", None)
    wanted.setdefault("x", per_sample(graph.inputs[0]) if len(graph.inputs) == 1 else None)
    wanted.setdefault("y", None)
    return wanted


def read_static(args: argparse.Namespace, graph=None) -> dict:
    """``--static NAME=FILE ...`` as arrays (each bounded by the shape ``graph``, the model, declares for
    ``NAME`` before it is read); an error when neither ``--data`` nor any ``--static`` is given."""
    from ..train.data import read_static as read

    require_data(args)
    shapes = {} if graph is None else {v.name: v.shape if v.kind == "tensor" else None for v in graph.inputs}
    return read(args.static, shapes)


def require_data(args: argparse.Namespace) -> None:
    """Refuse a training run given neither ``--data`` nor any ``--static``."""
    if args.data is None and not args.static:
        raise RevgraphError("give the training data: --data DATA.npz|DIR (and --static NAME=FILE for inputs without "
                            "a sample axis)")


def input_paths(args: argparse.Namespace) -> dict:
    """The files the loss and data options read (none may be an output; each must exist before a launch): a
    data directory, and each ``.npy`` file in it (issue 40: ``-o DIR/x.npy`` replaced the training data, as the
    output was compared with the directory only)."""
    from ..train.data import npy_files

    files = {"--data": args.data, "--test-data": args.test_data, "--eval-data": getattr(args, "eval_data", None),
             "--class-weights": args.class_weights}
    for label in ("--data", "--test-data", "--eval-data"):
        folder = files[label]
        if folder is not None and os.path.isdir(folder):
            files.update({f"the {label} file {f.name!r}": str(f) for f in npy_files(folder)})
    for s in args.static:
        name, _, file = s.partition("=")
        base, colon, _member = file.rpartition(":")
        files[f"--static {name}"] = base if colon and base.endswith(".npz") else file
    return files
