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
from ..algebra import Val, name_of, where
from ..context import Ctx
from ..registry import vjp
from ._common import optional_input
from .softmax import drop_rows, masked_rows, zero_rows


def _class_mask(ctx: Ctx, node: Node, x: Val, rank: int) -> tuple[Val, Val]:
    """``onehot[n, c, d...] = (y[n, d...] == c and y[n, d...] != ignore_index)``: as bool, and in the dtype of
    ``x``."""
    e = ctx.e
    labels = e.op("Cast", [node.inputs[1]], to=onnx.TensorProto.INT64)
    if "ignore_index" in node.attrs:
        ignored = e.op("Equal", [labels, e.const(np.array(int(node.attrs["ignore_index"]), np.int64))])
        labels = e.op("Where", [ignored, e.const(np.array(-1, np.int64)), labels])
    n_classes = e.op("Gather", [e.shape_of(x.name), e.const(np.array(1, np.int64))], axis=0)
    classes = e.op("Range", [e.const(np.array(0, np.int64)), n_classes, e.const(np.array(1, np.int64))])
    classes = ctx.val(classes).reshape([1, -1] + [1] * (rank - 2))
    hit = classes.eq(ctx.val(labels).unsqueeze([1]))
    return hit, hit.indicator(x)


@dataclass(frozen=True)
class _Counted:
    """What both cotangents read: the label mask ``hit`` (bool) and ``onehot`` (in the dtype of ``x``), the
    ``weighted`` mask (times ``w[c]``), ``total = W`` (for ``mean``, else ``None``) and the loss cotangent ``g``
    as each element sees it (divided by ``W``, or broadcast over the class axis)."""

    hit: Val
    onehot: Val
    weighted: Val
    total: Val | None
    g: Val


def _counted(ctx: Ctx, node: Node, g: Val, rank: int, reduction: str, weights: str | None) -> _Counted:
    hit, onehot = _class_mask(ctx, node, ctx.val(node.inputs[0]), rank)
    weighted = onehot if weights is None else onehot * ctx.val(weights).reshape([1, -1] + [1] * (rank - 2))
    total = None
    if reduction == "mean":  # every element's cotangent is g / W; all zero when nothing counts (W = 0)
        total = weighted.sum(keepdims=0)
        nothing = total.eq(0)
        g = where(nothing, 0, g / where(nothing, 1, total))
    elif reduction == "none":  # one cotangent per element, broadcast over the class axis
        g = g.unsqueeze([1])
    return _Counted(hit, onehot, weighted, total, g)


def _weights_grad(ctx: Ctx, node: Node, c: _Counted, logp: Val, rank: int, reduction: str, weights: str) -> Val:
    """d l / d w[c] = -x[n, c, d...] at elements labelled c; the mean's d(sum/W)/dw adds -out/W there."""
    x = ctx.val(node.inputs[0])
    # Only labelled entries are read: a log-probability of -inf or NaN elsewhere must not leak (0 * inf).
    risky = ctx.nonfinite(logp.name)
    picked = -(where(c.hit, logp, 0, like=x) if risky else c.onehot * logp)
    if reduction == "mean":
        out = ctx.val(node.outputs[0])
        if risky:  # the forward may be NaN (0 x -inf at a row that does not count): recompute sum / W
            out = c.weighted.times(picked, like=x).sum(keepdims=0) / where(c.total.eq(0), 1, c.total)
        picked = picked - c.onehot * out
    return (c.g * picked).sum([0, *range(2, rank)], keepdims=0)


def _loss_vjp(ctx: Ctx, node: Node, cts: list, logp: Callable[[], Val], log_prob_grad: str | None) -> tuple:
    """Functions emitting the cotangent of the log-probabilities and of the weights (``None``: no weights
    input), and the :class:`_Counted` masks (``None`` without a loss cotangent); ``logp`` emits (or names) the
    log-probabilities, called only for the weights' cotangent."""
    e, x = ctx.e, node.inputs[0]
    rank = e.need_rank(x, node)
    reduction = node.attrs.get("reduction", "mean")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    weights = optional_input(node, 2)
    if cts[0] is None:
        return (lambda: log_prob_grad), None, None
    g = ctx.val(cts[0])

    @cache
    def counted() -> _Counted:
        return _counted(ctx, node, g, rank, reduction, weights)

    def glogp() -> Val:
        c = counted()
        out = -(c.g * c.weighted)
        return out if log_prob_grad is None else out + log_prob_grad

    if weights is None:
        return glogp, None, counted
    return glogp, lambda: _weights_grad(ctx, node, counted(), logp(), rank, reduction, weights), counted


def _discarded(ctx: Ctx, node: Node, weighted: Val | None) -> Val | None:
    """bool ``[N, 1, d...]``: the elements whose scores get a zero gradient, where the scores may be non-finite
    (else ``None``): those whose scores are all ``-inf`` (issue 27: a fully masked row, as Softmax's), and, given
    the ``weighted`` label mask, those that do not count (weight 0 or ignored), whose softmax the VJP reads only
    as ``0 * softmax`` (set to 0 instead, so that forward mode, which meets the tangent times the softmax
    first, gives 0 too where the softmax is NaN)."""
    masked = masked_rows(ctx, node.inputs[0], 1)
    if masked is None or weighted is None:
        return masked
    return masked | weighted.sum([1]).eq(0)


@vjp("NegativeLogLikelihoodLoss", bounded=True, finite=True, reads="all")
def negative_log_likelihood_loss(ctx: Ctx, node: Node, cts: list) -> list:
    """``d input = -g * w[y] * onehot(y)`` (``g`` divided by ``W`` for ``mean``); ONNX operator spec
    "NegativeLogLikelihoodLoss", PyTorch ``nll_loss_backward``."""
    gx, gw, _ = _loss_vjp(ctx, node, cts, lambda: ctx.val(node.inputs[0]), None)
    return [gx, None, gw][: len(node.inputs)]


@vjp("SoftmaxCrossEntropyLoss", bounded=True, finite=True, reads="all")
def softmax_cross_entropy_loss(ctx: Ctx, node: Node, cts: list) -> list:
    """The NegativeLogLikelihoodLoss cotangent of ``log_prob`` (plus the cotangent of the optional
    ``log_prob`` output), pulled back through ``LogSoftmax(scores, axis=1)``:
    ``d scores = G - softmax(scores) * sum_c G`` (ONNX operator spec "SoftmaxCrossEntropyLoss", PyTorch
    ``_log_softmax_backward_data``)."""
    x = ctx.val(node.inputs[0])
    has_log_prob = len(node.outputs) > 1 and node.outputs[1]
    log_prob_grad = cts[1] if len(cts) > 1 else None

    def logp() -> Val:
        return ctx.val(node.outputs[1]) if has_log_prob else x.apply("LogSoftmax", axis=1)

    glogp, gw, counted = _loss_vjp(ctx, node, cts, logp, log_prob_grad)

    def gx() -> Val | None:
        grad = glogp()
        if grad is None:
            return None
        grad = ctx.val(name_of(grad))
        # with a log_prob cotangent every element's softmax is read: only fully masked rows are discarded then
        off = _discarded(ctx, node, None if counted is None or log_prob_grad is not None else counted().weighted)
        prob = zero_rows(ctx, off, x.apply("Softmax", axis=1), x)
        rows = grad.sum([1])  # 0 for an element that does not count
        return drop_rows(ctx, off, grad - rows.times(prob, reads=[x], like=x), x)

    return [gx, None, gw][: len(node.inputs)]
