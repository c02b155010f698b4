"""VJPs of indexing operators (ONNX operator spec, "Gather", "GatherElements", "GatherND", "ScatterND",
"ScatterElements", "OneHot", "TopK"; derivatives as in PyTorch's ``tools/autograd/derivatives.yaml``:
``index_select_backward``, ``gather_backward``, ``index_put``/``scatter`` and ``topk`` ->
``value_selecting_reduction_backward``).

A gather reads elements; its transpose adds the cotangent back at the read positions with a scatter whose
``reduction="add"`` accumulates repeated indices (DESIGN.md section 5). ``Gather`` along axis 0 returns the
rows as a :class:`SparseGrad` (indices normalised into ``[0, n)``, since ``Gather`` allows negative indices
and the sparse contract does not); the backward pass concatenates and densifies them.

Every reducing scatter emitted here is ``ScatterElements``: onnxruntime's ``ScatterND`` with a reduction
races on repeated indices when it runs on several threads, so the ScatterND-shaped transposes (GatherND, the
``mul`` scale of ScatterND) go through :func:`~revgraph.autodiff.sparse.scatter_nd_reduce` (see
``autodiff/sparse.py``). ``ScatterND`` without a reduction, at unique positions, stays.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...errors import GraphError
from ...ir import Node
from ..registry import Emitter, vjp
from ..sparse import SparseGrad, scatter_nd_reduce

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
        return e.ints([int(d) for k in known for d in np.asarray(k).reshape(-1)])
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
def gather(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX "Gather": ``y[i0..i(a-1), j.., k..] = x[i0.., idx[j..], k..]``. The transpose adds ``g`` into
    zeros at the gathered positions (PyTorch ``index_select_backward``: ``index_add``). Axis 0 gives a
    :class:`SparseGrad` of rows; other axes a dense ``ScatterElements(reduction="add")``."""
    data, idx = node.inputs
    g = out_grads[0]
    if not e.need[0]:
        return [None, None]
    axis = _axis(e, node, data, 0)  # axis 0 needs no rank: the rows' shape can come from Shape(data)
    flat = _flat_indices(e, idx, _dim(e, data, axis))
    rows = g  # with 1-D indices the cotangent already has the rows' shape
    if e.rank(idx) != 1:
        parts = [_shape_part(e, data, 0, axis), _shape_part(e, flat, 0), _shape_part(e, data, axis + 1)]
        static = all(isinstance(p, list) for p in parts)
        shape = tuple(d for p in parts for d in p) if static else None
        rows = e.op("Reshape", [g, _cat_shapes(e, parts)], shape=shape, dtype=e.dtype(g))
    if axis == 0:
        return [SparseGrad(flat, rows, data), None]
    # ScatterElements needs indices of the updates' shape: the flat indices along `axis`, broadcast.
    r = e.need_rank(data, node)
    lined = e.op("Unsqueeze", [flat, e.ints([d for d in range(r) if d != axis])])
    spread = e.op("Expand", [lined, e.shape_of(rows)])
    dx = e.op("ScatterElements", [e.zeros_like(data), spread, rows], axis=axis, reduction="add", like=data)
    return [dx, None]


@vjp("GatherElements")
def gather_elements(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX "GatherElements": ``y[i][j] = x[idx[i][j]][j]`` (axis 0). The transpose is
    ``ScatterElements(zeros, idx, g, reduction="add")`` (PyTorch ``gather_backward``: ``scatter_add``);
    ScatterElements takes negative indices as GatherElements does."""
    data, idx = node.inputs
    if not e.need[0]:
        return [None, None]
    axis = _axis(e, node, data, 0, required=False)
    dx = e.op("ScatterElements", [e.zeros_like(data), idx, out_grads[0]], axis=axis, reduction="add", like=data)
    return [dx, None]


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
def gather_nd(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX "GatherND": ``y[p..] = x[batch(p), idx[p..]]``. The transpose has the semantics of
    ``ScatterND(zeros, idx', g, reduction="add")``, where ``idx'`` holds the batch positions explicitly and
    non-negative indices, written race free by :func:`~revgraph.autodiff.sparse.scatter_nd_reduce`."""
    data, idx = node.inputs
    if not e.need[0]:
        return [None, None]
    b = int(node.attrs.get("batch_dims", 0))
    full = _nonneg(e, idx, _nd_dims(e, data, idx, b))
    if b:
        full = e.op("Concat", [_batch_coords(e, node, idx, b), full], axis=-1)
    return [scatter_nd_reduce(e, e.zeros_like(data), full, out_grads[0], "add"), None]


def _nd_dims(e: Emitter, data: str, idx: str, b: int) -> str:
    """``shape(data)[b:b+m]`` as a 1-D int64 value (a constant when static), ``m = idx.shape[-1]``: the
    extents that ND indices (GatherND after ``b`` batch dimensions, ScatterND with ``b = 0``) count in."""
    m = e.dims(idx)[-1] if e.dims(idx) else None
    dims = _shape_part(e, data, b, b + m) if isinstance(m, int) else None
    if dims is None:  # the index depth is only known at run time: slice shape(x)[b:b+m] with it
        depth = e.op("Shape", [idx], start=-1)
        dims = e.op("Slice", [e.op("Shape", [data]), e.ints([b]), e.op("Add", [e.ints([b]), depth])])
    return _cat_shapes(e, [dims])


def _scatter_vjp(e: Emitter, node: Node, g: str, scatter: str, gather: str, attrs: dict) -> list:
    """Shared VJP of ScatterND / ScatterElements (``gather`` is the matching read). ``none``: the data
    gradient is ``g`` with the written positions zeroed, and the updates read ``g`` there; ``add``: ``g``
    passes to data unchanged; ``mul``: ``g`` times the product of the updates written at each position."""
    data, idx, upd = node.inputs
    reduction = node.attrs.get("reduction", "none")
    grads: list = [None, None, None]
    if reduction in ("max", "min") or (reduction == "mul" and e.need[2]):
        which = "updates and data" if reduction != "mul" else "updates"
        raise GraphError(f"{node.label()}: no gradient with respect to {which} for reduction={reduction!r}")
    if e.need[0]:
        if reduction == "none":
            grads[0] = e.op(scatter, [g, idx, e.zeros_like(upd)], like=data, **attrs)
        elif reduction == "add":
            grads[0] = g
        else:
            grads[0] = e.op("Mul", [g, _product_at(e, scatter, data, idx, upd, attrs)], like=data)
    if e.need[2]:
        src = _fit_to_indices(e, node, g, idx, attrs["axis"]) if "axis" in attrs else g
        if gather == "GatherElements" and e.rank(src) == 1:
            # The same read; the reference evaluator's GatherElements (numpy.choose) takes at most 64 entries
            # along the axis, and the race-free scatters of autodiff/sparse.py are 1-D.
            grads[2] = e.op("Gather", [src, idx], axis=0, like=upd)
        else:
            grads[2] = e.op(gather, [src, idx], like=upd, **attrs)
    return grads


def _product_at(e: Emitter, scatter: str, data: str, idx: str, upd: str, attrs: dict) -> str:
    """Ones of ``data``'s shape times the product of the updates written at each position (the data
    gradient's scale of a ``mul`` scatter). ScatterElements' kernel is sequential; ScatterND(mul) races on
    repeated indices in onnxruntime, so its product goes through
    :func:`~revgraph.autodiff.sparse.scatter_nd_reduce` (with non-negative indices)."""
    if scatter == "ScatterElements":
        return e.op(scatter, [e.ones_like(data), idx, upd], reduction="mul", like=data, **attrs)
    return scatter_nd_reduce(e, e.ones_like(data), _nonneg(e, idx, _nd_dims(e, data, idx, 0)), upd, "mul")


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
def scatter_nd(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX "ScatterND" (reduction none/add/mul): transpose of GatherND on the updates, masking or
    pass-through on the data (PyTorch ``index_put``: ``values`` gets ``grad[indices]``)."""
    return _scatter_vjp(e, node, out_grads[0], "ScatterND", "GatherND", {})


@vjp("ScatterElements")
def scatter_elements(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX "ScatterElements" (reduction none/add/mul): as ScatterND with GatherElements along ``axis``
    (PyTorch ``scatter``/``scatter_add``: ``src`` gets ``grad.gather(dim, index)``)."""
    return _scatter_vjp(e, node, out_grads[0], "ScatterElements", "GatherElements",
                        {"axis": _axis(e, node, node.inputs[0], 0, required=False)})


@vjp("OneHot")
def one_hot(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX "OneHot": ``y = where(hot, on, off)`` with ``values = [off, on]``, so ``d values =
    [sum(g * (1 - hot)), sum(g * hot)]``. Indices and depth select positions and get no gradient."""
    idx, depth, values = node.inputs
    if not e.need[2]:
        return [None, None, None]
    g = out_grads[0]
    # The mask comes from the forward's own OneHot (same index, depth and value types, same axis), so it
    # runs wherever the forward runs; elementwise ops then keep the backward differentiable.
    hot = e.op("OneHot", [idx, depth, _vector(e, [0, 1], values)], axis=int(node.attrs.get("axis", -1)))
    on = e.op("ReduceSum", [e.op("Mul", [g, hot])], keepdims=0)
    off = e.op("ReduceSum", [e.op("Mul", [g, e.op("Sub", [e.scalar(1.0, g), hot])])], keepdims=0)
    parts = [e.op("Mul", [off, _vector(e, [1, 0], values)]), e.op("Mul", [on, _vector(e, [0, 1], values)])]
    return [None, None, e.op("Add", parts, like=values)]


@vjp("TopK")
def top_k(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX "TopK": the values output reads ``x`` at the returned indices along ``axis``, so ``g`` goes back
    there (PyTorch ``value_selecting_reduction_backward``); the indices output carries no gradient."""
    x, k = node.inputs
    g = out_grads[0]
    if g is None or not e.need[0]:
        return [None, None]
    axis = _axis(e, node, x, -1, required=False)
    dx = e.op("ScatterElements", [e.zeros_like(x), node.outputs[1], g], axis=axis, reduction="add", like=x)
    return [dx, None]
