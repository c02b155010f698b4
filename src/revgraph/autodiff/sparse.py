"""Sparse gradients of gathered tables (:class:`SparseGrad`, concatenation, densification) and the race-free
scatters that add rows into dense tensors.

The gradient of ``Gather(data, indices)`` (axis 0) with respect to ``data`` touches only the gathered rows.
As in Caffe2's ``GradientSlice`` and TensorFlow's ``IndexedSlices`` it is kept as rows: ``indices`` (int64,
shape ``[K]``, every entry in ``[0, data.shape[0])``) and ``values`` (shape ``[K, *data.shape[1:]]``), with
the dense shape taken from the table. Repeated indices mean the rows add up. Two sparse contributions
concatenate; sparse meets dense through :func:`add_rows`.

Scatters with repeated indices. onnxruntime's CPU ``ScatterND`` with ``reduction="add"`` (or ``"mul"``)
races when indices repeat and it runs on more than one thread (microsoft/onnxruntime#18048; 8192 rows added
into a 2048 x 256 table over 64 distinct indices came out ~4e-2 off, relative, on 2 to 8 threads), so a
gradient would depend on the thread count. revgraph therefore never emits a reducing ``ScatterND``:
:func:`add_rows` writes ``ScatterElements(axis=0)`` on flat views, the table as [R * S] and the rows as
[K * S] (S elements per row) at positions ``indices[k] * S + j``, and onnxruntime's ScatterElements kernel
is sequential; :func:`scatter_nd_reduce` gives ScatterND's semantics through the same scatter by
linearising the index tuples. ``tests/test_determinism.py`` guards this. The price is speed: the sequential
kernel takes ~5 ms for 8192 x 256 rows where the racing ScatterND took ~0.3 ms (the 1-D view is ~2.5x
faster than a [R, S] view with the indices expanded to [K, S]).

Both helpers write with the small protocol shared by the autodiff :class:`Emitter` and ``graphbuild.Builder``:
``b.op(op_type, inputs, **attrs)`` and ``b.const(value, dtype)``. Given an :class:`Emitter` they use the
static shapes it knows (constants instead of ``Shape`` arithmetic) and record the output types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .emitter import Emitter

#: An :class:`Emitter` or ``graphbuild.Builder``: ``op(op_type, inputs, **attrs)`` and ``const(value, dtype)``.
Builder = Any


@dataclass(frozen=True)
class SparseGrad:
    """Rows of a gradient: ``indices`` ([K] int64) and ``values`` ([K, *dense.shape[1:]]) name values in the
    graph; ``table`` names the dense value (its shape and dtype are the dense gradient's)."""

    indices: str
    values: str
    table: str


def concat(e: Emitter, parts: list[SparseGrad]) -> SparseGrad:
    """One :class:`SparseGrad` holding the rows of all ``parts`` (which share a table)."""
    if len(parts) == 1:
        return parts[0]
    known = [e.value(p.indices) for p in parts]
    if all(k is not None for k in known):  # constant indices stay a constant, for densify to read
        indices = e.const(np.concatenate([np.asarray(k, np.int64).reshape(-1) for k in known]))
    else:
        indices = e.op("Concat", [p.indices for p in parts], axis=0)
    values = e.op("Concat", [p.values for p in parts], axis=0)
    return SparseGrad(indices, values, parts[0].table)


def scatter_add(e: Emitter, dense: str, sparse: SparseGrad) -> str:
    """``dense`` (the table's shape and dtype) with the rows of ``sparse`` added, repeated indices
    accumulating (:func:`add_rows`)."""
    return add_rows(e, dense, sparse.indices, sparse.values)


def densify(e: Emitter, sparse: SparseGrad) -> str:
    """The dense gradient: zeros of the table's shape with the rows added. Rows at constant indices that name
    rows 0 .. K-1 once each (a tensor split by ``Gather`` at 0, 1, 2, as exported attention splits its packed
    q, k, v) are the gradient's first K rows, in index order: no scatter, and zeros only for the rows past K
    (none when the table has K rows; their count is read at run time when the table's shape is not static)."""
    idx, dt = e.value(sparse.indices), e.dtype(sparse.table)
    if idx is None or dt is None:
        return scatter_add(e, e.zeros_like(sparse.table), sparse)
    idx = np.asarray(idx, np.int64).reshape(-1)
    k = idx.size
    if not k or not np.array_equal(np.sort(idx), np.arange(k)):
        return scatter_add(e, e.zeros_like(sparse.table), sparse)
    rows = sparse.values
    if not np.array_equal(idx, np.arange(k)):
        rows = e.op("Gather", [rows, e.const(np.argsort(idx))], axis=0, like=rows)
    shape = e.shape(sparse.table)
    if shape and shape[0] == k:
        return rows
    full = e.shape_of(sparse.table)
    rest = e.op("Concat", [e.op("Sub", [e.op("Slice", [full, e.ints([0]), e.ints([1])]), e.ints([k])]),
                           e.op("Slice", [full, e.ints([1]), e.ints([np.iinfo(np.int64).max])])], axis=0)
    zeros = e.op("ConstantOfShape", [rest], value=np.zeros(1, dtype=dt))
    return e.op("Concat", [rows, zeros], axis=0, like=sparse.table)


# ------------------------------------------------------------------------------------ race-free scatters


def add_rows(b: Builder, dense: str, indices: str, values: str, reduction: str = "add") -> str:
    """``dense`` ([R, *rest], float) with ``values[k]`` ([K, *rest], the same dtype) combined into row
    ``indices[k]`` (int64 [K], in [0, R), repeats allowed) by ``reduction`` ("add": ``np.add.at``, or
    "mul"); the result has ``dense``'s shape and dtype. Written as ``ScatterElements`` on the flat views
    [R * S] and [K * S] (S = prod(rest)) at ``indices[k] * S + j`` (module doc); K may be 0."""
    width = _width(b, dense, 1)
    if width == 0:  # rows of no elements: nothing to combine (onnxruntime rejects some empty scatters)
        return dense
    if _rank(b, dense) == 1:
        return _op(b, "ScatterElements", [dense, indices, values], axis=0, reduction=reduction, like=dense)
    return _scatter_flat(b, dense, _flat_index(b, indices, width), values, reduction)


def scatter_nd_reduce(b: Builder, data: str, full: str, updates: str, reduction: str = "add") -> str:
    """``ScatterND(data, full, updates, reduction)`` ("add" or "mul") without ScatterND. ``data`` [d0, ...,
    d(r-1)], ``full`` int64 [*lead, m] with ``0 <= full[..., j] < d_j``, ``updates`` [*lead, *data.shape[m:]];
    the result has ``data``'s shape and dtype. The index tuples are linearised with the row-major strides of
    ``data.shape[:m]`` into rows of S = prod(data.shape[m:]) elements, then scattered as in :func:`add_rows`."""
    m, dims = _last_dim(b, full), _static(b, data)
    if m is not None and dims is not None:
        strides = _ints(b, [math.prod(dims[i + 1:m]) for i in range(m)])
        width: int | str = math.prod(dims[m:])
    else:
        depth = _ints(b, [m]) if m is not None else _op(b, "Shape", [full], start=-1)
        shape = _op(b, "Shape", [data])
        strides = _strides(b, _op(b, "Slice", [shape, _ints(b, [0]), depth]))
        tail = _op(b, "Slice", [shape, depth, _ints(b, [np.iinfo(np.int64).max])])
        width = _op(b, "ReduceProd", [tail], keepdims=0)
    if width == 0:
        return data
    row = _op(b, "ReduceSum", [_op(b, "Mul", [full, strides]), _ints(b, [-1])], keepdims=0)
    row = _op(b, "Reshape", [row, _ints(b, [-1])], **_typed((None,), np.int64))
    return _scatter_flat(b, data, _flat_index(b, row, width), updates, reduction)


def _flat_index(b: Builder, rows: str, width: int | str) -> str:
    """int64 [K * S]: ``rows[k] * S + j`` for ``j < S`` in row-major order (``rows`` int64 [K]; ``width``
    S an int or a 0-d int64 value): the flat positions of whole rows of S elements."""
    w = b.const(width, np.int64) if isinstance(width, int) else width
    if isinstance(width, int) and width <= 1024:  # a small constant; wider rows would bloat the graph file
        ramp = b.const(np.arange(width, dtype=np.int64), np.int64)
    else:
        ramp = _op(b, "Range", [b.const(0, np.int64), w, b.const(1, np.int64)])
    col = _op(b, "Unsqueeze", [rows, _ints(b, [1])])
    grid = _op(b, "Add", [_op(b, "Mul", [col, w]), ramp])
    return _op(b, "Reshape", [grid, _ints(b, [-1])], **_typed((None,), np.int64))


def _scatter_flat(b: Builder, dense: str, positions: str, values: str, reduction: str) -> str:
    """``dense`` (any shape) with ``values`` (any shape, as many elements as ``positions``) combined at the
    flat ``positions`` (int64 [N], in [0, dense.size)) by ``reduction``: ``ScatterElements(axis=0)`` on the
    flat views (a sequential kernel in onnxruntime), reshaped back to ``dense``'s shape and type."""
    dims, dt = _static(b, dense), _dtype(b, dense)
    flat = _op(b, "Reshape", [dense, _ints(b, [-1])], **_typed((math.prod(dims) if dims else None,), dt))
    vals = _op(b, "Reshape", [values, _ints(b, [-1])], **_typed((None,), dt))
    out = _op(b, "ScatterElements", [flat, positions, vals], axis=0, reduction=reduction, like=flat)
    return _op(b, "Reshape", [out, _shape_of(b, dense)], allowzero=1, like=dense)  # a 0 in the shape is 0


def _strides(b: Builder, head: str) -> str:
    """Row-major strides of the dimensions ``head`` (1-D int64 [m]): ``s[i] = prod(head[i+1:])``, int64 [m],
    as the product over a row of ``where(j > i, head[j], 1)`` (a triangular mask over ``Range(m)``)."""
    count = _op(b, "Squeeze", [_op(b, "Shape", [head]), _ints(b, [0])])
    ramp = _op(b, "Range", [b.const(0, np.int64), count, b.const(1, np.int64)])
    later = _op(b, "Less", [_op(b, "Unsqueeze", [ramp, _ints(b, [1])]), _op(b, "Unsqueeze", [ramp, _ints(b, [0])])])
    factors = _op(b, "Where", [later, _op(b, "Unsqueeze", [head, _ints(b, [0])]), b.const(1, np.int64)])
    return _op(b, "ReduceProd", [factors, _ints(b, [1])], keepdims=0)


def _width(b: Builder, x: str, start: int) -> int | str:
    """``prod(shape(x)[start:])``: an int when those dimensions are static, else a 0-d int64 value."""
    dims = _static(b, x)
    if dims is not None:
        return math.prod(dims[start:])
    return _op(b, "ReduceProd", [_op(b, "Shape", [x], start=start)], keepdims=0)


# ---------------------------------------------------------------- what the two builders know and write


def _op(b: Builder, op_type: str, inputs: list[str], *, like: str | None = None, shape: tuple | None = None,
        dtype: Any = None, **attrs: Any) -> str:
    """``b.op(op_type, inputs, **attrs)``; an :class:`Emitter` also records the output type (``like`` a
    value, or ``shape``/``dtype``, else its own inference)."""
    if isinstance(b, Emitter):
        return b.op(op_type, inputs, like=like, shape=shape, dtype=dtype, **attrs)
    return b.op(op_type, inputs, **attrs)


def _typed(shape: tuple | None, dtype: Any) -> dict:
    """Type keywords for :func:`_op` when the dtype is known (dimensions may be ``None``), else none (the
    emitter infers the type)."""
    return {"shape": shape, "dtype": dtype} if shape is not None and dtype is not None else {}


def _ints(b: Builder, values: list[int]) -> str:
    """A 1-D int64 constant."""
    return b.const(np.asarray(values, dtype=np.int64).reshape(-1), np.int64)


def _static(b: Builder, x: str) -> tuple | None:
    """The static shape of ``x`` (all ints) when an :class:`Emitter` knows it, else ``None``."""
    return b.shape(x) if isinstance(b, Emitter) else None


def _rank(b: Builder, x: str) -> int | None:
    """The rank of ``x`` when an :class:`Emitter` knows it, else ``None``."""
    return b.rank(x) if isinstance(b, Emitter) else None


def _dtype(b: Builder, x: str) -> Any:
    """The numpy dtype of ``x`` when an :class:`Emitter` knows it, else ``None``."""
    return b.dtype(x) if isinstance(b, Emitter) else None


def _last_dim(b: Builder, x: str) -> int | None:
    """The last dimension of ``x`` when it is a known int, else ``None``."""
    dims = b.dims(x) if isinstance(b, Emitter) else None
    return dims[-1] if dims and isinstance(dims[-1], int) else None


def _shape_of(b: Builder, x: str) -> str:
    """A 1-D int64 value holding the shape of ``x`` (a constant when static)."""
    return b.shape_of(x) if isinstance(b, Emitter) else b.op("Shape", [x])
