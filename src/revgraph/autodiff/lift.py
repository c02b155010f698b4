"""Lift constants into trainable initializers.

Models exported for inference often hold weights as ``Constant`` (in any of its forms: ``value``,
``value_floats``, ``sparse_value``, ...) or ``ConstantOfShape`` nodes (the onnx wheel's ``light/`` models keep
every weight as a ``ConstantOfShape``); such values are not graph inputs or
initializers, so they are not differentiated by default. :func:`lift_constants` turns each floating-point
constant with more than one element into an initializer of the same name.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from .. import limits
from ..errors import GraphError
from ..ir import Graph, Node, is_float_dtype
from ..onnx_io.value_types import constant_value, sparse_to_dense

_SMALL = 64  # elements of a constant that is not lifted but kept as a value (a shape)


def _constant_value(node: Node, known: dict[str, np.ndarray]) -> np.ndarray | None:
    if node.domain or len(node.outputs) != 1:
        return None
    if node.op_type == "Constant":
        sparse = node.attrs.get("sparse_value")
        if isinstance(sparse, onnx.AttributeProto) and sparse.type == onnx.AttributeProto.SPARSE_TENSOR:
            # a weight stored sparse: made dense here, as an initializer holds it
            dims = tuple(int(d) for d in sparse.sparse_tensor.dims)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(sparse.sparse_tensor.values.data_type)
            limits.check_allocation(f"the output {node.outputs[0]!r} of {node.label()}", dims, dtype,
                                    "a lifted constant (--lift-constants)")
            return sparse_to_dense(sparse.sparse_tensor, math.prod(dims))
        value = constant_value(node)  # value, value_float(s), value_int(s), value_string(s)
        return None if value is None else np.asarray(value)
    if node.op_type == "ConstantOfShape" and node.inputs and node.inputs[0] in known:
        fill = node.attrs.get("value", np.zeros(1, np.float32))
        fill = np.asarray(fill).reshape(-1)
        shape = tuple(int(d) for d in np.asarray(known[node.inputs[0]]).reshape(-1))
        if any(d < 0 for d in shape) or fill.size != 1:
            raise GraphError(f"{node.label()} has shape {list(shape)} and a fill value of {fill.size} elements; "
                             "ConstantOfShape takes non-negative dimensions and one value")
        size = math.prod(shape)
        if not (is_float_dtype(fill.dtype) and size > 1):
            # not lifted: kept only where it may be the shape of another ConstantOfShape
            return np.full(shape, fill[0], dtype=fill.dtype) if size <= _SMALL else None
        # a weight: it becomes an initializer, so it is made; the model only wrote its shape
        limits.check_allocation(f"the output {node.outputs[0]!r} of {node.label()}", shape, fill.dtype,
                                "a lifted constant (--lift-constants)")
        return np.full(shape, fill[0], dtype=fill.dtype)
    return None


def lift_constants(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of ``graph`` whose floating-point ``Constant``/``ConstantOfShape`` outputs with more than one
    element (in the top-level graph) are initializers, and the names lifted, in node order.

    ``ConstantOfShape`` is lifted when its shape is an initializer or a ``Constant`` output. Scalars and
    one-element constants stay constants: they are hyperparameters (epsilons, exponents), not weights. An
    initializer that only lifted nodes read (the shape of a ``ConstantOfShape``) is dropped with them, so the
    graph keeps no unused initializer (onnxruntime warns about each one).

    ``ai.onnx.ml`` ``LinearClassifier``/``LinearRegressor`` nodes, whose weights are attributes, become standard
    operators reading initializers ``<node>.coefficients`` and ``<node>.intercepts`` first
    (:func:`revgraph.autodiff.lift_ml.lift_ml_coefficients`; a ``GraphError`` for a ``post_transform`` it does not
    support)."""
    from .lift_ml import lift_ml_coefficients  # (here: it imports the autodiff rules, which import this module)

    g, lifted = lift_ml_coefficients(graph)
    known: dict[str, np.ndarray] = dict(g.initializers)
    kept, orphans = [], set()
    for node in g.nodes:
        value = _constant_value(node, known)
        if value is not None:
            known[node.outputs[0]] = value
            if is_float_dtype(value.dtype) and value.size > 1:
                g.initializers[node.outputs[0]] = value
                g.value_info.pop(node.outputs[0], None)
                lifted.append(node.outputs[0])
                orphans.update(i for i in node.inputs if i in g.initializers)
                continue
        kept.append(node)
    g.nodes = kept
    drop_unused_initializers(g, orphans)
    return g, lifted


def drop_unused_initializers(g: Graph, candidates: set[str] | None = None) -> list[str]:
    """Remove from ``g`` (in place) the initializers (of ``candidates``, default all) that no node, in any
    subgraph, reads and no graph output names; return their names. onnxruntime warns about each unused
    initializer of a graph it loads."""
    candidates = set(g.initializers) if candidates is None else candidates
    if not candidates:
        return []
    read = {i for _, n in g.walk() for i in n.inputs} | set(g.output_names)
    unused = sorted(candidates - read)
    for name in unused:
        del g.initializers[name]
    return unused
