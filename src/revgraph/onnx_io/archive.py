"""Reading ``.npz`` archives that the user gives (``run --inputs``, ``check --inputs``, ``train --data``,
``--test-data``, ``--static FILE.npz:member``, ``lora apply ADAPTERS.npz``) without trusting their headers.

An ``.npz`` is a zip of ``.npy`` members, and a member's ``.npy`` header *declares* its shape: a 3 MB file can
hold a member of zeros whose header says 3 GiB (deflate packs zeros about 1000:1), and ``np.load`` allocates
and decompresses all of it as soon as the member is read, used or not. So :func:`read_archive`

- reads only the members the command needs (``wanted``); the others are never decompressed, only listed;
- reads each member's ``.npy`` header first (a few hundred bytes) and refuses, before allocating or
  decompressing anything, a member whose declared shape disagrees with the shape the model declares for it
  (rank, static dimensions), a member whose declared size is over :data:`MAX_MEMBER_BYTES` unless the model's
  declared shape fixes every dimension of it, a member the zip itself says is shorter than its header
  declares (a truncated or forged member), and an array of Python objects (a pickle, never loaded);
- turns a failed allocation into a one-line error.

Every refusal is an :class:`~revgraph.errors.InputError` naming the file, the member and what to do.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from collections.abc import Mapping

import numpy as np

from ..errors import InputError, RevgraphError
from ..limits import _human, open_regular_file

#: The largest member read from an ``.npz`` whose size the model does not fix (2 GiB): larger data goes in a
#: directory of ``.npy`` files, which training memory-maps instead of reading (``--data DIR``).
MAX_MEMBER_BYTES = 2**31
#: The largest ``.npy`` header read (numpy's own default limit).
_MAX_HEADER = 10000


def read_archive(path: str | os.PathLike, wanted: Mapping[str, object] | None = None, *,
                 what: str = ".npz file", unknown: str | None = None, samples: bool = False) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` file ``path`` by member name (``.npy`` stripped), checked as the module doc
    says before each is decompressed.

    ``wanted`` maps the member names the command reads to the shape the model declares for each (a tuple of
    ``int`` / symbolic ``str`` / ``None`` dimensions, ``None`` when unknown, or an object with a ``shape``
    attribute such as a :class:`~revgraph.ir.ValueInfo`); members not in it are not read. ``None``: every
    member is read (each bounded by :data:`MAX_MEMBER_BYTES`). ``unknown``: when given, a member not in
    ``wanted`` is refused (without reading it) with this text after the member's name, e.g.
    ``"the model has no such input"``. ``samples``: the members are training data, one row per sample, so
    the headers of all the members read must agree on their first axis before any is decompressed (a member
    declaring 2^28 labels beside 10 samples is refused, not decompressed). Raises :class:`InputError` (one
    line)."""
    label = repr(os.fspath(path))
    try:
        fd = open_regular_file(path, what)
    except RevgraphError as exc:
        raise InputError(str(exc)) from None
    with os.fdopen(fd, "rb") as f:
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            if _is_npy(f):
                raise InputError(f"{label} holds one array (a .npy file); pass an .npz file that maps input names "
                                 "to arrays, or a directory of NAME.npy files") from None
            raise InputError(f"{label} is not a readable .npz file ({type(exc).__name__})") from None
        with zf:
            members = {_key(i.filename): i for i in zf.infolist() if not i.is_dir()}
            if unknown is not None and wanted is not None:
                extra = [k for k in members if k not in wanted]
                if extra:
                    raise InputError(f"{label}: member(s) {', '.join(map(repr, extra))}: {unknown}")
            keys = list(members) if wanted is None else [k for k in members if k in wanted]
            if samples:
                _same_samples(zf, {k: members[k] for k in keys}, label)
            return {k: _read_member(zf, members[k], k, None if wanted is None else _shape_of(wanted[k]), label)
                    for k in keys}


def _same_samples(zf: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo], label: str) -> None:
    """Refuse data members whose headers disagree on the number of samples (their first axis), from the headers
    alone."""
    rows = {}
    for k, info in members.items():
        shape = member_header(zf, info, label, k)[0]
        if not shape:
            raise InputError(f"{label}: member {k!r} is a scalar; data members hold one row per sample")
        rows[k] = shape[0]
    if len(set(rows.values())) > 1:  # (the member with the most rows named first: the likelier mistake)
        (a, n), (b, m) = max(rows.items(), key=lambda kv: kv[1]), min(rows.items(), key=lambda kv: kv[1])
        raise InputError(f"{label}: member {a!r} declares {n:,} samples but {b!r} {m:,}; every member holds one row "
                         "per sample (checked before reading)")


def _key(filename: str) -> str:
    """The name ``np.load`` gives a member: its file name without ``.npy``."""
    return filename.removesuffix(".npy")


def _is_npy(f) -> bool:
    try:
        f.seek(0)
        return f.read(6) == b"\x93NUMPY"
    except OSError:
        return False


def _shape_of(declared: object) -> tuple | None:
    shape = getattr(declared, "shape", declared)
    return None if shape is None else tuple(shape)


def member_header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, label: str, key: str) -> tuple[tuple, np.dtype, int]:
    """``(shape, dtype, header bytes)`` from the ``.npy`` header of the member ``info`` (a few hundred bytes
    decompressed, nothing allocated). Raises :class:`InputError` for a member that is not an ``.npy`` array or
    holds Python objects."""
    try:
        with zf.open(info) as stream:
            version = np.lib.format.read_magic(stream)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(stream, max_header_size=_MAX_HEADER)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(stream, max_header_size=_MAX_HEADER)
            else:
                raise ValueError(f".npy format version {version}")
            offset = stream.tell()
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, NotImplementedError, zlib.error) as exc:
        raise InputError(f"{label}: member {key!r} is not a readable .npy array ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'bad header'})") from None
    if dtype.hasobject:
        raise InputError(f"{label}: member {key!r} holds an array of Python objects (a pickle), which is not read; "
                         "save numeric arrays")
    return tuple(int(d) for d in shape), dtype, offset


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, declared: tuple | None,
                 label: str) -> np.ndarray:
    """The member ``info`` as an array, after its header has been checked against ``declared`` (the shape the
    model declares for it) and the bounds of the module doc."""
    shape, dtype, offset = member_header(zf, info, label, key)
    nbytes = math.prod(shape) * dtype.itemsize
    described = f"{dtype}{list(shape)}"
    fixed = False
    if declared is not None:
        if len(shape) != len(declared) or any(isinstance(d, int) and d != s
                                              for d, s in zip(declared, shape, strict=False)):
            want = "[" + ",".join("?" if d is None else str(d) for d in declared) + "]"  # as ValueInfo.describe
            raise InputError(f"{label}: member {key!r} declares shape {list(shape)}; the model declares {want} for "
                             f"it (checked before reading)")
        fixed = all(isinstance(d, int) for d in declared)
    if offset + nbytes > info.file_size:
        raise InputError(f"{label}: member {key!r} declares {described} ({nbytes:,} bytes) but the archive holds "
                         f"{max(info.file_size - offset, 0):,} bytes of it; the file is truncated or forged")
    if nbytes > MAX_MEMBER_BYTES and not fixed:
        raise InputError(f"{label}: member {key!r} declares {described}, {_human(nbytes)}, over the limit of "
                         f"{_human(MAX_MEMBER_BYTES)} for an .npz member; give large data as a directory of .npy "
                         "files (memory-mapped), or smaller arrays")
    try:
        with zf.open(info) as stream:
            return np.lib.format.read_array(stream, allow_pickle=False, max_header_size=_MAX_HEADER)
    except MemoryError:
        raise InputError(f"{label}: member {key!r} ({described}, {_human(nbytes)}) does not fit in memory") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise InputError(f"{label}: member {key!r} cannot be read ({type(exc).__name__}); is the file "
                         "complete?") from None


def check_npy_file(path: str | os.PathLike, *, whole: bool) -> None:
    """Refuse (:class:`InputError`) the ``.npy`` file ``path`` when its header declares more bytes than the
    file holds (``np.load`` would allocate all of them first), or, when it is read ``whole`` (not
    memory-mapped), more than :data:`MAX_MEMBER_BYTES`. Reads the header only; a file numpy cannot parse is
    left to ``np.load``'s own error."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in reader:
                return
            shape, _, dtype = reader[version](f, max_header_size=_MAX_HEADER)
            offset, size = f.tell(), os.fstat(f.fileno()).st_size
    except (ValueError, OSError, EOFError):
        return
    if dtype.hasobject:
        return  # np.load refuses it with its own message (allow_pickle=False)
    nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
    described = f"{dtype}{[int(d) for d in shape]}"
    if offset + nbytes > size:
        raise InputError(f"{os.fspath(path)!r} declares {described} ({nbytes:,} bytes) but holds "
                         f"{max(size - offset, 0):,} bytes of data; the file is truncated or forged")
    if whole and nbytes > MAX_MEMBER_BYTES:
        raise InputError(f"{os.fspath(path)!r} declares {described}, {_human(nbytes)}, over the limit of "
                         f"{_human(MAX_MEMBER_BYTES)} for an array read whole")


def member_names(path: str | os.PathLike) -> list[str]:
    """The member names (``.npy`` stripped) of the ``.npz`` file ``path``, nothing decompressed; ``[]`` for a
    file that is not a zip."""
    try:
        with zipfile.ZipFile(path) as zf:
            return [_key(i.filename) for i in zf.infolist() if not i.is_dir()]
    except (zipfile.BadZipFile, OSError, ValueError):
        return []
