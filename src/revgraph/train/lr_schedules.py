"""The learning-rate schedules' registry (:data:`SCHEDULES`): each schedule is a :class:`Kind` subclass whose
decay formula is written once (:meth:`Kind.decay`), against a small arithmetic interface with two
implementations: :class:`Floats` (Python floats: the value :meth:`revgraph.train.schedules.Schedule.factor` reports)
and :class:`Nodes` (float64 ONNX nodes of the training-step graph: :func:`revgraph.train.schedules.learning_rate`).
So the rate a run logs and the rate its graph computes come from one definition and cannot drift apart.

A formula sees ``s`` (the step counter, 0 for the first step), ``t`` (the total steps, only for a kind with
:attr:`Kind.needs_total`) and ``w`` (the warmup steps, a Python int); ``+ - * /`` with Python numbers on either
side, and ``m.max``, ``m.min``, ``m.cos``, ``m.sqrt`` (and ``m.where_less(a, b, x, y)``, ``x()`` where
``a < b`` else ``y()``, the branches given as functions). :func:`factor` adds what every schedule shares (the
linear warmup from 0 and the decay towards ``min_lr``; module doc of :mod:`revgraph.train.schedules`). A new schedule
is one registered class here or in user code (:func:`register`); the CLI's ``--lr-schedule`` choices, the
argument checks and the snapshot record read the registry.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import onnx

if TYPE_CHECKING:
    from .graphbuild import Builder


class Floats:
    """The formulas' arithmetic in Python floats (as PyTorch's ``LambdaLR`` evaluates transformers' lambdas)."""

    max, min = staticmethod(max), staticmethod(min)
    cos, sqrt = staticmethod(math.cos), staticmethod(math.sqrt)

    @staticmethod
    def where_less(a, b, x, y):
        """``x() if a < b else y()``: only the branch taken is evaluated (the other may divide by zero there,
        where the graph's ``Where`` computes an infinity it does not select)."""
        return x() if a < b else y()


class Sym:
    """A float64 scalar node name of :class:`Nodes`' builder, with the operators ``+ - * /`` emitting ``Add``,
    ``Sub``, ``Mul``, ``Div`` (a Python number on either side becomes a constant)."""

    def __init__(self, m: Nodes, name: str):
        self.m, self.name = m, name

    def _op(self, op: str, a, b) -> Sym:
        return self.m.emit(op, a, b)

    # (the eight operators, one line each)
    def __add__(self, o): return self._op("Add", self, o)
    def __radd__(self, o): return self._op("Add", o, self)
    def __sub__(self, o): return self._op("Sub", self, o)
    def __rsub__(self, o): return self._op("Sub", o, self)
    def __mul__(self, o): return self._op("Mul", self, o)
    def __rmul__(self, o): return self._op("Mul", o, self)
    def __truediv__(self, o): return self._op("Div", self, o)
    def __rtruediv__(self, o): return self._op("Div", o, self)


class Nodes:
    """The formulas' arithmetic as float64 ONNX nodes appended to the builder ``b`` (:class:`Sym` values)."""

    def __init__(self, b: Builder):
        self.b = b

    def name(self, v) -> str:
        """The node name of ``v``: a :class:`Sym`'s, or a float64 constant for a Python number."""
        return v.name if isinstance(v, Sym) else self.b.const(float(v), np.float64)

    def emit(self, op: str, *args, **attrs) -> Sym:
        return Sym(self, self.b.op(op, [self.name(a) for a in args], **attrs))

    def cast(self, name: str) -> Sym:
        """The int64 scalar ``name`` (the step counter, the total) as a float64 :class:`Sym`."""
        return Sym(self, self.b.op("Cast", [name], to=onnx.TensorProto.DOUBLE))

    def max(self, a, b) -> Sym:
        return self.emit("Max", a, b)

    def min(self, a, b) -> Sym:
        return self.emit("Min", a, b)

    def cos(self, a) -> Sym:
        return self.emit("Cos", a)

    def sqrt(self, a) -> Sym:
        return self.emit("Sqrt", a)

    def where_less(self, a, b, x, y) -> Sym:
        """``Where(Less(a, b), x(), y())`` (both branches are computed, as ``Where`` needs them)."""
        return self.emit("Where", self.emit("Less", a, b), x(), y())


class Kind:
    """A learning-rate schedule, registered in :data:`SCHEDULES` under :attr:`name` (:func:`register`).

    ``needs_total``: the formula reads the total steps ``t`` (it is then a carried input of the graph and
    recorded in snapshots). ``reads_min_lr``: the decay ends at ``min_lr`` (:func:`factor` mixes it in; a
    ``min_lr`` given to another kind is refused). ``varies``: the factor is not 1 everywhere (a schedule that
    does not vary, without warmup, is the plain learning rate: no nodes). ``help``: the CLI's words for it.
    """

    name: ClassVar[str]
    needs_total: ClassVar[bool] = False
    varies: ClassVar[bool] = True
    reads_min_lr: ClassVar[bool] = False
    help: ClassVar[str] = ""

    def decay(self, m, s, t, w: int):
        """The factor after the warmup, before ``min_lr`` is mixed in: written with ``m``'s arithmetic (module
        doc), so one definition gives the Python value and the graph nodes."""
        raise NotImplementedError


#: The learning-rate schedules, by name (the CLI's ``--lr-schedule`` choices read this).
SCHEDULES: dict[str, Kind] = {}


def register(cls: type[Kind]) -> type[Kind]:
    """Register the :class:`Kind` subclass ``cls`` under ``cls.name`` (a class decorator)."""
    SCHEDULES[cls.name] = cls()
    return cls


def factor(m, kind: Kind, s, t, w: int, r: float):
    """``f(s)``: linear warmup ``s / max(1, w)`` while ``s < w``, then ``r + (1 - r) * kind.decay(...)`` with
    ``r = min_lr / lr`` (``kind.decay`` alone when ``r`` is 0 or the kind does not read ``min_lr``), with ``m``
    :class:`Floats` or :class:`Nodes`."""
    def decayed():
        f = kind.decay(m, s, t, w)
        return r + (1.0 - r) * f if kind.reads_min_lr and r else f

    return m.where_less(s, float(w), lambda: s / float(max(1, w)), decayed) if w else decayed()


@register
class Constant(Kind):
    """``constant``: ``f = 1`` (transformers' ``get_constant_schedule_with_warmup``)."""

    name = "constant"
    varies = False
    help = "constant"

    def decay(self, m, s, t, w):
        return 1.0


@register
class Linear(Kind):
    """``linear``: ``f = max(0, (t - s) / max(1, t - w))`` (transformers' ``get_linear_schedule_with_warmup``)."""

    name = "linear"
    needs_total = reads_min_lr = True
    help = "linear decay from --lr to --min-lr over all the run's steps"

    def decay(self, m, s, t, w):
        return m.max(0.0, (t - s) / m.max(1.0, t - float(w)))


@register
class Cosine(Kind):
    """``cosine``: ``f = 0.5 * (1 + cos(pi * min(1, (s - w) / max(1, t - w))))`` (transformers'
    ``get_cosine_with_min_lr_schedule_with_warmup``, ``num_cycles = 0.5``; the ``min(1, .)`` holds it at the
    end past ``t``, where transformers' would rise again)."""

    name = "cosine"
    needs_total = reads_min_lr = True
    help = "cosine decay from --lr to --min-lr over all the run's steps"

    def decay(self, m, s, t, w):
        progress = m.min(1.0, (s - float(w)) / m.max(1.0, t - float(w)))
        return 0.5 * (1.0 + m.cos(math.pi * progress))
