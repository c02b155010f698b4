"""VJPs of the scatters (ONNX operator spec, "ScatterND", "ScatterElements"; derivatives as in PyTorch's
``tools/autograd/derivatives.yaml``: ``index_put``, ``scatter`` and ``scatter_reduce``).

Every reducing scatter emitted here is ``ScatterElements``: onnxruntime's ``ScatterND`` with a reduction
races on repeated indices when it runs on several threads, so the ScatterND-shaped transposes (the counts of
tied max/min updates, the updates that land) go through ``ScatterElements`` on row numbers
(:func:`~revgraph.autodiff.sparse.scatter_nd_reduce`, :func:`_nd_rows`) and the ``mul`` scale of ScatterND
through ScatterElements on the rows of the data. ``ScatterND`` without a reduction, at unique positions, stays.

Reducing scatters (``reduction`` mul, max, min) differentiate as PyTorch's ``scatter_reduce`` with
``include_self=True`` does (``prod``, ``amax``, ``amin``), with two differences: the product of the other
updates at a position is formed without dividing (exact at zeros, ``autodiff/segments.py``), and every
gradient here is written in ONNX operators, so it can be differentiated again.

``reduction="none"`` with repeated indices (issue 27): the ONNX spec says indices "should not" repeat, and
onnxruntime and onnx's reference evaluator write the updates in order, so the last update written to a
position is the one the forward keeps. The gradient is that forward's: only the update that lands gets the
cotangent, the ones it overwrites 0 (:func:`_landed`; PyTorch's ``scatter`` backward gives every duplicate
the cotangent instead). Constant indices are resolved when the graph is built (nothing is emitted when none
repeats); indices known only at run time are resolved in the graph, race free (the largest update number
written at each position, a ``ScatterElements(reduction="max")``), with a warning, since another runtime may
write in another order.

The cotangents' movement and the formulas are written in the algebra; index tables (ScatterND's row numbers,
the last-write table, shape products) are shape plumbing and stay :meth:`~revgraph.autodiff.emitter.Emitter.op`
calls.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ...warn import warn
from ..algebra import Val
from ..context import Ctx
from ..emitter import Emitter
from ..group_products import others_product
from ..registry import vjp
from ..sparse import scatter_nd_reduce
from ._common import cat_shapes, dim, node_axis, nonneg, shape_part
from .indexing import nd_dims


def _scatter_vjp(ctx: Ctx, node: Node, g: str, scatter: str, gather: str, attrs: dict) -> list:
    """Shared VJP of ScatterND / ScatterElements (``gather`` is the matching read), by ``reduction``; ``p`` is
    a position of the data and ``k`` runs over the updates written there.

    - ``none``: the data gradient is ``g`` with the written positions zeroed; the updates read ``g``, where they
      land (:func:`_landed`: an update overwritten by a later one at the same position gets 0).
    - ``add``: ``g`` passes to the data unchanged; the updates read ``g``.
    - ``mul``: ``y[p] = x[p] prod_k u_k``, so ``dx[p] = g[p] prod_k u_k`` and ``du_k = g[p] x[p] prod_{j != k}
      u_j`` (duplicates included; the product of the others without dividing by ``u_k``, so exact at zeros:
      :func:`~revgraph.autodiff.group_products.others_product`).
    - ``max``/``min``: :func:`_extremum_vjp`.
    """
    e, (data, idx, upd), gv = ctx.e, node.inputs, ctx.val(g)
    reduction = node.attrs.get("reduction", "none")
    if reduction in ("max", "min"):
        return _extremum_vjp(ctx, node, g, scatter, gather, attrs)
    if reduction == "none":  # (the written positions are zeroed whatever the order of the writes)
        ddata = lambda: gv.apply(scatter, idx, e.zeros_like(upd), like=data, **attrs)
    elif reduction == "add":
        ddata = g
    else:  # dx[p] = g[p] prod_k u_k
        ddata = lambda: gv.apply("Mul", _product_at(ctx, node, scatter, attrs), like=data)

    def dupdates() -> Val:
        if reduction == "mul":  # du_k = g[p] x[p] prod_{j != k} u_j
            read = _read(e, node, gv.apply("Mul", data, like=data), gather, attrs)
            return read.apply("Mul", _others_at(ctx, node, scatter), like=upd)
        read = _read(e, node, gv, gather, attrs)
        landed = _landed(ctx, node, scatter, attrs) if reduction == "none" else None
        return read if landed is None else read.select(landed, like=upd)

    return [ddata, None, dupdates]


def _read(e: Emitter, node: Node, v: Val, gather: str, attrs: dict) -> Val:
    """``v`` (data-shaped) read at the positions the scatter writes, in the updates' shape."""
    idx, upd = node.inputs[1], node.inputs[2]
    src = v.ctx.val(_fit_to_indices(v.ctx, node, v.name, idx, attrs["axis"])) if "axis" in attrs else v
    if gather == "GatherElements" and src.rank == 1:
        # The same read; the reference evaluator's GatherElements (numpy.choose) takes at most 64 entries
        # along the axis, and the race-free scatters of autodiff/sparse.py are 1-D.
        return src.apply("Gather", idx, axis=0, like=upd)
    return src.apply(gather, idx, like=upd, **attrs)


def _extremum_vjp(ctx: Ctx, node: Node, g: str, scatter: str, gather: str, attrs: dict) -> list:
    """``reduction`` max/min: ``y[p]`` is the extremum of ``x[p]`` and the ``u_k`` written at ``p``. Ties split
    equally (DESIGN.md section 5; PyTorch's ``scatter_reduce`` amax/amin backward does the same): ``g[p]``
    goes in equal shares to ``x[p]`` if it equals ``y[p]`` and to every ``u_k`` that equals it. The shares
    count the attaining elements with a race-free scatter-add of ones; the rest is elementwise."""
    e, (data, _, upd), y = ctx.e, ctx.vals(*node.inputs), ctx.val(node.outputs[0])

    @cache
    def shares() -> tuple[Val, Val, Val]:
        """``(hit_x, hit_u, share)``: where the data and the updates attain ``y``, and ``g`` per attaining element."""
        hit_x, hit_u = data.eq(y), upd.eq(_read(e, node, y, gather, attrs))
        count = hit_x.indicator(data).apply(
            "Add", _scatter_add(ctx, node, scatter, hit_u.indicator(upd).name, attrs), like=data)
        share = ctx.val(g).apply("Div", count, like=data)  # count >= 1 where hit_x, at every position read where hit_u
        return hit_x, hit_u, share

    def ddata() -> Val:
        hit_x, _, share = shares()
        return share.select(hit_x, like=data)

    def dupdates() -> Val:
        _, hit_u, share = shares()
        return _read(e, node, share, gather, attrs).select(hit_u, like=upd)

    return [ddata, None, dupdates]


def _scatter_add(ctx: Ctx, node: Node, scatter: str, vals: str, attrs: dict) -> str | Val:
    """Zeros of the data's shape with ``vals`` (updates-shaped) added at the positions the scatter writes,
    repeated positions accumulating; race free (ScatterElements' kernel is sequential; ScatterND's semantics
    through :func:`~revgraph.autodiff.sparse.scatter_nd_reduce`)."""
    e, (data, idx, _) = ctx.e, node.inputs
    if scatter == "ScatterElements":
        return ctx.val(e.zeros_like(data)).apply(scatter, idx, vals, like=data, reduction="add", **attrs)
    return scatter_nd_reduce(e, e.zeros_like(data), nonneg(e, idx, nd_dims(e, data, idx, 0)), vals, "add")


def _product_at(ctx: Ctx, node: Node, scatter: str, attrs: dict) -> str | Val:
    """Ones of the data's shape times the product of the updates written at each position (the data
    gradient's scale of a ``mul`` scatter), with the sequential ``ScatterElements(reduction="mul")`` kernel:
    ScatterND(mul) races on repeated indices in onnxruntime. ScatterND's K index tuples become row numbers
    (:func:`_nd_rows`) of the data viewed as R rows of S elements: rows of a static S are scattered on the
    flat view (as :func:`~revgraph.autodiff.sparse.scatter_nd_reduce` does, ~2.4x faster than the [R, S] view
    in onnxruntime), others on the [R, S] view with the updates as [K, S]. Either way the scatter's updates
    have a static length along its axis whenever K is static, so differentiating it again with respect to
    the updates works (:func:`_others_at` needs that length). An index depth known only at run time goes
    through ``scatter_nd_reduce``."""
    e, (data, idx, upd) = ctx.e, node.inputs
    if scatter == "ScatterElements":
        return ctx.val(e.ones_like(data)).apply(scatter, idx, upd, like=data, reduction="mul", **attrs)
    depth = _depth(e, idx)
    if depth is None:
        return scatter_nd_reduce(e, e.ones_like(data), nonneg(e, idx, nd_dims(e, data, idx, 0)), upd, "mul")
    rows = _nd_rows(ctx, node, depth)
    count, width = shape_part(e, rows, 0), _row_width(e, data, depth)
    if isinstance(count, list) and isinstance(width, list) and count[0] * width[0] == 0:
        return e.ones_like(data)  # nothing written (onnxruntime rejects some empty scatters)
    if isinstance(width, list):
        size = count[0] * width[0] if isinstance(count, list) else None
        flat = ctx.val(e.ones_like(data)).reshape([-1])
        vals = ctx.val(upd).out("Reshape", e.ints([-1]), shape=(size,), dtype=e.dtype(upd))
        out = flat.apply("ScatterElements", _row_elements(ctx, rows, width[0]), vals, like=None, axis=0,
                         reduction="mul")
        return out.reshape(e.shape_of(data), like=data)
    dt = e.dtype(data)
    ones = e.op("ConstantOfShape", [cat_shapes(e, [_positions(e, data, depth), width])],
                value=np.ones(1, dtype=dt if dt is not None else np.float32))
    ones = ones if dt is not None else e.op("CastLike", [ones, data])
    spread = ctx.val(rows).unsqueeze([1]).expand(cat_shapes(e, [count, width]))
    vals = ctx.val(upd).reshape(cat_shapes(e, [count, width]))
    out = ctx.val(ones).apply("ScatterElements", spread, vals, like=None, axis=0, reduction="mul")
    return out.reshape(e.shape_of(data), like=data)


def _row_elements(ctx: Ctx, rows: str, width: int) -> str | Val:
    """int64 [K * width]: ``rows[k] * width + j`` for ``j < width``, row-major (a constant for constant rows)."""
    rv, j = ctx.value(rows), np.arange(width, dtype=np.int64)
    if rv is not None:
        return ctx.e.const((rv[:, None] * width + j).reshape(-1))
    return (ctx.val(rows).unsqueeze([1]) * np.asarray(width, dtype=np.int64) + j).reshape([-1])


def _row_width(e: Emitter, x: str, start: int) -> list[int] | str:
    """``[prod(x.shape[start:])]``: a one-int list when static, else a 1-D int64 value of length 1."""
    part = shape_part(e, x, start)
    if isinstance(part, list):
        return [int(np.prod(part, dtype=np.int64))]
    return e.op("ReduceProd", [part], keepdims=1)


def _depth(e: Emitter, idx: str) -> int | None:
    """The index depth ``m = idx.shape[-1]`` of ScatterND / GatherND when static."""
    dims = e.dims(idx)
    return dims[-1] if dims and isinstance(dims[-1], int) else None


def _positions(e: Emitter, data: str, depth: int) -> list[int] | str:
    """``[prod(data.shape[:depth])]``: the number of positions index tuples of ``depth`` entries address."""
    head = shape_part(e, data, 0, depth)
    if isinstance(head, list):
        return [int(np.prod(head, dtype=np.int64))]
    return e.op("ReduceProd", [head], keepdims=1)


def _nd_rows(ctx: Ctx, node: Node, depth: int) -> str:
    """int64 [K]: ScatterND's index tuples (K of them, ``depth`` entries each; negative entries counted from
    the end) as row numbers of the [prod(data.shape[:depth]), ...] view of the data, row-major (Horner's rule
    over the dimensions; a constant for constant indices and static dimensions)."""
    e, (data, idx, _) = ctx.e, node.inputs
    full = nonneg(e, idx, nd_dims(e, data, idx, 0))
    if e.dtype(full) != np.int64:
        full = ctx.val(full).cast(np.int64).name
    dims = [dim(e, data, j) for j in range(depth)]
    fv, dv = e.value(full), [e.value(d) for d in dims]
    if fv is not None and all(d is not None for d in dv):
        rows = np.zeros(fv.shape[:-1], dtype=np.int64)
        for j in range(depth):
            rows = rows * int(dv[j]) + fv[..., j]
        return e.const(rows.reshape(-1))
    column = lambda j: ctx.val(full).apply("Gather", np.asarray(j, dtype=np.int64), like=None, axis=-1)
    rows = column(0)
    for j in range(1, depth):
        rows = rows * dims[j] + column(j)
    return rows.reshape([-1]).name


def _others_at(ctx: Ctx, node: Node, scatter: str) -> str | Val:
    """For each update of a ``mul`` scatter, the product of the other updates written to the same position
    (updates-shaped; :func:`~revgraph.autodiff.group_products.others_product`). ScatterElements: grouped along
    ``axis`` by the (non-negative) index, line by line. ScatterND: the updates as [K, S] rows grouped by
    :func:`_nd_rows`. The number of updates along the grouped axis must be static (the scans' length)."""
    e, (data, idx, upd) = ctx.e, node.inputs
    if scatter == "ScatterElements":
        axis = node_axis(e, node, data, 0)
        n = _static_dim(e, node, idx, axis)
        keys = nonneg(e, idx, dim(e, data, axis))
        return others_product(e, upd, keys, axis, n)
    dims = e.dims(idx)
    lead = list(dims[:-1]) if dims is not None else None
    if lead is None or not all(isinstance(d, int) for d in lead) or not isinstance(dims[-1], int):
        raise _static_error(node, idx)
    count = int(np.prod(lead, dtype=np.int64))
    if count <= 1:
        return e.ones_like(upd)
    rows = _nd_rows(ctx, node, dims[-1])
    rv = e.value(rows)
    keys = e.const(rv.reshape(count, 1)) if rv is not None else \
        ctx.val(rows).out("Reshape", e.ints([count, 1]), shape=(count, 1), dtype=np.int64).name
    vals = ctx.val(upd).reshape(cat_shapes(e, [[count], _row_width(e, upd, len(lead))]))
    others = others_product(e, vals.name, keys, 0, count)
    return ctx.val(others).reshape(e.shape_of(upd), like=upd)


def _static_dim(e: Emitter, node: Node, x: str, axis: int) -> int:
    dims = e.dims(x)
    if dims is None or not isinstance(dims[axis], int):
        raise _static_error(node, x)
    return dims[axis]


def _static_error(node: Node, idx: str) -> GraphError:
    return GraphError(f"{node.label()}: the gradient with respect to the updates of reduction='mul' needs the "
                      f"shape of the indices {idx!r} when the graph is built; declare the shapes of the graph inputs")


def _fit_to_indices(ctx: Ctx, node: Node, g: str, idx: str, axis: int) -> str:
    """``g`` cut to the extent of ``idx`` in every dimension but ``axis``. ScatterElements allows indices
    smaller than the data there; GatherElements reads the same positions from a cut ``g`` (the reference
    evaluator's GatherElements insists on equal sizes outside ``axis``)."""
    e = ctx.e
    r = e.need_rank(g, node)
    axis = axis % r
    sg, si = e.shape(g), e.shape(idx)
    if sg is not None and si is not None and all(
            a == b for d, (a, b) in enumerate(zip(sg, si, strict=True)) if d != axis):
        return g
    ends = cat_shapes(e, [shape_part(e, idx, 0, axis), [np.iinfo(np.int64).max], shape_part(e, idx, axis + 1)])
    return ctx.val(g).apply("Slice", e.ints([0] * r), ends, like=None).name


@vjp("ScatterND", bounded=True, finite=True, reads="all", moves=True)
def scatter_nd(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "ScatterND" (every reduction, :func:`_scatter_vjp`): transpose of GatherND on the updates, masking
    or pass-through on the data (PyTorch ``index_put``: ``values`` gets ``grad[indices]``)."""
    return _scatter_vjp(ctx, node, cts[0], "ScatterND", "GatherND", {})


@vjp("ScatterElements", bounded=True, finite=True, reads="all", moves=True)
def scatter_elements(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "ScatterElements" (every reduction, :func:`_scatter_vjp`): as ScatterND with GatherElements along
    ``axis`` (PyTorch ``scatter``/``scatter_add``/``scatter_reduce``: ``src`` gets ``grad.gather(dim, index)``
    times the reduction's local derivative)."""
    return _scatter_vjp(ctx, node, cts[0], "ScatterElements", "GatherElements",
                        {"axis": node_axis(ctx.e, node, node.inputs[0], 0, required=False)})


# ---------------------------------------------------------------------------------------------- overwrites


def last_writes(targets: np.ndarray) -> np.ndarray:
    """bool [K]: for K writes in order to the positions ``targets`` ([K, t] ints, one row per write), whether
    write k is the last one to its position (the one that lands)."""
    keep = np.zeros(len(targets), dtype=bool)
    if len(targets):
        _, first_from_end = np.unique(targets[::-1], axis=0, return_index=True)
        keep[len(targets) - 1 - first_from_end] = True
    return keep


def _landed(ctx: Ctx, node: Node, scatter: str, attrs: dict) -> str | None:
    """bool, broadcastable to the updates: the updates of a ``reduction="none"`` scatter that the forward keeps
    (the last written to each position, module doc), or ``None`` when they all land (constant indices that do
    not repeat). A constant for constant indices and dimensions; else computed in the graph, with a warning."""
    e, (data, idx, upd) = ctx.e, node.inputs
    if scatter == "ScatterElements":
        axis = node_axis(e, node, data, 0)
        keys = nonneg(e, idx, dim(e, data, axis))
        kv = e.value(keys)
        if kv is not None:
            grid = np.indices(kv.shape).reshape(kv.ndim, -1)
            grid[axis] = kv.reshape(-1)
            keep = last_writes(grid.T)
            return None if keep.all() else e.const(keep.reshape(kv.shape))
        _warn_order(node)
        ids = ctx.val(e.op("Range", [e.const(np.int64(0)), e.op("Size", [idx]), e.const(np.int64(1))]))
        ids = ids.reshape(e.op("Shape", [idx])).name
        top = e.op("ScatterElements", [e.op("ConstantOfShape", [e.op("Shape", [data])],
                                             value=np.array([-1], np.int64)), idx, ids],
                   axis=axis, reduction="max", shape=e.dims(data), dtype=np.dtype(np.int64))
        read = ctx.val(_fit_to_indices(ctx, node, top, idx, axis)).apply("GatherElements", idx, like=None, axis=axis)
        return read.eq(ids).name
    depth = _depth(e, idx)
    if depth is None:
        raise GraphError(f"{node.label()}: the gradient with respect to the updates needs the index depth (the last "
                         f"dimension of {idx!r}) when the graph is built; {e.shape_advice()}")
    lead = e.need_rank(idx, node) - 1
    trail = e.need_rank(upd, node) - lead  # the slice dimensions each update tuple writes
    rows = _nd_rows(ctx, node, depth)
    rv = e.value(rows)
    if rv is not None:
        keep = last_writes(rv.reshape(-1, 1))
        if keep.all():
            return None
        lead_shape = np.shape(e.value(idx))[:-1] if e.value(idx) is not None else e.shape(idx)[:-1]
        return e.const(keep.reshape(tuple(lead_shape) + (1,) * trail))
    _warn_order(node)
    ids = e.op("Range", [e.const(np.int64(0)), e.op("Size", [rows]), e.const(np.int64(1))])
    top = e.op("ConstantOfShape", [cat_shapes(e, [_positions(e, data, depth)])], value=np.array([-1], np.int64))
    top = e.op("ScatterElements", [top, rows, ids], axis=0, reduction="max")
    hit = ctx.val(top).apply("Gather", rows, like=None, axis=0).eq(ids)
    return hit.reshape(cat_shapes(e, [shape_part(e, idx, 0, lead), [1] * trail])).name


def _warn_order(node: Node) -> None:
    warn(f"{node.label()}: reduction='none' with indices known only at run time, which may repeat; where "
         "they do, the gradient follows the forward as onnxruntime and onnx's reference evaluator run it (the "
         "last update written to a position gets its cotangent, the ones it overwrites 0); a runtime that "
         "writes repeated indices in another order computes another forward")
