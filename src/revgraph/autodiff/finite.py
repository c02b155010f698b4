"""Which cotangents are finite: lets selection VJPs (ReLU, Dropout, Clip, Where) multiply by a mask.

The strong-zero convention (DESIGN section 5) asks that a selection VJP such as ReLU's send an exact 0 where
the selection is off, even when the incoming cotangent is inf or NaN there (``sqrt(relu(x))`` at x < 0 must
get 0, not ``inf * 0 = NaN``). ``Where(c, g, 0)`` does that, but onnxruntime's ``Where`` is 7-11x slower than
``g * Cast(c)`` (bench/micro.py), and ReLU and Dropout VJPs sit on every hot path. The two agree whenever
``g`` is finite, so the backward pass proves finiteness where it can, in two steps:

1. :func:`nonfinite_values`: which forward values may be inf or NaN although the graph's inputs and weights
   are finite. ``where(y > 0, x * log(y), 0)`` computes ``log(0) = -inf`` in the branch it discards, and the
   Mul VJP then multiplies a zero cotangent by it (NaN). Operators in :data:`FINITE` keep finite values
   finite; any other operator (``Log``, ``Exp``, ``Sqrt``, ``Div`` by a variable, a loop, ...) may not, unless
   it only computes with constants and shapes; a constant holding inf or NaN is non-finite.
2. :func:`nonfinite_cotangents`: a cotangent is finite when every VJP between it and a seed of ones maps
   finite cotangents to finite ones: the operators in :data:`BOUNDED`, whose local derivatives are their
   forward values (``Exp``'s is its output), applied where none of those values may be non-finite, and not a
   ``Cast`` whose VJP narrows the cotangent (float32 to float16 overflows).

The proof assumes the graph's inputs and weights are finite and that products of finite values do not
overflow; a seed supplied as a graph value is not known to be finite.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..ir import Node, ValueInfo
from ..ssa import captured_names

#: VJPs that map a finite cotangent to a finite one when the forward values they read are finite
BOUNDED = frozenset({
    # elementwise arithmetic and activations
    "Identity", "Add", "Sub", "Mul", "Neg", "Abs", "Max", "Min", "Sum", "Mean", "Where", "Clip", "Cast", "CastLike",
    "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus",
    "Softsign", "Mish", "Erf", "Gelu", "Exp", "Sin", "Cos", "Sinh", "Cosh", "Atan",
    "Floor", "Ceil", "Round", "Sign",
    # linear algebra, convolution, pooling, normalisation (eps > 0), losses
    "MatMul", "Gemm", "Einsum", "Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool",
    "GlobalMaxPool", "BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
    "Softmax", "LogSoftmax", "Dropout", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
    # reductions and data movement
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceLogSumExp", "ReduceSumSquare", "ReduceL1",
    "CumSum", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Concat", "Split", "Slice",
    "Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements", "Pad", "Tile", "Resize",
    "DepthToSpace", "SpaceToDepth",
})

#: forward operators whose outputs are finite when their inputs are (``Softmax`` even when some inputs are
#: -inf, as an additive attention mask makes them; ``Exp``, ``Sinh`` and ``Cosh`` overflow and are not here)
FINITE = (BOUNDED - {"Exp", "Sinh", "Cosh", "Softplus"}) | {"Shape", "Size", "Constant", "ConstantOfShape", "Range",
                                                            "OneHot", "NonZero", "ArgMax", "ArgMin", "TopK"}
_SANITIZING = frozenset({"Softmax"})


def nonfinite_values(nodes: list[Node], values: Mapping[str, np.ndarray], types: Mapping[str, ValueInfo]) -> set[str]:
    """The forward values of ``nodes`` (in order) that may be inf or NaN for finite graph inputs and weights."""
    risky = {k for k, v in values.items() if np.asarray(v).dtype.kind == "f" and not np.all(np.isfinite(v))}
    static = set(values)  # computed from constants and shapes only: finite unless a constant is not
    for node in nodes:
        outs = [o for o in node.outputs if o]
        ins = [i for i in node.inputs if i]
        if node.op_type in ("Shape", "Size") or all(i in static for i in ins) and not node.subgraphs:
            static.update(outs)
        if any(_is_discrete(types.get(o)) for o in outs) and not node.subgraphs:
            continue  # integer and boolean results are finite
        if node.op_type in _SANITIZING and not node.domain:
            continue
        inherits = any(i in risky for i in ins) or any(
            i in risky for sg in node.subgraphs.values() for i in captured_names(sg))
        opaque = bool(node.subgraphs or node.domain)  # loops, branches and custom operators: not analysed
        unbounded = (node.op_type not in FINITE and not _static_division(node, static)
                     and not all(i in static for i in ins))
        if inherits or opaque or unbounded:
            risky.update(outs)
    return risky


def _static_division(node: Node, static: set[str]) -> bool:
    # x / d with d computed from shapes or constants (an attention scale): finite, sizes being positive
    return node.op_type == "Div" and len(node.inputs) == 2 and node.inputs[1] in static


def _is_discrete(vi: ValueInfo | None) -> bool:
    return vi is not None and vi.dtype is not None and vi.dtype.kind in "biu"


def nonfinite_cotangents(nodes: list[Node], ys: Mapping[str, str | None], values: Mapping[str, np.ndarray],
                         risky: set[str] = frozenset(), types: Mapping[str, ValueInfo] | None = None) -> set[str]:
    """The values among ``nodes``' inputs and outputs whose cotangent may be inf or NaN. ``nodes`` are in
    forward order; ``ys`` maps each differentiated value to its seed (``None`` for ones); a seed whose value
    is known when the graph is built (``values``: initializers, ``Constant`` outputs) counts as finite when
    all its elements are. ``risky`` are the forward values that may be non-finite (:func:`nonfinite_values`),
    ``types`` the value types (to find narrowing casts)."""

    def finite_seed(seed: str | None) -> bool:
        return seed is None or (seed in values and bool(np.all(np.isfinite(values[seed]))))

    types = types or {}
    unsafe = {y for y, seed in ys.items() if not finite_seed(seed)}
    for node in reversed(nodes):
        bounded = (node.op_type in BOUNDED and not node.domain and not _narrowing(node, types)
                   and not any(v in risky for v in [*node.inputs, *node.outputs] if v))
        if bounded and not any(o in unsafe for o in node.outputs if o):
            continue
        unsafe.update(i for i in node.inputs if i)
        for sg in node.subgraphs.values():
            unsafe.update(captured_names(sg))
    return unsafe


def _narrowing(node: Node, types: Mapping[str, ValueInfo]) -> bool:
    """A Cast whose VJP casts the cotangent to a smaller float type (or whose types are unknown)."""
    if node.op_type not in ("Cast", "CastLike"):
        return False
    a, b = types.get(node.inputs[0]), types.get(node.outputs[0])
    if a is None or b is None or a.dtype is None or b.dtype is None:
        return True
    return a.dtype.itemsize < b.dtype.itemsize
