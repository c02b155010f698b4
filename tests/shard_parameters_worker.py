"""A training process for tests/test_shard_parameters.py, started by torchrun: trains an MLP, a one-block causal
Transformer (tests/kit/lossdata_models.tiny_lm) or an exported LLaMA (an ONNX file), plain or with LoRA adapters,
data-parallel with ``shard="parameters"`` (or another ``--shard``), and writes this rank's parameters, full
optimizer state, per-step losses and the engine's held bytes to ``<out>/rank<r>.npz``. :func:`setup` builds the
same Trainer and data in one process for the reference. Run as
``torchrun --nproc-per-node 2 tests/shard_parameters_worker.py --model mlp --out DIR``."""

from __future__ import annotations

import argparse
import os

import numpy as np
from distributed_worker import LOSS, OPTIMIZERS, build, schedule_options
from kit.held_arrays import numpy_bytes

import revgraph as rg
from revgraph.train import lora, make_optimizer

#: the LLaMA's vocabulary and sequence length (tests/test_shard_parameters.py exports it)
VOCAB, LENGTH = 64, 8


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp", help="mlp, deep (8 layers of 128), lm (the one-block Transformer) or a "
                   "LLaMA's .onnx file")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: train every parameter)")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--samples", type=int, default=37)
    p.add_argument("--batch-size", type=int, default=12, help="the global batch")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accumulate-steps", type=int, default=1)
    p.add_argument("--schedule", default="constant")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--clip-grad-norm", type=float)
    p.add_argument("--shard", default="parameters")
    p.add_argument("--bucket-bytes", type=int, default=4096)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--out")
    return p


def setup(a: argparse.Namespace, distributed: bool) -> tuple[rg.Trainer, dict]:
    """The Trainer of ``a`` (``shard`` and ``bucket_mb`` when ``distributed``) and its data."""
    if a.model == "deep":  # 8 square layers of 128: each layer a unit of its own at --bucket-bytes 65536
        g, data = deep_mlp(8, 128, a.samples)
        loss, options = "cross-entropy", None
    elif a.model.endswith(".onnx"):
        g = rg.load(a.model)
        rng = np.random.default_rng(5)
        data = {"input_ids": rng.integers(0, VOCAB, (a.samples, LENGTH)).astype(np.int64)}
        loss, options = "causal-lm", None
    else:
        g, data = build(a.model, a.samples, 13)
        loss, options = LOSS.get(a.model, ("cross-entropy", None))
    if a.lora:
        g = lora.add_adapters(g, a.lora, alpha=2.0 * a.lora)
        rng = np.random.default_rng(2)
        for ad in lora.config(g)["adapters"]:  # B = 0 would leave every A's gradient zero
            g.initializers[ad["B"]] = rng.normal(0, 0.1, g.initializers[ad["B"]].shape).astype(np.float32)
    how = schedule_options(a.schedule, a.warmup_steps, 0.001 if a.schedule != "constant" else 0.0, a.clip_grad_norm)
    if distributed:
        how.update(shard=a.shard, bucket_mb=a.bucket_bytes / 2**20)
    tr = rg.Trainer(g, loss, make_optimizer(**OPTIMIZERS[a.optimizer]), threads=1, distributed=distributed,
                    loss_options=options, **how)
    return tr, data


def deep_mlp(layers: int, width: int, samples: int) -> tuple[rg.Graph, dict]:
    """``x [N, width] -> (Gemm, Relu) x layers -> Gemm -> 10 classes`` (torch.nn.Linear's initialization) and its
    data."""
    from revgraph.ir import Graph, Node, ValueInfo

    rng = np.random.default_rng(7)
    nodes, h, init = [], "x", {}
    for i in range(layers + 1):
        cols = 10 if i == layers else width
        init[f"W{i}"] = rng.uniform(-width ** -0.5, width ** -0.5, (width, cols)).astype(np.float32)
        init[f"b{i}"] = rng.uniform(-width ** -0.5, width ** -0.5, (cols,)).astype(np.float32)
        nodes.append(Node("Gemm", [h, f"W{i}", f"b{i}"], [f"z{i}"], {}, f"layer{i}/gemm"))
        h = f"z{i}"
        if i < layers:
            nodes.append(Node("Relu", [h], [f"h{i}"], {}, f"layer{i}/relu"))
            h = f"h{i}"
    g = Graph(nodes, [ValueInfo("x", np.float32, ("N", width))], [ValueInfo(h, np.float32, ("N", 10))], init)
    return g, {"x": rng.standard_normal((samples, width)).astype(np.float32),
               "labels": rng.integers(0, 10, samples).astype(np.int64)}


def fit(tr: rg.Trainer, data: dict, a: argparse.Namespace, world: int = 1, checkpoint_dir=None):
    """Train ``a.epochs`` epochs of global batches ``a.batch_size`` (``world`` processes share each)."""
    return tr.fit(data, a.epochs, a.batch_size // world, seed=3, progress=False, accumulate_steps=a.accumulate_steps,
                  checkpoint_dir=checkpoint_dir)


def main() -> None:
    a = parser().parse_args()
    tr, data = setup(a, True)
    built = numpy_bytes(tr)  # host arrays the trainer holds (ZeRO-3: no full copy of the parameters)
    fit(tr, data, a, int(os.environ["WORLD_SIZE"]), a.checkpoint_dir)
    fitted = numpy_bytes(tr)  # (rank 0: and the trained parameters it writes the model from)
    try:
        written = len(tr._written())  # rank 0 alone
    except rg.RevgraphError as exc:
        written = str(exc)
    held = tr._engine.held()
    units = getattr(tr._engine, "units", [])
    stages = getattr(getattr(tr._engine, "schedule", None), "stages", [])
    np.savez(os.path.join(a.out, f"rank{tr.rank}.npz"), **tr.parameters, **tr.state, losses=np.array(tr.losses),
             **{f"held:{k}": np.array(v) for k, v in held.items()},
             units=np.array([[u.length, u.k, u.used] for u in units]).reshape(-1, 3), stages=np.array(len(stages)),
             most=np.array(max([len(s.units) for s in stages] or [0])),
             slots=np.array(getattr(getattr(tr._engine, "schedule", None), "slots", 0)),
             arrays_built=np.array(built), arrays_fitted=np.array(fitted), written=np.array(written))
    tr.comm.close()


if __name__ == "__main__":
    main()
