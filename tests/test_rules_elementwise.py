"""Elementwise VJP rules, three ways (central differences, PyTorch, second order) on random broadcast shapes,
and the conventions of DESIGN.md section 5: ties, 0 subgradients, strong zeros."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from kit.harness import check_rule, one_node_graph

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F = torch.nn.functional
SETTINGS = settings(max_examples=6, deadline=None)

BINARY = {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Div": torch.div,
    "Pow": torch.pow,
}

UNARY = {  # op -> (torch function, attributes, domain of x: "any" or "pos")
    "Neg": (torch.neg, {}, "any"),
    "Identity": (lambda x: x * 1, {}, "any"),
    "Sqrt": (torch.sqrt, {}, "pos"),
    "Reciprocal": (torch.reciprocal, {}, "pos"),
    "Exp": (torch.exp, {}, "any"),
    "Log": (torch.log, {}, "pos"),
    "Abs": (torch.abs, {}, "any"),
    "Tanh": (torch.tanh, {}, "any"),
    "Sigmoid": (torch.sigmoid, {}, "any"),
    "Relu": (torch.relu, {}, "any"),
    "LeakyRelu": (lambda x: F.leaky_relu(x, 0.2), {"alpha": 0.2}, "any"),
    "Elu": (lambda x: F.elu(x, 0.7), {"alpha": 0.7}, "any"),
    "Softplus": (F.softplus, {}, "any"),
    "Erf": (torch.erf, {}, "any"),
    "Sin": (torch.sin, {}, "any"),
    "Cos": (torch.cos, {}, "any"),
}


def _arrays(seed: int, shapes, positive=False):
    rng = np.random.default_rng(seed)
    out = [np.asarray(rng.standard_normal(s)) for s in shapes]
    return [np.abs(a) + 0.5 for a in out] if positive else out


@pytest.mark.parametrize("op", list(BINARY))
@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3), seed=st.integers(0, 2**16))
def test_binary_broadcasting(op, shapes, seed):
    a, b = _arrays(seed, shapes.input_shapes, positive=op in ("Pow", "Div"))
    g = one_node_graph(op, {"a": a, "b": b})
    check_rule(g, {"a": a, "b": b}, lambda a, b: BINARY[op](a, b))


@pytest.mark.parametrize("op", list(UNARY))
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), max_size=3), seed=st.integers(0, 2**16))
def test_unary(op, shape, seed):
    fn, attrs, domain = UNARY[op]
    (x,) = _arrays(seed, [tuple(shape)], positive=domain == "pos")
    if op in ("Relu", "Abs", "LeakyRelu", "Elu"):
        x = np.where(np.abs(x) < 1e-3, 0.5, x)  # keep central differences off the kink
    g = one_node_graph(op, {"x": x}, attrs)
    check_rule(g, {"x": x}, lambda x: fn(x), fd_with_torch=op == "Erf", second_order=op != "Erf")


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3), seed=st.integers(0, 2**16))
def test_variadic(op, shapes, seed):
    if op == "Mean":  # onnx.reference's Mean adds in place into its first input: give that one the full shape
        shapes = shapes._replace(input_shapes=(shapes.result_shape, *shapes.input_shapes[1:]))
    a, b, c = _arrays(seed, shapes.input_shapes)
    fns = {
        "Sum": lambda a, b, c: a + b + c,
        "Mean": lambda a, b, c: (a + b + c) / 3,
        "Max": lambda a, b, c: torch.maximum(torch.maximum(a, b), c),
        "Min": lambda a, b, c: torch.minimum(torch.minimum(a, b), c),
    }
    g = one_node_graph(op, {"a": a, "b": b, "c": c})
    check_rule(g, {"a": a, "b": b, "c": c}, fns[op])


@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3), seed=st.integers(0, 2**16))
def test_where(shapes, seed):
    rng = np.random.default_rng(seed)
    c = rng.random(shapes.input_shapes[0]) < 0.5
    a, b = _arrays(seed + 1, shapes.input_shapes[1:])
    g = one_node_graph("Where", {"c": c, "a": a, "b": b})
    check_rule(g, {"a": a, "b": b}, lambda a, b: torch.where(torch.tensor(c), a, b))


@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_clip_with_bounds(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2
    lo, hi = np.array(-0.7), np.array(0.9)
    x = np.where(np.abs(np.abs(x) - 0.8) < 0.15, 0.0, x)  # off the clip points
    g = one_node_graph("Clip", {"x": x, "lo": lo, "hi": hi})
    check_rule(g, {"x": x, "lo": lo, "hi": hi}, lambda x, lo, hi: torch.clamp(x, lo, hi))


def test_clip_without_max():
    x = np.array([-2.0, -0.5, 0.3, 4.0])
    g = Graph([Node("Clip", ["x", "lo"], ["y0"], name="op")], [ValueInfo("x", x.dtype, x.shape)],
              [ValueInfo("y0")], {"lo": np.array(0.0)})
    grads = check_rule(g, {"x": x}, lambda x: torch.clamp(x, min=0.0))
    assert grads["x"].shape == (4,)


def test_clip_with_constant_bounds_at_its_kinks():
    # ReLU6 as Clip(x, 0, 6) (constant bounds): ONNX's Min(Max(x, 0), 6) with ties split equally gives x half of
    # the cotangent at either bound (PyTorch's clamp gives all of it; its maximum/minimum split as revgraph)
    x = np.array([-1.0, 0.0, 3.0, 6.0, 7.0])
    g = Graph([Node("Clip", ["x", "lo", "hi"], ["y"], name="op"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "s")],
              [ValueInfo("x", x.dtype, x.shape)], [ValueInfo("loss")], {"lo": np.array(0.0), "hi": np.array(6.0)})
    got = _grad(g, {"x": x}, ["x"])["x"]
    np.testing.assert_array_equal(got, [0.0, 0.5, 1.0, 0.5, 0.0])
    xt = torch.tensor(x, requires_grad=True)
    lo, hi = torch.tensor(0.0, dtype=torch.float64), torch.tensor(6.0, dtype=torch.float64)
    torch.minimum(torch.maximum(xt, lo), hi).sum().backward()
    np.testing.assert_array_equal(got, xt.grad.numpy())


def test_max_sends_exact_zeros_to_the_smaller_operand():
    # sqrt(Max(x, 0)): sqrt' is inf at 0; where x < 0 the Max VJP must send 0, not inf x 0 (PyTorch: masked_fill)
    g = Graph([Node("Max", ["x", "zero"], ["m"], name="max"), Node("Sqrt", ["m"], ["s"], name="sqrt"),
               Node("ReduceSum", ["s"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float64, (2,))], [ValueInfo("loss")], {"zero": np.array(0.0)})
    with np.errstate(divide="ignore"):
        got = _grad(g, {"x": np.array([-1.0, 4.0])}, ["x"])["x"]
    xt = torch.tensor([-1.0, 4.0], dtype=torch.float64, requires_grad=True)
    torch.sqrt(torch.maximum(xt, torch.tensor(0.0, dtype=torch.float64))).sum().backward()
    np.testing.assert_array_equal(got, xt.grad.numpy())  # [0, 1/4]


def test_cast_float_to_float():
    # float64 -> float32 -> float64: central differences drown in float32 rounding, so compare with PyTorch,
    # whose cast backward also rounds the cotangent through float32.
    rng = np.random.default_rng(1)
    x, u = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    g = Graph([Node("Cast", ["x"], ["x32"], {"to": 1}, "down"), Node("Cast", ["x32"], ["y"], {"to": 11}, "up"),
               Node("Mul", ["y", "u"], ["uy"], name="mul"),
               Node("ReduceSum", ["uy"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float64, (2, 3))], [ValueInfo("loss", np.float64, ())], {"u": u})
    ours = _grad(g, {"x": x}, ["x"])["x"]
    tx = torch.tensor(x, requires_grad=True)
    (tx.float().double() * torch.tensor(u)).sum().backward()
    np.testing.assert_array_equal(ours, tx.grad.numpy())
    assert not np.array_equal(ours, u)  # the rounding really happened


# -------------------------------------------------------------------------------------- conventions


def _grad(g: Graph, feeds: dict, wrt: list[str]) -> dict[str, np.ndarray]:
    gg = rg.gradient(g, wrt=wrt)
    out = rg.Session(gg).run(feeds)
    ref = rg.Session(gg, backend="reference").run(feeds)
    for w in wrt:
        np.testing.assert_array_equal(out[f"{w}_grad"], ref[f"{w}_grad"])
    return {w: out[f"{w}_grad"] for w in wrt}


def _sum_of(op: str, inputs: list[str], shape, attrs=None) -> Graph:
    nodes = [Node(op, inputs, ["y"], attrs or {}, "op"), Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")]
    return Graph(nodes, [ValueInfo(i, np.float64, shape) for i in inputs], [ValueInfo("loss")])


def test_max_min_ties_split_equally():
    a = np.array([1.0, 2.0, 3.0])
    b = np.array([1.0, 5.0, 3.0])
    c = np.array([1.0, 0.0, 2.0])
    for op in ("Max", "Min"):
        grads = _grad(_sum_of(op, ["a", "b", "c"], (3,)), {"a": a, "b": b, "c": c}, ["a", "b", "c"])
        total = grads["a"] + grads["b"] + grads["c"]
        np.testing.assert_allclose(total, np.ones(3))  # the cotangent is shared, never duplicated
        np.testing.assert_allclose(grads["a"][0], 1 / 3)  # a three-way tie at index 0, for Max and Min alike
    grads = _grad(_sum_of("Max", ["a", "b", "c"], (3,)), {"a": a, "b": b, "c": c}, ["a", "b", "c"])
    np.testing.assert_allclose(grads["a"], [1 / 3, 0, 0.5])
    np.testing.assert_allclose(grads["b"], [1 / 3, 1, 0.5])


def test_zero_subgradients_at_kinks():
    x = np.array([-1.0, 0.0, 2.0])
    for op, expected in (("Relu", [0.0, 0.0, 1.0]), ("Abs", [-1.0, 0.0, 1.0])):
        grads = _grad(_sum_of(op, ["x"], (3,)), {"x": x}, ["x"])
        np.testing.assert_array_equal(grads["x"], expected)


def test_strong_zero_where_sqrt_branch():
    # where(x > 0, sqrt(x), x) at x = -1: the unselected sqrt branch has a NaN derivative; gradient is 1.
    nodes = [
        Node("Constant", [], ["zero"], {"value": np.array(0.0)}, "zero"),
        Node("Greater", ["x", "zero"], ["c"], name="gt"),
        Node("Sqrt", ["x"], ["s"], name="sqrt"),
        Node("Where", ["c", "s", "x"], ["y"], name="where"),
        Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum"),
    ]
    g = Graph(nodes, [ValueInfo("x", np.float64, (3,))], [ValueInfo("loss")])
    with np.errstate(invalid="ignore"):  # the forward computes sqrt(-1) = NaN in the untaken branch
        grads = _grad(g, {"x": np.array([-1.0, 0.0, 4.0])}, ["x"])
    assert np.all(np.isfinite(grads["x"]))
    np.testing.assert_array_equal(grads["x"][:2], [1.0, 1.0])
    np.testing.assert_allclose(grads["x"][2], 0.25)


@pytest.mark.parametrize("op,value", [("Log", 0.0), ("Div", 0.0), ("Reciprocal", 0.0), ("Pow", 0.0)])
def test_strong_zero_of_infinite_derivatives(op, value):
    # x enters op at a point with an infinite derivative, but its output is multiplied by 0 afterwards.
    inputs = ["x", "x"] if op in ("Div", "Pow") else ["x"]
    nodes = [
        Node(op, inputs if op != "Pow" else ["x", "half"], ["y"], name="op"),
        Node("Where", ["mask", "y", "zero"], ["z"], name="where"),
        Node("ReduceSum", ["z"], ["loss"], {"keepdims": 0}, "sum"),
    ]
    g = Graph(nodes, [ValueInfo("x", np.float64, (2,))], [ValueInfo("loss")],
              {"mask": np.array([False, True]), "zero": np.array(0.0), "half": np.array(0.5)})
    with np.errstate(all="ignore"):
        x = np.array([value, 2.0])
        grads = _grad(g, {"x": x}, ["x"])
    assert grads["x"][0] == 0.0
    assert np.isfinite(grads["x"][1])
