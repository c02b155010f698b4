"""Sparse gradients of gathered tables: :class:`SparseGrad`, concatenation and densification.

The gradient of ``Gather(data, indices)`` (axis 0) with respect to ``data`` touches only the gathered rows.
As in Caffe2's ``GradientSlice`` and TensorFlow's ``IndexedSlices`` it is kept as rows: ``indices`` (int64,
shape ``[K]``, every entry in ``[0, data.shape[0])``) and ``values`` (shape ``[K, *data.shape[1:]]``), with
the dense shape taken from the table. Repeated indices mean the rows add up. Two sparse contributions
concatenate; sparse meets dense through ``ScatterND(reduction="add")``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Emitter


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
    indices = e.op("Concat", [p.indices for p in parts], axis=0)
    values = e.op("Concat", [p.values for p in parts], axis=0)
    return SparseGrad(indices, values, parts[0].table)


def scatter_add(e: Emitter, dense: str, sparse: SparseGrad) -> str:
    """``dense`` with the rows of ``sparse`` added (``ScatterND`` with ``reduction="add"``, which
    accumulates repeated indices)."""
    idx = e.op("Unsqueeze", [sparse.indices, e.ints([1])])
    return e.op("ScatterND", [dense, idx, sparse.values], reduction="add", like=sparse.table)


def densify(e: Emitter, sparse: SparseGrad) -> str:
    """The dense gradient: zeros of the table's shape with the rows added."""
    return scatter_add(e, e.zeros_like(sparse.table), sparse)
