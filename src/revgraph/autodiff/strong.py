"""The strong product, a primitive of the rule algebra with its own derivative (DESIGN section 5, issue 39).

``strong(g, d)`` is ``g * d`` where both factors are finite, and exactly 0 where either factor is 0, even where
the other is inf or NaN (0 x inf = 0). Its derivative is the product rule, written with strong products again:

    VJP:  g_bar = strong(s_bar, d),   d_bar = strong(s_bar, g)
    JVP:  s_dot = strong(g_dot, d) + strong(d_dot, g)

so gradients of gradients (Hessians, HVPs, third derivatives) are right at exact zeros too: at ``d == 0`` the
product is 0, but its derivative in ``d`` is ``g``, not 0.

**Lowering.** ONNX has no such operator, so the primitive is written ``Where(test, 0, Mul(g, d))``, where
``test`` is ``Equal(g, 0)``, ``Equal(d, 0)`` or their ``Or`` (:func:`lower`; :meth:`.context.Ctx.times` decides
which tests the operator facts cannot rule out, and emits the plain ``Mul`` where none is needed). That ``Where``
alone is a selection: its own VJP would send ``s_bar`` to the ``Mul`` only where ``test`` is false, dropping
``strong(s_bar, g)`` at ``d == 0`` (``H[0, 0] = 0`` for ``sum(sqrt(x*x + 1))`` at 0, where it is 1) and the whole
second derivative at ``g == 0`` (at a minimum, where the gradient is 0). So the ``Where`` is tagged (its node
name is ``<scope>/StrongZero``, kept in ONNX files) and :func:`is_lowered` recognizes the tagged form; the
``Where`` rule then passes ``s_bar`` to the ``Mul`` unmasked, and the ``Mul`` rule, whose two cotangents are
``Ctx.times`` products, gives the strong products above. Forward mode transposes that VJP, so the JVP follows.
One lowering and one recognizer serve reverse mode, forward mode and the loop rules (bodies are differentiated
by the same pass).

A ``Where`` a user wrote (``Where(p == 0, 0, p * log(p))``, the entropy guard) has no tag and stays a selection:
its unselected branch gets an exact 0, as DESIGN promises, where the primitive's derivative would be ``-inf``.
A tagged ``Where`` whose structure an optimizer changed is a selection again (first order stays right).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..ir import Node
from .emitter import Emitter

#: the node name (last path component) of a lowered strong product's ``Where``
TAG = "StrongZero"
_TAGGED = re.compile(rf"(^|/){TAG}(_\d+)?$")


def lower(e: Emitter, g: str, d: str, tests: Sequence[str], like: str | None = None) -> str:
    """Emit ``strong(g, d)`` as ``Where(test, 0, Mul(g, d))``, testing each value of ``tests`` (``g``, ``d`` or
    both) against 0; the plain ``Mul`` when ``tests`` is empty. ``like``: a value of the result's type.
    Returns the result's name."""
    prod = e.op("Mul", [g, d], like=like)
    if not tests:
        return prod
    zero = e.scalar(0.0, g)
    hits = [e.op("Equal", [v, zero], shape=e.dims(v), dtype=np.dtype(bool)) for v in tests]
    hit = hits[0] if len(hits) == 1 else e.op("Or", hits)
    return e.op("Where", [hit, zero, prod], like=like, tag=TAG)


def is_lowered(node: Node, producers: Mapping[str, Node], value: Callable[[str], np.ndarray | None]) -> bool:
    """Is ``node`` the ``Where`` of a lowered strong product (:func:`lower`)? It must be tagged, and what can be
    seen of it must match: its second input a constant 0, its third a ``Mul(g, d)``, its condition ``Equal(v,
    0)`` for ``v`` among ``g`` and ``d``, or an ``Or`` of such tests. ``producers`` maps a value to the node
    writing it and ``value`` a name to its constant value (``None`` when not known). A value written outside
    the graph being differentiated is not seen (a loop body capturing the zero or the test, a segment of forward
    mode reading an earlier one): the tag is trusted there, as the rule needs nothing of the structure."""
    if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or not _TAGGED.search(node.name or ""):
        return False
    if len(node.inputs) != 3:
        return False
    cond, zero, prod = node.inputs
    z = value(zero)
    if z is not None and not _is_zero(z):
        return False
    mul = producers.get(prod)
    if mul is None:
        return True
    if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx"):
        return False
    tested = _tested(cond, producers, value)
    return tested is None or tested <= set(mul.inputs)


def _tested(cond: str, producers: Mapping[str, Node], value: Callable[[str], np.ndarray | None]) -> set[str] | None:
    """The values ``cond`` compares with 0 (``Equal(v, 0)``, or an ``Or`` of such tests); ``None`` where that
    cannot be seen (written outside); ``{cond}`` (matching nothing) for any other condition."""
    node = producers.get(cond)
    if node is None:
        return None
    if node.domain in ("", "ai.onnx") and node.op_type == "Or":
        parts = [_tested(c, producers, value) for c in node.inputs]
        return None if any(p is None for p in parts) else set().union(*parts)
    if node.domain in ("", "ai.onnx") and node.op_type == "Equal" and len(node.inputs) == 2:
        z = value(node.inputs[1])
        if z is None or _is_zero(z):
            return {node.inputs[0]}
    return {cond}


def _is_zero(v: np.ndarray | None) -> bool:
    return v is not None and np.asarray(v).size > 0 and bool(np.all(np.asarray(v) == 0))
