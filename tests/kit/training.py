"""Training for tests: small models, the optimizers with their PyTorch twins, and training the same steps in PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from revgraph import train as T
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.train import optimizers

F32 = np.float32


@dataclass(frozen=True)
class Twin:
    """A registered optimizer's reference: ``make(opt, params)``, PyTorch's optimizer with ``opt``'s
    hyperparameters over ``params`` (a list of tensors or of parameter groups), and ``per_tensor``, the nodes its
    update takes per tensor, counted by hand from its formulas (weight decay on, as :func:`optimizer_for_tests`).
    ``lazy(opt, tables)``: PyTorch's optimizer of the gathered tables' sparse gradients that the lazy row update
    (``embedding_update="lazy"``) equals (``None``: plain SGD, the row update without state)."""

    make: Callable
    per_tensor: int
    lazy: Callable | None = None


#: The PyTorch twin of each registered optimizer (a test that registers one adds its twin: no list to edit).
TWINS: dict[str, Twin] = {
    # v' = momentum v + (g + wd p); p' = p - lr v': Mul, Add (the L2 term), Mul, Add, Mul, Sub
    "sgd": Twin(lambda o, ps: torch.optim.SGD(ps, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay), 6),
    # 12 elementwise passes plus Mul, Add for the L2 term
    "adam": Twin(lambda o, ps: torch.optim.Adam(ps, lr=o.lr, betas=o.betas, eps=o.eps,
                                                weight_decay=o.weight_decay), 14,
                 lambda o, ts: torch.optim.SparseAdam(ts, lr=o.lr, betas=o.betas, eps=o.eps)),
    # 12 passes plus the decoupled decay's Mul
    "adamw": Twin(lambda o, ps: torch.optim.AdamW(ps, lr=o.lr, betas=o.betas, eps=o.eps,
                                                  weight_decay=o.weight_decay), 13),
}


def optimizer_for_tests(name: str, **settings) -> T.Optimizer:
    """The registered optimizer ``name`` with test hyperparameters read from its registry entry: ten times its
    default learning rate, weight decay 0.1 (decoupled) or 0.01 (L2 penalty), momentum 0.9 where it takes one,
    and weight decay on every parameter unless ``settings`` say otherwise."""
    method = optimizers.OPTIMIZERS[name]
    extra = {"momentum": 0.9} if "momentum" in method.hyperparameters else {}
    wd = 0.1 if method.decay == "decoupled decay" else 0.01
    return T.make_optimizer(name, lr=10 * method.defaults["lr"], weight_decay=wd,
                            **{"no_decay": "none", **extra, **settings})


#: Every registered optimizer (at import) with :func:`optimizer_for_tests`' hyperparameters.
OPTIMIZERS = {name: optimizer_for_tests(name) for name in optimizers.OPTIMIZERS}


def torch_optimizer(opt: T.Optimizer, params: list) -> torch.optim.Optimizer:
    """PyTorch's optimizer with ``opt``'s hyperparameters over ``params`` (:data:`TWINS`)."""
    return TWINS[opt.kind].make(opt, params)


TORCH_LOSS = {
    "cross-entropy": F.cross_entropy,
    "mse": F.mse_loss,
    "bce": F.binary_cross_entropy_with_logits,
}


def torch_train(params0, forward, loss, opt, batches, sparse=()):
    """Train with PyTorch; ``forward(P, x)`` gives the model output. Returns the parameters and the losses.
    Tables named in ``sparse`` get sparse gradients and the twin's lazy optimizer (:class:`Twin`)."""
    P = {k: torch.tensor(v, requires_grad=True) for k, v in params0.items()}
    dense = [P[k] for k in P if k not in sparse]
    opts = [torch_optimizer(opt, dense)]
    if sparse:
        tables = [P[k] for k in sparse]
        lazy = TWINS[opt.kind].lazy
        opts.append(lazy(opt, tables) if lazy else torch.optim.SGD(tables, lr=opt.lr))
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
