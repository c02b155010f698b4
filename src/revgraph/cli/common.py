"""What the ``revgraph`` commands share: the consoles (output shown literally), .npz inputs and outputs, and the
check that no output path is one of the command's inputs."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ..errors import RevgraphError
from ..onnx_io.archive import read_archive
from ..onnx_io.atomic import check_outputs, write_error
from ..onnx_io.external_data import external_data_files
from ..onnx_io.npz import write_outputs
from ..text import LiteralConsole

# Piped output keeps whole names and numbers instead of rich's 80-column truncation. Every string printed is
# shown literally (names from a model may hold escape sequences, newlines or Rich markup): revgraph.text.
# (sys.stdout is None when the command runs with its standard output closed, `revgraph info m.onnx >&-`: Rich
# then writes nowhere.)


class _StandardOutput:
    """The file of :data:`out`: ``sys.stdout`` as it is at each write (a caller's redirection is followed), or
    ``sys.stderr`` while an output path of the command is standard output itself (``-o /dev/stdout``: the
    report lines may not mix with the file written). A write error that is not a closed pipe (stdout on
    ``/dev/full``) is a one-line :class:`RevgraphError`, and standard output then goes to ``/dev/null`` so that
    the interpreter's last flush of what is still buffered cannot fail again."""

    to_stderr = False

    def _stream(self):
        return sys.stderr if self.to_stderr else sys.stdout

    def _call(self, method: str, *args):
        stream = self._stream()
        if stream is None:  # stdout closed (`revgraph info m.onnx >&-`): write nowhere
            return len(args[0]) if args else None
        try:
            return getattr(stream, method)(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            if stream is sys.stdout:
                silence_stdout()
            raise RevgraphError(write_error(exc, "standard output" if stream is sys.stdout else "standard error")) \
                from None

    def write(self, text: str):
        return self._call("write", text)

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str):
        return getattr(self._stream(), name)


def silence_stdout() -> None:
    """Point file descriptor 1 at ``/dev/null`` (after a write error on it, so that what is still buffered
    can be flushed at exit without a second error)."""
    try:
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


stdout = _StandardOutput()
out = LiteralConsole(file=stdout, highlight=False,
                     width=None if sys.stdout is not None and sys.stdout.isatty() else 200)
err = LiteralConsole(stderr=True, highlight=False)

# --quiet (-1) and --verbose (1) of the command running (revgraph.cli._main sets it; 0 for Python callers)
_VERBOSITY = {"level": 0}


def set_verbosity(level: int) -> None:
    """-1 (``--quiet``), 0 or 1 (``--verbose``) for the command about to run."""
    _VERBOSITY["level"] = level


def quiet() -> bool:
    """``--quiet``: print only errors, warnings and results (no progress bar, notes, information lines)."""
    return _VERBOSITY["level"] < 0


def verbose() -> bool:
    """``--verbose``: also the settings in effect, every name added and the time taken (on stderr)."""
    return _VERBOSITY["level"] > 0


def note(console, text: str) -> None:
    """Print ``text``, a line that informs but is no result (what trains, a note), on ``console`` unless
    ``--quiet``; shown literally."""
    if not quiet():
        console.print(text, soft_wrap=True, markup=False)


def read_npz(path: str, wanted=None, unknown: str | None = None, samples: bool = False) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by key; only the members in ``wanted`` (name -> the shape the model
    declares, see :func:`revgraph.onnx_io.archive.read_archive`; ``None``: all), each checked against that shape and
    the archive limits before it is decompressed. :class:`InputError` if the file is missing, not a regular file
    (a FIFO would block, a device would be read forever), not an npz file, or a member is refused."""
    return read_archive(path, wanted, unknown=unknown, samples=samples)


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` as .npz, atomically, under safe member names with the real names inside
    (:mod:`revgraph.onnx_io.npz`)."""
    write_outputs(path, arrays)


def check_command_outputs(args: argparse.Namespace, outputs: dict, inputs: dict | None = None,
                          creatable: tuple[str, ...] = (), regular: tuple[str, ...] = (),
                          models: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, output paths that cannot be written or would destroy a file: one of the
    command's input files (the model, its external data, ``inputs``), the same file twice, the directory of
    another output, and the ``OUT.data`` a large model would write next to each output being an input or an
    output (:func:`revgraph.onnx_io.atomic.check_outputs`), and ``models`` (labels) named as another format than ONNX
    (``.safetensors``, ``.pt``, ...). When an output is standard output itself
    (``-o /dev/stdout``), the command's report lines go to stderr."""
    inputs = {"the model": args.model, **(inputs or {})}
    given = [p for p in outputs.values() if p]
    companions = {f"the external data of {label} {str(p)!r}": os.path.realpath(str(p)) + ".data"
                  for label, p in outputs.items() if p and label not in regular and label not in creatable}
    if any(os.path.exists(p) for p in given):  # only an existing file can be one of the model's data files
        for f in external_data_files(args.model):
            inputs[f"the model's external data file {f.name!r}"] = f
    targets = check_outputs(outputs, inputs, creatable=creatable, regular=regular, companions=companions)
    from ..onnx_io import refuse_other_format

    for label in models:  # an ONNX model under another format's name: refused before the work, not after it
        if outputs.get(label):
            refuse_other_format(outputs[label], label)
    stdout.to_stderr = any(_is_stdout(t.identity) for t in targets.values())


def _is_stdout(identity: tuple[int, int] | None) -> bool:
    """Whether ``identity`` is the file standard output writes to (but not /dev/null: nothing is read there)."""
    if identity is None or sys.stdout is None:
        return False
    try:
        st = os.fstat(sys.stdout.fileno())
        null = os.stat(os.devnull)
    except (AttributeError, OSError, ValueError):  # (a captured stdout has no descriptor)
        return False
    return identity == (st.st_dev, st.st_ino) and identity != (null.st_dev, null.st_ino)


def read_feeds(path: str, graph) -> dict[str, np.ndarray]:
    """``--inputs FILE.npz`` for ``graph``: one member per graph input, each bounded by the input's declared
    shape before it is decompressed; a member that is no input of the graph is refused without being read
    (:func:`read_npz`)."""
    wanted = {v.name: v.shape if v.kind == "tensor" else None for v in graph.inputs}
    inputs = ", ".join(f"{v.name} {v.describe()}" for v in graph.inputs) or "none"
    return read_npz(path, wanted, unknown=f"the graph has no such input (its inputs are {inputs})")
