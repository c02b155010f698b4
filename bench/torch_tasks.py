"""PyTorch eager's side of the training-step comparison (a worker in the project's virtual environment).

The module of models.torch_module is loaded with the state of the exported file (so PyTorch, revgraph and JAX
start from the same parameters and batch), kept in training mode (batch norm uses batch statistics), and one
step is ``zero_grad(set_to_none=True)``, ``F.cross_entropy(model(x), labels)``, ``loss.backward()``
(``mode="grad"``), followed by ``torch.optim.Adam.step()`` for ``mode="adam"``. ``torch.set_num_threads``
sets the same thread count as onnxruntime's intra-op pool.
"""

from __future__ import annotations

import time

import numpy as np

_STEPS: dict[str, dict] = {}


def versions() -> dict:
    import torch

    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def prepare_step(key: str, info: dict, threads: int = 2, mode: str = "grad") -> dict:
    import torch
    from models import load_npz, torch_module

    torch.set_num_threads(threads)
    state, data = load_npz(info["npz"])
    model = torch_module(info["model"])
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True)
    model.train()
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["labels"])
    F = torch.nn.functional
    params = dict(model.named_parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if mode in ("adam", "update") else None
    if mode == "update":  # the update alone, on fixed random gradients (the default single-tensor path)
        gen = torch.Generator().manual_seed(0)
        for t in model.parameters():
            t.grad = 1e-2 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        _STEPS[key] = {"run": opt.step}
        opt.step()
        return {"loss": None}

    def run():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    _STEPS[key] = {"run": run}
    loss = run()
    out = {"loss": float(loss.detach())}
    if mode == "grad":
        out["grad_sq"] = {p: float(np.sum(np.square(t.grad.double().numpy()))) for p, t in params.items()}
    return out


def step_time(key: str, seconds: float = 0.5, min_iters: int = 3) -> dict:
    run = _STEPS[key]["run"]
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    iters = max(min_iters, int(seconds / max(first, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    return {"mean": (time.perf_counter() - t0) / iters, "iters": iters}


def drop_step(key: str) -> bool:
    _STEPS.pop(key, None)
    return True
