"""What a forward Loop stacks for its backward loop under ``store`` (issue 24, DESIGN.md section 4 "Residuals"):
each distinct value once. A carried value's per-iteration input is the previous iteration's output, so one stack
serves both; a row of a loop-invariant input read by ``Gather`` at the iteration number is read again from the
input; a scan output the body already has is reused. Gradients are checked against the unrolled loop in PyTorch
(float64, both runtimes, every residual policy), and the stacked bytes are counted from the written gradient
graph (the residuals' declared types, :func:`revgraph.autodiff.memory.residual_sizes`) against hand counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit.loops import F64, POLICIES, assert_close, body, const, grads, graph, loop, n, torch_grads

import revgraph as rg
from revgraph.autodiff.memory import residual_sizes, saved_bytes
from revgraph.ir import Graph, Node, ValueInfo

T, B, H, I = 5, 2, 4, 3  # steps, batch, hidden, input
F = 8  # bytes of a float64
WRT = ["xs", "h0", "W", "U", "b"]


def _rnn_nodes(index="i"):
    return [n("Gather", ["xs", index], "x_t", axis=0), n("MatMul", ["h_in", "W"], "hw"),
            n("MatMul", ["x_t", "U"], "xu"), n("Add", ["hw", "xu"], "pre0"), n("Add", ["pre0", "b"], "pre"),
            n("Tanh", ["pre"], "h_out")]


def _declare(b: Graph, shapes: dict[str, tuple]) -> Graph:
    b.outputs = [ValueInfo(v.name, v.dtype, shapes.get(v.name, v.shape)) for v in b.outputs]
    return b


def rnn_graph(steps=T, scan=(), cond=None, extra=(), index="i", trip="M", start="true"):
    """h_t = tanh(h_{t-1} W + x_t U + b) over the rows of xs [steps, B, I]; loss = sum(h_T) (+ sum of each scan
    output). ``scan``: (name, body value) pairs scanned out through Identity; ``cond``: the body's condition
    output (with ``extra`` nodes computing it)."""
    nodes = [*_rnn_nodes(index), *extra, *[n("Identity", [src], dst) for dst, src in scan]]
    b = body(nodes, [("h_in", "h_out")], cond_out=cond or "cond_out", scan=[d for d, _ in scan],
             types={"h_in": (B, H), "h_out": (B, H)})
    _declare(b, {d: (B, H) for d, _ in scan})
    outs = ["h", *[f"Y{k}" for k in range(len(scan))]]
    nodes = [loop(b, trip, ["h0"], outs, cond=start), n("ReduceSum", ["h"], "l0", keepdims=0)]
    loss = "l0"
    for k in range(len(scan)):
        nodes += [n("ReduceSum", [f"Y{k}"], f"ly{k}", keepdims=0), n("Add", [loss, f"ly{k}"], f"l{k + 1}")]
        loss = f"l{k + 1}"
    nodes.append(n("Identity", [loss], "loss"))
    inits = {"M": np.array(steps, np.int64)} if trip == "M" else {}
    return graph(nodes, {"xs": (max(steps, 1), B, I), "h0": (B, H), "W": (H, H), "U": (I, H), "b": (H,)}, ["loss"],
                 inits)


def feeds(steps=T, seed=0):
    rng = np.random.default_rng(seed)
    return {"xs": rng.standard_normal((max(steps, 1), B, I)), "h0": rng.standard_normal((B, H)) * 0.5,
            "W": rng.standard_normal((H, H)) * 0.5, "U": rng.standard_normal((I, H)), "b": rng.standard_normal(H) * 0.1}


def unrolled(steps, scan_weights=(), stop=None):
    """The RNN in PyTorch: ``scan_weights`` lists, per scan output, "h_out" or "h_in" (summed into the loss);
    ``stop(t, h_out)`` is False to end the loop after iteration t."""
    def fn(xs, h0, W, U, b):
        h, extra = h0, 0
        for t in range(steps):
            h_in, h = h, torch.tanh(h @ W + xs[t] @ U + b)
            extra = extra + sum((h if which == "h_out" else h_in).sum() for which in scan_weights)
            if stop is not None and not stop(t, h):
                break
        return h.sum() + extra
    return fn


def forward_loop(gg: Graph, name="loop") -> Node:
    return next(node for node in gg.nodes if node.name == name)


def new_stacks(gg: Graph, name="loop") -> dict[str, tuple]:
    """The scan outputs revgraph added to the forward loop ``name`` (its residual stacks), with their types."""
    return {o: gg.type_of(o).shape for o in forward_loop(gg, name).outputs if "/stacked/" in o}


def loop_residual_bytes(gg: Graph, name="loop") -> int:
    """Bytes of the residuals the forward loop ``name`` writes (stacks, and the user's scan outputs read back)."""
    outs = set(forward_loop(gg, name).outputs)
    return sum(size for r, size in residual_sizes(gg).items() if r in outs and "trip_count" not in r)


# ------------------------------------------------------------------------------------------------ the RNN

@pytest.mark.parametrize("policy", POLICIES)
def test_rnn_gradients_unchanged(policy):
    assert_close(grads(rnn_graph(), feeds(), WRT, policy=policy), torch_grads(unrolled(T), feeds(), WRT))


def test_rnn_store_keeps_one_stack_of_h():
    # The body's VJP reads h_out (Tanh's derivative 1 - h_out^2), h_in (W's gradient h_in^T g) and x_t (U's
    # gradient x_t^T g). Before: three stacks, 2 T B H + T B I floats = 2*5*2*4 + 5*2*3 = 110 floats. Now: h_in[t]
    # is h_out[t - 1] (h0 at t = 0) and x_t is Gather(xs, t) again: one stack of h_out, T x B x H floats, typed
    # with its T rows (the trip count is a constant and the condition is passed on unchanged).
    gg = rg.gradient(rnn_graph(), wrt=WRT)
    assert new_stacks(gg) == {"loop/stacked/h_out": (T, B, H)}
    assert loop_residual_bytes(gg) == T * B * H * F == 320
    body_names = {o for nd in forward_loop(gg).attrs["body"].nodes for o in nd.outputs}
    assert "x_t" in body_names and not any("x_t" in o or "h_in" in o for o in new_stacks(gg))


def test_rnn_recompute_keeps_the_carried_value_only():
    # recompute: the carried input h_in, T x B x H floats; x_t and the rest are recomputed
    gg = rg.gradient(rnn_graph(), wrt=WRT, checkpoint="recompute")
    assert new_stacks(gg) == {"loop/stacked/h_in": (T, B, H)}


def test_rnn_saved_bytes_of_the_whole_gradient_graph():
    # Loss = y = h_T V (seeded with ones, as a non-scalar loss is): the residuals are the stack of h_out
    # (T B H floats), h_T itself (B H floats, read by MatMul's VJP for V) and the trip count (one int64):
    # 5*2*4*8 + 2*4*8 + 8 = 392 bytes, where the three stacks of before were 2*320 + 5*2*3*8 = 880 bytes.
    g = rnn_graph()
    g.nodes = [g.nodes[0], n("MatMul", ["h", "V"], "y")]
    g.outputs = [ValueInfo("y", F64, (B, 2))]
    g.inputs.append(ValueInfo("V", F64, (H, 2)))
    gg = rg.gradient(g, loss="y", wrt=[*WRT, "V"])
    assert saved_bytes(gg) == T * B * H * F + B * H * F + 8 == 392
    out = rg.Session(gg).run({**feeds(), "V": np.ones((H, 2))})
    ref = torch_grads(unrolled(T), feeds(), ["W"])  # y summed, with V all ones, is 2 sum(h_T)
    np.testing.assert_allclose(out[gg.output_names[1 + WRT.index("W")]], 2 * ref["W"], rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------- early exit and zero trips

def _stop_nodes(limit):
    # continue while sum(|h_out|) < limit
    return [n("Abs", ["h_out"], "ah"), n("ReduceSum", ["ah"], "mass", keepdims=0), const("limit", limit),
            n("Less", ["mass", "limit"], "go")]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("limit", [0.0, 3.0, 1e9])  # stops after the first iteration, somewhere, never
def test_condition_stops_early(policy, limit):
    g = rnn_graph(steps=8, cond="go", extra=_stop_nodes(limit))
    f = feeds(8, seed=3)
    ref = torch_grads(unrolled(8, stop=lambda t, h: float(h.abs().sum()) < limit), f, WRT)
    assert_close(grads(g, f, WRT, policy=policy), ref)
    if policy == "store":  # T is only known when the loop has run: one stack of h_out with unknown rows
        assert new_stacks(rg.gradient(g, wrt=WRT)) == {"loop/stacked/h_out": (None, B, H)}


@pytest.mark.parametrize("policy", POLICIES)
def test_zero_trip_count(policy):
    f = feeds(0)
    ours = grads(rnn_graph(steps=0), f, WRT, policy=policy)
    assert_close(ours, torch_grads(unrolled(0), f, WRT))
    np.testing.assert_array_equal(ours["h0"], np.ones((B, H)))
    if policy == "store":
        assert new_stacks(rg.gradient(rnn_graph(steps=0), wrt=WRT)) == {"loop/stacked/h_out": (0, B, H)}


@pytest.mark.parametrize("policy", POLICIES)
def test_condition_false_before_the_first_iteration(policy):
    g = rnn_graph(start="start")
    g.initializers["start"] = np.array(False)
    assert_close(grads(g, feeds(), WRT, policy=policy), torch_grads(unrolled(0), feeds(), WRT))


@pytest.mark.parametrize("policy", POLICIES)
def test_while_loop_without_trip_count(policy):
    # no M: the loop runs until sum(|h|) reaches the limit
    g = rnn_graph(steps=6, trip="", cond="go", extra=_stop_nodes(4.0))
    f = feeds(6, seed=5)
    f["xs"] = np.concatenate([f["xs"], np.ones((30, B, I))])  # rows enough for the loop to reach the limit
    g.inputs[0] = ValueInfo("xs", F64, f["xs"].shape)
    steps = next(t + 1 for t in range(len(f["xs"])) if _mass(f, t + 1) >= 4.0)
    assert steps < len(f["xs"])
    ref = torch_grads(unrolled(steps), f, WRT)
    assert_close(grads(g, f, WRT, policy=policy), ref)


def _mass(f, steps):
    h = f["h0"]
    for t in range(steps):
        h = np.tanh(h @ f["W"] + f["xs"][t] @ f["U"] + f["b"])
    return np.abs(h).sum()


# ------------------------------------------------------------------------------------ scanned carried values

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("which", ["h_out", "h_in"])
def test_body_scans_out_its_carried_value(policy, which):
    # The body carries h and scans it out (h_out, or the h it started the iteration with): the user's own scan
    # output Y already holds every h the VJP reads, so nothing more is stacked. With Y = h_out stacked, h_in[t]
    # is Y[t - 1] (h0 at t = 0); with Y = h_in stacked, h_out[t] is Y[t + 1] (the final h at t = T - 1).
    g = rnn_graph(scan=[("y", which)])
    assert_close(grads(g, feeds(), WRT, policy=policy), torch_grads(unrolled(T, [which]), feeds(), WRT))
    if policy in ("store", "recompute"):
        gg = rg.gradient(g, wrt=WRT, checkpoint=policy)
        assert new_stacks(gg) == {}
        # Y itself, read back; with Y = h_in stacked, also the final h (B H floats), read at t = T - 1
        final = B * H * F if which == "h_in" and policy == "store" else 0
        assert loop_residual_bytes(gg) == T * B * H * F + final
        assert gg.type_of("Y0").shape == (T, B, H)


@pytest.mark.parametrize("policy", POLICIES)
def test_scan_outputs_of_other_values_are_reused(policy):
    # Y scans out Tanh's output under another name and pre (the pre-activation) is scanned out too: the VJP's
    # reads all come from the user's stacks
    g = rnn_graph(scan=[("y", "h_out"), ("p", "pre")])
    g.nodes[0].attrs["body"].outputs[-1] = ValueInfo("p", F64, (B, H))

    def ref(xs, h0, W, U, b):
        h, extra = h0, 0
        for t in range(T):
            pre = h @ W + xs[t] @ U + b
            h = torch.tanh(pre)
            extra = extra + h.sum() + pre.sum()
        return h.sum() + extra

    assert_close(grads(g, feeds(), WRT, policy=policy), torch_grads(ref, feeds(), WRT))
    if policy == "store":
        assert new_stacks(rg.gradient(g, wrt=WRT)) == {}


# ------------------------------------------------------------------------------------------- rows of inputs

@pytest.mark.parametrize("policy", POLICIES)
def test_row_read_through_cast_and_unsqueeze(policy):
    # x_t = Squeeze(Gather(xs, Unsqueeze(Cast(i, int32)))): still a row of xs, read again, never stacked
    index = [n("Cast", ["i"], "i32", to=6), const("ax0", [0], np.int64), n("Unsqueeze", ["i32", "ax0"], "iu")]
    nodes = [*index, n("Gather", ["xs", "iu"], "x_t1", axis=0), n("Squeeze", ["x_t1", "ax0"], "x_t"),
             *_rnn_nodes()[1:]]
    b = body(nodes, [("h_in", "h_out")], types={"h_in": (B, H), "h_out": (B, H)})
    g = graph([loop(b, "M", ["h0"], ["h"]), n("ReduceSum", ["h"], "loss", keepdims=0)],
              {"xs": (T, B, I), "h0": (B, H), "W": (H, H), "U": (I, H), "b": (H,)}, ["loss"],
              {"M": np.array(T, np.int64)})
    assert_close(grads(g, feeds(), WRT, policy=policy), torch_grads(unrolled(T), feeds(), WRT))
    if policy == "store":
        assert new_stacks(rg.gradient(g, wrt=WRT)) == {"loop/stacked/h_out": (T, B, H)}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("reverse", [0, 1])
def test_scan_reads_its_inputs_again_and_reuses_its_outputs(policy, reverse):
    # ONNX Scan (lowered to a Loop whose body reads x_t = Gather(xs, i), or Gather(xs, T - 1 - i) in reverse)
    # whose body scans out its state: no residual is stacked at all
    sb = Graph([*_rnn_nodes()[1:], n("Identity", ["h_out"], "y")],
               [ValueInfo("h_in", F64, (B, H)), ValueInfo("x_t", F64, (B, I))],
               [ValueInfo("h_out", F64, (B, H)), ValueInfo("y", F64, (B, H))])
    scan = Node("Scan", ["h0", "xs"], ["h", "Y"], {"body": sb, "num_scan_inputs": 1, "scan_input_directions": [reverse],
                                                  "scan_output_directions": [reverse]}, "scan")
    g = graph([scan, n("Mul", ["Y", "u"], "uy"), n("ReduceSum", ["uy"], "ys", keepdims=0),
               n("ReduceSum", ["h"], "hs", keepdims=0), n("Add", ["ys", "hs"], "loss")],
              {"xs": (T, B, I), "h0": (B, H), "W": (H, H), "U": (I, H), "b": (H,)}, ["loss"],
              {"u": np.linspace(-1, 1, T * B * H).reshape(T, B, H)})
    u = g.initializers["u"]

    def ref(xs, h0, W, U, b):
        h, ys = h0, []
        for t in (range(T - 1, -1, -1) if reverse else range(T)):
            h = torch.tanh(h @ W + xs[t] @ U + b)
            ys.append(h)
        y = torch.stack(ys[::-1] if reverse else ys)
        return (y * torch.tensor(u)).sum() + h.sum()

    assert_close(grads(g, feeds(), WRT, policy=policy), torch_grads(ref, feeds(), WRT))
    if policy in ("store", "recompute"):
        gg = rg.gradient(g, wrt=WRT, checkpoint=policy)
        loops = [nd for nd in gg.nodes if nd.op_type == "Loop" and not nd.name.startswith("grad/")]
        assert len(loops) == 1 and not [o for o in loops[0].outputs if "/stacked/" in o]


# ------------------------------------------------------------------------------------------------ nesting

def _nested_graph():
    # outer (3 steps): s <- s + 0.5 * r, r the result of the inner RNN (2 steps): h <- tanh(h W + s_in)
    inner = body([n("MatMul", ["h_in", "W"], "hw"), n("Add", ["hw", "s_in"], "pre"), n("Tanh", ["pre"], "h_out")],
                 [("h_in", "h_out")], iter_name="k", cond_name="c_in", types={"h_in": (B, H), "h_out": (B, H)})
    outer = body([loop(inner, "M2", ["s_in"], ["r"], "inner"), const("half", 0.5), n("Mul", ["r", "half"], "hr"),
                  n("Add", ["s_in", "hr"], "s_out")], [("s_in", "s_out")], types={"s_in": (B, H), "s_out": (B, H)})
    g = graph([loop(outer, "M", ["s0"], ["s"], "outer"), n("ReduceSum", ["s"], "loss", keepdims=0)],
              {"s0": (B, H), "W": (H, H)}, ["loss"], {"M": np.array(3, np.int64), "M2": np.array(2, np.int64)})

    def ref(s0, W):
        s = s0
        for _ in range(3):
            h = s
            for _ in range(2):
                h = torch.tanh(h @ W + s)
            s = s + 0.5 * h
        return s.sum()

    return g, ref


@pytest.mark.parametrize("policy", POLICIES)
def test_nested_loops(policy):
    g, ref = _nested_graph()
    rng = np.random.default_rng(7)
    f = {"s0": rng.standard_normal((B, H)) * 0.5, "W": rng.standard_normal((H, H)) * 0.5}
    assert_close(grads(g, f, ["s0", "W"], policy=policy), torch_grads(ref, f, ["s0", "W"]))
    if policy == "store":
        # The inner loop (inside the outer body) stacks h_out alone, 2 x B x H (before: h_in and h_out); that
        # stack is an inner scan output, recomputed by the outer backward body (its length could change between
        # outer iterations), so the outer loop stacks s_in, the inner loop's initial value (which the recomputed
        # inner loop and the shifted h_in read), and the inner trip count: 3 x B x H floats + 3 int64
        gg = rg.gradient(g, wrt=["s0", "W"])
        fwd_inner = next(nd for nd in forward_loop(gg, "outer").attrs["body"].nodes if nd.name == "inner")
        assert [o for o in fwd_inner.outputs if "/stacked/" in o] == ["inner/stacked/h_out"]
        assert new_stacks(gg, "outer") == {"outer/stacked/s_in": (3, B, H), "outer/stacked/inner/trip_count": (3,)}


# ---------------------------------------------------------------------------------------------- second order

@pytest.mark.parametrize("policy", ["store", "recompute"])
def test_gradient_of_the_gradient_through_shifted_values(policy):
    # d/dW of sum(dL/dW) for the RNN: the first gradient graph reads h_in from the stack of h_out (Where on
    # t = 0, Gather at t - 1), and that graph is differentiated again
    first = rg.gradient(rnn_graph(), wrt=["W"], checkpoint=policy)
    first.nodes.append(n("ReduceSum", [first.output_names[-1]], "gsum", keepdims=0))
    first.outputs = [ValueInfo("gsum", F64, ())]
    second = rg.gradient(first, loss="gsum", wrt=["W"], checkpoint=policy)
    f = feeds()
    t = {k: torch.tensor(v, requires_grad=k == "W") for k, v in f.items()}
    (gw,) = torch.autograd.grad(unrolled(T)(**t), [t["W"]], create_graph=True)
    (ggw,) = torch.autograd.grad(gw.sum(), [t["W"]])
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(second, backend=backend).run(f)
        np.testing.assert_allclose(out[second.output_names[-1]], ggw.numpy(), rtol=1e-8, atol=1e-10)


def test_zero_trip_loop_with_a_reduced_scan_output_runs_on_onnxruntime():
    # Hypothesis's example: Loop(M = 0) scanning out y = sin(s) tanh(x) x, then ReduceSum over the (empty) scan
    # axis. The scan output's length 0 is known before running; declaring it made onnxruntime refuse the
    # gradient graph (its inference merges the [0] stack with the [1] it infers for the reduction's VJP).
    # The loss is 0 whatever x is: the gradient is exactly 0.
    f64 = np.float64
    b = Graph([Node("Sin", ["s_in"], ["s_sin"], name="b_sin"), Node("Tanh", ["x"], ["tx"], name="b_tanh"),
               Node("Mul", ["s_sin", "tx"], ["s_out"], name="b_mul"), Node("Mul", ["s_out", "x"], ["y"], name="b_y"),
               Node("Identity", ["c"], ["c_out"], name="b_c")],
              [ValueInfo("i", np.int64, ()), ValueInfo("c", np.bool_, ()), ValueInfo("s_in", f64, ())],
              [ValueInfo("c_out", np.bool_, ()), ValueInfo("s_out", f64, ()), ValueInfo("y", f64, ())], name="body")
    g = Graph([Node("Loop", ["M", "true", "x"], ["s_T", "Y"], {"body": b}, name="loop"),
               Node("ReduceSum", ["Y", "axis0"], ["Ys"], {"keepdims": 0}, name="r"),
               Node("Mul", ["Ys", "Ys"], ["sq"], name="sq"),
               Node("ReduceSum", ["sq"], ["loss"], {"keepdims": 0}, name="sum")],
              [ValueInfo("x", f64, ())], [ValueInfo("loss", f64, ())],
              {"M": np.array(0), "true": np.array(True), "axis0": np.array([0])})
    gg = rg.gradient(g, wrt=["x"])
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(gg, backend=backend).run({"x": np.array(0.3)})
        assert out["loss"] == 0 and out["x_grad"] == 0
