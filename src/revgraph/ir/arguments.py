"""Argument rules of :func:`revgraph.validate.arguments` for the IR's types: a :class:`~revgraph.ir.Graph`
(:data:`GRAPH`), what becomes one (:data:`MODEL`, :data:`SAVABLE`) and an opset (:data:`OPSET`). They sit here,
over :mod:`revgraph.validate`, so that validate imports no layer (tests/test_architecture.py); the rule that loads
a model is :data:`revgraph.onnx_io.arguments.AS_GRAPH`."""

from __future__ import annotations

import os

import onnx

from .. import validate as V
from ..errors import RevgraphError
from . import NEWEST_OPSET, TARGET_OPSET, Graph


def graph(name: str, value, where: str = "this function") -> Graph:
    """A :class:`revgraph.Graph` (``rg.load`` reads one from a file or an ``onnx.ModelProto``); else
    :class:`~revgraph.validate.WholeRefusal` naming ``where``, with the recipe for a PyTorch module."""
    if not isinstance(value, Graph):
        hint = ("export it to ONNX first (torch.onnx.export, the README's recipe), then rg.load the file"
                if V.is_torch_module(value) else "rg.load(path) reads one from a file")
        raise V.WholeRefusal(f"{where} takes a revgraph.Graph as {name}=, got {type(value).__name__} ({hint})")
    return value


graph.with_where = True


def model(name: str, value):
    """A :class:`revgraph.Graph`, an ``onnx.ModelProto``, its serialized bytes or a path to an ``.onnx`` file
    (checked, not loaded); else :class:`RevgraphError` (one line)."""
    if isinstance(value, Graph | onnx.ModelProto | bytes):
        return value
    if isinstance(value, str | os.PathLike):
        return V.path(name, value)
    if V.is_torch_module(value):  # (issue 38: the message printed the module, several lines)
        raise RevgraphError(f"{name}= is a PyTorch module ({type(value).__name__}); export it to ONNX first, "
                            "torch.onnx.export(module, args, 'model.onnx', dynamo=True, optimize=False, "
                            "opset_version=23) (the README's recipe), and give the file")
    raise RevgraphError(f"{name}={value!r} ({type(value).__name__}): give a revgraph.Graph, an "
                        "onnx.ModelProto or the path of an .onnx file")


def savable(name: str, value, where: str = "this function"):
    """A :class:`revgraph.Graph` or an ``onnx.ModelProto`` (what :func:`revgraph.save` writes)."""
    if not isinstance(value, Graph | onnx.ModelProto):
        raise V.WholeRefusal(f"{where} takes a revgraph.Graph or an onnx.ModelProto as {name}=, got "
                             f"{type(value).__name__}")
    return value


savable.with_where = True


def opset(name: str, value):
    """``None`` (the model's own) or an opset from :data:`~revgraph.ir.TARGET_OPSET` to the newest the installed
    onnx knows."""
    if value is not None and V.number_problem(value, integer=True, low=TARGET_OPSET, high=NEWEST_OPSET):
        raise RevgraphError(f"{name}={value!r}: give None (the model's own, at least {TARGET_OPSET}) or a whole "
                            f"number from {TARGET_OPSET} to {NEWEST_OPSET} (the newest this onnx knows)")
    return value


GRAPH = graph  # a Graph, used as it is (a function that changes it in place)
MODEL = model  # a Graph, a ModelProto, bytes or a path, passed on as given
SAVABLE = savable
OPSET = opset
