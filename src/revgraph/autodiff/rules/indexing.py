"""VJPs of indexing operators (ONNX operator spec, "Gather", "GatherElements", "GatherND", "ScatterND",
"ScatterElements", "OneHot", "TopK", "Compress", "ReverseSequence", "TensorScatter"; derivatives as in
PyTorch's ``tools/autograd/derivatives.yaml``: ``index_select_backward``, ``gather_backward``,
``index_put``/``scatter``/``scatter_reduce`` and ``topk`` -> ``value_selecting_reduction_backward``).

A gather reads elements; its transpose adds the cotangent back at the read positions with a scatter whose
``reduction="add"`` accumulates repeated indices (DESIGN.md section 5). ``Gather`` along axis 0 returns the
rows as a :class:`SparseGrad` (indices normalised into ``[0, n)``, since ``Gather`` allows negative indices
and the sparse contract does not); the backward pass concatenates and densifies them.

Every reducing scatter emitted here is ``ScatterElements``: onnxruntime's ``ScatterND`` with a reduction
races on repeated indices when it runs on several threads, so the ScatterND-shaped transposes (GatherND, the
counts of tied max/min updates) go through :func:`~revgraph.autodiff.sparse.scatter_nd_reduce` (see
``autodiff/sparse.py``) and the ``mul`` scale of ScatterND through ScatterElements on the rows of the data.
``ScatterND`` without a reduction, at unique positions, stays.

Reducing scatters (``reduction`` mul, max, min) differentiate as PyTorch's ``scatter_reduce`` with
``include_self=True`` does (``prod``, ``amax``, ``amin``), with two differences: the product of the other
updates at a position is formed without dividing (exact at zeros, ``autodiff/segments.py``), and every
gradient here is written in ONNX operators, so it can be differentiated again.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx

from ...errors import GraphError
from ...ir import Node
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ..segments import others_product
from ..sparse import SparseGrad, add_rows, scatter_nd_reduce

_INT64 = onnx.TensorProto.INT64


def _axis(e: Emitter, node: Node, x: str, default: int, *, required: bool = True) -> int:
    """The node's ``axis`` attribute as a non-negative axis of ``x`` (left negative when the rank is unknown
    and not ``required``: the reference evaluator's GatherElements mishandles negative axes)."""
    axis = int(node.attrs.get("axis", default))
    if axis >= 0:
        return axis
    r = e.need_rank(x, node) if required else e.rank(x)
    return axis if r is None else axis + r


def _shape_part(e: Emitter, x: str, start: int, end: int | None = None) -> list[int] | str:
    """``shape(x)[start:end]``: a list of ints when those dimensions are static, else a ``Shape`` value."""
    dims = e.dims(x)
    if dims is not None:
        part = list(dims[start:end])
        if all(isinstance(d, int) for d in part):
            return part
    attrs = {"start": start} if end is None else {"start": start, "end": end}
    return e.op("Shape", [x], **attrs)


def _cat_shapes(e: Emitter, parts: list[list[int] | str]) -> str:
    """A 1-D int64 shape made of ``parts`` (int lists or 1-D int64 values); a constant when all are known."""
    known = [p if isinstance(p, list) else e.value(p) for p in parts]
    if all(k is not None for k in known):
        return e.dims_const([int(d) for k in known for d in np.asarray(k).reshape(-1)])
    names = [e.ints(p) if isinstance(p, list) else p for p in parts]
    return names[0] if len(names) == 1 else e.op("Concat", names, axis=0)


def _vector(e: Emitter, values: list[float], like: str) -> str:
    """A 1-D constant with the dtype of ``like`` (``CastLike`` when that dtype is unknown)."""
    dt = e.dtype(like)
    if dt is not None:
        return e.const(np.asarray(values, dtype=dt))
    return e.op("CastLike", [e.const(np.asarray(values, dtype=np.float32)), like])


def _nonneg(e: Emitter, idx: str, n: str) -> str:
    """``idx`` with negative entries counted from the end (``idx + n`` where ``idx < 0``); ``n`` broadcasts
    against ``idx`` (a scalar, or a vector along the last axis for GatherND). Folded for constants."""
    v, nv = e.value(idx), e.value(n)
    if v is not None and (v >= 0).all():
        return idx
    if v is not None and nv is not None:
        return e.const(np.where(v < 0, v + nv, v).astype(v.dtype))
    n = n if e.dtype(n) == e.dtype(idx) and e.dtype(n) is not None else e.op("CastLike", [n, idx])
    zero = e.scalar(0, idx)
    return e.op("Where", [e.op("Less", [idx, zero]), e.op("Add", [idx, n]), idx], like=idx)


def _dim(e: Emitter, x: str, axis: int) -> str:
    """Dimension ``axis`` of ``x`` as a 0-d int64 value (a constant when static)."""
    dims = e.dims(x)
    if dims is not None and isinstance(dims[axis], int):
        return e.const(np.int64(dims[axis]))
    return e.op("Squeeze", [e.op("Shape", [x], start=axis, end=axis + 1)], shape=(), dtype=np.int64)


def _flat_indices(e: Emitter, idx: str, n: str) -> str:
    """``idx`` as int64 of shape ``[K]`` with every entry in ``[0, n)``."""
    v = e.value(idx)
    if v is not None:
        flat = e.const(np.asarray(v, dtype=np.int64).reshape(-1))
    else:
        if e.dtype(idx) != np.int64:
            idx = e.op("Cast", [idx], to=_INT64)
        flat = e.op("Reshape", [idx, e.ints([-1])])
    return _nonneg(e, flat, n)


@vjp("Gather")
def gather(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Gather": ``y[i0..i(a-1), j.., k..] = x[i0.., idx[j..], k..]``. The transpose adds ``g`` into
    zeros at the gathered positions (PyTorch ``index_select_backward``: ``index_add``). Axis 0 gives a
    :class:`SparseGrad` of rows; other axes a dense ``ScatterElements(reduction="add")``."""
    return [lambda: _ungather(ctx.e, node, cts[0]), None]


def _ungather(e: Emitter, node: Node, g: str) -> SparseGrad | str:
    """The cotangent of Gather's data (see :func:`gather`)."""
    data, idx = node.inputs
    axis = _axis(e, node, data, 0)  # axis 0 needs no rank: the rows' shape can come from Shape(data)
    flat = _flat_indices(e, idx, _dim(e, data, axis))
    rows = g  # with 1-D indices the cotangent already has the rows' shape
    if e.rank(idx) != 1:
        parts = [_shape_part(e, data, 0, axis), _shape_part(e, flat, 0), _shape_part(e, data, axis + 1)]
        static = all(isinstance(p, list) for p in parts)
        shape = tuple(d for p in parts for d in p) if static else None
        rows = e.op("Reshape", [g, _cat_shapes(e, parts)], shape=shape, dtype=e.dtype(g))
    return _add_back(e, node, data, flat, rows, axis)


def _add_back(e: Emitter, node: Node, data: str, flat: str, rows: str, axis: int) -> SparseGrad | str:
    """Zeros of ``data``'s shape with the slices ``rows`` (``data``'s shape but ``K`` along ``axis``) added at
    the positions ``flat`` (int64 [K], in ``[0, n)``, repeats accumulating) along ``axis``: the transpose of
    ``Gather(data, flat, axis)``. Axis 0 gives a :class:`SparseGrad`; other axes a ScatterElements(add)."""
    if axis == 0:
        return SparseGrad(flat, rows, data)
    # ScatterElements needs indices of the updates' shape: the flat indices along `axis`, broadcast.
    r = e.need_rank(data, node)
    lined = e.op("Unsqueeze", [flat, e.ints([d for d in range(r) if d != axis])])
    spread = e.op("Expand", [lined, e.shape_of(rows)])
    return e.op("ScatterElements", [e.zeros_like(data), spread, rows], axis=axis, reduction="add", like=data)


@vjp("GatherElements")
def gather_elements(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "GatherElements": ``y[i][j] = x[idx[i][j]][j]`` (axis 0). The transpose is
    ``ScatterElements(zeros, idx, g, reduction="add")`` (PyTorch ``gather_backward``: ``scatter_add``);
    ScatterElements takes negative indices as GatherElements does."""
    e, (data, idx) = ctx.e, node.inputs
    axis = _axis(e, node, data, 0, required=False)
    return [lambda: e.op("ScatterElements", [e.zeros_like(data), idx, cts[0]], axis=axis, reduction="add", like=data),
            None]


def _batch_coords(e: Emitter, node: Node, idx: str, b: int) -> str:
    """int64 ``c`` of shape ``idx.shape[:-1] + [b]`` with ``c[p0..p(q-2), j] = p_j``: the batch positions
    that GatherND's ``batch_dims`` leave implicit, made explicit for ScatterND (which has no batch_dims)."""
    s = e.shape(idx)
    if s is not None:
        grid = np.indices(s[:-1], dtype=np.int64)[:b]
        return e.const(np.moveaxis(grid, 0, -1))
    q = e.need_rank(idx, node)
    lead = e.op("Shape", [idx], end=-1)
    target = _cat_shapes(e, [lead, [1]])
    one, zero = e.const(np.int64(1)), e.const(np.int64(0))
    coords = []
    for j in range(b):
        ramp = e.op("Range", [zero, _dim(e, idx, j), one])
        lined = e.op("Reshape", [ramp, e.ints([1] * j + [-1] + [1] * (q - 1 - j))])
        coords.append(e.op("Expand", [lined, target]))
    return coords[0] if b == 1 else e.op("Concat", coords, axis=-1)


@vjp("GatherND")
def gather_nd(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "GatherND": ``y[p..] = x[batch(p), idx[p..]]``. The transpose has the semantics of
    ``ScatterND(zeros, idx', g, reduction="add")``, where ``idx'`` holds the batch positions explicitly and
    non-negative indices, written race free by :func:`~revgraph.autodiff.sparse.scatter_nd_reduce`."""
    e, (data, idx) = ctx.e, node.inputs

    def ddata() -> str:
        b = int(node.attrs.get("batch_dims", 0))
        full = _nonneg(e, idx, _nd_dims(e, data, idx, b))
        if b:
            full = e.op("Concat", [_batch_coords(e, node, idx, b), full], axis=-1)
        return scatter_nd_reduce(e, e.zeros_like(data), full, cts[0], "add")

    return [ddata, None]


def _nd_dims(e: Emitter, data: str, idx: str, b: int) -> str:
    """``shape(data)[b:b+m]`` as a 1-D int64 value (a constant when static), ``m = idx.shape[-1]``: the
    extents that ND indices (GatherND after ``b`` batch dimensions, ScatterND with ``b = 0``) count in."""
    m = e.dims(idx)[-1] if e.dims(idx) else None
    dims = _shape_part(e, data, b, b + m) if isinstance(m, int) else None
    if dims is None:  # the index depth is only known at run time: slice shape(x)[b:b+m] with it
        depth = e.op("Shape", [idx], start=-1)
        dims = e.op("Slice", [e.op("Shape", [data]), e.ints([b]), e.op("Add", [e.ints([b]), depth])])
    return _cat_shapes(e, [dims])


def _scatter_vjp(ctx: Ctx, node: Node, g: str, scatter: str, gather: str, attrs: dict) -> list:
    """Shared VJP of ScatterND / ScatterElements (``gather`` is the matching read), by ``reduction``; ``p`` is
    a position of the data and ``k`` runs over the updates written there.

    - ``none``: the data gradient is ``g`` with the written positions zeroed; the updates read ``g``.
    - ``add``: ``g`` passes to the data unchanged; the updates read ``g``.
    - ``mul``: ``y[p] = x[p] prod_k u_k``, so ``dx[p] = g[p] prod_k u_k`` and ``du_k = g[p] x[p] prod_{j != k}
      u_j`` (duplicates included; the product of the others without dividing by ``u_k``, so exact at zeros:
      :func:`~revgraph.autodiff.segments.others_product`).
    - ``max``/``min``: :func:`_extremum_vjp`.
    """
    e, (data, idx, upd) = ctx.e, node.inputs
    reduction = node.attrs.get("reduction", "none")
    if reduction in ("max", "min"):
        return _extremum_vjp(ctx, node, g, scatter, gather, attrs)
    if reduction == "none":
        ddata = lambda: e.op(scatter, [g, idx, e.zeros_like(upd)], like=data, **attrs)
    elif reduction == "add":
        ddata = g
    else:
        ddata = lambda: e.op("Mul", [g, _product_at(e, node, scatter, attrs)], like=data)

    def dupdates() -> str:
        if reduction == "mul":
            read = _read(e, node, e.op("Mul", [g, data], like=data), gather, attrs)
            return e.op("Mul", [read, _others_at(e, node, scatter)], like=upd)
        return _read(e, node, g, gather, attrs)

    return [ddata, None, dupdates]


def _read(e: Emitter, node: Node, v: str, gather: str, attrs: dict) -> str:
    """``v`` (data-shaped) read at the positions the scatter writes, in the updates' shape."""
    idx, upd = node.inputs[1], node.inputs[2]
    src = _fit_to_indices(e, node, v, idx, attrs["axis"]) if "axis" in attrs else v
    if gather == "GatherElements" and e.rank(src) == 1:
        # The same read; the reference evaluator's GatherElements (numpy.choose) takes at most 64 entries
        # along the axis, and the race-free scatters of autodiff/sparse.py are 1-D.
        return e.op("Gather", [src, idx], axis=0, like=upd)
    return e.op(gather, [src, idx], like=upd, **attrs)


def _extremum_vjp(ctx: Ctx, node: Node, g: str, scatter: str, gather: str, attrs: dict) -> list:
    """``reduction`` max/min: ``y[p]`` is the extremum of ``x[p]`` and the ``u_k`` written at ``p``. Ties split
    equally (DESIGN.md section 5; PyTorch's ``scatter_reduce`` amax/amin backward does the same): ``g[p]``
    goes in equal shares to ``x[p]`` if it equals ``y[p]`` and to every ``u_k`` that equals it. The shares
    count the attaining elements with a race-free scatter-add of ones; the rest is elementwise."""
    e, (data, _, upd), y = ctx.e, node.inputs, node.outputs[0]

    @cache
    def shares() -> tuple[str, str, str]:
        """``(hit_x, hit_u, share)``: where the data and the updates attain ``y``, and ``g`` per attaining element."""
        hit_x = e.op("Equal", [data, y])
        hit_u = e.op("Equal", [upd, _read(e, node, y, gather, attrs)])
        count = e.op("Add", [_indicator(e, hit_x, data),
                             _scatter_add(e, node, scatter, _indicator(e, hit_u, upd), attrs)], like=data)
        share = e.op("Div", [g, count], like=data)  # count >= 1 where hit_x, and at every position read where hit_u
        return hit_x, hit_u, share

    def ddata() -> str:
        hit_x, _, share = shares()
        return ctx.select(hit_x, share, like=data)

    def dupdates() -> str:
        _, hit_u, share = shares()
        return ctx.select(hit_u, _read(e, node, share, gather, attrs), like=upd)

    return [ddata, None, dupdates]


def _indicator(e: Emitter, mask: str, like: str) -> str:
    """The bool ``mask`` as 0/1 in the dtype of ``like``."""
    dt = e.onnx_dtype(like)
    if dt is not None:
        return e.op("Cast", [mask], to=dt)
    return e.op("CastLike", [mask, like])


def _scatter_add(e: Emitter, node: Node, scatter: str, vals: str, attrs: dict) -> str:
    """Zeros of the data's shape with ``vals`` (updates-shaped) added at the positions the scatter writes,
    repeated positions accumulating; race free (ScatterElements' kernel is sequential; ScatterND's semantics
    through :func:`~revgraph.autodiff.sparse.scatter_nd_reduce`)."""
    data, idx, _ = node.inputs
    if scatter == "ScatterElements":
        return e.op(scatter, [e.zeros_like(data), idx, vals], reduction="add", like=data, **attrs)
    return scatter_nd_reduce(e, e.zeros_like(data), _nonneg(e, idx, _nd_dims(e, data, idx, 0)), vals, "add")


def _product_at(e: Emitter, node: Node, scatter: str, attrs: dict) -> str:
    """Ones of the data's shape times the product of the updates written at each position (the data
    gradient's scale of a ``mul`` scatter), with the sequential ``ScatterElements(reduction="mul")`` kernel:
    ScatterND(mul) races on repeated indices in onnxruntime. ScatterND's K index tuples become row numbers
    (:func:`_nd_rows`) of the data viewed as R rows of S elements: rows of a static S are scattered on the
    flat view (as :func:`~revgraph.autodiff.sparse.scatter_nd_reduce` does, ~2.4x faster than the [R, S] view
    in onnxruntime), others on the [R, S] view with the updates as [K, S]. Either way the scatter's updates
    have a static length along its axis whenever K is static, so differentiating it again with respect to
    the updates works (:func:`_others_at` needs that length). An index depth known only at run time goes
    through ``scatter_nd_reduce``."""
    data, idx, upd = node.inputs
    if scatter == "ScatterElements":
        return e.op(scatter, [e.ones_like(data), idx, upd], reduction="mul", like=data, **attrs)
    depth = _depth(e, idx)
    if depth is None:
        return scatter_nd_reduce(e, e.ones_like(data), _nonneg(e, idx, _nd_dims(e, data, idx, 0)), upd, "mul")
    rows = _nd_rows(e, node, depth)
    count, width = _shape_part(e, rows, 0), _row_width(e, data, depth)
    if isinstance(count, list) and isinstance(width, list) and count[0] * width[0] == 0:
        return e.ones_like(data)  # nothing written (onnxruntime rejects some empty scatters)
    if isinstance(width, list):
        size = count[0] * width[0] if isinstance(count, list) else None
        flat = e.op("Reshape", [e.ones_like(data), e.ints([-1])])
        vals = e.op("Reshape", [upd, e.ints([-1])], shape=(size,), dtype=e.dtype(upd))
        out = e.op("ScatterElements", [flat, _row_elements(e, rows, width[0]), vals], axis=0, reduction="mul")
        return e.op("Reshape", [out, e.shape_of(data)], like=data)
    dt = e.dtype(data)
    ones = e.op("ConstantOfShape", [_cat_shapes(e, [_positions(e, data, depth), width])],
                value=np.ones(1, dtype=dt if dt is not None else np.float32))
    ones = ones if dt is not None else e.op("CastLike", [ones, data])
    spread = e.op("Expand", [e.op("Unsqueeze", [rows, e.ints([1])]), _cat_shapes(e, [count, width])])
    vals = e.op("Reshape", [upd, _cat_shapes(e, [count, width])])
    out = e.op("ScatterElements", [ones, spread, vals], axis=0, reduction="mul")
    return e.op("Reshape", [out, e.shape_of(data)], like=data)


def _row_elements(e: Emitter, rows: str, width: int) -> str:
    """int64 [K * width]: ``rows[k] * width + j`` for ``j < width``, row-major (a constant for constant rows)."""
    rv = e.value(rows)
    if rv is not None:
        return e.const((rv[:, None] * width + np.arange(width, dtype=np.int64)).reshape(-1))
    grid = e.op("Add", [e.op("Mul", [e.op("Unsqueeze", [rows, e.ints([1])]), e.const(np.int64(width))]),
                        e.const(np.arange(width, dtype=np.int64))])
    return e.op("Reshape", [grid, e.ints([-1])])


def _row_width(e: Emitter, x: str, start: int) -> list[int] | str:
    """``[prod(x.shape[start:])]``: a one-int list when static, else a 1-D int64 value of length 1."""
    part = _shape_part(e, x, start)
    if isinstance(part, list):
        return [int(np.prod(part, dtype=np.int64))]
    return e.op("ReduceProd", [part], keepdims=1)


def _depth(e: Emitter, idx: str) -> int | None:
    """The index depth ``m = idx.shape[-1]`` of ScatterND / GatherND when static."""
    dims = e.dims(idx)
    return dims[-1] if dims and isinstance(dims[-1], int) else None


def _positions(e: Emitter, data: str, depth: int) -> list[int] | str:
    """``[prod(data.shape[:depth])]``: the number of positions index tuples of ``depth`` entries address."""
    head = _shape_part(e, data, 0, depth)
    if isinstance(head, list):
        return [int(np.prod(head, dtype=np.int64))]
    return e.op("ReduceProd", [head], keepdims=1)


def _nd_rows(e: Emitter, node: Node, depth: int) -> str:
    """int64 [K]: ScatterND's index tuples (K of them, ``depth`` entries each; negative entries counted from
    the end) as row numbers of the [prod(data.shape[:depth]), ...] view of the data, row-major (Horner's rule
    over the dimensions; a constant for constant indices and static dimensions)."""
    data, idx, _ = node.inputs
    full = _nonneg(e, idx, _nd_dims(e, data, idx, 0))
    if e.dtype(full) != np.int64:
        full = e.op("Cast", [full], to=_INT64)
    dims = [_dim(e, data, j) for j in range(depth)]
    fv, dv = e.value(full), [e.value(d) for d in dims]
    if fv is not None and all(d is not None for d in dv):
        rows = np.zeros(fv.shape[:-1], dtype=np.int64)
        for j in range(depth):
            rows = rows * int(dv[j]) + fv[..., j]
        return e.const(rows.reshape(-1))
    rows = e.op("Gather", [full, e.const(np.int64(0))], axis=-1)
    for j in range(1, depth):
        rows = e.op("Add", [e.op("Mul", [rows, dims[j]]), e.op("Gather", [full, e.const(np.int64(j))], axis=-1)])
    return e.op("Reshape", [rows, e.ints([-1])])


def _others_at(e: Emitter, node: Node, scatter: str) -> str:
    """For each update of a ``mul`` scatter, the product of the other updates written to the same position
    (updates-shaped; :func:`~revgraph.autodiff.segments.others_product`). ScatterElements: grouped along
    ``axis`` by the (non-negative) index, line by line. ScatterND: the updates as [K, S] rows grouped by
    :func:`_nd_rows`. The number of updates along the grouped axis must be static (the scans' length)."""
    data, idx, upd = node.inputs
    if scatter == "ScatterElements":
        axis = _axis(e, node, data, 0)
        n = _static_dim(e, node, idx, axis)
        keys = _nonneg(e, idx, _dim(e, data, axis))
        return others_product(e, upd, keys, axis, n)
    dims = e.dims(idx)
    lead = list(dims[:-1]) if dims is not None else None
    if lead is None or not all(isinstance(d, int) for d in lead) or not isinstance(dims[-1], int):
        raise _static_error(node, idx)
    count = int(np.prod(lead, dtype=np.int64))
    if count <= 1:
        return e.ones_like(upd)
    rows = _nd_rows(e, node, dims[-1])
    rv = e.value(rows)
    keys = e.const(rv.reshape(count, 1)) if rv is not None else e.op("Reshape", [rows, e.ints([count, 1])],
                                                                        shape=(count, 1), dtype=np.int64)
    vals = e.op("Reshape", [upd, _cat_shapes(e, [[count], _row_width(e, upd, len(lead))])])
    others = others_product(e, vals, keys, 0, count)
    return e.op("Reshape", [others, e.shape_of(upd)], like=upd)


def _static_dim(e: Emitter, node: Node, x: str, axis: int) -> int:
    dims = e.dims(x)
    if dims is None or not isinstance(dims[axis], int):
        raise _static_error(node, x)
    return dims[axis]


def _static_error(node: Node, idx: str) -> GraphError:
    return GraphError(f"{node.label()}: the gradient with respect to the updates of reduction='mul' needs the "
                      f"shape of the indices {idx!r} when the graph is built; declare the shapes of the graph inputs")


def _fit_to_indices(e: Emitter, node: Node, g: str, idx: str, axis: int) -> str:
    """``g`` cut to the extent of ``idx`` in every dimension but ``axis``. ScatterElements allows indices
    smaller than the data there; GatherElements reads the same positions from a cut ``g`` (the reference
    evaluator's GatherElements insists on equal sizes outside ``axis``)."""
    r = e.need_rank(g, node)
    axis = axis % r
    sg, si = e.shape(g), e.shape(idx)
    if sg is not None and si is not None:
        if all(a == b for d, (a, b) in enumerate(zip(sg, si, strict=True)) if d != axis):
            return g
    ends = _cat_shapes(e, [_shape_part(e, idx, 0, axis), [np.iinfo(np.int64).max], _shape_part(e, idx, axis + 1)])
    return e.op("Slice", [g, e.ints([0] * r), ends])


@vjp("ScatterND")
def scatter_nd(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "ScatterND" (every reduction, :func:`_scatter_vjp`): transpose of GatherND on the updates, masking
    or pass-through on the data (PyTorch ``index_put``: ``values`` gets ``grad[indices]``)."""
    return _scatter_vjp(ctx, node, cts[0], "ScatterND", "GatherND", {})


@vjp("ScatterElements")
def scatter_elements(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "ScatterElements" (every reduction, :func:`_scatter_vjp`): as ScatterND with GatherElements along
    ``axis`` (PyTorch ``scatter``/``scatter_add``/``scatter_reduce``: ``src`` gets ``grad.gather(dim, index)``
    times the reduction's local derivative)."""
    return _scatter_vjp(ctx, node, cts[0], "ScatterElements", "GatherElements",
                        {"axis": _axis(ctx.e, node, node.inputs[0], 0, required=False)})


@vjp("OneHot")
def one_hot(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "OneHot": ``y = where(hot, on, off)`` with ``values = [off, on]``, so ``d values =
    [sum(g * (1 - hot)), sum(g * hot)]``. Indices and depth select positions and get no gradient."""
    e, (idx, depth, values), g = ctx.e, node.inputs, cts[0]

    def dvalues() -> str:
        # The mask comes from the forward's own OneHot (same index, depth and value types, same axis), so it
        # runs wherever the forward runs; elementwise ops then keep the backward differentiable.
        hot = e.op("OneHot", [idx, depth, _vector(e, [0, 1], values)], axis=int(node.attrs.get("axis", -1)))
        on = e.op("ReduceSum", [e.op("Mul", [g, hot])], keepdims=0)
        off = e.op("ReduceSum", [e.op("Mul", [g, e.op("Sub", [e.scalar(1.0, g), hot])])], keepdims=0)
        parts = [e.op("Mul", [off, _vector(e, [1, 0], values)]), e.op("Mul", [on, _vector(e, [0, 1], values)])]
        return e.op("Add", parts, like=values)

    return [None, None, dvalues]


@vjp("TopK")
def top_k(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "TopK": the values output reads ``x`` at the returned indices along ``axis``, so ``g`` goes back
    there (PyTorch ``value_selecting_reduction_backward``); the indices output carries no gradient."""
    e, x, g = ctx.e, node.inputs[0], cts[0]
    if g is None:
        return [None, None]
    axis = _axis(e, node, x, -1, required=False)
    return [lambda: e.op("ScatterElements", [e.zeros_like(x), node.outputs[1], g], axis=axis, reduction="add", like=x),
            None]


@vjp("Compress")
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
            return _add_back(e, node, x, kept, g, _axis(e, node, x, 0))
        flat = e.op("Reshape", [e.zeros_like(x), e.ints([-1])])
        return e.op("Reshape", [add_rows(e, flat, kept, g), e.shape_of(x)], like=x)

    return [dx, None]


def _true_positions(e: Emitter, cond: str) -> str:
    """int64 [K]: the positions where the 1-D bool ``cond`` is true, in order (a constant for a constant)."""
    v = e.value(cond)
    if v is not None:
        return e.const(np.flatnonzero(np.asarray(v).reshape(-1)).astype(np.int64))
    return e.op("Reshape", [e.op("NonZero", [cond]), e.ints([-1])], shape=(None,), dtype=np.dtype(np.int64))


@vjp("ReverseSequence")
def reverse_sequence(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "ReverseSequence": on every batch slice, a permutation of the time axis that reverses the first
    ``sequence_lens[b]`` entries and keeps the rest, an involution, so its own transpose (as TensorFlow's
    ``_ReverseSequenceGrad``): ``dx = ReverseSequence(g, sequence_lens)``."""
    e, (x, lens), g = ctx.e, node.inputs, cts[0]
    attrs = {k: node.attrs[k] for k in ("batch_axis", "time_axis") if k in node.attrs}
    return [lambda: e.op("ReverseSequence", [g, lens], like=x, **attrs), None]


@vjp("TensorScatter")
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
    m, n = _dim(e, past, axis), _dim(e, upd, axis)
    spread = [d for d in range(r) if d not in (0, axis)]  # [batch, sequence] tables -> rank r

    def dpast() -> str:
        mv, nv = e.value(m), e.value(n)
        if w is None:  # slots 0 .. n-1 are written
            if mv is not None and nv is not None:
                shape = [1] * r
                shape[axis] = int(mv)
                kept = e.const((np.arange(int(mv)) >= int(nv)).reshape(shape))
            else:
                kept = e.op("Unsqueeze", [e.op("GreaterOrEqual", [_ramp(e, m), n]),
                                          e.ints([d for d in range(r) if d != axis])])
            return ctx.select(kept, g, like=past)
        off = e.op("Sub", [e.op("Unsqueeze", [_ramp(e, m), e.ints([0])]), e.op("Unsqueeze", [w, e.ints([1])])])
        if circular:  # Mod of integers takes the divisor's sign: 0 <= off < m
            kept = e.op("GreaterOrEqual", [e.op("Mod", [off, m]), n])
        else:
            kept = e.op("Or", [e.op("Less", [off, e.const(np.int64(0))]), e.op("GreaterOrEqual", [off, n])])
        kept = e.op("Unsqueeze", [kept, e.ints(spread)]) if spread else kept
        return ctx.select(kept, g, like=past)

    def dupdate() -> str:
        if w is None:
            return e.op("Slice", [g, e.ints([0]), e.op("Reshape", [n, e.ints([1])]) if e.value(n) is None
                                  else e.ints([int(e.value(n))]), e.ints([axis])], like=upd)
        slots = e.op("Add", [e.op("Unsqueeze", [w, e.ints([1])]), e.op("Unsqueeze", [_ramp(e, n), e.ints([0])])])
        if circular:
            slots = e.op("Mod", [slots, m])
        slots = e.op("Unsqueeze", [slots, e.ints(spread)]) if spread else slots
        slots = e.op("Expand", [slots, e.shape_of(upd)])
        return e.op("GatherElements", [g, slots], axis=axis, like=upd)

    return [dpast, dupdate, None][:len(node.inputs)]


def _ramp(e: Emitter, n: str) -> str:
    """int64 ``[0, 1, ..., n-1]`` for a 0-d int64 ``n`` (a constant when ``n`` is)."""
    v = e.value(n)
    if v is not None:
        return e.const(np.arange(int(v), dtype=np.int64))
    return e.op("Range", [e.const(np.int64(0)), n, e.const(np.int64(1))], shape=(None,), dtype=np.dtype(np.int64))
