"""`revgraph check` without false alarms: where revgraph's gradient is right (PyTorch in float64 agrees), the
check must agree too; values it cannot check are said so, never a crash (issue 13, section 3).

The kinds: float64 kernels that are float32-precise (onnx.reference's Erf and Gelu, onnxruntime's Shrink and
GroupNormalization statistics) and reference kernels off the spec (GatherElements, OneHot, Resize
align_corners); float64 graphs onnxruntime refuses (Celu, LayerNormalization statistics, float32 constants);
random values drawn anew per run (Dropout masks, random operators); inputs that set a shape or sit on a kink;
ranks lost in the promotion (declared types, keepdims=1 reductions over computed axes).
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import revgraph as rg
from revgraph.autodiff import registry
from revgraph.autodiff.context import ForwardPatch, PatchedVJP
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo, fastshape
from revgraph.onnx_io.value_types import infer_types
from revgraph.tools.check import _ORT_FLOAT32_PRECISE, to_float64

F32 = np.float32


def one(op: str, inputs: dict[str, tuple], attrs: dict | None = None, outputs=("y",), inits=None) -> Graph:
    """One node; ``inputs`` maps names to (dtype, shape) graph inputs, ``inits`` to initializer arrays."""
    inits = inits or {}
    names = [*inputs, *inits] if not attrs or "_order" not in attrs else attrs.pop("_order")
    return Graph([Node(op, list(names), list(outputs), dict(attrs or {}), "op")],
                 [ValueInfo(k, *v) for k, v in inputs.items()], [ValueInfo(o, F32) for o in outputs], dict(inits))


def quiet_check(g: Graph, *args, **kwargs) -> rg.GradientReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no path" warnings for inputs a rule does not differentiate
        return rg.check_gradients(g, *args, **kwargs)


def statuses(rep: rg.GradientReport) -> dict[str, str]:
    return {r.name: r.status for r in rep.rows}


def run_float64(g: Graph, feeds: dict, backend: str) -> np.ndarray:
    return rg.Session(to_float64(g), backend=backend).run({k: np.asarray(v, np.float64) for k, v in feeds.items()})["y"]


# ------------------------------------------------------------------------------- float64 kernels (item 1, 3)

def f32(v: float) -> float:
    """An ONNX float attribute as runtimes see it (attributes are float32)."""
    return float(np.float32(v))


SELU_ALPHA, SELU_GAMMA = f32(1.67326319217681884765625), f32(1.05070102214813232421875)  # the schema's defaults
#: unary operators with their PyTorch float64 reference (with the float32 values of their attributes)
UNARY = {
    "Erf": ({}, torch.erf),
    "Gelu": ({}, lambda t: torch.nn.functional.gelu(t)),
    "Gelu/tanh": ({"approximate": "tanh"}, lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
    "Acos": ({}, torch.acos), "Asin": ({}, torch.asin), "Atan": ({}, torch.atan), "Tan": ({}, torch.tan),
    "Acosh": ({}, lambda t: torch.acosh(1.5 + t.abs())), "Asinh": ({}, torch.asinh), "Atanh": ({}, torch.atanh),
    "Cosh": ({}, torch.cosh), "Sinh": ({}, torch.sinh), "Softsign": ({}, torch.nn.functional.softsign),
    "Elu": ({"alpha": 0.5}, lambda t: torch.nn.functional.elu(t, 0.5)),
    "Celu": ({"alpha": 1.5}, lambda t: torch.nn.functional.celu(t, 1.5)),
    "Selu": ({}, lambda t: SELU_GAMMA * torch.where(t > 0, t, SELU_ALPHA * torch.expm1(t))),
    "Softplus": ({}, torch.nn.functional.softplus), "Mish": ({}, torch.nn.functional.mish),
    "HardSwish": ({}, lambda t: t * torch.clamp(f32(1 / 6) * t + 0.5, 0, 1)),
    "HardSigmoid": ({"alpha": 0.25, "beta": 0.5}, lambda t: torch.clamp(0.25 * t + 0.5, 0, 1)),
    "Shrink": ({"lambd": 0.5, "bias": 0.1},
               lambda t: torch.where(t < -0.5, t + f32(0.1), torch.where(t > 0.5, t - f32(0.1), 0))),
    "LeakyRelu": ({"alpha": 0.3}, lambda t: torch.nn.functional.leaky_relu(t, f32(0.3))),
}


@pytest.mark.parametrize("name", UNARY)
def test_float64_kernels_are_exact_or_avoided(name):
    """The whole kind of items 1 and 3. The reference evaluator's float64 kernels are exact (<= 1e-13 relative
    to PyTorch in float64). onnxruntime's float64 kernels give difference quotients (step 1e-6, the check's)
    within 1e-7 of PyTorch's, or are in _ORT_FLOAT32_PRECISE so that the check runs them on the reference
    evaluator (a float32-precise kernel is ~1e-7 / 1e-6 = 10% off; a float32 constant, as in onnxruntime's
    Gelu(tanh), is a smooth 3e-8 deviation and harmless). Inputs are off the float32 grid."""
    op = name.split("/")[0]
    attrs, fn = UNARY[name]
    x = np.random.default_rng(0).uniform(-0.99, 0.99, (4, 64)) * (1 + 1e-9)
    t = torch.tensor(x)
    if op == "Acosh":
        x = 1.5 + np.abs(x)
    g = one(op, {"x": (F32, x.shape)}, attrs)
    expected, h = fn(t).numpy(), 1e-6
    slope = (fn(t + h).numpy() - expected) / h
    scale = np.maximum(np.abs(expected), 1e-3)
    assert np.max(np.abs(run_float64(g, {"x": x}, "reference") - expected) / scale) < 1e-13
    try:
        at, moved = run_float64(g, {"x": x}, "onnxruntime"), run_float64(g, {"x": x + h}, "onnxruntime")
    except rg.RevgraphError:  # no float64 kernel or a float-only schema: the check uses the reference evaluator
        return
    error = np.max(np.abs((moved - at) / h - slope) / np.maximum(np.abs(slope), 1))
    assert error < 1e-7 or op in _ORT_FLOAT32_PRECISE, f"onnxruntime's float64 {op}: quotients off by {error:.2g}"


def test_erf_and_gelu_exact_on_the_reference_backend():
    """Item 1: onnx.reference's Erf rounds through float32 (~3e-8 off); revgraph's kernel is math.erf."""
    x = np.array([-3.0, -0.7, 1e-9, 0.3, 1.0 + 1e-12, 2.5])
    erf = rg.Session(to_float64(one("Erf", {"x": (F32, (6,))})), backend="reference").run({"x": x})["y"]
    np.testing.assert_array_equal(erf, [math.erf(v) for v in x])
    gelu = rg.Session(to_float64(one("Gelu", {"x": (F32, (6,))})), backend="reference").run({"x": x})["y"]
    np.testing.assert_allclose(gelu, [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x], rtol=1e-15, atol=0)


def test_check_agrees_on_a_conv_gelu_net_whose_gradient_equals_torch():
    """Item 1: a Conv -> Gelu net runs on the reference evaluator (no float64 Conv in onnxruntime); with
    float32-precise Erf its check reported ~10% errors. revgraph's gradient equals PyTorch's in float64."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 2, 3, 3)).astype(F32)
    g = Graph([Node("Conv", ["x", "w"], ["c"], {"pads": [1, 1, 1, 1]}, "conv"),
               Node("Gelu", ["c"], ["y"], name="gelu")],
              [ValueInfo("x", F32, (1, 2, 5, 5))], [ValueInfo("y", F32, (1, 3, 5, 5))], {"w": w})
    rep = quiet_check(g)
    assert rep.ok and set(statuses(rep).values()) == {"agree"}, rep
    assert rep.backend == "reference" and "Conv" in rep.notes[0]
    x = rng.standard_normal((1, 2, 5, 5))
    u = rng.standard_normal((1, 3, 5, 5))
    gg = rg.gradient(to_float64(g), "y", ["x", "w"], seed="input")
    out = rg.Session(gg, backend="reference").run({"x": x, "y_grad": u})
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w.astype(np.float64), requires_grad=True)
    (torch.nn.functional.gelu(torch.nn.functional.conv2d(tx, tw, padding=1)) * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(out["x_grad"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["w_grad"], tw.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_check_agrees_on_group_norm_and_shrink():
    """Item 3: onnxruntime's float64 GroupNormalization keeps float32 statistics (stash_type 1, promoted to
    11 now) and its float64 Shrink computes in float32 (run on the reference evaluator now)."""
    gn = one("GroupNormalization", {"x": (F32, (2, 4, 3)), "s": (F32, (4,)), "b": (F32, (4,))}, {"num_groups": 2})
    assert to_float64(gn).nodes[0].attrs["stash_type"] == 11
    rep = quiet_check(gn)
    assert rep.ok and rep.backend == "onnxruntime" and set(statuses(rep).values()) == {"agree"}, rep
    rep = quiet_check(one("Shrink", {"x": (F32, (3, 4))}, {"lambd": 0.5, "bias": 0.2}))
    assert rep.ok and statuses(rep) == {"x": "agree"} and "Shrink computes in float32" in rep.notes[0], rep


# ------------------------------------------------------------------------------- promotion (item 2, 6)


def test_check_runs_celu_and_layer_norm_statistics():
    """Item 2: Celu's schema is float-only and LayerNormalization's Mean/InvStdDev are float32 or bfloat16
    only, so onnxruntime refused the promoted graphs; they run on the reference evaluator, and unused
    statistics outputs are dropped so that onnxruntime runs the rest."""
    rep = quiet_check(one("Celu", {"x": (F32, (3, 4))}, {"alpha": 1.5}))
    assert rep.ok and rep.backend == "reference" and "Celu" in rep.notes[0], rep
    ins = {"x": (F32, (3, 4)), "s": (F32, (4,)), "b": (F32, (4,))}
    ln = one("LayerNormalization", ins, {"axis": -1}, outputs=("y", "mean", "inv"))
    for loss in ("y", "mean", "inv"):
        rep = quiet_check(ln, loss)
        assert rep.ok and statuses(rep)["x"] == "agree" and "LayerNormalization" in rep.notes[0], (loss, rep)
    only_y = one("LayerNormalization", ins, {"axis": -1}, outputs=("y", "mean", "inv"))
    only_y.outputs = only_y.outputs[:1]
    assert to_float64(only_y).nodes[0].outputs == ["y"]
    rep = quiet_check(only_y)
    assert rep.ok and rep.backend == "onnxruntime", rep


def test_check_runs_conv_and_layer_norm_with_stash_type_spelled_out():
    """Issue 27: the dynamo exporter writes LayerNormalization's stash_type=1; the float64 copy made it 11, which
    onnx's reference evaluator (needed for the float64 Conv) refuses. It stays 1, and the statistics are float64
    anyway (both runtimes; the check agrees, and the gradient equals PyTorch's in float64)."""
    rng = np.random.default_rng(3)
    w, s, b = rng.standard_normal((2, 2, 1, 1)).astype(F32), rng.standard_normal(3).astype(F32), rng.standard_normal(3)
    # (float32 parameters: the float64 copy promotes them exactly)
    g = Graph([Node("Conv", ["x", "w"], ["c"], name="conv"),
               Node("LayerNormalization", ["c", "s", "b"], ["y"], {"axis": -1, "stash_type": 1}, "ln")],
              [ValueInfo("x", F32, (1, 2, 2, 3))], [ValueInfo("y", F32, (1, 2, 2, 3))],
              {"w": w, "s": s, "b": b.astype(F32)})
    assert to_float64(g).nodes[1].attrs["stash_type"] == 1
    rep = quiet_check(g)
    assert rep.ok and rep.backend == "reference" and set(statuses(rep).values()) == {"agree"}, rep
    x, u = rng.standard_normal((1, 2, 2, 3)), rng.standard_normal((1, 2, 2, 3))
    gg = rg.gradient(to_float64(g), "y", ["x"], seed="input")
    out = rg.Session(gg, backend="reference").run({"x": x, "y_grad": u})
    tx = torch.tensor(x, requires_grad=True)
    c = torch.nn.functional.conv2d(tx, torch.tensor(w.astype(np.float64)))
    scale, bias = torch.tensor(s.astype(np.float64)), torch.tensor(b.astype(F32).astype(np.float64))
    y = torch.nn.functional.layer_norm(c, (3,), scale, bias)
    (y * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(out["x_grad"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rank", [3, 4])
def test_float64_attention_agrees_on_both_runtimes(rank):
    """Issue 27: with the default scale of a head size whose 1/sqrt is not exact in float32 (5), onnxruntime
    applies float32(sqrt(float32(1/sqrt(5)))) to Q and K, as the spec's function body does, and onnx's reference
    kernel the float64 value: the forwards, and so the gradients, differed by 1e-7. revgraph's reference kernel
    computes it as the spec does; both runtimes agree to 1e-12, and with PyTorch's float64 SDPA at that scale."""
    rng = np.random.default_rng(5)
    hq, d = 2, 5
    shape = (1, 3, hq * d) if rank == 3 else (1, hq, 3, d)
    feeds = {n: rng.standard_normal(shape) for n in "qkv"}
    attrs = {"q_num_heads": hq, "kv_num_heads": hq} if rank == 3 else {}
    g = Graph([Node("Attention", ["q", "k", "v"], ["y"], attrs, "att")],
              [ValueInfo(n, np.float64, shape) for n in "qkv"], [ValueInfo("y", np.float64, shape)], opsets={"": 23})
    gg = rg.gradient(g, "y", list("qkv"), seed="input")
    u = rng.standard_normal(shape)
    ort_out, ref_out = (rg.Session(gg, backend=b).run({**feeds, "y_grad": u}) for b in ("onnxruntime", "reference"))
    for k in ort_out:
        np.testing.assert_allclose(ref_out[k], ort_out[k], rtol=1e-12, atol=1e-14, err_msg=k)
    root = float(np.float32(np.sqrt(np.float32(1.0) / np.sqrt(np.float32(d)))))
    t = {n: torch.tensor(feeds[n], requires_grad=True) for n in "qkv"}
    heads = [x.reshape(1, 3, hq, d).transpose(1, 2) if rank == 3 else x for x in t.values()]
    y = torch.nn.functional.scaled_dot_product_attention(*heads, scale=root * root)
    y = y.transpose(1, 2).reshape(shape) if rank == 3 else y
    (y * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(ort_out["y"], y.detach().numpy(), rtol=1e-12, atol=1e-14)
    for n in "qkv":
        np.testing.assert_allclose(ort_out[f"{n}_grad"], t[n].grad.numpy(), rtol=1e-10, atol=1e-13, err_msg=n)


def test_float32_constants_and_bfloat16_inputs_are_promoted():
    """Float32 by construction: Constant value_float, ConstantOfShape without a value, RandomNormal without a
    dtype; bfloat16 inputs (numpy kind 'V') were left as they were. Each made a graph onnxruntime refuses."""
    g = Graph([Node("Constant", [], ["c"], {"value_float": 2.5}, "c"), Node("Mul", ["x", "c"], ["y"], name="mul")],
              [ValueInfo("x", F32, (3,))], [ValueInfo("y", F32, (3,))])
    assert quiet_check(g).ok
    g = Graph([Node("ConstantOfShape", ["shape"], ["z"], name="zeros"), Node("Add", ["x", "z"], ["y"], name="add")],
              [ValueInfo("x", F32, (3,))], [ValueInfo("y", F32, (3,))], {"shape": np.array([3])})
    assert quiet_check(g).ok
    bf = Graph([Node("Mul", ["x", "x"], ["y"], name="mul")], [ValueInfo("x", ml_dtypes.bfloat16, (3,))],
               [ValueInfo("y", ml_dtypes.bfloat16, (3,))])
    assert to_float64(bf).inputs[0].dtype == np.float64
    assert quiet_check(bf, inputs={"x": np.array([1, 2, 3], ml_dtypes.bfloat16)}).ok


def rms_norm_model(declare: bool, keepdims: int = 1) -> onnx.ModelProto:
    """LLaMA's RMSNorm as PyTorch's exporter writes ``mean(-1, keepdim=True)``: ReduceMean over axes
    ``Reshape(Constant(-1), [1])``, on a [batch, seq, 8] input, then a MatMul (whose VJP needs ranks). With
    ``keepdims=0`` an Unsqueeze (over constant axes) puts the reduced axis back."""
    const = [("m1", np.array(-1, np.int64)), ("one", np.array([1], np.int64)), ("last", np.array([-1], np.int64))]
    nodes = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v)) for k, v in const] + [
        helper.make_node("Reshape", ["m1", "one"], ["axes"]),
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=keepdims),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        *([] if keepdims else [helper.make_node("Unsqueeze", ["rms", "last"], ["rms_k"])]),
        helper.make_node("Div", ["x", "rms" if keepdims else "rms_k"], ["xn"]),
        helper.make_node("Mul", ["xn", "w"], ["h"]),
        helper.make_node("MatMul", ["h", "W"], ["y"]),
    ]
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        nodes, "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array(1e-6, F32), "eps"),
                     numpy_helper.from_array(rng.standard_normal(8).astype(F32), "w"),
                     numpy_helper.from_array(rng.standard_normal((8, 4)).astype(F32), "W")])
    if declare:  # as the exporter declares them: every intermediate value with its rank
        stat = ["batch", "seq", 1] if keepdims else ["batch", "seq"]
        dims = {"sq": ["batch", "seq", 8], "ms": stat, "mse": stat, "rms": stat, "xn": ["batch", "seq", 8],
                "h": ["batch", "seq", 8], **({} if keepdims else {"rms_k": ["batch", "seq", 1]})}
        graph.value_info.extend(helper.make_tensor_value_info(k, TensorProto.FLOAT, d) for k, d in dims.items())
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("declare", [True, False])
def test_llama_rms_norm_with_computed_axes_is_checked(declare):
    """Item 6: check dropped value_info and lost the rank of ReduceMean(keepdims=1) over computed axes, then
    refused the MatMul ("the rank of 'h' is unknown"). With keepdims=1 the rank is the input's, whatever the
    axes; declared types survive the promotion."""
    g = rg.load(rms_norm_model(declare))
    assert infer_types(g)["ms"].shape is not None and len(infer_types(g)["ms"].shape) == 3
    rg.gradient(g, "y")
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 3, 8)).astype(F32)}
    rep = quiet_check(g, inputs=feeds)
    assert rep.ok and set(statuses(rep).values()) == {"agree"}, rep
    if declare:
        promoted = to_float64(g)
        assert promoted.value_info["h"].dtype == np.float64 and len(promoted.value_info["h"].shape) == 3


def test_declared_types_survive_the_promotion():
    """Only the declared types know the ranks here (ReduceMean keepdims=0 over computed axes, then
    Unsqueeze and MatMul): grad accepted the model and check refused it."""
    g = rg.load(rms_norm_model(True, keepdims=0))
    rg.gradient(g, "y")
    rep = quiet_check(g, inputs={"x": np.random.default_rng(3).standard_normal((2, 3, 8)).astype(F32)})
    assert rep.ok and set(statuses(rep).values()) == {"agree"}, rep


@pytest.mark.parametrize("op", fastshape.KEEPDIMS)
def test_keepdims_rank_matches_onnxruntime(op):
    """The kind of item 6: every keepdims=1 reduction over axes revgraph cannot see keeps the input's rank,
    with 1 where the input has 1 (onnxruntime's output shapes as the reference)."""
    rng = np.random.default_rng(4)
    x = rng.uniform(0.5, 2, (2, 1, 3, 4)).astype(F32)
    for axes in ([-1], [0, 2], [1]):
        arg = op in ("ArgMax", "ArgMin")
        attrs = {"keepdims": 1, **({"axis": axes[0]} if arg else {})}
        node = Node(op, ["x"] if arg else ["x", "axes"], ["y"], attrs, "op")
        types = {"x": ValueInfo("x", F32, ("b", 1, None, 4)), "axes": ValueInfo("axes", np.int64, (len(axes),))}
        vi = fastshape.keepdims_type(node, types)
        g = Graph([node], [ValueInfo("x", F32, x.shape)], [ValueInfo("y", np.int64 if arg else F32, None)],
                  {} if arg else {"axes": np.array(axes)})
        actual = rg.Session(g).run({"x": x})["y"]
        assert len(vi.shape) == actual.ndim and vi.shape[1] == actual.shape[1] == 1 and vi.dtype == actual.dtype


# ------------------------------------------------------------------------------- randomness (item 4)


def training_dropout() -> Graph:
    inits = {"r": np.array(0.3, F32), "t": np.array(True)}
    return one("Dropout", {"x": (F32, (4, 5))}, {"_order": ["x", "r", "t"]}, inits=inits)


def test_dropout_masks_are_replayed():
    """Item 4: Dropout in training mode drew a new mask per run, so central differences compared different
    functions (relative errors ~1). The check replays the gradient run's mask."""
    g = training_dropout()
    rep = quiet_check(g, wrt=["x"])
    assert statuses(rep) == {"x": "agree"} and "replayed" in rep.notes[0], rep


def test_the_replayed_dropout_still_catches_a_wrong_rule(monkeypatch):
    """The replay is the ONNX spec's formula, not revgraph's rule: a Dropout VJP without the 1 / (1 - ratio)
    scale is caught."""
    g = training_dropout()
    original = registry.RULES["Dropout"]

    def unscaled(ctx, node, cts):
        patch = ForwardPatch()
        mask = original.__globals__["_mask"](ctx.e, node, patch)
        return PatchedVJP([ctx.select(mask, cts[0], like=node.inputs[0]), None, None], {}, patch)

    monkeypatch.setitem(registry.RULES, "Dropout", unscaled)
    assert statuses(quiet_check(g, wrt=["x"])) == {"x": "mismatch"}


def test_dropout_ratio_at_zero_is_checked_inside_its_domain(monkeypatch):
    """Item 5: a ratio of 0 was moved below 0, where onnxruntime's Dropout fails (exit 3). With the replayed
    formula the function x * mask / (1 - r) is smooth at 0. The ratio rule here is written from that formula
    (d/dr = x * mask / (1 - r)^2), independently of revgraph's rule."""
    original = registry.RULES["Dropout"]

    def with_ratio(ctx, node, cts):
        result = original(ctx, node, cts)
        e, (x, ratio), g = ctx.e, node.inputs[:2], cts[0]

        def dratio():
            mask = e.op("Cast", [original.__globals__["_mask"](e, node, result.patch)], to=11)
            one_minus = e.op("Sub", [e.scalar(1.0, x), ratio])
            return e.op("ReduceSum", [e.op("Div", [e.op("Mul", [e.op("Mul", [g, x]), mask]),
                                                   e.op("Mul", [one_minus, one_minus])])], keepdims=0)

        return PatchedVJP([result.inputs[0], dratio, *result.inputs[2:]], result.captured, result.patch)

    monkeypatch.setitem(registry.RULES, "Dropout", with_ratio)
    g = one("Dropout", {"x": (F32, (4, 5)), "r": (F32, ())}, {"_order": ["x", "r", "t"]}, inits={"t": np.array(True)})
    x = np.random.default_rng(5).standard_normal((4, 5)).astype(F32)
    for r in (0.0, 0.4):
        rep = quiet_check(g, inputs={"x": x, "r": np.array(r, F32)})
        assert statuses(rep) == {"x": "agree", "r": "agree"}, (r, rep)


def test_random_operators_are_replayed():
    g = Graph([Node("RandomNormal", [], ["n"], {"shape": [3, 4]}, "noise"), Node("Mul", ["x", "n"], ["y"], name="mul")],
              [ValueInfo("x", F32, (3, 4))], [ValueInfo("y", F32, (3, 4))])
    rep = quiet_check(g)
    assert statuses(rep) == {"x": "agree"} and "replayed" in rep.notes[0], rep


# ------------------------------------------------------------------------------- not checkable (item 5)


def test_an_input_that_sets_the_shape_is_not_checked(tmp_path, capsys):
    """Item 5: OneHot's depth (10 -> 10.000001 made 11 classes on the reference evaluator, 9.999999 makes 9 as
    the spec casts it) crashed the check with a broadcasting error, exit 3. Its row says it is not checked."""
    g = Graph([Node("OneHot", ["i", "d", "v"], ["y"], name="onehot")],
              [ValueInfo("d", F32, ()), ValueInfo("v", F32, (2,))], [ValueInfo("y", F32, (3, None))],
              {"i": np.array([0, 2, 1])})
    feeds = {"d": np.array(4, F32), "v": np.array([0.5, 2], F32)}
    rep = quiet_check(g, inputs=feeds)
    assert rep.ok and statuses(rep) == {"d": "shape", "v": "agree"}, rep
    assert "changes the loss's shape from [3, 4] to [3, 3]" in rep.rows[0].note
    rg.save(g, tmp_path / "onehot.onnx")
    np.savez(tmp_path / "in.npz", **feeds)
    assert main(["check", str(tmp_path / "onehot.onnx"), "--inputs", str(tmp_path / "in.npz")]) == 0
    out = capsys.readouterr().out
    assert "not checked" in out and "d: not checked: moving it by 1e-06 changes the loss's shape" in out
    assert "1 of 2 values checked: all agree" in out


def test_range_bounds_on_a_length_boundary_are_not_checked():
    """Range(0, 4, 1): moving any of its inputs by 1e-6 changes the length (ceil((limit - start) / delta))."""
    g = Graph([Node("Range", ["s", "l", "d"], ["r"], name="range"), Node("Mul", ["r", "r"], ["y"], name="sq")],
              [ValueInfo(k, F32, ()) for k in "sld"], [ValueInfo("y", F32, (None,))])
    rep = quiet_check(g, inputs={"s": np.array(0, F32), "l": np.array(4, F32), "d": np.array(1, F32)})
    assert rep.ok and statuses(rep)["l"] == "shape", rep


def test_a_kink_is_reported_not_failed():
    """Relu at 0 has one-sided derivatives 0 and 1: no difference quotient can check a gradient there. Tied
    Max inputs are no false alarm either way: the equal split is the central difference, (v_a + v_b) / 2."""
    g = one("Relu", {"x": (F32, (3,))})
    rep = quiet_check(g, inputs={"x": np.array([0, 1, -1], F32)})
    assert rep.ok and statuses(rep) == {"x": "kink"}, rep
    assert statuses(quiet_check(g, inputs={"x": np.array([0.5, 1, -1], F32)})) == {"x": "agree"}
    tie = Graph([Node("Max", ["a", "b"], ["y"], name="max")], [ValueInfo("a", F32, (2,)), ValueInfo("b", F32, (2,))],
                [ValueInfo("y", F32, (2,))])
    rep = quiet_check(tie, inputs={"a": np.array([1, 2], F32), "b": np.array([1, -2], F32)})
    assert rep.ok and statuses(rep) == {"a": "agree", "b": "agree"}, rep


def test_an_empty_value_agrees_without_differences():
    """ReduceMax of an empty set is -inf; an empty input has no direction to move in."""
    g = one("ReduceMax", {"x": (F32, (2, 0))}, {"keepdims": 1})
    rep = quiet_check(g, inputs={"x": np.zeros((2, 0), F32)})
    assert rep.ok and rep.rows[0].note == "empty", rep


# ------------------------------------------------------------------------------- reference kernels (item 7)


@pytest.mark.parametrize("data_shape, idx_shape, axis", [
    ((1, 512), (1, 8), 1),      # BERT's position ids: "cannot reshape array of size 1 into shape (1,8)"
    ((5, 8), (1, 3), 1),        # indices smaller than data outside the axis
    ((4, 6, 3), (2, 6, 2), 0),
    ((70, 2), (3, 2), 0),       # more than 64 choices along the axis (np.choose's limit)
])
def test_reference_gather_elements(data_shape, idx_shape, axis):
    """ONNX GatherElements: out[i][j] = data[i][indices[i][j]] (axis 1) for every position of indices, which
    may be smaller than data along every axis; negative indices count from the end. Expected values from
    numpy's take_along_axis on the matching corner of data, and onnxruntime agrees."""
    rng = np.random.default_rng(6)
    data = rng.standard_normal(data_shape)
    idx = rng.integers(-data_shape[axis], data_shape[axis], idx_shape)
    corner = data[tuple(slice(0, n) if d != axis else slice(None) for d, n in enumerate(idx_shape))]
    expected = np.take_along_axis(corner, idx % data_shape[axis], axis=axis)
    g = Graph([Node("GatherElements", ["data", "idx"], ["y"], {"axis": axis}, "gather")],
              [ValueInfo("data", np.float64, data_shape), ValueInfo("idx", np.int64, idx_shape)],
              [ValueInfo("y", np.float64, idx_shape)])
    for backend in ("reference", "onnxruntime"):
        np.testing.assert_array_equal(rg.Session(g, backend=backend).run({"data": data, "idx": idx})["y"], expected)
    rep = quiet_check(g, wrt=["data"], inputs={"data": data, "idx": idx}, backend="reference")
    assert rep.ok and rep.backend == "reference", rep


def test_reference_one_hot_casts_depth_and_indices():
    """The spec casts a non-integer depth and indices to int64 (onnx's kernel made np.arange(depth) classes
    and compared float indices exactly); onnxruntime (float32 depth) agrees."""
    feeds = {"i": np.array([[1.7, -2, 7], [0, 4.2, -6]], F32), "v": np.array([-1, 3], F32)}
    g = Graph([Node("OneHot", ["i", "d", "v"], ["y"], {"axis": 1}, "onehot")],
              [ValueInfo("i", F32, (2, 3)), ValueInfo("v", F32, (2,))], [ValueInfo("y", F32, None)],
              {"d": np.array(5.7, F32)})
    got = rg.Session(g, backend="reference").run(feeds)["y"]
    expected = np.full((2, 5, 3), -1, F32)
    for (r, c), k in np.ndenumerate(np.array([[1, 3, -1], [0, 4, -1]])):
        if k >= 0:
            expected[r, k, c] = 3
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(rg.Session(g).run(feeds)["y"], expected)


@pytest.mark.parametrize("mode", ["linear", "cubic", "nearest"])
def test_reference_resize_align_corners_uses_the_resized_length(mode):
    """align_corners: x_original = x_resized * (length_original - 1) / (length_resized - 1), with
    length_resized the resized tensor's length, floor(4 * 0.8) = 3: positions 0, 1.5, 3 (onnx's kernel used
    3.2: 0, 1.36, 2.73). Linear on [1, 2, 3, 4] gives [1, 2.5, 4]; onnxruntime computes the same."""
    attrs = {"mode": mode, "coordinate_transformation_mode": "align_corners"}
    g = Graph([Node("Resize", ["x", "", "scales"], ["y"], attrs, "resize")], [ValueInfo("x", F32, (1, 1, 1, 4))],
              [ValueInfo("y", F32, None)], {"scales": np.array([1, 1, 1, 0.8], F32)})
    x = np.array([[[[1, 2, 3, 4]]]], F32)
    ref = rg.Session(g, backend="reference").run({"x": x})["y"]
    np.testing.assert_allclose(ref, rg.Session(g).run({"x": x})["y"], rtol=1e-6)
    if mode == "linear":
        np.testing.assert_allclose(ref.ravel(), [1, 2.5, 4])
    rep = quiet_check(g, wrt=["x"])
    assert rep.ok and statuses(rep) == {"x": "agree"} and rep.backend == "reference", rep


def test_onnxruntime_float32_precise_list_is_current():
    """Shrink is listed because onnxruntime's float64 kernel is float32-precise (~1e-7 off); if a new
    onnxruntime fixes it, this says so (and the check could run it on onnxruntime again)."""
    x = np.random.default_rng(7).uniform(-2, 2, 64) * (1 + 1e-9)
    g = to_float64(one("Shrink", {"x": (F32, (64,))}, {"lambd": 0.5, "bias": 0.1}))
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    sess = ort.InferenceSession(rg.to_onnx(g).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})[0]
    expected = np.where(x < -0.5, x + 0.1, np.where(x > 0.5, x - 0.1, 0))
    assert np.max(np.abs(got - expected)) > 1e-9


# ------------------------------------------------------------------------------------- a sequence as the loss

def sequence_loss_model(kind: str) -> Graph:
    """``x`` float32 [2, 3], a weight ``w`` [2, 3], and a sequence loss ``s``: SequenceConstruct(x * w, sin(x)),
    SplitToSequence of x * w along axis 1 into [2, 1] and [2, 2] (uneven), or an empty split per row (keepdims 0)."""
    w = np.linspace(-1, 1, 6).reshape(2, 3).astype(F32)
    nodes = [Node("Mul", ["x", "w"], ["p"], {}, "mul")]
    if kind == "construct":
        nodes += [Node("Sin", ["x"], ["q"], {}, "sin"), Node("SequenceConstruct", ["p", "q"], ["s"], {}, "sc")]
    elif kind == "uneven split":
        nodes += [Node("SplitToSequence", ["p", "sizes"], ["s"], {"axis": 1}, "sts")]
    else:
        nodes += [Node("SplitToSequence", ["p"], ["s"], {"axis": 0, "keepdims": 0}, "sts")]
    inits = {"w": w, **({"sizes": np.array([1, 2], np.int64)} if kind == "uneven split" else {})}
    return Graph(nodes, [ValueInfo("x", np.dtype(F32), (2, 3))], [ValueInfo("s", np.dtype(F32), None, "sequence")],
                 inits, name="seq", opsets={"": 21})


def sequence_grads(kind: str, x: np.ndarray, us: list[np.ndarray]) -> dict[str, np.ndarray]:
    """torch.autograd of sum_i <u_i, s_i> in float64: the VJP of the sequence loss."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(np.linspace(-1, 1, 6).reshape(2, 3), dtype=torch.float64, requires_grad=True)
    p = xt * wt
    s = {"construct": lambda: [p, torch.sin(xt)], "uneven split": lambda: list(torch.split(p, [1, 2], dim=1)),
         "rows": lambda: list(torch.unbind(p, 0))}[kind]()
    total = sum((torch.tensor(u, dtype=torch.float64) * si).sum() for u, si in zip(us, s, strict=True))
    total.backward()
    return {"x": xt.grad.numpy(), "w": wt.grad.numpy()}


KINDS = ["construct", "uneven split", "rows"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_vjp_of_a_sequence_loss_takes_a_sequence_seed(kind, tmp_path):
    """Issue 28 round 3 (a sibling): ``gradient(seed="input")`` declared a sequence loss's seed as a tensor, and the
    graph was invalid (``grad --seed input``: exit 3). The seed is a sequence; the VJP equals torch's."""
    g = sequence_loss_model(kind)
    gg = rg.gradient(g, "s", ["x", "w"], seed="input")
    seed = gg.inputs[-1]
    assert seed.name == "s_grad" and seed.kind == "sequence"
    x = np.random.default_rng(1).normal(0, 1, (2, 3)).astype(F32)
    probe = rg.Session(g).run({"x": x})["s"]
    us = [np.random.default_rng(i).normal(0, 1, np.shape(a)).astype(F32) for i, a in enumerate(probe)]
    want = sequence_grads(kind, x, us)
    for backend in ("onnxruntime", "reference"):
        got = rg.Session(gg, backend=backend).run({"x": x, "s_grad": us})
        for k in ("x", "w"):
            np.testing.assert_allclose(got[f"{k}_grad"], want[k], rtol=1e-5, atol=1e-6)
    rg.save(g, tmp_path / "m.onnx")
    assert main(["grad", str(tmp_path / "m.onnx"), "--seed", "input", "-o", str(tmp_path / "g.onnx")]) == 0
    written = rg.Session(rg.load(tmp_path / "g.onnx")).run({"x": x, "s_grad": us})
    np.testing.assert_allclose(written["x_grad"], want["x"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_check_gradients_of_a_sequence_loss(kind, tmp_path, capsys, monkeypatch):
    """Issue 28 round 3: ``rg.check_gradients`` and ``revgraph check`` of a sequence loss raised AttributeError
    (exit 3). The sequence is checked as its elements concatenated: the right gradient agrees, a wrong one (the
    gradient graph's x_grad scaled by 1.5) is found out."""
    g = sequence_loss_model(kind)
    rep = rg.check_gradients(g, loss="s")
    assert rep.ok and sorted(r.name for r in rep.rows) == ["w", "x"] and {r.status for r in rep.rows} == {"agree"}, rep
    rg.save(g, tmp_path / "m.onnx")
    assert main(["check", str(tmp_path / "m.onnx")]) == 0
    assert "all 2 gradients agree" in capsys.readouterr().out

    import revgraph.tools.check as check_module

    real = check_module.gradient

    def wrong(*args, **kwargs):  # the gradient graph with x_grad * 1.5
        gg = real(*args, **kwargs)
        node = next(n for n in gg.nodes if "x_grad" in n.outputs)
        node.outputs[node.outputs.index("x_grad")] = "x_grad_right"
        gg.initializers["x_grad_factor"] = np.array(1.5, np.float64)
        gg.nodes.append(Node("Mul", ["x_grad_right", "x_grad_factor"], ["x_grad"], {}, "wrong"))
        return gg

    monkeypatch.setattr(check_module, "gradient", wrong)
    rep = rg.check_gradients(g, loss="s")
    assert not rep.ok and {r.name: r.status for r in rep.rows} == {"x": "mismatch", "w": "agree"}
    assert main(["check", str(tmp_path / "m.onnx")]) == 1
