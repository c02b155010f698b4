"""A small algebra for writing VJP rules as their formulas: :class:`Val`, a value of the graph being built.

A rule writes its derivative with Python's operators and methods named after the ONNX operators, and each
emits one node through the rule's :class:`~revgraph.autodiff.emitter.Emitter` (no more nodes than the same
rule written with ``e.op`` calls)::

    @unary("Softsign", bounded=True, finite=True, reads="all")
    def softsign(ctx, node, x, y, g):
        x, g = ctx.vals(x, g)
        a = x.abs() + 1                                # Abs, then Add of a constant in x's dtype
        return g.times((a * a).reciprocal(), reads=[x])  # the strong-zero product (Mul, or Where over it)

A pointwise VJP ``g * d`` needs only its derivative (:func:`~revgraph.autodiff.registry.slope`)::

    @slope("Tanh", of="y", bounded=True, finite=True, reads="all")
    def tanh(x, y):
        return 1 - y * y

* Python numbers become scalar constants of the other operand's dtype (shared, as :meth:`Emitter.scalar`
  makes them); a ``str`` operand is a value name; a numpy array a constant of its own dtype.
* The result's type is recorded as the operand's (``like=``) when the other operand is a scalar or has the
  same declared shape and dtype; otherwise ONNX shape inference of the node gives it, as for ``e.op``.
* :meth:`Val.times` is the one strong-zero product (:meth:`Ctx.times`, DESIGN section 5), :meth:`Val.select`
  the one selection (:meth:`Ctx.select`); rules never write a strong zero by hand.
* A rule may return a :class:`Val` (or a function returning one) wherever it returns a value name: the
  backward pass takes its name (:func:`name_of`).

The source of the idea: JAX's ``ad.defjvp(sin_p, lambda g, x: mul(g, cos(x)))`` and HIPS autograd's ``defvjp``,
where a rule is a line of the derivative table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, Union

import numpy as np

from ..ir import onnx_dtype

if TYPE_CHECKING:
    from .emitter import Emitter

Operand = Union["Val", str, float, int, np.ndarray]


class Ctx(Protocol):
    """What a :class:`Val` asks of the rule's context (:class:`.context.Ctx` is one): its emitter and the
    strong-zero products. Declared here, below the context, so that the algebra and the context are no circle."""

    e: Emitter

    def times(self, g: str, d: str, like: str | None = None, reads: Sequence[str] | None = None,
              zero: bool = True) -> str: ...

    def weigh(self, g: str, w: str, like: str | None = None) -> str: ...

    def select(self, cond: str, g: str, like: str | None = None) -> str: ...


def name_of(v: Any) -> Any:
    """The value name of ``v`` when it is a :class:`Val`, else ``v`` itself (a name, ``None``, a sparse
    gradient): what the backward pass stores of a rule's result."""
    return v.name if isinstance(v, Val) else v


def _binary_pair(op: str):
    """``(method, reflected method)`` of :class:`Val` emitting the binary operator ``op`` (reflected: the other
    operand first, a Python scalar as in ``1 - y``)."""

    def method(self: Val, other: Operand) -> Val:
        return self._binary(op, other)

    def reflected(self: Val, other: Operand) -> Val:
        return self._binary(op, other, reverse=True)

    method.__doc__ = reflected.__doc__ = f"``{op}`` (one node; a scalar takes this value's dtype)."
    return method, reflected


def _pointwise(op: str):
    """The :class:`Val` method emitting the one-input operator ``op``, whose output has the input's type."""

    def method(self: Val) -> Val:
        return self.apply(op)

    method.__doc__ = f"``{op}(self)`` (one node)."
    return method


class Val:
    """A value of the backward graph under construction: a value name and the rule context that emits nodes
    reading it. Arithmetic operators and the methods below each emit one ONNX node (module doc); comparisons are
    methods (``gt``, ``lt``, ...) and return bool values, as ``==`` must keep meaning identity of names.

    ``dtype``, ``shape``, ``dims`` and ``rank`` are what the emitter knows statically (``None`` when unknown).
    """

    __slots__ = ("ctx", "name")

    def __init__(self, ctx: Ctx, name: str):
        self.ctx, self.name = ctx, name

    def __repr__(self) -> str:
        return f"Val({self.name!r})"

    # ------------------------------------------------------------------------------------------ types

    @property
    def dtype(self) -> np.dtype | None:
        return self.ctx.e.dtype(self.name)

    @property
    def shape(self) -> tuple | None:
        return self.ctx.e.shape(self.name)

    @property
    def dims(self) -> tuple | None:
        return self.ctx.e.dims(self.name)

    @property
    def rank(self) -> int | None:
        return self.ctx.e.rank(self.name)

    # ------------------------------------------------------------------------------------------ emitting

    def _name(self, other: Operand) -> str:
        """The value name of an operand: a :class:`Val`'s, a name itself, a scalar of this value's dtype, or a
        constant array."""
        if isinstance(other, Val):
            return other.name
        if isinstance(other, str):
            return other
        if isinstance(other, np.ndarray):
            return self.ctx.e.const(other)
        return self.ctx.e.scalar(float(other), self.name)

    def _like(self, other: Operand) -> str | None:
        """This value's name when the result of a broadcast with ``other`` has this value's type (module doc)."""
        if not isinstance(other, (Val, str)):
            return self.name if not isinstance(other, np.ndarray) or other.ndim == 0 else None
        o = other.name if isinstance(other, Val) else other
        if o == self.name:
            return self.name
        e = self.ctx.e
        mine, theirs = e.types.get(self.name), e.types.get(o)
        if mine is None or theirs is None or mine.dtype is None or mine.dtype != theirs.dtype:
            return None
        if theirs.shape == ():  # a scalar broadcast to this value
            return self.name
        if mine.shape is not None and mine.shape == theirs.shape and all(isinstance(d, int) for d in mine.shape):
            return self.name
        return None

    def _binary(self, op: str, other: Operand, reverse: bool = False) -> Val:
        o = self._name(other)
        ins = [o, self.name] if reverse else [self.name, o]
        return Val(self.ctx, self.ctx.e.op(op, ins, like=self._like(other)))

    def apply(self, op_type: str, *others: Operand, like: Val | str | bool | None = True, **attrs: Any) -> Val:
        """``op_type(self, *others, **attrs)``, one node. ``like``: the value whose type the result has (default
        this value's: elementwise operators; ``None``: ONNX shape inference gives it)."""
        e = self.ctx.e
        ref = self.name if like is True else name_of(like) if like else None
        return Val(self.ctx, e.op(op_type, [self.name, *(self._name(o) for o in others)], like=ref, **attrs))

    def out(self, op_type: str, *others: Operand, shape: tuple | None = None, dtype: Any = None,
            **attrs: Any) -> Val:
        """``op_type(self, *others, **attrs)`` with an explicit output type (``shape``, ``dtype``; ``None`` for
        both: inferred)."""
        e = self.ctx.e
        return Val(self.ctx, e.op(op_type, [self.name, *(self._name(o) for o in others)], shape=shape, dtype=dtype,
                                  **attrs))

    # ------------------------------------------------------------------------------------------ arithmetic
    # (each operator emits its ONNX node; the reflected forms put a Python scalar first, as in ``1 - y``)

    __add__, __radd__ = _binary_pair("Add")
    __sub__, __rsub__ = _binary_pair("Sub")
    __mul__, __rmul__ = _binary_pair("Mul")
    __truediv__, __rtruediv__ = _binary_pair("Div")
    __pow__ = _binary_pair("Pow")[0]

    def __neg__(self) -> Val:
        return self.apply("Neg")

    def __matmul__(self, other: Operand) -> Val:
        return self.apply("MatMul", other, like=None)

    # ------------------------------------------------------------------------------------------ pointwise
    # (one-input operators whose output has the input's type)

    exp = _pointwise("Exp")
    log = _pointwise("Log")
    sqrt = _pointwise("Sqrt")
    reciprocal = _pointwise("Reciprocal")
    abs = _pointwise("Abs")
    sign = _pointwise("Sign")
    tanh = _pointwise("Tanh")
    sigmoid = _pointwise("Sigmoid")
    erf = _pointwise("Erf")
    sin = _pointwise("Sin")
    cos = _pointwise("Cos")

    def cast(self, dtype: Any) -> Val:
        """``Cast`` to the numpy ``dtype`` (or an ONNX ``TensorProto`` type number)."""
        to = dtype if isinstance(dtype, int) else onnx_dtype(np.dtype(dtype))
        return self.apply("Cast", like=None, to=to)

    def cast_like(self, other: Operand) -> Val:
        """``CastLike(self, other)``: this value (its shape) in ``other``'s dtype."""
        e, o = self.ctx.e, self._name(other)
        dt = e.dtype(o)
        return Val(self.ctx, e.op("CastLike", [self.name, o], shape=self.dims if dt is not None else None, dtype=dt))

    # ------------------------------------------------------------------------------------------ comparisons

    def _compare(self, op: str, other: Operand) -> Val:
        e, o = self.ctx.e, self._name(other)
        same = self._like(other) is not None
        return Val(self.ctx, e.op(op, [self.name, o], shape=e.dims(self.name) if same else None,
                                  dtype=np.dtype(bool) if same else None))

    def gt(self, other: Operand) -> Val:
        return self._compare("Greater", other)

    def lt(self, other: Operand) -> Val:
        return self._compare("Less", other)

    def ge(self, other: Operand) -> Val:
        return self._compare("GreaterOrEqual", other)

    def le(self, other: Operand) -> Val:
        return self._compare("LessOrEqual", other)

    def eq(self, other: Operand) -> Val:
        return self._compare("Equal", other)

    def indicator(self, like: Val | str) -> Val:
        """This bool value as 0 and 1 in ``like``'s dtype (``Cast``; ``CastLike`` when that dtype is unknown)."""
        e, ref = self.ctx.e, name_of(like)
        dt = e.onnx_dtype(ref)
        return Val(self.ctx, e.op("Cast", [self.name], to=dt) if dt is not None else e.op("CastLike", [self.name, ref]))

    def __and__(self, other: Operand) -> Val:
        return self.apply("And", other, like=self._like(other))

    def __or__(self, other: Operand) -> Val:
        return self.apply("Or", other, like=self._like(other))

    def __invert__(self) -> Val:
        return self.apply("Not")

    # ------------------------------------------------------------------------------------------ strong zeros

    def times(self, d: Operand, reads: Sequence[str | Val] | None = None, zero: bool = True,
              like: Val | str | bool | None = True) -> Val:
        """``self * d`` for a cotangent ``self`` with strong zeros (:meth:`Ctx.times`: ``reads`` the forward
        values ``d`` is computed from, ``None`` when ``d`` may be inf at finite values; ``zero=False`` when
        ``d`` is never 0). ``like``: the result's type (default this value's)."""
        ref = self.name if like is True else name_of(like) if like else None
        reads = None if reads is None else [name_of(r) for r in reads]
        return Val(self.ctx, self.ctx.times(self.name, self._name(d), ref, reads, zero))

    def select(self, cond: Operand, like: Val | str | bool | None = True) -> Val:
        """This cotangent where the bool ``cond`` holds and exactly 0 elsewhere (:meth:`Ctx.select`)."""
        ref = self.name if like is True else name_of(like) if like else None
        return Val(self.ctx, self.ctx.select(self._name(cond), self.name, ref))

    def weigh(self, w: Operand, like: Val | str | bool | None = True) -> Val:
        """``self * w`` for a finite weight ``w >= 0``, exactly 0 where ``w == 0`` (:meth:`Ctx.weigh`)."""
        ref = self.name if like is True else name_of(like) if like else None
        return Val(self.ctx, self.ctx.weigh(self.name, self._name(w), ref))

    # ------------------------------------------------------------------------------------------ shapes

    def reduce_to(self, x: Val | str) -> Val:
        """This cotangent of a broadcast result summed down to ``x``'s shape (:meth:`Emitter.reduce_to`)."""
        return Val(self.ctx, self.ctx.e.reduce_to(self.name, name_of(x)))

    def sum(self, axes: Sequence[int] | Val | str | None = None, keepdims: int = 1, **attrs: Any) -> Val:
        """``ReduceSum`` over ``axes`` (a list of ints, or a value holding them; ``None``: every axis)."""
        return self._reduce("ReduceSum", axes, keepdims, **attrs)

    def mean(self, axes: Sequence[int] | Val | str | None = None, keepdims: int = 1, **attrs: Any) -> Val:
        """``ReduceMean`` over ``axes`` (as :meth:`sum`)."""
        return self._reduce("ReduceMean", axes, keepdims, **attrs)

    def max(self, axes: Sequence[int] | Val | str | None = None, keepdims: int = 1, **attrs: Any) -> Val:
        """``ReduceMax`` over ``axes`` (as :meth:`sum`)."""
        return self._reduce("ReduceMax", axes, keepdims, **attrs)

    def _reduce(self, op: str, axes: Any, keepdims: int, **attrs: Any) -> Val:
        e = self.ctx.e
        ins = [self.name]
        if axes is not None:
            ins.append(name_of(axes) if isinstance(axes, (Val, str)) else e.ints(list(axes)))
        return Val(self.ctx, e.op(op, ins, keepdims=keepdims, **attrs))

    def reshape(self, shape: Sequence[int] | Val | str, like: Val | str | None = None) -> Val:
        """``Reshape`` to ``shape`` (ints, or a value holding them); ``like``: a value of the result's type."""
        e = self.ctx.e
        s = name_of(shape) if isinstance(shape, (Val, str)) else e.ints(list(shape))
        return Val(self.ctx, e.op("Reshape", [self.name, s], like=name_of(like)))

    def unsqueeze(self, axes: Sequence[int]) -> Val:
        return Val(self.ctx, self.ctx.e.op("Unsqueeze", [self.name, self.ctx.e.ints(list(axes))]))

    def squeeze(self, axes: Sequence[int]) -> Val:
        return Val(self.ctx, self.ctx.e.op("Squeeze", [self.name, self.ctx.e.ints(list(axes))]))

    def transpose(self, perm: Sequence[int]) -> Val:
        return Val(self.ctx, self.ctx.e.op("Transpose", [self.name], perm=list(perm)))

    def expand(self, shape: Val | str) -> Val:
        """``Expand`` to the shape held by the value ``shape``."""
        return Val(self.ctx, self.ctx.e.op("Expand", [self.name, name_of(shape)]))


def where(cond: Val, a: Operand, b: Operand, like: Val | str | bool | None = True) -> Val:
    """``Where(cond, a, b)``. Scalar branches take the dtype of ``like`` when it is a value, else of the other
    branch (one of them must then be a :class:`Val`). The result has ``like``'s type (default: the branch that
    is a value; ``None``: inferred)."""
    typed = like if isinstance(like, Val) else a if isinstance(a, Val) else b
    if not isinstance(typed, Val):
        raise TypeError("where: a branch or like= must be a Val (its dtype types the scalars)")
    ref = typed.name if like is True else name_of(like) if like else None
    e = cond.ctx.e
    return Val(cond.ctx, e.op("Where", [cond.name, typed._name(a), typed._name(b)], like=ref))
