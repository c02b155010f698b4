"""Rewrite operators that are differentiated through their ``Loop`` form (``Scan``, ``LSTM``, ``GRU``,
``RNN``, ``SequenceMap``) before the backward pass."""

from __future__ import annotations

import numpy as np

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo, fresh_name, onnx_dtype
from ...onnx_io.value_types import constant_values, infer_types
from ..registry import LOWERED
from .recurrent import RECURRENT_OPS, lower_recurrent
from .reverse import complete_loop_types, refine
from .rewrite import replace_nodes
from .scan import lower_scans

LOWERED["SequenceMap"] = ("rewritten into its Loop form (ONNX's function body: SequenceAt of each input sequence, "
                          "the body, SequenceInsert of each result), then the Loop VJP")

#: operators whose outputs are sequences (to tell SequenceMap's sequence inputs from its tensor inputs)
_MAKES_SEQUENCES = frozenset({"SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase",
                              "SplitToSequence", "SequenceMap"})


def lower_to_loops(graph: Graph, types: dict[str, ValueInfo] | None, used: set[str]) -> bool:
    """Rewrite, in place and in every subgraph, each ``Scan``/``LSTM``/``GRU``/``RNN`` node into the
    equivalent ``Loop``; fresh names avoid ``used``; ``types`` (inferred here when ``None``) gains the types of
    the new values (rules need static ranks), and the shapes of loops' carried outputs that ONNX's inference
    leaves out (:func:`.reverse.complete_loop_types`; also when nothing is rewritten). Returns True if the graph
    changed."""
    inlined = constants_in_bodies(graph, used)
    if types is not None:
        complete_types(graph, types)
    ops = {n.op_type for _, n in graph.walk() if n.domain in ("", "ai.onnx")}
    if "Scan" not in ops and not ops & set(RECURRENT_OPS) and "SequenceMap" not in ops:
        return inlined
    types = infer_types(graph) if types is None else types
    changed = False
    if "SequenceMap" in ops:
        changed |= lower_sequence_maps(graph, types, used)
    if "Scan" in ops:
        changed |= bool(lower_scans(graph, types, used))
    if ops & set(RECURRENT_OPS):
        lower_recurrent(graph, types, used)
        changed = True
    if changed:
        for name, vi in infer_types(graph).items():
            types.setdefault(name, vi)
        complete_types(graph, types)
    return changed


def constants_in_bodies(graph: Graph, used: set[str]) -> bool:
    """Turn, in place, the initializers of every subgraph (a Loop, Scan or If body: valid ONNX, and what tf2onnx
    and jax2onnx write) into ``Constant`` nodes at the start of that body, under the same value names. The
    backward loop is a graph of its own: it could not read the forward body's initializers, and referred to
    them from outside the body (issue 41: onnxruntime refused the gradient graph, ``grad`` exited 3); a
    ``Constant`` node is recomputed in the backward body as every constant is. Returns True if one moved."""
    moved = False
    for _, node in list(graph.walk()):
        for body in node.subgraphs.values():
            if not body.initializers:
                continue
            consts = [Node("Constant", [], [k], {"value": np.asarray(v)}, fresh_name(f"{k}/constant", used))
                      for k, v in body.initializers.items()]
            body.nodes[:0] = consts
            body.initializers = {}
            moved = True
    return moved


def complete_types(graph: Graph, types: dict[str, ValueInfo]) -> None:
    """The types of the loops' outputs where the model declares none (:func:`.reverse.complete_loop_types`: what
    the body declares or gives), declared in the graph's value_info, and the types inferred again from them."""
    if not any(n.op_type == "Loop" for n in graph.nodes):
        return
    completed = complete_loop_types(graph.nodes, types, constant_values(graph))
    if completed:
        graph.value_info.update(completed)
        refine(types, infer_types(graph))


def lower_sequence_maps(graph: Graph, types: dict[str, ValueInfo], used: set[str]) -> bool:
    """Replace every ``SequenceMap`` node of ``graph`` and of its subgraphs by the ``Loop`` that defines it (ONNX
    "SequenceMap", opset 17): a loop over the elements of the first input, each sequence input read with
    ``SequenceAt`` at the iteration number and each tensor input passed as it is, the body, and each result
    appended (``SequenceInsert``) to a carried sequence that starts empty. Returns True if anything changed."""
    def lower(node: Node, g: Graph) -> list[Node]:
        producers = {o: n for n in g.nodes for o in n.outputs if o}  # a node's inputs come before it
        return _lower_map(node, types, producers, used)

    return replace_nodes(graph, ("SequenceMap",), lower)


def _is_sequence(name: str, types: dict[str, ValueInfo], producers: dict[str, Node], node: Node) -> bool:
    vi = types.get(name)
    if vi is not None and vi.dtype is not None:
        return vi.kind == "sequence"
    p = producers.get(name)
    if p is not None and p.op_type in _MAKES_SEQUENCES:
        return True
    if p is not None and p.op_type not in ("Loop", "If", "Identity"):
        return False
    raise GraphError(f"{node.label()}: cannot tell whether its input {name!r} is a sequence or a tensor; declare "
                     "its type in the model's value_info")


def _lower_map(node: Node, types: dict[str, ValueInfo], producers: dict[str, Node], used: set[str]) -> list[Node]:
    body: Graph = node.attrs["body"].copy()
    base = node.name or "SequenceMap"
    i, cond = fresh_name(f"{base}/i", used), fresh_name(f"{base}/cond", used)
    pre: list[Node] = []
    length = fresh_name(f"{base}/length", used)
    pre.append(Node("SequenceLength", [node.inputs[0]], [length], name=length))
    reads: list[Node] = []
    for k, (src, dst) in enumerate(zip(node.inputs, body.inputs, strict=True)):
        if k == 0 or _is_sequence(src, types, producers, node):
            reads.append(Node("SequenceAt", [src, i], [dst.name], name=fresh_name(f"{base}/element", used)))
        else:
            reads.append(Node("Identity", [src], [dst.name], name=fresh_name(f"{base}/tensor", used)))
    accs, appended, empties = [], [], []
    for out, res in zip(node.outputs, body.outputs, strict=True):
        declared = types.get(out)
        dtype = res.dtype if res.dtype is not None else declared.dtype if declared is not None else None
        if dtype is None:
            raise GraphError(f"{node.label()}: the element type of its output {out!r} is unknown; declare the types "
                             "of the body's outputs")
        acc, new, empty = (fresh_name(f"{base}/{w}", used) for w in ("acc", "appended", "empty"))
        accs.append(ValueInfo(acc, dtype, res.shape, "sequence"))
        appended.append(Node("SequenceInsert", [acc, res.name], [new], name=new))
        empties.append(Node("SequenceEmpty", [], [empty], {"dtype": onnx_dtype(dtype)}, empty))
        types.setdefault(out, ValueInfo(out, dtype, res.shape, "sequence"))
    cond_out = fresh_name(f"{base}/cond_out", used)
    loop_body = Graph(
        [*reads, *body.nodes, *appended, Node("Identity", [cond], [cond_out], name=cond_out)],
        [ValueInfo(i, np.int64, ()), ValueInfo(cond, np.bool_, ()), *accs],
        [ValueInfo(cond_out, np.bool_, ()),
         *(ValueInfo(n.outputs[0], a.dtype, a.shape, "sequence") for n, a in zip(appended, accs, strict=True))],
        dict(body.initializers),
        {**body.value_info, **{v.name: v for v in body.inputs}},
        name=f"{body.name}_as_loop",
    )
    pre += empties
    pre.append(Node("Loop", [length, "", *(n.outputs[0] for n in empties)], list(node.outputs), {"body": loop_body},
                    fresh_name(f"{base}/as_loop", used)))
    return pre
