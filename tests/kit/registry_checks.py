"""Generic checks of a registered optimizer or loss against its PyTorch twin (:data:`kit.training.TWINS`,
:data:`kit.training.TORCH_LOSS`). The generic tests run them over the registries (tests/test_train.py); a test
that registers a new entry calls them on it (tests/test_registries_open.py), so a new optimizer, loss or
schedule (:mod:`kit.schedules`) is checked with no list edited."""

from __future__ import annotations

import numpy as np
import pytest

import revgraph as rg
from revgraph import train as T
from revgraph.train import update_nodes

from .training import F32, TWINS, assert_params_close, mlp, torch_mlp, torch_train

#: Label makers of the losses whose labels are neither class indices nor any float (default: normal floats,
#: or class indices for a loss with ``LossKind.classes``)
LABELS = {"bce": lambda rng, n, out: (rng.random((n, out)) < 0.5).astype(F32)}


def labels_for(loss: str, rng, n: int, out: int) -> np.ndarray:
    """Labels of ``n`` samples of ``out`` outputs for the registered ``loss``."""
    if loss in LABELS:
        return LABELS[loss](rng, n, out)
    if T.LOSSES[loss].classes:
        return rng.integers(0, out, n)
    return rng.normal(0, 1, (n, out)).astype(F32)


def make_batches(rng, loss: str, n_batches=4, size=16, din=6, out=3) -> list:
    """``n_batches`` random ``(x, labels)`` batches for :func:`kit.training.mlp`."""
    return [(rng.normal(0, 1, (size, din)).astype(F32), labels_for(loss, rng, size, out)) for _ in range(n_batches)]


def check_trains_like_torch(opt: T.Optimizer, loss: str = "cross-entropy", steps: int = 20) -> None:
    """20 steps of the float32 MLP with ``opt`` and ``loss``: the losses and parameters equal PyTorch's (the
    optimizer's twin, the loss's ``torch.nn.functional``), and the parameters moved."""
    rng = np.random.default_rng(0)
    g = mlp(rng)
    batches = make_batches(rng, loss)
    schedule = [batches[k % len(batches)] for k in range(steps)]
    trainer = rg.Trainer(g, loss=loss, optimizer=opt)
    ours = [trainer.step(b) for b in schedule]
    theirs, torch_losses = torch_train(g.initializers, torch_mlp, loss, opt, schedule)
    assert trainer.steps == steps
    np.testing.assert_allclose(ours, torch_losses, rtol=1e-4)
    assert_params_close(trainer.parameters, theirs)
    moved = max(float(np.abs(theirs[k] - g.initializers[k]).max()) for k in theirs)
    assert moved > 0.05  # the parameters did change: the comparison is not between two initial states


def check_float64_to_rounding(opt: T.Optimizer, steps: int = 20) -> None:
    """In float64 the only differences from PyTorch left are rounding: the formulas are the same, term by term."""
    rng = np.random.default_rng(14)
    g = mlp(rng, dtype=np.float64)
    schedule = [(rng.normal(0, 1, (16, 6)), rng.integers(0, 3, 16)) for _ in range(steps)]
    trainer = rg.Trainer(g, "cross-entropy", opt)
    for b in schedule:
        trainer.step(b)
    theirs, _ = torch_train(g.initializers, torch_mlp, "cross-entropy", opt, schedule)
    assert_params_close(trainer.parameters, theirs, rtol=1e-10)
    assert trainer.parameters["W1"].dtype == np.float64


def check_update_nodes(opt: T.Optimizer) -> None:
    """The update's outputs are named by the nodes that compute them (no Identity copies), with the names of
    old, and each tensor's update is its twin's hand-counted number of nodes (:class:`kit.training.Twin`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(update_nodes, "GROUP_ELEMENTS", 0)  # one update per tensor
        tg = T.training_graph(mlp(np.random.default_rng(3)), "cross-entropy", opt)
    update = tg.graph.nodes[-tg.n_update_nodes:]
    assert not [n for n in update if n.op_type == "Identity"]
    assert tg.new_params == {p: f"{p}.new" for p in tg.params}
    assert tg.new_state == {p: [f"{s}.new" for s in tg.state[p]] for p in tg.params} and tg.new_step == "step.new"
    produced = {o for n in update for o in n.outputs}
    assert {o for _, o in tg.carried()} <= produced
    mine = tuple(f"optim/{p}/" for p in tg.params)
    per_tensor = [n for n in update if n.op_type != "Constant" and n.name.startswith(mine)]
    assert len(per_tensor) == TWINS[opt.kind].per_tensor * len(tg.params)
