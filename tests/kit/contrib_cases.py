"""One-node cases of onnxruntime contrib operators for the LLM operator tests (tests/test_contrib_llm_ops.py):
the node over given inputs, run by onnxruntime, a loss ``sum_k sum(out_k * u_k)`` over chosen outputs, and
revgraph's gradients of it against PyTorch float64 autograd of the same math at the same inputs."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import onnx
import torch

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.onnx_io.value_types import infer_types

MS = "com.microsoft"
F32, F64 = np.float32, np.float64


def graph(op: str, inputs: list[tuple[str, np.ndarray] | None], attrs: dict, outputs: list[str], domain: str = MS,
          opset: int = 21) -> Graph:
    """One ``op`` node over the graph inputs ``inputs`` (``None``: an omitted optional input) writing ``outputs``
    (``""``: an omitted optional output), with revgraph's types of its outputs."""
    names = ["" if i is None else i[0] for i in inputs]
    while names and not names[-1]:
        names.pop()
    node = Node(op, names, outputs, dict(attrs), "op", domain)
    ins = [ValueInfo(n, a.dtype, a.shape) for n, a in (i for i in inputs if i is not None)]
    g = Graph([node], ins, [ValueInfo(o) for o in outputs if o], opsets={"": opset, MS: 1})
    types = infer_types(g)
    g.outputs = [types[o] if o in types and types[o].dtype is not None else ValueInfo(o) for o in outputs if o]
    return g


def with_loss(g: Graph, fwd: dict[str, np.ndarray], used: list[str]) -> Graph:
    """``g`` plus inputs ``<y>_u`` and ``loss = sum_y sum(y * <y>_u)`` in float64."""
    g = g.copy()
    parts = []
    for y in used:
        g.inputs.append(ValueInfo(f"{y}_u", fwd[y].dtype, fwd[y].shape))
        g.nodes += [Node("Mul", [y, f"{y}_u"], [f"{y}_uy"], name=f"loss/{y}/mul"),
                    Node("ReduceSum", [f"{y}_uy"], [f"{y}_s"], {"keepdims": 0}, name=f"loss/{y}/sum"),
                    Node("Cast", [f"{y}_s"], [f"{y}_s64"], {"to": onnx.TensorProto.DOUBLE}, name=f"loss/{y}/cast")]
        parts.append(f"{y}_s64")
    g.nodes.append(Node("Sum", parts, ["loss"], name="loss/sum"))
    g.outputs = [ValueInfo("loss", np.dtype(F64), ())]
    return g


def outside_onnx(g: Graph) -> list[tuple[str, str]]:
    """The operators of ``g``'s nodes that ONNX does not define."""
    return sorted((n.domain, n.op_type) for n in g.nodes if n.domain or not onnx.defs.has(n.op_type))


def check(op: str, inputs: list[tuple[str, np.ndarray] | None], fn: Callable, *, attrs: dict | None = None,
          outputs: tuple[str, ...] = ("y",), used: list[str] | None = None, wrt: list[str] | None = None,
          weights: dict[str, np.ndarray] | None = None, tol: float = 2e-5, ftol: float = 1e-5, seed: int = 0,
          check_types: bool = True) -> dict[str, np.ndarray]:
    """Differentiate ``loss`` w.r.t. ``wrt`` (default: every float input) with revgraph, run it on
    onnxruntime (which runs the contrib node) and compare with float64 autograd of ``fn`` (torch tensors of the
    inputs in order, ``None`` for omitted ones; returns the outputs in order) at the same inputs; the forward
    outputs are compared with ``fn``'s too, and the gradient graph may hold no operator outside ONNX's standard
    set but the forward node. ``weights``: the loss weights ``u`` of some outputs (zeros on rows whose value
    onnxruntime leaves unspecified). Returns revgraph's gradients by input name."""
    rng = np.random.default_rng(seed)
    outputs = list(outputs)
    used = [o for o in outputs if o] if used is None else used
    g = graph(op, inputs, attrs or {}, outputs)
    feeds = dict(i for i in inputs if i is not None)
    fwd = rg.Session(g).run(feeds)
    if check_types:
        for vi in g.outputs:  # revgraph's output types of the contrib operator are onnxruntime's
            got = fwd[vi.name]
            assert vi.dtype == got.dtype, (vi, got.dtype)
            assert vi.shape is None or all(d is None or isinstance(d, str) or d == s
                                           for d, s in zip(vi.shape, got.shape, strict=True)), (vi, got.shape)
    lg = with_loss(g, fwd, used)
    us = {f"{y}_u": rng.standard_normal(fwd[y].shape).astype(fwd[y].dtype) for y in used}
    for y, w in (weights or {}).items():
        us[f"{y}_u"] = (us[f"{y}_u"] * w).astype(fwd[y].dtype)
    wrt = [n for n, a in feeds.items() if a.dtype.kind == "f"] if wrt is None else wrt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gg = rg.gradient(lg, loss="loss", wrt=wrt, unconnected="zero")
    assert outside_onnx(gg) == outside_onnx(g), "the backward must use ONNX's standard operators only"
    got = rg.Session(gg).run({**feeds, **us})
    tin = [None if i is None else torch.tensor(i[1].astype(F64) if i[1].dtype.kind == "f" else i[1],
                                               requires_grad=i[0] in wrt) for i in inputs]
    touts = fn(*tin)
    touts = touts if isinstance(touts, tuple) else (touts,)
    for o, t in zip(outputs, touts, strict=False):
        if o and t is not None:
            w = (weights or {}).get(o)
            a, b = fwd[o], t.detach().numpy()
            if w is not None:  # (rows onnxruntime leaves unspecified are not compared)
                a, b = a * (np.asarray(w) != 0), b * (np.asarray(w) != 0)
            np.testing.assert_allclose(a, b, rtol=ftol, atol=ftol * max(1.0, float(np.abs(b).max(initial=0.0))),
                                       err_msg=f"{op} {o}")
    total = sum((t * torch.tensor(us[f"{o}_u"].astype(F64))).sum() for o, t in zip(outputs, touts, strict=False)
                if o in used and t is not None)
    leaves = [t for i, t in zip(inputs, tin, strict=True) if i is not None and i[0] in wrt]
    want = torch.autograd.grad(total, leaves, allow_unused=True)
    out = {}
    for name, w in zip([i[0] for i in inputs if i is not None and i[0] in wrt], want, strict=True):
        a = feeds[name]
        w = np.zeros(a.shape) if w is None else w.numpy()
        grad = got[f"{name}_grad"]
        assert grad.shape == a.shape and grad.dtype == a.dtype, (name, grad.shape, grad.dtype)
        np.testing.assert_allclose(grad, w, rtol=tol, atol=tol * max(1.0, float(np.abs(w).max(initial=0.0))),
                                   err_msg=f"{op} d{name}")
        out[name] = grad
    return out
