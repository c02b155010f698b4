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
   (or by ``x`` when the permutations cancel). (``Transpose(Gemm(A, B))`` is not folded into ``Gemm(B, A)``:
   with the fold, onnxruntime's default order ran the LLaMA step of bench/memory_common.py at a 13-28% higher
   peak, batch 8 to 64, for one small Transpose per linear layer saved; issue 42);
3. ``CastLike(x, like)`` becomes ``Cast(x, to=like's element type)`` where that type is known: ONNX defines
   ``CastLike`` as a function, which onnxruntime's CPU provider runs by inlining its body as new nodes, and new
   nodes come last in the ``"priority_based"`` order revgraph's training sessions run in (they would delay
   everything behind them, and keep the values alive meanwhile: issue 42);
4. nodes none of whose outputs are read are removed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..ir import Graph, Node, ValueInfo, fresh_name, onnx_dtype
from ..ir.ssa import captured_names

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
    if node.op_type in RANDOM or not all(node.outputs) or node.name.startswith("remat/"):
        # (a recomputation merged back into its forward original would keep what the planner freed)
        return None  # (a subgraph attribute makes _attr_key raise: control flow never merges either)
    try:
        attrs = tuple(sorted((k, _attr_key(v)) for k, v in node.attrs.items())) if node.attrs else ()
    except TypeError:
        return None
    return (node.domain, node.op_type, tuple(node.inputs), len(node.outputs), attrs)


def simplify(graph: Graph, types: Mapping[str, ValueInfo] | None = None) -> Graph:
    """Simplify ``graph`` (SSA form) in place as the module docstring says, and return it. ``types``: value types
    known beyond ``graph.value_info`` (a pass's tracked types, recorded after the clean-up)."""
    interface = set(graph.input_names) | set(graph.output_names) | set(graph.initializers)
    pinned = set(interface)
    for node in graph.nodes:
        if node.attrs:
            for sg in node.subgraphs.values():
                pinned.update(captured_names(sg))
    names = _Names(graph)
    rename: dict[str, str] = {}
    # CSE: the first node of each key, by the key's hash (a key tuple per node was a tenth of a long build's
    # peak); a hit is compared key to key, so a hash collision only misses a merge
    seen: dict[int, Node] = {}
    producer: dict[str, Node] = {}
    kept: list[Node] = []
    identities: list[Node] = []  # the kept Identity nodes (they write graph outputs)
    for node in graph.nodes:
        if not rename.keys().isdisjoint(node.inputs):
            node.inputs = [rename.get(i, i) for i in node.inputs]
        if node.op_type == "Transpose" and not node.domain:
            _fold_transpose(node, producer)
        if node.op_type == "Pad" and not node.domain:
            kept += _fold_pad(node, producer, names)
        if node.op_type == "CastLike" and not node.domain:
            _cast_like_to_cast(node, graph, types or {})
        key = _key(node)
        replaced = _replacement(node, key, seen)
        if replaced is not None and pinned.isdisjoint(node.outputs):
            rename.update(zip(node.outputs, replaced, strict=True))
            continue
        if key is not None:
            seen.setdefault(hash(key), node)
        for o in node.outputs:
            if o:
                producer[o] = node
        kept.append(node)
        if node.op_type == "Identity":
            identities.append(node)
    kept = _outputs_in_place(kept, identities, graph, pinned, producer.keys())
    graph.nodes = _guard_conv_weights(_live(kept, graph), names)
    produced: set[str] = set()
    for node in graph.nodes:
        produced.update(node.outputs)
    graph.value_info = {k: v for k, v in graph.value_info.items() if k in produced or k in interface}
    return graph


def _replacement(node: Node, key: tuple | None, seen: dict[int, Node]) -> list[str] | None:
    """Existing values ``node`` (whose CSE key is ``key``) computes again, or ``None``. ``seen``: earlier
    nodes by the hash of their keys (never changed after they were seen)."""
    if node.op_type == "Identity" and not node.domain and node.inputs and node.inputs[0]:
        return [node.inputs[0]]
    if node.op_type == "Transpose" and not node.domain:
        perm = node.attrs.get("perm")
        if perm is not None and list(perm) == sorted(perm):
            return [node.inputs[0]]
    if key is None:
        return None
    earlier = seen.get(hash(key))
    return earlier.outputs if earlier is not None and _key(earlier) == key else None


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


def _cast_like_to_cast(node: Node, graph: Graph, types: Mapping[str, ValueInfo]) -> None:
    """``CastLike(x, like)`` as ``Cast(x, to=dtype(like))`` (ONNX "CastLike": "the output has the element type of
    ``target_type``"; ``saturate`` means the same in both) where ``like``'s element type is declared."""
    like = node.inputs[1] if len(node.inputs) == 2 else ""
    vi = (types.get(like) or graph.type_of(like)) if like else None
    if vi is None or vi.dtype is None or vi.kind != "tensor":
        return
    node.op_type, node.inputs = "Cast", node.inputs[:1]
    node.attrs = {**{k: v for k, v in node.attrs.items() if k == "saturate"}, "to": onnx_dtype(vi.dtype)}


def _fold_pad(node: Node, producer: dict[str, Node], names: _Names) -> list[Node]:
    """``Pad(Pad(x, p), q)``, both zero-padding (mode "constant", no value, no axes) by constant non-negative
    amounts, becomes ``Pad(x, p + q)`` (ONNX "Pad": the amounts add). Returns the new amounts' ``Constant``.
    Forward mode writes such pairs (the transposes of two crops); onnxruntime 1.32 also rejects a ``Conv`` whose
    weight is a Pad of a Pad ("Node input ... is not ... output of a previous node")."""
    inner = producer.get(node.inputs[0]) if node.inputs else None
    if inner is None or inner.op_type != "Pad" or inner.domain:
        return []
    pads = []
    for n in (inner, node):
        if n.attrs.get("mode", "constant") != "constant" or any(n.inputs[2:]) or len(n.inputs) < 2:
            return []
        const = producer.get(n.inputs[1])
        if const is None or const.op_type != "Constant" or const.domain or "value" not in const.attrs:
            return []
        pads.append(np.asarray(const.attrs["value"]).reshape(-1))
    if pads[0].shape != pads[1].shape or (pads[0] < 0).any() or (pads[1] < 0).any():
        return []
    total = names.fresh(f"{node.name or 'Pad'}/pads")
    node.inputs = [inner.inputs[0], total]
    return [Node("Constant", [], [total], {"value": (pads[0] + pads[1]).astype(np.int64)}, total)]


def _guard_conv_weights(nodes: list[Node], names: _Names) -> list[Node]:
    """Give a zero-padding ``Pad`` whose output is a ``Conv``'s weight an explicit ``axes`` input (all axes: the
    same Pad). onnxruntime 1.32's ``Pad_Fusion`` moves a Pad into the following Conv's ``pads`` without checking
    that it pads the data input, and then rejects the graph ("Node input ... is not a graph input, initializer,
    or output of a previous node"); it leaves Pads with ``axes`` alone. Forward mode pads weight tangents (the
    transpose of the crop in a strided convolution's weight gradient)."""
    if not any(node.op_type == "Conv" for node in nodes):
        return nodes
    producer = {o: n for n in nodes for o in n.outputs if o}
    out = []
    for node in nodes:
        if node.op_type == "Conv" and not node.domain and len(node.inputs) > 1:
            pad = producer.get(node.inputs[1])
            const = (producer.get(pad.inputs[1]) if pad is not None and pad.op_type == "Pad" and len(pad.inputs) > 1
                     else None)
            if (const is not None and len(pad.inputs) <= 3 and not pad.domain and const.op_type == "Constant"
                    and "value" in const.attrs):
                axes = names.fresh(f"{pad.name or 'Pad'}/axes")
                rank = np.asarray(const.attrs["value"]).size // 2
                out.insert(out.index(pad),
                           Node("Constant", [], [axes], {"value": np.arange(rank, dtype=np.int64)}, axes))
                pad.inputs = [*pad.inputs[:2], pad.inputs[2] if len(pad.inputs) > 2 else "", axes]
        out.append(node)
    return out


class _Names:
    """Fresh names for nodes that simplification adds (the graph's names are collected on first use)."""

    def __init__(self, graph: Graph):
        self.graph, self.used = graph, None

    def fresh(self, base: str) -> str:
        if self.used is None:
            self.used = self.graph.names_in_use()
        return fresh_name(base, self.used)


def _outputs_in_place(nodes: list[Node], identities: list[Node], graph: Graph, pinned: set[str],
                      produced) -> list[Node]:
    """Drop ``y = Identity(x)`` for a graph output ``y`` by letting ``x``'s producer write ``y`` itself (when
    ``x`` is an internal value, read by no subgraph). ``identities``: the Identity nodes of ``nodes``;
    ``produced``: the outputs of ``nodes``."""
    outputs = set(graph.output_names)
    rename: dict[str, str] = {}
    for node in identities:
        if (node.op_type == "Identity" and not node.domain and node.outputs[0] in outputs and node.inputs
                and node.inputs[0] in produced and node.inputs[0] not in pinned and node.inputs[0] not in rename):
            rename[node.inputs[0]] = node.outputs[0]
    if not rename:
        return nodes
    out = []
    for node in nodes:
        if node.op_type == "Identity" and node.inputs and rename.get(node.inputs[0]) == node.outputs[0]:
            continue
        if not rename.keys().isdisjoint(node.inputs):
            node.inputs = [rename.get(i, i) for i in node.inputs]
        if not rename.keys().isdisjoint(node.outputs):
            node.outputs = [rename.get(o, o) for o in node.outputs]
        out.append(node)
    return out  # the outputs' types are declared by the graph's outputs already


def _live(nodes: list[Node], graph: Graph) -> list[Node]:
    """``nodes`` without those whose outputs nothing reads (a reverse walk from the graph outputs)."""
    needed = set(graph.output_names)
    needed.discard("")
    out: list[Node] = []
    for node in reversed(nodes):
        if needed.isdisjoint(node.outputs):  # ("" is never in needed)
            continue
        out.append(node)
        needed.update(node.inputs)
        needed.discard("")
        if node.attrs:
            for sg in node.subgraphs.values():
                needed.update(captured_names(sg))
    out.reverse()
    return out
