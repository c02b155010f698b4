"""Helpers every rule family shares, in one spelling: attributes as the runtimes read them and optional inputs.
(The algebra rules write their formulas in is :mod:`revgraph.autodiff.algebra`; constant tables are in
:mod:`.tables`.) No rule family imports another family's private names (tests/test_architecture.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx

from ...ir import Node

if TYPE_CHECKING:
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

#: the ONNX type number of int64 (``Cast``'s ``to``)
INT64 = onnx.TensorProto.INT64


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
            idx = e.op("Cast", [idx], to=INT64)
        flat = e.op("Reshape", [idx, e.ints([-1])])
    return nonneg(e, flat, n)
