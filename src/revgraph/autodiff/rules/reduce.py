"""VJPs of reductions (ONNX operator spec, "ReduceSum" ... "ReduceLogSumExp"; since opset 18 every
reduction takes its axes as an optional second input, and ``noop_with_empty_axes`` decides what no axes
mean).

Strong zeros (DESIGN section 5): the products of the cotangent with forward values (``2 x``, ``sign(x)``,
``x / |x|``, ``exp(x - y)``) are guarded where those values may be inf or NaN (:func:`strong`), the product of
the others in ``ReduceProd`` always (it overflows); ``ReduceMax``/``ReduceMin`` select (exact 0 off the
extremum, and 0 everywhere in a group whose extremum is NaN)."""

from __future__ import annotations

import numpy as np

from ...ir import Node
from ..context import Ctx
from ..emitter import Emitter
from ..registry import unary
from .elementwise import strong


def reduced_axes(e: Emitter, node: Node) -> str | None:
    """The axes input of a reduction (a value name), or ``None`` when every axis is reduced.

    Raises nothing; a reduction with no axes and ``noop_with_empty_axes=1`` is handled by the caller.
    A constant empty axes input means the same as a missing one."""
    if len(node.inputs) > 1 and node.inputs[1]:
        value = e.value(node.inputs[1])
        if value is not None and value.size == 0:
            return None
        return node.inputs[1]
    return None


def expand_back(e: Emitter, node: Node, g: str) -> str:
    """The cotangent ``g`` of a reduction, broadcast back to the input's shape: reduced axes are
    re-inserted (``Unsqueeze``) when ``keepdims=0``, then ``Expand``."""
    x = node.inputs[0]
    axes = reduced_axes(e, node)
    if node.attrs.get("keepdims", 1) == 0 and axes is not None:
        g = e.op("Unsqueeze", [g, axes])
    return e.op("Expand", [g, e.shape_of(x)], like=x)


def is_noop(e: Emitter, node: Node) -> bool:
    """True for a reduction that reduces nothing (no axes given and ``noop_with_empty_axes=1``)."""
    axes = reduced_axes(e, node)
    if axes is None:
        return bool(node.attrs.get("noop_with_empty_axes", 0))
    value = e.value(axes)
    return value is not None and value.size == 0 and bool(node.attrs.get("noop_with_empty_axes", 0))


@unary("ReduceSum")
def reduce_sum(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy`` broadcast back (ONNX "ReduceSum")."""
    return g if is_noop(ctx.e, node) else expand_back(ctx.e, node, g)


# ------------------------------------------------------------------------------------------ helpers


def keep(e: Emitter, node: Node, v: str) -> str:
    """A reduction result ``v`` with the reduced axes re-inserted as size 1 (when ``keepdims=0``), so that
    it broadcasts against the input; a no-op reduction's result is returned as is."""
    axes = reduced_axes(e, node)
    if is_noop(e, node) or node.attrs.get("keepdims", 1) or axes is None:
        return v
    return e.op("Unsqueeze", [v, axes])


def reduce_like(e: Emitter, node: Node, op_type: str, v: str) -> str:
    """``op_type`` over the same axes as ``node`` (with ``keepdims=1``), applied to ``v`` of the input's
    shape: counts and partial products per reduced group, broadcastable against the input."""
    axes = reduced_axes(e, node)
    noop = 1 if node.attrs.get("noop_with_empty_axes", 0) else None
    return e.op(op_type, [v] if axes is None else [v, axes], keepdims=1, noop_with_empty_axes=noop)


# ------------------------------------------------------------------------------------------ rules


@unary("ReduceMean")
def reduce_mean(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy / n`` broadcast back, ``n`` the number of elements per group (ONNX "ReduceMean")."""
    e = ctx.e
    sx, sy = e.shape(x), e.shape(y)
    if sx is not None and sy is not None:
        count = e.scalar(float(np.prod(sx, dtype=np.int64)) / max(int(np.prod(sy, dtype=np.int64)), 1), g)
    else:  # the group size is |x| / |y| (the same with keepdims either way)
        ny = e.op("Max", [e.op("Size", [y]), e.const(np.int64(1))])
        count = e.op("CastLike", [e.op("Div", [e.op("Size", [x]), ny]), g])
    share = e.op("Div", [g, count], like=g)
    return e.op("Expand", [keep(e, node, share), e.shape_of(x)], like=x)


@unary("ReduceMax", "ReduceMin")
def reduce_max_min(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """The cotangent goes to the elements equal to the extremum, split equally among ties (DESIGN.md
    section 5; JAX's ``_reduce_chooser_jvp_rule`` does the same)."""
    e = ctx.e
    hit = e.op("Equal", [x, keep(e, node, y)])
    count = reduce_like(e, node, "ReduceSum", e.op("CastLike", [hit, x], like=x))
    share = e.op("Div", [keep(e, node, g), e.op("Max", [count, e.scalar(1.0, x)])])  # no hit where y is NaN
    return ctx.select(hit, share, like=x)


@unary("ReduceProd")
def reduce_prod(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx_i = dy * prod_{j != i} x_j`` (ONNX "ReduceProd"; PyTorch's ``prod_backward``), computed without
    dividing by zero: with ``S = where(x == 0, 1, x)`` and ``Z`` the zero elements, the product of the others
    is ``(prod S / S_i) * prod_{k in Z, k != i} x_k``; the second factor is 1 when no other element is zero,
    ``x_k`` (value 0, derivative 1) when exactly one other ``x_k`` is, and 0 otherwise. Value and first
    derivative are exact at zeros too, so second derivatives are right."""
    e = ctx.e
    zero, one = e.scalar(0.0, x), e.scalar(1.0, x)
    is_zero = e.op("Equal", [x, zero])
    safe = e.op("Where", [is_zero, one, x], like=x)
    zeros_only = e.op("Where", [is_zero, x, zero], like=x)  # the zero elements themselves, for their derivative
    zmask = e.op("CastLike", [is_zero, x], like=x)
    others_safe = e.op("Div", [reduce_like(e, node, "ReduceProd", safe), safe], like=x)
    other_zeros = e.op("Sub", [reduce_like(e, node, "ReduceSum", zmask), zmask], like=x)
    lone_zero = e.op("Sub", [reduce_like(e, node, "ReduceSum", zeros_only), zeros_only], like=x)
    factor = e.op("Where", [e.op("Equal", [other_zeros, one]), lone_zero, zero], like=x)
    factor = e.op("Where", [e.op("Equal", [other_zeros, zero]), one, factor], like=x)
    others = e.op("Mul", [others_safe, factor], like=x)
    return strong(ctx, keep(e, node, g), others, x)  # the product of the others may overflow


@unary("ReduceSumSquare")
def reduce_sum_square(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = 2 x dy`` (ONNX "ReduceSumSquare")."""
    e = ctx.e
    g2 = e.op("Mul", [keep(e, node, g), e.scalar(2.0, x)])
    return strong(ctx, g2, x, x, [x])


@unary("ReduceL2")
def reduce_l2(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy * x / ||x||`` (ONNX "ReduceL2"; PyTorch's ``norm_backward``), with the 0 subgradient where
    the norm is 0 (there every x is 0, so dividing by 1 instead gives exactly 0)."""
    e = ctx.e
    yk = keep(e, node, y)
    safe = e.op("Where", [e.op("Equal", [yk, e.scalar(0.0, yk)]), e.scalar(1.0, yk), yk])
    unit = e.op("Div", [x, safe], like=x)
    return strong(ctx, keep(e, node, g), unit, x, [x])


@unary("ReduceL1")
def reduce_l1(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy * sign(x)`` (ONNX "ReduceL1"), the 0 subgradient at 0."""
    e = ctx.e
    return strong(ctx, keep(e, node, g), e.op("Sign", [x], like=x), x, [x])


@unary("ReduceLogSumExp")
def reduce_log_sum_exp(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy * softmax(x) = dy * exp(x - y)`` (ONNX "ReduceLogSumExp"; JAX's ``logsumexp`` derivative).
    ``x - y <= 0`` since ``y >= max x``: the max-subtracted softmax, which cannot overflow."""
    e = ctx.e
    p = e.op("Exp", [e.op("Sub", [x, keep(e, node, y)], like=x)], like=x)
    return strong(ctx, keep(e, node, g), p, x, [x])


@unary("CumSum")
def cumsum(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """The transpose of a prefix sum is the suffix sum in the other direction, with the same exclusivity
    (ONNX "CumSum"; JAX's ``cumsum`` transpose rule)."""
    exclusive = 1 if node.attrs.get("exclusive", 0) else None
    reverse = None if node.attrs.get("reverse", 0) else 1
    return ctx.e.op("CumSum", [g, node.inputs[1]], exclusive=exclusive, reverse=reverse, like=x)
