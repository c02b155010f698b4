"""VJP rules of the reductions, CumSum and CumProd, checked three ways by tests/kit/harness.py (central
differences, PyTorch autograd, second order), plus the conventions of DESIGN.md section 5: ties split equally,
the 0 subgradient of a zero norm, products with zeros (ReduceProd, CumProd), strong zeros."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.harness import check_rule, one_node_graph, with_loss

import revgraph as rg
from revgraph.ir import Node, ValueInfo

FAST = settings(max_examples=8, deadline=None)


def _prod(x, dims, keepdim):
    for d in sorted(dims, reverse=True):  # torch.prod takes one dim at a time
        x = x.prod(d, keepdim=keepdim)
    return x


#: op type -> (torch reduction over ``dims`` with ``keepdim``, the same op when nothing is reduced)
REDUCTIONS = {
    "ReduceSum": (lambda x, d, k: x.sum(d, keepdim=k), lambda x: x),
    "ReduceMean": (lambda x, d, k: x.mean(d, keepdim=k), lambda x: x),
    "ReduceMax": (lambda x, d, k: x.amax(d, keepdim=k), lambda x: x),
    "ReduceMin": (lambda x, d, k: x.amin(d, keepdim=k), lambda x: x),
    "ReduceProd": (_prod, lambda x: x),
    "ReduceSumSquare": (lambda x, d, k: (x * x).sum(d, keepdim=k), lambda x: x * x),
    "ReduceL2": (lambda x, d, k: torch.linalg.vector_norm(x, dim=d, keepdim=k), lambda x: x.abs()),
    "ReduceL1": (lambda x, d, k: x.abs().sum(d, keepdim=k), lambda x: x.abs()),
    "ReduceLogSumExp": (lambda x, d, k: torch.logsumexp(x, d, keepdim=k), lambda x: x),
}


def reduction_graph(op, x, axes, keepdims, noop=None):
    inputs = {"x": x} if axes is None else {"x": x, "axes": np.asarray(axes, dtype=np.int64)}
    attrs = {"keepdims": int(keepdims)}
    if noop is not None:
        attrs["noop_with_empty_axes"] = noop
    return one_node_graph(op, inputs, attrs)


def torch_reduction(op, rank, axes, keepdims):
    fn = REDUCTIONS[op][0]
    dims = tuple(range(rank)) if not axes else tuple(a % rank for a in axes)
    return lambda x, **_: fn(x, dims, bool(keepdims))


@st.composite
def reduction_case(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    some = st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank, unique_by=lambda a: a % rank)
    axes = draw(st.none() | some)
    return shape, axes, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@FAST
@given(case=reduction_case())
def test_reduction(op, case):
    shape, axes, keepdims, seed = case
    x = np.random.default_rng(seed).standard_normal(shape)
    ref = torch_reduction(op, len(shape), axes, keepdims)
    check_rule(reduction_graph(op, x, axes, keepdims), {"x": x}, ref, seed=seed)


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_reduction_default_attributes(op):
    """No axes input and no keepdims attribute: every axis reduced, kept as size 1."""
    x = np.random.default_rng(1).standard_normal((2, 3, 4))
    fn = REDUCTIONS[op][0]
    check_rule(one_node_graph(op, {"x": x}), {"x": x}, lambda x: fn(x, (0, 1, 2), True))


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@pytest.mark.parametrize("empty_axes", [False, True])
def test_reduction_noop_with_empty_axes(op, empty_axes):
    """noop_with_empty_axes=1 with no (or empty) axes: no reduction, the op's elementwise part only."""
    x = np.random.default_rng(2).standard_normal((3, 4))
    g = reduction_graph(op, x, [] if empty_axes else None, keepdims=0, noop=1)
    check_rule(g, {"x": x}, REDUCTIONS[op][1])


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_reduction_empty_axes_reduce_everything(op):
    x = np.random.default_rng(3).standard_normal((3, 2))
    g = reduction_graph(op, x, [], keepdims=0)
    check_rule(g, {"x": x}, torch_reduction(op, 2, None, False))


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax", "ReduceProd", "ReduceL2", "ReduceLogSumExp"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduction_unknown_dimensions(op, keepdims):
    x = np.random.default_rng(4).standard_normal((2, 3, 4))
    g = reduction_graph(op, x, [0, -1], keepdims)
    g.inputs = [ValueInfo("x", x.dtype, ("n", "m", "k"))]
    check_rule(g, {"x": x}, torch_reduction(op, 3, [0, -1], keepdims))


def test_reduction_axes_from_graph_input():
    """Axes known only at run time (a graph input): Unsqueeze takes them as a value."""
    x = np.random.default_rng(5).standard_normal((2, 3, 4))
    g = reduction_graph("ReduceMax", x, [1], keepdims=0)
    g.inputs.append(ValueInfo("axes", np.dtype(np.int64), (1,)))
    axes = g.initializers.pop("axes")
    fwd = rg.Session(g).run({"x": x, "axes": axes})
    lg, _ = with_loss(g, fwd)
    u = np.random.default_rng(6).standard_normal(fwd["y0"].shape)
    got = rg.Session(rg.gradient(lg, loss="loss", wrt=["x"])).run({"x": x, "axes": axes, "y0_u": u})["x_grad"]
    tx = torch.tensor(x, requires_grad=True)
    (tx.amax(1) * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-12)


def _grad(g, feeds, u):
    """The VJP of g's output y0 with cotangent u, by the reference evaluator and by onnxruntime."""
    fwd = rg.Session(g).run(feeds)
    lg, _ = with_loss(g, fwd)
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    out = [rg.Session(gg, backend=b).run({**feeds, "y0_u": u})["x_grad"] for b in ("onnxruntime", "reference")]
    np.testing.assert_allclose(out[0], out[1], rtol=1e-12)
    return out[0]


@pytest.mark.parametrize("op, torch_fn", [("ReduceMax", torch.amax), ("ReduceMin", torch.amin)])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_max_min_ties_split_equally(op, torch_fn, keepdims):
    rng = np.random.default_rng(7)
    x = rng.integers(0, 3, (4, 5, 3)).astype(np.float64)  # many ties
    u = rng.standard_normal((4, 3) if not keepdims else (4, 1, 3))
    got = _grad(reduction_graph(op, x, [-2], keepdims), {"x": x}, u)
    ext = x.max(1, keepdims=True) if op == "ReduceMax" else x.min(1, keepdims=True)
    hit = (x == ext).astype(np.float64)
    expected = hit * u.reshape(4, 1, 3) / hit.sum(1, keepdims=True)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    tx = torch.tensor(x, requires_grad=True)
    (torch_fn(tx, 1, keepdim=bool(keepdims)) * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-12)


@pytest.mark.parametrize("zeros", [[(0, 1, 2)], [(0, 1, 2), (1, 2, 0)], [(0, 0, 0), (1, 0, 0), (0, 0, 1)]])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_prod_with_zeros(zeros, keepdims):
    """One, two and three zeros in a group: the product of the others, no NaN, exact second order."""
    x = np.random.default_rng(8).standard_normal((2, 3, 4))
    for z in zeros:
        x[z] = 0.0
    g = reduction_graph("ReduceProd", x, [0, 2], keepdims)
    grads = check_rule(g, {"x": x}, torch_reduction("ReduceProd", 3, [0, 2], keepdims))
    assert np.isfinite(grads["x"]).all()


def test_reduce_prod_all_zero():
    x = np.zeros((3, 2))
    grads = check_rule(reduction_graph("ReduceProd", x, [0], 1), {"x": x}, torch_reduction("ReduceProd", 2, [0], 1))
    np.testing.assert_array_equal(grads["x"], 0.0)


def test_reduce_l2_zero_norm_has_zero_subgradient():
    x = np.random.default_rng(9).standard_normal((3, 4))
    x[1] = 0.0
    u = np.random.default_rng(10).standard_normal((3,))
    got = _grad(reduction_graph("ReduceL2", x, [1], 0), {"x": x}, u)
    expected = u[:, None] * x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    np.testing.assert_array_equal(got[1], 0.0)


def test_reduce_l1_zero_has_zero_subgradient():
    x = np.array([[0.0, 1.5, -2.0], [0.0, 0.0, 3.0]])
    u = np.array([2.0, -1.0])
    got = _grad(reduction_graph("ReduceL1", x, [1], 0), {"x": x}, u)
    np.testing.assert_array_equal(got, u[:, None] * np.sign(x))


def test_reduce_log_sum_exp_large_inputs():
    """exp(x - y) never overflows: the softmax of huge logits."""
    x = np.array([[1000.0, 1000.0, 990.0], [-1000.0, 5.0, -2000.0]])
    u = np.array([1.0, 2.0])
    got = _grad(reduction_graph("ReduceLogSumExp", x, [1], 0), {"x": x}, u)
    s = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(got, u[:, None] * s / s.sum(1, keepdims=True), rtol=1e-12)


# ------------------------------------------------------------------------------------------ ReduceLogSum
# Positive inputs (the logarithm of a negative sum is NaN), so not in REDUCTIONS' sweeps over normal draws.


def _log_sum(rank, axes, keepdims):
    dims = tuple(range(rank)) if not axes else tuple(a % rank for a in axes)
    return lambda x, **_: torch.log(x.sum(dims, keepdim=bool(keepdims)))


@FAST
@given(case=reduction_case())
def test_reduce_log_sum(case):
    shape, axes, keepdims, seed = case
    x = np.random.default_rng(seed).uniform(0.2, 2.0, shape)
    check_rule(reduction_graph("ReduceLogSum", x, axes, keepdims), {"x": x}, _log_sum(len(shape), axes, keepdims),
               seed=seed)


@pytest.mark.parametrize("axes,noop", [(None, 1), ([], 1), ([], 0), (None, None)])
def test_reduce_log_sum_empty_axes(axes, noop):
    """noop_with_empty_axes=1 without axes: log(x) elementwise; otherwise every axis is reduced."""
    x = np.random.default_rng(14).uniform(0.2, 2.0, (3, 4))
    g = reduction_graph("ReduceLogSum", x, axes, keepdims=0, noop=noop)
    check_rule(g, {"x": x}, torch.log if noop else _log_sum(2, None, 0))


@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_log_sum_unknown_dimensions(keepdims):
    x = np.random.default_rng(15).uniform(0.2, 2.0, (2, 3, 4))
    g = reduction_graph("ReduceLogSum", x, [0, -1], keepdims)
    g.inputs = [ValueInfo("x", x.dtype, ("n", "m", "k"))]
    check_rule(g, {"x": x}, _log_sum(3, [0, -1], keepdims))


def test_reduce_log_sum_zero_sum_is_strong():
    """A zero sum: 1 / sum is inf; a zero cotangent there gives exactly 0, a nonzero one inf."""
    x = np.array([[0.0, 0.0], [1.0, 3.0], [0.0, 0.0]])
    with np.errstate(divide="ignore", invalid="ignore"):
        got = _grad(reduction_graph("ReduceLogSum", x, [1], 0), {"x": x}, np.array([0.0, 2.0, 1.0]))
    np.testing.assert_array_equal(got, [[0.0, 0.0], [0.5, 0.5], [np.inf, np.inf]])


# ------------------------------------------------------------------------------------------ CumSum


def torch_cumsum(axis, exclusive, reverse):
    def fn(x, **_):
        y = torch.flip(x, [axis]) if reverse else x
        c = torch.cumsum(y, axis)
        if exclusive:
            c = c - y
        return torch.flip(c, [axis]) if reverse else c

    return fn


@st.composite
def cumsum_case(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    axis = draw(st.integers(-rank, rank - 1))
    return shape, axis, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@FAST
@given(cumsum_case())
def test_cumsum(case):
    shape, axis, exclusive, reverse, seed = case
    x = np.random.default_rng(seed).standard_normal(shape)
    attrs = {"exclusive": int(exclusive), "reverse": int(reverse)}
    g = one_node_graph("CumSum", {"x": x, "axis": np.asarray(axis, dtype=np.int64)}, attrs)
    check_rule(g, {"x": x}, torch_cumsum(axis % len(shape), exclusive, reverse), seed=seed)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum_int32_axis_and_defaults(exclusive, reverse):
    x = np.random.default_rng(12).standard_normal((3, 5))
    attrs = {k: v for k, v in {"exclusive": exclusive, "reverse": reverse}.items() if v}
    g = one_node_graph("CumSum", {"x": x, "axis": np.asarray(-1, dtype=np.int32)}, attrs)
    check_rule(g, {"x": x}, torch_cumsum(1, exclusive, reverse))


# ------------------------------------------------------------------------------------------ CumProd (opset 26)


def torch_cumprod(axis, exclusive, reverse):
    def fn(x, **_):
        y = torch.flip(x, [axis]) if reverse else x
        if exclusive:
            y = torch.cat([torch.ones_like(y.narrow(axis, 0, 1)), y.narrow(axis, 0, y.shape[axis] - 1)], axis)
        c = torch.cumprod(y, axis)
        return torch.flip(c, [axis]) if reverse else c

    return fn


def cumprod_graph(x, axis, exclusive=0, reverse=0, axis_dtype=np.int64):
    attrs = {k: v for k, v in {"exclusive": exclusive, "reverse": reverse}.items() if v}
    g = one_node_graph("CumProd", {"x": x, "axis": np.asarray(axis, dtype=axis_dtype)}, attrs)
    g.opsets = {"": 26}
    return g


def brute_cumprod_grad(x, u, axis, exclusive, reverse):
    """``dx_i = sum_j u_j prod_{k in window(j), k != i} x_k`` by brute force along ``axis``."""
    xm, um = np.moveaxis(x, axis, -1), np.moveaxis(u, axis, -1)
    n = xm.shape[-1]
    out = np.zeros_like(xm)
    for j in range(n):
        window = [k for k in range(n) if (k >= j if reverse else k <= j) and not (exclusive and k == j)]
        for i in window:
            others = [k for k in window if k != i]
            out[..., i] += um[..., j] * np.prod(xm[..., others], axis=-1)
    return np.moveaxis(out, -1, axis)


@st.composite
def cumprod_case(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    axis = draw(st.integers(-rank, rank - 1))
    zeros = draw(st.integers(0, 4))
    return shape, axis, draw(st.booleans()), draw(st.booleans()), zeros, draw(st.integers(0, 2**31 - 1))


@FAST
@given(cumprod_case())
def test_cumprod(case):
    """Random shapes, axes and attributes, with up to four zeros (products with zeros are polynomials too:
    central differences and second order hold there)."""
    shape, axis, exclusive, reverse, zeros, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    x.reshape(-1)[rng.integers(0, x.size, zeros)] = 0.0
    g = cumprod_graph(x, axis, int(exclusive), int(reverse))
    check_rule(g, {"x": x}, torch_cumprod(axis % len(shape), exclusive, reverse), seed=seed)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumprod_several_zeros_exact(exclusive, reverse):
    """Lines with one, two, three and only zeros, against the brute-force sum of products: no division, so
    the elements after the first zero and the first zero itself get their exact gradients."""
    rng = np.random.default_rng(16)
    x = rng.uniform(0.5, 2.0, (5, 7)) * rng.choice([-1.0, 1.0], (5, 7))
    x[0, 3] = 0.0
    x[1, [1, 4]] = 0.0
    x[2, [0, 2, 6]] = 0.0
    x[3] = 0.0
    g = cumprod_graph(x, 1, exclusive, reverse, np.int32)
    grads = check_rule(g, {"x": x}, torch_cumprod(1, exclusive, reverse))
    u = np.random.default_rng(0).standard_normal(x.shape)  # the harness's cotangent of y0
    np.testing.assert_allclose(grads["x"], brute_cumprod_grad(x, u, 1, exclusive, reverse), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumprod_unknown_length(exclusive, reverse):
    """A symbolic axis length: the scan is a Loop that doubles its step while it is below the length (second
    order through it as well)."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((2, 11, 3))
    x[0, [2, 5], 1] = 0.0
    g = cumprod_graph(x, -2, exclusive, reverse)
    g.inputs = [ValueInfo("x", x.dtype, (2, "n", 3))]
    check_rule(g, {"x": x}, torch_cumprod(1, exclusive, reverse))
    lg, _ = with_loss(g, {"y0": x})
    assert any(n.op_type == "Loop" for n in rg.gradient(lg, loss="loss", wrt=["x"]).nodes)
    for n in (1, 2, 4, 5):  # lengths around the powers of two, and 1 (no step)
        xs = x[:, :n]
        grads = check_rule(g, {"x": xs}, torch_cumprod(1, exclusive, reverse), second_order=False)
        u = np.random.default_rng(0).standard_normal(xs.shape)
        np.testing.assert_allclose(grads["x"], brute_cumprod_grad(xs, u, 1, exclusive, reverse), rtol=1e-12)


def test_cumprod_strong_zeros_where_products_overflow():
    """Partial products overflow to inf; the elements whose cotangents are all 0 get exactly 0, not NaN."""
    x = np.array([1e200, 1e200, 1e200, 2.0])
    with np.errstate(over="ignore", invalid="ignore"):
        got = _grad(cumprod_graph(x, 0), {"x": x}, np.array([1.0, 0.0, 0.0, 0.0]))
        np.testing.assert_array_equal(got, [1.0, 0.0, 0.0, 0.0])
        got = _grad(cumprod_graph(x, 0, reverse=1), {"x": x}, np.array([0.0, 0.0, 0.0, 1.0]))
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.0, 1.0])


def test_cumprod_float32_and_valid_onnx():
    x = np.random.default_rng(18).standard_normal((3, 9)).astype(np.float32)
    x[1, 4] = 0.0
    g = cumprod_graph(x, 1, exclusive=1)
    lg, _ = with_loss(g, {"y0": x})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    assert not any(n.op_type == "Pad" and len(n.inputs) > 3 for n in gg.nodes)  # no Pad with axes (issue 15)
    u = np.random.default_rng(19).standard_normal(x.shape).astype(np.float32)
    got = rg.Session(gg).run({"x": x, "y0_u": u})["x_grad"]
    expected = brute_cumprod_grad(x.astype(np.float64), u.astype(np.float64), 1, 1, 0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", [*sorted(REDUCTIONS), "CumSum"])
def test_gradient_graphs_are_valid_onnx(op):
    """First- and second-order gradient graphs pass the full ONNX checker."""
    x = np.random.default_rng(13).standard_normal((2, 3, 4))
    if op == "CumSum":
        g = one_node_graph(op, {"x": x, "axis": np.asarray(1, dtype=np.int64)}, {"exclusive": 1})
    else:
        g = reduction_graph(op, x, [0, -1], keepdims=0)
    lg, _ = with_loss(g, rg.Session(g).run({"x": x}))
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    h = gg.copy()
    h.nodes.append(Node("ReduceSumSquare", ["x_grad"], ["s"], {"keepdims": 0}, name="s"))
    h.outputs = [ValueInfo("s")]
    with warnings.catch_warnings():  # CumSum and ReduceSum are linear: no second-order path
        warnings.simplefilter("ignore")
        onnx.checker.check_model(rg.to_onnx(rg.gradient(h, loss="s", wrt=["x"])), full_check=True)
