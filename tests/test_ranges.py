"""Signs of forward values (autodiff/ranges.py, issue 39 "fewer guards"): Sqrt, Reciprocal, Div, Log and Pow whose
operands keep them away from their singular points count as finite and bounded, so that an RMSNorm or a
LayerNorm written out as exporters write it costs no strong-zero test; where nothing keeps them away (no eps, a
variable that may be 0) the tests stay and the strong zeros hold (checked against torch float64 and by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit import zeros

import revgraph as rg
from revgraph.autodiff.ranges import NONNEG, POSITIVE, refined_nodes, signs
from revgraph.autodiff.strong import TAG
from revgraph.errors import RevgraphError
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.float64


def _rms_norm_nodes(eps: float, square: str = "pow") -> tuple[list[Node], dict]:
    """``y = w * x / sqrt(mean(x^2) + eps)`` as torch.onnx writes RMSNorm (Pow, ReduceMean, Add, Sqrt,
    Reciprocal, Mul); ``square="mul"`` writes ``x * x``."""
    sq = (Node("Pow", ["x", "two"], ["p"], name="pow") if square == "pow"
          else Node("Mul", ["x", "x"], ["p"], name="sq"))
    nodes = [sq, Node("ReduceMean", ["p", "axes"], ["m"], {"keepdims": 1}, "mean"),
             Node("Add", ["m", "eps"], ["a"], name="add"), Node("Sqrt", ["a"], ["s"], name="sqrt"),
             Node("Reciprocal", ["s"], ["r"], name="rsqrt"), Node("Mul", ["x", "r"], ["n"], name="norm"),
             Node("Mul", ["w", "n"], ["y"], name="scale"), Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")]
    consts = {"two": np.array(2.0), "axes": np.array([-1]), "eps": np.array(eps)}
    return nodes, consts


def _rms_graph(eps: float, square: str = "pow") -> Graph:
    nodes, consts = _rms_norm_nodes(eps, square)
    return Graph(nodes, [ValueInfo("x", F64, (2, 3)), ValueInfo("w", F64, (3,))], [ValueInfo("loss")], consts)


def _guards(gg: Graph) -> int:
    """The strong products lowered with a test (autodiff/strong.py: their Where is tagged)."""
    return sum(1 for _, n in gg.walk() if n.op_type == "Where" and n.name.rsplit("/", 1)[-1].startswith(TAG))


def test_signs_follow_an_rms_norm():
    nodes, consts = _rms_norm_nodes(1e-6)
    sg = signs(nodes, consts)
    assert sg["p"] == NONNEG and sg["m"] == NONNEG  # x^2 and its mean are >= 0
    assert sg["a"] == POSITIVE and sg["s"] == POSITIVE  # + eps: >= 1e-6, and its sqrt >= 1e-3
    assert sg["r"] == NONNEG and "x" not in sg and "n" not in sg
    refined = {n.name for n in nodes if id(n) in refined_nodes(nodes, consts)}
    assert refined == {"pow", "sqrt", "rsqrt"}


@pytest.mark.parametrize(("nodes", "refined"), [
    # a positive divisor, a Log of exp-plus-one (softplus written out), a Pow of a positive base
    ([Node("Exp", ["x"], ["e"], name="exp"), Node("Add", ["e", "one"], ["a"], name="add"),
      Node("Log", ["a"], ["l"], name="log"), Node("Div", ["x", "a"], ["d"], name="div"),
      Node("Pow", ["a", "half"], ["p"], name="pow")], {"log", "div", "pow"}),
    # nothing keeps these away from 0: a variable divisor, Sqrt of a sum without eps, Log of a square, x^0.5
    ([Node("Div", ["x", "x"], ["d"], name="div"), Node("Mul", ["x", "x"], ["q"], name="sq"),
      Node("Sqrt", ["q"], ["s"], name="sqrt"), Node("Log", ["q"], ["l"], name="log"),
      Node("Pow", ["x", "half"], ["p"], name="pow"), Node("Pow", ["q", "half"], ["p2"], name="pow_nonneg")], set()),
    # a negative constant added, an exponent that is an input, a maximum with a positive constant
    ([Node("Add", ["x", "minus"], ["a"], name="add"), Node("Sqrt", ["a"], ["s"], name="sqrt"),
      Node("Pow", ["one", "x"], ["p"], name="pow"), Node("Max", ["x", "one"], ["m"], name="max"),
      Node("Reciprocal", ["m"], ["r"], name="rec")], {"rec"}),
])
def test_refined_nodes(nodes, refined):
    consts = {"one": np.array(1.0), "half": np.array(0.5), "minus": np.array(-1.0)}
    assert {n.name for n in nodes if id(n) in refined_nodes(nodes, consts)} == refined


@pytest.mark.parametrize("square", ["pow", "mul"])
def test_an_rms_norm_costs_no_guard_and_equals_torch(square):
    # the LLaMA: the guards came from RMSNorm's Sqrt and Reciprocal (a zero-partial test on every product
    # before them in backward order) and Pow; with eps > 0 none is needed. A row of zeros is the point where
    # the old proof failed: the gradient there is w / sqrt(eps) per element (PyTorch agrees)
    # (x and w are inputs, taken as finite here: finite_inputs; the graph inputs' own guards are below)
    gg = rg.gradient(_rms_graph(1e-6, square), "loss", wrt=["x", "w"], finite_inputs=["x", "w"])
    assert _guards(gg) == 0
    x = np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    w = np.array([0.5, 0.0, 2.0])
    out = zeros.run(gg, {"x": x, "w": w})
    got = {"x": out["x_grad"], "w": out["w_grad"]}
    zeros.assert_jvp_is_dot(_rms_graph(1e-6, square), got, {"x": x, "w": w})
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (wt * xt / torch.sqrt((xt * xt).mean(-1, keepdim=True) + 1e-6)).sum().backward()
    np.testing.assert_allclose(got["x"], xt.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(got["w"], wt.grad.numpy(), rtol=1e-12)


def test_without_eps_the_guards_stay_and_a_zero_row_gets_the_zero_subgradient():
    # the norm sqrt(mean(x^2) + eps) with eps = 0: the mean may be 0, so Sqrt is singular there and keeps its
    # tests; the zero row gets the norm's 0 subgradient (DESIGN section 5) where plain products give NaN
    nodes, consts = _rms_norm_nodes(0.0)
    g = Graph([*nodes[:4], Node("ReduceSum", ["s"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", F64, (2, 3))], [ValueInfo("loss")], consts)
    assert _guards(rg.gradient(g, "loss", wrt=["x"], finite_inputs=["x"])) > 0
    x = np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    got = zeros.grads(g, ["x"], {"x": x})["x"]
    assert got[0].tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_allclose(got[1], x[1] / 3 / np.sqrt(np.mean(x[1] ** 2)), rtol=1e-12)


def test_hessians_through_a_refined_rms_norm_equal_torch():
    x = np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    w = np.array([0.5, 0.0, 2.0])
    h = zeros.run(rg.hessian(_rms_graph(1e-6), "loss", ["x"]), {"x": x, "w": w})["x_hessian"]
    want = torch.func.hessian(lambda t: (torch.tensor(w) * t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6))
                              .sum())(torch.tensor(x)).numpy()
    np.testing.assert_allclose(h, want, rtol=1e-9, atol=1e-9)


def test_finite_inputs_drop_the_guards_behind_a_parameter_fed_as_input():
    # an embedding table fed as an input (a training step's parameters): without finite_inputs its rows may
    # be inf or NaN, so the norm's products test for zeros; the Trainer declares its parameters finite
    g = Graph([Node("Gather", ["table", "ids"], ["x"], {"axis": 0}, "embed"), *_rms_norm_nodes(1e-6)[0]],
              [ValueInfo("table", F64, (5, 3)), ValueInfo("ids", np.int64, (2,)), ValueInfo("w", F64, (3,))],
              [ValueInfo("loss")], _rms_norm_nodes(1e-6)[1])
    assert _guards(rg.gradient(g, "loss", wrt=["table", "w"])) > 0
    gg = rg.gradient(g, "loss", wrt=["table", "w"], finite_inputs=["table", "w"])
    assert _guards(gg) == 0
    feeds = {"table": np.arange(15.0).reshape(5, 3) - 7, "ids": np.array([1, 3]), "w": np.array([0.5, 1.0, 2.0])}
    plain = rg.Session(rg.gradient(g, "loss", wrt=["table", "w"])).run(feeds)
    lean = rg.Session(gg).run(feeds)
    for k in ("table_grad", "w_grad"):
        np.testing.assert_allclose(lean[k], plain[k], rtol=1e-14)
    with pytest.raises(RevgraphError, match=r"finite_inputs names 'tabel', not an input of the graph; did you mean"):
        rg.gradient(g, "loss", wrt=["table"], finite_inputs=["tabel"])
