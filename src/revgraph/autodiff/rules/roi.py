"""VJPs of the region pools and of max unpooling (ONNX operator spec, "MaxUnpool", "MaxRoiPool", "RoiAlign";
derivatives as in PyTorch's ``tools/autograd/derivatives.yaml``: ``max_unpool``; torchvision's
``roi_pool_backward`` and ``roi_align_backward``), and the small helpers on sizes known statically or only at
run time that resize.py and pool.py import from here.

Each of these is linear in its input (MaxRoiPool piecewise so), and its VJP is the adjoint data movement.
MaxUnpool asks the runtime's own ``MaxUnpool`` where each element landed (unpooling its positions), since
onnxruntime and the ONNX reference place elements differently when ``output_shape`` is larger than the
inferred shape. Scatters that add (RoiAlign, MaxRoiPool, MaxUnpool) are ``ScatterElements(reduction="add")``
on flat views, never a reducing ``ScatterND`` (sparse.py: race-free).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import unary, vjp
from ._common import Dim, as1, dim_of, dims_product, i64, int_range, numel, zeros_of_shape
from .conv import shape_cat
from .tables import arange, small

# ------------------------------------------------------------------------------------------ small helpers


def _scatter_add(e: Emitter, size: Dim, positions: str, values: str, like: str) -> str:
    """Zeros of ``like``'s shape and dtype (``size`` elements) with ``values`` added at the flat ``positions``
    (int64, the shape of ``values``; repeats add up): ``ScatterElements(reduction="add")`` on the flat views,
    which onnxruntime runs sequentially (race-free, sparse.py)."""
    length = e.ints([size]) if isinstance(size, int) else e.op("Unsqueeze", [size, e.ints([0])])
    flat = zeros_of_shape(e, length, like)
    out = e.op("ScatterElements", [flat, e.op("Reshape", [positions, e.ints([-1])]),
                                   e.op("Reshape", [values, e.ints([-1])])], axis=0, reduction="add")
    return e.op("Reshape", [out, e.shape_of(like)], like=like)


# ------------------------------------------------------------------------------------------ MaxUnpool

#: positions of up to 2^24 elements are exact in the float32 probe that MaxUnpool's VJP unpools
_EXACT_F32 = 1 << 24
_LOW = 1 << 12


@unary("MaxUnpool", bounded=False, finite=False)
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
    n = numel(e, x)
    shape = e.shape_of(x)

    def landed(code: Val) -> Val:
        """The code written at each place of the unpooled output (0 where nothing was), as int64 [Y]."""
        return code.reshape(shape).apply("MaxUnpool", *rest, like=None, **node.attrs).reshape([-1]).cast(np.int64)

    if isinstance(n, int) and n < _EXACT_F32 and small([n]):  # element j is coded j + 1
        src = landed(ctx.val(e.const(np.arange(1, n + 1, dtype=np.float32)))) - 1
    else:  # element j is coded (j // 4096, j % 4096 + 1)
        j = ctx.val(int_range(e, n))
        hi, lo = landed((j / _LOW).cast(np.float32)), landed((j.apply("Mod", _LOW) + 1).cast(np.float32))
        src = where(lo.eq(0), -1, hi * _LOW + (lo - 1))
    src = where(src.lt(0), i64(e, n), src)  # nothing landed: the extra slot
    room = n + 1 if isinstance(n, int) else (ctx.val(n) + 1).name
    acc = ctx.val(zeros_of_shape(e, shape_cat(e, [as1(e, room)]), x)).apply(
        "ScatterElements", src, ctx.val(g).reshape([-1]), like=None, axis=0, reduction="add")
    acc = acc.apply("Slice", e.ints([0]), shape_cat(e, [as1(e, n)]), e.ints([0]), like=None)
    return acc.reshape(shape, like=x)


# ------------------------------------------------------------------------------------------ MaxRoiPool


def _round_half_away(v: Val) -> Val:
    """C's ``round`` (halves away from zero, as onnxruntime's MaxRoiPool rounds), computed in float64 so that
    ``v + 0.5`` is exact; int64."""
    d = v.cast(np.float64)
    return where(d.ge(0.0), (d + 0.5).apply("Floor"), (d - 0.5).apply("Ceil"), like=None).cast(np.int64)


def _roi_bins(start: Val, size: Val, pooled: int, length: Dim) -> tuple[Val, Val]:
    """MaxRoiPool's bins along one axis: ``[R, P]`` int64 first (inclusive) and end (exclusive) positions,
    ``floor(p * size / P)`` and ``ceil((p + 1) * size / P)`` (float32, as onnxruntime) past ``start``,
    clipped to ``[0, length]``."""
    e = start.ctx.e
    step = (size.cast(np.float32) / float(pooled)).unsqueeze([1])  # [R, 1]
    ps = start.ctx.val(arange(e, pooled, np.float32))
    first = (ps * step).apply("Floor").cast(np.int64)
    end = ((ps + 1.0) * step).apply("Ceil").cast(np.int64)
    at, top = start.unsqueeze([1]), i64(e, length)
    return (first + at).apply("Clip", 0, top), (end + at).apply("Clip", 0, top)


def _roi_boxes(rois: Val, scale: float) -> tuple[Val, Val]:
    """The batch index of each roi ``[b, x1, y1, x2, y2]`` (int64 [R]) and its box ``x1, y1, x2, y2`` scaled by
    ``spatial_scale`` (in float32) and rounded as onnxruntime rounds (:func:`_round_half_away`; int64 [R, 4])."""
    e = rois.ctx.e
    b = rois.apply("Slice", e.ints([0]), e.ints([1]), e.ints([1]), like=None).reshape([-1]).cast(np.int64)
    box = rois.apply("Slice", e.ints([1]), e.ints([5]), e.ints([1]), like=None).cast(np.float32)
    return b, _round_half_away(box * scale)


def _box_bins(corners: Val, ph: int, pw: int, h: Dim, w: Dim) -> tuple[Val, Val, Val, Val]:
    """The bins of the roi boxes ``corners`` (:func:`_roi_boxes`, a box at least one element high and wide):
    first and end rows ``[R, PH]``, first and end columns ``[R, PW]`` (:func:`_roi_bins`)."""
    sw, sh, ew, eh = (corners.apply("Gather", corners.ctx.e.const(np.int64(i)), like=None, axis=1)  # [R]
                      for i in range(4))
    hs, he = _roi_bins(sh, (eh - sh + 1).apply("Max", 1), ph, h)
    ws, we = _roi_bins(sw, (ew - sw + 1).apply("Max", 1), pw, w)
    return hs, he, ws, we


@dataclass(frozen=True)
class _RoiWindows:
    """MaxRoiPool's bins as windows of the largest bin size ``BH x BW``: ``hs``, ``ws`` the bins' first row and
    column ([R, PH], [R, PW] int64); ``bh``, ``bw`` the window size and ``last_row``, ``last_col`` ``H - 1`` and
    ``W - 1`` (0-d int64); ``pix`` the flat ``[N*H*W]`` position of every window element (clamped into the
    image) and ``ok`` whether it lies inside its bin ([R, PH, BH, PW, BW], int64 and bool)."""

    hs: Val
    ws: Val
    bh: Val
    bw: Val
    last_row: Val
    last_col: Val
    pix: Val
    ok: Val


def _roi_windows(b: Val, hs: Val, he: Val, ws: Val, we: Val, h: Dim, w: Dim) -> _RoiWindows:
    """The windows (:class:`_RoiWindows`) of the bins ``[hs, he) x [ws, we)`` in image ``b`` of each roi."""
    ctx, e = b.ctx, b.ctx.e

    def span(first: Val, end: Val) -> Val:  # the largest bin, at least 1
        return (end - first).apply("ReduceMax", like=None, keepdims=0).apply("Max", 1)

    bh, bw = span(hs, he), span(ws, we)
    hm1, wm1 = (ctx.val(i64(e, v)) - 1 for v in (h, w))

    def lines(first: Val, end: Val, size: Val, last: Val) -> tuple[Val, Val]:
        at = first.unsqueeze([2]) + int_range(e, size.name)  # [R, P, B]
        return at.apply("Min", last), at.lt(end.unsqueeze([2]))

    rows, row_ok = lines(hs, he, bh, hm1)
    cols, col_ok = lines(ws, we, bw, wm1)
    # flat [N*H*W] positions of the window elements: [R, PH, BH, PW, BW]
    pix = (b.reshape([-1, 1, 1, 1, 1]) * i64(e, h) + rows.unsqueeze([3, 4])) * i64(e, w) + cols.unsqueeze([1, 2])
    ok = row_ok.unsqueeze([3, 4]) & col_ok.unsqueeze([1, 2])
    return _RoiWindows(hs, ws, bh, bw, hm1, wm1, pix, ok)


def _bin_argmax(x: Val, c: Dim, win: _RoiWindows) -> Val:
    """The window tap of each bin's maximum, the first in the bin's row-major order (int64 [R, C, PH, PW]): the
    windows gathered from ``x`` viewed as ``[N*H*W, C]``, positions outside the bin reading ``-inf``."""
    e = x.ctx.e
    pixels = x.transpose([0, 2, 3, 1]).reshape(shape_cat(e, [[-1], as1(e, c)]))
    vals = pixels.apply("Gather", win.pix, like=None, axis=0)  # [R, PH, BH, PW, BW, C]
    vals = where(win.ok.unsqueeze([5]), vals, -np.inf, like=None)
    taps = as1(e, dims_product(e, win.bh.name, win.bw.name))
    vals = vals.transpose([0, 5, 1, 3, 2, 4]).reshape(shape_cat(e, [[0, 0, 0, 0], taps]))
    return vals.apply("ArgMax", like=None, axis=4, keepdims=0)


def _tap_positions(win: _RoiWindows, tap: Val, b: Val, c: Dim, h: Dim, w: Dim) -> Val:
    """The flat position in ``x`` (int64 [R, C, PH, PW]) of the element each bin reads at window tap ``tap``."""
    ctx, e = b.ctx, b.ctx.e
    hsel = (win.hs.unsqueeze([1, 3]) + tap / win.bw).apply("Min", win.last_row)
    wsel = (win.ws.unsqueeze([1, 2]) + tap.apply("Mod", win.bw)).apply("Min", win.last_col)
    plane = b.reshape([-1, 1, 1, 1]) * i64(e, c) + ctx.val(int_range(e, c)).reshape([1, -1, 1, 1])
    return (plane * i64(e, h) + hsel) * i64(e, w) + wsel


@unary("MaxRoiPool", bounded=False, finite=False)
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
    c, h, w = (dim_of(e, x, a) for a in range(1, 4))
    b, corners = _roi_boxes(ctx.val(node.inputs[1]), scale)
    hs, he, ws, we = _box_bins(corners, ph, pw, h, w)
    win = _roi_windows(b, hs, he, ws, we, h, w)
    tap = _bin_argmax(ctx.val(x), c, win)  # [R, C, PH, PW]: the first maximum in the bin
    pos = _tap_positions(win, tap, b, c, h, w)
    full = he.gt(hs).unsqueeze([1, 3]) & we.gt(ws).unsqueeze([1, 2])  # [R, 1, PH, PW]: the bins not empty
    return _scatter_add(e, numel(e, x), pos.name, ctx.val(g).select(full, like=None).name, x)


# ------------------------------------------------------------------------------------------ RoiAlign


@dataclass(frozen=True)
class AlignAxis:
    """RoiAlign's samples along one axis, for roi ``r``, bin ``p``, sample ``i`` and tap ``t`` (the floor and the
    next position). ``taps`` [R, P, 2G] int64 (in range); ``weights`` [R, P, 2G] (``1 - f`` and ``f``; 0 for a
    sample the roi's grid lacks or outside ``[-1, length]``); ``slope`` [R, P, 2G], their derivatives with
    respect to the sample coordinate (``-1`` and ``1`` where the coordinate is interpolated, 0 where it is
    clamped or the sample counts 0); ``dlo``, ``dhi`` [R, P, G], the derivatives of the coordinate with respect
    to the roi's first and last coordinate; ``grid`` [R] (or 0-d) int64 samples per bin; ``big`` the largest."""

    taps: Val
    weights: Val
    slope: Val
    dlo: Val
    dhi: Val
    grid: Val
    big: Dim


def _align_axis(ctx: Ctx, lo: Val, hi: Val, length: Dim, pooled: int, half_pixel: bool, sampling: int,
                scale: float) -> AlignAxis:
    """RoiAlign's sampling along one axis, as onnxruntime's and the ONNX reference's ``pre_calc_for_bilinear_
    interpolate`` compute it: the coordinate ``start + p * bin + (i + .5) * bin / grid`` (``start = lo * scale -
    offset``, ``bin = size / P``, ``size = (hi - lo) * scale``, at least 1 without half_pixel); a sample outside
    ``[-1, length]`` counts 0; others are clamped to ``[0, length - 1]`` and interpolated between ``floor`` and
    ``floor + 1``. ``grid`` is ``sampling_ratio``, or ``ceil(size / P)`` per roi when that is 0."""
    e = ctx.e
    off = 0.5 if half_pixel else 0.0
    start = lo * scale - off
    size = hi * scale - off - start
    free = None  # where the size is not clamped to 1 (it moves with the roi)
    if not half_pixel:
        free = size.gt(1.0).cast_like(lo)
        size = size.apply("Max", 1.0)
    step = size / float(pooled)  # [R]
    if sampling > 0:
        grid, big, per = ctx.val(e.const(np.int64(sampling))), sampling, float(sampling)
    else:
        grid_f = (size / float(pooled)).apply("Ceil")
        grid = grid_f.apply("Max", -1.0).cast(np.int64)  # [R]; <= 0: no samples
        big = grid.apply("ReduceMax", like=None, keepdims=0).apply("Max", 1).name
        per = grid_f.apply("Max", 1.0).reshape([-1, 1, 1])
    samples = ctx.val(int_range(e, big))
    col = step.unsqueeze([1, 2])  # [R, 1, 1]
    bins = ctx.val(arange(e, pooled, np.float64, shape=(1, -1, 1))).cast_like(lo)
    half = (samples.cast_like(lo) + 0.5).reshape([1, 1, -1])
    # the kernel's order of operations: (start + p * bin) + ((i + .5) * bin) / grid
    coord = (start.unsqueeze([1, 2]) + bins * col) + half * col / per  # [R, P, G]
    # d coord / d lo and d hi: coord = start + k * size with k = (p + (i + .5) / grid) / P
    k = (bins + half / per) / float(pooled)
    moving = k * scale if free is None else k * scale * free.unsqueeze([1, 2])
    dlo, dhi = scale - moving, moving
    length_f = ctx.val(i64(e, length)).cast_like(lo)
    last = length_f - 1.0
    inside = ~(coord.lt(-1.0) | coord.gt(length_f))
    exists = samples.reshape([1, 1, -1]).lt(grid.reshape([-1, 1, 1]) if sampling <= 0 else grid)
    c = coord.apply("Max", 0.0)
    low = c.apply("Floor")
    clamp = low.ge(last)
    low = where(clamp, last, low, like=None)
    high = where(clamp, last, low + 1.0, like=None)
    frac = where(clamp, 0.0, c - low, like=None)
    counted = inside & exists
    keep = counted.cast_like(lo)
    moves = (counted & (coord.gt(0.0) & ~clamp)).cast_like(lo)

    lined = shape_cat(e, [[0, pooled], as1(e, dims_product(e, big, 2))])

    def pair(a: Val, b: Val) -> Val:  # [R, P, G, 2] -> [R, P, 2G]
        return ctx.val(e.op("Concat", [a.unsqueeze([3]).name, b.unsqueeze([3]).name], axis=3)).reshape(lined)

    weights = pair((1.0 - frac) * keep, frac * keep)
    slope = pair(-moves, moves)
    top = ctx.val(i64(e, length)) - e.const(np.int64(1))
    taps = pair(low, high).cast(np.int64).apply("Clip", e.const(np.int64(0)), top)  # NaN coordinates stay in range
    return AlignAxis(taps, weights, slope, dlo, dhi, grid, big)


def _sample_mask(e: Emitter, gy: str, gx: str, big_y: Dim, big_x: Dim) -> str:
    """``[R|1, 1, 1, 1, GY*GX*4]`` bool: the samples (and their 4 corners) that roi ``r``'s grid has, in the
    kernel's order (sample row, sample column, corner)."""
    ey = e.op("Less", [e.op("Unsqueeze", [int_range(e, big_y), e.ints([0])]), e.op("Reshape", [gy, e.ints([-1, 1])])])
    ex = e.op("Less", [e.op("Unsqueeze", [int_range(e, big_x), e.ints([0])]), e.op("Reshape", [gx, e.ints([-1, 1])])])
    both = e.op("And", [e.op("Unsqueeze", [ey, e.ints([2, 3])]), e.op("Unsqueeze", [ex, e.ints([1, 3])])])
    return e.op("Reshape", [e.op("Expand", [both, e.ints([1, 1, 1, 4])]),
                            shape_cat(e, [[0, 1, 1, 1], as1(e, dims_product(e, big_y, big_x, 4))])])


@dataclass(frozen=True)
class _AlignSpec:
    """The attributes of a RoiAlign node."""

    mode: str
    half_pixel: bool
    oh: int
    ow: int
    sampling: int
    scale: float


def _align_spec(node: Node) -> _AlignSpec:
    mode = node.attrs.get("mode", "avg") or "avg"
    if mode not in ("avg", "max"):
        raise GraphError(f"{node.label()}: no VJP for RoiAlign with mode={mode!r}")
    half_pixel = (node.attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel") == "half_pixel"
    oh, ow = int(node.attrs.get("output_height", 1)), int(node.attrs.get("output_width", 1))
    sampling = int(node.attrs.get("sampling_ratio", 0))
    scale = float(np.float32(node.attrs.get("spatial_scale", 1.0)))
    return _AlignSpec(mode, half_pixel, oh, ow, sampling, scale)


@dataclass(frozen=True)
class _AlignGrid:
    """RoiAlign's samples of every output: the axes ``ay``, ``ax`` (:class:`AlignAxis`); ``pos`` [R, C, PH, PW,
    2GY, 2GX] the flat position in ``x`` of every sample corner; the bilinear weights ``wy`` [R, 1, PH, 1, 2GY,
    1] and ``wx`` [R, 1, 1, PW, 1, 2GX] in ``x``'s dtype."""

    ay: AlignAxis
    ax: AlignAxis
    pos: Val
    wy: Val
    wx: Val


def _align_grid(ctx: Ctx, node: Node, spec: _AlignSpec) -> _AlignGrid:
    e = ctx.e
    x, rois, batch = ctx.vals(*node.inputs)
    e.need_rank(x.name, node)
    c, h, w = (dim_of(e, x.name, a) for a in range(1, 4))

    def coord(i: int) -> Val:
        return rois.apply("Gather", e.const(np.int64(i)), like=None, axis=1)  # [R]

    ay = _align_axis(ctx, coord(1), coord(3), h, spec.oh, spec.half_pixel, spec.sampling, spec.scale)
    ax = _align_axis(ctx, coord(0), coord(2), w, spec.ow, spec.half_pixel, spec.sampling, spec.scale)
    # [R, C, PH, PW, 2GY, 2GX]: the flat position in x of every sample corner of every output
    b = batch.cast(np.int64).reshape([-1, 1, 1, 1, 1, 1])
    plane = b * i64(e, c) + ctx.val(int_range(e, c)).reshape([1, -1, 1, 1, 1, 1])
    pos = (plane * i64(e, h) + ay.taps.unsqueeze([1, 3, 5])) * i64(e, w) + ax.taps.unsqueeze([1, 2, 4])
    wy = ay.weights.unsqueeze([1, 3, 5]).cast_like(x)  # [R, 1, PH, 1, 2GY, 1]
    wx = ax.weights.unsqueeze([1, 2, 4]).cast_like(x)  # [R, 1, 1, PW, 1, 2GX]
    return _AlignGrid(ay, ax, pos, wy, wx)


def _in_kernel_order(v: Val, grid: _AlignGrid) -> Val:
    """``[R, C|1, PH, PW, 2GY, 2GX]`` -> ``[R, C|1, PH, PW, GY*GX*4]`` in the kernel's order. The leading
    dimensions are recorded: a broadcast (C or 1) must stay visible to the VJPs of gradients of gradients."""
    ctx, ay, ax, v = v.ctx, grid.ay, grid.ax, v.name
    e = ctx.e
    split = e.op("Reshape", [v, shape_cat(e, [[0, 0, 0, 0], as1(e, ay.big), [2], as1(e, ax.big), [2]])])
    lead = tuple(e.dims(v)[:4]) if e.rank(v) == 6 else (None,) * 4
    flat = shape_cat(e, [[0, 0, 0, 0], as1(e, dims_product(e, ay.big, ax.big, 4))])
    return ctx.val(e.op("Reshape", [e.op("Transpose", [split], perm=[0, 1, 2, 3, 4, 6, 5, 7]), flat],
                        shape=(*lead, None), dtype=e.dtype(v)))


def _from_kernel_order(v: Val, grid: _AlignGrid) -> Val:
    """The inverse of :func:`_in_kernel_order`: ``[R, C, PH, PW, GY*GX*4]`` -> ``[R, C, PH, PW, 2GY, 2GX]``."""
    e, ay, ax = v.ctx.e, grid.ay, grid.ax
    split = v.reshape(shape_cat(e, [[0, 0, 0, 0], as1(e, ay.big), as1(e, ax.big), [2, 2]]))
    sides = [as1(e, dims_product(e, ay.big, 2)), as1(e, dims_product(e, ax.big, 2))]
    return split.transpose([0, 1, 2, 3, 4, 6, 5, 7]).reshape(shape_cat(e, [[0, 0, 0, 0], *sides]))


def _avg_spread(g: Val, grid: _AlignGrid, x: str) -> Val:
    """Avg mode: the cotangent each sample corner receives before its weight, ``dy / count`` ([R, C, PH, PW, 1,
    1]; ``count`` the roi's samples per bin, at least 1)."""
    count = (grid.ay.grid * grid.ax.grid).apply("Max", 1).cast_like(x).reshape([-1, 1, 1, 1])
    return (g / count).unsqueeze([4, 5])


def _align_roi_grads(seen: Val, other: Val, axes: list[int], a: AlignAxis, pooled: int, x: str,
                     rois: str) -> tuple[Val, Val]:
    """The gradients ([R]) of the roi's first and last coordinate along axis ``a``: ``seen`` (the cotangent times
    ``x`` at every sample corner, [R, C, PH, PW, 2GY, 2GX]) times the ``other`` axis' weights, summed over
    ``axes`` onto this axis' taps, times the weights' slopes, summed per sample coordinate, through the
    coordinates' derivatives ``a.dlo`` and ``a.dhi``."""
    e = seen.ctx.e
    per_tap = (seen * other).sum(axes, keepdims=0)  # [R, P, 2G]
    taps = (per_tap * a.slope.cast_like(x)).reshape(shape_cat(e, [[0, pooled], as1(e, a.big), [2]]))
    per_coord = taps.sum([3], keepdims=0).cast_like(rois)  # [R, P, G]
    return (per_coord * a.dlo).sum([1, 2], keepdims=0), (per_coord * a.dhi).sum([1, 2], keepdims=0)


@vjp("RoiAlign", bounded=False, finite=False)
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
    e, g = ctx.e, ctx.val(cts[0])
    x, rois, _ = node.inputs
    spec = _align_spec(node)

    @cache
    def grid() -> _AlignGrid:
        return _align_grid(ctx, node, spec)

    @cache
    def ordered_pos() -> Val:
        return _in_kernel_order(grid().pos, grid())

    @cache
    def corners() -> Val:
        """``x`` at every sample corner, [R, C, PH, PW, 2GY, 2GX]."""
        return ctx.val(x).reshape([-1]).apply("Gather", grid().pos, like=None, axis=0)

    @cache
    def winner() -> Val:
        """Max mode: the winning corner of each output in the kernel's order, int64 [R, C, PH, PW, 1]."""
        geo = grid()
        mask = ctx.val(_sample_mask(e, geo.ay.grid.name, geo.ax.grid.name, geo.ay.big, geo.ax.big))
        scores = where(mask, _in_kernel_order(corners() * (geo.wy * geo.wx), geo), -np.inf, like=None)
        return scores.apply("ArgMax", like=None, axis=4, keepdims=1)

    @cache
    def spread() -> Val:
        """The cotangent each sample corner receives before its weight: ``dy / count`` (avg, [R, C, PH, PW, 1,
        1]) or ``dy`` at the winning corner and 0 elsewhere (max, [R, C, PH, PW, 2GY, 2GX])."""
        if spec.mode == "avg":
            return _avg_spread(g, grid(), x)
        n = e.op("Reshape", [e.op("Shape", [ordered_pos().name], start=4), e.ints([])])
        hot = ctx.val(int_range(e, n)).reshape([1, 1, 1, 1, -1]).eq(winner())
        picked = g.unsqueeze([4]).select(hot, like=None)  # [R, C, PH, PW, GY*GX*4]
        return _from_kernel_order(picked, grid())

    def dx() -> str:  # the cotangents spread back with the bilinear weights
        geo = grid()
        weight = geo.wy * geo.wx  # [R, 1, PH, PW, 2GY, 2GX]
        if spec.mode == "avg":
            return _scatter_add(e, numel(e, x), geo.pos.name, spread().weigh(weight, like=None).name, x)
        tap = winner()
        sel_pos = ordered_pos().apply("GatherElements", tap, like=None, axis=4)
        full = _in_kernel_order(weight, geo).expand(e.op("Shape", [ordered_pos().name]))
        sel_w = full.apply("GatherElements", tap, like=None, axis=4)
        return _scatter_add(e, numel(e, x), sel_pos.name, g.unsqueeze([4]).weigh(sel_w, like=None).name, x)

    def drois() -> str:
        geo = grid()
        seen = spread().times(corners(), reads=[x], like=None)  # [R, C, PH, PW, 2GY, 2GX]
        y1, y2 = _align_roi_grads(seen, geo.wx, [1, 3, 5], geo.ay, spec.oh, x, rois)
        x1, x2 = _align_roi_grads(seen, geo.wy, [1, 2, 4], geo.ax, spec.ow, x, rois)
        return e.op("Concat", [v.unsqueeze([1]).name for v in (x1, y1, x2, y2)], axis=1, like=rois)

    return [dx, drois, None]
