"""The ``.npz`` file that ``revgraph run -o`` writes: outputs under safe member names, with their real names.

Output names come from the model and may be anything: ``../../x`` or ``/abs`` would be zip member names
that extraction tools write outside the target directory, ``file`` or ``allow_pickle`` clash with the
keyword arguments of ``np.savez``, and two names may differ only in case. So each output is stored under a
member name that is its own name when that is plain (letters, digits, ``_ . - [ ]``, not starting with a
dot, unique without regard to case) and ``output_<k>`` otherwise, and the member :data:`NAMES` holds the
mapping, an ``(n, 2)`` string array of ``(member, real name)`` rows. Read it back with::

    z = np.load("out.npz")
    outputs = {name: z[member] for member, name in z["revgraph_names"]}

or with :func:`read_outputs`. Arrays are stored without pickle (string outputs as numpy strings).
"""

from __future__ import annotations

import os
import re
import stat
import zipfile

import numpy as np

from ..errors import RevgraphError
from .atomic import atomic_path

#: The member holding the ``(member, real name)`` rows.
NAMES = "revgraph_names"
_PLAIN = re.compile(r"[A-Za-z0-9_\[\]-][A-Za-z0-9_.\[\]-]{0,199}")


def member_names(names: list[str]) -> list[str]:
    """A safe, unique zip member name (without ``.npy``) for each output name, in order (module doc)."""
    plain = [n if _PLAIN.fullmatch(n) and n.casefold() != NAMES.casefold() else None for n in names]
    used = {NAMES.casefold()}
    members: list[str | None] = []
    for n in plain:  # plain names keep their name unless an earlier one took it (case-insensitively)
        if n is not None and n.casefold() not in used:
            used.add(n.casefold())
            members.append(n)
        else:
            members.append(None)
    k = 0
    for i, m in enumerate(members):
        if m is None:
            while f"output_{k}".casefold() in used:
                k += 1
            members[i] = f"output_{k}"
            used.add(members[i].casefold())
    return members  # type: ignore[return-value]


def _storable(name: str, a: np.ndarray) -> np.ndarray:
    """``a`` as an array np.save writes without pickle (onnxruntime gives string outputs as object arrays)."""
    a = np.asarray(a)
    if a.dtype != object:
        return a
    try:
        return a.astype(str)
    except (TypeError, ValueError):
        raise RevgraphError(f"output {name!r} holds Python objects that cannot be stored without pickle") from None


class _Stream:
    """A file that zipfile cannot ask for its position, so that it writes without seeking."""

    def __init__(self, f) -> None:
        self.write, self.flush = f.write, f.flush


def write_outputs(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` (output name -> array) to ``path`` as ``.npz`` with the name mapping (module doc),
    atomically. Raises :class:`RevgraphError` for an output that cannot be stored without pickle."""
    names = list(arrays)
    members = member_names(names)
    stored = [_storable(n, arrays[n]) for n in names]
    mapping = np.array([[m, n] for m, n in zip(members, names, strict=True)], dtype=str).reshape(len(names), 2)
    with atomic_path(path, suffix=".npz") as tmp, open(tmp, "wb") as f:
        # A FIFO or a device (a character device can claim to seek, /dev/null's position stays 0) is written as
        # a stream: zipfile then puts each member's sizes after its data instead of seeking back
        stream = f if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else _Stream(f)
        with zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for member, array in [*zip(members, stored, strict=True), (NAMES, mapping)]:
                with zf.open(member + ".npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, array, allow_pickle=False)


def read_outputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of a file written by :func:`write_outputs`, by their real output names."""
    with np.load(path, allow_pickle=False) as z:
        return {str(name): z[str(member)] for member, name in z[NAMES]}
