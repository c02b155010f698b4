"""Selection VJPs (ReLU, Clip, Dropout, Where) multiply by a mask only where the backward pass proves the
cotangent finite (autodiff/finite.py); an inf or NaN cotangent on the unselected side still gives exactly 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import revgraph as rg
from revgraph.autodiff import registry
from revgraph.autodiff.finite import nonfinite_cotangents
from revgraph.ir import Graph, Node, ValueInfo


def _graph(nodes, shape=(4,), extra_inputs=()):
    inputs = [ValueInfo("x", np.float64, shape), *extra_inputs]
    return Graph(nodes, inputs, [ValueInfo("loss")])


def _ops(gg: Graph) -> list[str]:
    return [n.op_type for _, n in gg.walk()]


def _run(gg: Graph, feeds: dict) -> dict:
    out = rg.Session(gg).run(feeds)
    ref = rg.Session(gg, backend="reference").run(feeds)
    for k in out:  # the two runtimes agree exactly on the gradients (log may differ in the last bit)
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-15, atol=0)
    return out


SELECTIONS = {  # op -> (extra nodes before it, attributes, torch function)
    "Relu": ([], {}, torch.relu),
    "Clip": ([Node("Constant", [], ["lo"], {"value": np.array(0.0)}, "lo")], {}, lambda x: torch.clamp(x, min=0.0)),
}


def test_the_examples_have_the_registered_facts_the_tests_take():
    # these tests pick operators for their facts (autodiff/finite.py reads them from the registrations,
    # registry.FACTS): selections read nothing, Sqrt and Log are singular or overflow, Tanh is bounded and finite,
    # MatMul and LayerNormalization mix, Softmax sanitizes, Gather moves, Cast casts
    facts = registry.FACTS
    assert all(facts[op].bounded and facts[op].reads == () for op in [*SELECTIONS, "Where"])
    assert not facts["Sqrt"].bounded and not facts["Log"].finite and not facts["Div"].finite
    assert facts["Div"].finite_if_static == (1,) and facts["Shape"].shape_only
    assert facts["Tanh"].bounded and facts["Tanh"].finite and facts["Tanh"].reads == registry.ALL
    assert facts["MatMul"].mixing and facts["MatMul"].product and facts["LayerNormalization"].mixing
    assert facts["Mul"].product and not facts["Mul"].mixing
    assert facts["Softmax"].sanitizing and facts["Gather"].moves and not facts["Add"].moves
    assert facts["Cast"].casts and facts["Dropout"].reads == (1,)


@pytest.mark.parametrize("op", SELECTIONS)
def test_sqrt_of_selection_is_zero_where_unselected(op):
    # sqrt'(0) is infinite: the cotangent reaching the selection is inf where it is off, and must become 0.
    pre, attrs, fn = SELECTIONS[op]
    inputs = ["x", "lo"] if op == "Clip" else ["x"]
    g = _graph([*pre, Node(op, inputs, ["r"], attrs, "sel"), Node("Sqrt", ["r"], ["s"], name="sqrt"),
                Node("ReduceSum", ["s"], ["loss"], {"keepdims": 0}, "sum")])
    gg = rg.gradient(g, wrt=["x"])
    assert "Where" in _ops(gg)  # the cotangent is not provably finite here
    x = np.array([-2.0, -0.5, 0.0, 4.0])
    with np.errstate(divide="ignore", invalid="ignore"):
        got = _run(gg, {"x": x})["x_grad"]
    xt = torch.tensor(x, requires_grad=True)
    torch.sqrt(fn(xt)).sum().backward()
    np.testing.assert_array_equal(got, xt.grad.numpy())  # PyTorch: exact zeros where x < 0
    assert got[:2].tolist() == [0.0, 0.0] and got[3] == 0.25


def test_relu_on_a_bounded_path_multiplies_by_a_mask():
    # loss = sum(relu(x W) * 3): every VJP downstream of the ReLU is bounded, so no Where is emitted.
    g = _graph([Node("MatMul", ["x", "W"], ["h"], name="mm"), Node("Relu", ["h"], ["r"], name="relu"),
                Node("Mul", ["r", "three"], ["m"], name="mul"),
                Node("ReduceSum", ["m"], ["loss"], {"keepdims": 0}, "sum")],
               shape=(2, 3), extra_inputs=[ValueInfo("W", np.float64, (3, 4))])
    g.initializers["three"] = np.array(3.0)
    gg = rg.gradient(g, wrt=["x", "W"])
    assert "Where" not in _ops(gg)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((3, 4))
    got = _run(gg, {"x": x, "W": w})
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (torch.relu(xt @ wt) * 3).sum().backward()
    np.testing.assert_allclose(got["x_grad"], xt.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(got["W_grad"], wt.grad.numpy(), rtol=1e-12)


def test_a_seed_given_as_input_may_be_infinite():
    # gradient(seed="input"): the cotangent is the caller's, so the ReLU VJP keeps Where and exact zeros.
    g = Graph([Node("Relu", ["x"], ["y"], name="relu")], [ValueInfo("x", np.float64, (3,))],
              [ValueInfo("y", np.float64, (3,))])
    gg = rg.gradient(g, "y", wrt=["x"], seed="input")
    assert "Where" in _ops(gg)
    seed_name = next(i for i in gg.input_names if i != "x")
    with np.errstate(invalid="ignore"):
        got = _run(gg, {"x": np.array([-1.0, 0.0, 2.0]), seed_name: np.array([np.inf, np.nan, 5.0])})
    assert got["x_grad"].tolist() == [0.0, 0.0, 5.0]


def test_where_selection_of_a_nan_branch_after_a_mask_multiply():
    # where(x > 0, log(x), 0) then relu: both selections are on bounded paths from the seed, and the
    # unselected log branch (NaN forward derivative 1/x at x < 0 is finite, log(x) itself NaN) gets exact 0.
    g = _graph([Node("Constant", [], ["zero"], {"value": np.array(0.0)}, "zero"),
                Node("Greater", ["x", "zero"], ["c"], name="gt"), Node("Log", ["x"], ["l"], name="log"),
                Node("Where", ["c", "l", "zero"], ["w"], name="where"), Node("Relu", ["w"], ["r"], name="relu"),
                Node("ReduceSum", ["r"], ["loss"], {"keepdims": 0}, "sum")])
    gg = rg.gradient(g, wrt=["x"])
    x = np.array([-1.0, 0.0, 0.5, 3.0])
    with np.errstate(divide="ignore", invalid="ignore"):
        got = _run(gg, {"x": x})["x_grad"]
    # d/dx relu(log x) = 1/x where log x > 0 (x > 1), else 0
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0, 1 / 3], rtol=1e-15)


def test_nonfinite_cotangents_follows_unbounded_vjps_backwards():
    nodes = [Node("Relu", ["x"], ["a"], name="relu"), Node("Sqrt", ["a"], ["b"], name="sqrt"),
             Node("Tanh", ["b"], ["c"], name="tanh"), Node("Relu", ["c"], ["d"], name="relu2")]
    unsafe = nonfinite_cotangents(nodes, {"d": None}, {})
    assert unsafe == {"a", "x"}  # below the Sqrt; d, c and b have bounded VJPs between them and the seed
    assert nonfinite_cotangents(nodes, {"d": "seed"}, {}) == {"a", "b", "c", "d", "x"}
    assert nonfinite_cotangents(nodes, {"d": "seed"}, {"seed": np.ones(3)}) == {"a", "x"}
    assert "x" in nonfinite_cotangents(nodes[:1], {"a": "seed"}, {"seed": np.array([1.0, np.inf])})


def test_nan_in_a_discarded_branch_does_not_reach_a_relu():
    # where(y > 0, relu(x) * log(y), 0) at y = 0: log(0) = -inf in the discarded branch, and the Mul VJP gives
    # 0 * -inf = NaN there; the ReLU must still send 0 (PyTorch does), so it may not multiply by its mask.
    g = Graph([Node("Relu", ["x"], ["r"], name="relu"), Node("Log", ["y"], ["l"], name="log"),
               Node("Mul", ["r", "l"], ["m"], name="mul"), Node("Constant", [], ["z"], {"value": np.array(0.0)}, "z"),
               Node("Greater", ["y", "z"], ["c"], name="gt"), Node("Where", ["c", "m", "z"], ["w"], name="where"),
               Node("ReduceSum", ["w"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float64, (3,)), ValueInfo("y", np.float64, (3,))], [ValueInfo("loss")])
    x, y = np.array([-1.0, -2.0, 3.0]), np.array([0.0, 2.0, 2.0])
    with np.errstate(divide="ignore", invalid="ignore"):
        got = _run(rg.gradient(g, wrt=["x"]), {"x": x, "y": y})["x_grad"]
    xt, yt = torch.tensor(x, requires_grad=True), torch.tensor(y)
    torch.where(yt > 0, torch.relu(xt) * torch.log(yt), torch.zeros(3, dtype=torch.float64)).sum().backward()
    np.testing.assert_array_equal(got, xt.grad.numpy())  # [0, 0, log 2]


def test_a_narrowing_cast_vjp_may_overflow():
    # float16 relu, cast to float32, times 1e5: the Cast VJP turns the cotangent 1e5 into float16 inf.
    g = Graph([Node("Relu", ["x"], ["r"], name="relu"), Node("Cast", ["r"], ["c"], {"to": 1}, "cast"),
               Node("Mul", ["c", "k"], ["b"], name="m"), Node("ReduceSum", ["b"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float16, (3,))], [ValueInfo("loss")], {"k": np.array(1e5, np.float32)})
    x = np.array([-1.0, 0.5, -3.0], np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        got = _run(rg.gradient(g, wrt=["x"]), {"x": x})["x_grad"]
    xt = torch.tensor(x, requires_grad=True)
    (torch.relu(xt).float() * 1e5).sum().backward()
    np.testing.assert_array_equal(got, xt.grad.numpy())  # [0, inf, 0]


def test_second_order_through_a_mask_multiply_keeps_strong_zeros():
    # x_grad of sum(relu(x) * w) is w * mask; d sum(sqrt(x_grad)) / dw must be 0 where the mask is off.
    g = Graph([Node("Relu", ["x"], ["r"], name="relu"), Node("Mul", ["r", "w"], ["m"], name="mul"),
               Node("ReduceSum", ["m"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float64, (3,)), ValueInfo("w", np.float64, (3,))], [ValueInfo("loss")])
    first = rg.gradient(g, wrt=["x"])
    first.nodes.append(Node("Sqrt", ["x_grad"], ["s"], name="sqrt"))
    first.nodes.append(Node("ReduceSum", ["s"], ["loss2"], {"keepdims": 0}, "sum2"))
    first.outputs = [ValueInfo("loss2")]
    x, w = np.array([-1.0, 2.0, -3.0]), np.array([4.0, 4.0, 9.0])
    with np.errstate(divide="ignore", invalid="ignore"):
        got = _run(rg.gradient(first, "loss2", wrt=["w"]), {"x": x, "w": w})["w_grad"]
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (gx,) = torch.autograd.grad((torch.relu(xt) * wt).sum(), xt, create_graph=True)
    torch.sqrt(gx).sum().backward()
    np.testing.assert_array_equal(got, wt.grad.numpy())  # [0, 0.25, 0]


def test_nonfinite_values_follow_unbounded_forward_operators():
    from revgraph.autodiff.finite import nonfinite_values

    nodes = [Node("Log", ["y"], ["l"], name="log"), Node("Mul", ["x", "l"], ["m"], name="mul"),
             Node("Shape", ["x"], ["s"], name="shape"), Node("Cast", ["s"], ["sf"], {"to": 1}, "cast"),
             Node("Sqrt", ["sf"], ["scale"], name="sqrt"), Node("Div", ["x", "scale"], ["q"], name="div"),
             Node("Div", ["x", "y"], ["d"], name="div2"), Node("Softmax", ["m"], ["p"], name="softmax")]
    types = {"s": ValueInfo("s", np.int64, (1,))}
    risky = nonfinite_values(nodes, {}, types)
    # log and what reads it; a division by a variable; not the attention-style scale from shapes, nor Softmax
    assert risky == {"l", "m", "d"}
    assert "c" in nonfinite_values([Node("Identity", ["k"], ["c"], name="i")], {"k": np.array([-np.inf])}, {})


# ------------------------------------------------------------------------------------ graph inputs (issue 13)


def test_graph_inputs_may_be_non_finite_until_a_contraction():
    from revgraph.autodiff.finite import nonfinite_values

    nodes = [Node("Mul", ["x", "w"], ["m"], name="mul"), Node("Tanh", ["m"], ["t"], name="tanh"),
             Node("MatMul", ["t", "W"], ["h"], name="mm"), Node("Add", ["h", "b"], ["z"], name="add"),
             Node("LayerNormalization", ["z", "s"], ["n"], name="ln"), Node("Relu", ["n"], ["r"], name="relu"),
             Node("Greater", ["x", "w"], ["c"], name="gt")]
    types = {"c": ValueInfo("c", np.bool_, (2,)), "k": ValueInfo("k", np.int64, (2,))}
    risky = nonfinite_values(nodes, {"s": np.ones(2)}, types, inputs=["x", "w", "W", "b", "k"])
    # inputs and what elementwise operators compute from them; not past the MatMul or the normalization
    # (b enters again after the MatMul), not a boolean, not an integer input, not a constant
    assert risky == {"x", "w", "W", "b", "m", "t", "z"}
    assert risky.from_inputs == risky
    log_first = [Node("Log", ["x"], ["l"], name="log"), Node("MatMul", ["l", "W"], ["h"], name="mm"),
                 Node("Add", ["h", "b"], ["z"], name="add")]
    both = nonfinite_values(log_first, {}, {}, inputs=["b"])
    assert both == {"l", "h", "b", "z"} and both.from_inputs == {"b"}  # Log's -inf passes the MatMul
    assert nonfinite_values(nodes, {}, types) == set()  # no inputs named: the old assumption, all finite


def test_the_rule_context_takes_the_declared_inputs_as_maybe_nonfinite(monkeypatch):
    # inside a loop body, the carried values (body inputs) may be non-finite, the captured ones are taken
    # as finite (the body is analysed on its own): what the backward pass tells each rule through its context
    from revgraph.autodiff import backward, registry

    body = Graph([Node("Add", ["h", "b"], ["z"], name="add"), Node("Tanh", ["z"], ["t"], name="tanh"),
                  Node("Mul", ["t", "cap"], ["u"], name="mul")],
                 [ValueInfo("i", np.int64, ()), ValueInfo("cond", np.bool_, ()), ValueInfo("h", np.float64, (3,))],
                 [ValueInfo("cond"), ValueInfo("u")], {"b": np.zeros(3)})
    seen = []
    original = registry.RULES["Tanh"]

    def spy(ctx, node, cts):
        seen.append(ctx)
        return original(ctx, node, cts)

    monkeypatch.setitem(registry.RULES, "Tanh", spy)
    backward(body, {"u": None}, ["h"])
    (ctx,) = seen
    assert ctx.nonfinite("h") and ctx.nonfinite("z") and ctx.nonfinite("t")
    assert not ctx.nonfinite("b") and not ctx.nonfinite("cap") and not ctx.nonfinite("i")


def test_cotangents_stay_finite_through_contractions_with_inputs():
    # loss = sum(relu(x W + b) V): every parameter is a graph input, yet the ReLU's cotangent (g V^T) is
    # finite: a contraction's VJP reading an input is not followed (DESIGN: strong zeros past contractions)
    g = Graph([Node("MatMul", ["x", "W"], ["h"], name="mm1"), Node("Add", ["h", "b"], ["z"], name="add"),
               Node("Relu", ["z"], ["r"], name="relu"), Node("MatMul", ["r", "V"], ["o"], name="mm2"),
               Node("ReduceSum", ["o"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float64, (2, 3)), ValueInfo("W", np.float64, (3, 4)), ValueInfo("b", np.float64, (4,)),
               ValueInfo("V", np.float64, (4, 2))], [ValueInfo("loss")])
    gg = rg.gradient(g, wrt=["W", "b", "V"])
    assert not {"Where", "Equal"} & set(_ops(gg))
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 3)), "W": rng.standard_normal((3, 4)), "b": rng.standard_normal(4),
             "V": rng.standard_normal((4, 2))}
    got = _run(gg, feeds)
    ts = {k: torch.tensor(v, requires_grad=k != "x") for k, v in feeds.items()}
    (torch.relu(ts["x"] @ ts["W"] + ts["b"]) @ ts["V"]).sum().backward()
    for k in ("W", "b", "V"):
        np.testing.assert_allclose(got[f"{k}_grad"], ts[k].grad.numpy(), rtol=1e-12)


def test_an_elementwise_product_with_an_input_is_guarded_and_unsafe():
    from revgraph.autodiff.finite import nonfinite_values

    # relu(a) * x with x an input: the Mul VJP multiplies the ReLU's cotangent by x, which may be inf, so the
    # ReLU keeps Where (an inf cotangent on its unselected side must give 0)
    nodes = [Node("Relu", ["a"], ["r"], name="relu"), Node("Mul", ["r", "x"], ["m"], name="mul"),
             Node("Tanh", ["m"], ["t"], name="tanh")]
    risky = nonfinite_values(nodes, {}, {}, inputs=["a", "x"])
    unsafe = nonfinite_cotangents(nodes, {"t": None}, {}, risky)
    assert "r" in unsafe and "a" in unsafe and "x" in unsafe
    assert "m" in unsafe  # Tanh reads t, which may be NaN through x
    # without inputs that may be non-finite (the old assumption), every cotangent here is finite
    assert nonfinite_cotangents(nodes, {"t": None}, {}, nonfinite_values(nodes, {}, {})) == set()


def test_a_broadcast_input_is_not_followed():
    from revgraph.autodiff.finite import nonfinite_values

    # z = h + b with b [4] repeated over the rows of h [2, 4] (a bias): not followed; m = beta * x with x [4]
    # of the result's shape: followed (beta is the broadcast one); a Gather of a table input is followed
    types = {n: ValueInfo(n, np.float64, s) for n, s in
             [("h", (2, 4)), ("b", (4,)), ("z", (2, 4)), ("beta", ()), ("x", (4,)), ("m", (4,)), ("t", (5, 4)),
              ("rows", (2, 3, 4))]}
    types["ids"] = ValueInfo("ids", np.int64, (2, 3))
    nodes = [Node("Add", ["h", "b"], ["z"], name="bias"), Node("Mul", ["beta", "x"], ["m"], name="scale"),
             Node("Gather", ["t", "ids"], ["rows"], name="gather")]
    risky = nonfinite_values(nodes, {}, types, inputs=["b", "beta", "x", "t", "ids"])
    assert risky == {"b", "beta", "x", "m", "t", "rows"}


def test_gelu_after_a_bias_input_stays_a_plain_product():
    # a training graph's feed-forward block: parameters are graph inputs; the bias is broadcast and the GELU's
    # input comes from a MatMul, so the GELU VJP multiplies without a Where
    g = Graph([Node("MatMul", ["x", "W"], ["h"], name="mm"), Node("Add", ["h", "b"], ["z"], name="bias"),
               Node("Gelu", ["z"], ["a"], name="gelu"), Node("ReduceSum", ["a"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float32, (8, 3)), ValueInfo("W", np.float32, (3, 4)),
               ValueInfo("b", np.float32, (4,))], [ValueInfo("loss")])
    assert not {"Where", "Equal"} & set(_ops(rg.gradient(g, wrt=["W", "b"])))
