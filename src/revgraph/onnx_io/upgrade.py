"""Node rewrites for models converted to a newer opset where ``onnx.version_converter`` does not adapt the
semantics itself: PRelu's per-channel slope before opset 7, and GroupNormalization's per-group scale and bias
before opset 21; and the kind of untyped subgraph values that hold sequences (:func:`type_untyped_sequences`).
``onnx_io.load`` applies them around the conversion."""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node, ValueInfo, fresh_name


def fix_legacy_prelu(graph: Graph) -> bool:
    """Before opset 7, ``PRelu`` applied a 1-D slope of size C along axis 1 (one slope per channel); from
    opset 7 on the slope broadcasts numpy-style from the last axis. The version converter does not adapt
    this, so reshape such slope initializers to ``(C, 1, ..., 1)``. Returns True if it changed anything."""
    changed = False
    ranks = {v.name: len(v.shape) for v in graph.inputs if v.shape is not None}
    for node in graph.nodes:
        if node.op_type != "PRelu" or node.inputs[1] not in graph.initializers:
            continue
        slope = graph.initializers[node.inputs[1]]
        rank = ranks.get(node.inputs[0])
        if slope.ndim == 1 and slope.size > 1 and rank is not None and rank > 2:
            graph.initializers[node.inputs[1]] = slope.reshape((slope.size,) + (1,) * (rank - 2))
            changed = True
    return changed



def group_norm_per_channel(graph: Graph) -> None:
    """Rewrite, in ``graph`` (converted from before opset 21), each GroupNormalization whose scale and bias are
    still per group (``[num_groups]``, opsets 18 to 20) to read them per channel (``[C]``, opset 21): each
    group's value repeated over its ``C / num_groups`` channels, as ONNX's 20 -> 21 adapter does
    (``onnx/version_converter/adapters/group_normalization_20_21.h``), which onnx 1.23's converter does not
    apply (onnxruntime then refuses the graph). In the graph rather than in the data, so a trainable per-group
    parameter keeps its shape and gets the sum over its channels as gradient."""
    used = graph.names_in_use()
    for g, node in list(graph.walk()):
        if node.op_type != "GroupNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        groups = int(node.attrs.get("num_groups", 0))
        shapes = {**{k: a.shape for k, a in g.initializers.items()},
                  **{v.name: v.shape for v in [*g.inputs, *g.value_info.values()] if v.shape is not None}}
        x_shape = shapes.get(node.inputs[0])
        if x_shape is not None and len(x_shape) > 1 and x_shape[1] == groups:
            continue  # one channel per group: per group is per channel
        slots = [i for i in (1, 2) if len(node.inputs) > i and shapes.get(node.inputs[i]) == (groups,)]
        if not slots:
            continue  # already per channel (a converter that applies the adapter)
        pos = next(k for k, n in enumerate(g.nodes) if n is node)
        g.nodes[pos:pos] = _repeat_per_channel(node, slots, groups, used)


def _repeat_per_channel(node: Node, slots: list[int], groups: int, used: set[str]) -> list[Node]:
    """Nodes giving ``node``'s inputs ``slots`` (``[groups]``) repeated per channel (``[C]``, C from the
    input's shape at run time), and ``node`` reading them."""
    added: list[Node] = []

    def fresh(base: str) -> str:
        return fresh_name(f"{node.name or 'GroupNormalization'}/per_channel/{base}", used)

    def const(base: str, value) -> str:
        name = fresh(base)
        added.append(Node("Constant", [], [name], {"value": np.asarray(value, np.int64)}, name))
        return name

    channels, per_group, shape = fresh("channels"), fresh("per_group"), fresh("shape")
    added.append(Node("Shape", [node.inputs[0]], [channels], {"start": 1, "end": 2}, channels))
    added.append(Node("Div", [channels, const("groups", [groups])], [per_group], name=per_group))
    added.append(Node("Concat", [const("rows", [groups]), per_group], [shape], {"axis": 0}, shape))
    for i in slots:
        column, wide, flat = fresh("column"), fresh("expand"), fresh("flat")
        added.append(Node("Unsqueeze", [node.inputs[i], const("axis", [1])], [column], name=column))
        added.append(Node("Expand", [column, shape], [wide], name=wide))
        added.append(Node("Reshape", [wide, const("all", [-1])], [flat], name=flat))
        node.inputs[i] = flat
    return added


#: operators whose output is a sequence, and the inputs of operators that are sequences (ONNX operator spec)
_MAKES_SEQUENCE = frozenset({"SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase",
                            "SplitToSequence"})
_READS_SEQUENCE = {"SequenceInsert": 0, "SequenceErase": 0, "SequenceAt": 0, "SequenceLength": 0,
                   "ConcatFromSequence": 0}


def type_untyped_sequences(graph: Graph) -> int:
    """Declare as sequences the subgraph inputs and outputs that are declared without a type and that hold
    sequences: written by a sequence operator, read as one, or carried by a ``Loop`` whose initial value or
    other end is one (torch.onnx's dynamo exporter writes ``SequenceEmpty -> Loop(SequenceInsert)`` with an
    untyped carried sequence, issue 27). Read as tensors, they were written back as tensors of element type 0,
    which ONNX shape inference refuses and onnxruntime cannot load. Edits ``graph``'s subgraphs in place (their
    element type is left to shape inference); returns how many values it declared."""
    seqs = {v.name for g in _graphs(graph) for v in [*g.inputs, *g.outputs, *g.value_info.values()]
            if v.kind == "sequence"}
    for _, node in graph.walk():
        if node.domain in ("", "ai.onnx") and node.op_type in _MAKES_SEQUENCE:
            seqs.update(o for o in node.outputs if o)
        k = _READS_SEQUENCE.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if k is not None and len(node.inputs) > k and node.inputs[k]:
            seqs.add(node.inputs[k])
    changed, count = True, 0
    while changed:  # a carried value is a sequence at all four of its places or at none
        changed = False
        for _, node in graph.walk():
            if node.op_type != "Loop" or node.domain not in ("", "ai.onnx") or "body" not in node.attrs:
                continue
            body = node.attrs["body"]
            for j in range(len(node.inputs) - 2):
                places = [node.inputs[2 + j], _name(body.inputs, 2 + j), _name(body.outputs, 1 + j),
                          node.outputs[j] if j < len(node.outputs) else ""]
                if any(p in seqs for p in places if p) and not all(p in seqs for p in places if p):
                    seqs.update(p for p in places if p)
                    changed = True
    for g in _graphs(graph):
        if g is graph:
            continue
        for field in (g.inputs, g.outputs):
            for k, v in enumerate(field):
                if v.name in seqs and v.kind == "tensor" and v.dtype is None and v.shape is None:
                    field[k] = ValueInfo(v.name, None, None, "sequence")
                    count += 1
    return count


def _graphs(graph: Graph) -> list[Graph]:
    out, stack = [], [graph]
    while stack:
        g = stack.pop()
        out.append(g)
        for node in g.nodes:
            stack.extend(node.subgraphs.values())
    return out


def _name(values: list[ValueInfo], k: int) -> str:
    return values[k].name if k < len(values) else ""
