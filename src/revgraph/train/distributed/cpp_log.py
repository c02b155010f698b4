"""torch's C++ log lines and stack traces out of the ``--nproc`` launcher's stderr, into a file.

torch's TCPStore and sockets log through c10 (``[W1206 11:10:32.348635008 socket.cpp:207] [c10d] ...``), often
followed by an exception's C++ stack (``Exception raised from ...``, ``frame #0: ...``): 25 lines on node 1 of a
run that succeeds, 40 when nothing listens at ``--rdzv-endpoint``. ``TORCH_CPP_LOG_LEVEL`` could silence them but
would lose them; torchrun's ``--redirects``/``--tee`` move a worker's whole stderr, revgraph's own lines with it,
and not the agent's (this process). So :class:`routed` puts a pipe at file descriptor 2 of this process, which the
workers inherit, and a thread copies what comes through to the real stderr, except the C++ lines, which go to a
log file (made at the first such line). Python's own lines pass unchanged and in order.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from pathlib import Path

#: a c10 log line ("[W1206 11:10:32.348 socket.cpp:207] ...") or a line of the C++ stack that follows one
CPP_LINE = re.compile(rb"^(\[[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ [^\]]*\] |Exception raised from |frame #\d+: |"
                      rb"<omitting python frames>)")


class routed:
    """Context manager: while it is open, C++ log lines written to file descriptor 2 (by this process or the
    workers it starts) go to ``log_file`` instead; ``lines`` counts them. On exit the real stderr is back and the
    copying thread has drained the pipe (what the workers wrote is all there)."""

    def __init__(self, log_file: str | os.PathLike):
        self.log_file, self.lines = Path(log_file), 0
        self._log, self._in_trace = None, False

    def __enter__(self):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        try:
            self._real = os.dup(2)
        except OSError:  # no stderr at all: nothing to keep clean
            self._real = None
            return self
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._copy, args=(read,), daemon=True)
        self._thread.start()
        return self

    def _write_log(self, line: bytes) -> None:
        if self._log is None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_file, "ab")  # noqa: SIM115 - open for the whole run, closed on exit
        self._log.write(line)
        self.lines += 1

    def _copy(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                *whole, pending = (pending + chunk).split(b"\n")
                for line in whole:
                    self._route(line + b"\n")
            if pending:
                self._route(pending)

    def _route(self, line: bytes) -> None:
        try:
            # (the blank lines inside a C++ stack go with it)
            self._in_trace = bool(CPP_LINE.match(line)) or (self._in_trace and not line.strip())
            if self._in_trace:
                with contextlib.suppress(OSError):  # (a log that cannot be written: the line goes to stderr)
                    return self._write_log(line)
            os.write(self._real, line)
        except OSError:  # a closed stderr: nothing better to do with the line
            pass

    def __exit__(self, *exc) -> None:
        if self._real is None:
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(self._real, 2)  # closes our end of the pipe: the thread ends once the workers' ends are closed too
        self._thread.join(timeout=5)  # (a worker's orphan holding the pipe must not hang the launcher)
        if not self._thread.is_alive():  # (else the thread still writes there: the descriptor stays)
            os.close(self._real)
        if self._log is not None:
            self._log.close()
