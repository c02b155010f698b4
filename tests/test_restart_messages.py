"""What `revgraph train --nproc` says when a run restarts or its rendezvous fails (issue 43, item 4): one line per
restart naming the rank, the node, the exit code or signal, "restart k of K" and the snapshot step resumed from;
torch's C++ log lines and stacks in a log file instead of stderr; ``--timeout`` bounding the rendezvous; losing
node 0 (the rendezvous host) explained; a rank that refuses before the process group exists named by the others
at once (revgraph.train.distributed.restarts, .cpp_log, .join).

Two "machines" are two launchers at 127.0.0.1 and 127.0.0.2 (torchrun numbers the ranks by --local-addr: node 0
holds rank 0) with directories of their own (as their own disks); the slow test
runs them in network namespaces (tests/test_distributed_launch.py's). Elapsed times are asserted against
``--timeout`` plus a margin for starting Python and torch: a correctness bound (the run must not wait torchrun's
600 s), not a benchmark."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from kit.distributed import free_port, launched
from kit.launching import REVGRAPH
from kit.launching import Lines as _Lines
from kit.launching import Namespaces as _Namespaces
from kit.launching import train_files as _files
from kit.launching import wait_for as _wait_for
from kit.launching import workers as _workers

from revgraph.train import snapshots

MARGIN = 25  # seconds: starting Python, torch and onnxruntime in the launcher and its workers, on 2 busy cores
CPP = re.compile(r"^(\[[IWEF]\d{4} |frame #\d+: |Exception raised from |<omitting python frames>)", re.MULTILINE)


def _train(epochs: int = 4, batch: int = 4) -> list[str]:
    return ["train", "mlp.onnx", "--data", "data.npz", "--loss", "cross-entropy", "--lr", "0.003", "--threads", "1",
            "--seed", "5", "--epochs", str(epochs), "--batch-size", str(batch), "-o", "trained.onnx"]


def _node_dirs(tmp_path: Path, samples: int = 600) -> list[Path]:
    _files(tmp_path, samples=samples)
    dirs = [tmp_path / f"node{r}" for r in range(2)]
    for d in dirs:
        d.mkdir()
        for f in ("mlp.onnx", "data.npz"):
            shutil.copy(tmp_path / f, d / f)
    return dirs


def _node(r: int, port: int, *extra: str, train: list[str] | None = None) -> list[str]:
    return [*REVGRAPH, *(train or _train()), "--nproc", "1", "--nnodes", "2", "--node-rank", str(r),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", f"127.0.0.{r + 1}", *extra]


def _lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


def _without_log(line: str) -> str:
    """An error line without the note at its end that says where torch's C++ log lines went (when there were)."""
    return re.sub(r" \(torch's C\+\+ log lines: torch-cpp\.node\d\.log\)$", "", line)


def _worker_of_rank(launcher_pid: int, rank: int) -> int:
    for w in _workers(launcher_pid):
        if f"\0RANK={rank}\0".encode() in b"\0" + Path(f"/proc/{w}/environ").read_bytes():
            return w
    raise AssertionError(f"no worker of rank {rank} under {launcher_pid}")


# ------------------------------------------------------------------------------------- restart lines


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds torchrun's workers through Linux /proc")
def test_a_killed_worker_gives_one_line_with_rank_signal_restart_and_snapshot_step(tmp_path):
    """SIGKILL to rank 1 after the first snapshot: the launcher prints one line naming rank 1, node 0, SIGKILL,
    "restart 1 of 2" and the snapshot step; the restarted workers resume from that same step (they say so on
    stdout, from the snapshot they loaded) and the run succeeds."""
    _files(tmp_path, samples=600)
    cmd = [*REVGRAPH, *_train(epochs=6), "--nproc", "2", "--max-restarts", "2", "--snapshot-dir", "ckpt",
           "--snapshot-every", "10"]
    with launched(cmd, cwds=[tmp_path]) as (p,):
        err = _Lines(p.stderr)
        _wait_for(lambda: snapshots.path_in(tmp_path / "ckpt").exists() or p.poll() is not None, 120,
                  "the first snapshot")
        assert p.poll() is None, err.text
        os.kill(_worker_of_rank(p.pid, 1), signal.SIGKILL)
        out = p.stdout.read()
        p.wait(timeout=180)
    assert p.returncode == 0, err.text
    restarts = [ln for ln in _lines(err.text) if "restart" in ln]
    assert len(restarts) == 1, err.text
    m = re.fullmatch(r"revgraph: rank 1 on node 0 was killed by SIGKILL; restart 1 of 2, resuming from the snapshot "
                     r"of step (\d+) \(epoch \d+\) in ckpt/checkpoint\.npz", restarts[0])
    assert m, restarts[0]
    resumed = re.search(r"resumed from ckpt/checkpoint\.npz \(epoch \d+, step (\d+)\)", out)
    assert resumed and resumed.group(1) == m.group(1), (out, restarts)
    assert int(m.group(1)) % 10 == 0 and int(m.group(1)) > 0  # a snapshot every 10 steps
    assert not CPP.search(err.text), err.text


def test_a_refusal_that_is_restarted_names_the_exit_code_and_the_message(tmp_path):
    """A NaN loss with --max-restarts 1: before the (refused) restart, one line per rank that stopped, each with
    exit code 2 and its one-line message, "restart 1 of 1" and where the workers resume (no --snapshot-dir: step
    0); then the run's one error line."""
    _files(tmp_path, nan_at=70)
    cmd = [*REVGRAPH, *_train(epochs=2, batch=8), "--nproc", "2", "--max-restarts", "1"]
    with launched(cmd, cwds=[tmp_path]) as (p,):
        _, err = p.communicate(timeout=180)
    assert p.returncode == 2, err
    lines = _lines(err)
    restarts = [ln for ln in lines if "restart 1 of 1" in ln]
    assert restarts, err
    for ln in restarts:
        assert re.fullmatch(r"revgraph: rank [01] on node 0 exited with code 2 \(the loss is nan at step \d+ "
                            r"\(epoch 1, batch \d+\);.*\); restart 1 of 1, no --snapshot-dir: training starts again "
                            r"from step 0", ln), ln
    assert len([ln for ln in lines if ln.startswith("revgraph: error:")]) == 1, err
    assert len(lines) == len(restarts) + 1, err  # nothing else


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds torchrun's workers through Linux /proc")
def test_a_worker_killed_on_node_1_is_named_on_node_1_and_both_nodes_resume_from_the_same_step(tmp_path):
    """Two nodes, --max-restarts 1, rank 1 (node 1) killed after rank 0 wrote a snapshot on node 0: node 1 names
    rank 1, node 1 and SIGKILL (its disk has no snapshot: rank 0's is used); node 0 says why its workers restart
    too and from which step; the workers resume from that step and both nodes exit 0."""
    dirs, port = _node_dirs(tmp_path), free_port()
    snap = ["--max-restarts", "1", "--snapshot-dir", "ckpt", "--snapshot-every", "10"]
    with launched(*[_node(r, port, *snap, train=_train(epochs=6)) for r in range(2)], cwds=dirs) as procs:
        errs = [_Lines(p.stderr) for p in procs]
        _wait_for(lambda: snapshots.path_in(dirs[0] / "ckpt").exists() or any(p.poll() is not None for p in procs),
                  120, "the first snapshot")
        assert all(p.poll() is None for p in procs), [e.text for e in errs]
        os.kill(_worker_of_rank(procs[1].pid, 1), signal.SIGKILL)
        out = procs[0].stdout.read()
        for p in procs:
            p.wait(timeout=180)
    assert [p.returncode for p in procs] == [0, 0], [e.text for e in errs]
    resumed = re.search(r"resumed from ckpt/checkpoint\.npz \(epoch \d+, step (\d+)\)", out)
    assert resumed, out
    node1 = _lines(errs[1].text)
    assert node1[:1] == [("revgraph: rank 1 on node 1 was killed by SIGKILL; restart 1 of 1, no snapshot in ckpt on "
                          "this machine: the workers resume from rank 0's, if any, or step 0")], node1
    node0 = [ln for ln in _lines(errs[0].text) if "restart" in ln]
    assert len(node0) == 1, errs[0].text
    # node 0's workers fail in their collective (counted), or torchrun sees node 1 rejoin first (not counted)
    m = re.fullmatch(r"revgraph: (?:rank 0 on node 0 exited with code 2 \(.* with the other training processes "
                     r"failed; .*\); restart 1 of 1, |restarting the workers of node 0 \(not counted against "
                     r"--max-restarts, 0 of 1 used\): another node left or rejoined the rendezvous, after a failure "
                     r"there; )resuming from the snapshot of step (\d+) \(epoch \d+\) in ckpt/checkpoint\.npz",
                     node0[0])
    assert m and m.group(1) == resumed.group(1), (node0[0], resumed.group(0))
    assert not any(CPP.search(e.text) for e in errs)


def test_the_side_channel_names_a_refusing_rank_and_one_that_never_joins(monkeypatch):
    """join.py alone, two ranks in this process (threads) on a store at a free port: rank 1's refusal, announced
    while rank 0 joins, makes rank 0 raise it at once naming rank 1 and its node; with nobody else, rank 0 names
    rank 1 as the rank that did not join within the timeout."""
    import threading

    import revgraph as rg
    from revgraph.train.distributed.data_parallel import CollectiveError
    from revgraph.train.distributed.join import NODE_RANK_ENV, announce_refusal, join_store

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "RANK": "1",
                 NODE_RANK_ENV: "1", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    refusing = threading.Thread(target=announce_refusal, args=("'data.npz' is truncated", 20))
    refusing.start()  # (rank 1's store client waits for rank 0's store)
    start = time.monotonic()
    with pytest.raises(rg.InputError, match=r"^rank 1 \(node 1, host [^)]+\) refused before joining: 'data\.npz' "
                                            r"is truncated$"):
        join_store(0, 2, 20)
    refusing.join(timeout=20)
    assert time.monotonic() - start < 10  # not the 20 s timeout
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(CollectiveError, match=r"^rank\(s\) 1 did not join the process group within 1\.5 s "):
        join_store(0, 2, 1.5)


# ------------------------------------------------------------------------------------- the rendezvous


def test_nothing_at_the_endpoint_ends_within_the_timeout_in_one_line_and_cpp_lines_go_to_a_file(tmp_path):
    """Node 1 alone, nothing listening at --rdzv-endpoint: exit 2 within --timeout (not 110 s) with one line
    saying node 0 hosts the rendezvous there; torch's C++ lines (a timed-out connect and its stack) are not on
    stderr but in torch-cpp.node1.log beside -o, which the line names."""
    (d,) = _node_dirs(tmp_path)[1:]
    start = time.monotonic()
    r = subprocess.run(_node(1, free_port(), "--timeout", "6"), cwd=d, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert r.returncode == 2, r.stderr
    assert elapsed < 6 + MARGIN, elapsed
    lines = _lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert re.fullmatch(r"revgraph: error: nothing answers at --rdzv-endpoint 127\.0\.0\.1:\d+ within --timeout 6 s: "
                        r"node 0 \(--node-rank 0\) hosts torchrun's rendezvous there; .* \(torch's C\+\+ log lines: "
                        r"torch-cpp\.node1\.log\)", lines[0]), lines[0]
    log = (d / "torch-cpp.node1.log").read_text()
    assert re.search(r"^\[[EW]\d{4} .*\] \[c10d\] .*127\.0\.0\.1", log, re.MULTILINE), log[:2000]
    assert "frame #0: " in log, log[:2000]
    assert not CPP.search(r.stderr)


def test_node_0_alone_ends_within_the_timeout_in_one_line(tmp_path):
    """Node 0 alone: the other machine never joins; exit 2 within --timeout (torchrun's join timeout is 600 s)
    with one line saying so and what to do."""
    d = _node_dirs(tmp_path)[0]
    start = time.monotonic()
    r = subprocess.run(_node(0, free_port(), "--timeout", "6"), cwd=d, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert time.monotonic() - start < 6 + MARGIN
    lines = _lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("revgraph: error: the other machines did not join the rendezvous "
                                                   "at 127.0.0.1:"), r.stderr
    assert "within --timeout 6 s" in lines[0] and "with the same --rdzv-id" in lines[0], lines[0]


def _lose_node_0(tmp_path: Path, timeout: int, restarts: int) -> tuple[subprocess.Popen, str, float]:
    dirs, port = _node_dirs(tmp_path), free_port()
    cmds = [_node(r, port, "--timeout", str(timeout), "--max-restarts", str(restarts),
                  train=_train(epochs=50)) for r in range(2)]
    with launched(*cmds, cwds=dirs) as procs:
        out0 = _Lines(procs[0].stdout)
        err1 = _Lines(procs[1].stderr)
        _wait_for(lambda: out0.has("data-parallel on 2 processes") or any(p.poll() is not None for p in procs), 120,
                  "training to start")
        assert all(p.poll() is None for p in procs), err1.text
        os.killpg(procs[0].pid, signal.SIGKILL)  # node 0 is lost: its launcher, torchrun's store and its worker
        lost = time.monotonic()
        procs[1].wait(timeout=timeout + 120)
        return procs[1], err1.text, time.monotonic() - lost


@pytest.mark.parametrize("restarts", [1, 0])
def test_losing_node_0_ends_node_1_within_the_timeout_saying_node_0_holds_the_rendezvous(tmp_path, restarts):
    """Node 0 killed mid-run (its launcher with torchrun's store, and its worker). Node 1 allowed a restart: its
    worker fails, the restart line says so, and the restart finds no rendezvous: exit 2 within --timeout with one
    error line saying node 0 holds the rendezvous and how to restart. Without restarts: the worker's line, and
    that node 0, which holds the rendezvous, is gone; or, when torchrun's agent polls the store first, the lost
    rendezvous line."""
    p, err, elapsed = _lose_node_0(tmp_path, timeout=8, restarts=restarts)
    assert p.returncode == 2, err
    assert elapsed < 8 + MARGIN, elapsed
    errors = [ln for ln in _lines(err) if ln.startswith("revgraph: error:")]
    assert len(errors) == 1, err
    if not restarts:
        assert _lines(err) == errors, err
        # Which side notices first is a race, and either line is true: the worker's failed collective (its line,
        # then that node 0 is gone), or torchrun's agent polling the store between health checks (lost rendezvous).
        if "lost the rendezvous at " not in errors[0]:
            assert re.fullmatch(r"revgraph: error: .* with the other training processes failed; one of them stopped "
                                r".*; node 0 \(--node-rank 0\), which holds the rendezvous \(torchrun's c10d store\), "
                                r"is gone too: restart the command on every machine with the same --rdzv-id, or use an "
                                r"external store", _without_log(errors[0])), errors[0]
            return
    assert "lost the rendezvous at 127.0.0.1:" in errors[0], errors[0]
    assert "node 0 (--node-rank 0) holds it (torchrun's c10d store lives there)" in errors[0], errors[0]
    assert "restart the command on every machine with the same --rdzv-id" in errors[0] and \
        "use an external store" in errors[0], errors[0]
    others = [ln for ln in _lines(err) if not ln.startswith("revgraph: error:")]
    assert len(others) <= 1 and all(re.match(r"revgraph: rank 1 on node 1 exited with code 2 .*; restart 1 of 1, ",
                                             ln) for ln in others), err
    assert not CPP.search(err), err


def test_a_rank_refusing_before_the_group_exists_stops_the_others_at_once_naming_it(tmp_path):
    """Node 1's data file is truncated: its rank refuses before joining the process group; node 0 (default
    --timeout, 300 s) stops within seconds with one line naming rank 1, node 1 and the file, instead of
    waiting 300 s and ending with RendezvousClosedError."""
    dirs, port = _node_dirs(tmp_path), free_port()
    data = (dirs[1] / "data.npz").read_bytes()
    (dirs[1] / "data.npz").write_bytes(data[: len(data) // 3])
    start = time.monotonic()
    with launched(*[_node(r, port) for r in range(2)], cwds=dirs) as procs:
        done = [p.communicate(timeout=240) for p in procs]
    elapsed = time.monotonic() - start
    assert [p.returncode for p in procs] == [2, 2], done
    assert elapsed < 60, elapsed  # (the default --timeout is 300 s)
    lines = [[_without_log(ln) for ln in _lines(err)] for _, err in done]
    assert all(len(ls) == 1 for ls in lines), lines
    assert re.fullmatch(r"revgraph: error: 'data\.npz' is not a readable \.npz file \(.*\)", lines[1][0]), lines[1]
    said = lines[1][0].removeprefix("revgraph: error: ")
    assert re.fullmatch(rf"revgraph: error: rank 1 \(node 1, host [^)]+\) refused before joining: {re.escape(said)}",
                        lines[0][0]), lines[0]


# ------------------------------------------------------------------------------------- two machines (slow)


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("ip"), reason="needs iproute2's `ip netns` to make two machines")
def test_two_machines_succeed_without_cpp_lines_on_stderr(tmp_path):
    """The README's recipe on two network namespaces: both nodes exit 0 and neither prints a C++ log line or stack
    on stderr; where torch logged any (the namespaces have no name service: "The hostname of the client socket
    cannot be retrieved"), they are in torch-cpp.node<R>.log beside -o and one line says so."""
    dirs = _node_dirs(tmp_path)
    with _Namespaces() as nets:
        port = free_port()
        cmds = [nets.command(r, [*REVGRAPH, *_train(epochs=2), "--nproc", "1", "--nnodes", "2", "--node-rank", str(r),
                                 "--rdzv-endpoint", f"{nets.addr[0]}:{port}", "--local-addr", nets.addr[r]],
                             {"GLOO_SOCKET_IFNAME": nets.ifname[r]}) for r in range(2)]
        with launched(*cmds, cwds=dirs) as procs:
            done = [p.communicate(timeout=300) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, done, strict=True)):
        assert p.returncode == 0, err[-3000:]
        assert not CPP.search(err), err[-3000:]
        log = dirs[r] / f"torch-cpp.node{r}.log"
        if log.exists():
            n = len(log.read_text().splitlines())
            assert _lines(err) == [f"revgraph: torch's C++ log lines ({n}) are in torch-cpp.node{r}.log"], err
        else:
            assert not _lines(err), err
    np.testing.assert_equal(len(list(dirs[1].glob("trained.onnx"))), 0)  # only rank 0 writes
