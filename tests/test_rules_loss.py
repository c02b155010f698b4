"""VJP rules of SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss, checked three ways by tests/kit/harness.py
(central differences, PyTorch autograd of torch.nn.functional.cross_entropy / nll_loss with the same options,
second order). The gradient of the class weights (which PyTorch does not differentiate) is checked against
the loss written out with torch ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.harness import check_rule, one_node_graph

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

FAST = settings(max_examples=8, deadline=None)
OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def torch_loss(op, x, y, w=None, reduction="mean", ignore_index=None):
    kw = {"weight": w, "reduction": reduction, "ignore_index": -100 if ignore_index is None else ignore_index}
    fn = F.cross_entropy if op == "SoftmaxCrossEntropyLoss" else F.nll_loss
    return fn(x, torch.as_tensor(y, dtype=torch.int64), **kw)


def written_out(op, x, y, w=None, reduction="mean", ignore_index=None):
    """The loss from its definition (ONNX operator spec), differentiable in the weights too."""
    logp = torch.log_softmax(x, 1) if op == "SoftmaxCrossEntropyLoss" else x
    y = torch.as_tensor(y, dtype=torch.int64)
    valid = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y))
    weight = (w[safe] if w is not None else torch.ones_like(safe, dtype=x.dtype)) * valid
    loss = -weight * logp.gather(1, safe.unsqueeze(1)).squeeze(1)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / weight.sum()


@st.composite
def loss_case(draw):
    rank = draw(st.integers(2, 4))
    n, c = draw(st.integers(1, 3)), draw(st.integers(2, 5))
    extra = tuple(draw(st.lists(st.integers(1, 3), min_size=rank - 2, max_size=rank - 2)))
    ignore = draw(st.sampled_from([None, 0, 1, -100]))
    return ((n, c, *extra), draw(st.sampled_from(["none", "sum", "mean"])), ignore, draw(st.booleans()),
            draw(st.integers(0, 2**31 - 1)))


def _case(shape, ignore, weighted, seed):
    rng = np.random.default_rng(seed)
    n, c, extra = shape[0], shape[1], shape[2:]
    x = rng.standard_normal(shape)
    y = rng.integers(0, c, (n, *extra)).astype(np.int64)
    if ignore is not None:
        y.flat[0] = ignore  # one ignored element (at least one other stays counted when there are two)
        if y.size > 1:
            y.flat[-1] = (ignore + 1) % c if 0 <= ignore < c else 0
    inputs = {"x": x, "y": y}
    if weighted:
        inputs["w"] = rng.uniform(0.5, 2.0, c)
    return inputs


@pytest.mark.parametrize("op", OPS)
@FAST
@given(case=loss_case())
def test_losses_against_torch(op, case):
    shape, reduction, ignore, weighted, seed = case
    inputs = _case(shape, ignore, weighted, seed)
    if reduction == "mean" and ignore is not None and inputs["y"].size == 1:
        inputs["y"].flat[0] = 0 if ignore != 0 else 1  # the mean over no element is 0/0
    attrs = {"reduction": reduction} | ({} if ignore is None else {"ignore_index": ignore})
    y = inputs["y"]
    # the weights are an initializer here: PyTorch does not differentiate them
    g = one_node_graph(op, inputs, attrs, float_inputs=["x"])
    w = None if "w" not in inputs else torch.tensor(inputs["w"])
    check_rule(g, {"x": inputs["x"]}, lambda x: torch_loss(op, x, y, w, reduction, ignore), seed=seed)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_weight_gradient(op, reduction):
    inputs = _case((3, 4, 2), 1, True, 7)
    y = inputs["y"]
    attrs = {"reduction": reduction, "ignore_index": 1}
    g = one_node_graph(op, inputs, attrs)
    check_rule(g, {"x": inputs["x"], "w": inputs["w"]}, lambda x, w: written_out(op, x, y, w, reduction, 1))


@pytest.mark.parametrize("op", OPS)
def test_default_reduction_is_mean_and_no_ignore_index(op):
    inputs = _case((4, 3), None, False, 3)
    y = inputs["y"]
    check_rule(one_node_graph(op, inputs), {"x": inputs["x"]}, lambda x: torch_loss(op, x, y))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_log_prob_output(reduction):
    """Both outputs carry cotangents: the loss and log_prob = LogSoftmax(scores, axis=1)."""
    inputs = _case((2, 5, 3), 2, True, 11)
    y = inputs["y"]
    g = one_node_graph("SoftmaxCrossEntropyLoss", inputs, {"reduction": reduction, "ignore_index": 2}, n_out=2)

    def fn(x, w):
        return written_out("SoftmaxCrossEntropyLoss", x, y, w, reduction, 2), torch.log_softmax(x, 1)

    check_rule(g, {"x": inputs["x"], "w": inputs["w"]}, fn)


def test_log_prob_output_alone():
    """Only log_prob reaches the loss: the rule pulls its cotangent back through LogSoftmax."""
    inputs = _case((3, 4), None, False, 5)
    g = one_node_graph("SoftmaxCrossEntropyLoss", inputs, n_out=2)
    check_rule(g, {"x": inputs["x"]}, lambda x: torch.log_softmax(x, 1), outputs=["y1"])


@pytest.mark.parametrize("op", OPS)
def test_labels_as_input_int32_unknown_dims(op):
    """Labels fed at run time as int32, scores with symbolic dimensions: no static value is needed."""
    inputs = _case((2, 3, 4), 0, True, 13)
    inputs["y"] = inputs["y"].astype(np.int32)
    y = inputs["y"]
    g = one_node_graph(op, inputs, {"reduction": "mean", "ignore_index": 0}, float_inputs=["x", "y", "w"])
    g.inputs = [ValueInfo("x", np.float64, ("n", "c", "d")), ValueInfo("y", np.int32, ("n", "d")),
                ValueInfo("w", np.float64, ("c",))]
    check_rule(g, {"x": inputs["x"], "y": y, "w": inputs["w"]}, lambda x, y, w: written_out(op, x, y, w, "mean", 0),
               wrt=["x", "w"])


@pytest.mark.parametrize("op", OPS)
def test_labels_get_no_gradient_and_float32(op):
    """float32 end to end through rg.gradient; the gradient matches PyTorch's float32 result."""
    inputs = _case((3, 4, 2), None, False, 17)
    x = inputs["x"].astype(np.float32)
    y = inputs["y"]
    nodes = [Node(op, ["x", "y"], ["loss"], {"reduction": "sum"}, "op")]
    g = Graph(nodes, [ValueInfo("x", np.float32, x.shape)], [ValueInfo("loss", np.float32, ())], {"y": y})
    gg = rg.gradient(g, loss="loss", wrt=["x"])
    got = rg.Session(gg).run({"x": x})["x_grad"]
    tx = torch.tensor(x, requires_grad=True)
    torch_loss(op, tx, y, reduction="sum").backward()
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-5, atol=1e-6)
