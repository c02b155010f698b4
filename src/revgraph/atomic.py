"""Atomic file writes, and output paths that never destroy the user's files.

:func:`atomic_path` writes through a temporary file next to the target that replaces it in one step, so a
crash or an error mid-write never leaves a half-written file where a good one was. The temporary file is
removed when the block fails, on Ctrl-C (``KeyboardInterrupt``), and on SIGTERM or SIGHUP: while one is open,
a handler for these two signals removes the temporary files and then lets the signal kill the process as it
would have (so a worker that ``torchrun`` stops still dies at once, by its signal). The handler is installed
only while a temporary file exists, only from the main thread, and only where the signal had its default
action (a ``nohup``-ignored SIGHUP stays ignored, an application's own handler is left in place).

:func:`check_outputs` refuses, before any work, output paths that name one of the command's input files
(compared by device and inode, so through symbolic and hard links too), the same file twice, a directory or
a missing directory.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from .errors import RevgraphError

_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGHUP") if hasattr(signal, s))
_live: set[str] = set()  # temporary files being written
_installed: dict[int, object] = {}  # signal -> the handler it had before ours
_lock = threading.Lock()


def _default_mode() -> int:
    """The mode a new file gets from open() (0o666 minus the umask), not mkstemp's private 0o600."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _on_signal(signum: int, frame) -> None:
    """Remove the temporary files being written, then die of ``signum`` as the default action would."""
    for tmp in list(_live):
        try:
            os.unlink(tmp)
        except OSError:
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install() -> None:
    """Handle SIGTERM/SIGHUP (where they have their default action) while temporary files exist."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works in the main thread only; its own writes install the handler
    for sig in _SIGNALS:
        if sig not in _installed and signal.getsignal(sig) == signal.SIG_DFL:
            _installed[sig] = signal.signal(sig, _on_signal)


def _uninstall() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in list(_installed.items()):
        signal.signal(sig, previous)
        del _installed[sig]


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds it replaces ``path`` in one step,
    when it fails (or SIGINT, SIGTERM or SIGHUP stops the process) the temporary file is removed. Raises
    :class:`RevgraphError` if the directory is missing or ``path`` is a directory."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not str(path):
        raise RevgraphError("cannot write to an empty path")
    if not directory.is_dir():
        raise RevgraphError(f"cannot write {str(target)!r}: directory {str(directory)!r} does not exist")
    if target.is_dir():
        raise RevgraphError(f"cannot write {str(target)!r}: it is a directory")
    with _lock:
        _install()  # before the file exists: a signal in between finds nothing to remove
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=directory)
    except OSError as exc:
        with _lock:
            if not _live:
                _uninstall()
        raise RevgraphError(f"cannot write {str(target)!r}: {exc.strerror}") from None
    with _lock:
        _live.add(tmp)
    os.close(fd)
    try:
        os.chmod(tmp, _default_mode())
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        with _lock:
            _live.discard(tmp)
            if not _live:
                _uninstall()


# ------------------------------------------------------------------------------------------- output paths


def _identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file ``path`` names (after symbolic links), or ``None`` if there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def check_outputs(outputs: Mapping[str, str | os.PathLike | None], inputs: Mapping[str, str | os.PathLike | None],
                  *, creatable: tuple[str, ...] = ()) -> None:
    """Refuse (:class:`RevgraphError`, one line) output paths that would destroy a file or fail late.

    ``outputs`` and ``inputs`` map a label (``"-o"``, ``"the model"``, ``"--data"``) to a path (``None``:
    not given). An output may not be empty, a directory, or in a directory that does not exist (labels in
    ``creatable`` may be in a directory yet to be made, under an existing one), and may not be the same file
    as an input or another output: same device and inode, so a symbolic or hard link to an input is refused
    as the input itself is."""
    sources = {label: _identity(p) for label, p in inputs.items() if p is not None}
    seen: dict[tuple[int, int] | str, str] = {}
    for label, path in outputs.items():
        if path is None:
            continue
        text = str(path)
        if not text:
            raise RevgraphError(f"{label} is empty; give a file name")
        target = Path(path)
        if target.is_dir():
            raise RevgraphError(f"cannot write {label} {text!r}: it is a directory; give a file name")
        parent = target.parent
        if label in creatable:
            while not parent.exists() and parent != parent.parent:
                parent = parent.parent
        if not parent.is_dir():
            raise RevgraphError(f"cannot write {label} {text!r}: directory {str(target.parent)!r} does not exist")
        ident = _identity(target)
        for source, found in sources.items():
            if ident is not None and ident == found:
                raise RevgraphError(f"{label} {text!r} is the same file as {source} {str(inputs[source])!r}; writing "
                                    "it would destroy that file: choose another output path")
        key = ident if ident is not None else os.path.abspath(text)
        if key in seen:
            raise RevgraphError(f"{label} and {seen[key]} name the same file {text!r}; choose two paths")
        seen[key] = label
