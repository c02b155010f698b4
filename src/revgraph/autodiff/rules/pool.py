"""VJPs of pooling operators (ONNX operator spec, "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool",
"LpPool", "GlobalLpPool", "LRN", "DepthToSpace", "SpaceToDepth"; derivatives as in PyTorch's
``tools/autograd/derivatives.yaml``: ``max_pool2d_with_indices_backward``, ``avg_pool2d_backward``, ``lp_pool``
(composite), ``local_response_norm`` (composite), ``pixel_shuffle``/``pixel_unshuffle``). Resize is in
resize.py; MaxUnpool, MaxRoiPool and RoiAlign are in roi.py.

Every one of these but LRN and the Lp pools is linear in its input (the max pools piecewise so), and its VJP is
the adjoint data movement. Where the forward semantics differ between runtimes or the reference evaluator has
bugs, the VJP avoids depending on them: MaxPool picks each window's maximum itself (``ArgMax`` over gathered
windows, the first maximum as in PyTorch) instead of reading ``MaxPool``'s ``Indices`` output, whose offsets the
onnx reference evaluator computes inconsistently; AveragePool asks the runtime's own ``AveragePool`` for its
divisors (pooling a tensor of ones), so ``count_include_pad`` and ``ceil_mode`` windows are weighted exactly as
the forward weighted them.
"""

from __future__ import annotations

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import unary
from ._common import EmitterContext, zeros_of_shape
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
from .tables import arange, small


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


def _reads_padding(dims: list[int], out: list[int], geo: Geometry) -> bool:
    """Whether some window of :func:`window_table` reads padding, from the extreme positions of each axis (its
    positions ``o s + k d - pb`` run from ``-pb`` to ``(O-1) s + (K-1) d - pb``) without making the table."""
    return any(pb > 0 or (o - 1) * s + (k - 1) * d - pb >= n
               for n, o, k, s, d, pb in zip(dims, out, geo.kernel, geo.strides, geo.dilations, geo.pb, strict=True))


def _axis_grid(e: Emitter, n_a: int, mul_a: int, n_b: int, mul_b: int, add: int, view: list[int]) -> Val:
    """int64 ``q[a, b] = a * mul_a + b * mul_b + add`` (``a < n_a``, ``b < n_b``), reshaped to ``view`` (1s
    but at the two axes of ``a`` and ``b``): one axis of a run-time index table."""
    b = EmitterContext(e)
    a_, b_ = b.val(arange(e, n_a)), b.val(arange(e, n_b))
    q = (a_ * mul_a).unsqueeze([1]) + (b_ * mul_b).unsqueeze([0]) + add
    return b.val(e.op("Reshape", [q.name, e.ints(view)], shape=tuple(view), dtype=np.dtype(np.int64)))


def window_table_value(e: Emitter, dims: list[int], out: list[int], geo: Geometry) -> tuple[str, bool]:
    """:func:`window_table` as a value: a constant when small (:mod:`.tables`), else computed at run time, one
    :func:`_axis_grid` of positions per spatial axis (a MaxPool over a declared 30000 x 30000 input must not make
    the build allocate its 3.6e9-entry table)."""
    n_out, taps = int(np.prod(out)), int(np.prod(geo.kernel))
    if small([n_out, taps]):
        table, padded = window_table(dims, out, geo)
        return e.const(table), padded
    k, size = len(dims), int(np.prod(dims))
    idx = inside = None
    for i in range(k):  # position q = o s + k d - pb along axis i, read when 0 <= q < D
        view = [1] * (2 * k)
        view[i], view[k + i] = out[i], geo.kernel[i]
        q = _axis_grid(e, out[i], geo.strides[i], geo.kernel[i], geo.dilations[i], -geo.pb[i], view)
        term = q * int(np.prod(dims[i + 1:]))
        ok = q.ge(0) & q.lt(dims[i])
        idx = term if idx is None else idx + term
        inside = ok if inside is None else inside & ok
    table = where(inside, idx, size, like=None)
    return e.op("Reshape", [table.name, e.ints([n_out, taps])], shape=(n_out, taps), dtype=np.dtype(np.int64)), \
        _reads_padding(dims, out, geo)


@unary("MaxPool", bounded=True, finite=True, reads="all")
def max_pool(ctx: Ctx, node: Node, x: str, y: str, g: str | None) -> str | None:
    """ONNX "MaxPool": each window's cotangent goes to the element it took the maximum from; among tied
    elements, the first in the window's row-major order (PyTorch ``max_pool*_with_indices_backward`` routes to
    the index its forward reports, which is that one). The windows are gathered with a constant index table
    (padding reads ``-inf``), ``ArgMax`` picks the tap, and ``ScatterElements(reduction="add")`` adds the
    cotangents of overlapping windows. The ``Indices`` output carries no gradient."""
    if g is None:
        return None
    e, g = ctx.e, ctx.val(g)
    geo = pool_geometry(e, node, x)
    dims = need_spatial(e, node, x, "the MaxPool VJP (a constant window table)")
    out = geo.out(dims, _ceil(node))
    table, padded = window_table_value(e, dims, out, geo)
    size, n_out, taps = int(np.prod(dims)), int(np.prod(out)), int(np.prod(geo.kernel))
    flat = ctx.val(x).reshape([0, 0, -1])
    if padded:
        flat = flat.apply("Pad", e.ints([0, 0, 0, 0, 0, 1]), e.scalar(-np.inf, x), like=None)
    tap = flat.apply("Gather", table, like=None, axis=2).apply("ArgMax", like=None, axis=3, keepdims=0)
    if small([n_out, taps]):  # the window's tap -> its input element
        source = ctx.val(e.const(e.value(table).reshape(-1))).apply("Gather", tap + np.arange(n_out) * taps,
                                                                     like=None, axis=0)
    else:
        entry = tap + ctx.val(arange(e, n_out)) * taps
        source = ctx.val(table).reshape([-1]).apply("Gather", entry, like=None, axis=0)
    total = ctx.val(zeros_of_shape(e, shape_cat(e, [dims_part(e, x, 0, 2), [size + padded]]), x))
    acc = total.apply("ScatterElements", source, g.reshape([0, 0, -1]), like=None, axis=2, reduction="add")
    if padded:
        acc = acc.apply("Slice", e.ints([0]), e.ints([size]), e.ints([2]), like=None)
    return acc.reshape(e.shape_of(x), like=x)


def _window_weights(ctx: Ctx, node: Node, x: str, geo: Geometry, out: list[int] | None,
                    ceil: bool) -> tuple[Val, str]:
    """The weight ``1 / div(o)`` of each AveragePool window ``o``, as ``AveragePool(ones)[o] / count(o)``
    (``count``: the number of input elements in window ``o``, a Conv of ones with a ones kernel; 0 for a
    window of padding only), and that ones kernel."""
    e, k = ctx.e, len(geo.kernel)
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
    avg, count = ctx.vals(avg, count)
    zero = e.scalar(0.0, x)
    return where(count.gt(zero), avg / count.apply("Max", e.scalar(1.0, x), like=None), zero, like=None), kernel


@unary("AveragePool", bounded=True, finite=True, reads=())
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
    weight, kernel = _window_weights(ctx, node, x, geo, out, ceil)
    scaled = ctx.val(g) * weight  # dy / div
    flat = scaled.reshape(shape_cat(e, [[-1, 1], out if out is not None else e.op("Shape", [g], start=2)]))
    back = input_grad(e, node, flat.name, kernel, x, geo, 1, out)
    return e.op("Reshape", [back, e.shape_of(x)], like=x)


@unary("GlobalAveragePool", bounded=True, finite=True, reads=())
def global_average_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "GlobalAveragePool": ``dx = dy / (number of spatial elements)``, broadcast back."""
    e, g = ctx.e, ctx.val(g)
    dims = spatial(e, x)
    if dims is not None:
        n = e.scalar(float(np.prod(dims)), x)
    else:
        n = (ctx.val(e.op("Size", [x])) / e.op("Size", [y])).cast_like(g)
    return (g / n).apply("Expand", e.shape_of(x), like=x)


@unary("GlobalMaxPool", bounded=True, finite=True, reads="all")
def global_max_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "GlobalMaxPool": the cotangent goes to the spatial maxima, split equally among ties (DESIGN.md
    section 5, as ``ReduceMax``)."""
    r = ctx.e.need_rank(x, node)
    x, y, g = ctx.vals(x, y, g)
    mask = x.eq(y).apply("CastLike", x, like=x)
    return (g / mask.sum(list(range(2, r)))).weigh(mask, like=x)  # 0 off the maxima, also for an inf or NaN g


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


def inverse_table_value(e: Emitter, dims: list[int], out: list[int], geo: Geometry) -> str:
    """:func:`inverse_table` as a value: a constant when small, else computed at run time per axis (ONNX's
    integer ``Div`` truncates where numpy's floors, but the two agree on the entries kept: multiples of the
    stride, non-negative)."""
    k, n_in, taps = len(dims), int(np.prod(dims)), int(np.prod(geo.kernel))
    if small([n_in, taps]):
        return e.const(inverse_table(dims, out, geo))
    n_out = int(np.prod(out))
    entry = valid = None
    for i in range(k):  # input i + pb - k d = o s: read by window o at tap k when s divides it and o < O
        view = [1] * (2 * k)
        view[i], view[k + i] = dims[i], geo.kernel[i]
        num = _axis_grid(e, dims[i], 1, geo.kernel[i], -geo.dilations[i], geo.pb[i], view)
        o = num / geo.strides[i]
        ok = num.apply("Mod", geo.strides[i]).eq(0) & (num.ge(0) & o.lt(out[i]))
        tap = _axis_grid(e, dims[i], 0, geo.kernel[i], int(np.prod(geo.kernel[i + 1:])), 0, view)
        term = o * (int(np.prod(out[i + 1:])) * taps) + tap
        entry = term if entry is None else entry + term
        valid = ok if valid is None else valid & ok
    table = where(valid, entry, n_out * taps, like=None)
    return e.op("Reshape", [table.name, e.ints([n_in, taps])], shape=(n_in, taps), dtype=np.dtype(np.int64))


def _lp_factor(v: Val, norm: Val, p: int) -> Val:
    """``d ||x||_p / d x_i = sign(x_i) (|x_i| / ||x||_p)^(p-1)`` for the elements ``v`` of windows whose norms are
    ``norm`` (broadcast): bounded by 1, and 0 where the norm is 0 (the subgradient 0 at 0, DESIGN.md section 5;
    for p = 1, ``sign(0) = 0``)."""
    if p == 1:
        return v.sign()
    safe = where(norm.eq(0), 1.0, norm, like=None)
    return v / safe if p == 2 else v.sign() * (v.abs() / safe) ** float(p - 1)


def _lp_p(node: Node) -> int:
    p = int(node.attrs.get("p", 2))
    if p < 1:
        raise GraphError(f"{node.label()}: p={p}: the Lp norm needs p >= 1")
    return p


@unary("LpPool", bounded=False, finite=False)
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
    table, padded = window_table_value(e, dims, out, geo)
    inverse = inverse_table_value(e, dims, out, geo)
    x, y, g = ctx.vals(x, y, g)
    flat = x.reshape([0, 0, -1])
    if padded:
        flat = flat.apply("Pad", e.ints([0, 0, 0, 0, 0, 1]), like=None)
    windows = flat.apply("Gather", table, like=None, axis=2)  # [N, C, O, K]
    terms = g.reshape([0, 0, -1, 1]).times(_lp_factor(windows, y.reshape([0, 0, -1, 1]), p), reads=[x], like=None)
    lined = terms.reshape([0, 0, -1]).apply("Pad", e.ints([0, 0, 0, 0, 0, 1]), like=None)
    back = lined.apply("Gather", inverse, like=None, axis=2).sum([3], keepdims=0)  # the adjoint of the gather
    return back.reshape(e.shape_of(x.name), like=x)


@unary("GlobalLpPool", bounded=False, finite=False)
def global_lp_pool(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "GlobalLpPool": ``y = ||x||_p`` over the spatial axes, ``dx = dy sign(x) (|x| / y)^(p-1)`` (0 where
    ``y`` is 0)."""
    x, y, g = ctx.vals(x, y, g)
    return g.times(_lp_factor(x, y, _lp_p(node)), like=x, reads=[x])


# ------------------------------------------------------------------------------------------ LRN


def _channel_window_sum(v: Val, before: int, after: int, size: int) -> Val:
    """``s[n, c, ...] = sum_{c - before <= i <= c + after} v[n, i, ...]`` (zero outside the channels): a Conv
    over the channel axis with a ones kernel, on ``v`` viewed as ``(N, 1, C, prod spatial)``."""
    e = v.ctx.e
    lined = v.reshape([0, 0, -1]).unsqueeze([1])
    summed = lined.apply("Conv", ones(e, [1, 1, size, 1], v.name), like=None, pads=[before, 0, after, 0])
    return summed.reshape(e.shape_of(v.name), like=v)


@unary("LRN", bounded=False, finite=False)
def lrn(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "LRN": ``y = x * S^-beta`` with ``S = bias + alpha/size * sum_{window(c)} x^2``, the window
    ``[c - floor((size-1)/2), c + ceil((size-1)/2)]``. Then ``dx = dy * S^-beta - (2 alpha beta / size) * x *
    sum_{c: j in window(c)} dy_c x_c S_c^(-beta-1)``; the second sum runs over the mirrored window."""
    x, g = ctx.vals(x, g)
    size = int(node.attrs["size"])
    alpha, beta = float(node.attrs.get("alpha", 1e-4)), float(node.attrs.get("beta", 0.75))
    bias = float(node.attrs.get("bias", 1.0))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    s = bias + _channel_window_sum(x * x, lo, hi, size) * (alpha / size)
    p = s ** -beta
    back = _channel_window_sum(g * x * (p / s), hi, lo, size)  # over the mirrored window
    return g * p - x * (back * (2.0 * alpha * beta / size))


# ------------------------------------------------------------------------------------------ depth and space


@unary("SpaceToDepth", bounded=True, finite=True, reads=(), moves=True)
def space_to_depth(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "SpaceToDepth" is the inverse permutation of DepthToSpace in the same ``mode`` (DCR, or CRD since
    opset 28), so its VJP is that op."""
    mode = node.attrs.get("mode", "DCR") or "DCR"
    return ctx.e.op("DepthToSpace", [g], blocksize=int(node.attrs["blocksize"]), mode=mode, like=x)


@unary("DepthToSpace", bounded=True, finite=True, reads=(), moves=True)
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
