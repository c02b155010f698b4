"""VJPs of neural-network activations over an axis (ONNX operator spec, "Softmax", "LogSoftmax"; since
opset 13 both normalise along the single ``axis``, default -1; derivatives as in PyTorch's
``_softmax_backward_data`` and ``_log_softmax_backward_data``)."""

from __future__ import annotations

from ...ir import Node
from ..context import Ctx
from ..registry import not_differentiable, vjp
from .elementwise import strong


@vjp("Softmax")
def softmax(ctx: Ctx, node: Node, cts: list) -> list:
    """``dx = y * (dy - sum(dy * y, axis))`` (the Jacobian ``diag(y) - y y^T`` applied to ``dy``). Strong zeros
    where ``y`` may be non-finite: ``dx = y dy - y sum(y dy)`` with both products strong, so a row whose
    cotangent is all zero gets zeros even where ``y`` is NaN (and the same values as above otherwise)."""
    e, x, y = ctx.e, node.inputs[0], node.outputs[0]
    g = cts[0]
    axes = e.ints([int(node.attrs.get("axis", -1))])
    if ctx.nonfinite(y):
        yg = strong(ctx, g, y, y)
        dot = e.op("ReduceSum", [yg, axes], keepdims=1)
        return [e.op("Sub", [yg, strong(ctx, dot, y, y)], like=x)]
    dot = e.op("ReduceSum", [e.op("Mul", [g, y], like=y), axes], keepdims=1)
    return [e.op("Mul", [y, e.op("Sub", [g, dot], like=y)], like=x)]


@vjp("LogSoftmax")
def log_softmax(ctx: Ctx, node: Node, cts: list) -> list:
    """``dx = dy - exp(y) * sum(dy, axis)`` (``exp(y)`` is the softmax); the product is strong where ``y`` may
    be NaN (a row of ``-inf`` scores), so a row whose cotangent sums to zero gets ``dy`` there."""
    e, x, y = ctx.e, node.inputs[0], node.outputs[0]
    g = cts[0]
    axes = e.ints([int(node.attrs.get("axis", -1))])
    total = e.op("ReduceSum", [g, axes], keepdims=1)
    return [e.op("Sub", [g, strong(ctx, total, e.op("Exp", [y], like=y), y, [y])], like=x)]


not_differentiable("piecewise constant: the derivative is 0 almost everywhere", "Hardmax")
not_differentiable("integer result", "ArgMax", "ArgMin")
not_differentiable("random: the sample does not depend on the input's values (only on its shape and dtype) or has no "
                   "inputs; a Bernoulli or Multinomial draw is discrete", "RandomNormal", "RandomNormalLike",
                   "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial")
not_differentiable("its only inputs are integers (a window length, bin counts)", "BlackmanWindow", "HammingWindow",
                   "HannWindow", "MelWeightMatrix")
not_differentiable("integer (quantized) arithmetic: no floating-point input carries a gradient", "ConvInteger",
                   "MatMulInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLinear")
not_differentiable("integer result (selected box indices)", "NonMaxSuppression")
not_differentiable("boolean result", "OptionalHasElement")
not_differentiable("strings or encoded bytes, not floating point", "ImageDecoder", "RegexFullMatch", "StringConcat",
                   "StringNormalizer", "StringSplit", "TfIdfVectorizer")
not_differentiable("the bits are reinterpreted as another type: the output's values are no differentiable function of "
                   "the input's", "BitCast")
