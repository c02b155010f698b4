"""Gradient checking for tests, independent of revgraph's own checker.

For a one-node (or small) graph built with the IR, :func:`check_rule` checks revgraph's gradient three ways:
1. float64 central differences of ``f(x) = sum(u * y(x))`` along random directions (the forward graph run
   by onnxruntime), against the VJP that the gradient graph computes (run by onnxruntime and by the
   reference evaluator, which must agree);
2. PyTorch autograd on the same function (``torch_fn``), with the same cotangent ``u``;
3. second order: the gradient of ``s(x) = sum_i <grad_i(x), v_i>`` (a Hessian-vector product, built by
   differentiating the gradient graph) against central differences of the gradient graph along ``v``.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import torch

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

H = 1e-6


def one_node_graph(op_type: str, inputs: dict[str, np.ndarray], attrs: dict | None = None, n_out: int = 1,
                   float_inputs: list[str] | None = None, domain: str = "") -> Graph:
    """A graph with one node: floating arrays become graph inputs, others initializers."""
    float_inputs = [k for k, v in inputs.items() if v.dtype.kind == "f"] if float_inputs is None else float_inputs
    outs = [f"y{i}" for i in range(n_out)]
    g = Graph(
        nodes=[Node(op_type, list(inputs), outs, dict(attrs or {}), "op", domain)],
        inputs=[ValueInfo(k, v.dtype, v.shape) for k, v in inputs.items() if k in float_inputs],
        outputs=[ValueInfo(o) for o in outs],
        initializers={k: v for k, v in inputs.items() if k not in float_inputs},
    )
    return g


def _ort(model_graph: Graph):
    """Run with onnxruntime; where it has no float64 kernel for an op (Erf, Conv, ...), with the reference
    evaluator instead (both are checked against each other on the gradient graph when both can run it)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        sess = ort.InferenceSession(rg.to_onnx(model_graph).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        if "NOT_IMPLEMENTED" not in str(exc):
            raise
        ref = rg.Session(model_graph, backend="reference")
        return ref.run
    names = [o.name for o in sess.get_outputs()]
    # copies: onnxruntime may write an in-place output (BatchNormalization's running statistics) into a fed array
    return lambda feeds: dict(zip(names, sess.run(None, {k: np.array(v) for k, v in feeds.items()}), strict=True))


def with_loss(g: Graph, fwd: dict[str, np.ndarray], outputs: list[str] | None = None) -> tuple[Graph, list[str]]:
    """``g`` plus inputs ``<y>_u`` and a scalar output ``loss = sum_y sum(y * <y>_u)``."""
    g = g.copy()
    outputs = outputs or g.output_names
    parts = []
    for y in outputs:
        u = f"{y}_u"
        g.inputs.append(ValueInfo(u, fwd[y].dtype, fwd[y].shape))
        g.nodes.append(Node("Mul", [y, u], [f"{y}_uy"], name=f"loss/{y}/mul"))
        g.nodes.append(Node("ReduceSum", [f"{y}_uy"], [f"{y}_s"], {"keepdims": 0}, name=f"loss/{y}/sum"))
        parts.append(f"{y}_s")
    g.nodes.append(Node("Sum", parts, ["loss"], name="loss/sum"))
    g.outputs = [ValueInfo("loss")]
    return g, outputs


def check_rule(g: Graph, feeds: dict[str, np.ndarray], torch_fn=None, *, wrt: list[str] | None = None,
               outputs: list[str] | None = None, seed: int = 0, rtol: float = 1e-5, atol: float = 1e-7,
               second_order: bool = True, fd_with_torch: bool = False) -> dict[str, np.ndarray]:
    """Check revgraph's gradients of ``g`` at ``feeds`` three ways (module doc); return the gradients.

    ``fd_with_torch``: take the central differences of ``torch_fn`` instead of the ONNX forward graph, for
    ops whose only float64 ONNX implementation is not float64-accurate (the reference ``Erf`` rounds to
    float32 and onnxruntime has no float64 ``Erf``)."""
    rng = np.random.default_rng(seed)
    feeds = {k: np.asarray(v) for k, v in feeds.items()}
    run_fwd = _ort(g)
    fwd = run_fwd(feeds)
    lg, outputs = with_loss(g, fwd, outputs)
    us = {f"{y}_u": rng.standard_normal(np.shape(fwd[y])).astype(fwd[y].dtype) for y in outputs}
    wrt = wrt or [v.name for v in g.inputs if feeds[v.name].dtype.kind == "f"]
    gg = rg.gradient(lg, loss="loss", wrt=wrt)
    run_grad = _ort(gg)
    grads_ort = run_grad({**feeds, **us})
    ref = rg.Session(gg, backend="reference").run({**feeds, **us})
    grads = {w: grads_ort[f"{w}_grad"] for w in wrt}
    for w in wrt:
        assert grads[w].shape == feeds[w].shape, (w, grads[w].shape, feeds[w].shape)
        np.testing.assert_allclose(ref[f"{w}_grad"], grads[w], rtol=1e-6, atol=1e-9, err_msg=f"ORT vs reference, {w}")

    # 1. central differences along random directions
    run_loss = _ort(lg)
    if fd_with_torch:
        def run_loss(f):
            outs = torch_fn(**{k: torch.tensor(f[k]) for k in feeds})
            outs = outs if isinstance(outs, (tuple, list)) else [outs]
            return {"loss": sum(float((t * torch.tensor(f[f"{y}_u"])).sum()) for y, t in zip(outputs, outs, strict=False))}
    for _ in range(2):
        v = {w: rng.standard_normal(feeds[w].shape) for w in wrt}
        plus = {**feeds, **us, **{w: feeds[w] + H * v[w] for w in wrt}}
        minus = {**feeds, **us, **{w: feeds[w] - H * v[w] for w in wrt}}
        numeric = (run_loss(plus)["loss"] - run_loss(minus)["loss"]) / (2 * H)
        analytic = sum(float(np.sum(grads[w] * v[w])) for w in wrt)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-6, err_msg="central differences")

    # 2. PyTorch autograd
    if torch_fn is not None:
        tin = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
        tout = torch_fn(**tin)
        tout = tout if isinstance(tout, (tuple, list)) else [tout]
        for y, t in zip(outputs, tout, strict=False):
            np.testing.assert_allclose(t.detach().numpy(), fwd[y], rtol=1e-6, atol=1e-9, err_msg=f"forward {y} vs torch")
        total = sum((t * torch.tensor(us[f"{y}_u"])).sum() for y, t in zip(outputs, tout, strict=False))
        tg = torch.autograd.grad(total, [tin[w] for w in wrt], allow_unused=True)
        for w, t in zip(wrt, tg, strict=True):
            expected = np.zeros_like(feeds[w]) if t is None else t.numpy()
            np.testing.assert_allclose(grads[w], expected, rtol=rtol, atol=atol, err_msg=f"torch autograd, {w}")

    # 3. second order: Hessian-vector product against differences of the gradient graph
    if second_order:
        hv_graph = gg.copy()
        vs = {f"{w}_v": rng.standard_normal(feeds[w].shape) for w in wrt}
        parts = []
        for w in wrt:
            hv_graph.inputs.append(ValueInfo(f"{w}_v", feeds[w].dtype, feeds[w].shape))
            hv_graph.nodes.append(Node("Mul", [f"{w}_grad", f"{w}_v"], [f"{w}_gv"], name=f"hv/{w}/mul"))
            hv_graph.nodes.append(Node("ReduceSum", [f"{w}_gv"], [f"{w}_gvs"], {"keepdims": 0}, name=f"hv/{w}/sum"))
            parts.append(f"{w}_gvs")
        # not "s": a graph input of that name would be silently shadowed
        hv_graph.nodes.append(Node("Sum", parts, ["hv/s"], name="hv/sum"))
        hv_graph.outputs = [ValueInfo("hv/s")]
        with warnings.catch_warnings():  # a linear function has a zero Hessian: no path, zeros
            warnings.simplefilter("ignore")
            hvp = rg.gradient(hv_graph, loss="hv/s", wrt=wrt, unconnected="zero")
        got = _ort(hvp)({**feeds, **us, **vs})
        got = dict(zip(wrt, (got[n] for n in hvp.output_names[-len(wrt):]), strict=True))
        v = {w: vs[f"{w}_v"] for w in wrt}
        plus = run_grad({**feeds, **us, **{w: feeds[w] + H * v[w] for w in wrt}})
        minus = run_grad({**feeds, **us, **{w: feeds[w] - H * v[w] for w in wrt}})
        for w in wrt:
            numeric = (plus[f"{w}_grad"] - minus[f"{w}_grad"]) / (2 * H)
            np.testing.assert_allclose(got[w], numeric, rtol=1e-4, atol=1e-5, err_msg=f"second order, {w}")
    return grads
