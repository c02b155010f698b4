"""VJPs of elementwise operators (ONNX operator spec, "Add" ... "Where"; derivatives as in JAX's
``jax/_src/lax/lax.py`` and PyTorch's ``tools/autograd/derivatives.yaml``).

Conventions (DESIGN.md section 5): broadcasting is undone with :meth:`Emitter.reduce_to`; ``Abs`` and ``Relu``
take the 0 subgradient at 0; ties of ``Max``/``Min`` split the cotangent equally; where a local derivative
can be infinite or NaN, :func:`strong` makes a zero cotangent give an exact zero (0 x inf = 0).
"""

from __future__ import annotations

import math

from ...ir import Node
from ..registry import Emitter, not_differentiable, vjp


def strong(e: Emitter, g: str, d: str, like: str) -> str:
    """``g * d`` with strong zeros: exactly 0 where ``g == 0``, even if ``d`` is inf or NaN there."""
    prod = e.op("Mul", [g, d])
    zero = e.scalar(0.0, g)
    return e.op("Where", [e.op("Equal", [g, zero]), zero, prod], like=like)


def _unary(op_type: str):
    """Register a one-input rule given as ``f(e, x, y, g) -> dx``."""

    def register(fn):
        @vjp(op_type)
        def rule(e: Emitter, node: Node, out_grads: list) -> list:
            x, y = node.inputs[0], node.outputs[0]
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
        return e.op("Mul", [g, other]) if mask is None else e.select(mask, g)

    ga = e.reduce_to(times(b), a) if e.need[0] else None
    gb = e.reduce_to(times(a), b) if e.need[1] else None
    return [ga, gb]


@vjp("Div")
def div(e: Emitter, node: Node, out_grads: list) -> list:
    a, b = node.inputs
    y, g = node.outputs[0], out_grads[0]
    ga = e.reduce_to(strong(e, g, e.op("Reciprocal", [b]), y), a) if e.need[0] else None
    gb = None
    if e.need[1]:  # d(a/b)/db = -y/b
        gb = e.reduce_to(strong(e, g, e.op("Neg", [e.op("Div", [y, b])]), y), b)
    return [ga, gb]


@vjp("Pow")
def pow_(e: Emitter, node: Node, out_grads: list) -> list:
    x, p = node.inputs
    y, g = node.outputs[0], out_grads[0]
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
    return e.op("Mul", [g, y], like=x)


@_unary("Log")
def log(e, node, x, y, g):
    return strong(e, g, e.op("Reciprocal", [x]), x)


@_unary("Abs")
def abs_(e, node, x, y, g):
    return e.op("Mul", [g, e.op("Sign", [x])], like=x)


@_unary("Tanh")
def tanh(e, node, x, y, g):
    return e.op("Mul", [g, e.op("Sub", [e.scalar(1.0, y), e.op("Mul", [y, y])])], like=x)


@_unary("Sigmoid")
def sigmoid(e, node, x, y, g):
    return e.op("Mul", [g, e.op("Mul", [y, e.op("Sub", [e.scalar(1.0, y), y])])], like=x)


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
    neg = e.op("Mul", [g, e.op("Add", [y, alpha])])
    return e.op("Where", [e.op("Greater", [x, e.scalar(0.0, x)]), g, neg], like=x)


@_unary("Softplus")
def softplus(e, node, x, y, g):
    return e.op("Mul", [g, e.op("Sigmoid", [x])], like=x)


@_unary("Erf")
def erf(e, node, x, y, g):
    d = e.op("Exp", [e.op("Neg", [e.op("Mul", [x, x])])])
    return e.op("Mul", [g, e.op("Mul", [d, e.scalar(2.0 / math.sqrt(math.pi), x)])], like=x)


@_unary("Sin")
def sin(e, node, x, y, g):
    return e.op("Mul", [g, e.op("Cos", [x])], like=x)


@_unary("Cos")
def cos(e, node, x, y, g):
    return e.op("Neg", [e.op("Mul", [g, e.op("Sin", [x])])], like=x)


@vjp("Cast", "CastLike")
def cast(e: Emitter, node: Node, out_grads: list) -> list:
    x = node.inputs[0]
    dt = e.dtype(x)
    if dt is not None and dt.kind != "f":
        return [None] * len(node.inputs)
    back = e.op("CastLike", [out_grads[0], x], like=x)
    return [back] + [None] * (len(node.inputs) - 1)


@vjp("Sum", "Mean")
def sum_mean(e: Emitter, node: Node, out_grads: list) -> list:
    g = out_grads[0]
    if node.op_type == "Mean":
        g = e.op("Div", [g, e.scalar(float(len(node.inputs)), g)], like=g)
    return [e.reduce_to(g, x) if need else None for x, need in zip(node.inputs, e.need, strict=True)]


@vjp("Max", "Min")
def max_min(e: Emitter, node: Node, out_grads: list) -> list:
    y, g = node.outputs[0], out_grads[0]
    if len(node.inputs) == 1:
        return [g]
    # Ties split the cotangent equally among the inputs that attain the extremum (total 1).
    masks = [e.op("CastLike", [e.op("Equal", [x, y]), y]) for x in node.inputs]
    count = e.op("Sum", masks)
    share = e.op("Div", [g, count])
    return [
        e.reduce_to(e.op("Mul", [share, m]), x) if need else None
        for x, m, need in zip(node.inputs, masks, e.need, strict=True)
    ]


@vjp("Where")
def where(e: Emitter, node: Node, out_grads: list) -> list:
    c, a, b = node.inputs
    g = out_grads[0]
    ga = e.reduce_to(e.select(c, g), a) if e.need[1] else None
    gb = e.reduce_to(e.select(e.op("Not", [c]), g), b) if e.need[2] else None
    return [None, ga, gb]


@vjp("Clip")
def clip(e: Emitter, node: Node, out_grads: list) -> list:
    x = node.inputs[0]
    lo = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1] else None
    hi = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    g = out_grads[0]
    inside = None
    grads: list = [None] * len(node.inputs)
    if lo is not None:
        inside = e.op("GreaterOrEqual", [x, lo])
        if e.need[1]:
            grads[1] = e.reduce_to(e.select(e.op("Less", [x, lo]), g), lo)
    if hi is not None:
        below = e.op("LessOrEqual", [x, hi])
        inside = below if inside is None else e.op("And", [inside, below])
        if e.need[2]:
            grads[2] = e.reduce_to(e.select(e.op("Greater", [x, hi]), g), hi)
    if e.need[0]:
        grads[0] = g if inside is None else e.select(inside, g, like=x)
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
