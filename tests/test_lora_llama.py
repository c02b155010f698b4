"""LoRA on a LLaMA exported by examples/llama_lora/export.py (transformers.LlamaConfig, torch.onnx.export dynamo):
the adapters land on q/k/v/o/gate/up/down, and their gradients through the exported graph equal torch autograd
on the same LLaMA with PEFT-style LoRA layers (tests/test_lora.py's LoraLinear) swapped in."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kit.lora import LoraLinear

import revgraph as rg
from revgraph.ir import Node, ValueInfo
from revgraph.train import lora

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama_lora" / "export.py"
F32 = np.float32


def example():
    spec = importlib.util.spec_from_file_location("llama_lora_export", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peft_llama(ex, config: dict, adapted: rg.Graph):
    """The LLaMA of ``config`` in float64 with the ONNX model's weights, each adapted ``nn.Linear`` replaced by a
    PEFT-style LoRA layer holding the graph's ``A`` and ``B``."""
    m = ex.logits_model(ex.llama_config(**config)).double()
    state = {k: torch.as_tensor(np.asarray(adapted.initializers[k], np.float64)) for k in m.state_dict()
             if k in adapted.initializers}
    missing = set(dict(m.named_parameters())) - set(state)
    assert not missing, missing  # every parameter of the PyTorch model is an initializer of the ONNX one
    m.load_state_dict(state, strict=False)
    c = lora.config(adapted)
    layers = {}
    for a in c["adapters"]:
        path = a["weight"].removesuffix(".weight").split(".")
        parent = m.get_submodule(".".join(path[:-1]))
        linear = getattr(parent, path[-1])
        bias = None if linear.bias is None else linear.bias.detach().numpy()
        layer = LoraLinear(linear.weight.detach().numpy(), bias,
                           adapted.initializers[a["A"]], adapted.initializers[a["B"]], c["scaling"])
        setattr(parent, path[-1], layer)
        layers[a["weight"]] = layer
    return m, layers


def check_llama(directory: Path, config: dict, rank: int, alpha: float, length: int):
    """Adapters on the 7 projections of every layer (and lm_head too by default); their gradients for
    loss = sum(logits * R) equal torch autograd's."""
    ex = example()
    g = rg.load(directory / "llama.onnx")
    layers = config["num_hidden_layers"]
    every = [a["weight"] for a in lora.config(lora.add_adapters(g, rank))["adapters"]]
    want = [f"model.layers.{i}.{'self_attn' if p in ex.PROJECTIONS[:4] else 'mlp'}.{p}.weight"
            for i in range(layers) for p in ex.PROJECTIONS]
    assert every == [*want, "lm_head.weight"]
    adapted = lora.add_adapters(g, rank, alpha=alpha, targets=[f"*{p}*" for p in ex.PROJECTIONS])
    assert [a["weight"] for a in lora.config(adapted)["adapters"]] == want
    rng = np.random.default_rng(0)
    for a in lora.config(adapted)["adapters"]:  # B = 0 would make every gradient of A zero
        adapted.initializers[a["B"]] = rng.normal(0, 0.2, adapted.initializers[a["B"]].shape).astype(F32)
    ids = rng.integers(0, config["vocab_size"], (2, length)).astype(np.int64)
    R = rng.normal(0, 1, (2, length, config["vocab_size"])).astype(F32)
    lg = adapted.copy()
    lg.nodes += [Node("Mul", ["logits", "R"], ["lr"], name="loss/mul"),
                 Node("ReduceSum", ["lr"], ["loss"], {"keepdims": 0}, name="loss/sum")]
    lg.inputs.append(ValueInfo("R", F32, R.shape))
    lg.outputs = [ValueInfo("loss", F32, ())]
    names = lora.adapter_names(adapted)
    got = rg.Session(rg.gradient(lg, "loss", names)).run({"input_ids": ids, "R": R})
    m, peft = peft_llama(ex, config, adapted)
    logits = m(torch.as_tensor(ids))
    loss = (logits * torch.as_tensor(R, dtype=torch.float64)).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-4, atol=1e-3)
    for a in lora.config(adapted)["adapters"]:
        layer = peft[a["weight"]]
        for key, ref in (("A", layer.lora_A.weight.grad), ("B", layer.lora_B.weight.grad)):
            ref = ref.numpy().T
            np.testing.assert_allclose(got[a[key] + "_grad"], ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max(),
                                       err_msg=a[key])
    before = rg.Session(g).run({"input_ids": ids})["logits"]  # the adapted model, B = 0, is the base model
    np.testing.assert_allclose(rg.Session(lora.add_adapters(g, rank)).run({"input_ids": ids})["logits"], before,
                               rtol=1e-5, atol=1e-5)


def test_lora_on_a_tiny_exported_llama(tmp_path):
    ex = example()
    config = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}
    ex.export(ex.logits_model(ex.llama_config(**config)), tmp_path / "llama.onnx", example_length=8)
    check_llama(tmp_path, config, rank=4, alpha=8.0, length=8)


@pytest.mark.slow
def test_the_walkthrough_llama(tmp_path):
    """examples/llama_lora/export.py as the README runs it (hidden 64, 2 layers, vocabulary 256)."""
    subprocess.run([sys.executable, str(EXAMPLE), "-o", str(tmp_path)], check=True, timeout=900, capture_output=True)
    config = json.loads((tmp_path / "config.json").read_text())
    ids = np.load(tmp_path / "tokens.npz")["input_ids"]
    assert ids.dtype == np.int64 and ids.shape == (256, 32) and ids.min() >= 0 and ids.max() < config["vocab_size"]
    check_llama(tmp_path, config, rank=8, alpha=16.0, length=32)


def _walkthrough_commands() -> list[str]:
    """The bash block of the train guide's "Fine-tuning a language model end to end" (after its marker)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "train.md").read_text()
    block = text.split("<!-- llm-walkthrough -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_llm_walkthrough_runs_as_printed(tmp_path):
    """The train guide's LLaMA walkthrough, command by command as printed (exit 0 each): the loss before training is
    transformers' own causal-LM loss of the same weights (``LlamaForCausalLM(..., labels=input_ids).loss``, the
    mean cross-entropy of every next token), the full fine-tune lowers it; its safetensors state dict loads strictly
    into ``LlamaForCausalLM`` and gives the trained ONNX model's logits; the LoRA run changed only adapters, its PEFT
    directory loads into ``peft.PeftModel`` on the base weights and gives the adapted ONNX model's logits, and the
    merged model's logits equal the adapted model's; the run log has a record per step and the curve is SVG."""
    import onnxruntime as ort
    from transformers import LlamaForCausalLM

    repo = Path(__file__).resolve().parent.parent
    printed = []
    for line in _walkthrough_commands():
        argv = line.split()
        argv = [sys.executable, str(repo / argv[1]), *argv[2:]] if argv[0] == "python" else \
            [sys.executable, "-m", "revgraph", *argv[1:]]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
        assert done.returncode == 0, (line, done.stderr[-2000:])
        printed += done.stdout.splitlines()
    after = next(line for line in printed if line.startswith("eval data"))
    loss_after = float(after.split("loss ")[1].split(",")[0])
    d = tmp_path / "llama"
    tokens = dict(np.load(d / "tokens.npz"))
    loss_before = rg.Trainer(d / "llama.onnx", "causal-lm").evaluate(tokens)["loss"]
    config = json.loads((d / "config.json").read_text())
    base = rg.load(d / "llama.onnx")
    ex = example()
    hf = LlamaForCausalLM(ex.llama_config(**config)).double().eval()
    hf.load_state_dict({k: torch.as_tensor(np.asarray(base.initializers[k], np.float64))
                        for k in hf.state_dict() if k in base.initializers}, strict=False)
    ids = torch.as_tensor(np.load(d / "tokens.npz")["input_ids"])
    with torch.no_grad():
        reference = float(hf(input_ids=ids, labels=ids, use_cache=False).loss)
    assert abs(loss_before - reference) <= 1e-5 * reference, (loss_before, reference)
    assert loss_after < 0.5 * loss_before
    check_hf_outputs(ex.llama_config(**config), base, d, ids[:8])
    trained = rg.load(d / "llama.lora.onnx")
    names = set(lora.adapter_names(trained))
    for k, a in base.initializers.items():  # the base is frozen: every base tensor is unchanged
        assert np.array_equal(np.asarray(trained.initializers[k]), np.asarray(a)), k
    assert names and not names & set(base.initializers)
    runs = []
    for f in ("llama.lora.onnx", "llama.merged.onnx"):
        s = ort.InferenceSession(str(d / f), providers=["CPUExecutionProvider"])
        runs.append(s.run(None, {"input_ids": ids[:8].numpy()})[0])
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-4, atol=1e-4 * np.abs(runs[0]).max())


def check_hf_outputs(config, base: rg.Graph, d: Path, ids: torch.Tensor) -> None:
    """The walkthrough's PyTorch outputs against its ONNX models (onnxruntime), float32, to 1e-5 of the largest
    logit: ``model.safetensors`` (loaded strictly) and ``llama.full.onnx``; the base weights with ``adapter/`` in
    peft and ``llama.lora.onnx``; and ``full.jsonl`` (200 steps) and ``loss.svg`` as written."""
    import xml.etree.ElementTree as ET

    import onnxruntime as ort
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    def onnx_logits(name: str) -> np.ndarray:
        s = ort.InferenceSession(str(d / name), providers=["CPUExecutionProvider"])
        return s.run(None, {"input_ids": ids.numpy()})[0]

    def torch_logits(module) -> np.ndarray:
        with torch.no_grad():
            out = module(input_ids=ids, use_cache=False)
        return out.logits.numpy()

    tuned = LlamaForCausalLM(config).eval()
    tuned.load_state_dict(load_file(d / "model.safetensors"))  # strict
    full = onnx_logits("llama.full.onnx")  # (logits up to about 10: float32 rounding is about 1e-5 of the largest)
    np.testing.assert_allclose(torch_logits(tuned), full, rtol=1e-5, atol=1e-5 * np.abs(full).max())
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict({k: torch.as_tensor(np.asarray(base.initializers[k])) for k in model.state_dict()})
    adapted = PeftModel.from_pretrained(model, d / "adapter").eval()
    lora_logits = onnx_logits("llama.lora.onnx")
    np.testing.assert_allclose(torch_logits(adapted), lora_logits, rtol=1e-5, atol=1e-5 * np.abs(lora_logits).max())
    steps = [json.loads(line)["step"] for line in (d / "full.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 201))
    assert ET.parse(d / "loss.svg").getroot().find(".//{http://www.w3.org/2000/svg}polyline") is not None
