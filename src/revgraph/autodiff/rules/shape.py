"""VJPs of shape-manipulating operators (ONNX operator spec, "Reshape" ... "Pad", "CenterCropPad"; opsets 21 and
newer).

Every one of them is linear in the tensor it moves, so its VJP is the adjoint data movement: each cotangent
element goes back to where its output element came from, and elements that came from the same place add up
(``Expand``, ``Tile``, ``Pad`` in reflect/edge/wrap mode). These are the transposes JAX uses for
``lax.reshape``, ``lax.transpose``, ``lax.slice`` / ``lax.pad`` (``jax/_src/lax/slicing.py``, ``lax.py``),
and PyTorch's ``derivatives.yaml`` entries for ``view``, ``permute``, ``slice``, ``repeat``,
``constant_pad_nd``, ``reflection_pad*``, ``replication_pad*`` and ``circular_pad*``.

Integer inputs (shapes, axes, pads, starts, repeats) get no gradient. ``Range``, which makes a tensor rather
than moving one, is here too: its output is affine in ``start`` and ``delta``. Backward nodes are chosen from
this family, elementwise and reduce ops so that gradients of gradients need no other family; only ``Pad`` with
non-constant pads or dimensions in reflect/edge/wrap mode scatters with ``ScatterElements``.

Sizes, offsets and strides are int-or-name (:data:`Dyn`): Python ints folded while the graph is built
(:func:`_arith`), values only where they are unknown, so that a static slice emits no index arithmetic: they
and the other shape and index values (Concat of shape parts, index lines) are
:meth:`~revgraph.autodiff.emitter.Emitter.op` calls, the shape plumbing of DESIGN.md's rules. The cotangents'
movement (Slice, Pad, Reshape, sums), the index formulas computed at run time (the masked Slice parameters,
Pad's cut borders) and the cotangent arithmetic are written in the algebra; helpers called with an emitter
build their values through :class:`._common.EmitterContext`.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ...ir.fastshape import slice_indices
from ..algebra import Val, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import not_differentiable, vjp
from ._common import I64, EmitterContext, optional_input, static_dim
from .tables import small

INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)

# An "int or name": a Python int when the value is known while the graph is built, else the name of a 1-D
# int64 value of length 1. The helpers below fold ints and emit ops only for unknown values.
Dyn = int | str


def _t(e: Emitter, v: Dyn) -> str:
    return e.ints([int(v)]) if isinstance(v, (int, np.integer)) else v


def _arith(e: Emitter, op: str, a: Dyn, b: Dyn) -> Dyn:
    """``a op b`` of two int-or-names: a Python int when both are known (no node), else one node."""
    if isinstance(a, int) and isinstance(b, int):
        return {"Add": a + b, "Sub": a - b, "Mul": a * b, "Max": max(a, b)}[op]
    return e.op(op, [_t(e, a), _t(e, b)])


def _const_ints(e: Emitter, name: str | None) -> list[int] | None:
    v = e.value(name) if name else None
    return None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]


def _as_int64(e: Emitter, name: str) -> str:
    """Slice indices may be int32; the backward mixes them with int64 constants."""
    dt = e.dtype(name)
    return name if dt == np.int64 else e.op("Cast", [name], to=I64)


def _norm_axis(e: Emitter, axis: int, value: str) -> int:
    """``axis`` made non-negative when the rank of ``value`` is known (else left negative)."""
    r = e.rank(value)
    return axis + r if axis < 0 and r is not None else axis


def _extent(e: Emitter, x: str, axis: int) -> Dyn:
    """The size of ``x`` along ``axis`` (which may be negative) as an int-or-name: :func:`._common.static_dim`
    when static, else a ``Shape`` slice of length 1 (where :func:`._common.dim` gives a 0-d value)."""
    n = static_dim(e, x, axis)
    if n is not None:
        return n
    attrs = {"start": axis} if axis == -1 else {"start": axis, "end": axis + 1}
    return e.op("Shape", [x], shape=(1,), dtype=np.int64, **attrs)


def _reshape_to(e: Emitter, g: str, x: str) -> str:
    """``g`` reshaped to the shape of ``x``; ``allowzero`` because that shape may hold real zero dims."""
    sg, sx = e.shape(g), e.shape(x)
    if sg is not None and sg == sx:
        return g
    dx = e.dims(x)
    if dx is not None and sum(not isinstance(d, int) for d in dx) == 1 and all(d != 0 for d in dx):
        # one symbolic dimension (the batch) and no empty static one: -1 recovers it from g's element count,
        # which is x's, so no Shape of x is read at run time
        return EmitterContext(e).val(g).reshape([d if isinstance(d, int) else -1 for d in dx], like=x).name
    return EmitterContext(e).val(g).apply("Reshape", e.shape_of(x), like=x, allowzero=1).name


def _reverse(e: Emitter, g: str, axis: int) -> str:
    return EmitterContext(e).val(g).apply("Slice", e.ints([-1]), e.ints([INT64_MIN]), e.ints([axis]), e.ints([-1])).name


def _pad_axis(e: Emitter, g: str, axis: int, before: Dyn, after: Dyn, like: str | None = None) -> str:
    """Zeros added along one axis (a no-op when both amounts are known zeros), written as a ``Pad`` over every
    axis, without the ``axes`` input (onnxruntime's transpose optimizer mishandles a Pad with ``axes``; the
    emitter rewrites any other Pad the same way, :meth:`Emitter.op`)."""
    if isinstance(before, int) and isinstance(after, int) and before == 0 and after == 0:
        return g
    r = e.rank(g)
    if r is None:  # the emitter turns the axes into full pads in the graph
        pads = e.op("Concat", [_t(e, before), _t(e, after)], axis=0)
        return EmitterContext(e).val(g).apply("Pad", pads, "", e.ints([axis]), like=like).name
    a = axis % r
    if isinstance(before, int) and isinstance(after, int):
        pads = e.ints([before if i == a else 0 for i in range(r)] + [after if i == a else 0 for i in range(r)])
    else:
        parts = []
        for amount in (before, after):
            parts += [e.ints([0] * a)] if a else []
            parts.append(_t(e, amount))
            parts += [e.ints([0] * (r - a - 1))] if r - a - 1 else []
        pads = e.op("Concat", parts, axis=0, shape=(2 * r,), dtype=np.dtype(np.int64))
    return EmitterContext(e).val(g).apply("Pad", pads, like=like).name


# ------------------------------------------------------------------------------------------ reshapes


@vjp("Reshape", "Flatten", "Squeeze", "Unsqueeze", bounded=True, finite=True, reads=(), moves=True)
def reshape(ctx: Ctx, node: Node, cts: list) -> list:
    """The cotangent reshaped back to ``Shape(x)``: the elements keep their row-major order (ONNX Reshape,
    Flatten, Squeeze, Unsqueeze; JAX's ``_reshape_transpose_rule``)."""
    return [lambda: _reshape_to(ctx.e, cts[0], node.inputs[0]), *[None] * (len(node.inputs) - 1)]


@vjp("Transpose", bounded=True, finite=True, reads=(), moves=True)
def transpose(ctx: Ctx, node: Node, cts: list) -> list:
    """Transpose by the inverse permutation; the default perm reverses the axes and is its own inverse
    (JAX's ``_transpose_transpose_rule``)."""
    x, g = node.inputs[0], ctx.val(cts[0])
    perm = node.attrs.get("perm")
    if perm is None:
        return [g.apply("Transpose", like=x)]
    perm = [int(p) + len(perm) if int(p) < 0 else int(p) for p in perm]
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [g.apply("Transpose", like=x, perm=inverse)]


@vjp("Expand", bounded=True, finite=True, reads=())
def expand(ctx: Ctx, node: Node, cts: list) -> list:
    """Expand broadcasts ``x`` (onnx/docs/Broadcasting.md); the adjoint sums the cotangent over the broadcast
    axes (PyTorch's ``expand`` backward, ``sum_to_size``)."""
    return [lambda: ctx.e.reduce_to(cts[0], node.inputs[0]), None]


@vjp("Trilu", bounded=False, finite=False)
def trilu(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Trilu" keeps the upper (``upper=1``) or lower triangle of the last two axes, from diagonal ``k``: a
    fixed mask, so the VJP keeps the same triangle of the cotangent (PyTorch's ``triu``/``tril`` backward).
    The discarded entries are written as zeros, exact also for an inf or NaN cotangent; ``k`` gets none."""
    x = node.inputs[0]
    return [lambda: ctx.val(cts[0]).apply("Trilu", *node.inputs[1:], like=x, upper=node.attrs.get("upper")),
            *[None] * (len(node.inputs) - 1)]


# ------------------------------------------------------------------------------------------ concat / split


@vjp("Concat", bounded=True, finite=True, reads=(), moves=True)
def concat(ctx: Ctx, node: Node, cts: list) -> list:
    """Input i gets the slice of the cotangent at its offset along ``axis`` (the sizes of the inputs
    before it), with static offsets when the sizes are known and ``Shape``-based ones otherwise (JAX's
    ``_concatenate_transpose_rule``)."""
    e, g = ctx.e, cts[0]
    axis = _norm_axis(e, int(node.attrs["axis"]), node.outputs[0])

    @cache
    def offset(i: int) -> Dyn:
        """Where input ``i`` starts along ``axis``: the sum of the sizes of the inputs before it."""
        return 0 if i == 0 else _arith(e, "Add", offset(i - 1), _extent(e, node.inputs[i - 1], axis))

    def piece(i: int, x: str) -> str:
        start, end = offset(i), offset(i + 1)
        return ctx.val(g).apply("Slice", _t(e, start), _t(e, end), e.ints([axis]), like=x).name

    return [lambda i=i, x=x: piece(i, x) for i, x in enumerate(node.inputs)]


@vjp("Split", bounded=True, finite=True, reads=(), moves=True)
def split(ctx: Ctx, node: Node, cts: list) -> list:
    """The cotangents of the pieces concatenated along ``axis``; pieces without one contribute zeros
    (PyTorch's ``split_backward``)."""
    e, x = ctx.e, node.inputs[0]

    def dx() -> str:
        parts = [g if g is not None else e.zeros_like(y) for g, y in zip(cts, node.outputs, strict=True)]
        if len(parts) == 1:
            return parts[0]
        return ctx.val(parts[0]).apply("Concat", *parts[1:], like=x, axis=int(node.attrs.get("axis", 0))).name

    return [dx, *[None] * (len(node.inputs) - 1)]


# ------------------------------------------------------------------------------------------ tile


@vjp("Tile", bounded=True, finite=True, reads=())
def tile(ctx: Ctx, node: Node, cts: list) -> list:
    """``y`` viewed as ``[r0, d0, r1, d1, ...]`` holds ``r0 * r1 * ...`` copies of ``x``; the adjoint sums
    the cotangent, viewed the same way, over the repeat axes (PyTorch's ``repeat_backward``)."""
    return [lambda: _untile(ctx, node, cts[0]), None]


def _untile(ctx: Ctx, node: Node, g: str) -> str | Val:
    """The cotangent of Tile's ``x`` (see :func:`tile`)."""
    e, (x, reps) = ctx.e, node.inputs
    r = e.rank(x)
    if r is None:
        rs = e.shape(reps)
        if rs is None:
            raise GraphError(e.unknown_rank(x, node, "the VJP of Tile"))
        r = rs[0]
    if r == 0:
        return g
    rv, xs = _const_ints(e, reps), e.shape(x)
    if rv is not None and xs is not None:
        if all(v == 1 for v in rv):
            return g
        view = e.ints([v for pair in zip(rv, xs, strict=True) for v in pair])
    else:
        cols = [e.op("Unsqueeze", [_as_int64(e, v), e.ints([1])]) for v in (reps, e.shape_of(x))]
        view = e.op("Reshape", [e.op("Concat", cols, axis=1), e.ints([-1])])
    grouped = ctx.val(g).apply("Reshape", view, like=None, allowzero=1)
    return grouped.sum(range(0, 2 * r, 2), keepdims=0, like=x)


# ------------------------------------------------------------------------------------------ slice


def _unslice_axis(e: Emitter, g: str, axis: int, dim: Dyn, lo: Dyn, n: Dyn, s: Dyn, neg,
                  like: str | None = None) -> str:
    """The adjoint of a strided selection along ``axis``: the ``n`` cotangent rows go to ``lo``,
    ``lo + s``, ... (in reverse order when ``neg``), zeros elsewhere, for a result of length ``dim``.

    Zeros are interleaved by padding a new unit axis to ``s`` and merging it, then the tail is cut off and
    the result padded to ``dim``: only Unsqueeze/Pad/Reshape/Slice, which have VJPs here.
    ``neg`` is a bool or the name of a boolean [1] value; the other arguments are int-or-name. ``like``: the
    value whose type the padded result has (the sliced input, for the last axis unsliced)."""
    val = EmitterContext(e).val
    if neg is True:
        g = _reverse(e, g, axis)
    elif neg is not False:  # the index triples of a reversed or a forward walk, chosen at run time
        pick = lambda a, b: e.op("Where", [neg, e.ints([a]), e.ints([b])])
        g = val(g).apply("Slice", pick(-1, 0), pick(INT64_MIN, INT64_MAX), e.ints([axis]), pick(-1, 1)).name
    if s == 1:
        length: Dyn = n
    else:
        new = axis + 1 if axis >= 0 else axis  # right after ``axis``, counted in the rank + 1 result
        u = val(g).unsqueeze([new])
        spread = _pad_axis(e, u.name, new, 0, _arith(e, "Sub", s, 1))
        gs = e.shape(g)
        merged_len = _arith(e, "Mul", n, s)
        if gs is not None and isinstance(merged_len, int):
            view = e.ints([merged_len if i == axis % len(gs) else d for i, d in enumerate(gs)])
        else:
            head = [e.op("Shape", [g], end=axis)] if axis != 0 else []
            tail = [e.op("Shape", [g], start=axis + 1)] if axis != -1 else []
            view = e.op("Concat", [*head, _t(e, merged_len), *tail], axis=0)
        merged = val(spread).apply("Reshape", view, like=None, allowzero=1)
        length = _arith(e, "Max", _arith(e, "Add", _arith(e, "Mul", _arith(e, "Sub", n, 1), s), 1), 0)
        g = merged.apply("Slice", e.ints([0]), _t(e, length), e.ints([axis]), like=None).name
    return _pad_axis(e, g, axis, lo, _arith(e, "Sub", _arith(e, "Sub", dim, lo), length), like=like)


def _dynamic_selection(ctx: Ctx, dim: Dyn, start: Dyn, end: Dyn, step: Dyn) -> tuple:
    """``(lo, n, s, neg)`` of one axis computed in the graph by slicing an index line ``0 .. dim-1`` with
    the node's own parameters, so the runtime's Slice decides the clamping."""
    e = ctx.e
    limit = e.op("Squeeze", [_t(e, dim), e.ints([0])]) if not isinstance(dim, int) else e.const(np.int64(dim))
    line = e.op("Range", [e.const(np.int64(0)), limit, e.const(np.int64(1))])
    picked = e.op("Slice", [line, _t(e, start), _t(e, end), e.ints([0]), _t(e, step)])
    n = e.op("Shape", [picked], shape=(1,), dtype=np.int64)
    # with nothing selected, lo = dim makes the padding put all of the (empty) row at the end
    lo = e.op("ReduceMin", [e.op("Concat", [picked, _t(e, dim)], axis=0)], keepdims=1)
    if isinstance(step, int):
        return lo, n, abs(step), step < 0
    s = ctx.val(step)
    return lo, n, s.abs().name, s.lt(e.ints([0])).name


def _masked_params(ctx: Ctx, node: Node, x: str, starts: str, ends: str, axes: str | None, steps: str | None):
    """Per-axis ``(axis, start, end, step)`` for every axis of ``x`` when the sliced axes are not known
    while the graph is built: an axis missing from ``axes`` takes the whole range."""
    e = ctx.e
    r = e.need_rank(x, node)
    if axes is None:
        axes = e.op("Range", [e.const(np.int64(0)), e.op("Size", [starts]), e.const(np.int64(1))])
    axes = ctx.val(_as_int64(e, axes))
    axes = where(axes.lt(e.ints([0])), axes + e.ints([r]), axes, like=None)
    starts, ends = _as_int64(e, starts), _as_int64(e, ends)
    if steps is None:
        steps = e.op("ConstantOfShape", [e.op("Shape", [starts])], value=np.ones(1, np.int64))
    steps = _as_int64(e, steps)
    zero = e.ints([0])
    out = []
    for i in range(r):
        hit = axes.eq(e.ints([i]))
        found = hit.cast(np.int64).sum().gt(zero)

        def pick(v, default, hit=hit, found=found):
            chosen = where(hit, ctx.val(v), zero, like=None).sum()
            return where(found, chosen, e.ints([default]), like=None).name

        out.append((i, pick(starts, 0), pick(ends, INT64_MAX), pick(steps, 1)))
    return out


@vjp("Slice", bounded=True, finite=True, reads=(), moves=True)
def slice_(ctx: Ctx, node: Node, cts: list) -> list:
    """The cotangent scattered into zeros of ``x``'s shape at the selected positions, axis by axis
    (JAX's ``_slice_transpose_rule``: a pad with interior padding ``step - 1``). Works from constants when
    the parameters and the sliced dimensions are known, from graph values otherwise."""
    return [lambda: _unslice(ctx, node, cts[0]), *[None] * (len(node.inputs) - 1)]


def _unslice(ctx: Ctx, node: Node, g: str) -> str:
    """The cotangent of Slice's ``x`` (see :func:`slice_`): :func:`_unslice_axis` for each sliced axis."""
    e, x = ctx.e, node.inputs[0]
    # an axis taken whole (``x[:, ...]`` as exporters write it) needs no padding back, whatever its length
    params = [p for p in _slice_params(ctx, node, x) if not _whole_axis(*p[1:])]
    if not params:
        return g  # the Slice is the identity: y is x
    for k, (a, start, end, step) in enumerate(params):
        a = _norm_axis(e, a, x)
        dim = _extent(e, x, a)
        if all(isinstance(v, int) for v in (dim, start, end, step)):
            idx = slice_indices(dim, start, end, step)
            if len(idx) == 0:
                return e.zeros_like(x)
            sel = (idx[-1] if step < 0 else idx[0], len(idx), abs(step), step < 0)  # (min() walks a range)
        else:
            sel = _dynamic_selection(ctx, dim, start, end, step)
        # the last axis's Pad restores x's shape exactly (every sliced axis is back to its extent): typed as
        # x, it needs no Reshape after it to carry that shape
        g = _unslice_axis(e, g, a, dim, *sel, like=x if k == len(params) - 1 else None)
    dg = e.dims(g)
    if dg is not None and None not in dg and dg == e.dims(x):  # typed as x (symbolic dims included)
        return g
    return _reshape_to(e, g, x)


def _whole_axis(start: Dyn, end: Dyn, step: Dyn) -> bool:
    """``start:end:step`` selects every element of an axis of any length, in order (ONNX Slice clamps
    ``end`` to the extent): ``0:INT64_MAX:1``."""
    return start == 0 and end == INT64_MAX and step == 1 and all(isinstance(v, int) for v in (start, end, step))


def _slice_params(ctx: Ctx, node: Node, x: str) -> list[tuple]:
    """``(axis, start, end, step)`` of each sliced axis, int-or-name: constants where known, one-element
    slices of the parameter inputs otherwise, and every axis of ``x`` (:func:`_masked_params`) when the sliced
    axes are only known at run time."""
    e = ctx.e
    starts, ends, axes, steps = node.inputs[1], node.inputs[2], optional_input(node, 3), optional_input(node, 4)
    sv, ev, av, tv = (_const_ints(e, v) for v in (starts, ends, axes, steps))
    k = len(sv) if sv is not None else (e.shape(starts) or [None])[0]
    if av is None and axes is None and k is not None:
        av = list(range(k))
    if av is not None:
        def part(vals, name, i, default=None):
            if name is None:
                return default
            if vals is not None:
                return vals[i]
            return e.op("Slice", [_as_int64(e, name), e.ints([i]), e.ints([i + 1])])

        return [(a, part(sv, starts, i), part(ev, ends, i), part(tv, steps, i, 1)) for i, a in enumerate(av)]
    return _masked_params(ctx, node, x, starts, ends, axes, steps)


# ------------------------------------------------------------------------------------------ pad


def _unpad_constant(ctx: Ctx, g: str, x: str, pads: str, axes: str | None) -> str:
    """Constant mode: the cotangent with the added border cut off (``Slice``) and zeros where ``x`` was
    cropped by negative pads (``Pad``), without negative pads (``onnx.reference`` rejects them)."""
    e, tail = ctx.e, [axes] if axes else []
    pv = _const_ints(e, pads)
    if pv is not None:
        k = len(pv) // 2
        before, after = pv[:k], pv[k:]
        gv = ctx.val(g)
        if any(p > 0 for p in pv):
            gv = gv.apply("Slice", e.ints([max(b, 0) for b in before]),
                          e.ints([-a if a > 0 else INT64_MAX for a in after]), *tail, like=None)
        if any(p < 0 for p in pv):
            gv = gv.apply("Pad", e.ints([max(-p, 0) for p in pv]), "", *tail, like=None)
        return _reshape_to(e, gv.name, x)
    p = ctx.val(pads)
    halves = p.apply("Max", e.ints([0]), like=None).reshape([2, -1])  # the positive pads: [before; after]
    row = lambda i: halves.apply("Slice", e.ints([i]), e.ints([i + 1]), like=None).reshape([-1])
    before, after = row(0), row(1)
    ends = where(after.gt(e.ints([0])), -after, e.ints([INT64_MAX]), like=None)
    cut = ctx.val(g).apply("Slice", before, ends, *tail, like=None)
    cropped = (-p).apply("Max", e.ints([0]), like=None)  # the negative pads, where x was cropped
    return cut.apply("Pad", cropped, "", *tail, like=x).name


def _unpad_axis(e: Emitter, g: str, axis: int, dim: int, before: int, after: int, mode: str) -> str:
    """Reflect/edge/wrap along one axis with known sizes. Negative pads crop first, then the mode pads
    the cropped row (what onnxruntime does); ``np.pad`` of ``0 .. n-1`` gives the source of every output
    position. That index map is cut into runs that ascend, descend or repeat one index; each run's
    cotangent is reversed or summed as needed and padded into place, and the runs are added."""
    if before == 0 and after == 0:
        return g
    cut_b, cut_a = max(-before, 0), max(-after, 0)
    n = dim - cut_b - cut_a
    if n <= 0:
        return _pad_axis(e, g, axis, dim, 0)
    src = np.pad(np.arange(n), (max(before, 0), max(after, 0)), mode=mode)
    val = EmitterContext(e).val
    parts, i = [], 0
    while i < len(src):
        j, d = i + 1, 1
        if j < len(src) and abs(int(src[j]) - int(src[i])) <= 1:
            d = int(src[j]) - int(src[i])
            while j + 1 < len(src) and int(src[j + 1]) - int(src[j]) == d:
                j += 1
            j += 1
        seg = val(g).apply("Slice", e.ints([i]), e.ints([j]), e.ints([axis]), like=None)
        if d == 0:
            seg = seg.sum([axis])
        elif d == -1:
            seg = val(_reverse(e, seg.name, axis))
        lo, length = int(src[i:j].min()), 1 if d == 0 else j - i
        parts.append(_pad_axis(e, seg.name, axis, lo, n - lo - length))
        i = j
    total = parts[0] if len(parts) == 1 else val(parts[0]).apply("Sum", *parts[1:], like=None).name
    return _pad_axis(e, total, axis, cut_b, cut_a)


def _unpad_scatter(e: Emitter, g: str, x: str, pads: str, axes: str | None, mode: str) -> str:
    """Reflect/edge/wrap with sizes known only at run time: pad an index grid of ``x`` with the same mode
    to learn each output's source, and add the cotangent there with ``ScatterElements(reduction="add")``."""
    size = e.op("Size", [x])
    grid = e.op("Reshape", [e.op("Range", [e.const(np.int64(0)), size, e.const(np.int64(1))]), e.shape_of(x)])
    source = e.op("Pad", [grid, pads, *(["", axes] if axes else [])], mode=mode)
    flat = e.ints([-1])
    n = e.op("Unsqueeze", [size, e.ints([0])])
    dt = e.dtype(x)
    zeros = e.op("ConstantOfShape", [n], value=np.zeros(1, dt if dt is not None else np.float32))
    if dt is None:
        zeros = e.op("CastLike", [zeros, g])
    val = EmitterContext(e).val
    summed = val(zeros).apply("ScatterElements", val(source).reshape(flat), val(g).reshape(flat), like=None, axis=0,
                              reduction="add")
    return summed.reshape(e.shape_of(x), like=x).name


@vjp("Pad", bounded=True, finite=True, reads=(), moves=True)
def pad(ctx: Ctx, node: Node, cts: list) -> list:
    """Constant mode: the cotangent of ``x`` is the cotangent without the border, and ``constant_value``
    gets the sum of the cotangent over the border. Reflect/edge/wrap: each output element is a copy of
    one ``x`` element, so ``x`` gets the sum of the cotangents of its copies (JAX's ``_pad_transpose``;
    PyTorch's ``reflection_pad*_backward``, ``replication_pad*_backward``)."""
    e, x, pads, g = ctx.e, node.inputs[0], node.inputs[1], cts[0]
    cv, axes = optional_input(node, 2), optional_input(node, 3)
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode

    def dx() -> str:
        if mode == "constant":
            return _unpad_constant(ctx, g, x, pads, axes)
        return _unpad_modes(e, node, g, x, pads, axes, mode)

    def dvalue() -> Val:  # the sum of g over the border, where Pad of ones is 0
        inside = ctx.val(e.ones_like(x)).apply("Pad", pads, "", *([axes] if axes else []), like=None)
        total = (ctx.val(g) * (1 - inside)).sum(keepdims=0)
        return total if e.rank(cv) == 0 else total.reshape(e.shape_of(cv), like=cv)

    grads: list = [dx, *[None] * (len(node.inputs) - 1)]
    if cv is not None and mode == "constant":
        grads[2] = dvalue
    return grads


def _unpad_modes(e: Emitter, node: Node, g: str, x: str, pads: str, axes: str | None, mode: str) -> str:
    pv, dims = _const_ints(e, pads), e.dims(x)
    av = _const_ints(e, axes) if axes else (None if pv is None else list(range(len(pv) // 2)))
    if pv is not None and av is not None and dims is not None:
        k = len(av)
        norm = [a + len(dims) if a < 0 else a for a in av]
        # the run decomposition reads the index map of each padded axis, built here: only for short axes (a
        # reflect Pad over 10^8 elements took a minute and 800 MB to build); longer ones scatter at run time
        if all(isinstance(dims[a], int) for a in norm) and all(
                small([dims[a] + max(b, 0) + max(after, 0)]) for a, b, after in zip(norm, pv[:k], pv[k:], strict=True)):
            for a, b, after in zip(norm, pv[:k], pv[k:], strict=True):
                g = _unpad_axis(e, g, a, dims[a], b, after, mode)
            return _reshape_to(e, g, x)
    return _unpad_scatter(e, g, x, pads, axes, mode)


@vjp("CenterCropPad", bounded=False, finite=False)
def center_crop_pad(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "CenterCropPad" (opset 18) crops each of ``axes`` (default all) to ``shape`` around its center
    (start ``(dim - n) // 2``) or pads it with zeros (``(n - dim) // 2`` before, the rest after). Both are
    linear data movements whose adjoints are the other one at the same offsets: cropping the cotangent back
    from ``n`` to ``dim`` starts at ``(n - dim) // 2``, the pad's offset, and padding it back puts it at
    ``(dim - n) // 2``, the crop's. So ``dx = CenterCropPad(g, dims of x along axes)`` (JAX's
    ``_slice_transpose_rule`` and ``_pad_transpose``): the cropped-away entries get exact zeros, the padding's
    cotangent is dropped. ``shape`` gets no gradient."""
    e, x, g = ctx.e, node.inputs[0], cts[0]
    axes = node.attrs.get("axes")

    def dx() -> str | Val:
        dims = e.dims(x)
        if dims is not None:
            picked = [dims[int(a)] for a in axes] if axes is not None else list(dims)
            if all(isinstance(d, int) for d in picked):
                if e.shape(g) is not None and e.shape(g) == e.shape(x):
                    return g
                return ctx.val(g).apply("CenterCropPad", e.ints(picked), like=x, axes=axes)
        target = e.op("Shape", [x])
        if axes is not None:
            target = e.op("Gather", [target, e.ints([int(a) for a in axes])], axis=0)
        return ctx.val(g).apply("CenterCropPad", target, like=x, axes=axes)

    return [dx, None]


@vjp("Range", bounded=False, finite=True)
def range_(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Range": ``y[i] = start + i * delta`` for ``i < n = max(ceil((limit - start) / delta), 0)``, so
    ``dstart = sum(g)`` and ``ddelta = sum(i * g)``. ``n`` moves only in steps (a piecewise-constant function
    of all three inputs), so ``limit`` gets no gradient and the others none through ``n``. Integer ranges
    never get here (integer values carry no gradient)."""
    (start, _, delta), g = node.inputs, ctx.val(cts[0])
    return [lambda: _to_scalar_like(g.sum(keepdims=0), start),
            None,
            lambda: _to_scalar_like((g * _ramp(g)).sum(keepdims=0), delta)]


def _ramp(g: Val) -> Val:
    """``[0, 1, ..., n - 1]`` for the 1-D ``g`` of length ``n``, in ``g``'s dtype: an integer ``Range`` (exact
    counts; ONNX shape inference rarely knows a Range's length, so no constant is folded here)."""
    e = g.ctx.e
    ramp = g.ctx.val(e.op("Range", [e.const(np.int64(0)), e.op("Size", [g.name]), e.const(np.int64(1))]))
    return ramp.cast(g.dtype) if g.dtype is not None else ramp.apply("CastLike", g, like=None)


def _to_scalar_like(total: Val, x: str) -> Val:
    """The 0-d ``total`` with the dtype of the scalar input ``x``, reshaped like ``x`` if it is not 0-d."""
    e = total.ctx.e
    if e.dtype(x) is None or e.dtype(x) != total.dtype:
        total = total.apply("CastLike", x, like=None)
    return total if e.rank(x) == 0 else total.reshape(e.shape_of(x), like=x)


not_differentiable("integer result, or a result fixed by the inputs' shapes rather than their values",
                   "Shape", "Size", bounded=False, finite=True, shape_only=True)
not_differentiable("integer result, or a result fixed by the inputs' shapes rather than their values",
                   "ConstantOfShape", "NonZero", bounded=False, finite=True)
not_differentiable("integer result, or a result fixed by the inputs' shapes rather than their values",
                   "EyeLike", bounded=False, finite=False)
not_differentiable("no inputs: a constant", "Constant", bounded=False, finite=True)
