"""Helpers every rule family shares, in one spelling: attributes as the runtimes read them and optional inputs.
(The algebra rules write their formulas in is :mod:`revgraph.autodiff.algebra`; constant tables are in
:mod:`.tables`.) No rule family imports another family's private names (tests/test_architecture.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx

from ...ir import Node
from .tables import arange

if TYPE_CHECKING:
    from ..algebra import Val
    from ..emitter import Emitter


def f32_attr(node: Node, name: str, default: float) -> float:
    """A float attribute as the runtimes see it: ONNX float attributes are 32-bit, so the derivative must use the
    rounded value the forward used."""
    return float(np.float32(node.attrs.get(name, default)))


def optional_input(node: Node, i: int) -> str | None:
    """The name of ``node``'s input ``i``, or ``None`` when it is absent or empty (an omitted optional input)."""
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i] else None


# ---- shapes and indices (portA)
# Shape and index plumbing several families share (indexing, scatter, rotary, attention, shape, norm, dropout).
# Dimensions: :func:`static_dim` is the size when the graph is built knows it; :func:`dim` the size as a 0-d int64
# value (a constant when static). A "shape part" is a list of ints when static, else a 1-D int64 value.

#: ONNX tensor types (``Cast``'s ``to``) of the float32, float64 and int64 index arithmetic of the rules
F32, F64, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64


def padded(values: Sequence, n: int) -> list:
    """``values`` cut or padded with ``None`` to length ``n`` (the cotangents of optional outputs, the gradients
    of optional inputs)."""
    return (list(values) + [None] * n)[:n]


def node_axis(e: Emitter, node: Node, x: str, default: int, *, required: bool = True) -> int:
    """The node's ``axis`` attribute as a non-negative axis of ``x`` (left negative when the rank is unknown and
    not ``required``: the reference evaluator's GatherElements mishandles negative axes)."""
    axis = int(node.attrs.get("axis", default))
    if axis >= 0:
        return axis
    r = e.need_rank(x, node) if required else e.rank(x)
    return axis if r is None else axis + r


def static_dim(e: Emitter, x: str, axis: int) -> int | None:
    """The size of ``x`` along ``axis`` (negative counts from the end) when it is static, else ``None``."""
    dims = e.dims(x)
    if dims is not None and -len(dims) <= axis < len(dims) and isinstance(dims[axis], int):
        return dims[axis]
    return None


def dim(e: Emitter, x: str, axis: int) -> str:
    """The size of ``x`` along the non-negative ``axis`` as a 0-d int64 value (a constant when static)."""
    n = static_dim(e, x, axis)
    if n is not None:
        return e.const(np.int64(n))
    return e.op("Squeeze", [e.op("Shape", [x], start=axis, end=axis + 1)], shape=(), dtype=np.int64)


def shape_part(e: Emitter, x: str, start: int, end: int | None = None) -> list[int] | str:
    """``shape(x)[start:end]``: a list of ints when those dimensions are static, else a ``Shape`` value."""
    dims = e.dims(x)
    if dims is not None:
        part = list(dims[start:end])
        if all(isinstance(d, int) for d in part):
            return part
    attrs = {"start": start} if end is None else {"start": start, "end": end}
    return e.op("Shape", [x], **attrs)


def cat_shapes(e: Emitter, parts: list[list[int] | str]) -> str:
    """A 1-D int64 shape made of ``parts`` (int lists or 1-D int64 values); a constant when all are known."""
    known = [p if isinstance(p, list) else e.value(p) for p in parts]
    if all(k is not None for k in known):
        return e.dims_const([int(d) for k in known for d in np.asarray(k).reshape(-1)])
    names = [e.ints(p) if isinstance(p, list) else p for p in parts]
    return names[0] if len(names) == 1 else e.op("Concat", names, axis=0)


def nonneg(e: Emitter, idx: str, n: str) -> str:
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


def flat_indices(e: Emitter, idx: str, n: str) -> str:
    """``idx`` as int64 of shape ``[K]`` with every entry in ``[0, n)`` (``n``: a 0-d int64 value)."""
    v = e.value(idx)
    if v is not None:
        flat = e.const(np.asarray(v, dtype=np.int64).reshape(-1))
    else:
        if e.dtype(idx) != np.int64:
            idx = e.op("Cast", [idx], to=I64)
        flat = e.op("Reshape", [idx, e.ints([-1])])
    return nonneg(e, flat, n)


# ---- geometry and grids (portB)


def product(factors: Sequence[Val]) -> Val:
    """The product of ``factors`` (at least one), left to right: one ``Mul`` per factor after the first, as
    multilinear interpolation weights multiply their per-axis weights (GridSample, DeformConv)."""
    out = factors[0]
    for f in factors[1:]:
        out = out * f
    return out


def zeros_of_shape(e: Emitter, shape: str, like: str) -> str:
    """Zeros of the shape held by the int64 value ``shape``, in ``like``'s dtype (``CastLike`` when that dtype is
    unknown: a float32 zero would mistype a float64 gradient); the tables scatters add into."""
    dt = e.dtype(like)
    if dt is not None:
        return e.op("ConstantOfShape", [shape], value=np.zeros(1, dtype=dt))
    return e.op("CastLike", [e.op("ConstantOfShape", [shape], value=np.zeros(1, dtype=np.float32)), like])


#: a size known while the graph is built (an int), or the name of a 0-d int64 value computed at run time
Dim = int | str


def dim_of(e: Emitter, x: str, axis: int) -> Dim:
    """``shape(x)[axis]``: an int when static, else a 0-d int64 value."""
    d = e.dims(x)
    if d is not None and isinstance(d[axis], int):
        return d[axis]
    return e.op("Reshape", [e.op("Shape", [x], start=axis, end=axis + 1), e.ints([])])


def i64(e: Emitter, v: Dim) -> str:
    """The size ``v`` as a 0-d int64 value."""
    return e.const(np.asarray(v, np.int64)) if isinstance(v, (int, np.integer)) else v


def int_range(e: Emitter, n: Dim, dtype: type = np.int64) -> str:
    """``[0, 1, .., n-1]`` (1-D, ``dtype``): a constant when ``n`` is static and small (:mod:`.tables`)."""
    if isinstance(n, (int, np.integer)):
        return arange(e, int(n), dtype)
    r = e.op("Range", [e.const(np.int64(0)), n, e.const(np.int64(1))])
    return r if dtype is np.int64 else e.op("Cast", [r], to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def dims_product(e: Emitter, *dims: Dim) -> Dim:
    """The product of sizes (ints or 0-d int64 values): an int when all are static."""
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    out = i64(e, dims[0])
    for d in dims[1:]:
        out = e.op("Mul", [out, i64(e, d)])
    return out


def as1(e: Emitter, v: Dim) -> list[int] | str:
    """``[v]``: an int list when static, else a 1-D int64 value (for :func:`.conv.shape_cat`; explicit sizes
    instead of ``-1``, which onnxruntime refuses next to a copied 0: no rois)."""
    return [v] if isinstance(v, int) else e.op("Unsqueeze", [v, e.ints([0])])


def numel(e: Emitter, x: str) -> Dim:
    """The number of elements of ``x``: an int when its shape is static, else a ``Size`` value."""
    s = e.shape(x)
    return int(np.prod(s)) if s is not None else e.op("Size", [x])


class EmitterContext:
    """What the algebra's arithmetic reads of a rule context, its emitter ``e``: for helpers that build values
    outside a rule and are called with an :class:`~revgraph.autodiff.emitter.Emitter` alone (Resize's run-time
    interpolation matrices, :func:`.resize.resize_matrix_graph`). Strong-zero products (``Val.times``,
    ``select``, ``weigh``) need the rule's :class:`~revgraph.autodiff.context.Ctx`."""

    __slots__ = ("e",)

    def __init__(self, e: Emitter):
        self.e = e

    def val(self, name: str) -> Val:
        """``name`` as a :class:`~revgraph.autodiff.algebra.Val`."""
        from ..algebra import Val

        return Val(self, name)  # type: ignore[arg-type]  (the arithmetic reads only .e)
