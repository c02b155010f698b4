"""Strong zeros (DESIGN section 5): an exact zero cotangent gives an exact zero, whatever the forward values.

A ``Where`` that discards a branch, a loss row that does not count (class weight 0, ``ignore_index``) and a
multiplication by an exact zero send a zero cotangent to values that may be inf or NaN: an overflowing ``Exp``,
an infinite or NaN graph input (a mask, padding), a derivative that is infinite at a finite point (``sqrt`` at
0). No gradient may become NaN there. References: values derived by hand, and PyTorch (float64) on the same
function with the discarded inputs replaced by finite ones (PyTorch has no strong zeros: ``0 * inf`` is NaN in
its products, so it is asked about the values that count only); a sweep runs every rule that multiplies a
cotangent by a forward value, and a property test builds random graphs around the three ways to discard.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kit import zeros

import revgraph as rg
from revgraph.autodiff import registry
from revgraph.errors import RevgraphError
from revgraph.ir import Graph, Node, ValueInfo

F = torch.nn.functional
F64 = np.float64
INF, NAN = math.inf, math.nan


def _grads(g: Graph, wrt: list[str] | None, feeds: dict, rtol: float = 1e-9) -> dict[str, np.ndarray]:
    return zeros.grads(g, wrt, feeds, rtol=rtol)  # and forward mode along random tangents agrees (issue 27)


def _const(name: str, value) -> Node:
    return Node("Constant", [], [name], {"value": np.asarray(value, F64)}, name)


def _sum(v: str, out: str = "loss") -> Node:
    return Node("ReduceSum", [v], [out], {"keepdims": 0}, f"sum_{v}")


# ------------------------------------------------------------------------------------ the issue's examples


def test_where_discards_an_overflowing_exp():
    # y = Where(x > 30, 1, Exp(x)), loss = sum(y) at x = [1000, 0]: d/dx = [0, exp(0)] = [0, 1]
    g = Graph([_const("t", 30.0), _const("one", 1.0), Node("Greater", ["x", "t"], ["c"], name="gt"),
               Node("Exp", ["x"], ["e"], name="exp"), Node("Where", ["c", "one", "e"], ["y"], name="where"), _sum("y")],
              [ValueInfo("x", F64, (2,))], [ValueInfo("loss")])
    grads = _grads(g, ["x"], {"x": np.array([1000.0, 0.0])})
    assert grads["x"].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("wrt", [["beta"], None])  # None: every float input, x included
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_where_discards_a_non_finite_input(wrt, bad):
    # y = Where(c, beta * x, 1): where c is False the product is discarded; d/dbeta = sum over kept x = 2,
    # d/dx = beta where kept, 0 where discarded (also at the inf or NaN element)
    g = Graph([Node("Mul", ["beta", "x"], ["m"], name="mul"), _const("one", 1.0),
               Node("Where", ["c", "m", "one"], ["y"], name="where"), _sum("y")],
              [ValueInfo("beta", F64, ()), ValueInfo("x", F64, (3,)), ValueInfo("c", np.bool_, (3,))],
              [ValueInfo("loss")])
    feeds = {"beta": np.array(1.5), "x": np.array([bad, 2.0, bad]), "c": np.array([False, True, False])}
    grads = _grads(g, wrt, feeds)
    assert grads["beta"] == 2.0
    if wrt is None:
        assert grads["x"].tolist() == [0.0, 1.5, 0.0]


def test_the_issue_example_beta_alone():
    # exactly as filed: c = False, x = inf, beta_grad = 0
    g = Graph([Node("Mul", ["beta", "x"], ["m"], name="mul"), _const("one", 1.0),
               Node("Where", ["c", "m", "one"], ["y"], name="where"), _sum("y")],
              [ValueInfo("beta", F64, ()), ValueInfo("x", F64, ()), ValueInfo("c", np.bool_, ())], [ValueInfo("loss")])
    grads = _grads(g, ["beta"], {"beta": np.array(2.0), "x": np.array(INF), "c": np.array(False)})
    assert grads["beta"] == 0.0


def _softmax(row):
    z = np.exp(np.asarray(row) - np.max(row))
    return z / z.sum()


def test_softmax_cross_entropy_zero_weight_row_of_minus_inf():
    # weight [1, 1, 0], labels [0, 2]: row 1 has weight 0 and does not count (W = 1); its logits are all -inf.
    # d/dscores row 0 = (softmax([1, 2, 3]) - onehot(0)) / W, row 1 = 0.
    g = Graph([Node("SoftmaxCrossEntropyLoss", ["s", "labels", "w"], ["loss"], name="sce")],
              [ValueInfo("s", F64, (2, 3)), ValueInfo("labels", np.int64, (2,))], [ValueInfo("loss")],
              {"w": np.array([1.0, 1.0, 0.0])})
    grads = _grads(g, ["s"], {"s": np.array([[1.0, 2.0, 3.0], [-INF] * 3]), "labels": np.array([0, 2])})
    expected = np.array([_softmax([1.0, 2.0, 3.0]) - [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(grads["s"], expected, rtol=1e-14, atol=0)
    assert np.array_equal(grads["s"][1], np.zeros(3))


def _loss_graph(op: str, reduction: str, ignore: int | None, weights: np.ndarray | None, shape) -> Graph:
    attrs = {"reduction": reduction} | ({"ignore_index": ignore} if ignore is not None else {})
    ins = ["s", "labels"] + (["w"] if weights is not None else [])
    nodes = [Node(op, ins, ["l"], attrs, "loss")]
    if reduction == "none":
        nodes.append(Node("Mul", ["l", "u"], ["lu"], name="mul"))
        nodes.append(_sum("lu"))
    else:
        nodes.append(Node("Identity", ["l"], ["loss"], name="id"))
    inits = {"u": np.array([0.5, -1.5, 2.0, 1.0])[: shape[0]]} | ({"w": weights} if weights is not None else {})
    inputs = [ValueInfo("s", F64, shape), ValueInfo("labels", np.int64, shape[:1])]
    return Graph(nodes, inputs, [ValueInfo("loss")], inits)


LOSS_CASES = [(op, red, how, bad) for op in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
              for red in ("none", "sum", "mean") for how in ("weight", "ignore_index") for bad in (-INF, INF, NAN)]


@pytest.mark.parametrize(("op", "reduction", "how", "bad"), LOSS_CASES)
def test_loss_rows_that_do_not_count_get_zero_gradients(op, reduction, how, bad):
    # rows 1 and 3 do not count (label of weight 0, or ignore_index); their scores are inf or NaN.
    # PyTorch on the same function with those rows made finite (their values do not matter) is the reference.
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((4, 3))
    weights = np.array([0.7, 1.3, 0.0]) if how == "weight" else None
    labels = np.array([0, 2, 1, 2]) if how == "weight" else np.array([0, -1, 1, -1])
    ignore = -1 if how == "ignore_index" else None
    dirty = scores.copy()
    dirty[[1, 3]] = bad
    g = _loss_graph(op, reduction, ignore, weights, (4, 3))
    got = _grads(g, ["s"], {"s": dirty, "labels": labels})["s"]
    st_ = torch.tensor(scores, requires_grad=True)
    fn = F.cross_entropy if op == "SoftmaxCrossEntropyLoss" else F.nll_loss
    lt = fn(st_, torch.tensor(labels), weight=None if weights is None else torch.tensor(weights),
            ignore_index=-100 if ignore is None else ignore, reduction=reduction)
    (lt * torch.tensor([0.5, -1.5, 2.0, 1.0]) if reduction == "none" else lt).sum().backward()
    np.testing.assert_allclose(got, st_.grad.numpy(), rtol=1e-12, atol=1e-15)
    assert np.array_equal(got[[1, 3]], np.zeros((2, 3)))


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_no_row_counts_mean_gives_zeros(op):
    # every label ignored: W = 0, the mean is 0/0; no row counts, so every gradient is 0 (PyTorch gives 0 too)
    g = _loss_graph(op, "mean", -1, None, (2, 3))
    got = _grads(g, ["s"], {"s": np.array([[1.0, 2.0, 3.0], [NAN, 0.0, 1.0]]), "labels": np.array([-1, -1])})["s"]
    assert np.array_equal(got, np.zeros((2, 3)))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_weight_gradient_ignores_rows_that_do_not_count(reduction):
    # d loss / d w[c] with a NaN row labelled with an ignored index: hand-derived from l_n = -w[y_n] logp[n, y_n]
    logp = np.log(np.array([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1], [NAN, NAN, NAN]]))
    labels = np.array([2, 0, -1])
    w = np.array([0.5, 2.0, 1.5])
    g = Graph([Node("NegativeLogLikelihoodLoss", ["x", "labels", "w"], ["l"], {"reduction": reduction,
                                                                              "ignore_index": -1}, "nll"),
               _sum("l")],
              [ValueInfo("x", F64, (3, 3)), ValueInfo("labels", np.int64, (3,)), ValueInfo("w", F64, (3,))],
              [ValueInfo("loss")])
    got = _grads(g, ["w"], {"x": logp, "labels": labels, "w": w})["w"]
    picked = np.array([-logp[1, 0], 0.0, -logp[0, 2]])  # sum over rows labelled c of -logp[n, c]
    if reduction == "mean":  # d (S / W) / dw_c = (dS/dw_c - (S / W) dW/dw_c) / W, W = w[2] + w[0]
        total_w = w[2] + w[0]
        s = w[2] * -logp[0, 2] + w[0] * -logp[1, 0]
        picked = (picked - np.array([1.0, 0.0, 1.0]) * s / total_w) / total_w
    np.testing.assert_allclose(got, picked, rtol=1e-14)


# ------------------------------------------------------------------------------------ every rule, swept

AX = np.array([-1])
_R = {"dim": -1, "keepdim": True}
# op -> (attributes, extra constant inputs, values that make the value or the slope inf or NaN, the same function
# in PyTorch, where the kept inputs lie: x in [0.2, 0.6] + shift)
UNARY_SWEEP = {
    "Exp": ({}, [], [1000.0, INF, NAN], torch.exp, 0.0),
    "Sinh": ({}, [], [1000.0, INF, NAN], torch.sinh, 0.0),
    "Cosh": ({}, [], [1000.0, -INF, NAN], torch.cosh, 0.0),
    "Tan": ({}, [], [INF, NAN], torch.tan, 0.0),
    "Softplus": ({}, [], [INF, NAN], F.softplus, 0.0),
    "Sigmoid": ({}, [], [NAN], torch.sigmoid, 0.0),
    "Tanh": ({}, [], [NAN], torch.tanh, 0.0),
    "Erf": ({}, [], [NAN], torch.erf, 0.0),
    "Sin": ({}, [], [INF, NAN], torch.sin, 0.0),
    "Cos": ({}, [], [-INF, NAN], torch.cos, 0.0),
    "Abs": ({}, [], [NAN, INF], torch.abs, 0.0),
    "Sqrt": ({}, [], [0.0, -1.0, INF, NAN], torch.sqrt, 0.0),
    "Log": ({}, [], [0.0, -1.0, NAN], torch.log, 0.0),
    "Reciprocal": ({}, [], [0.0, NAN], torch.reciprocal, 0.0),
    "Gelu": ({}, [], [-INF, NAN], F.gelu, 0.0),
    "Mish": ({}, [], [-INF, NAN], F.mish, 0.0),
    "Elu": ({"alpha": 0.5}, [], [NAN, -INF], lambda x: F.elu(x, 0.5), -0.4),
    "Selu": ({}, [], [NAN], F.selu, -0.4),
    "Celu": ({}, [], [NAN], F.celu, -0.4),
    "Softsign": ({}, [], [NAN], F.softsign, 0.0),
    "Atan": ({}, [], [NAN], torch.atan, 0.0),
    "Asinh": ({}, [], [NAN], torch.asinh, 0.0),
    "Asin": ({}, [], [1.0, 2.0, NAN], torch.asin, 0.0),
    "Acos": ({}, [], [-1.0, 2.0, NAN], torch.acos, 0.0),
    "Acosh": ({}, [], [1.0, 0.0, NAN], torch.acosh, 1.0),
    "Atanh": ({}, [], [1.0, NAN], torch.atanh, 0.0),
    "LeakyRelu": ({"alpha": 0.25}, [], [NAN, -INF], lambda x: F.leaky_relu(x, 0.25), -0.4),
    "HardSwish": ({}, [], [NAN, INF], F.hardswish, 0.0),
    "HardSigmoid": ({}, [], [NAN, INF], lambda x: torch.clamp(float(np.float32(0.2)) * x + 0.5, 0.0, 1.0), 0.0),
    "Relu": ({}, [], [NAN, INF], torch.relu, -0.4),
    "ThresholdedRelu": ({"alpha": 0.5}, [], [NAN], lambda x: x * (x > 0.5), 0.0),
    "Shrink": ({"lambd": 0.25}, [], [NAN], lambda x: torch.where(x.abs() > 0.25, x, 0.0), 0.0),
    "Softmax": ({"axis": -1}, [], [-INF], lambda x: torch.softmax(x, -1), 0.0),
    "LogSoftmax": ({"axis": -1}, [], [-INF, INF, NAN], lambda x: torch.log_softmax(x, -1), 0.0),
    "ReduceSumSquare": ({"keepdims": 1}, [AX], [INF, NAN], lambda x: (x * x).sum(**_R), 0.0),
    "ReduceL1": ({"keepdims": 1}, [AX], [NAN], lambda x: x.abs().sum(**_R), 0.0),
    "ReduceL2": ({"keepdims": 1}, [AX], [INF, NAN], lambda x: x.norm(**_R), 0.0),
    "ReduceLogSumExp": ({"keepdims": 1}, [AX], [INF, NAN], lambda x: torch.logsumexp(x, **_R), 0.0),
    "ReduceProd": ({"keepdims": 1}, [AX], [INF, 1e200], lambda x: x.prod(**_R), 0.0),
    "ReduceMax": ({"keepdims": 1}, [AX], [INF, NAN], lambda x: x.amax(**_R), 0.0),
    "ReduceMin": ({"keepdims": 1}, [AX], [-INF, NAN], lambda x: x.amin(**_R), 0.0),
    "ReduceLogSum": ({"keepdims": 1}, [AX], [INF, NAN, 0.0], lambda x: torch.log(x.sum(**_R)), 0.0),
    "Swish": ({"alpha": 1.0}, [], [INF, NAN, -INF], F.silu, 0.0),
}
#: op -> (values that make the value or a slope inf or NaN, PyTorch function of (first, second), operand
#: orders allowed: the scalar parameter p second only where ONNX wants a scalar or slope there)
BINARY_SWEEP = {
    "Mul": ([INF, NAN], torch.mul, (0, 1)), "Div": ([0.0, INF, NAN], torch.div, (0, 1)),
    "Pow": ([0.0, -1.0, INF, NAN], torch.pow, (0, 1)), "Max": ([NAN, INF], torch.maximum, (0, 1)),
    "Min": ([NAN, -INF], torch.minimum, (0, 1)), "Sub": ([INF, NAN], torch.sub, (0, 1)),
    "Add": ([INF, NAN], torch.add, (0, 1)), "Mod": ([0.0, INF, NAN], torch.fmod, (0, 1)),
    "PRelu": ([NAN, -INF], lambda x, s: torch.where(x > 0, x, s * x), (0,)),
    "Clip": ([NAN, INF, -INF], lambda x, lo: torch.clamp(x, lo, torch.tensor(2.0, dtype=torch.float64)), (0,)),
}
#: rules of the strong-zero families (DESIGN section 5) whose VJP multiplies the cotangent by a forward value
#: (their registration: not ``bounded``, ``product`` or ``reads="all"``) that the two sweeps do not run: where
#: they are tested instead, or why not
NOT_SWEPT = {
    "SoftmaxCrossEntropyLoss": "test_loss_rows_that_do_not_count_get_zero_gradients",
    "NegativeLogLikelihoodLoss": "test_loss_rows_that_do_not_count_get_zero_gradients",
    "CumProd": "a discarded element enters every later product along the axis, kept ones too",
    "SwiGLU": "not swept yet: its operands are the two halves of one input",
}
STRONG_ZERO_FAMILIES = ("rules.elementwise", "rules.activations", "rules.softmax", "rules.reduce", "rules.loss")
KEPT = np.array([[0.3, 0.4, 0.5], [0.2, 0.6, 0.45]])
U = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
#: the reference evaluator computes Erf and Gelu in float32 precision (issue 13, section 3); ONNX float attributes
#: and constants are float32 (Selu's alpha and gamma, HardSwish's 1/6)
LOOSE = {"Erf": 1e-6, "Gelu": 1e-6, "Selu": 1e-7, "HardSwish": 1e-7}  # and float32 attributes


def _discarding_graph(nodes: list[Node], out: str, inputs: list[ValueInfo]) -> Graph:
    """``loss = sum(u * Where(c, out, 0))`` with ``c`` of the shape (2, 3) of ``out`` (after broadcasting)."""
    tail = [_const("zero", 0.0), Node("Where", ["c", out, "zero"], ["w"], name="where"),
            Node("Mul", ["w", "u"], ["wu"], name="mulu"), _sum("wu")]
    return Graph(nodes + tail, [*inputs, ValueInfo("c", np.bool_, (2, 3))], [ValueInfo("loss")], {"u": U})


def _row_mask(op: str) -> np.ndarray:
    # whole rows for the reductions and softmaxes, single elements otherwise
    if op.startswith("Reduce") or op.endswith("Softmax"):
        return np.array([[True] * 3, [False] * 3])
    return np.array([[True, False, True], [False, True, False]])


def _torch_grads(fn, c: np.ndarray, *args: np.ndarray) -> list[np.ndarray]:
    """Gradients of ``sum(u * where(c, fn(*args), 0))`` by PyTorch autograd (float64)."""
    ts = [torch.tensor(a, requires_grad=True) for a in args]
    y = fn(*ts)
    (torch.where(torch.tensor(c), y, torch.zeros_like(y)) * torch.tensor(U)).sum().backward()
    return [t.grad.numpy() for t in ts]


@pytest.mark.parametrize(("op", "bad"), [(op, bad) for op, spec in UNARY_SWEEP.items() for bad in spec[2]])
def test_every_unary_rule_keeps_strong_zeros(op, bad):
    # loss = sum(u * Where(c, op(x * p), 0)): the discarded elements of x are inf, NaN, or where op overflows
    attrs, extra, _, fn, shift = UNARY_SWEEP[op]
    c = _row_mask(op)
    kept = KEPT + shift
    x = np.where(c, kept, bad)
    if op == "Softmax":  # a row of Softmax must keep a finite entry (DESIGN: Softmax outputs are taken as finite)
        x[1] = [bad, 0.1, 0.2]
    names = [f"k{i}" for i in range(len(extra))]
    nodes = [Node("Mul", ["x", "p"], ["xp"], name="scale"), Node(op, ["xp", *names], ["y"], attrs, "op")]
    g = _discarding_graph(nodes, "y", [ValueInfo("x", F64, (2, 3)), ValueInfo("p", F64, ())])
    g.initializers.update(dict(zip(names, extra, strict=True)))
    grads = _grads(g, ["x", "p"], {"x": x, "p": np.array(1.0), "c": c})
    assert np.all(np.isfinite(grads["x"])) and np.isfinite(grads["p"]), grads
    assert np.array_equal(grads["x"][~c], np.zeros(int((~c).sum())))
    want_x, want_p = _torch_grads(lambda x, p: fn(x * p), c, np.where(c, kept, 0.7 + shift), np.array(1.0))
    rtol = LOOSE.get(op, 1e-12)
    np.testing.assert_allclose(grads["x"], want_x, rtol=rtol, atol=1e-300)
    np.testing.assert_allclose(grads["p"], want_p, rtol=rtol)


@pytest.mark.parametrize(("op", "bad", "side"), [(op, bad, side) for op, (bads, _, sides) in BINARY_SWEEP.items()
                                                 for bad in bads for side in sides])
def test_every_binary_rule_keeps_strong_zeros(op, bad, side):
    # the non-finite value sits in x, the wrt scalar p in the other operand (first or second); both get gradients
    _, fn, _ = BINARY_SWEEP[op]
    c = _row_mask(op)
    x = np.where(c, KEPT, bad)
    ins = ["x", "p"] if side == 0 else ["p", "x"]
    nodes = [Node(op, ins + (["hi"] if op == "Clip" else []), ["y"], {"fmod": 1} if op == "Mod" else {}, "op")]
    if op == "Clip":
        nodes.insert(0, _const("hi", 2.0))
    g = _discarding_graph(nodes, "y", [ValueInfo("x", F64, (2, 3)), ValueInfo("p", F64, ())])
    p = np.array(0.35)
    grads = _grads(g, ["x", "p"], {"x": x, "p": p, "c": c})
    assert np.all(np.isfinite(grads["x"])) and np.isfinite(grads["p"]), grads
    assert np.array_equal(grads["x"][~c], np.zeros(int((~c).sum())))
    both = (lambda x, p: fn(x, p)) if side == 0 else (lambda x, p: fn(p, x))
    want_x, want_p = _torch_grads(both, c, np.where(c, KEPT, 0.7), p)
    np.testing.assert_allclose(grads["x"], want_x, rtol=1e-12)
    np.testing.assert_allclose(grads["p"], want_p, rtol=1e-12)


def test_the_sweeps_run_every_rule_that_multiplies_by_a_forward_value():
    # read from the registrations (registry.FACTS), the facts finite.py decides by: a rule registered as
    # reading forward values is swept (or listed in NOT_SWEPT); the sweeps also run selections that read none
    reading = {op for op, f in registry.FACTS.items() if op in registry.RULES
               and registry.RULES[op].__module__.endswith(STRONG_ZERO_FAMILIES)
               and (not f.bounded or f.product or f.reads == registry.ALL)}
    assert reading - set(UNARY_SWEEP) - set(BINARY_SWEEP) == set(NOT_SWEPT)
    assert {"Exp", "Mul", "Sqrt", "Softmax", "ReduceLogSum", "Swish"} <= reading


def test_multiplication_by_an_exact_zero_hides_an_infinite_slope():
    # y = w * sqrt(x) with w = 0 where x = 0: d/dx = w / (2 sqrt(x)) = 0 * inf there, taken as 0; d/dw = sqrt(x)
    g = Graph([Node("Sqrt", ["x"], ["s"], name="sqrt"), Node("Mul", ["w", "s"], ["y"], name="mul"), _sum("y")],
              [ValueInfo("x", F64, (3,)), ValueInfo("w", F64, (3,))], [ValueInfo("loss")])
    grads = _grads(g, None, {"x": np.array([0.0, 4.0, 0.0]), "w": np.array([0.0, 3.0, 0.0])})
    np.testing.assert_array_equal(grads["x"], [0.0, 0.75, 0.0])
    np.testing.assert_array_equal(grads["w"], [0.0, 2.0, 0.0])


# ------------------------------------------------------------------------------------ Clip, Max, Min at ties


def _clip_graph(with_lo=True, with_hi=True) -> Graph:
    ins = ["x", "lo" if with_lo else "", "hi" if with_hi else ""]
    while ins and not ins[-1]:
        ins.pop()
    vis = [ValueInfo("x", F64, (3,))] + [ValueInfo(n, F64, ()) for n in ("lo", "hi") if n in ins]
    return Graph([Node("Clip", ins, ["y"], name="clip"), Node("Mul", ["y", "u"], ["yu"], name="mul"), _sum("yu")],
                 vis, [ValueInfo("loss")], {"u": np.array([1.0, 2.0, 4.0])})


def test_clip_with_crossed_bounds_gives_everything_to_max():
    # ONNX: Clip = Min(max, Max(x, min)); min = 2 > max = 1 makes every output 1 = max
    g = _clip_graph()
    g.initializers["u"] = np.ones(3)
    grads = _grads(g, None, {"x": np.array([-2.0, 0.0, 6.0]), "lo": np.array(2.0), "hi": np.array(1.0)})
    assert grads["x"].tolist() == [0.0, 0.0, 0.0] and grads["lo"] == 0.0 and grads["hi"] == 3.0


def test_clip_at_coinciding_bounds_splits_ties():
    # lo = hi = 1, u = [1, 2, 4]: x = -2: Max gives lo, then Min ties lo with hi: half each;
    # x = 1: Max ties x with lo, Min ties that with hi: x 1/4, lo 1/4, hi 1/2; x = 6: all to hi
    grads = _grads(_clip_graph(), None, {"x": np.array([-2.0, 1.0, 6.0]), "lo": np.array(1.0), "hi": np.array(1.0)})
    np.testing.assert_array_equal(grads["x"], [0.0, 0.5, 0.0])
    assert grads["lo"] == 0.5 * 1 + 0.25 * 2 and grads["hi"] == 0.5 * 1 + 0.5 * 2 + 4


def _torch_clip(x, lo, hi):
    return torch.minimum(torch.maximum(x, lo), hi)  # PyTorch splits ties of maximum/minimum equally, too


@settings(max_examples=40, deadline=None)
@given(xs=st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0, 2.0]), min_size=3, max_size=3),
       lo=st.sampled_from([-1.0, 0.0, 1.0, 2.0]), hi=st.sampled_from([-1.0, 0.0, 1.0, 2.0]))
def test_clip_is_min_of_max_at_every_tie_and_crossing(xs, lo, hi):
    # bounds and inputs drawn from a few integers: ties at both bounds, coinciding and crossed bounds
    x = np.array(xs)
    grads = _grads(_clip_graph(), None, {"x": x, "lo": np.array(lo), "hi": np.array(hi)})
    xt, lot, hit = (torch.tensor(v, requires_grad=True) for v in (x, lo, hi))
    (_torch_clip(xt, lot, hit) * torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)).sum().backward()
    np.testing.assert_array_equal(grads["x"], xt.grad.numpy())
    assert grads["lo"] == lot.grad.item() and grads["hi"] == hit.grad.item()
    # the same function written with Max and Min nodes
    comp = Graph([Node("Max", ["x", "lo"], ["m"], name="max"), Node("Min", ["m", "hi"], ["y"], name="min"),
                  Node("Mul", ["y", "u"], ["yu"], name="mul"), _sum("yu")],
                 [ValueInfo("x", F64, (3,)), ValueInfo("lo", F64, ()), ValueInfo("hi", F64, ())], [ValueInfo("loss")],
                 {"u": np.array([1.0, 2.0, 4.0])})
    composed = _grads(comp, None, {"x": x, "lo": np.array(lo), "hi": np.array(hi)})
    for k in grads:
        np.testing.assert_array_equal(composed[k], grads[k])


@pytest.mark.parametrize("which", ["lo", "hi"])
def test_clip_with_one_bound_splits_its_tie(which):
    x = np.array([-1.0, 0.0, 1.0])
    g = _clip_graph(with_lo=which == "lo", with_hi=which == "hi")
    grads = _grads(g, None, {"x": x, which: np.array(0.0)})
    if which == "lo":  # Max(x, 0), u = [1, 2, 4]: the tie at x = 0 gives half of 2 to each
        np.testing.assert_array_equal(grads["x"], [0.0, 1.0, 4.0])
        assert grads["lo"] == 1.0 + 1.0
    else:  # Min(x, 0)
        np.testing.assert_array_equal(grads["x"], [1.0, 1.0, 0.0])
        assert grads["hi"] == 1.0 + 4.0


@pytest.mark.parametrize(("lo", "hi"), [(1.0, 1.0), (2.0, 1.0), (0.0, 1.0)])
def test_where_built_clamp_matches_pytorch_at_coinciding_and_crossed_bounds(lo, hi):
    # Where(x < lo, lo, Where(x > hi, hi, x)): a different function from Clip when lo > hi (lo wins there)
    x = np.array([-2.0, 0.0, 1.0, 1.5, 6.0])
    g = Graph([Node("Less", ["x", "lo"], ["below"], name="lt"), Node("Greater", ["x", "hi"], ["above"], name="gt"),
               Node("Where", ["above", "hi", "x"], ["top"], name="w1"),
               Node("Where", ["below", "lo", "top"], ["y"], name="w2"), _sum("y")],
              [ValueInfo("x", F64, (5,)), ValueInfo("lo", F64, ()), ValueInfo("hi", F64, ())], [ValueInfo("loss")])
    grads = _grads(g, None, {"x": x, "lo": np.array(lo), "hi": np.array(hi)})
    xt, lot, hit = (torch.tensor(v, requires_grad=True) for v in (x, lo, hi))
    torch.where(xt < lot, lot, torch.where(xt > hit, hit, xt)).sum().backward()
    np.testing.assert_array_equal(grads["x"], xt.grad.numpy())
    assert grads["lo"] == lot.grad.item() and grads["hi"] == hit.grad.item()


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_of_nan_send_no_nan(op):
    # Max(a, b) with a NaN: the result is NaN (numpy and onnxruntime propagate it) and equals no operand, so
    # no operand gets a share; a zero cotangent from a Where must stay 0
    g = Graph([Node(op, ["a", "b"], ["m"], name="op"), _const("zero", 0.0),
               Node("Where", ["c", "m", "zero"], ["y"], name="w"), _sum("y")],
              [ValueInfo("a", F64, (2,)), ValueInfo("b", F64, (2,)), ValueInfo("c", np.bool_, (2,))],
              [ValueInfo("loss")])
    feeds = {"a": np.array([NAN, 1.0]), "b": np.array([2.0, 1.0]), "c": np.array([False, True])}
    grads = _grads(g, ["a", "b"], feeds)
    np.testing.assert_array_equal(grads["a"], [0.0, 0.5])
    np.testing.assert_array_equal(grads["b"], [0.0, 0.5])


# ------------------------------------------------------------------------------------ integer results


def _integer_node_gradients(node: Node, inputs: list[ValueInfo], feeds: dict) -> dict:
    """``rg.backward`` of a one-node graph whose output type is not recorded (so that the entry check for
    integer losses lets it through and the rule decides), with ones as the seed; the gradients computed."""
    g = Graph([node], inputs, [ValueInfo(node.outputs[0])])
    types = {v.name: v for v in inputs}
    nodes, grad_map = rg.backward(g, {node.outputs[0]: None}, [v.name for v in inputs if v.dtype.kind == "f"],
                                  types=types)
    g.nodes += nodes
    g.outputs += [ValueInfo(v) for v in grad_map.values() if v not in g.output_names]
    return {k: rg.Session(g).run(feeds)[v] for k, v in grad_map.items()} if grad_map else {}


def test_pow_of_an_integer_base_gives_no_gradient_with_a_warning():
    # Pow(int32, float) is int32: an integer carries no gradient (the rule used to emit Log of an int32)
    node = Node("Pow", ["b", "p"], ["y"], name="pow")
    inputs = [ValueInfo("b", np.int32, (3,)), ValueInfo("p", np.float32, (3,))]
    with pytest.warns(UserWarning, match=r"node 'pow' \(Pow\): its output 'y' is int32, an integer, so no gradient "
                                         r"flows to 'p'"):
        grads = _integer_node_gradients(node, inputs, {"b": np.array([1, 2, 3], np.int32),
                                                       "p": np.array([2.0, 1.0, 0.5], np.float32)})
    assert "p" not in grads  # no gradient flows: gradient() gives zeros with its "no path" warning


def test_pow_of_an_integer_base_through_gradient():
    # the public entry refuses an integer loss in one line, or (before that check) the rule gives zeros
    g = Graph([Node("Pow", ["b", "p"], ["y"], name="pow")],
              [ValueInfo("b", np.int32, (3,)), ValueInfo("p", np.float32, (3,))], [ValueInfo("y", np.int32, (3,))])
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            gg = rg.gradient(g, wrt=["p"])
    except RevgraphError as exc:
        assert "\n" not in str(exc) and "'y'" in str(exc)
        return
    out = rg.Session(gg).run({"b": np.array([1, 2, 3], np.int32), "p": np.array([2.0, 1.0, 0.5], np.float32)})
    assert out["p_grad"].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("op", ["Cast", "CastLike"])
def test_cast_to_an_integer_gives_no_gradient(op):
    # Cast(x, to=int64) is piecewise constant: PyTorch refuses to differentiate it, revgraph gives none
    ins = ["x"] if op == "Cast" else ["x", "like"]
    node = Node(op, ins, ["y"], {"to": 7} if op == "Cast" else {}, "cast")
    inputs = [ValueInfo("x", F64, (2,))] + ([ValueInfo("like", np.int64, ())] if op == "CastLike" else [])
    feeds = {"x": np.array([1.7, -2.2])} | ({"like": np.array(0, np.int64)} if op == "CastLike" else {})
    with pytest.warns(UserWarning, match=r"is int64, an integer, so no gradient flows to 'x'"):
        grads = _integer_node_gradients(node, inputs, feeds)
    assert "x" not in grads


@pytest.mark.parametrize("to", [onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.BOOL])
def test_a_cast_to_an_integer_inside_the_path_warns(to):
    # issue 39: x*x -> Cast(int) -> Cast(float) -> + x: the integer path carries no gradient, and prune cut it
    # before any rule could say so; the warning names the node, the gradient is the other path's (1)
    g = Graph([Node("Mul", ["x", "x"], ["m"], name="sq"), Node("Cast", ["m"], ["i"], {"to": to}, "to_int"),
               Node("Cast", ["i"], ["f"], {"to": onnx.TensorProto.DOUBLE}, "to_float"),
               Node("Add", ["f", "x"], ["y"], name="add"), _sum("y")], [ValueInfo("x", F64, (3,))], [ValueInfo("loss")])
    with pytest.warns(UserWarning, match=r"node 'to_int' \(Cast\): its output 'i' is (int32|int64|bool), an "
                                         r"integer, so no gradient flows to 'm' through it"):
        gg = rg.gradient(g, "loss", wrt=["x"])
    assert rg.Session(gg).run({"x": np.array([1.5, 2.0, 3.0])})["x_grad"].tolist() == [1.0, 1.0, 1.0]


def test_no_integer_warning_for_comparisons_or_casts_off_the_path():
    # a mask made by a comparison is meant to carry no gradient, and a Cast whose result never reaches the loss
    # is no cut: neither warns
    g = Graph([Node("Greater", ["x", "zero"], ["c"], name="gt"), Node("Cast", ["c"], ["cf"], {"to": 11}, "mask"),
               Node("Cast", ["x"], ["unused"], {"to": onnx.TensorProto.INT64}, "dead"),
               Node("Mul", ["x", "cf"], ["y"], name="relu"), _sum("y")], [ValueInfo("x", F64, (3,))],
              [ValueInfo("loss"), ValueInfo("unused")], {"zero": np.array(0.0)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gg = rg.gradient(g, "loss", wrt=["x"])
    assert rg.Session(gg).run({"x": np.array([-1.0, 2.0, 3.0])})["x_grad"].tolist() == [0.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------ random graphs

CHAIN = {  # onnx op -> (attributes, torch function); all defined on the whole real line, moderate slopes
    "Tanh": ({}, torch.tanh), "Sigmoid": ({}, torch.sigmoid), "Sin": ({}, torch.sin), "Cos": ({}, torch.cos),
    "Exp": ({}, torch.exp), "Neg": ({}, torch.neg), "Abs": ({}, torch.abs), "Relu": ({}, torch.relu),
    "Softplus": ({}, F.softplus), "Atan": ({}, torch.atan), "Softsign": ({}, F.softsign),
    "Elu": ({"alpha": 1.0}, F.elu), "Asinh": ({}, torch.asinh), "Sinh": ({}, torch.sinh),
    "Erf": ({}, torch.erf),
}
WITH_P = {  # binary ops with the scalar parameter p in [0.5, 1.5]
    "Mul": torch.mul, "Add": torch.add, "Sub": torch.sub, "Div": torch.div, "Max": torch.maximum, "Min": torch.minimum,
}
BAD = [INF, -INF, NAN, 1000.0, -1000.0]


@st.composite
def chains(draw, max_len=4):
    """A list of steps: ("unary", op) or ("binary", op, p first?)."""
    steps = []
    for _ in range(draw(st.integers(1, max_len))):
        if draw(st.booleans()):
            steps.append(("unary", draw(st.sampled_from(sorted(CHAIN)))))
        else:
            steps.append(("binary", draw(st.sampled_from(sorted(WITH_P))), draw(st.booleans())))
    return steps


def _onnx_chain(steps, v: str) -> tuple[list[Node], str]:
    nodes = []
    for k, step in enumerate(steps):
        out = f"h{k}"
        if step[0] == "unary":
            nodes.append(Node(step[1], [v], [out], CHAIN[step[1]][0], f"c{k}"))
        else:
            ins = ["p", v] if step[2] else [v, "p"]
            nodes.append(Node(step[1], ins, [out], name=f"c{k}"))
        v = out
    return nodes, v


def _torch_chain(steps, v, p):
    for step in steps:
        if step[0] == "unary":
            v = CHAIN[step[1]][1](v)
        else:
            v = WITH_P[step[1]](p, v) if step[2] else WITH_P[step[1]](v, p)
    return v


@st.composite
def discarding_graphs(draw) -> dict:
    """A graph whose non-finite values are all discarded: by a ``Where`` (inputs that are inf, NaN or +-1000,
    where a chain's ``Exp`` or ``Sinh`` overflows), by loss rows of class weight 0, or by a multiplication with
    an exact zero (``z * sqrt(x * x)`` with ``z = 0`` where ``x = 0``, the slope of sqrt being inf there)."""
    kind = draw(st.sampled_from(["where", "loss", "mulzero"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    keep = np.array([draw(st.booleans()) for _ in range(12)]).reshape(4, 3)
    keep[0, 0] = True
    if kind == "loss":  # rows 1 and 3 are labelled 1, whose class weight is 0; row 3 is dirty or not
        keep = np.repeat(np.array([True, False, True, not draw(st.booleans())])[:, None], 3, axis=1)
    return {"kind": kind, "x": rng.uniform(-1.5, 1.5, (4, 3)), "keep": keep, "bad": draw(st.sampled_from(BAD)),
            "steps": draw(chains()), "reduction": draw(st.sampled_from(["none", "sum", "mean"])),
            "u": rng.uniform(-1, 1, (4, 3))}


LABELS, CLASS_WEIGHTS = np.array([0, 1, 2, 1]), np.array([1.0, 0.0, 0.5])


def _build(case: dict) -> Graph:
    kind, keep, u = case["kind"], case["keep"], case["u"]
    inputs = [ValueInfo("x", F64, (4, 3)), ValueInfo("p", F64, ())]
    head: list[Node] = []
    start = "x"
    if kind == "mulzero":
        head = [Node("Mul", ["x", "x"], ["sq"], name="sq"), Node("Sqrt", ["sq"], ["r"], name="sqrt"),
                Node("Mul", ["z", "r"], ["zr"], name="mulz")]
        inputs.append(ValueInfo("z", F64, (4, 3)))
        start = "zr"
    nodes, out = _onnx_chain(case["steps"], start)
    inits: dict = {"u": u}
    if kind == "loss":
        reduction = case["reduction"]
        nodes.append(Node("SoftmaxCrossEntropyLoss", [out, "labels", "w"], ["l"], {"reduction": reduction}, "sce"))
        if reduction == "none":
            nodes += [Node("Mul", ["l", "u1"], ["lu"], name="mulu"), _sum("lu")]
        else:
            nodes.append(Node("Identity", ["l"], ["loss"], name="id"))
        inits = {"labels": LABELS, "w": CLASS_WEIGHTS, "u1": u[:, 0]}
    elif kind == "where":
        nodes += [_const("zero", 0.0), Node("Where", ["keep", out, "zero"], ["y"], name="where"),
                  Node("Mul", ["y", "u"], ["yu"], name="mulu"), _sum("yu")]
        inputs.append(ValueInfo("keep", np.bool_, keep.shape))
    else:
        nodes += [Node("Mul", [out, "u"], ["yu"], name="mulu"), _sum("yu")]
    return Graph(head + nodes, inputs, [ValueInfo("loss")], inits)


def _reference(case: dict, x: np.ndarray, p: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch gradients of x and p, the discarded inputs replaced by finite ones (the double-where trick)."""
    kind, keep, steps, u = case["kind"], torch.tensor(case["keep"]), case["steps"], torch.tensor(case["u"])
    xt = torch.tensor(x, requires_grad=True)
    pt = torch.tensor(p, requires_grad=True)
    if kind == "mulzero":
        at0 = torch.tensor(x == 0)
        r = torch.where(at0, 0.0, torch.sqrt(torch.where(at0, 1.0, xt * xt)))
        total = (_torch_chain(steps, torch.tensor(z) * r, pt) * u).sum()
    elif kind == "where":
        h = _torch_chain(steps, torch.where(keep, xt, 0.5), pt)
        total = (torch.where(keep, h, 0.0) * u).sum()
    else:
        h = _torch_chain(steps, torch.where(keep, xt, 0.0), pt)
        lt = F.cross_entropy(h, torch.tensor(LABELS), weight=torch.tensor(CLASS_WEIGHTS), reduction=case["reduction"])
        total = (lt * u[:, 0]).sum() if case["reduction"] == "none" else lt
    total.backward()
    zero = np.zeros(())  # a chain without p: revgraph warns "no path" and gives 0
    return xt.grad.numpy(), zero if pt.grad is None else pt.grad.numpy()


def _check_discarding(case: dict) -> None:
    kind, keep = case["kind"], case["keep"]
    p = np.array(0.9)
    z = np.where(keep, 1.25, 0.0)
    x = np.where(keep, case["x"], 0.0 if kind == "mulzero" else case["bad"])
    feeds = {"x": x, "p": p} | {"where": {"keep": keep}, "mulzero": {"z": z}, "loss": {}}[kind]
    want_x, want_p = _reference(case, x, p, z)
    assume(np.all(np.isfinite(want_x)) and np.isfinite(want_p))  # the kept values stay moderate
    got = _grads(_build(case), ["x", "p"], feeds)
    assert np.all(np.isfinite(got["x"])) and np.isfinite(got["p"]), (got, case["steps"])
    rtol = 1e-6 if any(s[1] == "Erf" for s in case["steps"]) else 1e-9  # the reference evaluator's float32 Erf
    np.testing.assert_allclose(got["x"], want_x, rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(got["p"], want_p, rtol=rtol, atol=1e-12)


PROPERTY = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much]}


@settings(max_examples=40, **PROPERTY)
@given(case=discarding_graphs())
def test_discarded_non_finite_values_never_reach_a_gradient(case):
    _check_discarding(case)


@pytest.mark.slow
@settings(max_examples=1500, **PROPERTY)
@given(case=discarding_graphs())
def test_discarded_non_finite_values_never_reach_a_gradient_long(case):
    _check_discarding(case)
