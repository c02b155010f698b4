"""VJPs of onnxruntime's fused ``com.microsoft`` activations, ``BiasAdd`` and ``FusedMatMul`` (onnxruntime
docs/ContribOperators.md, ``onnxruntime/core/graph/contrib_ops/contrib_defs.cc`` and ``bert_defs.cc``; the CPU
kernels ``contrib_ops/cpu/activations.h``, ``bert/bias_gelu.cc``, ``bert/fast_gelu.h``, ``math/fused_matmul.cc``).
The forward keeps the fused node, which onnxruntime runs; the VJPs are standard ONNX operators, and where the
math is a default-domain operator's the rule is that operator's (rules/activations.py, rules/linalg.py) applied
to the node's unfused form:

- ``Gelu(X)``: the exact (erf) GELU, ONNX ``Gelu``; ``BiasGelu(A, B) = Gelu(A + B)`` (``B`` 1-D, broadcast).
- ``FastGelu(X, bias?)``: ``y = x (1 + tanh(0.797885 x + 0.035677 x^3)) / 2`` with ``x = X + bias``, the
  constants as the kernel writes them (``sqrt(2 / pi)`` and ``0.044715 sqrt(2 / pi)`` to six digits); with ``t``
  the tanh, ``dy/dx = (1 + t) / 2 + x (1 - t^2) (0.797885 + 3 * 0.035677 x^2) / 2``.
- ``QuickGelu(X)``: ``x sigmoid(alpha x)`` (``alpha`` default 1.702): ONNX ``Swish`` with that ``alpha``.
- ``BiasAdd(X, bias, skip) = X + bias + skip``: the cotangent, summed to each input's shape.
- ``FusedMatMul(A, B)``: ``alpha * op(A) @ op(B)`` with numpy.matmul broadcasting, where ``op`` applies
  ``transBatch`` (axis 0 moved behind the batch axes, to the row axis; both operands of one rank >= 3) and
  then ``trans`` (the last two axes swapped; a vector is never transposed): the ``MatMul`` rule on the
  transposed operands, its cotangents scaled by ``alpha`` and transposed back.

A bias added inside the fused node (``A + B``, ``X + bias``) is recomputed in the backward graph; where an
addend may be inf or NaN the sum is marked so for the strong-zero products (:func:`summed`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ...ir.contrib_types import MS, fused_matmul_perm
from ..algebra import Val, name_of
from ..context import Ctx
from ..registry import RULES, vjp
from ._common import f32_attr, optional_input

#: FastGelu's constants as onnxruntime's kernel writes them (float32 in a float32 kernel)
FAST_GELU_A, FAST_GELU_B = 0.797885, 0.035677


def summed(ctx: Ctx, names: list[str | None]) -> tuple[Ctx, str]:
    """The sum of the present ``names`` (the first one's type: the others broadcast into it), emitted in the
    backward graph, and the context to differentiate through it: its risky values include the sum when an
    addend may be inf or NaN (the fused node's inputs are forward values the analysis saw; the sum is not)."""
    first, *rest = [n for n in names if n]
    s = ctx.val(first)
    for n in rest:
        s = s.apply("Add", n, like=first)
    if rest and ctx.nonfinite(*names):
        ctx = replace(ctx, risky=ctx.risky | {s.name})
    return ctx, s.name


def _unfused(ctx: Ctx, node: Node, cts: list, op_type: str, x: str, attrs: dict | None = None) -> Val | None:
    """The cotangent of the single input of the default-domain ``op_type`` node reading ``x`` and writing
    ``node``'s output, by that operator's rule (``None`` without an output cotangent)."""
    if cts[0] is None:
        return None
    inner = Node(op_type, [x], [node.outputs[0]], dict(attrs or {}), name=node.name)
    return ctx.val(name_of(RULES[op_type](ctx, inner, cts[:1])[0]()))


@vjp("Gelu", domain=MS, bounded=True, finite=True, reads="all")
def gelu(ctx: Ctx, node: Node, cts: list) -> list:
    """``X Phi(X)`` (the erf form): ONNX ``Gelu``'s rule."""
    return [lambda: _unfused(ctx, node, cts, "Gelu", node.inputs[0])]


@vjp("BiasGelu", domain=MS, bounded=True, finite=True, reads="all")
def bias_gelu(ctx: Ctx, node: Node, cts: list) -> list:
    """``Gelu(A + B)`` (erf form); the cotangent of the sum goes to ``A`` and, summed, to the 1-D ``B``."""
    a, b = node.inputs[:2]

    @cache
    def dx() -> Val:
        inner_ctx, x = summed(ctx, [a, b])
        return _unfused(inner_ctx, node, cts, "Gelu", x)

    return [lambda: dx().reduce_to(a), lambda: dx().reduce_to(b)]


@vjp("FastGelu", domain=MS, bounded=True, finite=True, reads="all")
def fast_gelu(ctx: Ctx, node: Node, cts: list) -> list:
    """The tanh GELU of ``X + bias`` with the kernel's constants (module doc)."""
    x, bias = node.inputs[0], optional_input(node, 1)

    @cache
    def dx() -> Val:
        inner_ctx, s = summed(ctx, [x, bias])
        v, g = inner_ctx.val(s), inner_ctx.val(cts[0])
        v2 = v * v
        t = (v * (FAST_GELU_B * v2 + FAST_GELU_A)).tanh()
        d = (1 + t) * 0.5 + v * ((1 - t * t) * (3 * FAST_GELU_B * v2 + FAST_GELU_A)) * 0.5
        return g.times(d, [v])

    return [lambda: dx().reduce_to(x), None if bias is None else lambda: dx().reduce_to(bias)][:len(node.inputs)]


@vjp("QuickGelu", domain=MS, bounded=False, finite=False)
def quick_gelu(ctx: Ctx, node: Node, cts: list) -> list:
    """``X sigmoid(alpha X)``: ONNX ``Swish``'s rule with the node's ``alpha`` (default 1.702)."""
    alpha = f32_attr(node, "alpha", 1.702)
    return [lambda: _unfused(ctx, node, cts, "Swish", node.inputs[0], {"alpha": alpha})]


@vjp("BiasAdd", domain=MS, bounded=True, finite=True, reads=())
def bias_add(ctx: Ctx, node: Node, cts: list) -> list:
    """``X + bias + skip``: the cotangent, summed to each input's shape."""
    g = ctx.val(cts[0])
    return [lambda i=i: g.reduce_to(i) for i in node.inputs]


@vjp("FusedMatMul", domain=MS, bounded=True, finite=True, product=True, mixing=True)
def fused_matmul(ctx: Ctx, node: Node, cts: list) -> list:
    """``alpha * op(A) @ op(B)`` (module doc): ``MatMul``'s VJP on ``op(A)``, ``op(B)``, transposed back."""
    e, (a, b), g = ctx.e, node.inputs[:2], cts[0]
    ra, rb = e.need_rank(a, node), e.need_rank(b, node)
    trans_batch = bool(node.attrs.get("transBatchA", 0)), bool(node.attrs.get("transBatchB", 0))
    if any(trans_batch) and not ra == rb >= 3:
        raise GraphError(f"{node.label()}: transBatchA/transBatchB need operands of one rank >= 3 "
                         f"(onnxruntime's FusedMatMul), got ranks {ra} and {rb}")
    perms = [fused_matmul_perm(ra, bool(node.attrs.get("transA", 0)), trans_batch[0]),
             fused_matmul_perm(rb, bool(node.attrs.get("transB", 0)), trans_batch[1])]
    alpha = f32_attr(node, "alpha", 1.0)

    @cache
    def inner() -> list:
        ops = [x if p is None else e.op("Transpose", [x], perm=p) for x, p in zip((a, b), perms, strict=True)]
        scaled = g if alpha == 1.0 else name_of(ctx.val(g) * alpha)
        return RULES["MatMul"](ctx, Node("MatMul", ops, [node.outputs[0]], name=node.name), [scaled])

    def grad(i: int) -> str:
        d = name_of(inner()[i]())
        p = perms[i]
        return d if p is None else e.op("Transpose", [d], perm=[int(k) for k in np.argsort(p)])

    return [lambda: grad(0), lambda: grad(1)]
