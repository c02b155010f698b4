"""Training for tests: small models, the optimizers with their PyTorch twins, and training the same steps in PyTorch."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from revgraph import train as T
from revgraph.ir import Graph, Node, ValueInfo

F32 = np.float32
OPTIMIZERS = {
    "sgd": T.sgd(lr=0.1, momentum=0.9, weight_decay=0.01, no_decay="none"),
    "adam": T.adam(lr=0.01, weight_decay=0.01, no_decay="none"),
    "adamw": T.adamw(lr=0.01, weight_decay=0.1, no_decay="none"),
}


def torch_optimizer(opt: T.Optimizer, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """PyTorch's optimizer with ``opt``'s hyperparameters over ``params``."""
    if opt.kind == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    cls = torch.optim.Adam if opt.kind == "adam" else torch.optim.AdamW
    return cls(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)


TORCH_LOSS = {
    "cross-entropy": F.cross_entropy,
    "mse": F.mse_loss,
    "bce": F.binary_cross_entropy_with_logits,
}


def torch_train(params0, forward, loss, opt, batches, sparse=()):
    """Train with PyTorch; ``forward(P, x)`` gives the model output. Returns the parameters and the losses.
    Tables named in ``sparse`` get sparse gradients and torch.optim.SparseAdam (Adam) or SGD (plain SGD)."""
    P = {k: torch.tensor(v, requires_grad=True) for k, v in params0.items()}
    dense = [P[k] for k in P if k not in sparse]
    opts = [torch_optimizer(opt, dense)]
    if sparse:
        tables = [P[k] for k in sparse]
        opts.append(torch.optim.SparseAdam(tables, lr=opt.lr, betas=opt.betas, eps=opt.eps) if opt.kind == "adam"
                    else torch.optim.SGD(tables, lr=opt.lr))
    losses = []
    for x, y in batches:
        for o in opts:
            o.zero_grad()
        value = TORCH_LOSS[loss](forward(P, torch.tensor(x)), torch.tensor(y))
        value.backward()
        for o in opts:
            o.step()
        losses.append(float(value.detach()))
    return {k: v.detach().numpy() for k, v in P.items()}, losses


def assert_params_close(ours, theirs, rtol=1e-4):
    """Equal within ``rtol`` relative to each tensor's largest magnitude (elementwise relative error is
    meaningless for entries that pass through zero)."""
    for k, ref in theirs.items():
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(ours[k], ref, rtol=rtol, atol=rtol * scale, err_msg=k)


def mlp(rng, din=6, hidden=8, out=3, dtype=F32):
    """x [N, din] -> MatMul, Add -> Tanh -> MatMul, Add -> y [N, out], random weights from ``rng``."""
    inits = {"W1": rng.normal(0, 0.5, (din, hidden)).astype(dtype), "b1": rng.normal(0, 0.1, hidden).astype(dtype),
             "W2": rng.normal(0, 0.5, (hidden, out)).astype(dtype), "b2": rng.normal(0, 0.1, out).astype(dtype)}
    nodes = [Node("MatMul", ["x", "W1"], ["a"], name="mm1"), Node("Add", ["a", "b1"], ["z"], name="add1"),
             Node("Tanh", ["z"], ["h"], name="tanh"), Node("MatMul", ["h", "W2"], ["o"], name="mm2"),
             Node("Add", ["o", "b2"], ["y"], name="add2")]
    return Graph(nodes, [ValueInfo("x", dtype, ("N", din))], [ValueInfo("y", dtype, ("N", out))], inits, name="mlp")


def torch_mlp(P, x):
    """:func:`mlp` in PyTorch with the parameters ``P``."""
    return torch.tanh(x @ P["W1"] + P["b1"]) @ P["W2"] + P["b2"]


def embedding_model(rng, rows=12, dim=4, out=3):
    """ids int64 [N, L] -> mean of the gathered rows of E [rows, dim] -> Gemm -> logits [N, out]."""
    inits = {"E": rng.normal(0, 1, (rows, dim)).astype(F32), "Wo": rng.normal(0, 0.5, (dim, out)).astype(F32),
             "bo": np.zeros(out, F32), "axis1": np.array([1], np.int64)}
    nodes = [Node("Gather", ["E", "ids"], ["emb"], name="embed"),
             Node("ReduceMean", ["emb", "axis1"], ["pooled"], {"keepdims": 0}, name="pool"),
             Node("Gemm", ["pooled", "Wo", "bo"], ["logits"], name="head")]
    return Graph(nodes, [ValueInfo("ids", np.int64, ("N", 5))], [ValueInfo("logits", F32, ("N", out))], inits)
