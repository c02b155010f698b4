"""QLoRA trains what it merges: LoRA adapters over int4 and int8 ``DequantizeLinear`` bases, trained, evaluated and
predicted by revgraph, against float64 numpy (dequantize, then matmul), PyTorch float64 autograd and the merged
float model. onnxruntime fuses ``DequantizeLinear`` + ``MatMul``/``Gemm`` into ``MatMulNBits``, whose default
accuracy level quantizes the activations to int8 (0.4-0.7% of the output scale off at these sizes); revgraph's
sessions set ``session.qdq_matmulnbits_accuracy_level`` to "0" (revgraph.runtime.options.exact_products)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from kit.lora import LoraLinear
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Node
from revgraph.onnx_io import to_onnx
from revgraph.runtime.options import QDQ_ACCURACY_KEY, exact_products, quantized_products
from revgraph.train import lora, sgd

F32 = np.float32
SIZES = (128, 96, 64, 16)  # x [N, 128] -> 96 -> 64 -> y [N, 16]: K of 64-128, what onnxruntime fuses
RANK, ALPHA = 4, 8.0
KINDS = ("int4", "int8")


def _quantized(rng, name: str, k: int, n: int, dtype: str, block: int | None, zero_point: bool):
    """Initializers of a quantized [k, n] weight, its DequantizeLinear node and its float64 value.
    ``block``: blocked along rows (axis 0, opset 21); ``None`` per output column (axis 1); 0 per tensor."""
    lo, hi = {"int4": (-8, 8), "uint4": (0, 16), "int8": (-128, 128), "uint8": (0, 256)}[dtype]
    q = rng.integers(lo, hi, (k, n))
    shape = (k // block, n) if block else (n,) if block is None else ()
    s = (rng.uniform(0.2, 0.4, shape) / np.sqrt(k) / (8 if dtype.endswith("4") else 128)).astype(F32)
    z = rng.integers((lo + hi) // 2 - 2, (lo + hi) // 2 + 2, shape) if zero_point else np.zeros(shape, np.int64)
    kind = {"int4": T.INT4, "uint4": T.UINT4, "int8": T.INT8, "uint8": T.UINT8}[dtype]
    tensors = [h.make_tensor(name, kind, (k, n), q.flatten().tolist()), nh.from_array(s, name + ".s")]
    inputs = [name, name + ".s"]
    if zero_point:
        tensors.append(h.make_tensor(name + ".z", kind, shape, np.ravel(z).tolist()))
        inputs.append(name + ".z")
    attrs = {"axis": 0, "block_size": block} if block else {"axis": 1} if block is None else {}
    node = h.make_node("DequantizeLinear", inputs, [name + ".w"], name=name + ".dq", **attrs)
    expand = (lambda a: np.repeat(np.asarray(a, np.float64).reshape(shape), block, axis=0)) if block else \
        (lambda a: np.asarray(a, np.float64))
    return tensors, node, (q - expand(z)) * expand(s)


def base_model(kind: str, seed: int = 0):
    """x [N, 128] -> MatMul(DQ q1) -> Tanh -> MatMul(DQ q2) -> Tanh -> Gemm(DQ q3, bias) -> y [N, 16].
    int4: signed blocks of 32, unsigned blocks of 32 with zero points, signed one block per column (read by the
    Gemm); int8: signed per column, unsigned per tensor with a zero point, signed blocks of 32 (the Gemm).
    Returns the graph and the float64 dequantized weights and bias."""
    rng = np.random.default_rng(seed)
    k1, k2, k3, n = SIZES
    specs = {"int4": [("int4", 32, False), ("uint4", 32, True), ("int4", k3, False)],
             "int8": [("int8", None, False), ("uint8", 0, True), ("int8", 32, False)]}[kind]
    tensors, nodes, ws = [], [], []
    for i, ((k, m), (dtype, block, zp)) in enumerate(zip([(k1, k2), (k2, k3), (k3, n)], specs, strict=True)):
        t, node, w = _quantized(rng, f"q{i + 1}", k, m, dtype, block, zp)
        tensors += t
        nodes.append(node)
        ws.append(w)
    bias = rng.normal(0, 0.1, n).astype(F32)
    tensors.append(nh.from_array(bias, "bias"))
    nodes += [h.make_node("MatMul", ["x", "q1.w"], ["h1"], name="mm1"), h.make_node("Tanh", ["h1"], ["t1"]),
              h.make_node("MatMul", ["t1", "q2.w"], ["h2"], name="mm2"), h.make_node("Tanh", ["h2"], ["t2"]),
              h.make_node("Gemm", ["t2", "q3.w", "bias"], ["y"], name="gemm3")]
    g = h.make_graph(nodes, kind, [h.make_tensor_value_info("x", T.FLOAT, ["N", k1])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", n])], tensors)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    return rg.load(model), ws, bias.astype(np.float64)


def adapted(kind: str, targets=None):
    """The base with rank-4 adapters on its products (``targets``: weight globs, ``None`` all three), every B random
    (B = 0 gives A no gradient)."""
    g, ws, bias = base_model(kind)
    g = lora.add_adapters(g, RANK, alpha=ALPHA, targets=targets)
    rng = np.random.default_rng(1)
    for a in lora.config(g)["adapters"]:
        g.initializers[a["B"]] = rng.normal(0, 0.05, g.initializers[a["B"]].shape).astype(F32)
    return g, ws, bias


def data(n: int = 24, seed: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(0, 1, (n, SIZES[0])).astype(F32), "labels": rng.normal(0, 0.5, (n, SIZES[-1])).astype(F32)}


def torch_layers(g: rg.Graph, ws, bias):
    """PEFT-style float64 LoRA layers over the dequantized weights, with the adapters of ``g`` (zeros where a
    weight has none)."""
    ads = {a["weight"]: (g.initializers[a["A"]], g.initializers[a["B"]]) for a in lora.config(g)["adapters"]}
    none = lambda w: (np.zeros((w.shape[0], RANK)), np.zeros((RANK, w.shape[1])))
    layers = [LoraLinear(w.T, None, *ads.get(f"q{i + 1}", none(w)), ALPHA / RANK) for i, w in enumerate(ws)]
    return layers, lambda x: layers[2](torch.tanh(layers[1](torch.tanh(layers[0](x))))) + torch.as_tensor(bias)


def product_model(w: str, g: rg.Graph, k: int) -> onnx.ModelProto:
    """One ``DequantizeLinear`` of ``g`` and a MatMul of it: p = x @ dq(w)."""
    dq = next(n for n in g.nodes if n.outputs == [w + ".w"])
    proto = to_onnx(g)
    keep = set(dq.inputs)
    nodes = [n for n in proto.graph.node if n.name == dq.name] + [h.make_node("MatMul", ["x", w + ".w"], ["p"])]
    graph = h.make_graph(nodes, "p", [h.make_tensor_value_info("x", T.FLOAT, ["N", k])],
                         [h.make_tensor_value_info("p", T.FLOAT, None)],
                         [t for t in proto.graph.initializer if t.name in keep])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _scaled(a, b) -> float:
    """max |a - b| over the scale of ``b`` (its largest magnitude)."""
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# ---------------------------------------------------------------------------------------------- the products


@pytest.mark.parametrize("kind", KINDS)
def test_products_equal_float64_dequantize_and_matmul(kind):
    """Each quantized product of a revgraph Session equals x @ dequantize(q) in float64 to float32 rounding, while
    onnxruntime's default session (the fusion at accuracy level 4) is over 2e-4 of the scale away (measured 8e-4 to
    6e-3): the fusion happens here, so the setting is what makes the products exact."""
    g, ws, _ = base_model(kind)
    x = np.random.default_rng(3).normal(0, 1, (16, SIZES[0])).astype(F32)
    for i, w in enumerate(ws):
        k = w.shape[0]
        xi = x[:, :k]
        model = product_model(f"q{i + 1}", g, k)
        want = xi.astype(np.float64) @ w
        exact = _scaled(rg.Session(model).run({"x": xi})["p"], want)
        default = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        fused = _scaled(default.run(None, {"x": xi})[0], want)
        assert exact < 2e-6, (kind, i, exact)
        assert fused > 2e-4, (kind, i, fused)


def test_detection_and_a_users_own_setting():
    g, _, _ = base_model("int4")
    assert quantized_products(g)
    float_model = rg.load(product_model("q1", g, SIZES[0]))
    float_model.nodes = [n for n in float_model.nodes if n.op_type != "DequantizeLinear"]
    float_model.initializers = {"q1.w": np.ones((SIZES[0], SIZES[1]), F32)}
    assert not quantized_products(float_model)  # a float weight: nothing to fuse
    read_by_add = g.copy()
    read_by_add.nodes = [n for n in g.nodes if n.op_type == "DequantizeLinear"] + \
        [Node("Add", ["q1.w", "q1.w"], ["y"], name="add")]
    assert not quantized_products(read_by_add)
    options = exact_products(ort.SessionOptions(), g)
    assert options.get_session_config_entry(QDQ_ACCURACY_KEY) == "0"
    mine = ort.SessionOptions()
    mine.add_session_config_entry(QDQ_ACCURACY_KEY, "4")  # the user's explicit choice stays
    assert exact_products(mine, g).get_session_config_entry(QDQ_ACCURACY_KEY) == "4"
    x = data()["x"]
    _, ws, bias = base_model("int4")
    want = np.tanh(np.tanh(x.astype(np.float64) @ ws[0]) @ ws[1]) @ ws[2] + bias
    assert _scaled(rg.Session(g).run({"x": x})["y"], want) < 2e-6
    assert _scaled(rg.Session(g, session_options=mine).run({"x": x})["y"], want) > 2e-4  # 8e-4 measured


# ---------------------------------------------------------------------------------------------- trained vs merged


@pytest.mark.parametrize("kind", KINDS)
def test_a_training_step_equals_pytorch_float64(kind):
    """One full-batch SGD step of the adapters: the change of each A and B is -lr times torch's float64 gradient
    of the mean squared error over PEFT-style layers on the dequantized weights. The first product has no adapter:
    onnxruntime fuses it in the training graph too (the adapted ones it may fuse into a Gemm with their update
    first), so its rounding would reach every gradient without the setting (measured 7e-3 of their scale)."""
    g, ws, bias = adapted(kind, targets=["q2", "q3"])
    d, lr = data(), 20.0  # a step far above float32's spacing of A and B
    tr = rg.Trainer(g, "mse", sgd(lr))
    tr.fit(d, epochs=1, batch_size=len(d["x"]), shuffle=False, progress=False)
    layers, forward = torch_layers(g, ws, bias)
    loss = ((forward(torch.as_tensor(d["x"], dtype=torch.float64)) - torch.as_tensor(d["labels"], dtype=torch.float64))
            ** 2).mean()
    loss.backward()
    assert tr.losses[0] == pytest.approx(loss.item(), rel=1e-5)
    for i, a in enumerate(lora.config(g)["adapters"]):
        layer = layers[int(a["weight"][1]) - 1]
        for name, grad in ((a["A"], layer.lora_A.weight.grad), (a["B"], layer.lora_B.weight.grad)):
            step = (g.initializers[name].astype(np.float64) - tr.parameters[name]) / lr
            assert _scaled(step, grad.numpy().T) < 1e-4, (kind, i, name, _scaled(step, grad.numpy().T))


@pytest.mark.parametrize("kind", KINDS)
def test_trained_adapters_predict_what_the_merged_model_computes(kind, tmp_path):
    """After a few Adam steps: Trainer.predict and Trainer.evaluate (the evaluation session) against the merged
    float model (W + (alpha / r) A B folded into float weights) within 1e-5 of the output scale, and both against
    float64 numpy of the trained adapted model."""
    g, ws, bias = adapted(kind)
    d = data()
    tr = rg.Trainer(g, "mse", "adam")
    tr.fit(d, epochs=3, batch_size=8, progress=False)
    trained = tr.export(tmp_path / "trained.onnx")
    merged = lora.merge_adapters(trained)
    assert not any(n.op_type == "DequantizeLinear" for n in merged.nodes)  # float weights now
    x = d["x"]
    y_merged = rg.Session(merged).run({"x": x})["y"]
    y_trained = tr.predict(x)
    _, forward = torch_layers(trained, ws, bias)
    want = forward(torch.as_tensor(x, dtype=torch.float64)).detach().numpy()
    assert _scaled(y_trained, y_merged) < 1e-5
    assert _scaled(y_trained, want) < 2e-6 and _scaled(y_merged, want) < 2e-6
    mse = float(((y_merged.astype(np.float64) - d["labels"]) ** 2).mean())
    assert tr.evaluate(d, batch_size=len(x))["loss"] == pytest.approx(mse, rel=5e-7)  # 3e-6 when fused


def test_cli_train_then_merge_computes_the_same(tmp_path, capsys):
    """revgraph train --lora on an int4 base, then lora extract and apply --merge: the trained ONNX's outputs (a
    revgraph Session) equal the merged model's within 1e-5 of the output scale."""
    g, _, _ = base_model("int4")
    rg.save(g, tmp_path / "base.onnx")
    np.savez(tmp_path / "d.npz", **data())
    assert main(["train", str(tmp_path / "base.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "mse",
                 "--epochs", "2", "--batch-size", "8", "--lr", "0.01", "--lora", "4", "-o",
                 str(tmp_path / "trained.onnx")]) == 0
    assert main(["lora", "extract", str(tmp_path / "trained.onnx"), "-o", str(tmp_path / "ad.npz")]) == 0
    assert main(["lora", "apply", str(tmp_path / "base.onnx"), str(tmp_path / "ad.npz"), "-o",
                 str(tmp_path / "merged.onnx"), "--merge"]) == 0
    capsys.readouterr()
    x = data(seed=7)["x"]
    trained = rg.Session(tmp_path / "trained.onnx").run({"x": x})["y"]
    merged = rg.Session(tmp_path / "merged.onnx").run({"x": x})["y"]
    assert _scaled(trained, merged) < 1e-5
