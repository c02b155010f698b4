"""examples/llama_finetune/finetune.py, the README's worked example (issue 38, item 8), run as a user runs it
(``--tiny``: hidden 16, 1 layer, 10 steps each) and its outputs checked against PyTorch, transformers and peft
themselves: the safetensors state dict loads strictly into a fresh ``LlamaForCausalLM`` and computes the logits of
revgraph's trained ONNX model, the PEFT directory loads into ``peft.PeftModel`` and computes the logits of the adapted
ONNX model, the run log's learning rates are transformers' cosine schedule with warmup, and the loss curve is an
SVG. The README's Python block is the script itself."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

import revgraph as rg
from revgraph.train import lora

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "llama_finetune" / "finetune.py"
TOL = {"rtol": 1e-5, "atol": 1e-5}
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The script's output directory after ``finetune.py -o DIR --tiny`` (it asserts its own checks: exit 0), and
    its standard output."""
    out = tmp_path_factory.mktemp("finetune") / "run"
    done = subprocess.run([sys.executable, str(SCRIPT), "-o", str(out), "--tiny"], capture_output=True, text=True,
                          timeout=300, cwd=out.parent, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def llama(out: Path):
    """A fresh ``LlamaForCausalLM`` of the run's ``config.json`` (random weights of another seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(123)
    return LlamaForCausalLM(LlamaConfig.from_pretrained(out)).eval()


def ids_for(model) -> np.ndarray:
    return np.random.default_rng(7).integers(0, model.config.vocab_size, (3, 12)).astype(np.int64)


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def onnx_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return rg.Session(rg.load(path)).run({"input_ids": ids})["logits"]


def test_the_state_dict_loads_strictly_and_gives_the_trained_onnx_models_logits(run):
    out, stdout = run
    assert "PyTorch agrees" in stdout.splitlines()[-1]
    from safetensors.torch import load_file

    model = llama(out)
    state = load_file(out / "model.safetensors")
    model.load_state_dict(state)  # strict: every key of the module's state dict, nothing else
    assert set(state) == set(model.state_dict())
    ids = ids_for(model)
    np.testing.assert_allclose(torch_logits(model, ids), onnx_logits(out / "llama.full.onnx", ids), **TOL)
    base = rg.load(out / "llama.onnx")
    changed = [k for k in state if not np.array_equal(state[k].numpy(), base.initializers[k])]
    assert sorted(changed) == sorted(dict(model.named_parameters()))  # every parameter trained, no buffer exists
    from transformers import LlamaForCausalLM

    # config.json beside model.safetensors: the directory is a Hugging Face model directory
    np.testing.assert_allclose(torch_logits(LlamaForCausalLM.from_pretrained(out).eval(), ids),
                               torch_logits(model, ids), **TOL)


def test_the_peft_directory_loads_in_peft_and_gives_the_adapted_onnx_models_logits(run):
    out, _ = run
    from peft import PeftModel

    base, adapted = rg.load(out / "llama.onnx"), rg.load(out / "llama.lora.onnx")
    for k, a in base.initializers.items():  # the LoRA run trained the adapters alone
        assert np.array_equal(adapted.initializers[k], a), k
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (8, 16, "CAUSAL_LM")
    model = llama(out)
    model.load_state_dict({k: torch.as_tensor(np.asarray(base.initializers[k])) for k in model.state_dict()})
    ids = ids_for(model)
    before = torch_logits(model, ids)
    peft = PeftModel.from_pretrained(model, out / "adapter").eval()
    got = torch_logits(peft, ids)
    np.testing.assert_allclose(got, onnx_logits(out / "llama.lora.onnx", ids), **TOL)
    assert np.abs(got - before).max() > 1e-3  # the adapters were trained (B starts at zero)
    assert len(lora.config(adapted)["adapters"]) == 7 + 1  # q k v o gate up down, lm_head


def test_the_log_follows_transformers_cosine_schedule_and_the_curve_is_svg(run):
    out, _ = run
    from transformers import get_cosine_schedule_with_warmup

    records = [json.loads(line) for line in (out / "full.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-2)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=10)
    want = []
    for _ in records:
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose([r["lr"] for r in records], want, rtol=1e-12, atol=1e-15)
    assert [r["step"] for r in records if r.get("eval_loss") is not None] == [2, 4, 6, 8, 10]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    root = ET.parse(out / "loss.svg").getroot()
    assert root.tag == SVG + "svg"
    lines = root.findall(f".//{SVG}polyline")
    assert lines and len(lines[0].get("points").split()) == len(records)  # the training loss, a point per step


def test_the_guides_python_block_is_the_script():
    """The train guide's worked example (docs/guides/train.md) shows finetune.py as it is (less its docstring)."""
    text = (ROOT / "docs" / "guides" / "train.md").read_text()
    block = text.split("<!-- llm-finetune-script -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    source = SCRIPT.read_text()
    body = source[source.index('"""\n', 3) + 4:]
    assert block == body
    assert len(body.splitlines()) < 40
