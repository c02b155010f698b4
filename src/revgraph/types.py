"""The type service: the types of a graph's values (ONNX shape inference, completed node by node with
:mod:`revgraph.fastshape`'s formulas), the values known when a graph is built, and the one predicate that says
whether a value can carry a gradient.

Rules and loop VJPs read types through the autodiff ``Emitter``; everything here is independent of
differentiation.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.shape_inference
from onnx import helper, numpy_helper

from . import fastshape, limits
from .errors import UnsupportedModelError
from .ir import Graph, Node, ValueInfo, is_float_dtype
from .onnx_io import attr_to_proto, light_graph, to_onnx, value_info_from_proto, value_info_to_proto
from .schema import get_schema


def differentiable(vi: ValueInfo | None) -> bool:
    """May the value carry a gradient? A floating-point tensor does; an integer, boolean or string tensor and
    an ONNX sequence do not; a value whose type is unknown (``None``, or no dtype) is taken as one that may,
    so that a path through it is differentiated rather than silently cut. The one answer the backward pass,
    the loop VJPs and the rules give."""
    return vi is None or vi.dtype is None or (vi.kind == "tensor" and is_float_dtype(vi.dtype))


def onnx_node_types(node: Node, types: dict[str, ValueInfo], values: dict[str, np.ndarray],
                    opset: int) -> dict[str, ValueInfo]:
    """The output types ONNX's per-node shape inference (``onnx.shape_inference.infer_node_outputs``) gives
    ``node``, whose input types must be in ``types``; small constant inputs in ``values`` take part (shapes,
    axes). ``{}`` when it cannot tell."""
    schema = get_schema(node.op_type, node.domain, {"": opset})
    if schema is None:
        return {}
    proto = helper.make_node(node.op_type, node.inputs, node.outputs)
    proto.attribute.extend(attr_to_proto(node, k, v, {"": opset}) for k, v in node.attrs.items())
    in_types = {i: value_info_to_proto(types[i]).type for i in node.inputs if i}
    data = {i: numpy_helper.from_array(values[i], i) for i in node.inputs if i in values and values[i].size <= 64}
    try:
        out = onnx.shape_inference.infer_node_outputs(schema, proto, in_types, data)
    except Exception:  # inference is a help; unknown types make rules use Shape-based ops
        return {}
    return {name: value_info_from_proto(helper.make_value_info(name, tp))
            for name, tp in out.items() if tp.HasField("tensor_type")}


def node_types(node: Node, types: dict[str, ValueInfo], values: dict[str, np.ndarray],
               opset: int) -> dict[str, ValueInfo]:
    """The output types of one node: :mod:`revgraph.fastshape`'s formulas when they apply, else
    :func:`onnx_node_types`, with the rank of a ``keepdims=1`` reduction over computed axes
    (:func:`revgraph.fastshape.keepdims_type`) where ONNX gives no shape."""
    fast = fastshape.infer(node, types, values)
    if fast is not None:
        return {fast.name: fast}
    found = onnx_node_types(node, types, values, opset)
    rank = fastshape.keepdims_type(node, types)
    if rank is not None and (rank.name not in found or found[rank.name].shape is None):
        known = found.get(rank.name)
        found[rank.name] = ValueInfo(rank.name, known.dtype if known and known.dtype else rank.dtype, rank.shape)
    return found


def _declared(graph: Graph) -> dict[str, ValueInfo]:
    types = {vi.name: vi for vi in [*graph.value_info.values(), *graph.outputs] if vi.dtype is not None}
    types.update((k, ValueInfo(k, a.dtype, a.shape)) for k, a in graph.initializers.items())
    types.update((vi.name, vi) for vi in graph.inputs)
    return types


def constant_values(graph: Graph) -> dict[str, np.ndarray]:
    """The values of ``graph`` known when it is built: its initializers and its ``Constant`` outputs."""
    values = {k: np.asarray(a) for k, a in graph.initializers.items()}
    for node in graph.nodes:
        if node.op_type == "Constant" and "value" in node.attrs and not node.domain:
            values[node.outputs[0]] = np.asarray(node.attrs["value"])
    return values


def _infer_incrementally(graph: Graph) -> dict[str, ValueInfo] | None:
    """Types of ``graph`` when it declares the types of most of its values (a loaded graph, to which a loss or
    a few nodes were added): the declared ones, and node-by-node inference for the other nodes. ``None``
    when that does not apply (many undeclared values, or an undeclared node with subgraphs)."""
    types = _declared(graph)
    pending = [n for n in graph.nodes if any(o and o not in types for o in n.outputs)]
    if len(pending) > max(8, len(graph.nodes) // 10) or any(n.subgraphs for n in pending):
        return None
    values = {k: a for k, a in constant_values(graph).items() if a.size <= 64}
    for node in pending:
        if all(not i or i in types for i in node.inputs):
            for name, vi in node_types(node, types, values, graph.opset).items():
                types.setdefault(name, vi)
    return types


def infer_types(graph: Graph) -> dict[str, ValueInfo]:
    """Types of the values of ``graph``'s own scope: what the graph declares (inputs, outputs,
    ``value_info``, initializers), completed by ONNX shape inference (with data propagation where
    :func:`revgraph.limits.infer_shapes` finds it bounded). A declared type
    with a shape wins over an inferred one (ONNX infers little through ``Loop``). Values whose type cannot
    be found are left out."""
    quick = _infer_incrementally(graph)
    if quick is not None:
        return _complete_shapes(graph, quick)
    types: dict[str, ValueInfo] = {}
    light, _ = light_graph(graph)
    try:
        proto = limits.infer_shapes(to_onnx(light))  # data propagation only where it stays small
        for vi in [*proto.graph.value_info, *proto.graph.output]:
            try:
                types[vi.name] = value_info_from_proto(vi)
            except UnsupportedModelError:
                pass
    except Exception:  # shape inference helps the rules; they fall back to Shape-based ops without it
        pass
    for vi in [*graph.value_info.values(), *graph.outputs]:
        known = types.get(vi.name)
        if known is None or known.dtype is None or (vi.dtype is not None and vi.shape is not None):
            types[vi.name] = vi
    for name, arr in graph.initializers.items():
        types[name] = ValueInfo(name, arr.dtype, arr.shape)
    for vi in graph.inputs:
        types[vi.name] = vi
    return _complete_shapes(graph, types)


def _complete_shapes(graph: Graph, types: dict[str, ValueInfo]) -> dict[str, ValueInfo]:
    """``types`` with the values that whole-graph inference left without a shape inferred again node by node,
    in node order (:func:`node_types`), where every input's shape is known: a rank found for one value (the
    rank of a ``keepdims=1`` reduction over computed axes) then reaches the values computed from it, which
    ONNX's whole-graph inference leaves without a shape too. A shape found never replaces a declared one."""
    values = None
    for node in graph.nodes:
        outs = [o for o in node.outputs if o]
        if node.subgraphs or all(o in types and types[o].shape is not None for o in outs):
            continue
        if any(i and (i not in types or types[i].shape is None) for i in node.inputs):
            continue
        if values is None:
            values = {k: a for k, a in constant_values(graph).items() if a.size <= 64}
        for name, vi in node_types(node, types, values, graph.opset).items():
            known = types.get(name)
            if vi.shape is not None and (known is None or known.shape is None):
                dtype = vi.dtype if vi.dtype is not None or known is None else known.dtype
                types[name] = ValueInfo(name, dtype, vi.shape, vi.kind)
    return types


def keep_types(g: Graph, types: dict[str, ValueInfo]) -> None:
    """Record the types the pass tracked as ``value_info``, so a later pass (gradients of gradients) has them."""
    declared = set(g.input_names) | set(g.output_names) | set(g.initializers)
    for node in g.nodes:
        for o in node.outputs:
            vi = types.get(o)
            if o and o not in declared and vi is not None and vi.dtype is not None and vi.shape is not None:
                g.value_info[o] = ValueInfo(o, vi.dtype, vi.shape, vi.kind)
