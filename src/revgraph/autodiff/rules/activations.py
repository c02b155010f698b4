"""VJPs of pointwise activations and the remaining unary math of ONNX (ONNX operator spec, "Gelu" ...
"Shrink", "Swish"; derivatives as in PyTorch's ``tools/autograd/derivatives.yaml`` and JAX's ``jax/_src/lax/lax.py``).

Conventions (DESIGN.md section 5): at a kink next to a constant piece the 0 subgradient is taken (both kinks of
``HardSigmoid``, ``ThresholdedRelu`` and ``Shrink``; ``HardSwish = x HardSigmoid(x)`` follows by the product
rule: 0 at -3, 1 at 3); at the kink of ``PRelu`` and ``Selu`` (0) the slope of the left piece, as PyTorch.
Strong zeros: slopes with an infinite limit (``Asin``, ``Acosh``, ``Atanh`` at the ends of their domains, ``Sinh``
and ``Cosh`` overflowing) always use the strong-zero product (``Val.times``), so that a zero cotangent gives an exact
zero; the other slopes are finite for finite inputs and use it where the forward values they read may be inf or NaN
(``Ctx.nonfinite``: a graph input, a discarded ``Where`` branch), e.g. GELU's ``x phi(x)`` is NaN at -inf.
Float attributes are rounded to float32 first, as ONNX stores them, so the derivative matches the forward.
"""

from __future__ import annotations

import math

from ...ir import Node
from ..algebra import Val, where
from ..context import Ctx
from ..registry import slope, unary, vjp
from ._common import f32_attr


def _over(ctx: Ctx, g: Val, denom: Val, x: Val) -> Val:
    """``g / denom`` for a ``denom >= 1`` computed from ``x`` (inf or NaN only where ``x`` is): a plain ``Div``
    unless ``x`` may be non-finite, then strong (``0 / NaN`` must be 0)."""
    if not ctx.nonfinite(x.name):
        return g.apply("Div", denom, like=x)
    return g.times(denom.reciprocal(), like=x)


# ---------------------------------------------------------------------------------------------- activations


@unary("Gelu", bounded=True, finite=True, reads="all")
def gelu(ctx, node, x, y, g):
    """Exact: ``Phi(x) + x phi(x)``; ``approximate="tanh"``: with ``t = tanh(k (x + c x^3))``,
    ``(1 + t) / 2 + x (1 - t^2) k (1 + 3 c x^2) / 2`` (PyTorch's ``gelu_backward``)."""
    x, g = ctx.vals(x, g)
    x2 = x * x
    if node.attrs.get("approximate", "none") == "tanh":
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        t = (k * (x + c * (x2 * x))).tanh()
        left = 0.5 * (1 + t)
        right = x * ((1 - t * t) * (1 + 3 * c * x2)) * (0.5 * k)
    else:
        left = 0.5 * (1 + (x * (1.0 / math.sqrt(2.0))).erf())
        right = x * ((x2 * -0.5).exp() * (1.0 / math.sqrt(2.0 * math.pi)))
    return g.times(left + right, [x])


def _swish_parts(node: Node, x: Val) -> tuple[Val, Val]:
    """``(swish(x), dswish/dx)`` with ``s = sigmoid(alpha x)``: ``x s`` and ``s (1 + alpha x (1 - s))``."""
    alpha = f32_attr(node, "alpha", 1.0)
    ax = x if alpha == 1.0 else x * alpha
    s = ax.sigmoid()
    return x * s, s * (1 + ax * (1 - s))


@unary("Swish", bounded=False, finite=False)
def swish(ctx, node, x, y, g):
    """``y = x sigmoid(alpha x)`` (ONNX "Swish", opset 24): with ``s = sigmoid(alpha x)``,
    ``dy/dx = s + alpha x s (1 - s) = s (1 + alpha x (1 - s))`` (PyTorch's ``silu_backward`` for alpha = 1)."""
    x, g = ctx.vals(x, g)
    return g.times(_swish_parts(node, x)[1], [x])


@vjp("SwiGLU", bounded=False, finite=False)
def swiglu(ctx: Ctx, node: Node, cts: list) -> list:
    """``Y = Swish_alpha(A) * B`` (ONNX "SwiGLU", opset 28; same shapes, no broadcasting): ``dA = dY B
    swish'(A)``, ``dB = dY swish(A)`` (the product rule over :func:`swish`)."""
    (a, b), g = ctx.vals(*node.inputs), ctx.val(cts[0])
    return [lambda: g.times(b, [b], like=a).times(_swish_parts(node, a)[1], [a], like=a),
            lambda: g.times(_swish_parts(node, a)[0], [a], like=b)]


@unary("HardSigmoid", bounded=True, finite=True, reads=())
def hard_sigmoid(ctx, node, x, y, g):
    """``alpha`` where ``0 < alpha x + beta < 1``, else 0 (also at both kinks). The mask is read from the output
    ``y = max(0, min(1, alpha x + beta))``: ``0 < y < 1`` exactly where the forward's ``alpha x + beta`` was
    inside (``y`` is that value there, and 0, 1 or NaN elsewhere), with no recomputation of it."""
    y, g = ctx.vals(y, g)
    return (g * f32_attr(node, "alpha", 0.2)).select(y.gt(0) & y.lt(1), like=x)


@unary("HardSwish", bounded=True, finite=True, reads=())
def hard_swish(ctx, node, x, y, g):
    """``h(x) + x h'(x)`` with ``h`` = HardSigmoid(alpha = 1/6 as float32, beta = 1/2) and its 0-at-kinks
    slope: ``2 alpha x + 1/2`` where ``0 < alpha x + beta < 1``, 0 below and 1 above (PyTorch takes the inner
    piece at the kinks ``x = -3, 3``; this takes the outer ones, as for HardSigmoid)."""
    x, g = ctx.vals(x, g)
    alpha = f32_attr(node, "alpha", 1.0 / 6.0)  # HardSwish has no attributes: this is the spec's constant
    t = x * alpha + 0.5
    outer = where(t.ge(1), 1.0, 0.0, like=x)
    return g.times(where(t.gt(0) & t.lt(1), x * (2 * alpha) + 0.5, outer), [])  # 0 or 1 outside: always finite


@vjp("PRelu", bounded=True, finite=True, reads="all")
def prelu(ctx: Ctx, node: Node, cts: list) -> list:
    """``dx = dy`` where ``x > 0`` else ``slope dy``; ``dslope = dy x`` where ``x <= 0``, summed over the axes
    the slope was broadcast along (PyTorch's ``_prelu_kernel_backward``; slope's piece at 0)."""
    (x, slope), g = ctx.vals(*node.inputs), ctx.val(cts[0])
    pos = x.gt(0)
    return [lambda: where(pos, g, g.times(slope, [slope], like=None), like=x),
            lambda: where(pos, 0.0, g.times(x, [x], like=None), like=x).reduce_to(slope)]


@unary("Selu", bounded=True, finite=True, reads="all")
def selu(ctx, node, x, y, g):
    """``gamma`` for ``x > 0``, ``gamma alpha exp(x) = y + gamma alpha`` otherwise (ONNX "Selu"). For
    ``gamma >= 1`` and ``alpha >= 0`` (the defaults) only the output is read: ``y = gamma x >= x > 0`` where
    ``x > 0`` and ``y = gamma (alpha exp(x) - alpha) <= 0`` elsewhere (``exp(x) <= 1``), so ``y > 0`` is
    ``x > 0``. Otherwise the mask reads ``x`` (a ``gamma < 1`` can round ``gamma x`` of a subnormal ``x`` to 0,
    a negative ``alpha`` or ``gamma`` flips a sign)."""
    x, y, g = ctx.vals(x, y, g)
    alpha = f32_attr(node, "alpha", 1.67326319217681884765625)
    gamma = f32_attr(node, "gamma", 1.05070102214813232421875)
    mask = (y if gamma >= 1.0 and alpha >= 0.0 else x).gt(0)
    return g.times(where(mask, gamma, y + alpha * gamma, like=x), [y])


@unary("Celu", bounded=True, finite=True, reads="all")
def celu(ctx, node, x, y, g):
    """1 for ``x > 0``, ``exp(x / alpha) = y / alpha + 1`` otherwise (ONNX "Celu"); written with ``y`` so that
    no ``exp`` of a large positive ``x`` can overflow. For ``alpha > 0`` (the default 1) only the output is
    read: ``x <= 0`` gives ``y <= 0``, ``x > 0`` gives ``y = x > 0`` (or 0 where ``x / alpha`` underflows, and
    there both pieces are 1), so ``Where(y > 0, 1, y / alpha + 1)`` is the same derivative. Another ``alpha``
    reads ``x`` for the mask."""
    x, y, g = ctx.vals(x, y, g)
    alpha = f32_attr(node, "alpha", 1.0)
    return g.times(where((y if alpha > 0.0 else x).gt(0), 1.0, y / alpha + 1, like=x), [y])


@unary("Mish", bounded=True, finite=True, reads="all")
def mish(ctx, node, x, y, g):
    """``t + x sigmoid(x) (1 - t^2)`` with ``t = tanh(softplus(x))`` (PyTorch's ``mish_backward``)."""
    x, g = ctx.vals(x, g)
    t = x.apply("Softplus").tanh()
    return g.times(t + x * x.sigmoid() * (1 - t * t), [x])


@unary("Softsign", bounded=True, finite=True, reads="all")
def softsign(ctx, node, x, y, g):
    """``1 / (1 + |x|)^2``."""
    x, g = ctx.vals(x, g)
    a = x.abs() + 1
    return _over(ctx, g, a * a, x)


@unary("ThresholdedRelu", bounded=True, finite=True, reads=())
def thresholded_relu(ctx, node, x, y, g):
    """1 where ``x > alpha``, else 0 (also at ``x = alpha``, PyTorch's ``threshold_backward``). For ``alpha >= 0``
    (the default 1) the mask is read from the output: ``y = x > alpha`` there and ``y = 0`` elsewhere, which
    is not ``> alpha``; a negative ``alpha`` reads ``x`` (``y = 0`` is then also the value of ``x = 0``)."""
    x, y, g = ctx.vals(x, y, g)
    alpha = f32_attr(node, "alpha", 1.0)
    return g.select((y if alpha >= 0.0 else x).gt(alpha), like=x)


@unary("Shrink", bounded=True, finite=True, reads=())
def shrink(ctx, node, x, y, g):
    """1 where ``|x| > lambd``, else 0 (also at ``|x| = lambd``, PyTorch's ``softshrink_backward``)."""
    x, g = ctx.vals(x, g)
    lambd = f32_attr(node, "lambd", 0.5)
    return g.select(x.gt(lambd) | x.lt(-lambd), like=x)


# ---------------------------------------------------------------------------------------------- trigonometric


@slope("Sinh", of=None, bounded=True, finite=False, reads="all")
def sinh(x, y):
    """``cosh(x)`` (strong zeros: it overflows to inf for large ``|x|``)."""
    return x.apply("Cosh")


@slope("Cosh", of=None, bounded=True, finite=False, reads="all")
def cosh(x, y):
    """``sinh(x)``."""
    return x.apply("Sinh")


@slope("Tan", of="y", bounded=False, finite=False)
def tan(x, y):
    """``1 + tan(x)^2`` (overflows near the poles in float16: ``y`` is never taken as finite)."""
    return 1 + y * y


def _inv_sqrt_one_minus_sq(x: Val) -> Val:
    """``1 / sqrt((1 - x)(1 + x))``: inf at ``|x| = 1`` (factored for accuracy near the ends)."""
    return ((1 - x) * (1 + x)).sqrt().reciprocal()


@slope("Asin", of=None, bounded=False, finite=False)
def asin(x, y):
    """``1 / sqrt(1 - x^2)``."""
    return _inv_sqrt_one_minus_sq(x)


@slope("Acos", of=None, bounded=False, finite=False)
def acos(x, y):
    """``-1 / sqrt(1 - x^2)``."""
    return -_inv_sqrt_one_minus_sq(x)


@unary("Atan", bounded=True, finite=True, reads="all")
def atan(ctx, node, x, y, g):
    """``1 / (1 + x^2)``."""
    x, g = ctx.vals(x, g)
    return _over(ctx, g, 1 + x * x, x)


@unary("Asinh", bounded=False, finite=False)
def asinh(ctx, node, x, y, g):
    """``1 / sqrt(x^2 + 1)``."""
    x, g = ctx.vals(x, g)
    return _over(ctx, g, (x * x + 1).sqrt(), x)


@slope("Acosh", of=None, bounded=False, finite=False)
def acosh(x, y):
    """``1 / sqrt((x - 1)(x + 1))``: inf at ``x = 1``."""
    return ((x - 1) * (x + 1)).sqrt().reciprocal()


@slope("Atanh", of=None, bounded=False, finite=False)
def atanh(x, y):
    """``1 / ((1 - x)(1 + x))``: inf at ``|x| = 1``."""
    return ((1 - x) * (1 + x)).reciprocal()


@vjp("Mod", bounded=False, finite=False)
def mod(ctx: Ctx, node: Node, cts: list) -> list:
    """``y = a - n b`` with ``n`` the truncated (``fmod=1``) or floored (``fmod=0``) quotient, piecewise
    constant: ``da = dy``, ``db = -n dy`` (PyTorch's ``fmod``/``remainder`` derivatives). ``n`` is recovered as
    ``round((a - y) / b)``, exactly the integer the forward used even where ``a / b`` rounds across it.
    Integer Mod has no gradient (the backward pass asks for none)."""
    (a, b), (y, g) = ctx.vals(*node.inputs), ctx.vals(node.outputs[0], cts[0])

    def gb() -> Val:
        n = ((a - y) / b).apply("Round", like=y)
        return g.times(-n, like=y).reduce_to(b)

    return [lambda: g.reduce_to(a), gb]
