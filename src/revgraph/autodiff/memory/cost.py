"""The cost model of recomputation: which forward nodes may be recomputed in the backward, and what it costs.

Recomputing a node costs its arithmetic (FLOPs, counted as multiply-adds x 2 for the contractions): the
matrix products (``MatMul``, ``Gemm``, ``Conv``, ``ConvTranspose``, ``Attention``, ``Einsum``) from their
operand shapes, every other operator a few operations per element it writes (:data:`PER_ELEMENT`: 1 for
arithmetic, more for transcendental functions and normalizations, 1 per element read for reductions). The
**free** operators (:data:`FREE`) only move or relabel data (``Reshape``, ``Transpose``, ``Squeeze``, ...):
they cost no FLOPs, one pass over memory at most, so the planner recomputes them whenever that saves bytes,
even without a budget (issue 24's "free shape ops"; onnxruntime runs ``Reshape``, ``Squeeze``, ``Unsqueeze``,
``Flatten`` and ``Identity`` without a copy).

A node may be recomputed when it is deterministic and self-contained: no random operator (recomputing would
draw anew: their draws and masks are kept), no subgraph (a ``Loop``/``Scan``/``If`` keeps its outputs; loops
have their own checkpoint policies), default domain, tensors only (no sequences), and every output's size
known. FLOP counts use the same sizes as the planner's bytes (symbolic dimensions from the budget's ``dims``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ...ir import Node, ValueInfo
from ..simplify import RANDOM
from .residuals import value_bytes

#: operators that move or relabel data and compute nothing (constant-index Gather/Slice included: their
#: indices are inputs that are themselves recomputed or kept)
FREE = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Identity", "Cast",
                  "Gather", "Slice", "Shape", "Size", "Constant", "ConstantOfShape", "Concat", "Split",
                  "CastLike", "Dropout", "Tile", "Pad"})

#: elementwise operators (numpy broadcasting, one output): **cheap** to recompute when no input is larger than
#: the output (one pass over it). The default plan recomputes them where the values they read are kept anyway
#: (a value and its elementwise image are never both kept: Sigmoid(x) beside x, x * r beside x).
ELEMENTWISE = frozenset({
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Celu", "Clip", "Cos", "Cosh",
    "Div", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish",
    "IsInf", "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log", "Max", "Mean", "Min", "Mish", "Mul", "Neg", "Not",
    "Or", "Pow", "PRelu", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus",
    "Softsign", "Sqrt", "Sub", "Sum", "Swish", "Tan", "Tanh", "ThresholdedRelu", "Where", "Xor"})

#: free operators that onnxruntime runs without copying (the output aliases the input): the others of
#: :data:`FREE` copy their input (one pass over memory), so the default plan costs them like cheap nodes
ALIASING = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})

#: operations per output element of operators that are neither free nor contractions (default 1)
PER_ELEMENT = {
    "Exp": 4, "Log": 4, "Tanh": 6, "Sigmoid": 5, "Erf": 8, "Gelu": 10, "Sqrt": 2, "Pow": 8, "Sin": 6, "Cos": 6,
    "Softmax": 6, "LogSoftmax": 7, "Softplus": 6, "Elu": 4, "Selu": 4, "Celu": 4, "Mish": 10, "HardSwish": 3,
    "Swish": 6, "LayerNormalization": 8, "RMSNormalization": 6, "GroupNormalization": 8,
    "InstanceNormalization": 8, "BatchNormalization": 4, "LRN": 10, "Div": 2, "Reciprocal": 2,
}

#: operators that read one input element per FLOP (their outputs are smaller than their inputs)
REDUCING = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                      "ReduceLogSumExp", "ReduceSumSquare", "ReduceLogSum", "ArgMax", "ArgMin", "GlobalAveragePool",
                      "GlobalMaxPool", "AveragePool", "MaxPool", "LpPool", "GlobalLpPool", "TopK", "CumSum"})


def _numel(vi: ValueInfo | None, dims: Mapping[str, int]) -> int | None:
    b = value_bytes(vi, dims)
    return None if b is None else b // max(1, np.dtype(vi.dtype).itemsize)


def _shape(vi: ValueInfo | None, dims: Mapping[str, int]) -> tuple[int, ...] | None:
    if vi is None or vi.shape is None:
        return None
    out = []
    for d in vi.shape:
        d = dims.get(d) if isinstance(d, str) else d
        if not isinstance(d, (int, np.integer)):
            return None
        out.append(int(d))
    return tuple(out)


def recomputable(node: Node, constant=lambda name: None) -> bool:
    """May ``node`` be recomputed inside the backward graph (deterministic, no subgraph, default domain)?
    ``Dropout`` is only when it cannot draw: its ``training_mode`` absent or a constant false (inference), or
    its ``ratio`` a constant 0 (the output is the input). ``constant(name)``: a value's constant, or ``None``."""
    if node.domain not in ("", "ai.onnx") or (node.attrs and node.subgraphs):
        return False
    if node.op_type == "Dropout":
        ins = [*node.inputs, "", ""]
        mode, ratio = constant(ins[2]) if ins[2] else False, constant(ins[1]) if ins[1] else 0.5
        return (mode is not None and not bool(np.all(mode))) or (ratio is not None and bool(np.all(ratio == 0)))
    return not (node.op_type in RANDOM or node.op_type.startswith("Sequence") or node.op_type in (
        "SplitToSequence", "ConcatFromSequence", "Optional", "OptionalGetElement", "OptionalHasElement"))


def is_identity(node: Node) -> bool:
    """Does ``node``'s only output equal its first input (``Identity``; ``Dropout`` writing no mask, which
    :func:`recomputable` lets through only where it draws nothing)? Its recomputation is no node at all: the
    backward reads the input instead."""
    return node.op_type in ("Identity", "Dropout") and node.domain in ("", "ai.onnx") and bool(node.inputs) and \
        [o for o in node.outputs if o] == node.outputs[:1]


def cheap(node: Node, types: Mapping[str, ValueInfo], dims: Mapping[str, int]) -> bool:
    """Is ``node`` elementwise (:data:`ELEMENTWISE`) with no input larger than its output (known sizes)?"""
    if node.op_type not in ELEMENTWISE or len(node.outputs) != 1:
        return False
    out = _numel(types.get(node.outputs[0]), dims)
    ins = [_numel(types.get(i), dims) for i in node.inputs if i]
    return out is not None and all(n is not None and n <= out for n in ins)


def flops(node: Node, types: Mapping[str, ValueInfo], dims: Mapping[str, int]) -> int | None:
    """Estimated FLOPs of running ``node`` once (``None`` when a size it depends on is unknown)."""
    op = node.op_type
    outs = [_numel(types.get(o), dims) for o in node.outputs if o]
    if any(n is None for n in outs):
        return None
    out = sum(outs)
    if op in FREE:
        return 0
    ins = [_shape(types.get(i), dims) if i else None for i in node.inputs]
    if op in ("MatMul", "MatMulInteger", "Gemm", "FusedMatMul"):
        a = ins[0] if ins else None
        if a is None or not a:
            return None
        k = a[0] if op == "Gemm" and node.attrs.get("transA", 0) else a[-1]
        return 2 * out * k
    if op in ("Conv", "ConvTranspose", "ConvInteger", "DeformConv"):
        w = ins[1] if len(ins) > 1 else None
        if w is None or len(w) < 2:
            return None
        per_out = int(np.prod(w[1:])) if op != "ConvTranspose" else int(np.prod(w[2:])) * w[0]
        return 2 * out * per_out
    if op == "Attention":
        q, k = [*ins, None, None][:2]
        if q is None or k is None:
            return None
        return 4 * out * (k[-2] if len(k) == 4 else k[1])  # softmax(QK^T)V: two contractions over the keys
    if op == "Einsum":
        return 2 * max(out, max((int(np.prod(s)) for s in ins if s), default=out))
    if op in REDUCING:
        first = ins[0] if ins else None
        return int(np.prod(first)) if first is not None else None
    return out * PER_ELEMENT.get(op, 1)
