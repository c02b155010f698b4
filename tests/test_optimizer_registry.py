"""Optimizers are classes in a registry (issue 29): each :class:`revgraph.train.optimizers.Method` carries its slots
and its update as graph nodes, and the CLI, the argument checks and the snapshot checks read the registry. A new
optimizer is one class: Lion (Chen et al. 2023, "Symbolic discovery of optimization algorithms"), registered
here, trains like its formulas written in numpy and shows up in ``revgraph train --optimizer``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit.training import mlp, torch_mlp

import revgraph as rg
from revgraph import train as T
from revgraph.cli import _parser
from revgraph.errors import RevgraphError
from revgraph.train import optimizers


class Lion(optimizers.Method):
    """``c = b1 m + (1 - b1) g``; ``p' = p (1 - lr wd) - lr sign(c)``; ``m' = b2 m + (1 - b2) g``."""

    name = "lion"
    hyperparameters = ("betas",)
    defaults = {"lr": 1e-4, "weight_decay": 0.0}  # noqa: RUF012 (as Method's)
    decay = "decoupled decay"

    def slots(self, opt):
        return ("m",)

    def update(self, step, p, g, state):
        b, (b1, b2) = step.b, step.opt.betas
        p = step.decoupled(p)
        c = b.op("Add", [b.op("Mul", [step.c(b1), state[0]]), b.op("Mul", [step.c(1.0 - b1), g])])
        new_p = b.op("Sub", [p, b.op("Mul", [step.lr(), b.op("Sign", [c])])])
        m = b.op("Add", [b.op("Mul", [step.c(b2), state[0]]), b.op("Mul", [step.c(1.0 - b2), g])])
        return new_p, [m]


@pytest.fixture
def lion():
    optimizers.register(Lion)
    try:
        yield
    finally:
        del optimizers.OPTIMIZERS["lion"]


def _torch_lion(params0, batches, lr, betas, wd):
    P = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params0.items()}
    m = {k: torch.zeros_like(v) for k, v in P.items()}
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(torch_mlp(P, torch.tensor(x)), torch.tensor(y))
        grads = torch.autograd.grad(loss, list(P.values()))
        with torch.no_grad():
            for (k, p), g in zip(P.items(), grads, strict=True):
                c = betas[0] * m[k] + (1 - betas[0]) * g
                p.mul_(1 - lr * wd).sub_(lr * torch.sign(c))
                m[k] = betas[1] * m[k] + (1 - betas[1]) * g
    return {k: v.detach().numpy() for k, v in P.items()}


def test_a_registered_optimizer_trains_as_its_formulas(lion):
    rng = np.random.default_rng(4)
    g = mlp(rng, dtype=np.float64)
    batches = [(rng.normal(0, 1, (16, 6)), rng.integers(0, 3, 16)) for _ in range(10)]
    opt = T.Optimizer("lion", lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, no_decay="none")
    assert opt.slots == ("m",) and isinstance(opt.method, Lion)
    trainer = rg.Trainer(g, "cross-entropy", opt, threads=1)
    for b in batches:
        trainer.step(b)
    theirs = _torch_lion(g.initializers, batches, 0.01, (0.9, 0.99), 0.1)
    for k, ref in theirs.items():
        np.testing.assert_allclose(trainer.parameters[k], ref, rtol=1e-10, atol=1e-12, err_msg=k)
        assert np.abs(ref - g.initializers[k]).max() > 0.05  # (it moved)
    assert set(trainer.state) == {f"{p}.m" for p in g.initializers}


def test_the_cli_and_make_optimizer_read_the_registry(lion):
    args = _parser().parse_args(["train", "m.onnx", "--data", "d.npz", "--loss", "mse", "--epochs", "1",
                                      "-o", "o.onnx", "--optimizer", "lion"])
    assert args.optimizer == "lion"
    opt = T.make_optimizer("lion")
    assert (opt.kind, opt.lr, opt.weight_decay) == ("lion", 1e-4, 0.0)
    with pytest.raises(RevgraphError, match="--momentum applies to sgd only; lion uses betas"):
        T.make_optimizer("lion", momentum=0.9)
    with pytest.raises(RevgraphError, match="momentum applies to sgd only"):
        T.Optimizer("adamw", lr=0.1, momentum=0.5)
    commands = next(a for a in _parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    train = commands.choices["train"]
    helps = {a.dest: a.help for a in train._actions}
    assert "0.0001 for lion" in helps["lr"] and "decoupled decay (adamw, lion" in helps["weight_decay"]
    with pytest.raises(RevgraphError, match="'sgd', 'adam', 'adamw', 'lion'"):
        rg.Trainer(mlp(np.random.default_rng(0)), "cross-entropy", 3)


def test_builtin_registry_and_construction_by_kind():
    """``Optimizer(kind=...)`` keeps working: the kind names the class that carries the behaviour."""
    assert list(optimizers.OPTIMIZERS)[:3] == ["sgd", "adam", "adamw"]  # (the built-ins first; tests add more)
    assert isinstance(T.Optimizer(kind="adam", lr=0.1).method, optimizers.Adam)
    assert T.Optimizer("sgd", 0.1).slots == () and T.Optimizer("sgd", 0.1, momentum=0.9).slots == ("momentum",)
    assert T.Optimizer("adamw", 0.1).slots == ("m", "v")
    assert optimizers.OPTIMIZERS["adam"].nonnegative == {"v": "Adam's second moment"}
    assert T.make_optimizer("adamw") == T.adamw() and T.make_optimizer("sgd", momentum=0.5) == T.sgd(momentum=0.5)
    with pytest.raises(RevgraphError, match="unknown optimizer 'lion'; choose one of sgd, adam, adamw"):
        T.Optimizer("lion", lr=0.1)
    with pytest.raises(RevgraphError, match="unknown optimizer"):
        T.Optimizer(["adam"], lr=0.1)
