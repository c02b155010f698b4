"""VJP rules of GridSample and AffineGrid (rules/sampling.py): central differences, PyTorch (``F.grid_sample``,
``F.affine_grid``) and second order over every mode, padding mode and ``align_corners``; 3-D sampling, grids far
outside the input, unit axes, dynamic shapes, opset 22, strong zeros for points outside the input; a spatial
transformer (AffineGrid then GridSample) end to end.

The onnx reference evaluator computes AffineGrid in float32 (and GridSample's coordinates too, and divides by
zero reflecting in a unit axis with ``align_corners=1``), so those graphs are checked with onnxruntime against
PyTorch and central differences (:func:`ort_check`) instead of :func:`harness.check_rule`."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from kit.harness import check_rule, one_node_graph, ort_runner, with_loss

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F = torch.nn.functional
MODES = [("linear", "bilinear"), ("cubic", "bicubic"), ("nearest", "nearest")]
PADDINGS = ["zeros", "border", "reflection"]


def sample_fn(mode: str, padding: str, align: int):
    torch_mode = dict(MODES)[mode]
    return lambda X, G: F.grid_sample(X, G, mode=torch_mode, padding_mode=padding, align_corners=bool(align))


def grid_graph(x: np.ndarray, grid: np.ndarray, mode: str, padding: str, align: int) -> Graph:
    return one_node_graph("GridSample", {"X": x, "G": grid},
                          {"mode": mode, "padding_mode": padding, "align_corners": align})


def ort_check(g: Graph, feeds: dict, torch_fn, wrt: list[str], seed: int = 0) -> dict:
    """The gradients of ``sum(y * u)`` run by onnxruntime against PyTorch autograd and against central differences
    of the forward graph (onnxruntime); returns them."""
    rng = np.random.default_rng(seed)
    fwd = ort_runner(g)(feeds)
    lg, outs = with_loss(g, fwd)
    us = {f"{y}_u": rng.standard_normal(fwd[y].shape) for y in outs}
    got = ort_runner(rg.gradient(lg, loss="loss", wrt=wrt))({**feeds, **us})
    tin = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
    out = torch_fn(**tin)
    np.testing.assert_allclose(out.detach().numpy(), fwd[outs[0]], rtol=1e-6, atol=1e-9, err_msg="forward vs torch")
    (out * torch.tensor(us[f"{outs[0]}_u"])).sum().backward()
    run = ort_runner(lg)
    for w in wrt:
        np.testing.assert_allclose(got[f"{w}_grad"], tin[w].grad.numpy(), rtol=1e-6, atol=1e-9, err_msg=f"torch, {w}")
        v, h = rng.standard_normal(feeds[w].shape), 1e-6
        numeric = (run({**feeds, **us, w: feeds[w] + h * v})["loss"]
                   - run({**feeds, **us, w: feeds[w] - h * v})["loss"]) / (2 * h)
        np.testing.assert_allclose(np.sum(got[f"{w}_grad"] * v), numeric, rtol=1e-5, atol=1e-6,
                                   err_msg=f"differences, {w}")
    return {w: got[f"{w}_grad"] for w in wrt}


# -------------------------------------------------------------------------------------------------- GridSample


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("mode", [m for m, _ in MODES])
def test_grid_sample_2d(mode, padding, align):
    rng = np.random.default_rng(hash((mode, padding, align)) % 2**32)
    feeds = {"X": rng.standard_normal((2, 3, 4, 5)), "G": rng.uniform(-1.3, 1.3, (2, 3, 2, 2))}
    g = grid_graph(feeds["X"], feeds["G"], mode, padding, align)
    if mode == "nearest":  # piecewise constant in the grid: zeros (checked below), not differences across jumps
        check_rule(g, feeds, sample_fn(mode, padding, align), wrt=["X"])
        lg, _ = with_loss(g, ort_runner(g)(feeds))
        u = {"y0_u": rng.standard_normal((2, 3, 3, 2))}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # connected: zeros without an "unconnected" warning
            gg = rg.gradient(lg, loss="loss", wrt=["G"])
        np.testing.assert_array_equal(ort_runner(gg)({**feeds, **u})["G_grad"], 0.0)
    else:
        check_rule(g, feeds, sample_fn(mode, padding, align))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("mode, padding", [("linear", "reflection"), ("nearest", "zeros"),
                                           *[pytest.param(m, p, marks=SLOW) for m, p in
                                             [("linear", "zeros"), ("linear", "border"), ("nearest", "border"),
                                              ("nearest", "reflection")]]])
def test_grid_sample_3d(mode, padding):
    rng = np.random.default_rng(3)
    for align in (0, 1):
        feeds = {"X": rng.standard_normal((2, 2, 3, 4, 2)), "G": rng.uniform(-1.2, 1.2, (2, 2, 3, 2, 3))}
        g = grid_graph(feeds["X"], feeds["G"], mode, padding, align)
        wrt = ["X"] if mode == "nearest" else ["X", "G"]
        check_rule(g, feeds, sample_fn(mode, padding, align), wrt=wrt)


@pytest.mark.parametrize("mode", ["linear", pytest.param("cubic", marks=SLOW)])
def test_grid_sample_far_outside(mode):
    """Points several widths outside: reflection folds them back more than once, border clamps them (zero
    derivative), zeros reads nothing."""
    rng = np.random.default_rng(4)
    for padding in PADDINGS:
        for align in (0, 1):
            feeds = {"X": rng.standard_normal((1, 2, 3, 4)), "G": rng.uniform(-4.0, 4.0, (1, 4, 3, 2))}
            check_rule(grid_graph(feeds["X"], feeds["G"], mode, padding, align), feeds, sample_fn(mode, padding, align))


@pytest.mark.parametrize("mode", ["linear", pytest.param("cubic", marks=SLOW)])
def test_grid_sample_unit_axis(mode):
    rng = np.random.default_rng(5)
    for padding in PADDINGS:
        for align in (0, 1):
            feeds = {"X": rng.standard_normal((2, 2, 1, 4)), "G": rng.uniform(-1.5, 1.5, (2, 3, 2, 2))}
            g = grid_graph(feeds["X"], feeds["G"], mode, padding, align)
            if padding == "reflection" and align:  # the reference evaluator divides by the zero reflection span
                ort_check(g, feeds, sample_fn(mode, padding, align), ["X", "G"])
            else:
                check_rule(g, feeds, sample_fn(mode, padding, align))


def test_grid_sample_dynamic_shapes():
    """Every dimension symbolic (the rank of X known): Shape-based sizes, strides and bounds."""
    rng = np.random.default_rng(6)
    feeds = {"X": rng.standard_normal((2, 3, 4, 5)), "G": rng.uniform(-1.6, 1.6, (2, 3, 2, 2))}
    for mode, padding in [("cubic", "reflection"), ("linear", "border"), ("linear", "zeros")]:
        g = grid_graph(feeds["X"], feeds["G"], mode, padding, 0)
        g.inputs = [ValueInfo("X", np.dtype(np.float64), ("n", "c", "h", "w")),
                    ValueInfo("G", np.dtype(np.float64), None)]
        check_rule(g, feeds, sample_fn(mode, padding, 0))


def test_grid_sample_opset_22():
    rng = np.random.default_rng(7)
    feeds = {"X": rng.standard_normal((1, 2, 3, 4)), "G": rng.uniform(-1.2, 1.2, (1, 2, 3, 2))}
    g = grid_graph(feeds["X"], feeds["G"], "linear", "reflection", 1)
    g.opsets = {"": 22}
    check_rule(g, feeds, sample_fn("linear", "reflection", 1))


def test_grid_sample_opset_16_names():
    """Opset 16 calls the modes bilinear and bicubic (onnxruntime runs GridSample-16 in float32 only)."""
    rng = np.random.default_rng(8)
    feeds = {"X": rng.standard_normal((1, 2, 3, 4)).astype(np.float32),
             "G": rng.uniform(-1.2, 1.2, (1, 2, 3, 2)).astype(np.float32)}
    g = one_node_graph("GridSample", feeds, {"mode": "bicubic", "padding_mode": "border"})
    g.opsets = {"": 16}
    compare_float32(g, feeds, sample_fn("cubic", "border", 0))


def compare_float32(g: Graph, feeds: dict, torch_fn) -> None:
    """float32 gradients from onnxruntime against PyTorch's in float64."""
    fwd = ort_runner(g)(feeds)
    lg, _ = with_loss(g, fwd)
    u = np.random.default_rng(0).standard_normal(fwd["y0"].shape).astype(np.float32)
    got = ort_runner(rg.gradient(lg, loss="loss", wrt=list(feeds)))({**feeds, "y0_u": u})
    tin = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in feeds.items()}
    (torch_fn(**tin) * torch.tensor(u.astype(np.float64))).sum().backward()
    for k in feeds:
        assert got[f"{k}_grad"].dtype == np.float32
        np.testing.assert_allclose(got[f"{k}_grad"], tin[k].grad.numpy(), rtol=1e-4, atol=1e-5)


def test_grid_sample_float32():
    rng = np.random.default_rng(9)
    feeds = {"X": rng.standard_normal((2, 3, 4, 5)).astype(np.float32),
             "G": rng.uniform(-1.2, 1.2, (2, 3, 2, 2)).astype(np.float32)}
    compare_float32(grid_graph(feeds["X"], feeds["G"], "linear", "zeros", 0), feeds, sample_fn("linear", "zeros", 0))


@pytest.mark.parametrize("mode", ["linear", "cubic", "nearest"])
def test_grid_sample_strong_zeros_outside(mode):
    """An inf cotangent at a point whose taps all lie outside X (zeros padding) reaches no gradient: X's and the
    grid's stay finite. X's equals PyTorch's, which skips such taps; PyTorch's CPU kernel gives the grid NaN at
    that point (a masked 0 times the inf), revgraph an exact 0 (strong zeros)."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((1, 2, 3, 4))
    grid = rng.uniform(-0.9, 0.9, (1, 2, 2, 2))
    grid[0, 1, 1] = [3.0, -2.5]  # far outside: every tap is outside
    g = grid_graph(x, grid, mode, "zeros", 0)
    lg, _ = with_loss(g, ort_runner(g)({"X": x, "G": grid}))
    u = rng.standard_normal((1, 2, 2, 2))
    u[:, :, 1, 1] = np.inf
    wrt = ["X"] if mode == "nearest" else ["X", "G"]
    got = ort_runner(rg.gradient(lg, loss="loss", wrt=wrt))({"X": x, "G": grid, "y0_u": u})
    tin = {"X": torch.tensor(x, requires_grad=True), "G": torch.tensor(grid, requires_grad=True)}
    (sample_fn(mode, "zeros", 0)(tin["X"], tin["G"]) * torch.tensor(u)).sum().backward()
    for w in wrt:
        assert np.isfinite(got[f"{w}_grad"]).all(), w
        expected = tin[w].grad.numpy()
        if w == "G":
            expected[0, 1, 1] = 0.0
        np.testing.assert_allclose(got[f"{w}_grad"], expected, rtol=1e-6, atol=1e-9)


def test_grid_sample_repeated_taps_accumulate():
    """Many points reading the same pixels: the scattered contributions add up (no lost updates)."""
    x = np.arange(12, dtype=np.float64).reshape(1, 1, 3, 4)
    grid = np.full((1, 8, 8, 2), 0.1)
    g = grid_graph(x, grid, "linear", "zeros", 1)
    lg, _ = with_loss(g, ort_runner(g)({"X": x, "G": grid}))
    got = ort_runner(rg.gradient(lg, loss="loss", wrt=["X"]))({"X": x, "G": grid,
                                                               "y0_u": np.ones((1, 1, 8, 8))})["X_grad"]
    tx = torch.tensor(x, requires_grad=True)
    F.grid_sample(tx, torch.tensor(grid), align_corners=True).sum().backward()
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-12)
    assert got.sum() == pytest.approx(64.0)


# -------------------------------------------------------------------------------------------------- AffineGrid


#: (size, align_corners); a unit spatial axis with align_corners=1 is not here: the spec's function divides by zero
#: there and PyTorch, onnxruntime and the spec disagree, so test_affine_grid_unit_axis_align_corners checks it
AFFINE_CASES = [(s, a) for s in [(2, 3, 4, 5), (2, 1, 1, 3), (2, 3, 3, 4, 2), (1, 1, 2, 1, 3)] for a in (0, 1)
                if not (a and 1 in s[2:])]


@pytest.mark.parametrize(("size", "align"), AFFINE_CASES)
def test_affine_grid(size, align):
    """Against PyTorch and differences (onnxruntime: the reference evaluator's AffineGrid is float32)."""
    rng = np.random.default_rng(sum(size) + align)
    theta = rng.standard_normal((size[0], len(size) - 2, len(size) - 1))
    g = one_node_graph("AffineGrid", {"theta": theta, "size": np.array(size, dtype=np.int64)}, {"align_corners": align})
    ort_check(g, {"theta": theta}, lambda theta: F.affine_grid(theta, list(size), align_corners=bool(align)), ["theta"])


def test_affine_grid_unit_axis_align_corners():
    """A unit spatial axis with ``align_corners=1``: the coordinate is -1 (the spec function's depth axis, the
    onnx reference evaluator); onnxruntime writes +1 and PyTorch 0. The gradient follows the spec: theta's column
    of that axis gets ``-sum(dgrid)``."""
    theta = np.random.default_rng(11).standard_normal((1, 2, 3))
    g = one_node_graph("AffineGrid", {"theta": theta, "size": np.array([1, 1, 1, 3])}, {"align_corners": 1})
    lg, _ = with_loss(g, {"y0": np.zeros((1, 1, 3, 2))})
    u = np.random.default_rng(12).standard_normal((1, 1, 3, 2))
    got = ort_runner(rg.gradient(lg, loss="loss", wrt=["theta"]))({"theta": theta, "y0_u": u})["theta_grad"]
    base = np.stack([np.linspace(-1, 1, 3), -np.ones(3), np.ones(3)], axis=1)  # [W, 3]: x, y = -1, 1
    np.testing.assert_allclose(got[0], u[0, 0].T @ base, rtol=1e-12)


def test_affine_grid_computed_size():
    """``size`` computed in the graph (Shape of an input with symbolic dimensions): the grid's own shape gives
    the axes' lengths."""
    rng = np.random.default_rng(13)
    theta, img = rng.standard_normal((2, 2, 3)), rng.standard_normal((2, 3, 4, 5))
    g = Graph(nodes=[Node("Shape", ["img"], ["size"], name="shape"),
                     Node("AffineGrid", ["theta", "size"], ["y0"], {}, "op")],
              inputs=[ValueInfo("theta", theta.dtype, theta.shape), ValueInfo("img", img.dtype, ("n", "c", "h", "w"))],
              outputs=[ValueInfo("y0")])
    ort_check(g, {"theta": theta, "img": img},
              lambda theta, img: F.affine_grid(theta, list(img.shape), align_corners=False), ["theta"])


@pytest.mark.parametrize("padding", PADDINGS)
def test_spatial_transformer(padding):
    """theta -> AffineGrid -> GridSample(X): gradients of theta and X as PyTorch's."""
    rng = np.random.default_rng(14)
    theta = np.array([[[0.9, -0.3, 0.1], [0.2, 1.1, -0.2]]]) + 0.05 * rng.standard_normal((1, 2, 3))
    x = rng.standard_normal((1, 2, 5, 6))
    g = Graph(nodes=[Node("AffineGrid", ["theta", "size"], ["grid"], {"align_corners": 0}, "affine"),
                     Node("GridSample", ["X", "grid"], ["y0"], {"padding_mode": padding}, "sample")],
              inputs=[ValueInfo("theta", theta.dtype, theta.shape), ValueInfo("X", x.dtype, x.shape)],
              outputs=[ValueInfo("y0")], initializers={"size": np.array([1, 2, 4, 3], dtype=np.int64)})

    def fn(theta, X):
        return F.grid_sample(X, F.affine_grid(theta, [1, 2, 4, 3], align_corners=False), padding_mode=padding,
                             align_corners=False)

    ort_check(g, {"theta": theta, "X": x}, fn, ["theta", "X"])
