"""VJPs of the spatial-transformer operators (ONNX operator spec, "GridSample" (opsets 16, 20, 22) and
"AffineGrid" (opset 20); derivatives as in PyTorch's ``grid_sampler_2d_backward``/``grid_sampler_3d_backward``
(aten/src/ATen/native/GridSampler.cpp, ``tools/autograd/derivatives.yaml``) and ``affine_grid_generator``, and
Jaderberg et al., "Spatial Transformer Networks", https://arxiv.org/abs/1506.02025, section 3.3).

GridSample reads, for every output point q, the input at taps around the point's coordinates ``p_i(grid)``
(one per spatial axis): ``Y[n, c, q] = sum_t W_t(p) X[n, c, idx_t(p)]``, with per-axis weights multiplied
over the tap tuples t (N-linear: 2 taps per axis, N-cubic: 4, nearest: 1). So

- ``dX = scatter_add(idx, W * dY)``: the transposed interpolation. It is written as one
  ``ScatterElements(reduction="add")`` on the flattened spatial axes, never as a reducing ``ScatterND``, whose
  onnxruntime kernel races on repeated indices (see autodiff/sparse.py); the scatter kernel is sequential.
- ``dgrid_i = a_i p_i'(u_i) sum_t sum_c dY X[idx_t] dW_t/dp_i``: the derivatives of the weights (``a_i`` the
  scale of the unnormalization ``u = a n + b``, ``p'`` the derivative of the border clamp (0 outside) or of
  the reflection (+-1)); nearest mode has a piecewise-constant output: the grid gets zeros.

The coordinates follow onnxruntime's kernel, which agrees with PyTorch (``grid_sample``): linear and nearest
modes clamp (``border``) or reflect (``reflection``) a coordinate outside ``[lo, hi]`` (``[0, D-1]`` with
``align_corners=1``, ``[-1/2, D-1/2]`` without), then read taps with the padding applied to the tap indices
(zeros: taps outside the input read 0; border: the nearest edge; reflection: the reflected index). Cubic mode
leaves the coordinate as it is and pads only the taps (as PyTorch's ``bicubic``); onnx's reference evaluator
clamps the coordinate in cubic mode too, which gives other values with ``padding_mode=border``.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val, where
from ..context import Ctx
from ..registry import vjp
from ._common import product
from .tables import small

#: Keys' cubic convolution coefficient, as onnxruntime and PyTorch use it for GridSample.
CUBIC_A = -0.75

#: Per tap of one axis, the distance ``T = s * sign + offset`` from the point (``s`` the fraction of the
#: coordinate) and the polynomial ``w(T) = ((a3 T + a2) T + a1) T + a0`` of the weight; ``taps`` the tap offsets
#: from ``floor(p)`` (``round(p)`` for nearest).
_KERNELS = {
    "linear": {"taps": [0, 1], "sign": [-1.0, 1.0], "offset": [1.0, 0.0],
               "poly": [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]},
    "cubic": {"taps": [-1, 0, 1, 2], "sign": [1.0, 1.0, -1.0, -1.0], "offset": [1.0, 0.0, 1.0, 2.0],
              "poly": [[CUBIC_A, CUBIC_A + 2, CUBIC_A + 2, CUBIC_A],
                       [-5 * CUBIC_A, -(CUBIC_A + 3), -(CUBIC_A + 3), -5 * CUBIC_A],
                       [8 * CUBIC_A, 0.0, 0.0, 8 * CUBIC_A],
                       [-4 * CUBIC_A, 1.0, 1.0, -4 * CUBIC_A]]},
    "nearest": {"taps": [0]},
}

#: Opset 16's names of the modes.
_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic", "nearest": "nearest"}


def _cast_like(v: Val, ref: str) -> Val:
    """``v`` in ``ref``'s dtype (GridSample's X and grid may have different float types)."""
    if v.dtype is not None and v.dtype == v.ctx.e.dtype(ref):
        return v
    return v.cast_like(ref)


class _Axis:
    """One spatial axis of X: its size as an int (static) and as values (int64 and float scalars)."""

    def __init__(self, ctx: Ctx, x: str, axis: int, like: str):
        e = ctx.e
        dims = e.dims(x)
        d = dims[axis] if dims is not None else None
        self.ctx, self.like = ctx, like
        self.static = d if isinstance(d, int) else None
        if self.static is not None:
            self.size = ctx.val(e.const(np.int64(self.static)))
        else:
            self.size = ctx.val(e.op("Squeeze", [e.op("Shape", [x], start=axis, end=axis + 1)], shape=(),
                                     dtype=np.dtype(np.int64)))

    def num(self, scale: float, shift: float) -> Val:
        """``scale * D + shift`` as a scalar of the grid's dtype."""
        if self.static is not None:
            return self.ctx.val(self.ctx.e.scalar(scale * self.static + shift, self.like))
        return self.size.cast_like(self.like) * scale + shift

    def ints(self, scale: int, shift: int) -> Val:
        """``scale * D + shift`` as an int64 scalar."""
        if self.static is not None:
            return self.ctx.val(self.ctx.e.const(np.int64(scale * self.static + shift)))
        return self.size * scale + shift


class _Taps:
    """What both cotangents of a GridSample node read: per spatial axis the coordinates, the tap indices and
    the weights with their derivatives, and over all axes the flat tap indices and the tap weights.

    Shapes: ``N`` batch, ``Q`` output points, ``k`` taps per axis, ``r`` spatial axes, ``T = k**r``. Per axis:
    ``w[i]``, ``dw[i]`` ``[N, Q, 1.., k, ..1]`` (the k taps at position ``2 + i``), ``dp[i]`` ``[N, Q]`` or
    ``None`` (the derivative factor of the coordinate transform: 1), ``a[i]`` the unnormalization scale.
    Together: ``index`` int64 ``[N, 1, Q * T]`` into the flattened spatial axes, ``weight`` ``[N, Q, k, .., k]``,
    ``valid`` (zeros padding only) bool ``[N, 1, Q * T]``: the taps inside the input."""

    def __init__(self, ctx: Ctx, node: Node, x: str, grid: str, r: int, mode: str, padding: str, align: bool):
        e = ctx.e
        kernel = _KERNELS[mode]
        self.k = len(kernel["taps"])
        self.r, self.T = r, self.k ** r
        flat = ctx.val(grid).reshape([0, -1, r])  # [N, Q, r]
        self.w, self.dw, self.dp, self.a = [], [], [], []
        index = valid = None
        stride: Val | int = 1
        for i in reversed(range(r)):  # the last axis has stride 1; grid[..., 0] is the last axis' coordinate
            ax = _Axis(ctx, x, 2 + i, grid)
            gi = flat.apply("Gather", e.const(np.int64(r - 1 - i)), like=None, axis=2)  # [N, Q]
            a = ax.num(0.5, -0.5) if align else ax.num(0.5, 0.0)
            u = gi * a + ax.num(0.5, -0.5)  # the pixel coordinate: u = a n + b
            p, dp = _transform(u, ax, padding, align) if mode != "cubic" else (u, None)
            base = p.apply("Round" if mode == "nearest" else "Floor")
            spread = [2 + j for j in range(r) if j != i]
            taps = base.unsqueeze([2]) + np.asarray(kernel["taps"], e.dtype(grid) or np.float32)
            idx, ok = _tap_index(taps.cast(np.int64), ax, padding, align)  # int64 [N, Q, k]
            w, dw = (None, None) if mode == "nearest" else _kernel(kernel, (p - base).unsqueeze([2]), grid)
            if ok is not None:
                mask = ok.indicator(grid)
                w = mask if w is None else w * mask
                dw = None if dw is None else dw * mask
            self.w.insert(0, None if w is None else w.unsqueeze(spread) if spread else w)
            self.dw.insert(0, None if dw is None else dw.unsqueeze(spread) if spread else dw)
            self.dp.insert(0, dp)
            self.a.insert(0, a)
            idx = idx.unsqueeze(spread) if spread else idx
            if ok is not None:
                ok = ok.unsqueeze(spread) if spread else ok
                valid = ok if valid is None else valid & ok
            scaled = idx if isinstance(stride, int) and stride == 1 else idx * stride
            index = scaled if index is None else index + scaled
            stride = stride * ax.static if isinstance(stride, int) and ax.static is not None else stride * ax.size
        self.index = index.reshape([0, 1, -1])
        self.valid = None if valid is None else valid.reshape([0, 1, -1])
        ws = [w for w in self.w if w is not None]
        self.weight = product(ws) if ws else None

    def others(self, i: int) -> list[Val]:
        """The weights of every axis but ``i`` (nearest: none)."""
        return [w for j, w in enumerate(self.w) if j != i and w is not None]


def _transform(u: Val, ax: _Axis, padding: str, align: bool) -> tuple[Val, Val | None]:
    """The coordinate of linear and nearest modes after the padding's transform, and the transform's derivative
    (``None``: 1). Outside ``[lo, hi]``, border clamps to ``[0, D-1]`` (derivative 0) and reflection reflects at
    lo and hi until inside (derivative +-1)."""
    if padding == "zeros":
        return u, None
    lo, hi = (ax.num(0.0, 0.0), ax.num(1.0, -1.0)) if align else (ax.num(0.0, -0.5), ax.num(1.0, -0.5))
    outside = u.lt(lo) | u.gt(hi)
    if padding == "border":
        clamped = u.apply("Clip", ax.num(0.0, 0.0), ax.num(1.0, -1.0))
        p = clamped if align else where(outside, clamped, u)
        return p, ~outside  # a selection: the derivative is 1 inside, 0 outside
    if align and ax.static == 1:  # no room to reflect in: PyTorch and onnxruntime read the one pixel
        return u.ctx.val(u.ctx.e.zeros_like(u.name)), u.lt(u)
    span = ax.num(1.0, -1.0) if align else ax.num(1.0, 0.0)
    t = u - lo
    off = (t.abs().apply("Mod", span + span, fmod=1)) - span
    p = where(outside, (lo + span) - off.abs(), u)  # reflected at lo and hi
    return p, where(outside, -(t.sign() * off.sign()), 1.0)


def _tap_index(t: Val, ax: _Axis, padding: str, align: bool) -> tuple[Val, Val | None]:
    """The index each integer tap position ``t`` (int64) reads, and for zeros padding whether it is inside
    (bool; the others read 0). Border clamps; reflection reflects at the border pixels (``align_corners=1``:
    ``-1 -> 1``) or at their outer edges (``-1 -> 0``), periodically."""
    last = ax.ints(1, -1)
    if padding == "zeros":
        return t.apply("Clip", 0, last), t.ge(0) & t.le(last)
    if padding == "border":
        return t.apply("Clip", 0, last), None
    period = ax.ints(2, -2).apply("Max", 1) if align else ax.ints(2, 0)
    m = t.apply("Mod", period)  # integer Mod takes the divisor's sign: in [0, period)
    return m.apply("Min", (period if align else period - 1) - m), None


def _kernel(kernel: dict, s: Val, like: str) -> tuple[Val, Val]:
    """The weights ``w`` of the taps of one axis (``[N, Q, k]``) at fraction ``s`` (``[N, Q, 1]``) and their
    derivatives ``dw/ds`` (``[N, Q, k]``, or ``[1, 1, k]`` when constant)."""
    dt = s.ctx.e.dtype(like) or np.float32

    def c(v, shape=None) -> np.ndarray:
        return np.asarray(v, dtype=dt).reshape(shape or -1)

    k = len(kernel["taps"])
    t = s * c(kernel["sign"]) + c(kernel["offset"])  # distances from the point
    a3, a2, a1, a0 = kernel["poly"]
    if not any(a3) and not any(a2):  # linear: w = T, dw/ds = sign
        return t, s.ctx.val(s.ctx.e.const(c(kernel["sign"], (1, 1, k))))
    w = ((t * c(a3) + c(a2)) * t + c(a1)) * t + c(a0)
    slope = (t * c(np.multiply(3, a3)) + c(np.multiply(2, a2))) * t + c(a1)  # dw/dT
    return w, slope * c(kernel["sign"])


def _mode(node: Node) -> tuple[str, str, bool]:
    mode = node.attrs.get("mode") or "linear"
    if mode not in _MODES:
        raise GraphError(f"{node.label()}: GridSample mode {mode!r} is not one of linear, nearest, cubic")
    padding = node.attrs.get("padding_mode", "zeros") or "zeros"
    if padding not in ("zeros", "border", "reflection"):
        raise GraphError(f"{node.label()}: GridSample padding_mode {padding!r} is not one of zeros, border, reflection")
    return _MODES[mode], padding, bool(node.attrs.get("align_corners", 0))


@vjp("GridSample", bounded=False, finite=False)
def grid_sample(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "GridSample": ``dX`` scatters ``W * dY`` to the taps (race free), ``dgrid`` sums ``dY X dW/dp``
    over channels and taps (module doc; PyTorch ``grid_sampler_2d_backward``). Opset 16's mode names
    (bilinear, bicubic) are the same modes. Shapes may be dynamic except the rank of X."""
    e, (x, grid), g = ctx.e, node.inputs[:2], ctx.val(cts[0])
    mode, padding, align = _mode(node)
    r = e.need_rank(x, node) - 2
    if r < 1:
        raise GraphError(f"{node.label()}: GridSample needs X of rank 3 or more, got rank {r + 2}")

    @cache
    def taps() -> _Taps:
        return _Taps(ctx, node, x, grid, r, mode, padding, align)

    @cache
    def gq() -> Val:
        return g.reshape([0, 0, -1, 1])  # [N, C, Q, 1]

    @cache
    def spread_index() -> Val:  # int64 [N, C, Q * T]: the flat tap indices, the same for every channel
        index = taps().index
        return index.expand(e.op("Concat", [e.op("Shape", [g.name], end=2), e.op("Shape", [index.name], start=2)],
                                 axis=0))

    def dx() -> Val:  # scatter_add(idx, W dY)
        tp = taps()
        if tp.weight is None:  # nearest with border or reflection padding: every tap has weight 1
            upd = gq().reshape([0, 0, -1])
        else:
            upd = (gq() * _cast_like(tp.weight.reshape([0, 1, -1, tp.T]), g.name)).reshape([0, 0, -1])
        if tp.valid is not None and not ctx.finite:  # an inf or NaN cotangent never reaches a tap outside X
            upd = upd.select(tp.valid, like=None)
        table = ctx.val(e.zeros_like(x)).reshape([0, 0, -1])
        out = table.apply("ScatterElements", spread_index(), upd, like=None, axis=2, reduction="add")
        return out.reshape(e.shape_of(x), like=x)

    def dgrid() -> Val | str:  # dgrid_i = a_i p_i' sum_t sum_c dY X[idx_t] dW_t/dp_i
        if mode == "nearest":  # piecewise constant in the grid
            return e.zeros_like(grid)
        tp = taps()
        xg = ctx.val(x).reshape([0, 0, -1]).apply("GatherElements", spread_index(), like=None, axis=2)
        h = (xg.reshape([0, 0, -1, tp.T]) * gq()).sum([1], keepdims=0)  # [N, Q, T]
        if tp.valid is not None and (not ctx.finite or ctx.nonfinite(x)):
            # a tap outside X reads 0, not the clamped pixel: an inf or NaN there (in X or in the cotangent of
            # a point outside) gives no contribution, as in PyTorch
            h = where(tp.valid.reshape([0, -1, tp.T]), h, 0.0, like=None)
        h = _cast_like(h.reshape([0, 0, *[tp.k] * r]), grid)
        cols = []
        for i in range(r):
            d = product([h, tp.dw[i], *tp.others(i)]).sum(list(range(2, 2 + r)), keepdims=0)  # dL/dp_i, [N, Q]
            dp = tp.dp[i]
            if dp is not None:
                d = where(dp, d, 0.0, like=None) if dp.dtype is not None and dp.dtype.kind == "b" else d * dp
            cols.insert(0, (d * tp.a[i]).unsqueeze([2]))
        out = cols[0] if r == 1 else ctx.val(e.op("Concat", [c.name for c in cols], axis=2))
        return out.reshape(e.shape_of(grid), like=grid)

    return [dx, dgrid]


# ------------------------------------------------------------------------------------------ AffineGrid


def _base_coords(ctx: Ctx, size: Val | int, like: Val, align: bool) -> Val:
    """The normalized coordinates ``[S, 1]`` of the S pixels along one axis, in ``like``'s dtype (ONNX
    "AffineGrid": ``-1 + 2 i / (S - 1)`` with ``align_corners=1`` (``-1`` for S = 1), ``-1 + (2 i + 1) / S``
    without)."""
    e = ctx.e
    if isinstance(size, int) and small([size]):
        i = np.arange(size, dtype=np.float64)
        v = (-1 + 2 * i / (size - 1) if size > 1 else np.full(size, -1.0)) if align else -1 + (2 * i + 1) / size
        return ctx.val(e.const(v.reshape(size, 1).astype(like.dtype or np.float32)))
    size = ctx.val(e.const(np.int64(size))) if isinstance(size, int) else size
    n = size.cast_like(like)
    i = ctx.val(e.op("Range", [e.const(np.int64(0)), size.name, e.const(np.int64(1))])).cast_like(like)
    v = i * (2.0 / (n - 1.0).apply("Max", 1.0)) - 1.0 if align else (i * 2.0 + 1.0) / n - 1.0
    return v.unsqueeze([1])


@vjp("AffineGrid", bounded=False, finite=False)
def affine_grid(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "AffineGrid" (opset 20): ``grid[n, s, :] = theta[n] @ [base(s), 1]`` is linear in ``theta``
    (``[N, r, r + 1]``, r = 2 or 3 spatial axes), so ``dtheta[n] = sum_s dgrid[n, s, :] [base(s), 1]^T``
    (PyTorch ``affine_grid_generator_backward``). The base coordinates are separable: column j (the
    coordinate of spatial axis r - 1 - j) is the cotangent summed over the other spatial axes times that axis'
    coordinates, and the last column the cotangent summed over all of them; no base grid is materialised.
    ``size`` is an integer input and gets no gradient."""
    e, theta, g = ctx.e, node.inputs[0], ctx.val(cts[0])
    align = bool(node.attrs.get("align_corners", 0))

    def dtheta() -> str:
        r = e.need_rank(g.name, node, "the AffineGrid VJP") - 2
        dims = g.dims
        spatial = list(range(1, 1 + r))
        cols = []
        for j in range(r):
            axis = 1 + (r - 1 - j)  # the spatial axis whose coordinate is grid[..., j]
            others = [a for a in spatial if a != axis]
            gs = g.sum(others, keepdims=0) if others else g  # [N, S, r]
            size = dims[axis] if dims is not None and isinstance(dims[axis], int) else ctx.val(
                e.op("Squeeze", [e.op("Shape", [g.name], start=axis, end=axis + 1)], shape=(),
                     dtype=np.dtype(np.int64)))
            cols.append(gs.transpose([0, 2, 1]) @ _base_coords(ctx, size, g, align))  # [N, r, 1]
        cols.append(g.sum(spatial, keepdims=0).unsqueeze([2]))
        return e.op("Concat", [c.name for c in cols], axis=2, like=theta)

    return [dtheta, None]
