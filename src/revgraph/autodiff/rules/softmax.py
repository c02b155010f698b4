"""VJPs of neural-network activations over an axis (ONNX operator spec, "Softmax", "LogSoftmax"; since
opset 13 both normalise along the single ``axis``, default -1; derivatives as in PyTorch's
``_softmax_backward_data`` and ``_log_softmax_backward_data``)."""

from __future__ import annotations

import math

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val, name_of, where
from ..context import Ctx
from ..registry import not_differentiable, vjp


def masked_rows(ctx: Ctx, x: Val | str, axis: int) -> Val | None:
    """bool, ``x``'s shape with ``axis`` of size 1: the rows of ``x`` along ``axis`` whose elements are all
    ``-inf`` (a fully masked row: its softmax is 0 / 0, NaN), or ``None`` where ``x`` cannot hold ``-inf`` (it is
    no value that may be non-finite, :meth:`Ctx.nonfinite`: then nothing is emitted). Such a row gets a zero
    gradient (issue 27; the convention of jax#6811 and PyTorch's masked softmax, as a fully masked Attention
    row has)."""
    if not ctx.nonfinite(name_of(x)):
        return None
    return ctx.val(name_of(x)).max([axis]).eq(-math.inf)


def zero_rows(ctx: Ctx, masked: Val | None, v: Val | str, like: Val | str) -> Val:
    """``v`` with the rows ``masked`` set to exactly 0 (a forward value: ``Where``, whatever ``v`` holds there)."""
    v = ctx.val(name_of(v))
    return v if masked is None else where(masked, 0, v, like=like)


def drop_rows(ctx: Ctx, masked: Val | None, dx: Val | str, like: Val | str) -> Val:
    """The cotangent ``dx`` with the rows ``masked`` set to 0 (a selection: exact also for inf or NaN there)."""
    dx = ctx.val(name_of(dx))
    return dx if masked is None else dx.select(~masked, like=like)


def _axis(node: Node) -> int:
    return int(node.attrs.get("axis", -1))


@vjp("Softmax", bounded=True, finite=True, reads="all", sanitizing=True)
def softmax(ctx: Ctx, node: Node, cts: list) -> list:
    """``dx = y * (dy - sum(dy * y, axis))`` (the Jacobian ``diag(y) - y y^T`` applied to ``dy``). Strong zeros
    where ``y`` may be non-finite: ``dx = y dy - y sum(y dy)`` with both products strong, so a row whose
    cotangent is all zero gets zeros even where ``y`` is NaN (and the same values as above otherwise). A row of
    ``x`` that is all ``-inf`` (:func:`masked_rows`) has ``y`` taken as 0 there: its gradient is 0, in forward
    mode too (the transposed VJP multiplies the tangent by that 0)."""
    x, y, g = ctx.vals(node.inputs[0], node.outputs[0], cts[0])
    axis = _axis(node)
    masked = masked_rows(ctx, x, axis)
    if ctx.nonfinite(y.name) or masked is not None:
        y = zero_rows(ctx, masked, y, y)
        yg = g.times(y, like=y)
        dx = yg - yg.sum([axis]).times(y, like=y)
        return [dx if ctx.finite else drop_rows(ctx, masked, dx, x)]  # (finite: 0 x finite is 0 already)
    return [y * (g - (g * y).sum([axis]))]


@vjp("LogSoftmax", bounded=True, finite=True, reads="all")
def log_softmax(ctx: Ctx, node: Node, cts: list) -> list:
    """``dx = dy - exp(y) * sum(dy, axis)`` (``exp(y)`` is the softmax); the product is strong where ``y`` may
    be NaN (a row of ``-inf`` scores), so a row whose cotangent sums to zero gets ``dy`` there. A row of ``x``
    that is all ``-inf`` (:func:`masked_rows`) gets 0: its softmax is taken as 0 and ``dy`` dropped there."""
    x, y, g = ctx.vals(node.inputs[0], node.outputs[0], cts[0])
    axis = _axis(node)
    masked = masked_rows(ctx, x, axis)
    total = g.sum([axis])
    p = zero_rows(ctx, masked, y.exp(), y)
    return [drop_rows(ctx, masked, g - total.times(p, reads=[y], like=y), x)]


not_differentiable("piecewise constant: the derivative is 0 almost everywhere", "Hardmax", bounded=False,
                   finite=False)
not_differentiable("integer result", "ArgMax", "ArgMin", bounded=False, finite=True)
not_differentiable("random: the sample does not depend on the input's values (only on its shape and dtype) or has no "
                   "inputs; a Bernoulli or Multinomial draw is discrete", "RandomNormal", "RandomNormalLike",
                   "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial", bounded=False, finite=False)
not_differentiable("its only inputs are integers (a window length, bin counts)", "BlackmanWindow", "HammingWindow",
                   "HannWindow", "MelWeightMatrix", bounded=False, finite=False)
not_differentiable("integer (quantized) arithmetic: no floating-point input carries a gradient", "ConvInteger",
                   "MatMulInteger", "QLinearConv", "QLinearMatMul", bounded=False,
                   finite=False)
not_differentiable("integer result (selected box indices)", "NonMaxSuppression", bounded=False, finite=False)
not_differentiable("boolean result", "OptionalHasElement", bounded=False, finite=False)
not_differentiable("strings or encoded bytes, not floating point", "ImageDecoder", "RegexFullMatch", "StringConcat",
                   "StringNormalizer", "StringSplit", "TfIdfVectorizer", bounded=False, finite=False)


@vjp("BitCast", bounded=True, finite=False, reads=())  # (its VJP refuses: it multiplies by nothing)
def bitcast(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "BitCast" (opset 26) reinterprets the bits of its input as another type of the same size: the
    output's values are no differentiable function of the input's. From or to an integer type no gradient
    flows (an integer value cuts the path, as everywhere); a float-to-float BitCast (float16 <-> bfloat16) on
    a path to the loss is refused, never cut silently (issue 41: a float output that varies with a float input
    is differentiated or refused)."""
    raise GraphError(f"{node.label()}: BitCast reinterprets the bits of {node.inputs[0]!r} as another floating-point "
                     "type; its output is no differentiable function of the input's value: remove the path from the "
                     "gradient (differentiate with respect to the BitCast's output, or a value after it)")
