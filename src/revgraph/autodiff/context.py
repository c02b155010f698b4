"""What a VJP rule is given besides the node: its :class:`Ctx`, and what control-flow rules return.

A rule is a pure function of its context (DESIGN.md section 3)::

    @vjp("Mul", bounded=True, finite=True, product=True)
    def mul(ctx: Ctx, node: Node, cts: list[str | None]) -> list[Cotangent]

``cts`` holds the cotangent of each output (``None``: that output gets no gradient; treat it as zero). The
rule returns one entry per input: the input's cotangent, ``None`` ("no gradient flows here"), or a function
of no arguments that emits and returns the cotangent. The backward pass calls such a function only when the
input needs a gradient (it is on a path from a wrt value and floating point), so rules never test which
inputs are needed (HIPS autograd's per-argument VJP makers, ``defvjp``). A rule that needs more returns a
:class:`PatchedVJP`: the same entries, the gradients of the values its subgraphs capture (control flow), and
the :class:`ForwardPatch` its forward node needs (a loop's trip counter, Dropout's mask output); rules never
change the forward graph themselves.

The context is immutable; rules build nodes through ``ctx.e`` (an :class:`Emitter`, which only builds nodes
and knows types) and write products with a cotangent through :meth:`Ctx.times`, :meth:`Ctx.select` and
:meth:`Ctx.weigh`, which keep strong zeros (DESIGN.md section 5).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..ir import Graph, Node, ValueInfo
from . import strong
from .algebra import Val
from .emitter import Emitter
from .policies import CheckpointPolicy, Store
from .sparse import SparseGrad

Grad = str | SparseGrad
#: What a rule returns for one input.
Cotangent = Grad | Callable[[], Grad | None] | None


@dataclass(frozen=True)
class Options:
    """Options of a whole backward pass that rules read: ``checkpoint``, the residual policy of loops;
    ``straight_through``, whether a ``QuantizeLinear -> DequantizeLinear`` pair is differentiated with the
    straight-through estimator (the gradient passes the rounding as if it were the identity, and is 0 where the
    value saturates: PyTorch's ``fake_quantize`` backward, as quantization-aware training uses it; rules/quant.py).
    Off by default, as the estimator is not the derivative: without it a path through such a pair is refused.
    ``strong_zeros``: keep exact zeros where a zero cotangent meets an inf or NaN partial derivative (DESIGN
    section 5). Forward mode (:mod:`..forward`) turns it off for the VJP it transposes: the guards there test
    the cotangent, so the VJP would not be linear in it, and the transposed guards would read it.
    ``tangents``: the pass transposes a VJP (forward mode's second pass, :mod:`..forward`): its seeds are
    tangents, taken as finite (a JVP along an infinite tangent is NaN where a partial derivative is 0, as
    ``<grad, t>`` is), and a zero partial derivative stops every cotangent that may be inf or NaN, not only the
    singular ones (:meth:`Ctx.times`): a tangent meets a forward NaN that the function discards (a loss row
    of weight 0) before the zero that discards it, where reverse mode meets the zero first.
    ``accumulate``: how the contributions to one value's gradient are added up (:class:`~.accumulate.
    Accumulator`): ``"sum"``, one ``Sum`` once all have arrived, or ``"running"``, each added at once with
    ``Add``; the whole pass uses it, loop bodies and branches too."""

    checkpoint: CheckpointPolicy = field(default_factory=Store)
    accumulate: str = "sum"
    straight_through: bool = False
    strong_zeros: bool = True
    tangents: bool = False
    #: graph inputs known to hold no inf or NaN (a Trainer's parameters): not followed as possibly non-finite
    #: by :func:`.finite.nonfinite_values` (top-level graph only: a body's inputs are its carried values)
    finite_inputs: frozenset[str] = frozenset()
    #: may the seeds be infinite at finite forward values (:attr:`Ctx.singular`)? A loop body's or branch's
    #: seeds may not when the enclosing node's output cotangents may not (``ctx.backward(..., singular=...)``)
    seeds_singular: bool = True


@dataclass(frozen=True)
class BodyVJP:
    """The backward pass of a subgraph, as :meth:`Ctx.backward` returns it: the emitted ``nodes`` (which read
    the subgraph's values by name) and the cotangent of each wrt value that received one."""

    nodes: list[Node]
    grads: dict[str, Grad]


@dataclass
class ForwardPatch:
    """What a control-flow rule needs its forward node to produce besides its own outputs; the backward pass
    applies it (:func:`apply_patch`) to the graph being differentiated.

    ``outputs``: optional outputs the node must write, by position (Dropout's mask). ``before``: nodes of the
    enclosing graph that must run before the forward node (a counter's initial value). ``carried``: new
    loop-carried values ``(initial value, body input, body output, node output)``, placed after the existing
    ones. ``body``: nodes appended to the forward body. ``scan_outputs``: new scan outputs ``(body output, node
    output)``, placed after the existing ones (stacked residuals). ``replace``: a node that takes the forward
    node's place (same name; it writes the forward node's outputs first, then its own), applied before the
    rest. A rule may fill it from a lazy cotangent: the backward pass applies it after the cotangents are
    emitted."""

    outputs: dict[int, str] = field(default_factory=dict)
    before: list[Node] = field(default_factory=list)
    carried: list[tuple[str, ValueInfo, ValueInfo, str]] = field(default_factory=list)
    body: list[Node] = field(default_factory=list)
    scan_outputs: list[tuple[ValueInfo, str]] = field(default_factory=list)
    replace: Node | None = None


@dataclass(frozen=True)
class PatchedVJP:
    """The result of a rule that captures values or extends its forward node: one entry per input (as a plain
    rule returns them, lazy or not), the gradients of captured values, and the forward patch (``None``: the
    forward node stays as it is)."""

    inputs: list[Cotangent]
    captured: dict[str, Grad]
    patch: ForwardPatch | None = None


def apply_patch(graph: Graph, node: Node, patch: ForwardPatch) -> None:
    """Extend the forward ``node`` of ``graph`` as ``patch`` says (see :class:`ForwardPatch`)."""
    if patch.replace is not None:  # in place: the backward pass and its callers hold this node object
        node.op_type, node.domain = patch.replace.op_type, patch.replace.domain
        node.inputs, node.outputs = list(patch.replace.inputs), list(patch.replace.outputs)
        node.attrs = dict(patch.replace.attrs)
    for pos, name in sorted(patch.outputs.items()):
        node.outputs += [""] * (pos + 1 - len(node.outputs))
        node.outputs[pos] = name
    if patch.before:
        pos = next(i for i, n in enumerate(graph.nodes) if n is node)
        graph.nodes[pos:pos] = patch.before
    body: Graph | None = node.attrs.get("body")
    for initial, body_in, body_out, out in patch.carried:
        n = len(node.inputs) - 2
        body.inputs.insert(2 + n, body_in)
        body.outputs.insert(1 + n, body_out)
        node.inputs.append(initial)
        node.outputs.insert(n, out)
    if patch.body:
        body.nodes.extend(patch.body)
    for body_out, out in patch.scan_outputs:
        body.outputs.append(body_out)
        node.outputs.append(out)


@dataclass(frozen=True)
class Ctx:
    """The immutable context of the rule that differentiates one node.

    ``e`` builds the nodes. ``need[i]``: does input i need a gradient (the backward pass reads it; rules return
    functions instead of testing it). ``finite``: are the node's output cotangents known to be finite
    (autodiff/finite.py)? ``singular``: may one of them be infinite even where every forward value is finite (a
    singular derivative, ``Sqrt``'s at 0, or a non-finite seed on the way from a seed:
    :func:`revgraph.autodiff.finite.nonfinite_cotangents` without the forward values' risk)? ``risky``: the forward
    values that may be inf or NaN. ``producers``: the node writing each value of the graph being differentiated.
    ``reach``: every value on a path from a wrt value (what a control-flow rule asks about captured values).
    ``backward``: the backward pass itself, for subgraphs. ``refined``: the nodes whose operands' signs keep them finite
    and bounded (:mod:`.ranges`): a rule's ``times(..., reads=None)`` then reads the node's own values instead of always
    testing ``g == 0``.
    """

    e: Emitter
    node: Node
    need: tuple[bool, ...]
    finite: bool
    singular: bool
    risky: frozenset[str]
    producers: Mapping[str, Node]
    reach: frozenset[str]
    options: Options
    backward: Callable[..., BodyVJP]
    #: the ids of the forward nodes proven finite and bounded by their operands' signs (:mod:`.ranges`)
    refined: frozenset[int] = frozenset()

    # ------------------------------------------------------------------------------------------ values

    def val(self, name: str) -> Val:
        """``name`` as a :class:`~revgraph.autodiff.algebra.Val`, to write a derivative with operators."""
        return Val(self, name)

    def vals(self, *names: str) -> list[Val]:
        """``names`` as :class:`~revgraph.autodiff.algebra.Val` values (``None`` stays ``None``)."""
        return [None if n is None else Val(self, n) for n in names]

    def value(self, name: str) -> np.ndarray | None:
        """The constant value of ``name`` (an initializer or a ``Constant`` output), or ``None``."""
        return self.e.value(name)

    def nonfinite(self, *names: str) -> bool:
        """May one of the forward values ``names`` hold inf or NaN (:func:`finite.nonfinite_values` on the graph
        being differentiated; values a body reads from the enclosing graph are taken as finite there)?"""
        return any(n in self.risky for n in names if n)

    def mask_of(self, name: str) -> str | None:
        """The bool value ``name`` is a ``Cast`` of, or ``None``: a multiply by it is a selection (what
        :meth:`select` writes), whose VJP must keep strong zeros in gradients of gradients too."""
        p = self.producers.get(name)
        if p is None or p.op_type != "Cast" or p.domain:
            return None
        vi = self.e.types.get(p.inputs[0])
        return p.inputs[0] if vi is not None and vi.dtype is not None and vi.dtype.kind == "b" else None

    # ------------------------------------------------------------------------------------------ strong zeros

    def times(self, g: str, d: str, like: str | None = None, reads: Sequence[str] | None = None,
              zero: bool = True) -> str:
        """``g * d`` with strong zeros (DESIGN section 5): exactly 0 where ``g == 0``, even where ``d`` is inf or
        NaN, and exactly 0 where ``d == 0``, even where ``g`` is inf (a zero partial derivative stops an infinite
        cotangent: ``Mul(x, x)`` at 0 under ``Sqrt``, whose cotangent is inf there, as forward mode gives).
        ``reads``: the forward values ``d`` is computed from; when none of them may be non-finite
        (:meth:`nonfinite`) and ``d`` cannot overflow from finite values, ``g == 0`` needs no test
        (``reads=None``: ``d`` may be inf for finite forward values, ``1 / x`` at 0, always tested). ``d == 0``
        is tested only where the node's output cotangents may be infinite at finite forward values
        (:attr:`singular`) and ``zero`` says ``d`` may be 0 (``False``: ``d`` is a nonzero constant's
        reciprocal); a cotangent that is inf or NaN only because a forward value is meets that value's own
        inf or NaN partial, where no test helps. Where neither test is needed the plain product is emitted:
        ``Where`` costs 7-11x a ``Mul`` on onnxruntime (bench/micro.py). The result is the strong product
        primitive (:mod:`.strong`): differentiated again, it gives strong products of the right terms."""
        if not self.options.strong_zeros:
            return self.e.op("Mul", [g, d], like=like)
        if reads is None and id(self.node) in self.refined:  # d is finite wherever the node's values are
            reads = [v for v in [*self.node.inputs, *self.node.outputs] if v]
        tests = []
        if reads is None or self.nonfinite(*reads):
            tests.append(g)
        if zero and self.singular:
            tests.append(d)
        return strong.lower(self.e, g, d, tests, like)

    def weigh(self, g: str, w: str, like: str | None = None) -> str:
        """``g * w`` for a finite weight ``w >= 0`` (a tie share), exactly 0 where ``w == 0`` even for an inf or
        NaN ``g`` (a selection, as :meth:`select`)."""
        e = self.e
        prod = e.op("Mul", [g, w], like=like)
        if self.finite or not self.options.strong_zeros:
            return prod
        return e.op("Where", [e.op("Greater", [w, e.scalar(0.0, w)]), prod, e.scalar(0.0, g)], like=like)

    def select(self, cond: str, g: str, like: str | None = None) -> str:
        """``g`` where the bool ``cond`` is true and exactly 0 elsewhere (broadcasting as ``Where``): the VJP
        of a selection (ReLU, Dropout, Clip, Where). ``g * Cast(cond)`` when :attr:`finite` says the node's
        cotangents are finite, as it is several times faster than ``Where`` on onnxruntime and equal for
        finite ``g``; ``Where(cond, g, 0)`` otherwise, so that an inf or NaN cotangent on the unselected side
        still gives an exact 0 (strong zeros, DESIGN section 5)."""
        e = self.e
        dt = e.onnx_dtype(g)
        if self.finite and dt is not None:
            return e.op("Mul", [g, e.op("Cast", [cond], to=dt)], like=like)
        return e.op("Where", [cond, g, e.scalar(0.0, g)], like=like)
