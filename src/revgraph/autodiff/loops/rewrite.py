"""Rewriting operators in place, in a graph and every subgraph: the lowering of ``Scan``, the recurrent
operators and ``SequenceMap`` into their ``Loop`` forms shares this walk."""

from __future__ import annotations

from collections.abc import Callable, Collection

from ...ir import Graph, Node


def replace_nodes(graph: Graph, ops: Collection[str], rewrite: Callable[[Node, Graph], list[Node]]) -> bool:
    """Replace each default-domain node of ``graph`` and of its subgraphs whose type is in ``ops`` by the nodes
    ``rewrite(node, enclosing graph)`` returns, in place (an iterative walk: the replacements' own subgraphs are
    visited too). Returns True if anything changed."""
    changed = False
    stack = [graph]
    while stack:
        g = stack.pop()
        out: list[Node] = []
        for node in g.nodes:
            if node.op_type in ops and node.domain in ("", "ai.onnx"):
                out.extend(rewrite(node, g))
                changed = True
            else:
                out.append(node)
        g.nodes[:] = out
        stack.extend(sub for n in out for sub in n.subgraphs.values())
    return changed
