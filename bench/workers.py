"""The orchestrator's end of bench/_worker.py: start a worker in some virtual environment, call functions."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class Log:
    """Progress lines prefixed with the seconds since the script started (bench/run.py, bench/memory.py)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)


class WorkerError(RuntimeError):
    """A call failed in the worker (``.error`` is its one-line message) or the worker died."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.error = message
        self.traceback = traceback


class WorkerTimeout(WorkerError):
    """A call ran past its time limit; the worker has been stopped (start a new one)."""


class Worker:
    """A long-lived ``python bench/_worker.py`` in interpreter ``python``; its stderr goes to ``log``."""

    def __init__(self, name: str, python: str | os.PathLike, log_dir: Path, env: dict | None = None):
        self.name = name
        self.python = str(python)
        self.log_path = Path(log_dir) / f"{name}.log"
        self._log = open(self.log_path, "a")  # noqa: SIM115 - lives as long as the worker
        full_env = {**os.environ, **(env or {})}
        self._spec = (name, python, log_dir, env)
        self.proc = subprocess.Popen([self.python, str(HERE / "_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=full_env,
                                     cwd=str(HERE))

    def call(self, function: str, timeout: float | None = None, **args):
        """``module:function(**args)`` in the worker; raises :class:`WorkerError` on failure, and
        :class:`WorkerTimeout` (after killing the worker) when no answer comes within ``timeout`` seconds."""
        if self.proc.poll() is not None:
            raise WorkerError(f"the {self.name} worker has exited (code {self.proc.returncode}); see {self.log_path}")
        self.proc.stdin.write(json.dumps({"call": function, "args": args}) + "\n")
        self.proc.stdin.flush()
        if timeout is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                self.proc.kill()
                self.proc.wait()
                raise WorkerTimeout(f"{function} did not finish within {timeout:.0f} s (the worker was stopped)")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"the {self.name} worker died during {function} (exit code {code}, "
                              f"signal {-code if code < 0 else 0}); see {self.log_path}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise WorkerError(answer["error"], answer.get("traceback", ""))
        return answer["result"]

    def restart(self) -> Worker:
        """A fresh worker like this one (after a timeout)."""
        self.close()
        return Worker(*self._spec)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def python_here() -> str:
    return sys.executable
