"""What an ONNX file records about the PyTorch module it was exported from: which initializers are the module's
parameters and which its buffers. The default trainable set (:func:`revgraph.train.selection.select`) trains
the parameters and leaves the buffers (a rotary ``inv_freq``, BatchNorm's running statistics) alone.

Two records, the first one found wins:

* revgraph's own, written by :func:`revgraph.export_torch` in the model's ``metadata_props``:

  - ``revgraph.torch_parameters``: JSON object ``{parameter name: initializer name}``, every name of
    ``module.named_parameters(remove_duplicate=False)`` whose parameter has ``requires_grad`` (a tied weight
    appears under each of its names, mapped to the one initializer);
  - ``revgraph.torch_buffers``: JSON object ``{buffer name: initializer name}``, persistent and non-persistent
    buffers alike (``module.named_buffers(remove_duplicate=False)``);
  - ``revgraph.torch_state_dict``: JSON object ``{state_dict key: initializer name}``, the tensors of
    ``module.state_dict()`` (every parameter, frozen ones too, and the persistent buffers: a buffer is
    persistent iff its name is here), what a safetensors writer of the module's state dict needs.

  - ``revgraph.torch_padding_rows``: JSON object ``{initializer name: [row, ...]}``, the rows of an embedding
    table whose gradient PyTorch keeps at zero (``nn.Embedding``/``nn.EmbeddingBag`` with ``padding_idx``);
    the training graph masks them the same way (:func:`revgraph.train.padding.mask_padding_rows`), so such a
    row is never stepped by its gradient (weight decay and the moments still apply, as in ``torch.optim``).
    Written only where a module has a ``padding_idx``.

  Names whose tensor the graph does not read are absent: the exporter drops unused initializers.

* the dynamo exporter's (``torch.onnx.export(dynamo=True)``, PyTorch 2.5 and newer): each lifted parameter and
  buffer has a ``value_info`` (or ``TensorProto``) metadata entry ``pkg.torch.export.graph_signature.InputSpec.kind``
  = ``PARAMETER`` / ``BUFFER``. :func:`revgraph.load` copies it to the model's metadata as
  :data:`EXPORTER_KINDS` = JSON ``{initializer name: "parameter" | "buffer"}`` (revgraph's ``value_info`` keeps
  types only, and the key keeps the record in the files revgraph writes, a trained model included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx

from ..errors import RevgraphError

PARAMETERS = "revgraph.torch_parameters"
BUFFERS = "revgraph.torch_buffers"
STATE_DICT = "revgraph.torch_state_dict"
PADDING_ROWS = "revgraph.torch_padding_rows"
#: the dynamo exporter's record of initializer kinds, as :func:`revgraph.load` keeps it
EXPORTER_KINDS = "revgraph.exporter_kinds"
#: the dynamo exporter's metadata entry (torch/onnx/_internal/exporter/_core.py writes the graph signature's
#: InputSpec.kind of each lifted tensor)
_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_KINDS = {"PARAMETER": "parameter", "BUFFER": "buffer"}


def exporter_kinds(model: onnx.ModelProto) -> dict[str, str]:
    """``{initializer name: "parameter" | "buffer"}`` from the dynamo exporter's per-tensor metadata (module doc),
    for the top-level initializers that carry it; ``{}`` for files without it (the TorchScript exporter, other
    converters)."""
    names = {t.name for t in model.graph.initializer}
    kinds: dict[str, str] = {}
    for v in [*model.graph.initializer, *model.graph.value_info, *model.graph.input]:
        for p in v.metadata_props:
            if p.key == _KIND and v.name in names and p.value in _KINDS:
                kinds[v.name] = _KINDS[p.value]
    return kinds


def keep_exporter_kinds(model: onnx.ModelProto, metadata: dict[str, str]) -> None:
    """Add :data:`EXPORTER_KINDS` to ``metadata`` (a loaded model's, in place) where the file has the exporter's
    record and neither revgraph's keys nor the kinds already."""
    if PARAMETERS not in metadata and EXPORTER_KINDS not in metadata:
        kinds = exporter_kinds(model)
        if kinds:
            metadata[EXPORTER_KINDS] = json.dumps(kinds)


@dataclass(frozen=True)
class TorchNames:
    """A model's record of which initializers are parameters and which buffers (module doc); ``source`` says
    which record (for messages): ``"revgraph.torch_parameters"`` or ``"the exporter's record"``. ``frozen``: the
    parameters the module did not train (``requires_grad=False``: in ``revgraph.torch_state_dict``, not in
    ``revgraph.torch_parameters``); the exporter's record does not tell them apart."""

    parameters: frozenset[str]
    buffers: frozenset[str]
    source: str
    frozen: frozenset[str] = frozenset()


def _names(metadata: dict[str, str], key: str) -> dict[str, str]:
    """The ``{torch name: initializer name}`` object under ``key``; a value of another shape is one line."""
    try:
        value = json.loads(metadata[key])
    except (ValueError, RecursionError):  # (a file's metadata is untrusted: not JSON, or nested too deep)
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise RevgraphError(f"the model's metadata_props key {key!r} is not a JSON object of names "
                            "({torch name: initializer name}); re-export the model with revgraph.export_torch or "
                            "remove the key")
    return value


def torch_names(metadata: dict[str, str]) -> TorchNames | None:
    """The record in a model's metadata (``Graph.metadata``): revgraph's keys first, else the exporter's kinds,
    else ``None``. Raises :class:`RevgraphError` (one line) for a key whose value is not the JSON object of names
    the module doc describes."""
    if PARAMETERS in metadata:
        parameters = frozenset(_names(metadata, PARAMETERS).values())
        buffers = frozenset(_names(metadata, BUFFERS).values() if BUFFERS in metadata else ())
        state = frozenset(_names(metadata, STATE_DICT).values() if STATE_DICT in metadata else ())
        return TorchNames(parameters, buffers, PARAMETERS, state - parameters - buffers)
    if EXPORTER_KINDS in metadata:
        kinds = _names(metadata, EXPORTER_KINDS)
        return TorchNames(frozenset(k for k, v in kinds.items() if v == "parameter"),
                          frozenset(k for k, v in kinds.items() if v == "buffer"), "the exporter's record")
    return None


def padding_rows(metadata: dict[str, str]) -> dict[str, list[int]]:
    """``{initializer: rows}`` of :data:`PADDING_ROWS` in a model's ``metadata`` (``{}`` when absent). Raises
    :class:`RevgraphError` (one line) when the entry is not such an object of non-negative integer lists."""
    text = metadata.get(PADDING_ROWS)
    if text is None:
        return {}
    try:
        rows = json.loads(text)
    except (ValueError, RecursionError):
        rows = None
    ok = isinstance(rows, dict) and all(isinstance(k, str) and isinstance(v, list) and v and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**62 for i in v) for k, v in rows.items())
    if not ok:
        raise RevgraphError(f"the model's metadata {PADDING_ROWS} is not an object of initializer names to lists of "
                            "row numbers: re-export the model with revgraph.export_torch, or remove the entry")
    return rows
