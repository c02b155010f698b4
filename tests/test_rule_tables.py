"""Rules' tables computed in the graph at run time (rules/tables.py, limits.MAX_RULE_CONSTANT_ELEMENTS).

A rule writes a table whose size follows a tensor's size (a window table, an interpolation matrix, an identity,
an index grid) as a constant only when small; larger ones are computed by nodes. Here the bound is lowered to
0 so that small cases take the run-time path, and each case checks (1) that the gradient graph then holds no
table constant (no constant over 8 elements, the length of a rank-4 pads vector) while the default build does,
(2) that both builds give the same gradient (onnxruntime, float64; the constant path is what the rule tests
check), and (3) the run-time path against float64 central differences (and PyTorch where it has the op),
second order and the JVP (tests/kit/harness.py ``check_rule``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.harness import check_rule, one_node_graph, with_loss

import revgraph as rg
from revgraph import limits
from revgraph.ir import Graph


def largest_constant(g: Graph) -> int:
    """The most elements of a ``Constant`` node's value in ``g`` (at any depth)."""
    sizes = []  # (not the initializers: the model's own data, such as GatherND's indices)
    stack = [g]
    while stack:
        h = stack.pop()
        for n in h.nodes:
            if n.op_type == "Constant" and "value" in n.attrs:
                sizes.append(np.asarray(n.attrs["value"]).size)
            stack.extend(n.subgraphs.values())
    return max(sizes, default=0)


def _run(g: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``g`` run by onnxruntime, or by the reference evaluator where onnxruntime has no float64 kernel
    (LpPool, AveragePool, Det)."""
    try:
        session = rg.Session(g)
    except rg.RevgraphError as exc:
        assert "no " in str(exc) and "float64" in str(exc), exc
        session = rg.Session(g, backend="reference")
    return session.run(feeds)


def _gradient(g: Graph, feeds: dict[str, np.ndarray], wrt: list[str],
              outputs: list[str] | None) -> tuple[Graph, dict, list[str]]:
    fwd = _run(g, feeds)
    lg, outs = with_loss(g, fwd, outputs)
    return rg.gradient(lg, loss="loss", wrt=wrt), fwd, outs


def both_paths(g: Graph, feeds: dict[str, np.ndarray], monkeypatch, *, rtol: float = 1e-9,
               outputs: list[str] | None = None, computed_by: str | None = None) -> None:
    """Build the gradient with the default bound and with the bound 0; compare their tables and gradients.
    ``computed_by``: the operator that computes the table at run time, for a rule whose small form is no
    table constant (Pad's slices, GatherND's batch grid of the size of the model's own indices)."""
    wrt = [v.name for v in g.inputs]
    const_graph, fwd, outs = _gradient(g, feeds, wrt, outputs)
    monkeypatch.setattr(limits, "MAX_RULE_CONSTANT_ELEMENTS", 0)
    run_graph, _, _ = _gradient(g, feeds, wrt, outputs)
    if computed_by is None:
        assert largest_constant(const_graph) > 8, "the case is too small to need a table"
        assert largest_constant(run_graph) <= 8
    else:
        assert computed_by not in {n.op_type for n in const_graph.nodes}
        assert computed_by in {n.op_type for n in run_graph.nodes}
    rng = np.random.default_rng(1)
    us = {f"{y}_u": rng.standard_normal(np.shape(fwd[y])).astype(fwd[y].dtype) for y in outs}
    a, b = _run(const_graph, {**feeds, **us}), _run(run_graph, {**feeds, **us})
    for w in wrt:
        np.testing.assert_allclose(b[f"{w}_grad"], a[f"{w}_grad"], rtol=rtol, atol=1e-12, err_msg=w)


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def test_max_pool(monkeypatch):
    x = _rand(1, 2, 5, 6)
    attrs = {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}
    g = one_node_graph("MaxPool", {"x": x}, attrs)
    both_paths(g, {"x": x}, monkeypatch)
    check_rule(g, {"x": x}, lambda x: F.max_pool2d(F.pad(x, (0, 1, 1, 1), value=-np.inf), (3, 2), (2, 1)))


def test_lp_pool(monkeypatch):
    x = _rand(1, 1, 4, 5, seed=1)
    g = one_node_graph("LpPool", {"x": x}, {"kernel_shape": [2, 3], "pads": [1, 1, 0, 1], "strides": [1, 2], "p": 2})
    both_paths(g, {"x": x}, monkeypatch)
    check_rule(g, {"x": x})


def test_average_pool(monkeypatch):
    x = _rand(1, 2, 5, 5, seed=2)
    g = one_node_graph("AveragePool", {"x": x}, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]})
    both_paths(g, {"x": x}, monkeypatch)
    check_rule(g, {"x": x}, lambda x: F.avg_pool2d(x, 3, 1, 1, count_include_pad=False))


def test_einsum_diagonal(monkeypatch):
    x = _rand(5, 5, seed=3)
    g = one_node_graph("Einsum", {"x": x}, {"equation": "ii->i"})
    both_paths(g, {"x": x}, monkeypatch)
    check_rule(g, {"x": x}, lambda x: torch.einsum("ii->i", x))


def test_det(monkeypatch):
    x = _rand(2, 4, 4, seed=4)
    g = one_node_graph("Det", {"x": x})
    both_paths(g, {"x": x}, monkeypatch)
    check_rule(g, {"x": x}, torch.det, second_order=False)


def test_layer_normalization_float32(monkeypatch):
    """The fused statistics (float32 only) with a run-time ones scale: the same gradient as with a constant."""
    x = _rand(3, 4, 5, seed=5).astype(np.float32)
    s = _rand(4, 5, seed=6).astype(np.float32)
    g = one_node_graph("LayerNormalization", {"x": x, "s": s}, {"axis": 1})
    both_paths(g, {"x": x, "s": s}, monkeypatch, rtol=1e-5)


def test_batch_normalization_training(monkeypatch):
    x = _rand(2, 9, 2, 2, seed=7)
    sc, b = _rand(9, seed=8), _rand(9, seed=9)
    mean, var = np.zeros(9), np.ones(9)
    g = one_node_graph("BatchNormalization", {"x": x, "s": sc, "b": b, "m": mean, "v": var},
                       {"training_mode": 1}, n_out=3, float_inputs=["x", "s", "b"])
    both_paths(g, {"x": x, "s": sc, "b": b}, monkeypatch, outputs=["y0"])


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
def test_pad_modes(mode, monkeypatch):
    x = _rand(2, 5, seed=10)
    g = one_node_graph("Pad", {"x": x, "pads": np.array([0, 3, 0, 4])}, {"mode": mode})
    both_paths(g, {"x": x}, monkeypatch, computed_by="ScatterElements")
    check_rule(g, {"x": x}, (lambda x: F.pad(x[None], (3, 4), mode="reflect")[0]) if mode == "reflect" else None,
               no_torch_jvp=None if mode == "reflect" else "no torch function")


@pytest.mark.parametrize("attrs, scales", [
    ({"mode": "linear"}, [1, 1, 2.0, 1.5]),
    ({"mode": "cubic", "coordinate_transformation_mode": "align_corners"}, [1, 1, 1.5, 2.0]),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 2.0, 2.0]),
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.5, 0.6]),
])
def test_resize(attrs, scales, monkeypatch):
    x = _rand(1, 2, 4, 5, seed=11)
    g = one_node_graph("Resize", {"x": x, "roi": np.zeros(0), "scales": np.array(scales, np.float32)}, attrs,
                       float_inputs=["x"])
    both_paths(g, {"x": x}, monkeypatch)
    check_rule(g, {"x": x}, no_torch_jvp="no torch function")


def test_gather_nd_batch(monkeypatch):
    x = _rand(3, 4, 5, seed=12)
    idx = np.array([[[1], [3], [0]], [[2], [2], [1]], [[0], [1], [3]]], np.int64)
    g = one_node_graph("GatherND", {"x": x, "i": idx}, {"batch_dims": 1})
    both_paths(g, {"x": x}, monkeypatch, computed_by="Range")
    check_rule(g, {"x": x}, no_torch_jvp="no torch function")


def test_max_roi_pool(monkeypatch):
    x = _rand(1, 2, 6, 6, seed=13).astype(np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [0, 1, 1, 4, 3]], np.float32)
    g = one_node_graph("MaxRoiPool", {"x": x, "rois": rois}, {"pooled_shape": [9, 10]}, float_inputs=["x"])
    both_paths(g, {"x": x}, monkeypatch)


def test_affine_grid(monkeypatch):
    theta = _rand(1, 2, 3, seed=14)
    g = one_node_graph("AffineGrid", {"theta": theta, "size": np.array([1, 1, 4, 12], np.int64)}, {"align_corners": 0})
    both_paths(g, {"theta": theta}, monkeypatch)  # (the bound stays 0 below)
    # against PyTorch (not check_rule: the reference evaluator's AffineGrid is float32)
    gg, fwd, _ = _gradient(g, {"theta": theta}, ["theta"], None)
    u = np.random.default_rng(2).standard_normal(fwd["y0"].shape)
    got = rg.Session(gg).run({"theta": theta, "y0_u": u})["theta_grad"]
    t = torch.tensor(theta, requires_grad=True)
    (F.affine_grid(t, [1, 1, 4, 12], align_corners=False) * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-9, atol=1e-12)
