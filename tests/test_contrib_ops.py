"""onnxruntime's contrib operators in, standard ONNX out for the backward (issue 41, item 1): the VJPs of
``com.microsoft`` SkipLayerNormalization, SkipSimplifiedLayerNormalization, Gelu, BiasGelu, FastGelu, QuickGelu,
BiasAdd, FusedMatMul and of the default-domain SimplifiedLayerNormalization, against PyTorch float64 autograd of
the same math (onnxruntime docs/ContribOperators.md), with their optional inputs present and absent and their
extra outputs (mean, inv_std_var, input_skip_bias_sum) read downstream.

Each case is one node whose chosen outputs feed ``loss = sum_k sum(out_k * u_k)``; the gradient graph runs on
onnxruntime (which runs the fused forward node), in float64 where onnxruntime has a float64 kernel for the
operator (SimplifiedLayerNormalization, FastGelu, QuickGelu, FusedMatMul), else in float32 against the float64
reference at the float32 inputs. onnxruntime has no CPU kernel of BiasAdd: its forward node is replaced by its
two Adds to run the gradient graph (the backward is what is tested). The last test checks that a model
onnxruntime's transformer optimizer (and its graph optimizer, for FusedMatMul) fused has the gradients of the
unfused model.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from kit.contrib_cases import graph as contrib_graph
from kit.contrib_cases import outside_onnx
from kit.contrib_cases import with_loss as contrib_loss
from kit.harness import double_backward, with_loss

import revgraph as rg
from revgraph.autodiff import registry
from revgraph.ir import Graph, Node, ValueInfo

MS = "com.microsoft"
F32, F64 = np.float32, np.float64


# ---------------------------------------------------------------------------------------------- the math, in torch


def _skip_sum(x, skip, bias=None):
    return x + skip + (0 if bias is None else bias)


def skip_layer_norm(x, skip, gamma, beta=None, bias=None, *, eps=1e-12):
    s = _skip_sum(x, skip, bias)
    mu = s.mean(-1, keepdim=True)
    inv = ((s - mu).square().mean(-1, keepdim=True) + eps).rsqrt()
    y = (s - mu) * inv * gamma + (0 if beta is None else beta)
    return y, mu, inv, s


def skip_simplified_layer_norm(x, skip, gamma, bias=None, *, eps=1e-12):
    s = _skip_sum(x, skip, bias)
    r = (s.square().mean(-1, keepdim=True) + eps).rsqrt()
    return s * r * gamma, torch.zeros_like(r), r, s  # onnxruntime writes no mean (zeros)


def simplified_layer_norm(x, scale, *, axis=-1, eps=1e-5):
    axes = tuple(range(axis % x.dim(), x.dim()))
    r = (x.square().mean(axes, keepdim=True) + eps).rsqrt()
    return x * r * scale, r


def gelu(x):
    return torch.nn.functional.gelu(x)


def bias_gelu(a, b):
    return torch.nn.functional.gelu(a + b)


def fast_gelu(x, bias=None):
    v = x + (0 if bias is None else bias)
    return 0.5 * v * (1 + torch.tanh(0.797885 * v + 0.035677 * v ** 3))  # the kernel's constants


def quick_gelu(x, *, alpha=1.702):
    return x * torch.sigmoid(float(np.float32(alpha)) * x)


def bias_add(x, bias, skip):
    return x + bias + skip


def fused_matmul(a, b, *, transA=0, transB=0, transBatchA=0, transBatchB=0, alpha=1.0):
    def op(t, trans, batch):
        if t.dim() == 1:
            return t
        if batch:
            t = t.permute(*range(1, t.dim() - 1), 0, t.dim() - 1)
        return t.transpose(-1, -2) if trans else t
    return float(np.float32(alpha)) * op(a, transA, transBatchA) @ op(b, transB, transBatchB)


# ---------------------------------------------------------------------------------------------- running a case


def _graph(op: str, domain: str, inputs: list[tuple[str, np.ndarray] | None], attrs: dict, outputs: list[str]) -> Graph:
    """One ``op`` node of ``domain`` (:func:`kit.contrib_cases.graph`: revgraph's types of the contrib outputs,
    which check_case compares with the run's)."""
    return contrib_graph(op, inputs, attrs, outputs, domain=domain)


def _runnable(gg: Graph) -> Graph:
    """``gg`` with a forward BiasAdd node written as its two Adds (onnxruntime has no CPU kernel of it)."""
    g = gg.copy()
    nodes = []
    for n in g.nodes:
        if n.domain == MS and n.op_type == "BiasAdd":
            x, bias, skip = n.inputs
            nodes += [Node("Add", [x, bias], [n.outputs[0] + "/xb"], name=n.name + "/xb"),
                      Node("Add", [n.outputs[0] + "/xb", skip], list(n.outputs), name=n.name + "/skip")]
        else:
            nodes.append(n)
    g.nodes = nodes
    return g


def check_case(op, fn, inputs, attrs=None, outputs=("y",), used=None, *, domain=MS, dtype=F32, seed=0, kw=None):
    """Build the case, differentiate ``loss`` w.r.t. every input, run it on onnxruntime and compare with
    ``fn``'s float64 autograd at the same (dtype-rounded) inputs; also check that the only operators outside
    ONNX's standard set in the gradient graph are the forward node's. Returns revgraph's gradients."""
    rng = np.random.default_rng(seed)
    ins = [None if s is None else (f"in{k}", rng.standard_normal(s).astype(dtype)) for k, s in enumerate(inputs)]
    outputs = list(outputs)
    used = [o for o in outputs if o] if used is None else used
    g = _graph(op, domain, ins, attrs or {}, outputs)
    feeds = dict(i for i in ins if i is not None)
    fwd = rg.Session(_runnable(g)).run(feeds)
    for vi in g.outputs:  # the output types revgraph gives the contrib operators are onnxruntime's
        assert (vi.dtype, vi.shape) == (fwd[vi.name].dtype, fwd[vi.name].shape), (vi, fwd[vi.name].shape)
    lg = contrib_loss(g, fwd, used)
    us = {f"{y}_u": rng.standard_normal(fwd[y].shape).astype(fwd[y].dtype) for y in used}
    wrt = list(feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("no path" to an input whose outputs are all unread: zeros, checked)
        gg = rg.gradient(lg, loss="loss", wrt=wrt, unconnected="zero")
    assert outside_onnx(gg) == outside_onnx(g), "the backward must use ONNX's standard operators only"
    got = rg.Session(_runnable(gg)).run({**feeds, **us})
    # the reference: float64 autograd of the same math at the same inputs
    tin = [None if i is None else torch.tensor(i[1].astype(F64), requires_grad=True) for i in ins]
    touts = fn(*tin, **(kw or {}))
    touts = touts if isinstance(touts, tuple) else (touts,)
    present = list(outputs)
    total = sum((t * torch.tensor(us[f"{o}_u"].astype(F64))).sum() for o, t in zip(present, touts, strict=False)
                if o in used)
    leaves = [t for t in tin if t is not None]
    want = torch.autograd.grad(total, leaves, allow_unused=True) if total.requires_grad else [None] * len(leaves)
    tol = {F64: 1e-10, F32: 2e-5}.get(dtype, 3e-3)  # (float16: statistics in float32, products in float16)
    for (name, a), w in zip((i for i in ins if i is not None), want, strict=True):
        w = np.zeros(a.shape) if w is None else w.numpy()
        grad = got[f"{name}_grad"]
        assert grad.shape == a.shape and grad.dtype == a.dtype, (name, grad.shape, grad.dtype)
        np.testing.assert_allclose(grad, w, rtol=tol, atol=tol * max(1.0, float(np.abs(w).max())),
                                   err_msg=f"{op} {name}")
    for o, t in zip(present, touts, strict=False):  # the forward is the math the reference differentiates
        if o:
            ftol = {F64: 1e-9, F32: 1e-5}.get(fwd[o].dtype.type, 3e-3)  # (inv_std_var is float32 for float64 X)
            np.testing.assert_allclose(fwd[o], t.detach().numpy(), rtol=ftol, atol=ftol)
    return got


# ---------------------------------------------------------------------------------------------- normalizations

B, S, H = 2, 3, 8
ALL4 = ("y", "mean", "inv", "sum")


@pytest.mark.parametrize(("inputs", "outputs", "used"), [
    ([(B, S, H), (B, S, H), (H,), (H,), (H,)], ALL4, None),  # every input and output, every output read
    ([(B, S, H), (S, H), (H,)], ("y",), None),  # skip of [S, H] broadcast, no beta, no bias
    ([(B, S, H), (1, S, H), (H,), (H,)], ALL4, ["mean", "inv"]),  # only the statistics read
    ([(B, S, H), (B, S, H), (H,), None, (H,)], ("y", "", "", "sum"), None),  # bias without beta; outputs with holes
    ([(S, H), (S, H), (H,), (H,), (H,)], ALL4, ["sum"]),  # 2-D input; only input_skip_bias_sum read
])
def test_skip_layer_normalization(inputs, outputs, used):
    attrs = {"epsilon": 1e-5}
    check_case("SkipLayerNormalization", skip_layer_norm, inputs, attrs, outputs, used, kw={"eps": 1e-5})


@pytest.mark.parametrize(("op", "fn", "inputs"), [
    ("SkipLayerNormalization", skip_layer_norm, [(B, S, H), (S, H), (H,), (H,), (H,)]),
    ("SkipSimplifiedLayerNormalization", skip_simplified_layer_norm, [(B, S, H), (B, S, H), (H,), (H,)]),
])
def test_skip_normalizations_in_float16(op, fn, inputs):
    """float16 inputs (onnxruntime's kernels compute the statistics in float32, and so do the VJPs)."""
    check_case(op, fn, inputs, {"epsilon": 1e-5}, ALL4, ["y", "inv", "sum"], dtype=np.float16, kw={"eps": 1e-5})


def test_skip_layer_normalization_default_epsilon():
    check_case("SkipLayerNormalization", skip_layer_norm, [(B, S, H), (B, S, H), (H,), (H,)], outputs=("y", "mean"))


@pytest.mark.parametrize(("inputs", "outputs", "used"), [
    ([(B, S, H), (B, S, H), (H,), (H,)], ALL4, ["y", "inv", "sum"]),
    ([(B, S, H), (S, H), (H,)], ("y",), None),
    ([(B, S, H), (B, S, H), (H,)], ("y", "", "inv"), ["inv"]),
    ([(B, S, H), (B, S, H), (H,), (H,)], ALL4, ["mean"]),  # mean is zeros: no gradient reaches anything
])
def test_skip_simplified_layer_normalization(inputs, outputs, used):
    check_case("SkipSimplifiedLayerNormalization", skip_simplified_layer_norm, inputs, {"epsilon": 1e-5}, outputs,
               used, kw={"eps": 1e-5})


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize(("x", "scale", "attrs", "outputs", "used"), [
    ((B, S, H), (H,), {}, ("y", "inv"), None),
    ((B, S, H), (S, H), {"axis": 1, "epsilon": 1e-3}, ("y", "inv"), None),
    ((B, S, H), (H,), {"axis": -1, "stash_type": 1}, ("y",), None),
    ((S, H), (H,), {}, ("y", "inv"), ["inv"]),  # only inv_std_var read
])
def test_simplified_layer_normalization(x, scale, attrs, outputs, used, dtype):
    kw = {"axis": attrs.get("axis", -1), "eps": attrs.get("epsilon", 1e-5)}
    check_case("SimplifiedLayerNormalization", simplified_layer_norm, [x, scale], attrs, outputs, used, domain="",
               dtype=dtype, kw=kw)


# ---------------------------------------------------------------------------------------------- activations, BiasAdd


def test_gelu_and_bias_gelu():  # (onnxruntime has no float64 Erf, nor BiasGelu)
    check_case("Gelu", gelu, [(B, S, H)])
    check_case("BiasGelu", bias_gelu, [(B, S, H), (H,)])


@pytest.mark.parametrize("dtype", [F32, F64])
def test_fast_gelu(dtype):
    check_case("FastGelu", fast_gelu, [(B, S, H), (H,)], dtype=dtype)
    check_case("FastGelu", fast_gelu, [(B, S, H)], dtype=dtype, seed=1)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_quick_gelu(dtype):
    check_case("QuickGelu", quick_gelu, [(B, S, H)], dtype=dtype)
    check_case("QuickGelu", quick_gelu, [(B, S, H)], {"alpha": 0.37}, dtype=dtype, kw={"alpha": 0.37})


def test_bias_add():
    check_case("BiasAdd", bias_add, [(B, S, H), (H,), (B, S, H)])


# ---------------------------------------------------------------------------------------------- FusedMatMul


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize(("a", "b", "attrs"), [
    ((B, S, H), (H, 5), {}),
    ((B, S, H), (5, H), {"transB": 1, "alpha": 0.125}),
    ((B, H, S), (H, 5), {"transA": 1}),
    ((B, H, S), (B, 5, H), {"transA": 1, "transB": 1, "alpha": -2.0}),
    ((H,), (B, H, 5), {"transA": 1}),  # a vector is never transposed
    ((B, S, H), (H,), {"transB": 1}),
    ((3, B, H), (B, H, 5), {"transBatchA": 1}),
    ((3, B, 4, H), (B, 4, H, 5), {"transBatchA": 1}),
    ((H, B, 3), (B, H, 5), {"transBatchA": 1, "transA": 1}),
    ((B, S, H), (H, B, 5), {"transBatchB": 1}),
    ((3, 1, 4, H), (5, B, 4, H), {"transBatchA": 1, "transBatchB": 1, "transB": 1, "alpha": 0.5}),  # broadcast
])
def test_fused_matmul(a, b, attrs, dtype):
    check_case("FusedMatMul", fused_matmul, [a, b], attrs, dtype=dtype, kw=attrs)


def test_fused_matmul_trans_batch_needs_equal_ranks():
    g = _graph("FusedMatMul", MS, [("a", np.ones((3, 2, 4), F32)), ("b", np.ones((4, 5), F32))], {"transBatchA": 1},
               ["y"])
    lg, _ = with_loss(g, {"y": np.ones((2, 3, 5), F32)})
    with pytest.raises(rg.GraphError, match="transBatchA/transBatchB need operands of one rank"):
        rg.gradient(lg, loss="loss", wrt=["a"])


# ---------------------------------------------------------------------------------------------- facts, forward mode,
# second order


def test_contrib_rules_state_their_facts():
    contrib = {k: f for k, f in registry.DOMAIN_FACTS.items() if k[0] == MS}
    assert {op for _, op in contrib} >= {"SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "Gelu",
                                         "BiasGelu", "FastGelu", "QuickGelu", "BiasAdd", "FusedMatMul"}
    assert {k: f.undeclared() for k, f in contrib.items() if f.undeclared()} == {}
    assert set(registry.DOMAIN_FACTS) <= set(registry.DOMAIN_RULES)
    assert registry.FACTS["SimplifiedLayerNormalization"].undeclared() == []


@pytest.mark.parametrize(("op", "fn", "inputs", "attrs", "outputs", "domain", "dtype"), [
    ("SkipLayerNormalization", skip_layer_norm, [(B, S, H), (S, H), (H,), (H,), (H,)], {}, ALL4, MS, F32),
    ("SimplifiedLayerNormalization", simplified_layer_norm, [(B, S, H), (H,)], {}, ("y", "inv"), "", F64),
    ("FusedMatMul", fused_matmul, [(3, B, H), (B, 5, H)], {"transBatchA": 1, "transB": 1}, ("y",), MS, F64),
    ("FastGelu", fast_gelu, [(B, S, H), (H,)], {}, ("y",), MS, F64),
])
def test_forward_mode(op, fn, inputs, attrs, outputs, domain, dtype):
    """``rg.jvp`` (the transposed VJP) against ``torch.func.jvp`` of the same math."""
    rng = np.random.default_rng(3)
    ins = [(f"in{k}", rng.standard_normal(s).astype(dtype)) for k, s in enumerate(inputs)]
    g = _graph(op, domain, ins, attrs, list(outputs))
    tangents = {n: rng.standard_normal(a.shape).astype(dtype) for n, a in ins}
    jg = rg.jvp(g, [o for o in outputs if o], [n for n, _ in ins])
    assert outside_onnx(jg) == outside_onnx(g)
    got = rg.Session(jg).run({**dict(ins), **{f"{n}_tangent": t for n, t in tangents.items()}})
    kw = {"eps": 1e-12} if op == "SkipLayerNormalization" else attrs if op == "FusedMatMul" else {}
    _, want = torch.func.jvp(lambda *xs: fn(*xs, **kw), tuple(torch.tensor(a.astype(F64)) for _, a in ins),
                             tuple(torch.tensor(tangents[n].astype(F64)) for n, _ in ins))
    want = want if isinstance(want, tuple) else (want,)
    for o, w in zip(outputs, want, strict=False):
        if o:
            w = w.numpy()
            tol = 1e-10 if got[f"{o}_tangent"].dtype == F64 else 3e-5  # (inv_std_var is float32 for float64 X)
            np.testing.assert_allclose(got[f"{o}_tangent"], w, rtol=tol, atol=tol * max(1.0, float(np.abs(w).max())))


@pytest.mark.parametrize(("op", "fn", "inputs", "attrs", "outputs", "domain"), [
    ("SimplifiedLayerNormalization", simplified_layer_norm, [(B, S, H), (H,)], {}, ("y", "inv"), ""),
    ("FusedMatMul", fused_matmul, [(B, H, S), (H, 5)], {"transA": 1, "alpha": 0.5}, ("y",), MS),
    ("QuickGelu", quick_gelu, [(B, S, H)], {}, ("y",), MS),
])
def test_second_order(op, fn, inputs, attrs, outputs, domain):
    """A Hessian-vector product through the gradient graph (which holds the fused forward node and the rules'
    standard backward) against PyTorch's double backward, float64."""
    rng = np.random.default_rng(4)
    ins = [(f"in{k}", rng.standard_normal(s)) for k, s in enumerate(inputs)]
    g = _graph(op, domain, ins, attrs, list(outputs))
    feeds = dict(ins)
    fwd = rg.Session(g).run(feeds)
    used = [o for o in outputs if o]
    lg = contrib_loss(g, fwd, used)
    us = {f"{y}_u": rng.standard_normal(fwd[y].shape).astype(fwd[y].dtype) for y in used}
    gg = rg.gradient(lg, loss="loss", wrt=list(feeds))
    vs = {f"{n}_v": rng.standard_normal(a.shape) for n, a in ins}
    hv = double_backward(gg, list(feeds), feeds)
    got = rg.Session(hv).run({**feeds, **us, **vs})
    kw = attrs if op == "FusedMatMul" else {}
    tin = [torch.tensor(a, requires_grad=True) for _, a in ins]
    touts = fn(*tin, **kw)
    touts = touts if isinstance(touts, tuple) else (touts,)
    total = sum((t * torch.tensor(us[f"{y}_u"].astype(F64))).sum() for y, t in zip(outputs, touts, strict=False) if y)
    grads = torch.autograd.grad(total, tin, create_graph=True)
    s = sum((gr * torch.tensor(vs[f"{n}_v"])).sum() for (n, _), gr in zip(ins, grads, strict=True))
    want = torch.autograd.grad(s, tin)
    for name, w in zip(hv.output_names[-len(ins):], want, strict=True):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------------------------------------- optimized models


def _block(path) -> None:
    """A transformer-like block in standard operators (opset 17) whose patterns onnxruntime's transformer
    optimizer fuses: RMSNorm -> SimplifiedLayerNormalization; Add + LayerNormalization -> SkipLayerNormalization;
    MatMul + Add + erf GELU -> BiasGelu; MatMul + Add + tanh GELU -> FastGelu; Add + RMSNorm ->
    SkipSimplifiedLayerNormalization; x sigmoid(1.702 x) -> QuickGelu; and, by onnxruntime's graph optimizer,
    MatMul(y, Transpose(y)) * 0.5 -> FusedMatMul(transB=1, alpha=0.5)."""
    from onnx import TensorProto
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(5)
    n = oh.make_node

    def w(name, *shape):
        return nh.from_array((rng.standard_normal(shape) * 0.5).astype(F32), name)

    def c(name, v):
        return nh.from_array(np.array(v, F32), name)

    inits = [w("rms0_w", H), w("ln_w", H), w("ln_b", H), w("W1", H, 16), w("b1", 16), w("W2", 16, H), w("b2", H),
             w("rms_w", H), w("W3", H, H), w("b3", H), c("sqrt2", np.sqrt(2)), c("one", 1.0), c("half", 0.5),
             c("k", np.sqrt(2 / np.pi)), c("c3", 0.044715), c("three", 3.0), c("two", 2.0), c("eps", 1e-6),
             c("qa", 1.702)]

    def rms(x, weight, out, tag):
        return [n("Pow", [x, "two"], [f"{tag}1"]), n("ReduceMean", [f"{tag}1"], [f"{tag}2"], axes=[-1], keepdims=1),
                n("Add", [f"{tag}2", "eps"], [f"{tag}3"]), n("Sqrt", [f"{tag}3"], [f"{tag}4"]),
                n("Div", [x, f"{tag}4"], [f"{tag}5"]), n("Mul", [weight, f"{tag}5"], [out])]

    nodes = [
        *rms("x", "rms0_w", "x0", "p"),
        n("Add", ["x0", "skip"], ["s1"]), n("LayerNormalization", ["s1", "ln_w", "ln_b"], ["ln1"], epsilon=1e-5),
        n("MatMul", ["ln1", "W1"], ["m1"]), n("Add", ["m1", "b1"], ["a1"]),
        n("Div", ["a1", "sqrt2"], ["g1"]), n("Erf", ["g1"], ["g2"]), n("Add", ["g2", "one"], ["g3"]),
        n("Mul", ["a1", "g3"], ["g4"]), n("Mul", ["g4", "half"], ["gelu1"]),
        n("MatMul", ["gelu1", "W2"], ["m2"]), n("Add", ["m2", "b2"], ["a2"]),
        n("Pow", ["a2", "three"], ["t1"]), n("Mul", ["t1", "c3"], ["t2"]), n("Add", ["a2", "t2"], ["t3"]),
        n("Mul", ["t3", "k"], ["t4"]), n("Tanh", ["t4"], ["t5"]), n("Add", ["t5", "one"], ["t6"]),
        n("Mul", ["a2", "half"], ["t7"]), n("Mul", ["t7", "t6"], ["gelu2"]),
        n("Add", ["gelu2", "ln1"], ["s2"]), *rms("s2", "rms_w", "rms", "r"),
        n("MatMul", ["rms", "W3"], ["m3"]), n("Add", ["m3", "b3"], ["a3"]),
        n("Mul", ["a3", "qa"], ["q1"]), n("Sigmoid", ["q1"], ["q2"]), n("Mul", ["a3", "q2"], ["y0"]),
        n("Transpose", ["y0"], ["yt"], perm=[0, 2, 1]), n("MatMul", ["y0", "yt"], ["yy"]),
        n("Mul", ["yy", "half"], ["y"]),
    ]
    io = [oh.make_tensor_value_info(v, TensorProto.FLOAT, ["b", 4, H]) for v in ("x", "skip")]
    graph = oh.make_graph(nodes, "block", io, [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4, 4])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _gradients(path, feeds: dict[str, np.ndarray], wrt: list[str]) -> dict[str, np.ndarray]:
    """revgraph's gradients of ``sum_y sum(y * u_y)`` over the model's outputs (``u`` from a fixed seed), run on
    onnxruntime; the gradient graph holds no operator outside ONNX's standard set but the model's own."""
    g = rg.load(path)
    fwd = rg.Session(g).run(feeds)
    lg = contrib_loss(g, fwd, g.output_names)
    rng = np.random.default_rng(6)
    us = {f"{y}_u": rng.standard_normal(fwd[y].shape).astype(fwd[y].dtype) for y in g.output_names}
    gg = rg.gradient(lg, loss="loss", wrt=wrt)
    assert set(outside_onnx(gg)) == set(outside_onnx(g))
    out = rg.Session(gg).run({**feeds, **us})
    return {w: out[f"{w}_grad"] for w in wrt}


def _assert_same_gradients(plain: dict, fused: dict) -> None:
    for w, a in plain.items():  # float32 on both sides: 1e-5 of the gradient's scale, and a floor of 1e-8 for
        # the gradients that are 0 in exact arithmetic (a key bias: softmax ignores a shift), float32 noise here
        np.testing.assert_allclose(fused[w], a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()) + 1e-8, err_msg=w)


def test_optimized_block_has_the_gradients_of_the_unoptimized_one(tmp_path):
    import onnxruntime as ort
    from onnxruntime.transformers import optimizer
    plain, fused, final = tmp_path / "block.onnx", tmp_path / "fused.onnx", tmp_path / "final.onnx"
    _block(plain)
    optimizer.optimize_model(str(plain), model_type="bert", num_heads=0, hidden_size=0,
                             opt_level=0).save_model_to_file(str(fused))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(final)
    ort.InferenceSession(str(fused), so, providers=["CPUExecutionProvider"])
    model = onnx.load(str(final))
    assert {(nd.domain, nd.op_type) for nd in model.graph.node if nd.domain or not onnx.defs.has(nd.op_type)} == {
        ("", "SimplifiedLayerNormalization"), (MS, "SkipLayerNormalization"), (MS, "BiasGelu"), (MS, "FastGelu"),
        (MS, "SkipSimplifiedLayerNormalization"), (MS, "QuickGelu"), (MS, "FusedMatMul")}
    rng = np.random.default_rng(7)
    feeds = {k: rng.standard_normal((2, 4, H)).astype(F32) for k in ("x", "skip")}
    wrt = ["x", "skip", *sorted(i.name for i in model.graph.initializer if i.name[0] in "Wblr" and len(i.dims))]
    assert len(wrt) == 12
    _assert_same_gradients(_gradients(plain, feeds, wrt), _gradients(final, feeds, wrt))


@pytest.mark.parametrize("name", ["bert", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_optimized_transformer_has_the_gradients_of_the_export(name, tmp_path):
    """A tiny BERT (SkipLayerNormalization, BiasGelu) or GPT-2 (SkipLayerNormalization, FastGelu) exported by
    the TorchScript exporter at opset 17, then fused by onnxruntime's transformer optimizer with its attention
    and embedding fusions off (their operators are not covered yet): the gradients of every parameter equal
    the unfused export's."""
    from kit import torch_models as tm
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    plain, fused = tmp_path / "plain.onnx", tmp_path / "fused.onnx"
    tm.export(tm.build(name), "torchscript-folded", plain)
    options = FusionOptions(name)
    options.enable_attention = False
    options.enable_embed_layer_norm = False
    optimizer.optimize_model(str(plain), model_type=name, num_heads=4, hidden_size=32,
                             optimization_options=options).save_model_to_file(str(fused))
    ops = {(nd.domain, nd.op_type) for nd in onnx.load(str(fused)).graph.node if nd.domain}
    assert ops == {(MS, "SkipLayerNormalization"), (MS, "BiasGelu" if name == "bert" else "FastGelu")}
    params = [i.name for i in onnx.load(str(plain)).graph.initializer if i.data_type == onnx.TensorProto.FLOAT
              and len(i.dims)]
    assert len(params) >= 15
    feeds = {"input_ids": tm.tokens(2)}
    _assert_same_gradients(_gradients(plain, feeds, params), _gradients(fused, feeds, params))


def test_the_cli_writes_files_with_onnxruntimes_default_domain_operators(tmp_path):
    """The genai builder's and the transformer optimizer's files hold SimplifiedLayerNormalization in the default
    domain, which ONNX's checker has no schema for: `revgraph grad` refused them as not valid ONNX and `revgraph
    lora apply` exited 3. The written files keep the node as it was and onnxruntime runs them; the gradient is
    the API's."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(F32)
    nodes = [Node("SimplifiedLayerNormalization", ["x", "g"], ["n"], {"axis": -1, "epsilon": 1e-5}, "sln"),
             Node("MatMul", ["n", "W"], ["y"], name="mm")]
    g = Graph(nodes, [ValueInfo("x", F32, ("B", 8))], [ValueInfo("y", F32, ("B", 4))],
              {"g": np.ones(8, F32), "W": w}, opsets={"": 17})
    rg.save(g, tmp_path / "m.onnx")

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "revgraph", *args], capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stderr
    cli("grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx"))
    written = onnx.load(tmp_path / "g.onnx")
    assert [n.domain for n in written.graph.node if n.op_type == "SimplifiedLayerNormalization"] == [""]
    x = rng.standard_normal((3, 8)).astype(F32)
    ours = rg.Session(rg.gradient(rg.load(tmp_path / "m.onnx"), "y", ["x", "W"])).run({"x": x})
    import onnxruntime as ort

    run = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in run.get_outputs()], run.run(None, {"x": x}), strict=True))
    np.testing.assert_allclose(got["W_grad"], ours["W_grad"], rtol=1e-6)
    from revgraph.train import lora

    rg.save(lora.add_adapters(rg.load(tmp_path / "m.onnx"), 2), tmp_path / "a.onnx")
    cli("lora", "extract", str(tmp_path / "a.onnx"), "-o", str(tmp_path / "ad.npz"))
    cli("lora", "apply", str(tmp_path / "m.onnx"), str(tmp_path / "ad.npz"), "-o", str(tmp_path / "merged.onnx"),
        "--merge")
    assert onnx.load(tmp_path / "merged.onnx").graph.node[0].domain == ""
