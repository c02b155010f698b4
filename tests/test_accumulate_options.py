"""``accumulate=`` reaches every subgraph's backward pass (issue 29): a value read four times in a Loop body,
an If branch or a nested loop gets one 4-input ``Sum`` with ``"sum"`` and chained ``Add`` nodes with
``"running"``, and both give the gradient of the unrolled computation (PyTorch, float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit.loops import F64, assert_close, body, const, grads, graph, loop, n, torch_grads

import revgraph as rg
from revgraph.autodiff.context import Options
from revgraph.ir import Graph, ValueInfo

H0 = np.array([0.3, -0.7, 1.1])
W = np.array([0.9, -0.4, 0.6])


def _four_reads(h_in: str, h_out: str, p: str = "") -> list:
    """``h_out = sin(h) + cos(h) * h + h * w``: four nodes read ``h`` (Sin, Cos, and two Mul)."""
    return [n("Sin", [h_in], f"{p}sn"), n("Cos", [h_in], f"{p}cs"), n("Mul", [f"{p}cs", h_in], f"{p}ch"),
            n("Mul", [h_in, "w"], f"{p}hw"), n("Add", [f"{p}sn", f"{p}ch"], f"{p}t"),
            n("Add", [f"{p}t", f"{p}hw"], h_out)]


def _step(h, w):
    return torch.sin(h) + torch.cos(h) * h + h * w


def _loop_graph(trips: int = 3) -> Graph:
    b = body(_four_reads("h_in", "h_out"), [("h_in", "h_out")], types={"h_in": (3,), "h_out": (3,)})
    return graph([loop(b, "M", ["h0"], ["h"]), n("ReduceSum", ["h"], "loss", keepdims=0)],
                 {"h0": (3,), "w": (3,)}, ["loss"], {"M": np.array(trips, np.int64)})


def _nested_graph() -> Graph:
    inner = body(_four_reads("g_in", "g_out", "in_"), [("g_in", "g_out")], iter_name="k", cond_name="c2",
                 types={"g_in": (3,), "g_out": (3,)})
    outer = body([loop(inner, "M2", ["h_in"], ["h_out"], "inner")], [("h_in", "h_out")],
                 types={"h_in": (3,), "h_out": (3,)})
    return graph([loop(outer, "M", ["h0"], ["h"], "outer"), n("ReduceSum", ["h"], "loss", keepdims=0)],
                 {"h0": (3,), "w": (3,)}, ["loss"], {"M": np.array(2, np.int64), "M2": np.array(2, np.int64)})


def _if_graph() -> Graph:
    then = Graph(_four_reads("h0", "r", "then_"), [], [ValueInfo("r", F64, None)], name="then")
    other = Graph([n("Mul", ["h0", "w"], "r2")], [], [ValueInfo("r2", F64, None)], name="else")
    return graph([const("zero", 0.0), n("ReduceSum", ["w"], "ws", keepdims=0), n("Greater", ["ws", "zero"], "c"),
                  n("If", ["c"], ["y"], "if", then_branch=then, else_branch=other),
                  n("ReduceSum", ["y"], "loss", keepdims=0)], {"h0": (3,), "w": (3,)}, ["loss"])


def _subgraph_nodes(g: Graph) -> list:
    """Every node inside a subgraph (at any depth) of ``g``'s nodes: what the backward loops and branches run."""
    found, todo = [], [sub for node in g.nodes for sub in node.subgraphs.values()]
    while todo:
        sub = todo.pop()
        found += sub.nodes
        todo += [s for node in sub.nodes for s in node.subgraphs.values()]
    return found


def _unrolled_loop(h0, w, trips=3):
    h = h0
    for _ in range(trips):
        h = _step(h, w)
    return h.sum()


def _unrolled_nested(h0, w):
    h = h0
    for _ in range(4):
        h = _step(h, w)
    return h.sum()


def _unrolled_if(h0, w):
    return _step(h0, w).sum()


CASES = {"loop": (_loop_graph, _unrolled_loop), "nested": (_nested_graph, _unrolled_nested),
         "if": (_if_graph, _unrolled_if)}


@pytest.mark.parametrize(("case", "policy"),  # (no loop in the If case: the policy does not apply)
                         [(c, p) for c in ("loop", "nested") for p in ("store", "recompute", "sqrt")]
                         + [("if", "store")])
def test_subgraph_backward_adds_up_as_accumulate_says(case, policy):
    make, unrolled = CASES[case]
    g = make()
    feeds = {"h0": H0, "w": W}
    expected = torch_grads(unrolled, feeds, ["h0", "w"])
    by_mode = {}
    for mode in ("sum", "running"):
        gg = rg.gradient(g, wrt=["h0", "w"], checkpoint=policy, accumulate=mode)
        inner = _subgraph_nodes(gg)
        sums4 = [m for m in inner if m.op_type == "Sum" and len(m.inputs) == 4]
        adds = [m for m in inner if m.op_type == "Add" and "accum/" in m.name]
        if mode == "sum":
            assert sums4, "the value read four times gets one 4-input Sum"
        else:
            assert not sums4, [m.name for m in sums4]
            assert len(adds) >= 3, "three chained Adds add the four contributions"
        by_mode[mode] = grads(g, feeds, ["h0", "w"], policy=policy, accumulate=mode)
        assert_close(by_mode[mode], expected)
    assert_close(by_mode["running"], by_mode["sum"], rtol=1e-12, atol=1e-14)


def test_loop_gradient_matches_central_differences_in_float64():
    """Both strategies against float64 central differences of the loop itself (no PyTorch)."""
    g = _loop_graph()
    feeds = {"h0": H0, "w": W}
    loss = rg.Session(g, backend="reference")

    def f(h0, w):
        return float(np.asarray(loss.run({"h0": h0, "w": w})["loss"]))

    eps, numeric = 1e-6, {}
    for k in ("h0", "w"):
        d = np.zeros(3)
        for i in range(3):
            up, down = dict(feeds), dict(feeds)
            up[k] = feeds[k] + eps * np.eye(3)[i]
            down[k] = feeds[k] - eps * np.eye(3)[i]
            d[i] = (f(**up) - f(**down)) / (2 * eps)
        numeric[k] = d
    for mode in ("sum", "running"):
        assert_close(grads(g, feeds, ["h0", "w"], accumulate=mode), numeric, rtol=1e-7, atol=1e-8)


def test_backward_takes_accumulate_from_options_or_keyword():
    """``rg.backward(accumulate=)`` keeps working and takes the place of ``options.accumulate``; without it the
    options' strategy is used, in the loop body too."""
    def body_sums(nodes):
        loops = [m for m in nodes if m.op_type == "Loop"]
        return [m for lp in loops for m in lp.attrs["body"].nodes if m.op_type == "Sum" and len(m.inputs) == 4]

    assert body_sums(rg.backward(rg.to_ssa(_loop_graph()), ["loss"], ["h0", "w"])[0])
    assert not body_sums(rg.backward(rg.to_ssa(_loop_graph()), ["loss"], ["h0", "w"], accumulate="running")[0])
    assert not body_sums(rg.backward(rg.to_ssa(_loop_graph()), ["loss"], ["h0", "w"],
                                     options=Options(accumulate="running"))[0])
    assert body_sums(rg.backward(rg.to_ssa(_loop_graph()), ["loss"], ["h0", "w"], accumulate="sum",
                                 options=Options(accumulate="running"))[0])
