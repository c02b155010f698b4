"""Reading ONNX models: files, bytes, external data and tensors, with one-line errors for bad input.

Everything here runs before revgraph has a :class:`~revgraph.ir.Graph`, on bytes the user gave: a fault is the
file's (exit 2), never revgraph's. :func:`model_proto` turns a path, bytes or a ``ModelProto`` into a
``ModelProto`` whose tensors hold their data; :func:`tensor_array` decodes one tensor;
:func:`check_graph_proto` refuses what the ONNX IR forbids and revgraph would otherwise trip over later
(empty names, attributes of the wrong type). The external-data rules: a tensor's data file is a regular file
in the model's directory or below it (``onnx`` refuses absolute paths, ``..`` and symbolic links), its
``offset`` and ``length`` are non-negative integers within the file, and it holds exactly the bytes that the
tensor's dims and type say. Bytes and ``ModelProto`` inputs have no directory: their external data is read
from ``base_dir``, and refused without one (never the process's working directory).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnx.external_data_helper
import onnx.inliner  # a submodule: `import onnx` alone does not load it
import onnx.shape_inference
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from ..errors import GraphError, RevgraphError
from ..ir import Graph
from ..ir.schema import get_schema
from ..limits import MAX_MODEL_BYTES, MAX_SUBGRAPH_NESTING, check_regular_file, read_regular_file

#: Attributes that hold axes of a tensor (ONNX's checks take them as 32-bit integers).
_AXIS_ATTRS = frozenset({"axis", "axes", "perm", "batch_axis", "time_axis"})
#: Element sizes in bits of the types whose external data size is checked (4-bit types pack two per byte).
_PACKED_BITS = {TensorProto.INT4: 4, TensorProto.UINT4: 4, TensorProto.FLOAT4E2M1: 4}


def read_model(path: str | os.PathLike) -> onnx.ModelProto:
    """The model in the file ``path``, its external data (next to it) included. Raises :class:`RevgraphError`
    for a missing file, a directory, a FIFO or device, a file over protobuf's 2 GiB limit, bytes that are not
    an ONNX model, and external data that is missing or does not fit the tensor."""
    data = read_regular_file(path, "model file", max_bytes=MAX_MODEL_BYTES)
    model = parse_model(data, repr(os.fspath(path)))
    load_external_data(model, Path(path).parent, repr(os.fspath(path)))
    return model


def parse_model(data: bytes, label: str) -> onnx.ModelProto:
    """``data`` parsed as an ``onnx.ModelProto`` (``label`` names it in messages); :class:`RevgraphError` if
    protobuf cannot parse it or it holds no graph."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise RevgraphError(f"{label} is not a readable ONNX model (protobuf parse failed: {type(exc).__name__}); "
                            "is the file complete, and its subgraphs nested at most "
                            f"{MAX_SUBGRAPH_NESTING} deep?") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise RevgraphError(f"{label} holds no ONNX graph; is it an ONNX model file?")
    return model


def model_proto(model: object, base_dir: str | os.PathLike | None = None) -> onnx.ModelProto:
    """A ``ModelProto`` whose tensors hold their data, from a path, serialized bytes or a ``ModelProto``.

    A path reads its external data next to the file; bytes and a ``ModelProto`` read it from ``base_dir``
    (a ``ModelProto`` is copied first: the caller's object is not changed), and refuse it without one.
    Raises :class:`RevgraphError`."""
    if isinstance(model, (bytes, bytearray, memoryview)):
        proto = parse_model(bytes(model), "the bytes given")
    elif isinstance(model, onnx.ModelProto):
        proto = model
        if _has_external_data(proto):
            proto = onnx.ModelProto()
            proto.CopyFrom(model)
    elif isinstance(model, (str, os.PathLike)):
        if base_dir is not None:
            raise RevgraphError("base_dir applies to bytes and ModelProto models; a model file reads its external "
                                "data from its own directory")
        return read_model(model)
    else:
        raise RevgraphError(f"cannot load a model from {type(model).__name__}; pass a path, an onnx.ModelProto or "
                            "the bytes of an ONNX file")
    if _has_external_data(proto):
        if base_dir is None:
            raise RevgraphError("the model keeps tensors in external data files; load it from its path, or pass "
                                "revgraph.load the directory of those files as base_dir=")
        load_external_data(proto, Path(base_dir), "the model")
    return proto


def _has_external_data(model: onnx.ModelProto) -> bool:
    return any(onnx.external_data_helper.uses_external_data(t) for t in _tensors(model.graph))


def _tensors(graph: onnx.GraphProto) -> list[TensorProto]:
    """Every ``TensorProto`` of ``graph`` and its subgraphs (iteratively): initializers, tensor attributes, and
    the ``values`` and ``indices`` of sparse initializers and sparse tensor attributes (a sparse ``Constant``'s
    ``sparse_value``), which may keep their data in external files like any tensor."""
    found, stack = [], [graph]
    while stack:
        g = stack.pop()
        found.extend(g.initializer)
        sparse = list(g.sparse_initializer)
        for node in g.node:
            for a in node.attribute:
                if a.type == AttributeProto.TENSOR:
                    found.append(a.t)
                found.extend(a.tensors)
                if a.type == AttributeProto.SPARSE_TENSOR:
                    sparse.append(a.sparse_tensor)
                sparse.extend(a.sparse_tensors)
                stack.extend([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs))
        for sp in sparse:
            found += [sp.values, sp.indices]
    return found


def load_external_data(model: onnx.ModelProto, base_dir: Path, label: str) -> None:
    """Read the external data of ``model``'s tensors from ``base_dir`` into the tensors (in place), after
    checking each entry (:func:`check_external_entry`). Raises :class:`RevgraphError` naming the tensor."""
    external = [t for t in _tensors(model.graph) if onnx.external_data_helper.uses_external_data(t)]
    for t in external:
        check_external_entry(t, base_dir, label)
    if not external:
        return
    try:
        # tensor by tensor: onnx's load_external_data_for_model skips sparse tensors, whose data numpy_helper
        # would later read relative to the process's working directory
        for t in external:
            onnx.external_data_helper.load_external_data_for_tensor(t, str(base_dir))
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:
        raise RevgraphError(f"{label}: its external data cannot be read ({_first_line(exc)}); keep the .data file "
                            "next to the model") from None


def check_external_entry(t: TensorProto, base_dir: Path, label: str) -> None:
    """Refuse (:class:`RevgraphError`) an external-data entry whose ``location`` is missing or not a regular
    file, whose ``offset`` or ``length`` is not a non-negative integer or reaches past the end of the file, or
    whose byte count differs from what the tensor's dims and type need. Reads nothing but the file's size."""
    entry = {e.key: e.value for e in t.external_data}
    what = f"{label}: tensor {t.name!r}"
    location = entry.get("location", "")
    if not location:
        raise RevgraphError(f"{what} says its data is external but names no file")
    numbers = {}
    for key in ("offset", "length"):
        if key in entry:
            try:
                numbers[key] = int(entry[key])
            except ValueError:
                raise RevgraphError(f"{what}: external data {key} {entry[key]!r} is not an integer") from None
            if numbers[key] < 0:
                raise RevgraphError(f"{what}: external data {key} {numbers[key]} is negative")
    path = base_dir / location
    if not os.path.lexists(path):
        raise RevgraphError(f"{what}: its external data file {location!r} does not exist; keep the .data file next "
                            "to the model")
    size = check_regular_file(path, "external data file").st_size
    offset = numbers.get("offset", 0)
    if offset > size:
        raise RevgraphError(f"{what}: external data offset {offset} is past the end of {location!r} ({size} bytes)")
    length = numbers.get("length", size - offset)
    if offset + length > size:
        raise RevgraphError(f"{what}: external data offset {offset} + length {length} reaches past the end of "
                            f"{location!r} ({size} bytes)")
    need = tensor_nbytes(t)
    if need is not None and need != length:
        raise RevgraphError(f"{what} ({_describe(t)}) needs {need} bytes; its external data holds {length}")


def tensor_nbytes(t: TensorProto) -> int | None:
    """The bytes of ``t``'s data in raw (little-endian, packed) form, from its dims and type; ``None`` for
    types of no fixed size (strings) or unknown ones."""
    count = math.prod(t.dims)
    if t.data_type in _PACKED_BITS:
        return (count * _PACKED_BITS[t.data_type] + 7) // 8
    if t.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return None
    try:
        return count * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None


def _describe(t: TensorProto) -> str:
    try:
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    except (KeyError, ValueError, TypeError):
        dtype = f"type {t.data_type}"
    return f"{dtype}{list(t.dims)}"


def tensor_array(t: TensorProto, where: str) -> np.ndarray:
    """``numpy_helper.to_array(t)`` with one-line errors naming the tensor (``where``: "initializer",
    "attribute 'value' of node 'c' (Constant)"): a negative dimension, data that does not match the dims (an
    initializer whose dims say 10^12 elements and that holds none), external data that was never read."""
    if any(d < 0 for d in t.dims):
        raise GraphError(f"{where} {t.name!r} has a negative dimension: dims {list(t.dims)}")
    if t.data_type not in TensorProto.DataType.values() or t.data_type == TensorProto.UNDEFINED:
        raise GraphError(f"{where} {t.name!r} has element type {t.data_type}, which ONNX does not define")
    if onnx.external_data_helper.uses_external_data(t):
        raise RevgraphError(f"{where} {t.name!r} keeps its data in an external file that was not read; load the "
                            "model from its path, or pass base_dir=")
    try:
        return numpy_helper.to_array(t)
    except Exception as exc:  # noqa: BLE001 - numpy's reshape error (the data does not fill the dims), an unknown type
        raise GraphError(f"{where} {t.name!r} ({_describe(t)}, {math.prod(t.dims):,} elements) does not hold its "
                         f"data: {_first_line(exc)}") from None


def check_graph_proto(gp: onnx.GraphProto, opsets: dict[str, int]) -> None:
    """Refuse (:class:`GraphError`) what the ONNX IR forbids in ``gp`` itself (not its subgraphs, which the
    caller converts one by one): names that are not UTF-8, an input, output or initializer with an empty
    name, an attribute without a type or of another type than its operator's schema declares (``Softmax``
    with ``axis="one"``)."""
    _check_text(gp)
    for kind, items in (("input", gp.input), ("output", gp.output), ("initializer", gp.initializer)):
        for k, item in enumerate(items):
            if not item.name:
                raise GraphError(f"graph {gp.name!r}: {kind} #{k + 1} has an empty name; ONNX values need names")
    schemas: dict[tuple[str, str], object] = {}
    for k, node in enumerate(gp.node):
        attributes = node.attribute
        if not attributes:  # (most nodes of a long chain: no schema lookup)
            continue
        key = (node.op_type, node.domain if node.domain != "ai.onnx" else "")
        if key not in schemas:
            schemas[key] = get_schema(*key, opsets)
        schema = schemas[key]
        for a in attributes:
            if a.ref_attr_name:
                continue  # a function's reference to its caller's attribute
            declared = schema.attributes.get(a.name) if schema is not None else None
            expected = declared.type if declared is not None else AttributeProto.UNDEFINED
            if a.type == AttributeProto.UNDEFINED or a.type not in AttributeProto.AttributeType.values():
                raise GraphError(f"{_node_label(node, k, gp)}: attribute {a.name!r} has no valid type ({a.type})")
            if expected not in (AttributeProto.UNDEFINED, a.type):
                raise GraphError(f"{_node_label(node, k, gp)}: attribute {a.name!r} is {_attr_kind(a.type)}; "
                                 f"{node.op_type} takes {_attr_kind(expected)}")
            if a.name in _AXIS_ATTRS and any(not -2**31 <= v < 2**31 for v in [*a.ints, a.i]):
                # ONNX's shape inference reads axes as 32-bit ints: 2^32 would pass its checks as axis 0
                raise GraphError(f"{_node_label(node, k, gp)}: attribute {a.name!r} holds "
                                 f"{next(v for v in [*a.ints, a.i] if not -2**31 <= v < 2**31)}, not an axis")


def _node_label(node: onnx.NodeProto, k: int, gp: onnx.GraphProto) -> str:
    """``node 'conv1' (Conv)``, or ``node #3 of graph 'g' (Conv)`` for an unnamed node (names come later)."""
    return (f"node {node.name!r}" if node.name else f"node #{k + 1} of graph {gp.name!r}") + f" ({node.op_type})"


def _check_text(gp: onnx.GraphProto) -> None:
    """Refuse (:class:`GraphError`) a name in ``gp`` that is not UTF-8: protobuf hands such a string field over
    as ``bytes`` (or raises ``UnicodeDecodeError``, which :func:`revgraph.load` turns into the same error)."""
    names = [gp.name, *(v.name for v in (*gp.input, *gp.output, *gp.value_info, *gp.initializer))]
    texts = []
    for node in gp.node:
        texts += node.input
        texts += node.output
        texts += (node.op_type, node.domain, node.name)
        if node.attribute:
            texts += (a.name for a in node.attribute)
    try:  # ("".join refuses a bytes item: one C loop instead of one isinstance call per name)
        "".join(names)
        "".join(texts)
        return
    except TypeError:
        pass  # find the culprit below
    if not all(isinstance(n, str) for n in names):
        bad = next(n for n in names if not isinstance(n, str))
        raise GraphError(f"graph {_text(gp.name)}: the name {bad!r} is not UTF-8 text; ONNX names are UTF-8")
    for k, node in enumerate(gp.node):
        fields = [node.op_type, node.domain, node.name, *node.input, *node.output, *(a.name for a in node.attribute)]
        if not all(isinstance(f, str) for f in fields):
            bad = next(f for f in fields if not isinstance(f, str))
            raise GraphError(f"node #{k + 1} of graph {_text(gp.name)}: the name {bad!r} is not UTF-8 text; ONNX "
                             "names are UTF-8")


def _text(name: str | bytes) -> str:
    return repr(name) if isinstance(name, str) else repr(name.decode("utf-8", "replace"))


def _attr_kind(t: int) -> str:
    name = AttributeProto.AttributeType.Name(t) if t in AttributeProto.AttributeType.values() else str(t)
    return {"INT": "an int", "FLOAT": "a float", "STRING": "a string", "TENSOR": "a tensor", "GRAPH": "a graph",
            "INTS": "a list of ints", "FLOATS": "a list of floats", "STRINGS": "a list of strings",
            "UNDEFINED": "of no type"}.get(name, name.lower())


def inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its model-local functions (as onnxscript writes them) inlined, also functions that call
    functions, and their domains dropped from the opset imports once no node uses them. ONNX forbids
    recursive functions; the inliner detects the cycle and :class:`GraphError` names it."""
    domains = {f.domain for f in model.functions}
    try:
        model = onnx.inliner.inline_local_functions(model, convert_version=True)
    except Exception as exc:  # noqa: BLE001 - the C++ inliner raises ValidationError or RuntimeError on a bad function
        if "Type unknown" not in str(exc):
            raise GraphError(f"the model's local functions cannot be inlined: {converter_error(exc)}") from None
        # converting a function written at another opset needs the types at its call sites
        try:
            typed = onnx.shape_inference.infer_shapes(model)
            model = onnx.inliner.inline_local_functions(typed, convert_version=True)
        except Exception as again:  # noqa: BLE001 - the inliner's errors, reported in one line
            raise GraphError(f"the model's local functions cannot be inlined: {converter_error(again)}") from None
    used = {n.domain for n in _proto_nodes(model.graph)}
    kept = [o for o in model.opset_import if o.domain not in domains or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return model


def _proto_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Every node of ``graph`` and of its subgraphs (an explicit stack: nesting depth is the file's choice)."""
    found, stack = [], [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            found.append(node)
            for a in node.attribute:
                stack.extend([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs))
    return found


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (``onnx`` errors span many lines)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def converter_error(exc: BaseException) -> str:
    """The reason in an ``onnx.version_converter`` error, without the C++ file and assertion text around it
    ("No Adapter To Version $19 for ConstantOfShape")."""
    text = _first_line(exc)
    return text.split(" failed: ", 1)[1] if " failed: " in text else text


def onnx_error_line(exc: BaseException) -> str:
    """The first error of an ONNX checker or shape-inference exception, as ``node 'm' (MatMul): <what>``."""
    text = _first_line(exc)
    match = re.search(r"\(op_type:([^,]+), node name: ([^)]*)\): (?:\[\w+\] )?(.*)", text)
    if match:
        op, name, what = match.groups()
        return f"node {name!r} ({op}): {what}" if name else f"a {op} node: {what}"
    return re.sub(r"^\[\w+\] ", "", text)


def check_loop_signatures(graph: Graph) -> None:
    """Raise :class:`GraphError` if a ``Loop`` body (at any depth) declares its iteration number, its condition
    input or its condition output with a rank other than 0: ONNX makes them scalars."""
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.nodes:
            stack.extend(node.subgraphs.values())
            body = node.attrs.get("body") if node.op_type == "Loop" and not node.domain else None
            if not isinstance(body, Graph) or len(body.inputs) < 2 or not body.outputs:
                continue
            roles = (("iteration number", body.inputs[0]), ("condition", body.inputs[1]),
                     ("condition output", body.outputs[0]))
            for role, vi in roles:
                if vi.shape is not None and len(vi.shape) != 0:
                    raise GraphError(f"body of {node.label()}: its {role} {vi.name!r} is declared {vi.describe()}; "
                                     "ONNX makes it a scalar")


def non_utf8_field(message) -> str | None:
    """The path (``graph.node[3].output[0]``) of the first string field of the protobuf ``message`` whose bytes
    are not UTF-8 (protobuf raises ``UnicodeDecodeError`` when such a field is read), or ``None``."""
    stack = [(message, "")]
    while stack:
        msg, path = stack.pop()
        for field in msg.DESCRIPTOR.fields:
            if field.type == field.TYPE_MESSAGE:
                if _is_repeated(field):
                    stack.extend((m, f"{path}.{field.name}[{k}]") for k, m in enumerate(getattr(msg, field.name)))
                elif msg.HasField(field.name):
                    stack.append((getattr(msg, field.name), f"{path}.{field.name}"))
            elif field.type == field.TYPE_STRING:
                try:
                    values = getattr(msg, field.name)
                    values = list(values) if _is_repeated(field) else [values]
                except UnicodeDecodeError:
                    return f"{path}.{field.name}".lstrip(".")
                for k, v in enumerate(values):
                    if isinstance(v, bytes):  # what protobuf gives for a string field that is not UTF-8
                        return f"{path}.{field.name}".lstrip(".") + (f"[{k}]" if _is_repeated(field) else "")
    return None


def _is_repeated(field) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5; `label` before
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED
