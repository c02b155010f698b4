"""VJP rules of the pooling and resampling operators (MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool,
LpPool, GlobalLpPool, MaxUnpool, MaxRoiPool, RoiAlign, LRN, DepthToSpace, SpaceToDepth, Resize), checked three
ways by tests/kit/harness.py (central differences, PyTorch autograd with the same parameters, second order) over
drawn attributes, plus explicit cases: ties (MaxPool and MaxRoiPool route to the first maximum as PyTorch does,
GlobalMaxPool splits equally, RoiAlign's max mode to the first corner in the kernel's order), zero windows of
the Lp pools, count_include_pad both ways, ceil_mode, auto_pad, dilations, float32 graphs under onnxruntime,
and Resize with its scales, sizes and roi as graph inputs (the ONNX backend node test models among them).

Known onnx reference-evaluator bugs (onnx 1.23) that shape the cases: LRN loops over the batch instead of the
channels (correct only when N == C), GlobalMaxPool reduces the wrong axes unless the input is 4-D, MaxPool
with unit strides and dilations mishandles pads unless the input is 4-D (and makes too many outputs in ceil
mode), LpPool mishandles ceil-mode windows that run past the padded input, Resize computes cubic weights in
float32, and there is no GlobalLpPool or MaxRoiPool kernel at all. Where a float64 case would hit one of them
it runs in float32 under onnxruntime instead (against PyTorch in float64, first and second order)."""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kit.harness import check_rule, double_backward, one_node_graph, ort_runner, with_loss

import revgraph as rg
from revgraph.autodiff.rules.resize import resize_matrix
from revgraph.errors import GraphError
from revgraph.ir import Node, ValueInfo

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
    runs = [ort_runner(gg)({**feeds, "y0_u": u}), rg.Session(gg, backend="reference").run({**feeds, "y0_u": u})]
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
        # 4-D inputs, and in ceil mode makes too many outputs (5 x 5 for a 2 x 2 input, kernel 2, pads 1)
        pads = [pads[0]] * (2 * nd) if nd == 2 else [0] * (2 * nd)
        assume(not ceil or not any(pads))
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
        tot = [max(0, (-(-n // st_) - 1) * st_ + (kk - 1) * dd + 1 - n)
               for n, kk, st_, dd in zip(shape[2:], k, s, d, strict=True)]
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


@pytest.mark.parametrize("op", ["MaxPool", "LpPool"])
def test_pool_unknown_spatial_dims_is_a_graph_error(op):
    x = np.zeros((1, 2, 4, 4))
    g = one_node_graph(op, {"x": x}, {"kernel_shape": [2, 2]})
    g.inputs[0] = ValueInfo("x", x.dtype, (1, 2, "H", "W"))
    lg, _ = with_loss(g, {"y0": np.zeros((1, 2, 3, 3))})
    with pytest.raises(GraphError, match=rf"node 'op' \({op}\).*spatial dimensions"):
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


# ------------------------------------------------------------------------------------------ float32 helper


def ort32_vs_torch(g, feeds, torch_fn, wrt, seed=0, rtol=1e-4, atol=1e-5, second_order=True):
    """For operators no runtime runs in float64 (onnxruntime has float kernels only and the onnx reference
    evaluator none: GlobalLpPool, MaxRoiPool): revgraph's float32 gradient and Hessian-vector product under
    onnxruntime against PyTorch's float64 autograd (``torch_fn`` computes the same function, written from the
    spec), at ``feeds``."""
    rng = np.random.default_rng(seed)
    fwd = rg.Session(g).run(feeds)
    lg, outs = with_loss(g, fwd)
    us = {f"{y}_u": rng.standard_normal(np.shape(fwd[y])).astype(np.float32) for y in outs}
    gg = rg.gradient(lg, loss="loss", wrt=wrt)
    got = rg.Session(gg).run({**feeds, **us})
    tin = {k: torch.tensor(v.astype(np.float64) if v.dtype.kind == "f" else v, requires_grad=k in wrt)
           for k, v in feeds.items()}
    tout = torch_fn(**tin)
    tout = tout if isinstance(tout, (tuple, list)) else [tout]
    for y, t in zip(outs, tout, strict=True):
        np.testing.assert_allclose(fwd[y], t.detach().numpy(), rtol=1e-5, atol=1e-5, err_msg=f"forward {y}")
    total = sum((t * torch.tensor(us[f"{y}_u"], dtype=torch.float64)).sum() for y, t in zip(outs, tout, strict=True))
    tg = torch.autograd.grad(total, [tin[w] for w in wrt], create_graph=second_order)
    for w, t in zip(wrt, tg, strict=True):
        np.testing.assert_allclose(got[f"{w}_grad"], t.detach().numpy(), rtol=rtol, atol=atol, err_msg=f"grad {w}")
    if not second_order:
        return got
    vs = {f"{w}_v": rng.standard_normal(feeds[w].shape).astype(np.float32) for w in wrt}
    hvp = double_backward(gg, wrt, feeds, np.float32)
    res = rg.Session(hvp).run({**feeds, **us, **vs})
    s = sum((t * torch.tensor(vs[f"{w}_v"], dtype=torch.float64)).sum() for w, t in zip(wrt, tg, strict=True))
    th = torch.autograd.grad(s, [tin[w] for w in wrt], allow_unused=True) if s.requires_grad else [None] * len(wrt)
    for w, name, t in zip(wrt, hvp.output_names[-len(wrt):], th, strict=True):
        expected = np.zeros(feeds[w].shape) if t is None else t.numpy()
        np.testing.assert_allclose(res[name], expected, rtol=rtol, atol=atol, err_msg=f"second order {w}")
    return got


# ------------------------------------------------------------------------------------------ LpPool


def torch_lp_pool(nd, kernel, strides, dilations, pads, p, out):
    """ONNX "LpPool" from the spec: ``(sum over the window of |x|^p)^(1/p)``, padding reading 0 (a depthwise
    Conv of ``|x|^p`` with a ones kernel, padded at the end far enough for ceil mode, cut to ``out``).
    PyTorch's own ``lp_pool`` takes ``x^p`` (not ``|x|^p``) and has no padding or dilation."""
    def fn(x):
        c = x.shape[1]
        w = torch.ones((c, 1, *kernel), dtype=x.dtype)
        extra = [*pads[:nd], *[a + s * k for a, s, k in zip(pads[nd:], strides, kernel, strict=True)]]
        s = CONV[nd](F.pad(x.abs() ** p, torch_pad(extra)), w, None, strides, 0, dilations, c)
        return s[(slice(None), slice(None), *[slice(0, o) for o in out])] ** (1.0 / p)
    return fn


LP_CASES = {
    "p2_default": ([2, 2], {}),
    "p1_stride_pads": ([3, 3], {"p": 1, "strides": [2, 2], "pads": [1, 0, 1, 2]}),
    "p3_dilation": ([2, 2], {"p": 3, "dilations": [2, 1], "strides": [1, 2]}),
    "p4_overlap": ([3, 2], {"p": 4, "pads": [1, 1, 1, 1]}),
    "same_upper": ([3, 2], {"strides": [2, 2], "auto_pad": "SAME_UPPER", "p": 3}),
    "1d": ([3], {"strides": [2], "pads": [1, 1]}),
    "3d": ([2, 2, 2], {"p": 3, "strides": [1, 2, 1]}),
}


def _lp_geometry(shape, kernel, attrs):
    nd = len(kernel)
    strides, dilations = attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    pads = attrs.get("pads", [0] * 2 * nd)
    dims = shape[2:]
    if attrs.get("auto_pad") == "SAME_UPPER":
        tot = [max(0, (-(-n // s) - 1) * s + (k - 1) * d + 1 - n)
               for n, k, s, d in zip(dims, kernel, strides, dilations, strict=True)]
        pads = [t // 2 for t in tot] + [t - t // 2 for t in tot]
    ceil = bool(attrs.get("ceil_mode", 0))
    out = []
    for i, n in enumerate(dims):
        span = (kernel[i] - 1) * dilations[i] + 1
        length = n + pads[i] + pads[nd + i] - span
        o = (-(-length // strides[i]) if ceil else length // strides[i]) + 1
        out.append(o - ((o - 1) * strides[i] >= n + pads[i]) if ceil else o)
    return nd, strides, dilations, pads, out


@pytest.mark.parametrize("name", sorted(LP_CASES))
def test_lp_pool(name):
    """float64 under the reference evaluator (onnxruntime has float LpPool only): central differences, PyTorch,
    second order. (Ceil mode adds windows that run past the padded input, which the reference evaluator
    computes wrongly: tested in float32 under onnxruntime below.)"""
    kernel, extra = LP_CASES[name]
    nd = len(kernel)
    shape = (2, 2, *[7, 6, 5][:nd]) if nd < 3 else (1, 2, 4, 5, 4)
    x = np.random.default_rng(30).standard_normal(shape)
    attrs = {"kernel_shape": kernel, **extra}
    nd, strides, dilations, pads, out = _lp_geometry(shape, kernel, attrs)
    check_rule(one_node_graph("LpPool", {"x": x}, attrs), {"x": x},
               torch_lp_pool(nd, kernel, strides, dilations, pads, int(attrs.get("p", 2)), out))


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool_ceil_past_the_padding_float32_onnxruntime(p):
    """A ceil-mode window that runs past the padded input (it reads zeros there). The onnx reference evaluator
    computes these windows wrongly (its LpPool averages over the window's inside elements and rescales by the
    kernel size), so this runs in float32 under onnxruntime against PyTorch."""
    x = np.random.default_rng(31).standard_normal((2, 3, 6, 7)).astype(np.float32)
    attrs = {"kernel_shape": [3, 2], "pads": [1, 0, 1, 1], "strides": [2, 2], "ceil_mode": 1, "p": p}
    nd, strides, dilations, pads, out = _lp_geometry(x.shape, [3, 2], attrs)
    assert out == [4, 4]
    ort32_vs_torch(one_node_graph("LpPool", {"x": x}, attrs), {"x": x},
                   torch_lp_pool(nd, [3, 2], strides, dilations, pads, p, out), ["x"], second_order=p > 1)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool_zero_windows_get_the_zero_subgradient(p):
    """A window of zeros has the norm 0, whose gradient is 0 by convention (PyTorch's composite gives NaN:
    ``0^(1/p - 1) * 0``); a zero element of a nonzero window gets 0 too (``sign(0) = 0`` for p = 1)."""
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, 0], x[0, 0, 3, 3], x[0, 0, 2, 3] = 2.0, -1.0, 0.5
    u = np.array([[[[1.0, -2.0], [0.5, 3.0]]]])
    g = one_node_graph("LpPool", {"x": x}, {"kernel_shape": [2, 2], "strides": [2, 2], "p": p})
    got = grads_both_backends(g, {"x": x}, u, ["x"])[1]["x"]  # float64: the reference evaluator
    expected = np.zeros_like(x)
    expected[0, 0, 0, 0] = 1.0
    norm = (1.0 + 0.5**p) ** (1 / p)  # the bottom-right window: -1 and 0.5
    expected[0, 0, 3, 3] = 3.0 * -((1 / norm) ** (p - 1))
    expected[0, 0, 2, 3] = 3.0 * (0.5 / norm) ** (p - 1)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
    assert np.isfinite(got).all()


def test_lp_pool_strong_zeros_for_an_infinite_input():
    """An inf in one window makes that window's norm inf (and its local derivative inf / inf = NaN): a zero
    cotangent there still gives exact zeros, and the other windows are unaffected."""
    x = np.random.default_rng(32).standard_normal((1, 1, 4, 4)).astype(np.float32)
    x[0, 0, 0, 1] = np.inf
    u = np.array([[[[0.0, 1.0], [2.0, -1.0]]]], np.float32)
    g = one_node_graph("LpPool", {"x": x}, {"kernel_shape": [2, 2], "strides": [2, 2], "p": 2})
    lg, _ = with_loss(g, {"y0": u})
    got = rg.Session(rg.gradient(lg, loss="loss", wrt=["x"])).run({"x": x, "y0_u": u})["x_grad"]
    assert np.array_equal(got[0, 0, :2, :2], np.zeros((2, 2)))
    y = np.sqrt((x[0, 0, 2:, 2:].astype(np.float64) ** 2).sum())
    np.testing.assert_allclose(got[0, 0, 2:, 2:], -x[0, 0, 2:, 2:] / y, rtol=1e-5)


@pytest.mark.parametrize("p, shape", [(1, (2, 3, 4, 5)), (2, (2, 3, 5)), (3, (1, 2, 3, 2, 4))])
def test_global_lp_pool(p, shape):
    """GlobalLpPool: float32 under onnxruntime (no float64 kernel in either runtime) against PyTorch's float64
    ``norm``, first and second order."""
    x = np.random.default_rng(33).standard_normal(shape).astype(np.float32)
    axes = tuple(range(2, len(shape)))
    ort32_vs_torch(one_node_graph("GlobalLpPool", {"x": x}, {"p": p}), {"x": x},
                   lambda x: (x.abs() ** p).sum(axes, keepdim=True) ** (1.0 / p), ["x"])


def test_global_lp_pool_zero_channel():
    """A channel of zeros: norm 0, gradient 0 (PyTorch's ``norm`` gives its subgradient 0 as well)."""
    x = np.random.default_rng(34).standard_normal((1, 2, 3, 3)).astype(np.float32)
    x[0, 1] = 0
    u = np.array([[[[2.0]], [[5.0]]]], np.float32)
    lg, _ = with_loss(one_node_graph("GlobalLpPool", {"x": x}, {"p": 2}), {"y0": u})
    got = rg.Session(rg.gradient(lg, loss="loss", wrt=["x"])).run({"x": x, "y0_u": u})["x_grad"]
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    (torch.linalg.vector_norm(tx, 2, dim=(2, 3), keepdim=True) * torch.tensor(u, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert np.array_equal(got[0, 1], np.zeros((3, 3)))


# ------------------------------------------------------------------------------------------ MaxUnpool


def pooled_with_indices(x, kernel, strides):
    """MaxPool's outputs and indices (flat over the whole tensor) from onnxruntime."""
    g = one_node_graph("MaxPool", {"x": x.astype(np.float32)}, {"kernel_shape": kernel, "strides": strides}, n_out=2)
    out = rg.Session(g).run({"x": x.astype(np.float32)})
    return out["y0"].astype(x.dtype), out["y1"]


def unpool_graph(p, idx, attrs, output_shape=None):
    ins = {"x": p, "i": idx, **({"os": np.asarray(output_shape, np.int64)} if output_shape is not None else {})}
    return one_node_graph("MaxUnpool", ins, attrs, float_inputs=["x"])


def torch_unpool(idx, kernel, strides, size):
    """PyTorch's max_unpool with ONNX's whole-tensor indices turned into per-plane ones."""
    n, c = idx.shape[:2]
    plane = int(np.prod(size))
    local = torch.tensor(idx - (np.arange(n * c) * plane).reshape(n, c, *[1] * (idx.ndim - 2)))
    fn = {1: F.max_unpool1d, 2: F.max_unpool2d, 3: F.max_unpool3d}[idx.ndim - 2]
    return lambda x: fn(x, local, kernel, strides, 0, list(size))


@pytest.mark.parametrize("kernel, strides, shape", [([2, 2], [2, 2], (2, 3, 6, 4)), ([2], [3], (2, 2, 8)),
                                                     ([2, 1, 2], [2, 1, 2], (1, 2, 4, 3, 4))])
def test_max_unpool(kernel, strides, shape):
    rng = np.random.default_rng(40)
    pooled, idx = pooled_with_indices(rng.standard_normal(shape), kernel, strides)
    p = rng.standard_normal(pooled.shape)
    attrs = {"kernel_shape": kernel, "strides": strides}
    check_rule(unpool_graph(p, idx, attrs), {"x": p}, torch_unpool(idx, kernel, strides, shape[2:]))


def test_max_unpool_unknown_size_uses_two_codes():
    """An input whose size is unknown when the gradient is built (or beyond 2^24 elements) is probed with two
    exact float32 codes per element, ``j // 4096`` and ``j % 4096 + 1``."""
    rng = np.random.default_rng(44)
    pooled, idx = pooled_with_indices(rng.standard_normal((2, 3, 6, 4)), [2, 2], [2, 2])
    p = rng.standard_normal(pooled.shape)
    g = unpool_graph(p, idx, {"kernel_shape": [2, 2], "strides": [2, 2]})
    g.inputs[0] = ValueInfo("x", p.dtype, ("N", 3, "H", "W"))
    check_rule(g, {"x": p}, torch_unpool(idx, [2, 2], [2, 2], (6, 4)))


def test_max_unpool_output_shape_follows_each_runtime():
    """``output_shape`` larger than the inferred shape: onnxruntime (and PyTorch) write ``x_j`` at index ``I_j``
    of the output; the ONNX reference evaluator (and the spec's node test) at ``I_j`` of the inferred shape,
    padded at the ends. The VJP unpools the positions with the runtime's own MaxUnpool, so it is right under
    both."""
    rng = np.random.default_rng(41)
    p = rng.standard_normal((2, 2, 2, 2))
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    # indices valid for both readings: inside each plane of the 4 x 4 inferred shape, spread over the planes
    idx = np.stack([rng.permutation(16)[:4] for _ in range(4)]).reshape(2, 2, 2, 2) + (np.arange(4) * 16).reshape(
        2, 2, 1, 1)
    g = unpool_graph(p, idx, attrs, [2, 2, 5, 5])
    check_rule(g, {"x": p})  # float64: the reference evaluator's reading
    u = rng.standard_normal((2, 2, 5, 5))
    got = grads_both_backends(unpool_graph(p.astype(np.float32), idx, attrs, [2, 2, 5, 5]), {"x": p.astype(
        np.float32)}, u.astype(np.float32), ["x"])
    np.testing.assert_allclose(got[0]["x"], u.reshape(-1)[idx.reshape(-1)].reshape(p.shape), rtol=1e-6)  # onnxruntime
    padded = np.pad(np.arange(2 * 2 * 4 * 4).reshape(2, 2, 4, 4), [(0, 0), (0, 0), (0, 1), (0, 1)], constant_values=-1)
    where = np.argwhere(padded.reshape(-1)[None, :] == idx.reshape(-1, 1))[:, 1]  # the reference's placement
    np.testing.assert_allclose(got[1]["x"], u.reshape(-1)[where].reshape(p.shape), rtol=1e-6)


def test_max_unpool_repeated_indices_last_write_wins():
    """Overlapping MaxPool windows report the same maximum twice; unpooling writes it twice and keeps the last
    write, so only that element depends on the output (PyTorch's max_unpool backward, a gather, gives both)."""
    x = np.random.default_rng(42).standard_normal((1, 1, 5, 5))
    pooled, idx = pooled_with_indices(x, [3, 3], [1, 1])
    flat = idx.reshape(-1)
    assert len(set(flat.tolist())) < flat.size
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1]}
    u = np.random.default_rng(43).standard_normal((1, 1, 5, 5))
    last = {v: j for j, v in enumerate(flat)}
    expected = np.array([u.reshape(-1)[v] if last[v] == j else 0.0 for j, v in enumerate(flat)]).reshape(pooled.shape)
    for got in grads_both_backends(unpool_graph(pooled, idx, attrs), {"x": pooled}, u, ["x"]):
        np.testing.assert_allclose(got["x"], expected, rtol=1e-12)


# ------------------------------------------------------------------------------------------ MaxRoiPool


def roi_pool_bins(rois, pooled, scale, h, w):
    """onnxruntime's MaxRoiPool bins (C ``round``, float32 bin sizes): per roi ``(b, [(hs, he)], [(ws, we)])``."""
    out = []
    for roi in rois:
        rnd = [math.floor(v + 0.5) if v >= 0 else math.ceil(v - 0.5)
               for v in (np.float32(roi[1:]) * np.float32(scale)).astype(np.float64)]
        sw, sh, ew, eh = rnd
        rh, rw = max(eh - sh + 1, 1), max(ew - sw + 1, 1)
        bh, bw = np.float32(rh) / np.float32(pooled[0]), np.float32(rw) / np.float32(pooled[1])
        hb = [(min(max(math.floor(np.float32(i) * bh) + sh, 0), h),
               min(max(math.ceil(np.float32(i + 1) * bh) + sh, 0), h)) for i in range(pooled[0])]
        wb = [(min(max(math.floor(np.float32(i) * bw) + sw, 0), w),
               min(max(math.ceil(np.float32(i + 1) * bw) + sw, 0), w)) for i in range(pooled[1])]
        out.append((int(roi[0]), hb, wb))
    return out


def numpy_roi_pool_grad(x, rois, pooled, scale, u):
    """The expected gradient: each output's cotangent to the first maximum of its bin (row-major)."""
    dx = np.zeros(x.shape)
    for r, (b, hb, wb) in enumerate(roi_pool_bins(rois, pooled, scale, *x.shape[2:])):
        for i, (hs, he) in enumerate(hb):
            for j, (ws, we) in enumerate(wb):
                if he <= hs or we <= ws:
                    continue
                for c in range(x.shape[1]):
                    k = np.argmax(x[b, c, hs:he, ws:we])
                    dx[b, c, hs + k // (we - ws), ws + k % (we - ws)] += u[r, c, i, j]
    return dx


ROIS = np.array([[0, 0, 0, 7, 8], [1, 1.4, 2.5, 5.5, 6.6], [0, 3, 3, 3, 3], [1, -2, -3, 30, 4],
                 [0, 12, 12, 20, 20], [1, 6, 5, 1, 2], [0, 2.5, 0.5, 1.5, -0.5]], np.float32)


@pytest.mark.parametrize("pooled, scale", [([2, 2], 1.0), ([3, 2], 0.5), ([4, 3], 1.3)])
def test_max_roi_pool(pooled, scale):
    """Rois inside, across and outside the input, degenerate and reversed (forced to 1 x 1), empty bins:
    onnxruntime's float32 gradient against the first-maximum rule, and against PyTorch (the bins' maxima)."""
    x = np.random.default_rng(50).standard_normal((2, 3, 9, 8)).astype(np.float32)
    g = one_node_graph("MaxRoiPool", {"x": x, "rois": ROIS}, {"pooled_shape": pooled, "spatial_scale": scale},
                       float_inputs=["x"])
    bins = roi_pool_bins(ROIS, pooled, scale, 9, 8)

    def torch_fn(x):
        out = torch.zeros((len(ROIS), 3, *pooled), dtype=x.dtype)
        for r, (b, hb, wb) in enumerate(bins):
            for i, (hs, he) in enumerate(hb):
                for j, (ws, we) in enumerate(wb):
                    if he > hs and we > ws:
                        out[r, :, i, j] = x[b, :, hs:he, ws:we].amax((-1, -2))
        return out

    got = ort32_vs_torch(g, {"x": x}, torch_fn, ["x"], rtol=1e-6, atol=1e-6)
    u = rg.Session(g).run({"x": x})["y0"] * 0  # the same cotangent as ort32_vs_torch drew
    u = np.random.default_rng(0).standard_normal(u.shape).astype(np.float32)
    np.testing.assert_allclose(got["x_grad"], numpy_roi_pool_grad(x, ROIS, pooled, scale, u), rtol=1e-6, atol=1e-6)


def test_max_roi_pool_ties_go_to_the_first_maximum():
    x = np.random.default_rng(51).integers(0, 2, (1, 2, 6, 6)).astype(np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [0, 1, 2, 4, 5]], np.float32)
    u = np.random.default_rng(52).standard_normal((2, 2, 2, 3)).astype(np.float32)
    g = one_node_graph("MaxRoiPool", {"x": x, "rois": rois}, {"pooled_shape": [2, 3]}, float_inputs=["x"])
    lg, _ = with_loss(g, {"y0": u})
    got = rg.Session(rg.gradient(lg, loss="loss", wrt=["x"])).run({"x": x, "y0_u": u})["x_grad"]
    np.testing.assert_allclose(got, numpy_roi_pool_grad(x, rois, [2, 3], 1.0, u), rtol=1e-6, atol=1e-7)


def test_max_roi_pool_rois_get_no_gradient():
    x = np.random.default_rng(53).standard_normal((1, 1, 4, 4)).astype(np.float32)
    g = one_node_graph("MaxRoiPool", {"x": x, "rois": ROIS[:1]}, {"pooled_shape": [2, 2]})
    lg, _ = with_loss(g, {"y0": np.zeros((1, 1, 2, 2), np.float32)})
    with pytest.warns(UserWarning, match="rois"):
        gg = rg.gradient(lg, loss="loss", wrt=["x", "rois"])
    out = rg.Session(gg).run({"x": x, "rois": ROIS[:1], "y0_u": np.ones((1, 1, 2, 2), np.float32)})
    assert np.array_equal(out["rois_grad"], np.zeros((1, 5), np.float32))


# ------------------------------------------------------------------------------------------ RoiAlign


def random_rois(rng, n, h, w, batch):
    lo = rng.uniform([-2, -2], [w - 1, h - 1], (n, 2))
    hi = lo + rng.uniform(0.3, max(h, w), (n, 2))
    return np.c_[lo, hi], rng.integers(0, batch, n).astype(np.int64)


ALIGN_CASES = {
    "avg_adaptive": {},
    "avg_sampling2": {"output_height": 3, "output_width": 2, "sampling_ratio": 2},
    "avg_output_half_pixel": {"output_height": 2, "output_width": 4, "spatial_scale": 0.7,
                              "coordinate_transformation_mode": "output_half_pixel"},
    "max_adaptive": {"mode": "max", "output_height": 2, "output_width": 3},
    "max_sampling3": {"mode": "max", "output_height": 3, "output_width": 2, "sampling_ratio": 3,
                      "spatial_scale": 0.6},
}


@pytest.mark.parametrize("name", sorted(ALIGN_CASES))
def test_roi_align(name):
    """float64 under onnxruntime and the reference evaluator, with respect to x and the rois: central
    differences and second order (PyTorch has no RoiAlign outside torchvision)."""
    rng = np.random.default_rng(60)
    x = rng.standard_normal((2, 3, 9, 8))
    rois, batch = random_rois(rng, 6, 9, 8, 2)
    g = one_node_graph("RoiAlign", {"x": x, "rois": rois, "b": batch}, ALIGN_CASES[name], float_inputs=["x", "rois"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnxruntime warns that its max mode is not what the paper does
        check_rule(g, {"x": x, "rois": rois})


def numpy_roi_align_grad(x, rois, batch, attrs, u):
    """dL/dx from the ONNX reference's own sample positions and weights (``pre_calc_for_bilinear_interpolate``):
    avg spreads ``u / count`` with the weights; max sends ``u * w`` to the first largest ``w * x`` in the kernel's
    order."""
    from onnx.reference.ops.op_roi_align import PreCalc, RoiAlign

    _, c, h, w = x.shape
    ph, pw = attrs.get("output_height", 1), attrs.get("output_width", 1)
    sr, sc = attrs.get("sampling_ratio", 0), float(np.float32(attrs.get("spatial_scale", 1.0)))  # a float attribute
    half = attrs.get("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    dx = np.zeros(x.shape)
    for r, roi in enumerate(rois):
        off = 0.5 if half else 0.0
        sw, sh, ew, eh = (v * sc - off for v in roi)
        rw, rh = (ew - sw, eh - sh) if half else (max(ew - sw, 1.0), max(eh - sh, 1.0))
        gh = sr if sr > 0 else int(np.ceil(rh / ph))
        gw = sr if sr > 0 else int(np.ceil(rw / pw))
        pre = [PreCalc() for _ in range(gh * gw * ph * pw)]
        RoiAlign.pre_calc_for_bilinear_interpolate(h, w, ph, pw, gh, gw, sh, sw, rh / ph, rw / pw, gh, gw, pre)
        count = max(gh * gw, 1)
        k = 0
        for i in range(ph):
            for j in range(pw):
                samples = pre[k:k + gh * gw]
                k += gh * gw
                corners = [(pos, wt) for pc in samples for pos, wt in
                           [(pc.pos1, pc.w1), (pc.pos2, pc.w2), (pc.pos3, pc.w3), (pc.pos4, pc.w4)]]
                for ch in range(c):
                    plane = x[batch[r], ch].reshape(-1)
                    grad = dx[batch[r], ch].reshape(-1)  # a view
                    if attrs.get("mode", "avg") == "avg":
                        for pos, wt in corners:
                            grad[pos] += u[r, ch, i, j] * wt / count
                    elif corners:
                        best = int(np.argmax([wt * plane[pos] for pos, wt in corners]))
                        grad[corners[best][0]] += u[r, ch, i, j] * corners[best][1]
    return dx


@pytest.mark.parametrize("name", ["avg_adaptive", "max_adaptive", "max_sampling3"])
def test_roi_align_ties_and_the_kernel_order(name):
    """Integer-valued x makes many weighted corners tie in max mode: the cotangent goes to the first in the
    kernel's order (sample row, sample column, corner), as both runtimes compute the maximum; avg spreads the
    bilinear weights exactly as the reference's own sampling."""
    rng = np.random.default_rng(61)
    x = rng.integers(-1, 2, (2, 2, 7, 6)).astype(np.float64)
    rois = np.array([[0.0, 0.0, 5.0, 6.0], [1.0, 1.5, 4.0, 3.0], [0.5, 0.5, 1.5, 1.5], [-3.0, 2.0, 2.0, 9.0]])
    batch = np.array([0, 1, 1, 0], np.int64)
    attrs = ALIGN_CASES[name]
    g = one_node_graph("RoiAlign", {"x": x, "rois": rois, "b": batch}, attrs, float_inputs=["x"])
    y = rg.Session(g, backend="reference").run({"x": x})["y0"]
    u = rng.standard_normal(y.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for got in grads_both_backends(g, {"x": x}, u, ["x"]):
            np.testing.assert_allclose(got["x"], numpy_roi_align_grad(x, rois, batch, attrs, u), rtol=1e-12, atol=1e-12)


def test_roi_align_symbolic_dims():
    """Unknown batch, spatial sizes and roi count: the sizes come from Shape values."""
    rng = np.random.default_rng(63)
    x = rng.standard_normal((2, 3, 7, 6))
    rois, batch = random_rois(rng, 5, 7, 6, 2)
    g = one_node_graph("RoiAlign", {"x": x, "rois": rois, "b": batch}, {"output_height": 2, "output_width": 3},
                       float_inputs=["x", "rois", "b"])
    g.inputs = [ValueInfo("x", x.dtype, ("N", 3, "H", "W")), ValueInfo("rois", rois.dtype, ("R", 4)),
                ValueInfo("b", batch.dtype, ("R",))]
    check_rule(g, {"x": x, "rois": rois, "b": batch}, wrt=["x", "rois"])


def test_max_roi_pool_no_rois():
    x = np.random.default_rng(54).standard_normal((1, 2, 4, 4)).astype(np.float32)
    g = one_node_graph("MaxRoiPool", {"x": x, "rois": np.zeros((0, 5), np.float32)}, {"pooled_shape": [2, 2]},
                       float_inputs=["x"])
    lg, _ = with_loss(g, {"y0": np.zeros((0, 2, 2, 2), np.float32)})
    out = rg.Session(rg.gradient(lg, loss="loss", wrt=["x"])).run({"x": x, "y0_u": np.zeros((0, 2, 2, 2), np.float32)})
    assert np.array_equal(out["x_grad"], np.zeros_like(x))


@pytest.mark.parametrize("op", ["LpPool", "MaxUnpool", "RoiAlign"])
def test_opset_22_versions(op):
    """The opset-22 versions (bfloat16 added) in graphs at opset 22: onnxruntime 1.32 has no kernels for
    MaxUnpool-22 and RoiAlign-22 (nor GlobalLpPool-22, MaxRoiPool-22), so these run on the reference
    evaluator."""
    rng = np.random.default_rng(64)
    x = rng.standard_normal((1, 2, 6, 4))
    feeds = {"x": x}
    if op == "LpPool":
        g = one_node_graph(op, {"x": x}, {"kernel_shape": [3, 2], "strides": [2, 1], "p": 3})
    elif op == "MaxUnpool":
        pooled, idx = pooled_with_indices(x, [2, 2], [2, 2])
        feeds = {"x": rng.standard_normal(pooled.shape)}
        g = unpool_graph(feeds["x"], idx, {"kernel_shape": [2, 2], "strides": [2, 2]})
    else:
        rois, batch = random_rois(rng, 3, 6, 4, 1)
        feeds["rois"] = rois
        g = one_node_graph(op, {"x": x, "rois": rois, "b": batch}, {"output_height": 2, "output_width": 2},
                           float_inputs=["x", "rois"])
    g.opsets = {"": 22}
    check_rule(g, feeds)


def test_roi_align_no_rois():
    """No rois: an empty output and a zero gradient."""
    x = np.random.default_rng(62).standard_normal((1, 2, 4, 4))
    g = one_node_graph("RoiAlign", {"x": x, "rois": np.zeros((0, 4)), "b": np.zeros(0, np.int64)},
                       {"output_height": 2, "output_width": 2}, float_inputs=["x"])
    for got in grads_both_backends(g, {"x": x}, np.zeros((0, 2, 2, 2)), ["x"]):
        assert np.array_equal(got["x"], np.zeros_like(x))


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


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_opset_28_mode(mode):
    """SpaceToDepth-28's ``mode``: CRD is PyTorch's pixel_unshuffle (the inverse of DepthToSpace's CRD)."""
    x = np.random.default_rng(24).standard_normal((2, 3, 4, 6))
    g = one_node_graph("SpaceToDepth", {"x": x}, {"blocksize": 2, "mode": mode})
    g.opsets = {"": 28}

    def dcr(x):
        return x.reshape(2, 3, 2, 2, 3, 2).permute(0, 3, 5, 1, 2, 4).reshape(2, 12, 2, 3)
    check_rule(g, {"x": x}, (lambda x: F.pixel_unshuffle(x, 2)) if mode == "CRD" else dcr)


# ------------------------------------------------------------------------------------------ Resize


def resize_graph(x, attrs, scales=None, sizes=None, roi=None, runtime=False):
    """A Resize node; ``runtime``: scales, sizes and roi are graph inputs (their values known only when the
    graph runs), else initializers."""
    ins = {"x": x}
    for name, v, dt in [("roi", roi, x.dtype), ("scales", scales, np.float32), ("sizes", sizes, np.int64)]:
        if v is not None:
            ins[name] = np.asarray(v, dt)
    g = one_node_graph("Resize", ins, attrs, float_inputs=["x", *(list(ins)[1:] if runtime else [])])
    g.nodes[0].inputs = ["x", *[name if name in ins else "" for name in ("roi", "scales", "sizes")]]
    while not g.nodes[0].inputs[-1]:
        g.nodes[0].inputs.pop()
    return g


def resize_feeds(x, scales=None, sizes=None, roi=None):
    feeds = {"x": x}
    for name, v, dt in [("scales", scales, np.float32), ("sizes", sizes, np.int64), ("roi", roi, x.dtype)]:
        if v is not None:
            feeds[name] = np.asarray(v, dt)
    return feeds


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
    return shape, attrs, scales, sizes, draw(st.integers(0, 2**31 - 1)), draw(st.booleans())


@FAST
@given(case=resize_case())
def test_resize(case):
    """Scales and sizes as constants (interpolation matrices built when the gradient is) or as graph inputs
    (matrices built by nodes when it runs)."""
    shape, attrs, scales, sizes, seed, runtime = case
    if sizes is not None and attrs.get("keep_aspect_ratio_policy") != "stretch":
        common = [o / shape[a] for a, o in zip(attrs["axes"], sizes, strict=True)]
        pick = min(common) if attrs["keep_aspect_ratio_policy"] == "not_larger" else max(common)
        assume(all(int(pick * shape[a] + 0.5) >= 1 for a in attrs["axes"]))
    x = np.random.default_rng(seed).standard_normal(shape)
    g = resize_graph(x, attrs, scales, sizes, runtime=runtime)
    check_rule(g, resize_feeds(x, scales if runtime else None, sizes if runtime else None), wrt=["x"], seed=seed)


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


@pytest.mark.parametrize("attrs, scales, roi", [
    ({"mode": "linear", "coordinate_transformation_mode": ctm}, sc, None)
    for ctm in ["half_pixel", "asymmetric", "pytorch_half_pixel", "half_pixel_symmetric"]
    for sc in ([2.0, 3.0], [0.5, 0.75])
] + [
    ({"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": nm}, [2.0, 0.5], None)
    for nm in ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
] + [({"mode": "cubic", "exclude_outside": 1}, [1.5, 2.0], None),
     ({"mode": "cubic", "cubic_coeff_a": -0.5}, [0.5, 2.0], None)] + [
    ({"mode": mode, "antialias": 1, "exclude_outside": ex}, sc, None)
    for mode in ["linear", "cubic"] for ex in [0, 1] for sc in ([0.5, 0.6], [0.25, 1.5])
] + [
    ({"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 10.0}, sc,
     [0.1, 0.0, 0.9, 1.2])
    for mode in ["nearest", "linear", "cubic"] for sc in ([1.5, 2.0], [0.5, 0.75])
])
def test_resize_matrices_reproduce_onnxruntime(attrs, scales, roi):
    """The interpolation matrices the VJP transposes give onnxruntime's float32 forward (the float64 tests run
    on the reference evaluator), so the VJP is the adjoint of what both runtimes compute: every mode, the
    antialiasing filters and tf_crop_and_resize (outputs outside the crop take the extrapolation value: zero
    rows)."""
    x = np.random.default_rng(14).standard_normal((2, 3, 4, 6)).astype(np.float32)
    full_roi = None if roi is None else [0, 0, roi[0], roi[1], 1, 1, roi[2], roi[3]]
    y = rg.Session(resize_graph(x, attrs, [1, 1, *scales], roi=full_roi), backend="onnxruntime").run({"x": x})["y0"]
    a_h = resize_matrix(4, math.floor(4 * scales[0]), scales[0], attrs, None if roi is None else (roi[0], roi[2]))
    a_w = resize_matrix(6, math.floor(6 * scales[1]), scales[1], attrs, None if roi is None else (roi[1], roi[3]))
    expected = np.einsum("nchw,ph,qw->ncpq", x.astype(np.float64), a_h, a_w)
    if roi is not None:  # extrapolated outputs: the value, not a gradient path
        away = (a_h.sum(1) == 0)[:, None] | (a_w.sum(1) == 0)[None, :]
        expected = np.where(away, attrs["extrapolation_value"], expected)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


MATRIX_CASES = [
    ({"mode": "nearest", "coordinate_transformation_mode": ctm, "nearest_mode": nm}, n_in, n_out, scale)
    for ctm in ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel", "half_pixel_symmetric"]
    for nm in ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
    for n_in, n_out, scale in [(4, 9, 2.3), (7, 3, 0.45), (5, 1, 0.3)]
] + [
    ({"mode": mode, "coordinate_transformation_mode": ctm, "exclude_outside": ex, "cubic_coeff_a": -0.5}, n_in,
     n_out, scale)
    for mode in ["linear", "cubic"] for ex in [0, 1]
    for ctm in ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel", "half_pixel_symmetric"]
    for n_in, n_out, scale in [(4, 9, 2.3), (7, 3, 0.45), (6, 6, 1.0), (5, 1, 0.3)]
] + [
    ({"mode": mode, "antialias": 1, "exclude_outside": ex}, n_in, n_out, scale)
    for mode in ["linear", "cubic"] for ex in [0, 1]
    for n_in, n_out, scale in [(9, 4, 0.45), (11, 3, 0.3), (4, 7, 1.75), (8, 8, 1.0)]
]


@pytest.mark.parametrize("static_scale, every", [
    (False, 4), (True, 7),
    pytest.param(False, 1, marks=pytest.mark.slow), pytest.param(True, 1, marks=pytest.mark.slow),
])
def test_resize_matrix_graph_equals_resize_matrix(static_scale, every):
    """The interpolation matrices built by nodes (sizes, scales and roi as graph inputs) equal the constant ones,
    under both runtimes, for every mode, coordinate transformation, nearest mode, antialias and exclude_outside
    (and tf_crop_and_resize with rois inside and outside the input); a sample of the cases unless slow."""
    from revgraph.autodiff.emitter import Emitter
    from revgraph.autodiff.rules.resize import ResizeAxis, resize_matrix_graph
    from revgraph.ir import Graph

    cases = MATRIX_CASES + [
        ({"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize"}, n_in, n_out, 1.0, roi)
        for mode in ["nearest", "linear", "cubic"]
        for n_in, n_out, roi in [(6, 4, (0.2, 0.8)), (5, 7, (-0.3, 1.4)), (4, 1, (0.1, 0.6))]
    ]
    inputs = [ValueInfo("n_in", np.int64, ()), ValueInfo("n_out", np.int64, ()), ValueInfo("scale", np.float64, ()),
              ValueInfo("start", np.float64, ()), ValueInfo("end", np.float64, ()), ValueInfo("like", np.float64, (1,))]
    for case in cases[::every]:
        attrs, n_in, n_out, scale = case[:4]
        roi = case[4] if len(case) > 4 else None
        e = Emitter({v.name: v for v in inputs}, {v.name for v in inputs}, 21)
        ax = ResizeAxis(0, "n_in", "n_out", scale if static_scale else "scale",
                        None if roi is None else ("start", "end"))
        out = resize_matrix_graph(e, attrs, ax, "like")
        g = Graph(e.nodes, inputs, [ValueInfo(out)])
        feeds = {"n_in": np.int64(n_in), "n_out": np.int64(n_out), "scale": np.float64(scale),
                 "start": np.float64(roi[0] if roi else 0), "end": np.float64(roi[1] if roi else 0),
                 "like": np.zeros(1)}
        expected = resize_matrix(n_in, n_out, scale, attrs, roi)
        for backend in ["onnxruntime", "reference"]:
            got = rg.Session(g, backend=backend).run(feeds)[out]
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=f"{backend} {case}")


def test_resize_identity_scales():
    x = np.random.default_rng(15).standard_normal((1, 2, 3, 3))
    check_rule(resize_graph(x, {"mode": "linear"}, [1, 1, 1, 1]), {"x": x}, lambda x: x * 1)


@pytest.mark.parametrize("runtime", [False, True])
@pytest.mark.parametrize("attrs, scales, sizes", [
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.6, 0.5], None),
    ({"mode": "cubic", "antialias": 1, "exclude_outside": 1}, [1, 1, 0.5, 0.75], None),
    ({"mode": "linear", "antialias": 1, "axes": [3, 2]}, None, [3, 2]),
])
def test_resize_antialias(attrs, scales, sizes, runtime):
    """Antialiasing (the kernel stretched by 1 / scale when downscaling, weights normalised): constant and
    run-time scales. ONNX's filter is not PyTorch's ``antialias=True`` (its edge taps are clamped, PyTorch's
    cut off: outputs differ by ~0.1), so only central differences and the two runtimes check it."""
    x = np.random.default_rng(16).standard_normal((2, 2, 5, 6))
    g = resize_graph(x, attrs, scales, sizes, runtime=runtime)
    check_rule(g, resize_feeds(x, scales if runtime else None, sizes if runtime else None), wrt=["x"])


TF_CROP = {
    "nearest": {"mode": "nearest"},
    "linear": {"mode": "linear"},
    "cubic": {"mode": "cubic"},
    "cubic_exclude_outside": {"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5},
    "linear_antialias": {"mode": "linear", "antialias": 1},
    "cubic_antialias": {"mode": "cubic", "antialias": 1},
}


@pytest.mark.parametrize("runtime", [False, True])
@pytest.mark.parametrize("name", sorted(TF_CROP))
def test_resize_tf_crop_and_resize(name, runtime):
    """tf_crop_and_resize: outputs whose coordinate leaves the input take ``extrapolation_value`` and send x no
    gradient. The roi places the coordinates, so it has a gradient too (TensorFlow's crop_and_resize gives its
    boxes one), through the derivatives of the weights (0 for nearest): checked when it is a graph input."""
    x = np.random.default_rng(17).standard_normal((1, 2, 5, 6))
    attrs = {**TF_CROP[name], "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 3.0,
             "axes": [2, 3]}
    roi = [0.13, -0.17, 0.86, 1.27]  # no coordinate on a tie or a knot
    sizes = [4, 7] if "antialias" not in name else [3, 4]
    g = resize_graph(x, attrs, sizes=sizes, roi=roi, runtime=runtime)
    # the reference evaluator computes cubic weights in float32: its differences along the roi are noise
    with_roi = runtime and attrs["mode"] != "cubic"
    check_rule(g, resize_feeds(x, sizes=sizes if runtime else None, roi=roi if runtime else None),
               wrt=["x", "roi"] if with_roi else ["x"])


@pytest.mark.parametrize("name", ["cubic", "cubic_exclude_outside", "cubic_antialias"])
def test_resize_tf_crop_and_resize_cubic_roi_gradient(name):
    """The roi gradient of the cubic modes against central differences of the float64 forward ``x x_a A_a(roi)``
    (the matrices that reproduce onnxruntime's forward, test_resize_matrices_reproduce_onnxruntime)."""
    rng = np.random.default_rng(23)
    x = rng.standard_normal((1, 2, 5, 6))
    attrs = {**TF_CROP[name], "coordinate_transformation_mode": "tf_crop_and_resize", "axes": [2, 3]}
    roi = np.array([0.13, -0.17, 0.86, 1.27])
    sizes = [4, 7] if "antialias" not in name else [3, 4]

    def forward(roi):
        a_h = resize_matrix(5, sizes[0], sizes[0] / 5, attrs, (roi[0], roi[2]))
        a_w = resize_matrix(6, sizes[1], sizes[1] / 6, attrs, (roi[1], roi[3]))
        return np.einsum("nchw,ph,qw->ncpq", x, a_h, a_w)

    u = rng.standard_normal((1, 2, *sizes))
    lg, _ = with_loss(resize_graph(x, attrs, sizes=sizes, roi=roi, runtime=True), {"y0": u})
    gg = rg.gradient(lg, loss="loss", wrt=["roi"])
    feeds = {**resize_feeds(x, sizes=sizes, roi=roi), "y0_u": u}
    got = rg.Session(gg, backend="reference").run(feeds)["roi_grad"]
    step = np.eye(4) * 1e-6
    numeric = [((forward(roi + d) - forward(roi - d)) * u).sum() / 2e-6 for d in step]
    np.testing.assert_allclose(got, numeric, rtol=1e-6, atol=1e-8)


def test_resize_tf_crop_and_resize_all_axes_roi_gradient():
    """No ``axes``: the roi holds a start and an end for every axis (here a crop of the batch and channels too,
    and a single output row: its coordinate is the roi's middle)."""
    x = np.random.default_rng(22).standard_normal((2, 3, 4, 5))
    roi = [0.2, 0.1, 0.3, 0.05, 0.9, 0.8, 0.7, 0.95]
    attrs = {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}
    g = resize_graph(x, attrs, sizes=[2, 2, 1, 6], roi=roi, runtime=True)
    check_rule(g, resize_feeds(x, sizes=[2, 2, 1, 6], roi=roi), wrt=["x", "roi"])


def test_resize_unknown_input_dims():
    """Constant scales but symbolic input sizes: the matrices are built when the graph runs."""
    x = np.random.default_rng(18).standard_normal((2, 3, 4, 5))
    g = resize_graph(x, {"mode": "linear"}, [1, 1, 2, 1.5])
    g.inputs[0] = ValueInfo("x", x.dtype, ("N", 3, "H", "W"))
    check_rule(g, {"x": x}, lambda x: F.interpolate(x, scale_factor=(2, 1.5), mode="bilinear", align_corners=False))


def test_resize_run_time_scales_match_pytorch_float32_onnxruntime():
    """F.interpolate as the legacy exporter writes it, scales computed in the graph: float32 gradients under
    onnxruntime equal PyTorch's float64 ones."""
    x = np.random.default_rng(19).standard_normal((2, 3, 4, 5))
    scales = np.array([1, 1, 2, 1.5], np.float32)
    g = resize_graph(x.astype(np.float32), {"mode": "linear"}, scales, runtime=True)
    tx = torch.tensor(x, requires_grad=True)
    y = F.interpolate(tx, scale_factor=(2, 1.5), mode="bilinear", align_corners=False)
    u = np.random.default_rng(20).standard_normal(tuple(y.shape))
    (y * torch.tensor(u)).sum().backward()
    lg, _ = with_loss(g, {"y0": u.astype(np.float32)})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    assert any(n.op_type == "Range" for n in gg.nodes)  # the run-time matrices
    out = rg.Session(gg).run({"x": x.astype(np.float32), "scales": scales, "y0_u": u.astype(np.float32)})
    np.testing.assert_allclose(out["x_grad"], tx.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_resize_both_scales_and_sizes_of_unknown_length_is_a_graph_error():
    x = np.zeros((1, 1, 4, 4))
    g = resize_graph(x, {"mode": "linear"}, [1, 1, 1, 1], [1, 1, 4, 4], runtime=True)
    g.inputs[1:] = [ValueInfo(v.name, v.dtype, ("k",)) for v in g.inputs[1:]]
    lg, _ = with_loss(g, {"y0": np.zeros((1, 1, 4, 4))})
    with pytest.raises(GraphError, match=r"node 'op' \(Resize\).*both scales and sizes"):
        rg.gradient(lg, loss="loss", wrt=["x"])


@functools.cache
def _resize_node_cases():
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = node.collect_testcases()  # every operator: a filtered collection would stick for the session
    return {c.name: c for c in cases if c.name.startswith("test_resize_")}


RESIZE_NODE_SAMPLE = ["test_resize_downsample_scales_linear", "test_resize_upsample_sizes_nearest_axes_3_2",
                      "test_resize_downsample_scales_cubic_antialias", "test_resize_tf_crop_and_resize_axes_3_2",
                      "test_resize_upsample_sizes_nearest_not_smaller",
                      "test_resize_upsample_scales_linear_half_pixel_symmetric"]


def check_resize_node_model(name):
    """An ONNX backend node test of Resize (onnx.backend.test.case.node.resize) as exported: its scales, sizes
    and roi are graph inputs. The gradient with respect to X is checked against float64 central differences
    (revgraph.check_gradients; the reference evaluator, which has float64 Resize), and the float32 gradient
    graph under onnxruntime against it."""
    case = _resize_node_cases()[name]
    model = case.model
    feeds = {vi.name: np.asarray(a) for vi, a in zip(model.graph.input, case.data_sets[0][0], strict=True)}
    g = rg.load(model)
    assert [v.name for v in g.inputs][1:] == [n for n in g.nodes[0].inputs[1:] if n]  # nothing constant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = rg.check_gradients(g, None, ["X"], inputs=feeds)
    assert all(r.status == "agree" for r in rep.rows), rep.rows
    y = rg.Session(g).run(feeds)["Y"]
    lg, _ = with_loss(g, {"Y": y})
    gg = rg.gradient(lg, loss="loss", wrt=["X"])
    u = np.random.default_rng(21).standard_normal(y.shape).astype(np.float32)
    got = rg.Session(gg).run({**feeds, "Y_u": u})["X_grad"]
    ref = rg.Session(gg, backend="reference").run({**feeds, "Y_u": u})["X_grad"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", RESIZE_NODE_SAMPLE)
def test_resize_node_models_with_run_time_scales(name):
    check_resize_node_model(name)


@pytest.mark.slow
def test_resize_node_models_with_run_time_scales_all():
    names = sorted(_resize_node_cases())
    assert len(names) >= 39
    for name in names:
        check_resize_node_model(name)


def test_global_max_pool_sends_exact_zeros_off_the_maxima_for_an_infinite_cotangent():
    # loss = sum(1 / GlobalMaxPool(x)) with a maximum of 0: the cotangent is -inf there; the other positions must
    # get an exact 0 (a selection, as PyTorch's amax backward), not -inf * 0 = NaN
    from revgraph.ir import Graph

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
