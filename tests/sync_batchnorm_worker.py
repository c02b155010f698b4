"""A training process for tests/test_sync_batchnorm.py, started by torchrun: trains :func:`bn_model` (a small
convolutional network with two training-mode BatchNormalization layers) data-parallel, with or without
``sync_batchnorm``, and writes this rank's parameters (BatchNormalization scale, bias and running statistics
included), optimizer state and losses to ``<out>/rank<r>.npz``. Run as
``torchrun --nproc-per-node 2 tests/sync_batchnorm_worker.py --out DIR [--sync]``."""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.train import make_optimizer

CHANNELS, SIDE, HIDDEN, CLASSES = 2, 4, 6, 3


def bn_model(seed: int = 0) -> Graph:
    """``x`` float32 ``[N, 2, 4, 4]`` -> Conv 3x3 (3 channels, no bias) -> BatchNormalization ``bn_conv`` (training
    mode, over N, H, W) -> Relu -> Flatten -> Gemm (6, no bias) -> BatchNormalization ``bn_fc`` (training mode, over N)
    -> Relu
    -> Gemm -> logits ``[N, 3]``. Each BatchNormalization writes its running statistics (three outputs, as
    ``torch.onnx.export(..., training=TrainingMode.TRAINING)`` writes them); momentum 0.9 and 0.7. No bias before a
    normalization (as in ResNets): its gradient is zero but for rounding, which Adam would turn into steps."""
    rng = np.random.default_rng(seed)
    f = np.float32
    inits = {"conv.w": (rng.standard_normal((3, CHANNELS, 3, 3)) / 4).astype(f),
             "bn_conv.scale": (1 + rng.standard_normal(3) / 4).astype(f),
             "bn_conv.bias": (rng.standard_normal(3) / 4).astype(f),
             "bn_conv.mean": (rng.standard_normal(3) / 4).astype(f), "bn_conv.var": (1 + rng.random(3)).astype(f),
             "fc.w": (rng.standard_normal((3 * SIDE * SIDE, HIDDEN)) / 7).astype(f),
             "bn_fc.scale": (1 + rng.standard_normal(HIDDEN) / 4).astype(f),
             "bn_fc.bias": (rng.standard_normal(HIDDEN) / 4).astype(f),
             "bn_fc.mean": np.zeros(HIDDEN, f), "bn_fc.var": np.ones(HIDDEN, f),
             "head.w": (rng.standard_normal((HIDDEN, CLASSES)) / 3).astype(f), "head.b": np.zeros(CLASSES, f)}
    nodes = [Node("Conv", ["x", "conv.w"], ["c"], {"pads": [1, 1, 1, 1]}, "conv"),
             Node("BatchNormalization", ["c", "bn_conv.scale", "bn_conv.bias", "bn_conv.mean", "bn_conv.var"],
                  ["cn", "bn_conv.mean.out", "bn_conv.var.out"], {"training_mode": 1, "momentum": 0.9}, "bn_conv"),
             Node("Relu", ["cn"], ["cr"], {}, "relu1"),
             Node("Flatten", ["cr"], ["flat"], {}, "flatten"),
             Node("Gemm", ["flat", "fc.w"], ["h"], {}, "fc"),
             Node("BatchNormalization", ["h", "bn_fc.scale", "bn_fc.bias", "bn_fc.mean", "bn_fc.var"],
                  ["hn", "bn_fc.mean.out", "bn_fc.var.out"], {"training_mode": 1, "momentum": 0.7, "epsilon": 1e-3},
                  "bn_fc"),
             Node("Relu", ["hn"], ["hr"], {}, "relu2"),
             Node("Gemm", ["hr", "head.w", "head.b"], ["logits"], {}, "head")]
    return Graph(nodes, [ValueInfo("x", np.float32, ("N", CHANNELS, SIDE, SIDE))],
                 [ValueInfo("logits", np.float32, ("N", CLASSES))], inits, name="bn_convnet")


def data(samples: int) -> dict[str, np.ndarray]:
    """Deterministic inputs (not centred: the statistics matter) and labels."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((samples, CHANNELS, SIDE, SIDE)) * 1.5 + 0.5).astype(np.float32)
    return {"x": x, "labels": rng.integers(0, CLASSES, samples)}


def trainer(optimizer: str, distributed: bool, sync: bool = False, buffers: str = "one") -> rg.Trainer:
    opt = make_optimizer(optimizer, lr=0.02, momentum=0.9 if optimizer == "sgd" else None)
    return rg.Trainer(bn_model(), "cross-entropy", opt, threads=1, distributed=distributed, sync_batchnorm=sync,
                      buffers=buffers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--samples", type=int, default=37)
    p.add_argument("--batch-size", type=int, default=6)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--buffers", default="one")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = trainer(a.optimizer, True, a.sync, a.buffers)
    with open(os.path.join(a.out, f"warnings{tr.rank}.txt"), "w") as f:
        f.write("\n".join(str(w.message) for w in caught))
    means = tr.fit(data(a.samples), a.epochs, a.batch_size, seed=3, progress=False)
    ev = tr.evaluate(data(a.samples))
    np.savez(os.path.join(a.out, f"rank{tr.rank}.npz"), **tr.parameters, **tr.state, losses=np.array(tr.losses),
             means=np.array(means), world=np.array(tr.world_size), eval_loss=np.array(ev["loss"]))
    tr.comm.close()


if __name__ == "__main__":
    main()
