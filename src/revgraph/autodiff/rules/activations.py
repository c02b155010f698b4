"""VJPs of pointwise activations and the remaining unary math of ONNX (ONNX operator spec, "Gelu" ...
"Shrink", "Swish"; derivatives as in PyTorch's ``tools/autograd/derivatives.yaml`` and JAX's ``jax/_src/lax/lax.py``).

Conventions (DESIGN.md section 5): at a kink next to a constant piece the 0 subgradient is taken (both kinks of
``HardSigmoid``, ``ThresholdedRelu`` and ``Shrink``; ``HardSwish = x HardSigmoid(x)`` follows by the product
rule: 0 at -3, 1 at 3); at the kink of ``PRelu`` and ``Selu`` (0) the slope of the left piece, as PyTorch.
Strong zeros: slopes with an infinite limit (``Asin``, ``Acosh``, ``Atanh`` at the ends of their domains, ``Sinh``
and ``Cosh`` overflowing) always use :func:`strong`, so that a zero cotangent gives an exact zero; the other
slopes are finite for finite inputs and use it where the forward values they read may be inf or NaN
(``Ctx.nonfinite``: a graph input, a discarded ``Where`` branch), e.g. GELU's ``x phi(x)`` is NaN at -inf.
Float attributes are rounded to float32 first, as ONNX stores them, so the derivative matches the forward.
"""

from __future__ import annotations

import math

import numpy as np

from ...ir import Node
from ..context import Ctx
from ..emitter import Emitter
from ..registry import unary, vjp
from .elementwise import positive, strong


def _attr(node: Node, name: str, default: float) -> float:
    """A float attribute as the runtimes see it (ONNX float attributes are 32-bit)."""
    return float(np.float32(node.attrs.get(name, default)))


def _times(ctx: Ctx, g: str, d: str, x: str, reads: list[str]) -> str:
    """``g * d``, strong where the forward values ``reads`` (that ``d`` is computed from) may be non-finite."""
    return strong(ctx, g, d, x, reads)


def _over(ctx: Ctx, g: str, denom: str, x: str) -> str:
    """``g / denom`` for a ``denom >= 1`` computed from ``x`` (inf or NaN only where ``x`` is): a plain ``Div``
    unless ``x`` may be non-finite, then strong (``0 / NaN`` must be 0)."""
    if not ctx.nonfinite(x):
        return ctx.e.op("Div", [g, denom], like=x)
    return strong(ctx, g, ctx.e.op("Reciprocal", [denom], like=x), x)


# ---------------------------------------------------------------------------------------------- activations


@unary("Gelu")
def gelu(ctx, node, x, y, g):
    """Exact: ``Phi(x) + x phi(x)``; ``approximate="tanh"``: with ``t = tanh(k (x + c x^3))``,
    ``(1 + t) / 2 + x (1 - t^2) k (1 + 3 c x^2) / 2`` (PyTorch's ``gelu_backward``)."""
    e = ctx.e
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
    return _times(ctx, g, e.op("Add", [left, right], like=x), x, [x])


def _swish_parts(e: Emitter, node: Node, x: str) -> tuple[str, str]:
    """``(swish(x), dswish/dx)`` with ``s = sigmoid(alpha x)``: ``x s`` and ``s (1 + alpha x (1 - s))``."""
    alpha = _attr(node, "alpha", 1.0)
    ax = x if alpha == 1.0 else e.op("Mul", [x, e.scalar(alpha, x)], like=x)
    s = e.op("Sigmoid", [ax], like=x)
    one = e.scalar(1.0, x)
    d = e.op("Mul", [s, e.op("Add", [one, e.op("Mul", [ax, e.op("Sub", [one, s], like=x)], like=x)], like=x)], like=x)
    return e.op("Mul", [x, s], like=x), d


@unary("Swish")
def swish(ctx, node, x, y, g):
    """``y = x sigmoid(alpha x)`` (ONNX "Swish", opset 24): with ``s = sigmoid(alpha x)``,
    ``dy/dx = s + alpha x s (1 - s) = s (1 + alpha x (1 - s))`` (PyTorch's ``silu_backward`` for alpha = 1)."""
    return _times(ctx, g, _swish_parts(ctx.e, node, x)[1], x, [x])


@vjp("SwiGLU")
def swiglu(ctx: Ctx, node: Node, cts: list) -> list:
    """``Y = Swish_alpha(A) * B`` (ONNX "SwiGLU", opset 28; same shapes, no broadcasting): ``dA = dY B
    swish'(A)``, ``dB = dY swish(A)`` (the product rule over :func:`swish`)."""
    e, (a, b), g = ctx.e, node.inputs, cts[0]

    def parts() -> tuple[str, str]:
        return _swish_parts(e, node, a)

    return [lambda: _times(ctx, ctx.times(g, b, a, [b]), parts()[1], a, [a]),
            lambda: ctx.times(g, parts()[0], b, [a])]


@unary("HardSigmoid")
def hard_sigmoid(ctx, node, x, y, g):
    """``alpha`` where ``0 < alpha x + beta < 1``, else 0 (also at both kinks). The mask is read from the output
    ``y = max(0, min(1, alpha x + beta))``: ``0 < y < 1`` exactly where the forward's ``alpha x + beta`` was
    inside (``y`` is that value there, and 0, 1 or NaN elsewhere), with no recomputation of it."""
    e = ctx.e
    alpha = _attr(node, "alpha", 0.2)
    inside = e.op("And", [e.op("Greater", [y, e.scalar(0.0, y)]), e.op("Less", [y, e.scalar(1.0, y)])])
    return ctx.select(inside, e.op("Mul", [g, e.scalar(alpha, x)]), like=x)


@unary("HardSwish")
def hard_swish(ctx, node, x, y, g):
    """``h(x) + x h'(x)`` with ``h`` = HardSigmoid(alpha = 1/6 as float32, beta = 1/2) and its 0-at-kinks
    slope: ``2 alpha x + 1/2`` where ``0 < alpha x + beta < 1``, 0 below and 1 above (PyTorch takes the inner
    piece at the kinks ``x = -3, 3``; this takes the outer ones, as for HardSigmoid)."""
    e = ctx.e
    alpha = _attr(node, "alpha", 1.0 / 6.0)  # HardSwish has no attributes: this is the spec's constant
    t = e.op("Add", [e.op("Mul", [x, e.scalar(alpha, x)]), e.scalar(0.5, x)], like=x)
    inside = e.op("And", [e.op("Greater", [t, e.scalar(0.0, x)]), e.op("Less", [t, e.scalar(1.0, x)])])
    ramp = e.op("Add", [e.op("Mul", [x, e.scalar(2 * alpha, x)]), e.scalar(0.5, x)], like=x)
    outer = e.op("Where", [e.op("GreaterOrEqual", [t, e.scalar(1.0, x)]), e.scalar(1.0, x), e.scalar(0.0, x)])
    return _times(ctx, g, e.op("Where", [inside, ramp, outer], like=x), x, [])  # 0 or 1 outside: always finite


@vjp("PRelu")
def prelu(ctx: Ctx, node: Node, cts: list) -> list:
    """``dx = dy`` where ``x > 0`` else ``slope dy``; ``dslope = dy x`` where ``x <= 0``, summed over the axes
    the slope was broadcast along (PyTorch's ``_prelu_kernel_backward``; slope's piece at 0)."""
    e, (x, slope), g = ctx.e, node.inputs, cts[0]
    pos = e.op("Greater", [x, e.scalar(0.0, x)])
    zero = e.scalar(0.0, x)
    return [lambda: e.op("Where", [pos, g, strong(ctx, g, slope, None, [slope])], like=x),
            lambda: e.reduce_to(e.op("Where", [pos, zero, strong(ctx, g, x, None, [x])], like=x), slope)]


@unary("Selu")
def selu(ctx, node, x, y, g):
    """``gamma`` for ``x > 0``, ``gamma alpha exp(x) = y + gamma alpha`` otherwise (ONNX "Selu"). For
    ``gamma >= 1`` and ``alpha >= 0`` (the defaults) only the output is read: ``y = gamma x >= x > 0`` where
    ``x > 0`` and ``y = gamma (alpha exp(x) - alpha) <= 0`` elsewhere (``exp(x) <= 1``), so ``y > 0`` is
    ``x > 0``. Otherwise the mask reads ``x`` (a ``gamma < 1`` can round ``gamma x`` of a subnormal ``x`` to 0,
    a negative ``alpha`` or ``gamma`` flips a sign)."""
    e = ctx.e
    alpha, gamma = _attr(node, "alpha", 1.67326319217681884765625), _attr(node, "gamma", 1.05070102214813232421875)
    neg = e.op("Add", [y, e.scalar(alpha * gamma, y)], like=x)
    d = e.op("Where", [positive(e, y if gamma >= 1.0 and alpha >= 0.0 else x), e.scalar(gamma, y), neg], like=x)
    return _times(ctx, g, d, x, [y])


@unary("Celu")
def celu(ctx, node, x, y, g):
    """1 for ``x > 0``, ``exp(x / alpha) = y / alpha + 1`` otherwise (ONNX "Celu"); written with ``y`` so that
    no ``exp`` of a large positive ``x`` can overflow. For ``alpha > 0`` (the default 1) only the output is
    read: ``x <= 0`` gives ``y <= 0``, ``x > 0`` gives ``y = x > 0`` (or 0 where ``x / alpha`` underflows, and
    there both pieces are 1), so ``Where(y > 0, 1, y / alpha + 1)`` is the same derivative. Another ``alpha``
    reads ``x`` for the mask."""
    e = ctx.e
    alpha = _attr(node, "alpha", 1.0)
    one = e.scalar(1.0, y)
    neg = e.op("Add", [e.op("Div", [y, e.scalar(alpha, y)]), one], like=x)
    return _times(ctx, g, e.op("Where", [positive(e, y if alpha > 0.0 else x), one, neg], like=x), x, [y])


@unary("Mish")
def mish(ctx, node, x, y, g):
    """``t + x sigmoid(x) (1 - t^2)`` with ``t = tanh(softplus(x))`` (PyTorch's ``mish_backward``)."""
    e = ctx.e
    t = e.op("Tanh", [e.op("Softplus", [x], like=x)], like=x)
    sech2 = e.op("Sub", [e.scalar(1.0, x), e.op("Mul", [t, t])], like=x)
    d = e.op("Add", [t, e.op("Mul", [e.op("Mul", [x, e.op("Sigmoid", [x], like=x)]), sech2])], like=x)
    return _times(ctx, g, d, x, [x])


@unary("Softsign")
def softsign(ctx, node, x, y, g):
    """``1 / (1 + |x|)^2``."""
    e = ctx.e
    a = e.op("Add", [e.op("Abs", [x], like=x), e.scalar(1.0, x)], like=x)
    return _over(ctx, g, e.op("Mul", [a, a], like=x), x)


@unary("ThresholdedRelu")
def thresholded_relu(ctx, node, x, y, g):
    """1 where ``x > alpha``, else 0 (also at ``x = alpha``, PyTorch's ``threshold_backward``). For ``alpha >= 0``
    (the default 1) the mask is read from the output: ``y = x > alpha`` there and ``y = 0`` elsewhere, which
    is not ``> alpha``; a negative ``alpha`` reads ``x`` (``y = 0`` is then also the value of ``x = 0``)."""
    e = ctx.e
    alpha = _attr(node, "alpha", 1.0)
    v = y if alpha >= 0.0 else x
    return ctx.select(e.op("Greater", [v, e.scalar(alpha, v)]), g, like=x)


@unary("Shrink")
def shrink(ctx, node, x, y, g):
    """1 where ``|x| > lambd``, else 0 (also at ``|x| = lambd``, PyTorch's ``softshrink_backward``)."""
    e = ctx.e
    lambd = _attr(node, "lambd", 0.5)
    outside = e.op("Or", [e.op("Greater", [x, e.scalar(lambd, x)]), e.op("Less", [x, e.scalar(-lambd, x)])])
    return ctx.select(outside, g, like=x)


# ---------------------------------------------------------------------------------------------- trigonometric


@unary("Sinh")
def sinh(ctx, node, x, y, g):
    """``cosh(x)`` (strong zeros: it overflows to inf for large ``|x|``)."""
    e = ctx.e
    return strong(ctx, g, e.op("Cosh", [x], like=x), x)


@unary("Cosh")
def cosh(ctx, node, x, y, g):
    """``sinh(x)``."""
    e = ctx.e
    return strong(ctx, g, e.op("Sinh", [x], like=x), x)


@unary("Tan")
def tan(ctx, node, x, y, g):
    """``1 + tan(x)^2`` (overflows near the poles in float16: ``y`` is never taken as finite)."""
    e = ctx.e
    return _times(ctx, g, e.op("Add", [e.scalar(1.0, x), e.op("Mul", [y, y])], like=x), x, [y])


def _inv_sqrt_one_minus_sq(e: Emitter, x: str) -> str:
    """``1 / sqrt((1 - x)(1 + x))``: inf at ``|x| = 1`` (factored for accuracy near the ends)."""
    one = e.scalar(1.0, x)
    prod = e.op("Mul", [e.op("Sub", [one, x]), e.op("Add", [one, x])], like=x)
    return e.op("Reciprocal", [e.op("Sqrt", [prod], like=x)], like=x)


@unary("Asin")
def asin(ctx, node, x, y, g):
    """``1 / sqrt(1 - x^2)``."""
    e = ctx.e
    return strong(ctx, g, _inv_sqrt_one_minus_sq(e, x), x)


@unary("Acos")
def acos(ctx, node, x, y, g):
    """``-1 / sqrt(1 - x^2)``."""
    e = ctx.e
    return strong(ctx, g, e.op("Neg", [_inv_sqrt_one_minus_sq(e, x)], like=x), x)


@unary("Atan")
def atan(ctx, node, x, y, g):
    """``1 / (1 + x^2)``."""
    e = ctx.e
    return _over(ctx, g, e.op("Add", [e.scalar(1.0, x), e.op("Mul", [x, x])], like=x), x)


@unary("Asinh")
def asinh(ctx, node, x, y, g):
    """``1 / sqrt(x^2 + 1)``."""
    e = ctx.e
    root = e.op("Sqrt", [e.op("Add", [e.op("Mul", [x, x]), e.scalar(1.0, x)], like=x)], like=x)
    return _over(ctx, g, root, x)


@unary("Acosh")
def acosh(ctx, node, x, y, g):
    """``1 / sqrt((x - 1)(x + 1))``: inf at ``x = 1``."""
    e = ctx.e
    one = e.scalar(1.0, x)
    prod = e.op("Mul", [e.op("Sub", [x, one]), e.op("Add", [x, one])], like=x)
    return strong(ctx, g, e.op("Reciprocal", [e.op("Sqrt", [prod], like=x)], like=x), x)


@unary("Atanh")
def atanh(ctx, node, x, y, g):
    """``1 / ((1 - x)(1 + x))``: inf at ``|x| = 1``."""
    e = ctx.e
    one = e.scalar(1.0, x)
    prod = e.op("Mul", [e.op("Sub", [one, x]), e.op("Add", [one, x])], like=x)
    return strong(ctx, g, e.op("Reciprocal", [prod], like=x), x)


@vjp("Mod")
def mod(ctx: Ctx, node: Node, cts: list) -> list:
    """``y = a - n b`` with ``n`` the truncated (``fmod=1``) or floored (``fmod=0``) quotient, piecewise
    constant: ``da = dy``, ``db = -n dy`` (PyTorch's ``fmod``/``remainder`` derivatives). ``n`` is recovered as
    ``round((a - y) / b)``, exactly the integer the forward used even where ``a / b`` rounds across it.
    Integer Mod has no gradient (the backward pass asks for none)."""
    e, (a, b) = ctx.e, node.inputs
    y, g = node.outputs[0], cts[0]
    def gb() -> str:
        n = e.op("Round", [e.op("Div", [e.op("Sub", [a, y]), b])], like=y)
        return e.reduce_to(strong(ctx, g, e.op("Neg", [n], like=y), y), b)

    return [lambda: e.reduce_to(g, a), gb]
