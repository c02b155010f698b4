"""VJP rules of activations and unary math (rules/activations.py), three ways (central differences, PyTorch,
second order) on random shapes and attributes, plus the documented values at kinks and strong zeros.

Where the ONNX forward is not float64-accurate (the reference ``Erf`` behind ``Gelu`` rounds to float32;
``Celu`` exists only for float32), :func:`torch_check` compares first and second order with PyTorch's autograd
(double backward for the Hessian-vector product) instead of central differences of the ONNX graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from kit.harness import check_rule, one_node_graph
from kit.rules import torch_check

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F = torch.nn.functional
SETTINGS = settings(max_examples=6, deadline=None)
SHAPES = st.lists(st.integers(1, 4), max_size=3).map(tuple)
SEEDS = st.integers(0, 2**16)
SELU_ALPHA, SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875  # ONNX defaults (float32)


def _attr(value: float) -> float:
    return float(np.float32(value))


def _away(x: np.ndarray, kinks, margin: float = 1e-3) -> np.ndarray:
    """``x`` with points closer than ``margin`` to a kink moved off it (central differences would straddle it)."""
    for k in kinks:
        x = np.where(np.abs(x - k) < margin, k + 10 * margin, x)
    return x


# op -> (attribute strategy, torch function of (x, attrs), domain, kinks of (attrs)); the drawn attributes are
# small dyadic numbers, exact in float32 as ONNX stores them.
DYADIC = st.sampled_from([0.25, 0.5, 0.75, 1.5])
UNARY = {
    "Gelu": (st.just({"approximate": "tanh"}), lambda x, a: F.gelu(x, approximate="tanh"), "any", lambda a: []),
    "HardSigmoid": (st.one_of(st.just({}), st.fixed_dictionaries({"alpha": DYADIC,
                                                                  "beta": st.sampled_from([0.25, 0.5, 0.75])})),
                    lambda x, a: torch.clamp(_attr(a.get("alpha", 0.2)) * x + a.get("beta", 0.5), 0, 1), "wide",
                    lambda a: [(t - a.get("beta", 0.5)) / a.get("alpha", 0.2) for t in (0.0, 1.0)]),
    "HardSwish": (st.just({}), lambda x, a: x * torch.clamp(x * _attr(1 / 6) + 0.5, 0, 1), "wide",
                  lambda a: [-3.0, 3.0]),
    "Selu": (st.one_of(st.just({}), st.fixed_dictionaries({"alpha": DYADIC, "gamma": DYADIC})),
             lambda x, a: a.get("gamma", SELU_GAMMA) * F.elu(x, a.get("alpha", SELU_ALPHA)), "any", lambda a: [0.0]),
    "Mish": (st.just({}), lambda x, a: F.mish(x), "wide", lambda a: []),
    "Softsign": (st.just({}), lambda x, a: F.softsign(x), "wide", lambda a: [0.0]),
    "ThresholdedRelu": (st.one_of(st.just({}), st.fixed_dictionaries({"alpha": DYADIC})),
                        lambda x, a: F.threshold(x, a.get("alpha", 1.0), 0.0), "wide", lambda a: [a.get("alpha", 1.0)]),
    "Sinh": (st.just({}), lambda x, a: torch.sinh(x), "any", lambda a: []),
    "Cosh": (st.just({}), lambda x, a: torch.cosh(x), "any", lambda a: []),
    "Tan": (st.just({}), lambda x, a: torch.tan(x), "unit", lambda a: []),
    "Asin": (st.just({}), lambda x, a: torch.asin(x), "unit", lambda a: []),
    "Acos": (st.just({}), lambda x, a: torch.acos(x), "unit", lambda a: []),
    "Atan": (st.just({}), lambda x, a: torch.atan(x), "wide", lambda a: []),
    "Asinh": (st.just({}), lambda x, a: torch.asinh(x), "wide", lambda a: []),
    "Acosh": (st.just({}), lambda x, a: torch.acosh(x), "above1", lambda a: []),
    "Atanh": (st.just({}), lambda x, a: torch.atanh(x), "unit", lambda a: []),
}
# Shrink: ORT's float64 kernel rounds through float32, so its central differences are taken of PyTorch, and x
# is made float32-exact with bias <= lambd, which makes x -+ bias exact in float32 too (the forward then agrees).
SHRINK_ATTRS = st.fixed_dictionaries({"lambd": DYADIC, "bias": st.sampled_from([0.0, 0.25])})
UNARY["Shrink"] = (st.one_of(st.just({}), SHRINK_ATTRS),
                   lambda x, a: _shrink(x, a.get("lambd", 0.5), a.get("bias", 0.0)),
                   "wide", lambda a: [-a.get("lambd", 0.5), a.get("lambd", 0.5)])


def _shrink(x, lambd, bias):
    return torch.where(x > lambd, x - bias, torch.where(x < -lambd, x + bias, torch.zeros_like(x)))


def _sample(rng, shape, domain):
    x = rng.standard_normal(shape)
    if domain == "wide":
        return x * 3
    if domain == "unit":
        return np.tanh(x) * 0.9
    if domain == "above1":
        return 1.1 + np.abs(x)
    return x


@pytest.mark.parametrize("op", list(UNARY))
@SETTINGS
@given(shape=SHAPES, data=st.data(), seed=SEEDS)
def test_unary(op, shape, data, seed):
    attr_strategy, fn, domain, kinks = UNARY[op]
    attrs = data.draw(attr_strategy)
    if op == "Softsign" and shape == ():  # the reference Softsign fails on 0-d arrays (np.divide out= a scalar)
        shape = (1,)
    x = _away(_sample(np.random.default_rng(seed), shape, domain), kinks(attrs))
    if op == "Shrink":
        x = x.astype(np.float32).astype(np.float64)
    g = one_node_graph(op, {"x": x}, attrs)
    check_rule(g, {"x": x}, lambda x: fn(x, attrs), fd_with_torch=op == "Shrink")


@SETTINGS
@given(shape=SHAPES, seed=SEEDS)
def test_gelu_exact(shape, seed):
    # The reference Erf is float32-accurate only: |x| <= 1.5 keeps the forward within 1e-6 of PyTorch (1 + erf
    # cancels for very negative x), and first and second order are checked against PyTorch.
    x = np.tanh(np.random.default_rng(seed).standard_normal(shape)) * 1.5
    g = one_node_graph("Gelu", {"x": x})
    check_rule(g, {"x": x}, lambda x: F.gelu(x), fd_with_torch=True, second_order=False)
    torch_check(g, {"x": x}, F.gelu, wrt=["x"], backends=("reference",), rtol=1e-5, atol=1e-7)


@SETTINGS
@given(shape=SHAPES, alpha=st.one_of(st.none(), DYADIC), seed=SEEDS)
def test_celu_float32(shape, alpha, seed):
    # ONNX defines Celu for float32 only: no float64 central differences; PyTorch in float64 instead.
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2
    g = one_node_graph("Celu", {"x": x}, {} if alpha is None else {"alpha": alpha})
    torch_check(g, {"x": x}, lambda x: F.celu(x, 1.0 if alpha is None else alpha), wrt=["x"], rtol=1e-5, atol=1e-6)


@st.composite
def slope_shapes(draw):
    """An X shape and a slope shape unidirectionally broadcastable to it (a suffix, some axes set to 1)."""
    xs = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    k = draw(st.integers(0, len(xs)))
    suffix = [d if draw(st.booleans()) else 1 for d in xs[len(xs) - k:]]
    return tuple(xs), tuple(suffix)


@SETTINGS
@given(shapes=slope_shapes(), seed=SEEDS)
def test_prelu_broadcast_slope(shapes, seed):
    rng = np.random.default_rng(seed)
    x = _away(rng.standard_normal(shapes[0]), [0.0])
    s = rng.standard_normal(shapes[1])
    g = one_node_graph("PRelu", {"x": x, "slope": s})
    check_rule(g, {"x": x, "slope": s}, lambda x, slope: torch.where(x > 0, x, slope * x))


def test_prelu_channel_slope_like_pytorch():
    rng = np.random.default_rng(3)
    x, s = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 1))  # ONNX's per-channel slope shape
    g = one_node_graph("PRelu", {"x": x, "slope": s})
    check_rule(g, {"x": x, "slope": s}, lambda x, slope: F.prelu(x, slope.reshape(-1)))


@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3), seed=SEEDS)
def test_mod_fmod(shapes, seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):  # keep a / b off the integers, where fmod jumps
        a = rng.standard_normal(shapes.input_shapes[0]) * 3
        b = rng.choice([-1.0, 1.0], shapes.input_shapes[1]) * rng.uniform(0.5, 1.5, shapes.input_shapes[1])
        q = np.abs(a / b)
        if np.all(np.abs(q - np.round(q)) > 1e-3):
            break
    g = one_node_graph("Mod", {"a": a, "b": b}, {"fmod": 1})
    check_rule(g, {"a": a, "b": b}, lambda a, b: torch.fmod(a, b))


def test_mod_quotient_rounded_across_integer():
    # 0.3 / 0.1 = 2.9999999999999996 in float64 while fmod(0.3, 0.1) = 0.1 - 2.8e-17 says the quotient is 2.
    a, b = np.array([0.3, -7.0, 7.5]), np.array([0.1, 2.0, -2.0])
    g = one_node_graph("Mod", {"a": a, "b": b}, {"fmod": 1})
    grads = _grad(g, {"a": a, "b": b}, ["a", "b"])
    np.testing.assert_array_equal(grads["a"], [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(grads["b"], -np.trunc(np.array([2.0, -3.5, -3.75])))


def test_integer_mod_has_no_gradient_path():
    x = np.array([1.3, 2.6])
    nodes = [Node("Cast", ["x"], ["xi"], {"to": 7}, "cast"), Node("Mod", ["xi", "k"], ["m"], name="mod"),
             Node("Cast", ["m"], ["mf"], {"to": 11}, "back"), Node("Add", ["mf", "x"], ["y0"], name="add")]
    g = Graph(nodes, [ValueInfo("x", np.float64, (2,))], [ValueInfo("y0")], {"k": np.array([2, 2], np.int64)})
    check_rule(g, {"x": x}, lambda x: torch.fmod(x.long(), 2).double() + x, second_order=False)


# -------------------------------------------------------------------------------------- Swish (opset 24)


def _swish_graph(x: np.ndarray, attrs: dict) -> Graph:
    g = one_node_graph("Swish", {"x": x}, attrs)
    g.opsets = {"": 24}
    return g


@SETTINGS
@given(shape=SHAPES, alpha=st.sampled_from([None, 1.0, 0.5, -1.5]), seed=SEEDS)
def test_swish(shape, alpha, seed):
    x = np.random.default_rng(seed).standard_normal(shape) * 3
    a = 1.0 if alpha is None else _attr(alpha)
    check_rule(_swish_graph(x, {} if alpha is None else {"alpha": alpha}), {"x": x},
               lambda x: x * torch.sigmoid(a * x))


def test_swish_is_silu():
    x = np.random.default_rng(31).standard_normal((2, 5)).astype(np.float32) * 4
    torch_check(_swish_graph(x, {}), {"x": x}, lambda x: F.silu(x), wrt=["x"], rtol=1e-5, atol=1e-6)


def test_swish_strong_zero_at_infinity():
    # At x = -inf and inf the slope is 0 * -inf or inf * 0 (NaN): a zero cotangent must give 0.
    x = np.array([-np.inf, np.inf, 2.0])
    nodes = [Node("Swish", ["x"], ["y"], {"alpha": 0.5}, "op"), Node("Mul", ["y", "w"], ["y0"], name="mul")]
    g = Graph(nodes, [ValueInfo("x", np.float64, (3,))], [ValueInfo("y0")], {"w": np.array([0.0, 0.0, 1.0])},
              opsets={"": 24})
    with np.errstate(all="ignore"):
        grads = _grad(g, {"x": x}, ["x"], backend="onnxruntime")
    s = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(grads["x"], [0.0, 0.0, s * (1 + 1.0 * (1 - s))], rtol=1e-12)


@pytest.mark.parametrize("alpha", [None, 1.0, 1.702])
def test_swiglu(alpha):
    # Y = Swish_alpha(A) * B (opset 28): Llama's gate_proj / up_proj product
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((3, 4)) * 2, rng.standard_normal((3, 4))
    g = one_node_graph("SwiGLU", {"a": a, "b": b}, {} if alpha is None else {"alpha": alpha})
    g.opsets = {"": 28}
    k = 1.0 if alpha is None else _attr(alpha)
    check_rule(g, {"a": a, "b": b}, lambda a, b: a * torch.sigmoid(k * a) * b)


def test_swiglu_keeps_strong_zeros():
    # A = -inf gives swish 0 * ... and a slope of NaN: a zero cotangent must still give exact zeros
    nodes = [Node("SwiGLU", ["a", "b"], ["y"], name="op"), Node("Mul", ["y", "w"], ["y0"], name="mul")]
    g = Graph(nodes, [ValueInfo("a", np.float64, (3,)), ValueInfo("b", np.float64, (3,))], [ValueInfo("y0")],
              {"w": np.array([0.0, 0.0, 1.0])}, opsets={"": 28})
    with np.errstate(all="ignore"):
        grads = _grad(g, {"a": np.array([-np.inf, np.inf, 1.0]), "b": np.array([np.inf, 2.0, 3.0])}, ["a", "b"])
    s = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(grads["a"], [0.0, 0.0, 3.0 * s * (1 + (1 - s))], rtol=1e-12)
    np.testing.assert_allclose(grads["b"], [0.0, 0.0, s], rtol=1e-12)


# -------------------------------------------------------------------------------------- kinks, strong zeros


def _grad(g: Graph, feeds: dict, wrt: list[str], backend: str = "reference") -> dict[str, np.ndarray]:
    """Gradients of ``sum(y0)`` (seed ones)."""
    gg = rg.gradient(g, loss="y0", wrt=wrt)
    out = rg.Session(gg, backend=backend).run(feeds)
    return {w: out[f"{w}_grad"] for w in wrt}


@pytest.mark.parametrize("op,attrs,x,expected", [
    # the piece on the left of each kink; 0 where that piece is constant
    ("HardSigmoid", {"alpha": 0.25, "beta": 0.5}, [-2.0, 2.0, 0.0], [0.0, 0.0, 0.25]),
    ("HardSwish", {}, [-3.0, 3.0, 0.0], [0.0, 1.0, 0.5]),
    ("ThresholdedRelu", {"alpha": 0.5}, [0.5, 0.75], [0.0, 1.0]),
    ("Shrink", {"lambd": 0.5, "bias": 0.25}, [-0.5, 0.5, 0.75], [0.0, 0.0, 1.0]),
    ("Selu", {"alpha": 1.5, "gamma": 2.0}, [0.0, 1.0], [3.0, 2.0]),
    ("Celu", {"alpha": 2.0}, [0.0, -2.0], [1.0, np.exp(-1.0)]),
    ("Softsign", {}, [0.0, 1.0], [1.0, 0.25]),
])
def test_values_at_kinks(op, attrs, x, expected):
    dtype = np.float32 if op == "Celu" else np.float64
    x = np.asarray(x, dtype)
    grads = _grad(one_node_graph(op, {"x": x}, attrs), {"x": x}, ["x"])
    np.testing.assert_allclose(grads["x"], np.asarray(expected, dtype), rtol=1e-7)


def test_prelu_at_zero_takes_the_slope_piece():
    x, s = np.array([0.0, 0.0, 1.0]), np.array([0.25, -0.5, 3.0])
    grads = _grad(one_node_graph("PRelu", {"x": x, "slope": s}), {"x": x, "slope": s}, ["x", "slope"])
    np.testing.assert_array_equal(grads["x"], [0.25, -0.5, 1.0])  # as PyTorch: slope where x <= 0
    np.testing.assert_array_equal(grads["slope"], [0.0, 0.0, 0.0])
    tx = torch.tensor(x, requires_grad=True)
    F.prelu(tx.reshape(1, 3), torch.tensor(s)).sum().backward()
    np.testing.assert_array_equal(grads["x"], tx.grad.numpy())


@pytest.mark.parametrize("op,x", [("Asin", 1.0), ("Acos", -1.0), ("Atanh", 1.0), ("Acosh", 1.0), ("Sinh", 800.0)])
def test_strong_zero_where_the_slope_is_infinite(op, x):
    # y is multiplied by 0 afterwards: the zero cotangent meets an infinite slope and must give 0, not NaN.
    x = np.array([x, 0.5 if op != "Acosh" else 2.0])
    nodes = [Node(op, ["x"], ["y"], name="op"), Node("Mul", ["y", "w"], ["y0"], name="mul")]
    g = Graph(nodes, [ValueInfo("x", np.float64, (2,))], [ValueInfo("y0")], {"w": np.array([0.0, 1.0])})
    with np.errstate(all="ignore"):
        grads = _grad(g, {"x": x}, ["x"])
    assert grads["x"][0] == 0.0
    tx = torch.tensor(x[1:], requires_grad=True)
    getattr(torch, op.lower())(tx).sum().backward()
    np.testing.assert_allclose(grads["x"][1], tx.grad.numpy()[0], rtol=1e-12)


def test_mod_strong_zero_at_zero_divisor():
    a, b = np.array([1.5, 1.5]), np.array([0.0, 1.0])
    nodes = [Node("Mod", ["a", "b"], ["y"], {"fmod": 1}, "op"), Node("Mul", ["y", "w"], ["y0"], name="mul")]
    g = Graph(nodes, [ValueInfo("a", np.float64, (2,)), ValueInfo("b", np.float64, (2,))], [ValueInfo("y0")],
              {"w": np.array([0.0, 1.0])})
    with np.errstate(all="ignore"):
        grads = _grad(g, {"a": a, "b": b}, ["a", "b"], backend="onnxruntime")
    np.testing.assert_array_equal(grads["b"], [0.0, -1.0])
    np.testing.assert_array_equal(grads["a"], [0.0, 1.0])
