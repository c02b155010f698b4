"""The ONNX training-preview ``Gradient`` operator (domain ``ai.onnx.preview.training``, version 1).

``Gradient(xs=[...], y=..., zs=[...])`` takes the values named by ``xs`` (then ``zs``) as inputs and returns
``dy/dx`` for each x, y's elements summed (ONNX operator spec, "ai.onnx.preview.training.Gradient"). No
runtime executes it; :func:`expand_gradient_ops` replaces each such node by its backward pass in standard ONNX.
"""

from __future__ import annotations

from .. import validate as V
from ..errors import GraphError
from ..ir import Graph, Node
from ..ir.arguments import GRAPH
from ..ir.ssa import is_ssa, to_ssa
from ..onnx_io.value_types import infer_types
from .arguments import used_names
from .backward import backward
from .emitter import Emitter
from .sparse import densify

DOMAIN = "ai.onnx.preview.training"


@V.arguments(graph=GRAPH)
def expand_gradient_ops(graph: Graph) -> Graph:
    """A copy of ``graph`` in which every ``Gradient`` node is replaced by the nodes computing its outputs.

    Raises :class:`GraphError` for a ``Gradient`` node whose ``y`` or ``xs`` name no value written before it.
    Only the top-level graph is searched (a ``Gradient`` inside a loop body is refused by the runtimes anyway).
    """
    g = graph if is_ssa(graph) else to_ssa(graph)
    if not any(n.domain == DOMAIN for n in g.nodes):
        return graph
    g = g.copy()
    while True:
        pos = next((i for i, n in enumerate(g.nodes) if n.domain == DOMAIN), None)
        if pos is None:
            break
        node = g.nodes[pos]
        if node.op_type != "Gradient":
            raise GraphError(f"{node.label()}: revgraph expands only Gradient from domain {DOMAIN}")
        xs, y = list(node.attrs.get("xs", [])), node.attrs.get("y")
        if len(xs) != len(node.outputs):
            raise GraphError(f"{node.label()} has {len(node.outputs)} outputs for {len(xs)} names in 'xs'")
        prefix = Graph(g.nodes[:pos], g.inputs, [], g.initializers, g.value_info, g.name, dict(g.opsets))
        written = set(prefix.input_names) | set(prefix.initializers) | {o for n in prefix.nodes for o in n.outputs}
        for name in [y, *xs]:
            if name not in written:
                raise GraphError(f"{node.label()} names {name!r}, which no input, initializer or earlier node writes")
        types = infer_types(Graph(prefix.nodes, prefix.inputs, [], prefix.initializers, {}, opsets=dict(g.opsets)))
        e = Emitter(types, used_names(g), g.opset, f"grad/{node.name or 'Gradient'}")
        _, grad_map = backward(prefix, {y: None}, xs, types=types, emitter=e)
        tail = []
        for x, out in zip(xs, node.outputs, strict=True):
            grad = grad_map.get(x)
            with e.scope(f"grad/{node.name or 'Gradient'}/{x}"):
                if grad is None:
                    grad = e.zeros_like(x)
                elif not isinstance(grad, str):
                    grad = densify(e, grad)
            tail.append(Node("Identity", [grad], [out], name=e.fresh(f"{node.name or 'Gradient'}/{out}")))
        g.nodes[pos : pos + 1] = [*e.nodes, *tail]
    g.opsets.pop(DOMAIN, None)
    return g
