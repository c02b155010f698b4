"""Data-parallel runs for tests: torchrun's command, its workers in sessions of their own (killed on the way out),
the ranks' results against one process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

import revgraph as rg

#: tests/, where the workers are (and on the workers' PYTHONPATH)
TESTS = Path(__file__).resolve().parent.parent
WORKER = TESTS / "distributed_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched(*cmds: list[str], cwds: list | None = None, env: dict = ENV):
    """Start each command (in ``cwds[i]``, default here) in a session of its own (torchrun and its workers),
    and kill every process of those sessions on the way out, so that a failed or timed-out test leaves no
    worker behind."""
    procs = [subprocess.Popen(c, env=env, cwd=(cwds or [None] * len(cmds))[i], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for i, c in enumerate(cmds)]
    try:
        yield procs
    finally:
        for p in procs:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_command(cmd: list[str], timeout: int = 240, check: bool = True, env: dict = ENV) -> subprocess.CompletedProcess:
    """Run ``cmd`` as :func:`launched` does, to its end; unless not ``check``, assert it exited 0."""
    with launched(cmd, env=env) as (p,):
        out, err = p.communicate(timeout=timeout)
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    assert not check or r.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return r


def train_single(model: str, optimizer: str, samples: int, batch: int, epochs: int) -> rg.Trainer:
    """The reference: distributed_worker's trainer fitted in this process alone on the same global batches."""
    from distributed_worker import trainer  # imports torch.distributed: only where a test runs

    tr, data = trainer(model, optimizer, samples, False)
    tr.fit(data, epochs, batch, seed=3, progress=False)
    return tr


def compare_ranks(out: Path, ref: rg.Trainer, world: int = 2) -> None:
    """The ranks' ``rank<r>.npz`` in ``out`` hold identical values, and equal ``ref``'s parameters, state and losses."""
    ranks = [dict(np.load(out / f"rank{r}.npz")) for r in range(world)]
    assert all(int(r["world"]) == world for r in ranks)
    for name in ranks[0]:  # every rank holds exactly the same parameters, state and losses
        for other in ranks[1:]:
            np.testing.assert_array_equal(other[name], ranks[0][name], err_msg=name)
    theirs = {**ref.parameters, **ref.state}
    assert set(theirs) <= set(ranks[0])
    for name, value in theirs.items():
        np.testing.assert_allclose(ranks[0][name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    np.testing.assert_allclose(ranks[0]["losses"], ref.losses, rtol=2e-5, atol=1e-6)
    assert len(ref.losses) == 2 * 7  # 97 samples in global batches of 16: 7 steps per epoch


def child_pids(pid: int) -> list[int]:
    """The process ids of ``pid``'s children (Linux /proc)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def cmdline(pid: int) -> str:
    """Process ``pid``'s command line (Linux /proc), or '' once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def check_undo_and_load(eng, step) -> None:
    """An engine-level check: a ``keep_previous`` step (``step(keep_previous=True)`` runs one) is undone exactly,
    and ``load`` of a ``read`` of every carried name restores it after another step (``step()``)."""
    before = eng.read(eng.names)
    steps = eng.steps
    step(keep_previous=True)
    assert eng.can_undo and eng.steps == steps + 1
    eng.undo()
    for name, value in eng.read(eng.names).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    step()
    eng.load(before)
    for name, value in eng.read(eng.names).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
