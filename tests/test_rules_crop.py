"""The CenterCropPad VJP (rules/shape.py): ONNX "CenterCropPad" (opset 18) against central differences, PyTorch
(``F.pad`` with negative amounts crops) and second order, on crops and pads of even and odd differences, with
and without ``axes``, on shapes known when the graph is built and on shapes known only at run time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.harness import check_rule, one_node_graph

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo


def _amounts(dim: int, n: int) -> tuple[int, int]:
    """The (before, after) amounts CenterCropPad adds along an axis of ``dim`` to reach ``n`` (negative: cut)."""
    if n >= dim:
        before = (n - dim) // 2
        return before, n - dim - before
    start = (dim - n) // 2
    return -start, -(dim - n - start)


def torch_center_crop_pad(x: torch.Tensor, shape: list[int], axes: list[int] | None) -> torch.Tensor:
    axes = list(range(x.ndim)) if axes is None else [a % x.ndim for a in axes]
    target = dict(zip(axes, shape, strict=True))
    pads: list[int] = []
    for a in reversed(range(x.ndim)):  # F.pad lists the last axis first
        pads += list(_amounts(x.shape[a], target.get(a, x.shape[a])))
    return F.pad(x, pads)


CASES = [
    ((5, 6), [3, 9], None),            # crop odd, pad odd
    ((4, 7), [2, 7], None),            # crop even, keep
    ((2, 5, 6), [8, 3], [1, 2]),       # pad odd, crop odd on chosen axes
    ((3, 4, 5), [6], [-1]),            # a negative axis, pad
    ((3, 4, 5), [1, 2], [2, 0]),       # axes out of order, crops
]


@pytest.mark.parametrize("xshape, shape, axes", CASES, ids=[f"{c[0]}->{c[1]}@{c[2]}" for c in CASES])
def test_center_crop_pad_vjp(xshape, shape, axes):
    x = np.random.default_rng(0).standard_normal(xshape)
    g = one_node_graph("CenterCropPad", {"x": x, "s": np.array(shape, np.int64)}, {"axes": axes} if axes else {})
    check_rule(g, {"x": x}, lambda x: torch_center_crop_pad(x, shape, axes))


def test_center_crop_pad_with_shapes_known_at_run_time():
    """x's dimensions and the target shape are only known when the graph runs: the VJP crops and pads back to
    ``Shape(x)`` (gathered at ``axes``)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 7, 4))
    g = Graph([Node("CenterCropPad", ["x", "s"], ["y"], {"axes": [1, 2]}, "op")],
              [ValueInfo("x", np.float64, ("a", "b", "c")), ValueInfo("s", np.int64, (2,))],
              [ValueInfo("y", np.float64)])
    gg = rg.gradient(g, "y", wrt=["x"], seed="input")
    s = np.array([4, 9], np.int64)
    u = rng.standard_normal((3, 4, 9))
    got = rg.Session(gg).run({"x": x, "s": s, "y_grad": u})["x_grad"]
    t = torch.tensor(x, requires_grad=True)
    (torch_center_crop_pad(t, [4, 9], [1, 2]) * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=0, atol=0)


def test_center_crop_pad_drops_an_infinite_cotangent_of_the_padding():
    """The padding's cotangent is dropped, and the cropped-away entries get exact zeros: inf or NaN in the
    cotangent of the zeros added stays out of dx (strong zeros)."""
    x = np.ones((2, 3), np.float32)
    g = one_node_graph("CenterCropPad", {"x": x, "s": np.array([4, 1], np.int64)})
    gg = rg.gradient(g, "y0", wrt=["x"], seed="input")
    u = np.array([[np.inf, np.nan], [1, 2], [3, 4], [np.nan, -np.inf]], np.float32)[:, :1]
    dx = rg.Session(gg).run({"x": x, "y0_grad": u})["x_grad"]
    np.testing.assert_array_equal(dx, [[0, 1, 0], [0, 3, 0]])
