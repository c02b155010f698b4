"""Loops as tf2onnx and jax2onnx write them (issue 41, items 4 and 6):

- subgraphs holding their own initializers, in nested loops and in forward mode (reverse mode of Loop, If and
  Scan bodies is tests/test_control_flow.py's);
- ``tf.while_loop``'s form: a Loop with no trip count, a condition the body computes, and loop and body
  outputs declared without a shape: the output types are inferred from the body (carried: the type the value
  keeps; scan outputs: one more leading dimension), in reverse and forward mode, and for ``Scan``.

Every gradient is compared with torch float64 autograd of the unrolled computation.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

import revgraph as rg
from revgraph.cli import main

D = TP.DOUBLE
K_IN, K_OUT = np.array([0.5, 1.5]), np.array([1.25, -0.75])
W = np.arange(6.0).reshape(2, 3) / 10 - 0.2
X = np.array([[0.3, -0.2], [0.1, 0.4]])
B = np.array([0.1, 0.2])


def vi(name: str, elem: int = D, shape=None) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, elem, shape)


def _model(nodes: list, inputs: list, inits: list, value_info=()) -> onnx.ModelProto:
    g = h.make_graph(nodes, "g", inputs, [vi("loss", D, [])], inits, value_info=list(value_info))
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(graph: rg.Graph, loss: str, wrt: list[str], feeds: dict, **kwargs) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rg.Session(rg.gradient(graph, loss, wrt=wrt, **kwargs)).run(feeds)


def _jvp(graph: rg.Graph, wrt: str, feeds: dict, tangent: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = rg.Session(rg.jvp(graph, outputs=["loss"], inputs=[wrt])).run({**feeds, f"{wrt}_tangent": tangent})
    return float(out["loss_tangent"])


def _torch_grads(fn, **arrays) -> tuple[float, dict[str, np.ndarray]]:
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in arrays.items()}
    loss = fn(**ts)
    loss.backward()
    return float(loss), {k: t.grad.numpy() for k, t in ts.items()}


# ------------------------------------------------------------------------------------------ body initializers


def _nested_initializers() -> onnx.ModelProto:
    """outer Loop, 2 trips: h <- inner(h) * k_out; inner Loop, 3 trips: h <- tanh(h * k_in + b); k_in and k_out
    are initializers of the inner and outer bodies. loss = sum(h)."""
    inner = h.make_graph([h.make_node("Mul", ["a_in", "k_in"], ["m"]), h.make_node("Add", ["m", "b"], ["s"]),
                          h.make_node("Tanh", ["s"], ["a_out"]), h.make_node("Identity", ["ci"], ["co"])], "inner",
                         [vi("j", TP.INT64, []), vi("ci", TP.BOOL, []), vi("a_in", D, [2])],
                         [vi("co", TP.BOOL, []), vi("a_out", D, [2])], [nh.from_array(K_IN, "k_in")])
    outer = h.make_graph([h.make_node("Loop", ["T3", "", "h_in"], ["r"], body=inner),
                          h.make_node("Mul", ["r", "k_out"], ["h_out"]), h.make_node("Identity", ["c_in"], ["c_out"])],
                         "outer", [vi("i", TP.INT64, []), vi("c_in", TP.BOOL, []), vi("h_in", D, [2])],
                         [vi("c_out", TP.BOOL, []), vi("h_out", D, [2])],
                         [nh.from_array(K_OUT, "k_out"), nh.from_array(np.array(3, np.int64), "T3")])
    nodes = [h.make_node("Loop", ["T2", "", "x"], ["y"], body=outer),
             h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    return _model(nodes, [vi("x", D, [2]), vi("b", D, [2])], [nh.from_array(np.array(2, np.int64), "T2")])


def _nested_reference(x, b):
    for _ in range(2):
        for _ in range(3):
            x = torch.tanh(x * torch.tensor(K_IN) + b)
        x = x * torch.tensor(K_OUT)
    return x.sum()


@pytest.mark.parametrize("policy", ["store", "recompute", "sqrt"])
def test_nested_loops_holding_their_own_initializers(policy):
    g = rg.load(_nested_initializers())
    x = np.array([0.3, -0.2])
    out = _run(g, "loss", ["x", "b"], {"x": x, "b": B}, checkpoint=policy)
    value, grads = _torch_grads(_nested_reference, x=x, b=B)
    np.testing.assert_allclose(out["loss"], value, rtol=1e-12)
    np.testing.assert_allclose(out["x_grad"], grads["x"], rtol=1e-10)
    np.testing.assert_allclose(out["b_grad"], grads["b"], rtol=1e-10)


def test_nested_loops_holding_their_own_initializers_in_forward_mode():
    g = rg.load(_nested_initializers())
    x, t = np.array([0.3, -0.2]), np.array([0.7, -1.1])
    _, grads = _torch_grads(_nested_reference, x=x, b=B)
    np.testing.assert_allclose(_jvp(g, "x", {"x": x, "b": B}, t), grads["x"] @ t, rtol=1e-10)


@pytest.mark.parametrize("name", ["loop", "if", "scan"])
def test_bodies_holding_their_own_initializers_in_forward_mode(name):
    from kit.loops import body_initializer_models, body_initializer_reference

    g = rg.load(body_initializer_models()[name])
    x, w, t = np.array([0.3, -0.2]), np.array([0.1, 0.2]), np.array([0.7, -1.1])
    _, grads = _torch_grads(lambda x, w: body_initializer_reference(name, x, w), x=x, w=w)
    np.testing.assert_allclose(_jvp(g, "x", {"x": x, "w": w}, t), grads["x"] @ t, rtol=1e-10)
    np.testing.assert_allclose(_jvp(g, "w", {"x": x, "w": w}, t), grads["w"] @ t, rtol=1e-10)


# ------------------------------------------------------------------------------------------ undeclared output types


def _while_loop(declare_inner: bool = False) -> onnx.ModelProto:
    """``tf.while_loop`` as tf2onnx writes it: ``i < 3`` computed by the body (no trip count), h <- tanh(h @ W2)
    with W2 = W[:, :2] captured; the body also emits h * h per iteration (a scan output). The loop's outputs and
    the body's carried values are declared with a dtype only (``declare_inner``: the inner values declared
    too, the control). loss = sum(h_final @ W) + sum(stacked squares)."""
    shape = [2, 2] if declare_inner else None
    body = h.make_graph([h.make_node("MatMul", ["h_in", "w2"], ["m"]), h.make_node("Tanh", ["m"], ["h_out"]),
                         h.make_node("Mul", ["h_out", "h_out"], ["sq"]),
                         h.make_node("Add", ["i", "one"], ["i1"]), h.make_node("Less", ["i1", "three"], ["c_out"])],
                        "while_body", [vi("i", TP.INT64, []), vi("c_in", TP.BOOL, []), vi("h_in", D, shape)],
                        [vi("c_out", TP.BOOL, []), vi("h_out", D, shape), vi("sq", D, shape)],
                        [nh.from_array(np.array(1, np.int64), "one"), nh.from_array(np.array(3, np.int64), "three")])
    nodes = [h.make_node("Slice", ["w", "s0", "s2", "s1"], ["w2"]),
             h.make_node("Loop", ["", "true", "x"], ["r", "ys"], body=body, name="while"),
             h.make_node("MatMul", ["r", "w"], ["z"]), h.make_node("ReduceSum", ["z"], ["l1"], keepdims=0),
             h.make_node("ReduceSum", ["ys"], ["l2"], keepdims=0), h.make_node("Add", ["l1", "l2"], ["loss"])]
    inits = [nh.from_array(np.array(True), "true"), nh.from_array(W, "w"),
             *(nh.from_array(np.array([v], np.int64), f"s{v}") for v in (0, 1, 2))]
    return _model(nodes, [vi("x", D, [2, 2])], inits, [vi("r", D), vi("ys", D)])


def _while_reference(x, w):
    h, total = x, 0
    for _ in range(3):
        h = torch.tanh(h @ w[:, :2])
        total = total + (h * h).sum()
    return (h @ w).sum() + total


def test_the_while_loop_form_is_refused_by_nothing_but_its_types():
    # the control: with the body's shapes declared by hand (issue 41's workaround), it differentiates
    g = rg.load(_while_loop(declare_inner=True))
    out = _run(g, "loss", ["x", "w"], {"x": X})
    _, grads = _torch_grads(_while_reference, x=X, w=W)
    np.testing.assert_allclose(out["x_grad"], grads["x"], rtol=1e-10)


@pytest.mark.parametrize("policy", ["store", "recompute", "sqrt"])
def test_loop_output_types_are_inferred_from_the_body(policy):
    g = rg.load(_while_loop())
    out = _run(g, "loss", ["x", "w"], {"x": X}, checkpoint=policy)
    value, grads = _torch_grads(_while_reference, x=X, w=W)
    np.testing.assert_allclose(out["loss"], value, rtol=1e-12)
    np.testing.assert_allclose(out["x_grad"], grads["x"], rtol=1e-10)
    np.testing.assert_allclose(out["w_grad"], grads["w"], rtol=1e-10)


def test_loop_output_types_are_inferred_in_forward_mode():
    g = rg.load(_while_loop())
    t = np.array([[0.5, -1.0], [2.0, 0.25]])
    _, grads = _torch_grads(_while_reference, x=X, w=W)
    np.testing.assert_allclose(_jvp(g, "x", {"x": X}, t), (grads["x"] * t).sum(), rtol=1e-10)


def test_the_inferred_types(tmp_path):
    from revgraph.autodiff.loops.lower import complete_types
    from revgraph.onnx_io.value_types import infer_types

    g = rg.load(_while_loop())
    types = infer_types(g)
    assert types["r"].shape is None and types["ys"].shape is None  # what ONNX's inference gives
    complete_types(g, types)
    assert types["r"].shape == (2, 2)
    assert types["ys"].shape == (None, 2, 2)  # the number of iterations is the body's to decide
    assert types["z"].shape == (2, 3)  # and the values computed from them
    onnx.save(_while_loop(), tmp_path / "while.onnx")
    assert main(["grad", str(tmp_path / "while.onnx"), "-o", str(tmp_path / "g.onnx")]) == 0
    assert main(["check", str(tmp_path / "while.onnx")]) == 0


def test_a_constant_trip_count_gives_the_scan_outputs_their_length():
    from revgraph.autodiff.loops.lower import complete_types
    from revgraph.onnx_io.value_types import infer_types

    model = _while_loop()
    loop = model.graph.node[1]
    loop.input[0], loop.input[1] = "T", ""  # Loop(M=3, cond=""): exactly 3 iterations
    model.graph.initializer.append(nh.from_array(np.array(3, np.int64), "T"))
    g = rg.load(model)
    types = infer_types(g)
    complete_types(g, types)
    assert types["ys"].shape == (3, 2, 2)
    out = _run(g, "loss", ["x", "w"], {"x": X})
    _, grads = _torch_grads(_while_reference, x=X, w=W)
    np.testing.assert_allclose(out["w_grad"], grads["w"], rtol=1e-10)


def _undeclared_scan() -> onnx.ModelProto:
    """Scan over 3 rows: h <- tanh(h * row + b), emitting h; the Scan's outputs and its body's values declared
    with a dtype only. loss = sum(h_final) + sum(stacked h * 2)."""
    body = h.make_graph([h.make_node("Mul", ["h_in", "row"], ["m"]), h.make_node("Add", ["m", "b"], ["s"]),
                         h.make_node("Tanh", ["s"], ["h_out"]), h.make_node("Add", ["h_out", "h_out"], ["y"])],
                        "scan_body", [vi("h_in"), vi("row")], [vi("h_out"), vi("y")])
    nodes = [h.make_node("Scan", ["x", "rows"], ["hT", "ys"], body=body, num_scan_inputs=1),
             h.make_node("ReduceSum", ["hT"], ["l1"], keepdims=0), h.make_node("ReduceSum", ["ys"], ["l2"], keepdims=0),
             h.make_node("Add", ["l1", "l2"], ["loss"])]
    return _model(nodes, [vi("x", D, [2]), vi("b", D, [2]), vi("rows", D, [3, 2])], [], [vi("hT"), vi("ys")])


def _scan_reference(x, b, rows):
    h, total = x, 0
    for row in rows:
        h = torch.tanh(h * row + b)
        total = total + 2 * h.sum()
    return h.sum() + total


@pytest.mark.parametrize("policy", ["store", "recompute"])
def test_scan_output_types_are_inferred_from_the_body(policy):
    g = rg.load(_undeclared_scan())
    rows = np.arange(6.0).reshape(3, 2) / 5 - 0.4
    feeds = {"x": np.array([0.3, -0.2]), "b": B, "rows": rows}
    out = _run(g, "loss", ["x", "b", "rows"], feeds, checkpoint=policy)
    _, grads = _torch_grads(_scan_reference, **feeds)
    for k in feeds:
        np.testing.assert_allclose(out[f"{k}_grad"], grads[k], rtol=1e-10)
    np.testing.assert_allclose(_jvp(g, "rows", feeds, np.ones_like(rows)), grads["rows"].sum(), rtol=1e-10)
