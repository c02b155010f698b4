"""VJP rules of the pooling and resampling operators (MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool,
LRN, DepthToSpace, SpaceToDepth, Resize), checked three ways by tests/harness.py (central differences,
PyTorch autograd with the same parameters, second order) over drawn attributes, plus explicit cases: ties
(MaxPool routes to the first maximum as PyTorch does, GlobalMaxPool splits equally), count_include_pad both
ways, ceil_mode, auto_pad, dilations, and float32 graphs under onnxruntime.

Known onnx reference-evaluator bugs (onnx 1.23) that shape the cases: LRN loops over the batch instead of the
channels (correct only when N == C), GlobalMaxPool reduces the wrong axes unless the input is 4-D, and MaxPool
with unit strides and dilations mishandles pads unless the input is 4-D. Where a float64 case would hit one
of them it runs in float32 under onnxruntime instead."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import _ort, check_rule, one_node_graph, with_loss
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import revgraph as rg
from revgraph.autodiff.rules.pool import resize_matrix
from revgraph.errors import GraphError
from revgraph.ir import ValueInfo

FAST = settings(max_examples=8, deadline=None)
MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def torch_pad(pads: list[int]) -> list[int]:
    k = len(pads) // 2
    return [p for i in reversed(range(k)) for p in (pads[i], pads[i + k])]


def grads_both_backends(g, feeds, u, wrt):
    """revgraph's gradients of ``sum(y0 * u)`` from onnxruntime (or the reference evaluator where
    onnxruntime has no kernel) and from the reference evaluator."""
    lg, _ = with_loss(g, {"y0": u})
    gg = rg.gradient(lg, loss="loss", wrt=wrt)
    runs = [_ort(gg)({**feeds, "y0_u": u}), rg.Session(gg, backend="reference").run({**feeds, "y0_u": u})]
    return [{w: r[f"{w}_grad"] for w in wrt} for r in runs]


def ort_vs_torch(op, x, attrs, torch_fn, seed=0, **graph_kw):
    """revgraph's float32 gradient run by onnxruntime against float64 PyTorch autograd."""
    tx = torch.tensor(x, requires_grad=True)
    y = torch_fn(tx)
    u = np.random.default_rng(seed).standard_normal(tuple(y.shape))
    (y * torch.tensor(u)).sum().backward()
    g = one_node_graph(op, {"x": x.astype(np.float32), **graph_kw}, attrs, float_inputs=["x"])
    lg, _ = with_loss(g, {"y0": u.astype(np.float32)})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    out = rg.Session(gg, backend="onnxruntime").run({"x": x.astype(np.float32), "y0_u": u.astype(np.float32)})
    np.testing.assert_allclose(out["x_grad"], tx.grad.numpy(), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------ MaxPool


@st.composite
def pool_case(draw, avg: bool):
    nd = draw(st.integers(1, 3))
    kernel = draw(st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    strides = draw(st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    ceil = draw(st.booleans())
    dilations = [1] * nd if ceil else draw(st.lists(st.integers(1, 2), min_size=nd, max_size=nd))
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    if ceil:  # PyTorch's own padding (symmetric, at most half the kernel), so its ceil-mode rule applies
        half = [draw(st.integers(0, k // 2)) for k in kernel]
        pads = half + half
    else:
        pads = [draw(st.integers(0, min(2, k - 1))) for k in kernel * 2]  # onnxruntime: pads below the kernel
    if not avg and all(s == 1 for s in strides) and all(d == 1 for d in dilations):
        # the reference evaluator's unit-stride MaxPool reads pads as [top, bottom, left, right] and only for
        # 4-D inputs
        pads = [pads[0]] * (2 * nd) if nd == 2 else [0] * (2 * nd)
    top = 6 if nd < 3 else 4
    low = [s if ceil else s - pads[i] - pads[i + nd] for i, s in enumerate(span)]  # PyTorch: no smaller than the kernel
    dims = [draw(st.integers(max(1, lo), top + s)) for lo, s in zip(low, span, strict=True)]
    if ceil:  # ONNX shape inference keeps a last window that starts in the end padding; runtimes drop it
        for d, k, s, p in zip(dims, span, strides, pads[:nd], strict=True):
            assume(-(-(d + 2 * p - k) // s) * s < d + p)
        if avg:  # the reference evaluator pads a ceil-mode input at the front too when it lacks 2+ positions
            assume(all(s <= 2 for s in strides))
    assume(windows_see_input(dims, kernel, strides, dilations, pads, ceil))
    return {"nd": nd, "kernel": kernel, "strides": strides, "dilations": dilations, "pads": pads, "ceil": ceil,
            "dims": dims, "cip": draw(st.integers(0, 1)), "n": draw(st.integers(1, 2)), "c": draw(st.integers(1, 3)),
            "seed": draw(st.integers(0, 2**31 - 1))}


def windows_see_input(dims, kernel, strides, dilations, pads, ceil):
    """Every window reads at least one input element (a window of padding only has no defined gradient)."""
    nd = len(dims)
    for i in range(nd):
        span = (kernel[i] - 1) * dilations[i] + 1
        length = dims[i] + pads[i] + pads[nd + i] - span
        out = (-(-length // strides[i]) if ceil else length // strides[i]) + 1
        for o in range(out):
            taps = [o * strides[i] + t * dilations[i] - pads[i] for t in range(kernel[i])]
            if not any(0 <= q < dims[i] for q in taps):
                return False
    return True


def max_pool_attrs(case):
    return {"kernel_shape": case["kernel"], "strides": case["strides"], "dilations": case["dilations"],
            "pads": case["pads"], "ceil_mode": int(case["ceil"])}


def torch_max_pool(case):
    nd, k, s, d, pads = case["nd"], case["kernel"], case["strides"], case["dilations"], case["pads"]
    if case["ceil"]:
        return lambda x: MAX_POOL[nd](x, k, s, pads[:nd], d, True)
    return lambda x: MAX_POOL[nd](F.pad(x, torch_pad(pads), value=-math.inf), k, s, 0, d)


@FAST
@given(case=pool_case(avg=False))
def test_max_pool(case):
    x = np.random.default_rng(case["seed"]).standard_normal((case["n"], case["c"], *case["dims"]))
    g = one_node_graph("MaxPool", {"x": x}, max_pool_attrs(case))
    check_rule(g, {"x": x}, torch_max_pool(case), seed=case["seed"])


def test_max_pool_with_indices_output():
    case = {"nd": 2, "kernel": [3, 3], "strides": [2, 2], "dilations": [1, 1], "pads": [1, 1, 1, 1], "ceil": False}
    x = np.random.default_rng(1).standard_normal((2, 3, 7, 6))
    g = one_node_graph("MaxPool", {"x": x}, {**max_pool_attrs(case), "storage_order": 1}, n_out=2)
    check_rule(g, {"x": x}, torch_max_pool(case), outputs=["y0"])


@pytest.mark.parametrize("name, attrs, shape", [
    ("same_upper", {"kernel_shape": [2, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 5, 6)),
    ("same_lower", {"kernel_shape": [3, 3], "strides": [2, 1], "auto_pad": "SAME_LOWER"}, (1, 2, 6, 5)),
    ("valid", {"kernel_shape": [2], "strides": [3], "auto_pad": "VALID"}, (2, 2, 8)),
    ("defaults", {"kernel_shape": [2, 2]}, (1, 3, 4, 5)),
    ("dilation2_odd", {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2]}, (1, 2, 7, 7)),
])
def test_max_pool_explicit(name, attrs, shape):
    x = np.random.default_rng(2).standard_normal(shape)
    nd = len(shape) - 2
    k, s, d = attrs["kernel_shape"], attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    pads = [0] * (2 * nd)
    if attrs.get("auto_pad", "").startswith("SAME"):  # spec: odd pad at the end for SAME_UPPER
        upper = attrs["auto_pad"] == "SAME_UPPER"
        tot = [max(0, (-(-n // st_) - 1) * st_ + (kk - 1) * dd + 1 - n) for n, kk, st_, dd in zip(shape[2:], k, s, d)]
        pads = [t // 2 if upper else t - t // 2 for t in tot] + [t - t // 2 if upper else t // 2 for t in tot]
    fn = lambda x: MAX_POOL[nd](F.pad(x, torch_pad(pads), value=-math.inf), k, s, 0, d)
    check_rule(one_node_graph("MaxPool", {"x": x}, attrs), {"x": x}, fn)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [2, 2], "strides": [1, 2], "dilations": [2, 1]},
    {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
])
def test_max_pool_ties_go_to_the_first_maximum(attrs):
    """Many tied maxima in overlapping windows: each window's cotangent goes to the first maximum in the
    window, the element PyTorch's MaxPool reports (central differences are undefined at ties)."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2, (2, 2, 5, 6)).astype(np.float64)
    k, s, d = attrs["kernel_shape"], attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    pads, ceil = attrs.get("pads", [0] * 4), bool(attrs.get("ceil_mode", 0))
    tx = torch.tensor(x, requires_grad=True)
    y = F.max_pool2d(tx, k, s, pads[:2], d, ceil) if ceil else F.max_pool2d(
        F.pad(tx, torch_pad(pads), value=-math.inf), k, s, 0, d)
    u = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(u)).sum().backward()
    for got in grads_both_backends(one_node_graph("MaxPool", {"x": x}, attrs), {"x": x}, u, ["x"]):
        np.testing.assert_allclose(got["x"], tx.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_max_pool_unknown_spatial_dims_is_a_graph_error():
    x = np.zeros((1, 2, 4, 4))
    g = one_node_graph("MaxPool", {"x": x}, {"kernel_shape": [2, 2]})
    g.inputs[0] = ValueInfo("x", x.dtype, (1, 2, "H", "W"))
    lg, _ = with_loss(g, {"y0": np.zeros((1, 2, 3, 3))})
    with pytest.raises(GraphError, match=r"node 'op' \(MaxPool\).*spatial dimensions"):
        rg.gradient(lg, loss="loss", wrt=["x"])


def test_max_pool_float32_onnxruntime():
    x = np.random.default_rng(4).standard_normal((2, 3, 7, 6))
    attrs = {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]}
    ort_vs_torch("MaxPool", x, attrs,
                 lambda x: F.max_pool2d(F.pad(x, [0, 1, 1, 1], value=-math.inf), [3, 2], [2, 1], 0, [1, 2]))


# ------------------------------------------------------------------------------------------ AveragePool


def torch_avg_pool(case):
    """ONNX AveragePool in PyTorch: the sum over the window's inside elements (a depthwise Conv of ones over
    the zero-padded input) divided by the window size (count_include_pad=1) or by the number of inside
    elements; in ceil mode, PyTorch's own avg_pool (symmetric pads, no dilation)."""
    nd, k, s, d, pads, cip = case["nd"], case["kernel"], case["strides"], case["dilations"], case["pads"], case["cip"]
    if case["ceil"]:
        return lambda x: AVG_POOL[nd](x, k, s, pads[:nd], True, bool(cip))

    def fn(x):
        c = x.shape[1]
        w = torch.ones((c, 1, *k), dtype=x.dtype)
        total = CONV[nd](F.pad(x, torch_pad(pads)), w, None, s, 0, d, c)
        count = float(np.prod(k)) if cip else CONV[nd](F.pad(torch.ones_like(x), torch_pad(pads)), w, None, s, 0, d, c)
        return total / count
    return fn


def avg_pool_attrs(case):
    return {"kernel_shape": case["kernel"], "strides": case["strides"], "dilations": case["dilations"],
            "pads": case["pads"], "ceil_mode": int(case["ceil"]), "count_include_pad": case["cip"]}


@FAST
@given(case=pool_case(avg=True))
def test_average_pool(case):
    x = np.random.default_rng(case["seed"]).standard_normal((case["n"], case["c"], *case["dims"]))
    g = one_node_graph("AveragePool", {"x": x}, avg_pool_attrs(case))
    check_rule(g, {"x": x}, torch_avg_pool(case), seed=case["seed"])


def _avg(**kw):
    base = {"nd": 2, "kernel": [3, 3], "strides": [1, 1], "dilations": [1, 1], "pads": [1, 1, 1, 1], "ceil": False,
            "cip": 0}
    base.update(kw)
    return base


EXPLICIT_AVG = {
    "include_pad": _avg(cip=1),
    "exclude_pad": _avg(cip=0),
    "ceil_include_pad": _avg(strides=[2, 2], ceil=True, cip=1),
    "ceil_exclude_pad": _avg(strides=[2, 2], ceil=True, cip=0),
    "ceil_no_pads_include": _avg(strides=[2, 2], pads=[0, 0, 0, 0], ceil=True, cip=1),
    "asymmetric_pads_include": _avg(kernel=[3, 2], pads=[0, 1, 2, 0], strides=[2, 1], cip=1),
    "dilation2_stride2_odd": _avg(kernel=[2, 2], dilations=[2, 2], strides=[2, 2]),
    "pool3d_include": _avg(nd=3, kernel=[3, 3, 2], strides=[2, 2, 1], dilations=[1, 1, 1], pads=[1, 1, 0, 1, 1, 1],
                           cip=1),
}


@pytest.mark.parametrize("name", sorted(EXPLICIT_AVG))
def test_average_pool_explicit(name):
    case = EXPLICIT_AVG[name]
    dims = (5, 7, 4)[: case["nd"]] if case["nd"] == 3 else (7, 6)
    x = np.random.default_rng(5).standard_normal((2, 2, *dims))
    check_rule(one_node_graph("AveragePool", {"x": x}, avg_pool_attrs(case)), {"x": x}, torch_avg_pool(case))


@pytest.mark.parametrize("auto", ["SAME_UPPER", "SAME_LOWER"])
def test_average_pool_auto_pad(auto):
    x = np.random.default_rng(6).standard_normal((1, 2, 5, 6))
    tot = [1, 0]  # total pads, by hand: 3 outputs each, (3-1)*2 + 2 - 5 = 1 and (3-1)*2 + 2 - 6 = 0
    upper = auto == "SAME_UPPER"
    pads = [t // 2 if upper else t - t // 2 for t in tot] + [t - t // 2 if upper else t // 2 for t in tot]
    case = _avg(kernel=[2, 2], strides=[2, 2], pads=pads, cip=0)
    g = one_node_graph("AveragePool", {"x": x}, {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": auto})
    check_rule(g, {"x": x}, torch_avg_pool(case))


def test_average_pool_unknown_dims():
    """Symbolic batch and spatial dimensions: the divisors and the fitting come from Shape values."""
    case = _avg(kernel=[3, 2], strides=[2, 3], pads=[1, 0, 1, 1], cip=0)
    x = np.random.default_rng(7).standard_normal((2, 3, 7, 8))
    g = one_node_graph("AveragePool", {"x": x}, avg_pool_attrs(case))
    g.inputs[0] = ValueInfo("x", x.dtype, ("N", 3, "H", "W"))
    check_rule(g, {"x": x}, torch_avg_pool(case))


@pytest.mark.parametrize("cip", [0, 1])
def test_average_pool_float32_onnxruntime(cip):
    x = np.random.default_rng(8).standard_normal((2, 3, 7, 6))
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": cip}
    ort_vs_torch("AveragePool", x, attrs, lambda x: F.avg_pool2d(x, 3, 2, 1, True, bool(cip)))


# ------------------------------------------------------------------------------------------ global pools


@FAST
@given(rank=st.integers(3, 5), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_global_average_pool(rank, seed, data):
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    x = np.random.default_rng(seed).standard_normal(shape)
    axes = tuple(range(2, rank))
    check_rule(one_node_graph("GlobalAveragePool", {"x": x}), {"x": x}, lambda x: x.mean(axes, keepdim=True), seed=seed)


@FAST
@given(shape=st.lists(st.integers(1, 4), min_size=4, max_size=4), seed=st.integers(0, 2**31 - 1))
def test_global_max_pool(shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape)
    check_rule(one_node_graph("GlobalMaxPool", {"x": x}), {"x": x}, lambda x: x.amax((2, 3), keepdim=True), seed=seed)


@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 2, 3, 2, 4)])
def test_global_max_pool_other_ranks_float32_onnxruntime(shape):
    x = np.random.default_rng(9).standard_normal(shape)
    axes = tuple(range(2, len(shape)))
    ort_vs_torch("GlobalMaxPool", x, {}, lambda x: x.amax(axes, keepdim=True))


def test_global_max_pool_ties_split_equally():
    """DESIGN.md section 5: the cotangent of a maximum is shared equally among the tied elements
    (PyTorch's amax does the same)."""
    x = np.array([[[[1.0, 3.0], [3.0, 0.0]], [[2.0, 2.0], [2.0, 2.0]]]])
    u = np.array([[[[6.0]], [[-4.0]]]])
    tx = torch.tensor(x, requires_grad=True)
    (tx.amax((2, 3), keepdim=True) * torch.tensor(u)).sum().backward()
    expected = np.array([[[[0.0, 3.0], [3.0, 0.0]], [[-1.0, -1.0], [-1.0, -1.0]]]])
    np.testing.assert_allclose(tx.grad.numpy(), expected)
    for got in grads_both_backends(one_node_graph("GlobalMaxPool", {"x": x}), {"x": x}, u, ["x"]):
        np.testing.assert_allclose(got["x"], expected)


# ------------------------------------------------------------------------------------------ LRN


def torch_lrn(size, alpha, beta, bias):
    """ONNX "LRN" written from the spec: the window of channel c is [c - floor((size-1)/2), c +
    ceil((size-1)/2)] (PyTorch's local_response_norm centres even windows the other way)."""
    lo, hi = (size - 1) // 2, math.ceil((size - 1) / 2)

    def fn(x):
        sq = x * x
        c = x.shape[1]
        sums = torch.stack([sq[:, max(0, i - lo):min(c, i + hi + 1)].sum(1) for i in range(c)], 1)
        return x / (bias + alpha / size * sums) ** beta
    return fn


@FAST
@given(c=st.integers(1, 4), h=st.integers(1, 3), w=st.integers(1, 3), size=st.integers(1, 5),
       alpha=st.floats(0.1, 2.0), beta=st.floats(0.25, 1.5), bias=st.floats(0.5, 2.0), seed=st.integers(0, 2**31 - 1))
def test_lrn(c, h, w, size, alpha, beta, bias, seed):
    x = np.random.default_rng(seed).standard_normal((c, c, h, w))  # N == C: see the module docstring
    g = one_node_graph("LRN", {"x": x}, {"size": size, "alpha": alpha, "beta": beta, "bias": bias})
    check_rule(g, {"x": x}, torch_lrn(size, alpha, beta, bias), seed=seed)


def test_lrn_default_attributes_match_pytorch():
    x = np.random.default_rng(10).standard_normal((3, 3, 2, 4)) * 30
    check_rule(one_node_graph("LRN", {"x": x}, {"size": 3}), {"x": x},
               lambda x: F.local_response_norm(x, 3, 1e-4, 0.75, 1.0))


def test_lrn_float32_onnxruntime():
    x = np.random.default_rng(11).standard_normal((2, 5, 3, 2))
    ort_vs_torch("LRN", x, {"size": 5, "alpha": 0.5, "beta": 0.75, "bias": 1.5}, torch_lrn(5, 0.5, 0.75, 1.5))


# ------------------------------------------------------------------------------------------ DepthToSpace / SpaceToDepth


def torch_depth_to_space(b, mode):
    """ONNX "DepthToSpace": CRD is PyTorch's pixel_shuffle; DCR is the spec's reshape/transpose."""
    def fn(x):
        n, c, h, w = x.shape
        if mode == "CRD":
            return F.pixel_shuffle(x, b)
        return x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2).reshape(n, c // (b * b), h * b, w * b)
    return fn


@FAST
@given(n=st.integers(1, 2), c=st.integers(1, 2), b=st.integers(1, 3), h=st.integers(1, 3), w=st.integers(1, 3),
       mode=st.sampled_from(["DCR", "CRD"]), seed=st.integers(0, 2**31 - 1))
def test_depth_to_space(n, c, b, h, w, mode, seed):
    x = np.random.default_rng(seed).standard_normal((n, c * b * b, h, w))
    g = one_node_graph("DepthToSpace", {"x": x}, {"blocksize": b, "mode": mode})
    check_rule(g, {"x": x}, torch_depth_to_space(b, mode), seed=seed)


def test_depth_to_space_default_mode_and_unknown_dims():
    x = np.random.default_rng(12).standard_normal((2, 8, 2, 3))
    g = one_node_graph("DepthToSpace", {"x": x}, {"blocksize": 2, "mode": "CRD"})
    g.inputs[0] = ValueInfo("x", x.dtype, ("N", "C", "H", "W"))
    check_rule(g, {"x": x}, torch_depth_to_space(2, "CRD"))
    check_rule(one_node_graph("DepthToSpace", {"x": x}, {"blocksize": 2}), {"x": x}, torch_depth_to_space(2, "DCR"))


@FAST
@given(n=st.integers(1, 2), c=st.integers(1, 3), b=st.integers(1, 3), h=st.integers(1, 2), w=st.integers(1, 2),
       seed=st.integers(0, 2**31 - 1))
def test_space_to_depth(n, c, b, h, w, seed):
    x = np.random.default_rng(seed).standard_normal((n, c, h * b, w * b))

    def fn(x):  # the ONNX "SpaceToDepth" spec: reshape, transpose (0, 3, 5, 1, 2, 4), reshape
        return x.reshape(n, c, h, b, w, b).permute(0, 3, 5, 1, 2, 4).reshape(n, c * b * b, h, w)
    check_rule(one_node_graph("SpaceToDepth", {"x": x}, {"blocksize": b}), {"x": x}, fn, seed=seed)


# ------------------------------------------------------------------------------------------ Resize


def resize_graph(x, attrs, scales=None, sizes=None):
    ins = {"x": x, "roi": np.zeros(0, np.float32)}
    if scales is not None:
        ins["scales"] = np.asarray(scales, np.float32)
    if sizes is not None:
        ins["sizes"] = np.asarray(sizes, np.int64)
    g = one_node_graph("Resize", ins, attrs, float_inputs=["x"])
    if sizes is not None:
        g.nodes[0].inputs = ["x", "roi", "", "sizes"]
    return g


@st.composite
def resize_case(draw):
    rank = draw(st.integers(3, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    axes = sorted(draw(st.sets(st.integers(1, rank - 1), min_size=1, max_size=rank - 1)))
    mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
    ctm = draw(st.sampled_from(["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel",
                                "half_pixel_symmetric"]))
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm, "axes": axes}
    if mode == "nearest":
        attrs["nearest_mode"] = draw(st.sampled_from(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))
    if mode == "cubic":
        attrs["exclude_outside"] = draw(st.integers(0, 1))
    # align_corners and pytorch_half_pixel read the output length, which onnxruntime (and the spec) take as the
    # integer size and the reference evaluator as in * scale: keep the two equal for them
    if mode == "cubic":  # the reference evaluator computes cubic weights in float32: keep them exact (dyadic)
        ctm = draw(st.sampled_from(["half_pixel", "asymmetric", "half_pixel_symmetric"]))
        attrs["coordinate_transformation_mode"] = ctm
    exact = ctm in ("align_corners", "pytorch_half_pixel")
    use_sizes = exact or (mode != "cubic" and draw(st.booleans()))
    if use_sizes:
        sizes = [draw(st.integers(1, 7)) for _ in axes]
        policy = "stretch" if exact else draw(st.sampled_from(["stretch", "not_larger", "not_smaller"]))
        attrs["keep_aspect_ratio_policy"] = policy
        scales = None
        outs = sizes if policy == "stretch" else None
    else:
        choices = [0.5, 2.0] if mode == "cubic" else [0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0]
        scales = [draw(st.sampled_from(choices)) for _ in axes]
        sizes = None
        outs = [math.floor(shape[a] * s) for a, s in zip(axes, scales, strict=True)]
    if outs is not None:
        assume(all(o >= 1 for o in outs))
    return shape, attrs, scales, sizes, draw(st.integers(0, 2**31 - 1))


@FAST
@given(case=resize_case())
def test_resize(case):
    shape, attrs, scales, sizes, seed = case
    if sizes is not None and attrs.get("keep_aspect_ratio_policy") != "stretch":
        common = [o / shape[a] for a, o in zip(attrs["axes"], sizes, strict=True)]
        pick = min(common) if attrs["keep_aspect_ratio_policy"] == "not_larger" else max(common)
        assume(all(int(pick * shape[a] + 0.5) >= 1 for a in attrs["axes"]))
    x = np.random.default_rng(seed).standard_normal(shape)
    check_rule(resize_graph(x, attrs, scales, sizes), {"x": x}, seed=seed)


@pytest.mark.parametrize("name, attrs, scales, sizes, torch_fn", [
    ("bilinear_half_pixel", {"mode": "linear"}, [1, 1, 2, 1.5], None,
     lambda x: F.interpolate(x, scale_factor=(2, 1.5), mode="bilinear", align_corners=False)),
    ("bilinear_down", {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, None, [2, 3, 3, 2],
     lambda x: F.interpolate(x, size=(3, 2), mode="bilinear", align_corners=False)),
    ("bilinear_align_corners", {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, None,
     [2, 3, 7, 3], lambda x: F.interpolate(x, size=(7, 3), mode="bilinear", align_corners=True)),
    ("nearest_floor_asymmetric",
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 2, 3], None,
     lambda x: F.interpolate(x, scale_factor=(2, 3), mode="nearest")),
    ("nearest_exact", {"mode": "nearest", "nearest_mode": "round_prefer_ceil"}, None, [2, 3, 3, 7],
     lambda x: F.interpolate(x, size=(3, 7), mode="nearest-exact")),
    ("bicubic", {"mode": "cubic"}, [1, 1, 2, 2], None,
     lambda x: F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=False)),
    ("linear_1d_axes", {"mode": "linear", "axes": [3]}, [2.5], None,
     lambda x: F.interpolate(x.flatten(0, 1), scale_factor=2.5, mode="linear").reshape(2, 3, 4, 12)),
])
def test_resize_matches_pytorch(name, attrs, scales, sizes, torch_fn):
    x = np.random.default_rng(13).standard_normal((2, 3, 4, 5))
    check_rule(resize_graph(x, attrs, scales, sizes), {"x": x}, torch_fn)


@pytest.mark.parametrize("attrs, scales", [
    ({"mode": "linear", "coordinate_transformation_mode": ctm}, sc)
    for ctm in ["half_pixel", "asymmetric", "pytorch_half_pixel", "half_pixel_symmetric"]
    for sc in ([2.0, 3.0], [0.5, 0.75])
] + [
    ({"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": nm}, [2.0, 0.5])
    for nm in ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
] + [({"mode": "cubic", "exclude_outside": 1}, [1.5, 2.0]), ({"mode": "cubic", "cubic_coeff_a": -0.5}, [0.5, 2.0])])
def test_resize_matrices_reproduce_onnxruntime(attrs, scales):
    """The interpolation matrices the VJP transposes give onnxruntime's float32 forward (the float64 tests run
    on the reference evaluator), so the VJP is the adjoint of what both runtimes compute."""
    x = np.random.default_rng(14).standard_normal((2, 3, 4, 6)).astype(np.float32)
    y = rg.Session(resize_graph(x, attrs, [1, 1, *scales]), backend="onnxruntime").run({"x": x})["y0"]
    a_h = resize_matrix(4, math.floor(4 * scales[0]), scales[0], attrs)
    a_w = resize_matrix(6, math.floor(6 * scales[1]), scales[1], attrs)
    np.testing.assert_allclose(y, np.einsum("nchw,ph,qw->ncpq", x.astype(np.float64), a_h, a_w), rtol=1e-5, atol=1e-5)


def test_resize_identity_scales():
    x = np.random.default_rng(15).standard_normal((1, 2, 3, 3))
    check_rule(resize_graph(x, {"mode": "linear"}, [1, 1, 1, 1]), {"x": x}, lambda x: x * 1)


@pytest.mark.parametrize("attrs, match", [
    ({"mode": "linear", "antialias": 1}, "antialias"),
    ({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}, "tf_crop_and_resize"),
])
def test_resize_unsupported_is_a_graph_error(attrs, match):
    x = np.zeros((1, 1, 4, 4))
    lg, _ = with_loss(resize_graph(x, attrs, [1, 1, 0.5, 0.5]), {"y0": np.zeros((1, 1, 2, 2))})
    with pytest.raises(GraphError, match=rf"node 'op' \(Resize\).*{match}"):
        rg.gradient(lg, loss="loss", wrt=["x"])


def test_resize_non_constant_scales_is_a_graph_error():
    x = np.zeros((1, 1, 4, 4))
    g = one_node_graph("Resize", {"x": x, "roi": np.zeros(0, np.float32), "scales": np.ones(4, np.float32)},
                       {"mode": "linear"}, float_inputs=["x", "scales"])
    lg, _ = with_loss(g, {"y0": np.zeros((1, 1, 4, 4))})
    with pytest.raises(GraphError, match=r"node 'op' \(Resize\).*constant scales or sizes"):
        rg.gradient(lg, loss="loss", wrt=["x"])


def test_global_max_pool_sends_exact_zeros_off_the_maxima_for_an_infinite_cotangent():
    # loss = sum(1 / GlobalMaxPool(x)) with a maximum of 0: the cotangent is -inf there; the other positions must
    # get an exact 0 (a selection, as PyTorch's amax backward), not -inf * 0 = NaN
    from revgraph.ir import Graph, Node

    g = Graph([Node("GlobalMaxPool", ["x"], ["y"], name="gmp"), Node("Reciprocal", ["y"], ["r"], name="rec"),
               Node("ReduceSum", ["r"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float32, (1, 2, 3))], [ValueInfo("loss", np.float32, ())])
    x = np.array([[[0.0, -1.0, -2.0], [-0.5, 0.25, -3.0]]], np.float32)
    got = rg.Session(rg.gradient(g)).run({"x": x})["x_grad"]
    # PyTorch's amax backward multiplies by the mask too (NaN off the maximum); its max_pool1d backward scatters
    xt = torch.tensor(x, requires_grad=True)
    (1 / F.max_pool1d(xt, 3)).sum().backward()
    assert np.array_equal(got, xt.grad.numpy()), (got, xt.grad)
    assert got[0, 0, 0] == -np.inf and np.array_equal(got[0, 0, 1:], [0, 0])
