"""VJPs of elementwise operators (ONNX operator spec, "Add" ... "Where"; derivatives as in JAX's
``jax/_src/lax/lax.py`` and PyTorch's ``tools/autograd/derivatives.yaml``).

Conventions (DESIGN.md section 5): broadcasting is undone with :meth:`Emitter.reduce_to`; ``Abs`` and ``Relu``
take the 0 subgradient at 0; ties of ``Max``/``Min`` split the cotangent equally, and ``Clip`` is their
composition ``Min(Max(x, min), max)``; strong zeros: where a rule multiplies the cotangent by a value that can
be infinite or NaN (a derivative such as ``1 / x`` at 0, or a forward value that may be non-finite:
``exp(1000)``, an infinite graph input), :meth:`Val.times <revgraph.autodiff.algebra.Val.times>` makes a zero cotangent
give an exact zero (0 x inf = 0); selections (``Relu``, ``Where``, ``Clip``, ``Max``/``Min``) send an exact 0 to the
unselected side. Integer results carry no gradient, also where an input is a float (``Cast`` to an integer, ``Pow`` of
an integer base).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache, partial

import numpy as np
import onnx

from ...ir import Node, is_float_dtype
from ...warn import warn
from .. import strong
from ..algebra import Val, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import not_differentiable, slope, unary, vjp
from ._common import f32_attr, optional_input


def integer_result(e: Emitter, node: Node) -> bool:
    """True (with a warning) when ``node`` has a floating-point input but an integer or boolean output, as
    ``Pow(int32 base, float exponent)`` has: no gradient flows through an integer value (as through a ``Cast``
    to an integer), so the float inputs get none from this node. The output type, when not recorded, is the
    one the operator gives: ``Cast``'s ``to``, ``CastLike``'s second input, ``Pow``'s base."""
    dt = e.dtype(node.outputs[0])
    if dt is None and node.op_type == "Cast" and "to" in node.attrs:
        dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs["to"])))
    elif dt is None and node.op_type in ("CastLike", "Pow"):
        dt = e.dtype(node.inputs[1 if node.op_type == "CastLike" else 0])
    if dt is None or is_float_dtype(dt):
        return False
    floats = [i for i in node.inputs if i and (e.dtype(i) is None or is_float_dtype(e.dtype(i)))]
    if floats:
        warn(f"{node.label()}: its output {node.outputs[0]!r} is {dt}, an integer, so no gradient flows "
             f"to {', '.join(map(repr, floats))} through it")
    return True


@vjp("Identity", bounded=True, finite=True, reads=(), moves=True)
def identity(ctx: Ctx, node: Node, cts: list) -> list:
    return [cts[0]]


@vjp("Neg", bounded=True, finite=True, reads=())
def neg(ctx: Ctx, node: Node, cts: list) -> list:
    return [lambda: -ctx.val(cts[0])]


@vjp("Add", "Sub", bounded=True, finite=True, reads=())
def add_sub(ctx: Ctx, node: Node, cts: list) -> list:
    (a, b), g = node.inputs, ctx.val(cts[0])
    return [lambda: g.reduce_to(a), lambda: (g if node.op_type == "Add" else -g).reduce_to(b)]


@vjp("Mul", bounded=True, finite=True, product=True)
def mul(ctx: Ctx, node: Node, cts: list) -> list:
    (a, b), g = node.inputs, ctx.val(cts[0])

    def times(other: str) -> Val:  # g * other; a selection when other is a mask (a selection VJP's own product)
        mask = ctx.mask_of(other)
        return g.times(other, reads=[other], like=None) if mask is None else g.select(mask, like=None)

    return [lambda: times(b).reduce_to(a), lambda: times(a).reduce_to(b)]


@vjp("Div", bounded=False, finite=False, finite_if_static=(1,))
def div(ctx: Ctx, node: Node, cts: list) -> list:
    (a, b), (y, g) = ctx.vals(*node.inputs), ctx.vals(node.outputs[0], cts[0])
    # 1 / b is inf where b is 0, unless b is a constant without zeros
    bv = ctx.value(b.name)
    safe = bv is not None and bool(np.all(np.isfinite(bv)) and np.all(bv != 0))
    # a finite nonzero constant divisor: g / b, one node, finite wherever g is (no test, no Reciprocal)
    da = (lambda: g.apply("Div", b, like=y)) if safe else (lambda: g.times(b.reciprocal(), None, like=y))
    return [lambda: da().reduce_to(a),
            lambda: g.times(-(y / b), like=y).reduce_to(b)]  # d(a/b)/db = -y/b


@vjp("Pow", bounded=False, finite=False)
def pow_(ctx: Ctx, node: Node, cts: list) -> list:
    (x, p), (y, g) = ctx.vals(*node.inputs), ctx.vals(node.outputs[0], cts[0])
    if integer_result(ctx.e, node):
        return [None, None]

    pv, dt = ctx.value(p.name), ctx.e.dtype(x.name)
    k = float(np.asarray(pv)) if pv is not None and dt is not None and np.asarray(pv).size == 1 else None

    def gx() -> Val:  # p * x^(p-1), taken as 0 where p == 0 (x^0 is constant, also at x = 0)
        if k is not None and k != 0:  # a constant exponent (RMSNorm's 2): no log, no test of p
            if k == 1:
                return g.reduce_to(x)  # y is x
            return g.times(power_slope(x, y, k, dt), like=y).reduce_to(x)
        pc = p.cast_like(x)
        return g.times(where(pc.eq(0), 0, pc * x ** (pc - 1)), like=y).reduce_to(x)

    def gp() -> Val:  # y * log(x), taken as 0 where x == 0 (PyTorch's convention)
        return g.times(where(x.eq(0), 0, y * x.log()), like=y).cast_like(p).reduce_to(p)

    return [gx, gp]


def power_slope(x: Val, y: Val, k: float, dt: np.dtype) -> Val:
    """``d x^k / dx = k x^(k-1)`` for a constant exponent ``k`` (not 0 or 1), in the fewest nodes: ``2 x`` for 2,
    ``0.5 / y`` (``y = sqrt(x)``) for 0.5, ``k x^(k-1)`` otherwise. Each equals ``k x^(k-1)`` at every ``x``,
    0, -0 (``pow(-0, 0.5)`` is +0), +-inf and NaN included (C99 ``pow``), so the strong-zero product over it is
    unchanged; ``2 x`` and the integer powers are finite for finite ``x``."""
    if k == 2:
        return x * 2
    if k == 0.5:
        return 0.5 / y
    return x ** np.asarray(k - 1, dt) * k


# Rules whose derivative is a function of the output read the output ``y``, not the input (PyTorch's
# ``derivatives.yaml`` uses ``result`` for the same ones): the output is kept anyway when the next layer's VJP
# reads it (a MatMul or Conv after an activation), so the input need not be kept beside it (issue 24). Each
# says why reading ``y`` is exact, also at 0, at +-inf and at NaN.


@slope("Sqrt", of=None, bounded=False, finite=False)
def sqrt(x, y):
    """``1 / (2 sqrt(x)) = 0.5 / y``: reads the output (inf at ``x = 0``: always strong)."""
    return 0.5 / y


@slope("Reciprocal", of=None, bounded=False, finite=False)
def reciprocal(x, y):
    """``-1 / x^2 = -y^2``: reads the output (inf at ``x = 0``: always strong)."""
    return -(y * y)


@slope("Exp", of="y", bounded=True, finite=False, reads="all")
def exp(x, y):
    """``exp(x) = y``: reads the output."""
    return y


@slope("Log", of=None, bounded=False, finite=False)
def log(x, y):
    return x.reciprocal()


@slope("Abs", of="x", bounded=True, finite=True, reads="all")
def abs_(x, y):
    return x.sign()  # Sign(NaN) is NaN


@slope("Tanh", of="y", bounded=True, finite=True, reads="all")
def tanh(x, y):
    """``1 - tanh(x)^2 = 1 - y^2``: reads the output (PyTorch's ``tanh_backward``)."""
    return 1 - y * y


@slope("Sigmoid", of="y", bounded=True, finite=True, reads="all")
def sigmoid(x, y):
    """``sigmoid(x) (1 - sigmoid(x)) = y (1 - y)``: reads the output (PyTorch's ``sigmoid_backward``)."""
    return y * (1 - y)


@unary("Relu", bounded=True, finite=True, reads=())
def relu(ctx, node, x, y, g):
    """``g`` where ``x > 0``, exactly 0 elsewhere (the 0 subgradient at 0). The mask is read from the output:
    ``y > 0`` is ``x > 0`` for every ``x`` (``y = x`` where ``x > 0``; ``y`` is 0, -0 or NaN elsewhere, none of
    them ``> 0``), as PyTorch's ``threshold_backward`` of the result."""
    y, g = ctx.vals(y, g)
    return g.select(y.gt(0), like=x)


@unary("LeakyRelu", bounded=True, finite=True, reads=())
def leaky_relu(ctx, node, x, y, g):
    """``g`` where ``x > 0``, ``alpha g`` elsewhere (``alpha`` at 0, as PyTorch). For ``alpha >= 0`` the mask is
    read from the output: ``y = alpha x <= 0`` (rounded, -0 when it underflows) where ``x <= 0``, ``y = x > 0``
    elsewhere, so ``y > 0`` is ``x > 0``; a negative ``alpha`` flips the sign of ``y`` and reads ``x``."""
    x, y, g = ctx.vals(x, y, g)
    alpha = f32_attr(node, "alpha", 0.01)
    return where((y if alpha >= 0 else x).gt(0), g, g * alpha, like=x)


@unary("Elu", bounded=True, finite=True, reads="all")
def elu(ctx, node, x, y, g):
    """1 where ``x > 0``, ``alpha exp(x) = y + alpha`` elsewhere (``alpha`` at 0, as PyTorch). For ``alpha >= 0``
    everything is read from the output, as PyTorch's ``elu_backward`` with ``is_result``: ``y = x > 0`` where
    ``x > 0`` and ``y = alpha (exp(x) - 1) <= 0`` elsewhere (a faithfully rounded ``exp`` of ``x <= 0`` is at
    most 1), so ``y > 0`` is ``x > 0``; a negative ``alpha`` makes ``y > 0`` for ``x < 0`` and reads ``x``."""
    x, y, g = ctx.vals(x, y, g)
    alpha = f32_attr(node, "alpha", 1.0)
    neg = g.times(y + alpha, [y])
    return where((y if alpha >= 0 else x).gt(0), g, neg, like=x)


@slope("Softplus", of="x", bounded=True, finite=False, reads="all")
def softplus(x, y):
    return x.sigmoid()


@slope("Erf", of="x", bounded=True, finite=True, reads="all")
def erf(x, y):
    return (-(x * x)).exp() * (2.0 / math.sqrt(math.pi))


@slope("Sin", of="x", bounded=True, finite=True, reads="all")
def sin(x, y):
    return x.cos()  # cos(inf) is NaN


@unary("Cos", bounded=True, finite=True, reads="all")
def cos(ctx, node, x, y, g):
    x, g = ctx.vals(x, g)
    return -g.times(x.sin(), [x])


@vjp("Cast", "CastLike", bounded=True, finite=True, reads=(), moves=True, casts=True)
def cast(ctx: Ctx, node: Node, cts: list) -> list:
    e, x = ctx.e, node.inputs[0]
    dt = e.dtype(x)
    if (dt is not None and not is_float_dtype(dt)) or integer_result(e, node):
        return [None] * len(node.inputs)  # no gradient through an integer value (truncation is piecewise constant)
    g = ctx.val(cts[0])
    # Cast when x's dtype is known: CastLike would read x, only for its dtype, keeping it alive
    back = (lambda: g.apply("Cast", like=x, to=e.onnx_dtype(x))) if dt is not None else (lambda: g.cast_like(x))
    return [back] + [None] * (len(node.inputs) - 1)


@vjp("Sum", "Mean", bounded=True, finite=True, reads=())
def sum_mean(ctx: Ctx, node: Node, cts: list) -> list:
    g = ctx.val(cts[0])
    if node.op_type == "Mean":
        g = g / len(node.inputs)
    return [partial(g.reduce_to, x) for x in node.inputs]


def tie_shares(ctx: Ctx, g: str, operands: list[str], y: str) -> list[Callable[[], Val]]:
    """The cotangent ``g`` of ``y = Max(operands)`` (or ``Min``) shared among the operands equal to ``y``
    (ties split equally, DESIGN section 5), each exactly 0 where its operand is not the extremum (a selection).
    A NaN ``y`` matches no operand: the tie count is taken as at least 1, so every share is 0 there.
    Returns one function per operand that emits its share (the tie count is emitted once, by the first)."""
    g, y = ctx.vals(g, y)

    @cache
    def split() -> tuple[list[Val], Val]:
        hits = [ctx.val(x).out("Equal", y) for x in operands]
        count = hits[0].indicator(y).out("Sum", *(h.indicator(y) for h in hits[1:]))
        return hits, g.out("Div", count.out("Max", ctx.e.scalar(1.0, y.name)))

    def share(i: int) -> Val:
        hits, each = split()
        return each.select(hits[i], like=None)

    return [partial(share, i) for i in range(len(operands))]


@vjp("Max", "Min", bounded=True, finite=True, reads=())
def max_min(ctx: Ctx, node: Node, cts: list) -> list:
    if len(node.inputs) == 1:
        return [cts[0]]
    shares = tie_shares(ctx, cts[0], node.inputs, node.outputs[0])
    return [lambda s=s, x=x: s().reduce_to(x) for x, s in zip(node.inputs, shares, strict=True)]


@vjp("Where", bounded=True, finite=True, reads=())
def where_(ctx: Ctx, node: Node, cts: list) -> list:
    """A selection: each branch gets the cotangent where it is selected, an exact 0 elsewhere. The ``Where`` of
    a lowered strong product (:mod:`..strong`, what ``Val.times`` emits) is the primitive instead: its ``Mul``
    gets the whole cotangent, so that the ``Mul`` rule gives the product rule's strong products."""
    (c, a, b), g = ctx.vals(*node.inputs), ctx.val(cts[0])
    if strong.is_lowered(node, ctx.producers, ctx.value):
        return [None, None, lambda: g.reduce_to(b)]
    return [None, lambda: g.select(c, like=None).reduce_to(a), lambda: g.select(~c, like=None).reduce_to(b)]


def _ordered_constants(e: Emitter, lo: str, hi: str) -> bool:
    """Both bounds are constants and ``lo < hi``: ``Max(x, lo)`` then equals ``x`` wherever ``x`` gets a share."""
    a, b = e.value(lo), e.value(hi)
    return a is not None and b is not None and bool(np.all(np.asarray(a) < np.asarray(b)))


@vjp("Clip", bounded=True, finite=True, reads=())
def clip(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX defines ``Clip(x, lo, hi) = Min(Max(x, lo), hi)``; its VJP is that composition's, with the ties of
    ``Max`` and ``Min`` split equally (DESIGN section 5). With ``m = Max(x, lo)`` and ``s(a, b)`` the share of
    ``a`` in ``Max(a, b)`` (1, 1/2 at a tie, 0): ``dx = g s(x, lo) s(hi, m)``, ``dlo = g s(lo, x) s(hi, m)``,
    ``dhi = g s(m, hi)``. So for ``lo < hi``: x gets ``g`` inside, half at either bound; for ``lo > hi`` every
    output is ``hi`` and ``hi`` gets all of ``g``; for ``lo == hi = c``: x < c gives half to each bound, x > c
    all to ``hi``, x == c a quarter to ``x`` and to ``lo`` and half to ``hi``. NaN inputs get 0."""
    x, g = ctx.vals(node.inputs[0], cts[0])
    lo, hi = (ctx.val(v) if v else None for v in (optional_input(node, 1), optional_input(node, 2)))
    grads: list = [None] * len(node.inputs)
    if lo is None and hi is None:
        grads[0] = g
        return grads

    def twice(a: Val, b: Val) -> Val:  # 2 where a > b, 1 where a == b, 0 where a < b or either is NaN
        return a.out("Greater", b).indicator(x).apply("Add", a.out("GreaterOrEqual", b).indicator(x), like=x)

    def grad(k: int, w: Val, scale: float) -> Val:  # w: twice its share, or four times a product of two
        share = g.weigh(w * scale, like=x)
        return share if k == 0 else share.reduce_to(node.inputs[k])

    if hi is None:
        grads[0] = lambda: grad(0, twice(x, lo), 0.5)
        grads[1] = lambda: grad(1, twice(lo, x), 0.5)
        return grads
    if lo is None:
        grads[0] = lambda: grad(0, twice(hi, x), 0.5)
        grads[2] = lambda: grad(2, twice(x, hi), 0.5)
        return grads

    @cache
    def m() -> Val:
        return x.apply("Max", lo)

    @cache
    def in_min(top: Val) -> Val:  # twice the share of top = Max(x, lo) in Min(top, hi)
        return twice(hi, top)

    def both(top: Val, a: Val, b: Val) -> Val:
        w = in_min(top)
        return twice(a, b).apply("Mul", w, like=x)

    ordered = _ordered_constants(ctx.e, lo.name, hi.name)  # Max(x, lo) is x wherever x gets a share, then
    grads[0] = lambda: grad(0, both(x if ordered else m(), x, lo), 0.25)
    grads[1] = lambda: grad(1, both(m(), lo, x), 0.25)
    grads[2] = lambda: grad(2, twice(m(), hi), 0.5)
    return grads


not_differentiable(
    "piecewise constant: the derivative is 0 almost everywhere",
    "Floor", "Ceil", "Round", "Sign", bounded=True, finite=True,
)
not_differentiable(
    "boolean or integer result",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "IsNaN", "IsInf",
    "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", bounded=False, finite=False,
)
