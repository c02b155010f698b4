"""Collectives inside a graph: a placeholder operator, its VJP, and the graph cut into segments around it.

``AllReduceSum`` of the private domain :data:`DOMAIN` stands for a sum over the ranks of a data-parallel run:
on rank ``r``, ``y_r = sum_s x_s`` (every rank's input has the same shape and dtype; world 1: ``y = x``).
Its VJP with respect to ``x_r`` is ``sum_s dy_s``: the same all-reduce of the cotangents (``d y_s / d x_r`` is
the identity for every ``s``), which is how ``torch.nn.SyncBatchNorm``'s backward all-reduces its per-channel
sums. So :func:`revgraph.gradient` of a graph holding such nodes writes the backward's all-reduces as
placeholders too, and a rank's gradient graph holds forward and backward collectives alike.

No runtime runs the placeholder. :func:`cut` cuts a graph at its placeholders into :class:`Segments`: stage 0
computes what needs no collective's result, then the collectives whose inputs it wrote run (all of a stage's
collectives in one all-reduce per dtype), then stage 1, and so on. Each segment is an ordinary ONNX graph that
onnxruntime runs; the caller runs the collectives between segments (:mod:`revgraph.train.distributed.sync_batchnorm`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...autodiff.registry import DOMAIN_RULES
from ...errors import RevgraphError
from ...ir import Graph, Node, ValueInfo
from ...ir.inplace import captured
from ...onnx_io.value_types import infer_types

#: the private operator domain of revgraph's collective placeholders (never in a file a runtime loads)
DOMAIN = "revgraph.collective"
ALL_REDUCE = "AllReduceSum"


def is_collective(node: Node) -> bool:
    return node.domain == DOMAIN and node.op_type == ALL_REDUCE


def all_reduce_node(x: str, y: str, name: str, size: int, **attrs) -> Node:
    """An ``AllReduceSum`` placeholder from ``x`` (a 1-D tensor of ``size`` elements) to ``y``; ``attrs`` say
    what it sums (kept by the VJP's placeholder, read by the caller)."""
    return Node(ALL_REDUCE, [x], [y], {"size": int(size), **attrs}, name, DOMAIN)


def _all_reduce_vjp(ctx, node: Node, cts: list) -> list:
    """VJP of ``y_r = sum_s x_s``: ``dx_r = sum_s dy_s``, another all-reduce (module doc)."""
    g = cts[0]
    if g is None:
        return [None]

    def dx() -> str:
        e = ctx.e
        out = e.op(ALL_REDUCE, [g], like=node.inputs[0], size=int(node.attrs["size"]), role="cotangent",
                   **{k: v for k, v in node.attrs.items() if k not in ("size", "role")})
        e.nodes[-1].domain = DOMAIN
        return out

    return [dx]


DOMAIN_RULES[(DOMAIN, ALL_REDUCE)] = _all_reduce_vjp


def world_of_one(graph: Graph) -> Graph:
    """A copy of ``graph`` with every placeholder an ``Identity`` (the sum over a world of one rank): a graph
    onnxruntime runs, for tests and for checking a rewrite in one process."""
    g = graph.copy()
    for _, node in g.walk():
        if is_collective(node):
            node.op_type, node.domain, node.attrs = "Identity", "", {}
    return g


@dataclass
class Stage:
    """One step of :class:`Segments`: ``graph`` (an ONNX graph without placeholders, ``None`` when the stage
    computes nothing), then the ``collectives`` whose inputs this or an earlier stage wrote, as nodes
    (``inputs[0]`` the value summed, ``outputs[0]`` the sum, ``attrs["size"]`` its length)."""

    graph: Graph | None
    collectives: list[Node] = field(default_factory=list)


@dataclass
class Segments:
    """A graph cut at its collectives (module doc). ``stages`` run in order; ``types`` are the types of the
    values that cross between stages (segment inputs and outputs, collective inputs and outputs)."""

    stages: list[Stage]
    types: dict[str, ValueInfo]

    @property
    def collectives(self) -> list[Node]:
        return [c for s in self.stages for c in s.collectives]


def cut(graph: Graph) -> Segments:
    """``graph`` (top level; its nodes in topological order) cut at its ``AllReduceSum`` placeholders. A node
    runs in the stage after the last collective it depends on; a collective runs after the stage that wrote its
    input. Segment ``j`` reads the graph inputs and initializers it uses, the values earlier segments wrote and
    the results of earlier collectives, and writes the values later stages or the graph's outputs read.
    Raises :class:`RevgraphError` for a placeholder inside a subgraph, or of a type that is not a static 1-D
    float tensor."""
    for g, node in graph.walk():
        if is_collective(node) and g is not graph:
            raise RevgraphError("a collective placeholder inside a subgraph (Loop, If, Scan) cannot be cut out of it; "
                                "train that model without --sync-batchnorm")
    types = infer_types(graph)
    types.update(graph.value_info)
    stage: dict[str, int] = {}  # of each value written by a node (graph inputs and initializers: 0)
    node_stage: list[int] = []
    for node in graph.nodes:
        reads = [*node.inputs, *captured(node)] if node.subgraphs else node.inputs
        s = max((stage.get(i, 0) for i in reads if i), default=0)
        node_stage.append(s)
        for o in node.outputs:
            if o:
                stage[o] = s + 1 if is_collective(node) else s
    last = max([*node_stage, 0]) if graph.nodes else 0
    collectives = [n for n in graph.nodes if is_collective(n)]
    for c in collectives:  # a collective sums a static 1-D float tensor into one of its type
        vi = types.get(c.inputs[0])
        if vi is not None and vi.dtype is not None and vi.dtype.kind != "f":
            raise RevgraphError(f"collective placeholder {c.name!r} sums a {vi.dtype} tensor; only floats")
        dt = vi.dtype if vi is not None and vi.dtype is not None else np.dtype(np.float32)
        for v in (c.inputs[0], c.outputs[0]):
            types[v] = ValueInfo(v, dt, (int(c.attrs["size"]),))
    summed = {c.inputs[0] for c in collectives}
    reads_at: dict[str, int] = {}  # the last stage whose segment reads each value
    for n, s in zip(graph.nodes, node_stage, strict=True):
        for i in ([*n.inputs, *captured(n)] if n.subgraphs else n.inputs):
            if i:
                reads_at[i] = max(reads_at.get(i, -1), s)
    kept = set(graph.output_names) | summed
    outer = {v.name: v for v in graph.inputs}
    stages = []
    for j in range(last + 1):
        nodes = [n for n, s in zip(graph.nodes, node_stage, strict=True) if s == j and not is_collective(n)]
        seg = None
        if nodes:
            made = {o for n in nodes for o in n.outputs if o}
            reads = [i for n in nodes for i in ([*n.inputs, *sorted(captured(n))] if n.subgraphs else n.inputs) if i]
            ins = [outer[i] if i in outer else _typed(types, i) for i in dict.fromkeys(reads)
                   if i not in made and i not in graph.initializers]
            outs = [_typed(types, o) for n in nodes for o in n.outputs if o and (o in kept or reads_at.get(o, -1) > j)]
            seg = Graph([n.copy() for n in nodes], ins, outs,
                        {k: v for k, v in graph.initializers.items() if k in set(reads)}, name=f"{graph.name}/stage{j}")
            seg.opsets = {k: v for k, v in graph.opsets.items() if k != DOMAIN}
        colls = [n for n, s in zip(graph.nodes, node_stage, strict=True) if is_collective(n) and s == j]
        stages.append(Stage(seg, colls))
    return Segments(stages, types)


def _typed(types: dict[str, ValueInfo], name: str) -> ValueInfo:
    vi = types.get(name)
    if vi is None or vi.dtype is None:
        raise RevgraphError(f"the type of {name!r} is unknown; it crosses between the segments of a graph cut at "
                            "its collectives, which need typed inputs and outputs")
    return ValueInfo(name, vi.dtype, vi.shape, vi.kind)
