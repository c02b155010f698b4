"""The tie conventions of every operator that has ties (DESIGN section 5; issue 27, item 8), each with a
hand-derived gradient: **split** equally where the forward only reports a value (Max, Min, ReduceMax,
ReduceMin, GlobalMaxPool, scatters with reduction max/min), **picked** where the forward picks one element
(MaxPool's first maximum, TopK's returned index, a gather at ArgMax's index)."""

from __future__ import annotations

import numpy as np
import pytest
from kit import zeros

from revgraph.ir import Graph, Node, ValueInfo

F64 = np.float64


def _grad(nodes: list[Node], out: str, inputs: dict[str, tuple], feeds: dict, inits: dict | None = None,
          wrt: list[str] | None = None) -> dict:
    """Gradients of ``loss = sum(w * out)`` (``w`` in ``inits``, else ones), also checked against forward mode."""
    inits = dict(inits or {})
    tail = ([Node("Mul", [out, "w"], ["ow"], name="mulw"), Node("ReduceSum", ["ow"], ["loss"], {"keepdims": 0}, "sum")]
            if "w" in inits else [Node("ReduceSum", [out], ["loss"], {"keepdims": 0}, "sum")])
    g = Graph(nodes + tail, [ValueInfo(k, *v) for k, v in inputs.items()], [ValueInfo("loss")], inits)
    return zeros.grads(g, wrt or [k for k, v in inputs.items() if v[0] == F64], feeds)


def test_max_and_min_split_ties():
    # Max(a, b, c) at a = b = 2 > c: a and b get half each, c nothing; Min(a, b) at a = b: half each
    feeds = {"a": np.array([2.0, 1.0]), "b": np.array([2.0, 3.0]), "c": np.array([0.0, 3.0])}
    ins = dict.fromkeys(feeds, (F64, (2,)))
    got = _grad([Node("Max", ["a", "b", "c"], ["y"], name="max")], "y", ins, feeds)
    assert got["a"].tolist() == [0.5, 0.0] and got["b"].tolist() == [0.5, 0.5] and got["c"].tolist() == [0.0, 0.5]
    got = _grad([Node("Min", ["a", "b"], ["y"], name="min")], "y", {"a": ins["a"], "b": ins["b"]},
                {"a": feeds["a"], "b": feeds["b"]})
    assert got["a"].tolist() == [0.5, 1.0] and got["b"].tolist() == [0.5, 0.0]


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reductions_split_ties(op):
    # rows [3, 1, 3] (max tied twice) and [0, 0, 0] (everything tied): 1/2 and 1/3 shares of w
    x = np.array([[3.0, 1.0, 3.0], [0.0, 0.0, 0.0]]) * (1 if op == "ReduceMax" else -1)
    got = _grad([Node(op, ["x", "ax"], ["y"], {"keepdims": 0}, "r")], "y", {"x": (F64, (2, 3))}, {"x": x},
                {"ax": np.array([1]), "w": np.array([2.0, 3.0])})["x"]
    np.testing.assert_array_equal(got, [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])


def test_global_max_pool_splits_ties():
    # one channel [[1, 4], [4, 2]]: the two 4s share the cotangent
    got = _grad([Node("GlobalMaxPool", ["x"], ["y"], name="gmp")], "y", {"x": (F64, (1, 1, 2, 2))},
                {"x": np.array([[[[1.0, 4.0], [4.0, 2.0]]]])})["x"]
    np.testing.assert_array_equal(got, [[[[0.0, 0.5], [0.5, 0.0]]]])


def test_max_pool_picks_the_first_maximum():
    # 2x2 windows with stride 1 over [[5, 5, 1], [5, 0, 5]]: every window's maximum 5 is tied; the first in
    # row-major order wins: window (0, 0) -> (0, 0), window (0, 1) -> (0, 1); w = [1, 10]
    got = _grad([Node("MaxPool", ["x"], ["y"], {"kernel_shape": [2, 2]}, "mp")], "y", {"x": (F64, (1, 1, 2, 3))},
                {"x": np.array([[[[5.0, 5.0, 1.0], [5.0, 0.0, 5.0]]]])}, {"w": np.array([[[[1.0, 10.0]]]])})["x"]
    np.testing.assert_array_equal(got, [[[[1.0, 10.0, 0.0], [0.0, 0.0, 0.0]]]])


def test_top_k_picks_the_lower_index():
    # TopK k = 2 of [1, 3, 3, 3]: the spec orders equal values by index, so indices 1 and 2 are returned
    # and get w = [1, 10]; index 3 (equal, not returned) gets 0
    nodes = [Node("TopK", ["x", "k"], ["v", "i"], name="topk")]
    got = _grad(nodes, "v", {"x": (F64, (4,))}, {"x": np.array([1.0, 3.0, 3.0, 3.0])},
                {"k": np.array([2]), "w": np.array([1.0, 10.0])})["x"]
    np.testing.assert_array_equal(got, [0.0, 1.0, 10.0, 0.0])


@pytest.mark.parametrize(("last", "want"), [(0, [0.0, 1.0, 0.0, 0.0]), (1, [0.0, 0.0, 0.0, 1.0])])
def test_a_gather_at_argmax_picks_its_index(last, want):
    # Gather(x, ArgMax(x)) over [0, 2, 1, 2]: the first maximum (select_last_index=0) or the last gets it all
    nodes = [Node("ArgMax", ["x"], ["i"], {"keepdims": 0, "select_last_index": last}, "argmax"),
             Node("Gather", ["x", "i"], ["y"], {"axis": 0}, "gather")]
    got = _grad(nodes, "y", {"x": (F64, (4,))}, {"x": np.array([0.0, 2.0, 1.0, 2.0])})["x"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_a_max_scatter_splits_between_data_and_updates(reduction):
    # ScatterElements(data [2, 0], idx [0, 0], u [2, 1], max): position 0 is max(2, 2, 1) = 2, tied by data[0]
    # and u[0]: half each; position 1 keeps data[1]. min: position 0 is min(2, 2, 1) = 1 -> u[1] alone
    nodes = [Node("ScatterElements", ["d", "i", "u"], ["y"], {"axis": 0, "reduction": reduction}, "sc")]
    feeds = {"d": np.array([2.0, 0.0]), "u": np.array([2.0, 1.0])}
    got = _grad(nodes, "y", {"d": (F64, (2,)), "u": (F64, (2,))}, feeds, {"i": np.array([0, 0])})
    if reduction == "max":
        assert got["d"].tolist() == [0.5, 1.0] and got["u"].tolist() == [0.5, 0.0]
    else:
        assert got["d"].tolist() == [0.0, 1.0] and got["u"].tolist() == [0.0, 1.0]
