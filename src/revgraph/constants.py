"""The value of a ``Constant`` node in any of its forms, dense sparse constants included: what the type service
(:mod:`revgraph.types`) and the writer's passes (:mod:`revgraph.portable`, which :mod:`revgraph.onnx_io` calls)
read, kept apart from both so that neither imports the other."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

from .ir import Node


def constant_value(node: Node, dense_limit: int = 1 << 16) -> np.ndarray | None:
    """The value of a default-domain ``Constant`` node in any of its forms (ONNX "Constant": ``value``,
    ``value_float``, ``value_floats``, ``value_int``, ``value_ints``, ``value_string``, ``value_strings``,
    ``sparse_value``); ``None`` for another node, or a sparse value of more than ``dense_limit`` elements
    (made dense only when small: a file may describe a huge sparse constant)."""
    if node.op_type != "Constant" or node.domain or not node.attrs:
        return None
    key, v = next(iter(node.attrs.items()))
    if key == "value" and isinstance(v, np.ndarray):
        return v
    if key in ("value_float", "value_floats"):
        return np.asarray(v, dtype=np.float32)
    if key in ("value_int", "value_ints"):
        return np.asarray(v, dtype=np.int64)
    if key in ("value_string", "value_strings"):
        return np.asarray(v, dtype=object)
    if key == "sparse_value" and isinstance(v, onnx.AttributeProto) and v.type == onnx.AttributeProto.SPARSE_TENSOR:
        return sparse_to_dense(v.sparse_tensor, dense_limit)
    return None


def sparse_to_dense(sp: onnx.SparseTensorProto, dense_limit: int) -> np.ndarray | None:
    """The dense array of a ``SparseTensorProto`` (ONNX IR: ``indices`` are ``[NNZ]`` linear indices or
    ``[NNZ, rank]`` coordinates into ``dims``), or ``None`` when it has more than ``dense_limit`` elements or
    does not hold together."""
    dims = tuple(int(d) for d in sp.dims)
    if any(d < 0 for d in dims) or math.prod(dims) > dense_limit:
        return None
    try:
        values = numpy_helper.to_array(sp.values).reshape(-1)
        indices = numpy_helper.to_array(sp.indices).astype(np.int64)
        dense = np.zeros(math.prod(dims), dtype=values.dtype)
        if indices.ndim == 2:
            indices = np.ravel_multi_index(tuple(indices.T), dims) if indices.size else indices.reshape(-1)
        dense[indices.reshape(-1)] = values
        return dense.reshape(dims)
    except Exception:  # a malformed sparse tensor: its value is not known
        return None
