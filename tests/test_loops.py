"""Gradients through ONNX Loop: closed forms, each also against the unrolled loop in PyTorch (float64), under
every residual policy and both runtimes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kit.loops import (
    POLICIES,
    assert_close,
    body,
    const,
    grads,
    graph,
    loop,
    n,
    taylor_cond_nodes,
    taylor_sin_body,
    three_nested_loops,
    torch_grads,
)

import revgraph as rg

X3 = np.array([0.5, 1.5, -0.8])
S3 = np.array([1.0, 2.0, 3.0])


def _trip(k):
    return {"M": np.array(k, np.int64)}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_product_s_times_x(policy, steps):
    b = body([n("Mul", ["s_in", "x"], "s_out")], [("s_in", "s_out")], types={"s_in": (3,), "s_out": (3,)})
    g = graph([loop(b, "M", ["s0"], ["s"]), n("ReduceSum", ["s"], "loss", keepdims=0)],
              {"x": (3,), "s0": (3,)}, ["loss"], _trip(steps))
    ours = grads(g, {"x": X3, "s0": S3}, ["x", "s0"], policy=policy)
    np.testing.assert_allclose(ours["x"], steps * X3 ** max(steps - 1, 0) * S3 if steps else 0 * X3)
    np.testing.assert_allclose(ours["s0"], X3**steps)  # zero trips: the cotangent of the output itself

    def unrolled(x, s0):
        s = s0
        for _ in range(steps):
            s = s * x
        return s.sum()

    assert_close(ours, torch_grads(unrolled, {"x": X3, "s0": S3}, ["x", "s0"]))


@pytest.mark.parametrize("policy", POLICIES)
def test_sum_s_plus_x(policy):
    b = body([n("Add", ["s_in", "x"], "s_out")], [("s_in", "s_out")])
    g = graph([loop(b, "M", ["s0"], ["s"]), n("ReduceSum", ["s"], "loss", keepdims=0)],
              {"x": (3,), "s0": (3,)}, ["loss"], _trip(7))
    ours = grads(g, {"x": X3, "s0": S3}, ["x", "s0"], policy=policy)
    np.testing.assert_allclose(ours["x"], np.full(3, 7.0))  # invariant: summed over all iterations
    np.testing.assert_allclose(ours["s0"], np.ones(3))


@pytest.mark.parametrize("policy", POLICIES)
def test_running_sum_uses_iteration_number(policy):
    # acc = sum_{i=1..n} i * x^i, with p carried as x^i and i read from the iteration number
    b = body(
        [
            n("Mul", ["p_in", "x"], "p_out"),
            const("one", 1, np.int64),
            n("Add", ["i", "one"], "i1"),
            n("Cast", ["i1"], "fi", to=11),
            n("Mul", ["fi", "p_out"], "term"),
            n("Add", ["acc_in", "term"], "acc_out"),
        ],
        [("p_in", "p_out"), ("acc_in", "acc_out")],
    )
    g = graph([loop(b, "M", ["one_f", "zero_f"], ["p", "acc"]), n("Identity", ["acc"], "loss")],
              {"x": ()}, ["loss"], {**_trip(6), "one_f": np.array(1.0), "zero_f": np.array(0.0)})
    x = np.array(0.7)
    ours = grads(g, {"x": x}, ["x"], policy=policy)
    np.testing.assert_allclose(ours["x"], sum(i * i * x ** (i - 1) for i in range(1, 7)))
    assert_close(ours, torch_grads(lambda x: sum(i * x**i for i in range(1, 7)), {"x": x}, ["x"]))


@pytest.mark.parametrize("policy", POLICIES)
def test_two_carried_updated_together(policy):
    # x <- x + y and y <- 3x + 1 (both from the old values)
    b = body(
        [
            n("Add", ["x_in", "y_in"], "x_out"),
            const("three", 3.0),
            const("onef", 1.0),
            n("Mul", ["x_in", "three"], "x3"),
            n("Add", ["x3", "onef"], "y_out"),
        ],
        [("x_in", "x_out"), ("y_in", "y_out")],
    )
    g = graph([loop(b, "M", ["x0", "y0"], ["x", "y"]), n("Mul", ["x", "y"], "xy"),
               n("ReduceSum", ["xy"], "loss", keepdims=0)], {"x0": (2,), "y0": (2,)}, ["loss"], _trip(4))
    feeds = {"x0": np.array([0.3, -0.2]), "y0": np.array([0.1, 0.5])}

    def unrolled(x0, y0):
        x, y = x0, y0
        for _ in range(4):
            x, y = x + y, 3 * x + 1
        return (x * y).sum()

    assert_close(grads(g, feeds, ["x0", "y0"], policy=policy), torch_grads(unrolled, feeds, ["x0", "y0"]))


@pytest.mark.parametrize("policy", POLICIES)
def test_carried_values_swap_and_one_feeds_two(policy):
    # (a, b, c) <- (b * w, a, a + c): a swaps with b and feeds both b and c
    b = body([n("Mul", ["b_in", "w"], "a_out"), n("Identity", ["a_in"], "b_out"), n("Add", ["a_in", "c_in"], "c_out")],
             [("a_in", "a_out"), ("b_in", "b_out"), ("c_in", "c_out")])
    nodes = [loop(b, "M", ["a0", "b0", "c0"], ["a", "b", "c"]), n("Mul", ["a", "b"], "ab"),
             n("Mul", ["ab", "c"], "abc"), n("ReduceSum", ["abc"], "loss", keepdims=0)]
    g = graph(nodes, {"a0": (2,), "b0": (2,), "c0": (2,), "w": (2,)}, ["loss"], _trip(5))
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(2) for k in ("a0", "b0", "c0", "w")}

    def unrolled(a0, b0, c0, w):
        a, b_, c = a0, b0, c0
        for _ in range(5):
            a, b_, c = b_ * w, a, a + c
        return (a * b_ * c).sum()

    wrt = ["a0", "b0", "c0", "w"]
    assert_close(grads(g, feeds, wrt, policy=policy), torch_grads(unrolled, feeds, wrt))


@pytest.mark.parametrize("policy", POLICIES)
def test_scan_output_with_cotangent_per_iteration(policy):
    # y_t = tanh(s_t * w) stacked; loss = sum(u * Y) with a different cotangent row per iteration
    b = body([n("Mul", ["s_in", "w"], "s_out"), n("Tanh", ["s_out"], "y")], [("s_in", "s_out")], scan=["y"])
    g = graph([loop(b, "M", ["s0"], ["s", "Y"]), n("Mul", ["Y", "u"], "uy"),
               n("ReduceSum", ["uy"], "loss", keepdims=0)], {"s0": (3,), "w": (3,)}, ["loss"],
              {**_trip(4), "u": np.arange(12.0).reshape(4, 3) / 10 - 0.5})
    feeds = {"s0": S3 / 3, "w": np.array([0.9, -1.1, 0.4])}
    u = g.initializers["u"]

    def unrolled(s0, w):
        s, total = s0, 0
        for t in range(4):
            s = s * w
            total = total + (torch.tanh(s) * torch.tensor(u[t])).sum()
        return total

    assert_close(grads(g, feeds, ["s0", "w"], policy=policy), torch_grads(unrolled, feeds, ["s0", "w"]))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("x", [0.0, 0.4, 2.5])
def test_taylor_sin_stops_when_term_is_small(policy, x):
    nodes = [*taylor_cond_nodes(), loop(taylor_sin_body(), "", ["x", "x"], ["t", "sin"], cond="go"),
             n("Identity", ["sin"], "loss")]
    g = graph(nodes, {"x": ()}, ["loss"], {"eps0": np.array(1e-12)})
    ours = grads(g, {"x": np.array(x)}, ["x"], policy=policy)  # x = 0: zero trips
    np.testing.assert_allclose(ours["x"], math.cos(x), rtol=1e-10, atol=1e-12)
    run = rg.Session(g).run({"x": np.array(x)})
    np.testing.assert_allclose(run["loss"], math.sin(x), atol=1e-12)


@pytest.mark.parametrize("policy", POLICIES)
def test_taylor_sin_nested_in_an_outer_loop(policy):
    # s <- s + sin(x * s): the while loop (data-dependent trip count) inside a fixed 3-step loop
    inner = taylor_sin_body()
    outer = body(
        [n("Mul", ["x0", "s_in"], "x"), *taylor_cond_nodes(),
         loop(inner, "", ["x", "x"], ["t", "sin"], "inner", cond="go"), n("Add", ["s_in", "sin"], "s_out")],
        [("s_in", "s_out")], iter_name="j", cond_name="c_outer",
    )
    nodes = [loop(outer, "M", ["s0"], ["s"], "outer"), n("Identity", ["s"], "loss")]
    g = graph(nodes, {"x0": (), "s0": ()}, ["loss"], {**_trip(3), "eps0": np.array(1e-12)})
    feeds = {"x0": np.array(0.8), "s0": np.array(0.6)}

    def unrolled(x0, s0):
        s = s0
        for _ in range(3):
            s = s + torch.sin(x0 * s)
        return s

    assert_close(grads(g, feeds, ["x0", "s0"], policy=policy), torch_grads(unrolled, feeds, ["x0", "s0"]), rtol=1e-8)


@pytest.mark.parametrize("policy", POLICIES)
def test_scan_until_value_is_five(policy):
    # r_i = x_i^2 for i = 0, 1, ... until x_i == 5, over x = 0..19: gradient 2 x_i for i <= 5, then 0
    b = body(
        [
            n("Gather", ["x", "i"], "xi", axis=0),
            n("Mul", ["xi", "xi"], "r"),
            const("five", 5.0),
            n("Equal", ["xi", "five"], "is5"),
            n("Not", ["is5"], "cond_next"),
        ],
        [], cond_out="cond_next", scan=["r"],
    )
    g = graph([loop(b, "M", [], ["R"]), n("ReduceSum", ["R"], "loss", keepdims=0)], {"x": (20,)}, ["loss"], _trip(1000))
    x = np.arange(20.0)
    ours = grads(g, {"x": x}, ["x"], policy=policy)
    expected = np.where(np.arange(20) <= 5, 2 * x, 0.0)
    np.testing.assert_array_equal(ours["x"], expected)
    assert rg.Session(g).run({"x": x})["loss"] == sum(v * v for v in range(6))


@pytest.mark.parametrize("policy", POLICIES)
def test_third_derivative_of_repeated_squaring(policy):
    b = body([n("Mul", ["x_in", "x_in"], "x_out")], [("x_in", "x_out")])
    g = graph([loop(b, "M", ["x0"], ["x"])], {"x0": ()}, ["x"], _trip(4))
    first = rg.gradient(g, wrt=["x0"], checkpoint=policy)
    first.outputs = first.outputs[-1:]
    second = rg.gradient(first, wrt=["x0"], checkpoint=policy)
    second.outputs = second.outputs[-1:]
    third = rg.gradient(second, wrt=["x0"], checkpoint=policy)
    x = np.array(0.95)
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(third, backend=backend).run({"x0": x})
        np.testing.assert_allclose(out[third.output_names[-1]], 16 * 15 * 14 * 0.95**13, rtol=1e-10)
        np.testing.assert_allclose(out[second.output_names[-1]], 16 * 15 * 0.95**14, rtol=1e-10)


@pytest.mark.parametrize("policy", POLICIES)
def test_outer_value_both_initial_and_captured(policy):
    # s0 = x and x captured: s <- s * x, three times: s = x^4
    b = body([n("Mul", ["s_in", "x"], "s_out")], [("s_in", "s_out")])
    g = graph([loop(b, "M", ["x"], ["s"]), n("ReduceSum", ["s"], "loss", keepdims=0)], {"x": (3,)}, ["loss"], _trip(3))
    ours = grads(g, {"x": X3}, ["x"], policy=policy)
    np.testing.assert_allclose(ours["x"], 4 * X3**3)


@pytest.mark.parametrize("policy", POLICIES)
def test_three_nested_loops(policy):
    g, feeds, unrolled = three_nested_loops()
    loss = lambda s0, w: unrolled(s0, w).sum()
    assert_close(grads(g, feeds, ["s0", "w"], policy=policy), torch_grads(loss, feeds, ["s0", "w"]))


def test_policies_stack_only_what_the_body_vjp_needs():
    # body y = x * w with gradients for x alone: the VJP needs w (captured, never stacked), nothing of x
    b = body([n("Mul", ["x_in", "w"], "x_out")], [("x_in", "x_out")], types={"x_in": (3,), "x_out": (3,)})
    g = graph([loop(b, "M", ["x0"], ["x"]), n("ReduceSum", ["x"], "loss", keepdims=0)], {"x0": (3,), "w": (3,)},
              ["loss"], _trip(4))
    gg = rg.gradient(g, wrt=["x0"])
    fwd = next(node for node in gg.nodes if node.name == "loop")
    assert [o for o in fwd.outputs if "stacked" in o] == []
    gw = rg.gradient(g, wrt=["w"])  # now x_in is needed: d(x*w)/dw = x
    fwd = next(node for node in gw.nodes if node.name == "loop")
    assert [o for o in fwd.outputs if "stacked" in o] == ["loop/stacked/x_in"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("steps", [0, 1, 4])
def test_rows_read_per_iteration_are_stacked_not_accumulated(policy, steps):
    # h <- tanh(h * w + xs[i]), as a recurrence reads its input sequence: xs's gradient is every iteration's row,
    # stacked by the backward loop as scan outputs, never added into a [T, 3] accumulator the loop carries
    # (onnxruntime copies a carried value each iteration: O(T^2) for T rows)
    b = body([n("Gather", ["xs", "i"], "xt", axis=0), n("Mul", ["h_in", "w"], "hw"), n("Add", ["hw", "xt"], "pre"),
              n("Tanh", ["pre"], "h_out")], [("h_in", "h_out")], types={"h_in": (3,), "h_out": (3,)})
    g = graph([loop(b, "M", ["h0"], ["h"]), n("ReduceSum", ["h"], "loss", keepdims=0)],
              {"xs": (4, 3), "w": (3,), "h0": (3,)}, ["loss"], _trip(steps))
    rng = np.random.default_rng(steps)
    feeds = {"xs": rng.standard_normal((4, 3)), "w": rng.standard_normal(3), "h0": rng.standard_normal(3)}

    def unrolled(xs, w, h0):
        h = h0
        for t in range(steps):
            h = torch.tanh(h * w + xs[t])
        return h.sum()

    ours = grads(g, feeds, ["xs", "w", "h0"], policy=policy)
    assert_close(ours, torch_grads(unrolled, feeds, ["xs", "w", "h0"]))
    if policy in ("store", "recompute"):
        gg = rg.gradient(g, wrt=["xs"], checkpoint=policy)
        backward_loops = [m for m in gg.nodes if m.op_type == "Loop" and m.name != "loop"]
        assert backward_loops and all(vi.shape != (4, 3) for m in backward_loops for vi in m.attrs["body"].inputs)


def _runs_of(graph, node_name: str) -> int:
    """How many loop bodies (at any depth) hold a node named ``node_name``: how often the gradient graph runs it."""
    count, todo = 0, [graph]
    while todo:
        g = todo.pop()
        for node in g.nodes:
            for sub in node.subgraphs.values():
                count += any(m.name == node_name for m in sub.nodes)
                todo.append(sub)
    return count


@pytest.mark.parametrize("policy", ["sqrt", 2, 3])
@pytest.mark.parametrize(("trips", "stop", "start"), [
    (np.array(0, np.int64), 9, True), (np.array(1, np.int64), 9, True), (np.array(4, np.int64), 9, True),
    (np.array(10, np.int64), 9, True),  # the condition stops it first: 9 trips
    (np.array([7], np.int64), 9, True),  # M written with shape [1]
    (None, 5, True), (None, 16, True),  # a while loop: no trip count
    (np.array(6, np.int64), 9, False),  # the condition is false before the first iteration
])
def test_forward_loop_keeps_the_checkpoints(policy, trips, stop, start):
    """Segment policies on a loop without scan outputs: the forward loop is rewritten to stack the checkpoints
    as it runs, so the user's body runs in two loops of the gradient graph (forward, and the backward loop's
    segment recomputation), not three; the gradients match the unrolled loop for every way the loop ends."""
    b = body([n("Mul", ["s_in", "x"], "s_out", "user_mul"), const("one", 1, np.int64), n("Add", ["i", "one"], "i1"),
              n("Less", ["i1", "stop"], "cond_out")], [("s_in", "s_out")], cond_out="go", types={"s_in": (3,)})
    b.outputs[0] = rg.ir.ValueInfo("cond_out", np.bool_, ())
    inits = {"stop": np.array(stop, np.int64), "start": np.array(start)}
    if trips is not None:
        inits["M"] = trips
    g = graph([loop(b, "M" if trips is not None else "", ["s0"], ["s"], cond="start"),
               n("ReduceSum", ["s"], "loss", keepdims=0)], {"x": (3,), "s0": (3,)}, ["loss"], inits)
    gg = rg.gradient(g, wrt=["x", "s0"], checkpoint=policy)
    assert _runs_of(gg, "user_mul") == 2
    steps = 0 if not start else min(stop, int(trips.reshape(-1)[0]) if trips is not None else stop)

    def unrolled(x, s0):
        s = s0
        for _ in range(steps):
            s = s * x
        return s.sum()

    feeds = {"x": X3, "s0": S3}
    assert_close(grads(g, feeds, ["x", "s0"], policy=policy), torch_grads(unrolled, feeds, ["x", "s0"]))
