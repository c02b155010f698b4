"""ONNX in and out: :func:`load`, :func:`save`, :func:`to_onnx`.

On load a model is read and checked by :mod:`revgraph.onnx_io.reading` (regular files only, external data that fits
its tensors, tensors that hold their data, non-empty UTF-8 names, attributes of their schema's type), its
model-local functions are inlined (``onnx.inliner``), names written more than once are renamed into SSA form
(:mod:`revgraph.ir.ssa`), a default-domain opset older than :data:`revgraph.ir.TARGET_OPSET` (21) is converted up
to it with ``onnx.version_converter`` (a model at opset 21 or newer keeps its own, up to the newest the installed
onnx knows, :data:`revgraph.ir.NEWEST_OPSET`; ``load(opset=N)`` converts to N instead), and ONNX shape
inference fills in the types of intermediate values (with data propagation only where it cannot materialise a
value the model merely describes: :mod:`revgraph.limits`).
What revgraph writes is always SSA, at the graph's opset, with the lowest IR version that opset allows (so the
installed onnxruntime accepts it).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import numpy as np
import onnx
import onnx.shape_inference
import onnx.version_converter
from onnx import AttributeProto, helper, numpy_helper

from .. import limits
from .. import validate as V
from ..errors import GraphError, RevgraphError, UnsupportedModelError
from ..ir import NEWEST_OPSET, TARGET_OPSET, Graph, Node, ValueInfo, gc_paused, require_graph
from ..ir.arguments import GRAPH, OPSET, SAVABLE
from ..ir.constants import sparse_parts
from ..ir.schema import get_schema
from ..ir.ssa import is_ssa, to_ssa
from ..version import __version__
from .atomic import atomic_path
from .portable import identity_dropouts
from .reading import (  # noqa: F401  (read_model, converter_error: API of this module)
    check_graph_proto,
    converter_error,
    inline_functions,
    model_proto,
    non_utf8_field,
    read_model,
    tensor_array,
)
from .runtime_ops import convert_version
from .torch_names import keep_exporter_kinds
from .upgrade import fix_legacy_prelu, group_norm_per_channel, type_untyped_sequences

#: The operator domains ONNX defines; a model may import others (loaded; see :func:`load`).
KNOWN_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training")

#: The element types ONNX defines (0: undefined, an unknown type).
_ELEM_TYPES = frozenset(onnx.TensorProto.DataType.values())

_PASSTHROUGH_ATTRS = {
    AttributeProto.TYPE_PROTO,
    AttributeProto.TYPE_PROTOS,
    AttributeProto.SPARSE_TENSOR,
    AttributeProto.SPARSE_TENSORS,
}


@V.arguments(model=V.LOADABLE, opset=OPSET, base_dir=V.OPTIONAL_PATH)
def load(model: str | os.PathLike | onnx.ModelProto | bytes, *, opset: int | None = None,
         base_dir: str | os.PathLike | None = None) -> Graph:
    """Load an ONNX model as a :class:`Graph` in SSA form.

    The default-domain opset is the model's own when it is :data:`~revgraph.ir.TARGET_OPSET` (21) or newer; an
    older model is converted up to 21 (``onnx.version_converter``), the oldest opset whose operator forms the
    VJP rules emit. ``opset=N`` (21 to :data:`~revgraph.ir.NEWEST_OPSET`, the newest the installed onnx knows)
    converts the model to N instead. Gradient graphs are written at the graph's opset. A model newer than the
    installed onnx knows is refused; one newer than onnxruntime runs loads, and :class:`revgraph.Session`
    refuses to run it on onnxruntime.

    ``model`` is a path, an ``onnx.ModelProto`` or serialized bytes. A file reads its external data from its
    own directory; bytes and a ``ModelProto`` read it from ``base_dir`` and are refused without one
    (:func:`revgraph.onnx_io.reading.model_proto`; the caller's ``ModelProto`` is not changed). Raises
    :class:`RevgraphError` for an unreadable or non-regular file, bytes that are not a model, bad external data
    or tensors, names that are empty or not UTF-8, attributes of the wrong type;
    :class:`UnsupportedModelError` for a model revgraph cannot represent (optional or map types, sparse
    initializers) or whose opset cannot be converted. Operators of other domains than ONNX's (``com.microsoft``,
    custom ones) load; the gradient refuses those it has no rule for, naming each.
    """
    opset = None if opset is None else int(opset)  # (checked by OPSET: a numpy integer too)
    model = model_proto(model, base_dir)
    try:
        with gc_paused():
            return _convert(model, opset)
    except UnicodeDecodeError:  # a string field holds bytes that are not UTF-8: protobuf hands them over as bytes
        where = non_utf8_field(model) or "a name or string"
        raise GraphError(f"the model's field {where} is not UTF-8 text; ONNX names and strings are UTF-8") from None


def target_opset(original: int, opset: int | None = None) -> int:
    """The default-domain opset :func:`load` gives a model at opset ``original``: ``opset`` when given, else the
    model's own when it is :data:`~revgraph.ir.TARGET_OPSET` or newer, else ``TARGET_OPSET``."""
    if opset is not None:
        return opset
    return max(original, TARGET_OPSET)


def _convert(model: onnx.ModelProto, opset: int | None) -> Graph:
    """:func:`load` once the model's tensors hold their data."""
    if model.functions:
        model = inline_functions(model)
    opsets = {o.domain: o.version for o in model.opset_import}
    if "ai.onnx" in opsets:
        opsets[""] = opsets.pop("ai.onnx")
    bad = {d: v for d, v in opsets.items() if not 1 <= v < 2**31}
    if bad:
        domain, version = next(iter(bad.items()))
        raise UnsupportedModelError(f"the model imports opset {version} of domain {domain or 'ai.onnx'!r}; opset "
                                    "versions are positive (ONNX's default domain is at most "
                                    f"{onnx.defs.onnx_opset_version()})")
    # Other operator domains (com.microsoft's contrib operators, custom ones) load: a domain imported and used
    # by no node is common (onnxruntime's transformer optimizer imports 8), and a node of one is refused only
    # where it must be differentiated and has no rule, naming it (autodiff.registry.unsupported_message).
    if opsets.get("", 0) > NEWEST_OPSET:
        raise UnsupportedModelError(
            f"the model is at opset {opsets['']}; the installed onnx {onnx.__version__} knows opsets up to "
            f"{NEWEST_OPSET} (its operator schemas and shape inference): upgrade onnx, or export at opset "
            f"{NEWEST_OPSET} or older")
    if not model.graph.node and not model.graph.output:
        raise RevgraphError("the model holds an empty graph")
    graph = graph_from_proto(model.graph, opsets)
    original = opsets.get("", TARGET_OPSET)
    opset = target_opset(original, opset)
    if original < 7:
        fix_legacy_prelu(graph)
    if not is_ssa(graph):
        graph = to_ssa(graph)
    type_untyped_sequences(graph)  # before the proto below is typed by shape inference
    light, big = light_graph(graph)
    proto = _ssa_to_onnx(light)
    renumber = _renumbering_converts(graph, original, opset)
    if renumber:
        for o in proto.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = opset
    elif original != opset:
        try:
            proto = convert_version(proto, opset)  # (onnxruntime's default-domain operators pass through)
        except Exception as exc:  # noqa: BLE001 - the converter's many failures, one line
            raise UnsupportedModelError(
                f"cannot convert the model from opset {original} to opset {opset} "
                f"(onnx.version_converter: {converter_error(exc)})"
            ) from None
    with contextlib.suppress(Exception):  # shape inference is a help for rules, never a requirement
        proto = limits.infer_shapes(proto)  # data propagation only where it cannot materialise a huge value
    if (original == opset or renumber) and not any(_subgraph_attrs(n) for n in graph.nodes):
        # No node converted: inference added types only (value_info, and the outputs' own), and the graph read
        # back from its proto would be ``graph`` again (a subgraph's value_info comes from the proto below).
        graph.value_info = {v.name: value_info_from_proto(v) for v in proto.graph.value_info}
        graph.outputs = [value_info_from_proto(v) for v in proto.graph.output]
        graph.opsets = {o.domain or "": o.version for o in proto.opset_import}
        result = graph
    else:
        result = graph_from_proto(proto.graph, {o.domain or "": o.version for o in proto.opset_import})
        declared = set(graph.input_names)
        result.inputs = [v for v in result.inputs if v.name not in big or v.name in declared]
        added = {k: a for k, a in result.initializers.items() if k not in graph.initializers}
        result.initializers = {**{k: big.get(k, result.initializers.get(k)) for k in graph.initializers}, **added}
    if original < 21 <= result.opset:
        group_norm_per_channel(result)
    _name_nodes(result)
    result.source_opset = original
    result.metadata = {p.key: p.value for p in model.metadata_props}
    keep_exporter_kinds(model, result.metadata)  # which initializers are parameters: the default trainable set
    result.check()
    return result


#: Opset steps (by the version they reach) at which ``onnx.version_converter``'s adapters change no node but
#: those of the operators listed: every other operator's adapter there is a ``CompatibleAdapter``, which only
#: renumbers the opset (onnx/version_converter/convert.h, "20 -> 21").
_RENUMBER_ONLY = {21: frozenset({"GroupNormalization"})}


def _renumbering_converts(graph: Graph, original: int, opset: int) -> bool:
    """Does renumbering the default-domain opset import convert ``graph`` from opset ``original`` to ``opset``,
    as ``onnx.version_converter`` would (every step is in :data:`_RENUMBER_ONLY`, and the graph has none of the
    operators whose adapters rewrite nodes there)? PyTorch's exporter writes opset 20. The converter costs 4 to
    8 ms even for a 5-node model (most of an MLP's build): it builds its adapter table and an IR copy of the
    graph on every call."""
    steps = range(original + 1, opset + 1)
    if original >= opset or not all(v in _RENUMBER_ONLY for v in steps):
        return False
    ops = {n.op_type for _, n in graph.walk() if n.domain in ("", "ai.onnx")}
    return not any(ops & _RENUMBER_ONLY[v] for v in steps)


def _subgraph_attrs(node: Node) -> bool:
    """Does ``node`` have a subgraph attribute (a graph, or a list of graphs)?"""
    return any(isinstance(v, Graph) or (isinstance(v, list) and v and isinstance(v[0], Graph))
               for v in node.attrs.values())


def _name_nodes(graph: Graph) -> None:
    """Give unnamed nodes a name (``<op_type>_<k>``) so that messages and gradient nodes can refer to them."""
    if all(node.name for _, node in graph.walk()):
        return
    used = {n.name for _, n in graph.walk() if n.name}
    counter = 0
    for _, node in graph.walk():
        if not node.name:
            while f"{node.op_type}_{counter}" in used:
                counter += 1
            node.name = f"{node.op_type}_{counter}"
            used.add(node.name)


# ---------------------------------------------------------------------------------------------- ONNX -> IR


def value_info_from_proto(vi: onnx.ValueInfoProto) -> ValueInfo:
    """Convert a ``ValueInfoProto``; raise :class:`UnsupportedModelError` for non-tensor, non-sequence types."""
    try:  # a graph repeats a few types thousands of times: read each once (by its serialized bytes)
        dtype, shape, kind = _cached_type(vi.type.SerializeToString())
    except UnsupportedModelError:
        dtype, shape, kind = _read_type(vi.type, vi.name)  # raises again, naming the value
    return ValueInfo(vi.name, dtype, shape, kind)


@functools.lru_cache(maxsize=4096)
def _cached_type(serialized: bytes) -> tuple:
    return _read_type(onnx.TypeProto.FromString(serialized), "")


def _read_type(t: onnx.TypeProto, name: str) -> tuple:
    """``(dtype, shape, kind)`` of the type ``t`` of value ``name`` (see :class:`ValueInfo`)."""
    which = t.WhichOneof("value")
    if which is None:
        return None, None, "tensor"
    kind = "tensor"
    if which == "sequence_type" and t.sequence_type.elem_type.WhichOneof("value") == "tensor_type":
        kind, t = "sequence", t.sequence_type.elem_type
    elif which != "tensor_type":
        readable = which.replace("_type", "").replace("_", " ")
        # a sequence of maps is what ai.onnx.ml ZipMap writes (skl2onnx's default classifier output)
        zipmap = which == "sequence_type" and t.sequence_type.elem_type.WhichOneof("value") == "map_type"
        raise UnsupportedModelError(
            f"value {name!r} has {readable} type; revgraph handles tensors and sequences of tensors"
            + ("; a sequence of maps is ZipMap's output: convert the classifier without it (skl2onnx: "
               "options={id(model): {'zipmap': False}}) or remove the ZipMap node" if zipmap else "")
        )
    tt = t.tensor_type
    if tt.elem_type not in _ELEM_TYPES:
        raise UnsupportedModelError(f"value {name!r} has element type {tt.elem_type}, which ONNX does not define")
    dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else None
    shape = None
    if tt.HasField("shape"):
        # a negative dim_value (some converters write -1 for "unknown") is taken as unknown
        shape = tuple(
            (d.dim_value if d.dim_value >= 0 else None) if d.HasField("dim_value")
            else (d.dim_param if d.HasField("dim_param") else None)
            for d in tt.shape.dim
        )
    return dtype, shape, kind


def _attr_from_proto(a: AttributeProto, opsets: dict[str, int], node: onnx.NodeProto | None = None) -> Any:
    place = f"attribute {a.name!r}" + (f" of node {node.name!r} ({node.op_type})" if node is not None else "")
    if a.type in (AttributeProto.SPARSE_TENSOR, AttributeProto.SPARSE_TENSORS) and not a.ref_attr_name:
        # kept as protos, but checked now: runtimes densify them with whatever indices they hold (a repeated
        # index silently keeps one of its values, an unsorted one is accepted by one runtime only)
        for sp in [a.sparse_tensor] if a.type == AttributeProto.SPARSE_TENSOR else a.sparse_tensors:
            sparse_parts(sp, place)
    if a.type in _PASSTHROUGH_ATTRS or a.ref_attr_name:
        return a
    if a.type == AttributeProto.GRAPH:
        return graph_from_proto(a.g, opsets)
    if a.type == AttributeProto.GRAPHS:
        return [graph_from_proto(g, opsets) for g in a.graphs]
    where = place + ":"
    if a.type == AttributeProto.TENSOR:
        return tensor_array(a.t, f"{where} tensor")
    if a.type == AttributeProto.TENSORS:
        return [tensor_array(t, f"{where} tensor") for t in a.tensors]
    if a.type == AttributeProto.STRING:
        return a.s.decode("utf-8", errors="surrogateescape")
    if a.type == AttributeProto.STRINGS:
        return [s.decode("utf-8", errors="surrogateescape") for s in a.strings]
    return helper.get_attribute_value(a)


def graph_from_proto(gp: onnx.GraphProto, opsets: dict[str, int]) -> Graph:
    """Convert a ``GraphProto`` (and its subgraphs) to a :class:`Graph`. Names may be written twice."""
    if gp.sparse_initializer:
        raise UnsupportedModelError(
            f"graph {gp.name!r} has sparse initializers ({gp.sparse_initializer[0].values.name!r}); "
            "store them dense"
        )
    check_graph_proto(gp, opsets)
    initializers = {t.name: tensor_array(t, "initializer") for t in gp.initializer}
    nodes = [
        Node(
            n.op_type,
            n.input,  # (Node copies them into lists)
            n.output,
            {a.name: _attr_from_proto(a, opsets, n) for a in n.attribute} if n.attribute else {},
            n.name,
            n.domain if n.domain != "ai.onnx" else "",
        )
        for n in gp.node
    ]
    value_info = {v.name: value_info_from_proto(v) for v in gp.value_info}
    for n in nodes:  # a Constant's type is its value's: the genai builder declares some scalars' rank wrongly
        value = n.attrs.get("value") if n.op_type == "Constant" and not n.domain and n.outputs else None
        if isinstance(value, np.ndarray) and n.outputs[0] in value_info:
            value_info[n.outputs[0]] = ValueInfo(n.outputs[0], value.dtype, value.shape)
    return Graph(
        nodes=nodes,
        # An input that also has an initializer (IR < 4 style) is a weight with a default: keep it an initializer.
        inputs=[value_info_from_proto(v) for v in gp.input if v.name not in initializers],
        outputs=[value_info_from_proto(v) for v in gp.output],
        initializers=initializers,
        value_info=value_info,
        name=gp.name or "graph",
        opsets=dict(opsets),
        doc_string=gp.doc_string,
    )


# ---------------------------------------------------------------------------------------------- IR -> ONNX


def value_info_to_proto(vi: ValueInfo) -> onnx.ValueInfoProto:
    """Convert a :class:`ValueInfo` (unknown dtype becomes ``UNDEFINED``, unknown shape is left out)."""
    proto = onnx.ValueInfoProto()
    proto.name = vi.name
    shape = None if vi.shape is None else tuple(vi.shape)
    proto.type.CopyFrom(_type_proto(vi.kind, vi.dtype, shape))
    return proto


@functools.lru_cache(maxsize=4096)
def _type_proto(kind: str, dtype: np.dtype | None, shape: tuple | None) -> onnx.TypeProto:
    # Gradient graphs repeat a few types thousands of times; building each TypeProto once saves a third
    # of the time of writing them.
    elem = helper.np_dtype_to_tensor_dtype(dtype) if dtype is not None else onnx.TensorProto.UNDEFINED
    tensor_type = helper.make_tensor_type_proto(elem, None if shape is None else list(shape))
    return helper.make_sequence_type_proto(tensor_type) if kind == "sequence" else tensor_type


#: Attribute types :func:`_numeric_attr` writes, by how to read a value of that type.
_NUMERIC = {AttributeProto.INT: int, AttributeProto.FLOAT: float, AttributeProto.INTS: int,
            AttributeProto.FLOATS: float}
_LISTS = (AttributeProto.INTS, AttributeProto.FLOATS)


def _numeric_attr(key: str, value: Any, attr_type: int) -> AttributeProto:
    """The fields ``onnx.helper.make_attribute`` writes for an int, float, ints or floats attribute, without its
    checks of the value's Python type against the ``numbers`` ABCs (which took most of the time of writing the
    attributes of a convolutional gradient graph)."""
    a = AttributeProto()
    a.name = key
    a.type = attr_type
    read = _NUMERIC[attr_type]
    if attr_type == AttributeProto.INT:
        a.i = read(value)
    elif attr_type == AttributeProto.FLOAT:
        a.f = read(value)
    elif attr_type == AttributeProto.INTS:
        a.ints.extend(read(v) for v in value)
    else:
        a.floats.extend(read(v) for v in value)
    return a


def attr_to_proto(node: Node, key: str, value: Any, opsets: dict[str, int]) -> AttributeProto:
    """The attribute ``key`` of ``node``, typed by its schema at ``opsets`` (subgraphs too: a body built by
    revgraph has no opsets of its own, it is written at its model's)."""
    if isinstance(value, AttributeProto):
        a = AttributeProto()
        a.CopyFrom(value)
        a.name = key
        return a
    if isinstance(value, Graph):
        return helper.make_attribute(key, graph_to_proto(value, opsets))
    if isinstance(value, np.ndarray):  # (the fields make_attribute writes for a tensor)
        a = AttributeProto()
        a.name = key
        a.t.CopyFrom(numpy_helper.from_array(value))
        a.type = AttributeProto.TENSOR
        return a
    domain = node.domain or ""
    version = opsets.get(domain, opsets.get("ai.onnx") if domain == "" else None)
    attr_type = _attr_types(node.op_type, domain, version).get(key)
    if attr_type in _NUMERIC and isinstance(value, list) == (attr_type in _LISTS) and (
            isinstance(value, list) or type(value) in (int, float)):
        return _numeric_attr(key, value, attr_type)
    if isinstance(value, (list, tuple)):
        value = [
            graph_to_proto(v, opsets) if isinstance(v, Graph)
            else numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v
            for v in value
        ]
        if attr_type == AttributeProto.FLOATS:
            value = [float(v) for v in value]
        elif attr_type == AttributeProto.INTS:
            value = [int(v) for v in value]
    elif attr_type == AttributeProto.FLOAT:
        value = float(value)
    elif attr_type == AttributeProto.INT:
        value = int(value)
    # string attributes were read with surrogateescape (ONNX strings may hold any bytes): write the same bytes
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = [v.encode("utf-8", "surrogateescape") for v in value]
    return helper.make_attribute(key, value, attr_type=attr_type)


@functools.lru_cache(maxsize=1024)
def _attr_types(op_type: str, domain: str, version: int | None) -> dict[str, int]:
    """The attribute types of ``domain::op_type``'s schema at opset ``version`` by name (``{}`` if unknown): a
    schema lookup per attribute written was a tenth of the time of writing a convolutional gradient graph."""
    schema = get_schema(op_type, domain, {domain: version}) if version is not None else None
    return {} if schema is None else {k: int(a.type) for k, a in schema.attributes.items()}


def graph_to_proto(graph: Graph, opsets: dict[str, int] | None = None) -> onnx.GraphProto:
    """Convert a :class:`Graph` to a ``GraphProto`` as it is (no SSA renaming; see :func:`to_onnx`), its
    attributes typed at ``opsets`` (default: the graph's own; a subgraph is written at its model's)."""
    opsets = graph.opsets if opsets is None else opsets
    gp = onnx.GraphProto()
    fill_nodes(gp, graph.nodes, opsets)
    gp.name = graph.name or "graph"
    for vi in graph.inputs:
        _add_value_info(gp.input, vi)
    for vi in graph.outputs:
        _add_value_info(gp.output, vi)
    gp.initializer.extend(numpy_helper.from_array(np.asarray(a), name=k) for k, a in graph.initializers.items())
    fill_value_info(gp, graph.value_info.items(), set(graph.input_names) | set(graph.output_names))
    if graph.doc_string:
        gp.doc_string = graph.doc_string
    return gp


def fill_nodes(gp: onnx.GraphProto, nodes, opsets: dict[str, int]) -> None:
    """Append ``nodes`` to ``gp.node`` with the fields ``onnx.helper.make_node`` writes (a node's name and
    domain only when set), filled in place in the repeated field: building each message apart and extending
    the graph with it copies it again, and that was a third of the time of writing a large gradient graph."""
    add_node = gp.node.add
    for node in nodes:
        proto = add_node()
        proto.op_type = node.op_type
        proto.input.extend(node.inputs)
        proto.output.extend(node.outputs)
        if node.name:
            proto.name = node.name
        if node.domain:
            proto.domain = node.domain
        if node.attrs:
            proto.attribute.extend(attr_to_proto(node, k, v, opsets) for k, v in node.attrs.items())


def fill_value_info(gp: onnx.GraphProto, items, declared: set[str]) -> None:
    """Append a ``value_info`` entry to ``gp`` for each ``(name, ValueInfo)`` of ``items`` whose name is not in
    ``declared`` (the graph's inputs and outputs, typed there); :func:`_add_value_info` inlined: gradient graphs
    type every value."""
    add_value_info = gp.value_info.add
    for k, vi in items:
        if k not in declared:
            proto = add_value_info()
            proto.name = vi.name
            proto.type.CopyFrom(_type_proto(vi.kind, vi.dtype, None if vi.shape is None else tuple(vi.shape)))


def _add_value_info(field, vi: ValueInfo) -> None:
    """Append :func:`value_info_to_proto` of ``vi`` to the repeated field ``field`` (in place, no copy)."""
    proto = field.add()
    proto.name = vi.name
    proto.type.CopyFrom(_type_proto(vi.kind, vi.dtype, None if vi.shape is None else tuple(vi.shape)))


@V.arguments(graph=GRAPH, producer=V.TEXT)
def to_onnx(graph: Graph, *, producer: str = "revgraph") -> onnx.ModelProto:
    """The ``onnx.ModelProto`` of ``graph``, renamed into SSA form first if it writes a name twice.

    The IR version is the lowest that the graph's opsets allow (``onnx.helper.find_min_ir_version_for``),
    at least 4 so that initializers need not be graph inputs. ``Dropout`` nodes that draw nothing are written as
    ``Identity`` (:func:`revgraph.onnx_io.portable.identity_dropouts`: some runtimes refuse training-mode Dropout).
    """
    require_graph(graph, "to_onnx")
    with gc_paused():
        return _ssa_to_onnx(as_written(graph), producer)


def as_written(graph: Graph) -> Graph:
    """``graph`` as :func:`to_onnx` writes it: ``Dropout`` identities rewritten, in SSA form (``graph`` itself
    when nothing changes)."""
    graph = identity_dropouts(graph)
    return graph if is_ssa(graph) else to_ssa(graph)


def _ssa_to_onnx(graph: Graph, producer: str = "revgraph") -> onnx.ModelProto:
    """:func:`to_onnx` of a graph in SSA form (refused, one line, where protobuf could not read it back)."""
    limits.check_nesting(graph)
    opset_imports = [helper.make_opsetid(d, v) for d, v in sorted(graph.opsets.items())]
    model = helper.make_model(graph_to_proto(graph), opset_imports=opset_imports, producer_name=producer)
    model.producer_version = __version__
    if graph.metadata:
        helper.set_model_props(model, dict(graph.metadata))
    model.ir_version = max(4, helper.find_min_ir_version_for(opset_imports, ignore_unknown=True))
    if any(not o.type.tensor_type.elem_type for o in model.graph.output if o.type.HasField("tensor_type")):
        _fill_output_types(model)
    return model


def _fill_output_types(model: onnx.ModelProto) -> None:
    """Runtimes need typed graph outputs; take the types that ONNX shape inference finds."""
    try:
        inferred = limits.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is a help: no types added without it
        return
    found = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]}
    for out in model.graph.output:
        vi = found.get(out.name)
        if not out.type.tensor_type.elem_type and vi is not None and vi.type.tensor_type.elem_type:
            out.type.CopyFrom(vi.type)


#: file name suffixes of other formats than ONNX: :func:`save` refuses to write a model under one
OTHER_FORMATS = {".safetensors": "a safetensors file", ".pt": "a PyTorch file", ".pth": "a PyTorch file",
                 ".ckpt": "a checkpoint", ".npz": "a NumPy archive", ".npy": "a NumPy array", ".h5": "an HDF5 file",
                 ".keras": "a Keras file", ".pkl": "a pickle", ".json": "a JSON file"}


def refuse_other_format(path: str | os.PathLike, label: str | None = None) -> None:
    """Raise :class:`RevgraphError` (one line) when ``path`` names another format than ONNX
    (:data:`OTHER_FORMATS`), where a user expects that format (issue 38: ``Trainer.export("x.safetensors")``
    wrote ONNX under that name); ``label``: the option that gave the path (``-o``), named in the message."""
    text = os.fsdecode(os.fspath(path))
    other = OTHER_FORMATS.get(os.path.splitext(text)[1].lower())
    if other:
        said = f"{label} {text!r} names {other}, but it gets" if label else f"{text!r} names {other}, but this writes"
        raise RevgraphError(f"{said} an ONNX model: give a name ending in .onnx")


@V.arguments(graph=SAVABLE)  # (the path: atomic.py's checks)
def save(graph: Graph | onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write ``graph`` to ``path`` as ONNX, atomically: a crash mid-write never leaves a half-written file.

    Models over protobuf's 2 GiB limit are written with their large tensors as external data in a new
    ``<path>.data`` next to the model (:func:`revgraph.onnx_io.external_data.save_external`); a ``ModelProto`` passed
    in is not changed. Raises :class:`RevgraphError` for a path named as another format (:data:`OTHER_FORMATS`:
    ``.safetensors``, ``.pt``, ``.npz``, ...), where a user expects that format.
    """
    from . import external_data

    if not isinstance(path, (str, os.PathLike)):
        raise RevgraphError(f"save writes to a path (str or os.PathLike), got {type(path).__name__}")
    refuse_other_format(path)
    if not isinstance(graph, onnx.ModelProto):
        require_graph(graph, "save")
    model = graph if isinstance(graph, onnx.ModelProto) else to_onnx(graph)
    if external_data.too_large(model):
        external_data.save_external(model, path)
        return
    data = model.SerializeToString()  # before the temporary file exists: a signal meanwhile leaves nothing
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def light_graph(graph: Graph) -> tuple[Graph, dict[str, np.ndarray]]:
    """``graph`` with its large initializers turned into typed graph inputs, and those initializers.

    Weights enter the version converter and shape inference this way: their values only matter when small
    (shapes, axes, scales), and serializing megabytes of them for each of those passes dominated the time of
    :func:`load` and :func:`infer_types` (the version converter alone took half of an MLP's build)."""
    big = {k: a for k, a in graph.initializers.items() if np.asarray(a).size > 4096}
    if not big:
        return graph, big
    declared = set(graph.input_names)  # an initializer may also be a graph input (IR version < 4)
    extra = [ValueInfo(k, a.dtype, a.shape) for k, a in big.items() if k not in declared]
    light = Graph(graph.nodes, [*graph.inputs, *extra],
                  graph.outputs, {k: a for k, a in graph.initializers.items() if k not in big}, graph.value_info,
                  graph.name, graph.opsets)
    return light, big
