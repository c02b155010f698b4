"""VJPs of linear quantization (ONNX operator spec, "QuantizeLinear" and "DequantizeLinear", opsets 21-25):
the exact gradient of DequantizeLinear's scale, and the straight-through estimator (STE) through a
``QuantizeLinear -> DequantizeLinear`` pair, as quantization-aware training uses it (Bengio et al.,
https://arxiv.org/abs/1308.3432; PyTorch's ``fake_quantize_per_tensor_affine`` / ``_per_channel_affine``
backward, and ``_fake_quantize_learnable_per_tensor_affine_backward`` for the scale: Esser et al., "Learned Step
Size Quantization", https://arxiv.org/abs/1902.08153).

``y = DequantizeLinear(q, s_d, z_d) = (q - z_d) s_d`` is exact in ``s_d``: ``ds_d = sum(dy (q - z_d))`` over the
elements each scale covers (per tensor, per axis or per block). ``q = QuantizeLinear(x, s_q, z_q) =
saturate(round(x / s_q) + z_q)`` is an integer: it carries no gradient, and its derivative is 0 almost
everywhere. Exported quantization-aware models write PyTorch's fake quantization as such a pair; with the
option ``straight_through`` (``gradient(..., straight_through=True)``, ``--straight-through``) the pair is
differentiated as one function whose rounding passes gradients unchanged: with ``v = x / s_q`` and ``mask`` the
elements where ``round(v) + z_q`` lies in the output type's range (PyTorch's mask),

- ``dx = dy s_d / s_q mask`` (``dy mask`` when both nodes read the same scale: PyTorch's backward),
- ``ds_q = -sum(dy s_d x / s_q^2 mask)``; with one shared scale this and ``ds_d`` add up to LSQ's
  ``sum(dy (round(v) - v))`` inside the range and ``sum(dy (q_min|q_max - z))`` outside.

The zero points are integers (or float8/float4 codes) and get no gradient. The DequantizeLinear rule gives the
pair's gradients to the QuantizeLinear's inputs (``PatchedVJP.captured``); the backward pass treats the pair
as one node reading those inputs. Without the option a path through a pair is refused with a ``GraphError``
that names the option: the estimator is not the derivative, so it is never applied silently.

``DynamicQuantizeLinear`` (ONNX spec, opset 11) computes its scale from the input, ``s = (max(0, max x) -
min(0, min x)) / 255``: a float output that varies with ``x`` (issue 41: it was declared not differentiable and
a ``quantize_dynamic`` model's gradients were silently 0). Its VJP differentiates the scale as the composition
of ``ReduceMax``/``ReduceMin`` and ``Max``/``Min`` with 0 (the cotangent to the elements equal to the extremum,
ties split equally, as those rules do: :func:`dynamic_quantize`). Its quantized output ``y`` and zero point are
rounded integers, treated as QuantizeLinear's output is: a ``DynamicQuantizeLinear -> DequantizeLinear`` pair
is refused without ``straight_through`` and gets the estimator above with it, the DynamicQuantizeLinear's scale
output standing for ``s_q``; elsewhere (``MatMulInteger``, the zero point) they carry no gradient, which is
their derivative almost everywhere.
"""

from __future__ import annotations

from functools import cache

import ml_dtypes
import numpy as np
from onnx import helper

from ...errors import GraphError
from ...ir import Node, is_float_dtype
from ..algebra import Val, name_of
from ..context import Ctx, PatchedVJP
from ..emitter import Emitter
from ..registry import not_differentiable, vjp
from ._common import optional_input

not_differentiable(
    "integer output (rounding: derivative 0 almost everywhere); a QuantizeLinear -> DequantizeLinear pair gets the "
    "straight-through estimator with straight_through=True (the DequantizeLinear rule)", "QuantizeLinear",
    bounded=False, finite=False)


#: the operators whose quantized output a DequantizeLinear forms a pair with (the straight-through estimator)
QUANTIZERS = ("QuantizeLinear", "DynamicQuantizeLinear")


def pair_of(ctx: Ctx, node: Node) -> Node | None:
    """The QuantizeLinear (or DynamicQuantizeLinear) that writes the quantized input of the DequantizeLinear
    ``node``, or ``None``."""
    q = ctx.producers.get(node.inputs[0]) if node.inputs else None
    if q is None or q.op_type not in QUANTIZERS or q.domain not in ("", "ai.onnx"):
        return None
    return q if q.outputs[0] == node.inputs[0] else None


def quantizer_operands(q: Node) -> tuple[str, str, str | None]:
    """``(x, scale, zero point or None)`` of a quantizer: QuantizeLinear's inputs; DynamicQuantizeLinear's
    input and its scale and zero-point outputs."""
    if q.op_type == "DynamicQuantizeLinear":
        return q.inputs[0], q.outputs[1], q.outputs[2] or None
    return q.inputs[0], q.inputs[1], optional_input(q, 2)


def quantized_type(e: Emitter, node: Node) -> np.dtype:
    """The output type of a QuantizeLinear node: its zero point's type, else ``output_dtype``, else uint8
    (ONNX "QuantizeLinear"); uint8 for DynamicQuantizeLinear."""
    if node.op_type == "DynamicQuantizeLinear":
        return np.dtype(np.uint8)
    zp = optional_input(node, 2)
    if zp is not None and e.dtype(zp) is not None:
        return np.dtype(e.dtype(zp))
    if node.attrs.get("output_dtype"):
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(node.attrs["output_dtype"])))
    return np.dtype(e.dtype(node.outputs[0]) or np.uint8)


def quantized_range(dt: np.dtype) -> tuple[float, float, bool]:
    """``(q_min, q_max, integer)`` of a quantized type; for float8/float4 types the largest finite magnitudes
    (where they saturate) and ``integer=False`` (no rounding to integers)."""
    try:
        info = ml_dtypes.iinfo(dt)
        return float(info.min), float(info.max), True
    except (TypeError, ValueError):
        info = ml_dtypes.finfo(dt)
        return float(info.min), float(info.max), False


class Granularity:
    """How a scale (and its zero point) covers the elements of x (ONNX "QuantizeLinear": per tensor, per axis,
    or per block of ``block_size`` along ``axis``): :meth:`spread` broadcasts a scale-shaped value over x,
    :meth:`gather` sums an x-shaped value back to the scale's shape."""

    def __init__(self, e: Emitter, node: Node, x: str, scale: str):
        self.e, self.x, self.scale = e, x, scale
        self.rank = e.need_rank(x, node)
        axis = int(node.attrs.get("axis", 1))
        self.axis = axis + self.rank if axis < 0 else axis
        self.block = int(node.attrs.get("block_size", 0) or 0)
        srank = e.need_rank(scale, node)
        sdims = e.dims(scale)
        if self.block > 0:
            self.kind = "block"
        elif srank == 0 or (sdims is not None and sdims == (1,)) or self.rank <= 1:
            self.kind = "tensor"
        else:
            self.kind = "axis"
        if self.kind != "tensor" and not 0 <= self.axis < self.rank:
            raise GraphError(f"{node.label()}: axis {axis} is out of range for rank {self.rank}")

    def key(self) -> tuple:
        return (self.scale, self.kind, self.axis if self.kind != "tensor" else None, self.block)

    def spread(self, v: str) -> str:
        """``v`` (the scale's shape) broadcastable against x."""
        e, a = self.e, self.axis
        if self.kind == "tensor":
            return v
        if self.kind == "axis":
            return e.op("Reshape", [v, e.ints([-1] + [1] * (self.rank - 1 - a))])
        wide = e.op("Expand", [e.op("Unsqueeze", [v, e.ints([a + 1])]),
                               e.op("Concat", [e.op("Shape", [v], end=a + 1), e.ints([self.block]),
                                               e.op("Shape", [v], start=a + 1)], axis=0)])
        merged = e.op("Reshape", [wide, e.op("Concat", [e.op("Shape", [v], end=a), e.ints([-1]),
                                                        e.op("Shape", [v], start=a + 1)], axis=0)])
        return e.op("Slice", [merged, e.ints([0]), e.op("Shape", [self.x], start=a, end=a + 1), e.ints([a])])

    def gather(self, full: str) -> str:
        """``full`` (x's shape) summed over the elements each scale covers, in the scale's shape."""
        e, a = self.e, self.axis
        if self.kind == "tensor":
            total = e.op("ReduceSum", [full], keepdims=0)
            return e.op("Reshape", [total, e.shape_of(self.scale)], like=self.scale)
        if self.kind == "axis":
            others = [i for i in range(self.rank) if i != a]
            total = e.op("ReduceSum", [full, e.ints(others)], keepdims=0) if others else full
            return e.op("Reshape", [total, e.shape_of(self.scale)], like=self.scale)
        padded_len = e.op("Mul", [e.op("Shape", [self.scale], start=a, end=a + 1), e.ints([self.block])])
        extra = e.op("Sub", [padded_len, e.op("Shape", [full], start=a, end=a + 1)])
        padded = e.op("Pad", [full, e.op("Concat", [e.ints([0]), extra], axis=0), "", e.ints([a])])
        split = e.op("Reshape", [padded, e.op("Concat", [e.op("Shape", [self.scale], end=a + 1), e.ints([self.block]),
                                                         e.op("Shape", [self.scale], start=a + 1)], axis=0)])
        return e.op("ReduceSum", [split, e.ints([a + 1])], keepdims=0, like=self.scale)


def _cast(v: Val, like: str) -> Val:
    """``v`` in the dtype of ``like`` (itself when it has that dtype already)."""
    e = v.ctx.e
    return v if e.dtype(v.name) is not None and e.dtype(v.name) == e.dtype(like) else v.cast_like(like)


@vjp("DequantizeLinear", bounded=False, finite=False)
def dequantize(ctx: Ctx, node: Node, cts: list) -> list | PatchedVJP:
    """ONNX "DequantizeLinear": the scale's exact gradient ``sum(dy (q - z))`` per covered block, and with
    ``straight_through`` the STE of a QuantizeLinear -> DequantizeLinear pair to the QuantizeLinear's float
    input and scale (module doc). The quantized input and the zero point get no gradient."""
    e, g = ctx.e, cts[0]
    q_in, scale = node.inputs[:2]
    zp = optional_input(node, 2)
    attrs = {k: node.attrs[k] for k in ("axis", "block_size") if k in node.attrs}

    @cache
    def gran() -> Granularity:
        return Granularity(e, node, q_in, scale)

    @cache
    def centered() -> str:  # q - z, in the scale's dtype, x's shape
        ones = e.ones_like(scale)
        return e.op("DequantizeLinear", [q_in, ones] + ([zp] if zp else []), **attrs)

    def dscale() -> str:
        return gran().gather((_cast(ctx.val(g), scale) * centered()).name)

    grads = [None, dscale if g is not None else None, None][:len(node.inputs)]
    grads += [None] * (len(node.inputs) - len(grads))
    pair = pair_of(ctx, node)
    if pair is None or g is None:
        return grads
    x, q_scale, _ = quantizer_operands(pair)
    needs = [v for v in (x, q_scale) if v in ctx.reach and is_float_dtype(e.dtype(v))]
    if not needs:
        return grads
    if not ctx.options.straight_through:
        raise GraphError(
            f"{node.label()}: the gradient through {pair.label()} -> {node.op_type} (quantization: rounding has "
            "derivative 0 almost everywhere) needs the straight-through estimator; ask for it with "
            "gradient(..., straight_through=True) or revgraph grad --straight-through (reverse mode; forward mode, "
            "jvp and hessian, has no estimator)")
    return PatchedVJP(grads, _straight_through(ctx, node, pair, g, gran, needs))


def _straight_through(ctx: Ctx, node: Node, pair: Node, g: str, dq_gran, needs: list[str]) -> dict[str, str]:
    """The STE gradients of the pair's QuantizeLinear inputs ``needs`` (x and/or its scale)."""
    e = ctx.e
    x, q_scale, q_zp = quantizer_operands(pair)
    qg = Granularity(e, pair, x, q_scale)
    shared = qg.key() == dq_gran().key()
    s_q = qg.spread(q_scale)
    v = _cast(ctx.val(x), q_scale) / s_q  # x / s_q, in the scale's precision
    lo, hi, integer = quantized_range(quantized_type(e, pair))
    level = v.apply("Round") if integer else v
    if q_zp is not None:
        level = level + qg.spread(e.op("CastLike", [q_zp, q_scale]))
    inside = level.ge(lo) & level.le(hi)
    gy = _cast(ctx.val(g), q_scale)
    if not shared:  # the cotangent of q as if it were continuous, dy s_d, divided by s_q
        gy = gy * dq_gran().spread(node.inputs[1]) / s_q
    passed = gy.select(inside, like=None)  # exactly 0 where the value saturates
    out = {}
    if x in needs:
        out[x] = name_of(_cast(passed, x))
    if q_scale in needs:  # d round(x / s) / ds = -x / s^2 under the STE: -passed * v
        out[q_scale] = qg.gather((-(passed * v)).name)
    return out


@vjp("DynamicQuantizeLinear", bounded=True, finite=False, reads=())
def dynamic_quantize(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "DynamicQuantizeLinear" (opset 11): ``y_scale = (max(0, max x) - min(0, min x)) / 255``, so ``dx =
    dy_scale / 255 (a [hit_max] / n_max - b [hit_min] / n_min)``, with ``hit`` the elements equal to the
    extremum and ``n`` their count (ReduceMax/ReduceMin's rule: ties split equally), ``a`` Max(M, 0)'s share
    of ``M = max x`` (1 above 0, 1/2 at 0, 0 below: the Max rule's tie) and ``b`` Min(m, 0)'s of ``m = min x``.
    ``y`` and ``y_zero_point`` are rounded integers: no gradient (the module doc; a DequantizeLinear of ``y``
    gets the straight-through estimator with ``straight_through``, in the DequantizeLinear rule)."""
    g = cts[1] if len(cts) > 1 else None
    if g is None:
        return [None]

    def dx() -> Val:
        x = ctx.val(node.inputs[0])
        gs = _cast(ctx.val(g), node.inputs[0]) / 255.0
        parts = []
        for extreme, outside in (("ReduceMax", "gt"), ("ReduceMin", "lt")):
            m = x.apply(extreme, like=None, keepdims=1)  # (every axis: y_scale is one scalar)
            hit = x.eq(m)
            count = hit.indicator(x).sum().apply("Max", 1.0)  # (>= 1: no hit where x holds a NaN)
            share = getattr(m, outside)(0.0).indicator(x) + m.eq(0.0).indicator(x) * 0.5
            parts.append((gs * share / count).select(hit, like=x))
        return parts[0] - parts[1]

    return [dx]
