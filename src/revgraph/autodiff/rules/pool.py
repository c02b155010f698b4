"""VJPs of pooling and resampling operators (ONNX operator spec, "MaxPool", "AveragePool", "GlobalAveragePool",
"GlobalMaxPool", "LRN", "DepthToSpace", "SpaceToDepth", "Resize"; derivatives as in PyTorch's
``tools/autograd/derivatives.yaml``: ``max_pool2d_with_indices_backward``, ``avg_pool2d_backward``,
``local_response_norm`` (composite), ``pixel_shuffle``/``pixel_unshuffle``, ``upsample_*_backward``).

Every one of these but LRN is linear in its input (MaxPool piecewise so), and its VJP is the adjoint data
movement. Where the forward semantics differ between runtimes or the reference evaluator has bugs, the VJP
avoids depending on them: MaxPool picks each window's maximum itself (``ArgMax`` over gathered windows, the
first maximum as in PyTorch) instead of reading ``MaxPool``'s ``Indices`` output, whose offsets the onnx
reference evaluator computes inconsistently; AveragePool asks the runtime's own ``AveragePool`` for its
divisors (pooling a tensor of ones), so ``count_include_pad`` and ``ceil_mode`` windows are weighted exactly as
the forward weighted them.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..context import Ctx
from ..emitter import Emitter
from ..registry import unary
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
    """ONNX "SpaceToDepth" is the inverse permutation of DCR-mode DepthToSpace, so its VJP is that op."""
    return ctx.e.op("DepthToSpace", [g], blocksize=int(node.attrs["blocksize"]), mode="DCR", like=x)


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


def _source_coords(n_in: int, n_out: int, scale: float, mode: str) -> np.ndarray:
    """The input coordinate of each output index (ONNX "Resize", ``coordinate_transformation_mode``)."""
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
    raise ValueError(mode)


def _cubic(r: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution weights of the 4 taps around a point at fraction ``r`` (ONNX "Resize")."""
    def near(t):
        return ((a + 2) * t - (a + 3)) * t * t + 1

    def far(t):
        return ((a * t - 5 * a) * t + 8 * a) * t - 4 * a

    return np.stack([far(r + 1), near(r), near(1 - r), far(2 - r)], axis=-1)


def resize_matrix(n_in: int, n_out: int, scale: float, attrs: dict) -> np.ndarray:
    """``A`` (``n_out x n_in``) with ``y = A @ x`` along one axis for ONNX "Resize" in mode nearest, linear or
    cubic: taps at ``floor(x) - n/2 + 1 ..`` (an integer ``x`` counts as ``x - 1`` with fraction 1), weights
    from the mode, out-of-range taps clamped to the edge (or dropped with ``exclude_outside``)."""
    mode = attrs.get("mode", "nearest") or "nearest"
    src = _source_coords(n_in, n_out, scale, attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel")
    base = np.floor(src)
    r = src - base
    exact = r == 0
    base, r = np.where(exact, base - 1, base), np.where(exact, 1.0, r)
    if mode == "nearest":
        how = attrs.get("nearest_mode", "round_prefer_floor") or "round_prefer_floor"
        up = {"round_prefer_floor": r > 0.5, "round_prefer_ceil": r >= 0.5, "floor": np.zeros_like(r, bool),
              "ceil": np.ones_like(r, bool)}[how] | exact
        coeffs = np.stack([~up, up], axis=-1).astype(np.float64)
    elif mode == "linear":
        coeffs = np.stack([1 - r, r], axis=-1)
    else:
        coeffs = _cubic(r, float(attrs.get("cubic_coeff_a", -0.75)))
    n = coeffs.shape[1]
    taps = (base - n // 2 + 1).astype(np.int64)[:, None] + np.arange(n)[None, :]
    if attrs.get("exclude_outside", 0):
        coeffs = np.where((taps < 0) | (taps >= n_in), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    a = np.zeros((n_out, n_in))
    np.add.at(a, (np.repeat(np.arange(n_out), n), np.clip(taps, 0, n_in - 1).reshape(-1)), coeffs.reshape(-1))
    return a


def _resize_plan(e: Emitter, node: Node, x: str) -> list[tuple[int, int, int, float]]:
    """``(axis, n_in, n_out, scale)`` for each resized axis (ONNX "Resize": output ``floor(n * scale)`` from
    scales; ``scale = out / n`` from sizes, or one common scale for ``keep_aspect_ratio_policy`` not_larger /
    not_smaller with ``out = round_half_up(scale * n)``)."""
    r = e.need_rank(x, node)
    axes = [int(a) % r for a in node.attrs.get("axes") or range(r)]
    scales = e.value(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    sizes = e.value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
    dims = e.dims(x)
    ins = [dims[a] if dims is not None else None for a in axes]
    if not all(isinstance(d, int) for d in ins):
        raise GraphError(f"{node.label()}: the resized dimensions of {x!r} are unknown, and the Resize VJP needs "
                         "them; declare the shapes of the graph inputs")
    if scales is not None and scales.size:
        factors = [float(s) for s in np.asarray(scales).reshape(-1)]
        outs = [math.floor(n * s) for n, s in zip(ins, factors, strict=True)]
    elif sizes is not None and sizes.size:
        outs = [int(s) for s in np.asarray(sizes).reshape(-1)]
        factors = [o / n for o, n in zip(outs, ins, strict=True)]
        policy = node.attrs.get("keep_aspect_ratio_policy", "stretch") or "stretch"
        if policy != "stretch":
            common = min(factors) if policy == "not_larger" else max(factors)
            factors = [common] * len(ins)
            outs = [int(common * n + 0.5) for n in ins]
    else:
        raise GraphError(f"{node.label()}: the Resize VJP needs constant scales or sizes")
    return list(zip(axes, ins, outs, factors, strict=True))


@unary("Resize")
def resize(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "Resize" in nearest, linear and cubic modes is separable and linear in ``x``: ``y = x x_a A_a``
    over the resized axes, with constant interpolation matrices ``A_a`` built from the static shapes. So
    ``dx = dy x_a A_a^T``, one ``MatMul`` per resized axis (PyTorch ``upsample_*_backward`` computes the same
    sums by scattering). roi, scales and sizes get no gradient."""
    e = ctx.e
    ctm = node.attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel"
    if node.attrs.get("antialias", 0) or ctm == "tf_crop_and_resize":
        what = "antialias=1" if node.attrs.get("antialias", 0) else "coordinate_transformation_mode=tf_crop_and_resize"
        raise GraphError(f"{node.label()}: no VJP for Resize with {what}")
    r = e.need_rank(x, node)
    dt = e.dtype(x)
    steps = [(axis, resize_matrix(n_in, n_out, scale, node.attrs))
             for axis, n_in, n_out, scale in _resize_plan(e, node, x) if n_out != n_in or not math.isclose(scale, 1.0)]
    for i, (axis, a) in enumerate(steps):
        like = x if i == len(steps) - 1 else None
        m = e.const(a.astype(dt)) if dt is not None else e.op("CastLike", [e.const(a.astype(np.float32)), x])
        if axis == r - 1:
            g = e.op("MatMul", [g, m], like=like)
        else:
            perm = list(range(r))
            perm[axis], perm[-1] = perm[-1], perm[axis]
            g = e.op("Transpose", [e.op("MatMul", [e.op("Transpose", [g], perm=perm), m])], perm=perm, like=like)
    return g
