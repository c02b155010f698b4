"""Memory of a language model's training step with the loss chunked (fused linear cross-entropy) and without
(issue 42, item 1): ``revgraph.train.chunked_loss``, ``loss_options={"chunk_tokens": C}``, ``--loss-chunk C``.

    python bench/chunked_loss.py [--vocab 32000] [--batch 4] [--seq 512] [--configs off 256 1024 auto pt] [--steps 3]
                               [--json FILE]

The model: transformers' ``LlamaForCausalLM`` (hidden 256, 2 layers, 4 heads, 2 KV heads, intermediate 688, no
tied embeddings, eager attention) at vocabulary ``--vocab``, exported once by ``rg.export_torch``; causal-lm
loss on ``--batch`` x ``--seq`` tokens, Adam, one thread. Every configuration runs in a fresh worker process
(``--worker``): it builds the ``rg.Trainer`` (or the PyTorch module and optimizer), resets the peak resident
set size (5 into /proc/self/clear_refs; ``built``: the resident size then), runs steps and reports the first
step's peak (VmHWM) over ``built`` (``step``: what a step adds, onnxruntime's arena and PyTorch's allocator
keeping it for the next steps) and the peak after ``--steps`` more steps (``peak``, absolute; their median
time). Configurations: ``off`` (the loss from the whole logits), a number ``C`` (``chunk_tokens=C``), ``auto``
(``memory=0.5`` and the chunk size it chooses; the memory planner's budget applies to the rest of the step too) and
``pt`` (PyTorch eager, ``F.cross_entropy`` of the whole logits, for scale). The losses of the revgraph
configurations must agree (1e-5): the same weights and batch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from memory_common import peak_mb, reset_peak

LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": False, "attn_implementation": "eager"}


def _module(vocab: int, seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class LogitsOnly(LlamaForCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    torch.manual_seed(0)
    return LogitsOnly(LlamaConfig(vocab_size=vocab, max_position_embeddings=seq, **LLAMA)).eval()


def export(vocab: int, seq: int, path: str) -> None:
    """The LLaMA exported to ``path`` (batch and sequence dynamic) and its weights to ``path + '.pt'``."""
    import torch

    import revgraph as rg

    m = _module(vocab, seq)
    ids = torch.randint(0, vocab, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rg.export_torch(m, (ids,), path, input_names=["input_ids"], output_names=["logits"],
                        dynamic_shapes=({0: torch.export.Dim("B"), 1: torch.export.Dim("T", max=seq)},))
    torch.save(m.state_dict(), path + ".pt")


def worker(config: str, path: str, vocab: int, batch: int, seq: int, steps: int) -> dict:
    """One configuration in this (fresh) process: build, warm up, measure one step (module doc)."""
    import numpy as np

    ids = np.random.default_rng(1).integers(0, vocab, (batch, seq)).astype(np.int64)
    if config == "pt":
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(1)
        m = _module(vocab, seq).train()
        m.load_state_dict(torch.load(path + ".pt"))
        opt = torch.optim.Adam(m.parameters())
        x = torch.as_tensor(ids)

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            logits = m(x)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            return float(loss)
        chunk = None
    else:
        import revgraph as rg

        kw = {"memory": 0.5} if config == "auto" else {}
        options = {"chunk_tokens": "off" if config == "off" else "auto" if config == "auto" else int(config)}
        tr = rg.Trainer(path, "causal-lm", "adam", threads=1, freeze=["*inv_freq"], loss_options=options, **kw)
        chunk = tr.spec.loss.settings.get("chunk_tokens")
        feeds = {"input_ids": ids}

        def step() -> float:
            return float(tr.step(feeds))
    gc.collect()
    built = reset_peak()
    t0 = time.perf_counter()
    first = step()
    warm = time.perf_counter() - t0
    first_peak = peak_mb()
    times = []
    for _ in range(steps):  # (after the measured first step: the arena and allocator hold what it took)
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    secs = statistics.median(times)
    return {"config": config, "chunk_tokens": chunk, "first_loss": first, "loss": loss, "step_s": round(secs, 2),
            "first_step_s": round(warm, 2), "built_mb": round(built, 1), "step_mb": round(first_peak - built, 1),
            "peak_mb": round(peak_mb(), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--configs", nargs="+", default=["off", "256", "1024", "auto", "pt"])
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the measured one (median)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.model, a.vocab, a.batch, a.seq, a.steps)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "llama.onnx")
        export(a.vocab, a.seq, path)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        for c in a.configs:
            cmd = [sys.executable, __file__, "--worker", c, "--model", path, "--vocab", str(a.vocab),
                   "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if out.returncode:
                raise SystemExit(f"{c}: worker failed: {out.stderr.strip().splitlines()[-1:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{c:>6}: chunk {row['chunk_tokens']!s:>5}  step +{row['step_mb']:8.1f} MB over "
                  f"{row['built_mb']:7.1f} MB  peak {row['peak_mb']:8.1f} MB  step {row['step_s']:6.2f} s  "
                  f"loss {row['loss']:.6f}", flush=True)
    rg_rows = [r for r in rows if r["config"] != "pt"]
    if rg_rows and max(abs(r["first_loss"] - rg_rows[0]["first_loss"]) for r in rg_rows) > 1e-5:
        raise SystemExit("the revgraph configurations' first losses differ")
    result = {"vocab": a.vocab, "batch": a.batch, "seq": a.seq, "model": LLAMA, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
