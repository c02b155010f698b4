"""VJP rules of the reductions and CumSum, checked three ways by tests/harness.py (central differences,
PyTorch autograd, second order), plus the conventions of DESIGN.md section 5: ties split equally, the 0
subgradient of a zero norm, products with zeros."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from harness import check_rule, one_node_graph, with_loss
from hypothesis import given, settings
from hypothesis import strategies as st

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
