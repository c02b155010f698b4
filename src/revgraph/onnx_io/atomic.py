"""Atomic file writes, and output paths that never destroy the user's files.

:func:`atomic_path` writes through a temporary file next to the target that replaces it in one step, so a
crash or an error mid-write never leaves a half-written file where a good one was. The temporary file has a
short random name (``.revgraph-XXXXXXXX.tmp``: an output name may use all of NAME_MAX), and gets the mode and
owner of the file it replaces (a new file gets 0o666 minus the umask). A write that fails (a full disk, a
file-size limit, a quota) is one :class:`RevgraphError` line, the temporary file removed and the old file
unchanged.

What an output path names decides how it is written (:func:`output_target`): a regular file (or a new one) is
replaced; a symbolic link to a regular file has its target replaced, the link kept (as editors do; a link
owned by another user in a sticky world-writable directory is not followed, as the kernel's
``protected_symlinks`` has it, since the link is resolved here and not by the kernel); a FIFO or a character
device (``/dev/null``, ``/dev/stdout`` on a terminal or a pipe) is written directly, never replaced (a FIFO
once a reader has opened it, waiting at most :data:`FIFO_WAIT` seconds). A dangling symbolic link, a directory,
a socket, a block device, a read-only file, a name longer than the file system's NAME_MAX, a missing or
read-only directory are refused. The temporary file is
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

import errno
import os
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from ..errors import RevgraphError

_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGHUP") if hasattr(signal, s))
_live: set[str] = set()  # temporary files being written
_installed: dict[int, object] = {}  # signal -> the handler it had before ours
_lock = threading.Lock()

#: How long a write to a FIFO waits for a process to open it for reading before it is refused (seconds).
FIFO_WAIT = 10.0
#: Where ``pathconf`` does not say: the NAME_MAX of Linux's file systems.
_NAME_MAX = 255


def _default_mode() -> int:
    """The mode a new file gets from open() (0o666 minus the umask), not mkstemp's private 0o600."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _on_signal(signum: int, frame) -> None:
    """Remove the temporary files being written, then die of ``signum`` as the default action would."""
    for tmp in list(_live):
        with suppress(OSError):
            os.unlink(tmp)
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


# ---------------------------------------------------------------------------------------- what a path names


@dataclass(frozen=True)
class Target:
    """What an output path names: ``kind`` is ``"new"`` (nothing there yet), ``"file"`` (a regular file, to be
    replaced), ``"fifo"`` or ``"device"`` (a character device; both written directly, never replaced);
    ``write`` is the path written (a symbolic link's final target for ``"file"``), ``st`` its ``os.stat``."""

    path: str
    write: str
    kind: str
    st: os.stat_result | None = None

    @property
    def identity(self) -> tuple[int, int] | None:
        """``(st_dev, st_ino)`` of the existing file, ``None`` for a new one."""
        return None if self.st is None else (self.st.st_dev, self.st.st_ino)


class _Refused(Exception):
    """Why a path cannot be written (the text after ``cannot write 'P': ``)."""


def _name_max(directory: str) -> int:
    try:
        return os.pathconf(directory or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return _NAME_MAX


def _follow(path: str) -> str:
    """The path a chain of symbolic links ending at ``path`` leads to (resolved here, not by the kernel, so that
    the target can be replaced and the link kept). A link owned by someone other than us and the directory's
    owner, in a sticky world-writable directory (/tmp), is not followed: the kernel's ``protected_symlinks``
    rule, which would not apply to a path resolved here (another user's link in /tmp pointing at our files)."""
    current = path
    for _ in range(40):  # the kernel's MAXSYMLINKS
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return current
        if not stat.S_ISLNK(st.st_mode):
            return current
        directory = os.path.dirname(current)
        dst = os.stat(directory or ".")
        if (dst.st_mode & stat.S_ISVTX and dst.st_mode & stat.S_IWOTH and st.st_uid != os.geteuid()
                and st.st_uid != dst.st_uid):
            raise _Refused(f"it is a symbolic link of another user (uid {st.st_uid}) in the world-writable directory "
                           f"{directory or '.'!r}, which revgraph does not follow; remove it or choose another path")
        current = os.path.join(directory, os.readlink(current))
    raise _Refused("it is a loop of symbolic links")


def _writable_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise _Refused(f"directory {directory!r} {what}")
    if not os.access(directory, os.W_OK | os.X_OK):  # (for root too on a read-only file system: EROFS)
        raise _Refused(f"directory {directory!r} is not writable")


def _classify(text: str, special: bool) -> Target:
    if "\x00" in text:
        raise _Refused("the path holds a NUL character")
    if text.endswith(os.sep) and not os.path.isdir(text):
        raise _Refused("the path ends with '/' (a directory); give a file name")
    directory, name = os.path.split(text)
    size = len(os.fsencode(name))
    limit = _name_max(directory if os.path.isdir(directory or ".") else ".")
    if size > limit:
        raise _Refused(f"its file name is {size} bytes, longer than the {limit} a file name may have here "
                       "(ENAMETOOLONG); choose a shorter name")
    try:
        st = os.stat(text)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Refused("it is a loop of symbolic links") from None
        raise _Refused(exc.strerror or str(exc)) from None
    if st is None:
        if os.path.islink(text):
            raise _Refused(f"it is a symbolic link to {_follow(text)!r}, which does not exist; write to that path or "
                           "remove the link")
        _writable_directory(directory or ".")
        return Target(text, text, "new")
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        raise _Refused("it is a directory; give a file name")
    if stat.S_ISREG(mode):
        write = _follow(text)
        try:
            found = os.stat(write)
        except OSError:
            found = None
        if found is None or (found.st_dev, found.st_ino) != (st.st_dev, st.st_ino):
            raise _Refused(f"it is a link to a file revgraph cannot name ({write!r}); give the file's own path")
        _writable_directory(os.path.dirname(write) or ".")
        if not os.access(write, os.W_OK):
            raise _Refused(f"the file is read-only (mode {stat.S_IMODE(mode):04o}); make it writable or remove it")
        return Target(text, write, "file", st)
    kind = "fifo" if stat.S_ISFIFO(mode) else "device" if stat.S_ISCHR(mode) else None
    if kind is None:
        what = "a socket" if stat.S_ISSOCK(mode) else "a block device" if stat.S_ISBLK(mode) else "not a regular file"
        raise _Refused(f"it is {what}, which revgraph does not write; give a regular file, a FIFO or a character "
                       "device such as /dev/null")
    if not special:
        raise _Refused(f"it is a {'FIFO' if kind == 'fifo' else 'character device'}; this file must be a regular file")
    _follow(text)  # (the protected-link rule; the kernel resolves the rest when the file is opened)
    return Target(text, text, kind, st)


def output_target(path: str | os.PathLike, *, special: bool = True, label: str | None = None) -> Target:
    """What ``path`` names and how it is written (module doc). Raises :class:`RevgraphError` (one line, naming
    ``label`` and ``path``) for a path that cannot be written: empty, with a NUL, a name over NAME_MAX, a
    directory, a socket, a block device, a dangling symbolic link or a loop of them, a read-only file, a
    missing or read-only directory; and, unless ``special``, a FIFO or character device."""
    text = os.fsdecode(os.fspath(path))
    where = f"{label} {text!r}" if label else repr(text)
    if not text:
        raise RevgraphError(f"{label or 'the output path'} is empty; give a file name")
    try:
        return _classify(text, special)
    except _Refused as exc:
        raise RevgraphError(f"cannot write {where}: {exc}") from None
    except OSError as exc:  # (a directory on the way that cannot be searched, say)
        raise RevgraphError(f"cannot write {where}: {exc.strerror or exc}") from None


def write_error(exc: OSError, what: str, existed: bool = False) -> str:
    """The one-line message for ``exc`` raised writing ``what`` (a quoted path, or "standard output")."""
    code = exc.errno
    if code == errno.ENOSPC:
        text = f"no space left on the device writing {what}"
    elif code == getattr(errno, "EDQUOT", -1):
        text = f"disk quota exceeded writing {what}"
    elif code == errno.EFBIG:
        text = f"file size limit exceeded writing {what} (ulimit -f)"
    elif code == errno.EPIPE:
        text = f"cannot write {what}: its reader closed it (broken pipe)"
    else:
        text = f"cannot write {what}: {exc.strerror or exc}"
    return text + ("; the file was left as it was" if existed else "")


def _keep_owner_and_mode(tmp: str, st: os.stat_result | None) -> None:
    """Give the temporary file the replaced file's permission bits (set-id bits dropped) and, where allowed,
    its owner and group; a new file gets the mode open() would give it (not mkstemp's 0600)."""
    if st is None:
        os.chmod(tmp, _default_mode())
        return
    for uid, gid in ((st.st_uid, st.st_gid), (-1, st.st_gid)):  # a user may give a file to one of their groups
        try:
            os.chown(tmp, uid, gid)
            break
        except OSError:
            pass
    os.chmod(tmp, stat.S_IMODE(st.st_mode) & 0o1777)  # after chown, which clears set-id bits


@contextmanager
def _direct(target: Target) -> Iterator[str]:
    """Yield the path of a FIFO or character device to write into (nothing is replaced or removed). A FIFO is
    written once a reader has opened it (waiting at most :data:`FIFO_WAIT` s, not forever as ``>`` does); the
    probe descriptor stays open while the block writes, so the reader does not see an end of file in between."""
    fd = None
    if target.kind == "fifo":
        deadline = time.monotonic() + FIFO_WAIT
        while fd is None:
            try:
                fd = os.open(target.write, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise RevgraphError(write_error(exc, repr(target.path))) from None
                if time.monotonic() > deadline:
                    raise RevgraphError(f"cannot write {target.path!r}: no process opened the FIFO for reading within "
                                        f"{FIFO_WAIT:g} s; start its reader first") from None
                time.sleep(0.02)
    try:
        yield target.write
    except OSError as exc:
        raise RevgraphError(write_error(exc, repr(target.path))) from None
    finally:
        if fd is not None:
            os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp", *, special: bool = True) -> Iterator[str]:
    """Yield the path to write ``path`` through: a temporary file in the directory of the file written (a
    symbolic link's target), which replaces it in one step when the block succeeds and is removed when it fails
    (or SIGINT, SIGTERM or SIGHUP stops the process); a FIFO or character device itself (written directly;
    refused unless ``special``). Raises :class:`RevgraphError` (one line) for a path that cannot be written
    (:func:`output_target`) and for an ``OSError`` while writing (a full disk: "no space left on the device
    writing 'OUT'"), the temporary file removed and an existing file unchanged."""
    target = output_target(path, special=special)
    if target.kind in ("fifo", "device"):
        with _direct(target) as written:
            yield written
        return
    directory = os.path.dirname(target.write) or "."
    with _lock:
        _install()  # before the file exists: a signal in between finds nothing to remove
    try:
        fd, tmp = tempfile.mkstemp(prefix=".revgraph-", suffix=suffix, dir=directory)
    except OSError as exc:
        with _lock:
            if not _live:
                _uninstall()
        raise RevgraphError(write_error(exc, repr(target.path), target.st is not None)) from None
    with _lock:
        _live.add(tmp)
    os.close(fd)
    try:
        _keep_owner_and_mode(tmp, target.st)
        yield tmp
        os.replace(tmp, target.write)
    except BaseException as exc:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise RevgraphError(write_error(exc, repr(target.path), target.st is not None)) from None
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
                  *, creatable: tuple[str, ...] = (), regular: tuple[str, ...] = (),
                  companions: Mapping[str, str | os.PathLike] | None = None) -> dict[str, Target]:
    """Refuse (:class:`RevgraphError`, one line) output paths that would destroy a file or fail late; return
    the :class:`Target` of each output given.

    ``outputs`` and ``inputs`` map a label (``"-o"``, ``"the model"``, ``"--data"``) to a path (``None``:
    not given). Each output must be writable (:func:`output_target`; labels in ``regular`` must be regular
    files, labels in ``creatable`` may be in a directory yet to be made, under an existing one), and may not be
    the same file as an input or another output (same device and inode, so a symbolic or hard link to an input
    is refused as the input itself is), nor the directory another output goes in. ``companions`` (label ->
    path) are files an output may write besides itself (a large model's ``OUT.onnx.data``): none may be an
    input or an output."""
    sources = {label: _identity(p) for label, p in inputs.items() if p is not None}
    seen: dict[tuple[int, int] | str, str] = {}
    places: list[tuple[str, str, str]] = []  # (label, text, real path) of each output
    targets: dict[str, Target] = {}
    for label, path in outputs.items():
        if path is None:
            continue
        text = os.fsdecode(os.fspath(path))
        if label in creatable and text and not os.path.isdir(os.path.dirname(os.path.abspath(text))):
            parent = os.path.dirname(os.path.abspath(text))
            while not os.path.exists(parent) and parent != os.path.dirname(parent):
                parent = os.path.dirname(parent)
            if not os.path.isdir(parent):
                raise RevgraphError(f"cannot write {label} {text!r}: directory {os.path.dirname(text)!r} does not "
                                    "exist")
            if not os.access(parent, os.W_OK | os.X_OK):  # (its directory would be made there after the work)
                raise RevgraphError(f"cannot write {label} {text!r}: directory {parent!r} is not writable")
            target = Target(text, text, "new")
        else:
            target = output_target(text, special=label not in regular, label=label)
        targets[label] = target
        ident = target.identity
        for source, found in sources.items():
            if ident is not None and ident == found:
                raise RevgraphError(f"{label} {text!r} is the same file as {source} {str(inputs[source])!r}; writing "
                                    "it would destroy that file: choose another output path")
        if ident is not None and ident == _identity(os.devnull):
            continue  # (what goes to /dev/null is dropped: two outputs may both go there)
        key = ident if ident is not None else os.path.realpath(text)
        if key in seen:
            raise RevgraphError(f"{label} and {seen[key]} name the same file {text!r}; choose two paths")
        seen[key] = label
        places.append((label, text, os.path.realpath(text)))
    for label, text, real in places:  # train -o X --checkpoint-dir X: a file where a directory must go
        for other, other_text, other_real in places:
            if other != label and other_real.startswith(real.rstrip(os.sep) + os.sep):
                raise RevgraphError(f"{label} {text!r} would be a file where {other} {other_text!r} needs a "
                                    "directory; choose two separate paths")
    for label, path in (companions or {}).items():
        text = os.fsdecode(os.fspath(path))
        ident = _identity(text)
        key = ident if ident is not None else os.path.realpath(text)
        clash = [(s, str(inputs[s])) for s, found in sources.items() if ident is not None and ident == found]
        clash += [(seen[key], text)] if key in seen else []
        if clash:
            raise RevgraphError(f"{clash[0][0]} {clash[0][1]!r} is where {label} would go; choose another path")
    return targets
