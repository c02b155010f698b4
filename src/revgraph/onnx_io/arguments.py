"""The argument rule of the functions that take what users have, a graph or a model file: :data:`AS_GRAPH`. It
loads, so it sits in onnx_io, over :mod:`revgraph.validate` and :mod:`revgraph.ir.arguments` (whose rules only
check)."""

from __future__ import annotations

import os

import onnx

from ..ir import Graph
from ..ir.arguments import model
from . import load


def as_graph(name: str, value):
    """What users have, as a :class:`revgraph.Graph`: the graph itself, or an ``onnx.ModelProto``, its serialized
    bytes or the path of an ``.onnx`` file (:func:`revgraph.ir.arguments.model` checks it), read with
    :func:`revgraph.load` as :class:`revgraph.Trainer` and :class:`revgraph.Session` read theirs. For functions that
    return a new graph or a number; one that changes its graph in place keeps ``ir.arguments.GRAPH`` (a graph loaded
    here would be lost)."""
    return value if isinstance(value, Graph) else load(model(name, value))


as_graph.converts = True  # (validate.arguments() passes the loaded graph on)

#: a Graph, a ModelProto or a path, passed on as a Graph
AS_GRAPH = as_graph

#: what :data:`AS_GRAPH` takes, for annotations: a graph, an ``onnx.ModelProto``, its serialized bytes or the path
#: of an ``.onnx`` file
ModelLike = Graph | onnx.ModelProto | bytes | str | os.PathLike
