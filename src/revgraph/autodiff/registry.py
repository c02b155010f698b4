"""The VJP rule table: :func:`vjp` registers a rule (signature in :mod:`.context`), :func:`not_differentiable`
declares operators that carry no gradient, :data:`LOWERED` lists those differentiated through a rewrite.

Every registration also states the operator's **facts** (:class:`Facts`, kept in :data:`FACTS`): what
:mod:`.finite` needs to know to decide where a VJP must keep strong zeros with a ``Where`` and where a plain
product is exact (DESIGN section 5). They are keywords of the registration, next to the rule::

    @unary("HardSwish", bounded=True, finite=True, reads=())
    @vjp("MatMul", bounded=True, finite=True, product=True, mixing=True)
    not_differentiable("integer result", "ArgMax", "ArgMin", bounded=False, finite=True)

``bounded`` and ``finite`` must be given on every registration, and a bounded rule must say what its VJP
multiplies by (``reads`` or ``product``); :data:`REQUIRED` lists them, :meth:`Facts.undeclared` names the
missing ones and ``tests/test_operator_facts.py`` fails on any. The other keywords default to the answer that
claims nothing (no refinement).

Rules emit standard ONNX nodes only (through ``ctx.e``), so the backward graph is itself differentiable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import onnx

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

#: ``reads`` of a VJP that multiplies the cotangent by any of the node's inputs and outputs
ALL = "all"


@dataclass(frozen=True)
class Facts:
    """What :mod:`.finite` knows of a default-domain operator (``None``: not stated, taken as ``False``).

    - ``bounded``: the VJP maps finite cotangents to finite ones when the forward values it multiplies by
      (``reads``) are finite: no singular derivative (``Sqrt`` at 0 is not bounded). Outside it,
      :func:`.finite.nonfinite_cotangents` marks the inputs' cotangents as possibly inf or NaN, and the
      selections before it keep their ``Where`` (and the products their zero-partial test, issue 27).
      ``False`` claims nothing. For a :func:`not_differentiable` operator: whether the inputs' cotangents
      may count as finite past it.
    - ``finite``: the forward outputs are finite when the inputs are (``Exp``, ``Sinh``, ``Softplus`` overflow,
      ``Log``, ``Div`` make inf of finite values: not finite). Otherwise :func:`.finite.nonfinite_values` takes
      every output as possibly inf or NaN, and the products that read them keep their ``Where``.
    - ``reads``: the forward values the VJP of every input multiplies the cotangent by, as input positions
      (``()``: none, it selects, moves or sums the cotangent, with masks from comparisons, which are false for
      NaN; ``(1,)``: Dropout's ratio), or :data:`ALL` (every input and output, the default). A product with a
      value that may be inf or NaN makes the cotangent of that input possibly non-finite.
    - ``product``: a two-operand product (Mul, MatMul, Gemm, Conv): the VJP of operand 0 reads operand 1 and
      the reverse; later inputs (a bias) read nothing. Replaces ``reads``.
    - ``mixing``: a contraction or normalization: a graph input's inf or NaN is not followed past it
      (:mod:`.finite`, case 2), and its VJP multiplying by such a value does not make the cotangent unsafe.
    - ``sanitizing``: the outputs are finite even when some inputs are ``-inf`` (Softmax under an additive
      mask): non-finite values are not followed through it.
    - ``moves``: moves or selects elements without repeating them, whatever the output's shape (Reshape,
      Gather, Concat): an input is never taken as broadcast into the output (:func:`.finite._repeats`).
    - ``casts``: the VJP casts the cotangent to the input's dtype (Cast, CastLike): not bounded where that
      narrows it (float32 to float16 overflows) or the types are unknown.
    - ``finite_if_static``: input positions such that the outputs are finite when those inputs are computed
      from constants and shapes (Div by a size: an attention scale).
    - ``shape_only``: the outputs are functions of the input's shape, not its values (Shape, Size): they are
      known when the graph is built, like constants.
    """

    bounded: bool | None = None
    finite: bool | None = None
    reads: tuple[int, ...] | str | None = None
    product: bool = False
    mixing: bool = False
    sanitizing: bool = False
    moves: bool = False
    casts: bool = False
    finite_if_static: tuple[int, ...] = ()
    shape_only: bool = False

    def __post_init__(self) -> None:
        if self.product and self.reads is not None:
            raise ValueError("give reads or product, not both (product=True says what the VJP reads)")
        if isinstance(self.reads, str) and self.reads != ALL:
            raise ValueError(f"reads is a tuple of input positions or ALL, not {self.reads!r}")

    def undeclared(self) -> list[str]:
        """The keywords of :data:`REQUIRED` this registration left out (``reads`` counts as given with
        ``product``, and is needed only when ``bounded``)."""
        missing = [k for k in ("bounded", "finite") if getattr(self, k) is None]
        if self.bounded and self.reads is None and not self.product:
            missing.append("reads")
        return missing

    def reads_of(self, node: Node, i: int) -> list[str]:
        """The forward values of ``node`` the VJP of input ``i`` multiplies the cotangent by."""
        if self.product:
            return [node.inputs[1 - i]] if i < 2 else []
        if self.reads is None or self.reads == ALL:
            return [v for v in [*node.inputs, *node.outputs] if v]
        return [node.inputs[k] for k in self.reads if k < len(node.inputs) and node.inputs[k]]


#: The keywords every registration gives: ``bounded`` and ``finite``, and for a bounded VJP ``reads`` (or
#: ``product``); :meth:`Facts.undeclared`.
REQUIRED = ("bounded", "finite", "reads")

#: The facts of every default-domain operator registered here (:func:`vjp`, :func:`unary`,
#: :func:`not_differentiable`), by op type; :mod:`.finite` derives its tables from them.
FACTS: dict[str, Facts] = {}

#: The facts of an operator nobody registered: nothing is claimed (not bounded, not finite, reads everything).
UNKNOWN = Facts(bounded=False, finite=False, reads=ALL)

FACT_NAMES = tuple(f.name for f in fields(Facts))


def ops_with(**facts) -> frozenset[str]:
    """The registered op types whose facts have the given values (``ops_with(bounded=True, reads=())``)."""
    return frozenset(op for op, f in FACTS.items() if all(getattr(f, k) == v for k, v in facts.items()))


def _stated(op_types: tuple[str, ...], facts: dict) -> Facts:
    unknown = set(facts) - set(FACT_NAMES)
    if unknown:
        raise TypeError(f"unknown operator facts {sorted(unknown)} for {op_types}; known: {FACT_NAMES}")
    return Facts(**facts)


def vjp(*op_types: str, domain: str = "", **facts) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the VJP of the default-domain operators ``op_types``, with their :class:`Facts`
    as keywords (``bounded``, ``finite``, ``reads`` or ``product`` required: :data:`REQUIRED`);
    ``ValueError`` if one has a rule already. ``domain``: another operator domain (``"com.microsoft"``'s
    contrib operators): the rule and facts go to :data:`DOMAIN_RULES` and :data:`DOMAIN_FACTS`."""
    stated = _stated(op_types, facts)

    def register(rule: Rule) -> Rule:
        for op in op_types:
            table, facts_table, key = (DOMAIN_RULES, DOMAIN_FACTS, (domain, op)) if domain else (RULES, FACTS, op)
            if key in table:
                raise ValueError(f"duplicate VJP rule for {op}" + (f" of domain {domain}" if domain else ""))
            table[key] = rule
            facts_table[key] = stated
        return rule

    return register


def unary(*op_types: str, **facts) -> Callable:
    """Register a rule for operators with one differentiable input, written as ``fn(ctx, node, x, y, g) -> dx``
    (``x`` the first input, ``y`` the first output, ``g`` its cotangent); other inputs get no gradient, and
    ``fn`` runs only when ``x`` needs one (not for an integer ``x``). ``facts``: as for :func:`vjp`."""

    def register(fn: Callable) -> Callable:
        def rule(ctx: Ctx, node: Node, cts: list) -> list:
            x, y, g = node.inputs[0], node.outputs[0], cts[0]
            return [lambda: fn(ctx, node, x, y, g), *[None] * (len(node.inputs) - 1)]

        rule.__doc__ = fn.__doc__
        rule.__name__, rule.__qualname__, rule.__module__ = fn.__name__, fn.__qualname__, fn.__module__
        rule.__wrapped__ = fn  # (functools' convention: the function the rule calls)
        vjp(*op_types, **facts)(rule)
        return fn

    return register


def slope(op_type: str, *, of: str | None, **facts) -> Callable:
    """Register the VJP ``dx = g * d`` of a one-input pointwise operator from its derivative alone, written as
    ``fn(x, y) -> d`` over :class:`~revgraph.autodiff.algebra.Val` values (``x`` the input, ``y`` the output):
    a line of a table of derivatives (JAX's ``ad.defjvp(sin_p, lambda g, x: mul(g, cos(x)))``). The product is
    the strong-zero one (:meth:`Val.times`); ``of`` names the forward value ``d`` is computed from, ``"x"`` or
    ``"y"``, when ``d`` is finite wherever that value is, or ``None`` when ``d`` may be inf at finite values (``1 /
    x`` at 0: always tested). ``facts``: as for :func:`vjp`."""
    if of not in ("x", "y", None):
        raise ValueError(f"slope({op_type!r}): of must be 'x', 'y' or None, got {of!r}")

    def register(fn: Callable) -> Callable:
        def rule(ctx: Ctx, node: Node, x: str, y: str, g: str):
            xv, yv = ctx.vals(x, y)
            reads = None if of is None else [x if of == "x" else y]
            return ctx.val(g).times(fn(xv, yv), reads, like=x)

        rule.__doc__ = fn.__doc__
        rule.__name__, rule.__qualname__, rule.__module__ = fn.__name__, fn.__qualname__, fn.__module__
        unary(op_type, **facts)(rule)
        return fn

    return register


def not_differentiable(reason: str, *op_types: str, **facts) -> None:
    """Declare ``op_types`` as carrying no gradient, with the reason (shown in docs/op_coverage.md) and their
    :class:`Facts` (``bounded`` and ``finite`` required; ``reads`` is ``()``: no gradient is sent, so nothing
    is multiplied; ``shape_only`` for Shape and Size)."""
    stated = _stated(op_types, {"reads": (), **facts})
    for op in op_types:
        NOT_DIFFERENTIABLE[op] = reason
        FACTS[op] = stated


#: Rules of operators of revgraph's private domains, by ``(domain, op_type)``: placeholders that never reach a
#: runtime, such as the collectives of :mod:`revgraph.train.distributed.sync_batchnorm` (registered by that module).
DOMAIN_RULES: dict[tuple[str, str], Rule] = {}

#: The facts of the operators of other domains registered with ``vjp(..., domain=...)`` (onnxruntime's contrib
#: operators, rules/contrib_*.py), by ``(domain, op_type)``; :mod:`.finite` reads them as :data:`FACTS`.
DOMAIN_FACTS: dict[tuple[str, str], Facts] = {}


def is_standard(node: Node) -> bool:
    """Is ``node`` an operator of ONNX's default domain that ONNX defines (not one onnxruntime adds to it, such
    as ``SimplifiedLayerNormalization``)?"""
    return node.domain in ("", "ai.onnx") and onnx.defs.has(node.op_type)


def qualified(node: Node) -> str:
    """``com.microsoft.Attention``, or the bare op type of the default domain."""
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def contrib_operators() -> list[str]:
    """The operators outside ONNX's standard set that revgraph differentiates (``com.microsoft.X``; default-domain
    names ONNX does not define), sorted; revgraph's private placeholder domains (``revgraph.*``) left out."""
    ops = {f"{d}.{op}" for d, op in DOMAIN_RULES if not d.startswith("revgraph")}
    ops.update(op for op in RULES if not onnx.defs.has(op))
    return sorted(ops)


def unsupported_message(missing: list[Node]) -> str:
    """The one-line refusal of the nodes ``missing`` (no rule, on a path that must be differentiated): operators
    outside ONNX's standard set named with their domain and node, then the contrib operators revgraph has
    rules for (issue 41); standard operators without a rule as the list of their nodes."""
    contrib = [n for n in missing if not is_standard(n)]
    parts = []
    if contrib:
        named = ", ".join(f"{qualified(n)} (node {n.name or '?'!r})" for n in contrib)
        parts.append(f"unsupported operator{'s' if len(contrib) > 1 else ''} {named}; supported contrib operators: "
                     f"{', '.join(contrib_operators()) or 'none'}")
    standard = [n for n in missing if is_standard(n)]
    if standard:
        parts.append(f"no VJP rule for {len(standard)} node(s) on the path to the loss: "
                     f"{', '.join(n.label() for n in standard)}")
    return "; ".join(parts)


def without_rules(nodes) -> dict[str, int]:
    """How many of ``nodes`` each operator revgraph cannot differentiate has (no rule; not declared without
    gradient, nor lowered), by :func:`qualified` name: what ``revgraph info`` lists. A gradient refuses such a
    node only where a path to the loss passes it."""
    found: dict[str, int] = {}
    for node in nodes:
        if get_rule(node) is None and not (node.domain in ("", "ai.onnx") and (
                node.op_type in NOT_DIFFERENTIABLE or node.op_type in LOWERED)):
            found[qualified(node)] = found.get(qualified(node), 0) + 1
    return found


def get_rule(node: Node) -> Rule | None:
    """The rule of ``node``'s operator, or ``None`` (other domains have none but :data:`DOMAIN_RULES`)."""
    if node.domain not in ("", "ai.onnx"):
        return DOMAIN_RULES.get((node.domain, node.op_type))
    return RULES.get(node.op_type)
