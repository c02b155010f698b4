"""The path of one batch from ``revgraph train --data DIR`` to onnxruntime is short (issue 45, item 3): at most half
the call frames it took before (11 from ``cmd_train``, 12 with onnxruntime's run: ``_train``, the
``validate.arguments`` wrapper of ``fit``, ``fit`` -> ``_fit``, ``_one_step`` -> ``Trainer._step``, ``Engine.step``
-> ``_gradients`` -> ``_run_grad``). Counted by a stand-in for onnxruntime's ``run_with_iobinding`` that walks its
callers up to ``cmd_train``."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
import pytest
from kit.training import mlp

import revgraph as rg
from revgraph.cli import main
from revgraph.cli.train import cmd_train

#: the most frames from cmd_train to the session's run: half of the 11 before issue 45, rounded down
MOST = 5


def _callers_up_to(code) -> list[str] | None:
    """The functions between the caller of this function's caller (the run's stand-in) and the frame running
    ``code``, innermost first; ``None`` when ``code`` is not on the stack."""
    names, frame = [], sys._getframe(2)
    while frame is not None:
        names.append(frame.f_code.co_name)
        if frame.f_code is code:
            return names
        frame = frame.f_back
    return None


@pytest.mark.parametrize("buffers", ["one", "two"])
def test_a_batch_reaches_the_session_in_at_most_half_the_frames(tmp_path, monkeypatch, buffers):
    rng = np.random.default_rng(0)
    rg.save(mlp(rng), tmp_path / "m.onnx")
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "x.npy", rng.normal(0, 1, (16, 6)).astype(np.float32))
    np.save(tmp_path / "data" / "labels.npy", rng.integers(0, 3, 16))
    paths, run = [], ort.InferenceSession.run_with_iobinding

    def counting(self, *args, **kwargs):
        paths.append(_callers_up_to(cmd_train.__code__))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", counting)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "data"), "--loss-fn", "cross-entropy",
                 "--epochs", "1", "--batch-size", "8", "--buffers", buffers, "-q",
                 "-o", str(tmp_path / "out.onnx")]) == 0
    # the runs of the 2 steps: buffers one, the grad graph then the update graph; two, the fused step graph
    steps = [p for p in paths if p is not None and "step" in p]
    assert len(steps) == (4 if buffers == "one" else 2), paths
    # every run of a step (the grad graph's and the update graph's too) counted, the longest path asserted
    longest = max(steps, key=len)
    assert all(p[-1] == "cmd_train" for p in steps) and len(longest) <= MOST, paths
    # fit's argument rules are checked inside it, not by a wrapper around it (validate.checked_inside)
    assert "fit" in longest and "checked" not in longest, longest
