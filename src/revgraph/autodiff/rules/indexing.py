"""VJPs of indexing operators (ONNX operator spec, "Gather", "GatherElements", "GatherND", "OneHot", "TopK",
"Compress", "ReverseSequence", "TensorScatter"; the scatters are in ``scatter.py``; derivatives as in PyTorch's
``tools/autograd/derivatives.yaml``: ``index_select_backward``, ``gather_backward``, ``index_put`` and
``topk`` -> ``value_selecting_reduction_backward``).

A gather reads elements; its transpose adds the cotangent back at the read positions with a scatter whose
``reduction="add"`` accumulates repeated indices (DESIGN.md section 5). ``Gather`` along axis 0 returns the
rows as a :class:`SparseGrad` (indices normalised into ``[0, n)``, since ``Gather`` allows negative indices
and the sparse contract does not); the backward pass concatenates and densifies them.

The transposes of GatherND go through :func:`~revgraph.autodiff.sparse.scatter_nd_reduce`, race free (see
``scatter.py``).

The cotangents' movement (scatters into zeros, reshapes, slices) and the formulas (OneHot's values,
TensorScatter's slots and kept positions) are written in the algebra; index tables (GatherND's batch
coordinates and extents, the positions Compress keeps) are shape plumbing and stay
:meth:`~revgraph.autodiff.emitter.Emitter.op` calls.
"""

from __future__ import annotations

import numpy as np

from ...ir import Node
from ..algebra import Val
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ..sparse import SparseGrad, add_rows, scatter_nd_reduce
from ._common import EmitterContext, cat_shapes, dim, flat_indices, node_axis, nonneg, shape_part
from .tables import small


def _vector(e: Emitter, values: list[float], like: str) -> str:
    """A 1-D constant with the dtype of ``like`` (``CastLike`` when that dtype is unknown)."""
    dt = e.dtype(like)
    if dt is not None:
        return e.const(np.asarray(values, dtype=dt))
    return e.op("CastLike", [e.const(np.asarray(values, dtype=np.float32)), like])


@vjp("Gather", bounded=True, finite=True, reads=(), moves=True)
def gather(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Gather": ``y[i0..i(a-1), j.., k..] = x[i0.., idx[j..], k..]``. The transpose adds ``g`` into
    zeros at the gathered positions (PyTorch ``index_select_backward``: ``index_add``). Axis 0 gives a
    :class:`SparseGrad` of rows; other axes a dense ``ScatterElements(reduction="add")``."""
    return [lambda: _ungather(ctx, node, cts[0]), None]


def _ungather(ctx: Ctx, node: Node, g: str) -> SparseGrad | str:
    """The cotangent of Gather's data (see :func:`gather`)."""
    e, (data, idx) = ctx.e, node.inputs
    axis = node_axis(e, node, data, 0)  # axis 0 needs no rank: the rows' shape can come from Shape(data)
    flat = flat_indices(e, idx, dim(e, data, axis))
    rows = g  # with 1-D indices the cotangent already has the rows' shape
    if e.rank(idx) != 1:
        parts = [shape_part(e, data, 0, axis), shape_part(e, flat, 0), shape_part(e, data, axis + 1)]
        static = all(isinstance(p, list) for p in parts)
        shape = tuple(d for p in parts for d in p) if static else None
        rows = ctx.val(g).out("Reshape", cat_shapes(e, parts), shape=shape, dtype=e.dtype(g)).name
    return add_back(e, node, data, flat, rows, axis)


def add_back(e: Emitter, node: Node, data: str, flat: str, rows: str, axis: int) -> SparseGrad | str:
    """Zeros of ``data``'s shape with the slices ``rows`` (``data``'s shape but ``K`` along ``axis``) added at
    the positions ``flat`` (int64 [K], in ``[0, n)``, repeats accumulating) along ``axis``: the transpose of
    ``Gather(data, flat, axis)``. Axis 0 gives a :class:`SparseGrad`; other axes a ScatterElements(add)."""
    if axis == 0:
        return SparseGrad(flat, rows, data)
    # ScatterElements needs indices of the updates' shape: the flat indices along `axis`, broadcast.
    r, val = e.need_rank(data, node), EmitterContext(e).val
    spread = val(flat).unsqueeze([d for d in range(r) if d != axis]).expand(e.shape_of(rows))
    return val(e.zeros_like(data)).apply("ScatterElements", spread, rows, like=data, axis=axis, reduction="add").name


@vjp("GatherElements", bounded=True, finite=True, reads=(), moves=True)
def gather_elements(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "GatherElements": ``y[i][j] = x[idx[i][j]][j]`` (axis 0). The transpose is
    ``ScatterElements(zeros, idx, g, reduction="add")`` (PyTorch ``gather_backward``: ``scatter_add``);
    ScatterElements takes negative indices as GatherElements does."""
    e, (data, idx) = ctx.e, node.inputs
    axis = node_axis(e, node, data, 0, required=False)
    return [lambda: ctx.val(e.zeros_like(data)).apply("ScatterElements", idx, cts[0], like=data, axis=axis,
                                                      reduction="add"),
            None]


def _batch_coords(e: Emitter, node: Node, idx: str, b: int) -> str:
    """int64 ``c`` of shape ``idx.shape[:-1] + [b]`` with ``c[p0..p(q-2), j] = p_j``: the batch positions
    that GatherND's ``batch_dims`` leave implicit, made explicit for ScatterND (which has no batch_dims)."""
    s = e.shape(idx)
    if s is not None and small([*s[:-1], b]):  # else Range-based below (a table per element of idx)
        grid = np.indices(s[:-1], dtype=np.int64)[:b]
        return e.const(np.moveaxis(grid, 0, -1))
    q = e.need_rank(idx, node)
    lead = e.op("Shape", [idx], end=-1)
    target = cat_shapes(e, [lead, [1]])
    one, zero = e.const(np.int64(1)), e.const(np.int64(0))
    coords = []
    for j in range(b):
        ramp = e.op("Range", [zero, dim(e, idx, j), one])
        lined = e.op("Reshape", [ramp, e.ints([1] * j + [-1] + [1] * (q - 1 - j))])
        coords.append(e.op("Expand", [lined, target]))
    return coords[0] if b == 1 else e.op("Concat", coords, axis=-1)


@vjp("GatherND", bounded=True, finite=True, reads=(), moves=True)
def gather_nd(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "GatherND": ``y[p..] = x[batch(p), idx[p..]]``. The transpose has the semantics of
    ``ScatterND(zeros, idx', g, reduction="add")``, where ``idx'`` holds the batch positions explicitly and
    non-negative indices, written race free by :func:`~revgraph.autodiff.sparse.scatter_nd_reduce`."""
    e, (data, idx) = ctx.e, node.inputs

    def ddata() -> str:
        b = int(node.attrs.get("batch_dims", 0))
        full = nonneg(e, idx, nd_dims(e, data, idx, b))
        if b:
            full = e.op("Concat", [_batch_coords(e, node, idx, b), full], axis=-1)
        return scatter_nd_reduce(e, e.zeros_like(data), full, cts[0], "add")

    return [ddata, None]


def nd_dims(e: Emitter, data: str, idx: str, b: int) -> str:
    """``shape(data)[b:b+m]`` as a 1-D int64 value (a constant when static), ``m = idx.shape[-1]``: the
    extents that ND indices (GatherND after ``b`` batch dimensions, ScatterND with ``b = 0``) count in."""
    m = e.dims(idx)[-1] if e.dims(idx) else None
    dims = shape_part(e, data, b, b + m) if isinstance(m, int) else None
    if dims is None:  # the index depth is only known at run time: slice shape(x)[b:b+m] with it
        depth = e.op("Shape", [idx], start=-1)
        dims = e.op("Slice", [e.op("Shape", [data]), e.ints([b]), e.op("Add", [e.ints([b]), depth])])
    return cat_shapes(e, [dims])


@vjp("OneHot", bounded=False, finite=True)
def one_hot(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "OneHot": ``y = where(hot, on, off)`` with ``values = [off, on]``, so ``d values =
    [sum(g * (1 - hot)), sum(g * hot)]``. Indices and depth select positions and get no gradient."""
    e, (idx, depth, values), g = ctx.e, node.inputs, ctx.val(cts[0])

    def dvalues() -> Val:
        # The mask comes from the forward's own OneHot (same index, depth and value types, same axis), so it
        # runs wherever the forward runs; elementwise ops then keep the backward differentiable.
        hot = ctx.val(idx).apply("OneHot", depth, _vector(e, [0, 1], values), like=None,
                                 axis=int(node.attrs.get("axis", -1)))
        on, off = (g * hot).sum(keepdims=0), (g * (1 - hot)).sum(keepdims=0)
        return (off * _vector(e, [1, 0], values)).apply("Add", on * _vector(e, [0, 1], values), like=values)

    return [None, None, dvalues]


@vjp("TopK", bounded=False, finite=True)
def top_k(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "TopK": the values output reads ``x`` at the returned indices along ``axis``, so ``g`` goes back
    there (PyTorch ``value_selecting_reduction_backward``); the indices output carries no gradient."""
    e, x, g = ctx.e, node.inputs[0], cts[0]
    if g is None:
        return [None, None]
    axis = node_axis(e, node, x, -1, required=False)
    return [lambda: ctx.val(e.zeros_like(x)).apply("ScatterElements", node.outputs[1], g, like=x, axis=axis,
                                                   reduction="add"),
            None]


@vjp("Compress", bounded=False, finite=False)
def compress(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Compress" (numpy.compress): ``y = Gather(x, k, axis)`` with ``k`` the positions where
    ``condition`` is true (a condition shorter than the axis drops the rest), of the flattened ``x`` when
    there is no ``axis``. The transpose adds ``g`` back at the kept positions (PyTorch
    ``masked_select_backward``: ``masked_scatter`` into zeros); dropped positions get exact zeros. Along axis 0
    the gradient is a :class:`SparseGrad` of rows, as Gather's; other axes and the flattened input use the
    race-free ScatterElements (the positions are distinct anyway)."""
    e, (x, cond), g = ctx.e, node.inputs, cts[0]

    def dx() -> SparseGrad | str:
        kept = _true_positions(e, cond)
        if node.attrs.get("axis") is not None:
            return add_back(e, node, x, kept, g, node_axis(e, node, x, 0))
        flat = ctx.val(e.zeros_like(x)).reshape([-1])
        return ctx.val(add_rows(e, flat.name, kept, g)).reshape(e.shape_of(x), like=x)

    return [dx, None]


def _true_positions(e: Emitter, cond: str) -> str:
    """int64 [K]: the positions where the 1-D bool ``cond`` is true, in order (a constant for a constant)."""
    v = e.value(cond)
    if v is not None:
        return e.const(np.flatnonzero(np.asarray(v).reshape(-1)).astype(np.int64))
    return e.op("Reshape", [e.op("NonZero", [cond]), e.ints([-1])], shape=(None,), dtype=np.dtype(np.int64))


@vjp("ReverseSequence", bounded=False, finite=False)
def reverse_sequence(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "ReverseSequence": on every batch slice, a permutation of the time axis that reverses the first
    ``sequence_lens[b]`` entries and keeps the rest, an involution, so its own transpose (as TensorFlow's
    ``_ReverseSequenceGrad``): ``dx = ReverseSequence(g, sequence_lens)``."""
    (x, lens), g = node.inputs, cts[0]
    attrs = {k: node.attrs[k] for k in ("batch_axis", "time_axis") if k in node.attrs}
    return [lambda: ctx.val(g).apply("ReverseSequence", lens, like=x, **attrs), None]


@vjp("TensorScatter", bounded=False, finite=False)
def tensor_scatter(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "TensorScatter" (opset 24, the KV-cache update): ``present = past_cache`` with
    ``update[..., s, ...]`` written at ``past_cache[..., p(b, s), ...]`` along ``axis``, ``p(b, s) =
    write_indices[b] + s`` (mod ``max_sequence_length`` in ``circular`` mode; ``write_indices`` 0 when
    omitted). The sequence_length positions written in a batch row are distinct (``sequence_length <=
    max_sequence_length``), so the transpose sums nothing: ``past_cache`` gets ``g`` with the written slots
    zeroed (a selection, exact zeros), ``update`` gets ``g`` read at the written slots (a ``Slice`` without
    ``write_indices``, else ``GatherElements``); as ``index_put``/``index_copy`` in PyTorch's derivatives.yaml."""
    e, g = ctx.e, cts[0]
    past, upd = node.inputs[0], node.inputs[1]
    w = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    circular = node.attrs.get("mode", "linear") == "circular"
    r = e.need_rank(past, node)
    axis = int(node.attrs.get("axis", -2)) % r
    m, n = dim(e, past, axis), dim(e, upd, axis)
    spread = [d for d in range(r) if d not in (0, axis)]  # [batch, sequence] tables -> rank r
    gv = ctx.val(g)

    def dpast() -> Val:
        mv, nv = e.value(m), e.value(n)
        if w is None:  # slots 0 .. n-1 are written
            if mv is not None and nv is not None and small([int(mv)]):
                shape = [1] * r
                shape[axis] = int(mv)
                kept = e.const((np.arange(int(mv)) >= int(nv)).reshape(shape))
            else:
                kept = _ramp(ctx, m).ge(n).unsqueeze([d for d in range(r) if d != axis])
            return gv.select(kept, like=past)
        off = _ramp(ctx, m).unsqueeze([0]) - ctx.val(w).unsqueeze([1])  # the slot's distance from the write index
        if circular:  # Mod of integers takes the divisor's sign: 0 <= off < m
            kept = off.apply("Mod", m, like=None).ge(n)
        else:
            kept = off.lt(np.asarray(0, dtype=np.int64)) | off.ge(n)
        return gv.select(kept.unsqueeze(spread) if spread else kept, like=past)

    def dupdate() -> str | Val:
        if w is None:
            return gv.apply("Slice", e.ints([0]), ctx.val(n).reshape([1]).name if e.value(n) is None
                            else e.ints([int(e.value(n))]), e.ints([axis]), like=upd)
        slots = ctx.val(w).unsqueeze([1]) + _ramp(ctx, n).unsqueeze([0])
        if circular:
            slots = slots.apply("Mod", m, like=None)
        slots = slots.unsqueeze(spread) if spread else slots
        return gv.apply("GatherElements", slots.expand(e.shape_of(upd)), like=upd, axis=axis)

    return [dpast, dupdate, None][:len(node.inputs)]


def _ramp(ctx: Ctx, n: str) -> Val:
    """int64 ``[0, 1, ..., n-1]`` for a 0-d int64 ``n`` (a constant when ``n`` is)."""
    e, v = ctx.e, ctx.value(n)
    if v is not None and small([int(v)]):
        return ctx.val(e.const(np.arange(int(v), dtype=np.int64)))
    return ctx.val(e.op("Range", [e.const(np.int64(0)), n, e.const(np.int64(1))], shape=(None,),
                        dtype=np.dtype(np.int64)))
