"""examples/web trains the demo MLP in headless Chromium with onnxruntime-web (WASM): its losses equal Python
onnxruntime's on the same training-step graph and feeds.

The example is copied to a temporary directory, ``npm ci`` installs the pinned onnxruntime-web there (or an
existing ``examples/web/node_modules`` is linked), ``prepare.py`` writes the graph (``revgraph train
--save-training-graph``), the initial state and the batches, Python's ``http.server`` serves the page on
127.0.0.1 in a thread, and Chromium (Debian's ``chromium``) loads it headless. The test reads ``window.losses``
over the DevTools protocol on a pipe (``--remote-debugging-pipe``: null-terminated JSON messages on file
descriptors 3 and 4, so no websocket client is needed) once ``window.trainingDone`` is true.

Tolerance rtol 1e-5: both runs execute the same float32 graph from the same feeds, but onnxruntime's native CPU
kernels (MLAS, AVX) and its WASM build (128-bit SIMD) sum the matrix products and reductions in different
orders, so each step's values differ by a few float32 ulps (~1e-7 relative) and the differences carry through
the parameters over 40 Adam steps; a wrong feed, a state not carried back or a step skipped changes the losses
by 1e-3 or more.
"""

from __future__ import annotations

import fcntl
import functools
import http.server
import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "examples" / "web"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--remote-debugging-pipe"]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request on stderr
        pass


class DevTools:
    """The DevTools protocol over ``--remote-debugging-pipe``: commands to Chromium's fd 3, replies and events
    from its fd 4, each a JSON object followed by a NUL byte (a reader thread collects them)."""

    def __init__(self, chromium: str, url: str, profile: Path):
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()
        # the child's ends at fds >= 10 (a pipe end at 3 or 4 would be closed or overwritten by the redirections
        # below); bash puts them at fds 3 and 4, where Chromium expects them (dash takes one-digit fds only)
        to_child, from_child = (self._high(fd) for fd in (to_child, from_child))
        script = f'exec "$0" "$@" 3<&{to_child} 4>&{from_child} {to_child}<&- {from_child}>&-'
        self.proc = subprocess.Popen(["bash", "-c", script, chromium, *FLAGS, f"--user-data-dir={profile}", url],
                                     pass_fds=(to_child, from_child), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._messages: queue.Queue = queue.Queue()
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def _high(fd: int) -> int:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(fd)
        return high

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._in, 1 << 16):
            buf += chunk
            *done, buf = buf.split(b"\0")
            for msg in done:
                self._messages.put(json.loads(msg))
        self._messages.put(None)  # Chromium closed the pipe

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30):
        """Send one command; return its ``result`` (raise on an error reply or when Chromium exits)."""
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._messages.get(timeout=max(0.1, deadline - time.monotonic()))
            if reply is None:
                raise RuntimeError(f"chromium exited (code {self.proc.poll()}) during {method}")
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, session: str, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        return result["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, OSError, queue.Empty):  # already gone or not answering: killed below
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._out)


def _tools() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    npm = shutil.which("npm")
    if chromium is None:
        pytest.skip("needs Debian's chromium for headless Chromium (apt-get install -y chromium)")
    if npm is None and not (WEB / "node_modules" / "onnxruntime-web").is_dir():
        pytest.skip("needs npm (to run npm ci for onnxruntime-web) or an installed examples/web/node_modules")
    return chromium, npm


def _copy_example(dest: Path, npm: str | None) -> None:
    """examples/web without its generated files, with onnxruntime-web: the existing install or ``npm ci``."""
    for name in ("index.html", "train.js", "prepare.py", "package.json", "package-lock.json"):
        shutil.copy(WEB / name, dest / name)
    existing = WEB / "node_modules" / "onnxruntime-web"
    if existing.is_dir():
        (dest / "node_modules").symlink_to(WEB / "node_modules", target_is_directory=True)
    else:
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=dest, check=True, timeout=600,
                       stdout=subprocess.DEVNULL)


def _prepare_module(path: Path):
    spec = importlib.util.spec_from_file_location("web_prepare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: prepare.py's options: the plain graph, and a cosine schedule with warmup and clipping (one more input,
#: the int64 scalar total_steps, fed --steps; tests/test_finetune_combinations.py holds its losses to PyTorch's)
SCHEDULED = ["--lr", "0.01", "--lr-schedule", "cosine", "--warmup-steps", "5", "--min-lr", "0.0001",
             "--clip-grad-norm", "1.0"]


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], SCHEDULED], ids=["constant", "cosine"])
def test_browser_losses_equal_python_onnxruntime(tmp_path, options):
    chromium, npm = _tools()
    site = tmp_path / "web"
    site.mkdir()
    _copy_example(site, npm)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(site / "prepare.py"), "--steps", "40", *options], cwd=site, env=env, check=True,
                   timeout=600, stdout=subprocess.DEVNULL)
    want = _prepare_module(site / "prepare.py").python_losses(site / "data")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tools = DevTools(chromium, f"http://127.0.0.1:{server.server_address[1]}/index.html", tmp_path / "profile")
    try:
        deadline = time.monotonic() + 30
        while not (pages := [t for t in tools.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]):
            assert time.monotonic() < deadline, "chromium opened no page in 30 s"
            time.sleep(0.2)
        page = pages[0]
        session = tools.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        deadline = time.monotonic() + 240
        while not tools.evaluate(session, "window.trainingDone === true"):
            assert time.monotonic() < deadline, "the page did not finish training in 240 s"
            time.sleep(0.5)
        result = tools.evaluate(session, "JSON.stringify({losses: window.losses, error: window.trainingError, "
                                         "shown: document.getElementById('losses').textContent})")
    finally:
        tools.close()
        server.shutdown()
        server.server_close()
    got = json.loads(result)
    assert got["error"] is None, got["error"]
    assert len(got["losses"]) == len(want) == 40
    np.testing.assert_allclose(got["losses"], want, rtol=1e-5)
    # it trains: Adam at lr 0.003 (0.01 peak, scheduled) over 40 steps
    assert got["losses"][-1] < 0.8 * got["losses"][0]
    assert f"step  40  loss {got['losses'][-1]:.6f}" in got["shown"]  # the page shows them
