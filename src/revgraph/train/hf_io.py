"""Trained weights back to PyTorch and Hugging Face: a model's state dict as a safetensors file
(:func:`save_state_dict`, ``Trainer.save_state_dict``, ``revgraph train --save-safetensors``), and the bounded
reading of an untrusted safetensors file (:func:`read_safetensors`, for PEFT adapters: :mod:`.peft_io`).

Names. A model exported by ``rg.export_torch`` records in its metadata (ONNX ``metadata_props``) which
initializer holds each key of the module's ``state_dict()`` (``revgraph.torch_state_dict``: the parameters, tied
ones under each of their names, and the persistent buffers; :mod:`revgraph.onnx_io.torch_names`): the state dict
holds exactly those keys, so that ``load_state_dict(strict=True)`` finds them all. A file of the dynamo exporter
loaded by revgraph keeps the exporter's kinds of its initializers: the state dict holds its parameters and
buffers under their own names (a non-persistent buffer, such as a rotary ``inv_freq``, which ``state_dict()``
leaves out, among them: load with ``strict=False``). Without any record it holds every initializer under its own
name (``torch.onnx.export(dynamo=True)`` names them after the parameters and buffers).

LoRA. A model with adapters (:mod:`.lora`) gives the merged weights: each adapted weight holds
``W + (alpha / r) A B`` in its stored orientation, as PEFT's ``merge_and_unload`` computes it, and the adapters
themselves are not written (``revgraph lora extract --format peft`` writes them in PEFT's format).

The file: safetensors (``safetensors.numpy.save_file``, no torch needed), with the metadata ``{"format": "pt"}``
that transformers' loaders expect; ``safetensors.torch.load_file(path)`` reads it back as torch tensors.
"""

from __future__ import annotations

import json
import os

import numpy as np

from .. import validate as V
from ..errors import RevgraphError
from ..ir import Graph
from ..ir.arguments import GRAPH
from ..onnx_io.torch_names import BUFFERS as TORCH_BUFFERS
from ..onnx_io.torch_names import EXPORTER_KINDS, STATE_DICT
from ..onnx_io.torch_names import PARAMETERS as TORCH_PARAMETERS

SUFFIX = ".safetensors"
#: safetensors' element types and numpy's (bfloat16 and the float8 types through ml_dtypes, as onnx reads them)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
           "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def torch_names(graph: Graph) -> dict[str, str] | None:
    """``{state-dict name: initializer name}`` from the model's record of its torch module (module doc):
    ``revgraph.torch_state_dict`` where ``rg.export_torch`` wrote it (every ``module.state_dict()`` key: the
    parameters, tied ones under each name, and the persistent buffers), else ``revgraph.torch_parameters`` and
    ``revgraph.torch_buffers`` together, else the dynamo exporter's kinds as :func:`revgraph.load` keeps them
    (``revgraph.exporter_kinds``: its parameters and buffers under their own names); ``None`` without a record.
    The record is untrusted (a model file may carry any metadata): raises :class:`RevgraphError` (one line,
    naming the key) when it is not a JSON object of names or names an initializer the model does not have."""
    md = graph.metadata
    if STATE_DICT in md:
        return _read_names(graph, STATE_DICT)
    if TORCH_PARAMETERS in md:
        return {**_read_names(graph, TORCH_PARAMETERS),
                **(_read_names(graph, TORCH_BUFFERS) if TORCH_BUFFERS in md else {})}
    if EXPORTER_KINDS in md:
        kinds = _read_names(graph, EXPORTER_KINDS, values=False)
        return {k: k for k, kind in kinds.items() if kind in ("parameter", "buffer")}
    return None


def _read_names(graph: Graph, key: str, values: bool = True) -> dict[str, str]:
    """The JSON object of strings under the metadata ``key``, each value (``values``; else each key) an
    initializer of ``graph``."""
    def fail(what: str) -> RevgraphError:
        return RevgraphError(f"the model's metadata {key!r} {what}; export the model again with rg.export_torch, or "
                             "remove the key from its metadata_props")

    try:
        found = json.loads(graph.metadata[key])
    except (ValueError, RecursionError):
        raise fail("is not JSON") from None
    if not isinstance(found, dict):
        raise fail(f"is a JSON {type(found).__name__}, not an object of names")
    for name, value in found.items():
        if not name or not isinstance(value, str) or not value:
            raise fail(f"gives {name!r} the value {value!r}, not a name")
        init = value if values else name
        if init not in graph.initializers:
            raise fail(f"names initializer {init!r}, which the model does not have")
    return found


@V.arguments(graph=GRAPH)
def state_dict(graph: Graph) -> dict[str, np.ndarray]:
    """The PyTorch state dict of ``graph`` as numpy arrays, by torch name (module doc: the record of
    ``rg.export_torch``, else every initializer), each in the initializer's dtype and shape, LoRA adapters
    merged into their weights. Raises :class:`RevgraphError` for a bad record and for adapters on a quantized
    weight (an integer state dict entry cannot hold the update: write the adapters with
    ``revgraph lora extract --format peft``)."""
    from . import lora

    values = {k: np.asarray(v) for k, v in graph.initializers.items()}
    found = lora.config(graph)
    adapters = set(lora.adapter_names(graph))
    for a in found["adapters"] if found else []:
        if a["quantized"]:
            raise RevgraphError(f"weight {a['weight']!r} is quantized ({values[a['weight']].dtype}) and has LoRA "
                                "adapters: a state dict cannot hold the merged weight in its integers; write the "
                                "adapters alone (revgraph lora extract --format peft)")
        w = values[a["weight"]]
        delta = found["scaling"] * (values[a["A"]].astype(np.float64) @ values[a["B"]].astype(np.float64))
        values[a["weight"]] = (w + (delta.T if a["transposed"] else delta)).astype(w.dtype)  # as merge_adapters
    names = torch_names(graph)
    if names is None:
        names = {k: k for k in values if k not in adapters}
    return {name: np.ascontiguousarray(values[init]) for name, init in names.items()}


@V.arguments(path=V.PATH, graph=GRAPH)
def save_state_dict(path: str | os.PathLike, graph: Graph) -> tuple[int, int]:
    """Write :func:`state_dict` of ``graph`` to ``path`` (``.safetensors``) atomically; returns ``(tensors,
    elements)``. ``model.load_state_dict(safetensors.torch.load_file(path))`` loads it into the torch module the
    model was exported from. Raises :class:`RevgraphError` (one line) for another suffix, a path that cannot be
    written, and what :func:`state_dict` refuses."""
    check_path(path)
    arrays = state_dict(graph)
    write_safetensors(path, arrays)
    return len(arrays), sum(a.size for a in arrays.values())


def check_path(path: str | os.PathLike, label: str | None = None) -> None:
    """Refuse (one line) a state-dict path that does not end in ``.safetensors``; ``label`` names the option."""
    text = os.fsdecode(os.fspath(path))
    if os.path.splitext(text)[1].lower() != SUFFIX:
        said = f"{label} {text!r}" if label else repr(text)
        raise RevgraphError(f"{said}: a state dict is written as safetensors: give a file name ending in {SUFFIX}")


def write_safetensors(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` as safetensors with the metadata ``{"format": "pt"}``, atomically
    (:func:`revgraph.onnx_io.atomic.atomic_path`). Raises :class:`RevgraphError` for a path that cannot be written
    or an element type safetensors has no name for."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    from ..onnx_io.atomic import atomic_path

    for name, a in arrays.items():
        if a.dtype.name not in _DTYPES.values():
            raise RevgraphError(f"cannot write {name!r} ({a.dtype}) as safetensors: its element types are "
                                f"{', '.join(sorted(_DTYPES.values()))}")
    with atomic_path(path) as tmp:
        try:
            save_file(arrays, tmp, metadata={"format": "pt"})
        except (SafetensorError, ValueError, TypeError) as exc:  # (OSError: atomic_path's one line)
            raise RevgraphError(f"cannot write {os.fspath(path)!r} as safetensors: {exc}") from None


def read_safetensors(path: str | os.PathLike, what: str, max_bytes: int) -> dict[str, np.ndarray]:
    """The arrays of the untrusted safetensors file ``path`` (``what`` names it in the errors: "adapter
    weights"): a regular file of at most ``max_bytes`` bytes (checked before it is read), parsed by safetensors
    itself (header length, JSON header, offsets covering the data exactly), of element types numpy reads. Raises
    :class:`RevgraphError` (one line) otherwise: a truncated file, a header that lies, a file too large."""
    import ml_dtypes  # noqa: F401  (bfloat16 and the float8 types by name)
    from safetensors import SafetensorError, deserialize

    from ..limits import open_regular_file

    label = repr(os.fspath(path))
    fd = open_regular_file(path, what)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise RevgraphError(f"{label} has {size:,} bytes, more than the {max_bytes:,} that {what} of this model "
                                "can take; give the file written for this model")
        data = f.read(max_bytes + 1)
    try:
        tensors = deserialize(data)
    except SafetensorError as exc:
        raise RevgraphError(f"{label} is not a whole safetensors file ({exc}); write it again") from None
    arrays = {}
    for name, t in tensors:
        dtype = _DTYPES.get(t["dtype"])
        if dtype is None:
            raise RevgraphError(f"{label}: tensor {name!r} has element type {t['dtype']}, which revgraph does not "
                                "read")
        arrays[name] = np.frombuffer(bytes(t["data"]), np.dtype(dtype)).reshape(t["shape"])
    return arrays
