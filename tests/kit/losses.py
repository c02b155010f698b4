"""Losses for tests: the tiny LM in PyTorch and a model that computes its own loss."""

from __future__ import annotations

import numpy as np
import torch

from kit.lossdata_models import D, T
from revgraph.ir import Graph, Node, ValueInfo


def torch_lm(params: dict, ids: torch.Tensor) -> torch.Tensor:
    """kit.lossdata_models' tiny LM (causal self-attention, a residual, the output projection) in PyTorch: logits."""
    h = params["E"][ids]
    s = (h @ params["Wq"]) @ (h @ params["Wk"]).transpose(1, 2) / np.sqrt(D)
    s = s + torch.triu(torch.full((T, T), -1e9, dtype=h.dtype), 1)
    return (torch.softmax(s, -1) @ (h @ params["Wv"]) + h) @ params["Wo"]


def own_loss_model() -> Graph:
    """x [N, 3], t [N] -> pred = x @ w -> its own loss: mean((pred - t)^2) as the output 'loss' (and 'pred')."""
    inits = {"w": np.array([[0.5], [-1.0], [0.25]], np.float32), "shape": np.array([-1], np.int64)}
    nodes = [Node("MatMul", ["x", "w"], ["p2"], {}, "mm"), Node("Reshape", ["p2", "shape"], ["pred"], {}, "flat"),
             Node("Sub", ["pred", "t"], ["d"], {}, "sub"), Node("Mul", ["d", "d"], ["sq"], {}, "sq"),
             Node("ReduceMean", ["sq"], ["loss"], {"keepdims": 0}, "mean")]
    return Graph(nodes, [ValueInfo("x", np.float32, ("N", 3)), ValueInfo("t", np.float32, ("N",))],
                 [ValueInfo("pred", np.float32, ("N",)), ValueInfo("loss", np.float32, ())], inits, name="own")
