"""VJPs of onnxruntime's fused normalizations: ``com.microsoft`` ``SkipLayerNormalization`` and
``SkipSimplifiedLayerNormalization``, and ``SimplifiedLayerNormalization``, which onnxruntime's tools write in the
default domain although ONNX does not define it (onnxruntime docs/ContribOperators.md and
``onnxruntime/core/graph/contrib_ops/bert_defs.cc``; the kernels ``contrib_ops/cpu/skip_layer_norm.cc`` and
``core/providers/cpu/nn/layer_norm_impl.cc``). The forward keeps the fused node, which onnxruntime runs; the VJPs
are standard ONNX operators.

``SkipLayerNormalization(input, skip, gamma, beta?, bias?)``: ``s = input + skip (+ bias)`` (``skip`` broadcast
from ``[B, S, H]``, ``[1, S, H]`` or ``[S, H]``), then LayerNormalization of ``s`` over the last axis with
``epsilon`` (default 1e-12), scale ``gamma`` and bias ``beta``. Outputs: ``output``, and optionally ``mean`` and
``inv_std_var`` (float32, ``[..., 1]``) and ``input_skip_bias_sum`` (``s``). The cotangents of all four reach
the inputs: the VJP of ``s`` is the default-domain ``LayerNormalization`` rule's (rules/norm.py, which takes the
statistics' cotangents too), plus the cotangent of ``input_skip_bias_sum``; ``input``, ``skip`` and ``bias``
receive it summed to their shapes.

The simplified forms are RMS normalizations (Zhang and Sennrich, https://arxiv.org/abs/1910.07467): ``y = s r
gamma`` with ``r = (mean(s^2) + eps)^(-1/2)`` over the normalized axes; ``inv_std_var`` is ``r``. With ``sh = s
r`` and ``h = dy gamma``: ``ds = r (h - sh mean(h sh)) - r^3 s d_r / n`` (``dr/ds = -r^3 s / n``, ``n`` the
number of normalized elements), ``dgamma = dy sh`` summed to gamma's shape. ``SkipSimplifiedLayerNormalization``'s
``mean`` output is not computed by onnxruntime (it holds zeros), so its cotangent goes nowhere.

Statistics are computed in the input's precision, float32 for float16/bfloat16 inputs (as the kernels do, and
``stash_type`` 1 says), and read nothing of the forward but its inputs (and ``input_skip_bias_sum`` where the
model keeps it), as rules/norm.py's rules.
"""

from __future__ import annotations

from functools import cache, cached_property

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ...ir.contrib_types import MS
from ..algebra import Val, name_of
from ..context import Ctx
from ..registry import RULES, vjp
from ._common import f32_attr, optional_input, padded
from .contrib_fused import summed


def _skip_sum(ctx: Ctx, parts: list[str | None], kept: str | None) -> tuple[Ctx, str]:
    """``s = input + skip (+ bias)``: the node's ``input_skip_bias_sum`` output when the model writes it (a
    forward value), else recomputed in the backward graph (:func:`.contrib_fused.summed`)."""
    return (ctx, kept) if kept else summed(ctx, parts)


def _work(z: Val) -> Val:
    """``z`` in the precision of the statistics: float32 for a float16/bfloat16 ``z`` (onnxruntime's kernels
    accumulate in float), ``z`` itself otherwise."""
    return z.cast(np.float32) if z.dtype is not None and z.dtype.itemsize < 4 else z


def _back(g: Val | None, x: Val | str) -> Val | None:
    """``g`` in ``x``'s dtype (statistics may be in another precision; the saved statistics are float32)."""
    if g is None or (g.dtype is not None and g.dtype == g.ctx.e.dtype(name_of(x))):
        return g
    return g.cast_like(x)


def _count(z: Val, axes: list[int]) -> Val:
    """The number of elements of ``z`` along ``axes``, a scalar of ``z``'s dtype (``Shape``-based when a
    dimension is not static)."""
    e, dims = z.ctx.e, z.dims
    if dims is not None and all(isinstance(dims[a], int) for a in axes):
        return z.ctx.val(e.scalar(float(np.prod([dims[a] for a in axes])), z.name))
    sizes = e.op("Gather", [e.op("Shape", [z.name]), e.ints(axes)], axis=0)
    return z.ctx.val(e.op("CastLike", [e.op("ReduceProd", [sizes], keepdims=0), z.name]))


class _Rms:
    """The RMS normalization of ``z`` over ``axes`` (module doc), each statistic emitted once when first read."""

    def __init__(self, z: Val, axes: list[int], eps: float):
        self.z, self.axes, self.eps = z, axes, eps

    @cached_property
    def r(self) -> Val:
        return ((self.z * self.z).mean(self.axes) + self.eps).sqrt().reciprocal()

    @cached_property
    def zh(self) -> Val:
        return self.z * self.r

    def vjp(self, h: Val | None, g_r: Val | None) -> Val:
        """``dz`` from ``h = dy gamma`` (in ``z``'s dtype) and the cotangent of ``r`` (module doc)."""
        parts = []
        if h is not None:
            parts.append(self.r * (h - self.zh * (h * self.zh).mean(self.axes)))
        if g_r is not None:
            r3 = self.r * self.r * self.r
            parts.append((g_r * r3 / _count(self.z, self.axes)) * self.z * -1.0)
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _rms_grads(ctx: Ctx, x: str, scale: str, axes: list[int], eps: float, gy: str | None,
               g_r: str | None) -> tuple:
    """The lazy cotangents ``(dx, dscale)`` of ``y = x r scale`` whose ``r`` has the cotangent ``g_r`` (either
    cotangent may be ``None``; ``dscale`` is ``None`` without ``gy``)."""

    @cache
    def rms() -> _Rms:
        return _Rms(_work(ctx.val(x)), axes, eps)

    def dx() -> Val:
        z = rms().z
        h = None if gy is None else _back(ctx.val(gy) * scale, z)
        return _back(rms().vjp(h, _back(ctx.val(g_r) if g_r else None, z)), x)

    def dscale() -> Val:
        return (ctx.val(gy) * _back(rms().zh, gy)).reduce_to(scale)

    return dx, (None if gy is None else dscale)


def _last_axis(ctx: Ctx, node: Node, x: str) -> list[int]:
    return [ctx.e.need_rank(x, node) - 1]


@vjp("SkipLayerNormalization", domain=MS, bounded=True, finite=True, reads="all", mixing=True)
def skip_layer_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """``LayerNormalization(input + skip + bias, gamma, beta)`` over the last axis (module doc); the VJP of the
    normalization is the default-domain ``LayerNormalization`` rule's on the sum."""
    x, skip, gamma = node.inputs[:3]
    beta, bias = optional_input(node, 3), optional_input(node, 4)
    g_out, g_mean, g_inv, g_sum = padded(cts, 4)
    outs = padded(node.outputs, 4)
    ctx, s = _skip_sum(ctx, [x, skip, bias], outs[3] or None)
    eps = f32_attr(node, "epsilon", 1e-12)
    ln = Node("LayerNormalization", [s, gamma, *([beta] if beta else [])], [o or "" for o in outs[:3]],
              {"axis": -1, "epsilon": eps}, name=node.name)
    inner = RULES["LayerNormalization"](ctx, ln, [g_out, g_mean, g_inv]) if (g_out or g_mean or g_inv) else None

    @cache
    def ds() -> Val:
        parts = [] if inner is None else [ctx.val(name_of(inner[0]()))]
        if g_sum:
            parts.append(ctx.val(g_sum))
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]

    grads = [lambda: ds().reduce_to(x), lambda: ds().reduce_to(skip),
             None if inner is None else inner[1], None if inner is None or not beta else inner[2],
             None if bias is None else lambda: ds().reduce_to(bias)]
    return grads[:len(node.inputs)]


@vjp("SkipSimplifiedLayerNormalization", domain=MS, bounded=False, finite=False)
def skip_simplified_layer_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """``RMSNorm(input + skip + bias) * gamma`` over the last axis (module doc); ``mean`` carries no gradient
    (onnxruntime writes zeros there)."""
    x, skip, gamma = node.inputs[:3]
    bias = optional_input(node, 3)
    g_out, _g_mean, g_inv, g_sum = padded(cts, 4)
    if not (g_out or g_inv or g_sum):
        return [None] * len(node.inputs)
    outs = padded(node.outputs, 4)
    ctx, s = _skip_sum(ctx, [x, skip, bias], outs[3] or None)
    dx, dgamma = _rms_grads(ctx, s, gamma, _last_axis(ctx, node, s), f32_attr(node, "epsilon", 1e-12), g_out,
                            g_inv)

    @cache
    def ds() -> Val:
        parts = [ctx.val(name_of(dx()))] if (g_out or g_inv) else []
        if g_sum:
            parts.append(ctx.val(g_sum))
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]

    grads = [lambda: ds().reduce_to(x), lambda: ds().reduce_to(skip), dgamma,
             None if bias is None else lambda: ds().reduce_to(bias)]
    return grads[:len(node.inputs)]


@vjp("SimplifiedLayerNormalization", bounded=False, finite=False)
def simplified_layer_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """``Y = X r scale`` over the axes ``[axis, rank)`` with ``epsilon`` (default 1e-5) (module doc): onnxruntime's
    RMSNorm, the ONNX ``RMSNormalization`` of opset 23 with the ``inv_std_var`` output (``r``, in ``stash_type``'s
    precision) whose cotangent reaches ``X`` too. ``Y`` has scale's dtype, which may differ from X's."""
    x, scale = node.inputs[:2]
    gy, g_r = padded(cts, 2)
    if gy is None and g_r is None:
        return [None, None]
    rank = ctx.e.need_rank(x, node)
    axis = int(node.attrs.get("axis", -1))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise GraphError(f"{node.label()}: axis {node.attrs.get('axis')} is out of range for rank {rank}")
    dx, dscale = _rms_grads(ctx, x, scale, list(range(axis, rank)), f32_attr(node, "epsilon", 1e-5), gy, g_r)
    return [dx, dscale]
