"""Lift the coefficients of ``ai.onnx.ml`` linear models into trainable initializers.

``LinearClassifier`` and ``LinearRegressor`` (skl2onnx's linear models) hold their weights as attributes, which
no gradient can reach. :func:`lift_ml_coefficients` rewrites each into standard ONNX operators computing the
same outputs from two initializers, ``<node>.coefficients`` ``[T, F]`` and ``<node>.intercepts`` ``[T]``
(float32), which revgraph then differentiates and trains like any weight; ``Normalizer`` has no weights and
stays. The rewrite follows onnxruntime's CPU kernels (the math: :mod:`revgraph.autodiff.rules.ml_linear`):

- ``s = Gemm(Reshape(Cast(X, float), [-1, F]), W, b, transB=1)``; scores: ``s``, ``Sigmoid(s)``,
  ``Softmax(s, axis=1)``, or SOFTMAX_ZERO's masked softmax by ``post_transform`` (``T > 1``); a one-target
  classifier with two class labels writes ``Concat(1 - p, p)``; ``PROBIT`` is refused, as by the rule.
- The label: ``Gather(classlabels, ArgMax(s, axis=1))`` (the first maximum, as the kernel), or for one target
  ``Gather(classlabels, s > 0)``; ints or strings.

It is part of :func:`revgraph.autodiff.lift.lift_constants` (``--lift-constants``). :func:`lower_ml_operators` writes
the same form with the coefficients as ``Constant`` values, and ``Normalizer`` too, for ``revgraph check``:
onnxruntime's ML kernels compute in float32 only, the standard operators have float64 kernels.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..errors import GraphError
from ..ir import Graph, Node
from .rules.ml_linear import ML, NORMS, ZERO, linear_weights, post_transform, text_attr, two_classes

LINEAR = ("LinearClassifier", "LinearRegressor")


def _labels(node: Node, targets: int) -> np.ndarray:
    ints, strings = node.attrs.get("classlabels_ints"), node.attrs.get("classlabels_strings")
    if strings is not None and len(strings):
        return np.array([s.decode() if isinstance(s, bytes) else str(s) for s in strings], dtype=object)
    if ints is not None and len(ints):
        return np.asarray(ints, np.int64)
    return np.arange(max(targets, 2), dtype=np.int64)  # (the kernel's 0 and 1 for one target)


def _emitters(nodes: list[Node], base: str):
    """``(op, const)``: append a default-domain node named ``<base>/<tag>`` to ``nodes`` (its output that name, or
    ``out``) and return its output; ``const`` a ``Constant`` of ``value``."""
    def op(op_type: str, inputs: list[str], tag: str, out: str | None = None, **attrs) -> str:
        name = out or f"{base}/{tag}"
        nodes.append(Node(op_type, inputs, [name], attrs, f"{base}/{tag}"))
        return name

    def const(value, tag: str) -> str:
        return op("Constant", [], tag, value=np.asarray(value))
    return op, const


def _rewrite(node: Node, base: str, w: np.ndarray, b: np.ndarray | None, opset: int, weights: list[str]) -> list[Node]:
    """Standard nodes writing ``node``'s outputs from the values named ``weights`` (W, and b when ``b`` is
    given) (module doc), for the default domain's ``opset``."""
    transform = post_transform(node)
    t, f = w.shape
    nodes: list[Node] = []
    op, const = _emitters(nodes, base)

    classifier = node.op_type == "LinearClassifier"
    z_out = node.outputs[1] if classifier and len(node.outputs) > 1 else node.outputs[0] if not classifier else ""
    xf = op("Cast", [node.inputs[0]], "cast", to=onnx.TensorProto.FLOAT)
    x2 = op("Reshape", [xf, const(np.array([-1, f], np.int64), "rows_shape")], "rows")
    gemm_in = [x2, *weights]
    s = op("Gemm", gemm_in, "scores", transB=1)
    if z_out:
        if two_classes(node, t):
            p = op("Sigmoid", [s], "p") if transform == "LOGISTIC" else s
            q = op("Sub", [const(np.float32(1), "one"), p], "q")
            op("Concat", [q, p], "two", z_out, axis=1)
        elif t == 1 or transform == "NONE":
            op("Identity", [s], "identity", z_out)
        elif transform == "LOGISTIC":
            op("Sigmoid", [s], "logistic", z_out)
        elif transform == "SOFTMAX":
            op("Softmax", [s], "softmax", z_out, axis=1)
        else:  # SOFTMAX_ZERO: exp(s - m) where |s| > 1e-7, else s exp(-m); over the sum of the former
            axes = const(np.array([1], np.int64), "axes")
            kept = op("Greater", [op("Abs", [s], "abs"), const(np.float32(ZERO), "zero_below")], "kept")
            # (ReduceMax takes its axes as an input from opset 18, ReduceSum from 13)
            m = op("ReduceMax", [s, axes], "max", keepdims=1) if opset >= 18 else \
                op("ReduceMax", [s], "max", keepdims=1, axes=[1])
            e = op("Exp", [op("Sub", [s, m], "shifted")], "exp")
            small = op("Mul", [s, op("Exp", [op("Neg", [m], "neg_max")], "exp_neg_max")], "small")
            num = op("Where", [kept, e, small], "numerator")
            zero = const(np.float32(0), "zero")
            total = op("ReduceSum", [op("Where", [kept, e, zero], "kept_exp"), axes], "total", keepdims=1)
            op("Div", [num, total], "softmax_zero", z_out)
    if classifier and node.outputs[0]:
        labels = const(_labels(node, t), "labels")
        if t == 1:
            idx = op("Cast", [op("Greater", [s, const(np.float32(0), "zero_score")], "positive")], "positive_index",
                     to=onnx.TensorProto.INT64)
            idx = op("Reshape", [idx, const(np.array([-1], np.int64), "flat")], "index")
        else:
            idx = op("ArgMax", [s], "index", axis=1, keepdims=0, select_last_index=0)
        op("Gather", [labels, idx], "label", node.outputs[0], axis=0)
    return nodes


def _opset(g: Graph) -> int:
    return int(g.opsets.get("", g.opsets.get("ai.onnx", 17)))


def _normalizer(node: Node, base: str, opset: int) -> list[Node]:
    """``Normalizer`` in standard operators: ``Where(z != 0, x / z, x)`` with ``z`` the row's max, L1 or L2 norm
    (onnxruntime's normalizer.cc; the rule's math, :mod:`revgraph.autodiff.rules.ml_linear`)."""
    norm = text_attr(node, "norm", "MAX")
    if norm not in NORMS:
        raise GraphError(f"{node.label()}: norm {norm!r} is not supported (supported: {', '.join(NORMS)})")
    nodes: list[Node] = []
    op, const = _emitters(nodes, base)

    x = op("Cast", [node.inputs[0]], "cast", to=onnx.TensorProto.FLOAT)
    axes = const(np.array([-1], np.int64), "axes")
    if norm == "MAX":
        z = op("ReduceMax", [x, axes], "max", keepdims=1) if opset >= 18 else \
            op("ReduceMax", [x], "max", keepdims=1, axes=[-1])
    elif norm == "L1":
        z = op("ReduceSum", [op("Abs", [x], "abs"), axes], "l1", keepdims=1)
    else:
        z = op("Sqrt", [op("ReduceSum", [op("Mul", [x, x], "square"), axes], "sum_squares", keepdims=1)], "l2")
    zero = op("Equal", [z, const(np.float32(0), "zero")], "is_zero")
    safe = op("Where", [zero, const(np.float32(1), "one"), z], "safe")
    op("Where", [zero, x, op("Div", [x, safe], "divided")], "normalized", node.outputs[0])
    return nodes


def lower_ml_operators(graph: Graph) -> Graph:
    """A copy of ``graph`` whose top-level ``ai.onnx.ml`` ``LinearClassifier``, ``LinearRegressor`` and
    ``Normalizer`` nodes are standard operators, the coefficients ``Constant`` values: the same function in
    operators that have float64 kernels (onnxruntime's ML kernels compute in float32 only), for
    :func:`revgraph.tools.check.check_gradients`. Raises :class:`GraphError` as :func:`lift_ml_coefficients`."""
    g = graph.copy()
    nodes = []
    for node in g.nodes:
        base = node.name or node.outputs[-1]
        if node.domain == ML and node.op_type in LINEAR:
            w, b = linear_weights(node)
            weights = [f"{base}/coefficients"] + ([f"{base}/intercepts"] if b is not None else [])
            nodes += [Node("Constant", [], [n], {"value": a}, n) for n, a in zip(weights, (w, b), strict=False)]
            nodes += _rewrite(node, base, w, b, _opset(g), weights)
        elif node.domain == ML and node.op_type == "Normalizer":
            nodes += _normalizer(node, base, _opset(g))
        else:
            nodes.append(node)
    g.nodes = nodes
    return g


def lift_ml_coefficients(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of ``graph`` whose top-level ``ai.onnx.ml`` ``LinearClassifier``/``LinearRegressor`` nodes are
    standard operators reading initializers ``<node>.coefficients`` ``[T, F]`` and ``<node>.intercepts``
    ``[T]`` (float32; ``<node>`` its name, else its last output's), and the initializers' names in node order.
    Raises :class:`~revgraph.errors.GraphError` (one line, naming the node) for a ``post_transform`` the rewrite
    does not support or coefficients that do not split into the targets."""
    g = graph.copy()
    nodes, lifted = [], []
    taken = {n for _, node in g.walk() for n in [*node.inputs, *node.outputs]} | set(g.initializers)
    for node in g.nodes:
        if node.domain != ML or node.op_type not in LINEAR:
            nodes.append(node)
            continue
        w, b = linear_weights(node)
        base = node.name or node.outputs[-1]
        while f"{base}.coefficients" in taken or f"{base}.intercepts" in taken:
            base += "_"
        names = [f"{base}.coefficients", f"{base}.intercepts"][:1 + (b is not None)]
        nodes += _rewrite(node, base, w, b, _opset(g), names)
        g.initializers[f"{base}.coefficients"] = w
        lifted.append(f"{base}.coefficients")
        if b is not None:
            g.initializers[f"{base}.intercepts"] = b
            lifted.append(f"{base}.intercepts")
    g.nodes = nodes
    return g, lifted
