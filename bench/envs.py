"""Virtual environments of the comparison frameworks, created on demand.

onnxruntime-training's ``generate_artifacts`` needs a virtual environment of its own: its last release
(1.19.2) is built against numpy 1.x and cannot share revgraph's environment (numpy 2, onnx 1.23, onnxruntime
1.32). JAX gets one too, so that installing it can never move the numpy or onnx that revgraph's tests run with.
Both are created next to the project's directory (``<parent>/venv-ort-training`` and ``<parent>/venv-jax`` for a
checkout in ``<parent>/<checkout>``; ``--venv-dir`` or ``RG_BENCH_VENV_DIR`` elsewhere) the first time a
benchmark needs them, with pinned versions; later runs reuse them.

    python bench/envs.py [ort-training|jax ...]     # create (or check) them without running a benchmark

torch is installed as ``torch==2.13.0``, the CPU build that lies on this machine's disk (never an unpinned
torch, which would pull a multi-gigabyte CUDA build).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SPECS = {
    "ort-training": {
        "dir": "venv-ort-training",
        "packages": ["numpy<2", "torch==2.13.0", "onnxruntime-training==1.19.2", "onnx==1.17.0"],
        "check": "import numpy, onnx, onnxruntime; from onnxruntime.training import artifacts; "
                 "print(numpy.__version__, onnx.__version__, onnxruntime.__version__)",
    },
    "jax": {
        "dir": "venv-jax",
        "packages": ["jax==0.10.2", "jaxlib==0.10.2"],
        "check": "import numpy, jax; print(numpy.__version__, jax.__version__)",
    },
}


class EnvError(RuntimeError):
    """A comparison environment could not be created or does not work; the message says why."""


def venv_root() -> Path:
    env = os.environ.get("RG_BENCH_VENV_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2]


def python_of(kind: str, root: Path | None = None) -> Path:
    return (root or venv_root()) / SPECS[kind]["dir"] / "bin" / "python"


def _check(python: Path, kind: str) -> str | None:
    if not python.exists():
        return None
    proc = subprocess.run([str(python), "-c", SPECS[kind]["check"]], capture_output=True, text=True, cwd="/")
    return proc.stdout.strip() if proc.returncode == 0 else None


def ensure(kind: str, root: Path | None = None, log=print) -> Path:
    """The Python interpreter of environment ``kind``, creating and installing it first if needed.
    Raises :class:`EnvError` with pip's last lines when that fails."""
    spec = SPECS[kind]
    python = python_of(kind, root)
    if _check(python, kind):
        return python
    venv = python.parent.parent
    log(f"setting up {venv} ({' '.join(spec['packages'])}); this takes a minute or two, once")
    if not python.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        proc = subprocess.run([base, "-m", "venv", str(venv)], capture_output=True, text=True)
        if proc.returncode:
            raise EnvError(f"python -m venv {venv} failed: {proc.stderr.strip().splitlines()[-1:]}")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *spec["packages"]], capture_output=True,
                          text=True)
    if proc.returncode:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "is ignored" not in ln]
        raise EnvError(f"pip install {' '.join(spec['packages'])} failed in {venv}: {' | '.join(lines[-3:])}")
    if not _check(python, kind):
        raise EnvError(f"{venv} was installed but `{spec['check']}` fails there")
    return python


def main(argv: list[str]) -> int:
    for kind in argv or list(SPECS):
        python = ensure(kind)
        print(f"{kind}: {python} ({_check(python, kind)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
