"""The registries are open (issue 45): an optimizer (Nesterov SGD), a loss (smooth L1) and a learning-rate schedule
(inverse square root) registered here, each one class or entry, pass the same generic checks the built-ins pass
(:mod:`kit.registry_checks`, :mod:`kit.schedules`) with no list edited anywhere, against PyTorch's
``torch.optim.SGD(nesterov=True)``, ``torch.nn.functional.smooth_l1_loss`` and transformers'
``get_inverse_sqrt_schedule``.

The registrations are made by a fixture and undone after each test (``monkeypatch.setitem``), not at import:
the generic tests elsewhere are parametrized from the registries when pytest collects them, and an entry added
at import would join them or not depending on the order the modules are collected in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.registry_checks import check_float64_to_rounding, check_trains_like_torch, check_update_nodes
from kit.schedules import check_schedule_trains_like_torch, check_schedule_values
from kit.training import OPTIMIZERS, TORCH_LOSS, TWINS, Twin, optimizer_for_tests

from revgraph.cli import _parser
from revgraph.errors import RevgraphError
from revgraph.ir import ValueInfo
from revgraph.train import losses, lr_schedules, optimizers
from revgraph.train.schedules import Schedule


class Nesterov(optimizers.Method):
    """``g' = g + wd p``; ``v' = momentum v + g'``; ``p' = p - lr (g' + momentum v')`` (Sutskever et al. 2013 as
    PyTorch writes it)."""

    name = "nesterov"
    hyperparameters = ("momentum",)
    defaults = {"lr": 0.01, "weight_decay": 0.0}  # noqa: RUF012 (as Method's)

    def slots(self, opt):
        return ("momentum",)

    def checks(self, opt):
        return [(opt.momentum > 0, "nesterov needs a momentum > 0 (--momentum)")]

    def update(self, step, p, g, state):
        b = step.b
        g = step.l2(g, p)
        v = b.op("Add", [b.op("Mul", [step.c(step.opt.momentum), state[0]]), g])
        look_ahead = b.op("Add", [g, b.op("Mul", [step.c(step.opt.momentum), v])])
        return b.op("Sub", [p, b.op("Mul", [step.lr(), look_ahead])]), [v]


def _smooth_l1(x: losses.Build):
    """``mean(0.5 d^2 if |d| < 1 else |d| - 0.5)``, ``d = output - labels``."""
    b, labels = x.b, x.b.fresh("labels")
    x.g.inputs.append(ValueInfo(labels, x.vi.dtype, x.vi.shape))
    d = b.op("Sub", [x.out, labels])
    a = b.op("Abs", [d])
    half = b.const(0.5, x.vi.dtype)
    inner = b.op("Mul", [half, b.op("Mul", [d, d])])
    outer = b.op("Sub", [a, half])
    value = b.op("Where", [b.op("Less", [a, b.const(1.0, x.vi.dtype)]), inner, outer])
    return b.op("ReduceMean", [value], keepdims=0), labels, None


class InverseSqrt(lr_schedules.Kind):
    """``f = 1 / sqrt((s + c - w) / c)`` with the timescale ``c = w`` (10,000 without warmup): transformers'
    ``get_inverse_sqrt_schedule``."""

    name = "inverse-sqrt"
    help = "the inverse square root of the steps after the warmup"

    def decay(self, m, s, t, w):
        c = float(w or 10_000)
        return 1.0 / m.sqrt((s + (c - w)) / c)


@pytest.fixture
def registered(monkeypatch):
    """Nesterov SGD with its PyTorch twin (8 nodes per tensor: 2 for the L2 term, 2 for the momentum, 2 for the
    look-ahead, 2 for the step), smooth L1 with torch's, inverse-sqrt."""
    monkeypatch.setitem(optimizers.OPTIMIZERS, Nesterov.name, Nesterov())
    monkeypatch.setitem(TWINS, "nesterov", Twin(lambda o, ps: torch.optim.SGD(
        ps, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=True), 8))
    monkeypatch.setitem(losses.LOSSES, "smooth-l1", losses.LossKind("required", (), "smooth L1", _smooth_l1))
    monkeypatch.setitem(TORCH_LOSS, "smooth-l1", F.smooth_l1_loss)
    monkeypatch.setitem(lr_schedules.SCHEDULES, InverseSqrt.name, InverseSqrt())


def _transformers_lambda(warmup: int, total: int = 0, min_lr_rate: float = 0.0):
    """transformers' own inverse-sqrt lambda (``total`` and the min-lr rate do not apply to it)."""
    from transformers import get_inverse_sqrt_schedule

    assert min_lr_rate == 0.0
    torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return get_inverse_sqrt_schedule(torch_opt, warmup).lr_lambdas[0]


def test_a_registered_optimizer_passes_the_generic_checks(registered):
    opt = optimizer_for_tests("nesterov")
    assert (opt.lr, opt.momentum, opt.weight_decay) == (0.1, 0.9, 0.01)
    check_trains_like_torch(opt)
    check_float64_to_rounding(opt)
    check_update_nodes(opt)


def test_a_registered_loss_passes_the_generic_checks(registered):
    check_trains_like_torch(OPTIMIZERS["adam"], "smooth-l1")
    check_trains_like_torch(optimizer_for_tests("nesterov"), "smooth-l1")


def test_a_registered_schedule_passes_the_generic_checks(registered):
    for warmup in (0, 4):
        check_schedule_values("inverse-sqrt", _transformers_lambda(warmup), warmup=warmup)
    check_schedule_trains_like_torch(optimizer_for_tests("nesterov"), "inverse-sqrt", _transformers_lambda)
    assert not Schedule("inverse-sqrt", 3).needs_total


def test_the_cli_and_the_checks_read_the_registered_entries(registered):
    args = _parser().parse_args(["train", "m.onnx", "--data", "d.npz", "--loss", "smooth-l1", "--epochs", "1",
                                 "-o", "o.onnx", "--optimizer", "nesterov", "--lr-schedule", "inverse-sqrt"])
    assert (args.optimizer, args.loss, args.lr_schedule) == ("nesterov", "smooth-l1", "inverse-sqrt")
    opt = optimizer_for_tests("nesterov", schedule=Schedule("inverse-sqrt", 3))
    assert opt.settings()["lr_schedule"] == "inverse-sqrt" and opt.settings()["warmup_steps"] == 3
    with pytest.raises(RevgraphError, match=r"--min-lr applies to the linear and cosine schedules"):
        Schedule("inverse-sqrt", 3, 1e-4)
    with pytest.raises(RevgraphError, match="nesterov needs a momentum > 0"):
        optimizers.Optimizer("nesterov", lr=0.1)
    assert np.isclose(Schedule("inverse-sqrt", 4).factor(16, None, 1.0), 0.5)  # 1 / sqrt(16 / 4)
