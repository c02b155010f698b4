"""Starting, stopping and failing data-parallel runs (revgraph.train.distributed.launch, the ``--nproc`` launcher,
revgraph under torchrun): exit codes and one-line messages, refusals before the first step, no restart of a
deterministic failure, signals, orphans, a taken port, ``--timeout``; and (slow) two machines in network namespaces
running the README's multi-node recipe, compared with one process and recovering from a killed worker.

Every run has 2 gloo processes with one thread each and a small MLP; subprocesses run in sessions of their own
and are killed on the way out (``launched``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.run  # noqa: F401  # (in the test extra: missing, it fails instead of skipping)
from kit.devices import gpu_test
from kit.distributed import ENV, TORCHRUN, free_port, launched
from kit.launching import REVGRAPH
from kit.launching import Lines as _Lines
from kit.launching import Namespaces as _Namespaces
from kit.launching import train_files as _files
from kit.launching import wait_for as _wait_for
from kit.launching import workers as _workers

import revgraph as rg
from revgraph.train import snapshots as checkpoints

HERE = Path(__file__).parent
WRAPPER = HERE / "launch_worker.py"
# the --nproc launcher (revgraph.train.distributed.launch.run_torchrun) on torchrun arguments of our own (the per-rank
# wrapper)
LAUNCHER = [sys.executable, "-c", ("import sys; from revgraph.train.distributed.launch import run_torchrun; "
                                   "sys.exit(run_torchrun(sys.argv[1:]))")]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("revgraph: error:")]


def _communicate(proc, timeout: float = 120) -> tuple[str, str]:
    return proc.communicate(timeout=timeout)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


# ------------------------------------------------------------------------------------- refusals before a step


@pytest.mark.parametrize("extra,message", [
    (["--lr", "0.01"], ("the training settings differ across ranks: rank 1 has lr 0.01, rank 0 has 0.003; give every "
                        "rank the same loss, optimizer and hyperparameters")),
    (["--epochs", "3"], "the train arguments differ across ranks: rank 1 has --epochs 3, rank 0 has 2;"),
])
def test_ranks_with_different_arguments_are_refused_before_any_step(tmp_path, extra, message):
    """A rank given another --lr (or another epoch count) is refused, with one line naming the rank and the
    argument, before the first step: no checkpoint is written (there would be one after every step)."""
    common = _files(tmp_path)
    ckpt = tmp_path / "ckpt"
    cmd = [*LAUNCHER, "--standalone", "--nproc-per-node=2", str(WRAPPER), "--on-rank", "1", str(len(extra)), *extra,
           "--", *common, "--epochs", "2", "--batch-size", "8", "--checkpoint-dir", str(ckpt),
           "--checkpoint-every", "1", "-o", str(tmp_path / "out.onnx")]
    with launched(cmd) as (p,):
        out, err = _communicate(p)
    assert p.returncode == 2, out + err
    errors = _errors(err)
    assert errors and all(message in e for e in errors), err  # every rank stops with the same line
    assert not checkpoints.path_in(ckpt).exists() and not (tmp_path / "out.onnx").exists()
    assert "steps of adam" not in out


def test_test_data_on_rank_0_only_is_refused_before_training(tmp_path):
    """--test-data on rank 0 only would make rank 0 evaluate alone after training (a hang, and the trained model
    lost): refused before training."""
    common = _files(tmp_path)
    shutil.copy(tmp_path / "data.npz", tmp_path / "test.npz")
    cmd = [*LAUNCHER, "--standalone", "--nproc-per-node=2", str(WRAPPER), "--on-rank", "0", "2", "--test-data",
           str(tmp_path / "test.npz"), "--", *common, "--epochs", "1", "--batch-size", "8",
           "-o", str(tmp_path / "o.onnx")]
    with launched(cmd) as (p,):
        out, err = _communicate(p)
    assert p.returncode == 2, out + err
    assert "rank 1 has --test-data given False, rank 0 has True" in err, err
    assert "training epoch" not in out and not (tmp_path / "o.onnx").exists()


def test_bad_data_on_one_rank_stops_every_rank_at_once(tmp_path):
    """A rank whose data is refused tells the others (which would otherwise wait for it in a collective): every
    rank exits with one line, the other ranks naming the rank that refused."""
    common = _files(tmp_path)
    np.savez(tmp_path / "bad.npz", x=np.zeros((10, 8, 8), np.float32), y=np.full(10, 99, np.int64))
    cmd = [*LAUNCHER, "--standalone", "--nproc-per-node=2", str(WRAPPER), "--on-rank", "1", "2", "--data",
           str(tmp_path / "bad.npz"), "--", *common, "--epochs", "1", "--batch-size", "8", "--timeout", "600",
           "-o", str(tmp_path / "o.onnx")]
    with launched(cmd) as (p,):
        out, err = _communicate(p)
    assert p.returncode == 2, out + err
    # (each worker hands its one line to the launcher, which prints it once, naming the rank that refused)
    assert "revgraph: error: rank 1 refused its data: label 99 is not a class index" in err, err


# ------------------------------------------------------------------------------------- exit codes and restarts


def test_nan_loss_exits_2_under_nproc_and_is_not_restarted(tmp_path):
    """A NaN loss stops training with exit 2 under --nproc (not torchrun's 1), and --max-restarts does not train
    again: the restarted attempt finds the failure that the first recorded and stops at once with the same line."""
    common = _files(tmp_path, nan_at=70)
    ckpt = tmp_path / "ckpt"
    cmd = [*REVGRAPH, *common, "--epochs", "2", "--batch-size", "8", "--nproc", "2", "--max-restarts", "1",
           "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "-o", str(tmp_path / "o.onnx")]
    with launched(cmd) as (p,):
        out, err = _communicate(p, 180)
    assert p.returncode == 2, out + err
    errors = _errors(err)
    assert errors and all(re.search(r"the loss is nan at step \d+ \(epoch 1, batch \d+\)", e) for e in errors), err
    assert len(errors) == 1, err  # the launcher prints the workers' refusal once (issue 28, part 4)
    assert out.count("data-parallel on 2 processes") == 1, out  # but only the first attempt trained
    assert "resumed from" not in out and not (tmp_path / "o.onnx").exists()
    assert checkpoints.path_in(ckpt).exists()  # the steps before the NaN were checkpointed


def test_raw_torchrun_exits_1_for_a_nan_loss_and_does_not_train_again(tmp_path):
    """Under raw torchrun (as the README runs it: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, --max-restarts, a
    checkpoint directory), a worker's exit 2 (a NaN loss) becomes torchrun's exit 1 with its failure summary
    naming exitcode 2; the restarted attempt finds the failure rank 0 recorded in the checkpoint directory and
    stops at once with the same line instead of training again."""
    common = _files(tmp_path, nan_at=70)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "-m", "revgraph", *common,
           "--epochs", "2", "--batch-size", "8", "--checkpoint-dir", str(tmp_path / "ckpt"),
           "-o", str(tmp_path / "o.onnx")]
    with launched(cmd, env={**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) as (p,):
        out, err = _communicate(p, 180)
    assert p.returncode == 1, out + err
    errors = _errors(err)
    assert "exitcode  : 2" in err and len(errors) == 4, err  # 2 ranks x 2 attempts
    assert all("the loss is nan at step" in e for e in errors), err
    assert out.count("data-parallel on 2 processes") == 1, out
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("option,message", [
    (["--timeout", "0"], "argument --timeout: invalid value '0'"),
    (["--nnodes", "2"], "--nnodes goes with --nproc N (under torchrun, give torchrun its own options)"),
    (["--nproc", "1", "--nnodes", "2"], "--nnodes 2 needs --node-rank R (0 on the machine of --rdzv-endpoint)"),
    (["--nproc", "1", "--rdzv-endpoint", "h:1"], "--rdzv-endpoint and --node-rank are for several machines"),
    (["--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "nohostport"],
     "--rdzv-endpoint must be HOST:PORT"),
])
def test_bad_launch_options_exit_2(tmp_path, option, message):
    common = _files(tmp_path)
    r = subprocess.run([*REVGRAPH, *common, "--epochs", "1", *option, "-o", str(tmp_path / "o.onnx")], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o.onnx").exists()


def test_taken_rendezvous_port_fails_fast_with_one_line(tmp_path):
    """Node 0 hosts the c10d rendezvous: a port another program listens on would make torchrun connect to it and
    wait; the launcher refuses it in one line before starting torchrun."""
    common = _files(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([*REVGRAPH, *common, "--epochs", "1", "--nproc", "1", "--nnodes", "2", "--node-rank", "0",
                            "--rdzv-endpoint", f"127.0.0.1:{port}", "-o", str(tmp_path / "o.onnx")], env=ENV,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"revgraph: error: port {port} of --rdzv-endpoint 127.0.0.1:{port} is already taken "
                                "on this machine (another run or program listens there): choose another port")


@gpu_test(torch_gpus=2)
def test_nccl_ranks_with_different_lr_are_refused_and_nan_exits_2(tmp_path):
    """The same on two GPUs (NCCL): the comparison of the settings (all_gather_object over NCCL) refuses another
    --lr before any step, and a NaN loss exits 2 under --nproc."""
    common = _files(tmp_path)
    cmd = [*LAUNCHER, "--standalone", "--nproc-per-node=2", str(WRAPPER), "--on-rank", "1", "2", "--lr", "0.01", "--",
           *common, "--epochs", "1", "--batch-size", "8", "--device", "cuda", "-o", str(tmp_path / "o.onnx")]
    with launched(cmd) as (p,):
        out, err = _communicate(p, 240)
    assert p.returncode == 2 and "rank 1 has lr 0.01, rank 0 has 0.003" in err, out + err
    common = _files(tmp_path, nan_at=70)
    with launched([*REVGRAPH, *common, "--epochs", "1", "--batch-size", "8", "--device", "cuda", "--nproc", "2",
                   "-o", str(tmp_path / "o.onnx")]) as (p,):
        out, err = _communicate(p, 240)
    assert p.returncode == 2 and "the loss is nan at step" in err, out + err
    assert not (tmp_path / "o.onnx").exists()


# ------------------------------------------------------------------------------------- signals and orphans


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds torchrun's workers through Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_nproc_stops_the_workers_and_writes_nothing(tmp_path, sig):
    """SIGTERM, SIGINT or SIGHUP to `revgraph train --nproc 2` alone (not its process group): torchrun, which runs
    in that process, stops the workers and waits for them; the command exits 128 + the signal with no worker left
    and no output written."""
    common = _files(tmp_path, samples=1000)
    cmd = [*REVGRAPH, *common, "--epochs", "200", "--batch-size", "4", "--nproc", "2", "-o", str(tmp_path / "o.onnx")]
    with launched(cmd) as (p,):
        lines = _Lines(p.stdout)
        _wait_for(lambda: lines.has("data-parallel on 2 processes") or p.poll() is not None, 120, "training to start")
        workers = _workers(p.pid)
        assert len(workers) == 2 and p.poll() is None, lines.text
        os.kill(p.pid, sig)
        p.wait(timeout=60)
        err = p.stderr.read()
    assert p.returncode == 128 + sig, err
    assert all(_gone(w) for w in workers)
    assert not (tmp_path / "o.onnx").exists()
    # issue 40, item 7: SIGINT printed "revgraph: interrupted" once per worker; the launcher says it once
    assert err.count("revgraph: interrupted") == (1 if sig == signal.SIGINT else 0), err


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds torchrun's workers through Linux /proc")
def test_killed_torchrun_agent_leaves_no_orphan(tmp_path):
    """SIGKILL to the torchrun agent (it can do nothing about it): its workers die with it (PR_SET_PDEATHSIG)
    instead of training on and writing the output."""
    common = _files(tmp_path, samples=1000)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "revgraph", *common, "--epochs", "200",
           "--batch-size", "4", "-o", str(tmp_path / "o.onnx")]
    with launched(cmd) as (p,):
        lines = _Lines(p.stdout)
        _wait_for(lambda: lines.has("data-parallel on 2 processes") or p.poll() is not None, 120, "training to start")
        workers = _workers(p.pid)
        assert len(workers) == 2 and p.poll() is None, lines.text
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        _wait_for(lambda: all(_gone(w) for w in workers), 20, "the workers to die with their agent")
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds torchrun's workers through Linux /proc")
def test_stopped_peer_fails_the_other_within_the_timeout(tmp_path):
    """A worker stopped by SIGSTOP (a hung machine) no longer answers: with --timeout 4 the other stops with one
    line naming the timeout instead of waiting gloo's 30 minutes, and --nproc exits 2."""
    common = _files(tmp_path, samples=1000)
    cmd = [*REVGRAPH, *common, "--epochs", "200", "--batch-size", "4", "--nproc", "2", "--timeout", "4",
           "-o", str(tmp_path / "o.onnx")]
    with launched(cmd) as (p,):
        out, err = _Lines(p.stdout), _Lines(p.stderr)
        _wait_for(lambda: out.has("data-parallel on 2 processes") or p.poll() is not None, 120, "training to start")
        workers = sorted(_workers(p.pid))
        assert len(workers) == 2 and p.poll() is None, out.text + err.text
        stopped = next(w for w in workers if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{w}/environ").read_bytes())
        os.kill(stopped, signal.SIGSTOP)
        _wait_for(lambda: err.has("revgraph: error:") or p.poll() is not None, 90, "the other rank to time out")
        with contextlib.suppress(ProcessLookupError):  # (already gone: the launcher stopped it first)
            os.kill(stopped, signal.SIGCONT)  # so that torchrun's SIGTERM reaches it at once (not after 30 s)
        p.wait(timeout=60)
    errors = _errors(err.text)
    assert p.returncode == 2, err.text
    assert errors and "one of them stopped or cannot be reached within the timeout (--timeout" in errors[0], err.text
    # the stopped worker, continued, may report the other's exit before torchrun's SIGTERM reaches it: one line too
    assert all("with the other training processes failed; one of them stopped" in e for e in errors), err.text
    assert not (tmp_path / "o.onnx").exists()


class _OneRank:
    """A stand-in for a Collective of one rank (rank 0): what :func:`revgraph.train.distributed.launch.recorded_failure`
    calls."""

    rank = 0

    def gather_objects(self, value) -> list:
        return [value]


def test_failure_record_stops_a_restart_of_the_same_run_only(tmp_path, monkeypatch):
    """The record a failed attempt leaves in the checkpoint directory stops a restarted attempt of the same run
    (same run id, restart count > 0) with the same message; a fresh start removes it, another run ignores it."""
    from revgraph.train.distributed.launch import FAILURE_FILE, RUN_DIR_ENV, record_failure, recorded_failure

    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    env = {"TORCHELASTIC_RUN_ID": "run-a", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    record_failure("the loss is nan at step 3 (epoch 1, batch 3); ...", 0, tmp_path)
    record_failure("a later message", 0, tmp_path)  # the first failure is the one to repeat
    assert (tmp_path / FAILURE_FILE).exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(rg.RevgraphError, match=r"^the loss is nan at step 3 \(epoch 1, batch 3\); \.\.\.$"):
        recorded_failure(_OneRank(), tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")  # another run (a new launch with another id)
    recorded_failure(_OneRank(), tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a fresh launch of run-a: the old record goes
    recorded_failure(_OneRank(), tmp_path)
    assert not (tmp_path / FAILURE_FILE).exists()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # nothing to restart: nothing recorded
    record_failure("bad data", 0, tmp_path)
    assert not (tmp_path / FAILURE_FILE).exists()


# ------------------------------------------------------------------------------------- the loopback trap


def test_loopback_hostname_trap_is_refused_before_joining(monkeypatch):
    """Several machines (WORLD_SIZE > LOCAL_WORLD_SIZE) meeting at a non-loopback address while this machine's
    name resolves to 127.0.0.1 and GLOO_SOCKET_IFNAME is unset: the Collective refuses in one line before it
    joins (gloo would listen on loopback), and not in the cases where loopback is right."""
    from revgraph.runtime.devices import Device
    from revgraph.train.distributed.data_parallel import Collective
    from revgraph.train.distributed.launch import network_problem

    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "9"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(rg.RevgraphError,
                       match=r"this machine's name 'localhost' resolves to 127\.0\.0\.1.*, a loopback "
                             r"address, .*set GLOO_SOCKET_IFNAME to the network interface"):
        Collective(Device.parse("cpu"), timeout=5)
    assert network_problem("nccl") is None  # NCCL picks a non-loopback interface itself
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert network_problem("gloo") is None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # every "machine" on this one (the tests' localhost runs)
    assert network_problem("gloo") is None
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one machine
    assert network_problem("gloo") is None


# ------------------------------------------------------------------------------------- two machines (slow)


def _two_nodes(nets: _Namespaces, tmp_path: Path, run: str, train: list[str], *, ifname: bool = True,
               raw: bool = False, kill_after_checkpoint: bool = False) -> list[subprocess.CompletedProcess]:
    """Run the README's multi-node recipe on both "machines", each in its own directory (as its own disk) holding
    the model and data: `revgraph train ... --nproc 1 --nnodes 2 --node-rank R --rdzv-endpoint NODE0:PORT
    --local-addr ADDR` with GLOO_SOCKET_IFNAME set (or the raw torchrun recipe with ``raw``). With
    ``kill_after_checkpoint``, node 1's worker is killed (SIGKILL) after node 0 wrote the first checkpoint."""
    port = free_port()
    dirs = [tmp_path / run / f"node{r}" for r in range(2)]
    cmds = []
    for r, d in enumerate(dirs):
        d.mkdir(parents=True)
        for f in ("mlp.onnx", "data.npz"):
            shutil.copy(tmp_path / f, d / f)
        env = {"GLOO_SOCKET_IFNAME": nets.ifname[r]} if ifname else {}
        if raw:  # restarted workers must not meet in the failed attempt's store (pytorch/pytorch#135712)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            launch = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"{nets.addr[0]}:{port}", "--rdzv-id", run, "--rdzv-conf", f"is_host={int(r == 0)}",
                      "--local-addr", nets.addr[r], "--max-restarts", "1", "-m", "revgraph", *train]
        else:
            launch = [*REVGRAPH, *train, "--nproc", "1", "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint",
                      f"{nets.addr[0]}:{port}", "--local-addr", nets.addr[r], "--max-restarts", "1"]
        cmds.append(nets.command(r, launch, env))
    with launched(*cmds, cwds=dirs) as procs:
        if kill_after_checkpoint:
            ckpt = checkpoints.path_in(dirs[0] / "ckpt")
            _wait_for(lambda: ckpt.exists() or any(p.poll() is not None for p in procs), 180, "the first checkpoint")
            workers = _workers(procs[1].pid)  # `ip netns exec` and `env` exec: the pid is torchrun's
            assert workers and all(p.poll() is None for p in procs), "the run ended before a worker could be killed"
            os.kill(workers[0], signal.SIGKILL)
        outs = [p.communicate(timeout=300) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs, strict=True)]


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("ip"), reason="needs iproute2's `ip netns` to make two machines")
def test_two_machines_in_network_namespaces_follow_the_readme(tmp_path):
    """Two "machines" (network namespaces joined by a veth pair; this host's name resolves to 127.0.0.1, the
    trap): the README's recipe trains the weights of one process on the same global batch; the raw torchrun
    recipe trains the same bits; a worker killed mid-run is restarted and the run ends bitwise equal to the
    uninterrupted one; and without GLOO_SOCKET_IFNAME both recipes stop with the one-line hint."""
    _files(tmp_path, samples=600)
    train = ["train", "mlp.onnx", "--data", "data.npz", "--loss", "cross-entropy", "--lr", "0.003", "--threads", "1",
             "--seed", "5", "--epochs", "4", "--batch-size", "4", "--checkpoint-dir", "ckpt", "--checkpoint-every",
             "40", "-o", "trained.onnx"]
    one = [*REVGRAPH, *train[:train.index("--batch-size")], "--batch-size", "8", "-o", "one.onnx"]  # 2 x 4
    r = subprocess.run(one, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    reference = rg.load(tmp_path / "one.onnx").initializers
    with _Namespaces() as nets:
        runs = {}
        for name, raw, kill in [("plain", False, False), ("raw", True, False), ("killed", False, True)]:
            done = _two_nodes(nets, tmp_path, name, train, raw=raw, kill_after_checkpoint=kill)
            assert [d.returncode for d in done] == [0, 0], [d.stderr[-3000:] for d in done]
            assert "data-parallel on 2 processes" in done[0].stdout  # rank 0 is node 0 (the smaller --local-addr)
            assert ("resumed from" in done[0].stdout) == kill, done[0].stdout
            assert not (tmp_path / name / "node1" / "trained.onnx").exists()  # only rank 0 writes
            runs[name] = rg.load(tmp_path / name / "node0" / "trained.onnx").initializers
        for name, value in reference.items():
            np.testing.assert_allclose(runs["plain"][name], value, rtol=2e-5, atol=2e-6, err_msg=name)
            np.testing.assert_array_equal(runs["raw"][name], runs["plain"][name], err_msg=name)
            np.testing.assert_array_equal(runs["killed"][name], runs["plain"][name], err_msg=name)
        hint = "resolves to 127.0.0.1, a loopback address, so gloo would listen where the other machines"
        for raw in (False, True):  # the launcher refuses before torchrun; raw torchrun's workers before joining
            done = _two_nodes(nets, tmp_path, f"trap{int(raw)}", train, ifname=False, raw=raw)
            for d in done:
                assert d.returncode == (1 if raw else 2), d.stderr[-3000:]
                errors = _errors(d.stderr)
                assert errors and all(hint in e and "set GLOO_SOCKET_IFNAME" in e for e in errors), d.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("ip"), reason="needs iproute2's `ip netns` to make two machines")
def test_two_machines_with_the_data_parallel_options_train_like_one_process(tmp_path):
    """The README's multi-node recipe on two "machines" with the options of issue 25: ZeRO-2 (--shard
    gradients), ZeRO-1, small buckets with the exchange overlapping the backward pass, and accumulated
    micro-batches (2 machines x batch 4 x 2 micro-batches = one process with batch 16): each trains the weights
    of one process on the same global batch (rtol 2e-5)."""
    _files(tmp_path, samples=150)
    train = ["train", "mlp.onnx", "--data", "data.npz", "--loss", "cross-entropy", "--lr", "0.003", "--threads", "1",
             "--seed", "5", "--epochs", "2", "--batch-size", "4", "-o", "trained.onnx"]
    references = {}
    for batch in (8, 16):
        one = [*REVGRAPH, *train[:train.index("--batch-size")], "--batch-size", str(batch), "-o", f"one{batch}.onnx"]
        r = subprocess.run(one, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        references[batch] = rg.load(tmp_path / f"one{batch}.onnx").initializers
    cases = {"zero2": (["--shard", "gradients"], 8), "zero1": (["--shard", "optimizer"], 8),
             "overlap": (["--bucket-mb", "0.002", "--overlap", "on"], 8),
             "accumulate": (["--accumulate-steps", "2"], 16)}
    with _Namespaces() as nets:
        for name, (options, batch) in cases.items():
            done = _two_nodes(nets, tmp_path, name, [*train, *options])
            assert [d.returncode for d in done] == [0, 0], (name, [d.stderr[-3000:] for d in done])
            trained = rg.load(tmp_path / name / "node0" / "trained.onnx").initializers
            for p, value in references[batch].items():
                np.testing.assert_allclose(trained[p], value, rtol=2e-5, atol=2e-6, err_msg=f"{name}: {p}")


def test_the_worker_named_is_the_one_that_stopped_the_run():
    # issue 40, item 7: a worker killed just after training ended was reported as "worker 0 stopped with exit code
    # -15", the rank torchrun terminated after it, not the one killed
    from types import SimpleNamespace as F

    from revgraph.train.distributed.launch import _first_failure

    killed_second = {0: F(exitcode=-15, timestamp=20), 1: F(exitcode=-9, timestamp=10)}
    assert _first_failure(killed_second)[0] == 1
    two_crashes = {0: F(exitcode=1, timestamp=30), 1: F(exitcode=-11, timestamp=25), 2: F(exitcode=-15, timestamp=1)}
    assert _first_failure(two_crashes)[0] == 1
    all_terminated = {3: F(exitcode=-15, timestamp=7), 2: F(exitcode=-15, timestamp=7)}
    assert _first_failure(all_terminated)[0] == 2


# ------------------------------------------------------------------ refusals, started either way (issue 43, item 5)


def _refusing_ranks(tmp_path: Path, how: str, runs: int) -> None:
    """Rank 1 of raw torchrun refuses its data (rank 0 is told and stops too), ``runs`` times; each rank is started
    as ``python -m revgraph`` or as the ``revgraph`` console script (``torchrun --no-python``, as ``srun revgraph``
    starts it). Every rank must end with its refusal, exit 2: never SIGABRT (exitcode -6, "terminate called without
    an active exception", from gloo's threads at interpreter finalization); torchrun may stop the other rank
    (SIGTERM, exitcode -15) once the first has exited."""
    common = _files(tmp_path)
    np.savez(tmp_path / "bad.npz", x=np.zeros((120, 8, 8), np.float32), y=np.full(120, 99, np.int64))
    start = f"{sys.executable} -m revgraph" if how == "module" else shutil.which("revgraph")
    assert start, "the revgraph console script is not on PATH (pip install -e . puts it there)"
    args = " ".join([*common, "--epochs", "1", "--batch-size", "8", "--timeout", "120", "-o",
                     str(tmp_path / "out.onnx")])
    script = (f'if [ "$RANK" = 1 ]; then exec {start} {args} --data {tmp_path / "bad.npz"}; '
              f'else exec {start} {args}; fi')
    for run in range(runs):
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--no-python", "sh", "-c", script]
        with launched(cmd) as (p,):
            _, err = _communicate(p, 180)
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
        assert p.returncode == 1 and "2" in codes and set(codes) <= {"2", "-15"}, (run, codes, err[-3000:])
        assert "terminate called" not in err and "label 99 is not a class index" in err, (run, err[-3000:])


@pytest.mark.parametrize("how", ["module", "console-script"])
def test_refusing_ranks_exit_2_started_either_way(tmp_path, how):
    _refusing_ranks(tmp_path, how, 2)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["module", "console-script"])
def test_refusing_ranks_exit_2_started_either_way_20_times(tmp_path, how):
    _refusing_ranks(tmp_path, how, 20)
