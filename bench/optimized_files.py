"""Optimized transformer files against their unoptimized exports (issue 41): build time, forward time, step time.

Models: a BERT sequence classifier (3 labels) and a GPT-2 causal LM from ``transformers`` configs, random
weights, hidden 128, 2 layers, 4 heads, intermediate 512, vocabulary 512, sequence 64, eager attention. Each is
exported with the TorchScript exporter at opset 17 (constant folding on, dynamic batch: as
tests/test_optimized_finetune.py does) and then optimized with ``onnxruntime.transformers.optimizer``
(``num_heads=4, hidden_size=128``), giving four files.

Each measurement runs in a fresh process (``--worker``), one file per process, one thread
(``OMP_NUM_THREADS=1``, onnxruntime intra-op 1, ``Trainer(threads=1)``); the four files alternate in each turn
(the order rotating) and the table reports the median of ``--turns`` turns. A worker measures:

- ``build_s``: ``rg.Trainer(path, loss, "adamw", threads=1)`` construction (loading, the training graph, the
  onnxruntime session): BERT ``cross-entropy``, GPT-2 ``causal-lm``;
- ``gradient_s``: ``rg.gradient`` of the model's output (its elements' sum) with respect to every initializer,
  the file already loaded;
- ``forward_ms``: an onnxruntime ``InferenceSession`` of the file (default optimizations, one thread), batch 8,
  the mean over ``--seconds``; ``forward_plain_ms`` the same with onnxruntime's graph optimizations off
  (``ORT_DISABLE_ALL``: the file's operators as written);
- ``first_step_s``: the first ``Trainer.fit`` step (batch 8), which includes creating the training session;
- ``step_ms``: ``Trainer.fit`` with batch 8, ``max_steps=--steps`` after that first step, per step;
- node counts: the model's, the gradient graph's and the training graph's.

Writes ``bench/results/optimized_files.json`` and a markdown table to stdout. Not part of the tests:
``python bench/optimized_files.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "optimized_files.json"
HIDDEN, LAYERS, HEADS, INTER, VOCAB, SEQ, BATCH = 128, 2, 4, 512, 512, 64, 8
LOSS = {"bert": "cross-entropy", "gpt2": "causal-lm"}
FILES = ["bert-export", "bert-optimized", "gpt2-export", "gpt2-optimized"]
MS = "com.microsoft"


def _build(name: str):
    """The transformers model ``name`` (``bert`` or ``gpt2``) returning its logits alone, in eval mode."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    quiet = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTER,
                            n_positions=SEQ, **quiet)
        cls = tf.GPT2LMHeadModel
    else:
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, intermediate_size=INTER, max_position_embeddings=SEQ,
                            num_labels=3, **quiet)
        cls = tf.BertForSequenceClassification
    cfg._attn_implementation = "eager"

    class LogitsOnly(cls):
        def forward(self, input_ids):  # an all-ones mask and no cache: the logits of input_ids alone
            extra = {} if name == "bert" else {"use_cache": False}
            return super().forward(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **extra).logits

    return LogitsOnly(cfg).eval()


def write_files(folder: Path) -> dict[str, Path]:
    """The four files of the module doc, in ``folder``."""
    import io

    import torch
    from onnxruntime.transformers import optimizer

    paths = {}
    for name in ("bert", "gpt2"):
        model = _build(name)
        example = (torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1)),)
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, example, buf, dynamo=False, opset_version=17, input_names=["input_ids"],
                              output_names=["logits"], dynamic_axes={"input_ids": {0: "batch"}})
        plain, fused = folder / f"{name}-export.onnx", folder / f"{name}-optimized.onnx"
        plain.write_bytes(buf.getvalue())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer.optimize_model(str(plain), model_type=name, num_heads=HEADS,
                                     hidden_size=HIDDEN).save_model_to_file(str(fused))
        paths[f"{name}-export"], paths[f"{name}-optimized"] = plain, fused
    return paths


def _data(name: str, samples: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    data = {"input_ids": rng.integers(3, VOCAB, (samples, SEQ)).astype(np.int64)}
    if name == "bert":
        data["labels"] = rng.integers(0, 3, samples).astype(np.int64)
    return data


def worker(path: str, key: str, steps: int, seconds: float) -> dict:
    """One file's measurements (the module doc), in this process."""
    import onnx
    import onnxruntime as ort

    import revgraph as rg

    name = key.split("-", maxsplit=1)[0]
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    trainer = rg.Trainer(path, LOSS[name], "adamw", threads=1)
    build = time.perf_counter() - t0

    model = rg.load(path)
    t0 = time.perf_counter()
    grad = rg.gradient(model)
    gradient = time.perf_counter() - t0

    feeds = {"input_ids": _data(name, BATCH)["input_ids"]}
    forward = {}
    for level in ("all", "none"):  # onnxruntime's own graph optimizations on (its default) and off
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        if level == "none":
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        sess.run(None, feeds)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds or n < 3:
            sess.run(None, feeds)
            n += 1
        forward[level] = (time.perf_counter() - t0) / n

    data = _data(name, BATCH * steps)
    t0 = time.perf_counter()  # (the first step: the training session is created when first needed)
    trainer.fit(data, batch_size=BATCH, max_steps=1, shuffle=False, progress=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.fit(data, batch_size=BATCH, max_steps=steps, shuffle=False, progress=False)
    step = (time.perf_counter() - t0) / steps

    proto = onnx.load(path)
    return {"build_s": build, "gradient_s": gradient, "forward_ms": 1e3 * forward["all"],
            "forward_plain_ms": 1e3 * forward["none"], "step_ms": 1e3 * step,
            "first_step_s": first,
            "model_nodes": len(model.nodes), "gradient_nodes": len(grad.nodes),
            "training_nodes": len(trainer.spec.graph.nodes),
            "contrib_ops": sorted({nd.op_type for nd in proto.graph.node if nd.domain == MS})}


def _run_worker(path: Path, key: str, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--worker", str(path), key, "--steps", str(args.steps),
                          "--seconds", str(args.seconds)], env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"worker {key} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


TIMES = ["build_s", "first_step_s", "gradient_s", "forward_ms", "forward_plain_ms", "step_ms"]


def table(results: dict) -> str:
    """The markdown table of ``results`` (medians)."""
    head = ("| file | contrib operators | nodes: model / gradient / training | build (Trainer) s | first step s | "
            "rg.gradient s | forward ms (ort all / none) | step ms |")
    rows = [head, "|---|---|---|---:|---:|---:|---:|---:|"]
    for key in FILES:
        r = results[key]
        m = r["median"]
        rows.append(f"| {key} | {', '.join(r['contrib_ops']) or '-'} | {r['model_nodes']} / {r['gradient_nodes']}"
                    f" / {r['training_nodes']} | {m['build_s']:.2f} | {m['first_step_s']:.2f} | {m['gradient_s']:.3f} "
                    f"| {m['forward_ms']:.2f} / {m['forward_plain_ms']:.2f} | {m['step_ms']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="timed Trainer.fit steps per worker")
    p.add_argument("--seconds", type=float, default=1.0, help="forward timing per worker")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", nargs=2, metavar=("PATH", "KEY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.steps, args.seconds)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(Path(tmp))
        runs: dict[str, list[dict]] = {k: [] for k in FILES}
        for turn in range(args.turns):
            order = FILES[turn % len(FILES):] + FILES[:turn % len(FILES)]
            for key in order:
                runs[key].append(_run_worker(paths[key], key, args))
            print(f"turn {turn + 1}/{args.turns} done", file=sys.stderr)
    results = {}
    for key, rs in runs.items():
        results[key] = {**{k: v for k, v in rs[0].items() if k not in TIMES},
                        "median": {t: statistics.median(r[t] for r in rs) for t in TIMES},
                        "runs": {t: [r[t] for r in rs] for t in TIMES}}
    import onnxruntime
    import torch
    import transformers

    meta = {"machine": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "config": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "intermediate": INTER, "vocab": VOCAB,
                       "seq": SEQ, "batch": BATCH, "threads": 1},
            "turns": args.turns, "steps": args.steps, "seconds": args.seconds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
