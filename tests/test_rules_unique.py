"""The VJP of ``Unique`` (rules/unique.py) and the corrected reference kernel (runtime/reference_ops.py).

Without ties Unique is differentiable (a permutation of the elements, or of the slices along ``axis``): the
harness checks the rule by central differences of the ONNX forward graph, PyTorch autograd of the same selection
(``index_select`` at the first occurrences numpy's ``np.unique`` finds), second order and forward mode. At ties
the rule's convention (the cotangent goes to each value's first occurrence, the other copies get zero: what
``jax.numpy.unique`` gives) is checked against PyTorch's gradient of that selection. The kernel is checked against
onnxruntime for every combination of outputs, ``sorted`` and ``axis``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from kit.harness import check_rule, one_node_graph

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

OUTPUTS = ["y", "indices", "inverse", "counts"]


def _first_occurrences(x: np.ndarray, axis: int | None, sort: bool) -> np.ndarray:
    """numpy's first occurrence of each unique value (or slice along ``axis``), in sorted or first-seen order."""
    _, first = np.unique(x.reshape(-1) if axis is None else x, return_index=True, axis=axis)
    return first if sort else np.sort(first)


def _selection(x: np.ndarray, axis: int | None, sort: bool):
    """PyTorch's ``Y`` as the selection of the first occurrences (independent of revgraph)."""
    index = torch.tensor(_first_occurrences(x, axis, sort))
    return lambda x: torch.index_select(x.reshape(-1) if axis is None else x, 0 if axis is None else axis, index)


def _unique_graph(x: np.ndarray, n_out: int, attrs: dict) -> Graph:
    return Graph([Node("Unique", ["x"], OUTPUTS[:n_out], attrs, "unique")], [ValueInfo("x", x.dtype, x.shape)],
                 [ValueInfo(o) for o in OUTPUTS[:n_out]])


CASES = [(axis, sort, n_out) for axis in (None, 0, 1, -1) for sort in (0, 1) for n_out in (1, 2, 4)]


@pytest.mark.parametrize("axis, sort, n_out", CASES)
def test_unique_without_ties_is_checked_four_ways(axis, sort, n_out):
    """Distinct values: Y is a permutation of X (of its slices along ``axis``) and the rule is the derivative."""
    rng = np.random.default_rng(CASES.index((axis, sort, n_out)))
    x = rng.standard_normal((3, 4))
    attrs = {"sorted": sort} | ({} if axis is None else {"axis": axis})
    g = one_node_graph("Unique", {"x": x}, attrs, n_out=n_out)
    grads = check_rule(g, {"x": x}, _selection(x, axis, bool(sort)), outputs=["y0"])
    assert np.count_nonzero(grads["x"]) == x.size  # every element is a unique value: each gets its cotangent


@pytest.mark.parametrize("axis, sort, n_out", CASES)
def test_at_ties_the_cotangent_goes_to_the_first_occurrence(axis, sort, n_out):
    """Repeated values (and repeated slices): the gradient of ``sum(u * Y)`` is ``u[j]`` at the first occurrence
    of unique value ``j`` and zero at its other copies, on both backends, as PyTorch's gradient of the selection."""
    rng = np.random.default_rng(7)
    x = rng.integers(0, 3, (4, 3)).astype(np.float64)
    x[2] = x[0]  # a repeated row, so axis=0 has ties too
    x[:, 2] = x[:, 1]  # and a repeated column
    attrs = {"sorted": sort} | ({} if axis is None else {"axis": axis})
    g = _unique_graph(x, n_out, attrs)
    y = rg.Session(g).run({"x": x})["y"]
    u = rng.standard_normal(y.shape)
    g.inputs.append(ValueInfo("u", np.float64, y.shape))
    g.nodes += [Node("Mul", ["y", "u"], ["uy"], name="mul"), Node("ReduceSum", ["uy"], ["loss"], {"keepdims": 0},
                                                                     name="sum")]
    g.outputs = [ValueInfo("loss")]
    gg = rg.gradient(g, loss="loss", wrt=["x"])
    xt = torch.tensor(x, requires_grad=True)
    (_selection(x, axis, bool(sort))(xt) * torch.tensor(u)).sum().backward()
    for backend in ("onnxruntime", "reference"):
        got = rg.Session(gg, backend=backend).run({"x": x, "u": u})["x_grad"]
        np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-12, atol=0, err_msg=backend)
    assert np.count_nonzero(xt.grad.numpy()) < x.size  # the copies got nothing: the case is a real tie


def test_integer_outputs_carry_no_gradient():
    """A loss of ``counts`` and ``inverse_indices`` (cast to float) has no path to X: the gradient is refused as
    unconnected, or zero when asked for."""
    x = np.array([[2.0, 1.0], [2.0, 3.0]])
    g = _unique_graph(x, 4, {"sorted": 0})
    g.nodes += [Node("Cast", ["counts"], ["cf"], {"to": onnx.TensorProto.DOUBLE}, "cast"),
                Node("ReduceSum", ["cf"], ["loss"], {"keepdims": 0}, "sum")]
    g.outputs = [ValueInfo("loss")]
    gg = rg.gradient(g, loss="loss", wrt=["x"], unconnected="zero")
    np.testing.assert_array_equal(rg.Session(gg).run({"x": x})["x_grad"], np.zeros_like(x))


@pytest.mark.parametrize("n_out", [1, 2, 3, 4])
@pytest.mark.parametrize("sort", [0, 1])
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1])
def test_reference_kernel_agrees_with_onnxruntime(axis, sort, n_out):
    """onnx 1.23's kernel ignores ``sorted=0`` with one output and reads the values along axis 0 of the
    unflattened input otherwise; revgraph's reference backend (the corrected kernel) equals onnxruntime."""
    x = np.random.default_rng(0).integers(0, 3, (4, 3, 2)).astype(np.float64)
    x[3] = x[1]
    g = _unique_graph(x, n_out, {"sorted": sort} | ({} if axis is None else {"axis": axis}))
    ours = rg.Session(g, backend="reference").run({"x": x})
    theirs = rg.Session(g, backend="onnxruntime").run({"x": x})
    for name in OUTPUTS[:n_out]:
        assert ours[name].shape == theirs[name].shape and ours[name].dtype == theirs[name].dtype, name
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    if not sort and axis is None:  # against the spec's example's definition: first-seen order of the flat x
        flat = x.reshape(-1)
        np.testing.assert_array_equal(ours["y"], flat[np.sort(np.unique(flat, return_index=True)[1])])
