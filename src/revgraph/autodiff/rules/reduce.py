"""VJPs of reductions and scans (ONNX operator spec, "ReduceSum" ... "ReduceLogSumExp", "CumSum", "CumProd";
since opset 18 every reduction takes its axes as an optional second input, and ``noop_with_empty_axes``
decides what no axes mean).

Strong zeros (DESIGN section 5): the products of the cotangent with forward values (``2 x``, ``sign(x)``,
``x / |x|``, ``exp(x - y)``) are guarded where those values may be inf or NaN (:meth:`Val.times`), the product of
the others in ``ReduceProd`` and ``CumProd`` and ``1 / sum`` in ``ReduceLogSum`` always (they overflow or are
infinite at finite inputs); ``ReduceMax``/``ReduceMin`` select (exact 0 off the extremum, and 0 everywhere in
a group whose extremum is NaN)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo
from ..algebra import Val, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import unary


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


@unary("ReduceSum", bounded=True, finite=True, reads=())
def reduce_sum(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy`` broadcast back (ONNX "ReduceSum")."""
    return g if is_noop(ctx.e, node) else expand_back(ctx.e, node, g)


# ------------------------------------------------------------------------------------------ helpers


def keep(ctx: Ctx, node: Node, v: str | Val) -> Val:
    """A reduction result ``v`` with the reduced axes re-inserted as size 1 (when ``keepdims=0``), so that
    it broadcasts against the input; a no-op reduction's result is returned as is."""
    e, v = ctx.e, ctx.val(v) if isinstance(v, str) else v
    axes = reduced_axes(e, node)
    if is_noop(e, node) or node.attrs.get("keepdims", 1) or axes is None:
        return v
    return v.apply("Unsqueeze", axes, like=None)


def group_size(e: Emitter, node: Node) -> int | None:
    """The number of elements per reduced group of a reduction when the reduced axes are constants and their
    sizes static (1 for a no-op reduction), else ``None``."""
    dims = e.dims(node.inputs[0])
    if is_noop(e, node):
        return 1
    if dims is None:
        return None
    axes = reduced_axes(e, node)
    picked = range(len(dims)) if axes is None else e.value(axes)
    if picked is None:
        return None
    sizes = [dims[int(a)] for a in np.asarray(picked).reshape(-1)]
    return int(np.prod(sizes, dtype=np.int64)) if all(isinstance(d, int) for d in sizes) else None


def reduce_like(ctx: Ctx, node: Node, op_type: str, v: Val) -> Val:
    """``op_type`` over the same axes as ``node`` (with ``keepdims=1``), applied to ``v`` of the input's
    shape: counts and partial products per reduced group, broadcastable against the input."""
    axes = reduced_axes(ctx.e, node)
    noop = 1 if node.attrs.get("noop_with_empty_axes", 0) else None
    return v.apply(op_type, *([] if axes is None else [axes]), like=None, keepdims=1, noop_with_empty_axes=noop)


# ------------------------------------------------------------------------------------------ rules


@unary("ReduceMean", bounded=True, finite=True, reads=())
def reduce_mean(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy / n`` broadcast back, ``n`` the number of elements per group (ONNX "ReduceMean")."""
    e = ctx.e
    sx, sy, n = e.shape(x), e.shape(y), group_size(e, node)
    if n is not None:  # the reduced axes' sizes are static, also where others (the batch) are not
        count = e.scalar(float(n), g)
    elif sx is not None and sy is not None:
        count = e.scalar(float(np.prod(sx, dtype=np.int64)) / max(int(np.prod(sy, dtype=np.int64)), 1), g)
    else:  # the group size is |x| / |y| (the same with keepdims either way)
        ny = e.op("Max", [e.op("Size", [y]), e.const(np.int64(1))])
        count = ctx.val(e.op("Div", [e.op("Size", [x]), ny])).cast_like(g)
    return keep(ctx, node, ctx.val(g) / count).apply("Expand", expand_shape(e, node, n), like=x)


def expand_shape(e: Emitter, node: Node, n: int | None) -> str:
    """The shape to ``Expand`` a reduction's cotangent (reduced axes kept as 1) back to its input: a constant
    with the reduced axes' static sizes and 1 elsewhere when ``n`` (:func:`group_size`) is known, as the
    other axes broadcast from the cotangent itself (ONNX "Expand" broadcasts both ways); ``Shape(x)`` else."""
    x, dims = node.inputs[0], e.dims(node.inputs[0])
    axes = reduced_axes(e, node)
    if n is None or dims is None or is_noop(e, node):
        return e.shape_of(x)
    picked = range(len(dims)) if axes is None else [int(a) % len(dims) for a in np.asarray(e.value(axes)).reshape(-1)]
    return e.ints([dims[i] if i in picked else 1 for i in range(len(dims))])


@unary("ReduceMax", "ReduceMin", bounded=True, finite=True, reads=())
def reduce_max_min(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """The cotangent goes to the elements equal to the extremum, split equally among ties (DESIGN.md
    section 5; JAX's ``_reduce_chooser_jvp_rule`` does the same)."""
    x = ctx.val(x)
    hit = x.eq(keep(ctx, node, y))
    count = reduce_like(ctx, node, "ReduceSum", hit.cast_like(x))
    share = keep(ctx, node, g) / count.apply("Max", 1)  # no hit where y is NaN
    return share.select(hit, like=x)


@unary("ReduceProd", bounded=False, finite=False)
def reduce_prod(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx_i = dy * prod_{j != i} x_j`` (ONNX "ReduceProd"; PyTorch's ``prod_backward``), computed without
    dividing by zero. When the reduced axes and their sizes are known while the graph is built, the product of
    the others is the product of the exclusive prefix and suffix products along the reduced elements
    (:func:`_others`: products only, a polynomial in ``x``, so every derivative is exact at any number of zeros,
    issue 39). Otherwise, with ``S = where(x == 0, 1, x)`` and ``Z`` the zero elements, it is ``(prod S / S_i) *
    prod_{k in Z, k != i} x_k``; the second factor is 1 when no other element is zero, ``x_k`` (value 0,
    derivative 1) when exactly one other ``x_k`` is, and 0 otherwise: value and first derivative exact at any
    number of zeros, higher ones with at most one."""
    xv = ctx.val(x)
    others = _others(ctx, node, xv)
    if others is None:
        is_zero = xv.eq(0)
        safe = where(is_zero, 1, xv)
        zeros_only = where(is_zero, xv, 0)  # the zero elements themselves, for their derivative
        zmask = is_zero.cast_like(xv)
        others_safe = reduce_like(ctx, node, "ReduceProd", safe) / safe
        other_zeros = reduce_like(ctx, node, "ReduceSum", zmask) - zmask
        lone_zero = reduce_like(ctx, node, "ReduceSum", zeros_only) - zeros_only
        others = others_safe * where(other_zeros.eq(0), 1, where(other_zeros.eq(1), lone_zero, 0))
    return keep(ctx, node, g).times(others, like=x)  # the product of the others may overflow


def _others(ctx: Ctx, node: Node, x: Val) -> Val | None:
    """``prod_{j != i} x_j`` over each reduced group, as ``prefix_i * suffix_i`` (the exclusive products before
    and after element i in the group's row-major order), by ``ceil(log2 n)`` doubling steps each (Hillis and
    Steele's scan, as :func:`_affine_scan`); the reduced axes are moved last and flattened into one. ``None``
    when the axes or the input's shape are not known while the graph is built."""
    e = ctx.e
    shape, axes = e.shape(x.name), reduced_axes(e, node)
    av = None if axes is None else e.value(axes)
    if shape is None or (axes is not None and av is None) or is_noop(e, node):
        return None
    r = len(shape)
    red = sorted({int(a) % r for a in np.asarray(av).reshape(-1)}) if av is not None else list(range(r))
    kept = [a for a in range(r) if a not in red]
    perm = kept + red
    n = int(np.prod([shape[a] for a in red], dtype=np.int64))
    if r == 0 or n == 0:
        return None
    flat = (*[shape[a] for a in kept], n)
    v = x if perm == list(range(r)) else x.transpose(perm)
    v = v.reshape(list(flat))
    axis, rank = len(flat) - 1, len(flat)

    def scan(later: bool) -> Val:  # exclusive products from the front (later=False) or the back
        acc = ctx.val(_shift(e, v.name, 1, axis, rank, later, 1.0))
        d = 1
        while d < n:
            acc = acc * ctx.val(_shift(e, acc.name, d, axis, rank, later, 1.0))
            d *= 2
        return acc

    others = (scan(False) * scan(True)).reshape([shape[a] for a in perm])
    return others if perm == list(range(r)) else others.transpose([perm.index(a) for a in range(r)])


@unary("ReduceSumSquare", bounded=True, finite=True, reads="all")
def reduce_sum_square(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = 2 x dy`` (ONNX "ReduceSumSquare")."""
    return (keep(ctx, node, g) * 2).times(x, [x], like=x)


@unary("ReduceL2", bounded=False, finite=False)
def reduce_l2(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy * x / ||x||`` (ONNX "ReduceL2"; PyTorch's ``norm_backward``), with the 0 subgradient where
    the norm is 0 (there every x is 0, so dividing by 1 instead gives exactly 0)."""
    yk = keep(ctx, node, y)
    return keep(ctx, node, g).times(ctx.val(x) / where(yk.eq(0), 1, yk), [x], like=x)


@unary("ReduceL1", bounded=True, finite=True, reads="all")
def reduce_l1(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy * sign(x)`` (ONNX "ReduceL1"), the 0 subgradient at 0."""
    return keep(ctx, node, g).times(ctx.val(x).sign(), [x], like=x)


@unary("ReduceLogSumExp", bounded=True, finite=True, reads="all")
def reduce_log_sum_exp(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``dx = dy * softmax(x) = dy * exp(x - y)`` (ONNX "ReduceLogSumExp"; JAX's ``logsumexp`` derivative).
    ``x - y <= 0`` since ``y >= max x``: the max-subtracted softmax, which cannot overflow. A group that is all
    ``-inf`` (``y = -inf``, where ``x - y`` is NaN) gets 0 (issue 27: a fully masked row, as Softmax's), tested
    only where ``x`` may be non-finite."""
    x = ctx.val(x)
    p = (x - keep(ctx, node, y)).exp()
    masked = None
    if ctx.nonfinite(x.name):  # from x's maximum, not y: runtimes differ on y there (onnx's reference: NaN)
        masked = reduce_like(ctx, node, "ReduceMax", x).eq(-np.inf)
        p = where(masked, 0, p, like=x)
    dx = keep(ctx, node, g).times(p, [x], like=x)
    if masked is None or ctx.finite:  # (finite: 0 x finite is 0 already)
        return dx
    return dx.select(~masked, like=x)


@unary("CumSum", bounded=True, finite=True, reads=())
def cumsum(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """The transpose of a prefix sum is the suffix sum in the other direction, with the same exclusivity
    (ONNX "CumSum"; JAX's ``cumsum`` transpose rule)."""
    exclusive = 1 if node.attrs.get("exclusive", 0) else None
    reverse = None if node.attrs.get("reverse", 0) else 1
    return ctx.val(g).apply("CumSum", node.inputs[1], exclusive=exclusive, reverse=reverse, like=x)


@unary("ReduceLogSum", bounded=False, finite=False)
def reduce_log_sum(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """``y = log(sum(x))``, so ``dx = dy / sum(x)`` broadcast back (ONNX "ReduceLogSum"; the sum is recomputed
    with the node's axes, ``keepdims=1``: one rounding, where ``exp(-y)`` would carry the logarithm's). A no-op
    reduction (``noop_with_empty_axes=1`` and no axes) is ``log(x)``: ``dx = dy / x``. ``1 / sum`` is infinite
    where the sum is 0: always strong (a zero cotangent gives 0)."""
    total = reduce_like(ctx, node, "ReduceSum", ctx.val(x))  # x itself for a no-op reduction
    share = keep(ctx, node, g).times(total.reciprocal(), like=None)
    return share.apply("Expand", ctx.e.shape_of(x), like=x)


# ------------------------------------------------------------------------------------------ CumProd

INT64_MAX = np.iinfo(np.int64).max


def _shift(e: Emitter, v: str, d, axis: int, rank: int, later: bool, fill: float) -> str:
    """``v`` moved ``d`` places along ``axis``: ``out[i] = v[i + d]`` (``later``) or ``v[i - d]``, ``fill``
    where that is outside; ``d`` is an int (``d <= n``) or an int64 ``[1]`` value (``d < n``). A ``Slice`` and a
    ``Pad`` over every axis (no ``axes`` input: onnxruntime's transpose optimizer mishandles that, issue 15)."""
    static = isinstance(d, int)
    if later:
        part = e.op("Slice", [v, e.ints([d]) if static else d, e.ints([INT64_MAX]), e.ints([axis])])
    else:
        end = e.ints([-d]) if static else e.op("Neg", [d])
        part = e.op("Slice", [v, e.ints([0]), end, e.ints([axis])])
    where = rank + axis if later else axis
    if static:
        pads = e.ints([d if i == where else 0 for i in range(2 * rank)])
    else:
        pads = e.op("Mul", [e.ints([int(i == where) for i in range(2 * rank)]), d])
    return e.op("Pad", [part, pads, e.scalar(fill, v)], mode="constant", like=v)


def _scan_step(ctx: Ctx, a: str, b: str, d, axis: int, rank: int, later: bool, last: bool) -> tuple[str, str | None]:
    """One doubling step of the affine scan ``R[i] = b[i] + a[i] R[i + 1]`` (``later``; ``R[i - 1]`` otherwise;
    0 past the end): ``(a, b)`` holds ``R[i] = b[i] + a[i] R[i + d]``, and composing it with the element ``d``
    places on gives the same with ``2 d`` (Hillis and Steele's doubling, "Data parallel algorithms", CACM 1986;
    Blelloch's first-order recurrences). ``b`` gathers cotangents: its products are strong (a partial product
    may overflow; the plain product without ``Options.strong_zeros``, so that forward mode, which transposes
    this VJP, meets a map linear in ``g``). ``ctx.e`` may be a loop body's emitter."""
    e, (av, bv) = ctx.e, ctx.vals(a, b)
    b2 = bv + ctx.val(_shift(e, b, d, axis, rank, later, 0.0)).times(av, None, zero=False)
    a2 = None if last else av * _shift(e, a, d, axis, rank, later, 0.0)
    return b2.name, None if a2 is None else a2.name


def _affine_scan(ctx: Ctx, a: str, b: str, axis: int, rank: int, later: bool, n: int | None, x: str) -> str:
    """``R`` with ``R[i] = b[i] + a[i] R[next(i)]`` along ``axis`` (``next(i) = i + 1`` when ``later``, else
    ``i - 1``; ``R`` past the end is 0), by ``ceil(log2 n)`` doubling steps: unrolled for a static length ``n``,
    a ``Loop`` that doubles ``d`` while ``d < n`` otherwise. Only products and sums: exact at zeros."""
    e = ctx.e
    if n is not None:
        steps = []
        d = 1
        while d < n:
            steps.append(d)
            d *= 2
        for k, d in enumerate(steps):
            b, a = _scan_step(ctx, a, b, d, axis, rank, later, k == len(steps) - 1)
        return b
    i64 = np.dtype(np.int64)
    length = e.op("Gather", [e.op("Shape", [x]), e.ints([axis])], axis=0, shape=(1,), dtype=i64)
    one = e.ints([1])
    base = e.fresh("CumProd/scan")  # the doubling loop's names
    eb = e.child(e.types, base)
    it, cond = eb.fresh(f"{base}/i"), eb.fresh(f"{base}/cond")
    dims, dt = e.dims(x), e.dtype(x)
    ins = [ValueInfo(eb.fresh(f"{base}/{k}"), t, s) for k, t, s in
           (("a", dt, dims), ("b", dt, dims), ("d", i64, (1,)))]
    for v in ins:
        eb.types[v.name] = v
    a_in, b_in, d_in = (v.name for v in ins)
    b_out, a_out = _scan_step(dataclasses.replace(ctx, e=eb), a_in, b_in, d_in, axis, rank, later, False)
    d_out = eb.op("Mul", [d_in, eb.ints([2])], shape=(1,), dtype=i64)
    more = eb.op("Less", [d_out, length], shape=(1,), dtype=np.dtype(bool))
    more = eb.op("Squeeze", [more, eb.ints([0])], shape=(), dtype=np.dtype(bool))
    outs = [ValueInfo(more, np.dtype(bool), ()), ValueInfo(a_out, dt, dims), ValueInfo(b_out, dt, dims),
            ValueInfo(d_out, i64, (1,))]
    body = Graph(eb.nodes, [ValueInfo(it, i64, ()), ValueInfo(cond, np.dtype(bool), ()), *ins], outs,
                 name=eb.fresh(f"{base}/body").replace("/", "_"))
    start = e.op("Squeeze", [e.op("Less", [one, length]), e.ints([0])], shape=(), dtype=np.dtype(bool))
    _, r, _ = e.op("Loop", ["", start, a, b, one], n_out=3, shape=dims, dtype=dt, body=body)
    e.types[r] = ValueInfo(r, dt, dims)
    return r


@unary("CumProd", bounded=False, finite=False)
def cumprod(ctx: Ctx, node: Node, x: str, y: str, g: str) -> str:
    """ONNX "CumProd" (opset 26), without dividing by ``x`` (exact at any number of zeros). For the forward
    direction, with ``E[i] = prod_{k<i} x_k`` (the exclusive products, from ``y``):

    - inclusive, ``y_j = prod_{k<=j} x_k``: ``dx_i = sum_{j>=i} dy_j prod_{k<=j, k!=i} x_k = E_i S_i`` with
      ``S_i = sum_{j>=i} dy_j prod_{i<k<=j} x_k``, that is ``S_i = dy_i + x_{i+1} S_{i+1}``;
    - exclusive, ``y_j = prod_{k<j} x_k`` (``E = y``): ``dx_i = E_i U_{i+1}`` with ``U_i = dy_i + x_i U_{i+1}``.

    These first-order linear recurrences run backwards along the axis as an associative scan of affine maps
    (:func:`_affine_scan`, ``ceil(log2 n)`` steps of products and sums), as JAX differentiates ``cumprod``
    through its associative scan, where PyTorch's ``cumprod_backward`` divides by ``x`` when it has no zero
    and special-cases the first zero otherwise. ``reverse=1`` mirrors the axis. The products of the cotangent
    with partial products are strong (they overflow): a zero cotangent gives exactly 0. Cost ``O(n log n)``
    elementwise work per line; the axis (an input) must be a constant."""
    e = ctx.e
    av = ctx.value(node.inputs[1])
    if av is None:
        raise GraphError(f"{node.label()}: the CumProd VJP needs a constant axis input")
    rank = e.need_rank(x, node)
    axis = int(np.asarray(av).reshape(-1)[0])
    if not -rank <= axis < rank:
        raise GraphError(f"{node.label()}: axis {axis} is out of range for rank {rank}")
    axis %= rank
    dims = e.dims(x)
    n = dims[axis] if isinstance(dims[axis], int) else None
    if n == 0:
        return e.zeros_like(x)
    later = not node.attrs.get("reverse", 0)  # the recurrences run against the direction of the products
    if node.attrs.get("exclusive", 0):
        u = _affine_scan(ctx, x, g, axis, rank, later, n, x)
        return ctx.val(_shift(e, u, 1, axis, rank, later, 0.0)).times(y, like=x)
    a = _shift(e, x, 1, axis, rank, later, 0.0)
    s = _affine_scan(ctx, a, g, axis, rank, later, n, x)
    return ctx.val(s).times(_shift(e, y, 1, axis, rank, not later, 1.0), like=x)
