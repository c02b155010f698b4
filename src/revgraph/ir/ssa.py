"""SSA versions of names written more than once.

A graph may write a name several times (``Relu(x) -> x``; nets converted from Caffe2 do this). Each write
starts a new *version* of the name; a read refers to the version most recently written before it in node
order (Caffe2's blob versions, ``caffe2/python/core.py``, ``IR.Play``). :func:`analyze` lists, for every
name, its versions with the producer and the readers of each; :func:`to_ssa` renames versions apart so that
every name is written once, which is the form ONNX requires and every later pass assumes.

Naming: the version that keeps the plain name is the last one for a graph output (so outputs keep their
names) and the first one otherwise (so inputs keep theirs, and a wrt name means the input); other versions
are called ``<name>__v<k>`` (k counts writes from 1).
"""

from __future__ import annotations

from collections import ChainMap, Counter
from dataclasses import dataclass, field

from .. import validate as V
from . import Graph, Node, ValueInfo, require_graph
from .arguments import GRAPH

CAPTURED = -1  #: the input position recorded for a value read inside a node's subgraph (captured)


@dataclass(eq=False)
class Version:
    """One version of a name: ``index`` counts writes from 0 (a graph input or initializer is version 0
    when present). ``producer`` is the writing node (``None`` for graph inputs, initializers and values of an
    enclosing graph). ``readers`` lists ``(node, input position)`` for every read, so a node that reads the
    version twice appears twice; a read inside a node's subgraph is recorded once as ``(node, CAPTURED)``."""

    name: str
    index: int
    producer: Node | None
    readers: list[tuple[Node, int]] = field(default_factory=list)
    ssa_name: str = ""


@dataclass
class SSAInfo:
    """Versions of every name of one graph (not of its subgraphs' local names)."""

    versions: dict[str, list[Version]]
    _reads: dict[tuple[int, int], Version]
    _writes: dict[tuple[int, int], Version]

    def read(self, node: Node, position: int) -> Version:
        """The version that ``node`` reads at input ``position``."""
        return self._reads[(id(node), position)]

    def written(self, node: Node, position: int) -> Version:
        """The version that ``node`` writes at output ``position``."""
        return self._writes[(id(node), position)]

    def final(self, name: str) -> Version:
        """The last version of ``name`` (what a graph output of that name refers to)."""
        return self.versions[name][-1]

    @property
    def multi_written(self) -> list[str]:
        """Names written more than once (counting a graph input or initializer as a write)."""
        return [n for n, vs in self.versions.items() if len(vs) > 1]


def captured_names(graph: Graph) -> list[str]:
    """Names that ``graph`` (a subgraph) reads from enclosing graphs, in first-read order."""
    out: dict[str, None] = {}
    stack: list[tuple[Graph, frozenset[str]]] = [(graph, frozenset())]
    while stack:
        g, inner = stack.pop()
        local = set(inner)
        local.update(g.input_names)
        local.update(g.initializers)
        for node in g.nodes:
            for name in node.inputs:
                if name and name not in local:
                    out.setdefault(name)
            for sub in node.subgraphs.values():
                stack.append((sub, frozenset(local)))
            local.update(node.outputs)
        for name in g.output_names:
            if name not in local:
                out.setdefault(name)
    return list(out)


@V.arguments(graph=GRAPH)
def analyze(graph: Graph) -> SSAInfo:
    """Versions, producers and readers of every name of ``graph``'s own scope.

    Names that ``graph`` reads but nothing in it writes (values of an enclosing graph) get a version 0
    with no producer. Raises nothing for a graph (:meth:`Graph.check` reports names read before any write).
    """
    require_graph(graph, "analyze_ssa")
    versions: dict[str, list[Version]] = {}
    current: dict[str, Version] = {}
    reads: dict[tuple[int, int], Version] = {}
    writes: dict[tuple[int, int], Version] = {}

    def write(name: str, producer: Node | None) -> Version:
        vs = versions.setdefault(name, [])
        v = Version(name, len(vs), producer)
        vs.append(v)
        current[name] = v
        return v

    def lookup(name: str) -> Version:
        return current[name] if name in current else write(name, None)

    for name in dict.fromkeys([*graph.input_names, *graph.initializers]):
        write(name, None)
    for node in graph.nodes:
        for i, name in enumerate(node.inputs):
            if name:
                v = lookup(name)
                v.readers.append((node, i))
                reads[(id(node), i)] = v
        # One reader per node, however many of its subgraphs (If's two branches) read the name.
        captured = dict.fromkeys(name for sub in node.subgraphs.values() for name in captured_names(sub))
        for name in captured:
            lookup(name).readers.append((node, CAPTURED))
        for j, name in enumerate(node.outputs):
            if name:
                writes[(id(node), j)] = write(name, node)
    for name in graph.output_names:
        lookup(name)
    return SSAInfo(versions, reads, writes)


@V.arguments(graph=GRAPH)
def is_ssa(graph: Graph) -> bool:
    """True when no name is written twice in ``graph`` or any subgraph, nor shadows an enclosing name."""
    require_graph(graph, "is_ssa")
    stack: list[tuple[Graph, frozenset[str]]] = [(graph, frozenset())]
    while stack:
        g, outer = stack.pop()
        seen = set(g.input_names) | set(g.initializers)
        if len(set(g.input_names)) != len(g.inputs) or seen & outer:
            return False
        for node in g.nodes:
            if node.attrs:
                for sub in node.subgraphs.values():
                    stack.append((sub, frozenset(outer | seen)))
            for name in node.outputs:
                if name:
                    if name in seen:
                        return False
                    seen.add(name)
        if not outer.isdisjoint(seen):  # (once per graph: the same answer as testing each output)
            return False
    return True


@V.arguments(graph=GRAPH)
def to_ssa(graph: Graph) -> Graph:
    """A copy of ``graph`` in SSA form that computes the same outputs (see the module doc for names)."""
    require_graph(graph, "to_ssa")
    used = graph.all_names()
    return _rename(graph, ChainMap(), used)


def _rename(graph: Graph, outer: ChainMap, used: set[str]) -> Graph:
    # Recursion here follows subgraph nesting only (a few levels), never the node chain.
    writes: Counter[str] = Counter(dict.fromkeys([*graph.input_names, *graph.initializers], 1))
    for node in graph.nodes:
        writes.update(o for o in node.outputs if o)
    declared = set(graph.input_names) | set(graph.initializers)
    keep_last = {n for n in graph.output_names if n not in declared}
    seen: Counter[str] = Counter()
    env: ChainMap = outer.new_child()

    def fresh(name: str) -> str:
        seen[name] += 1
        k = seen[name]
        plain = k == writes[name] if name in keep_last else k == 1
        if plain and name not in outer:
            new = name
        else:
            new, extra = f"{name}__v{k}", 1
            while new in used:
                extra += 1
                new = f"{name}__v{k}_{extra}"
            used.add(new)
        env[name] = new
        return new

    inputs = [ValueInfo(fresh(v.name), v.dtype, v.shape, v.kind) for v in graph.inputs]
    initializers = {fresh(k) if k not in env.maps[0] else env[k]: a for k, a in graph.initializers.items()}
    value_info: dict[str, ValueInfo] = {}
    nodes = []
    for node in graph.nodes:
        attrs = {}
        for k, v in node.attrs.items():
            if isinstance(v, Graph):
                v = _rename(v, env, used)
            elif isinstance(v, list) and v and isinstance(v[0], Graph):
                v = [_rename(x, env, used) for x in v]
            attrs[k] = v
        ins = [env.get(n, n) if n else n for n in node.inputs]
        outs = [fresh(n) if n else n for n in node.outputs]
        for old, new in zip(node.outputs, outs, strict=True):
            if old in graph.value_info and writes[old] == 1:
                vi = graph.value_info[old]
                value_info[new] = ValueInfo(new, vi.dtype, vi.shape, vi.kind)
        nodes.append(Node(node.op_type, ins, outs, attrs, node.name, node.domain))
    outputs = [ValueInfo(env.get(v.name, v.name), v.dtype, v.shape, v.kind) for v in graph.outputs]
    return Graph(nodes, inputs, outputs, initializers, value_info, graph.name, dict(graph.opsets), graph.doc_string,
                 metadata=dict(graph.metadata))
