"""Forward mode against independent references, in float64 on onnxruntime and the ONNX reference evaluator
(which must agree):

- ``rg.jvp`` through ``Loop`` (fixed trip counts including zero, a ``while`` loop whose trip count depends on
  the data, nested loops, scan outputs, a ``Loop`` made from an ONNX ``Scan`` node) and ``If`` (at top
  level on both branches, and inside a loop) equals ``torch.func.jvp`` of the same computation unrolled in
  PyTorch; the JVP of a loop carries the tangents forward and stores no residuals (counted on the graph);
- ``rg.hvp`` equals ``torch.autograd.functional.hvp`` and ``torch.func.jvp`` of ``torch.func.grad``
  (forward-over-reverse) on an MLP with softmax cross-entropy and on loop models, under every checkpoint
  policy of the gradient's loops;
- ``rg.jacobian`` (modes forward, reverse, auto) and ``rg.hessian`` equal ``torch.autograd.functional.jacobian``
  and ``...hessian`` (several inputs and outputs, cross blocks, through loops); ``auto`` picks the mode with
  fewer basis iterations, read from the trip count of the basis loop;
- the onnx wheel's light/ models: these are ONNX files with no PyTorch source, so ``torch.func.jvp`` cannot
  be the reference there; ``J t`` is checked against float64 central differences of the model (converted to
  float64 with ``revgraph.tools.check.to_float64``, run by the reference evaluator since onnxruntime has no float64
  ``Conv``) and against the dot-product identity ``<u, J t> = <J^T u, t>`` with the VJP of
  ``rg.gradient(seed="input")``. The large models run under ``-m slow``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kit.forward import (
    assert_hessians,
    assert_jacobians,
    assert_loop_jvp_stores_nothing,
    basis_trips,
    close,
    hessian_run,
    hvp_run,
    jacobian_run,
    jvp_run,
    light_check,
    loop_body,
    taylor_sin,
    torch_hvp,
    torch_jvp,
)
from kit.light_models import MODELS as LIGHT_MODELS
from kit.loops import (
    F64,
    POLICIES,
    body,
    branch,
    const,
    graph,
    if_node,
    loop,
    n,
    scan_graph,
    taylor_cond_nodes,
    taylor_sin_body,
    three_nested_loops,
)

import revgraph as rg
from revgraph.ir import Graph, ValueInfo

X3 = np.array([0.5, 1.5, -0.8])
S3 = np.array([1.0, 2.0, 3.0])
RNG = np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _fresh_rng():
    """The same random values in a test whether it runs alone or with the others."""
    global RNG
    RNG = np.random.default_rng(1234)


def _trip(k):
    return {"M": np.array(k, np.int64)}


# ---------------------------------------------------------------------------------------------- loops


def _product_graph(steps):
    b = body([n("Mul", ["s_in", "x"], "s_out")], [("s_in", "s_out")], types={"s_in": (3,), "s_out": (3,)})
    g = graph([loop(b, "M", ["s0"], ["s"]), n("ReduceSum", ["s"], "loss", keepdims=0)],
              {"x": (3,), "s0": (3,)}, ["loss"], _trip(steps))
    g.outputs.append(ValueInfo("s", F64, (3,)))
    return g


@pytest.mark.parametrize("wrt", [("x", "s0"), ("x",), ("s0",)])
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_product_s_times_x(steps, wrt):
    # s = s0 * x^steps; with wrt x alone s0 has no tangent but s gains one in the first iteration (fixpoint)
    g = _product_graph(steps)
    feeds = {"x": X3, "s0": S3}
    tangents = {w: RNG.standard_normal(3) for w in wrt}
    jg, primal, tan = jvp_run(g, feeds, tangents, ["loss", "s"])

    def unrolled(x, s0):
        s = s0
        for _ in range(steps):
            s = s * x
        return s.sum(), s

    t_loss, t_s = torch_jvp(unrolled, feeds, tangents)
    close(tan["loss"], t_loss)
    close(tan["s"], t_s)
    along_x = steps * X3 ** max(steps - 1, 0) * S3 * tangents["x"] if "x" in wrt else 0
    close(tan["s"], tangents.get("s0", 0) * X3**steps + along_x)
    close(primal["s"], S3 * X3**steps)
    assert_loop_jvp_stores_nothing(g, jg, "loop", carried_tangents=1, scan_tangents=0, wrt=list(wrt))


@pytest.mark.parametrize("x", [0.0, 0.4, 2.5])
def test_while_loop_with_data_dependent_trip_count(x):
    # Taylor series of sin until the term is below 1e-12: zero trips at x = 0, about 8 at 0.4, 20 at 2.5
    nodes = [*taylor_cond_nodes(), loop(taylor_sin_body(), "", ["x", "x"], ["t", "sin"], cond="go"),
             n("Identity", ["sin"], "loss")]
    g = graph(nodes, {"x": ()}, ["loss"], {"eps0": np.array(1e-12)})
    tx = np.array(0.75)
    jg, primal, tan = jvp_run(g, {"x": np.array(x)}, {"x": tx}, ["loss"])
    close(primal["loss"], math.sin(x), atol=1e-12)
    close(tan["loss"], math.cos(x) * 0.75, rtol=1e-10, atol=1e-12)
    (t_loss,) = torch_jvp(taylor_sin, {"x": np.array(x)}, {"x": tx})
    close(tan["loss"], t_loss)
    assert_loop_jvp_stores_nothing(g, jg, "loop", carried_tangents=2, scan_tangents=0, wrt=["x"])


def test_while_loop_nested_in_an_outer_loop():
    # s <- s + sin(x0 * s) three times, sin being the data-dependent while loop
    inner = taylor_sin_body()
    outer = body(
        [n("Mul", ["x0", "s_in"], "x"), *taylor_cond_nodes(),
         loop(inner, "", ["x", "x"], ["t", "sin"], "inner", cond="go"), n("Add", ["s_in", "sin"], "s_out")],
        [("s_in", "s_out")], iter_name="j", cond_name="c_outer",
    )
    g = graph([loop(outer, "M", ["s0"], ["s"], "outer"), n("Identity", ["s"], "loss")], {"x0": (), "s0": ()}, ["loss"],
              {**_trip(3), "eps0": np.array(1e-12)})
    feeds = {"x0": np.array(0.8), "s0": np.array(0.6)}
    tangents = {"x0": np.array(-0.3), "s0": np.array(1.2)}
    jg, _, tan = jvp_run(g, feeds, tangents, ["loss"])

    def unrolled(x0, s0):
        s = s0
        for _ in range(3):
            s = s + taylor_sin(x0 * s)
        return s

    close(tan["loss"], torch_jvp(unrolled, feeds, tangents)[0])
    assert_loop_jvp_stores_nothing(g, jg, "outer", carried_tangents=1, scan_tangents=0, wrt=["x0", "s0"])
    inner_jvp = next(nd for nd in loop_body(jg, "outer").nodes if nd.op_type == "Loop")
    assert len(inner_jvp.outputs) == 2 + 2  # (t, sin) and their tangents


def test_three_nested_loops():
    g, feeds, inner_fn = three_nested_loops()
    g.outputs.append(ValueInfo("s", F64, (2,)))
    tangents = {"s0": np.array([0.2, 0.5]), "w": np.array([-1.0, 0.3])}
    jg, _, tan = jvp_run(g, feeds, tangents, ["loss", "s"])

    def unrolled(s0, w):
        s = inner_fn(s0, w)
        return s.sum(), s

    t_loss, t_s = torch_jvp(unrolled, feeds, tangents)
    close(tan["loss"], t_loss)
    close(tan["s"], t_s)
    assert_loop_jvp_stores_nothing(g, jg, "outer", carried_tangents=1, scan_tangents=0, wrt=["s0", "w"])


def test_scan_outputs_per_iteration():
    # y_t = tanh(s_t * w), stacked; loss = sum(u * Y); only w has a tangent, s0 gains none... but s does
    b = body([n("Mul", ["s_in", "w"], "s_out"), n("Tanh", ["s_out"], "y")], [("s_in", "s_out")], scan=["y"])
    u = np.arange(12.0).reshape(4, 3) / 10 - 0.5
    nodes = [loop(b, "M", ["s0"], ["s", "Y"]), n("Mul", ["Y", "u"], "uy"), n("ReduceSum", ["uy"], "loss", keepdims=0)]
    g = graph(nodes, {"s0": (3,), "w": (3,)}, ["loss"], {**_trip(4), "u": u})
    g.outputs.append(ValueInfo("Y", F64, (4, 3)))
    feeds = {"s0": S3 / 3, "w": np.array([0.9, -1.1, 0.4])}
    for tangents in ({"s0": RNG.standard_normal(3), "w": RNG.standard_normal(3)}, {"w": RNG.standard_normal(3)}):
        jg, _, tan = jvp_run(g, feeds, tangents, ["loss", "Y"])

        def unrolled(s0, w):
            s, ys = s0, []
            for _ in range(4):
                s = s * w
                ys.append(torch.tanh(s))
            y = torch.stack(ys)
            return (y * torch.tensor(u)).sum(), y

        t_loss, t_y = torch_jvp(unrolled, feeds, tangents)
        close(tan["loss"], t_loss)
        close(tan["Y"], t_y)
        assert_loop_jvp_stores_nothing(g, jg, "loop", carried_tangents=1, scan_tangents=1, wrt=list(tangents))


def test_scan_until_value_is_five():
    # r_i = x_i^2 until x_i == 5 (the condition stops a loop of 1000 trips after 6): J t = 2 x_i t_i, i <= 5
    b = body([n("Gather", ["x", "i"], "xi", axis=0), n("Mul", ["xi", "xi"], "r"), const("five", 5.0),
              n("Equal", ["xi", "five"], "is5"), n("Not", ["is5"], "cond_next")], [], cond_out="cond_next", scan=["r"])
    g = graph([loop(b, "M", [], ["R"]), n("ReduceSum", ["R"], "loss", keepdims=0)], {"x": (20,)}, ["loss"], _trip(1000))
    g.outputs.append(ValueInfo("R", F64, ("T",)))
    x, tx = np.arange(20.0), RNG.standard_normal(20)
    jg, primal, tan = jvp_run(g, {"x": x}, {"x": tx}, ["loss", "R"])
    close(primal["R"], x[:6] ** 2)
    close(tan["R"], 2 * x[:6] * tx[:6])

    def unrolled(x):
        rs = []
        for i in range(1000):
            rs.append(x[i] * x[i])
            if x[i] == 5:
                break
        r = torch.stack(rs)
        return r.sum(), r

    t_loss, t_r = torch_jvp(unrolled, {"x": x}, {"x": tx})
    close(tan["loss"], t_loss)
    close(tan["R"], t_r)
    assert_loop_jvp_stores_nothing(g, jg, "loop", carried_tangents=0, scan_tangents=1, wrt=["x"])


@pytest.mark.parametrize(("in_dir", "out_dir", "in_axis", "out_axis"),
                         [(0, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, -1), (0, 1, 1, 0)])
def test_loop_made_from_a_scan_node(in_dir, out_dir, in_axis, out_axis):
    # h_t = tanh(h_{t-1} * w + x_t), y_t = 2 h_t stacked (ONNX Scan, lowered to a Loop before the JVP)
    t = 3
    shape_x = (t, 3) if in_axis == 0 else (3, t)
    g, u = scan_graph(in_dir, out_dir, in_axis, out_axis, shape_x)
    g.outputs += [ValueInfo("h", F64, (3,)), ValueInfo("Y", F64, (t, 3) if out_axis == 0 else (3, t))]
    feeds = {"h0": RNG.standard_normal(3), "x": RNG.standard_normal(shape_x), "w": RNG.standard_normal(3)}
    tangents = {k: RNG.standard_normal(v.shape) for k, v in feeds.items()}
    jg, _, tan = jvp_run(g, feeds, tangents, ["loss", "h", "Y"])

    def unrolled(h0, x, w):
        xs = x if in_axis == 0 else x.T
        h, ys = h0, []
        for i in (range(t - 1, -1, -1) if in_dir else range(t)):
            h = torch.tanh(h * w + xs[i])
            ys.append(h * 2)
        y = torch.stack(ys[::-1] if out_dir else ys)
        y = y if out_axis == 0 else y.T
        return (y * torch.tensor(u)).sum() + h.sum(), h, y

    for name, theirs in zip(["loss", "h", "Y"], torch_jvp(unrolled, feeds, tangents), strict=True):
        close(tan[name], theirs, what=name)
    loops = [nd for nd in jg.nodes if nd.op_type == "Loop"]
    assert len(loops) == 1 and not any(nd.op_type == "Scan" for nd in jg.nodes)
    assert_loop_jvp_stores_nothing(g, jg, loops[0].name, carried_tangents=1, scan_tangents=1, wrt=list(tangents))


def test_if_inside_a_loop():
    # s <- s * x if sum(s) > 1 else s + x: the branch taken changes along the iterations
    then = branch([n("Mul", ["s_in", "x"], "r")], ["r"], "then")
    other = branch([n("Add", ["s_in", "x"], "r2")], ["r2"], "else")
    b = body([n("ReduceSum", ["s_in"], "tot", keepdims=0), const("onef", 1.0), n("Greater", ["tot", "onef"], "big"),
              if_node("big", then, other, ["s_out"])], [("s_in", "s_out")])
    g = graph([loop(b, "M", ["s0"], ["s"]), n("ReduceSum", ["s"], "loss", keepdims=0)], {"x": (2,), "s0": (2,)},
              ["loss"], _trip(5))
    feeds = {"x": np.array([0.9, 0.7]), "s0": np.array([0.1, 0.2])}
    tangents = {"x": np.array([0.4, -1.3]), "s0": np.array([2.0, 0.5])}
    jg, _, tan = jvp_run(g, feeds, tangents, ["loss"])

    def unrolled(x, s0):
        s = s0
        for _ in range(5):
            s = s * x if s.sum() > 1 else s + x
        return s.sum()

    close(tan["loss"], torch_jvp(unrolled, feeds, tangents)[0])
    assert_loop_jvp_stores_nothing(g, jg, "loop", carried_tangents=1, scan_tangents=0, wrt=list(tangents))


@pytest.mark.parametrize("x", [-1.0, 0.5, 4.0])
def test_if_at_top_level_on_both_branches(x):
    # y = sqrt(x) * w if x > 0 else sin(x) + w (the condition read from the data)
    then = branch([n("Sqrt", ["x"], "r"), n("Mul", ["r", "w"], "rw")], ["rw"], "then")
    other = branch([n("Sin", ["x"], "r2"), n("Add", ["r2", "w"], "rw2")], ["rw2"], "else")
    g = graph([const("zero", 0.0), n("Greater", ["x", "zero"], "pos"), if_node("pos", then, other, ["y"])],
              {"x": (), "w": (2,)}, ["y"])
    g.outputs[0] = ValueInfo("y", F64, (2,))
    feeds = {"x": np.array(x), "w": np.array([0.3, -2.0])}
    tangents = {"x": np.array(0.7), "w": np.array([1.5, 0.25])}
    jg, primal, tan = jvp_run(g, feeds, tangents, ["y"])

    def fn(x, w):
        return torch.sqrt(x) * w if x > 0 else torch.sin(x) + w

    close(tan["y"], torch_jvp(fn, feeds, tangents)[0])
    close(primal["y"], fn(*(torch.tensor(v) for v in feeds.values())).numpy())
    if x > 0:
        close(tan["y"], 0.5 / math.sqrt(x) * 0.7 * feeds["w"] + math.sqrt(x) * tangents["w"])
    else:
        close(tan["y"], math.cos(x) * 0.7 + tangents["w"])
    (ifs,) = [nd for nd in jg.nodes if nd.op_type == "If"]
    assert len(ifs.outputs) == 2  # y and its tangent


@pytest.mark.parametrize("c", [True, False])
def test_if_with_a_tangent_from_one_branch_only(c):
    # then: a * b, else: sin(a); along b alone the else branch gives a zero tangent
    then = branch([n("Mul", ["a", "b"], "r")], ["r"], "then")
    other = branch([n("Sin", ["a"], "r2")], ["r2"], "else")
    g = graph([if_node("c", then, other, ["y"])], {"a": (3,), "b": (3,)}, ["y"], {"c": np.array(c)})
    g.outputs[0] = ValueInfo("y", F64, (3,))
    feeds = {"a": np.array([0.1, 0.2, 0.3]), "b": np.array([1.0, 2.0, 3.0])}
    tb = np.array([0.5, -1.0, 2.0])
    _, _, tan = jvp_run(g, feeds, {"b": tb}, ["y"])
    close(tan["y"], torch_jvp(lambda a, b: a * b if c else torch.sin(a), feeds, {"b": tb})[0])
    close(tan["y"], feeds["a"] * tb if c else np.zeros(3))


@pytest.mark.parametrize("c", [True, False])
def test_loops_inside_if_branches(c):
    # if c: 3 steps of s <- s * x  else: 2 steps of s <- sin(s) + x
    mul = body([n("Mul", ["s_in", "x"], "s_out")], [("s_in", "s_out")])
    sin = body([n("Sin", ["t_in"], "st"), n("Add", ["st", "x"], "t_out")], [("t_in", "t_out")], iter_name="j",
               cond_name="cj")
    then = branch([loop(mul, "M3", ["s0"], ["r"], "loop_then")], ["r"], "then")
    other = branch([loop(sin, "M2", ["s0"], ["r2"], "loop_else")], ["r2"], "else")
    g = graph([if_node("c", then, other, ["y"]), n("ReduceSum", ["y"], "loss", keepdims=0)], {"x": (2,), "s0": (2,)},
              ["loss"], {"M3": np.array(3, np.int64), "M2": np.array(2, np.int64), "c": np.array(c)})
    feeds = {"x": np.array([0.9, -0.7]), "s0": np.array([0.5, 0.25])}
    tangents = {"x": np.array([1.0, 0.5]), "s0": np.array([-0.2, 0.8])}
    _, _, tan = jvp_run(g, feeds, tangents, ["loss"])

    def unrolled(x, s0):
        s = s0
        for _ in range(3 if c else 2):
            s = s * x if c else torch.sin(s) + x
        return s.sum()

    close(tan["loss"], torch_jvp(unrolled, feeds, tangents)[0])


def test_captured_tangent_read_by_a_rule_that_needs_its_rank_in_a_loop():
    # (a regression test: the body did not know the captured tangent's type)
    # Y[i] = sin(x[:, i]): the VJP of Gather(axis=1), transposed, needs the rank of the captured x_tangent
    b = body([n("Gather", ["x", "i"], "xi", axis=1), n("Sin", ["xi"], "y")], [], scan=["y"])
    g = graph([loop(b, "M", [], ["Y"])], {"x": (2, 3)}, [], _trip(3))
    g.outputs = [ValueInfo("Y", F64, (3, 2))]
    x, tx = RNG.standard_normal((2, 3)), RNG.standard_normal((2, 3))
    _, _, tan = jvp_run(g, {"x": x}, {"x": tx}, ["Y"])
    close(tan["Y"], (np.cos(x) * tx).T)


def test_captured_tangent_read_by_a_rule_that_needs_its_rank_in_an_if():
    then = branch([const("one", 1, np.int64), n("Gather", ["x", "one"], "r", axis=1)], ["r"], "then")
    other = branch([const("zero", 0, np.int64), n("Gather", ["x", "zero"], "r2", axis=1)], ["r2"], "else")
    g = graph([if_node("c", then, other, ["y"])], {"x": (2, 2)}, [], {"c": np.array(True)})
    g.outputs = [ValueInfo("y", F64, (2,))]
    tx = RNG.standard_normal((2, 2))
    _, _, tan = jvp_run(g, {"x": np.eye(2)}, {"x": tx}, ["y"])
    close(tan["y"], tx[:, 1])


def test_output_names_of_loop_outputs():
    # the public <y>_tangent is reserved before the Loop's JVP names its inner tangent of y (was <y>_tangent_1)
    jg = rg.jvp(_product_graph(2), outputs=["s"], inputs=["x"])
    assert jg.output_names == ["loss", "s", "s_tangent"]


# ---------------------------------------------------------------------------------------------- HVP


def _mlp():
    """loss = mean softmax cross-entropy of tanh(x W1 + b1) W2 + b2 (x [4, 3], 3 classes)."""
    nodes = [n("MatMul", ["x", "W1"], "xw"), n("Add", ["xw", "b1"], "pre"), n("Tanh", ["pre"], "h"),
             n("MatMul", ["h", "W2"], "hw"), n("Add", ["hw", "b2"], "logits"),
             n("SoftmaxCrossEntropyLoss", ["logits", "labels"], "loss", reduction="mean")]
    rng = np.random.default_rng(5)
    params = {"W1": (3, 5), "b1": (5,), "W2": (5, 3), "b2": (3,)}
    inputs = [ValueInfo("x", F64, (4, 3)), ValueInfo("labels", np.int64, (4,))]
    weights = {k: 0.7 * rng.standard_normal(s) for k, s in params.items()}
    return Graph(nodes, inputs, [ValueInfo("loss", F64, ())], weights)


def _torch_mlp(x, W1, b1, W2, b2, labels):
    return torch.nn.functional.cross_entropy(torch.tanh(x @ W1 + b1) @ W2 + b2, labels)


def test_hvp_of_an_mlp_with_softmax_cross_entropy():
    g = _mlp()
    rng = np.random.default_rng(6)
    x, labels = rng.standard_normal((4, 3)), np.array([0, 2, 1, 2])
    values = {**{k: g.initializers[k] for k in ("W1", "b1", "W2", "b2")}, "x": x}
    v = {k: rng.standard_normal(a.shape) for k, a in values.items()}
    grads, hvps = hvp_run(g, {"x": x, "labels": labels}, values, v)
    labels_t = torch.tensor(labels)
    t_grads, t_hvps = torch_hvp(lambda W1, b1, W2, b2, x: _torch_mlp(x, W1, b1, W2, b2, labels_t), values, v)
    for k in values:
        close(grads[k], t_grads[k], what=f"{k}_grad")
        close(hvps[k], t_hvps[k], what=f"{k}_hvp")


def _rnn_graph(trips=4):
    """h <- tanh(h * w + x), y = h * h stacked; loss = sum(h) + sum(u * Y)."""
    b = body([n("Mul", ["h_in", "w"], "hw"), n("Add", ["hw", "x"], "pre"), n("Tanh", ["pre"], "h_out"),
              n("Mul", ["h_out", "h_out"], "y")], [("h_in", "h_out")], scan=["y"])
    u = np.linspace(-1.0, 1.0, 3 * trips).reshape(trips, 3)
    g = graph([loop(b, "M", ["h0"], ["h", "Y"]), n("Mul", ["Y", "u"], "uy"), n("ReduceSum", ["uy"], "ys", keepdims=0),
               n("ReduceSum", ["h"], "hs", keepdims=0), n("Add", ["ys", "hs"], "loss")],
              {"h0": (3,), "w": (3,), "x": (3,)}, ["loss"], {**_trip(trips), "u": u})

    def unrolled(h0, w, x):
        h, total = h0, 0
        for t in range(trips):
            h = torch.tanh(h * w + x)
            total = total + (h * h * torch.tensor(u[t])).sum()
        return total + h.sum()

    return g, unrolled


@pytest.mark.parametrize("policy", POLICIES)
def test_hvp_through_a_checkpointed_loop(policy):
    g, unrolled = _rnn_graph()
    rng = np.random.default_rng(7)
    values = {"h0": rng.standard_normal(3), "w": rng.standard_normal(3), "x": 0.5 * rng.standard_normal(3)}
    v = {k: rng.standard_normal(3) for k in values}
    grads, hvps = hvp_run(g, values, values, v, checkpoint=policy)
    t_grads, t_hvps = torch_hvp(unrolled, values, v)
    for k in values:
        close(grads[k], t_grads[k], what=f"{k}_grad")
        close(hvps[k], t_hvps[k], what=f"{k}_hvp")


def _taylor_graph():
    nodes = [*taylor_cond_nodes(), loop(taylor_sin_body(), "", ["x", "x"], ["t", "sin"], cond="go"),
             n("Identity", ["sin"], "loss")]
    return graph(nodes, {"x": ()}, ["loss"], {"eps0": np.array(1e-12)})


@pytest.mark.parametrize("policy", POLICIES)
def test_hvp_through_a_while_loop(policy):
    # the backward loop reads the stacked residuals (captured) through Gather: their tangents are captured too
    # d^2 sin / dx^2 = -sin(x), the trip count depending on x
    x, v = np.array(1.3), np.array(0.6)
    grads, hvps = hvp_run(_taylor_graph(), {"x": x}, {"x": x}, {"x": v}, checkpoint=policy)
    close(grads["x"], math.cos(1.3), rtol=1e-10)
    close(hvps["x"], -math.sin(1.3) * 0.6, rtol=1e-10)
    close(hvps["x"], torch_hvp(taylor_sin, {"x": x}, {"x": v})[1]["x"])


# ---------------------------------------------------------------------------------------------- Jacobian, Hessian


def _multi_graph():
    """a [2, 3], b [3] -> y1 = tanh(a) * b [2, 3], y2 = a @ b [2], y3 = sum(sin(b)) [] (no path from a)."""
    nodes = [n("Tanh", ["a"], "ta"), n("Mul", ["ta", "b"], "y1"), n("MatMul", ["a", "b"], "y2"), n("Sin", ["b"], "sb"),
             n("ReduceSum", ["sb"], "y3", keepdims=0)]
    g = Graph(nodes, [ValueInfo("a", F64, (2, 3)), ValueInfo("b", F64, (3,))],
              [ValueInfo("y1", F64, (2, 3)), ValueInfo("y2", F64, (2,)), ValueInfo("y3", F64, ())])

    def fn(a, b):
        return torch.tanh(a) * b, a @ b, torch.sin(b).sum()

    return g, fn


@pytest.mark.parametrize("mode", ["forward", "reverse", "auto"])
def test_jacobian_several_inputs_and_outputs(mode):
    g, fn = _multi_graph()
    feeds = {"a": RNG.standard_normal((2, 3)), "b": RNG.standard_normal(3)}
    jg, ours = jacobian_run(g, feeds, ["y1", "y2", "y3"], ["a", "b"], mode)
    assert_jacobians(ours, fn, feeds, ["y1", "y2", "y3"], ["a", "b"])
    assert basis_trips(jg) == (6 + 3 if mode != "reverse" else 6 + 2 + 1)  # auto: 9 <= 9 elements, forward
    np.testing.assert_array_equal(ours[("y3", "a")], np.zeros((2, 3)))  # no path: exact zeros


def test_jvp_of_an_output_with_no_path_is_zero_with_a_warning():
    g, fn = _multi_graph()
    feeds = {"a": RNG.standard_normal((2, 3)), "b": RNG.standard_normal(3)}
    ta = RNG.standard_normal((2, 3))
    with pytest.warns(UserWarning, match="no path from the inputs to 'y3'"):
        _, _, tan = jvp_run(g, feeds, {"a": ta}, ["y1", "y3"])
    np.testing.assert_array_equal(tan["y3"], 0.0)
    close(tan["y1"], torch_jvp(lambda a, b: fn(a, b)[0], feeds, {"a": ta})[0])


@pytest.mark.parametrize("mode", ["forward", "reverse", "auto"])
@pytest.mark.parametrize("policy", ["store", "sqrt"])
def test_jacobian_through_a_loop(mode, policy):
    # s = s0 * x^5 (a non-square block: [3] and a scalar loss, w.r.t. x [3] and s0 [3])
    g = _product_graph(5)
    feeds = {"x": X3, "s0": S3}
    _, ours = jacobian_run(g, feeds, ["s", "loss"], ["x", "s0"], mode, checkpoint=policy)

    def fn(x, s0):
        s = s0 * x**5
        return s, s.sum()

    assert_jacobians(ours, fn, feeds, ["s", "loss"], ["x", "s0"])


def _fanout_graph(nx, ny):
    """x [nx] -> y [ny]: y = tanh(tile(x, ny / nx) * c) for nx <= ny, else y = MatMul(C, sin(x))."""
    c = np.linspace(0.5, 1.5, max(nx, ny))
    if nx <= ny:
        nodes = [n("Tile", ["x", "reps"], "xt"), n("Mul", ["xt", "c"], "xc"), n("Tanh", ["xc"], "y")]
        inits = {"reps": np.array([ny // nx], np.int64), "c": c}

        def fn(x):
            return torch.tanh(x.repeat(ny // nx) * torch.tensor(c))
    else:
        cm = c[:ny, None] * np.cos(np.arange(nx))[None, :]
        nodes = [n("Sin", ["x"], "sx"), n("MatMul", ["C", "sx"], "y")]
        inits = {"C": cm}

        def fn(x):
            return torch.tensor(cm) @ torch.sin(x)
    return Graph(nodes, [ValueInfo("x", F64, (nx,))], [ValueInfo("y", F64, (ny,))], inits), fn


@pytest.mark.parametrize(("nx", "ny", "picked"), [(2, 6, "forward"), (6, 2, "reverse"), (3, 3, "forward")])
def test_auto_mode_takes_the_fewer_basis_iterations(nx, ny, picked):
    g, fn = _fanout_graph(nx, ny)
    feeds = {"x": RNG.standard_normal(nx)}
    trips = {}
    for mode in ("forward", "reverse", "auto"):
        jg, ours = jacobian_run(g, feeds, ["y"], ["x"], mode)
        assert_jacobians(ours, fn, feeds, ["y"], ["x"])
        trips[mode] = basis_trips(jg)
    assert (trips["forward"], trips["reverse"]) == (nx, ny)  # one iteration per input / output element
    assert trips["auto"] == trips[picked]


def test_auto_mode_takes_reverse_when_the_input_size_is_symbolic():
    g = Graph([n("Sin", ["x"], "sx"), n("ReduceSum", ["sx"], "y", keepdims=0)], [ValueInfo("x", F64, ("N",))],
              [ValueInfo("y", F64, ())])
    x = RNG.standard_normal(4)
    jg, ours = jacobian_run(g, {"x": x}, ["y"], ["x"], "auto")
    assert basis_trips(jg) == 1
    close(ours[("y", "x")], np.cos(x))


@pytest.mark.parametrize(("mode", "name"), [("forward", "x"), ("reverse", "y"), ("auto", "y")])
def test_jacobian_needs_static_shapes(mode, name):
    g = Graph([n("Tanh", ["x"], "y")], [ValueInfo("x", F64, ("N", 3))], [ValueInfo("y", F64, ("N", 3))])
    with pytest.raises(rg.RevgraphError) as info:
        rg.jacobian(g, mode=mode)
    message = str(info.value)
    assert "\n" not in message and f"{name!r}" in message and "not static" in message, message
    if mode != "forward":  # the way out when only the outputs' shapes are unknown
        assert "mode='forward'" in message, message


def test_auto_mode_takes_forward_when_only_the_output_size_is_symbolic():
    # x [3] static, y [N] (a Tile by a run-time count): the basis must run over x
    g = Graph([n("Tile", ["x", "reps"], "xt"), n("Sin", ["xt"], "y")], [ValueInfo("x", F64, (3,)),
              ValueInfo("reps", np.int64, (1,))], [ValueInfo("y", F64, ("N",))])
    x = RNG.standard_normal(3)
    assert rg.autodiff.transforms.jacobian_mode(g, ["y"], ["x"]) == "forward"
    jac = rg.jacobian(g, ["y"], ["x"])
    out = rg.Session(jac).run({"x": x, "reps": np.array([2], np.int64)})["y_jacobian_x"]
    close(out, np.concatenate([np.diag(np.cos(x))] * 2))


def test_shape_error_names_the_value_when_its_tangent_name_is_taken():
    g = Graph([n("Add", ["x", "x_tangent"], "y")], [ValueInfo("x", F64, ("N",)), ValueInfo("x_tangent", F64, ("N",))],
              [ValueInfo("y", F64, ("N",))])
    with pytest.raises(rg.RevgraphError, match=r"^'x' has shape") as info:
        rg.jacobian(g, ["y"], ["x"], mode="forward")
    assert "x_tangent" not in str(info.value)


def test_integer_outputs_are_refused_as_outputs():
    g = Graph([n("Cast", ["x"], "k", to=7)], [ValueInfo("x", F64, (3,))], [ValueInfo("k", np.int64, (3,))])
    for build in (rg.jvp, rg.jacobian):
        with pytest.raises(rg.RevgraphError, match=r"^the output 'k' is int64"):
            build(g, ["k"], ["x"])


def test_jacobian_refuses_an_unknown_mode():
    g, _ = _multi_graph()
    with pytest.raises(rg.RevgraphError, match="mode='sideways': choose one of 'auto', 'forward', 'reverse'"):
        rg.jacobian(g, mode="sideways")


def test_hessian_with_cross_blocks():
    # loss = sum(tanh(a @ b)^2) + sum(b^3) * sum(a): a [2, 3], b [3]
    nodes = [n("MatMul", ["a", "b"], "ab"), n("Tanh", ["ab"], "t"), n("Mul", ["t", "t"], "t2"),
             n("ReduceSum", ["t2"], "p", keepdims=0), n("Mul", ["b", "b"], "b2"), n("Mul", ["b2", "b"], "b3"),
             n("ReduceSum", ["b3"], "q", keepdims=0), n("ReduceSum", ["a"], "sa", keepdims=0),
             n("Mul", ["q", "sa"], "qa"), n("Add", ["p", "qa"], "loss")]
    g = Graph(nodes, [ValueInfo("a", F64, (2, 3)), ValueInfo("b", F64, (3,))], [ValueInfo("loss", F64, ())])
    feeds = {"a": RNG.standard_normal((2, 3)), "b": RNG.standard_normal(3)}
    ours = hessian_run(g, feeds, ["a", "b"])
    assert_hessians(ours, lambda a, b: (torch.tanh(a @ b) ** 2).sum() + (b**3).sum() * a.sum(), feeds, ["a", "b"])
    close(ours[("a", "b")], ours[("b", "a")].transpose(1, 2, 0))  # symmetric


@pytest.mark.parametrize("policy", POLICIES)
def test_hessian_through_a_loop(policy):
    g, unrolled = _rnn_graph(3)
    rng = np.random.default_rng(8)
    feeds = {"h0": rng.standard_normal(3), "w": rng.standard_normal(3), "x": 0.5 * rng.standard_normal(3)}
    ours = hessian_run(g, feeds, ["w", "h0"], checkpoint=policy)
    assert_hessians(ours, lambda w, h0: unrolled(h0, w, torch.tensor(feeds["x"])), feeds, ["w", "h0"])



@pytest.mark.parametrize("policy", ["store", "sqrt"])
@pytest.mark.parametrize("x", [0.0, 2.5])
def test_jacobian_and_hessian_through_a_while_loop(x, policy):
    # the Taylor-series sin again (zero trips at x = 0): d sin = cos, d^2 sin = -sin
    g, feeds = _taylor_graph(), {"x": np.array(x)}
    for mode in ("forward", "reverse"):
        _, ours = jacobian_run(g, feeds, ["loss"], ["x"], mode, checkpoint=policy)
        close(ours[("loss", "x")], math.cos(x), rtol=1e-10, atol=1e-12)
        assert_jacobians(ours, taylor_sin, feeds, ["loss"], ["x"])
    ours = hessian_run(g, feeds, ["x"], checkpoint=policy)
    close(ours[("x", "x")], -math.sin(x), rtol=1e-10, atol=1e-12)
    assert_hessians(ours, taylor_sin, feeds, ["x"])


# ---------------------------------------------------------------------------------------------- light models


SMALL_LIGHT = ["squeezenet"]  # about 9 s; shufflenet 9 s, the others 20 s to 4 min (-m slow)


@pytest.mark.parametrize("name", SMALL_LIGHT)
def test_light_model_jvp_small(name):
    light_check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [m for m in LIGHT_MODELS if m not in SMALL_LIGHT])
def test_light_model_jvp(name):
    light_check(name)


def test_a_zero_tangent_meeting_an_infinite_derivative_gives_zero():
    # sqrt(relu(x)): where relu is inactive its tangent is exactly 0, and sqrt'(0) = inf; strong zeros make the
    # JVP 0 there (torch.func.jvp gives NaN), and 1 / (2 sqrt(x)) * t where x > 0
    g = Graph([n("Relu", ["x"], "r"), n("Sqrt", ["r"], "y")], [ValueInfo("x", F64, (3,))], [ValueInfo("y", F64, (3,))])
    jg = rg.jvp(g)
    x, t = np.array([-1.0, 0.0, 4.0]), np.array([1.0, 2.0, 3.0])
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(jg, backend=backend).run({"x": x, "x_tangent": t})["y_tangent"]
        np.testing.assert_array_equal(out, [0.0, 0.0, 0.75])
