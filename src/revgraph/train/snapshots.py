"""Training checkpoints: parameters, optimizer state, step and data position in one ``.npz``, written atomically.

A checkpoint is ``<dir>/checkpoint.npz``: the arrays ``a0``, ``a1``, ... (parameters, optimizer state and the
step counter, in the order the metadata lists their names) and ``meta``, a JSON text with the position in the
data (``epoch``, ``batch``: the next batch to train), the loss sums of the epoch so far and of the finished
epochs, and what the position depends on (``batch_size``, ``world_size``, ``seed``, ``shuffle``, ``samples``).
It is written to a temporary file that replaces the old one in one step (:mod:`revgraph.onnx_io.atomic`), so a worker
killed mid-write leaves the previous checkpoint intact. It loads without pickle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import RevgraphError
from ..onnx_io.atomic import atomic_path
from . import snapshot_checks

FILE = "checkpoint.npz"
FORMAT = snapshot_checks.FORMAT


def path_in(directory: str | os.PathLike) -> Path:
    return Path(directory) / FILE


def save(directory: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    """Write ``arrays`` (name -> array) and ``meta`` (JSON-serialisable) to ``<directory>/checkpoint.npz``
    atomically; create ``directory`` if needed. Returns the path. Raises :class:`RevgraphError` if it
    cannot be written."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RevgraphError(f"cannot create the checkpoint directory {str(directory)!r}: {exc.strerror}") from None
    names = list(arrays)
    payload = {f"a{i}": np.array(arrays[n], order="C") for i, n in enumerate(names)}  # (0-d stays 0-d)
    text = json.dumps({**meta, "format": FORMAT, "names": names})
    target = path_in(directory)
    try:
        with atomic_path(target, suffix=".npz", special=False) as tmp, open(tmp, "wb") as f:
            np.savez(f, meta=np.array(text), **payload)
    except OSError as exc:
        raise RevgraphError(f"cannot write the checkpoint {str(target)!r}: {exc.strerror}") from None
    return target


def load(directory: str | os.PathLike, like: dict | None = None, order: list[str] | None = None,
         step: str | None = None, check=None) -> tuple[dict[str, np.ndarray], dict] | None:
    """``(arrays, meta)`` of ``<directory>/checkpoint.npz``, or ``None`` when there is none. ``like``, ``order``,
    ``step``, ``check``: what this run holds (:func:`revgraph.train.snapshot_checks.read`: each member is checked
    against it before it is read). Raises :class:`RevgraphError` (one line naming the file and the member or field) for
    a file that is not a revgraph checkpoint (of this run)."""
    target = path_in(directory)
    if not target.is_file():
        return None
    return snapshot_checks.read(target, like, order, step, check)
