"""A training process for tests/test_precision.py, started by torchrun: fp16 loss scaling data-parallel. Trains
:func:`scaled_model` (no product, so the step computes in float32 on onnxruntime's CPU and only the loss scaling
is fp16's) with a loss scale of 2^127, which overflows float32 itself: steps are skipped and the scale backs off
and grows. Writes this rank's parameters, state, loss scale and losses to ``<out>/rank<r>.npz``. Run as
``torchrun --nproc-per-node 2 tests/precision_worker.py --out DIR``."""

from __future__ import annotations

import argparse
import os

import numpy as np

import revgraph as rg
import revgraph.train.distributed.data_parallel
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.train import adam
from revgraph.train.precision import Precision

CLASSES, SAMPLES = 5, 48
#: the loss scaling of the run: 2^127 overflows float32 in the backward; growth after 2 good steps
SCALING = {"init_scale": 2.0 ** 127, "growth_interval": 2}


def scaled_model() -> tuple[Graph, dict[str, np.ndarray]]:
    """``logits = x * w`` (``w`` [5]) and its data: inputs of magnitude 4 to 8, so scaled gradients overflow."""
    rng = np.random.default_rng(6)
    w = rng.uniform(0.5, 1.5, CLASSES).astype(np.float32)
    g = Graph([Node("Mul", ["x", "w"], ["logits"], name="mul")], [ValueInfo("x", np.float32, ("N", CLASSES))],
              [ValueInfo("logits", np.float32, ("N", CLASSES))], {"w": w})
    x = (rng.uniform(4, 8, (SAMPLES, CLASSES)) * rng.choice([-1, 1], (SAMPLES, CLASSES))).astype(np.float32)
    return g, {"x": x, "labels": rng.integers(0, CLASSES, SAMPLES)}


def trainer(distributed: bool) -> tuple[rg.Trainer, dict]:
    import warnings

    g, data = scaled_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no product: "the whole step runs in float32")
        tr = rg.Trainer(g, "cross-entropy", adam(lr=1e-2), threads=1, distributed=distributed,
                        precision=Precision("fp16", **SCALING))
    return tr, data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    tr, data = trainer(True)
    tr.fit(data, 2, 4, seed=3, progress=False)
    s = tr.spec.scaling
    carried = tr._engine.read([s.scale, s.growth, tr.spec.step])
    np.savez(os.path.join(a.out, f"rank{tr.rank}.npz"), **tr.parameters, **tr.state, **carried,
             losses=np.array(tr.losses))
    tr.comm.close()


if __name__ == "__main__":
    main()
