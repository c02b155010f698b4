"""VJPs of the ``ai.onnx.ml`` linear models skl2onnx writes: ``LinearClassifier``, ``LinearRegressor`` and
``Normalizer`` (issue 41, item 8), with respect to their input ``X``. The math is onnxruntime's CPU kernels
(``core/providers/cpu/ml/linearclassifier.cc``, ``linearregressor.cc``, ``normalizer.cc``, ``ml_common.h``),
checked against onnxruntime 1.32's outputs in tests/test_ml_linear.py; the VJPs are standard ONNX operators.

- Scores: ``s = float(X) @ W^T + b`` with ``W = coefficients`` as ``[T, F]`` and ``b = intercepts`` (``T``
  targets: the intercepts' count for the classifier, ``targets`` for the regressor; a 1-D ``X`` is one row).
  ``multi_class`` changes nothing in the kernel. ``post_transform`` applies to ``T > 1`` scores: ``NONE``,
  ``LOGISTIC`` (``sigmoid(s)``), ``SOFTMAX`` (over the targets), ``SOFTMAX_ZERO`` (a softmax over the scores
  with ``|s| > 1e-7``; the others become ``s exp(-max) / sum``). With one target the transform is not applied,
  except that a classifier with two class labels writes ``[1 - p, p]``, ``p = sigmoid(s)`` under ``LOGISTIC``,
  else ``p = s``. ``PROBIT`` is refused: onnxruntime computes it with an approximate inverse erf and returns
  NaN for scores outside (0, 1).
- The classifier's label is an integer or string (no gradient); its scores output carries it.
- ``Normalizer``: ``y = x / z`` per row with ``z = max(x)`` (``MAX``, the signed maximum), ``sum |x|`` (``L1``)
  or ``sqrt(sum x^2)`` (``L2``), and ``y = x`` where ``z == 0``; ``MAX``'s cotangent of ``z`` goes to the
  maximal elements split among ties, as ``ReduceMax``'s rule does.

The coefficients are attributes, so these rules give no gradient for them: :func:`revgraph.autodiff.lift.lift_constants`
(``--lift-constants``) first rewrites both linear operators into standard ONNX operators reading initializers
(:mod:`revgraph.autodiff.lift_ml`), whose gradients the standard rules give.
"""

from __future__ import annotations

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val, where
from ..context import Ctx
from ..registry import vjp

ML = "ai.onnx.ml"
TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO")
NORMS = ("MAX", "L1", "L2")
#: the magnitude below which SOFTMAX_ZERO takes a score for zero (``ComputeSoftmaxZero``)
ZERO = 1e-7


def text_attr(node: Node, name: str, default: str) -> str:
    """A string attribute as text (onnx gives bytes)."""
    v = node.attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def post_transform(node: Node) -> str:
    """``node``'s ``post_transform``; :class:`GraphError` in one line for ``PROBIT`` or an unknown value."""
    t = text_attr(node, "post_transform", "NONE")
    if t not in TRANSFORMS:
        raise GraphError(f"{node.label()}: post_transform {t!r} is not supported (supported: {', '.join(TRANSFORMS)}; "
                         "onnxruntime's PROBIT is an approximate inverse erf, NaN outside (0, 1))")
    return t


def linear_weights(node: Node) -> tuple[np.ndarray, np.ndarray | None]:
    """``(W [T, F], b [T] or None)`` of a ``LinearClassifier``/``LinearRegressor`` in float32, as onnxruntime
    reads them: the classifier's ``T`` is its intercepts' count, the regressor's ``targets`` (its intercepts
    used only when there are ``targets`` of them). :class:`GraphError` when the coefficients do not split
    into ``T`` rows."""
    coef = np.asarray(node.attrs.get("coefficients", []), np.float32).reshape(-1)
    icpt = np.asarray(node.attrs.get("intercepts", []), np.float32).reshape(-1)
    t = icpt.size if node.op_type == "LinearClassifier" else int(node.attrs.get("targets", 1))
    if t < 1 or coef.size == 0 or coef.size % t:
        raise GraphError(f"{node.label()}: {coef.size} coefficients do not make {t} target rows "
                         f"({'its intercepts count the classes' if node.op_type == 'LinearClassifier' else 'targets'})")
    return coef.reshape(t, -1), (icpt if icpt.size == t else None)


def two_classes(node: Node, targets: int) -> bool:
    """Does a one-target classifier write two score columns ``[1 - p, p]`` (it has two class labels)?"""
    labels = node.attrs.get("classlabels_ints", node.attrs.get("classlabels_strings", []))
    return node.op_type == "LinearClassifier" and targets == 1 and len(labels) == 2


def _rows(ctx: Ctx, node: Node, x: str) -> tuple[Val, int]:
    """``X`` as float32 ``[N, F]`` and its rank (1 or 2)."""
    rank = ctx.e.need_rank(x, node)
    if rank not in (1, 2):
        raise GraphError(f"{node.label()}: input of rank {rank}; onnxruntime takes [N, F] or [F]")
    xv = ctx.val(x)
    xf = xv if xv.dtype == np.float32 else xv.cast(np.float32)
    return (xf.unsqueeze([0]) if rank == 1 else xf), rank


def _scores_cotangent(ctx: Ctx, node: Node, g: str, z: str, transform: str, w: np.ndarray, b, x: str) -> Val:
    """The cotangent of the raw scores ``s`` from the scores output's (``g``, output ``z``)."""
    e, gv, zv = ctx.e, ctx.val(g), ctx.val(z)
    t = w.shape[0]
    if two_classes(node, t):  # z = [1 - p, p]: dp = g1 - g0
        gp = gv @ e.const(np.array([[-1.0], [1.0]], np.float32))
        if transform != "LOGISTIC":
            return gp
        p = zv @ e.const(np.array([[0.0], [1.0]], np.float32))
        return gp * (p * (1 - p))
    if t == 1 or transform == "NONE":
        return gv
    if transform == "LOGISTIC":
        return gv * (zv * (1 - zv))
    soft = zv * (gv - (gv * zv).sum([1]))
    if transform == "SOFTMAX":
        return soft
    # SOFTMAX_ZERO: a softmax over the scores away from 0; a score near 0 gives s exp(-m) / S, slope exp(-m) / S
    s = _rows(ctx, node, x)[0] @ e.const(np.ascontiguousarray(w.T))
    if b is not None:
        s = s + e.const(b)
    kept = s.abs().gt(ZERO)
    m = s.max([1])
    total = where(kept, (s - m).exp(), 0).sum([1])
    return where(kept, soft, gv * ((-m).exp() / total))


def _input_cotangent(ctx: Ctx, node: Node, g: str | None, z: str) -> list:
    x = node.inputs[0]
    transform = post_transform(node)
    w, b = linear_weights(node)
    if g is None:
        return [None]

    def dx() -> str:
        rank = _rows(ctx, node, x)[1]
        d = _scores_cotangent(ctx, node, g, z, transform, w, b, x) @ ctx.e.const(w)
        d = d.squeeze([0]) if rank == 1 else d
        return d.name if ctx.val(x).dtype == np.float32 else d.cast_like(x).name

    return [dx]


@vjp("LinearClassifier", domain=ML, bounded=False, finite=False)
def linear_classifier(ctx: Ctx, node: Node, cts: list) -> list:
    """``X``'s cotangent from the scores output's (module doc); the label carries none."""
    return _input_cotangent(ctx, node, cts[1] if len(cts) > 1 else None, node.outputs[1] if len(node.outputs) > 1
                            else "")


@vjp("LinearRegressor", domain=ML, bounded=False, finite=False)
def linear_regressor(ctx: Ctx, node: Node, cts: list) -> list:
    """``X``'s cotangent: ``g' @ W`` with ``g'`` the post-transform's VJP (module doc)."""
    return _input_cotangent(ctx, node, cts[0], node.outputs[0])


@vjp("Normalizer", domain=ML, bounded=False, finite=False)
def normalizer(ctx: Ctx, node: Node, cts: list) -> list:
    """``y = x / z`` (module doc): ``dx = (g - dz/dx sum(g y)) / z`` with ``dz/dx`` the maximal elements'
    share (MAX), ``sign(x)`` (L1) or ``y`` (L2); ``dx = g`` where ``z == 0``."""
    norm = text_attr(node, "norm", "MAX")
    if norm not in NORMS:
        raise GraphError(f"{node.label()}: norm {norm!r} is not supported (supported: {', '.join(NORMS)})")
    x, y, g = node.inputs[0], node.outputs[0], cts[0]
    if g is None:
        return [None]

    def dx() -> str:
        rank = ctx.e.need_rank(x, node)
        if rank not in (1, 2):
            raise GraphError(f"{node.label()}: input of rank {rank}; onnxruntime's Normalizer takes [N, C] or [C]")
        xv, yv, gv = ctx.val(x), ctx.val(y), ctx.val(g)
        xf = xv if xv.dtype == np.float32 else xv.cast(np.float32)
        z = xf.max([-1]) if norm == "MAX" else xf.abs().sum([-1]) if norm == "L1" else (xf * xf).sum([-1]).sqrt()
        nonzero = ~z.eq(0)
        safe = where(nonzero, z, 1)
        gy = (gv * yv).sum([-1])
        if norm == "MAX":
            hit = xf.eq(z).cast(np.float32)
            slope = hit / hit.sum([-1])
        else:
            slope = xf.sign() if norm == "L1" else yv
        d = where(nonzero, (gv - slope * gy) / safe, gv)
        return d.name if xv.dtype == np.float32 else d.cast_like(x).name

    return [dx]
