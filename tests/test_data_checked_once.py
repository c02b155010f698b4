"""A run checks its data once (issue 45, item 3): `revgraph train --data DIR --test-data --eval-data` reads and
scans each data set's labels once, however often fit and evaluate are handed the data afterwards."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import revgraph as rg
from revgraph.cli import main
from revgraph.errors import InputError
from revgraph.tools import demo
from revgraph.train import data as datasets


def _counting(monkeypatch) -> collections.Counter:
    """Count the calls of the data module's reading and label-scanning functions."""
    counts: collections.Counter = collections.Counter()
    for name in ("read_dir", "_check_targets"):
        original = getattr(datasets, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(datasets, name, counted)
    return counts


@pytest.fixture
def files(tmp_path):
    train, test = demo.digits()
    (tmp_path / "digits").mkdir()
    for k, v in train.items():
        np.save(tmp_path / "digits" / f"{k}.npy", v[:96])
    np.savez(tmp_path / "test.npz", **{k: v[:32] for k, v in test.items()})
    np.savez(tmp_path / "eval.npz", **{k: v[32:64] for k, v in test.items()})
    rg.save(demo.mlp_model(hidden=8), tmp_path / "mlp.onnx")
    return tmp_path


def test_each_data_set_is_read_and_scanned_once_per_run(files, monkeypatch, capsys):
    counts = _counting(monkeypatch)
    rc = main(["train", str(files / "mlp.onnx"), "--data", str(files / "digits"), "--test-data",
               str(files / "test.npz"), "--eval-data", str(files / "eval.npz"), "--eval-every", "1",
               "--loss", "cross-entropy", "--epochs", "2", "--batch-size", "32", "-o", str(files / "out.onnx")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "test data: loss" in out
    # 6 steps, each followed by an evaluation of --eval-data, then the test data: still one scan per data set
    assert counts == {"read_dir": 1, "_check_targets": 3}, counts


def test_a_checked_dataset_is_not_checked_again_but_other_static_inputs_are(files, monkeypatch):
    tr = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", "adam")
    counts = _counting(monkeypatch)
    ds = tr.arrays(str(files / "digits"))
    assert tr.arrays(ds) is ds and counts["_check_targets"] == 1
    tr.fit(ds, epochs=1, batch_size=32, progress=False)
    tr.evaluate(ds, 32)
    assert counts == {"read_dir": 1, "_check_targets": 1}, counts
    # a Dataset with static inputs other than those it was checked with is checked again (and refused here:
    # the model has no such input)
    with pytest.raises(InputError, match="--static nope: the model has no input 'nope'"):
        tr.arrays(ds, {"nope": np.zeros(3, np.float32)})
