"""Build small ONNX Loop graphs with the IR and compare their gradients with the unrolled loop in PyTorch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import torch

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.dtype(np.float64)
POLICIES = ("store", "recompute", "sqrt", 2)


def n(op, ins, outs, name=None, **attrs):
    outs = outs if isinstance(outs, list) else [outs]
    return Node(op, ins, outs, attrs, name or f"{op}_{outs[0]}")


def const(name, value, dtype=None):
    return n("Constant", [], name, f"const_{name}", value=np.asarray(value, dtype=dtype))


def body(nodes, carried, cond_out="cond_out", scan=(), types=None, iter_name="i", cond_name="cond_in"):
    """A Loop body: ``carried`` is a list of (input name, output name); ``scan`` lists scan output names.
    ``types`` maps names to shapes (float64); when ``cond_out`` is ``"cond_out"`` it is cond_in passed on."""
    types = types or {}
    if cond_out == "cond_out":
        nodes = [*nodes, n("Identity", [cond_name], "cond_out", "pass_cond")]
    return Graph(
        nodes,
        [ValueInfo(iter_name, np.int64, ()), ValueInfo(cond_name, np.bool_, ())]
        + [ValueInfo(i, F64, types.get(i)) for i, _ in carried],
        [ValueInfo(cond_out, np.bool_, ())]
        + [ValueInfo(o, F64, types.get(o)) for _, o in carried]
        + [ValueInfo(s, F64, None) for s in scan],
    )


def loop(b, trip, initial, outputs, name="loop", cond="true"):
    """A Loop node over body ``b``; ``trip`` and ``cond`` name values ("" to omit)."""
    return n("Loop", [trip, cond, *initial], list(outputs), name, body=b)


def graph(nodes, inputs, outputs, inits=None):
    """A float64 graph with scalar outputs; ``inputs`` maps names to shapes."""
    inits = {"true": np.array(True), **(inits or {})}
    return Graph(nodes, [ValueInfo(k, F64, s) for k, s in inputs.items()], [ValueInfo(o, F64, ()) for o in outputs], inits)


def grads(g, feeds, wrt, loss=None, policy="store", backends=("onnxruntime", "reference")):
    """revgraph's gradients of ``loss`` under each backend (which must agree); checks the gradient graph."""
    gg = rg.gradient(g, loss=loss, wrt=wrt, checkpoint=policy)
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    names = gg.output_names[len(g.outputs):]
    results = []
    for backend in backends:
        out = rg.Session(gg, backend=backend).run(feeds)
        results.append({w: out[k] for w, k in zip(wrt, names, strict=True)})
    for other in results[1:]:
        for w in wrt:
            np.testing.assert_allclose(other[w], results[0][w], rtol=1e-10, atol=1e-12, err_msg=f"backends, {w}")
    return results[0]


def torch_grads(fn, feeds, wrt):
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in wrt) for k, v in feeds.items()}
    out = fn(**t)
    gs = torch.autograd.grad(out, [t[w] for w in wrt], allow_unused=True)
    return {w: np.zeros_like(feeds[w]) if g is None else g.numpy() for w, g in zip(wrt, gs, strict=True)}


def assert_close(ours, theirs, rtol=1e-9, atol=1e-10):
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=rtol, atol=atol, err_msg=k)


def three_nested_loops() -> tuple[Graph, dict[str, np.ndarray], Callable]:
    """innermost: s <- s * w (2 steps); middle: 3 steps of it plus a sin; outer: 2 steps of the middle, then
    loss = sum(s). Returns the graph, feeds and the unrolled PyTorch function (of s0 and w, returning s)."""
    inner = body([n("Mul", ["s3_in", "w"], "s3_out")], [("s3_in", "s3_out")], iter_name="k", cond_name="c3")
    middle = body([loop(inner, "M2", ["s2_in"], ["s2_mid"], "inner"), n("Sin", ["s2_mid"], "s2_out")],
                  [("s2_in", "s2_out")], iter_name="j", cond_name="c2")
    outer = body([loop(middle, "M3", ["s1_in"], ["s1_mid"], "middle"), n("Mul", ["s1_mid", "w"], "s1_out")],
                 [("s1_in", "s1_out")])
    trips = {"M": np.array(2, np.int64), "M2": np.array(2, np.int64), "M3": np.array(3, np.int64)}
    g = graph([loop(outer, "M", ["s0"], ["s"], "outer"), n("ReduceSum", ["s"], "loss", keepdims=0)],
              {"s0": (2,), "w": (2,)}, ["loss"], trips)
    feeds = {"s0": np.array([0.7, -0.4]), "w": np.array([1.1, 0.9])}

    def unrolled(s0, w):
        s = s0
        for _ in range(2):
            for _ in range(3):
                for _ in range(2):
                    s = s * w
                s = torch.sin(s)
            s = s * w
        return s

    return g, feeds, unrolled
