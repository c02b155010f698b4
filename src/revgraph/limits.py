"""Bounds on what revgraph reads and allocates before it is asked to run a model.

A model file is a few bytes that may *describe* terabytes: a declared input of 10^15 elements, a
``ConstantOfShape`` of 10^12 elements, a ``Range`` up to 10^12. revgraph allocates memory proportional to such
a number only when it runs the model (and then the runtime refuses what it cannot allocate); before that,
reading, converting, typing and differentiating a model costs memory proportional to the file. This module
holds the checks that keep that promise, each refusing in one line (:class:`RevgraphError`):

- :func:`read_regular_file`: model files, ``.npz`` files and external data must be regular files (a FIFO
  would block forever, ``/dev/zero`` would be read until memory runs out), and a model file at most protobuf's
  2 GiB limit;
- :func:`check_allocation`: arrays revgraph makes up itself (random inputs, lifted constants) have at most
  :data:`MAX_RANK` dimensions and :data:`MAX_MATERIALIZED_BYTES` bytes;
- :data:`MAX_RULE_CONSTANT_ELEMENTS`: a VJP or JVP rule writes a table it can compute when the gradient is
  built (a pooling window table, an interpolation matrix, an identity, an index grid) as a ``Constant`` only
  up to this many elements, and computes a larger one in the graph at run time (``Range``,
  ``ConstantOfShape``, ``EyeLike``: :mod:`revgraph.autodiff.rules.tables`), so that the build's memory and
  the written graph follow the model's size, not the tensor sizes it declares;
- :func:`data_propagation_is_bounded`: ONNX shape inference with data propagation represents every rank-1
  input of a data-propagating operator (``Add``, ``Mul``, ``Concat``, ...) with a static length N as N
  protobuf dimensions (about 140 bytes each), so ``Range(0, 1e12, 1)`` feeding a ``Mul`` grows the process by
  terabytes; :func:`infer_shapes` runs data propagation only where those lengths are small, and infers without
  it otherwise.
"""

from __future__ import annotations

import math
import os
import stat

import numpy as np
import onnx
import onnx.shape_inference
from onnx import AttributeProto

from .errors import InputError, RevgraphError

#: protobuf cannot parse a message over 2 GiB; larger models keep their tensors as external data.
MAX_MODEL_BYTES = 2**31 - 1
#: numpy's limit on the number of dimensions of an array (``numpy.ndarray`` refuses more).
MAX_RANK = 64
#: The largest array revgraph makes up itself (random inputs of one run, one lifted constant): 2 GiB.
MAX_MATERIALIZED_BYTES = 2**31
#: The most elements a rule's constant whose size follows a tensor's (declared) size may have: 4096 (32 KiB of
#: int64). Larger tables are computed in the graph at run time (:mod:`revgraph.autodiff.rules.tables`).
#: Constants that follow the model's own data (a normalized copy of a constant index initializer) are not
#: bounded by this: they are as large as the model already is.
MAX_RULE_CONSTANT_ELEMENTS = 4096
#: Operators whose ONNX data-propagation function reads the values of their inputs (onnx 1.23: the schemas
#: with ``has_data_propagation_function``).
DATA_PROPAGATING_OPS = frozenset(
    {"Add", "Cast", "Concat", "Gather", "Mul", "Shape", "Size", "Slice", "Squeeze", "Sub", "Unsqueeze"})
#: Those that read their inputs' values (``Shape`` and ``Size`` read only their input's shape).
READS_VALUES = DATA_PROPAGATING_OPS - {"Shape", "Size"}
#: Data propagation runs when the static lengths of the rank-1 inputs of data-propagating operators add up to
#: at most this many elements (about 140 bytes of protobuf each: 150 MB at most). Shape computations, what
#: data propagation is for, read vectors of a few elements.
MAX_PROPAGATED_ELEMENTS = 2**20
#: The most nodes (subgraphs included) ``revgraph check`` takes: it builds the gradient graph and runs it and the
#: forward graph on onnxruntime in float64, whose session creation grows about as n^1.2; a 100,000-node chain
#: takes 80 CPU s (issue 40: 200,000 nodes took over 300 s). ``revgraph.check_gradients`` has no such bound.
MAX_CHECK_NODES = 100_000
#: The deepest nesting of subgraphs (Loop, Scan and If bodies in bodies) a model may have: protobuf parses
#: messages at most 100 levels deep (upb's and the C++ runtime's default), and each subgraph costs three (node,
#: attribute, graph) plus up to five for the value types inside it; onnx.load, onnx's shape inference and
#: onnxruntime all refuse a model nested 32 deep (issue 39: the Jacobian of a model nested 31 deep adds a Loop).
MAX_SUBGRAPH_NESTING = 31


def read_regular_file(path: str | os.PathLike, what: str, *, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file ``path``; ``what`` names it in messages ("model", "--inputs file").

    Opens without blocking (a FIFO would wait for a writer forever), then refuses, from the open descriptor,
    anything that is not a regular file (a FIFO, a device such as ``/dev/zero``, a socket, a directory) and a
    file over ``max_bytes``, before reading it. Raises :class:`RevgraphError`."""
    fd = open_regular_file(path, what, max_bytes=max_bytes)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def open_regular_file(path: str | os.PathLike, what: str, *, max_bytes: int | None = None) -> int:
    """A file descriptor on the regular file ``path`` (checked as :func:`read_regular_file` says)."""
    text = os.fspath(path)
    if not text:
        raise RevgraphError(f"the {what} path is empty")
    try:
        fd = os.open(text, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise RevgraphError(f"{text!r}: no such file") from None
    except IsADirectoryError:
        raise RevgraphError(f"{text!r} is a directory, not a {what}") from None
    except OSError as exc:
        raise RevgraphError(f"cannot read {text!r} ({exc.strerror or type(exc).__name__})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise RevgraphError(f"{text!r} is a directory, not a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise RevgraphError(f"{text!r} is not a regular file ({_file_kind(st.st_mode)}); the {what} must be "
                                "a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise RevgraphError(f"{text!r} has {st.st_size:,} bytes, over protobuf's limit of {max_bytes:,} for a "
                                f"{what}; store its weights as ONNX external data")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular_file(path: str | os.PathLike, what: str) -> os.stat_result:
    """``os.stat`` of ``path`` (following links) if it is a regular file; :class:`RevgraphError` otherwise."""
    text = os.fspath(path)
    try:
        st = os.stat(text)
    except FileNotFoundError:
        raise RevgraphError(f"{text!r}: no such file") from None
    except OSError as exc:
        raise RevgraphError(f"cannot read {text!r} ({exc.strerror or type(exc).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise RevgraphError(f"{text!r} is not a regular file ({_file_kind(st.st_mode)}); the {what} must be a "
                            "regular file")
    return st


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def check_nesting(graph, what: str = "the graph") -> None:
    """Raise :class:`RevgraphError` (one line, naming the innermost chain of nodes) when ``graph`` (a
    :class:`revgraph.ir.Graph`) nests subgraphs deeper than :data:`MAX_SUBGRAPH_NESTING`: such a model can be
    built in memory but not written as ONNX that anything can read back. An iterative walk."""
    deepest: tuple[int, list[str]] = (0, [])
    stack = [(graph, 0, [])]
    while stack:
        g, depth, path = stack.pop()
        for node in g.nodes:
            for sub in node.subgraphs.values():
                chain = [*path, node.name or node.op_type]
                if depth + 1 > deepest[0]:
                    deepest = (depth + 1, chain)
                stack.append((sub, depth + 1, chain))
    depth, chain = deepest
    if depth > MAX_SUBGRAPH_NESTING:
        shown = " > ".join(repr(n) for n in (chain if len(chain) <= 4 else [*chain[:2], "...", *chain[-2:]]))
        raise RevgraphError(f"{what} nests subgraphs {depth} deep ({shown}), more than the {MAX_SUBGRAPH_NESTING} "
                            "levels an ONNX file can hold (protobuf reads messages at most 100 levels deep); "
                            "flatten nested If or Loop nodes (jacobian and hessian wrap the model in one more Loop; "
                            "hvp and jvp add no level)")


def check_allocation(label: str, shape: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    """Refuse (:class:`InputError`) to make up the array ``label`` ("input 'x'") of ``shape`` and ``dtype``
    with more than :data:`MAX_RANK` dimensions or more than :data:`MAX_MATERIALIZED_BYTES` bytes; ``what``
    says what revgraph makes it for ("a random input", "a lifted constant"). Python integers: no overflow."""
    if len(shape) > MAX_RANK:
        raise InputError(f"{label} has rank {len(shape)}; revgraph makes up arrays of at most {MAX_RANK} "
                         f"dimensions (numpy's limit) for {what}")
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > MAX_MATERIALIZED_BYTES:
        raise InputError(f"{label} would take {_human(nbytes)} ({np.dtype(dtype)}{list(shape)}); revgraph makes up "
                         f"at most {_human(MAX_MATERIALIZED_BYTES)} for {what}")


def _human(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} bytes"


# ------------------------------------------------------------------------------------- shape inference


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes`` with data propagation where it is bounded
    (:func:`data_propagation_is_bounded`), without it otherwise. Raises what ONNX raises."""
    plain = onnx.shape_inference.infer_shapes(model, data_prop=False)
    nodes = list(_nodes(plain.graph))
    if not _propagates_data(plain, nodes) or not data_propagation_is_bounded(plain, nodes):
        return plain
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - data propagation fails on some graphs that plain inference types
        return plain


#: Element types whose values ONNX data propagation reads from an initializer or ``Constant`` (onnx
#: ``DataPropagationContextImpl::getInputData``: "Only supports integer type to form a shape").
_SHAPE_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})


def _propagates_data(inferred: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> bool:
    """Can data propagation on ``inferred`` (typed without it) find anything plain inference does not? Only if
    some value is data to it: a ``Shape`` or ``Size`` output, or an int32/int64 value that a data-propagating
    operator reads (its first input: ``Add``, ``Mul``, ``Concat`` and the others take operands of one type).
    A graph without either (a float chain, a convnet with static shapes) is typed alike both ways, and the
    second inference (a third of the 10k chain's load) is skipped. An input of unknown type counts as data."""
    first = set()
    for node in nodes:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in ("Shape", "Size"):
            return True
        if node.op_type in READS_VALUES and node.input and node.input[0]:
            first.add(node.input[0])
    if not first:
        return False
    types = _elem_types(inferred, first)
    return len(types) < len(first) or any(t in _SHAPE_TYPES or t == 0 for t in types.values())


def data_propagation_is_bounded(inferred: onnx.ModelProto, nodes: list[onnx.NodeProto] | None = None) -> bool:
    """True if ONNX data propagation on ``inferred`` (a model typed by shape inference *without* data
    propagation) materialises at most :data:`MAX_PROPAGATED_ELEMENTS` elements.

    Data propagation represents the value of every rank-1 input of a data-propagating operator with a static
    length N as N dimensions (onnx ``DataPropagationContextImpl::getInputData``), and a value whose length or
    rank is unknown here may get a static length there (a ``ConstantOfShape`` of a ``Shape``). So: every such
    input must have a known rank, a static length if it has rank 1, and those lengths must add up to at most
    the bound."""
    nodes = _nodes(inferred.graph) if nodes is None else nodes
    read = {i for node in nodes if node.op_type in READS_VALUES and node.domain in ("", "ai.onnx")
            for i in node.input if i}
    shapes = _shapes(inferred, read)
    total = 0
    for name in read:
        shape = shapes.get(name)
        if shape is None:
            return False  # of unknown rank here, it may be a long vector there
        if len(shape) == 1:  # data propagation represents rank-1 values (and scalars) only
            if shape[0] is None:
                return False
            total += shape[0]
    return total <= MAX_PROPAGATED_ELEMENTS


def _shapes(model: onnx.ModelProto, names: set[str]) -> dict[str, tuple]:
    """Shapes of the values ``names``, over the graph and its subgraphs; dims are ``int`` or ``None``; a value
    of unknown rank is left out."""
    found: dict[str, tuple] = {}
    for g in _graphs(model.graph):
        for t in g.initializer:
            if t.name in names:
                found[t.name] = tuple(t.dims)
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.name in names and vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                found[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None
                                       for d in vi.type.tensor_type.shape.dim)
    return found


def _elem_types(model: onnx.ModelProto, names: set[str]) -> dict[str, int]:
    """The element types of the values ``names`` that ``model`` (and its subgraphs) declare or infer, by name
    (0: undefined); a value of no tensor type is left out."""
    found: dict[str, int] = {}
    for g in _graphs(model.graph):
        for t in g.initializer:
            if t.name in names:
                found[t.name] = t.data_type
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.name in names and vi.type.HasField("tensor_type"):
                found[vi.name] = vi.type.tensor_type.elem_type
        for node in g.node:
            if node.op_type == "Constant" and node.output and node.output[0] in names:
                found[node.output[0]] = _constant_type(node)
    return found


def _constant_type(node: onnx.NodeProto) -> int:
    """The element type of a ``Constant`` node's value (0 when it is not a tensor attribute)."""
    for a in node.attribute:
        if a.name == "value" and a.type == AttributeProto.TENSOR:
            return a.t.data_type
        if a.name in ("value_int", "value_ints"):
            return onnx.TensorProto.INT64
    return 0


def _graphs(graph: onnx.GraphProto):
    """``graph`` and every subgraph in it, at any depth (iteratively)."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for a in node.attribute:
                stack.extend([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs))


def _nodes(graph: onnx.GraphProto):
    for g in _graphs(graph):
        yield from g.node
