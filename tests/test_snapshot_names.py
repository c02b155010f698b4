"""One word each: a training *snapshot* (``fit(snapshot_dir=, snapshot_every=)``, ``train --snapshot-dir
--snapshot-every``) and a loop *checkpoint* policy (``checkpoint=``, ``--checkpoint``). The snapshot's old names
(``checkpoint_dir``, ``--checkpoint-dir``, ...) stay accepted and do the same."""

from __future__ import annotations

import numpy as np
import pytest

import revgraph as rg
from revgraph.cli import main
from revgraph.errors import RevgraphError
from revgraph.ir import Graph, Node, ValueInfo

F32 = np.float32


def _model_and_data(n=40):
    rng = np.random.default_rng(0)
    g = Graph([Node("MatMul", ["x", "W"], ["y"], name="mm")], [ValueInfo("x", F32, ("N", 4))],
              [ValueInfo("y", F32, ("N", 3))], {"W": rng.normal(0, 0.5, (4, 3)).astype(F32)}, name="lin")
    return g, {"x": rng.normal(size=(n, 4)).astype(F32), "labels": rng.integers(0, 3, n)}


def test_fit_resumes_from_a_snapshot_under_either_name(tmp_path):
    g, data = _model_and_data()
    whole = rg.Trainer(g)
    whole.fit(data, epochs=2, batch_size=8, progress=False)
    for old, new in [("checkpoint_dir", "snapshot_dir"), ("snapshot_dir", "checkpoint_dir")]:
        where = tmp_path / old
        rg.Trainer(g).fit(data, epochs=1, batch_size=8, progress=False, **{old: where})
        again = rg.Trainer(g)
        again.fit(data, epochs=2, batch_size=8, progress=False, **{new: where})
        assert again.steps == whole.steps == 10 and again.resumed
        np.testing.assert_allclose(again.parameters["W"], whole.parameters["W"], rtol=1e-6)


def test_snapshot_every_saves_as_checkpoint_every_did(tmp_path):
    g, data = _model_and_data()
    a, b = rg.Trainer(g), rg.Trainer(g)
    a.fit(data, epochs=1, batch_size=8, progress=False, snapshot_dir=tmp_path / "a", snapshot_every=2)
    b.fit(data, epochs=1, batch_size=8, progress=False, checkpoint_dir=tmp_path / "b", checkpoint_every=2)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in (tmp_path / "b").iterdir())
    with pytest.raises(RevgraphError, match="not both"):
        rg.Trainer(g).fit(data, progress=False, snapshot_dir=tmp_path / "c", checkpoint_dir=tmp_path / "d")


def test_the_cli_takes_both_spellings(tmp_path):
    g, data = _model_and_data()
    rg.save(g, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **data)
    outs = {}
    for flag in ("--snapshot-dir", "--checkpoint-dir"):
        snap = tmp_path / flag.strip("-")
        args = ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs", "1",
                "--batch-size", "8", "--loss", "cross-entropy", "-o", str(tmp_path / f"{flag.strip('-')}.onnx"),
                flag, str(snap)]
        assert main(args) == 0
        assert (snap / "checkpoint.npz").exists()
        outs[flag] = rg.load(tmp_path / f"{flag.strip('-')}.onnx").initializers["W"]
    np.testing.assert_array_equal(outs["--snapshot-dir"], outs["--checkpoint-dir"])
