"""Helpers of the tests that launch data-parallel runs (tests/test_distributed_launch.py,
tests/test_restart_messages.py): the command, the files of a small run, waiting, the workers of an agent, a
pipe's lines read by a thread, and two network namespaces as two machines."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import revgraph as rg
from revgraph.tools import demo

from .distributed import child_pids, cmdline

REVGRAPH = [sys.executable, "-m", "revgraph"]


def train_files(tmp_path: Path, samples: int = 120, nan_at: int | None = None) -> list[str]:
    train, _ = demo.digits()
    x = train["x"][:samples].copy()
    if nan_at is not None:
        x[nan_at] = np.nan
    np.savez(tmp_path / "data.npz", x=x, y=train["labels"][:samples])
    rg.save(demo.mlp_model(hidden=8), tmp_path / "mlp.onnx")
    return ["train", str(tmp_path / "mlp.onnx"), "--data", str(tmp_path / "data.npz"), "--loss", "cross-entropy",
            "--lr", "0.003", "--threads", "1", "--seed", "5"]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def workers(pid: int) -> list[int]:
    """The revgraph workers that are children of ``pid`` (a torchrun agent)."""
    try:
        return [c for c in child_pids(pid) if "revgraph" in cmdline(c) or "launch_worker" in cmdline(c)]
    except OSError:
        return []


class Lines:
    """The lines a pipe gives, collected by a thread (so that a test can wait for one while the run goes on)."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    @property
    def text(self) -> str:
        self.thread.join(timeout=10)
        return "".join(self.lines)


class Namespaces:
    """Two network namespaces ("machines") joined by a veth pair: node r has address 10.231.<k>.<r+1> on
    interface rgv<k><r>. Created and removed by the test; loopback is up in each (torchrun's local agent)."""

    def __init__(self):
        self.k = os.getpid() % 200 + 20
        tag = uuid.uuid4().hex[:6]
        self.ns = [f"rgt{tag}{r}" for r in range(2)]
        self.ifname = [f"rgv{tag}{r}" for r in range(2)]
        self.addr = [f"10.231.{self.k}.{r + 1}" for r in range(2)]

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def __enter__(self):
        try:
            self._ip("netns", "add", self.ns[0])
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"needs `ip netns add` (root or CAP_SYS_ADMIN) to make two machines: {exc}")
        try:
            self._ip("netns", "add", self.ns[1])
            self._ip("link", "add", self.ifname[0], "type", "veth", "peer", "name", self.ifname[1])
            for r in range(2):
                self._ip("link", "set", self.ifname[r], "netns", self.ns[r])
                self._ip("-n", self.ns[r], "addr", "add", f"{self.addr[r]}/24", "dev", self.ifname[r])
                self._ip("-n", self.ns[r], "link", "set", self.ifname[r], "up")
                self._ip("-n", self.ns[r], "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.ns:  # removing a namespace removes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def command(self, r: int, cmd: list[str], env: dict) -> list[str]:
        return ["ip", "netns", "exec", self.ns[r], "env", *[f"{k}={v}" for k, v in env.items()], *cmd]
