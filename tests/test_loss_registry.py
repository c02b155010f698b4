"""A loss is one registry entry carrying its behaviour (issue 29): ``LOSSES[name] = LossKind(labels, options, help,
build, ...)``, after which :func:`loss_graph`, the CLI's ``--loss`` and training know it. The entry written here
(mean absolute error) trains like ``torch.nn.functional.l1_loss``."""

from __future__ import annotations

import numpy as np
import torch

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.train import losses
from revgraph.train.losses import LOSSES, LossKind, loss_graph

F64 = np.float64


def _l1(x: losses.Build):
    """``mean(|output - labels|)``."""
    labels = x.b.fresh("labels")
    x.g.inputs.append(ValueInfo(labels, x.vi.dtype, x.vi.shape))
    return x.b.op("ReduceMean", [x.b.op("Abs", [x.b.op("Sub", [x.out, labels])])], keepdims=0), labels, None


def _model():
    rng = np.random.default_rng(0)
    W = rng.normal(size=(4, 2))
    g = Graph([Node("MatMul", ["x", "W"], ["y"], name="mm")], [ValueInfo("x", F64, (5, 4))],
              [ValueInfo("y", F64, (5, 2))], {"W": W}, name="lin")
    return g, W, rng.normal(size=(5, 4)), rng.normal(size=(5, 2))


def test_a_registered_loss_builds_and_differentiates_like_torch(monkeypatch):
    monkeypatch.setitem(LOSSES, "l1", LossKind("required", (), "mean absolute error", _l1))
    g, W, x, t = _model()
    lg, spec = loss_graph(g, "l1")
    assert spec.kind == "l1" and spec.labels is not None and spec.settings == {"kind": "l1", "output": "y"}
    gg = rg.gradient(lg, spec.loss, ["W"])
    got = rg.Session(gg).run({"x": x, spec.labels: t})
    Wt = torch.tensor(W, requires_grad=True)
    want = torch.nn.functional.l1_loss(torch.tensor(x) @ Wt, torch.tensor(t))
    want.backward()
    np.testing.assert_allclose(got[spec.loss], want.item(), rtol=1e-12)
    np.testing.assert_allclose(got["W_grad"], Wt.grad.numpy(), rtol=1e-12)


def test_the_cli_takes_a_registered_loss(monkeypatch, tmp_path):
    from revgraph.cli import main

    monkeypatch.setitem(LOSSES, "l1", LossKind("required", (), "mean absolute error", _l1))
    g, _, x, t = _model()
    g.inputs[0] = ValueInfo("x", F64, ("N", 4))
    g.outputs[0] = ValueInfo("y", F64, ("N", 2))
    rg.save(g, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=x, labels=t)
    assert main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "l1",
                 "--epochs", "3", "--batch-size", "5", "--lr", "0.1", "-o", str(tmp_path / "t.onnx")]) == 0
    trained = rg.load(tmp_path / "t.onnx").initializers["W"]
    before = np.abs(x @ g.initializers["W"] - t).mean()
    assert np.abs(x @ trained - t).mean() < before
