"""VJPs of pooling and resampling operators (ONNX operator spec, "MaxPool", "AveragePool", "GlobalAveragePool",
"GlobalMaxPool", "LpPool", "GlobalLpPool", "MaxUnpool", "MaxRoiPool", "RoiAlign", "LRN", "DepthToSpace",
"SpaceToDepth", "Resize"; derivatives as in PyTorch's ``tools/autograd/derivatives.yaml``:
``max_pool2d_with_indices_backward``, ``avg_pool2d_backward``, ``lp_pool`` (composite), ``max_unpool``,
``local_response_norm`` (composite), ``pixel_shuffle``/``pixel_unshuffle``, ``upsample_*_backward``; torchvision's
``roi_pool_backward`` and ``roi_align_backward``).

Every one of these but LRN and the Lp pools is linear in its input (the max pools piecewise so), and its VJP is
the adjoint data movement. Where the forward semantics differ between runtimes or the reference evaluator has
bugs, the VJP avoids depending on them: MaxPool picks each window's maximum itself (``ArgMax`` over gathered
windows, the first maximum as in PyTorch) instead of reading ``MaxPool``'s ``Indices`` output, whose offsets the
onnx reference evaluator computes inconsistently; AveragePool asks the runtime's own ``AveragePool`` for its
divisors (pooling a tensor of ones), so ``count_include_pad`` and ``ceil_mode`` windows are weighted exactly as
the forward weighted them; MaxUnpool asks the runtime's own ``MaxUnpool`` where each element landed (unpooling
its positions), since onnxruntime and the ONNX reference place elements differently when ``output_shape`` is
larger than the inferred shape. Scatters that add (RoiAlign, MaxRoiPool, MaxUnpool) are
``ScatterElements(reduction="add")`` on flat views, never a reducing ``ScatterND`` (sparse.py: race-free).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import onnx

from ...errors import GraphError
from ...ir import Node
from ..context import Ctx
from ..emitter import Emitter
from ..registry import unary, vjp
from .conv import (
    Geometry,
    dims_part,
    input_grad,
    ints_attr,
    need_spatial,
    ones,
    resolve_pads,
    shape_cat,
    spatial,
)


def pool_geometry(e: Emitter, node: Node, x: str) -> Geometry:
    k = e.need_rank(x, node) - 2
    if not node.attrs.get("kernel_shape"):
        raise GraphError(f"{node.label()}: no kernel_shape attribute")
    kernel = [int(a) for a in node.attrs["kernel_shape"]]
    strides, dilations = ints_attr(node, "strides", [1] * k), ints_attr(node, "dilations", [1] * k)
    pb, pe = resolve_pads(e, node, x, kernel, strides, dilations)
    return Geometry(kernel, strides, dilations, pb, pe)


def _ceil(node: Node) -> bool:
    return bool(node.attrs.get("ceil_mode", 0)) and (node.attrs.get("auto_pad", "NOTSET") or "NOTSET") == "NOTSET"


def _zeros(e: Emitter, shape: str, like: str) -> str:
    dt = e.dtype(like)
    if dt is not None:
        return e.op("ConstantOfShape", [shape], value=np.zeros(1, dtype=dt))
    z = e.op("ConstantOfShape", [shape], value=np.zeros(1, dtype=np.float32))
    return e.op("CastLike", [z, like])


def window_table(dims: list[int], out: list[int], geo: Geometry) -> tuple[np.ndarray, bool]:
    """``table[o, k]``: the row-major flat input index that window ``o`` reads at kernel tap ``k``, or
    ``prod(dims)`` where it reads padding; and whether any tap reads padding."""
    k = len(dims)
    size = int(np.prod(dims))
    row = [int(np.prod(dims[i + 1:])) for i in range(k)]
    idx = np.zeros([*out, *geo.kernel], dtype=np.int64)
    inside = np.ones([*out, *geo.kernel], dtype=bool)
    for i in range(k):
        q = np.arange(out[i])[:, None] * geo.strides[i] + np.arange(geo.kernel[i])[None, :] * geo.dilations[i]
        q = q - geo.pb[i]
        view = [1] * (2 * k)
        view[i], view[k + i] = out[i], geo.kernel[i]
        q = q.reshape(view)
        idx = idx + q * row[i]
        inside = inside & (q >= 0) & (q < dims[i])
    table = np.where(inside, idx, size).reshape(int(np.prod(out)), int(np.prod(geo.kernel)))
    return table, not bool(inside.all())


@unary("MaxPool")
def max_pool(ctx: Ctx, node: Node, x: str, y: str, g: str | None) -> str | None:
    """ONNX "MaxPool": each window's cotangent goes to the element it took the maximum from; among tied
    elements, the first in the window's row-major order (PyTorch ``max_pool*_with_indices_backward`` routes to
    the index its forward reports, which is that one). The windows are gathered with a constant index table
    (padding reads ``-inf``), ``ArgMax`` picks the tap, and ``ScatterElements(reduction="add")`` adds the
    cotangents of overlapping windows. The ``Indices`` output carries no gradient."""
    if g is None:
        return None
    e = ctx.e
    geo = pool_geometry(e, node, x)
    dims = need_spatial(e, node, x, "the MaxPool VJP (a constant window table)")
    out = geo.out(dims, _ceil(node))
    table, padded = window_table(dims, out, geo)
    size, taps = int(np.prod(dims)), table.shape[1]
    flat = e.op("Reshape", [x, e.ints([0, 0, -1])])
    if padded:
        flat = e.op("Pad", [flat, e.ints([0, 0, 0, 0, 0, 1]), e.scalar(-np.inf, x)])
    windows = e.op("Gather", [flat, e.const(table)], axis=2)
    tap = e.op("ArgMax", [windows], axis=3, keepdims=0)
    entry = e.op("Add", [tap, e.const(np.arange(table.shape[0]) * taps)])
    source = e.op("Gather", [e.const(table.reshape(-1)), entry], axis=0)
    lead = dims_part(e, x, 0, 2)
    total = _zeros(e, shape_cat(e, [lead, [size + padded]]), x)
    acc = e.op("ScatterElements", [total, source, e.op("Reshape", [g, e.ints([0, 0, -1])])], axis=2, reduction="add")
    if padded:
        acc = e.op("Slice", [acc, e.ints([0]), e.ints([size]), e.ints([2])])
    return e.op("Reshape", [acc, e.shape_of(x)], like=x)


def _window_weights(e: Emitter, node: Node, x: str, geo: Geometry, out: list[int] | None,
                    ceil: bool) -> tuple[str, str]:
    """The weight ``1 / div(o)`` of each AveragePool window ``o``, as ``AveragePool(ones)[o] / count(o)``
    (``count``: the number of input elements in window ``o``, a Conv of ones with a ones kernel; 0 for a
    window of padding only), and that ones kernel."""
    k = len(geo.kernel)
    one = e.op("ConstantOfShape", [shape_cat(e, [[1, 1], dims_part(e, x, 2)])],
               value=np.ones(1, dtype=e.dtype(x) or np.float32))
    if e.dtype(x) is None:
        one = e.op("CastLike", [one, x])
    kernel = ones(e, [1, 1, *geo.kernel], x)
    avg = e.op("AveragePool", [one], **node.attrs)
    # ceil mode may add a last window past the padded end: pad more so that the count has it too
    tail = [a + (s if ceil else 0) for a, s in zip(geo.pe, geo.strides, strict=True)]
    count = e.op("Conv", [one, kernel], strides=geo.strides, dilations=geo.dilations, pads=[*geo.pb, *tail])
    if ceil:
        ends = e.ints(out) if out is not None else e.op("Shape", [avg], start=2)
        count = e.op("Slice", [count, e.ints([0] * k), ends, e.ints(list(range(2, k + 2)))])
    zero = e.scalar(0.0, x)
    weight = e.op("Div", [avg, e.op("Max", [count, e.scalar(1.0, x)])])
    return e.op("Where", [e.op("Greater", [count, zero]), weight, zero]), kernel


@unary("AveragePool")
def average_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "AveragePool": ``y[o] = sum_{taps inside} x / div(o)``, so ``dx`` is the transposed convolution
    (a ones kernel, batch and channels flattened) of ``dy / div`` (PyTorch ``avg_pool*_backward``). The
    weights ``1 / div(o)`` are ``AveragePool(ones)[o] / count(o)`` with ``count`` the number of input elements
    in window ``o`` (a Conv of ones with a ones kernel): the runtime's own divisor, whatever
    ``count_include_pad`` and ``ceil_mode`` make of it."""
    e = ctx.e
    geo = pool_geometry(e, node, x)
    ceil = _ceil(node)
    dims = spatial(e, x)
    out = geo.out(dims, ceil) if dims is not None else None
    weight, kernel = _window_weights(e, node, x, geo, out, ceil)
    scaled = e.op("Mul", [g, weight])
    flat = e.op("Reshape", [scaled, shape_cat(e, [[-1, 1], out if out is not None else e.op("Shape", [g], start=2)])])
    back = input_grad(e, node, flat, kernel, x, geo, 1, out)
    return e.op("Reshape", [back, e.shape_of(x)], like=x)


@unary("GlobalAveragePool")
def global_average_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "GlobalAveragePool": ``dx = dy / (number of spatial elements)``, broadcast back."""
    e = ctx.e
    dims = spatial(e, x)
    if dims is not None:
        n = e.scalar(float(np.prod(dims)), x)
    else:
        n = e.op("CastLike", [e.op("Div", [e.op("Size", [x]), e.op("Size", [y])]), g])
    return e.op("Expand", [e.op("Div", [g, n]), e.shape_of(x)], like=x)


@unary("GlobalMaxPool")
def global_max_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "GlobalMaxPool": the cotangent goes to the spatial maxima, split equally among ties (DESIGN.md
    section 5, as ``ReduceMax``)."""
    e = ctx.e
    r = e.need_rank(x, node)
    mask = e.op("CastLike", [e.op("Equal", [x, y]), x], like=x)
    count = e.op("ReduceSum", [mask, e.ints(list(range(2, r)))], keepdims=1)
    return ctx.weigh(e.op("Div", [g, count]), mask, like=x)  # 0 off the maxima, also for an inf or NaN g


# ------------------------------------------------------------------------------------------ small helpers

_F32, _F64, _I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64
Dim = int | str  # a static size, or the name of a 0-d int64 value


def _dim(e: Emitter, x: str, axis: int) -> Dim:
    """``shape(x)[axis]``: an int when static, else a 0-d int64 value."""
    d = e.dims(x)
    if d is not None and isinstance(d[axis], int):
        return d[axis]
    return e.op("Reshape", [e.op("Shape", [x], start=axis, end=axis + 1), e.ints([])])


def _i64(e: Emitter, v: Dim) -> str:
    """``v`` as a 0-d int64 value."""
    return e.const(np.asarray(v, np.int64)) if isinstance(v, (int, np.integer)) else v


def _range(e: Emitter, n: Dim, dtype: type = np.int64) -> str:
    """``[0, 1, .., n-1]`` (1-D, ``dtype``): a constant when ``n`` is static."""
    if isinstance(n, (int, np.integer)):
        return e.const(np.arange(int(n), dtype=dtype))
    r = e.op("Range", [e.const(np.int64(0)), n, e.const(np.int64(1))])
    return r if dtype is np.int64 else e.op("Cast", [r], to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def _scatter_add(e: Emitter, size: Dim, positions: str, values: str, like: str) -> str:
    """Zeros of ``like``'s shape and dtype (``size`` elements) with ``values`` added at the flat ``positions``
    (int64, the shape of ``values``; repeats add up): ``ScatterElements(reduction="add")`` on the flat views,
    which onnxruntime runs sequentially (race-free, sparse.py)."""
    length = e.ints([size]) if isinstance(size, int) else e.op("Unsqueeze", [size, e.ints([0])])
    flat = _zeros(e, length, like)
    out = e.op("ScatterElements", [flat, e.op("Reshape", [positions, e.ints([-1])]),
                                   e.op("Reshape", [values, e.ints([-1])])], axis=0, reduction="add")
    return e.op("Reshape", [out, e.shape_of(like)], like=like)


def _times(e: Emitter, *dims: Dim) -> Dim:
    """The product of sizes (ints or 0-d int64 values): an int when all are static."""
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    out = _i64(e, dims[0])
    for d in dims[1:]:
        out = e.op("Mul", [out, _i64(e, d)])
    return out


def _as1(e: Emitter, v: Dim) -> list[int] | str:
    """``[v]``: an int list when static, else a 1-D int64 value (for :func:`shape_cat`; explicit sizes instead
    of ``-1``, which onnxruntime refuses next to a copied 0: no rois)."""
    return [v] if isinstance(v, int) else e.op("Unsqueeze", [v, e.ints([0])])


def _numel(e: Emitter, x: str) -> Dim:
    s = e.shape(x)
    return int(np.prod(s)) if s is not None else e.op("Size", [x])


# ------------------------------------------------------------------------------------------ Lp pools


def inverse_table(dims: list[int], out: list[int], geo: Geometry) -> np.ndarray:
    """``inv[i, k]``: the entry ``o * K + k`` of the ``[O, K]`` window table (:func:`window_table`) in which
    window ``o`` reads input element ``i`` (row-major flat) at kernel tap ``k``, or ``O * K`` where no window
    reads ``i`` at tap ``k``. Summing a ``[O*K]`` array of per-tap values (padded with a zero) gathered through
    it is the adjoint of gathering windows: a col2im without a scatter."""
    k = len(dims)
    n_out, taps = int(np.prod(out)), int(np.prod(geo.kernel))
    orow = [int(np.prod(out[i + 1:])) for i in range(k)]
    krow = [int(np.prod(geo.kernel[i + 1:])) for i in range(k)]
    entry = np.zeros([*dims, *geo.kernel], dtype=np.int64)
    valid = np.ones([*dims, *geo.kernel], dtype=bool)
    for i in range(k):
        num = np.arange(dims[i])[:, None] + geo.pb[i] - np.arange(geo.kernel[i])[None, :] * geo.dilations[i]
        o = num // geo.strides[i]
        ok = (num % geo.strides[i] == 0) & (o >= 0) & (o < out[i])
        view = [1] * (2 * k)
        view[i], view[k + i] = dims[i], geo.kernel[i]
        tap = np.arange(geo.kernel[i])[None, :] * np.ones((dims[i], 1), np.int64)
        entry = entry + (o * orow[i] * taps + tap * krow[i]).reshape(view)
        valid = valid & ok.reshape(view)
    return np.where(valid, entry, n_out * taps).reshape(int(np.prod(dims)), taps)


def _lp_factor(e: Emitter, v: str, norm: str, p: int) -> str:
    """``d ||x||_p / d x_i = sign(x_i) (|x_i| / ||x||_p)^(p-1)`` for the elements ``v`` of windows whose norms are
    ``norm`` (broadcast): bounded by 1, and 0 where the norm is 0 (the subgradient 0 at 0, DESIGN.md section 5;
    for p = 1, ``sign(0) = 0``)."""
    if p == 1:
        return e.op("Sign", [v])
    safe = e.op("Where", [e.op("Equal", [norm, e.scalar(0.0, norm)]), e.scalar(1.0, norm), norm])
    if p == 2:
        return e.op("Div", [v, safe])
    ratio = e.op("Div", [e.op("Abs", [v]), safe])
    return e.op("Mul", [e.op("Sign", [v]), e.op("Pow", [ratio, e.scalar(float(p - 1), v)])])


def _lp_p(node: Node) -> int:
    p = int(node.attrs.get("p", 2))
    if p < 1:
        raise GraphError(f"{node.label()}: p={p}: the Lp norm needs p >= 1")
    return p


@unary("LpPool")
def lp_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "LpPool": ``y_o = (sum_{taps inside} |x|^p)^(1/p)`` (padding reads 0), so ``dx_i = sum_{(o, k) reading
    i} dy_o sign(x_i) (|x_i| / y_o)^(p-1)`` (PyTorch differentiates its composite ``lp_pool`` the same way). The
    ratio form stays bounded where ``y`` is tiny, and a window whose norm is 0 gives 0 (the subgradient at 0).
    Windows are gathered through a constant table (as MaxPool) and the per-tap terms summed back through the
    inverse table (a Gather and a ReduceSum: no scatter)."""
    e = ctx.e
    p = _lp_p(node)
    geo = pool_geometry(e, node, x)
    dims = need_spatial(e, node, x, "the LpPool VJP (constant window tables)")
    out = geo.out(dims, _ceil(node))
    table, padded = window_table(dims, out, geo)
    inverse = inverse_table(dims, out, geo)
    flat = e.op("Reshape", [x, e.ints([0, 0, -1])])
    if padded:
        flat = e.op("Pad", [flat, e.ints([0, 0, 0, 0, 0, 1])])
    windows = e.op("Gather", [flat, e.const(table)], axis=2)  # [N, C, O, K]
    norm = e.op("Reshape", [y, e.ints([0, 0, -1, 1])])
    d = _lp_factor(e, windows, norm, p)
    terms = ctx.times(e.op("Reshape", [g, e.ints([0, 0, -1, 1])]), d, reads=[x])
    lined = e.op("Pad", [e.op("Reshape", [terms, e.ints([0, 0, -1])]), e.ints([0, 0, 0, 0, 0, 1])])
    back = e.op("ReduceSum", [e.op("Gather", [lined, e.const(inverse)], axis=2), e.ints([3])], keepdims=0)
    return e.op("Reshape", [back, e.shape_of(x)], like=x)


@unary("GlobalLpPool")
def global_lp_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "GlobalLpPool": ``y = ||x||_p`` over the spatial axes, ``dx = dy sign(x) (|x| / y)^(p-1)`` (0 where
    ``y`` is 0)."""
    return ctx.times(g, _lp_factor(ctx.e, x, y, _lp_p(node)), like=x, reads=[x])


# ------------------------------------------------------------------------------------------ MaxUnpool

#: positions of up to 2^24 elements are exact in the float32 probe that MaxUnpool's VJP unpools
_EXACT_F32 = 1 << 24
_LOW = 1 << 12


@unary("MaxUnpool")
def max_unpool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "MaxUnpool": ``y`` is zeros with each ``x_j`` written at the place index ``I_j`` names, so ``dx_j``
    is ``dy`` at that place (PyTorch ``max_unpool`` backward: a gather of ``dy`` at the indices). Which place
    that is depends on the runtime when ``output_shape`` exceeds the inferred shape (onnxruntime writes into the
    output at ``I_j``; the ONNX reference and the spec's node test at ``I_j`` of the inferred shape, padded at
    the ends), and with repeated indices the last write wins. So the VJP asks the runtime itself: it unpools the
    positions ``j + 1`` (exact float32 codes; two codes, ``j // 4096`` and ``j % 4096 + 1``, beyond 2^24
    elements) with the same indices and attributes, and adds each ``dy`` element into the ``dx`` element that
    landed there (``ScatterElements``; places nothing landed on go to a dropped extra slot)."""
    e = ctx.e
    rest = node.inputs[1:]
    n = _numel(e, x)
    shape = e.shape_of(x)

    def landed(code: str) -> str:
        """The code written at each place of the unpooled output (0 where nothing was), as int64 [Y]."""
        probe = e.op("Reshape", [code, shape])
        out = e.op("MaxUnpool", [probe, *rest], **node.attrs)
        return e.op("Cast", [e.op("Reshape", [out, e.ints([-1])])], to=_I64)

    if isinstance(n, int) and n < _EXACT_F32:
        src = e.op("Sub", [landed(e.const(np.arange(1, n + 1, dtype=np.float32))), e.const(np.int64(1))])
    else:
        j = _range(e, n)
        hi = landed(e.op("Cast", [e.op("Div", [j, e.const(np.int64(_LOW))])], to=_F32))
        lo = landed(e.op("Cast", [e.op("Add", [e.op("Mod", [j, e.const(np.int64(_LOW))]),
                                                 e.const(np.int64(1))])], to=_F32))
        src = e.op("Where", [e.op("Equal", [lo, e.const(np.int64(0))]), e.const(np.int64(-1)),
                             e.op("Add", [e.op("Mul", [hi, e.const(np.int64(_LOW))]),
                                          e.op("Sub", [lo, e.const(np.int64(1))])])])
    src = e.op("Where", [e.op("Less", [src, e.const(np.int64(0))]), _i64(e, n), src])  # nothing: the extra slot
    room = n + 1 if isinstance(n, int) else e.op("Add", [n, e.const(np.int64(1))])
    acc = e.op("ScatterElements", [_zeros(e, shape_cat(e, [_as1(e, room)]), x), src,
                                   e.op("Reshape", [g, e.ints([-1])])], axis=0, reduction="add")
    acc = e.op("Slice", [acc, e.ints([0]), shape_cat(e, [_as1(e, n)]), e.ints([0])])
    return e.op("Reshape", [acc, shape], like=x)


# ------------------------------------------------------------------------------------------ MaxRoiPool


def _round_half_away(e: Emitter, v: str) -> str:
    """C's ``round`` (halves away from zero, as onnxruntime's MaxRoiPool rounds), computed in float64 so that
    ``v + 0.5`` is exact; int64."""
    d = e.op("Cast", [v], to=_F64)
    half = e.const(np.float64(0.5))
    up = e.op("Floor", [e.op("Add", [d, half])])
    down = e.op("Ceil", [e.op("Sub", [d, half])])
    pos = e.op("GreaterOrEqual", [d, e.const(np.float64(0.0))])
    return e.op("Cast", [e.op("Where", [pos, up, down])], to=_I64)


def _roi_bins(e: Emitter, start: str, size: str, pooled: int, length: Dim) -> tuple[str, str]:
    """MaxRoiPool's bins along one axis: ``[R, P]`` int64 first (inclusive) and end (exclusive) positions,
    ``floor(p * size / P)`` and ``ceil((p + 1) * size / P)`` (float32, as onnxruntime) past ``start``,
    clipped to ``[0, length]``."""
    step = e.op("Div", [e.op("Cast", [size], to=_F32), e.const(np.float32(pooled))])
    step = e.op("Unsqueeze", [step, e.ints([1])])  # [R, 1]
    ps = e.const(np.arange(pooled, dtype=np.float32))
    first = e.op("Cast", [e.op("Floor", [e.op("Mul", [ps, step])])], to=_I64)
    end = e.op("Cast", [e.op("Ceil", [e.op("Mul", [e.const(np.arange(1, pooled + 1, dtype=np.float32)), step])])],
               to=_I64)
    at = e.op("Unsqueeze", [start, e.ints([1])])
    zero, top = e.const(np.int64(0)), _i64(e, length)
    return (e.op("Clip", [e.op("Add", [first, at]), zero, top]), e.op("Clip", [e.op("Add", [end, at]), zero, top]))


@unary("MaxRoiPool")
def max_roi_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "MaxRoiPool" (Fast R-CNN's RoI pooling; onnxruntime's ``RoiPool``): roi ``[b, x1, y1, x2, y2]``
    scaled by ``spatial_scale`` and rounded, split into ``pooled_shape`` bins ``[floor(p h / P), ceil((p+1) h /
    P))``, each output the maximum over its bin (0 for an empty bin). Each output's cotangent goes to the
    element it took the maximum from, the first in the bin's row-major order among ties (as MaxPool and
    torchvision's ``roi_pool`` backward); empty bins send nothing. The bins are gathered as windows of the
    largest bin size (positions past a bin's end read ``-inf``) from ``x`` viewed as ``[N*H*W, C]`` and the
    cotangents added with one ``ScatterElements``. The rois get no gradient (the output moves with them in
    integer steps)."""
    e = ctx.e
    e.need_rank(x, node)
    ph, pw = (int(v) for v in node.attrs["pooled_shape"])
    scale = float(np.float32(node.attrs.get("spatial_scale", 1.0)))
    rois = node.inputs[1]
    c, h, w = (_dim(e, x, a) for a in range(1, 4))
    b = e.op("Cast", [e.op("Reshape", [e.op("Slice", [rois, e.ints([0]), e.ints([1]), e.ints([1])]),
                                       e.ints([-1])])], to=_I64)
    corners = _round_half_away(e, e.op("Mul", [e.op("Cast", [e.op("Slice", [rois, e.ints([1]), e.ints([5]),
                                                                            e.ints([1])])], to=_F32),
                                               e.const(np.float32(scale))]))

    def col(i: int) -> str:
        return e.op("Gather", [corners, e.const(np.int64(i))], axis=1)  # [R]

    one = e.const(np.int64(1))
    sw, sh, ew, eh = col(0), col(1), col(2), col(3)
    hs, he = _roi_bins(e, sh, e.op("Max", [e.op("Add", [e.op("Sub", [eh, sh]), one]), one]), ph, h)
    ws, we = _roi_bins(e, sw, e.op("Max", [e.op("Add", [e.op("Sub", [ew, sw]), one]), one]), pw, w)

    def span(first: str, end: str) -> str:
        return e.op("Max", [e.op("ReduceMax", [e.op("Sub", [end, first])], keepdims=0), one])

    bh, bw = span(hs, he), span(ws, we)
    hm1, wm1 = (e.op("Sub", [_i64(e, v), one]) for v in (h, w))

    def lines(first: str, end: str, size: str, last: str) -> tuple[str, str]:
        at = e.op("Add", [e.op("Unsqueeze", [first, e.ints([2])]), _range(e, size)])  # [R, P, B]
        return e.op("Min", [at, last]), e.op("Less", [at, e.op("Unsqueeze", [end, e.ints([2])])])

    rows, row_ok = lines(hs, he, bh, hm1)
    cols, col_ok = lines(ws, we, bw, wm1)
    # flat [N*H*W] positions of the window elements: [R, PH, BH, PW, BW]
    base = e.op("Mul", [e.op("Reshape", [b, e.ints([-1, 1, 1, 1, 1])]), _i64(e, h)])
    pix = e.op("Add", [e.op("Mul", [e.op("Add", [base, e.op("Unsqueeze", [rows, e.ints([3, 4])])]), _i64(e, w)]),
                       e.op("Unsqueeze", [cols, e.ints([1, 2])])])
    ok = e.op("And", [e.op("Unsqueeze", [row_ok, e.ints([3, 4])]), e.op("Unsqueeze", [col_ok, e.ints([1, 2])])])
    pixels = e.op("Reshape", [e.op("Transpose", [x], perm=[0, 2, 3, 1]), shape_cat(e, [[-1], _as1(e, c)])])  # [N*H*W, C]
    vals = e.op("Gather", [pixels, pix], axis=0)  # [R, PH, BH, PW, BW, C]
    vals = e.op("Where", [e.op("Unsqueeze", [ok, e.ints([5])]), vals, e.scalar(-np.inf, x)])
    vals = e.op("Reshape", [e.op("Transpose", [vals], perm=[0, 5, 1, 3, 2, 4]),
                            shape_cat(e, [[0, 0, 0, 0], _as1(e, _times(e, bh, bw))])])
    tap = e.op("ArgMax", [vals], axis=4, keepdims=0)  # [R, C, PH, PW]: the first maximum in the bin
    hsel = e.op("Min", [e.op("Add", [e.op("Unsqueeze", [hs, e.ints([1, 3])]), e.op("Div", [tap, bw])]), hm1])
    wsel = e.op("Min", [e.op("Add", [e.op("Unsqueeze", [ws, e.ints([1, 2])]), e.op("Mod", [tap, bw])]), wm1])
    plane = e.op("Add", [e.op("Mul", [e.op("Reshape", [b, e.ints([-1, 1, 1, 1])]), _i64(e, c)]),
                         e.op("Reshape", [_range(e, c), e.ints([1, -1, 1, 1])])])
    pos = e.op("Add", [e.op("Mul", [e.op("Add", [e.op("Mul", [plane, _i64(e, h)]), hsel]), _i64(e, w)]), wsel])
    full = e.op("And", [e.op("Unsqueeze", [e.op("Greater", [he, hs]), e.ints([1, 3])]),
                        e.op("Unsqueeze", [e.op("Greater", [we, ws]), e.ints([1, 2])])])  # [R, 1, PH, PW]
    return _scatter_add(e, _numel(e, x), pos, ctx.select(full, g), x)


# ------------------------------------------------------------------------------------------ RoiAlign


@dataclass(frozen=True)
class AlignAxis:
    """RoiAlign's samples along one axis, for roi ``r``, bin ``p``, sample ``i`` and tap ``t`` (the floor and the
    next position). ``taps`` [R, P, 2G] int64 (in range); ``weights`` [R, P, 2G] (``1 - f`` and ``f``; 0 for a
    sample the roi's grid lacks or outside ``[-1, length]``); ``slope`` [R, P, 2G], their derivatives with
    respect to the sample coordinate (``-1`` and ``1`` where the coordinate is interpolated, 0 where it is
    clamped or the sample counts 0); ``dlo``, ``dhi`` [R, P, G], the derivatives of the coordinate with respect
    to the roi's first and last coordinate; ``grid`` [R] (or 0-d) int64 samples per bin; ``big`` the largest."""

    taps: str
    weights: str
    slope: str
    dlo: str
    dhi: str
    grid: str
    big: Dim


def _align_axis(e: Emitter, lo: str, hi: str, length: Dim, pooled: int, half_pixel: bool, sampling: int,
                scale: float) -> AlignAxis:
    """RoiAlign's sampling along one axis, as onnxruntime's and the ONNX reference's ``pre_calc_for_bilinear_
    interpolate`` compute it: the coordinate ``start + p * bin + (i + .5) * bin / grid`` (``start = lo * scale -
    offset``, ``bin = size / P``, ``size = (hi - lo) * scale``, at least 1 without half_pixel); a sample outside
    ``[-1, length]`` counts 0; others are clamped to ``[0, length - 1]`` and interpolated between ``floor`` and
    ``floor + 1``. ``grid`` is ``sampling_ratio``, or ``ceil(size / P)`` per roi when that is 0."""
    sc = e.scalar(scale, lo)
    one = e.scalar(1.0, lo)
    off = e.scalar(0.5 if half_pixel else 0.0, lo)
    start = e.op("Sub", [e.op("Mul", [lo, sc]), off])
    size = e.op("Sub", [e.op("Sub", [e.op("Mul", [hi, sc]), off]), start])
    free = None  # where the size is not clamped to 1 (it moves with the roi)
    if not half_pixel:
        free = e.op("CastLike", [e.op("Greater", [size, one]), lo])
        size = e.op("Max", [size, one])
    pooled_f = e.scalar(float(pooled), lo)
    step = e.op("Div", [size, pooled_f])  # [R]
    if sampling > 0:
        grid_f = e.scalar(float(sampling), lo)
        grid: str = e.const(np.int64(sampling))
        big: Dim = sampling
        per = grid_f
    else:
        grid_f = e.op("Ceil", [e.op("Div", [size, pooled_f])])
        grid = e.op("Cast", [e.op("Max", [grid_f, e.scalar(-1.0, lo)])], to=_I64)  # [R]; <= 0: no samples
        big = e.op("Max", [e.op("ReduceMax", [grid], keepdims=0), e.const(np.int64(1))])
        per = e.op("Reshape", [e.op("Max", [grid_f, one]), e.ints([-1, 1, 1])])
    samples = _range(e, big)
    col = e.op("Unsqueeze", [step, e.ints([1, 2])])  # [R, 1, 1]
    bins = e.op("CastLike", [e.const(np.arange(pooled, dtype=np.float64).reshape(1, -1, 1)), lo])
    half = e.op("Reshape", [e.op("Add", [e.op("CastLike", [samples, lo]), e.scalar(0.5, lo)]), e.ints([1, 1, -1])])
    # the kernel's order of operations: (start + p * bin) + ((i + .5) * bin) / grid
    at = e.op("Add", [e.op("Unsqueeze", [start, e.ints([1, 2])]), e.op("Mul", [bins, col])])  # [R, P, 1]
    coord = e.op("Add", [at, e.op("Div", [e.op("Mul", [half, col]), per])])  # [R, P, G]
    # d coord / d lo and d hi: coord = start + k * size with k = (p + (i + .5) / grid) / P
    k = e.op("Div", [e.op("Add", [bins, e.op("Div", [half, per])]), pooled_f])
    moving = e.op("Mul", [k, sc]) if free is None else e.op("Mul", [e.op("Mul", [k, sc]),
                                                                   e.op("Unsqueeze", [free, e.ints([1, 2])])])
    dlo, dhi = e.op("Sub", [sc, moving]), moving
    length_f = e.op("CastLike", [_i64(e, length), lo])
    last = e.op("Sub", [length_f, one])
    inside = e.op("Not", [e.op("Or", [e.op("Less", [coord, e.scalar(-1.0, lo)]), e.op("Greater", [coord, length_f])])])
    exists = e.op("Less", [e.op("Reshape", [samples, e.ints([1, 1, -1])]),
                           e.op("Reshape", [grid, e.ints([-1, 1, 1])]) if sampling <= 0 else grid])
    c = e.op("Max", [coord, e.scalar(0.0, lo)])
    low = e.op("Floor", [c])
    clamp = e.op("GreaterOrEqual", [low, last])
    low = e.op("Where", [clamp, last, low])
    high = e.op("Where", [clamp, last, e.op("Add", [low, one])])
    frac = e.op("Where", [clamp, e.scalar(0.0, lo), e.op("Sub", [c, low])])
    counted = e.op("And", [inside, exists])
    keep = e.op("CastLike", [counted, lo])
    moves = e.op("CastLike", [e.op("And", [counted, e.op("And", [e.op("Greater", [coord, e.scalar(0.0, lo)]),
                                                                   e.op("Not", [clamp])])]), lo])

    lined = shape_cat(e, [[0, pooled], _as1(e, _times(e, big, 2))])

    def pair(a: str, b: str) -> str:
        both = e.op("Concat", [e.op("Unsqueeze", [a, e.ints([3])]), e.op("Unsqueeze", [b, e.ints([3])])], axis=3)
        return e.op("Reshape", [both, lined])  # [R, P, G, 2] -> [R, P, 2G]

    weights = pair(e.op("Mul", [e.op("Sub", [one, frac]), keep]), e.op("Mul", [frac, keep]))
    slope = pair(e.op("Neg", [moves]), moves)
    zero, top = e.const(np.int64(0)), e.op("Sub", [_i64(e, length), e.const(np.int64(1))])
    taps = e.op("Clip", [e.op("Cast", [pair(low, high)], to=_I64), zero, top])  # NaN coordinates stay in range
    return AlignAxis(taps, weights, slope, dlo, dhi, grid, big)


def _sample_mask(e: Emitter, gy: str, gx: str, big_y: Dim, big_x: Dim) -> str:
    """``[R|1, 1, 1, 1, GY*GX*4]`` bool: the samples (and their 4 corners) that roi ``r``'s grid has, in the
    kernel's order (sample row, sample column, corner)."""
    ey = e.op("Less", [e.op("Unsqueeze", [_range(e, big_y), e.ints([0])]), e.op("Reshape", [gy, e.ints([-1, 1])])])
    ex = e.op("Less", [e.op("Unsqueeze", [_range(e, big_x), e.ints([0])]), e.op("Reshape", [gx, e.ints([-1, 1])])])
    both = e.op("And", [e.op("Unsqueeze", [ey, e.ints([2, 3])]), e.op("Unsqueeze", [ex, e.ints([1, 3])])])
    return e.op("Reshape", [e.op("Expand", [both, e.ints([1, 1, 1, 4])]),
                            shape_cat(e, [[0, 1, 1, 1], _as1(e, _times(e, big_y, big_x, 4))])])


@vjp("RoiAlign")
def roi_align(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "RoiAlign" (Mask R-CNN; onnxruntime's kernel and the ONNX reference agree): each output averages
    (``mode="avg"``) the bilinear interpolations ``sum_k w_k x_k`` of ``x`` at a grid of samples in its bin, or
    (``"max"``) takes the largest weighted corner value ``w_k x_k`` over the samples.

    ``x``: each cotangent is spread back with the bilinear weights (divided by the sample count; in max mode
    only to the winning corner, the first among ties in the kernel's order: sample row, sample column,
    corner), as torchvision's ``roi_align`` backward does, by one ``ScatterElements(reduction="add")`` into the
    flat ``dx``. ``rois``: the sample coordinates move linearly with the roi's corners, and the weights with
    the coordinates (``d w / d coord = -1, +1`` for the floor and next tap, 0 where a coordinate is clamped);
    ``d rois`` sums ``dy * (d w / d coord) * (the other axis' weight) * x`` over the corners, samples, bins and
    channels (torchvision gives the boxes no gradient). The grid size (``sampling_ratio=0``), the clamping
    and which samples count are piecewise constant in the rois; the batch indices are integers. Positions and
    weights are computed at run time from the rois."""
    e, g = ctx.e, cts[0]
    x, rois, batch = node.inputs
    mode = node.attrs.get("mode", "avg") or "avg"
    if mode not in ("avg", "max"):
        raise GraphError(f"{node.label()}: no VJP for RoiAlign with mode={mode!r}")
    half_pixel = (node.attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel") == "half_pixel"
    oh, ow = int(node.attrs.get("output_height", 1)), int(node.attrs.get("output_width", 1))
    sampling = int(node.attrs.get("sampling_ratio", 0))
    scale = float(np.float32(node.attrs.get("spatial_scale", 1.0)))

    @cache
    def geometry() -> tuple:
        e.need_rank(x, node)
        c, h, w = (_dim(e, x, a) for a in range(1, 4))

        def coord(i: int) -> str:
            return e.op("Gather", [rois, e.const(np.int64(i))], axis=1)  # [R]

        ay = _align_axis(e, coord(1), coord(3), h, oh, half_pixel, sampling, scale)
        ax = _align_axis(e, coord(0), coord(2), w, ow, half_pixel, sampling, scale)
        # [R, C, PH, PW, 2GY, 2GX]: the flat position in x of every sample corner of every output
        b = e.op("Reshape", [e.op("Cast", [batch], to=_I64), e.ints([-1, 1, 1, 1, 1, 1])])
        plane = e.op("Add", [e.op("Mul", [b, _i64(e, c)]), e.op("Reshape", [_range(e, c), e.ints([1, -1, 1, 1, 1, 1])])])
        rows = e.op("Add", [e.op("Mul", [plane, _i64(e, h)]), e.op("Unsqueeze", [ay.taps, e.ints([1, 3, 5])])])
        pos = e.op("Add", [e.op("Mul", [rows, _i64(e, w)]), e.op("Unsqueeze", [ax.taps, e.ints([1, 2, 4])])])
        wy = e.op("CastLike", [e.op("Unsqueeze", [ay.weights, e.ints([1, 3, 5])]), x])  # [R, 1, PH, 1, 2GY, 1]
        wx = e.op("CastLike", [e.op("Unsqueeze", [ax.weights, e.ints([1, 2, 4])]), x])  # [R, 1, 1, PW, 1, 2GX]
        return ay, ax, pos, wy, wx

    def order(v: str) -> str:
        """``[R, C|1, PH, PW, 2GY, 2GX]`` -> ``[R, C|1, PH, PW, GY*GX*4]`` in the kernel's order. The leading
        dimensions are recorded: a broadcast (C or 1) must stay visible to the VJPs of gradients of gradients."""
        ay, ax = geometry()[:2]
        split = e.op("Reshape", [v, shape_cat(e, [[0, 0, 0, 0], _as1(e, ay.big), [2], _as1(e, ax.big), [2]])])
        lead = tuple(e.dims(v)[:4]) if e.rank(v) == 6 else (None,) * 4
        flat = shape_cat(e, [[0, 0, 0, 0], _as1(e, _times(e, ay.big, ax.big, 4))])
        return e.op("Reshape", [e.op("Transpose", [split], perm=[0, 1, 2, 3, 4, 6, 5, 7]), flat],
                    shape=(*lead, None), dtype=e.dtype(v))

    @cache
    def ordered_pos() -> str:
        return order(geometry()[2])

    @cache
    def corners() -> str:
        """``x`` at every sample corner, [R, C, PH, PW, 2GY, 2GX]."""
        return e.op("Gather", [e.op("Reshape", [x, e.ints([-1])]), geometry()[2]], axis=0)

    @cache
    def winner() -> str:
        """Max mode: the winning corner of each output in the kernel's order, int64 [R, C, PH, PW, 1]."""
        ay, ax, _, wy, wx = geometry()
        mask = _sample_mask(e, ay.grid, ax.grid, ay.big, ax.big)
        scores = e.op("Where", [mask, order(e.op("Mul", [corners(), e.op("Mul", [wy, wx])])), e.scalar(-np.inf, x)])
        return e.op("ArgMax", [scores], axis=4, keepdims=1)

    @cache
    def spread() -> str:
        """The cotangent each sample corner receives before its weight: ``dy / count`` (avg, [R, C, PH, PW, 1,
        1]) or ``dy`` at the winning corner and 0 elsewhere (max, [R, C, PH, PW, 2GY, 2GX])."""
        ay, ax = geometry()[:2]
        if mode == "avg":
            count = e.op("Max", [e.op("Mul", [ay.grid, ax.grid]), e.const(np.int64(1))])
            count = e.op("Reshape", [e.op("CastLike", [count, x]), e.ints([-1, 1, 1, 1])])
            return e.op("Unsqueeze", [e.op("Div", [g, count]), e.ints([4, 5])])
        n = e.op("Reshape", [e.op("Shape", [ordered_pos()], start=4), e.ints([])])
        hot = e.op("Equal", [e.op("Reshape", [_range(e, n), e.ints([1, 1, 1, 1, -1])]), winner()])
        picked = ctx.select(hot, e.op("Unsqueeze", [g, e.ints([4])]))  # [R, C, PH, PW, GY*GX*4]
        split = e.op("Reshape", [picked, shape_cat(e, [[0, 0, 0, 0], _as1(e, ay.big), _as1(e, ax.big), [2, 2]])])
        back = e.op("Transpose", [split], perm=[0, 1, 2, 3, 4, 6, 5, 7])
        sides = [_as1(e, _times(e, ay.big, 2)), _as1(e, _times(e, ax.big, 2))]
        return e.op("Reshape", [back, shape_cat(e, [[0, 0, 0, 0], *sides])])

    def dx() -> str:
        pos, wy, wx = geometry()[2:]
        weight = e.op("Mul", [wy, wx])  # [R, 1, PH, PW, 2GY, 2GX]
        if mode == "avg":
            return _scatter_add(e, _numel(e, x), pos, ctx.weigh(spread(), weight), x)
        tap = winner()
        sel_pos = e.op("GatherElements", [ordered_pos(), tap], axis=4)
        full = e.op("Expand", [order(weight), e.op("Shape", [ordered_pos()])])
        sel_w = e.op("GatherElements", [full, tap], axis=4)
        return _scatter_add(e, _numel(e, x), sel_pos, ctx.weigh(e.op("Unsqueeze", [g, e.ints([4])]), sel_w), x)

    def drois() -> str:
        ay, ax, _, wy, wx = geometry()
        seen = ctx.times(spread(), corners(), reads=[x])  # [R, C, PH, PW, 2GY, 2GX]

        def along(other: str, axes: list[int], a: AlignAxis, pooled: int) -> tuple[str, str]:
            per_tap = e.op("ReduceSum", [e.op("Mul", [seen, other]), e.ints(axes)], keepdims=0)  # [R, P, 2G]
            taps = e.op("Reshape", [e.op("Mul", [per_tap, e.op("CastLike", [a.slope, x])]),
                                    shape_cat(e, [[0, pooled], _as1(e, a.big), [2]])])
            per_coord = e.op("ReduceSum", [taps, e.ints([3])], keepdims=0)
            per_coord = e.op("CastLike", [per_coord, rois])  # [R, P, G]
            total = [e.op("ReduceSum", [e.op("Mul", [per_coord, d]), e.ints([1, 2])], keepdims=0) for d in (a.dlo, a.dhi)]
            return total[0], total[1]

        y1, y2 = along(wx, [1, 3, 5], ay, oh)
        x1, x2 = along(wy, [1, 2, 4], ax, ow)
        return e.op("Concat", [e.op("Unsqueeze", [v, e.ints([1])]) for v in (x1, y1, x2, y2)], axis=1, like=rois)

    return [dx, drois, None]


# ------------------------------------------------------------------------------------------ LRN


def _channel_window_sum(e: Emitter, v: str, before: int, after: int, size: int) -> str:
    """``s[n, c, ...] = sum_{c - before <= i <= c + after} v[n, i, ...]`` (zero outside the channels): a Conv
    over the channel axis with a ones kernel, on ``v`` viewed as ``(N, 1, C, prod spatial)``."""
    lined = e.op("Unsqueeze", [e.op("Reshape", [v, e.ints([0, 0, -1])]), e.ints([1])])
    summed = e.op("Conv", [lined, ones(e, [1, 1, size, 1], v)], pads=[before, 0, after, 0])
    return e.op("Reshape", [summed, e.shape_of(v)], like=v)


@unary("LRN")
def lrn(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "LRN": ``y = x * S^-beta`` with ``S = bias + alpha/size * sum_{window(c)} x^2``, the window
    ``[c - floor((size-1)/2), c + ceil((size-1)/2)]``. Then ``dx = dy * S^-beta - (2 alpha beta / size) * x *
    sum_{c: j in window(c)} dy_c x_c S_c^(-beta-1)``; the second sum runs over the mirrored window."""
    e = ctx.e
    size = int(node.attrs["size"])
    alpha, beta = float(node.attrs.get("alpha", 1e-4)), float(node.attrs.get("beta", 0.75))
    bias = float(node.attrs.get("bias", 1.0))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = _channel_window_sum(e, e.op("Mul", [x, x], like=x), lo, hi, size)
    s = e.op("Add", [e.scalar(bias, x), e.op("Mul", [sq, e.scalar(alpha / size, x)])], like=x)
    p = e.op("Pow", [s, e.scalar(-beta, x)], like=x)
    direct = e.op("Mul", [g, p], like=x)
    inner = e.op("Mul", [e.op("Mul", [g, x], like=x), e.op("Div", [p, s], like=x)], like=x)
    back = _channel_window_sum(e, inner, hi, lo, size)
    cross = e.op("Mul", [x, e.op("Mul", [back, e.scalar(2.0 * alpha * beta / size, x)], like=x)], like=x)
    return e.op("Sub", [direct, cross], like=x)


# ------------------------------------------------------------------------------------------ depth and space


@unary("SpaceToDepth")
def space_to_depth(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "SpaceToDepth" is the inverse permutation of DepthToSpace in the same ``mode`` (DCR, or CRD since
    opset 28), so its VJP is that op."""
    mode = node.attrs.get("mode", "DCR") or "DCR"
    return ctx.e.op("DepthToSpace", [g], blocksize=int(node.attrs["blocksize"]), mode=mode, like=x)


@unary("DepthToSpace")
def depth_to_space(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "DepthToSpace": a permutation. DCR mode is undone by SpaceToDepth; CRD mode reads channel
    ``c*b*b + i*b + j`` where DCR reads ``(i*b + j)*C' + c``, so its VJP is SpaceToDepth followed by that
    channel permutation."""
    e = ctx.e
    b = int(node.attrs["blocksize"])
    mode = node.attrs.get("mode", "DCR") or "DCR"
    if mode == "DCR":
        return e.op("SpaceToDepth", [g], blocksize=b, like=x)
    packed = e.op("SpaceToDepth", [g], blocksize=b)
    dy = e.dims(y)
    inner = [dy[1]] if dy is not None and isinstance(dy[1], int) else e.op(
        "Div", [e.op("Shape", [x], start=1, end=2), e.ints([b * b])])
    split = e.op("Reshape", [packed, shape_cat(e, [[0, b * b], inner, [-1]])])
    moved = e.op("Transpose", [split], perm=[0, 2, 1, 3])
    return e.op("Reshape", [moved, e.shape_of(x)], like=x)


# ------------------------------------------------------------------------------------------ Resize


def _source_coords(n_in: int, n_out: int, scale: float, mode: str, roi: tuple | None = None) -> np.ndarray:
    """The input coordinate of each output index (ONNX "Resize", ``coordinate_transformation_mode``; ``roi``
    ``(start, end)`` for tf_crop_and_resize)."""
    o = np.arange(n_out, dtype=np.float64)
    if mode == "half_pixel":
        return (o + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (o + 0.5) / scale - 0.5 if n_out > 1 else np.zeros(n_out)
    if mode == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / (scale * n_in))
        return offset + (o + 0.5) / scale - 0.5
    if mode == "align_corners":
        return o * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros(n_out)
    if mode == "asymmetric":
        return o / scale
    if mode == "tf_crop_and_resize":
        start, end = roi
        if n_out > 1:
            return start * (n_in - 1) + o * (end - start) * (n_in - 1) / (n_out - 1)
        return np.full(n_out, 0.5 * (start + end) * (n_in - 1))
    raise ValueError(mode)


def _keys(t: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at distances ``t`` (ONNX "Resize", ``cubic_coeff_a``)."""
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def _cubic(r: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution weights of the 4 taps around a point at fraction ``r`` (ONNX "Resize")."""
    def near(t):
        return ((a + 2) * t - (a + 3)) * t * t + 1

    def far(t):
        return ((a * t - 5 * a) * t + 8 * a) * t - 4 * a

    return np.stack([far(r + 1), near(r), near(1 - r), far(2 - r)], axis=-1)


def _antialiased(attrs: dict) -> bool:
    return bool(attrs.get("antialias", 0)) and (attrs.get("mode", "nearest") or "nearest") in ("linear", "cubic")


def _aa_offsets(scale: float, mode: str) -> np.ndarray:
    """The taps of the antialiasing filter relative to ``floor(x)`` (ONNX reference ``_linear_coeffs_antialias``
    / ``_cubic_coeffs_antialias``): the kernel stretched by ``1 / min(scale, 1)``."""
    start = math.floor(-(1 if mode == "linear" else 2) / min(scale, 1.0)) + 1
    return np.arange(start, 2 - start, dtype=np.float64)


def resize_matrix(n_in: int, n_out: int, scale: float, attrs: dict, roi: tuple | None = None) -> np.ndarray:
    """``A`` (``n_out x n_in``) with ``y = A @ x`` along one axis for ONNX "Resize" in mode nearest, linear or
    cubic: taps at ``floor(x) - n/2 + 1 ..`` (an integer ``x`` counts as ``x - 1`` with fraction 1), weights
    from the mode, out-of-range taps clamped to the edge (or dropped with ``exclude_outside``). With
    ``antialias`` (linear, cubic) the kernel is stretched by ``1 / scale`` when downscaling and its weights
    normalised; with tf_crop_and_resize, outputs whose coordinate falls outside the input take the
    extrapolation value (a zero row)."""
    mode = attrs.get("mode", "nearest") or "nearest"
    ctm = attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel"
    src = _source_coords(n_in, n_out, scale, ctm, roi)
    base = np.floor(src)
    r = src - base
    exact = r == 0
    base, r = np.where(exact, base - 1, base), np.where(exact, 1.0, r)
    a = float(attrs.get("cubic_coeff_a", -0.75))
    if mode == "nearest":
        how = attrs.get("nearest_mode", "round_prefer_floor") or "round_prefer_floor"
        up = {"round_prefer_floor": r > 0.5, "round_prefer_ceil": r >= 0.5, "floor": np.zeros_like(r, bool),
              "ceil": np.ones_like(r, bool)}[how] | exact
        offsets, coeffs = np.array([0.0, 1.0]), np.stack([~up, up], axis=-1).astype(np.float64)
    elif _antialiased(attrs):
        offsets = _aa_offsets(scale, mode)
        args = (offsets[None, :] - r[:, None]) * min(scale, 1.0)
        coeffs = np.clip(1 - np.abs(args), 0, 1) if mode == "linear" else _keys(args, a)
        coeffs = coeffs / coeffs.sum(axis=1, keepdims=True)
    elif mode == "linear":
        offsets, coeffs = np.array([0.0, 1.0]), np.stack([1 - r, r], axis=-1)
    else:
        offsets, coeffs = np.array([-1.0, 0.0, 1.0, 2.0]), _cubic(r, a)
    taps = (base[:, None] + offsets[None, :]).astype(np.int64)
    if attrs.get("exclude_outside", 0):
        coeffs = np.where((taps < 0) | (taps >= n_in), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    if ctm == "tf_crop_and_resize":
        coeffs = np.where(((src < 0) | (src > n_in - 1))[:, None], 0.0, coeffs)
    n = offsets.size
    out = np.zeros((n_out, n_in))
    np.add.at(out, (np.repeat(np.arange(n_out), n), np.clip(taps, 0, n_in - 1).reshape(-1)), coeffs.reshape(-1))
    return out


@dataclass(frozen=True)
class ResizeAxis:
    """One resized axis of a Resize node: its sizes in and out (ints, or 0-d int64 values computed at run
    time), its scale (a float, or a 0-d float64 value) and, for tf_crop_and_resize, its roi ``(start, end)``
    (floats or 0-d float64 values)."""

    axis: int
    n_in: Dim
    n_out: Dim
    scale: float | str
    roi: tuple | None

    @property
    def static(self) -> bool:
        values = [self.n_in, self.n_out, self.scale, *(self.roi or ())]
        return not any(isinstance(v, str) for v in values)

    def identity(self, attrs: dict) -> bool:
        """Statically the identity (a size kept at scale 1; not a crop)."""
        ctm = attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel"
        return (self.static and ctm != "tf_crop_and_resize" and self.n_in == self.n_out
                and math.isclose(self.scale, 1.0))


def _length(e: Emitter, name: str | None) -> int | None:
    """The length of the 1-D value ``name`` if known (0 when the input is absent)."""
    if not name:
        return 0
    v = e.value(name)
    if v is not None:
        return int(np.asarray(v).size)
    d = e.dims(name)
    return d[0] if d is not None and len(d) == 1 and isinstance(d[0], int) else None


def _entry(e: Emitter, values: str, known: np.ndarray | None, i: int) -> float | str:
    """Entry ``i`` of the 1-D ``values``: a float when constant, else a 0-d float64 value."""
    if known is not None:
        return float(np.asarray(known).reshape(-1)[i])
    return e.op("Cast", [e.op("Gather", [values, e.const(np.int64(i))], axis=0)], to=_F64)


def _resize_axes(e: Emitter, node: Node, x: str, y: str, g: str) -> list[ResizeAxis]:
    """The resized axes of ``node`` (ONNX "Resize": output ``floor(n * scale)`` from scales; from sizes, ``scale =
    out / n``, or one common scale for ``keep_aspect_ratio_policy`` not_larger / not_smaller), with what is
    known statically as numbers and the rest as values computed at run time (the sizes from ``x`` and ``dy``,
    the scales and roi from their inputs)."""
    r = e.need_rank(x, node)
    axes = [int(a) % r for a in node.attrs.get("axes") or range(r)]
    ins = [*node.inputs, "", "", ""]
    roi_in, scales_in, sizes_in = ins[1] or None, ins[2] or None, ins[3] or None
    n_sc, n_sz = _length(e, scales_in), _length(e, sizes_in)
    use_scales = n_sc != 0 and not (n_sc is None and n_sz != 0)
    use_sizes = n_sz != 0 and not (n_sz is None and n_sc != 0)
    if use_scales == use_sizes:
        what = ("both scales and sizes, of unknown lengths" if n_sc is None and n_sz is None
                else "no scales or sizes" if not use_scales else "both scales and sizes")
        raise GraphError(f"{node.label()}: the Resize VJP cannot tell how the output is sized ({what})")
    xd, yd, gd = e.dims(x), e.dims(y), e.dims(g)

    def static(d: tuple | None, a: int) -> int | None:
        return d[a] if d is not None and len(d) == r and isinstance(d[a], int) else None

    n_in = [static(xd, a) if static(xd, a) is not None else _dim(e, x, a) for a in axes]
    n_out = [next((v for v in (static(yd, a), static(gd, a)) if v is not None), None) for a in axes]
    n_out = [v if v is not None else _dim(e, g, a) for v, a in zip(n_out, axes, strict=True)]
    if use_scales:
        known = e.value(scales_in)
        scales = [_entry(e, scales_in, known, i) for i in range(len(axes))]
    elif (node.attrs.get("keep_aspect_ratio_policy", "stretch") or "stretch") == "stretch":
        scales = [o / n if isinstance(o, int) and isinstance(n, int) else
                  e.op("Div", [e.op("Cast", [_i64(e, o)], to=_F64), e.op("Cast", [_i64(e, n)], to=_F64)])
                  for o, n in zip(n_out, n_in, strict=True)]
    else:
        smaller = node.attrs["keep_aspect_ratio_policy"] == "not_larger"
        known = e.value(sizes_in)
        if known is not None and all(isinstance(n, int) for n in n_in):
            ratios = [float(s) / n for s, n in zip(np.asarray(known).reshape(-1), n_in, strict=True)]
            common: float | str = min(ratios) if smaller else max(ratios)
        else:
            lengths = e.op("Concat", [e.op("Unsqueeze", [_i64(e, n), e.ints([0])]) for n in n_in], axis=0)
            ratios = e.op("Div", [e.op("Cast", [sizes_in], to=_F64), e.op("Cast", [lengths], to=_F64)])
            common = e.op("ReduceMin" if smaller else "ReduceMax", [ratios], keepdims=0)
        scales = [common] * len(axes)
    rois: list[tuple | None] = [None] * len(axes)
    if (node.attrs.get("coordinate_transformation_mode", "") or "") == "tf_crop_and_resize":
        if roi_in is None:
            raise GraphError(f"{node.label()}: coordinate_transformation_mode=tf_crop_and_resize without a roi")
        known = e.value(roi_in)
        rois = [(_entry(e, roi_in, known, i), _entry(e, roi_in, known, len(axes) + i)) for i in range(len(axes))]
    return [ResizeAxis(*t) for t in zip(axes, n_in, n_out, scales, rois, strict=True)]


class _Doubles:
    """float64 arithmetic on numbers and 0-d float64 values for the run-time interpolation matrices."""

    def __init__(self, e: Emitter):
        self.e = e

    def v(self, a: float | str) -> str:
        return self.e.const(np.float64(a)) if isinstance(a, (int, float, np.floating, np.integer)) else a

    def __call__(self, op: str, *args: float | str) -> str:
        return self.e.op(op, [self.v(a) for a in args])


@dataclass(frozen=True)
class _Taps:
    """The interpolation along one axis as nodes (float64): ``src`` [n_out] the source coordinates, ``index``
    [n_out, n] int64 the (clamped) taps, ``coeffs`` [n_out, n] their weights, ``slope`` [n_out, n] the weights'
    derivatives with respect to the source coordinate (only when asked for), ``n_in`` the input size."""

    src: str
    index: str
    coeffs: str
    slope: str | None
    n_in: Dim


def _resize_taps(e: Emitter, attrs: dict, ax: ResizeAxis, slope: bool = False) -> _Taps:
    """The taps and weights of :func:`resize_matrix` as nodes (sizes, scales or roi may be values computed at
    run time), and with ``slope`` their derivatives with respect to the source coordinate: ``d/dr`` of the
    mode's weights at fraction ``r``, through the antialiasing and exclude_outside normalisations (0 for
    nearest, whose weights are piecewise constant)."""
    f = _Doubles(e)
    mode = attrs.get("mode", "nearest") or "nearest"
    ctm = attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel"
    n_in, n_out = _i64(e, ax.n_in), _i64(e, ax.n_out)
    fin, fout = (e.op("Cast", [n], to=_F64) for n in (n_in, n_out))
    scale = f.v(ax.scale)
    o = _range(e, ax.n_out, np.float64)
    several = (e.const(np.bool_(ax.n_out > 1)) if isinstance(ax.n_out, int)
               else e.op("Greater", [n_out, e.const(np.int64(1))]))
    zero = f.v(0.0)

    def half_pixel() -> str:
        return f("Sub", f("Div", f("Add", o, 0.5), scale), 0.5)

    if ctm == "half_pixel":
        src = half_pixel()
    elif ctm == "pytorch_half_pixel":
        src = e.op("Where", [several, half_pixel(), zero])
    elif ctm == "half_pixel_symmetric":
        offset = f("Mul", f("Div", fin, 2.0), f("Sub", 1.0, f("Div", fout, f("Mul", scale, fin))))
        src = f("Add", offset, half_pixel())
    elif ctm == "align_corners":
        src = e.op("Where", [several, f("Div", f("Mul", o, f("Sub", fin, 1.0)), f("Max", f("Sub", fout, 1.0), 1.0)),
                             zero])
    elif ctm == "asymmetric":
        src = f("Div", o, scale)
    elif ctm == "tf_crop_and_resize":
        start, end = ax.roi
        span = f("Sub", fin, 1.0)
        many = f("Add", f("Mul", start, span),
                 f("Div", f("Mul", f("Mul", o, f("Sub", end, start)), span), f("Max", f("Sub", fout, 1.0), 1.0)))
        one = f("Mul", f("Mul", 0.5, f("Add", start, end)), span)
        src = e.op("Where", [several, many, e.op("Expand", [one, e.op("Shape", [o])])])
    else:
        raise GraphError(f"no VJP for Resize with coordinate_transformation_mode={ctm!r}")
    base = e.op("Floor", [src])
    frac = f("Sub", src, base)
    exact = e.op("Equal", [frac, zero])
    base = e.op("Where", [exact, f("Sub", base, 1.0), base])
    r = e.op("Unsqueeze", [e.op("Where", [exact, f.v(1.0), frac]), e.ints([1])])  # [n_out, 1]
    a = float(attrs.get("cubic_coeff_a", -0.75))

    def keys(t: str) -> str:  # t >= 0
        near = f("Add", f("Mul", f("Mul", f("Sub", f("Mul", a + 2, t), a + 3), t), t), 1.0)
        far = f("Sub", f("Mul", f("Add", f("Mul", f("Sub", f("Mul", a, t), 5 * a), t), 8 * a), t), 4 * a)
        return e.op("Where", [f("LessOrEqual", t, 1.0), near, e.op("Where", [f("Less", t, 2.0), far, zero])])

    def keys_slope(t: str) -> str:  # d keys / d t, t >= 0
        near = f("Mul", f("Sub", f("Mul", 3 * (a + 2), t), 2 * (a + 3)), t)
        far = f("Add", f("Mul", f("Sub", f("Mul", 3 * a, t), 10 * a), t), 8 * a)
        return e.op("Where", [f("LessOrEqual", t, 1.0), near, e.op("Where", [f("Less", t, 2.0), far, zero])])

    dcoeffs = None
    if mode == "nearest":
        how = attrs.get("nearest_mode", "round_prefer_floor") or "round_prefer_floor"
        if how in ("floor", "ceil"):
            up = e.op("Unsqueeze", [exact, e.ints([1])]) if how == "floor" else f("Less", r, 2.0)
        else:
            up = e.op("Or", [f("Greater" if how == "round_prefer_floor" else "GreaterOrEqual", r, 0.5),
                             e.op("Unsqueeze", [exact, e.ints([1])])])
        coeffs = e.op("Cast", [e.op("Equal", [e.op("Cast", [up], to=_I64), e.const(np.array([[0, 1]], np.int64))])],
                      to=_F64)
        offsets = e.const(np.array([0.0, 1.0]))
        if slope:
            dcoeffs = f("Mul", coeffs, 0.0)
    elif _antialiased(attrs):
        support = 1.0 if mode == "linear" else 2.0
        if isinstance(ax.scale, str):
            shrink = f("Min", scale, 1.0)
            start = f("Add", e.op("Floor", [f("Div", -support, shrink)]), 1.0)
            count = e.op("Cast", [f("Sub", 2.0, f("Mul", 2.0, start))], to=_I64)
            offsets = f("Add", start, e.op("Cast", [_range(e, count)], to=_F64))
        else:
            shrink = f.v(min(ax.scale, 1.0))
            offsets = e.const(_aa_offsets(ax.scale, mode))
        args = f("Mul", f("Sub", e.op("Unsqueeze", [offsets, e.ints([0])]), r), shrink)
        t = e.op("Abs", [args])
        raw = f("Max", f("Sub", 1.0, t), 0.0) if mode == "linear" else keys(t)
        total = e.op("ReduceSum", [raw, e.ints([1])], keepdims=1)
        coeffs = f("Div", raw, total)
        if slope:  # d raw / d r = f'(|args|) sign(args) (-shrink); then the quotient rule
            fslope = e.op("Cast", [f("Less", t, 1.0)], to=_F64) if mode == "linear" else keys_slope(t)
            fslope = f("Neg", fslope) if mode == "linear" else fslope
            draw = f("Mul", f("Mul", fslope, e.op("Sign", [args])), f("Neg", shrink))
            dtotal = e.op("ReduceSum", [draw, e.ints([1])], keepdims=1)
            dcoeffs = f("Div", f("Sub", draw, f("Mul", coeffs, dtotal)), total)
    elif mode == "linear":
        offsets, coeffs = e.const(np.array([0.0, 1.0])), e.op("Concat", [f("Sub", 1.0, r), r], axis=1)
        if slope:
            dcoeffs = e.op("Expand", [e.const(np.array([[-1.0, 1.0]])), e.op("Shape", [coeffs])])
    else:
        offsets = e.const(np.array([-1.0, 0.0, 1.0, 2.0]))
        diff = f("Sub", e.op("Unsqueeze", [offsets, e.ints([0])]), r)
        coeffs = keys(e.op("Abs", [diff]))
        if slope:
            dcoeffs = f("Mul", keys_slope(e.op("Abs", [diff])), f("Neg", e.op("Sign", [diff])))
    taps = e.op("Add", [e.op("Unsqueeze", [base, e.ints([1])]), e.op("Unsqueeze", [offsets, e.ints([0])])])
    last = f("Sub", fin, 1.0)
    if attrs.get("exclude_outside", 0):
        inside = e.op("Cast", [e.op("Not", [e.op("Or", [f("Less", taps, 0.0), e.op("Greater", [taps, last])])])],
                      to=_F64)
        kept = f("Mul", coeffs, inside)
        total = e.op("ReduceSum", [kept, e.ints([1])], keepdims=1)
        total = e.op("Where", [f("Equal", total, 0.0), f.v(1.0), total])
        coeffs = f("Div", kept, total)
        if dcoeffs is not None:
            dkept = f("Mul", dcoeffs, inside)
            dcoeffs = f("Div", f("Sub", dkept, f("Mul", coeffs, e.op("ReduceSum", [dkept, e.ints([1])], keepdims=1))),
                        total)
    if ctm == "tf_crop_and_resize":
        away = e.op("Unsqueeze", [e.op("Or", [f("Less", src, 0.0), e.op("Greater", [src, last])]), e.ints([1])])
        coeffs = e.op("Where", [away, zero, coeffs])
        if dcoeffs is not None:
            dcoeffs = e.op("Where", [away, zero, dcoeffs])
    index = e.op("Clip", [e.op("Cast", [taps], to=_I64), e.const(np.int64(0)),
                          e.op("Sub", [n_in, e.const(np.int64(1))])])
    return _Taps(src, index, coeffs, dcoeffs, ax.n_in)


def _taps_matrix(e: Emitter, taps: _Taps, weights: str) -> str:
    """``M[o, i] = sum_t weights[o, t] [index(o, t) == i]`` (float64 [n_out, n_in]): a one-hot product."""
    hot = e.op("Cast", [e.op("Equal", [e.op("Unsqueeze", [taps.index, e.ints([2])]), _range(e, taps.n_in)])], to=_F64)
    return e.op("ReduceSum", [e.op("Mul", [hot, e.op("Unsqueeze", [weights, e.ints([2])])]), e.ints([1])], keepdims=0)


def resize_matrix_graph(e: Emitter, attrs: dict, ax: ResizeAxis, like: str) -> str:
    """:func:`resize_matrix` as nodes, for sizes, scales or rois known only at run time: the source coordinate
    of each output (``Range``), its taps and weights, and ``A[o, i] = sum_t w[o, t] [tap(o, t) == i]`` (a
    one-hot product, ``n_out x taps x n_in``), computed in float64 and cast to ``like``'s dtype."""
    taps = _resize_taps(e, attrs, ax)
    return e.op("CastLike", [_taps_matrix(e, taps, taps.coeffs), like])


def _move_last(e: Emitter, v: str, axis: int, r: int) -> str:
    if axis == r - 1:
        return v
    perm = list(range(r))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    return e.op("Transpose", [v], perm=perm)


def _apply(e: Emitter, g: str, axis: int, m: str, r: int, like: str | None = None) -> str:
    """``g`` with its axis ``axis`` multiplied by ``m`` (``g x_axis m``: ``MatMul`` on that axis moved last)."""
    if axis == r - 1:
        return e.op("MatMul", [g, m], like=like)
    perm = list(range(r))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    return e.op("Transpose", [e.op("MatMul", [e.op("Transpose", [g], perm=perm), m])], perm=perm, like=like)


@vjp("Resize")
def resize(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Resize" in nearest, linear and cubic modes (with or without antialias, every coordinate
    transformation) is separable and linear in ``x``: ``y = x x_a A_a`` over the resized axes, with
    interpolation matrices ``A_a`` (``n_out x n_in``). So ``dx = dy x_a A_a^T``, one ``MatMul`` per resized
    axis (PyTorch ``upsample_*_backward`` computes the same sums by scattering). ``A_a`` is a constant when the
    sizes and scales are known when the gradient is built, and is computed by nodes otherwise (scales, sizes
    or roi computed in the graph, unknown input sizes).

    With tf_crop_and_resize the roi places the source coordinates, ``src_o = start (n - 1) + o (end - start)
    (n - 1) / (n_out - 1)``, so it has a gradient (as TensorFlow's ``crop_and_resize`` gives its boxes one):
    ``d start_a = sum_{o, i} (dL/dA_a)[o, i] (dA_a/dsrc)[o, i] dsrc_o/dstart``, with ``dL/dA_a`` the contraction
    of ``dy`` (mapped back through the other axes) with ``x``, and ``dA/dsrc`` the derivatives of the mode's
    weights (0 for nearest). scales and sizes get no gradient (with a fixed output size the coordinates move
    with the scales in the linear and cubic modes; PyTorch's interpolate takes its scale factors as numbers)."""
    e, g = ctx.e, cts[0]
    x = node.inputs[0]
    ctm = node.attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel"

    @cache
    def plan() -> tuple[int, list[tuple[ResizeAxis, str]]]:
        r = e.need_rank(x, node)
        dt = e.dtype(x)
        steps = []
        for ax in _resize_axes(e, node, x, node.outputs[0], g):
            if ax.identity(node.attrs):
                continue
            if ax.static:
                a = resize_matrix(ax.n_in, ax.n_out, ax.scale, node.attrs, ax.roi)
                m = e.const(a.astype(dt)) if dt is not None else e.op("CastLike", [e.const(a.astype(np.float32)), x])
            else:
                m = resize_matrix_graph(e, node.attrs, ax, x)
            steps.append((ax, m))
        return r, steps

    def dx() -> str:
        r, steps = plan()
        out = g
        for i, (ax, m) in enumerate(steps):
            out = _apply(e, out, ax.axis, m, r, like=x if i == len(steps) - 1 else None)
        return out if steps else e.op("Identity", [g], like=x)

    def droi() -> str:
        r, steps = plan()
        roi = node.inputs[1]
        entries = {}
        for k, (ax, _) in enumerate(steps):
            back = g  # dy mapped back through every other axis
            for j, (other, m) in enumerate(steps):
                if j != k:
                    back = _apply(e, back, other.axis, m, r)
            rows = e.op("Reshape", [_move_last(e, back, ax.axis, r), shape_cat(e, [[-1], _as1(e, ax.n_out)])])
            cols = e.op("Reshape", [_move_last(e, x, ax.axis, r), shape_cat(e, [[-1], _as1(e, ax.n_in)])])
            grad_a = e.op("Cast", [e.op("MatMul", [e.op("Transpose", [rows], perm=[1, 0]), cols])], to=_F64)
            taps = _resize_taps(e, node.attrs, ax, slope=True)
            per_out = e.op("ReduceSum", [e.op("Mul", [grad_a, _taps_matrix(e, taps, taps.slope)]), e.ints([1])],
                           keepdims=0)  # dL/dsrc_o
            f = _Doubles(e)
            n_in, n_out = (e.op("Cast", [_i64(e, n)], to=_F64) for n in (ax.n_in, ax.n_out))
            span = f("Sub", n_in, 1.0)
            o = _range(e, ax.n_out, np.float64)
            several = e.op("Greater", [_i64(e, ax.n_out), e.const(np.int64(1))])
            at_end = e.op("Where", [several, f("Div", o, f("Max", f("Sub", n_out, 1.0), 1.0)), f.v(0.5)])
            at_start = e.op("Where", [several, f("Sub", 1.0, at_end), f.v(0.5)])
            for pos, share in ((k, at_start), (len(steps) + k, at_end)):
                entries[pos] = e.op("ReduceSum", [f("Mul", per_out, f("Mul", share, span))], keepdims=1)
        parts = [entries[i] for i in range(2 * len(steps))]
        return e.op("CastLike", [e.op("Concat", parts, axis=0), roi], like=roi)

    grads: list = [dx]
    if len(node.inputs) > 1:
        grads.append(droi if ctm == "tf_crop_and_resize" and node.inputs[1] else None)
    return grads + [None] * (len(node.inputs) - len(grads))
