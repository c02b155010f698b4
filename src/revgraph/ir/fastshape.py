"""Output types of the nodes rules emit most, computed in Python from static shapes and constant inputs.

The emitter records the type of every backward value so that later rules see static shapes. ONNX's per-node
inference (``onnx.shape_inference.infer_node_outputs``) does that for any operator, but costs a protobuf
round trip per node, and it took most of the build time of convolutional and attention models. This module
answers for the shape-moving and elementwise operators with fully static shapes (the formulas of the ONNX
operator spec sections of each operator); :func:`infer` returns ``None`` for anything else and the emitter
falls back to ONNX. tests/test_fastshape.py checks every answer against ONNX's inference.

Two more services of the same kind: :func:`rank_types`, the ranks of operators whose output rank does not
depend on values where ONNX gives none (a ``keepdims=1`` reduction over computed axes), and :func:`fold`, the
values of shape arithmetic over static shapes (``Concat(Slice(Shape(x)), Cast(Constant))``), which
:func:`revgraph.onnx_io.value_types.constant_values` gives the rules as constants (tests/test_constants.py checks them
against onnxruntime). The formulas are those of opset 21 and every newer opset (opsets 22 to 28 changed none of them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import numpy as np

from . import Node, ValueInfo

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


def _same(node: Node, shapes: list[Shape], values) -> Shape:
    return shapes[0]


def _flatten(node: Node, shapes: list[Shape], values) -> Shape:
    x = shapes[0]
    axis = node.attrs.get("axis", 1)
    axis = axis + len(x) if axis < 0 else axis
    if not 0 <= axis <= len(x):
        raise ValueError("axis out of range")
    return (math.prod(x[:axis]), math.prod(x[axis:]))


def _pad(node: Node, shapes: list[Shape], values) -> Shape | None:
    pads, axes = _ints(values, node, 1), _ints(values, node, 3)
    x = list(shapes[0])
    if pads is None or axes is None or node.attrs.get("mode", "constant") != "constant":
        return None
    axes = [a % len(x) for a in axes] if axes else list(range(len(x)))
    if len(pads) != 2 * len(axes):
        return None
    for j, a in enumerate(axes):
        x[a] += pads[j] + pads[j + len(axes)]
    return tuple(x)


SHAPES: dict[str, Callable] = {
    **dict.fromkeys(BROADCASTING, _broadcast),
    "Transpose": _transpose, "Reshape": _reshape, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Slice": _slice, "Concat": _concat, "MatMul": _matmul, "Gemm": _gemm, "Flatten": _flatten, "Pad": _pad,
    "Cast": _same,
    **dict.fromkeys(["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"], _reduce),
}
#: how many leading inputs carry data whose shapes the formula reads (the rest are constant operands)
_DATA_INPUTS = {"Reshape": 1, "Unsqueeze": 1, "Squeeze": 1, "Slice": 1, "ReduceSum": 1, "ReduceMean": 1,
                "ReduceMax": 1, "ReduceMin": 1, "Gemm": 2, "Pad": 1}


#: reductions that keep the input's rank with ``keepdims=1`` (the default), whatever their axes
KEEPDIMS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
            "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin")


def keepdims_type(node: Node, types: Mapping[str, ValueInfo]) -> ValueInfo | None:
    """The type of a reduction's output with ``keepdims=1`` when its axes are not known (computed, as the
    PyTorch exporter writes ``mean(-1)``: ``Reshape(Constant(-1), [1])``): the input's rank, with the
    dimensions that are 1 in the input (a reduced axis becomes 1, a kept one stays) and the others unknown.
    ONNX's inference gives no shape at all there, and the rank is what rules need. ``None`` when the input's
    rank is unknown or ``keepdims=0``."""
    if node.op_type not in KEEPDIMS or not node.attrs.get("keepdims", 1):
        return None
    return rank_types(node, types).get(node.outputs[0]) if node.outputs else None


def _length(types: Mapping[str, ValueInfo], node: Node, i: int) -> int | None:
    """The static length of the 1-D input ``i`` of ``node`` (axes, repeats, a shape), ``None`` when absent or
    unknown."""
    if len(node.inputs) <= i or not node.inputs[i]:
        return None
    vi = types.get(node.inputs[i])
    if vi is None or vi.shape is None or len(vi.shape) != 1 or type(vi.shape[0]) is not int:
        return None
    return vi.shape[0]


def rank_types(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    """Output types with the rank (and the dimensions that do not depend on values) of operators whose output
    rank does not depend on the values of their inputs, where ONNX's inference gives no shape when an input that
    sets dimensions (axes, split sizes, a target shape) is computed: reductions (``keepdims=1``: the input's
    rank, 1 where the input has 1; ``keepdims=0``: the input's rank less the static length of ``axes``),
    ``Unsqueeze`` and ``Squeeze`` (plus or minus that length), ``Split`` (the input's rank, its dimensions
    off ``axis``), ``CenterCropPad`` (the input's rank, its dimensions off ``axes``), ``MaxUnpool`` (N and C
    kept) and ``STFT`` (``[batch, frames, bins, 2]``). Unknown dimensions are ``None``. ``{}`` when the input's
    rank is unknown or the operator is none of these."""
    if node.domain or not node.inputs or not node.inputs[0] or not node.outputs:
        return {}
    x = types.get(node.inputs[0])
    if x is None or x.shape is None:
        return {}
    xs, op, out = tuple(x.shape), node.op_type, node.outputs[0]
    dtype = x.dtype
    if op in KEEPDIMS:
        arg = op in ("ArgMax", "ArgMin")
        dtype = np.dtype(np.int64) if arg else x.dtype
        if node.attrs.get("keepdims", 1):
            dims = tuple(1 if d == 1 else None for d in xs)
        elif arg:
            dims = (None,) * (len(xs) - 1) if xs else None
        elif len(node.inputs) < 2 or not node.inputs[1]:  # no axes: every axis, or none with noop_with_empty_axes
            dims = xs if node.attrs.get("noop_with_empty_axes", 0) else ()
        else:
            k = _length(types, node, 1)
            if k is None or k > len(xs):
                return {}
            dims = (xs if node.attrs.get("noop_with_empty_axes", 0) else ()) if k == 0 else (None,) * (len(xs) - k)
        return {} if dims is None else {out: ValueInfo(out, dtype, dims)}
    if op in ("Unsqueeze", "Squeeze"):
        k = _length(types, node, 1)
        if not k or (op == "Squeeze" and k > len(xs)):
            return {}
        return {out: ValueInfo(out, dtype, (None,) * (len(xs) + k if op == "Unsqueeze" else len(xs) - k))}
    if op == "Split":
        if not xs:
            return {}
        axis = int(node.attrs.get("axis", 0)) % len(xs)
        dims = tuple(None if i == axis else d for i, d in enumerate(xs))
        return {o: ValueInfo(o, dtype, dims) for o in node.outputs if o}
    if op == "CenterCropPad":
        axes = {int(a) % len(xs) for a in node.attrs.get("axes") or range(len(xs))} if xs else set()
        return {out: ValueInfo(out, dtype, tuple(None if i in axes else d for i, d in enumerate(xs)))}
    if op == "MaxUnpool" and len(xs) >= 2:
        return {out: ValueInfo(out, dtype, (*xs[:2], *(None,) * (len(xs) - 2)))}
    if op == "STFT" and len(xs) == 3:
        return {out: ValueInfo(out, dtype, (xs[0], None, None, 2))}
    return {}


# ---------------------------------------------------------------------------------------------- folding

#: The most elements a folded value may have: shape arithmetic reads vectors of a few elements.
MAX_FOLDED = 1024

#: Operators :func:`fold` computes, when every input is known (``Shape`` and ``Size``: when the input's shape is
#: static): the shape arithmetic exporters write (``Concat(Slice(Shape(x)), Cast(Constant))`` for Resize sizes,
#: ``Reshape(Constant(-1), [1])`` for reduction axes, ``Floor(Mul(Cast(Shape(x)), scale))``).
FOLDABLE = frozenset({
    "Shape", "Size", "Identity", "Cast", "Concat", "Gather", "Slice", "Unsqueeze", "Squeeze", "Reshape",
    "Flatten", "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Floor", "Ceil", "Max", "Min", "Equal", "Less",
    "Greater", "Not", "Where", "ConstantOfShape", "Range", "ReduceProd", "ReduceSum", "Expand", "Transpose",
})


def _static(vi: ValueInfo | None) -> tuple[int, ...] | None:
    if vi is None or vi.shape is None or not all(type(d) is int for d in vi.shape):
        return None
    return tuple(vi.shape)


def slice_indices(dim: int, start: int, end: int, step: int) -> range:
    """The indices ONNX ``Slice`` selects along one axis (operator spec, Slice-13: negative starts/ends
    count from the end, then starts clamp to [0, dim] for positive steps and [0, dim-1] for negative
    ones, ends to [0, dim] and [-1, dim-1])."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return range(start, end, step)


def _fold_slice(node: Node, args: list) -> np.ndarray:
    x = args[0]
    starts, ends = (np.asarray(a).reshape(-1).tolist() for a in args[1:3])
    given = len(args) > 3 and args[3] is not None
    axes = np.asarray(args[3]).reshape(-1).tolist() if given else list(range(len(starts)))
    steps = np.asarray(args[4]).reshape(-1).tolist() if len(args) > 4 and args[4] is not None else [1] * len(starts)
    for b, e, a, st in zip(starts, ends, axes, steps, strict=True):
        if st == 0:
            raise ValueError("Slice step 0")
        a %= x.ndim
        x = np.take(x, list(slice_indices(x.shape[a], b, e, st)), axis=a)
    return x


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division truncating toward zero, as C and onnxruntime divide."""
    if np.any(b == 0):
        raise ZeroDivisionError
    q = np.abs(a) // np.abs(b)
    return (np.sign(a) * np.sign(b) * q).astype(np.result_type(a, b))


def _fold_reduce(node: Node, args: list) -> np.ndarray:
    x = args[0]
    axes = args[1] if len(args) > 1 and args[1] is not None else None
    keep = bool(node.attrs.get("keepdims", 1))
    if axes is None or axes.size == 0:
        if node.attrs.get("noop_with_empty_axes", 0):
            return x
        axes = np.arange(x.ndim)
    fn = np.prod if node.op_type == "ReduceProd" else np.sum
    return np.asarray(fn(x, axis=tuple(int(a) % x.ndim for a in axes.reshape(-1)), keepdims=keep), dtype=x.dtype)


def fold(node: Node, values: Mapping[str, np.ndarray], types: Mapping[str, ValueInfo]) -> np.ndarray | None:
    """The value of ``node``'s single output when it is shape arithmetic (:data:`FOLDABLE`) over known values
    (``values``) and static shapes (``types``), computed with numpy as the ONNX operator spec says; ``None``
    otherwise, or when the result would have more than :data:`MAX_FOLDED` elements."""
    op = node.op_type
    if op not in FOLDABLE or node.domain or len(node.outputs) != 1 or not node.outputs[0]:
        return None
    if op in ("Shape", "Size"):
        shape = _static(types.get(node.inputs[0]))
        if shape is None:
            return None
        if op == "Size":
            return np.asarray(math.prod(shape), np.int64)
        r = len(shape)
        start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
        start = min(max(start + r if start < 0 else start, 0), r)
        end = r if end is None else min(max(int(end) + r if int(end) < 0 else int(end), 0), r)
        return np.asarray(shape[start:end], np.int64)
    if any(i and i not in values for i in node.inputs) or not node.inputs:
        return None
    args = [np.asarray(values[i]) if i else None for i in node.inputs]
    if any(a is not None and (a.size > MAX_FOLDED or a.dtype.kind not in "biuf") for a in args):
        return None
    try:
        with np.errstate(all="raise"):
            result = _compute(node, args)
    except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError, FloatingPointError, OverflowError):
        return None
    if result is None:
        return None
    result = np.asarray(result)
    return result if result.size <= MAX_FOLDED else None


def _compute(node: Node, args: list) -> np.ndarray | None:
    op, a = node.op_type, node.attrs
    x = args[0]
    if op == "Identity":
        return x.copy()
    if op == "Transpose":  # the legacy exporter reorders Pad amounts with Reshape, Slice and Transpose
        perm = a.get("perm")
        return np.transpose(x, None if perm is None else [int(p) for p in perm])
    if op == "Cast":
        from onnx import helper

        to = np.dtype(helper.tensor_dtype_to_np_dtype(int(a["to"])))
        return x.astype(to) if to.kind in "biuf" else None  # float8/float4 round by attributes: not folded
    if op == "Concat":
        return np.concatenate([v for v in args if v is not None], axis=int(a["axis"]))
    if op == "Gather":
        axis = int(a.get("axis", 0)) % x.ndim
        idx = args[1].astype(np.int64)
        idx = np.where(idx < 0, idx + x.shape[axis], idx)
        return np.take(x, idx, axis=axis)
    if op == "Slice":
        return _fold_slice(node, args)
    if op == "Reshape":
        target = [int(d) for d in args[1].reshape(-1)]
        if not a.get("allowzero", 0):
            target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
        return x.reshape(target)
    if op == "Flatten":
        axis = int(a.get("axis", 1))
        axis = axis + x.ndim if axis < 0 else axis
        return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
    if op in ("Unsqueeze", "Squeeze"):
        values = {node.inputs[i]: v for i, v in enumerate(args) if v is not None}
        if op == "Squeeze" and len(args) > 1 and args[1] is not None and args[1].size == 0:
            return None  # an empty axes tensor: onnx and onnxruntime disagree on what it means
        shape = (_unsqueeze if op == "Unsqueeze" else _squeeze)(node, [x.shape], values)
        return None if shape is None else x.reshape(shape)
    if op in ("Add", "Sub", "Mul", "Max", "Min", "Equal", "Less", "Greater"):
        fn = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Max": np.maximum, "Min": np.minimum,
              "Equal": np.equal, "Less": np.less, "Greater": np.greater}[op]
        if op in ("Max", "Min"):
            return functools.reduce(fn, args)
        if args[0].dtype != args[1].dtype:
            return None
        out = fn(args[0], args[1])
        return out if op in ("Equal", "Less", "Greater") else out.astype(args[0].dtype)
    if op == "Div":
        if args[0].dtype != args[1].dtype:
            return None
        if x.dtype.kind in "iu":
            return _int_div(args[0], args[1])
        return (args[0] / args[1]).astype(x.dtype)
    if op in ("Neg", "Abs", "Floor", "Ceil", "Not"):
        return {"Neg": np.negative, "Abs": np.abs, "Floor": np.floor, "Ceil": np.ceil, "Not": np.logical_not}[op](x)
    if op == "Where":
        return np.where(args[0], args[1], args[2])
    if op == "ConstantOfShape":
        shape = tuple(int(d) for d in x.reshape(-1))
        if any(d < 0 for d in shape) or math.prod(shape) > MAX_FOLDED:
            return None
        fill = np.asarray(a.get("value", np.zeros(1, np.float32))).reshape(-1)
        return np.full(shape, fill[0], dtype=fill.dtype)
    if op == "Range":
        start, limit, delta = (v.reshape(()) for v in args)
        if delta == 0:
            return None
        n = max(math.ceil((limit - start) / delta), 0)
        if n > MAX_FOLDED:
            return None
        return (start + np.arange(n, dtype=np.int64).astype(start.dtype) * delta).astype(start.dtype)
    if op in ("ReduceProd", "ReduceSum"):
        return _fold_reduce(node, args)
    if op == "Expand":
        shape = tuple(int(d) for d in args[1].reshape(-1))
        out = np.broadcast_shapes(x.shape, shape)
        return None if math.prod(out) > MAX_FOLDED else np.broadcast_to(x, out).copy()
    return None


@functools.lru_cache(maxsize=4096)
def _all_ints(shape: tuple) -> bool:
    """Is every dimension of ``shape`` a known int? (Asked for every emitted node; graphs have few shapes.)"""
    return all(type(d) is int for d in shape)


@functools.lru_cache(maxsize=64)
def _cast_dtype(to: int | None) -> np.dtype | None:
    """The numpy dtype of ``Cast``'s ``to`` (as :func:`revgraph.onnx_io.value_info_from_proto` reads an element
    type), ``None`` for one numpy does not have."""
    from onnx import helper

    try:
        return helper.tensor_dtype_to_np_dtype(int(to)) if to else None
    except (KeyError, TypeError, ValueError):
        return None


def infer(node: Node, types: Mapping[str, ValueInfo], values: Mapping[str, np.ndarray]) -> ValueInfo | None:
    """The type of ``node``'s single output when every data input has a static shape and a known dtype and
    the operator is one of :data:`SHAPES`; ``None`` otherwise (ask ONNX)."""
    fn = SHAPES.get(node.op_type)
    if fn is None or node.domain or len(node.outputs) != 1:
        return None
    infos = []
    for i in node.inputs[: _DATA_INPUTS.get(node.op_type, len(node.inputs))]:
        if i:
            vi = types.get(i)
            if vi is None or vi.kind != "tensor" or vi.shape is None or not _all_ints(tuple(vi.shape)):
                return None  # (ONNX sequences: ONNX's inference types them)
            infos.append(vi)
    if not infos:
        return None
    try:
        shape = fn(node, [tuple(vi.shape) for vi in infos], values)
    except (ValueError, IndexError, KeyError, ZeroDivisionError):
        return None
    if shape is None:
        return None
    ref = infos[1] if node.op_type == "Where" else infos[0]
    dtype = np.dtype(bool) if BROADCASTING.get(node.op_type) == "bool" else ref.dtype
    if node.op_type == "Cast":
        dtype = _cast_dtype(node.attrs.get("to"))
    if dtype is None:
        return None
    return ValueInfo(node.outputs[0], dtype, tuple(shape))
