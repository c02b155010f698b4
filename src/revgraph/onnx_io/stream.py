"""Serialize a :class:`~revgraph.ir.Graph` as an ONNX model in pieces, so that writing a long gradient graph
never holds its whole ``ModelProto``.

:func:`revgraph.to_onnx` builds every ``NodeProto`` and ``ValueInfoProto`` of the graph as protobuf objects
before a byte is written: about 1.3 KB per node of a gradient graph, more than the graph's own IR (docs/
benchmarks.md, "Build memory"). Protobuf's wire format defines the concatenation of two serialized messages as
their merge: repeated fields are appended in order and embedded messages merged field by field ("Last One
Wins" for scalars, <https://protobuf.dev/programming-guides/encoding/#last-one-wins>). So the model is written
as its skeleton (everything but the nodes and ``value_info``) followed by ``ModelProto`` pieces that each hold
only a few thousand nodes or value infos of ``graph``; the file parses to the same model ``to_onnx`` makes,
and only one piece's protobuf objects are alive at a time. The protobuf library encodes every byte.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import onnx

from .. import limits
from ..ir import Graph, require_graph
from . import _ssa_to_onnx, as_written, fill_nodes, fill_value_info
from .part_check import PartCheck

#: Nodes (or value infos) per piece: large enough that a piece's framing is negligible, small enough that its
#: protobuf objects are a few MB.
PIECE = 4096


def prepared(graph: Graph) -> Graph | None:
    """``graph`` as :func:`revgraph.to_onnx` writes it (``Dropout`` identities rewritten, SSA form), or
    ``None`` when it cannot be written in pieces: a graph output without a dtype, which ``to_onnx`` types from
    ONNX shape inference of the whole model. Raises what ``to_onnx`` raises."""
    require_graph(graph, "prepared")
    limits.check_nesting(graph)  # (pieces() writes the nodes apart from the skeleton, which holds none)
    if any(vi.kind == "tensor" and vi.dtype is None for vi in graph.outputs):
        return None
    return as_written(graph)


def pieces(graph: Graph, *, producer: str = "revgraph", piece: int = PIECE,
           check: PartCheck | None = None) -> Iterator[bytes]:
    """The serialized ``ModelProto`` of ``graph`` (a result of :func:`prepared`) as consecutive byte strings
    whose concatenation parses to ``revgraph.to_onnx(graph, producer=producer)``: the skeleton, then ``piece``
    nodes at a time in order, then ``piece`` value infos at a time. ``check`` (a :class:`revgraph.onnx_io.part_check.
    PartCheck` of ``graph``) is given each piece of nodes after it is yielded (its errors are raised from the
    generator); the caller calls its ``finish``."""
    skeleton = _ssa_to_onnx(dataclasses.replace(graph, nodes=[], value_info={}, memory_plan=None), producer)
    yield skeleton.SerializeToString()
    del skeleton
    for start in range(0, len(graph.nodes), piece):
        model = onnx.ModelProto()
        nodes = graph.nodes[start:start + piece]
        fill_nodes(model.graph, nodes, graph.opsets)
        yield model.SerializeToString()
        if check is not None:
            check.piece(nodes, model)
    declared = set(graph.input_names) | set(graph.output_names)
    items = iter(graph.value_info.items())
    while chunk := list(itertools.islice(items, piece)):
        model = onnx.ModelProto()
        fill_value_info(model.graph, chunk, declared)
        yield model.SerializeToString()
