"""Models over protobuf's 2 GiB limit: written with their tensors in a ``.data`` file, run from a file.

A serialized protobuf message cannot exceed 2 GiB, so a larger model keeps its large tensors as ONNX
*external data*: the model file holds ``location``/``offset``/``length`` and the bytes live in another file.
:func:`save_external` writes ``<path>.data`` next to ``<path>`` (the location is relative, as the ONNX spec
wants), each through :func:`revgraph.onnx_io.atomic.atomic_path`: a new file that replaces the old one in one step,
with the usual file mode, never appended to whatever ``<path>.data`` held. It works on a copy, so the caller's
``ModelProto`` keeps its tensors. :func:`session_source` gives onnxruntime such a model as a file in a
temporary directory. :func:`external_data_files` lists the data files a model on disk reads.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
from google.protobuf.message import EncodeError
from onnx import TensorProto, numpy_helper

from ..errors import RevgraphError
from .atomic import atomic_path, output_target

#: The largest model written as one protobuf message (protobuf's 2 GiB limit); tests lower it.
PROTOBUF_LIMIT = 2**31 - 1
#: Tensors of at least this many bytes go to the data file (onnx.save_model's default threshold).
THRESHOLD = 1024
_ALIGN = 4096  # page-aligned offsets let onnxruntime map large tensors instead of copying them
_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def too_large(model: onnx.ModelProto) -> bool:
    """True if ``model`` cannot be serialized as one protobuf message."""
    try:
        return model.ByteSize() > PROTOBUF_LIMIT
    except EncodeError:  # upb refuses to even size a message over 2 GiB
        return True


def tensors(model: onnx.ModelProto, sparse: bool = False) -> Iterator[TensorProto]:
    """Every tensor of ``model``: initializers and tensor attributes, in subgraphs too (iteratively); with
    ``sparse``, also the ``values`` and ``indices`` of sparse initializers and sparse tensor attributes."""
    stack = [model.graph]
    while stack:
        graph = stack.pop()
        yield from graph.initializer
        for sp in graph.sparse_initializer if sparse else ():
            yield from (sp.values, sp.indices)
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                for sp in ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors):
                    if sparse:
                        yield from (sp.values, sp.indices)
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def external_data_files(path: str | os.PathLike) -> list[Path]:
    """The files that the tensors of the ONNX model at ``path`` keep their data in, resolved against the
    model's directory; ``[]`` when it has none or cannot be parsed (loading it reports that). Only a regular
    file within protobuf's limit is read (a FIFO would block, a device never end)."""
    if not os.path.isfile(path) or os.path.getsize(path) > PROTOBUF_LIMIT:
        return []
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - an unreadable model lists no external files
        return []
    base = Path(path).parent
    found: dict[str, Path] = {}
    for t in tensors(model, sparse=True):
        if t.data_location == TensorProto.EXTERNAL:
            for entry in t.external_data:
                if entry.key == "location":
                    found.setdefault(entry.value, base / entry.value)
    return list(found.values())


def _raw_bytes(t: TensorProto) -> bytes:
    """The little-endian bytes of ``t``'s data, as ``raw_data`` holds them."""
    if t.HasField("raw_data"):
        return t.raw_data
    return numpy_helper.from_array(numpy_helper.to_array(t)).raw_data


def _externalize(t: TensorProto, location: str, offset: int, length: int) -> None:
    for field in _DATA_FIELDS:
        t.ClearField(field)
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def _shell(msg, skip: frozenset[str]):
    """A copy of the protobuf message ``msg`` without the fields named in ``skip``."""
    new = type(msg)()
    for field, value in msg.ListFields():
        if field.name in skip:
            continue
        if field.is_repeated:
            getattr(new, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(new, field.name).CopyFrom(value)
        else:
            setattr(new, field.name, value)
    return new


def _goes_out(t: TensorProto) -> bool:
    """Whether ``t``'s data goes to the data file (numeric, at least :data:`THRESHOLD` bytes)."""
    if t.data_location == TensorProto.EXTERNAL:
        raise RevgraphError(f"tensor {t.name!r} refers to external data that was not loaded; "
                            "load the model with its data before saving it")
    return t.data_type not in (TensorProto.STRING, TensorProto.UNDEFINED) and t.ByteSize() >= THRESHOLD


def save_external(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write ``model`` to ``path`` with every numeric tensor of at least :data:`THRESHOLD` bytes in
    ``<path>.data`` (offsets aligned to 4 KiB), both files atomically; ``model`` is not changed (the copy
    written leaves out the data of its large initializers, so memory grows by one tensor at a time). Raises
    :class:`RevgraphError` for a tensor whose data is external and not loaded, or a model still too large."""
    found = output_target(path)
    if found.kind not in ("new", "file"):  # two files cannot go into one FIFO or device
        raise RevgraphError(f"cannot write {found.path!r}: a model over protobuf's 2 GiB limit is written as two "
                            "files (the model and its .data); give a regular file's path")
    target = Path(found.write)  # a symbolic link's target: the model's .data goes next to the file written
    location = target.name + ".data"
    copy = _shell(model, frozenset({"graph"}))
    copy.graph.CopyFrom(_shell(model.graph, frozenset({"initializer"})))

    def put(t: TensorProto, f) -> tuple[int, int]:
        data = _raw_bytes(t)
        offset = -(-f.tell() // _ALIGN) * _ALIGN
        f.write(b"\0" * (offset - f.tell()))
        f.write(data)
        return offset, len(data)

    with atomic_path(target.with_name(location), suffix=".tmp") as data_tmp, open(data_tmp, "wb") as f:
        for t in model.graph.initializer:  # the caller's tensors are read, never changed
            if _goes_out(t):
                stored = copy.graph.initializer.add()
                stored.CopyFrom(_shell(t, frozenset(_DATA_FIELDS)))
                _externalize(stored, location, *put(t, f))
            else:
                copy.graph.initializer.add().CopyFrom(t)
        for t in tensors(copy):  # tensors in attributes and subgraphs (copied whole with the nodes)
            if t.data_location != TensorProto.EXTERNAL and _goes_out(t):
                _externalize(t, location, *put(t, f))
    if too_large(copy):
        raise RevgraphError(f"cannot write {str(target)!r}: even without its large tensors the model is over "
                            "protobuf's 2 GiB limit")
    data = copy.SerializeToString()
    with atomic_path(target) as tmp, open(tmp, "wb") as f:
        f.write(data)


@contextmanager
def session_source(model: onnx.ModelProto) -> Iterator[bytes | str]:
    """What ``onnxruntime.InferenceSession`` takes for ``model``: its serialized bytes or, for a model over
    protobuf's limit, the path of a copy written by :func:`save_external` in a temporary directory that is
    removed when the block ends (onnxruntime has read the tensors by then)."""
    if not too_large(model):
        yield model.SerializeToString()
        return
    with tempfile.TemporaryDirectory(prefix="revgraph-") as directory:
        path = os.path.join(directory, "model.onnx")
        save_external(model, path)
        yield path
