"""Learning-rate schedules for tests: Hugging Face's schedule functions as references (:data:`REFERENCES`, one
per registered schedule; a test that registers a schedule adds its own), PyTorch's training under
``LambdaLR`` with them (:func:`torch_run`), and the generic checks of a registered schedule
(:func:`check_schedule_values`, :func:`check_schedule_trains_like_torch`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from revgraph import train as T
from revgraph.train.schedules import Schedule

from .training import assert_params_close, mlp, torch_mlp, torch_optimizer


def _constant(step, warmup, total):
    return 1.0


def _linear(step, warmup, total):
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step, warmup, total):
    progress = float(step - warmup) / float(max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))


#: transformers.optimization's decay after the warmup, ``(step, warmup, total) -> factor``, of each registered
#: schedule: get_constant_schedule_with_warmup, get_linear_schedule_with_warmup and
#: get_cosine_with_min_lr_schedule_with_warmup (num_cycles 0.5), and whether it decays to min-lr
REFERENCES = {"constant": (_constant, False), "linear": (_linear, True), "cosine": (_cosine, True)}


def hf_lambda(kind: str, warmup: int, total: int, min_lr_rate: float = 0.0):
    """transformers' lr lambda of ``kind`` (:data:`REFERENCES`): linear from 0 over the warmup, then the decay,
    mixed with ``min_lr_rate`` as get_cosine_with_min_lr_schedule_with_warmup does (the linear one too)."""
    decay, to_min = REFERENCES[kind]

    def f(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        factor = decay(step, warmup, total)
        return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate) if to_min else factor
    return f


def graph_learning_rate(opt: T.Optimizer):
    """The schedule's nodes alone as an onnxruntime session: ``lr(step, total)`` -> float."""
    import onnxruntime as ort

    from revgraph.ir import Graph, ValueInfo
    from revgraph.onnx_io import to_onnx
    from revgraph.train.graphbuild import Builder
    from revgraph.train.optimizers import Scalars

    b = Builder({"step", "total"})
    lr = Scalars(b, opt, "step", "total").lr64()
    graph = Graph(b.nodes, [ValueInfo("step", np.int64, ()), ValueInfo("total", np.int64, ())],
                  [ValueInfo(lr, np.float64, ())])
    sess = ort.InferenceSession(to_onnx(graph).SerializeToString())
    return lambda s, t: float(sess.run(None, {"step": np.array(s), "total": np.array(t)})[0])


def check_schedule_values(kind: str, lam, peak=0.02, warmup=4, total=30) -> None:
    """The registered schedule ``kind``'s graph nodes and Python value (``Schedule.factor``) at every step of a
    run (warmup included) equal ``peak * lam(s)``, ``lam`` the reference lambda for this warmup and total (with
    min-lr a tenth of the peak where the kind decays to it)."""
    reads = Schedule(kind).rule.reads_min_lr
    opt = T.adam(lr=peak, schedule=Schedule(kind, warmup, peak / 10 if reads else 0.0))
    lr = graph_learning_rate(opt)
    for s in range(total + 1):
        want = peak * lam(s)
        assert lr(s, total) == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, s)
        assert opt.schedule.factor(s, total, peak) * peak == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, s)


def torch_run(params0, forward, opt, batches, lam, clip, no_decay):
    """PyTorch's training: two parameter groups (``opt``'s weight decay on the others, none on ``no_decay``),
    LambdaLR with ``lam``, clip_grad_norm_ before each step. Returns the parameters, the losses and the global
    norms before clipping."""
    P = {k: torch.tensor(v, requires_grad=True) for k, v in params0.items() if v.dtype.kind == "f"}
    groups = [{"params": [P[k] for k in P if k not in no_decay], "weight_decay": opt.weight_decay},
              {"params": [P[k] for k in P if k in no_decay], "weight_decay": 0.0}]
    torch_opt = torch_optimizer(opt, groups)
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lam)
    losses, norms = [], []
    for x, y in batches:
        torch_opt.zero_grad()
        loss = F.cross_entropy(forward(P, torch.tensor(x)), torch.tensor(y))
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(P.values()), clip)))
        torch_opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().numpy() for k, v in P.items()}, losses, norms


def check_schedule_trains_like_torch(opt: T.Optimizer, kind: str, lam_for, n=48, batch=8, epochs=4, clip=1.0):
    """``epochs`` of the MLP (``n`` samples, ``batch`` each): warmup 5 then the schedule ``kind`` (down to
    min-lr a tenth of the peak where it reads min-lr), the global norm clipped to ``clip``, no weight decay on
    the biases: parameters and losses equal PyTorch's with ``opt``'s twin under ``LambdaLR(lam_for(warmup,
    total, min_lr_rate))``."""
    import revgraph as rg

    rng = np.random.default_rng(0)
    g = mlp(rng)
    data = {"x": rng.normal(0, 1, (n, 6)).astype(np.float32), "labels": rng.integers(0, 3, n)}
    rate = 0.1 if Schedule(kind).rule.reads_min_lr else 0.0
    tr = rg.Trainer(g, "cross-entropy", opt, threads=1, schedule=Schedule(kind, 5, opt.lr * rate),
                    clip_grad_norm=clip, no_decay="default")
    tr.fit(data, epochs, batch, shuffle=False, progress=False)
    assert tr.spec.no_decay == ["b1", "b2"]
    batches = [(data["x"][i:i + batch], data["labels"][i:i + batch]) for _ in range(epochs) for i in range(0, n, batch)]
    theirs, losses, norms = torch_run(g.initializers, torch_mlp, opt, batches, lam_for(5, len(batches), rate), clip,
                                      {"b1", "b2"})
    assert min(norms) < clip < max(norms)  # some steps clipped, some not
    assert tr.steps == len(batches)
    np.testing.assert_allclose(tr.losses, losses, rtol=1e-4)
    assert_params_close(tr.parameters, theirs)
