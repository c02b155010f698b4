"""The type service: the types of a graph's values (ONNX shape inference, completed node by node with
:mod:`revgraph.ir.fastshape`'s formulas), the values known when a graph is built, and the one predicate that says
whether a value can carry a gradient.

Rules and loop VJPs read types through the autodiff ``Emitter``; everything here is independent of
differentiation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import numpy as np
import onnx
import onnx.shape_inference
from onnx import helper, numpy_helper

from .. import limits
from ..errors import UnsupportedModelError
from ..ir import Graph, Node, ValueInfo, contrib_types, fastshape, is_float_dtype
from ..ir.constants import constant_value, sparse_to_dense  # noqa: F401  (API of this module)
from ..ir.schema import get_schema
from . import attr_to_proto, light_graph, to_onnx, value_info_from_proto, value_info_to_proto


def differentiable(vi: ValueInfo | None) -> bool:
    """May the value carry a gradient? A floating-point tensor does, and so does an ONNX sequence of them (its
    cotangent is a sequence); an integer, boolean or string tensor does not; a value whose type is unknown
    (``None``, or no dtype) is taken as one that may, so that a path through it is differentiated rather than
    silently cut. The one answer the backward pass, the loop VJPs and the rules give."""
    return vi is None or vi.dtype is None or (vi.kind in ("tensor", "sequence") and is_float_dtype(vi.dtype))


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
    except Exception:  # noqa: BLE001 - inference is a help; unknown types make rules use Shape-based ops
        return {}
    found: dict[str, ValueInfo] = {}
    for name, tp in out.items():
        if tp.HasField("tensor_type") or tp.sequence_type.elem_type.HasField("tensor_type"):
            with contextlib.suppress(UnsupportedModelError):  # a type revgraph does not model (a sequence of maps)
                found[name] = value_info_from_proto(helper.make_value_info(name, tp))
    return _computed_dft_length(node, found, values)


def _computed_dft_length(node: Node, found: dict[str, ValueInfo],
                         values: dict[str, np.ndarray]) -> dict[str, ValueInfo]:
    """onnx 1.23 gives a DFT with a ``dft_length`` computed in the graph the signal's length along the transformed
    axis (also when ``onesided=1`` halves it): leave that dimension unknown instead."""
    if node.op_type != "DFT" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 or not node.inputs[1]:
        return found
    if node.inputs[1] in values:
        return found
    axis = values.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else node.attrs.get("axis", -2)
    for name, vi in found.items():
        if axis is None or vi.shape is None:
            found[name] = ValueInfo(name, vi.dtype, None, vi.kind)
            continue
        a = int(np.asarray(axis).reshape(-1)[0])
        a = a + len(vi.shape) if a < 0 else a
        if 0 <= a < len(vi.shape):
            found[name] = ValueInfo(name, vi.dtype, (*vi.shape[:a], None, *vi.shape[a + 1:]), vi.kind)
    return found


def node_types(node: Node, types: dict[str, ValueInfo], values: dict[str, np.ndarray],
               opset: int) -> dict[str, ValueInfo]:
    """The output types of one node: :mod:`revgraph.ir.fastshape`'s formulas when they apply, else
    :func:`onnx_node_types`, with the rank of operators whose output rank does not depend on values (a
    ``keepdims=1`` reduction over computed axes, ``Unsqueeze`` of computed axes of static length, ...:
    :func:`revgraph.ir.fastshape.rank_types`) where ONNX gives no shape. The onnxruntime contrib operators revgraph
    differentiates, which ONNX does not know, by :mod:`revgraph.ir.contrib_types`."""
    contrib = contrib_types.infer(node, types)
    if contrib:
        return contrib
    fast = fastshape.infer(node, types, values)
    if fast is not None:
        return {fast.name: fast}
    found = onnx_node_types(node, types, values, opset)
    for name, rank in fastshape.rank_types(node, types).items():
        known = found.get(name)
        if known is None or known.shape is None:
            found[name] = ValueInfo(name, known.dtype if known and known.dtype else rank.dtype, rank.shape)
    return found


def _declared(graph: Graph) -> dict[str, ValueInfo]:
    types = {vi.name: vi for vi in [*graph.value_info.values(), *graph.outputs] if vi.dtype is not None}
    types.update((k, ValueInfo(k, a.dtype, a.shape)) for k, a in graph.initializers.items())
    types.update((vi.name, vi) for vi in graph.inputs)
    return types


def constant_values(graph: Graph, types: Mapping[str, ValueInfo] | None = None) -> dict[str, np.ndarray]:
    """The values of ``graph`` known when it is built: its initializers, its ``Constant`` outputs (every form,
    :func:`constant_value`) and, given the types of its values, the shape arithmetic over them and over
    static shapes (``Concat(Slice(Shape(x)), Cast(Constant))``, the sizes PyTorch's exporter computes for
    Resize; :func:`revgraph.ir.fastshape.fold`), in node order."""
    values = {k: np.asarray(a) for k, a in graph.initializers.items()}
    for node in graph.nodes:
        if node.op_type == "Constant" and not node.domain:
            value = constant_value(node)
            if value is not None:
                values[node.outputs[0]] = np.asarray(value)
        elif types is not None and node.op_type in fastshape.FOLDABLE:
            value = fastshape.fold(node, values, types)
            if value is not None:
                values[node.outputs[0]] = value
    return values


def _infer_incrementally(graph: Graph) -> dict[str, ValueInfo] | None:
    """Types of ``graph`` when it declares the types of most of its values (a loaded graph, to which a loss or
    a few nodes were added): the declared ones, and node-by-node inference for the other nodes. ``None``
    when that does not apply (many undeclared values, or an undeclared node with subgraphs)."""
    types = _declared(graph)
    pending = [n for n in graph.nodes if any(o and o not in types for o in n.outputs)]
    if len(pending) > max(8, len(graph.nodes) // 10) or any(n.subgraphs for n in pending):
        return None
    values = {k: a for k, a in constant_values(graph, types).items() if a.size <= 64}
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
    # (shape inference helps the rules; they fall back to Shape-based ops without it: any failure is no types)
    with contextlib.suppress(Exception):
        proto = limits.infer_shapes(to_onnx(light))  # data propagation only where it stays small
        for vi in [*proto.graph.value_info, *proto.graph.output]:
            with contextlib.suppress(UnsupportedModelError):
                types[vi.name] = value_info_from_proto(vi)
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
        if node.subgraphs or all(_settled(types.get(o)) for o in outs):
            continue
        if any(i and (i not in types or types[i].shape is None) for i in node.inputs):
            continue
        if values is None:
            values = {k: a for k, a in constant_values(graph, types).items() if a.size <= 64}
        for name, vi in node_types(node, types, values, graph.opset).items():
            known = types.get(name)
            if vi.shape is not None and (known is None or known.shape is None
                                         or _static_dims(vi) > _static_dims(known)):
                dtype = vi.dtype if vi.dtype is not None or known is None else known.dtype
                types[name] = ValueInfo(name, dtype, vi.shape, vi.kind)
    return types


def _settled(vi: ValueInfo | None) -> bool:
    """A type whose every dimension is a number or a name the model gave (not one ONNX inference made up,
    ``unk__<k>``, which later folded values may pin down: the legacy exporter's computed Pad amounts)."""
    return vi is not None and vi.shape is not None and all(
        isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__")) for d in vi.shape)


def _static_dims(vi: ValueInfo) -> int:
    return -1 if vi.shape is None else sum(isinstance(d, int) for d in vi.shape)


def keep_types(g: Graph, types: dict[str, ValueInfo]) -> None:
    """Record the types the pass tracked as ``value_info``, so a later pass (gradients of gradients) has them."""
    declared = set(g.input_names) | set(g.output_names) | set(g.initializers)
    value_info = g.value_info
    for node in g.nodes:
        for o in node.outputs:
            vi = types.get(o)
            if vi is not None and vi.dtype is not None and vi.shape is not None and o and o not in declared:
                # the tracked type itself when it carries the name (nothing changes a ValueInfo in place)
                value_info[o] = vi if vi.name == o else ValueInfo(o, vi.dtype, vi.shape, vi.kind)
