"""Which forward values may be inf or NaN, and which cotangents are finite (DESIGN section 5, strong zeros).

Two uses:

- **Strong products.** A VJP rule that multiplies a cotangent by a forward value (``Exp``'s ``g * y``, ``Mul``'s
  ``g * b``) must give an exact 0 where the cotangent is 0, even where that value is inf or NaN (``Where(x > 30,
  1, Exp(x))`` at x = 1000: the Where VJP sends 0 to the Exp branch, and ``0 * exp(1000)`` is NaN). Rules write
  ``Where(g == 0, 0, g * d)`` for that (:meth:`Emitter.times`), but only where :func:`nonfinite_values` says a
  value they read may be non-finite: ``Where`` costs 7-11x a ``Mul`` on onnxruntime (bench/micro.py).
- **Selections.** A selection VJP (ReLU, Dropout, Clip, Where) sends an exact 0 to the unselected side even
  for an inf or NaN cotangent: ``Where(c, g, 0)``, or ``g * Cast(c)`` where :func:`nonfinite_cotangents` proves
  the cotangent finite (the two agree for finite ``g``).
- **Zero partials** (issue 27). The same products are exactly 0 where the partial derivative ``d`` is 0 and the
  cotangent infinite (``Mul(x, x)`` at 0 under ``Sqrt``): tested only where :func:`nonfinite_cotangents`,
  called without forward risk (``risky`` empty), finds that the cotangent may be infinite at finite forward
  values, i.e. after a VJP outside :data:`BOUNDED` (a singular derivative), a loop or custom operator, or a
  seed that is not a finite constant (``Ctx.singular``).

:func:`nonfinite_values` marks a forward value as possibly non-finite ("risky") when

1. it is computed by an operator that can make inf or NaN out of finite values (anything outside
   :data:`FINITE`: ``Log``, ``Exp``, ``Sqrt``, ``Div`` by a variable, a loop, a custom operator), or from a
   constant holding inf or NaN, or from such a value through any operator (``Softmax`` excepted: an additive
   ``-inf`` mask leaves it finite); or
2. it is a declared input of the graph being differentiated (for a loop body: its carried values), or computed
   from one through operators other than the contractions and normalizations in :data:`MIXING`, where the
   input is not broadcast. Inputs may hold inf or NaN (``-inf`` attention masks, NaN padding). Past a
   contraction such an element is no longer tracked: it makes the contraction's other operand's gradient NaN
   anyway (``x^T g`` with a NaN row of ``x``), in PyTorch and JAX as here; a broadcast operand (a bias or a
   scale repeated over the rows) makes a whole slice of the result, and the loss, non-finite unless all of it
   is discarded. Tracking either would put a ``Where`` on every activation of a network whose weights are
   graph inputs (a training graph): a GELU after a bias costs 10% more per step with it.

Initializers and ``Constant`` outputs are judged by their values; values a loop or branch body reads from the
enclosing graph are taken as finite there (the body is differentiated on its own).

:func:`nonfinite_cotangents`: the cotangent of an input is finite when the node's output cotangents are, its
VJP is in :data:`BOUNDED` (maps finite cotangents to finite ones when the forward values it multiplies by are
finite), none of those values (:func:`_reads`, per input) is risky, and the node is not a ``Cast`` whose VJP
narrows the cotangent (float32 to float16 overflows). A contraction's VJP multiplying by a value that is risky
only through an input does not count (case 2's limit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ..ir import Node, ValueInfo
from ..ir.ssa import captured_names

#: operators that move tensors in and out of ONNX sequences without changing them (their VJPs move cotangents)
SEQUENCE_MOVES = ("SequenceConstruct", "SequenceInsert", "SequenceErase", "SequenceAt", "SplitToSequence",
                  "ConcatFromSequence")

#: VJPs that map a finite cotangent to a finite one when the forward values they read are finite
BOUNDED = frozenset({
    # elementwise arithmetic and activations
    "Identity", "Add", "Sub", "Mul", "Neg", "Abs", "Max", "Min", "Sum", "Mean", "Where", "Clip", "Cast", "CastLike",
    "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus",
    "Softsign", "Mish", "Erf", "Gelu", "Exp", "Sin", "Cos", "Sinh", "Cosh", "Atan", "ThresholdedRelu", "Shrink",
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
    # sequences: elements moved in and out unchanged
    *SEQUENCE_MOVES,
})

#: forward operators whose outputs are finite when their inputs are (``Softmax`` even when some inputs are
#: -inf, as an additive attention mask makes them; ``Exp``, ``Sinh`` and ``Cosh`` overflow and are not here)
FINITE = (BOUNDED - {"Exp", "Sinh", "Cosh", "Softplus"}) | {"Shape", "Size", "Constant", "ConstantOfShape", "Range",
                                                            "OneHot", "NonZero", "ArgMax", "ArgMin", "TopK",
                                                            "SequenceEmpty", "SequenceLength"}
_SANITIZING = frozenset({"Softmax"})

#: contractions and normalizations: a non-finite graph input is not tracked past them (module doc, case 2)
MIXING = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "BatchNormalization",
                    "LayerNormalization", "InstanceNormalization", "GroupNormalization"})

#: VJPs that multiply the cotangent by no forward value (they select, move or sum it; masks come from
#: comparisons, which are false for NaN, and tie counts are at least 1)
_READS_NOTHING = frozenset({
    "Identity", "Add", "Sub", "Neg", "Sum", "Mean", "Where", "Clip", "Max", "Min", "Relu", "LeakyRelu",
    "HardSigmoid", "HardSwish", "ThresholdedRelu", "Shrink", "Cast", "CastLike", "Floor", "Ceil", "Round", "Sign",
    "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Concat", "Split", "Slice", "Pad", "Tile",
    "Gather", "GatherElements", "GatherND", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "CumSum",
    "DepthToSpace", "SpaceToDepth", "GlobalAveragePool", "AveragePool", *SEQUENCE_MOVES,
})
#: two-operand products: the VJP of operand i multiplies by operand 1 - i (a bias, input 2, by nothing)
_PRODUCTS = frozenset({"Mul", "MatMul", "Gemm", "Conv", "ConvTranspose"})


class Risky(set):
    """The forward values that may be inf or NaN; ``from_inputs`` holds those that may be only because a graph
    input may be (case 2 of the module doc)."""

    from_inputs: frozenset = frozenset()


def nonfinite_values(nodes: list[Node], values: Mapping[str, np.ndarray], types: Mapping[str, ValueInfo],
                     inputs: Iterable[str] | None = None) -> Risky:
    """The forward values of ``nodes`` (in order) that may be inf or NaN (module doc). ``values`` holds the
    values known when the graph is built (initializers, ``Constant`` outputs); ``inputs`` the declared inputs of
    the graph, which may hold inf or NaN (default: ``values.inputs`` when the mapping has that attribute, as
    the :class:`Emitter`'s table does, else none)."""
    memo = getattr(values, "memo", None)  # the Emitter's table keeps the last answer (backward and rules ask)
    key = (id(nodes), len(nodes), None if inputs is None else tuple(inputs))
    if memo is not None and memo.get("key") == key:
        return memo["risky"]
    inputs = getattr(values, "inputs", ()) if inputs is None else inputs
    computed = {k for k, v in values.items() if np.asarray(v).dtype.kind == "f" and not np.all(np.isfinite(v))}
    via_input = {i for i in inputs if i not in values and not _is_discrete(types.get(i))}
    static = set(values)  # computed from constants and shapes only: finite unless a constant is not
    for node in nodes:
        outs = [o for o in node.outputs if o]
        ins = [i for i in node.inputs if i]
        subs = node.subgraphs
        if node.op_type in ("Shape", "Size") or all(i in static for i in ins) and not subs:
            static.update(outs)
        if any(_is_discrete(types.get(o)) for o in outs) and not subs:
            continue  # integer and boolean results are finite
        if node.op_type in _SANITIZING and not node.domain:
            continue
        reads = ins + [i for sg in subs.values() for i in captured_names(sg)] if subs else ins
        opaque = bool(subs or node.domain)  # loops, branches and custom operators: not analysed
        unbounded = (node.op_type not in FINITE and not _static_division(node, static)
                     and not all(i in static for i in ins))
        if opaque or unbounded or any(i in computed for i in reads):
            computed.update(outs)
        elif node.op_type not in MIXING:
            via_input.update(o for o in outs if any(i in via_input and not _repeats(node, i, o, types) for i in reads))
    risky = Risky(computed | via_input)
    risky.from_inputs = frozenset(via_input - computed)
    if memo is not None:
        memo.update(key=key, risky=risky)
    return risky


#: operators that move or select elements without repeating them (their output ranks may differ)
_MOVES = frozenset({"Identity", "Cast", "CastLike", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice",
                    "Split", "Concat", "Pad", "Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements",
                    "DepthToSpace", "SpaceToDepth", "Dropout", *SEQUENCE_MOVES})


def _repeats(node: Node, i: str, o: str, types: Mapping[str, ValueInfo]) -> bool:
    """Is input ``i`` broadcast (repeated along an axis) into output ``o``: a bias or a scale added to or
    multiplied with every row? Then a non-finite element of ``i`` reaches a whole slice of ``o``, and the loss
    unless all of it is discarded, and an input's elements are not followed there (module doc, case 2).
    ``False`` when a shape is unknown."""
    if node.op_type in _MOVES:
        return False
    si, so = (getattr(types.get(n), "shape", None) for n in (i, o))
    if si is None or so is None:
        return False
    return len(si) < len(so) or any(a == 1 and b != 1 for a, b in zip(reversed(si), reversed(so)))


def _static_division(node: Node, static: set[str]) -> bool:
    # x / d with d computed from shapes or constants (an attention scale): finite, sizes being positive
    return node.op_type == "Div" and len(node.inputs) == 2 and node.inputs[1] in static


def _is_discrete(vi: ValueInfo | None) -> bool:
    return vi is not None and vi.dtype is not None and vi.dtype.kind in "biu"


def _reads(node: Node, i: int) -> list[str]:
    """The forward values the VJP of input ``i`` multiplies the cotangent by (all of them when not listed)."""
    if node.op_type in _READS_NOTHING:
        return []
    if node.op_type == "Dropout":  # the scale 1 / (1 - ratio)
        return node.inputs[1:2]
    if node.op_type in _PRODUCTS:
        return [node.inputs[1 - i]] if i < 2 else []
    return [v for v in [*node.inputs, *node.outputs] if v]


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
    from_inputs = getattr(risky, "from_inputs", frozenset())
    unsafe = {y for y, seed in ys.items() if not finite_seed(seed)}
    for node in reversed(nodes):
        if (node.op_type not in BOUNDED or node.domain or _narrowing(node, types)
                or any(o in unsafe for o in node.outputs if o)):
            unsafe.update(i for i in node.inputs if i)
            for sg in node.subgraphs.values():
                unsafe.update(captured_names(sg))
            continue
        ignored = from_inputs if node.op_type in MIXING else frozenset()
        for k, name in enumerate(node.inputs):
            if name and any(v in risky and v not in ignored for v in _reads(node, k)):
                unsafe.add(name)
    return unsafe


def _narrowing(node: Node, types: Mapping[str, ValueInfo]) -> bool:
    """A Cast whose VJP casts the cotangent to a smaller float type (or whose types are unknown)."""
    if node.op_type not in ("Cast", "CastLike"):
        return False
    a, b = types.get(node.inputs[0]), types.get(node.outputs[0])
    if a is None or b is None or a.dtype is None or b.dtype is None:
        return True
    return a.dtype.itemsize < b.dtype.itemsize
