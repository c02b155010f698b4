"""VJP of ONNX "Unique" (its values output; ``indices``, ``inverse_indices`` and ``counts`` are integers and carry
no gradient).

The unique values are a selection of ``X``: ``Y = Gather(Reshape(X, [-1]), indices)`` without ``axis`` and
``Y = Gather(X, indices, axis)`` with it, ``indices`` being each unique value's first occurrence, whether the
values are sorted or not (``sorted`` only orders ``Y`` and ``indices`` alike). Where ``X`` has no ties that is the
derivative: a small change of ``X`` keeps every value distinct and moves each ``Y[j]`` with its one element.
At a tie it is a convention: perturbing one of several equal elements splits the group (Unique is not
differentiable there). The one chosen is the selection's: the cotangent of ``Y[j]`` goes to the first occurrence
and the other copies get zero, which is what ``jax.numpy.unique`` gives (a stable sort, then the first element
of each group kept: ``_unique_sorted_mask``); PyTorch's ``torch.unique`` has no derivative. The alternatives
(each copy the full cotangent, or a share ``1 / count`` of it) are not the derivative of any selection: the
first double-counts, and neither agrees with a one-sided perturbation of the first copy.
"""

from __future__ import annotations

from ...ir import Node
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from .indexing import add_back


@vjp("Unique", bounded=True, finite=True, reads=(), moves=True)
def unique(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Unique": the cotangent of ``Y`` added into zeros of ``X``'s shape at each unique value's first
    occurrence (module doc: the convention at ties), read from the node's ``indices`` output or, when the node
    does not produce it, from a ``Unique`` of the backward graph with the node's attributes."""
    g = cts[0]
    if g is None:
        return [None]
    return [lambda: _unselect(ctx.e, node, g)]


def _first_occurrences(e: Emitter, node: Node) -> str:
    """The ``indices`` output of ``node``, or that of a ``Unique`` emitted with its attributes."""
    if len(node.outputs) > 1 and node.outputs[1]:
        return node.outputs[1]
    return e.op("Unique", [node.inputs[0]], 2, **node.attrs)[1]


def _unselect(e: Emitter, node: Node, g: str):
    """The transpose of ``Y = Gather(X, indices, axis)`` (or of the flattened ``X`` without ``axis``)."""
    x, indices = node.inputs[0], _first_occurrences(e, node)
    if "axis" in node.attrs:
        axis = int(node.attrs["axis"])
        axis = axis if axis >= 0 else axis + e.need_rank(x, node)
        return add_back(e, node, x, indices, g, axis)
    flat = e.op("Reshape", [e.zeros_like(x), e.ints([-1])])
    # (the indices are distinct: no two updates meet, so "add" is only the transpose's usual reduction)
    scattered = e.op("ScatterElements", [flat, indices, g], axis=0, reduction="add", like=flat)
    return e.op("Reshape", [scattered, e.shape_of(x)], like=x)
