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
guarded (:meth:`Emitter.times`) only where the scores may be.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...ir import Node
from ..registry import Emitter, vjp
from .elementwise import strong


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


def _loss_vjp(e: Emitter, node: Node, out_grads: list, logp: str, log_prob_grad: str | None) -> tuple:
    """The cotangent of the log-probabilities ``logp`` and of the weights (``None`` when not needed)."""
    x = node.inputs[0]
    rank = e.need_rank(x, node)
    reduction = node.attrs.get("reduction", "mean")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    weights = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    wants_w = weights is not None and e.need[2]
    g = out_grads[0]
    if g is None:
        return log_prob_grad, None
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
    glogp = e.op("Neg", [e.op("Mul", [g, weighted])], like=x)
    if log_prob_grad is not None:
        glogp = e.op("Add", [glogp, log_prob_grad], like=x)
    gw = None
    if wants_w:
        # d l / d w[c] = -x[n, c, d...] at elements labelled c; the mean's d(sum/W)/dw adds -out/W there.
        # Only labelled entries are read: a log-probability of -inf or NaN elsewhere must not leak (0 * inf).
        risky = e.nonfinite(logp)
        picked = e.op("Neg", [e.op("Where", [hit, logp, e.scalar(0.0, x)], like=x) if risky
                              else e.op("Mul", [onehot, logp], like=x)], like=x)
        if reduction == "mean":
            out = node.outputs[0]
            if risky:  # the forward may be NaN (0 x -inf at a row that does not count): recompute sum / W
                per = e.op("ReduceSum", [strong(e, weighted, picked, x)], keepdims=0)
                out = e.op("Div", [per, e.op("Where", [e.op("Equal", [total, e.scalar(0.0, x)]),
                                                      e.scalar(1.0, x), total])])
            picked = e.op("Sub", [picked, e.op("Mul", [onehot, out], like=x)], like=x)
        axes = [0, *range(2, rank)]
        gw = e.op("ReduceSum", [e.op("Mul", [g, picked], like=x), e.ints(axes)], keepdims=0, like=weights)
    return glogp, gw


@vjp("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss(e: Emitter, node: Node, out_grads: list) -> list:
    """``d input = -g * w[y] * onehot(y)`` (``g`` divided by ``W`` for ``mean``); ONNX operator spec
    "NegativeLogLikelihoodLoss", PyTorch ``nll_loss_backward``."""
    x = node.inputs[0]
    gx, gw = _loss_vjp(e, node, out_grads, x, None)
    if not e.need[0]:
        gx = None
    return [gx, None, gw][: len(node.inputs)]


@vjp("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(e: Emitter, node: Node, out_grads: list) -> list:
    """The NegativeLogLikelihoodLoss cotangent of ``log_prob`` (plus the cotangent of the optional
    ``log_prob`` output), pulled back through ``LogSoftmax(scores, axis=1)``:
    ``d scores = G - softmax(scores) * sum_c G`` (ONNX operator spec "SoftmaxCrossEntropyLoss", PyTorch
    ``_log_softmax_backward_data``)."""
    x = node.inputs[0]
    has_log_prob = len(node.outputs) > 1 and node.outputs[1]
    log_prob_grad = out_grads[1] if len(out_grads) > 1 else None
    logp = node.outputs[1] if has_log_prob else None
    if logp is None and len(node.inputs) > 2 and node.inputs[2] and e.need[2]:
        logp = e.op("LogSoftmax", [x], axis=1, like=x)
    glogp, gw = _loss_vjp(e, node, out_grads, logp, log_prob_grad)
    gx = None
    if e.need[0] and glogp is not None:
        axes = e.ints([1])
        prob = e.op("Softmax", [x], axis=1, like=x)
        rows = e.op("ReduceSum", [glogp, axes], keepdims=1)  # 0 for an element that does not count
        gx = e.op("Sub", [glogp, strong(e, rows, prob, x, [x])], like=x)
    return [gx, None, gw][: len(node.inputs)]
