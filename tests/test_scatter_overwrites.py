"""Scatters with repeated indices and ``reduction="none"`` (issue 27, item 4): the forward keeps one update per
position (onnxruntime and onnx's reference evaluator: the last written), so only that update gets the
cotangent and the ones it overwrites get 0. Checked against the hand-derived values of the issue's example and,
for every scatter operator that takes ``reduction="none"``, against float64 central differences of the forward
as onnxruntime runs it (and as the reference evaluator runs it: both must agree)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from kit import zeros

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.float64
W = np.arange(1.0, 9.0).reshape(2, 4)


def _scatter_graph(op: str, data_shape, idx: np.ndarray, upd_shape, attrs: dict, idx_input: bool) -> Graph:
    """``loss = sum(w * op(data, idx, u))``, ``idx`` an initializer or a graph input."""
    w = np.arange(1.0, 1.0 + np.prod(data_shape)).reshape(data_shape)
    inputs = [ValueInfo("data", F64, data_shape), ValueInfo("u", F64, upd_shape)]
    inits = {"w": w}
    if idx_input:
        inputs.append(ValueInfo("i", np.int64, idx.shape))
    else:
        inits["i"] = idx
    return Graph([Node(op, ["data", "i", "u"], ["y"], attrs, "scatter"), Node("Mul", ["y", "w"], ["yw"], name="mul"),
                  Node("ReduceSum", ["yw"], ["loss"], {"keepdims": 0}, "sum")], inputs, [ValueInfo("loss")], inits)


def _grads(g: Graph, feeds: dict) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the run-time indices' warning: tested on its own
        return zeros.grads(g, ["data", "u"], feeds)


@pytest.mark.parametrize("idx_input", [False, True])
def test_the_issue_example(idx_input):
    # axis 1, indices [[1, 1, 3], [0, 2, 0]]: row 0 writes u00 then u01 at column 1 (u01 lands), row 1 writes
    # u10 then u12 at column 0 (u12 lands). loss = sum(w * y), w = [[1, 2, 3, 4], [5, 6, 7, 8]]:
    # du = w at the landing position, 0 where overwritten; ddata = w with the written positions zeroed
    idx = np.array([[1, 1, 3], [0, 2, 0]])
    g = _scatter_graph("ScatterElements", (2, 4), idx, (2, 3), {"axis": 1}, idx_input)
    u = np.array([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])
    feeds = {"data": np.zeros((2, 4)), "u": u} | ({"i": idx} if idx_input else {})
    for backend in ("onnxruntime", "reference"):  # the forward that ran: the last write lands
        y = rg.Session(Graph(g.nodes[:1], g.inputs, [ValueInfo("y")], g.initializers), backend=backend).run(feeds)["y"]
        assert y.tolist() == [[0.0, 20.0, 0.0, 30.0], [60.0, 0.0, 50.0, 0.0]]
    grads = _grads(g, feeds)
    assert grads["u"].tolist() == [[0.0, 2.0, 4.0], [0.0, 7.0, 5.0]]
    assert grads["data"].tolist() == [[1.0, 0.0, 3.0, 0.0], [0.0, 6.0, 0.0, 8.0]]


def _central(g: Graph, feeds: dict, name: str, backend: str, h: float = 0.5) -> np.ndarray:
    """Central differences of ``loss`` with respect to ``name`` on ``backend`` (exact: linear in the values)."""
    s = rg.Session(g, backend=backend)
    out = np.zeros_like(feeds[name])
    for k in np.ndindex(out.shape):
        plus, minus = feeds[name].copy(), feeds[name].copy()
        plus[k] += h
        minus[k] -= h
        out[k] = (s.run({**feeds, name: plus})["loss"] - s.run({**feeds, name: minus})["loss"]) / (2 * h)
    return out


#: every scatter with reduction "none" (spelled out, or the default): (op, data shape, indices, updates shape,
#: attributes); each case repeats some index
CASES = {
    "elements_axis1": ("ScatterElements", (2, 4), np.array([[1, 1, 3], [0, 2, 0]]), (2, 3), {"axis": 1}),
    "elements_axis0_default": ("ScatterElements", (3, 2), np.array([[2, 0], [2, 0], [1, 0]]), (3, 2), {}),
    "elements_negative": ("ScatterElements", (2, 4), np.array([[-1, 3, 0], [1, -3, 1]]), (2, 3),
                          {"axis": -1, "reduction": "none"}),
    "elements_three_writes": ("ScatterElements", (1, 3), np.array([[2, 2, 2, 0]]), (1, 4), {"axis": 1}),
    "nd_rows": ("ScatterND", (3, 2), np.array([[2], [0], [2], [2]]), (4, 2), {}),
    "nd_elements": ("ScatterND", (2, 3), np.array([[1, 2], [0, 0], [1, -1], [0, 0]]), (4,), {"reduction": "none"}),
    "nd_batched": ("ScatterND", (2, 2, 2), np.array([[[1, 0], [1, 0]], [[0, 1], [1, 0]]]), (2, 2, 2), {}),
}


@pytest.mark.parametrize("idx_input", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_scatter_with_repeats_is_the_gradient_of_the_forward_that_ran(case, idx_input):
    op, dshape, idx, ushape, attrs = CASES[case]
    g = _scatter_graph(op, dshape, idx, ushape, attrs, idx_input)
    rng = np.random.default_rng(7)
    feeds = {"data": rng.standard_normal(dshape), "u": rng.standard_normal(ushape)} | ({"i": idx} if idx_input else {})
    grads = _grads(g, feeds)
    for name in ("data", "u"):
        for backend in ("onnxruntime", "reference"):
            np.testing.assert_allclose(grads[name], _central(g, feeds, name, backend), rtol=1e-12, atol=1e-12,
                                       err_msg=f"{name} on {backend}")


def test_indices_known_only_at_run_time_warn():
    g = _scatter_graph("ScatterElements", (2, 4), np.zeros((2, 3), np.int64), (2, 3), {"axis": 1}, idx_input=True)
    with pytest.warns(UserWarning, match=r"node 'scatter' \(ScatterElements\): reduction='none' with indices known "
                                         r"only at run time, which may repeat; .*onnxruntime"):
        rg.gradient(g, wrt=["u"])


def test_constant_indices_without_repeats_cost_nothing():
    # distinct constant indices: every update lands, no test is emitted (no max scatter, no Equal, no Where)
    g = _scatter_graph("ScatterElements", (2, 4), np.array([[1, 0, 3], [0, 2, 1]]), (2, 3), {"axis": 1}, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gg = rg.gradient(g, wrt=["u"])
    assert not [n for n in gg.nodes if n.op_type in ("Equal", "Where") or n.attrs.get("reduction") == "max"]
