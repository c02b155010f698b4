"""Quantization-aware training (issue 41, item 8's ``train --straight-through``): a QDQ model trains with the
straight-through estimator as PyTorch's fake quantization does (round in the forward, identity inside the range
and 0 outside it in the backward), and without the option the pair is refused in one line, exit 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import revgraph as rg
from revgraph import train as T
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo

F32 = np.float32
SCALE = 0.05


def _qdq_model() -> Graph:
    """x [N, 4] -> MatMul W [4, 3] -> QuantizeLinear/DequantizeLinear (int8, scale 0.05) -> y [N, 3]."""
    rng = np.random.default_rng(2)
    inits = {"W": rng.normal(0, 1, (4, 3)).astype(F32), "s": np.array(SCALE, F32), "z": np.array(0, np.int8)}
    nodes = [Node("MatMul", ["x", "W"], ["a"], name="mm"), Node("QuantizeLinear", ["a", "s", "z"], ["q"], name="quant"),
             Node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dequant")]
    return Graph(nodes, [ValueInfo("x", F32, ("N", 4))], [ValueInfo("y", F32, ("N", 3))], inits)


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 2, (16, 4)).astype(F32)
    return x, rng.normal(0, 3, (16, 3)).astype(F32)


def _torch(steps: int):
    g = _qdq_model()
    W = torch.tensor(g.initializers["W"], requires_grad=True)
    opt = torch.optim.SGD([W], lr=0.05)
    x, y = _data()
    losses = []
    for k in range(steps):
        xb, yb = torch.tensor(x[k * 8 % 16:][:8]), torch.tensor(y[k * 8 % 16:][:8])
        a = xb @ W
        q = torch.fake_quantize_per_tensor_affine(a, SCALE, 0, -128, 127)  # STE: grad 1 inside the range, else 0
        loss = ((q - yb) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return W.detach().numpy(), losses


def test_straight_through_training_equals_torch_fake_quantization():
    x, y = _data()
    assert (np.abs(x @ _qdq_model().initializers["W"]) > 127 * SCALE).any()  # (some products saturate: the 0 side)
    trainer = rg.Trainer(_qdq_model(), "mse", T.sgd(lr=0.05), params=["W"], straight_through=True)
    trainer.fit({"x": x, "labels": y}, batch_size=8, shuffle=False, max_steps=6, progress=False)
    W, losses = _torch(6)
    np.testing.assert_allclose(trainer.losses, losses, rtol=1e-5)
    np.testing.assert_allclose(trainer.parameters["W"], W, rtol=1e-5, atol=1e-6)


def test_without_the_option_the_pair_is_refused():
    with pytest.raises(rg.RevgraphError, match="straight-through") as info:
        rg.Trainer(_qdq_model(), "mse", "sgd", params=["W"])
    assert "\n" not in str(info.value)


def test_cli_straight_through(tmp_path, capsys):
    rg.save(_qdq_model(), tmp_path / "q.onnx")
    x, y = _data()
    np.savez(tmp_path / "d.npz", x=x, labels=y)
    base = ["train", str(tmp_path / "q.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "mse", "--optimizer",
            "sgd", "--lr", "0.05", "--train", "W", "--max-steps", "6", "--batch-size", "8", "--no-shuffle",
            "-o", str(tmp_path / "t.onnx")]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "--straight-through" in err and len(err.strip().splitlines()) == 1
    assert main([*base, "--straight-through"]) == 0
    W, _ = _torch(6)
    np.testing.assert_allclose(rg.load(tmp_path / "t.onnx").initializers["W"], W, rtol=1e-5, atol=1e-6)
