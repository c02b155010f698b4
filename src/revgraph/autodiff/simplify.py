"""Clean-up of a gradient graph: common subexpressions, identities, transpose pairs and dead nodes.

Rules emit what each VJP needs on its own, so the assembled graph repeats work: two VJPs ask for the same
``Shape`` or transpose of a forward value, a VJP transposes the output of a forward ``Transpose`` back,
outputs are exposed through ``Identity`` nodes, and a rule may emit a value only some paths read. Runtimes
differ in how much of this they remove (onnxruntime removes most; the reference evaluator and smaller
runtimes nothing), and every node counts in the size of a saved training graph and in per-node overhead.

:func:`simplify` rewrites the top-level graph in place, keeping the values the graph's interface names
(inputs, outputs, initializers) and anything a subgraph reads from it:

1. common-subexpression elimination: a node with the same operator, attributes and (renamed) inputs as an
   earlier one reuses the earlier outputs (random operators never merge);
2. ``Identity(x)`` is replaced by ``x``; ``Transpose(Transpose(x, p), q)`` by one ``Transpose`` of ``x``
   (or by ``x`` when the permutations cancel);
3. nodes none of whose outputs are read are removed.
"""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from ..ssa import captured_names

#: operators whose two identical calls give different results (sampling), or whose outputs are a fresh mask
RANDOM = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                    "Multinomial", "Bernoulli"})


def _attr_key(value) -> object:
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, (float, np.floating)):
        return ("float", float(value).hex())  # 0.0 == -0.0, but 1 / -0.0 is -inf: compare the bits
    if isinstance(value, (int, str, bytes, bool, np.generic)) or value is None:
        return value
    raise TypeError  # a subgraph or proto attribute: not merged


def _key(node: Node) -> tuple | None:
    if node.op_type in RANDOM or not all(node.outputs):
        return None  # (a subgraph attribute makes _attr_key raise: control flow never merges either)
    try:
        attrs = tuple(sorted((k, _attr_key(v)) for k, v in node.attrs.items()))
    except TypeError:
        return None
    return (node.domain, node.op_type, tuple(node.inputs), len(node.outputs), attrs)


def simplify(graph: Graph) -> Graph:
    """Simplify ``graph`` (SSA form) in place as the module docstring says, and return it."""
    interface = set(graph.input_names) | set(graph.output_names) | set(graph.initializers)
    pinned = set(interface)
    for node in graph.nodes:
        for sg in node.subgraphs.values():
            pinned.update(captured_names(sg))
    rename: dict[str, str] = {}
    seen: dict[tuple, list[str]] = {}
    producer: dict[str, Node] = {}
    kept: list[Node] = []
    for node in graph.nodes:
        node.inputs = [rename.get(i, i) for i in node.inputs]
        if node.op_type == "Transpose" and not node.domain:
            _fold_transpose(node, producer)
        key = _key(node)
        replaced = _replacement(node, key, seen)
        if replaced is not None and not any(o in pinned for o in node.outputs):
            rename.update(zip(node.outputs, replaced, strict=True))
            continue
        if key is not None:
            seen.setdefault(key, node.outputs)
        producer.update((o, node) for o in node.outputs if o)
        kept.append(node)
    graph.nodes = _live(_outputs_in_place(kept, graph, pinned), graph)
    produced = {o for n in graph.nodes for o in n.outputs}
    graph.value_info = {k: v for k, v in graph.value_info.items() if k in produced or k in interface}
    return graph


def _replacement(node: Node, key: tuple | None, seen: dict[tuple, list[str]]) -> list[str] | None:
    """Existing values ``node`` (whose CSE key is ``key``) computes again, or ``None``."""
    if node.op_type == "Identity" and not node.domain and node.inputs and node.inputs[0]:
        return [node.inputs[0]]
    if node.op_type == "Transpose" and not node.domain:
        perm = node.attrs.get("perm")
        if perm is not None and list(perm) == sorted(perm):
            return [node.inputs[0]]
    return seen.get(key) if key is not None else None


def _fold_transpose(node: Node, producer: dict[str, Node]) -> None:
    """``Transpose(Transpose(x, p), q)`` becomes ``Transpose(x, p[q])`` (ONNX "Transpose": output axis i is
    input axis perm[i], so the composition reads x's axis p[q[i]])."""
    inner = producer.get(node.inputs[0])
    q = node.attrs.get("perm")
    if inner is None or inner.op_type != "Transpose" or inner.domain or q is None:
        return
    p = inner.attrs.get("perm")
    if p is None:
        return
    node.inputs = [inner.inputs[0]]
    node.attrs = {**node.attrs, "perm": [int(p[i]) for i in q]}


def _outputs_in_place(nodes: list[Node], graph: Graph, pinned: set[str]) -> list[Node]:
    """Drop ``y = Identity(x)`` for a graph output ``y`` by letting ``x``'s producer write ``y`` itself (when
    ``x`` is an internal value, read by no subgraph)."""
    outputs = set(graph.output_names)
    produced = {o for n in nodes for o in n.outputs if o}
    rename: dict[str, str] = {}
    for node in nodes:
        if (node.op_type == "Identity" and not node.domain and node.outputs[0] in outputs and node.inputs
                and node.inputs[0] in produced and node.inputs[0] not in pinned and node.inputs[0] not in rename):
            rename[node.inputs[0]] = node.outputs[0]
    if not rename:
        return nodes
    out = []
    for node in nodes:
        if node.op_type == "Identity" and node.inputs and rename.get(node.inputs[0]) == node.outputs[0]:
            continue
        node.inputs = [rename.get(i, i) for i in node.inputs]
        node.outputs = [rename.get(o, o) for o in node.outputs]
        out.append(node)
    return out  # the outputs' types are declared by the graph's outputs already


def _live(nodes: list[Node], graph: Graph) -> list[Node]:
    """``nodes`` without those whose outputs nothing reads (a reverse walk from the graph outputs)."""
    needed = set(graph.output_names)
    out: list[Node] = []
    for node in reversed(nodes):
        if not any(o in needed for o in node.outputs if o):
            continue
        out.append(node)
        needed.update(i for i in node.inputs if i)
        for sg in node.subgraphs.values():
            needed.update(captured_names(sg))
    out.reverse()
    return out
