"""LSTM, GRU and RNN, differentiated through their Loop form (revgraph.autodiff.loops.recurrent).

Forward: the lowered graph computes what onnxruntime's own LSTM/GRU/RNN kernels compute (float32, the only
dtype they support), and what the reference evaluator's kernels compute in float64 (default options: the
reference ignores clip, activations and input_forget). Gradients, three ways (tests/kit/harness.py): central
differences, PyTorch autograd, second order. PyTorch's torch.nn.LSTM/GRU/RNN take the same weights with
their gates reordered (ONNX LSTM iofc vs PyTorch ifgo, ONNX GRU zrh vs PyTorch rzn; PyTorch's GRU is
linear_before_reset=1); options PyTorch's modules lack (peepholes, clip, input_forget, other activations,
sequence_lens) are checked against the spec's equations written with torch ops.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import assert_same_values
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.harness import check_rule
from torch.func import functional_call

import revgraph as rg
from revgraph.autodiff.arguments import used_names
from revgraph.autodiff.loops.recurrent import lower_recurrent
from revgraph.errors import GraphError
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.onnx_io.value_types import infer_types

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
TORCH_ORDER = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}  # ONNX gate chunks in PyTorch's order
N_ACTS = {"LSTM": 3, "GRU": 2, "RNN": 1}
DEFAULT_ACTS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
TAKES = {"Affine": "ab", "ScaledTanh": "ab", "HardSigmoid": "ab", "LeakyRelu": "a", "ThresholdedRelu": "a", "Elu": "a"}


def make(op, attrs=None, *, dtype=np.float64, T=3, B=2, I=3, H=4, opts=("B", "h0", "c0"), lens=None, seed=0,
         outputs=("Y", "Yh", "Yc")):
    """A one-node graph (float inputs are graph inputs; sequence_lens an int32 initializer) and its feeds."""
    attrs = dict(attrs or {})
    rng = np.random.default_rng(seed)
    nd = 2 if attrs.get("direction") == "bidirectional" else 1
    layout = attrs.get("layout", 0)
    g_h = GATES[op] * H
    feeds = {"X": rng.standard_normal((B, T, I) if layout else (T, B, I)),
             "W": 0.6 * rng.standard_normal((nd, g_h, I)), "R": 0.6 * rng.standard_normal((nd, g_h, H))}
    names = ["X", "W", "R", "", "", "", "", ""]
    state = (B, nd, H) if layout else (nd, B, H)
    extra = {"B": (3, (nd, 2 * g_h)), "h0": (5, state), "c0": (6, state), "P": (7, (nd, 3 * H))}
    for key, (pos, shape) in extra.items():
        if key in opts and (op == "LSTM" or key in ("B", "h0")):
            feeds[key] = 0.6 * rng.standard_normal(shape)
            names[pos] = key
    inits = {}
    if lens is not None:
        inits["L"] = np.asarray(lens, np.int32)
        names[4] = "L"
    while names[-1] == "":
        names.pop()
    feeds = {k: v.astype(dtype) for k, v in feeds.items()}
    outs = [o for o in outputs if o != "Yc" or op == "LSTM"]
    attrs.setdefault("hidden_size", H)
    g = Graph([Node(op, names, outs, attrs, "rnn")], [ValueInfo(k, dtype, v.shape) for k, v in feeds.items()],
              [ValueInfo(o) for o in outs if o], inits)
    return g, feeds


def lowered(g):
    g = g.copy()
    assert lower_recurrent(g, infer_types(g), used_names(g))
    assert not any(n.op_type in GATES for _, n in g.walk())
    return g


def run(g, feeds, backend="onnxruntime"):
    return rg.Session(g, backend=backend).run(feeds)


def activation_attrs(acts):
    """``activations`` / ``activation_alpha`` / ``activation_beta`` from (name, alpha, beta) triples: each
    value is listed by the activations that take it, in order (ONNX spec, onnxruntime)."""
    out = {"activations": [a[0] for a in acts]}
    alphas = [a[1] for a in acts if "a" in TAKES.get(a[0], "")]
    betas = [a[2] for a in acts if "b" in TAKES.get(a[0], "")]
    if alphas:
        out["activation_alpha"] = alphas
    if betas:
        out["activation_beta"] = betas
    return out


# ---------------------------------------------------------------------------------------------- torch references


def torch_module(op, attrs, H):
    """``fn(X, W, R, B, h0, c0)`` computing the node with torch.nn.LSTM/GRU/RNN and the ONNX weights."""
    layout, nd = attrs.get("layout", 0), 2 if attrs.get("direction") == "bidirectional" else 1
    reverse = attrs.get("direction") == "reverse"

    def fn(X, W, R, B=None, h0=None, c0=None):
        cls = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN}[op]
        kw = {"nonlinearity": attrs.get("activations", ["Tanh"])[0].lower()} if op == "RNN" else {}
        m = cls(X.shape[-1], H, bias=B is not None, batch_first=bool(layout), bidirectional=nd == 2, **kw).double()
        g_h = GATES[op] * H

        def order(t):
            return torch.cat([t[k * H:(k + 1) * H] for k in TORCH_ORDER[op]], 0)

        params = {}
        for d in range(nd):
            sfx = "_reverse" if d else ""
            params[f"weight_ih_l0{sfx}"], params[f"weight_hh_l0{sfx}"] = order(W[d]), order(R[d])
            if B is not None:
                params[f"bias_ih_l0{sfx}"], params[f"bias_hh_l0{sfx}"] = order(B[d, :g_h]), order(B[d, g_h:])
        state = None
        if h0 is not None:
            h = h0.transpose(0, 1) if layout else h0
            state = (h, c0.transpose(0, 1) if layout else c0) if op == "LSTM" else h
        t_axis = 1 if layout else 0
        x = X.flip(t_axis) if reverse else X
        y, last = functional_call(m, params, (x, state))
        y = y.flip(t_axis) if reverse else y
        if layout:
            Y = y.reshape(y.shape[0], y.shape[1], nd, H)
        else:
            Y = y.reshape(y.shape[0], y.shape[1], nd, H).permute(0, 2, 1, 3)
        finals = list(last) if op == "LSTM" else [last]
        return (Y, *(s.transpose(0, 1) if layout else s for s in finals))

    return fn


def _torch_act(name, alpha, beta):
    return {
        "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Relu": torch.relu,
        "Affine": lambda x: alpha * x + beta, "LeakyRelu": lambda x: torch.where(x >= 0, x, alpha * x),
        "ThresholdedRelu": lambda x: torch.where(x > alpha, x, torch.zeros_like(x)),
        "ScaledTanh": lambda x: alpha * torch.tanh(beta * x), "HardSigmoid": lambda x: (alpha * x + beta).clamp(0, 1),
        "Elu": lambda x: torch.where(x >= 0, x, alpha * (torch.exp(x) - 1)), "Softsign": lambda x: x / (1 + x.abs()),
        "Softplus": torch.nn.functional.softplus,
    }[name]


def spec_reference(op, attrs, H, acts=None, lens=None):
    """``fn(X, W, R, B, h0, c0, P)``: the ONNX spec's equations with torch ops, one time step at a time
    (with onnxruntime's choices where the spec leaves room; see the lowering's module doc)."""
    layout = attrs.get("layout", 0)
    direction = attrs.get("direction", "forward")
    nd = 2 if direction == "bidirectional" else 1
    acts = acts or [(a, 0.0, 0.0) for a in DEFAULT_ACTS[op]] * nd
    clip = attrs.get("clip")

    def cl(v):
        return v if clip is None else v.clamp(-clip, clip)

    def one_direction(x, w, r, b, h, c, p, fs, reverse):
        T, batch = x.shape[0], x.shape[1]
        f, g, hact = [*fs, None, None][:3]
        ln = torch.full((batch,), T) if lens is None else torch.as_tensor(lens, dtype=torch.int64)
        if reverse:  # each sequence reversed within its length
            t = torch.arange(T)[:, None]
            idx = torch.where(t < ln[None], ln[None] - 1 - t, t)
            x = x[idx, torch.arange(batch)[None]]
        wb, rb = b.chunk(2)
        ys = []
        for t in range(T):
            if op == "LSTM":
                gi, go, gf, gc = (x[t] @ w.T + h @ r.T + wb + rb).chunk(4, -1)
                pi, po, pf = p.chunk(3)
                i = f(cl(gi + pi * c))
                fg = 1 - i if attrs.get("input_forget") else f(cl(gf + pf * c))
                new_c = fg * c + i * g(cl(gc))
                new_h = f(cl(go + po * new_c)) * hact(new_c)
            elif op == "GRU":
                xz, xr, xh = (x[t] @ w.T).chunk(3, -1)
                wz, wr, wh = wb.chunk(3)
                rz, rr, rh = rb.chunk(3)
                r_z, r_r, r_h = r.chunk(3)
                z = f(cl(xz + h @ r_z.T + wz + rz))
                rt = f(cl(xr + h @ r_r.T + wr + rr))
                if attrs.get("linear_before_reset"):
                    hh = g(cl(xh + rt * (h @ r_h.T + rh) + wh))
                else:
                    hh = g(cl(xh + (rt * h) @ r_h.T + rh + wh))
                new_h, new_c = (1 - z) * hh + z * h, None
            else:
                new_h, new_c = f(cl(x[t] @ w.T + h @ r.T + wb + rb)), None
            valid = (t < ln)[:, None]
            ys.append(torch.where(valid, new_h, torch.zeros_like(new_h)))
            h = torch.where(valid, new_h, h)
            c = None if new_c is None else torch.where(valid, new_c, c)
        y = torch.stack(ys)
        if reverse:
            y = y[idx, torch.arange(batch)[None]]
        empty = (ln == 0)[:, None]
        finals = [torch.where(empty, torch.zeros_like(s), s) for s in (h, c) if s is not None]
        return y, finals

    def fn(X, W, R, B=None, h0=None, c0=None, P=None):
        x = X.transpose(0, 1) if layout else X
        batch, dt = x.shape[1], X.dtype
        zeros = torch.zeros(nd, batch, H, dtype=dt)
        h0 = zeros if h0 is None else (h0.transpose(0, 1) if layout else h0)
        c0 = zeros if c0 is None else (c0.transpose(0, 1) if layout else c0)
        B = torch.zeros(nd, 2 * GATES[op] * H, dtype=dt) if B is None else B
        P = torch.zeros(nd, 3 * H, dtype=dt) if P is None else P
        k = N_ACTS[op]
        results = [one_direction(x, W[d], R[d], B[d], h0[d], c0[d], P[d],
                                 [_torch_act(*a) for a in acts[d * k:(d + 1) * k]],
                                 direction == "reverse" or d == 1) for d in range(nd)]
        Y = torch.stack([y for y, _ in results], 1)
        finals = [torch.stack([f[j] for _, f in results]) for j in range(len(results[0][1]))]
        if layout:
            return (Y.permute(2, 0, 1, 3), *(s.transpose(0, 1) for s in finals))
        return (Y, *finals)

    return fn


# ---------------------------------------------------------------------------------------------- forward


def _acts(op, names, alpha=0.3, beta=0.6):
    return [(n, alpha + 0.1 * i, beta) for i, n in enumerate(names[: N_ACTS[op]])]


FORWARD_CASES = {
    "defaults": ({}, {}),
    "reverse": ({"direction": "reverse"}, {}),
    "bidirectional": ({"direction": "bidirectional"}, {}),
    "no_optional_inputs": ({}, {"opts": ()}),
    "peepholes": ({"direction": "bidirectional"}, {"opts": ("B", "h0", "c0", "P")}),
    "clip": ({"clip": 0.5}, {"opts": ("B", "h0", "c0", "P")}),
    "input_forget": ({"input_forget": 1}, {}),
    "linear_before_reset": ({"linear_before_reset": 1, "direction": "reverse"}, {}),
    "relu": ({"activations": ["Relu", "Relu", "Relu"]}, {}),
    "activations_a": ({"acts": ["HardSigmoid", "LeakyRelu", "Softsign"]}, {}),
    "activations_b": ({"acts": ["ScaledTanh", "Affine", "Elu"]}, {}),
    "activations_c": ({"acts": ["Softplus", "ThresholdedRelu", "Sigmoid"]}, {}),
    "lens_forward": ({}, {"lens": [3, 1]}),
    "lens_full": ({"direction": "reverse"}, {"lens": [3, 3]}),
    "lens_reverse": ({"direction": "reverse"}, {"lens": [2, 3]}),
    "lens_bidirectional_empty": ({"direction": "bidirectional"}, {"lens": [0, 2]}),
    "only_final_state": ({}, {"outputs": ("", "Yh", "Yc")}),
}


def _attrs(op, attrs):
    attrs = dict(attrs)
    if "acts" in attrs:
        attrs.update(activation_attrs(_acts(op, attrs.pop("acts"))))
    if "activations" in attrs:
        attrs["activations"] = attrs["activations"][: N_ACTS[op]]
    if op != "LSTM":
        attrs.pop("input_forget", None)
    if op != "GRU":
        attrs.pop("linear_before_reset", None)
    return attrs


@pytest.mark.parametrize("op", sorted(GATES))
@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
def test_forward_matches_onnxruntime_kernels(op, case):
    attrs, kw = FORWARD_CASES[case]
    g, feeds = make(op, _attrs(op, attrs), dtype=np.float32, seed=len(case), **kw)
    expected = run(g, feeds)
    low = lowered(g)
    got, ref = run(low, feeds), run(low, feeds, "reference")
    assert set(got) == set(expected)
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-4, atol=5e-5, err_msg=k)
        # relative to the outputs' scale: with Relu the states grow to ~25, and an output near 0 is a difference
        # of such values, whose rounding (1e-6 absolute) depends on the BLAS kernels of the reference's MatMul
        assert_same_values(ref[k], got[k], what=f"reference, {k}")


@pytest.mark.parametrize("op", sorted(GATES))
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_layout_1_is_layout_0_transposed(op, direction):
    """onnxruntime has no kernel for layout=1: compare with its layout=0 result on the transposed data."""
    g1, feeds = make(op, {"direction": direction, "layout": 1}, dtype=np.float32, seed=3)
    g0, _ = make(op, {"direction": direction}, dtype=np.float32)
    t = {k: (v.transpose(1, 0, 2) if k in ("X", "h0", "c0") else v) for k, v in feeds.items()}
    expected = run(g0, t)
    got = run(lowered(g1), feeds)
    np.testing.assert_allclose(got["Y"], expected["Y"].transpose(2, 0, 1, 3), rtol=1e-5, atol=1e-6)
    for k in ("Yh", "Yc")[: 2 if op == "LSTM" else 1]:
        np.testing.assert_allclose(got[k], expected[k].transpose(1, 0, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", sorted(GATES))
@pytest.mark.parametrize("attrs", [{}, {"direction": "reverse"}, {"direction": "bidirectional", "layout": 1},
                                   {"linear_before_reset": 1}])
def test_forward_float64_matches_reference_kernels(op, attrs):
    g, feeds = make(op, _attrs(op, attrs), opts=("B", "h0", "c0", "P"), seed=5)
    expected = run(g, feeds, "reference")
    got = run(lowered(g), feeds)
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-12, atol=1e-12, err_msg=k)


# ---------------------------------------------------------------------------------------------- gradients


@st.composite
def module_case(draw):
    return (draw(st.sampled_from(["forward", "reverse", "bidirectional"])), draw(st.integers(0, 1)),
            draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4)),
            draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN", "RNN-relu"])
@settings(max_examples=6, deadline=None)
@given(case=module_case())
def test_gradients_against_torch_modules(op, case):
    direction, layout, T, B, I, H, bias, initial, seed = case
    op, _, act = op.partition("-")
    attrs = {"direction": direction, "layout": layout}
    if op == "GRU":
        attrs["linear_before_reset"] = 1  # PyTorch's GRU
    if act:
        attrs["activations"] = ["Relu"] * (2 if direction == "bidirectional" else 1)
    opts = (("B",) if bias else ()) + (("h0", "c0") if initial else ())
    g, feeds = make(op, attrs, T=T, B=B, I=I, H=H, opts=opts, seed=seed)
    check_rule(lowered(g), feeds, torch_module(op, attrs, H), seed=seed)


GRADIENT_CASES = {
    "peepholes_bidirectional": ({"direction": "bidirectional"}, {"opts": ("B", "h0", "c0", "P")}),
    "clip": ({"clip": 0.4, "direction": "reverse"}, {"opts": ("B", "h0", "c0", "P")}),
    "input_forget": ({"input_forget": 1}, {"opts": ("B", "P")}),
    "gru_reset_before_linear": ({"linear_before_reset": 0, "direction": "bidirectional"}, {}),
    "activations_a": ({"acts": ["HardSigmoid", "LeakyRelu", "Softsign"]}, {}),
    "activations_b": ({"acts": ["ScaledTanh", "Affine", "Elu"], "direction": "reverse"}, {}),
    "activations_c": ({"acts": ["Softplus", "ThresholdedRelu", "Sigmoid"], "layout": 1}, {}),
    "lens_forward": ({}, {"lens": [3, 1]}),
    "lens_bidirectional": ({"direction": "bidirectional"}, {"lens": [2, 3], "opts": ("B", "h0", "c0", "P")}),
    "lens_empty_reverse": ({"direction": "reverse"}, {"lens": [0, 2]}),
    "no_optional_inputs": ({"direction": "bidirectional"}, {"opts": ()}),
}


@pytest.mark.parametrize("op", sorted(GATES))
@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
def test_gradients_against_spec_equations(op, case):
    attrs, kw = GRADIENT_CASES[case]
    attrs = dict(attrs)
    nd = 2 if attrs.get("direction") == "bidirectional" else 1
    names = attrs.pop("acts", None)
    acts = None
    if names is not None:
        acts = _acts(op, names) * nd
        attrs.update(activation_attrs(acts))
    attrs = _attrs(op, attrs)
    g, feeds = make(op, attrs, H=3, seed=len(case), **kw)
    check_rule(lowered(g), feeds, spec_reference(op, attrs, 3, acts, kw.get("lens")), seed=len(case))


def test_spec_reference_is_onnxruntime_in_float32():
    """The torch reference above agrees with onnxruntime's kernel on the options only it covers."""
    acts = _acts("LSTM", ["HardSigmoid", "LeakyRelu", "Softsign"]) * 2
    attrs = {"direction": "bidirectional", "clip": 0.6, "input_forget": 1, **activation_attrs(acts)}
    g, feeds = make("LSTM", attrs, dtype=np.float32, opts=("B", "h0", "c0", "P"), lens=[3, 2], seed=9)
    expected = run(g, feeds)
    got = spec_reference("LSTM", attrs, 4, acts, [3, 2])(**{k: torch.tensor(v) for k, v in feeds.items()})
    for k, t in zip(["Y", "Yh", "Yc"], got, strict=True):
        np.testing.assert_allclose(t.numpy(), expected[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_gradient_of_the_node_itself_float32():
    """rg.gradient lowers the node (the graph keeps its LSTM until then) and matches PyTorch in float32."""
    attrs = {"direction": "bidirectional"}
    g, feeds = make("LSTM", attrs, dtype=np.float32, seed=21)
    g.nodes.append(Node("ReduceSum", ["Y"], ["s"], {"keepdims": 0}, "sum"))
    g.outputs = [ValueInfo("s", np.float32, ())]
    gg = rg.gradient(g, loss="s")
    assert any(n.op_type == "LSTM" for n in g.nodes)
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    got = run(gg, feeds)
    t = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in feeds.items()}
    torch_module("LSTM", attrs, 4)(**t)[0].sum().backward()
    for k in feeds:
        np.testing.assert_allclose(got[f"{k}_grad"], t[k].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


def test_backward_lowers_too():
    """The low-level rg.backward pass lowers recurrent nodes of the graph it is given."""
    g, feeds = make("GRU", {"linear_before_reset": 1}, outputs=("", "Yh"))
    g.nodes.append(Node("ReduceSum", ["Yh"], ["s"], {"keepdims": 0}, "sum"))
    g.outputs = [ValueInfo("s", np.float64, ())]
    nodes, grad_map = rg.backward(g, ys={"s": None}, wrt=["W", "X"])
    assert not any(n.op_type == "GRU" for n in g.nodes)
    g.nodes.extend(nodes)
    g.outputs += [ValueInfo(grad_map["W"], np.float64, feeds["W"].shape)]
    got = run(g, feeds)[grad_map["W"]]
    t = {k: torch.tensor(v, requires_grad=k == "W") for k, v in feeds.items()}
    torch_module("GRU", {}, 4)(**t)[1].sum().backward()
    np.testing.assert_allclose(got, t["W"].grad.numpy(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("policy", ["recompute", "sqrt", 2])
def test_checkpoint_policies_agree(policy):
    g, feeds = make("LSTM", {"direction": "bidirectional"}, T=4, opts=("B", "h0", "c0", "P"), seed=4)
    g.nodes.append(Node("ReduceSum", ["Y"], ["s"], {"keepdims": 0}, "sum"))
    g.outputs = [ValueInfo("s", np.float64, ())]
    stored = run(rg.gradient(g, loss="s"), feeds)
    other = run(rg.gradient(g, loss="s", checkpoint=policy), feeds)
    for k in feeds:
        np.testing.assert_allclose(other[f"{k}_grad"], stored[f"{k}_grad"], rtol=1e-10, atol=1e-12, err_msg=k)


def test_rnn_inside_a_loop_body():
    """A recurrent node in a subgraph is lowered too: h <- RNN(X, W, R, initial_h=h).Y_h, twice."""
    rng = np.random.default_rng(2)
    feeds = {"X": rng.standard_normal((2, 1, 2)), "W": rng.standard_normal((1, 3, 2)),
             "R": rng.standard_normal((1, 3, 3)), "h0": rng.standard_normal((1, 1, 3))}
    body = Graph(
        [Node("RNN", ["X", "W", "R", "", "", "h_in"], ["", "h_out"], {"hidden_size": 3}, "inner"),
         Node("Identity", ["cond"], ["cond_out"], name="pass")],
        [ValueInfo("i", np.int64, ()), ValueInfo("cond", np.bool_, ()), ValueInfo("h_in", np.float64, (1, 1, 3))],
        [ValueInfo("cond_out", np.bool_, ()), ValueInfo("h_out", np.float64, (1, 1, 3))],
    )
    nodes = [Node("Loop", ["two", "true", "h0"], ["h"], {"body": body}, "loop"),
             Node("ReduceSum", ["h"], ["s"], {"keepdims": 0}, "sum")]
    g = Graph(nodes, [ValueInfo(k, np.float64, v.shape) for k, v in feeds.items()], [ValueInfo("s", np.float64, ())],
              {"two": np.array(2, np.int64), "true": np.array(True)})
    got = run(rg.gradient(g, loss="s"), feeds)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    h = t["h0"]
    for _ in range(2):
        h = torch_module("RNN", {}, 3)(t["X"], t["W"], t["R"], None, h)[1]
    h.sum().backward()
    for k in feeds:
        np.testing.assert_allclose(got[f"{k}_grad"], t[k].grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=k)


def test_hidden_size_from_r_when_the_attribute_is_missing():
    g, feeds = make("GRU", {"linear_before_reset": 1}, seed=6)
    del g.nodes[0].attrs["hidden_size"]
    check_rule(lowered(g), feeds, torch_module("GRU", {}, 4))


def test_unknown_activation_is_a_one_line_error():
    g, _ = make("RNN", {"activations": ["Swish"]})
    with pytest.raises(GraphError, match=r"'rnn'.*Swish") as info:
        lowered(g)
    assert "\n" not in str(info.value)
