"""VJPs of elementwise operators (ONNX operator spec, "Add" ... "Where"; derivatives as in JAX's
``jax/_src/lax/lax.py`` and PyTorch's ``tools/autograd/derivatives.yaml``).

Conventions (DESIGN.md section 5): broadcasting is undone with :meth:`Emitter.reduce_to`; ``Abs`` and ``Relu``
take the 0 subgradient at 0; ties of ``Max``/``Min`` split the cotangent equally, and ``Clip`` is their
composition ``Min(Max(x, min), max)``; strong zeros: where a rule multiplies the cotangent by a value that can
be infinite or NaN (a derivative such as ``1 / x`` at 0, or a forward value that may be non-finite:
``exp(1000)``, an infinite graph input), :func:`strong` makes a zero cotangent give an exact zero (0 x inf = 0);
selections (``Relu``, ``Where``, ``Clip``, ``Max``/``Min``) send an exact 0 to the unselected side.
Integer results carry no gradient, also where an input is a float (``Cast`` to an integer, ``Pow`` of an
integer base).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx

from ...ir import Node, is_float_dtype
from ..registry import Emitter, not_differentiable, vjp


def strong(e: Emitter, g: str, d: str, like: str | None, reads: list[str] | None = None) -> str:
    """``g * d`` with strong zeros: exactly 0 where ``g == 0``, even if ``d`` is inf or NaN there.
    ``reads``: the forward values ``d`` is computed from, when ``d`` is finite for finite values (the product
    is then plain where they are all provably finite, :meth:`Emitter.times`); ``None``: always guarded."""
    return e.times(g, d, like, reads)


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
        warnings.warn(f"{node.label()}: its output {node.outputs[0]!r} is {dt}, an integer, so no gradient flows "
                      f"to {', '.join(map(repr, floats))} through it", stacklevel=2)
    return True


def _unary(op_type: str):
    """Register a one-input rule given as ``f(e, x, y, g) -> dx``."""

    def register(fn):
        @vjp(op_type)
        def rule(e: Emitter, node: Node, out_grads: list) -> list:
            x, y = node.inputs[0], node.outputs[0]
            if not e.need[0]:  # an integer x (Abs, Relu of an int32 loss): no gradient, no dead nodes
                return [None]
            return [fn(e, node, x, y, out_grads[0])]

        return fn

    return register


@vjp("Identity")
def identity(e: Emitter, node: Node, out_grads: list) -> list:
    return [out_grads[0]]


@vjp("Neg")
def neg(e: Emitter, node: Node, out_grads: list) -> list:
    return [e.op("Neg", [out_grads[0]], like=node.inputs[0])]


@vjp("Add", "Sub")
def add_sub(e: Emitter, node: Node, out_grads: list) -> list:
    a, b = node.inputs
    g = out_grads[0]
    ga = e.reduce_to(g, a) if e.need[0] else None
    gb = None
    if e.need[1]:
        gb = e.reduce_to(g if node.op_type == "Add" else e.op("Neg", [g], like=g), b)
    return [ga, gb]


@vjp("Mul")
def mul(e: Emitter, node: Node, out_grads: list) -> list:
    a, b = node.inputs
    g = out_grads[0]

    def times(other: str) -> str:  # g * other; a selection when other is a mask (a selection VJP's own product)
        mask = e.mask_of(other)
        return strong(e, g, other, None, [other]) if mask is None else e.select(mask, g)

    ga = e.reduce_to(times(b), a) if e.need[0] else None
    gb = e.reduce_to(times(a), b) if e.need[1] else None
    return [ga, gb]


@vjp("Div")
def div(e: Emitter, node: Node, out_grads: list) -> list:
    a, b = node.inputs
    y, g = node.outputs[0], out_grads[0]
    # 1 / b is inf where b is 0, unless b is a constant without zeros
    bv = e.value(b)
    safe = bv is not None and bool(np.all(np.isfinite(bv)) and np.all(bv != 0))
    ga = e.reduce_to(strong(e, g, e.op("Reciprocal", [b]), y, [] if safe else None), a) if e.need[0] else None
    gb = None
    if e.need[1]:  # d(a/b)/db = -y/b
        gb = e.reduce_to(strong(e, g, e.op("Neg", [e.op("Div", [y, b])]), y), b)
    return [ga, gb]


@vjp("Pow")
def pow_(e: Emitter, node: Node, out_grads: list) -> list:
    x, p = node.inputs
    y, g = node.outputs[0], out_grads[0]
    if integer_result(e, node):
        return [None, None]
    zero = e.scalar(0.0, x)
    gx = gp = None
    if e.need[0]:  # p * x^(p-1), taken as 0 where p == 0 (x^0 is constant, also at x = 0)
        pc = e.op("CastLike", [p, x])
        d = e.op("Mul", [pc, e.op("Pow", [x, e.op("Sub", [pc, e.scalar(1.0, x)])])])
        d = e.op("Where", [e.op("Equal", [pc, zero]), zero, d])
        gx = e.reduce_to(strong(e, g, d, y), x)
    if e.need[1]:  # y * log(x), taken as 0 where x == 0 (PyTorch's convention)
        d = e.op("Mul", [y, e.op("Log", [x])])
        d = e.op("Where", [e.op("Equal", [x, zero]), zero, d])
        gp = e.reduce_to(e.op("CastLike", [strong(e, g, d, y), p]), p)
    return [gx, gp]


@_unary("Sqrt")
def sqrt(e, node, x, y, g):
    return strong(e, g, e.op("Div", [e.scalar(0.5, y), y]), x)


@_unary("Reciprocal")
def reciprocal(e, node, x, y, g):
    return strong(e, g, e.op("Neg", [e.op("Mul", [y, y])]), x)


@_unary("Exp")
def exp(e, node, x, y, g):
    return strong(e, g, y, x, [y])  # exp(1000) = inf: a zero cotangent must still give 0


@_unary("Log")
def log(e, node, x, y, g):
    return strong(e, g, e.op("Reciprocal", [x]), x)


@_unary("Abs")
def abs_(e, node, x, y, g):
    return strong(e, g, e.op("Sign", [x]), x, [x])  # Sign(NaN) is NaN


@_unary("Tanh")
def tanh(e, node, x, y, g):
    return strong(e, g, e.op("Sub", [e.scalar(1.0, y), e.op("Mul", [y, y])]), x, [y])


@_unary("Sigmoid")
def sigmoid(e, node, x, y, g):
    return strong(e, g, e.op("Mul", [y, e.op("Sub", [e.scalar(1.0, y), y])]), x, [y])


@_unary("Relu")
def relu(e, node, x, y, g):
    return e.select(e.op("Greater", [x, e.scalar(0.0, x)]), g, like=x)


@_unary("LeakyRelu")
def leaky_relu(e, node, x, y, g):
    alpha = e.scalar(node.attrs.get("alpha", 0.01), x)
    return e.op("Where", [e.op("Greater", [x, e.scalar(0.0, x)]), g, e.op("Mul", [g, alpha])], like=x)


@_unary("Elu")
def elu(e, node, x, y, g):
    alpha = e.scalar(node.attrs.get("alpha", 1.0), x)
    neg = strong(e, g, e.op("Add", [y, alpha]), None, [y])
    return e.op("Where", [e.op("Greater", [x, e.scalar(0.0, x)]), g, neg], like=x)


@_unary("Softplus")
def softplus(e, node, x, y, g):
    return strong(e, g, e.op("Sigmoid", [x]), x, [x])


@_unary("Erf")
def erf(e, node, x, y, g):
    d = e.op("Exp", [e.op("Neg", [e.op("Mul", [x, x])])])
    return strong(e, g, e.op("Mul", [d, e.scalar(2.0 / math.sqrt(math.pi), x)]), x, [x])


@_unary("Sin")
def sin(e, node, x, y, g):
    return strong(e, g, e.op("Cos", [x]), x, [x])  # cos(inf) is NaN


@_unary("Cos")
def cos(e, node, x, y, g):
    return e.op("Neg", [strong(e, g, e.op("Sin", [x]), None, [x])], like=x)


@vjp("Cast", "CastLike")
def cast(e: Emitter, node: Node, out_grads: list) -> list:
    x = node.inputs[0]
    dt = e.dtype(x)
    if dt is not None and not is_float_dtype(dt) or integer_result(e, node):
        return [None] * len(node.inputs)  # no gradient through an integer value (truncation is piecewise constant)
    back = e.op("CastLike", [out_grads[0], x], like=x)
    return [back] + [None] * (len(node.inputs) - 1)


@vjp("Sum", "Mean")
def sum_mean(e: Emitter, node: Node, out_grads: list) -> list:
    g = out_grads[0]
    if node.op_type == "Mean":
        g = e.op("Div", [g, e.scalar(float(len(node.inputs)), g)], like=g)
    return [e.reduce_to(g, x) if need else None for x, need in zip(node.inputs, e.need, strict=True)]


def _indicator(e: Emitter, cond: str, like: str) -> str:
    """``cond`` (bool) as 0/1 in the dtype of ``like``."""
    dt = e.onnx_dtype(like)
    return e.op("Cast", [cond], to=dt) if dt is not None else e.op("CastLike", [cond, like])


def tie_shares(e: Emitter, g: str, operands: list[str], y: str) -> list[str]:
    """The cotangent ``g`` of ``y = Max(operands)`` (or ``Min``) shared among the operands equal to ``y``
    (ties split equally, DESIGN section 5), each exactly 0 where its operand is not the extremum (a selection).
    A NaN ``y`` matches no operand: the tie count is taken as at least 1, so every share is 0 there."""
    hits = [e.op("Equal", [x, y]) for x in operands]
    count = e.op("Sum", [_indicator(e, h, y) for h in hits])
    share = e.op("Div", [g, e.op("Max", [count, e.scalar(1.0, y)])])
    return [e.select(h, share) for h in hits]


@vjp("Max", "Min")
def max_min(e: Emitter, node: Node, out_grads: list) -> list:
    y, g = node.outputs[0], out_grads[0]
    if len(node.inputs) == 1:
        return [g]
    if not any(e.need):
        return [None] * len(node.inputs)
    shares = tie_shares(e, g, node.inputs, y)
    return [e.reduce_to(s, x) if need else None for x, s, need in zip(node.inputs, shares, e.need, strict=True)]


@vjp("Where")
def where(e: Emitter, node: Node, out_grads: list) -> list:
    c, a, b = node.inputs
    g = out_grads[0]
    ga = e.reduce_to(e.select(c, g), a) if e.need[1] else None
    gb = e.reduce_to(e.select(e.op("Not", [c]), g), b) if e.need[2] else None
    return [None, ga, gb]


def _above(e: Emitter, a: str, b: str, like: str) -> str:
    """2 where ``a > b``, 1 where ``a == b``, 0 where ``a < b`` or either is NaN: twice the share of ``a`` in
    ``Max(a, b)`` with ties split equally."""
    return e.op("Add", [_indicator(e, e.op("Greater", [a, b]), like),
                        _indicator(e, e.op("GreaterOrEqual", [a, b]), like)], like=like)


def _ordered_constants(e: Emitter, lo: str, hi: str) -> bool:
    """Both bounds are constants and ``lo < hi``: ``Max(x, lo)`` then equals ``x`` wherever ``x`` gets a share."""
    a, b = e.value(lo), e.value(hi)
    return a is not None and b is not None and bool(np.all(np.asarray(a) < np.asarray(b)))


@vjp("Clip")
def clip(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX defines ``Clip(x, lo, hi) = Min(Max(x, lo), hi)``; its VJP is that composition's, with the ties of
    ``Max`` and ``Min`` split equally (DESIGN section 5). With ``m = Max(x, lo)`` and ``s(a, b)`` the share of
    ``a`` in ``Max(a, b)`` (1, 1/2 at a tie, 0): ``dx = g s(x, lo) s(hi, m)``, ``dlo = g s(lo, x) s(hi, m)``,
    ``dhi = g s(m, hi)``. So for ``lo < hi``: x gets ``g`` inside, half at either bound; for ``lo > hi`` every
    output is ``hi`` and ``hi`` gets all of ``g``; for ``lo == hi = c``: x < c gives half to each bound, x > c
    all to ``hi``, x == c a quarter to ``x`` and to ``lo`` and half to ``hi``. NaN inputs get 0."""
    x = node.inputs[0]
    lo = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1] else None
    hi = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    g = out_grads[0]
    grads: list = [None] * len(node.inputs)
    if lo is None and hi is None:
        grads[0] = g
        return grads

    def twice(a: str, b: str) -> str:
        return _above(e, a, b, x)

    shares: dict[int, tuple[str, float]] = {}  # input -> (twice its share, or four times a product of two; scale)
    if hi is None:
        shares = {k: (twice(a, b), 0.5) for k, a, b in ((0, x, lo), (1, lo, x)) if e.need[k]}
    elif lo is None:
        shares = {k: (twice(a, b), 0.5) for k, a, b in ((0, hi, x), (2, x, hi)) if e.need[k]}
    else:
        ordered = _ordered_constants(e, lo, hi) and not e.need[1] and not e.need[2]
        m = x if ordered else e.op("Max", [x, lo], like=x)  # Max(x, lo) is x wherever x gets a share, then
        if e.need[0] or e.need[1]:
            in_min = twice(hi, m)
            shares = {k: (e.op("Mul", [twice(a, b), in_min], like=x), 0.25)
                      for k, a, b in ((0, x, lo), (1, lo, x)) if e.need[k]}
        if e.need[2]:
            shares[2] = (twice(m, hi), 0.5)
    for k, (w, scale) in shares.items():
        share = e.weigh(g, e.op("Mul", [w, e.scalar(scale, x)], like=x), like=x)
        grads[k] = share if k == 0 else e.reduce_to(share, node.inputs[k])
    return grads


not_differentiable(
    "piecewise constant: the derivative is 0 almost everywhere",
    "Floor", "Ceil", "Round", "Sign",
)
not_differentiable(
    "boolean or integer result",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "IsNaN", "IsInf",
    "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
)
