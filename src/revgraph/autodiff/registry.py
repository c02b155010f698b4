"""The VJP rule table and the :class:`Emitter` that rules write the backward graph with.

A rule has one signature for every operator (DESIGN.md section 3)::

    @vjp("Mul")
    def mul(e: Emitter, node: Node, out_grads: list[str | None]) -> list[str | SparseGrad | None]

``out_grads`` holds the cotangent of each output (``None``: that output gets no gradient; treat it as
zero). The rule returns one entry per input: the input's cotangent, or ``None`` meaning "no gradient flows
here". Rules emit standard ONNX nodes only (through the emitter), so the backward graph is itself
differentiable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import GraphError
from ..ir import Node, ValueInfo, fresh_name, onnx_dtype
from ..onnx_io import constant_values, node_types
from .finite import nonfinite_values

Rule = Callable[["Emitter", Node, list], list]

RULES: dict[str, Rule] = {}

#: Operators whose outputs carry no gradient: integer/boolean results, or piecewise-constant functions whose
#: derivative is zero almost everywhere (their VJP sends no gradient to any input).
NOT_DIFFERENTIABLE: dict[str, str] = {}


#: Operators differentiated by rewriting them into other operators before the backward pass (Scan into Loop,
#: ...), with how; docs/op_coverage.md lists them as covered.
LOWERED: dict[str, str] = {}


def vjp(*op_types: str) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the VJP of the default-domain operators ``op_types``."""

    def register(rule: Rule) -> Rule:
        for op in op_types:
            if op in RULES:
                raise ValueError(f"duplicate VJP rule for {op}")
            RULES[op] = rule
        return rule

    return register


def not_differentiable(reason: str, *op_types: str) -> None:
    """Declare ``op_types`` as carrying no gradient, with the reason (shown in docs/op_coverage.md)."""
    for op in op_types:
        NOT_DIFFERENTIABLE[op] = reason


def get_rule(node: Node) -> Rule | None:
    if node.domain not in ("", "ai.onnx"):
        return None
    return RULES.get(node.op_type)


class KnownValues(dict):
    """Values known when the graph is built, by name; ``inputs`` names the declared inputs of the graph being
    differentiated (they may hold inf or NaN: autodiff/finite.py), ``memo`` keeps the last answer of
    :func:`finite.nonfinite_values` for that graph (the backward pass and the rules both ask)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inputs: tuple[str, ...] = ()
        self.memo: dict = {}


class Emitter:
    """Appends backward nodes with fresh, readable names and knows the types of values.

    Node and value names are ``grad/<forward node name>/<OpType>`` (made unique with a counter) while a
    rule runs for a forward node, and ``accum/<value>`` for accumulation. ``types`` maps value names to
    :class:`ValueInfo` (from ONNX shape inference on the forward graph); rules read static shapes and dtypes
    through :meth:`shape`, :meth:`dtype` and :meth:`rank`, which return ``None`` when unknown, and fall
    back to ``Shape``-based ops then.
    """

    def __init__(self, types: dict[str, ValueInfo], used_names: set[str], opset: int):
        self.types = types
        self.used = used_names
        self.opset = opset
        self.nodes: list[Node] = []
        self.prefix = "grad"
        #: per input of the node whose rule runs: does that input need a gradient? Rules may skip the others.
        self.need: list[bool] = []
        #: every value on a path from a wrt value (control-flow rules ask it about captured values)
        self.reach: set[str] = set()
        #: are the cotangents of the node whose rule runs known to be finite? (see autodiff/finite.py)
        self.finite = False
        #: the node writing each value of the graph being differentiated
        self.producers: dict[str, Node] = {}
        #: options of the whole pass that rules read (``checkpoint``: the loop residual policy)
        self.options: dict[str, Any] = {}
        #: the graph being differentiated (control-flow rules add forward nodes to it)
        self.graph = None
        self._consts: dict[tuple, str] = {}
        #: values known when the graph is built (initializers, Constant outputs): axes, shapes, pads; its
        #: ``inputs`` are the declared inputs of the graph being differentiated (autodiff/finite.py)
        self.values: KnownValues = KnownValues()

    # ------------------------------------------------------------------------------------------ naming

    def fresh(self, base: str) -> str:
        """A value or node name not used anywhere yet, starting with ``base``."""
        return fresh_name(base, self.used)

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, *, like: str | None = None,
           shape: tuple | None = None, dtype: Any = None, **attrs: Any) -> Any:
        """Emit ``op_type(inputs, **attrs)``; return its output name (a list if ``n_out > 1``).

        ``like`` (a value name) records that the output has that value's type; ``shape``/``dtype`` record
        a type explicitly, so later rules see static shapes of backward values too.
        """
        base = self.fresh(f"{self.prefix}/{op_type}")
        outs = [base] if n_out == 1 else [self.fresh(f"{base}:{i}") for i in range(n_out)]
        self.nodes.append(Node(op_type, list(inputs), outs, {k: v for k, v in attrs.items() if v is not None}, base))
        if like is not None and like in self.types:
            ref = self.types[like]
            self.types[outs[0]] = ValueInfo(outs[0], ref.dtype, ref.shape)
        elif shape is not None or dtype is not None:
            self.types[outs[0]] = ValueInfo(outs[0], dtype, shape)
        else:
            self._infer(self.nodes[-1])
        return outs[0] if n_out == 1 else outs

    def _infer(self, node: Node) -> None:
        """Record the output types of an emitted node, so that later rules see static shapes of backward values
        too (and reduce broadcasting with static axes)."""
        if not any(i and i not in self.types for i in node.inputs):
            self.types.update(node_types(node, self.types, self.values, self.opset))

    # ------------------------------------------------------------------------------------------ types

    def dtype(self, name: str) -> np.dtype | None:
        vi = self.types.get(name)
        return vi.dtype if vi is not None else None

    def shape(self, name: str) -> tuple | None:
        """The static shape of ``name`` if every dimension is a known integer, else ``None``."""
        vi = self.types.get(name)
        if vi is None or vi.shape is None or not all(isinstance(d, int) for d in vi.shape):
            return None
        return vi.shape

    def dims(self, name: str) -> tuple | None:
        """The declared dimensions (ints, symbols or ``None``) of ``name``, or ``None`` if the rank is unknown."""
        vi = self.types.get(name)
        return None if vi is None else vi.shape

    def rank(self, name: str) -> int | None:
        d = self.dims(name)
        return None if d is None else len(d)

    def need_rank(self, name: str, node: Node) -> int:
        """The rank of ``name``; :class:`GraphError` if shape inference could not find it."""
        r = self.rank(name)
        if r is None:
            raise GraphError(
                f"{node.label()}: the rank of {name!r} is unknown, and its VJP needs it; "
                "declare the shapes of the graph inputs"
            )
        return r

    # ------------------------------------------------------------------------------------------ constants

    def const(self, value: Any, dtype: Any = None) -> str:
        """A ``Constant`` node holding ``value`` (numpy dtype ``dtype``); identical constants are shared."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh(f"{self.prefix}/const")
            self.nodes.append(Node("Constant", [], [name], {"value": arr}, name))
            self.types[name] = ValueInfo(name, arr.dtype, arr.shape)
            self.values[name] = arr
            self._consts[key] = name
        return self._consts[key]

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 constant (axes, shapes, pads)."""
        return self.const(np.asarray(list(values), dtype=np.int64).reshape(-1))

    def scalar(self, value: float, like: str) -> str:
        """A scalar constant with the dtype of ``like`` (``CastLike`` when that dtype is unknown)."""
        dt = self.dtype(like)
        if dt is not None:
            return self.const(np.asarray(value, dtype=dt))
        return self.op("CastLike", [self.const(np.asarray(value, dtype=np.float32)), like])

    def onnx_dtype(self, name: str) -> int | None:
        dt = self.dtype(name)
        return None if dt is None else onnx_dtype(dt)

    def insert_before(self, anchor: Node, nodes: list[Node]) -> None:
        """Insert forward ``nodes`` into the graph being differentiated, right before ``anchor`` (control-flow
        rules need values such as a counter's initial value to exist before the forward loop runs)."""
        pos = next(i for i, n in enumerate(self.graph.nodes) if n is anchor)
        self.graph.nodes[pos:pos] = nodes

    def value(self, name: str) -> np.ndarray | None:
        """The constant value of ``name`` (an initializer or a ``Constant`` output), or ``None``."""
        return self.values.get(name) if name else None

    def learn_constants(self, graph) -> None:
        """Record the initializers and ``Constant`` outputs of ``graph`` for :meth:`value`, and its declared
        inputs (which may hold inf or NaN) for the finiteness analysis."""
        self.values.update(constant_values(graph))
        self.values.inputs = tuple(graph.input_names)
        self.values.memo.clear()

    # ------------------------------------------------------------------------------------------ strong zeros

    def nonfinite(self, *names: str) -> bool:
        """May one of the forward values ``names`` hold inf or NaN (:func:`finite.nonfinite_values` on the
        graph being differentiated; values a body reads from the enclosing graph are taken as finite there)?
        Without a graph, every value may be."""
        g = self.graph
        if g is None:
            return True
        risky = nonfinite_values(g.nodes, self.values, self.types)  # memoized in self.values
        return any(n in risky for n in names if n)

    def times(self, g: str, d: str, like: str | None = None, reads: Sequence[str] | None = None) -> str:
        """``g * d`` with strong zeros (DESIGN section 5): exactly 0 where ``g == 0``, even where ``d`` is inf or
        NaN. ``reads``: the forward values ``d`` is computed from; when none of them may be non-finite
        (:meth:`nonfinite`) and ``d`` cannot overflow from finite values, the plain product is equal and is
        emitted (``Where`` costs 7-11x a ``Mul`` on onnxruntime). ``reads=None``: ``d`` may be inf for finite
        forward values (``1 / x`` at 0), always guarded."""
        prod = self.op("Mul", [g, d], like=like)
        if reads is not None and not self.nonfinite(*reads):
            return prod
        zero = self.scalar(0.0, g)
        is_zero = self.op("Equal", [g, zero], shape=self.dims(g), dtype=np.dtype(bool))
        return self.op("Where", [is_zero, zero, prod], like=like)

    def weigh(self, g: str, w: str, like: str | None = None) -> str:
        """``g * w`` for a finite weight ``w >= 0`` (a tie share), exactly 0 where ``w == 0`` even for an inf or
        NaN ``g`` (a selection, as :meth:`select`)."""
        prod = self.op("Mul", [g, w], like=like)
        if self.finite:
            return prod
        return self.op("Where", [self.op("Greater", [w, self.scalar(0.0, w)]), prod, self.scalar(0.0, g)], like=like)

    # ------------------------------------------------------------------------------------------ helpers

    def shape_of(self, name: str) -> str:
        """A 1-D int64 value holding the shape of ``name`` (a constant when the shape is static)."""
        s = self.shape(name)
        if s is not None:
            return self.ints(s)
        return self.op("Shape", [name], shape=(self.rank(name),), dtype=np.int64)

    def select(self, cond: str, g: str, like: str | None = None) -> str:
        """``g`` where the bool ``cond`` is true and exactly 0 elsewhere (broadcasting as ``Where``): the VJP
        of a selection (ReLU, Dropout, Clip, Where). ``g * Cast(cond)`` when :attr:`finite` says the current
        node's cotangents are finite, as it is several times faster than ``Where`` on onnxruntime and equal
        for finite ``g``; ``Where(cond, g, 0)`` otherwise, so that an inf or NaN cotangent on the unselected
        side still gives an exact 0 (strong zeros, DESIGN section 5)."""
        dt = self.onnx_dtype(g)
        if self.finite and dt is not None:
            return self.op("Mul", [g, self.op("Cast", [cond], to=dt)], like=like)
        return self.op("Where", [cond, g, self.scalar(0.0, g)], like=like)

    def mask_of(self, name: str) -> str | None:
        """The bool value ``name`` is a ``Cast`` of, or ``None``: a multiply by it is a selection (what
        :meth:`select` writes), whose VJP must keep strong zeros in gradients of gradients too."""
        p = self.producers.get(name)
        if p is None or p.op_type != "Cast" or p.domain:
            return None
        vi = self.types.get(p.inputs[0])
        return p.inputs[0] if vi is not None and vi.dtype is not None and vi.dtype.kind == "b" else None

    def zeros_like(self, name: str) -> str:
        """Zeros of the shape and dtype of ``name``."""
        dt = self.dtype(name)
        if dt is None:  # 0 * x would turn an infinite x into NaN
            z = self.op("ConstantOfShape", [self.shape_of(name)], value=np.zeros(1, dtype=np.float32))
            return self.op("CastLike", [z, name], like=name)
        return self.op("ConstantOfShape", [self.shape_of(name)], value=np.zeros(1, dtype=dt), like=name)

    def ones_like(self, name: str) -> str:
        """Ones of the shape and dtype of ``name``."""
        dt = self.dtype(name)
        if dt is None:  # float32 ones would mistype a float64 value
            one = self.op("ConstantOfShape", [self.shape_of(name)], value=np.ones(1, dtype=np.float32))
            return self.op("CastLike", [one, name], like=name)
        return self.op("ConstantOfShape", [self.shape_of(name)], value=np.ones(1, dtype=dt), like=name)

    def reduce_to(self, g: str, x: str) -> str:
        """Undo numpy-style broadcasting: sum ``g`` (the cotangent of a broadcast result) down to the shape
        of ``x`` (ONNX "Broadcasting in ONNX", onnx/docs/Broadcasting.md). Static ``ReduceSum`` axes when the
        dimensions allow, ``Shape``/``NonZero``-based axes otherwise."""
        dx, dg = self.dims(x), self.dims(g)
        if dx is not None and dg is not None and len(dg) >= len(dx):
            lead = len(dg) - len(dx)
            tail = dg[lead:]
            if all(isinstance(a, int) or a == b for a, b in zip(dx, tail, strict=True)):
                axes = list(range(lead)) + [lead + i for i, (a, b) in enumerate(zip(dx, tail, strict=True)) if a == 1 and b != 1]
                if not axes:
                    return g
                if lead == len(axes):
                    return self.op("ReduceSum", [g, self.ints(axes)], keepdims=0, shape=tuple(dx), dtype=self.dtype(g))
                r = self.op("ReduceSum", [g, self.ints(axes)], keepdims=1)
                return self.op("Reshape", [r, self.shape_of(x)], shape=tuple(dx), dtype=self.dtype(g))
        sg, sx = self.op("Shape", [g]), self.op("Shape", [x])
        if dx is not None and dg is not None and len(dg) >= len(dx):
            padded = self.op("Concat", [self.ints([1] * (len(dg) - len(dx))), sx], axis=0) if len(dg) > len(dx) else sx
            mask = self.op("Not", [self.op("Equal", [padded, sg])])
            axes = self.op("Reshape", [self.op("NonZero", [mask]), self.ints([-1])])
            r = self.op("ReduceSum", [g, axes], keepdims=1, noop_with_empty_axes=1)
            return self.op("Reshape", [r, sx], like=x)
        diff = self.op("Sub", [self.op("Size", [sg]), self.op("Size", [sx])])
        ones = self.op("ConstantOfShape", [self.op("Unsqueeze", [diff, self.ints([0])])], value=np.ones(1, np.int64))
        padded = self.op("Concat", [ones, sx], axis=0)
        axes = self.op("Reshape", [self.op("NonZero", [self.op("Not", [self.op("Equal", [padded, sg])])]), self.ints([-1])])
        r = self.op("ReduceSum", [g, axes], keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", [r, sx], like=x)
