"""What the ``revgraph`` commands share: the consoles (output shown literally), .npz inputs and outputs, and the
check that no output path is one of the command's inputs."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .atomic import check_outputs
from .errors import InputError, RevgraphError
from .external_data import external_data_files
from .limits import open_regular_file
from .npz import write_outputs
from .text import LiteralConsole

# Piped output keeps whole names and numbers instead of rich's 80-column truncation. Every string printed is
# shown literally (names from a model may hold escape sequences, newlines or Rich markup): revgraph.text.
# (sys.stdout is None when the command runs with its standard output closed, `revgraph info m.onnx >&-`: Rich
# then writes nowhere.)
out = LiteralConsole(highlight=False, width=None if sys.stdout is not None and sys.stdout.isatty() else 200)
err = LiteralConsole(stderr=True, highlight=False)


def read_npz(path: str) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by key; :class:`InputError` if it is missing, not a regular file (a FIFO
    would block, a device would be read forever) or not an npz file."""
    try:
        fd = open_regular_file(path, ".npz file")
    except RevgraphError as exc:
        raise InputError(str(exc)) from None
    try:
        with os.fdopen(fd, "rb") as f:
            data = np.load(f, allow_pickle=False)
            # a .npy gives an ndarray, which is no context manager: `with np.load(...)` raised a bare TypeError
            if not hasattr(data, "files"):
                raise InputError(f"{path!r} holds one array (a .npy file); pass an .npz file that maps input names "
                                 "to arrays, or a directory of NAME.npy files")
            with data:
                return {k: data[k] for k in data.files}
    except InputError:
        raise
    except Exception as exc:
        if "Object arrays" in str(exc):  # an object array's items are pickles, never loaded (untrusted input)
            raise InputError(f"{path!r} holds an array of Python objects (a pickle), which is not read; save "
                             "numeric arrays") from None
        raise InputError(f"{path!r} is not a readable .npz file ({type(exc).__name__})") from None


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
