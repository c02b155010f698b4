"""Fine-tune a transformers LLaMA with revgraph and take the results back to PyTorch: full fine-tuning to a
safetensors state dict, then LoRA to a PEFT adapter directory, each checked against the PyTorch model's own logits.

    python examples/llama_finetune/finetune.py -o run          # hidden 64, 2 layers, vocabulary 256, 200 steps each
    python examples/llama_finetune/finetune.py -o run --tiny   # hidden 16, 1 layer, vocabulary 32, 10 steps (CI)

It builds a ``LlamaForCausalLM`` from a ``LlamaConfig`` (random weights, no download) and 288 token sequences of 32
that count up by 1 to 3 from a random start (256 to train on, 32 held out), exports the model with
``rg.export_torch`` (which records the names of ``model.parameters()``, so the full fine-tune trains exactly those
and not the rotary ``inv_freq`` buffer), trains it with the causal-LM loss (AdamW at 1e-2, a cosine schedule with 10%
warmup, gradient clipping at 1.0), and writes to the output directory:

* ``llama.onnx``: the base model; ``full.jsonl``: the full fine-tune's record of each step (loss, learning rate,
  gradient norm, held-out loss every quarter of the run); ``loss.svg``: its loss curve;
* ``model.safetensors`` and ``config.json``: the fully fine-tuned weights as the module's state dict, loaded with
  ``load_state_dict(load_file(...))`` (strict); the directory is also a Hugging Face model directory
  (``LlamaForCausalLM.from_pretrained(DIR)``);
* ``llama.lora.onnx`` and ``adapter/`` (PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``): rank-8
  LoRA adapters (alpha 16) on every projection and ``lm_head`` of the base, trained alone, loaded with
  ``PeftModel.from_pretrained``.

It asserts that both PyTorch models compute revgraph's logits on the held-out sequences (to 1e-4) and prints the
held-out losses. Needs torch, transformers and peft (``pip install torch transformers peft``).
"""
import argparse
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from peft import PeftModel
from safetensors.torch import load_file

import revgraph as rg
from revgraph.train import Schedule, adamw, peft_io, runlog

cli = argparse.ArgumentParser(description="full and LoRA fine-tuning of a tiny LLaMA, back to PyTorch")
cli.add_argument("-o", "--output", type=Path, default=Path("llama_finetune"), help="the directory to write")
cli.add_argument("--tiny", action="store_true", help="hidden 16, 1 layer, vocabulary 32, 10 steps each (for CI)")
args = cli.parse_args()
(out := args.output).mkdir(exist_ok=True)
hidden, layers, vocab, steps = (16, 1, 32, 10) if args.tiny else (64, 2, 256, 200)
config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, use_cache=False)
torch.manual_seed(0)
model = tf.LlamaForCausalLM(config).eval()  # random weights, no download; eval(): no dropout in the graph
ids = ((torch.randint(0, vocab, (288, 1)) + torch.randint(1, 4, (288, 1)) * torch.arange(32)) % vocab).numpy()
train, held_out, held = {"input_ids": ids[:256]}, {"input_ids": ids[256:]}, torch.as_tensor(ids[256:])
rg.export_torch(model, held[:2], out / "llama.onnx", output_names=["logits"], dynamic_shapes=({0: "B", 1: "T"},))
opt = adamw(1e-2, schedule=Schedule("cosine", warmup_steps=steps // 10), clip_grad_norm=1.0)  # for both runs
full = rg.Trainer(out / "llama.onnx", "causal-lm", opt)  # every parameter (export_torch's record), not inv_freq
with runlog.JsonlLog(out / "full.jsonl") as log, runlog.LossCurve(out / "loss.svg", "full fine-tuning") as curve:
    full.fit(train, max_steps=steps, batch_size=16, eval_data=held_out, eval_every=steps // 4, callbacks=[log, curve])
full.export(out / "llama.full.onnx")
full.save_state_dict(out / "model.safetensors")  # PyTorch's state dict; with config.json a from_pretrained directory
config.save_pretrained(out)
(tuned := tf.LlamaForCausalLM(config).eval()).load_state_dict(load_file(out / "model.safetensors"))  # strict
lora = rg.Trainer(rg.lora.add_adapters(rg.load(out / "llama.onnx"), 8, 16), "causal-lm", opt)  # rank 8, alpha 16
lora.fit(train, max_steps=steps, batch_size=16, eval_data=held_out)
peft_io.save_peft(out / "adapter", lora.export(out / "llama.lora.onnx"), task_type="CAUSAL_LM")
for theirs, ours in ((tuned, full), (PeftModel.from_pretrained(model, out / "adapter"), lora)):  # PyTorch = revgraph
    np.testing.assert_allclose(theirs(held).logits.detach(), ours.predict(held_out), rtol=1e-4, atol=1e-4)
print(f"loss {full.last_evaluation['loss']:.4f} (full), {lora.last_evaluation['loss']:.4f} (LoRA); PyTorch agrees")
