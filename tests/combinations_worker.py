"""tests/distributed_worker.py with two more models for tests/test_finetune_combinations.py (torchrun starts it
the same way): ``lmpad``, the tiny causal LM trained on its own ``input_ids`` whose right padding is token 0,
not counted (``ignore_index=0``); ``own``, a model whose scalar output ``loss`` is the loss (``output:loss``,
no labels). The other models and every option are distributed_worker's."""

from __future__ import annotations

import distributed_worker as worker
import numpy as np
from kit import lossdata_models

from revgraph.ir import Graph, Node, ValueInfo

worker.LOSS["lmpad"] = ("causal-lm", {"ignore_index": 0})
worker.LOSS["own"] = ("output:loss", None)
_build = worker.build


def own_loss_model() -> Graph:
    """x [N, 3], t [N] -> pred = tanh(x @ W1) @ w2 -> its own loss mean((pred - t)^2), the scalar output 'loss'."""
    rng = np.random.default_rng(21)
    inits = {"W1": (rng.standard_normal((3, 4)) / 2).astype(np.float32),
             "w2": (rng.standard_normal((4, 1)) / 2).astype(np.float32), "shape": np.array([-1], np.int64)}
    nodes = [Node("MatMul", ["x", "W1"], ["h"], {}, "mm1"), Node("Tanh", ["h"], ["a"], {}, "tanh"),
             Node("MatMul", ["a", "w2"], ["p2"], {}, "mm2"), Node("Reshape", ["p2", "shape"], ["pred"], {}, "flat"),
             Node("Sub", ["pred", "t"], ["d"], {}, "sub"), Node("Mul", ["d", "d"], ["sq"], {}, "sq"),
             Node("ReduceMean", ["sq"], ["loss"], {"keepdims": 0}, "mean")]
    return Graph(nodes, [ValueInfo("x", np.float32, ("N", 3)), ValueInfo("t", np.float32, ("N",))],
                 [ValueInfo("pred", np.float32, ("N",)), ValueInfo("loss", np.float32, ())], inits, name="own")


def build(model: str, samples: int, hidden: int = 16):
    if model == "lmpad":  # tokens 1..10, right padding with 0 (2 to 6 real tokens per row)
        rng = np.random.default_rng(22)
        ids = rng.integers(1, lossdata_models.V, (samples, lossdata_models.T))
        for i, m in enumerate(rng.integers(2, lossdata_models.T + 1, samples)):
            ids[i, m:] = 0
        return lossdata_models.tiny_lm(), {"input_ids": ids}
    if model == "own":
        rng = np.random.default_rng(23)
        x = rng.standard_normal((samples, 3)).astype(np.float32)
        return own_loss_model(), {"x": x, "t": np.sin(x.sum(1)).astype(np.float32)}
    return _build(model, samples, hidden)


worker.build = build


def scaled_trainer(distributed: bool):
    """tests/precision_worker.py's fp16 run (a loss scale of 2^127 that overflows float32: skips, back-offs,
    growth) with clipping and a cosine schedule with warmup."""
    import warnings

    import precision_worker

    import revgraph as rg
    from revgraph.train import adam
    from revgraph.train.precision import Precision
    from revgraph.train.schedules import Schedule

    g, data = precision_worker.scaled_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no product: "the whole step runs in float32")
        tr = rg.Trainer(g, "cross-entropy", adam(lr=1e-2), threads=1, distributed=distributed,
                        precision=Precision("fp16", **precision_worker.SCALING), clip_grad_norm=2.0,
                        schedule=Schedule("cosine", warmup_steps=2, min_lr=1e-3))
    return tr, data


def scaled_main(out: str) -> None:
    """2 processes x batch 2 x 2 accumulated micro-batches of :func:`scaled_trainer`, written to rank<r>.npz."""
    import os

    tr, data = scaled_trainer(True)
    tr.fit(data, 2, 2, seed=3, progress=False, accumulate_steps=2)
    s = tr.spec.scaling
    carried = tr._engine.read([s.scale, s.growth, tr.spec.step])
    np.savez(os.path.join(out, f"rank{tr.rank}.npz"), **tr.parameters, **tr.state, **carried,
             losses=np.array(tr.losses))
    tr.comm.close()


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--fp16"]:
        scaled_main(sys.argv[3])
    else:
        worker.main()
