"""VJP rules of Softmax and LogSoftmax, checked three ways by tests/kit/harness.py (central differences,
PyTorch autograd, second order); Hardmax, ArgMax and ArgMin carry no gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.harness import check_rule, one_node_graph

import revgraph as rg
from revgraph.autodiff.registry import NOT_DIFFERENTIABLE
from revgraph.ir import Graph, Node, ValueInfo

FAST = settings(max_examples=8, deadline=None)
TORCH = {"Softmax": torch.softmax, "LogSoftmax": torch.log_softmax}


@st.composite
def axis_case(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    return shape, draw(st.integers(-rank, rank - 1)), draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("op", sorted(TORCH))
@FAST
@given(case=axis_case())
def test_softmax_family(op, case):
    shape, axis, seed = case
    x = np.random.default_rng(seed).standard_normal(shape)
    g = one_node_graph(op, {"x": x}, {"axis": axis})
    check_rule(g, {"x": x}, lambda x: TORCH[op](x, axis), seed=seed)


@pytest.mark.parametrize("op", sorted(TORCH))
def test_softmax_family_default_axis_is_last(op):
    x = np.random.default_rng(1).standard_normal((2, 3, 4))
    check_rule(one_node_graph(op, {"x": x}), {"x": x}, lambda x: TORCH[op](x, -1))


@pytest.mark.parametrize("op", sorted(TORCH))
def test_softmax_family_large_logits(op):
    x = np.array([[1000.0, 999.0, 985.0], [0.5, 0.25, 0.0]])
    check_rule(one_node_graph(op, {"x": x}), {"x": x}, lambda x: TORCH[op](x, -1))


@pytest.mark.parametrize("op", sorted(TORCH))
def test_softmax_family_unknown_dimensions(op):
    x = np.random.default_rng(2).standard_normal((2, 3, 4))
    g = one_node_graph(op, {"x": x}, {"axis": 1})
    g.inputs = [ValueInfo("x", x.dtype, ("a", "b", "c"))]
    check_rule(g, {"x": x}, lambda x: TORCH[op](x, 1))


def test_not_differentiable_declarations():
    assert {"Hardmax", "ArgMax", "ArgMin"} <= set(NOT_DIFFERENTIABLE)


@pytest.mark.parametrize("op", ["Hardmax", "ArgMax", "ArgMin"])
def test_not_differentiable_ops_pass_no_gradient(op):
    """``loss = sum(x * f(x))`` with f treated as a constant: the gradient is exactly f(x)."""
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)  # no float64 Hardmax in onnxruntime
    nodes = [Node(op, ["x"], ["f"], {"axis": 1} if op == "Hardmax" else {"axis": 1, "keepdims": 1}, "f")]
    if op != "Hardmax":
        nodes.append(Node("CastLike", ["f", "x"], ["fc"], name="cast"))
    nodes += [
        Node("Mul", ["x", "f" if op == "Hardmax" else "fc"], ["p"], name="mul"),
        Node("ReduceSum", ["p"], ["loss"], {"keepdims": 0}, name="sum"),
    ]
    g = Graph(nodes=nodes, inputs=[ValueInfo("x", x.dtype, x.shape)], outputs=[ValueInfo("loss")])
    got = rg.Session(rg.gradient(g, loss="loss", wrt=["x"])).run({"x": x})["x_grad"]
    if op == "Hardmax":
        expected = (np.arange(4) == x.argmax(1)[:, None]).astype(np.float32)
    else:
        index = x.argmax(1) if op == "ArgMax" else x.argmin(1)
        expected = np.broadcast_to(index[:, None], x.shape).astype(np.float32)
    np.testing.assert_array_equal(got, expected)
