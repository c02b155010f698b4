"""Signs of forward values, so that Sqrt, Reciprocal, Div, Log and Pow count as finite and bounded where their
operands keep them away from their singular points (issue 39, "fewer guards"; DESIGN section 5).

Registered facts (:mod:`.registry`) are per operator: ``Sqrt`` is not ``finite`` nor ``bounded``, because
``1 / (2 sqrt(x))`` is inf at ``x = 0``. A normalization as exporters write it, ``x * Reciprocal(Sqrt(
ReduceMean(Pow(x, 2)) + eps))``, never reaches 0: the sum of a value ``>= 0`` and a constant ``eps > 0`` is at
least ``eps``. Taking its ``Sqrt`` and ``Reciprocal`` as singular put a zero-partial test (``d == 0``) on every
product after them in backward order and a zero-cotangent test (``g == 0``) on every product reading a value
computed from them: a third of a LLaMA step's backward nodes. This module proves, node by node, in one forward
pass:

- *positive*: every element is at least some constant ``c > 0`` (bounded away from 0, as ``eps`` is);
- *nonneg*: every element is ``>= 0`` (or NaN, which the finiteness analysis of :mod:`.finite` follows apart).

Each rule is a small function of the node and its operands' signs (:data:`_SIGN_RULES`); constants are judged
by their values. From the signs, :func:`refined_nodes` gives the nodes whose registration claims too little:

- ``Sqrt(x)``, ``Log(x)``, ``Reciprocal(x)`` with ``x`` positive, ``Div(a, b)`` with ``b`` positive: the outputs
  are finite for finite inputs and the derivatives (``0.5 / y``, ``1 / x``, ``-y^2``, ``1 / b``, ``-y / b``)
  finite: ``finite`` and ``bounded``;
- ``Pow(x, p)`` with ``p`` a constant: ``x^p`` and ``p x^(p-1)`` are finite for finite ``x`` when every ``p`` is a
  non-negative integer (``p x^(p-1)`` needs ``p >= 1`` or ``p == 0``, which the rule takes as 0), for ``x``
  nonneg when ``p >= 1``, and for ``x`` positive whatever ``p``; no gradient flows to a constant exponent, so
  its ``x^p log x`` never enters.

:func:`.finite.nonfinite_values` and :func:`.finite.nonfinite_cotangents` treat a refined node as ``finite`` and
``bounded``, and its rule's strong products test ``g == 0`` only where a value they read may be non-finite
(:meth:`.context.Ctx.times`). Like the rest of :mod:`.finite`, the proof assumes finite products do not
overflow (``Pow(x, 2)`` of ``1e200`` is inf, as ``Mul(x, x)`` is).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..ir import Node

POSITIVE, NONNEG = 2, 1  # the sign lattice: positive implies nonneg; 0 claims nothing

#: operators that only move, repeat or select elements of their first input, or take a mean or an extremum of
#: them: its sign passes through
_MOVES = frozenset({"Identity", "Reshape", "Expand", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice",
                    "Gather", "GatherElements", "GatherND", "Tile", "ReduceMax", "ReduceMin", "ReduceMean",
                    "MaxPool", "GlobalAveragePool", "GlobalMaxPool"})
#: operators whose results are >= 0 whatever their inputs (NaN aside)
_NONNEG = frozenset({"Abs", "Relu", "Exp", "Sigmoid", "Softmax", "ReduceSumSquare", "ReduceL1", "ReduceL2",
                     "Softplus", "HardSigmoid"})


def _constant_sign(v: np.ndarray) -> int:
    a = np.asarray(v)
    if a.dtype.kind not in "fiu" or a.size == 0 or not np.all(np.isfinite(a)):
        return 0
    return POSITIVE if np.all(a > 0) else NONNEG if np.all(a >= 0) else 0


def _even_integer(v: np.ndarray | None) -> bool:
    return v is not None and np.asarray(v).size > 0 and bool(np.all(np.mod(np.asarray(v), 2) == 0))


def _add(node: Node, s: list[int], value) -> int:
    if all(s) and max(s) == POSITIVE:  # positive plus nonneg: at least the positive one's bound
        return POSITIVE
    return NONNEG if all(s) else 0


def _mul(node: Node, s: list[int], value) -> int:
    # never positive: a product of two small positive values may underflow to 0
    if (len(node.inputs) == 2 and node.inputs[0] == node.inputs[1]) or all(s):  # x * x, or nonneg factors
        return NONNEG
    return 0


def _pow(node: Node, s: list[int], value) -> int:
    p = value(node.inputs[1]) if len(node.inputs) > 1 else None
    if p is None or np.asarray(p).size == 0 or not np.all(np.isfinite(p)):
        return 0
    # never positive: c^p may underflow to 0
    if s[0] == POSITIVE or _even_integer(p) or (s[0] == NONNEG and np.all(np.asarray(p) >= 0)):
        return NONNEG
    return 0


def _sqrt(node: Node, s: list[int], value) -> int:
    return s[0]  # sqrt of a value >= c > 0 is >= sqrt(c) > 0; of a value >= 0, >= 0


def _div(node: Node, s: list[int], value) -> int:
    return NONNEG if s[0] and s[1] == POSITIVE else 0


def _reciprocal(node: Node, s: list[int], value) -> int:
    return NONNEG if s[0] == POSITIVE else 0


def _max(node: Node, s: list[int], value) -> int:
    return max(s)  # at least each operand


def _moves(node: Node, s: list[int], value) -> int:
    return s[0]


def _cast(node: Node, s: list[int], value) -> int:
    return min(s[0], NONNEG)  # a narrower type may round a small positive value to 0


def _reduce_sum(node: Node, s: list[int], value) -> int:
    return NONNEG if s[0] else 0  # an empty sum is 0: never positive


_SIGN_RULES: dict[str, Callable[[Node, list[int], Callable], int]] = {
    "Add": _add, "Sum": _add, "Mul": _mul, "Pow": _pow, "Sqrt": _sqrt, "Div": _div, "Reciprocal": _reciprocal,
    "Max": _max, "ReduceSum": _reduce_sum, "Cast": _cast, "CastLike": _cast, **dict.fromkeys(_MOVES, _moves),
}


def signs(nodes: list[Node], values: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The sign (:data:`POSITIVE`, :data:`NONNEG`) of each value of ``nodes`` (in forward order) that has one;
    ``values`` holds the constants (initializers, ``Constant`` outputs). Default-domain nodes without
    subgraphs only; every other value claims nothing."""
    out: dict[str, int] = {k: s for k, v in values.items() if (s := _constant_sign(v))}

    def sign(name: str) -> int:
        return out.get(name, 0) if name else 0

    for node in nodes:
        if node.domain or node.subgraphs or not node.outputs or not node.outputs[0]:
            continue
        rule = _SIGN_RULES.get(node.op_type)
        s = 0
        if node.op_type in _NONNEG:
            s = NONNEG
        elif rule is not None and node.inputs:
            s = rule(node, [sign(i) for i in node.inputs], values.get)
        if s:
            out[node.outputs[0]] = s
    return out


def refined_nodes(nodes: list[Node], values: Mapping[str, np.ndarray]) -> frozenset[int]:
    """The ids of the nodes among ``nodes`` whose outputs are finite for finite inputs and whose VJP is bounded
    although their operator's registration does not say so (module doc): ``Sqrt``, ``Log``, ``Reciprocal``
    and ``Div`` by a positive value, ``Pow`` with a constant exponent that keeps it polynomial or a positive
    base."""
    if not any(n.op_type in _REFINABLE for n in nodes):
        return frozenset()
    sg = signs(nodes, values)
    found = set()
    for node in nodes:
        if node.domain or node.op_type not in _REFINABLE:
            continue
        if _REFINABLE[node.op_type](node, [sg.get(i, 0) if i else 0 for i in node.inputs], values.get):
            found.add(id(node))
    return frozenset(found)


def _positive_operand(k: int) -> Callable[[Node, list[int], Callable], bool]:
    return lambda node, s, value: len(s) > k and s[k] == POSITIVE


def _pow_refined(node: Node, s: list[int], value) -> bool:
    p = value(node.inputs[1]) if len(node.inputs) > 1 else None
    if p is None:
        return False  # a variable exponent gets a gradient: x^p log x is singular at 0
    p = np.asarray(p, dtype=np.float64)
    if p.size == 0 or not np.all(np.isfinite(p)):
        return False
    if s[0] == POSITIVE:
        return True
    whole = bool(np.all(p == np.round(p)) and np.all(p >= 0))
    return bool(whole or (s[0] == NONNEG and np.all(p >= 1)))


_REFINABLE: dict[str, Callable[[Node, list[int], Callable], bool]] = {
    "Sqrt": _positive_operand(0), "Log": _positive_operand(0), "Reciprocal": _positive_operand(0),
    "Div": _positive_operand(1), "Pow": _pow_refined,
}
