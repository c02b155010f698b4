"""Which forward values may be inf or NaN, and which cotangents are finite (DESIGN section 5, strong zeros).

Two uses:

- **Strong products.** A VJP rule that multiplies a cotangent by a forward value (``Exp``'s ``g * y``, ``Mul``'s
  ``g * b``) must give an exact 0 where the cotangent is 0, even where that value is inf or NaN (``Where(x > 30,
  1, Exp(x))`` at x = 1000: the Where VJP sends 0 to the Exp branch, and ``0 * exp(1000)`` is NaN). Rules write
  ``Where(g == 0, 0, g * d)`` for that (:meth:`Ctx.times`, which rules reach as :meth:`Val.times`), but only where
  :func:`nonfinite_values` says a value they read may be non-finite: ``Where`` costs 7-11x a ``Mul`` on onnxruntime
  (bench/micro.py).
- **Selections.** A selection VJP (ReLU, Dropout, Clip, Where) sends an exact 0 to the unselected side even
  for an inf or NaN cotangent: ``Where(c, g, 0)``, or ``g * Cast(c)`` where :func:`nonfinite_cotangents` proves
  the cotangent finite (the two agree for finite ``g``).
- **Zero partials** (issue 27). The same products are exactly 0 where the partial derivative ``d`` is 0 and the
  cotangent infinite (``Mul(x, x)`` at 0 under ``Sqrt``): tested only where :func:`nonfinite_cotangents`,
  called without forward risk (``risky`` empty), finds that the cotangent may be infinite at finite forward
  values, i.e. after a VJP not registered ``bounded`` (a singular derivative), a loop or custom operator, or a
  seed that is not a finite constant (``Ctx.singular``).

:func:`nonfinite_values` marks a forward value as possibly non-finite ("risky") when

1. it is computed by an operator that can make inf or NaN out of finite values (anything not registered
   ``finite``: ``Log``, ``Exp``, ``Sqrt``, ``Div`` by a variable, a loop, a custom operator), or from a
   constant holding inf or NaN, or from such a value through any operator (``sanitizing`` ones excepted:
   ``Softmax``, which an additive ``-inf`` mask leaves finite); or
2. it is a declared input of the graph being differentiated (for a loop body: its carried values), or computed
   from one through operators other than the contractions and normalizations (``mixing``), where the
   input is not broadcast. Inputs may hold inf or NaN (``-inf`` attention masks, NaN padding). Past a
   contraction such an element is no longer tracked: it makes the contraction's other operand's gradient NaN
   anyway (``x^T g`` with a NaN row of ``x``), in PyTorch and JAX as here; a broadcast operand (a bias or a
   scale repeated over the rows) makes a whole slice of the result, and the loss, non-finite unless all of it
   is discarded. Tracking either would put a ``Where`` on every activation of a network whose weights are
   graph inputs (a training graph): a GELU after a bias costs 10% more per step with it.

Initializers and ``Constant`` outputs are judged by their values; values a loop or branch body reads from the
enclosing graph are taken as finite there (the body is differentiated on its own).

What each operator is (``bounded``, ``finite``, ``reads``, ``product``, ``mixing``, ``sanitizing``, ``moves``,
``casts``, ``finite_if_static``, ``shape_only``) is stated where it is registered, as keywords of its
``@vjp``/``@unary``/``not_differentiable`` (:class:`.registry.Facts` says what each means here); this module
names no operator.

:func:`nonfinite_cotangents`: the cotangent of an input is finite when the node's output cotangents are, its
VJP is ``bounded`` (maps finite cotangents to finite ones when the forward values it multiplies by are
finite), none of those values (``reads``, per input) is risky, and the node is not a cast whose VJP narrows
the cotangent (``casts``: float32 to float16 overflows). A contraction's VJP multiplying by a value that is
risky only through an input does not count (case 2's limit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ..ir import Node, ValueInfo
from ..ir.ssa import captured_names
from .registry import DOMAIN_FACTS, FACTS, UNKNOWN, Facts


def _facts(node: Node) -> Facts:
    """The facts of ``node``'s operator as its registration states them (looked up on each call, so that a test
    may patch :data:`.registry.FACTS`); an operator of another domain registered with its facts (onnxruntime's
    contrib operators: :data:`.registry.DOMAIN_FACTS`) as stated, one nobody registered claims nothing."""
    if node.domain:
        return DOMAIN_FACTS.get((node.domain, node.op_type), UNKNOWN)
    return FACTS.get(node.op_type, UNKNOWN)


class Risky(set):
    """The forward values that may be inf or NaN; ``from_inputs`` holds those that may be only because a graph
    input may be (case 2 of the module doc)."""

    from_inputs: frozenset = frozenset()


def nonfinite_values(nodes: list[Node], values: Mapping[str, np.ndarray], types: Mapping[str, ValueInfo],
                     inputs: Iterable[str] | None = None, refined: frozenset[int] = frozenset()) -> Risky:
    """The forward values of ``nodes`` (in order) that may be inf or NaN (module doc). ``values`` holds the
    values known when the graph is built (initializers, ``Constant`` outputs); ``inputs`` the declared inputs of
    the graph, which may hold inf or NaN (default: ``values.inputs`` when the mapping has that attribute, as
    the :class:`Emitter`'s table does, else none); ``refined`` the ids of nodes proven ``finite`` and ``bounded``
    by their operands' signs although their operator is not registered so (:func:`.ranges.refined_nodes`)."""
    memo = getattr(values, "memo", None)  # the Emitter's table keeps the last answer (backward and rules ask)
    key = (id(nodes), len(nodes), None if inputs is None else tuple(inputs), refined)
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
        facts = _facts(node)
        if facts.shape_only or (all(i in static for i in ins) and not subs):
            static.update(outs)
        if any(_is_discrete(types.get(o)) for o in outs) and not subs:
            continue  # integer and boolean results are finite
        if facts.sanitizing:
            continue
        reads = ins + [i for sg in subs.values() for i in captured_names(sg)] if subs else ins
        opaque = bool(subs or node.domain)  # loops, branches and custom operators: not analysed
        unbounded = (not facts.finite and not _finite_if_static(node, facts, static)
                     and not all(i in static for i in ins) and id(node) not in refined)
        if opaque or unbounded or any(i in computed for i in reads):
            computed.update(outs)
        elif not facts.mixing:
            via_input.update(o for o in outs if any(i in via_input and not _repeats(node, facts, i, o, types)
                                                    for i in reads))
    risky = Risky(computed | via_input)
    risky.from_inputs = frozenset(via_input - computed)
    if memo is not None:
        memo.update(key=key, risky=risky)
    return risky


def _repeats(node: Node, facts: Facts, i: str, o: str, types: Mapping[str, ValueInfo]) -> bool:
    """Is input ``i`` broadcast (repeated along an axis) into output ``o``: a bias or a scale added to or
    multiplied with every row? Then a non-finite element of ``i`` reaches a whole slice of ``o``, and the loss
    unless all of it is discarded, and an input's elements are not followed there (module doc, case 2).
    ``False`` when a shape is unknown or the operator only moves elements (``moves``)."""
    if facts.moves:
        return False
    si, so = (getattr(types.get(n), "shape", None) for n in (i, o))
    if si is None or so is None:
        return False
    return len(si) < len(so) or any(a == 1 and b != 1 for a, b in zip(reversed(si), reversed(so), strict=False))


def _finite_if_static(node: Node, facts: Facts, static: set[str]) -> bool:
    # x / d with d computed from shapes or constants (an attention scale): finite, sizes being positive
    return bool(facts.finite_if_static) and all(k < len(node.inputs) and node.inputs[k] in static
                                                for k in facts.finite_if_static)


def _is_discrete(vi: ValueInfo | None) -> bool:
    return vi is not None and vi.dtype is not None and vi.dtype.kind in "biu"


def nonfinite_cotangents(nodes: list[Node], ys: Mapping[str, str | None], values: Mapping[str, np.ndarray],
                         risky: set[str] = frozenset(), types: Mapping[str, ValueInfo] | None = None,
                         refined: frozenset[int] = frozenset()) -> set[str]:
    """The values among ``nodes``' inputs and outputs whose cotangent may be inf or NaN. ``nodes`` are in
    forward order; ``ys`` maps each differentiated value to its seed (``None`` for ones); a seed whose value
    is known when the graph is built (``values``: initializers, ``Constant`` outputs) counts as finite when
    all its elements are. ``risky`` are the forward values that may be non-finite (:func:`nonfinite_values`),
    ``types`` the value types (to find narrowing casts), ``refined`` the nodes proven bounded by their operands'
    signs (:func:`.ranges.refined_nodes`)."""

    def finite_seed(seed: str | None) -> bool:
        return seed is None or (seed in values and bool(np.all(np.isfinite(values[seed]))))

    types = types or {}
    from_inputs = getattr(risky, "from_inputs", frozenset())
    unsafe = {y for y, seed in ys.items() if not finite_seed(seed)}
    for node in reversed(nodes):
        facts = _facts(node)
        if ((not facts.bounded and id(node) not in refined) or (facts.casts and _narrowing(node, types))
                or any(o in unsafe for o in node.outputs if o)):
            unsafe.update(i for i in node.inputs if i)
            for sg in node.subgraphs.values():
                unsafe.update(captured_names(sg))
            continue
        ignored = from_inputs if facts.mixing else frozenset()
        for k, name in enumerate(node.inputs):
            if name and any(v in risky and v not in ignored for v in facts.reads_of(node, k)):
                unsafe.add(name)
    return unsafe


def _narrowing(node: Node, types: Mapping[str, ValueInfo]) -> bool:
    """Does the VJP of a cast (``casts``) cast the cotangent to a smaller float type (or are the types unknown)?"""
    a, b = types.get(node.inputs[0]), types.get(node.outputs[0])
    if a is None or b is None or a.dtype is None or b.dtype is None:
        return True
    return a.dtype.itemsize < b.dtype.itemsize
