"""Which cotangents are finite: lets selection VJPs (ReLU, Dropout, Clip, Where) multiply by a mask.

The strong-zero convention (DESIGN section 5) asks that a selection VJP such as ReLU's send an exact 0 where
the selection is off, even when the incoming cotangent is inf or NaN there (``sqrt(relu(x))`` at x < 0 must
get 0, not ``inf * 0 = NaN``). ``Where(c, g, 0)`` does that, but onnxruntime's ``Where`` is 5-9x slower than
``g * Cast(c)`` (bench/micro.py), and ReLU and Dropout VJPs sit on every hot path. The two agree whenever
``g`` is finite, so the backward pass proves finiteness where it can: a cotangent is finite when the forward
values are finite and every VJP between it and the seeds maps finite cotangents to finite ones (the ops in
:data:`BOUNDED`, whose local derivatives are bounded by forward values: ``Exp``'s derivative is its output;
``Sqrt``, ``Log``, ``Div``, ``Pow`` are left out because their derivatives are infinite at finite points).
Seeds of ones are finite; a seed supplied as a graph value is not known to be.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..ir import Node
from ..ssa import captured_names

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


def nonfinite_cotangents(nodes: list[Node], ys: Mapping[str, str | None], values: Mapping[str, np.ndarray]) -> set[str]:
    """The values among ``nodes``' inputs and outputs whose cotangent may be inf or NaN for finite forward
    values. ``nodes`` are in forward order; ``ys`` maps each differentiated value to its seed (``None`` for
    ones); a seed whose value is known when the graph is built (``values``: initializers, ``Constant``
    outputs) counts as finite when all its elements are."""

    def finite_seed(seed: str | None) -> bool:
        return seed is None or (seed in values and bool(np.all(np.isfinite(values[seed]))))

    unsafe = {y for y, seed in ys.items() if not finite_seed(seed)}
    for node in reversed(nodes):
        if node.op_type in BOUNDED and not node.domain and not any(o in unsafe for o in node.outputs if o):
            continue
        unsafe.update(i for i in node.inputs if i)
        for sg in node.subgraphs.values():
            unsafe.update(captured_names(sg))
    return unsafe
