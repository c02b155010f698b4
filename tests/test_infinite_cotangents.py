"""A zero partial derivative stops an infinite cotangent in reverse mode, as in forward mode (issue 27, item 1;
DESIGN section 5, strong zeros).

``Sqrt`` at 0 sends an infinite cotangent to its input; where the next VJP multiplies it by a partial
derivative that is exactly 0 (``Mul(x, x)`` at x = 0, ``d * d`` of a deviation from a mean that is 0), the
product must be 0, not NaN: the 0 subgradient of a norm at 0 and of the standard deviation of a constant input,
which ``ReduceL2`` and forward mode give. Every spelling of a norm and of a standard deviation is swept; the
rows whose function is differentiable are checked against PyTorch (float64), the singular rows against the
hand-derived 0. Each gradient is also checked against forward mode (:func:`kit.zeros.grads`: the JVP along random
tangents equals ``<grad, t>``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kit import zeros

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.float64
AX = np.array([-1])


def _graph(nodes: list[Node], out: str, inits: dict | None = None) -> Graph:
    """``loss = sum(u * out)`` with ``out`` of shape (2, 1) or (2,) per row of ``x`` (2, 3)."""
    tail = [Node("Mul", [out, "u"], ["ou"], name="mulu"), Node("ReduceSum", ["ou"], ["loss"], {"keepdims": 0}, "sum")]
    return Graph(nodes + tail, [ValueInfo("x", F64, (2, 3))], [ValueInfo("loss")],
                 {"u": np.array([[0.5], [-1.5]]), "ax": AX, **(inits or {})})


def test_the_issue_example_sqrt_of_x_times_x_at_zero():
    # loss = sum(sqrt(x * x)) = sum(|x|) at x = [0, 0]: the 0 subgradient, as `revgraph jvp` gives (0)
    g = Graph([Node("Mul", ["x", "x"], ["s"], name="mul"), Node("Sqrt", ["s"], ["r"], name="sqrt"),
               Node("ReduceSum", ["r"], ["loss"], {"keepdims": 0}, "sum")], [ValueInfo("x", F64, (2,))],
              [ValueInfo("loss")])
    grads = zeros.grads(g, ["x"], {"x": np.zeros(2)})
    assert grads["x"].tolist() == [0.0, 0.0]
    # and away from 0 it is sign(x)
    assert zeros.grads(g, ["x"], {"x": np.array([-2.0, 3.0])})["x"].tolist() == [-1.0, 1.0]


def _n(name: str, op: str, ins: list[str], **attrs) -> Node:
    return Node(op, ins, [name], attrs, name)


def _sq(v: str, how: str, out: str) -> list[Node]:
    """``v * v`` spelled ``Mul``, ``Pow(v, 2)`` or ``Abs(v) * Abs(v)``."""
    if how == "mul":
        return [_n(out, "Mul", [v, v])]
    if how == "pow":
        return [_n(out, "Pow", [v, "two"])]
    return [_n(f"{out}_abs", "Abs", [v]), _n(out, "Mul", [f"{out}_abs", f"{out}_abs"])]


KD = {"keepdims": 1}
#: norms of the rows of x: name -> (nodes computing "n" from "x", torch function of x)
NORMS = {
    "sqrt_sum_mul": ([*_sq("x", "mul", "q"), _n("s", "ReduceSum", ["q", "ax"], **KD), _n("n", "Sqrt", ["s"])],
                     lambda x: x.norm(dim=-1, keepdim=True)),
    "sqrt_sum_pow": ([*_sq("x", "pow", "q"), _n("s", "ReduceSum", ["q", "ax"], **KD), _n("n", "Sqrt", ["s"])],
                     lambda x: x.norm(dim=-1, keepdim=True)),
    "sqrt_sum_abs_abs": ([*_sq("x", "abs", "q"), _n("s", "ReduceSum", ["q", "ax"], **KD), _n("n", "Sqrt", ["s"])],
                         lambda x: x.norm(dim=-1, keepdim=True)),
    "sqrt_sumsquare": ([_n("s", "ReduceSumSquare", ["x", "ax"], **KD), _n("n", "Sqrt", ["s"])],
                       lambda x: x.norm(dim=-1, keepdim=True)),
    "reduce_l2": ([_n("n", "ReduceL2", ["x", "ax"], **KD)], lambda x: x.norm(dim=-1, keepdim=True)),
    "rms": ([*_sq("x", "mul", "q"), _n("s", "ReduceMean", ["q", "ax"], **KD), _n("n", "Sqrt", ["s"])],
            lambda x: (x * x).mean(dim=-1, keepdim=True).sqrt()),
    "pow_half": ([*_sq("x", "mul", "q"), _n("s", "ReduceSum", ["q", "ax"], **KD), _n("n", "Pow", ["s", "half"])],
                 lambda x: x.norm(dim=-1, keepdim=True)),
    "sqrt_div_n": ([*_sq("x", "mul", "q"), _n("s", "ReduceSum", ["q", "ax"], **KD), _n("m", "Div", ["s", "three"]),
                    _n("n", "Sqrt", ["m"])], lambda x: (x * x).mean(dim=-1, keepdim=True).sqrt()),
}


def _deviation() -> list[Node]:
    return [_n("mu", "ReduceMean", ["x", "ax"], **KD), _n("d", "Sub", ["x", "mu"])]


def _torch_std(unbiased: bool):
    return lambda x: x.std(dim=-1, keepdim=True, correction=1 if unbiased else 0)


#: standard deviations of the rows of x, the same way
STDS = {
    "mean_mul": ([*_deviation(), *_sq("d", "mul", "q"), _n("v", "ReduceMean", ["q", "ax"], **KD),
                  _n("n", "Sqrt", ["v"])], _torch_std(False)),
    "mean_pow": ([*_deviation(), *_sq("d", "pow", "q"), _n("v", "ReduceMean", ["q", "ax"], **KD),
                  _n("n", "Sqrt", ["v"])], _torch_std(False)),
    "sumsquare_div": ([*_deviation(), _n("s", "ReduceSumSquare", ["d", "ax"], **KD), _n("v", "Div", ["s", "three"]),
                       _n("n", "Sqrt", ["v"])], _torch_std(False)),
    "sumsquare_unbiased": ([*_deviation(), _n("s", "ReduceSumSquare", ["d", "ax"], **KD),
                            _n("v", "Div", ["s", "two"]), _n("n", "Sqrt", ["v"])], _torch_std(True)),
    "sum_mul_times_third": ([*_deviation(), *_sq("d", "mul", "q"), _n("s", "ReduceSum", ["q", "ax"], **KD),
                             _n("v", "Mul", ["s", "third"]), _n("n", "Sqrt", ["v"])], _torch_std(False)),
    "l2_over_sqrt_n": ([*_deviation(), _n("s", "ReduceL2", ["d", "ax"], **KD), _n("n", "Div", ["s", "sqrt3"])],
                       _torch_std(False)),
    "mean_pow_pow_half": ([*_deviation(), *_sq("d", "pow", "q"), _n("v", "ReduceMean", ["q", "ax"], **KD),
                           _n("n", "Pow", ["v", "half"])], _torch_std(False)),
    "mean_abs_abs": ([*_deviation(), *_sq("d", "abs", "q"), _n("v", "ReduceMean", ["q", "ax"], **KD),
                      _n("n", "Sqrt", ["v"])], _torch_std(False)),
}
CONSTS = {"two": np.array(2.0), "half": np.array(0.5), "three": np.array(3.0), "third": np.array(1.0 / 3.0),
          "sqrt3": np.array(math.sqrt(3.0))}


def _check(nodes: list[Node], fn, x: np.ndarray, singular: int) -> None:
    """Row ``singular`` of ``x`` is where the function is not differentiable (a norm at 0, a constant row): its
    gradient is the hand-derived 0; the other row's is PyTorch's."""
    g = _graph(nodes, "n", CONSTS)
    got = zeros.grads(g, ["x"], {"x": x})["x"]
    assert np.array_equal(got[singular], np.zeros(3)), got
    xt = torch.tensor(x[1 - singular : 2 - singular], requires_grad=True)
    (fn(xt) * torch.tensor([[0.5, -1.5][1 - singular]], dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got[1 - singular], xt.grad.numpy()[0], rtol=1e-12)


@pytest.mark.parametrize("spelling", sorted(NORMS))
def test_every_norm_spelling_has_the_zero_subgradient_at_zero(spelling):
    nodes, fn = NORMS[spelling]
    _check(nodes, fn, np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 2.0]]), singular=0)


@pytest.mark.parametrize("spelling", sorted(STDS))
@pytest.mark.parametrize("value", [0.0, 2.0, -1e-3])
def test_every_standard_deviation_of_a_constant_row_has_gradient_zero(spelling, value):
    # the row [v, v, v] has deviations exactly 0 (its mean is v exactly for these v): variance 0, std 0
    nodes, fn = STDS[spelling]
    _check(nodes, fn, np.array([[1.0, 2.0, 4.0], [value] * 3]), singular=1)


def test_a_z_score_of_a_constant_row():
    # z = (x - mean) / (std + eps) at a constant row: the std's cotangent is sum(-d / (std + eps)^2 * u) = 0, and
    # the path through d gives (u - mean(u)) / eps; hand-derived with u = [1, 2, 6], eps = 0.5: [-2, -1, 3] / 0.5
    nodes = [*_deviation(), *_sq("d", "mul", "q"), _n("v", "ReduceMean", ["q", "ax"], **KD), _n("s", "Sqrt", ["v"]),
             _n("se", "Add", ["s", "eps"]), _n("z", "Div", ["d", "se"])]
    g = Graph([*nodes, Node("Mul", ["z", "w"], ["zw"], name="mulw"),
               Node("ReduceSum", ["zw"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", F64, (1, 3))], [ValueInfo("loss")],
              {"ax": AX, "eps": np.array(0.5), "w": np.array([[1.0, 2.0, 6.0]])})
    got = zeros.grads(g, ["x"], {"x": np.full((1, 3), 7.0)})["x"]
    np.testing.assert_allclose(got, [[-4.0, -2.0, 6.0]], rtol=1e-14)


def test_the_zero_partial_test_only_where_the_cotangent_may_be_infinite():
    # x an initializer (finite): Mul(x, x)'s VJP tests x == 0 under Sqrt, whose cotangent is inf at 0, and tests
    # nothing under Tanh, whose VJP maps finite cotangents to finite ones (nor g == 0: x is finite)
    def tests(top: str) -> list[str]:
        nodes = [*_sq("x", "mul", "q"), _n("s", "ReduceSum", ["q", "ax"], **KD), _n("n", top, ["s"])]
        g = _graph(nodes, "n", {"x": np.ones((2, 3))})
        g.inputs = []
        gg = rg.gradient(g, wrt=["x"])
        return sorted(n.op_type for n in gg.nodes if n.name.startswith("grad/q/") and n.op_type in ("Equal", "Or"))

    assert tests("Sqrt") == ["Equal"]  # x == 0 (the same test for both operands: merged)
    assert tests("Tanh") == []


def test_a_loop_body_that_makes_its_carried_cotangent_infinite():
    # h <- sqrt(h * h) three times from h0 = [0, -2]: loss = sum(h_3) = sum(|h0|), gradient [0, -1]. The body's
    # seeds (the carried cotangent) are finite in the first reverse iteration and infinite after it: the body's
    # VJP makes them so, and its Mul must stop them
    body = Graph([Node("Mul", ["h", "h"], ["q"], name="mul"), Node("Sqrt", ["q"], ["h2"], name="sqrt"),
                  Node("Identity", ["c"], ["c2"], name="cond")],
                 [ValueInfo("i", np.int64, ()), ValueInfo("c", np.bool_, ()), ValueInfo("h", F64, (2,))],
                 [ValueInfo("c2", np.bool_, ()), ValueInfo("h2", F64, (2,))])
    g = Graph([Node("Loop", ["n", "t", "h0"], ["hT"], {"body": body}, "loop"),
               Node("ReduceSum", ["hT"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("h0", F64, (2,))], [ValueInfo("loss")], {"n": np.array(3), "t": np.array(True)})
    assert zeros.grads(g, ["h0"], {"h0": np.array([0.0, -2.0])})["h0"].tolist() == [0.0, -1.0]


# ------------------------------------------------------------------------------------ rows that are all -inf

NEG = -math.inf
U = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
ROW = np.array([0.3, -1.2, 2.0])
#: op -> (attributes, extra inputs, PyTorch function of a row batch)
ROWWISE = {
    "Softmax": ({"axis": -1}, [], lambda x: torch.softmax(x, -1)),
    "LogSoftmax": ({"axis": -1}, [], lambda x: torch.log_softmax(x, -1)),
    "ReduceLogSumExp": ({"keepdims": 1}, ["ax"], lambda x: torch.logsumexp(x, -1, keepdim=True)),
}


def _rowwise_graph(op: str, mask_from: str) -> Graph:
    """``loss = sum(u * op(x + m))``: ``m`` a graph input or a constant (both may hold -inf)."""
    attrs, extra, _ = ROWWISE[op]
    nodes = [Node("Add", ["x", "m"], ["xm"], name="add"), Node(op, ["xm", *extra], ["y"], attrs, "op"),
             Node("Mul", ["y", "u"], ["yu"], name="mulu"), Node("ReduceSum", ["yu"], ["loss"], {"keepdims": 0}, "sum")]
    inits = {"u": U if op != "ReduceLogSumExp" else U[:, :1], "ax": AX}
    inputs = [ValueInfo("x", F64, (2, 3))]
    if mask_from == "input":
        inputs.append(ValueInfo("m", F64, (2, 3)))
    else:
        inits["m"] = np.array([[0.0] * 3, [NEG] * 3])
    return Graph(nodes, inputs, [ValueInfo("loss")], inits)


@pytest.mark.parametrize("mask_from", ["input", "constant"])
@pytest.mark.parametrize("op", sorted(ROWWISE))
def test_a_fully_masked_row_gets_a_zero_gradient(op, mask_from):
    # row 1 is all -inf (x + m with m = -inf there): its gradient is 0 (jax#6811, PyTorch's masked softmax);
    # row 0 is PyTorch's gradient of the same function
    g = _rowwise_graph(op, mask_from)
    x = np.array([ROW, [0.1, 0.2, 0.3]])
    feeds = {"x": x} | ({"m": np.array([[0.0] * 3, [NEG] * 3])} if mask_from == "input" else {})
    got = zeros.grads(g, ["x"], feeds)["x"]
    assert np.array_equal(got[1], np.zeros(3))
    xt = torch.tensor(ROW[None], requires_grad=True)
    u = torch.tensor(g.initializers["u"][:1])
    (ROWWISE[op][2](xt) * u).sum().backward()
    np.testing.assert_allclose(got[0], xt.grad.numpy()[0], rtol=1e-12)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_softmax_cross_entropy_over_a_fully_masked_row_that_counts(reduction):
    # row 1's scores are all -inf and its label counts (weight 1): that row's gradient is 0; row 0's is
    # softmax - onehot, hand-derived (divided by W = 2 for the mean: both rows count)
    g = Graph([Node("SoftmaxCrossEntropyLoss", ["s", "labels"], ["l"], {"reduction": reduction}, "sce"),
               Node("ReduceSum", ["l"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("s", F64, (2, 3)), ValueInfo("labels", np.int64, (2,))], [ValueInfo("loss")])
    got = zeros.grads(g, ["s"], {"s": np.array([ROW, [NEG] * 3]), "labels": np.array([2, 0])})["s"]
    p = np.exp(ROW - ROW.max()) / np.exp(ROW - ROW.max()).sum()
    want = (p - [0.0, 0.0, 1.0]) / (2.0 if reduction == "mean" else 1.0)
    np.testing.assert_allclose(got[0], want, rtol=1e-13)
    assert np.array_equal(got[1], np.zeros(3))


# ------------------------------------------------------------------------------------ forward = reverse


def test_the_issue_example_a_constant_function_has_zero_jvp_gradient_and_hvp():
    # loss = Exp(ReduceLogSumExp(c + x)) with c = [-inf, -inf] is the constant exp(-inf) = 0: its gradient,
    # JVP and HVP are 0 (the JVP was NaN: exp(x - y) is NaN at x = y = -inf)
    g = Graph([Node("Constant", [], ["c"], {"value": np.array([NEG, NEG])}, "c"),
               Node("Add", ["c", "x"], ["a"], name="add"),
               Node("ReduceLogSumExp", ["a"], ["r"], {"keepdims": 0}, "lse"),
               Node("Exp", ["r"], ["loss"], name="exp")],
              [ValueInfo("x", F64, (2,))], [ValueInfo("loss")])
    x = np.array([0.5, -1.0])
    assert zeros.grads(g, ["x"], {"x": x})["x"].tolist() == [0.0, 0.0]  # and the JVP is <grad, t> = 0
    hg = rg.hvp(g, "loss", ["x"])
    out = zeros.run(hg, {"x": x, **{v.name: np.array([0.3, -0.7]) for v in hg.inputs if v.name != "x"}})
    assert len(out) > 1 and all(v.tolist() == [0.0, 0.0] for k, v in out.items() if k != "loss")  # grad, H v


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_zero_factor_discards_an_input_in_both_modes(bad):
    # loss = sum(z * (x * p)) with z = 0 where x is inf or NaN: d/dp = sum(z * x) over the kept element = 1.5 * 2,
    # d/dx = z * p; forward mode meets t_p * x = NaN before the zero z, and must give <grad, t> too
    g = Graph([Node("Mul", ["x", "p"], ["xp"], name="mulp"), Node("Mul", ["z", "xp"], ["y"], name="mulz"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", F64, (3,)), ValueInfo("p", F64, ()), ValueInfo("z", F64, (3,))], [ValueInfo("loss")])
    feeds = {"x": np.array([bad, 2.0, bad]), "p": np.array(0.5), "z": np.array([0.0, 1.5, 0.0])}
    got = zeros.grads(g, ["x", "p"], feeds)
    assert got["p"] == 3.0 and got["x"].tolist() == [0.0, 0.75, 0.0]
