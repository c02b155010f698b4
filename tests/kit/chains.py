"""A deep chain of layers for the memory planner's tests: ``h_l = tanh(h_(l-1) @ w_l)``, then ``sum``."""

from __future__ import annotations

import numpy as np

from revgraph.ir import Graph, Node, ValueInfo


def tanh_chain(layers: int, width: int, rows: int | str, extra=None, scale: float = 4.0) -> Graph:
    """``x [rows, width] -> (MatMul w_l -> Tanh) x layers -> ReduceSum`` (or ``extra(last value)``'s nodes, which
    must write ``loss``): the backward reads each Tanh output ``h_l`` (Tanh's VJP, 1 - h^2, and the next MatMul's
    weight gradient, h^T g), and ``x`` (an input: never a residual). Weights: seeded normal / ``scale``."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], {}, "x"
    for k in range(layers):
        inits[f"w{k}"] = (rng.standard_normal((width, width)) / scale).astype(np.float32)
        nodes += [Node("MatMul", [x, f"w{k}"], [f"m{k}"], name=f"mm{k}"),
                  Node("Tanh", [f"m{k}"], [f"h{k}"], name=f"act{k}")]
        x = f"h{k}"
    nodes += extra(x) if extra else [Node("ReduceSum", [x], ["loss"], {"keepdims": 0}, name="sum")]
    return Graph(nodes, [ValueInfo("x", np.float32, (rows, width))], [ValueInfo("loss", np.float32, ())], inits)
