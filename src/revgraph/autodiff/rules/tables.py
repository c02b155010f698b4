"""Tables and filled tensors for rules: a ``Constant`` when small, computed in the graph at run time otherwise.

A rule often knows a table's contents when the gradient is built (a pooling window table from static shapes,
an interpolation matrix from static scales, an identity of a static size, a ramp ``0 .. n-1``), but the
table's size follows the tensor sizes the model *declares*, not the model's own size: a 200-byte model may
declare a ``[1, 1, 30000, 30000]`` input or a Resize by ``1e7``. So a rule writes such a table as a constant
only up to :data:`revgraph.limits.MAX_RULE_CONSTANT_ELEMENTS` elements (:func:`small`), and emits the nodes
that compute it otherwise (``Range``, ``ConstantOfShape``, ``EyeLike``), where it costs memory when the
gradient runs (about as much as the tensors it indexes) and nothing when it is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ... import limits
from ...ir import onnx_dtype
from ..emitter import Emitter


def small(shape: Sequence[int]) -> bool:
    """True if a table of ``shape`` (ints) may be a constant: at most
    :data:`~revgraph.limits.MAX_RULE_CONSTANT_ELEMENTS` elements. Python integers: no overflow."""
    return math.prod(int(d) for d in shape) <= limits.MAX_RULE_CONSTANT_ELEMENTS  # (read here: tests lower it)


def filled(e: Emitter, shape: Sequence[int], value: float, like: str | None = None, dtype=None) -> str:
    """A tensor of static ``shape`` filled with ``value``, of ``dtype`` (or ``like``'s dtype; ``CastLike`` to
    ``like`` when that is unknown, float32 without ``like``): a constant when :func:`small`, a
    ``ConstantOfShape`` otherwise."""
    shape = [int(d) for d in shape]
    dt = np.dtype(dtype) if dtype is not None else (e.dtype(like) if like is not None else np.dtype(np.float32))
    if dt is None:
        return e.op("CastLike", [filled(e, shape, value, dtype=np.float32), like])
    if small(shape):
        return e.const(np.full(shape, value, dtype=dt))
    return e.op("ConstantOfShape", [e.dims_const(shape)], value=np.full(1, value, dtype=dt), shape=tuple(shape),
                dtype=dt)


def arange(e: Emitter, n: int, dtype=np.int64, shape: Sequence[int] | None = None) -> str:
    """``[0, 1, .., n-1]`` of ``dtype`` (reshaped to ``shape`` if given, one entry -1): a constant when
    :func:`small`, a ``Range`` (and ``Cast``, ``Reshape``) otherwise."""
    n, dt = int(n), np.dtype(dtype)
    if small([n]):
        a = np.arange(n, dtype=dt)
        return e.const(a if shape is None else a.reshape(shape))
    r = e.op("Range", [e.const(np.int64(0)), e.const(np.int64(n)), e.const(np.int64(1))], shape=(n,),
             dtype=np.dtype(np.int64))
    if dt != np.int64:
        r = e.op("Cast", [r], to=onnx_dtype(dt), shape=(n,), dtype=dt)
    if shape is not None:
        full = tuple(n if d == -1 else int(d) for d in shape)
        r = e.op("Reshape", [r, e.ints(list(shape))], shape=full, dtype=dt)
    return r


def eye(e: Emitter, n: int, like: str) -> str:
    """The ``n x n`` identity in ``like``'s dtype: a constant when :func:`small`, ``EyeLike`` of a
    ``ConstantOfShape`` otherwise."""
    dt = e.dtype(like)
    if dt is not None and small([n, n]):
        return e.const(np.eye(n, dtype=dt))
    zeros = filled(e, [n, n], 0.0, dtype=dt if dt is not None else np.float32)
    one = e.op("EyeLike", [zeros], shape=(n, n), dtype=dt)
    return one if dt is not None else e.op("CastLike", [one, like])
