"""When a graph may write an output into the buffer of one of its inputs: the structural check behind one buffer set.

A training step's update graph reads the parameters, the optimizer state and the step and writes their new
values. Binding an output (``p.new``) to the very ``OrtValue`` of its input (``p``) makes onnxruntime write the
new value over the old one, so one buffer set holds parameters and state instead of two swapped sets. That is
right only if nothing reads the old value after the new one is written. onnxruntime runs the nodes in some
topological order, and a node can run before any node that is not its ancestor; so the pair ``(p, p.new)`` is
safe when every node that may read ``p``'s buffer is an **ancestor** of the node writing ``p.new`` (it then
runs first), or is that writer itself reading ``p`` elementwise, each output element from the same input
element (:data:`SAME_INDEX`: ``Sub(p, step) -> p.new`` may overwrite ``p`` as it goes, as onnxruntime's own
in-place kernels do), or is a ``ScatterND``/``ScatterElements`` writing ``p.new`` from ``p`` as its data
(onnxruntime's kernels skip the copy of the data when input and output share a buffer, then write the rows).

"May read ``p``'s buffer": a node reading ``p``, and transitively any node reading a value that onnxruntime may
make a view of ``p`` rather than a copy (the outputs of :data:`ALIAS_OPS` on it), or a subgraph of a node that
reads one of those values from its enclosing graph. Everything else (an unknown writer, a writer that reads
``p`` through a view, a reader that runs in parallel to the writer) makes the pair unsafe, and the engine keeps
two buffers for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import Graph, Node

#: Operators whose output onnxruntime may place in their first input's buffer (a view, no copy).
ALIAS_OPS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})

#: Operators that compute output element ``k`` from input element ``k`` of an input of the output's shape (the
#: others broadcast), so they may overwrite such an input while they run.
SAME_INDEX = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Reciprocal", "Where", "Max", "Min",
                        "Sum", "Clip", "Identity", "Cast"})

#: Operators that write their output from their data input (position 0) and then change some elements.
SCATTERS = frozenset({"ScatterND", "ScatterElements"})


def captured(node: Node) -> set[str]:
    """Names that ``node``'s subgraphs read from enclosing graphs (read anywhere inside, defined nowhere there)."""
    reads: set[str] = set()
    defined: set[str] = set()
    stack = list(node.subgraphs.values())
    while stack:
        g = stack.pop()
        defined.update(g.input_names, g.initializers)
        for n in g.nodes:
            reads.update(i for i in n.inputs if i)
            defined.update(n.outputs)
            stack.extend(n.subgraphs.values())
    return reads - defined


def inplace_pairs(graph: Graph, pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Which ``(input, output)`` pairs of ``graph`` may share one buffer (module doc).

    ``graph`` is a top-level graph in SSA form (every value written once); ``pairs`` names graph inputs and the
    graph outputs meant to overwrite them. Returns ``{input: reason}`` for the pairs that may **not** share a
    buffer (an empty dict when all may); the reason names the node that could read the old value too late.
    """
    nodes = graph.nodes
    producer: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for o in n.outputs:
            if o:
                producer[o] = k
    reads: list[list[str]] = []
    for n in nodes:
        names = [i for i in n.inputs if i]
        if n.subgraphs:
            names += sorted(captured(n))
        reads.append(names)
    readers: dict[str, list[int]] = {}
    for k, names in enumerate(reads):
        for name in names:
            readers.setdefault(name, []).append(k)
    ancestors: list[int] = []  # ancestors[k]: bit j set when node j is an ancestor of node k
    for k, names in enumerate(reads):
        bits = 0
        for name in names:
            j = producer.get(name)
            if j is not None and j >= k:  # ONNX keeps nodes in topological order; anything else is not checked
                return {i: f"{nodes[k].label()} reads {name!r} before it is computed" for i, _ in pairs}
            if j is not None:
                bits |= ancestors[j] | (1 << j)
        ancestors.append(bits)
    unsafe: dict[str, str] = {}
    for i, o in pairs:
        reason = _unsafe(i, o, nodes, producer, readers, ancestors)
        if reason:
            unsafe[i] = reason
    return unsafe


def _unsafe(i: str, o: str, nodes: list[Node], producer: dict[str, int], readers: dict[str, list[int]],
            ancestors: list[int]) -> str | None:
    """Why ``o`` may not be written into ``i``'s buffer, or ``None`` when it may."""
    w = producer.get(o)
    if w is None:
        return f"{o!r} is not computed by a node of the graph"
    writer = nodes[w]
    views, todo, seen = [], [i], {i}
    while todo:  # i and the values that may be views of it
        v = todo.pop()
        views.append(v)
        for r in readers.get(v, ()):
            n = nodes[r]
            if n.op_type in ALIAS_OPS and n.inputs[:1] == [v] and n.domain in ("", "ai.onnx"):
                for out in n.outputs:
                    if out and out not in seen:
                        seen.add(out)
                        todo.append(out)
    for v in views:
        for r in readers.get(v, ()):
            if r == w:
                if not _writes_over(writer, v, i):
                    return f"{writer.label()} reads {v!r} while it writes {o!r}"
            elif not (ancestors[w] >> r) & 1:
                return f"{nodes[r].label()} reads {v!r} and may run after {writer.label()} writes {o!r}"
    return None


def _writes_over(writer: Node, v: str, i: str) -> bool:
    """May ``writer`` write its output into the buffer of ``v``, which it reads? Only when ``v`` is the input
    ``i`` itself (of the output's shape) read elementwise or as a scatter's data, and only there."""
    if v != i or writer.domain not in ("", "ai.onnx") or writer.subgraphs or len(writer.outputs) != 1:
        return False
    if writer.op_type in SAME_INDEX:
        return True
    positions = [k for k, name in enumerate(writer.inputs) if name == i]
    return writer.op_type in SCATTERS and positions == [0]
