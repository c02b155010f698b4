"""The residuals of a gradient graph: the forward values its backward part reads, and their bytes.

A gradient graph written by revgraph holds the forward nodes first and the backward nodes after them; the
backward pass names every node it emits ``grad/<forward node>/...``, ``accum/<value>/...``, ``seed/<y>/...``
or ``remat/<value>/...`` (a forward node recomputed inside the backward, :mod:`.plan`), the names
:mod:`revgraph.tools.viz` colours by. A **residual** (JAX's term; PyTorch's "saved tensor") is a value a forward node
writes and a backward node reads (directly or from one of its subgraphs): it must stay alive from its producer
to its last backward reader. Graph inputs and initializers (the parameters, the batch) are alive for the whole
run anyway and are not residuals. So ``saved_bytes`` is what the backward pass costs in memory on top of the
forward pass's own working set, the figure PyTorch's ``saved_tensors_hooks`` count measures (without the
parameters, which PyTorch saves by reference).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ... import validate as V
from ...errors import RevgraphError
from ...ir import Graph, Node, ValueInfo
from ...ir.ssa import captured_names
from ...onnx_io.arguments import AS_GRAPH, ModelLike

#: The name prefixes of nodes the backward pass emits (:mod:`..backward`, :mod:`..accumulate`, :mod:`.plan`).
BACKWARD_PREFIXES = ("grad/", "accum/", "seed/", "remat/")


def is_backward_node(node: Node) -> bool:
    """True for a node the backward pass emitted (by its name: see :data:`BACKWARD_PREFIXES`)."""
    return node.name.startswith(BACKWARD_PREFIXES)


def reads(node: Node) -> list[str]:
    """The values ``node`` reads: its inputs and what its subgraphs capture from the enclosing graph."""
    names = [i for i in node.inputs if i]
    for sub in node.subgraphs.values():
        names.extend(captured_names(sub))
    return names


def residuals(graph: Graph) -> list[str]:
    """The residuals of ``graph`` (a gradient graph, top level only), in the order their producers run: values
    written by a forward node and read by a backward node or by a subgraph of one. Inputs and initializers
    are never residuals. A graph with no backward nodes has none."""
    forward_values: dict[str, int] = {}
    read: set[str] = set()
    for k, node in enumerate(graph.nodes):
        if is_backward_node(node):
            read.update(reads(node))
        else:
            for o in node.outputs:
                if o:
                    forward_values.setdefault(o, k)
    return sorted((v for v in forward_values if v in read), key=forward_values.__getitem__)


def value_bytes(vi: ValueInfo | None, dims: Mapping[str, int] | None = None) -> int | None:
    """Bytes of a tensor of type ``vi``: the product of its dimensions times its element size. A symbolic
    dimension takes its value from ``dims`` (e.g. ``{"batch": 64}``); ``None`` when the dtype, the rank, a
    dimension (unknown, or symbolic and not in ``dims``) is unknown, or the value is a sequence."""
    if vi is None or vi.dtype is None or vi.shape is None or vi.kind != "tensor":
        return None
    n = 1
    for d in vi.shape:
        if isinstance(d, str):
            d = dims.get(d) if dims is not None else None
        if not isinstance(d, (int, np.integer)):
            return None
        n *= int(d)
    return n * np.dtype(vi.dtype).itemsize


def residual_sizes(graph: Graph, dims: Mapping[str, int] | None = None) -> dict[str, int | None]:
    """Each residual of ``graph`` with its bytes (``None`` where its type does not say, see :func:`value_bytes`)."""
    return {r: value_bytes(graph.type_of(r), dims) for r in residuals(graph)}


@V.arguments(graph=AS_GRAPH, dims=V.OPTIONAL_MAPPING)
def saved_bytes(graph: ModelLike, dims: Mapping[str, int] | None = None) -> int:
    """Total bytes of the residuals of ``graph`` (a gradient or training-step graph written by revgraph), from
    the declared types of the values: symbolic dimensions are given by ``dims`` (name -> size). A residual
    stacked by a loop (a scan output) counts with its stacked size, so its leading dimension must be known.

    Raises :class:`RevgraphError` naming the first residual whose size the types do not determine."""
    if not isinstance(graph, Graph):
        raise RevgraphError(f"saved_bytes takes a revgraph.Graph, got {type(graph).__name__}")
    total = 0
    for name, size in residual_sizes(graph, dims).items():
        if size is None:
            vi = graph.type_of(name)
            raise RevgraphError(f"the size of the residual {name!r} ({vi.describe() if vi else 'untyped'}) is not "
                                "known from the graph's types; give its symbolic dimensions with dims={name: size}")
        total += size
    return total
