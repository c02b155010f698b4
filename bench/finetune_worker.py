"""One side of bench/finetune.py in a process of its own: revgraph's or PyTorch's fine-tune of the LLaMA, run in
blocks of steps when the orchestrator says so, or the one-off preparation of the files both sides read.

    python bench/finetune_worker.py prepare --cache DIR
    python bench/finetune_worker.py run {rg,torch} {full,lora} --cache DIR --threads N --steps S --block K

``prepare`` (torch and revgraph, once per cache): ``transformers.LlamaForCausalLM`` of :data:`LLAMA` with seeded
random weights (SDPA attention, transformers' default), written as ``hf/`` (``save_pretrained``: what PyTorch
loads) and as ``llama.onnx`` (``rg.export_torch`` of the same weights: what revgraph loads), ``tokens.npz``
(``input_ids`` int64 ``[samples, SEQ]``: :func:`tokens`) and ``peft/``: revgraph's initial LoRA adapters
(``lora.add_adapters(seed=0)``, B = 0) in PEFT's format (``peft_io.save_peft``), which the PyTorch side loads
with ``PeftModel.from_pretrained``: both sides start from the same adapters.

``run``: the process imports its framework, builds the fine-tune from the files and trains ``S`` steps in order
(no shuffling), batch :data:`BATCH`, AdamW (the mode's learning rate :data:`LR`, weight decay 0.01, none on 1-D
parameters), a cosine schedule with :data:`WARMUP` linear warm-up steps over ``S`` steps and gradient clipping
at global norm 1.0.

* revgraph: ``rg.Trainer("llama.onnx", "causal-lm", rg.train.adamw(...), clip_grad_norm=1.0, threads=N)`` (LoRA:
  ``lora.add_adapters(graph, 8, alpha=16, targets=the seven projections)`` first; the default trainable set is
  then the adapters, else the module's parameters) and ``fit(..., shuffle=False, max_steps=S, callbacks=[...])``;
* PyTorch: ``LlamaForCausalLM.from_pretrained`` (LoRA: ``PeftModel.from_pretrained(..., is_trainable=True)``),
  ``torch.optim.AdamW`` with two parameter groups (decay on the parameters of two or more dimensions, as
  revgraph's default ``no_decay``), ``transformers.get_cosine_schedule_with_warmup``,
  ``model(input_ids=x, labels=x).loss.backward()``, ``clip_grad_norm_``, ``step``; ``torch.set_num_threads(N)``.

Protocol (one JSON object a line on a private copy of stdout; fd 1 goes to stderr, as in bench/_worker.py):
after the first step ``{"event": "first", ...}`` with wall-clock marks (``time.time()``: imported, built, first
step done) and resident sizes; then the process waits for a line on stdin before each block of ``K`` steps and
answers ``{"event": "block", "losses": [...], "times": [...], "cpu": [...]}`` (seconds per step: from the end of
the previous step, or from the go, to the end of this one; and the process's CPU seconds in that time); after the last
block ``{"event": "done", "peak_mb": VmHWM}``. So the orchestrator runs the two sides' blocks in turn and neither
computes while the other is timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path

from memory_common import peak_mb, rss_mb  # (bench/ is the script's directory: on sys.path)

#: issue 38's LLaMA: 4 layers, hidden 256, grouped-query attention (8 heads, 4 key/value heads), vocabulary 8000,
#: intermediate 688 (256 x 11008 / 4096, transformers' default ratio), untied LM head; no pad token (a pad row of
#: ``nn.Embedding(padding_idx=)`` never trains in torch, while ONNX's Gather has no such row).
LLAMA = {"vocab_size": 8000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128,
         "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}
SEQ, BATCH, WARMUP, WEIGHT_DECAY, CLIP = 128, 8, 10, 0.01, 1.0
#: the learning rate of each mode: LoRA's higher (as usual), so that its loss moves in 100 steps too (at 1e-2 it
#: did not fall, and the two sides' losses drifted apart by 1e-2 as unstable training amplifies rounding)
LR = {"full": 1e-3, "lora": 3e-3}
RANK, ALPHA = 8, 16.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SAMPLES = 800  # 100 steps of 8


def tokens(samples: int = SAMPLES, seed: int = 0):
    """``input_ids`` int64 ``[samples, SEQ]``: ``(start + stride * t) % vocab`` with a random start and a stride
    of 1 to 3 per sequence (seeded): random sequences with a pattern a causal LM learns, so the loss moves."""
    import numpy as np

    rng = np.random.default_rng(seed)
    start, stride = rng.integers(0, LLAMA["vocab_size"], (samples, 1)), rng.integers(1, 4, (samples, 1))
    return ((start + stride * np.arange(SEQ)) % LLAMA["vocab_size"]).astype(np.int64)


# ---------------------------------------------------------------------------------------------- prepare

def prepare(cache: Path) -> dict:
    """Write the files of the module doc into ``cache`` (nothing if they exist); returns what was written."""
    info_path = cache / "finetune.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    import numpy as np
    import torch
    import transformers as tf

    import revgraph as rg
    from revgraph.train import lora, peft_io

    cache.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA, use_cache=False)).eval()

    export_s = export_logits(model, tokens(2), cache / "llama.onnx")
    model.save_pretrained(cache / "hf")
    np.savez(cache / "tokens.npz", input_ids=tokens())
    adapted = lora.add_adapters(rg.load(cache / "llama.onnx"), RANK, alpha=ALPHA, targets=lora_targets())
    peft_io.save_peft(cache / "peft", adapted, task_type="CAUSAL_LM")
    info = {"export_s": round(export_s, 2), "parameters": sum(p.numel() for p in model.parameters()),
            "attention": model.config._attn_implementation,
            "lora_parameters": int(sum(adapted.initializers[n].size for n in lora.adapter_names(adapted))),
            "onnx_mb": round(os.path.getsize(cache / "llama.onnx") / 2**20, 1)}
    info_path.write_text(json.dumps(info))
    return info


def export_logits(model, ids, path) -> float:
    """Write ``model`` (a ``transformers.LlamaForCausalLM``) as an ONNX file of its logits, ``input_ids`` ->
    ``logits`` with a symbolic batch (``rg.export_torch``, traced on ``ids``, int64 ``[n, SEQ]``); returns the
    seconds it took."""
    import torch
    import transformers as tf

    import revgraph as rg

    class LogitsOnly(tf.LlamaForCausalLM):  # (a subclass: the weights keep LlamaForCausalLM's names)
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    logits = LogitsOnly(model.config).eval()
    logits.load_state_dict(model.state_dict())
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rg.export_torch(logits, (torch.from_numpy(ids),), path, dynamic_shapes={"input_ids": {0: "batch"}},
                        input_names=["input_ids"], output_names=["logits"])
    return time.perf_counter() - t0


def lora_targets() -> list[str]:
    """revgraph's ``targets`` globs of the seven projections (PEFT's ``target_modules`` are the bare names)."""
    return [f"*{p}*" for p in PROJECTIONS]


# -------------------------------------------------------------------------------------------------- run

class Turns:
    """Called after every step with its loss: times the steps, reports each block and waits for the next go."""

    def __init__(self, proto, steps: int, block: int, marks: dict):
        self.proto, self.steps, self.block, self.marks = proto, steps, block, marks
        self.losses: list[float] = []
        self.times: list[float] = []
        self.cpu: list[float] = []  # CPU seconds of the process (all its threads) per step: checks the threads
        self.sent = 0
        self.start()

    def start(self) -> None:
        self.t_prev, self.c_prev = time.perf_counter(), time.process_time()

    def __call__(self, loss: float) -> None:
        self.times.append(time.perf_counter() - self.t_prev)
        self.cpu.append(time.process_time() - self.c_prev)
        self.losses.append(float(loss))
        n = len(self.losses)
        if n == 1:
            gc.collect()
            self._send({"event": "first", "marks": {**self.marks, "first_step": time.time()}, "loss": self.losses[0],
                        "step_s": self.times[0], "rss_mb": rss_mb(), "peak_mb": peak_mb()})
        elif (n - 1) % self.block == 0 or n == self.steps:
            self._send({"event": "block", "losses": self.losses[self.sent:], "times": self.times[self.sent:],
                        "cpu": self.cpu[self.sent:]})
        else:
            self.start()
            return
        self.sent = n
        if n < self.steps and not sys.stdin.readline():
            raise SystemExit(0)  # the orchestrator went away
        self.start()

    def _send(self, message: dict) -> None:
        self.proto.write(json.dumps(message) + "\n")
        self.proto.flush()


def run_rg(mode: str, cache: Path, threads: int, steps: int, turns_factory, marks: dict) -> None:
    import numpy as np

    import revgraph as rg
    from revgraph.train import lora
    from revgraph.train.schedules import Schedule

    marks["imported"] = time.time()
    marks["import_rss_mb"] = rss_mb()
    model = rg.load(cache / "llama.onnx")
    if mode == "lora":
        model = lora.add_adapters(model, RANK, alpha=ALPHA, targets=lora_targets())
    opt = rg.train.adamw(LR[mode], weight_decay=WEIGHT_DECAY, schedule=Schedule("cosine", warmup_steps=WARMUP))
    trainer = rg.Trainer(model, "causal-lm", opt, clip_grad_norm=CLIP, threads=threads)
    data = {"input_ids": np.load(cache / "tokens.npz")["input_ids"]}
    marks["built"] = time.time()
    marks["built_rss_mb"], marks["build_peak_mb"] = rss_mb(), peak_mb()
    turns = turns_factory()
    turns.start()
    trainer.fit(data, batch_size=BATCH, shuffle=False, max_steps=steps, progress=False,
                callbacks=[lambda record: turns(record["loss"])])


def run_torch(mode: str, cache: Path, threads: int, steps: int, turns_factory, marks: dict) -> None:
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM, get_cosine_schedule_with_warmup

    if mode == "lora":
        from peft import PeftModel
    torch.set_num_threads(threads)
    marks["imported"] = time.time()
    marks["import_rss_mb"] = rss_mb()
    model = LlamaForCausalLM.from_pretrained(cache / "hf")
    if mode == "lora":
        model = PeftModel.from_pretrained(model, cache / "peft", is_trainable=True)
    model.train()  # (LLaMA has no dropout; PEFT's lora_dropout is 0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # revgraph's default no_decay (revgraph.train.schedules.excluded): none on 1-D parameters and biases
    excluded = {n for n, p in named if p.ndim <= 1 or "bias" in n.lower()}
    groups = [{"params": [p for n, p in named if n not in excluded]},
              {"params": [p for n, p in named if n in excluded], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR[mode], weight_decay=WEIGHT_DECAY)
    sched = get_cosine_schedule_with_warmup(opt, WARMUP, steps)
    params = [p for _, p in named]
    ids = torch.from_numpy(np.load(cache / "tokens.npz")["input_ids"])
    marks["built"] = time.time()
    marks["built_rss_mb"], marks["build_peak_mb"] = rss_mb(), peak_mb()
    turns = turns_factory()
    turns.start()
    for k in range(steps):
        x = ids[k * BATCH:(k + 1) * BATCH]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        sched.step()
        turns(loss.item())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--cache", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("side", choices=["rg", "torch"])
    r.add_argument("mode", choices=["full", "lora"])
    r.add_argument("--cache", type=Path, required=True)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--block", type=int, default=5)
    args = parser.parse_args(argv)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    if args.command == "prepare":
        proto.write(json.dumps(prepare(args.cache)) + "\n")
        return 0
    samples = args.steps * BATCH
    if samples > SAMPLES:
        parser.error(f"--steps at most {SAMPLES // BATCH}: tokens.npz has {SAMPLES} sequences")
    marks = {"main": time.time()}
    run = run_rg if args.side == "rg" else run_torch
    turns: list[Turns] = []

    def factory() -> Turns:
        turns.append(Turns(proto, args.steps, args.block, marks))
        return turns[0]

    run(args.mode, args.cache, args.threads, args.steps, factory, marks)
    t = turns[0]
    proto.write(json.dumps({"event": "done", "peak_mb": peak_mb(), "rss_mb": rss_mb(), "losses": t.losses,
                            "times": t.times}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
