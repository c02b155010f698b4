"""The value of a ``Constant`` node in any of its forms, dense sparse constants included: what the type service
(:mod:`revgraph.onnx_io.value_types`) and the writer's passes (:mod:`revgraph.onnx_io.portable`, which
:mod:`revgraph.onnx_io` calls) read, kept apart from both so that neither imports the other."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import GraphError
from . import Node


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
    does not hold together (:func:`check_sparse`)."""
    dims = tuple(int(d) for d in sp.dims)
    if any(d < 0 for d in dims) or math.prod(dims) > dense_limit:
        return None
    try:
        values, indices = sparse_parts(sp, "a sparse tensor")
    except Exception:  # noqa: BLE001 - a malformed sparse tensor: its value is not known
        return None
    return densify(values, indices, dims)


def densify(values: np.ndarray, indices: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """The dense array of shape ``dims`` holding ``values`` ([NNZ]) at the linear ``indices`` ([NNZ] int64,
    checked by :func:`linear_indices`) and zeros (empty strings for strings) elsewhere."""
    size = math.prod(dims)
    dense = np.full(size, b"", dtype=object) if values.dtype == object else np.zeros(size, dtype=values.dtype)
    dense[indices] = values
    return dense.reshape(dims)


def dense_constants(model: onnx.ModelProto) -> None:
    """Rewrite, in place, every sparse ``Constant`` of ``model`` (subgraphs included, walked iteratively) into the
    ``Constant`` of its dense value, zeros where it has no value: what :class:`revgraph.Session` hands to a
    runtime, so that both backends compute the tensor ONNX defines (onnxruntime densifies a top-level sparse
    constant itself but fails on one inside a ``Loop`` or ``If`` body; onnx.reference returns a Python
    ``SparseTensor`` object that its evaluator then refuses). Raises :class:`GraphError` for indices ONNX does
    not allow (:func:`linear_indices`) and :class:`InputError` for a dense form over
    :data:`revgraph.limits.MAX_MATERIALIZED_BYTES`."""
    from ..limits import check_allocation

    stack = [model.graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    stack.append(a.g)
                stack.extend(a.graphs)
            sparse = [a for a in node.attribute
                      if a.name == "sparse_value" and a.type == onnx.AttributeProto.SPARSE_TENSOR]
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not sparse:
                continue
            sp = sparse[0].sparse_tensor
            where = f"attribute 'sparse_value' of node {node.name!r} (Constant)"
            dims = tuple(int(d) for d in sp.dims)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(sp.values.data_type) if sp.values.data_type else np.float32
            check_allocation(f"the sparse output {node.output[0]!r} of node {node.name!r} (Constant)", dims, dtype,
                             "its dense form")
            values, indices = sparse_parts(sp, where)
            dense = numpy_helper.from_array(densify(values.reshape(-1), indices, dims), sp.values.name)
            node.ClearField("attribute")
            node.attribute.append(onnx.helper.make_attribute("value", dense))


def sparse_parts(sp: onnx.SparseTensorProto, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values [NNZ], linear indices [NNZ] int64)`` of a ``SparseTensorProto`` whose data is loaded, after
    :func:`linear_indices` checked them; ``where`` says where the tensor sits (for the message).
    Raises :class:`GraphError` naming the tensor."""
    name = f"sparse tensor {sp.values.name!r} ({where})" if sp.values.name else f"the sparse tensor of {where}"
    dims = tuple(int(d) for d in sp.dims)
    if any(d < 0 for d in dims):
        raise GraphError(f"{name} has dims {list(dims)}; a sparse tensor's dense shape has non-negative "
                         "dimensions")
    try:
        values = numpy_helper.to_array(sp.values)
        indices = numpy_helper.to_array(sp.indices)
    except Exception as exc:  # noqa: BLE001 - onnx's reader fails in many ways: one line
        raise GraphError(f"{name} cannot be read: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                         ) from None
    if values.ndim != 1:
        raise GraphError(f"{name} has values of shape {list(values.shape)}; ONNX stores a sparse tensor's values "
                         "as a 1-D tensor [NNZ]")
    return values, linear_indices(indices, values.shape[0], dims, name)


def linear_indices(indices: np.ndarray, nnz: int, dims: tuple[int, ...], name: str) -> np.ndarray:
    """The ``[NNZ]`` linear indices into ``dims`` of a sparse tensor's ``indices`` (``[NNZ]`` linear indices
    or ``[NNZ, rank]`` coordinates), checked as ONNX's SparseTensorProto requires: int64, within the dense
    shape, ascending without duplicates (lexicographic for coordinates). ``name`` names the tensor.
    Raises :class:`GraphError` (one line) saying what is wrong and what to do."""
    indices = np.asarray(indices)
    shapes = f"[{nnz}] (linear indices) or [{nnz}, {len(dims)}] (coordinates)"
    if indices.dtype != np.int64:
        raise GraphError(f"{name} has {indices.dtype} indices; ONNX requires int64 indices: store them as int64")
    if indices.ndim not in (1, 2) or indices.shape[0] != nnz or (indices.ndim == 2 and indices.shape[1] != len(dims)):
        raise GraphError(f"{name} has indices of shape {list(indices.shape)} for {nnz} values in a "
                         f"{list(dims)} tensor; ONNX takes indices of shape {shapes}")
    if indices.ndim == 2:
        bad = np.nonzero((indices < 0) | (indices >= np.asarray(dims, np.int64)))
        if bad[0].size:
            i = int(bad[0][0])
            raise GraphError(f"{name} has coordinate {indices[i].tolist()} (entry {i}) outside its dense shape "
                             f"{list(dims)}; each index j must lie in [0, dims[j]): fix or drop it")
        linear = np.ravel_multi_index(tuple(indices.T), dims) if nnz else np.zeros(0, np.int64)
    else:
        size = math.prod(dims)
        bad = np.nonzero((indices < 0) | (indices >= size))[0]
        if bad.size:
            i = int(bad[0])
            raise GraphError(f"{name} has index {int(indices[i])} (entry {i}) outside its dense shape {list(dims)} "
                             f"of {size} elements; linear indices lie in [0, {size}): fix or drop it")
        linear = indices
    linear = np.asarray(linear, np.int64).reshape(-1)
    steps = np.diff(linear)
    wrong = np.nonzero(steps <= 0)[0]
    if wrong.size:
        i = int(wrong[0]) + 1

        def what(k: int) -> str:
            return f"coordinate {indices[k].tolist()}" if indices.ndim == 2 else f"index {int(indices[k])}"

        kind = "repeats" if steps[i - 1] == 0 else "comes after"
        raise GraphError(f"{name} has {what(i)} (entry {i}) that {kind} {what(i - 1)} (entry {i - 1}); ONNX requires "
                         "a sparse tensor's indices in ascending order without duplicates: sort them and merge "
                         "repeated entries")
    return linear
