"""Helpers of the strong-zero tests (test_strong_zeros.py, test_infinite_cotangents.py): gradients run on both
runtimes, and the check that forward mode agrees with them (issue 27, item 2): wherever a test asks for a
gradient, the JVP of the same graph along random tangents must equal ``<grad, t>`` (both modes give the same
strong zeros, also where the function is constant)."""

from __future__ import annotations

import numpy as np

import revgraph as rg
from revgraph.errors import RevgraphError
from revgraph.ir import Graph


def run(gg: Graph, feeds: dict) -> dict:
    """Run on onnxruntime and the reference evaluator, which must agree; the reference evaluator alone where
    onnxruntime has no float64 kernel (Sinh, Erf, Softplus, ...)."""
    with np.errstate(all="ignore"):
        ref = rg.Session(gg, backend="reference").run(feeds)
        try:
            out = rg.Session(gg).run(feeds)
        except RevgraphError as exc:
            assert "refuses the graph" in str(exc) or "NOT_IMPLEMENTED" in str(exc), exc
            return ref
    for k in out:
        if k.endswith(("_grad", "_tangent")):
            # summation order: a gradient that cancels to about 0 keeps the rounding of its terms (Hypothesis
            # found exp(exp(x) / p / p) terms whose sum is -2.3e-13 on one runtime and 0 on the other)
            np.testing.assert_allclose(out[k], ref[k], rtol=1e-12, atol=1e-11, err_msg=k)
    return out


def grads(g: Graph, wrt: list[str] | None, feeds: dict, loss: str = "loss", jvp: bool = True,
          rtol: float = 1e-9) -> dict[str, np.ndarray]:
    """The gradients of ``loss`` by ``rg.gradient``, by wrt name; with ``jvp``, also checks that ``rg.jvp`` of
    ``g`` along random tangents of the same values gives ``<grad, t>`` (to ``rtol``, NaN where it is NaN)."""
    out = run(rg.gradient(g, loss, wrt=wrt), feeds)
    got = {k[: -len("_grad")]: v for k, v in out.items() if k.endswith("_grad")}
    if jvp and got:
        assert_jvp_is_dot(g, got, feeds, loss, rtol)
    return got


def assert_jvp_is_dot(g: Graph, grad: dict[str, np.ndarray], feeds: dict, loss: str = "loss",
                      rtol: float = 1e-9) -> None:
    """``rg.jvp(g)`` of ``loss`` along random tangents of the values of ``grad`` equals ``sum(grad * t)``."""
    rng = np.random.default_rng(27)
    tangents = {x: rng.standard_normal(np.shape(v)).astype(np.asarray(v).dtype) for x, v in grad.items()}
    jg = rg.jvp(g, outputs=[loss], inputs=list(grad))
    out = run(jg, {**feeds, **{f"{x}_tangent": t for x, t in tangents.items()}})
    with np.errstate(all="ignore"):
        dot = sum(float(np.sum(grad[x] * t)) for x, t in tangents.items())
    scale = sum(float(np.sum(np.abs(grad[x] * t))) for x, t in tangents.items() if np.all(np.isfinite(grad[x])))
    np.testing.assert_allclose(out[f"{loss}_tangent"], dot, rtol=rtol, atol=1e-12 + rtol * scale,
                               err_msg="forward mode disagrees with reverse mode")
