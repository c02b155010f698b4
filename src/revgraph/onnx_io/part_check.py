"""ONNX's full check of a graph a few thousand nodes at a time, so that checking a long graph never holds its
whole model in ONNX's C++ checker.

``onnx.checker.check_model(model, full_check=True)`` parses the whole model into C++ and then runs strict shape
inference over it: about 4.2 KB per node of a long chain's gradient graph, more than revgraph's own objects for
that graph (docs/benchmarks.md, "Build memory"). What it checks is local except for the names: each node
against its operator's schema, each node's inputs written by an earlier node or a graph input or initializer
(topological order), each name written once (SSA), each graph output written, and strict inference (every
declared type agrees with what the node computes from its inputs' types). So :class:`PartCheck` checks a
graph's nodes in consecutive pieces, each as a model of its own through the same ``check_model``: the piece's
nodes, its value infos and the graph outputs it writes, with every value it reads from outside the piece
declared as a graph input of the type the graph declares for it (or, where it declares none, the type ONNX
inferred for it in its own piece), small initializers as themselves and large ones as typed inputs (their values
never matter to shape inference beyond a few thousand elements, as in :func:`revgraph.onnx_io.light_graph`).
It tracks the names written so far to check the order and SSA across pieces itself, with ONNX's own messages.

The checks per node are ONNX's; a type crossing a piece boundary is the declared one, which strict inference
has already checked against what its producer computes, in the producer's piece.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import GraphError
from ..ir import Graph, Node, ValueInfo, gc_paused
from ..ir.inplace import captured
from . import _add_value_info, _ssa_to_onnx, _type_proto, as_written, fill_nodes
from .reading import check_loop_signatures, onnx_error_line
from .runtime_ops import parked

#: Initializers of more elements than this enter a piece's check as typed inputs (``light_graph``'s bound).
SMALL = 4096


def _known(vi: ValueInfo | None) -> bool:
    return vi is not None and (vi.kind != "tensor" or vi.dtype is not None)


class _Whole(Exception):
    """A value crossing a piece boundary has no known type: the whole model is checked instead."""


class PartCheck:
    """The full check of ``graph`` (in SSA form, as :func:`revgraph.onnx_io.as_written` leaves it), piece by
    piece: :meth:`piece` for consecutive slices of ``graph.nodes`` in order, then :meth:`finish`. Each raises
    ``onnx.checker.ValidationError`` or ``onnx.shape_inference.InferenceError`` as ``check_model`` does, with
    ONNX's messages (a node named as ``(op_type:T, node name: N)``). Memory: one piece's protobuf objects and
    C++ copy, and a set of the names written so far. Where a value read across a boundary has a type neither
    the graph declares nor ONNX infers (an operator of a domain ONNX does not know), the pieces stop being
    checked and :meth:`finish` checks the whole model instead."""

    #: The input a piece computes its tensors of unknown rank from (:meth:`_unranked`).
    RANK = "revgraph.part_check/shape"

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.outputs = {vi.name: vi for vi in graph.outputs}
        self.inputs = {vi.name: vi for vi in graph.inputs}
        self.defined: set[str] = set(self.inputs) | set(graph.initializers)
        self.inferred: dict[str, bytes] = {}  # serialized TypeProto of values the graph declares no type for
        self.whole = False
        direct = [vi for vi in graph.outputs if vi.name in self.defined]
        light = dataclasses.replace(graph, nodes=[], value_info={}, outputs=direct, memory_plan=None,
                                    initializers={k: a for k, a in graph.initializers.items() if self._small(k)},
                                    inputs=[*graph.inputs, *(self._typed(k) for k in graph.initializers
                                                             if not self._small(k) and k not in self.inputs)])
        skeleton = _ssa_to_onnx(light)
        # the model, its inputs, small initializers and the outputs no node writes: checked once
        with parked(skeleton):
            onnx.checker.check_model(skeleton, full_check=True)
        header = onnx.ModelProto()
        header.CopyFrom(skeleton)
        header.ClearField("graph")
        header.ClearField("metadata_props")
        self.header = header.SerializeToString()

    def _small(self, name: str) -> bool:
        return np.asarray(self.graph.initializers[name]).size <= SMALL

    def _typed(self, name: str) -> ValueInfo:
        a = np.asarray(self.graph.initializers[name])
        return ValueInfo(name, a.dtype, a.shape)

    def piece(self, nodes: list[Node], model: onnx.ModelProto | None = None) -> None:
        """Check ``nodes``, the next slice of the graph's nodes. ``model``: a ``ModelProto`` holding just those
        nodes (``fill_nodes``), as the streamed writer has serialized it; it is completed in place and checked
        (``None``: made here)."""
        if self.whole:
            return
        written: dict[str, None] = {}
        reads: dict[str, Node] = {}
        for node in nodes:
            names = [*node.inputs, *sorted(captured(node))] if node.attrs and node.subgraphs else node.inputs
            for name in names:
                if name and name not in written and name not in reads:
                    reads[name] = node
            for name in node.outputs:
                if name:
                    if name in self.defined or name in written:
                        raise onnx.checker.ValidationError(
                            "Graph must be in single static assignment (SSA) form, however "
                            f"'{name}' has been used as output names multiple times.")
                    written[name] = None
        if model is None:
            model = onnx.ModelProto()
            fill_nodes(model.graph, nodes, self.graph.opsets)
        model.MergeFromString(self.header)
        gp = model.graph
        gp.name = self.graph.name or "graph"
        prelude: list[onnx.NodeProto] = []
        try:
            for name, node in reads.items():
                if name in written:
                    continue  # read before its write in this piece: ONNX's check of the piece says so
                if name not in self.defined:
                    raise onnx.checker.ValidationError(
                        f"Nodes in a graph must be topologically sorted, however input '{name}' of node: \n"
                        f"name: {node.name} OpType: {node.op_type}\n is not output of any previous nodes.")
                self._declare(gp, name, prelude)
        except _Whole:
            self.whole = True
            return
        if prelude:  # (before the piece's own nodes, which read them)
            own = list(gp.node)
            del gp.node[:]
            gp.node.extend([*prelude, *own])
        untyped = []
        for name in written:
            if name in self.outputs:
                _add_value_info(gp.output, self.outputs[name])
            elif _known(vi := self.graph.value_info.get(name)):
                _add_value_info(gp.value_info, vi)
            else:
                untyped.append(name)
        if not untyped:
            with parked(model):  # (onnxruntime's default-domain operators: checked as other domains' are)
                onnx.checker.check_model(model, full_check=True)
        else:  # the same check, keeping what inference found for the values the graph leaves untyped
            with parked(model):
                onnx.checker.check_model(model)
                found = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
            types = {vi.name: vi.type for vi in found.graph.value_info}
            for name in untyped:
                if name in types and types[name].WhichOneof("value") is not None:
                    self.inferred[name] = types[name].SerializeToString()
        self.defined.update(written)

    def _declare(self, gp: onnx.GraphProto, name: str, prelude: list) -> None:
        """``name``, written before this piece, as the piece's graph input (or initializer) of its type."""
        if name in self.graph.initializers and self._small(name):
            gp.initializer.append(numpy_helper.from_array(np.asarray(self.graph.initializers[name]), name))
            return
        vi = (self.inputs.get(name) or (self._typed(name) if name in self.graph.initializers else None)
              or self.outputs.get(name) or self.graph.value_info.get(name))
        if _known(vi):
            proto = _type_proto(vi.kind, vi.dtype, None if vi.shape is None else tuple(vi.shape))
        elif name in self.inferred:
            proto = onnx.TypeProto.FromString(self.inferred[name])
        else:  # no type known: only the whole model's check can say whether its readers are consistent
            raise _Whole
        if proto.HasField("tensor_type") and not proto.tensor_type.HasField("shape"):
            self._unranked(gp, name, proto.tensor_type.elem_type, prelude)
        else:
            gp.input.add(name=name).type.CopyFrom(proto)

    def _unranked(self, gp: onnx.GraphProto, name: str, elem_type: int, prelude: list) -> None:
        """A tensor of unknown rank: ONNX wants a shape for each input of a model, so the piece computes it
        (``ConstantOfShape`` of a 1-D shape of unknown length, then ``Cast`` to its dtype) from an input."""
        if self.RANK in self.defined or not elem_type:
            raise _Whole
        if not prelude:
            gp.input.append(helper.make_tensor_value_info(self.RANK, onnx.TensorProto.INT64, ["n"]))
        filled = f"{self.RANK}/{name}"
        prelude.append(helper.make_node("ConstantOfShape", [self.RANK], [filled]))
        prelude.append(helper.make_node("Cast", [filled], [name], to=elem_type))

    def finish(self, whole=None) -> None:
        """After the last piece: every graph output written; or, if the pieces could not be checked, ONNX's
        check of ``whole`` (the model: a path, bytes, a ``ModelProto``, or ``None`` for ``to_onnx`` of the
        graph)."""
        if self.whole:
            model = _ssa_to_onnx(self.graph) if whole is None else whole
            if isinstance(model, onnx.ModelProto):
                with parked(model):
                    onnx.checker.check_model(model, full_check=True)
            else:
                onnx.checker.check_model(model, full_check=True)
            return
        for name in self.outputs:
            if name not in self.defined:
                raise onnx.checker.ValidationError(f"Graph output '{name}' is not an output of any node in graph.")


def check_valid(graph: Graph) -> None:
    """Raise :class:`GraphError` if ONNX's checker with strict shape inference (``full_check=True``, what
    ``revgraph grad`` holds its output to) refuses ``graph``: MatMul operands whose static shapes do not fit, a
    ``ConstantOfShape`` of a negative shape, a Loop body whose outputs contradict their declared types, a graph
    input or output without a type; or if a Loop body declares its iteration number or condition other than
    as a scalar (the backward loop counts iterations in a value of that type). Such a model is bad input; a
    gradient graph of a valid model that fails the check is revgraph's fault. The check runs
    :func:`check_in_parts`."""
    untyped = [v.name for v in [*graph.inputs, *graph.outputs] if v.dtype is None]
    if untyped:
        raise GraphError(f"graph input or output {untyped[0]!r} has no type; ONNX needs the types of a model's "
                         "inputs and outputs")
    check_loop_signatures(graph)
    try:  # (in pieces: a long model is never whole in ONNX's C++ checker)
        with gc_paused():
            check_in_parts(as_written(graph))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as exc:
        raise GraphError(f"the model is not valid ONNX: {onnx_error_line(exc)}") from None


def check_in_parts(graph: Graph, piece: int = 4096) -> None:
    """ONNX's full check of ``graph`` (SSA form) ``piece`` nodes at a time (:class:`PartCheck`)."""
    check = PartCheck(graph)
    for start in range(0, len(graph.nodes), piece):
        check.piece(graph.nodes[start:start + piece])
    check.finish()
