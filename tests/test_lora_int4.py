"""LoRA on ``com.microsoft.MatMulNBits``, the 4-bit frozen base of quantized and generated LLMs (issue 41, item 2):
the adapters' gradients and a few Trainer steps against PyTorch float64 of ``x dequant(W)^T + bias + s (x A) B``
(the dequantization written in :mod:`kit.genai` from onnxruntime's operator docs), the extract / apply / merge
round trip, the default trainable set of such a file, and onnxruntime-genai's model builder end to end: a tiny
int4 LLaMA fine-tuned with ``revgraph train --lora 8 --loss causal-lm``, its adapters extracted, its logits
against the transformers model in float64 with the dequantized weights plus the adapters, and the trained file
generating in onnxruntime-genai."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from kit.contrib_cases import with_loss
from kit.genai import dequantize, genai_llama, token_data
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import revgraph as rg
from revgraph.cli import main
from revgraph.train import lora, selection

F32 = np.float32
RANK, ALPHA = 4, 8.0
Q = "/model/layers.0/attn/q_proj/MatMul_Q4"  # the builder's node names
O = "/model/layers.0/attn/o_proj/MatMul_Q4"


def _quantized(rng, K, N, block, zp: bool) -> dict[str, np.ndarray]:
    blocks = -(-K // block)
    out = {"B": rng.integers(0, 256, (N, blocks, block // 2), dtype=np.uint8),
           "s": (rng.random((N, blocks)) * 0.1 + 0.01).astype(F32)}
    if zp:
        out["z"] = rng.integers(0, 256, (N, -(-blocks // 2)), dtype=np.uint8)
    return out


def nbits_model(seed: int = 0) -> rg.Graph:
    """``x [n, 64] -> MatMulNBits(K=64, N=24, block 32, zero points, bias) -> Tanh -> MatMulNBits(K=24, N=8, block
    16: K ends inside a block) -> y [n, 8]``. The scales are named ``s1``/``s2`` (not ``*scales*``): the default
    trainable set leaves them out by structure."""
    rng = np.random.default_rng(seed)
    q1, q2 = _quantized(rng, 64, 24, 32, True), _quantized(rng, 24, 8, 16, False)
    inits = {"B1": q1["B"], "s1": q1["s"], "z1": q1["z"], "b1": rng.normal(0, 0.3, 24).astype(F32),
             "B2": q2["B"], "s2": q2["s"]}
    nodes = [h.make_node("MatMulNBits", ["x", "B1", "s1", "z1", "", "b1"], ["h"], name=Q, domain="com.microsoft",
                         K=64, N=24, bits=4, block_size=32),
             h.make_node("Tanh", ["h"], ["t"], name="tanh"),
             h.make_node("MatMulNBits", ["t", "B2", "s2"], ["y"], name=O, domain="com.microsoft", K=24, N=8, bits=4,
                         block_size=16)]
    g = h.make_graph(nodes, "nbits", [h.make_tensor_value_info("x", T.FLOAT, ["n", 64])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["n", 8])],
                     [nh.from_array(v, k) for k, v in inits.items()])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return rg.load(model)


def _weights(g: rg.Graph) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W1^T [64, 24]``, ``b1``, ``W2^T [24, 8]`` in float64, dequantized by :func:`kit.genai.dequantize`."""
    i = g.initializers
    w1 = dequantize(i["B1"], i["s1"], i["z1"], 64, 24, 32)
    w2 = dequantize(i["B2"], i["s2"], None, 24, 8, 16)
    return torch.tensor(w1.T), torch.tensor(i["b1"].astype(np.float64)), torch.tensor(w2.T)


def _torch_forward(g: rg.Graph, x, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float):
    """``y`` of :func:`nbits_model` with the adapters ``{weight: (A, B)}`` (float64 torch)."""
    w1, b1, w2 = _weights(g)
    h1 = x @ w1 + b1
    if "B1" in adapters:
        a, b = adapters["B1"]
        h1 = h1 + scaling * (x @ a) @ b
    t = torch.tanh(h1)
    y = t @ w2
    if "B2" in adapters:
        a, b = adapters["B2"]
        y = y + scaling * (t @ a) @ b
    return y


def _random_b(g: rg.Graph, seed: int = 3) -> rg.Graph:
    """``g`` with non-zero ``B`` adapters (they start at zero, where ``dL/dA`` is zero too)."""
    g = g.copy()
    rng = np.random.default_rng(seed)
    for a in lora.config(g)["adapters"]:
        g.initializers[a["B"]] = rng.normal(0, 0.2, g.initializers[a["B"]].shape).astype(F32)
    return g


def test_sites_and_configuration():
    """Both MatMulNBits are sites: A [K, r], B [r, N] float32 (the scales' dtype), K/N from the attributes; the
    node names of the builder select them; the base's outputs are unchanged before training."""
    base = nbits_model()
    g = lora.add_adapters(base, RANK, alpha=ALPHA)
    c = lora.config(g)
    assert [(a["weight"], a["in"], a["out"], a["quantized"], a["transposed"]) for a in c["adapters"]] == [
        ("B1", 64, 24, True, True), ("B2", 24, 8, True, True)]
    for a in c["adapters"]:
        assert g.initializers[a["A"]].shape == (a["in"], RANK) and g.initializers[a["A"]].dtype == F32
        assert g.initializers[a["B"]].shape == (RANK, a["out"]) and not g.initializers[a["B"]].any()
    only_q = lora.config(lora.add_adapters(base, RANK, targets=["*q_proj*"]))
    assert [a["weight"] for a in only_q["adapters"]] == ["B1"]
    x = np.random.default_rng(1).normal(0, 1, (5, 64)).astype(F32)
    np.testing.assert_array_equal(rg.Session(g).run({"x": x})["y"], rg.Session(base).run({"x": x})["y"])
    with pytest.raises(rg.RevgraphError, match="rank 9 exceeds min\\(in, out\\) = 8"):
        lora.add_adapters(base, 9, targets=[O])


def test_adapter_gradients_equal_pytorch():
    """d/dA, d/dB and d/dx of ``sum(y * R)`` through the adapted graph against torch float64 autograd."""
    g = _random_b(lora.add_adapters(nbits_model(), RANK, alpha=ALPHA))
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (5, 64)).astype(F32)
    fwd = rg.Session(g).run({"x": x})
    R = rng.normal(0, 1, fwd["y"].shape)
    names = lora.adapter_names(g)
    got = rg.Session(rg.gradient(with_loss(g, fwd, ["y"]), "loss", [*names, "x"])).run({"x": x, "y_u": R.astype(F32)})
    c = lora.config(g)
    params = {a["weight"]: tuple(torch.tensor(g.initializers[a[k]].astype(np.float64), requires_grad=True)
                                 for k in ("A", "B")) for a in c["adapters"]}
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    y = _torch_forward(g, xt, params, c["scaling"])
    np.testing.assert_allclose(fwd["y"], y.detach().numpy(), rtol=1e-5, atol=1e-5)
    (y * torch.tensor(R)).sum().backward()
    for a in c["adapters"]:
        for k, t in zip(("A", "B"), params[a["weight"]], strict=True):
            want = t.grad.numpy()
            np.testing.assert_allclose(got[a[k] + "_grad"], want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                       err_msg=a[k])
    np.testing.assert_allclose(got["x_grad"], xt.grad.numpy(), rtol=1e-4, atol=1e-5 * np.abs(xt.grad.numpy()).max())


def test_trainer_steps_equal_pytorch_sgd():
    """Three SGD steps of the Trainer (mse, the adapters train by default, the packed base stays) against torch
    float64 SGD on the same math."""
    g = lora.add_adapters(nbits_model(), RANK, alpha=ALPHA, seed=2)
    rng = np.random.default_rng(5)
    batch = {"x": rng.normal(0, 1, (6, 64)).astype(F32), "labels": rng.normal(0, 1, (6, 8)).astype(F32)}
    tr = rg.Trainer(g, "mse", rg.train.sgd(lr=0.5))
    assert tr.spec.params == lora.adapter_names(g)
    c = lora.config(g)
    params = {a["weight"]: tuple(torch.tensor(g.initializers[a[k]].astype(np.float64), requires_grad=True)
                                 for k in ("A", "B")) for a in c["adapters"]}
    opt = torch.optim.SGD([t for p in params.values() for t in p], lr=0.5)
    x, labels = (torch.tensor(batch[k].astype(np.float64)) for k in ("x", "labels"))
    for _ in range(3):
        loss = tr.step(batch)
        opt.zero_grad()
        want = ((_torch_forward(g, x, params, c["scaling"]) - labels) ** 2).mean()
        want.backward()
        opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-5)
    trained = tr.parameters
    for a in c["adapters"]:
        for k, t in zip(("A", "B"), params[a["weight"]], strict=True):
            np.testing.assert_allclose(trained[a[k]], t.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=a[k])
    for k, v in nbits_model().initializers.items():  # the frozen base
        np.testing.assert_array_equal(tr.spec.model.initializers[k], v)


def test_extract_apply_and_merge_round_trip(tmp_path):
    """Trained adapters written by ``lora extract`` and applied to the base give the trained model's outputs; merged
    (``--merge``) they become a float MatMul weight: the MatMulNBits nodes and packed weights are gone and the
    outputs equal the dequantized weight plus the update (float64 torch)."""
    base = nbits_model()
    base_path, trained_path = tmp_path / "base.onnx", tmp_path / "trained.onnx"
    rg.save(base, base_path)
    rng = np.random.default_rng(6)
    data = {"x": rng.normal(0, 1, (16, 64)).astype(F32), "labels": rng.normal(0, 1, (16, 8)).astype(F32)}
    tr = rg.Trainer(lora.add_adapters(base, RANK, alpha=ALPHA), "mse", "adam")
    tr.fit(data, epochs=2, batch_size=8, progress=False)
    trained = tr.export(trained_path)
    assert main(["lora", "extract", str(trained_path), "-o", str(tmp_path / "ad.npz")]) == 0
    assert main(["lora", "apply", str(base_path), str(tmp_path / "ad.npz"), "-o", str(tmp_path / "applied.onnx")]) == 0
    assert main(["lora", "apply", str(base_path), str(tmp_path / "ad.npz"), "--merge", "-o",
                 str(tmp_path / "merged.onnx")]) == 0
    x = data["x"][:5]
    want = rg.Session(trained).run({"x": x})["y"]
    np.testing.assert_array_equal(rg.Session(rg.load(tmp_path / "applied.onnx")).run({"x": x})["y"], want)
    merged = rg.load(tmp_path / "merged.onnx")
    assert {n.op_type for n in merged.nodes} == {"MatMul", "Add", "Tanh"}
    assert not {"B1", "B2", "s1", "z1", "s2"} & set(merged.initializers)
    c = lora.config(trained)
    ad = {a["weight"]: tuple(torch.tensor(trained.initializers[a[k]].astype(np.float64)) for k in ("A", "B"))
          for a in c["adapters"]}
    exact = _torch_forward(base, torch.tensor(x.astype(np.float64)), ad, c["scaling"]).numpy()
    np.testing.assert_allclose(rg.Session(merged).run({"x": x})["y"], exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(want, exact, rtol=1e-5, atol=1e-5)


def test_default_selection_leaves_out_scales_and_zero_points_by_structure():
    """Without adapters the bias trains; the scales and zero points MatMulNBits reads (named s1, z1, s2: no
    ``*scales*``) are left out, and say why; the packed weights count as frozen parameters (K * N elements)."""
    g = nbits_model()
    assert selection.select(g) == ["b1"]
    out = selection.left_out(g)
    assert {k: out[k] for k in ("s1", "s2")} == dict.fromkeys(("s1", "s2"), selection.FROZEN_BASE)
    assert "z1" not in selection.select(g, params=["*1"])  # (uint8: never trains)
    assert selection.count_line(g, ["b1"]) == ("parameters: 24 trainable in 1 tensor "
                                               f"({100 * 24 / (24 + 64 * 24 + 24 * 8 + 48 + 16):.3g}%), "
                                               f"{64 * 24 + 24 * 8 + 48 + 16:,} frozen in 4 tensors")


# ---------------------------------------------------------------------------------------------- the genai builder


def _merged_torch(model, g: rg.Graph, adapters: dict[str, np.ndarray], scaling: float):
    """The transformers ``model`` in float64 with every ``MatMulNBits`` weight of ``g`` dequantized
    (:func:`kit.genai.dequantize`) plus ``scaling A B`` of its adapter (the fused QKV split back into q, k, v)."""
    model = model.double()
    w = {}
    for n in g.nodes:
        if n.op_type != "MatMulNBits":
            continue
        i, a = g.initializers, n.attrs
        dq = dequantize(i[n.inputs[1]], i[n.inputs[2]], None, a["K"], a["N"], a["block_size"]).T  # [K, N]
        name = n.inputs[1]
        if f"{name}.lora_A" in adapters:
            dq = dq + scaling * adapters[f"{name}.lora_A"].astype(np.float64) @ adapters[f"{name}.lora_B"].astype(
                np.float64)
        w[name.removesuffix(".MatMul.weight_Q4")] = torch.tensor(dq.T)  # [out, in], as nn.Linear holds it
    with torch.no_grad():
        for k, layer in enumerate(model.model.layers):
            qkv = w[f"model.layers.{k}.attn.qkv_proj"]
            layer.self_attn.q_proj.weight.copy_(qkv[:64])
            layer.self_attn.k_proj.weight.copy_(qkv[64:96])
            layer.self_attn.v_proj.weight.copy_(qkv[96:])
            layer.self_attn.o_proj.weight.copy_(w[f"model.layers.{k}.attn.o_proj"])
            for p in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, p).weight.copy_(w[f"model.layers.{k}.mlp.{p}"])
        model.lm_head.weight.copy_(w["lm_head"])
    return model


def test_genai_builder_int4_llama_lora_end_to_end(tmp_path, capsys):
    """``revgraph train model.onnx --lora 8 --loss causal-lm`` on the builder's int4 LLaMA, then ``lora extract``:
    the loss falls, the base initializers are untouched, and the trained model's logits (its MatMulNBits at
    accuracy_level 0, where onnxruntime multiplies the dequantized weights in float) equal the transformers model in
    float64 with the dequantized weights plus the adapters, attention by onnxruntime's GroupQueryAttention kernel;
    and onnxruntime-genai generates with the trained file."""
    path, model = genai_llama(tmp_path, "int4", vocab=256)
    ids = np.random.default_rng(0).integers(3, 256, (8, 16))
    np.savez(tmp_path / "tokens.npz", **token_data(ids))
    out = tmp_path / "trained.onnx"
    assert main(["train", str(path), "--lora", "8", "--loss", "causal-lm", "--model-output", "logits", "--data",
                 str(tmp_path / "tokens.npz"), "--max-steps", "20", "--batch-size", "4", "--optimizer", "adam", "--lr",
                 "1e-2", "--log", str(tmp_path / "log.jsonl"), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "parameters: 16,896 trainable in 22 tensors" in text, text  # 11 sites: (in + out) * 8 each
    losses = [json.loads(line)["loss"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 20 and losses[0] == pytest.approx(np.log(256), rel=0.02) and losses[-1] < losses[0] - 1
    assert main(["lora", "extract", str(out), "-o", str(tmp_path / "adapters.npz")]) == 0
    assert "wrote" in capsys.readouterr().out
    adapters, c = lora.load_adapters(tmp_path / "adapters.npz")
    assert len(c["adapters"]) == 11 and c["rank"] == 8
    base, trained = rg.load(path), rg.load(out)
    for k, v in base.initializers.items():
        np.testing.assert_array_equal(trained.initializers[k], v, err_msg=k)
    for k, v in adapters.items():
        np.testing.assert_array_equal(trained.initializers[k], v, err_msg=k)
    assert any(trained.initializers[a["B"]].any() for a in c["adapters"])
    # the adapters go back on the builder's file from the command line, separate and merged (its
    # SimplifiedLayerNormalization in the default domain and a Constant it declares with the wrong rank made ONNX's
    # check of the written file fail: exit 3, then 2), and the builder's file's gradient is written too
    applied = tmp_path / "applied.onnx"
    assert main(["lora", "apply", str(path), str(tmp_path / "adapters.npz"), "-o", str(applied)]) == 0
    assert main(["lora", "apply", str(path), str(tmp_path / "adapters.npz"), "-o", str(tmp_path / "merged.onnx"),
                 "--merge"]) == 0
    assert main(["grad", str(path), "--loss", "logits", "--wrt", "model.embed_tokens.weight", "-o",
                 str(tmp_path / "grad.onnx")]) == 0
    capsys.readouterr()
    feeds = token_data(np.random.default_rng(2).integers(0, 256, (2, 5)))

    def logits(f) -> np.ndarray:
        g = rg.load(f)
        g.outputs = [vi for vi in g.outputs if vi.name == "logits"]
        return rg.Session(g).run(feeds)["logits"]
    np.testing.assert_allclose(logits(applied), logits(out), rtol=1e-6, atol=1e-6)  # (the trained model's)
    _generates_with_genai(path.parent, out, trained)
    for n in trained.nodes:
        if n.op_type == "MatMulNBits":
            n.attrs["accuracy_level"] = 0
    trained.outputs = [vi for vi in trained.outputs if vi.name == "logits"]
    test_ids = np.random.default_rng(1).integers(0, 256, (2, 7))
    feeds = token_data(test_ids)
    got = rg.Session(trained).run(feeds)["logits"]
    want = _merged_torch(model, base, adapters, c["scaling"])(torch.tensor(test_ids)).logits.detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _generates_with_genai(builder_dir, trained_path, trained: rg.Graph) -> None:
    """The trained file (adapters as nodes, same inputs and outputs) in place of the builder's ``model.onnx`` runs
    in onnxruntime-genai's generator, with its KV cache: its greedy tokens are the argmax of the trained model's
    logits recomputed over the whole sequence at each step."""
    import shutil

    import onnxruntime_genai as og

    gen = trained_path.parent / "generate"
    shutil.copytree(builder_dir, gen)
    shutil.copy(trained_path, gen / "model.onnx")
    model = og.Model(str(gen))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=10, do_sample=False)
    generator = og.Generator(model, params)
    prompt = [5, 6, 7, 8]
    generator.append_tokens(np.array([prompt], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    got = [int(t) for t in generator.get_sequence(0)]
    g = trained.copy()
    g.outputs = [vi for vi in g.outputs if vi.name == "logits"]
    session, want = rg.Session(g), list(prompt)
    while len(want) < 10:
        logits = session.run(token_data(np.array([want])))["logits"]
        want.append(int(logits[0, -1].argmax()))
    assert got == want
