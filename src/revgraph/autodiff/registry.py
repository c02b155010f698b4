"""The VJP rule table: :func:`vjp` registers a rule (signature in :mod:`.context`), :func:`not_differentiable`
declares operators that carry no gradient, :data:`LOWERED` lists those differentiated through a rewrite.

Rules emit standard ONNX nodes only (through ``ctx.e``), so the backward graph is itself differentiable.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir import Node
from .context import Ctx

Rule = Callable[[Ctx, Node, list], list]

RULES: dict[str, Rule] = {}

#: Operators whose outputs carry no gradient: integer/boolean results, or piecewise-constant functions whose
#: derivative is zero almost everywhere (their VJP sends no gradient to any input).
NOT_DIFFERENTIABLE: dict[str, str] = {}

#: Operators differentiated by rewriting them into other operators before the backward pass (Scan into Loop,
#: ...), with how; docs/op_coverage.md lists them as covered.
LOWERED: dict[str, str] = {}


def vjp(*op_types: str) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the VJP of the default-domain operators ``op_types``; ``ValueError`` if one has
    a rule already."""

    def register(rule: Rule) -> Rule:
        for op in op_types:
            if op in RULES:
                raise ValueError(f"duplicate VJP rule for {op}")
            RULES[op] = rule
        return rule

    return register


def unary(*op_types: str) -> Callable:
    """Register a rule for operators with one differentiable input, written as ``fn(ctx, node, x, y, g) -> dx``
    (``x`` the first input, ``y`` the first output, ``g`` its cotangent); other inputs get no gradient, and
    ``fn`` runs only when ``x`` needs one (not for an integer ``x``)."""

    def register(fn: Callable) -> Callable:
        def rule(ctx: Ctx, node: Node, cts: list) -> list:
            x, y, g = node.inputs[0], node.outputs[0], cts[0]
            return [lambda: fn(ctx, node, x, y, g), *[None] * (len(node.inputs) - 1)]

        rule.__doc__ = fn.__doc__
        rule.__name__ = fn.__name__
        vjp(*op_types)(rule)
        return fn

    return register


def not_differentiable(reason: str, *op_types: str) -> None:
    """Declare ``op_types`` as carrying no gradient, with the reason (shown in docs/op_coverage.md)."""
    for op in op_types:
        NOT_DIFFERENTIABLE[op] = reason


#: Rules of operators of revgraph's private domains, by ``(domain, op_type)``: placeholders that never reach a
#: runtime, such as the collectives of :mod:`revgraph.sync_batchnorm` (registered by that module).
DOMAIN_RULES: dict[tuple[str, str], Rule] = {}


def get_rule(node: Node) -> Rule | None:
    """The rule of ``node``'s operator, or ``None`` (other domains have none but :data:`DOMAIN_RULES`)."""
    if node.domain not in ("", "ai.onnx"):
        return DOMAIN_RULES.get((node.domain, node.op_type))
    return RULES.get(node.op_type)
