"""Written graphs that every ONNX runtime runs: ``Dropout`` nodes that are identities become ``Identity``.

A model exported from PyTorch in training mode (``torch.onnx.export(training=TrainingMode.TRAINING)``) writes
every ``nn.Dropout`` as ``Dropout(data, ratio, training_mode=true)``, even where ``p = 0`` (a Transformer
built with ``dropout=0.0``). At ratio 0 such a node draws nothing: its output is its input and its mask is all
true (ONNX operator spec, "Dropout", opset 13: ``output = data * mask / (1 - ratio)`` with ``mask = draw >=
ratio``). Some runtimes refuse the node anyway -- OpenVINO's ONNX frontend rejects any training-mode
``Dropout`` -- so :func:`to_onnx <revgraph.onnx_io.to_onnx>` (through which every graph revgraph writes or
runs passes: ``revgraph grad``, ``jvp``/``jacobian``..., ``revgraph train --save-training-graph``,
:meth:`Trainer.save_training_graph`, :meth:`Trainer.export`) rewrites each identity ``Dropout`` by
:func:`identity_dropouts`:

- a ``Dropout`` is an identity when its ``training_mode`` is absent or a constant false (inference: the output
  is the input whatever the ratio), or its ``ratio`` is a constant 0; constants are initializers or
  ``Constant`` nodes of its graph or of an enclosing one. A ratio or mode known only at run time (a graph
  input) keeps the node;
- it becomes ``Identity(data) -> output`` (same output name, same node name, so nothing downstream is
  renamed and subgraphs that read the output still find it); a mask output that anything reads becomes the
  all-true mask ``ConstantOfShape(Shape(data), value=true)``; its ratio and training_mode constants go when
  nothing else reads them.

The gradient is unchanged: revgraph's Dropout VJP (:mod:`revgraph.autodiff.rules.dropout`) already passes the
cotangent through at ratio 0 and in inference mode, and uses no mask there.
"""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node, fresh_name
from ..ir.constants import constant_value


def _constants(graph: Graph, outer: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Small constants ``graph`` can read: the enclosing graphs', its initializers and its ``Constant`` nodes."""
    known = dict(outer)
    known.update({k: a for k, a in graph.initializers.items() if np.asarray(a).size == 1})
    for node in graph.nodes:
        if node.op_type == "Constant" and not node.domain and len(node.outputs) == 1:
            value = constant_value(node)
            if value is not None and np.asarray(value).size == 1:
                known[node.outputs[0]] = np.asarray(value)
    return known


def is_identity_dropout(node: Node, known: dict[str, np.ndarray]) -> bool:
    """Does the default-domain ``Dropout`` ``node`` (opset >= 12: ratio and training_mode are inputs) draw
    nothing? True when its ``training_mode`` is absent or a constant false, or its ``ratio`` a constant 0
    (``known``: constant values by name). A ratio absent is 0.5 (the spec's default), so it does not count."""
    if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or not node.inputs or not node.inputs[0]:
        return False
    ins = [*node.inputs, "", ""]
    mode = known.get(ins[2]) if ins[2] else np.asarray(False)
    ratio = known.get(ins[1]) if ins[1] else None
    return (mode is not None and not bool(np.asarray(mode).reshape(-1)[0])) or \
        (ratio is not None and float(np.asarray(ratio).reshape(-1)[0]) == 0.0)


def _reads(graph: Graph) -> set[str]:
    """Every name read by the nodes of ``graph`` and its subgraphs, and their outputs."""
    read: set[str] = set()
    stack = [graph]
    while stack:
        g = stack.pop()
        read.update(g.output_names)
        for node in g.nodes:
            read.update(node.inputs)
            stack.extend(node.subgraphs.values())
    return read


def _rewrite(graph: Graph, outer: dict[str, np.ndarray], used: set[str] | None) -> tuple[bool, set[str] | None]:
    """Rewrite the identity Dropouts of ``graph`` and its subgraphs in place; ``(changed, used names)``."""
    known = _constants(graph, outer)
    changed = False
    nodes: list[Node] = []
    read: set[str] | None = None
    freed: set[str] = set()  # the ratio and training_mode values of the rewritten Dropouts
    for node in graph.nodes:
        for sub in node.subgraphs.values():
            sub_changed, used = _rewrite(sub, known, used)
            changed |= sub_changed
        if not is_identity_dropout(node, known):
            nodes.append(node)
            continue
        changed = True
        freed.update(i for i in node.inputs[1:] if i)
        data, out = node.inputs[0], node.outputs[0]
        mask = node.outputs[1] if len(node.outputs) > 1 else ""
        if out:
            nodes.append(Node("Identity", [data], [out], name=node.name))
        if mask:
            read = _reads(graph) if read is None else read
            if mask in read:  # the all-true mask of data's shape
                if used is None:
                    used = graph.names_in_use()
                shape = fresh_name(f"{node.name or 'Dropout'}/shape", used)
                nodes.append(Node("Shape", [data], [shape], name=fresh_name(f"{node.name}/mask_shape", used)))
                nodes.append(Node("ConstantOfShape", [shape], [mask], {"value": np.ones(1, np.bool_)},
                                  fresh_name(f"{node.name}/mask", used)))
    graph.nodes = nodes
    if freed:  # constants only the Dropouts read: onnxruntime warns about each unused initializer
        unread = freed - _reads(graph) - set(graph.input_names)
        for name in unread & graph.initializers.keys():
            del graph.initializers[name]
        graph.nodes = [n for n in nodes if not (n.op_type == "Constant" and n.outputs[0] in unread)]
    return changed, used


def identity_dropouts(graph: Graph) -> Graph:
    """``graph`` with each ``Dropout`` that is an identity (module doc) rewritten as ``Identity`` (and an
    all-true mask where its mask is read), in it and in its subgraphs. Returns ``graph`` itself when it has
    no such node, else a rewritten copy (initializer arrays shared); ``graph`` is never changed."""
    if not any(n.op_type == "Dropout" for _, n in graph.walk()):
        return graph
    copy = graph.copy()
    changed, _ = _rewrite(copy, {}, None)
    return copy if changed else graph
