"""VJP of resizing (ONNX operator spec, "Resize": modes nearest, linear and cubic, with or without antialias,
every ``coordinate_transformation_mode``; the interpolation weights as the spec and the ONNX reference
evaluator compute them; derivatives as in PyTorch's ``tools/autograd/derivatives.yaml``: ``upsample_*_backward``,
and the roi of tf_crop_and_resize differentiated as TensorFlow's ``crop_and_resize`` differentiates its boxes).

Resize is separable and linear in its input, so its VJP is the adjoint: one ``MatMul`` with the transposed
interpolation matrix per resized axis, a constant when the sizes, scales and roi are known when the gradient
is built (:func:`resize_matrix`), computed by nodes otherwise (:func:`resize_matrix_graph`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ._common import F64, Dim, EmitterContext, as1, dim_of, i64, int_range
from .conv import shape_cat
from .tables import small


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


def _aa_count(scale: float, mode: str) -> int:
    """The number of antialiasing taps, ``len(_aa_offsets(scale, mode))``, without making them (``1/scale`` of
    them: a downscale by 1e-7 has 2e7)."""
    return 2 - 2 * (math.floor(-(1 if mode == "linear" else 2) / min(scale, 1.0)) + 1)


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
    return e.op("Cast", [e.op("Gather", [values, e.const(np.int64(i))], axis=0)], to=F64)


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

    n_in = [static(xd, a) if static(xd, a) is not None else dim_of(e, x, a) for a in axes]
    n_out = [next((v for v in (static(yd, a), static(gd, a)) if v is not None), None) for a in axes]
    n_out = [v if v is not None else dim_of(e, g, a) for v, a in zip(n_out, axes, strict=True)]
    if use_scales:
        known = e.value(scales_in)
        scales = [_entry(e, scales_in, known, i) for i in range(len(axes))]
    elif (node.attrs.get("keep_aspect_ratio_policy", "stretch") or "stretch") == "stretch":
        scales = [o / n if isinstance(o, int) and isinstance(n, int) else
                  e.op("Div", [e.op("Cast", [i64(e, o)], to=F64), e.op("Cast", [i64(e, n)], to=F64)])
                  for o, n in zip(n_out, n_in, strict=True)]
    else:
        smaller = node.attrs["keep_aspect_ratio_policy"] == "not_larger"
        known = e.value(sizes_in)
        if known is not None and all(isinstance(n, int) for n in n_in):
            ratios = [float(s) / n for s, n in zip(np.asarray(known).reshape(-1), n_in, strict=True)]
            common: float | str = min(ratios) if smaller else max(ratios)
        else:
            lengths = e.op("Concat", [e.op("Unsqueeze", [i64(e, n), e.ints([0])]) for n in n_in], axis=0)
            ratios = e.op("Div", [e.op("Cast", [sizes_in], to=F64), e.op("Cast", [lengths], to=F64)])
            common = e.op("ReduceMin" if smaller else "ReduceMax", [ratios], keepdims=0)
        scales = [common] * len(axes)
    rois: list[tuple | None] = [None] * len(axes)
    if (node.attrs.get("coordinate_transformation_mode", "") or "") == "tf_crop_and_resize":
        if roi_in is None:
            raise GraphError(f"{node.label()}: coordinate_transformation_mode=tf_crop_and_resize without a roi")
        known = e.value(roi_in)
        rois = [(_entry(e, roi_in, known, i), _entry(e, roi_in, known, len(axes) + i)) for i in range(len(axes))]
    return [ResizeAxis(*t) for t in zip(axes, n_in, n_out, scales, rois, strict=True)]


@dataclass(frozen=True)
class _Taps:
    """The interpolation along one axis as nodes (float64): ``src`` [n_out] the source coordinates, ``index``
    [n_out, n] int64 the (clamped) taps, ``coeffs`` [n_out, n] their weights, ``slope`` [n_out, n] the weights'
    derivatives with respect to the source coordinate (only when asked for), ``n_in`` the input size."""

    src: Val
    index: Val
    coeffs: Val
    slope: Val | None
    n_in: Dim


def _resize_taps(e: Emitter, attrs: dict, ax: ResizeAxis, slope: bool = False) -> _Taps:
    """The taps and weights of :func:`resize_matrix` as nodes (sizes, scales or roi may be values computed at
    run time), and with ``slope`` their derivatives with respect to the source coordinate: ``d/dr`` of the
    mode's weights at fraction ``r``, through the antialiasing and exclude_outside normalisations (0 for
    nearest, whose weights are piecewise constant). Computed in float64: the numbers in the formulas are
    float64 constants (the algebra's scalars take the value's dtype)."""
    b = EmitterContext(e)
    num = lambda v: b.val(v) if isinstance(v, str) else float(v)
    mode = attrs.get("mode", "nearest") or "nearest"
    ctm = attrs.get("coordinate_transformation_mode", "half_pixel") or "half_pixel"
    n_in, n_out = b.val(i64(e, ax.n_in)), b.val(i64(e, ax.n_out))
    fin, fout = n_in.cast(np.float64), n_out.cast(np.float64)
    scale = num(ax.scale)
    o = b.val(int_range(e, ax.n_out, np.float64))
    several = b.val(e.const(np.bool_(ax.n_out > 1))) if isinstance(ax.n_out, int) else n_out.gt(1)

    def half_pixel() -> Val:
        return (o + 0.5) / scale - 0.5

    if ctm == "half_pixel":
        src = half_pixel()
    elif ctm == "pytorch_half_pixel":
        src = where(several, half_pixel(), 0.0)
    elif ctm == "half_pixel_symmetric":
        src = fin / 2.0 * (1.0 - fout / (scale * fin)) + half_pixel()
    elif ctm == "align_corners":
        src = where(several, o * (fin - 1.0) / (fout - 1.0).apply("Max", 1.0), 0.0)
    elif ctm == "asymmetric":
        src = o / scale
    elif ctm == "tf_crop_and_resize":
        start, end = (num(v) for v in ax.roi)
        span = fin - 1.0
        many = start * span + o * (end - start) * span / (fout - 1.0).apply("Max", 1.0)
        one = 0.5 * (start + end) * span
        src = where(several, many, one.expand(e.op("Shape", [o.name])))
    else:
        raise GraphError(f"no VJP for Resize with coordinate_transformation_mode={ctm!r}")
    base = src.apply("Floor")
    frac = src - base
    exact = frac.eq(0.0)
    base = where(exact, base - 1.0, base)
    r = where(exact, 1.0, frac).unsqueeze([1])  # [n_out, 1]
    a = float(attrs.get("cubic_coeff_a", -0.75))

    def keys(t: Val) -> Val:  # Keys' cubic kernel, t >= 0
        near = (((a + 2) * t - (a + 3)) * t) * t + 1.0
        far = (((a * t - 5 * a) * t) + 8 * a) * t - 4 * a
        return where(t.le(1.0), near, where(t.lt(2.0), far, 0.0))

    def keys_slope(t: Val) -> Val:  # d keys / d t, t >= 0
        near = (3 * (a + 2) * t - 2 * (a + 3)) * t
        far = (3 * a * t - 10 * a) * t + 8 * a
        return where(t.le(1.0), near, where(t.lt(2.0), far, 0.0))

    dcoeffs = None
    if mode == "nearest":
        how = attrs.get("nearest_mode", "round_prefer_floor") or "round_prefer_floor"
        if how in ("floor", "ceil"):
            up = exact.unsqueeze([1]) if how == "floor" else r.lt(2.0)
        else:
            up = (r.gt(0.5) if how == "round_prefer_floor" else r.ge(0.5)) | exact.unsqueeze([1])
        coeffs = up.cast(np.int64).eq(np.array([[0, 1]], np.int64)).cast(np.float64)
        offsets = b.val(e.const(np.array([0.0, 1.0])))
        if slope:
            dcoeffs = coeffs * 0.0
    elif _antialiased(attrs):
        support = 1.0 if mode == "linear" else 2.0
        if isinstance(ax.scale, str) or not small([_aa_count(ax.scale, mode)]):
            shrink = scale.apply("Min", 1.0) if isinstance(scale, Val) else b.val(e.const(np.float64(scale))).apply(
                "Min", 1.0)
            start = (-support / shrink).apply("Floor") + 1.0
            count = (2.0 - 2.0 * start).cast(np.int64)
            offsets = start + b.val(int_range(e, count.name)).cast(np.float64)
        else:
            shrink = b.val(e.const(np.float64(min(ax.scale, 1.0))))
            offsets = b.val(e.const(_aa_offsets(ax.scale, mode)))
        args = (offsets.unsqueeze([0]) - r) * shrink
        t = args.abs()
        raw = (1.0 - t).apply("Max", 0.0) if mode == "linear" else keys(t)
        total = raw.sum([1])
        coeffs = raw / total
        if slope:  # d raw / d r = f'(|args|) sign(args) (-shrink); then the quotient rule
            fslope = -t.lt(1.0).cast(np.float64) if mode == "linear" else keys_slope(t)
            draw = fslope * args.sign() * -shrink
            dcoeffs = (draw - coeffs * draw.sum([1])) / total
    elif mode == "linear":
        offsets = b.val(e.const(np.array([0.0, 1.0])))
        coeffs = b.val(e.op("Concat", [(1.0 - r).name, r.name], axis=1))
        if slope:
            dcoeffs = b.val(e.const(np.array([[-1.0, 1.0]]))).expand(e.op("Shape", [coeffs.name]))
    else:
        offsets = b.val(e.const(np.array([-1.0, 0.0, 1.0, 2.0])))
        diff = offsets.unsqueeze([0]) - r
        coeffs = keys(diff.abs())
        if slope:
            dcoeffs = keys_slope(diff.abs()) * -diff.sign()
    taps = base.unsqueeze([1]) + offsets.unsqueeze([0])
    last = fin - 1.0
    if attrs.get("exclude_outside", 0):
        inside = (~(taps.lt(0.0) | taps.gt(last))).cast(np.float64)
        kept = coeffs * inside
        total = kept.sum([1])
        total = where(total.eq(0.0), 1.0, total)
        coeffs = kept / total
        if dcoeffs is not None:
            dkept = dcoeffs * inside
            dcoeffs = (dkept - coeffs * dkept.sum([1])) / total
    if ctm == "tf_crop_and_resize":
        away = (src.lt(0.0) | src.gt(last)).unsqueeze([1])
        coeffs = where(away, 0.0, coeffs)
        if dcoeffs is not None:
            dcoeffs = where(away, 0.0, dcoeffs)
    index = taps.cast(np.int64).apply("Clip", e.const(np.int64(0)), n_in - 1)
    return _Taps(src, index, coeffs, dcoeffs, ax.n_in)


def _taps_matrix(taps: _Taps, weights: Val) -> Val:
    """``M[o, i] = sum_t weights[o, t] [index(o, t) == i]`` (float64 [n_out, n_in]): a one-hot product."""
    hot = taps.index.unsqueeze([2]).eq(int_range(weights.ctx.e, taps.n_in)).cast(np.float64)
    return (hot * weights.unsqueeze([2])).sum([1], keepdims=0)


def resize_matrix_graph(e: Emitter, attrs: dict, ax: ResizeAxis, like: str) -> str:
    """:func:`resize_matrix` as nodes, for sizes, scales or rois known only at run time: the source coordinate
    of each output (``Range``), its taps and weights, and ``A[o, i] = sum_t w[o, t] [tap(o, t) == i]`` (a
    one-hot product, ``n_out x taps x n_in``), computed in float64 and cast to ``like``'s dtype."""
    taps = _resize_taps(e, attrs, ax)
    return _taps_matrix(taps, taps.coeffs).cast_like(like).name


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


def _interpolation_matrix(e: Emitter, attrs: dict, ax: ResizeAxis, x: str) -> str:
    """``A`` of the resized axis ``ax`` in ``x``'s dtype: a constant (:func:`resize_matrix`) when its sizes, scale
    and roi are static and it is small (:mod:`.tables`), else nodes (:func:`resize_matrix_graph`): a 200-byte
    model resizing by 1e7 must not make the build allocate (and the graph hold) a 2e7 x 2 matrix."""
    taps = _aa_count(ax.scale, "cubic") if ax.static and _antialiased(attrs) and ax.scale > 0 else 4
    if ax.static and small([ax.n_out, ax.n_in]) and small([ax.n_out, taps]):
        dt = e.dtype(x)
        a = resize_matrix(ax.n_in, ax.n_out, ax.scale, attrs, ax.roi)
        return e.const(a.astype(dt)) if dt is not None else e.op("CastLike", [e.const(a.astype(np.float32)), x])
    return resize_matrix_graph(e, attrs, ax, x)


def _resize_plan(e: Emitter, node: Node, g: str) -> tuple[int, list[tuple[ResizeAxis, str]]]:
    """The rank of ``x`` and, for every resized axis that is not statically the identity, the axis and its
    interpolation matrix."""
    x = node.inputs[0]
    r = e.need_rank(x, node)
    steps = [(ax, _interpolation_matrix(e, node.attrs, ax, x))
             for ax in _resize_axes(e, node, x, node.outputs[0], g) if not ax.identity(node.attrs)]
    return r, steps


def _map_back(e: Emitter, g: str, steps: list[tuple[ResizeAxis, str]], r: int, skip: int) -> str:
    """``dy`` mapped back through the interpolation matrix of every resized axis but ``steps[skip]``'s."""
    back = g
    for j, (other, m) in enumerate(steps):
        if j != skip:
            back = _apply(e, back, other.axis, m, r)
    return back


def _source_grad(e: Emitter, attrs: dict, ax: ResizeAxis, back: str, x: str, r: int) -> str:
    """``dL/dsrc_o`` (float64 [n_out]) along the resized axis ``ax``: ``dL/dA`` (the contraction of ``back``, the
    cotangent mapped back through the other axes, with ``x``) times ``dA/dsrc`` (the derivatives of the mode's
    weights), summed over the input positions."""
    rows = e.op("Reshape", [_move_last(e, back, ax.axis, r), shape_cat(e, [[-1], as1(e, ax.n_out)])])
    cols = e.op("Reshape", [_move_last(e, x, ax.axis, r), shape_cat(e, [[-1], as1(e, ax.n_in)])])
    grad_a = EmitterContext(e).val(e.op("Cast", [e.op("MatMul", [e.op("Transpose", [rows], perm=[1, 0]), cols])],
                                         to=F64))
    taps = _resize_taps(e, attrs, ax, slope=True)
    return (grad_a * _taps_matrix(taps, taps.slope)).sum([1], keepdims=0).name


def _crop_grads(e: Emitter, ax: ResizeAxis, per_out: str) -> tuple[str, str]:
    """The gradients (float64 [1]) of the roi's start and end along ``ax`` from ``per_out``, ``dL/dsrc_o``:
    tf_crop_and_resize's ``src_o = start (n - 1) + o (end - start) (n - 1) / (n_out - 1)``, or ``(start + end)
    (n - 1) / 2`` for a single output."""
    b = EmitterContext(e)
    n_in, n_out = (b.val(i64(e, n)).cast(np.float64) for n in (ax.n_in, ax.n_out))
    span = n_in - 1.0
    o = b.val(int_range(e, ax.n_out, np.float64))
    several = b.val(i64(e, ax.n_out)).gt(1)
    at_end = where(several, o / (n_out - 1.0).apply("Max", 1.0), 0.5)  # d src_o / d end, over n - 1
    at_start = where(several, 1.0 - at_end, 0.5)
    start, end = ((b.val(per_out) * (share * span)).sum().name for share in (at_start, at_end))
    return start, end


@vjp("Resize", bounded=True, finite=True, reads="all")
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
        return _resize_plan(e, node, g)

    def dx() -> str:
        r, steps = plan()
        out = g
        for i, (ax, m) in enumerate(steps):
            out = _apply(e, out, ax.axis, m, r, like=x if i == len(steps) - 1 else None)
        return out if steps else e.op("Identity", [g], like=x)

    def droi() -> str:
        r, steps = plan()
        roi = node.inputs[1]
        starts, ends = [], []
        for k, (ax, _) in enumerate(steps):
            per_out = _source_grad(e, node.attrs, ax, _map_back(e, g, steps, r, k), x, r)  # dL/dsrc_o
            start, end = _crop_grads(e, ax, per_out)
            starts.append(start)
            ends.append(end)
        return e.op("CastLike", [e.op("Concat", [*starts, *ends], axis=0), roi], like=roi)

    grads: list = [dx]
    if len(node.inputs) > 1:
        grads.append(droi if ctm == "tf_crop_and_resize" and node.inputs[1] else None)
    return grads + [None] * (len(node.inputs) - len(grads))
