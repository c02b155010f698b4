"""VJPs of reductions (ONNX operator spec, "ReduceSum" ... "ReduceLogSumExp"; since opset 18 every
reduction takes its axes as an optional second input, and ``noop_with_empty_axes`` decides what no axes
mean)."""

from __future__ import annotations

from ...ir import Node
from ..registry import Emitter, vjp


def reduced_axes(e: Emitter, node: Node) -> str | None:
    """The axes input of a reduction (a value name), or ``None`` when every axis is reduced.

    Raises nothing; a reduction with no axes and ``noop_with_empty_axes=1`` is handled by the caller."""
    if len(node.inputs) > 1 and node.inputs[1]:
        return node.inputs[1]
    return None


def expand_back(e: Emitter, node: Node, g: str) -> str:
    """The cotangent ``g`` of a reduction, broadcast back to the input's shape: reduced axes are
    re-inserted (``Unsqueeze``) when ``keepdims=0``, then ``Expand``."""
    x = node.inputs[0]
    axes = reduced_axes(e, node)
    if node.attrs.get("keepdims", 1) == 0 and axes is not None:
        g = e.op("Unsqueeze", [g, axes])
    return e.op("Expand", [g, e.shape_of(x)], like=x)


def is_noop(e: Emitter, node: Node) -> bool:
    """True for a reduction that reduces nothing (no axes given and ``noop_with_empty_axes=1``)."""
    axes = reduced_axes(e, node)
    if axes is None:
        return bool(node.attrs.get("noop_with_empty_axes", 0))
    value = e.value(axes)
    return value is not None and value.size == 0 and bool(node.attrs.get("noop_with_empty_axes", 0))


@vjp("ReduceSum")
def reduce_sum(e: Emitter, node: Node, out_grads: list) -> list:
    g = out_grads[0]
    rest = [None] * (len(node.inputs) - 1)
    if is_noop(e, node):
        return [g, *rest]
    return [expand_back(e, node, g), *rest]
