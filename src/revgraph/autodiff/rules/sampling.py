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
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
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


def _cast_like(e: Emitter, v: str, ref: str) -> str:
    """``v`` in ``ref``'s dtype (GridSample's X and grid may have different float types)."""
    if e.dtype(v) is not None and e.dtype(v) == e.dtype(ref):
        return v
    return e.op("CastLike", [v, ref], shape=e.dims(v), dtype=e.dtype(ref))


class _Axis:
    """One spatial axis of X: its size as an int (static) and as values (int64 and float scalars)."""

    def __init__(self, e: Emitter, x: str, axis: int, like: str):
        dims = e.dims(x)
        d = dims[axis] if dims is not None else None
        self.e, self.like = e, like
        self.static = d if isinstance(d, int) else None
        if self.static is not None:
            self.size = e.const(np.int64(self.static))
        else:
            self.size = e.op("Squeeze", [e.op("Shape", [x], start=axis, end=axis + 1)], shape=(), dtype=np.dtype(np.int64))

    def num(self, scale: float, shift: float) -> str:
        """``scale * D + shift`` as a scalar of the grid's dtype."""
        e = self.e
        if self.static is not None:
            return e.scalar(scale * self.static + shift, self.like)
        v = e.op("CastLike", [self.size, self.like])
        return e.op("Add", [e.op("Mul", [v, e.scalar(scale, self.like)]), e.scalar(shift, self.like)])

    def ints(self, scale: int, shift: int) -> str:
        """``scale * D + shift`` as an int64 scalar."""
        e = self.e
        if self.static is not None:
            return e.const(np.int64(scale * self.static + shift))
        return e.op("Add", [e.op("Mul", [self.size, e.const(np.int64(scale))]), e.const(np.int64(shift))])


class _Taps:
    """What both cotangents of a GridSample node read: per spatial axis the coordinates, the tap indices and
    the weights with their derivatives, and over all axes the flat tap indices and the tap weights.

    Shapes: ``N`` batch, ``Q`` output points, ``k`` taps per axis, ``r`` spatial axes, ``T = k**r``. Per axis:
    ``w[i]``, ``dw[i]`` ``[N, Q, 1.., k, ..1]`` (the k taps at position ``2 + i``), ``dp[i]`` ``[N, Q]`` or
    ``None`` (the derivative factor of the coordinate transform: 1), ``a[i]`` the unnormalization scale.
    Together: ``index`` int64 ``[N, 1, Q * T]`` into the flattened spatial axes, ``weight`` ``[N, Q, k, .., k]``,
    ``valid`` (zeros padding only) bool ``[N, 1, Q * T]``: the taps inside the input."""

    def __init__(self, e: Emitter, node: Node, x: str, grid: str, r: int, mode: str, padding: str, align: bool):
        kernel = _KERNELS[mode]
        self.k = len(kernel["taps"])
        self.r, self.T = r, self.k ** r
        flat = e.op("Reshape", [grid, e.ints([0, -1, r])])  # [N, Q, r]
        self.w, self.dw, self.dp, self.a = [], [], [], []
        index = valid = None
        stride: str | int = 1
        for i in reversed(range(r)):  # the last axis has stride 1; grid[..., 0] is the last axis' coordinate
            ax = _Axis(e, x, 2 + i, grid)
            gi = e.op("Gather", [flat, e.const(np.int64(r - 1 - i))], axis=2)  # [N, Q]
            a = ax.num(0.5, -0.5) if align else ax.num(0.5, 0.0)
            u = e.op("Add", [e.op("Mul", [gi, a]), ax.num(0.5, -0.5)], like=gi)
            p, dp = _transform(e, u, ax, padding, align) if mode != "cubic" else (u, None)
            base = e.op("Round" if mode == "nearest" else "Floor", [p], like=p)
            spread = [2 + j for j in range(r) if j != i]
            taps = e.op("Add", [e.op("Unsqueeze", [base, e.ints([2])]), e.const(np.asarray(kernel["taps"], e.dtype(grid) or np.float32))])
            t = e.op("Cast", [taps], to=7)  # int64 [N, Q, k]
            idx, ok = _tap_index(e, t, ax, padding, align)
            if mode == "nearest":
                w = dw = None
            else:
                s = e.op("Unsqueeze", [e.op("Sub", [p, base], like=p), e.ints([2])])
                w, dw = _kernel(e, kernel, s, grid)
            if ok is not None:
                mask = e.op("Cast", [ok], to=e.onnx_dtype(grid) or 1)
                w = mask if w is None else e.op("Mul", [w, mask])
                dw = None if dw is None else e.op("Mul", [dw, mask])
            self.w.insert(0, None if w is None else e.op("Unsqueeze", [w, e.ints(spread)]) if spread else w)
            self.dw.insert(0, None if dw is None else e.op("Unsqueeze", [dw, e.ints(spread)]) if spread else dw)
            self.dp.insert(0, dp)
            self.a.insert(0, a)
            idx = e.op("Unsqueeze", [idx, e.ints(spread)]) if spread else idx
            if ok is not None:
                ok = e.op("Unsqueeze", [ok, e.ints(spread)]) if spread else ok
                valid = ok if valid is None else e.op("And", [valid, ok])
            scaled = idx if isinstance(stride, int) and stride == 1 else e.op("Mul", [idx, _int(e, stride)])
            index = scaled if index is None else e.op("Add", [index, scaled])
            if isinstance(stride, int) and ax.static is not None:
                stride *= ax.static
            else:
                stride = e.op("Mul", [_int(e, stride), ax.size])
        flat_shape = e.ints([0, 1, -1])
        self.index = e.op("Reshape", [index, flat_shape])
        self.valid = None if valid is None else e.op("Reshape", [valid, flat_shape])
        ws = [w for w in self.w if w is not None]
        self.weight = _product(e, ws) if ws else None

    def others(self, i: int) -> list[str]:
        """The weights of every axis but ``i`` (nearest: none)."""
        return [w for j, w in enumerate(self.w) if j != i and w is not None]


def _int(e: Emitter, v: int | str) -> str:
    return e.const(np.int64(v)) if isinstance(v, int) else v


def _product(e: Emitter, vs: list[str]) -> str:
    out = vs[0]
    for v in vs[1:]:
        out = e.op("Mul", [out, v])
    return out


def _transform(e: Emitter, u: str, ax: _Axis, padding: str, align: bool) -> tuple[str, str | None]:
    """The coordinate of linear and nearest modes after the padding's transform, and the transform's derivative
    (``None``: 1). Outside ``[lo, hi]``, border clamps to ``[0, D-1]`` (derivative 0) and reflection reflects at
    lo and hi until inside (derivative +-1)."""
    if padding == "zeros":
        return u, None
    lo, hi = (ax.num(0.0, 0.0), ax.num(1.0, -1.0)) if align else (ax.num(0.0, -0.5), ax.num(1.0, -0.5))
    outside = e.op("Or", [e.op("Less", [u, lo]), e.op("Greater", [u, hi])])
    if padding == "border":
        clamped = e.op("Clip", [u, ax.num(0.0, 0.0), ax.num(1.0, -1.0)], like=u)
        p = clamped if align else e.op("Where", [outside, clamped, u], like=u)
        return p, e.op("Not", [outside])  # a selection: the derivative is 1 inside, 0 outside
    if align and ax.static == 1:  # no room to reflect in: PyTorch and onnxruntime read the one pixel
        return e.zeros_like(u), e.op("Less", [u, u])
    span = ax.num(1.0, -1.0) if align else ax.num(1.0, 0.0)
    t = e.op("Sub", [u, lo], like=u)
    m = e.op("Mod", [e.op("Abs", [t], like=u), e.op("Add", [span, span])], fmod=1, like=u)
    off = e.op("Sub", [m, span], like=u)
    reflected = e.op("Sub", [e.op("Add", [lo, span]), e.op("Abs", [off], like=u)], like=u)
    p = e.op("Where", [outside, reflected, u], like=u)
    sign = e.op("Neg", [e.op("Mul", [e.op("Sign", [t]), e.op("Sign", [off])])], like=u)
    return p, e.op("Where", [outside, sign, e.scalar(1.0, u)], like=u)


def _tap_index(e: Emitter, t: str, ax: _Axis, padding: str, align: bool) -> tuple[str, str | None]:
    """The index each integer tap position ``t`` (int64) reads, and for zeros padding whether it is inside
    (bool; the others read 0). Border clamps; reflection reflects at the border pixels (``align_corners=1``:
    ``-1 -> 1``) or at their outer edges (``-1 -> 0``), periodically."""
    zero = e.const(np.int64(0))
    last = ax.ints(1, -1)
    if padding == "zeros":
        ok = e.op("And", [e.op("GreaterOrEqual", [t, zero]), e.op("LessOrEqual", [t, last])])
        return e.op("Clip", [t, zero, last], like=t), ok
    if padding == "border":
        return e.op("Clip", [t, zero, last], like=t), None
    period = e.op("Max", [ax.ints(2, -2), e.const(np.int64(1))]) if align else ax.ints(2, 0)
    m = e.op("Mod", [t, period], like=t)  # integer Mod takes the divisor's sign: in [0, period)
    mirror = e.op("Sub", [period if align else e.op("Sub", [period, e.const(np.int64(1))]), m], like=t)
    return e.op("Min", [m, mirror], like=t), None


def _kernel(e: Emitter, kernel: dict, s: str, like: str) -> tuple[str, str]:
    """The weights ``w`` of the taps of one axis (``[N, Q, k]``) at fraction ``s`` (``[N, Q, 1]``) and their
    derivatives ``dw/ds`` (``[N, Q, k]``, or ``[1, 1, k]`` when constant)."""
    dt = e.dtype(like) or np.float32

    def c(v, shape=None):
        return e.const(np.asarray(v, dtype=dt).reshape(shape or -1))

    k = len(kernel["taps"])
    t = e.op("Add", [e.op("Mul", [s, c(kernel["sign"])]), c(kernel["offset"])])  # distances from the point
    a3, a2, a1, a0 = kernel["poly"]
    if not any(a3) and not any(a2):  # linear: w = T, dw/ds = sign
        return t, c(kernel["sign"], (1, 1, k))
    w = e.op("Add", [e.op("Mul", [e.op("Add", [e.op("Mul", [e.op("Add", [e.op("Mul", [t, c(a3)]), c(a2)]), t]),
                                                c(a1)]), t]), c(a0)])
    slope = e.op("Add", [e.op("Mul", [e.op("Add", [e.op("Mul", [t, c(np.multiply(3, a3))]), c(np.multiply(2, a2))]),
                                      t]), c(a1)])
    return w, e.op("Mul", [slope, c(kernel["sign"])])


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
    e, (x, grid), g = ctx.e, node.inputs[:2], cts[0]
    mode, padding, align = _mode(node)
    r = e.need_rank(x, node) - 2
    if r < 1:
        raise GraphError(f"{node.label()}: GridSample needs X of rank 3 or more, got rank {r + 2}")

    @cache
    def taps() -> _Taps:
        return _Taps(e, node, x, grid, r, mode, padding, align)

    @cache
    def gq() -> str:
        return e.op("Reshape", [g, e.ints([0, 0, -1, 1])])  # [N, C, Q, 1]

    @cache
    def spread_index() -> str:  # int64 [N, C, Q * T]: the flat tap indices, the same for every channel
        index = taps().index
        target = e.op("Concat", [e.op("Shape", [g], end=2), e.op("Shape", [index], start=2)], axis=0)
        return e.op("Expand", [index, target])

    def dx() -> str:
        tp = taps()
        if tp.weight is None:  # nearest with border or reflection padding: every tap has weight 1
            upd = e.op("Reshape", [gq(), e.ints([0, 0, -1])])
        else:
            w = _cast_like(e, e.op("Reshape", [tp.weight, e.ints([0, 1, -1, tp.T])]), g)  # [N, 1, Q, T]
            upd = e.op("Reshape", [e.op("Mul", [gq(), w]), e.ints([0, 0, -1])])
        if tp.valid is not None and not ctx.finite:  # an inf or NaN cotangent never reaches a tap outside X
            upd = e.op("Where", [tp.valid, upd, e.scalar(0.0, upd)])
        table = e.op("Reshape", [e.zeros_like(x), e.ints([0, 0, -1])])
        out = e.op("ScatterElements", [table, spread_index(), upd], axis=2, reduction="add")
        return e.op("Reshape", [out, e.shape_of(x)], like=x)

    def dgrid() -> str:
        if mode == "nearest":  # piecewise constant in the grid
            return e.zeros_like(grid)
        tp = taps()
        xg = e.op("GatherElements", [e.op("Reshape", [x, e.ints([0, 0, -1])]), spread_index()], axis=2)
        h = e.op("ReduceSum", [e.op("Mul", [e.op("Reshape", [xg, e.ints([0, 0, -1, tp.T])]), gq()]), e.ints([1])],
                 keepdims=0)  # [N, Q, T]
        if tp.valid is not None and (not ctx.finite or ctx.nonfinite(x)):
            # a tap outside X reads 0, not the clamped pixel: an inf or NaN there (in X or in the cotangent of
            # a point outside) gives no contribution, as in PyTorch
            h = e.op("Where", [e.op("Reshape", [tp.valid, e.ints([0, -1, tp.T])]), h, e.scalar(0.0, h)])
        h = _cast_like(e, e.op("Reshape", [h, e.ints([0, 0, *[tp.k] * r])]), grid)
        axes = e.ints(list(range(2, 2 + r)))
        cols = []
        for i in range(r):
            term = _product(e, [h, tp.dw[i], *tp.others(i)])
            d = e.op("ReduceSum", [term, axes], keepdims=0)  # dL/dp_i, [N, Q]
            if tp.dp[i] is not None:
                if e.dtype(tp.dp[i]) is not None and e.dtype(tp.dp[i]).kind == "b":
                    d = e.op("Where", [tp.dp[i], d, e.scalar(0.0, d)])
                else:
                    d = e.op("Mul", [d, tp.dp[i]])
            cols.insert(0, e.op("Unsqueeze", [e.op("Mul", [d, tp.a[i]]), e.ints([2])]))
        out = cols[0] if r == 1 else e.op("Concat", cols, axis=2)
        return e.op("Reshape", [out, e.shape_of(grid)], like=grid)

    return [dx, dgrid]


# ------------------------------------------------------------------------------------------ AffineGrid


def _base_coords(e: Emitter, size: str | int, like: str, align: bool) -> str:
    """The normalized coordinates ``[S, 1]`` of the S pixels along one axis, in ``like``'s dtype (ONNX
    "AffineGrid": ``-1 + 2 i / (S - 1)`` with ``align_corners=1`` (``-1`` for S = 1), ``-1 + (2 i + 1) / S``
    without)."""
    if isinstance(size, int) and small([size]):
        i = np.arange(size, dtype=np.float64)
        v = (-1 + 2 * i / (size - 1) if size > 1 else np.full(size, -1.0)) if align else -1 + (2 * i + 1) / size
        return e.const(v.reshape(size, 1).astype(e.dtype(like) or np.float32))
    size = e.const(np.int64(size)) if isinstance(size, int) else size
    n = e.op("CastLike", [size, like])
    i = e.op("CastLike", [e.op("Range", [e.const(np.int64(0)), size, e.const(np.int64(1))]), like])
    one, two = e.scalar(1.0, like), e.scalar(2.0, like)
    if align:
        step = e.op("Div", [two, e.op("Max", [e.op("Sub", [n, one]), one])])
        v = e.op("Sub", [e.op("Mul", [i, step]), one])
    else:
        v = e.op("Sub", [e.op("Div", [e.op("Add", [e.op("Mul", [i, two]), one]), n]), one])
    return e.op("Unsqueeze", [v, e.ints([1])])


@vjp("AffineGrid", bounded=False, finite=False)
def affine_grid(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "AffineGrid" (opset 20): ``grid[n, s, :] = theta[n] @ [base(s), 1]`` is linear in ``theta``
    (``[N, r, r + 1]``, r = 2 or 3 spatial axes), so ``dtheta[n] = sum_s dgrid[n, s, :] [base(s), 1]^T``
    (PyTorch ``affine_grid_generator_backward``). The base coordinates are separable: column j (the
    coordinate of spatial axis r - 1 - j) is the cotangent summed over the other spatial axes times that axis'
    coordinates, and the last column the cotangent summed over all of them; no base grid is materialised.
    ``size`` is an integer input and gets no gradient."""
    e, theta, g = ctx.e, node.inputs[0], cts[0]
    align = bool(node.attrs.get("align_corners", 0))

    def dtheta() -> str:
        rank = e.need_rank(g, node, "the AffineGrid VJP")
        r = rank - 2
        dims = e.dims(g)
        spatial = list(range(1, 1 + r))
        cols = []
        for j in range(r):
            axis = 1 + (r - 1 - j)  # the spatial axis whose coordinate is grid[..., j]
            others = [a for a in spatial if a != axis]
            gs = e.op("ReduceSum", [g, e.ints(others)], keepdims=0) if others else g  # [N, S, r]
            size = dims[axis] if dims is not None and isinstance(dims[axis], int) else \
                e.op("Squeeze", [e.op("Shape", [g], start=axis, end=axis + 1)], shape=(), dtype=np.dtype(np.int64))
            coords = _base_coords(e, size, g, align)  # [S, 1]
            cols.append(e.op("MatMul", [e.op("Transpose", [gs], perm=[0, 2, 1]), coords]))  # [N, r, 1]
        cols.append(e.op("ReduceSum", [g, e.ints(spatial)], keepdims=0))
        cols[-1] = e.op("Unsqueeze", [cols[-1], e.ints([2])])
        return e.op("Concat", cols, axis=2, like=theta)

    return [dtheta, None]
