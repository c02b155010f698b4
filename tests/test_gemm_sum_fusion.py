"""onnxruntime's ``GemmSumFusion`` throws on valid graphs that revgraph's gradients contain (issue 41, item 7):
a ``Gemm`` reading a loop's third carried value, whose weight the loop body also reads, has its weight's
gradient written as ``Sum(loop's contribution, Gemm(...))``; the rule checks the producer's output position
(2 here) where it means the Gemm's input slot and throws while the session is built. revgraph's sessions
disable that rule where the pattern is (``runtime.options.gemm_sum_trap``), at the top level and in a loop
body's backward (the gradient of a JAX ``lax.scan`` nested in a loop). Gradients against torch float64."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

import revgraph as rg
from revgraph.runtime.options import GEMM_SUM_FUSION, disabled_optimizers, gemm_sum_trap, scope_gemm_sum_trap

F = TP.FLOAT
S = [2, 3]
W = (np.arange(9).reshape(3, 3) / 10 - 0.4).astype(np.float32)
X = np.linspace(-1, 1, 6).reshape(2, 3).astype(np.float32)


def vi(name: str, elem: int = F, shape=None) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, elem, shape)


def _scan_body() -> onnx.GraphProto:
    """lax.scan's step as a Loop body with three carried values: a <- tanh(Gemm(a, w)), b <- b + a, c <- c * a."""
    return h.make_graph([h.make_node("Gemm", ["a_in", "w"], ["m"]), h.make_node("Tanh", ["m"], ["a_out"]),
                         h.make_node("Add", ["b_in", "a_out"], ["b_out"]),
                         h.make_node("Mul", ["c_in", "a_out"], ["c_out"]),
                         h.make_node("Identity", ["cond"], ["cond_out"])], "scan_body",
                        [vi("i", TP.INT64, []), vi("cond", TP.BOOL, []), vi("a_in", F, S), vi("b_in", F, S),
                         vi("c_in", F, S)],
                        [vi("cond_out", TP.BOOL, []), vi("a_out", F, S), vi("b_out", F, S), vi("c_out", F, S)])


def _step_nodes(src: str, dst: str) -> list:
    """dst = Gemm(c, w) with c the scan's third carried value, starting from src three times."""
    return [h.make_node("Loop", ["T", "", src, src, src], [f"{dst}_a", f"{dst}_b", f"{dst}_c"], body=_scan_body()),
            h.make_node("Gemm", [f"{dst}_c", "w"], [dst])]


def _model(nested: bool) -> onnx.ModelProto:
    """loss = sum(Gemm(scan(x).c, w)); ``nested``: that step twice, as the body of an outer Loop."""
    inits = [nh.from_array(np.array(3, np.int64), "T"), nh.from_array(W, "w")]
    if nested:
        outer = h.make_graph([*_step_nodes("h_in", "h_out"), h.make_node("Identity", ["oc"], ["oc_out"])], "outer",
                             [vi("j", TP.INT64, []), vi("oc", TP.BOOL, []), vi("h_in", F, S)],
                             [vi("oc_out", TP.BOOL, []), vi("h_out", F, S)])
        nodes = [h.make_node("Loop", ["T2", "", "x"], ["z"], body=outer)]
        inits.append(nh.from_array(np.array(2, np.int64), "T2"))
    else:
        nodes = _step_nodes("x", "z")
    g = h.make_graph([*nodes, h.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)], "g", [vi("x", F, S)],
                     [vi("loss", F, [])], inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _reference(x, w, nested: bool):
    def step(v):
        a, b, c = v, v, v
        for _ in range(3):
            a = torch.tanh(a @ w)
            b, c = b + a, c * a
        return c @ w

    z = x
    for _ in range(2 if nested else 1):
        z = step(z)
    return z.sum()


@pytest.mark.parametrize("nested", [False, True], ids=["top", "in_a_loop_body"])
@pytest.mark.parametrize("policy", ["store", "recompute"])
def test_gradients_holding_gemm_into_sum_run(nested, policy):
    gg = rg.gradient(rg.load(_model(nested)), "loss", wrt=["x", "w"], checkpoint=policy)
    assert gemm_sum_trap(gg) and GEMM_SUM_FUSION in disabled_optimizers(gg)
    assert scope_gemm_sum_trap(gg) != nested  # nested: the pattern is in the backward loop's body only
    out = rg.Session(gg).run({"x": X})
    tx = torch.tensor(X, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    _reference(tx, tw, nested).backward()
    np.testing.assert_allclose(out["x_grad"], tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["w_grad"], tw.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_the_rule_stays_on_elsewhere():
    model = _model(False)
    assert not gemm_sum_trap(rg.load(model))  # the forward: the Gemm feeds a ReduceSum
    g = rg.gradient(rg.load(model), "loss", wrt=["x"])  # w is no wrt: no Sum of its contributions
    assert GEMM_SUM_FUSION not in disabled_optimizers(g)
