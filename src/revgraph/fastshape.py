"""Output types of the nodes rules emit most, computed in Python from static shapes and constant inputs.

The emitter records the type of every backward value so that later rules see static shapes. ONNX's per-node
inference (``onnx.shape_inference.infer_node_outputs``) does that for any operator, but costs a protobuf
round trip per node, and it took most of the build time of convolutional and attention models. This module
answers for the shape-moving and elementwise operators with fully static shapes (the formulas of the ONNX
operator spec sections of each operator); :func:`infer` returns ``None`` for anything else and the emitter
falls back to ONNX. tests/test_fastshape.py checks every answer against ONNX's inference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from .ir import Node, ValueInfo

Shape = tuple[int, ...]

#: Elementwise operators (value: result dtype, ``same`` as the first value input or ``bool``).
BROADCASTING = {
    **dict.fromkeys(["Add", "Sub", "Mul", "Div", "Pow", "Sum", "Max", "Min", "Mean", "Where", "Neg", "Exp", "Log",
                     "Sqrt", "Reciprocal", "Abs", "Sign", "Sin", "Cos", "Tanh", "Sigmoid", "Relu", "Identity", "Erf",
                     "Softplus"], "same"),
    **dict.fromkeys(["Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Xor", "Not"], "bool"),
}


def _ints(values: Mapping[str, np.ndarray], node: Node, i: int) -> list[int] | None:
    """Constant integer input ``i`` of ``node`` as a list, ``[]`` when absent, ``None`` when not constant."""
    if len(node.inputs) <= i or not node.inputs[i]:
        return []
    v = values.get(node.inputs[i])
    return None if v is None else np.asarray(v).reshape(-1).tolist()


def _broadcast(node: Node, shapes: list[Shape], values) -> Shape | None:
    first = shapes[0]
    if all(s == first for s in shapes):
        return first
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for s in shapes:
        for i, d in enumerate(s, rank - len(s)):
            if d != 1:
                if out[i] not in (1, d):
                    raise ValueError("shapes do not broadcast")
                out[i] = d
    return tuple(out)


def _transpose(node: Node, shapes: list[Shape], values) -> Shape:
    x = shapes[0]
    perm = node.attrs.get("perm") or list(range(len(x)))[::-1]
    return tuple(x[p] for p in perm)


def _reshape(node: Node, shapes: list[Shape], values) -> Shape | None:
    target = _ints(values, node, 1)
    if not target or node.attrs.get("allowzero", 0):
        return None
    x = shapes[0]
    out = [x[i] if d == 0 else d for i, d in enumerate(target)]
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        if known == 0:
            return None
        out[out.index(-1)] = math.prod(x) // known
    return tuple(out)


def _unsqueeze(node: Node, shapes: list[Shape], values) -> Shape | None:
    axes = _ints(values, node, 1)
    if not axes:
        return None
    out: list = list(shapes[0])
    rank = len(out) + len(axes)
    for a in sorted(a % rank for a in axes):
        out.insert(a, 1)
    return tuple(out)


def _squeeze(node: Node, shapes: list[Shape], values) -> Shape | None:
    axes = _ints(values, node, 1)
    x = shapes[0]
    if axes is None or (not axes and len(node.inputs) > 1 and node.inputs[1]):
        return None  # an empty axes tensor: onnx and onnxruntime disagree on what it means
    drop = {a % len(x) for a in axes} if axes else {i for i, d in enumerate(x) if d == 1}
    return tuple(d for i, d in enumerate(x) if i not in drop)


def _slice(node: Node, shapes: list[Shape], values) -> Shape | None:
    starts, ends, axes, steps = (_ints(values, node, i) for i in (1, 2, 3, 4))
    if starts is None or ends is None or axes is None or steps is None:
        return None
    x = list(shapes[0])
    axes = axes or list(range(len(starts)))
    steps = steps or [1] * len(starts)
    for b, e, a, s in zip(starts, ends, axes, steps, strict=True):
        a %= len(x)
        n = x[a]
        if s > 0:
            b, e = min(max(b + n if b < 0 else b, 0), n), min(max(e + n if e < 0 else e, 0), n)
            x[a] = max(0, -(-(e - b) // s))
        else:
            b, e = min(max(b + n if b < 0 else b, 0), n - 1), min(max(e + n if e < 0 else e, -1), n - 1)
            x[a] = max(0, -(-(b - e) // -s))
    return tuple(x)


def _concat(node: Node, shapes: list[Shape], values) -> Shape:
    axis = node.attrs["axis"] % len(shapes[0])
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    return tuple(out)


def _matmul(node: Node, shapes: list[Shape], values) -> Shape | None:
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        return None
    return (*_broadcast(node, [a[:-2], b[:-2]], values), a[-2], b[-1])


def _gemm(node: Node, shapes: list[Shape], values) -> Shape:
    a, b = shapes[0], shapes[1]
    m = a[1] if node.attrs.get("transA", 0) else a[0]
    n = b[0] if node.attrs.get("transB", 0) else b[1]
    return (m, n)


def _reduce(node: Node, shapes: list[Shape], values) -> Shape | None:
    axes = _ints(values, node, 1)
    x = shapes[0]
    if axes is None:
        return None
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return x
        axes = list(range(len(x)))
    drop = {a % len(x) for a in axes}
    if node.attrs.get("keepdims", 1):
        return tuple(1 if i in drop else d for i, d in enumerate(x))
    return tuple(d for i, d in enumerate(x) if i not in drop)


SHAPES: dict[str, Callable] = {
    **dict.fromkeys(BROADCASTING, _broadcast),
    "Transpose": _transpose, "Reshape": _reshape, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Slice": _slice, "Concat": _concat, "MatMul": _matmul, "Gemm": _gemm,
    **dict.fromkeys(["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"], _reduce),
}
#: how many leading inputs carry data whose shapes the formula reads (the rest are constant operands)
_DATA_INPUTS = {"Reshape": 1, "Unsqueeze": 1, "Squeeze": 1, "Slice": 1, "ReduceSum": 1, "ReduceMean": 1,
                "ReduceMax": 1, "ReduceMin": 1, "Gemm": 2}


#: reductions that keep the input's rank with ``keepdims=1`` (the default), whatever their axes
KEEPDIMS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
            "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin")


def keepdims_type(node: Node, types: Mapping[str, ValueInfo]) -> ValueInfo | None:
    """The type of a reduction's output with ``keepdims=1`` when its axes are not known (computed, as the
    PyTorch exporter writes ``mean(-1)``: ``Reshape(Constant(-1), [1])``): the input's rank, with the
    dimensions that are 1 in the input (a reduced axis becomes 1, a kept one stays) and the others unknown.
    ONNX's inference gives no shape at all there, and the rank is what rules need. ``None`` when the input's
    rank is unknown or ``keepdims=0``."""
    if node.op_type not in KEEPDIMS or node.domain or not node.attrs.get("keepdims", 1) or not node.inputs:
        return None
    x = types.get(node.inputs[0])
    if x is None or x.shape is None:
        return None
    dtype = np.dtype(np.int64) if node.op_type in ("ArgMax", "ArgMin") else x.dtype
    return ValueInfo(node.outputs[0], dtype, tuple(1 if d == 1 else None for d in x.shape))


def infer(node: Node, types: Mapping[str, ValueInfo], values: Mapping[str, np.ndarray]) -> ValueInfo | None:
    """The type of ``node``'s single output when every data input has a static shape and a known dtype and
    the operator is one of :data:`SHAPES`; ``None`` otherwise (ask ONNX)."""
    fn = SHAPES.get(node.op_type)
    if fn is None or node.domain or len(node.outputs) != 1:
        return None
    data = [i for i in node.inputs[: _DATA_INPUTS.get(node.op_type, len(node.inputs))] if i]
    if not data or any(i not in types for i in data):
        return None
    infos = [types[i] for i in data]
    if any(vi.shape is None or not all(type(d) is int for d in vi.shape) for vi in infos):
        return None
    try:
        shape = fn(node, [tuple(vi.shape) for vi in infos], values)
    except (ValueError, IndexError, KeyError, ZeroDivisionError):
        return None
    if shape is None:
        return None
    ref = infos[1] if node.op_type == "Where" else infos[0]
    dtype = np.dtype(bool) if BROADCASTING.get(node.op_type) == "bool" else ref.dtype
    if dtype is None:
        return None
    return ValueInfo(node.outputs[0], dtype, tuple(shape))
