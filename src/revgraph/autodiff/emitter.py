"""The :class:`Emitter`: appends backward nodes with fresh, readable names and knows the types of values.

It only builds nodes. What a rule knows about the node it differentiates (which inputs need a gradient, which
cotangents are finite, the producers of values, options) is its :class:`~revgraph.autodiff.context.Ctx`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import GraphError
from ..ir import Node, ValueInfo, fresh_name, onnx_dtype
from ..onnx_io.value_types import constant_values, node_types


class _Scope:
    """The ``with`` block of :meth:`Emitter.scope` (a class: rules enter one per differentiated node, and a
    generator-based context manager costs several times more)."""

    __slots__ = ("e", "prefix", "saved")

    def __init__(self, e: Emitter, prefix: str):
        self.e, self.prefix = e, prefix

    def __enter__(self) -> Emitter:
        self.saved, self.e.prefix = self.e.prefix, self.prefix
        return self.e

    def __exit__(self, *exc: object) -> None:
        self.e.prefix = self.saved


class Emitter:
    """Appends backward nodes with fresh, readable names and knows the types of values.

    Node and value names are ``grad/<forward node name>/<OpType>`` (made unique with a counter) while a
    rule runs for a forward node, and ``accum/<value>`` for accumulation. ``types`` maps value names to
    :class:`ValueInfo` (from ONNX shape inference on the forward graph); rules read static shapes and dtypes
    through :meth:`shape`, :meth:`dtype` and :meth:`rank`, which return ``None`` when unknown, and fall
    back to ``Shape``-based ops then.
    """

    def __init__(self, types: dict[str, ValueInfo], used_names: set[str], opset: int, prefix: str = "grad"):
        self.types = types
        self.used = used_names
        self.opset = opset
        self.nodes: list[Node] = []
        self.prefix = prefix  # set through scope()
        self._consts: dict[tuple, str] = {}
        self._ints: dict[tuple[int, ...], str] = {}  # ints() by value: its constants in self._consts
        self._dims: set[str] = set()  # shapes of real values (shape_of, dims_const): Reshape takes 0 literally
        #: values known when the graph is built (initializers, Constant outputs, folded shape arithmetic):
        #: axes, shapes, pads
        self.values: dict[str, np.ndarray] = {}
        #: the graph inputs whose rank the graph being differentiated does not declare (:meth:`learn_constants`)
        self.undeclared: list[str] = []

    def child(self, types: dict[str, ValueInfo], prefix: str) -> Emitter:
        """An emitter for a subgraph (a backward loop body, a branch): the same names in use, its own nodes
        and constants (a constant must be defined in the scope that reads it), ``types`` for its values."""
        child = Emitter(types, self.used, self.opset, prefix)
        child.undeclared = list(self.undeclared)
        return child

    def scope(self, prefix: str) -> _Scope:
        """Name what is emitted inside the ``with`` block ``<prefix>/<OpType>`` (then the previous prefix again)."""
        return _Scope(self, prefix)

    # ------------------------------------------------------------------------------------------ naming

    def fresh(self, base: str) -> str:
        """A value or node name not used anywhere yet, starting with ``base``."""
        return fresh_name(base, self.used)

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, *, like: str | None = None,
           shape: tuple | None = None, dtype: Any = None, tag: str | None = None, **attrs: Any) -> Any:
        """Emit ``op_type(inputs, **attrs)``; return its output name (a list if ``n_out > 1``).

        ``like`` (a value name) records that the output has that value's type; ``shape``/``dtype`` record
        a type explicitly, so later rules see static shapes of backward values too. ``tag`` names the node
        ``<prefix>/<tag>`` instead of ``<prefix>/<OpType>`` (what a later pass recognizes it by: the strong
        product's ``Where``, :mod:`.strong`).
        """
        if op_type == "Pad" and len(inputs) > 3 and inputs[3]:
            inputs = self._pad_all_axes(list(inputs))
            inputs = inputs if inputs[2] else inputs[:2]
        if op_type == "Reshape" and len(inputs) > 1 and inputs[1] in self._dims and "allowzero" not in attrs:
            attrs["allowzero"] = 1  # an empty dimension, not "copy" (Gather's rows of an empty index tensor)
        base = fresh_name(f"{self.prefix}/{tag or op_type}", self.used)
        outs = [base] if n_out == 1 else [fresh_name(f"{base}:{i}", self.used) for i in range(n_out)]
        if attrs:  # (a fresh dict of this call's keywords otherwise: the node may keep it)
            attrs = {k: v for k, v in attrs.items() if v is not None}
        node = Node(op_type, inputs, outs, attrs, base)  # (Node copies the inputs into a list)
        self.nodes.append(node)
        types = self.types
        if like is not None and like in types:
            ref = types[like]
            types[outs[0]] = ValueInfo(outs[0], ref.dtype, ref.shape, ref.kind)
        elif shape is not None or dtype is not None:
            types[outs[0]] = ValueInfo(outs[0], dtype, shape)
        else:
            self._infer(node)
        return outs[0] if n_out == 1 else outs

    def _pad_all_axes(self, inputs: list[str]) -> list[str]:
        """``Pad`` inputs with the ``axes`` input folded into ``pads`` over every axis: onnxruntime's transpose
        optimizer (``ORT_ENABLE_BASIC`` and above, its default level) mishandles a Pad with ``axes`` after a
        Transpose ("Gather ... idx=3 must be within the inclusive range"), so no emitted Pad has one. Static
        when the rank, the axes and the pads are known; else the pads are scattered into zeros of length
        ``2 * rank`` in the graph."""
        x, pads, value, axes = inputs[:4]
        r, av, pv = self.rank(x), self.value(axes), self.value(pads)
        if r is not None and av is not None:
            slots = [int(a) + r if int(a) < 0 else int(a) for a in np.asarray(av).reshape(-1)]
            k = len(slots)
            if pv is not None:
                pv = [int(p) for p in np.asarray(pv).reshape(-1)]
                full = [0] * (2 * r)
                for j, a in enumerate(slots):
                    full[a], full[r + a] = pv[j], pv[k + j]
                return [x, self.ints(full), value]
            parts = []
            for half in (0, 1):
                for i in range(r):
                    j = slots.index(i) if i in slots else None
                    parts.append(self.ints([0]) if j is None else
                                 self.op("Slice", [pads, self.ints([half * k + j]), self.ints([half * k + j + 1])],
                                         shape=(1,), dtype=np.dtype(np.int64)))
            return [x, self.op("Concat", parts, axis=0, shape=(2 * r,), dtype=np.dtype(np.int64)), value]
        rank = self.op("Size", [self.op("Shape", [x], dtype=np.dtype(np.int64), shape=(r,))],
                       dtype=np.dtype(np.int64), shape=())
        ax = self.op("Cast", [axes], to=onnx_dtype(np.int64))
        ax = self.op("Where", [self.op("Less", [ax, self.ints([0])]), self.op("Add", [ax, rank]), ax])
        where = self.op("Concat", [ax, self.op("Add", [ax, rank])], axis=0)
        zeros = self.op("ConstantOfShape", [self.op("Reshape", [self.op("Mul", [rank, self.const(np.int64(2))]),
                                                                self.ints([1])])], value=np.zeros(1, np.int64))
        full = self.op("ScatterElements", [zeros, where, self.op("Cast", [pads], to=onnx_dtype(np.int64))], axis=0)
        return [x, full, value]

    def _infer(self, node: Node) -> None:
        """Record the output types of an emitted node, so that later rules see static shapes of backward values
        too (and reduce broadcasting with static axes)."""
        types = self.types
        for i in node.inputs:
            if i and i not in types:
                return
        types.update(node_types(node, types, self.values, self.opset))

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

    def need_rank(self, name: str, node: Node, what: str | None = None) -> int:
        """The rank of ``name``; :class:`GraphError` if shape inference could not find it (``what``: who needs
        it, default "its VJP"). The message says what to do: declare the shapes of the graph inputs that have
        none, or, when they are all declared, the type of the value itself."""
        r = self.rank(name)
        if r is None:
            raise GraphError(self.unknown_rank(name, node, what))
        return r

    def unknown_rank(self, name: str, node: Node, what: str | None = None) -> str:
        """The message of :meth:`need_rank` (also for rules that find the rank elsewhere first)."""
        what = what or "its VJP"
        return f"{node.label()}: the rank of {name!r} is unknown, and {what} needs it; {self.shape_advice()}"

    def shape_advice(self) -> str:
        """What to do about a shape or rank that shape inference could not find, for the end of a message:
        declare the shapes of the graph inputs that have none, or, when every input's is declared, the type
        of the value itself (a value computed from values known only at run time)."""
        if self.undeclared:
            listed = ", ".join(map(repr, self.undeclared[:4])) + (", ..." if len(self.undeclared) > 4 else "")
            return f"declare the shapes of the graph inputs (not declared: {listed})"
        return ("the graph inputs' shapes are declared, but shape inference cannot follow them to this value; "
                "declare its type in the model's value_info")

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
        key = tuple(values)
        if not all(type(v) is int for v in key):  # numpy ints, floats, nested lists: as numpy reads them
            key = tuple(np.asarray(list(key), dtype=np.int64).reshape(-1).tolist())
        name = self._ints.get(key)
        if name is None:  # (rules ask for the same few axes and shapes hundreds of times)
            name = self._ints[key] = self.const(np.asarray(key, dtype=np.int64).reshape(-1))
        return name

    def scalar(self, value: float, like: str) -> str:
        """A scalar constant with the dtype of ``like`` (``CastLike`` when that dtype is unknown)."""
        dt = self.dtype(like)
        if dt is not None:
            return self.const(np.asarray(value, dtype=dt))
        return self.op("CastLike", [self.const(np.asarray(value, dtype=np.float32)), like])

    def onnx_dtype(self, name: str) -> int | None:
        dt = self.dtype(name)
        return None if dt is None else onnx_dtype(dt)

    def value(self, name: str) -> np.ndarray | None:
        """The constant value of ``name`` (an initializer or a ``Constant`` output), or ``None``."""
        return self.values.get(name) if name else None

    def learn_constants(self, graph) -> None:
        """Record the values of ``graph`` known when it is built, for :meth:`value`: initializers, ``Constant``
        outputs (every form) and shape arithmetic over them and over static shapes
        (:func:`revgraph.onnx_io.value_types.constant_values`); and which graph inputs have no declared rank (for
        :meth:`need_rank`'s advice)."""
        self.values.update(constant_values(graph, self.types))
        self.undeclared = [v.name for v in graph.inputs if v.shape is None and v.kind == "tensor"]

    # ------------------------------------------------------------------------------------------ helpers

    def shape_of(self, name: str) -> str:
        """A 1-D int64 value holding the shape of ``name`` (a constant when the shape is static)."""
        s = self.shape(name)
        if s is not None:
            return self.dims_const(s)
        shape = self.op("Shape", [name], shape=(self.rank(name),), dtype=np.int64)
        self._dims.add(shape)
        return shape

    def dims_const(self, dims) -> str:
        """A 1-D int64 constant holding real dimensions: a ``Reshape`` to it keeps a 0 as an empty dimension
        (``allowzero=1``), where ONNX's default reads a 0 as "copy the input's dimension"."""
        name = self.ints(dims)
        if 0 in list(dims):
            self._dims.add(name)
        return name

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
            # an unknown dimension (None) equals nothing, not even another unknown one: it may be broadcast
            if all(isinstance(a, int) or (a is not None and a == b) for a, b in zip(dx, tail, strict=True)):
                axes = [*range(lead), *(lead + i for i, (a, b) in enumerate(zip(dx, tail, strict=True))
                                        if a == 1 and b != 1)]
                if not axes:
                    return g
                if lead == len(axes) or lead == 0:  # keepdims=1 over the same rank gives x's shape itself
                    return self.op("ReduceSum", [g, self.ints(axes)], keepdims=int(lead == 0), shape=tuple(dx),
                                   dtype=self.dtype(g))
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
        differ = self.op("Not", [self.op("Equal", [padded, sg])])
        axes = self.op("Reshape", [self.op("NonZero", [differ]), self.ints([-1])])
        r = self.op("ReduceSum", [g, axes], keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", [r, sx], like=x)
