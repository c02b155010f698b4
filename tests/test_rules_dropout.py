"""VJP of Dropout (rules/dropout.py): the identity in inference mode, the forward's own mask reused in training
mode (both runtimes), central differences, a ratio and training flag given at run time, ratio 0 passing the
cotangent through, and one Dropout left after a second differentiation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit.harness import check_rule, with_loss

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo


def f32(v: float) -> float:
    return float(np.float32(v))


def _dropout_graph(x: np.ndarray, ratio: float | None, training, n_out: int = 1, seed: int = 7) -> Graph:
    inputs = ["x", "ratio" if ratio is not None else "", "training" if training is not None else ""]
    while inputs and not inputs[-1]:
        inputs.pop()
    init = {}
    if ratio is not None:
        init["ratio"] = np.array(ratio, np.float32)
    graph_inputs = [ValueInfo("x", x.dtype, x.shape)]
    if isinstance(training, str):  # a run-time input
        graph_inputs.append(ValueInfo("training", np.bool_, ()))
    elif training is not None:
        init["training"] = np.array(training)
    outs = ["y0", "mask"][:n_out]
    return Graph([Node("Dropout", inputs, outs, {"seed": seed}, "drop")], graph_inputs, [ValueInfo("y0")], init)


@pytest.mark.parametrize("ratio,training", [(None, None), (0.25, None), (0.25, False), (0.0, True)])
def test_dropout_inference_is_identity(ratio, training):
    x = np.random.default_rng(0).standard_normal((3, 4))
    g = _dropout_graph(x, ratio, training)
    grads = check_rule(g, {"x": x}, lambda x: x * 1.0)
    assert grads["x"].shape == x.shape


def _run_with_mask(gg: Graph, feeds: dict, backend: str):
    drops = [n for n in gg.nodes if n.op_type == "Dropout"]
    assert len(drops) == 1, "the mask must be reused, not drawn again"
    mask = drops[0].outputs[1]
    gg = gg.copy()
    gg.outputs.append(ValueInfo(mask, np.bool_, feeds["x"].shape))
    out = rg.Session(gg, backend=backend).run(feeds)
    return out, out[mask]


@pytest.mark.parametrize("n_out", [1, 2])
@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_dropout_training_reuses_the_forward_mask(n_out, backend):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 5))
    ratio = 0.25
    g = _dropout_graph(x, ratio, True, n_out=n_out)
    lg, _ = with_loss(g, {"y0": x})
    u = rng.standard_normal(x.shape)
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    out, mask = _run_with_mask(gg, {"x": x, "y0_u": u}, backend)
    assert 0 < mask.sum() < mask.size  # the seed drops some values and keeps others
    np.testing.assert_allclose(out["x_grad"], mask * u / (1 - f32(ratio)), rtol=1e-12)
    assert len(g.nodes[0].outputs) == n_out  # the caller's graph is left alone


def test_dropout_training_central_differences():
    # The reference evaluator draws the same mask for the same seed every run: central differences apply.
    rng = np.random.default_rng(2)
    x, u, v = rng.standard_normal((3, 6)), rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    g = _dropout_graph(x, 0.5, True)
    lg, _ = with_loss(g, {"y0": x})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    grad = rg.Session(gg, backend="reference").run({"x": x, "y0_u": u})["x_grad"]
    fwd = rg.Session(lg, backend="reference")
    h = 1e-6
    numeric = (fwd.run({"x": x + h * v, "y0_u": u})["loss"] - fwd.run({"x": x - h * v, "y0_u": u})["loss"]) / (2 * h)
    np.testing.assert_allclose(np.sum(grad * v), numeric, rtol=1e-6)
    tx = torch.tensor(x, requires_grad=True)  # PyTorch on the same mask
    mask = torch.tensor(grad != 0)
    (tx * mask / 0.5 * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-12)


@pytest.mark.parametrize("training", [True, False])
def test_dropout_runtime_training_mode_and_ratio(training):
    x = np.random.default_rng(3).standard_normal((4, 4))
    g = _dropout_graph(x, None, "training")
    g.nodes[0].inputs[1] = "ratio"
    g.inputs.append(ValueInfo("ratio", np.float64, ()))
    lg, _ = with_loss(g, {"y0": x})
    u = np.random.default_rng(4).standard_normal(x.shape)
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    out, mask = _run_with_mask(gg, {"x": x, "y0_u": u, "training": np.array(training), "ratio": np.array(0.75)},
                               "reference")
    assert mask.all() != training
    np.testing.assert_allclose(out["x_grad"], mask * u * (4.0 if training else 1.0), rtol=1e-12)


@pytest.mark.parametrize("training", [True, "training"])
def test_dropout_ratio_zero_passes_the_cotangent_through(training):
    # ratio 0 keeps every element at scale 1: the VJP is the cotangent itself, no pass reads the mask
    x, u = (np.random.default_rng(6).standard_normal((3, 5)) for _ in range(2))
    gg = rg.gradient(with_loss(_dropout_graph(x, 0.0, training, n_out=2), {"y0": x})[0], loss="loss", wrt=["x"])
    assert not any("mask" in n.inputs for n in gg.nodes)
    feeds = {"x": x, "y0_u": u, **({"training": np.array(True)} if training == "training" else {})}
    np.testing.assert_array_equal(rg.Session(gg, backend="reference").run(feeds)["x_grad"], u)


def test_dropout_second_pass_keeps_one_dropout():
    # Differentiating the gradient graph again (here with respect to the cotangent) reuses the same mask.
    x = np.random.default_rng(5).standard_normal((2, 3))
    g = _dropout_graph(x, 0.5, True)
    lg, _ = with_loss(g, {"y0": x})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    gg.outputs = [o for o in gg.outputs if o.name == "x_grad"]
    g2 = rg.gradient(gg, loss="x_grad", wrt=["y0_u"])
    assert sum(n.op_type == "Dropout" for n in g2.nodes) == 1
    out = rg.Session(g2, backend="reference").run({"x": x, "y0_u": np.ones_like(x)})
    mask = out["x_grad"] != 0
    np.testing.assert_allclose(out["y0_u_grad"], mask * 2.0, rtol=1e-12)


# -------------------------------------------------------------------------------------- unknown dimensions
