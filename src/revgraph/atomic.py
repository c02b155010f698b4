"""Atomic file writes: a crash or an error mid-write never leaves a half-written file where a good one was."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import RevgraphError


def _default_mode() -> int:
    """The mode a new file gets from open() (0o666 minus the umask), not mkstemp's private 0o600."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds it replaces ``path`` in one step,
    when it fails the temporary file is removed. Raises :class:`RevgraphError` if the directory is missing."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise RevgraphError(f"cannot write {str(target)!r}: directory {str(directory)!r} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=directory)
    os.close(fd)
    os.chmod(tmp, _default_mode())
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
