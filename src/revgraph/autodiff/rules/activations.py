"""VJPs of pointwise activations and the remaining unary math of ONNX (ONNX operator spec, "Gelu" ...
"Shrink"; derivatives as in PyTorch's ``tools/autograd/derivatives.yaml`` and JAX's ``jax/_src/lax/lax.py``).

Conventions (DESIGN.md section 5): at a kink next to a constant piece the 0 subgradient is taken (both kinks of
``HardSigmoid``, ``ThresholdedRelu`` and ``Shrink``; ``HardSwish = x HardSigmoid(x)`` follows by the product
rule: 0 at -3, 1 at 3); at the kink of ``PRelu`` and ``Selu`` (0) the slope of the left piece, as PyTorch.
Strong zeros: slopes with an infinite limit (``Asin``, ``Acosh``, ``Atanh`` at the ends of their domains, ``Sinh``
and ``Cosh`` overflowing) always use :func:`strong`, so that a zero cotangent gives an exact zero; the other
slopes are finite for finite inputs and use it where the forward values they read may be inf or NaN
(``Emitter.nonfinite``: a graph input, a discarded ``Where`` branch), e.g. GELU's ``x phi(x)`` is NaN at -inf.
Float attributes are rounded to float32 first, as ONNX stores them, so the derivative matches the forward.
"""

from __future__ import annotations

import math

import numpy as np

from ...ir import Node, is_float_dtype
from ..registry import Emitter, vjp
from .elementwise import strong


def _attr(node: Node, name: str, default: float) -> float:
    """A float attribute as the runtimes see it (ONNX float attributes are 32-bit)."""
    return float(np.float32(node.attrs.get(name, default)))


def _floating(e: Emitter, x: str) -> bool:
    dt = e.dtype(x)
    return dt is None or is_float_dtype(dt)


def _unary(*op_types: str):
    """Register a one-input rule written as ``fn(e, node, x, y, g) -> dx``; integer inputs get no gradient."""

    def register(fn):
        @vjp(*op_types)
        def rule(e: Emitter, node: Node, out_grads: list) -> list:
            x, y, g = node.inputs[0], node.outputs[0], out_grads[0]
            if not e.need[0] or not _floating(e, x):
                return [None] * len(node.inputs)
            return [fn(e, node, x, y, g)] + [None] * (len(node.inputs) - 1)

        rule.__doc__ = fn.__doc__
        return fn

    return register


def _times(e: Emitter, g: str, d: str, x: str, reads: list[str]) -> str:
    """``g * d``, strong where the forward values ``reads`` (that ``d`` is computed from) may be non-finite."""
    return strong(e, g, d, x, reads)


def _over(e: Emitter, g: str, denom: str, x: str) -> str:
    """``g / denom`` for a ``denom >= 1`` computed from ``x`` (inf or NaN only where ``x`` is): a plain ``Div``
    unless ``x`` may be non-finite, then strong (``0 / NaN`` must be 0)."""
    if not e.nonfinite(x):
        return e.op("Div", [g, denom], like=x)
    return strong(e, g, e.op("Reciprocal", [denom], like=x), x)


# ---------------------------------------------------------------------------------------------- activations


@_unary("Gelu")
def gelu(e, node, x, y, g):
    """Exact: ``Phi(x) + x phi(x)``; ``approximate="tanh"``: with ``t = tanh(k (x + c x^3))``,
    ``(1 + t) / 2 + x (1 - t^2) k (1 + 3 c x^2) / 2`` (PyTorch's ``gelu_backward``)."""
    half, one = e.scalar(0.5, x), e.scalar(1.0, x)
    x2 = e.op("Mul", [x, x], like=x)
    if node.attrs.get("approximate", "none") == "tanh":
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        inner = e.op("Mul", [e.scalar(k, x), e.op("Add", [x, e.op("Mul", [e.scalar(c, x), e.op("Mul", [x2, x])])])])
        t = e.op("Tanh", [inner], like=x)
        left = e.op("Mul", [half, e.op("Add", [one, t])], like=x)
        sech2 = e.op("Sub", [one, e.op("Mul", [t, t])], like=x)
        slope = e.op("Mul", [sech2, e.op("Add", [one, e.op("Mul", [e.scalar(3 * c, x), x2])])], like=x)
        right = e.op("Mul", [e.op("Mul", [x, slope]), e.scalar(0.5 * k, x)], like=x)
    else:
        cdf = e.op("Erf", [e.op("Mul", [x, e.scalar(1.0 / math.sqrt(2.0), x)])], like=x)
        left = e.op("Mul", [half, e.op("Add", [one, cdf])], like=x)
        gauss = e.op("Exp", [e.op("Mul", [x2, e.scalar(-0.5, x)])], like=x)
        pdf = e.op("Mul", [gauss, e.scalar(1.0 / math.sqrt(2.0 * math.pi), x)], like=x)
        right = e.op("Mul", [x, pdf], like=x)
    return _times(e, g, e.op("Add", [left, right], like=x), x, [x])


@_unary("HardSigmoid")
def hard_sigmoid(e, node, x, y, g):
    """``alpha`` where ``0 < alpha x + beta < 1``, else 0 (also at both kinks)."""
    alpha = _attr(node, "alpha", 0.2)
    t = e.op("Add", [e.op("Mul", [x, e.scalar(alpha, x)]), e.scalar(_attr(node, "beta", 0.5), x)], like=x)
    inside = e.op("And", [e.op("Greater", [t, e.scalar(0.0, x)]), e.op("Less", [t, e.scalar(1.0, x)])])
    return e.select(inside, e.op("Mul", [g, e.scalar(alpha, x)]), like=x)


@_unary("HardSwish")
def hard_swish(e, node, x, y, g):
    """``h(x) + x h'(x)`` with ``h`` = HardSigmoid(alpha = 1/6 as float32, beta = 1/2) and its 0-at-kinks
    slope: ``2 alpha x + 1/2`` where ``0 < alpha x + beta < 1``, 0 below and 1 above (PyTorch takes the inner
    piece at the kinks ``x = -3, 3``; this takes the outer ones, as for HardSigmoid)."""
    alpha = _attr(node, "alpha", 1.0 / 6.0)  # HardSwish has no attributes: this is the spec's constant
    t = e.op("Add", [e.op("Mul", [x, e.scalar(alpha, x)]), e.scalar(0.5, x)], like=x)
    inside = e.op("And", [e.op("Greater", [t, e.scalar(0.0, x)]), e.op("Less", [t, e.scalar(1.0, x)])])
    ramp = e.op("Add", [e.op("Mul", [x, e.scalar(2 * alpha, x)]), e.scalar(0.5, x)], like=x)
    outer = e.op("Where", [e.op("GreaterOrEqual", [t, e.scalar(1.0, x)]), e.scalar(1.0, x), e.scalar(0.0, x)])
    return _times(e, g, e.op("Where", [inside, ramp, outer], like=x), x, [])  # 0 or 1 outside: always finite


@vjp("PRelu")
def prelu(e: Emitter, node: Node, out_grads: list) -> list:
    """``dx = dy`` where ``x > 0`` else ``slope dy``; ``dslope = dy x`` where ``x <= 0``, summed over the axes
    the slope was broadcast along (PyTorch's ``_prelu_kernel_backward``; slope's piece at 0)."""
    x, slope = node.inputs
    g = out_grads[0]
    pos = e.op("Greater", [x, e.scalar(0.0, x)])
    zero = e.scalar(0.0, x)
    gx = e.op("Where", [pos, g, strong(e, g, slope, None, [slope])], like=x) if e.need[0] else None
    gs = e.reduce_to(e.op("Where", [pos, zero, strong(e, g, x, None, [x])], like=x), slope) if e.need[1] else None
    return [gx, gs]


@_unary("Selu")
def selu(e, node, x, y, g):
    """``gamma`` for ``x > 0``, ``gamma alpha exp(x) = y + gamma alpha`` otherwise (ONNX "Selu")."""
    alpha, gamma = _attr(node, "alpha", 1.67326319217681884765625), _attr(node, "gamma", 1.05070102214813232421875)
    neg = e.op("Add", [y, e.scalar(alpha * gamma, x)], like=x)
    d = e.op("Where", [e.op("Greater", [x, e.scalar(0.0, x)]), e.scalar(gamma, x), neg], like=x)
    return _times(e, g, d, x, [x])


@_unary("Celu")
def celu(e, node, x, y, g):
    """1 for ``x > 0``, ``exp(x / alpha) = y / alpha + 1`` otherwise (ONNX "Celu"); written with ``y`` so that
    no ``exp`` of a large positive ``x`` can overflow."""
    alpha = _attr(node, "alpha", 1.0)
    one = e.scalar(1.0, x)
    neg = e.op("Add", [e.op("Div", [y, e.scalar(alpha, x)]), one], like=x)
    return _times(e, g, e.op("Where", [e.op("Greater", [x, e.scalar(0.0, x)]), one, neg], like=x), x, [x])


@_unary("Mish")
def mish(e, node, x, y, g):
    """``t + x sigmoid(x) (1 - t^2)`` with ``t = tanh(softplus(x))`` (PyTorch's ``mish_backward``)."""
    t = e.op("Tanh", [e.op("Softplus", [x], like=x)], like=x)
    sech2 = e.op("Sub", [e.scalar(1.0, x), e.op("Mul", [t, t])], like=x)
    d = e.op("Add", [t, e.op("Mul", [e.op("Mul", [x, e.op("Sigmoid", [x], like=x)]), sech2])], like=x)
    return _times(e, g, d, x, [x])


@_unary("Softsign")
def softsign(e, node, x, y, g):
    """``1 / (1 + |x|)^2``."""
    a = e.op("Add", [e.op("Abs", [x], like=x), e.scalar(1.0, x)], like=x)
    return _over(e, g, e.op("Mul", [a, a], like=x), x)


@_unary("ThresholdedRelu")
def thresholded_relu(e, node, x, y, g):
    """1 where ``x > alpha``, else 0 (also at ``x = alpha``, PyTorch's ``threshold_backward``)."""
    above = e.op("Greater", [x, e.scalar(_attr(node, "alpha", 1.0), x)])
    return e.select(above, g, like=x)


@_unary("Shrink")
def shrink(e, node, x, y, g):
    """1 where ``|x| > lambd``, else 0 (also at ``|x| = lambd``, PyTorch's ``softshrink_backward``)."""
    lambd = _attr(node, "lambd", 0.5)
    outside = e.op("Or", [e.op("Greater", [x, e.scalar(lambd, x)]), e.op("Less", [x, e.scalar(-lambd, x)])])
    return e.select(outside, g, like=x)


# ---------------------------------------------------------------------------------------------- trigonometric


@_unary("Sinh")
def sinh(e, node, x, y, g):
    """``cosh(x)`` (strong zeros: it overflows to inf for large ``|x|``)."""
    return strong(e, g, e.op("Cosh", [x], like=x), x)


@_unary("Cosh")
def cosh(e, node, x, y, g):
    """``sinh(x)``."""
    return strong(e, g, e.op("Sinh", [x], like=x), x)


@_unary("Tan")
def tan(e, node, x, y, g):
    """``1 + tan(x)^2`` (overflows near the poles in float16: ``y`` is never taken as finite)."""
    return _times(e, g, e.op("Add", [e.scalar(1.0, x), e.op("Mul", [y, y])], like=x), x, [y])


def _inv_sqrt_one_minus_sq(e: Emitter, x: str) -> str:
    """``1 / sqrt((1 - x)(1 + x))``: inf at ``|x| = 1`` (factored for accuracy near the ends)."""
    one = e.scalar(1.0, x)
    prod = e.op("Mul", [e.op("Sub", [one, x]), e.op("Add", [one, x])], like=x)
    return e.op("Reciprocal", [e.op("Sqrt", [prod], like=x)], like=x)


@_unary("Asin")
def asin(e, node, x, y, g):
    """``1 / sqrt(1 - x^2)``."""
    return strong(e, g, _inv_sqrt_one_minus_sq(e, x), x)


@_unary("Acos")
def acos(e, node, x, y, g):
    """``-1 / sqrt(1 - x^2)``."""
    return strong(e, g, e.op("Neg", [_inv_sqrt_one_minus_sq(e, x)], like=x), x)


@_unary("Atan")
def atan(e, node, x, y, g):
    """``1 / (1 + x^2)``."""
    return _over(e, g, e.op("Add", [e.scalar(1.0, x), e.op("Mul", [x, x])], like=x), x)


@_unary("Asinh")
def asinh(e, node, x, y, g):
    """``1 / sqrt(x^2 + 1)``."""
    root = e.op("Sqrt", [e.op("Add", [e.op("Mul", [x, x]), e.scalar(1.0, x)], like=x)], like=x)
    return _over(e, g, root, x)


@_unary("Acosh")
def acosh(e, node, x, y, g):
    """``1 / sqrt((x - 1)(x + 1))``: inf at ``x = 1``."""
    one = e.scalar(1.0, x)
    prod = e.op("Mul", [e.op("Sub", [x, one]), e.op("Add", [x, one])], like=x)
    return strong(e, g, e.op("Reciprocal", [e.op("Sqrt", [prod], like=x)], like=x), x)


@_unary("Atanh")
def atanh(e, node, x, y, g):
    """``1 / ((1 - x)(1 + x))``: inf at ``|x| = 1``."""
    one = e.scalar(1.0, x)
    prod = e.op("Mul", [e.op("Sub", [one, x]), e.op("Add", [one, x])], like=x)
    return strong(e, g, e.op("Reciprocal", [prod], like=x), x)


@vjp("Mod")
def mod(e: Emitter, node: Node, out_grads: list) -> list:
    """``y = a - n b`` with ``n`` the truncated (``fmod=1``) or floored (``fmod=0``) quotient, piecewise
    constant: ``da = dy``, ``db = -n dy`` (PyTorch's ``fmod``/``remainder`` derivatives). ``n`` is recovered as
    ``round((a - y) / b)``, exactly the integer the forward used even where ``a / b`` rounds across it.
    Integer Mod has no gradient."""
    a, b = node.inputs
    y, g = node.outputs[0], out_grads[0]
    if not _floating(e, a):
        return [None, None]
    ga = e.reduce_to(g, a) if e.need[0] else None
    gb = None
    if e.need[1]:
        n = e.op("Round", [e.op("Div", [e.op("Sub", [a, y]), b])], like=y)
        gb = e.reduce_to(strong(e, g, e.op("Neg", [n], like=y), y), b)
    return [ga, gb]
