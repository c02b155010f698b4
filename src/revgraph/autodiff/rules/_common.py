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


#: ONNX tensor types (``Cast``'s ``to``) of the float32, float64 and int64 index arithmetic of the geometry rules
F32, F64, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64
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
