"""Operators that onnxruntime adds to ONNX's default domain, through ``onnx.version_converter``.

onnxruntime's transformer optimizer and model builder write ``SimplifiedLayerNormalization`` (and other
operators onnxruntime registers in the default domain) next to standard operators, keeping the model's opset:
an optimized BERT at opset 17 holds one. ``onnx.version_converter``, which :func:`revgraph.load` uses to bring
such a model up to opset 21, refuses any default-domain node it has no schema for ("has no registered
schema"), although nothing about those nodes changes between opsets (onnxruntime keeps version 1 of each at
every opset). So they are parked in a private domain for the conversion and put back after it: the converter
leaves other domains' nodes as they are, as it does ``com.microsoft``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import onnx

#: the private domain the runtime's default-domain operators wait in while the converter runs
PARKED = "revgraph.parked_default_domain"


def _nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of its subgraphs (Loop bodies, If branches)."""
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            yield node
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    stack.append(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(a.graphs)


def runtime_defaults(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The default-domain nodes of ``model`` (subgraphs included) whose operator ONNX does not define."""
    return [n for n in _nodes(model.graph) if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)]


def convert_version(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """``onnx.version_converter.convert_version(model, opset)`` for a model that may hold default-domain
    operators ONNX does not define (module doc): those pass through unchanged. ``model`` is changed in place
    while the converter runs and restored after it (also when the converter raises)."""
    parked = runtime_defaults(model)
    if not parked:
        return onnx.version_converter.convert_version(model, opset)
    for n in parked:
        n.domain = PARKED
    model.opset_import.append(onnx.helper.make_opsetid(PARKED, 1))
    try:
        converted = onnx.version_converter.convert_version(model, opset)
    finally:
        for n in parked:
            n.domain = ""
        del model.opset_import[-1]
    for n in _nodes(converted.graph):
        if n.domain == PARKED:
            n.domain = ""
    kept = [o for o in converted.opset_import if o.domain != PARKED]
    del converted.opset_import[:]
    converted.opset_import.extend(kept)
    return converted


@contextlib.contextmanager
def parked(model: onnx.ModelProto) -> Iterator[onnx.ModelProto]:
    """``model`` (changed in place, restored on exit) with the runtime's default-domain operators in the private
    domain, for ``onnx.checker.check_model``: ONNX's checker refuses a default-domain node it has no schema for
    ("No Op registered for SimplifiedLayerNormalization"), and checks other domains' nodes structurally only, as
    it checks ``com.microsoft``'s. Nothing is done for a model without such nodes."""
    nodes = runtime_defaults(model)
    if not nodes:
        yield model
        return
    for n in nodes:
        n.domain = PARKED
    model.opset_import.append(onnx.helper.make_opsetid(PARKED, 1))
    try:
        yield model
    finally:
        for n in nodes:
            n.domain = ""
        del model.opset_import[-1]
