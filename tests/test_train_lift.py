"""Training a model whose weights are ``Constant`` nodes, as paddle2onnx writes them (the exporter sweep, issue 41
item 9): the trainer's refusal names ``lift_constants``, and ``revgraph train --lift-constants`` trains those
weights as torch's SGD does. The model is built by hand here, in paddle2onnx's form (``Constant`` weights,
``MatMul`` + ``Add``, ``Identity`` after each layer), so the test needs no paddle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit.harness import one_line_error  # (tests/ is on sys.path)
from onnx import TensorProto, helper, numpy_helper

import revgraph as rg
from revgraph.cli import main
from revgraph.errors import RevgraphError
from revgraph.train import sgd

F32 = np.float32


def _paddle_like(path, w1, b1, w2, b2) -> None:
    """``Identity(Tanh(x W1 + b1) W2 + b2)``, each weight a ``Constant`` node, written to ``path``."""
    consts = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(a, n))
              for n, a in (("linear_0.w_0", w1), ("linear_0.b_0", b1), ("linear_1.w_0", w2), ("linear_1.b_0", b2))]
    nodes = [*consts, helper.make_node("MatMul", ["x", "linear_0.w_0"], ["m0"]),
             helper.make_node("Add", ["m0", "linear_0.b_0"], ["a0"]),
             helper.make_node("Identity", ["a0"], ["i0"]),
             helper.make_node("Tanh", ["i0"], ["t0"]),
             helper.make_node("MatMul", ["t0", "linear_1.w_0"], ["m1"]),
             helper.make_node("Add", ["m1", "linear_1.b_0"], ["a1"]),
             helper.make_node("Identity", ["a1"], ["y"])]
    graph = helper.make_graph(nodes, "paddle-like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])])
    rg.save(rg.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])), path)


@pytest.fixture
def weights():
    rng = np.random.default_rng(0)
    return [(0.5 * rng.standard_normal(s)).astype(F32) for s in ((8, 16), (16,), (16, 3), (3,))]


def test_the_trainer_names_lift_constants_for_constant_weights(tmp_path, weights):
    _paddle_like(tmp_path / "m.onnx", *weights)
    g = rg.load(tmp_path / "m.onnx")
    with pytest.raises(RevgraphError, match=r"no floating-point initializers to train; its weights are Constant "
                       r"nodes \('linear_0.w_0', 'linear_0.b_0', 'linear_1.w_0', 'linear_1.b_0'\): make them "
                       r"initializers with revgraph.autodiff.lift.lift_constants \(revgraph train --lift-constants\)"):
        rg.Trainer(g, "mse", sgd(lr=0.1))


def test_train_lift_constants_matches_torch_sgd(tmp_path, weights, capsys):
    """One full-batch SGD step (mse) of ``revgraph train --lift-constants`` against the same step in torch."""
    _paddle_like(tmp_path / "m.onnx", *weights)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 8)).astype(F32), rng.standard_normal((16, 3)).astype(F32)
    np.savez(tmp_path / "d.npz", x=x, labels=y)
    argv = ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "mse", "--optimizer",
            "sgd", "--lr", "0.1", "--epochs", "1", "--batch-size", "16", "--no-shuffle", "-o", str(tmp_path / "o.onnx")]
    one_line_error(main(argv), capsys.readouterr().err, "its weights are Constant nodes", "--lift-constants")
    assert main([*argv, "--lift-constants"]) == 0
    ps = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in weights]
    pred = torch.tanh(torch.tensor(x, dtype=torch.float64) @ ps[0] + ps[1]) @ ps[2] + ps[3]
    torch.nn.functional.mse_loss(pred, torch.tensor(y, dtype=torch.float64)).backward()
    trained = rg.load(tmp_path / "o.onnx").initializers
    for name, p in zip(["linear_0.w_0", "linear_0.b_0", "linear_1.w_0", "linear_1.b_0"], ps, strict=True):
        want = (p - 0.1 * p.grad).detach().numpy()
        np.testing.assert_allclose(trained[name], want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(trained[name], p.detach().numpy())  # (the step moved it)
