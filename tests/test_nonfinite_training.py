"""Training that goes wrong (issue 12 section 7): a NaN or infinite loss stops training at that step, names
it, and keeps the parameters from before it; accuracy is never computed from NaN outputs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import revgraph as rg
from revgraph.errors import NonFiniteError
from revgraph.tools import demo


def _data(n=64, seed=0):
    train, _ = demo.digits()
    return {"x": train["x"][:n].copy(), "labels": train["labels"][:n].copy()}


def test_nan_in_the_third_batch_stops_there_and_keeps_the_earlier_parameters():
    data = _data()
    data["x"][40] = np.nan  # sample 40 is in batch 3 (no shuffling, batches of 16)
    tr = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", "sgd")
    with pytest.raises(NonFiniteError, match=r"the loss is nan at step 3 \(epoch 1, batch 3\); the trainer keeps"):
        tr.fit(data, 2, 16, shuffle=False, progress=False)
    assert tr.steps == 2 and len(tr.losses) == 2 and np.isfinite(tr.losses).all()
    ref = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", "sgd")
    for start in (0, 16):  # the same two steps by hand, on the clean batches
        ref.step({"x": data["x"][start:start + 16], "labels": data["labels"][start:start + 16]})
    for name, value in ref.parameters.items():
        np.testing.assert_array_equal(tr.parameters[name], value, err_msg=name)


def test_a_last_update_that_overflows_is_caught_at_the_end():
    """lr 1e38 on inputs of size 1e6: the first loss is finite, the update overflows float32; with one step in
    all, only the check of the parameters after fit can catch it."""
    tr = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", rg.train.sgd(lr=1e38))
    before = tr.parameters
    data = _data(16)
    data["x"] *= 1e6
    with pytest.raises(NonFiniteError, match=r"parameter '\w+' became NaN or infinite at step 1"):
        tr.fit(data, 1, 16, shuffle=False, progress=False)
    assert tr.steps == 0
    for name, value in before.items():
        np.testing.assert_array_equal(tr.parameters[name], value)


def test_continue_trains_on_and_reports_no_accuracy_from_nan_outputs():
    data = _data()
    data["x"][0] = np.nan
    tr = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", "adam")
    tr.fit(data, 1, 16, shuffle=False, progress=False, nonfinite="continue")
    ev = tr.evaluate(data)
    assert ev["accuracy"] is None and ev["nonfinite"] > 0 and np.isnan(ev["loss"])
    clean = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", "adam").evaluate(_data())
    assert clean["nonfinite"] == 0 and 0 <= clean["accuracy"] <= 1


@pytest.mark.parametrize("nan_data,lr,message", [
    (True, "0.01", "the loss is nan at step 1 (epoch 1, batch 1)"),
    (False, "1e38", "became NaN or infinite at step"),
])
def test_cli_stops_with_one_line_and_writes_nothing(tmp_path, nan_data, lr, message):
    data = _data(32)
    if nan_data:
        data["x"][:] = np.nan
    else:
        data["x"] *= 1e6
    np.savez(tmp_path / "d.npz", **data)
    rg.save(demo.mlp_model(hidden=8), tmp_path / "m.onnx")
    cmd = [sys.executable, "-m", "revgraph", "train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"),
           "--loss", "cross-entropy", "--optimizer", "sgd", "--lr", lr, "--epochs", "1", "-o", str(tmp_path / "o.onnx")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o.onnx").exists()
    r = subprocess.run([*cmd, "--allow-nonfinite", "--eval-data", str(tmp_path / "d.npz")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "accuracy 100" not in r.stdout and "outputs are NaN or infinite" in r.stdout, r.stdout


def test_a_learning_rate_beyond_the_dtype_is_refused_before_training():
    """--lr 1e308 is infinite in float32: refused when the training graph is built, naming the dtype."""
    with pytest.raises(rg.RevgraphError, match=r"the learning rate 1e[+]308 does not fit in float32, the dtype of "
                                                "parameter 'W1'"):
        rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", rg.train.sgd(lr=1e308))
