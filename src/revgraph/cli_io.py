"""What the ``revgraph`` commands share: the consoles (output shown literally), .npz inputs and outputs, and the
check that no output path is one of the command's inputs."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .archive import read_archive
from .atomic import check_outputs
from .external_data import external_data_files
from .npz import write_outputs
from .text import LiteralConsole

# Piped output keeps whole names and numbers instead of rich's 80-column truncation. Every string printed is
# shown literally (names from a model may hold escape sequences, newlines or Rich markup): revgraph.text.
# (sys.stdout is None when the command runs with its standard output closed, `revgraph info m.onnx >&-`: Rich
# then writes nowhere.)
out = LiteralConsole(highlight=False, width=None if sys.stdout is not None and sys.stdout.isatty() else 200)
err = LiteralConsole(stderr=True, highlight=False)


def read_npz(path: str, wanted=None, unknown: str | None = None) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by key; only the members in ``wanted`` (name -> the shape the model
    declares, see :func:`revgraph.archive.read_archive`; ``None``: all), each checked against that shape and
    the archive limits before it is decompressed. :class:`InputError` if the file is missing, not a regular file
    (a FIFO would block, a device would be read forever), not an npz file, or a member is refused."""
    return read_archive(path, wanted, unknown=unknown)


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` as .npz, atomically, under safe member names with the real names inside
    (:mod:`revgraph.npz`)."""
    write_outputs(path, arrays)


def check_command_outputs(args: argparse.Namespace, outputs: dict, inputs: dict | None = None,
                   creatable: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, output paths that are one of the command's input files (the model, its
    external data, ``inputs``), the same file twice, a directory or in a missing directory
    (:func:`revgraph.atomic.check_outputs`)."""
    inputs = {"the model": args.model, **(inputs or {})}
    given = [p for p in outputs.values() if p]
    for path in given:  # a big model's tensors would go to <out>.data: it may not be an input either
        if os.path.isfile(str(path) + ".data"):
            outputs = {**outputs, f"the external data of {path!r}": str(path) + ".data"}
    if any(os.path.exists(p) for p in given):  # only an existing file can be one of the model's data files
        for f in external_data_files(args.model):
            inputs[f"the model's external data file {f.name!r}"] = f
    check_outputs(outputs, inputs, creatable=creatable)


def read_feeds(path: str, graph) -> dict[str, np.ndarray]:
    """``--inputs FILE.npz`` for ``graph``: one member per graph input, each bounded by the input's declared
    shape before it is decompressed; a member that is no input of the graph is refused without being read
    (:func:`read_npz`)."""
    wanted = {v.name: v.shape if v.kind == "tensor" else None for v in graph.inputs}
    inputs = ", ".join(f"{v.name} {v.describe()}" for v in graph.inputs) or "none"
    return read_npz(path, wanted, unknown=f"the graph has no such input (its inputs are {inputs})")
