"""VJPs of the classification losses (ONNX operator spec, "SoftmaxCrossEntropyLoss" and
"NegativeLogLikelihoodLoss", opset 13; derivatives as in PyTorch's ``nll_loss_backward`` and
``log_softmax_backward_data``).

With ``x`` the log-probabilities (``LogSoftmax(scores, axis=1)`` for SoftmaxCrossEntropyLoss, the input
itself for NegativeLogLikelihoodLoss), labels ``y`` and class weights ``w`` (ones when omitted), each
element ``(n, d1, ...)`` contributes ``l = -w[y] * x[n, y, d1, ...]``, or 0 where ``y == ignore_index``.
``reduction="none"`` returns ``l``, ``"sum"`` its sum, and ``"mean"`` its sum divided by ``W``, the sum of
``w[y]`` over the elements that are not ignored (PyTorch's weighted mean).

The labels select entries through a one-hot mask built with ``Equal`` against ``Range(C)`` (an ignored
label, inside or outside ``[0, C)``, matches no class), so no index is ever out of bounds; labels get no
gradient.

Strong zeros (DESIGN section 5): an element that does not count (its label is ``ignore_index``, or its class
weight is 0) gets an exactly zero gradient, also when its scores are ``-inf`` or NaN (a padded row), and when no
element counts (``W = 0``) every gradient is 0. The products with forward values that may be non-finite are
guarded (:meth:`Ctx.times`) only where the scores may be.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import onnx

from ...ir import Node
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from .elementwise import strong
from .nn import drop_rows, masked_rows, zero_rows


def _class_mask(e: Emitter, node: Node, x: str, rank: int) -> tuple[str, str]:
    """``onehot[n, c, d...] = (y[n, d...] == c and y[n, d...] != ignore_index)``: as bool, and in the dtype of
    ``x``."""
    labels = e.op("Cast", [node.inputs[1]], to=onnx.TensorProto.INT64)
    if "ignore_index" in node.attrs:
        ignored = e.op("Equal", [labels, e.const(np.array(int(node.attrs["ignore_index"]), np.int64))])
        labels = e.op("Where", [ignored, e.const(np.array(-1, np.int64)), labels])
    n_classes = e.op("Gather", [e.shape_of(x), e.const(np.array(1, np.int64))], axis=0)
    classes = e.op("Range", [e.const(np.array(0, np.int64)), n_classes, e.const(np.array(1, np.int64))])
    classes = e.op("Reshape", [classes, e.ints([1, -1] + [1] * (rank - 2))])
    hit = e.op("Equal", [classes, e.op("Unsqueeze", [labels, e.ints([1])])])
    dt = e.onnx_dtype(x)
    return hit, e.op("Cast", [hit], to=dt, like=x) if dt is not None else e.op("CastLike", [hit, x], like=x)


@dataclass(frozen=True)
class _Counted:
    """What both cotangents read: the label mask ``hit`` (bool) and ``onehot`` (in the dtype of ``x``), the
    ``weighted`` mask (times ``w[c]``), ``total = W`` (for ``mean``, else ``None``) and the loss cotangent ``g``
    as each element sees it (divided by ``W``, or broadcast over the class axis)."""

    hit: str
    onehot: str
    weighted: str
    total: str | None
    g: str


def _counted(e: Emitter, node: Node, g: str, rank: int, reduction: str, weights: str | None) -> _Counted:
    x = node.inputs[0]
    hit, onehot = _class_mask(e, node, x, rank)
    weighted = onehot
    if weights is not None:
        weighted = e.op("Mul", [onehot, e.op("Reshape", [weights, e.ints([1, -1] + [1] * (rank - 2))])], like=x)
    total = None
    if reduction == "mean":  # every element's cotangent is g / W; all zero when nothing counts (W = 0)
        total = e.op("ReduceSum", [weighted], keepdims=0)
        zero = e.scalar(0.0, g)
        nothing = e.op("Equal", [total, zero])
        g = e.op("Where", [nothing, zero, e.op("Div", [g, e.op("Where", [nothing, e.scalar(1.0, g), total])])])
    elif reduction == "none":  # one cotangent per element, broadcast over the class axis
        g = e.op("Unsqueeze", [g, e.ints([1])])
    return _Counted(hit, onehot, weighted, total, g)


def _weights_grad(ctx: Ctx, node: Node, c: _Counted, logp: str, rank: int, reduction: str, weights: str) -> str:
    """d l / d w[c] = -x[n, c, d...] at elements labelled c; the mean's d(sum/W)/dw adds -out/W there."""
    e, x = ctx.e, node.inputs[0]
    # Only labelled entries are read: a log-probability of -inf or NaN elsewhere must not leak (0 * inf).
    risky = ctx.nonfinite(logp)
    picked = e.op("Neg", [e.op("Where", [c.hit, logp, e.scalar(0.0, x)], like=x) if risky
                          else e.op("Mul", [c.onehot, logp], like=x)], like=x)
    if reduction == "mean":
        out = node.outputs[0]
        if risky:  # the forward may be NaN (0 x -inf at a row that does not count): recompute sum / W
            per = e.op("ReduceSum", [strong(ctx, c.weighted, picked, x)], keepdims=0)
            out = e.op("Div", [per, e.op("Where", [e.op("Equal", [c.total, e.scalar(0.0, x)]),
                                                  e.scalar(1.0, x), c.total])])
        picked = e.op("Sub", [picked, e.op("Mul", [c.onehot, out], like=x)], like=x)
    axes = [0, *range(2, rank)]
    return e.op("ReduceSum", [e.op("Mul", [c.g, picked], like=x), e.ints(axes)], keepdims=0, like=weights)


def _loss_vjp(ctx: Ctx, node: Node, cts: list, logp: Callable[[], str], log_prob_grad: str | None) -> tuple:
    """Functions emitting the cotangent of the log-probabilities and of the weights (``None``: no weights
    input), and the :class:`_Counted` masks (``None`` without a loss cotangent); ``logp`` emits (or names) the
    log-probabilities, called only for the weights' cotangent."""
    e, x = ctx.e, node.inputs[0]
    rank = e.need_rank(x, node)
    reduction = node.attrs.get("reduction", "mean")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    weights = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    g = cts[0]
    if g is None:
        return (lambda: log_prob_grad), None, None

    @cache
    def counted() -> _Counted:
        return _counted(e, node, g, rank, reduction, weights)

    def glogp() -> str:
        c = counted()
        out = e.op("Neg", [e.op("Mul", [c.g, c.weighted])], like=x)
        return out if log_prob_grad is None else e.op("Add", [out, log_prob_grad], like=x)

    if weights is None:
        return glogp, None, counted
    return glogp, lambda: _weights_grad(ctx, node, counted(), logp(), rank, reduction, weights), counted


def _discarded(ctx: Ctx, node: Node, weighted: str | None) -> str | None:
    """bool ``[N, 1, d...]``: the elements whose scores get a zero gradient, where the scores may be non-finite
    (else ``None``): those whose scores are all ``-inf`` (issue 27: a fully masked row, as Softmax's), and, given
    the ``weighted`` label mask, those that do not count (weight 0 or ignored), whose softmax the VJP reads only
    as ``0 * softmax`` (set to 0 instead, so that forward mode, which meets the tangent times the softmax
    first, gives 0 too where the softmax is NaN)."""
    masked = masked_rows(ctx, node.inputs[0], 1)
    if masked is None or weighted is None:
        return masked
    e = ctx.e
    counts = e.op("ReduceSum", [weighted, e.ints([1])], keepdims=1)
    return e.op("Or", [masked, e.op("Equal", [counts, e.scalar(0.0, counts)])])


@vjp("NegativeLogLikelihoodLoss", bounded=True, finite=True, reads="all")
def negative_log_likelihood_loss(ctx: Ctx, node: Node, cts: list) -> list:
    """``d input = -g * w[y] * onehot(y)`` (``g`` divided by ``W`` for ``mean``); ONNX operator spec
    "NegativeLogLikelihoodLoss", PyTorch ``nll_loss_backward``."""
    x = node.inputs[0]
    gx, gw, _ = _loss_vjp(ctx, node, cts, lambda: x, None)
    return [gx, None, gw][: len(node.inputs)]


@vjp("SoftmaxCrossEntropyLoss", bounded=True, finite=True, reads="all")
def softmax_cross_entropy_loss(ctx: Ctx, node: Node, cts: list) -> list:
    """The NegativeLogLikelihoodLoss cotangent of ``log_prob`` (plus the cotangent of the optional
    ``log_prob`` output), pulled back through ``LogSoftmax(scores, axis=1)``:
    ``d scores = G - softmax(scores) * sum_c G`` (ONNX operator spec "SoftmaxCrossEntropyLoss", PyTorch
    ``_log_softmax_backward_data``)."""
    e, x = ctx.e, node.inputs[0]
    has_log_prob = len(node.outputs) > 1 and node.outputs[1]
    log_prob_grad = cts[1] if len(cts) > 1 else None

    def logp() -> str:
        return node.outputs[1] if has_log_prob else e.op("LogSoftmax", [x], axis=1, like=x)

    glogp, gw, counted = _loss_vjp(ctx, node, cts, logp, log_prob_grad)

    def gx() -> str | None:
        grad = glogp()
        if grad is None:
            return None
        axes = e.ints([1])
        # with a log_prob cotangent every element's softmax is read: only fully masked rows are discarded then
        off = _discarded(ctx, node, None if counted is None or log_prob_grad is not None else counted().weighted)
        prob = zero_rows(ctx, off, e.op("Softmax", [x], axis=1, like=x), x)
        rows = e.op("ReduceSum", [grad, axes], keepdims=1)  # 0 for an element that does not count
        return drop_rows(ctx, off, e.op("Sub", [grad, strong(ctx, rows, prob, x, [x])], like=x), x)

    return [gx, None, gw][: len(node.inputs)]
