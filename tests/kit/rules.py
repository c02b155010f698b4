"""Helpers of the rule tests: second order through a squared output, repeated and negative indices, PyTorch autograd
checks for ops central differences cannot check."""

from __future__ import annotations

import numpy as np
import torch

import revgraph as rg
from kit.harness import double_backward, ort_runner, with_loss
from revgraph.ir import Graph, Node, ValueInfo


def squared(g: Graph) -> Graph:
    """``g`` with its first output squared, so that the gradient depends on the input (a real second order)."""
    g = g.copy()
    g.nodes.append(Node("Mul", ["y0", "y0"], ["sq"], name="square"))
    g.outputs = [ValueInfo("sq")]
    return g


def with_repeat(idx: np.ndarray, n) -> np.ndarray:
    """``idx`` whose last entry along axis 0 names the same position as its first, through the other sign:
    a repeated index, and a negative index aliasing a non-negative one (``n``: the sizes indexed)."""
    idx = np.array(idx, copy=True)
    if idx.ndim and idx.shape[0] > 1:
        idx[-1] = np.where(idx[0] >= 0, idx[0] - n, idx[0] + n)
    return idx


def wrap(idx: np.ndarray, n) -> np.ndarray:
    """``idx`` with its negative entries counted from the end (``+ n``)."""
    return np.where(idx < 0, idx + n, idx)


def torch_check(g: Graph, feeds: dict, torch_fn, *, wrt: list[str], outputs: list[str] | None = None,
                backends=("onnxruntime", "reference"), rtol: float = 1e-6, atol: float = 1e-8, seed: int = 0) -> None:
    """revgraph's gradient of ``sum(u * y)`` and its Hessian-vector product against PyTorch autograd in float64.

    For ops whose ONNX forward cannot be differentiated numerically in float64 (float32-rounded kernels or
    float32-only types), so the harness's central differences do not apply."""
    rng = np.random.default_rng(seed)
    fwd = ort_runner(g)(feeds)
    lg, outputs = with_loss(g, fwd, outputs)
    us = {f"{y}_u": rng.standard_normal(np.shape(fwd[y])).astype(fwd[y].dtype) for y in outputs}
    vs = {f"{w}_v": rng.standard_normal(feeds[w].shape).astype(feeds[w].dtype) for w in wrt}
    gg = rg.gradient(lg, loss="loss", wrt=wrt)
    hvp = double_backward(gg, wrt, feeds)

    tin = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in wrt) if v.dtype.kind == "f" else torch.tensor(v)
           for k, v in feeds.items()}
    tout = torch_fn(**tin)
    tout = tout if isinstance(tout, (tuple, list)) else [tout]
    total = sum((t * torch.tensor(us[f"{y}_u"], dtype=torch.float64)).sum()
                for y, t in zip(outputs, tout, strict=False))
    tg = torch.autograd.grad(total, [tin[w] for w in wrt], create_graph=True)
    s = sum((t * torch.tensor(vs[f"{w}_v"], dtype=torch.float64)).sum() for w, t in zip(wrt, tg, strict=True))
    th = torch.autograd.grad(s, [tin[w] for w in wrt], allow_unused=True) if s.requires_grad else [None] * len(wrt)
    for backend in backends:
        got = rg.Session(gg, backend=backend).run({**feeds, **us})
        hgot = rg.Session(hvp, backend=backend).run({**feeds, **us, **vs})
        for k, w in enumerate(wrt):
            np.testing.assert_allclose(got[f"{w}_grad"], tg[k].detach().numpy(), rtol=rtol, atol=atol,
                                       err_msg=f"{backend}: gradient of {w} vs torch")
            expected = np.zeros(feeds[w].shape) if th[k] is None else th[k].numpy()
            np.testing.assert_allclose(hgot[hvp.output_names[len(hvp.output_names) - len(wrt) + k]], expected,
                                       rtol=rtol * 10, atol=atol * 10, err_msg=f"{backend}: Hessian-vector product {w}")
