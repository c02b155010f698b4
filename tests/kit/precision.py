"""Mixed-precision models for tests: a small MLP and its torch.autocast twin, batches, the step graph run on onnx's
reference evaluator, and a model without products (loss scaling alone)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F32 = np.float32
D, H, C, N = 12, 16, 5, 32
#: parameters after 20 Adam steps with lr 1e-2: one flipped 16-bit rounding (module doc)
ATOL = {"bf16": 4e-5, "fp16": 1e-5}


def mlp(rng) -> Graph:
    """Gemm (bias) -> LayerNormalization -> Tanh -> MatMul -> Add: products, a normalization, an elementwise op."""
    P = {"W1": rng.uniform(-.3, .3, (H, D)).astype(F32), "b1": rng.uniform(-.3, .3, (H,)).astype(F32),
         "g": (1 + .1 * rng.standard_normal(H)).astype(F32), "beta": (.1 * rng.standard_normal(H)).astype(F32),
         "W2": rng.uniform(-.3, .3, (H, C)).astype(F32), "b2": rng.uniform(-.3, .3, (C,)).astype(F32)}
    nodes = [Node("Gemm", ["x", "W1", "b1"], ["z1"], {"transB": 1}, "gemm"),
             Node("LayerNormalization", ["z1", "g", "beta"], ["n1"], {"axis": -1}, "ln"),
             Node("Tanh", ["n1"], ["h"], name="tanh"),
             Node("MatMul", ["h", "W2"], ["a2"], name="mm"), Node("Add", ["a2", "b2"], ["logits"], name="add")]
    return Graph(nodes, [ValueInfo("x", F32, ("N", D))], [ValueInfo("logits", F32, ("N", C))], P)


def torch_mlp(T, x, low):
    """The autocast forward with revgraph.train.precision's casts written out (module doc)."""
    with torch.autocast("cpu", dtype=low):
        z1 = F.linear(x, T["W1"]).float() + T["b1"]
        h = torch.tanh(F.layer_norm(z1, (H,), T["g"], T["beta"], eps=1e-5))
        return (h @ T["W2"]).float() + T["b2"]


def batches(rng, shape, steps_=20, n=N):
    """``steps_`` random batches of ``n`` inputs of ``shape`` and labels in ``range(C)``."""
    return [(rng.standard_normal((n, *shape)).astype(F32), rng.integers(0, C, n)) for _ in range(steps_)]


def reference_train(tg, data):
    """The step graph run step after step on onnx's reference evaluator, its carried outputs fed back."""
    sess = rg.Session(tg.graph, backend="reference")
    feeds = tg.initial_state()
    names = [o.name for o in tg.graph.outputs]
    losses, scales = [], []
    for x, y in data:
        out = sess.run({**feeds, tg.inputs[0]: x, tg.labels: y}, names)
        losses.append(float(out[names[0]]))
        feeds.update({i: out[o] for i, o in tg.carried()})
        if tg.scaling is not None:
            scales.append(float(feeds[tg.scaling.scale]))
    return feeds, losses, scales


def scaled_linear(rng):
    """A model with no product: fp16 precision is then loss scaling alone, computed in float32 (the same on
    onnxruntime's CPU and the reference evaluator)."""
    return Graph([Node("Mul", ["x", "w"], ["logits"], name="mul")], [ValueInfo("x", F32, ("N", C))],
                 [ValueInfo("logits", F32, ("N", C))], {"w": rng.uniform(0.5, 1.5, C).astype(F32)})
