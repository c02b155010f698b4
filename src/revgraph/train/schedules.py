"""Learning-rate schedules, gradient clipping by the global norm and weight-decay exclusions, as nodes of the
training-step graph (they run where the step runs: onnxruntime, a browser, another process).

**Schedules** (:class:`Schedule`; ``--lr-schedule``, ``--warmup-steps``, ``--min-lr``; each kind a registered
class of :mod:`revgraph.train.lr_schedules` whose formula, written once, gives both these nodes and the Python
value that run logs report). The
learning rate of the step that starts with the graph's counter ``step = s`` (0 for the first step, as
``torch.optim.lr_scheduler.LambdaLR`` evaluates its lambda at ``last_epoch = 0`` before the first step) is
``lr(s) = lr_peak * f(s)`` with warmup ``W``, total steps ``T`` and ``r = min_lr / lr_peak`` (the formulas of
transformers' ``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup`` and
``get_cosine_with_min_lr_schedule_with_warmup``, ``num_cycles = 0.5``):

- warmup, ``s < W``: ``f = s / max(1, W)`` (linear from 0);
- ``constant``: ``f = 1``;
- ``linear``: ``f = r + (1 - r) * max(0, (T - s) / max(1, T - W))``;
- ``cosine``: ``f = r + (1 - r) * 0.5 * (1 + cos(pi * min(1, (s - W) / max(1, T - W))))``.

So the decay reaches ``min_lr`` at ``s = T``, after the last step (``s = T - 1``), as in transformers; past
``T`` (steps taken after the run it was planned for) both stay at ``min_lr`` (the ``min(1, .)``: transformers'
cosine would rise again). ``f`` is computed in float64 from ``step`` (PyTorch computes it in Python floats) and
``lr(s)`` replaces the constant learning rate everywhere the update reads it: SGD's ``p - lr v``, Adam's step
size ``lr sqrt(1 - b2^t) / (1 - b1^t)`` (:meth:`revgraph.train.optimizers.Scalars.bias`, so the bias correction
uses the scheduled rate as ``torch.optim.Adam`` under ``LambdaLR`` does) and AdamW's decay ``1 - lr wd``.

The total ``T`` (linear and cosine only): ``Schedule(total_steps=T)``, or, left ``None``, the number of steps
:meth:`revgraph.Trainer.fit` takes (``epochs * ceil(samples / global step batch)``). It is not a constant of
the graph (the graph is built before ``fit`` knows the data): it is the int64 scalar input
``TrainingGraph.total`` carried from step to step unchanged, like ``step``, which ``fit`` sets before the first
step. Both are saved in checkpoints, so a resumed run computes the same rates; the checkpoint also records
``total_steps`` (:mod:`revgraph.train.run_record`), and resuming with another total (more epochs) is refused unless
overridden.

**Clipping** (``--clip-grad-norm C``): ``torch.nn.utils.clip_grad_norm_``: the global L2 norm
``n = sqrt(sum_p ||g_p||^2)`` over every trained parameter's gradient, and every gradient scaled by
``min(1, C / (n + 1e-6))``. A sparse table's gradient rows are coalesced first (repeated indices added, as in
the dense gradient PyTorch sees) and its squares summed over the coalesced rows. The nodes are the first of the
update (``TrainingGraph.n_update_nodes``) and read the gradients by their names (``tg.grads``), so
data-parallel engines clip the exchanged gradients; the sharded engine sums its shards' squares over the ranks
(an all-reduce) and feeds the sum to its update graph (``clip/dense_squares``).

**Weight-decay exclusions** (:func:`excluded`): by default weight decay is not applied to biases and 1-D
parameters (transformers' ``Trainer``: no decay on biases and normalization weights): a parameter is excluded
when it has at most one dimension or its name contains ``bias`` (any case). ``Optimizer.no_decay``:
``"default"`` (that rule), ``"none"`` (decay everything: ``--decay-all``), a tuple of ``fnmatch`` patterns
over parameter names (``--no-decay GLOB ...``), or a predicate ``(name, array) -> bool``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx

from ..errors import RevgraphError
from .lr_schedules import SCHEDULES, Floats, Kind, Nodes, factor

if TYPE_CHECKING:
    from .graphbuild import Builder

#: ``Optimizer.no_decay`` values besides patterns and predicates.
NO_DECAY_RULES = ("default", "none")

#: Added to the global norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does.
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule (module doc): ``kind`` one of :data:`SCHEDULES`, ``warmup_steps >= 0``,
    ``min_lr >= 0`` (the rate the decay ends at; at most the peak ``Optimizer.lr``), ``total_steps`` (``None``:
    the steps :meth:`revgraph.Trainer.fit` takes). Raises :class:`RevgraphError` for values out of range."""

    kind: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise RevgraphError(f"the learning-rate schedule must be a name (str), got {type(self.kind).__name__}")
        if self.kind not in SCHEDULES:
            raise RevgraphError(f"unknown learning-rate schedule {self.kind!r} (--lr-schedule); choose one of "
                                f"{', '.join(SCHEDULES)}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int | np.integer) \
                or self.warmup_steps < 0:
            raise RevgraphError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        if isinstance(self.min_lr, bool) or not isinstance(self.min_lr, int | float | np.integer | np.floating) \
                or not (np.isfinite(self.min_lr) and self.min_lr >= 0):
            raise RevgraphError(f"--min-lr must be a finite number >= 0, got {self.min_lr!r}")
        if self.total_steps is not None and (isinstance(self.total_steps, bool)
                                             or not isinstance(self.total_steps, int | np.integer)
                                             or self.total_steps < 1):
            raise RevgraphError(f"total_steps must be a positive integer, got {self.total_steps!r}")
        if not self.rule.reads_min_lr and self.min_lr:
            takers = [k for k, v in SCHEDULES.items() if v.reads_min_lr]
            names = f"{', '.join(takers[:-1])} and {takers[-1]}" if len(takers) > 1 else takers[0]
            raise RevgraphError(f"--min-lr applies to the {names} schedules (--lr-schedule {'|'.join(takers)})")

    @property
    def rule(self) -> Kind:
        """The registered schedule ``kind`` names (:data:`revgraph.train.lr_schedules.SCHEDULES`)."""
        return SCHEDULES[self.kind]

    @property
    def needs_total(self) -> bool:
        """Whether the rate depends on the total number of steps (linear and cosine decay)."""
        return self.rule.needs_total

    @property
    def varies(self) -> bool:
        """Whether the rate changes at all (a constant schedule without warmup is the plain learning rate)."""
        return self.rule.varies or self.warmup_steps > 0

    def factor(self, step: int, total: int | None, peak: float) -> float:
        """``f(step)`` of the module doc in Python floats: the registered formula
        (:func:`revgraph.train.lr_schedules.factor`) that the graph's nodes compute too."""
        return float(factor(Floats, self.rule, float(step), float(total or 0), self.warmup_steps,
                            self.min_lr / peak))


def check_schedule(s: Schedule | None, lr: float) -> None:
    """Raise :class:`RevgraphError` when the schedule ``s`` does not fit the optimizer's peak rate ``lr``
    (``min_lr`` above it)."""
    if s is not None and s.min_lr > lr:
        raise RevgraphError(f"--min-lr {s.min_lr:g} is above the peak learning rate --lr {lr:g}; the decay ends "
                            "at min-lr: choose one below lr")


def check_clip(value) -> float | None:
    """``value`` as the clipping threshold (``None``: no clipping). Raises :class:`RevgraphError` unless it is a
    finite number > 0."""
    if value is None:
        return None
    try:
        c = float(value)
    except (TypeError, ValueError):
        raise RevgraphError(f"--clip-grad-norm must be a number, got {value!r}") from None
    if not (np.isfinite(c) and c > 0):
        raise RevgraphError(f"--clip-grad-norm must be a finite number > 0, got {value!r}")
    return c


def check_no_decay(value) -> str | tuple[str, ...] | Callable:
    """``value`` as ``Optimizer.no_decay`` (module doc): a rule name, a tuple of patterns or a callable."""
    if callable(value) or value in NO_DECAY_RULES:
        return value
    if isinstance(value, str):
        value = (value,)
    try:
        patterns = tuple(value)
    except TypeError:
        raise RevgraphError(f"no_decay must be 'default', 'none', parameter name patterns or a predicate, got "
                            f"{value!r}") from None
    if not all(isinstance(p, str) and p for p in patterns):
        raise RevgraphError(f"no_decay patterns must be non-empty strings, got {value!r}")
    return patterns


def excluded(rule: str | tuple[str, ...] | Callable, initial: dict[str, np.ndarray]) -> list[str]:
    """The parameters (of ``initial``, in its order) weight decay is not applied to under ``rule``
    (``Optimizer.no_decay``, module doc). Raises :class:`RevgraphError` for a pattern that matches no parameter."""
    if rule == "none":
        return []
    if rule == "default":
        return [p for p, a in initial.items() if np.ndim(a) <= 1 or "bias" in p.lower()]
    if callable(rule):
        return [p for p, a in initial.items() if rule(p, a)]
    for pattern in rule:
        if not any(fnmatch.fnmatchcase(p, pattern) for p in initial):
            raise RevgraphError(f"the --no-decay pattern {pattern!r} matches no trained parameter; parameters: "
                                f"{', '.join(list(initial)[:8])}{' ...' if len(initial) > 8 else ''}")
    return [p for p in initial if any(fnmatch.fnmatchcase(p, pattern) for pattern in rule)]


# ---------------------------------------------------------------------------------------------- graph nodes

def learning_rate(b: Builder, sched: Schedule, lr: float, step: str, total: str | None) -> str:
    """The float64 scalar ``lr(step)`` of the schedule ``sched`` from the peak rate ``lr`` (module doc) as nodes
    of ``b``: the registered formula (:func:`revgraph.train.lr_schedules.factor`) emitted; ``total`` is the int64
    scalar of the total steps (read by the kinds that need it)."""
    with b.scope("optim/lr_schedule"):
        m = Nodes(b)
        s = m.cast(step)
        t = m.cast(total) if sched.needs_total else None
        f = factor(m, sched.rule, s, t, sched.warmup_steps, sched.min_lr / lr)
        return b.op("Mul", [b.const(lr, np.float64), m.name(f)])


def coalesce(b: Builder, idx: str, rows: str, dt) -> tuple[str, str]:
    """Sparse gradient rows (int64 ``[K]`` indices, maybe repeated, and ``[K, ...]`` rows) as ``(unique indices
    [U], their summed rows [U, ...])``: the rows of the dense gradient that are not zero."""
    from ..autodiff.sparse import add_rows  # the race-free row scatter
    from ..ir import Node

    unique = b.fresh(f"{b.prefix}/Unique")
    inverse = b.fresh(f"{unique}:inverse")
    b.nodes.append(Node("Unique", [idx], [unique, "", inverse], {"sorted": 1}, unique))
    row_shape = b.op("Shape", [rows], start=1)
    zeros = b.op("ConstantOfShape", [b.op("Concat", [b.op("Shape", [unique]), row_shape], axis=0)],
                 value=np.zeros(1, dtype=dt))
    return unique, add_rows(b, zeros, inverse, rows)


def squares(b: Builder, g: str) -> str:
    """``sum(g ** 2)`` of a gradient, as a float64 scalar (each tensor's sum in its dtype, as PyTorch takes each
    tensor's norm in its dtype)."""
    return b.op("Cast", [b.op("ReduceSumSquare", [g], keepdims=0)], to=onnx.TensorProto.DOUBLE)


def global_norm(b: Builder, parts: list[str]) -> str:
    """``sqrt(sum(parts))``: the global L2 norm (float64 scalar) from float64 scalar squared norms."""
    return b.op("Sqrt", [parts[0] if len(parts) == 1 else b.op("Sum", parts)])


def clip_coefficient(b: Builder, max_norm: float, parts: list[str], norm: str | None = None) -> str:
    """``min(1, max_norm / (sqrt(sum(parts)) + 1e-6))`` (float64 scalar) from float64 scalar squared norms (or
    from their :func:`global_norm` ``norm``, when given)."""
    f64 = np.float64
    norm = norm or global_norm(b, parts)
    coef = b.op("Div", [b.const(max_norm, f64), b.op("Add", [norm, b.const(CLIP_EPS, f64)])])
    return b.op("Min", [b.const(1.0, f64), coef])


def scaled(b: Builder, g: str, coef: str, dt, cache: dict) -> str:
    """``g * coef`` with the float64 coefficient cast to ``g``'s dtype once per dtype (``cache``)."""
    key = np.dtype(dt)
    if key not in cache:
        cache[key] = b.op("Cast", [coef], to=onnx.helper.np_dtype_to_tensor_dtype(key))
    return b.op("Mul", [g, cache[key]])


def clipped_gradients(b: Builder, tg, max_norm: float) -> dict[str, list[str]]:
    """The gradients of ``tg`` scaled by the clipping coefficient of their global norm (module doc): ``{p: [g]}``
    for a dense parameter and ``{p: [unique indices, coalesced rows]}`` for a sparse table (rows already
    coalesced: :func:`revgraph.train.optimizers.sparse_update` with ``unique=True``)."""
    out: dict[str, list[str]] = {}
    parts = []
    with b.scope("optim/clip"):
        for p in tg.params:
            dt = tg.initial[p].dtype
            out[p] = list(coalesce(b, *tg.grads[p], dt)) if p in tg.sparse else [tg.grads[p][0]]
            parts.append(squares(b, out[p][-1]))
        tg.grad_norm = global_norm(b, parts)  # (an output of the step: torch's clip_grad_norm_ returns it too)
        coef = clip_coefficient(b, max_norm, parts, tg.grad_norm)
        cache: dict = {}
        for p in tg.params:
            out[p][-1] = scaled(b, out[p][-1], coef, tg.initial[p].dtype, cache)
    return out


def clipped_shards(b: Builder, spec, dense_squares: str, grads: dict, dtypes: dict) -> tuple[dict, dict]:
    """The clipping of a sharded update (:mod:`revgraph.train.distributed.sharding`): ``grads`` (unit -> gradient shard,
    of ``dtypes[unit]``) and the sparse tables' rows of ``spec`` scaled by the clipping coefficient of the global
    norm, whose dense part is the float64 scalar ``dense_squares`` (every rank's shards' squares, summed by the
    engine's all-reduce) and whose sparse part the coalesced rows add here (replicated tables: every rank adds
    the same). Returns ``(scaled shards, {table: [unique indices, coalesced scaled rows]})``."""
    with b.scope("optim/clip"):
        rows = {p: list(coalesce(b, *spec.grads[p], spec.initial[p].dtype)) for p in spec.sparse}
        coef = clip_coefficient(b, spec.optimizer.clip_grad_norm,
                                [dense_squares, *(squares(b, r[1]) for r in rows.values())])
        cache: dict = {}
        grads = {j: scaled(b, g, coef, dtypes[j], cache) for j, g in grads.items()}
        for p in spec.sparse:
            rows[p][1] = scaled(b, rows[p][1], coef, spec.initial[p].dtype, cache)
    return grads, rows


def flat_decay(unit, no_decay) -> bool | np.ndarray:
    """Whether weight decay applies to a rank's shard ``[lo, lo + k)`` of a flat unit of parameters
    (:class:`revgraph.train.distributed.shard_plan.Unit`: ``names`` at ``offsets`` with ``shapes``): ``True``/``False``
    when it does for every element in it, else a boolean mask of ``k`` elements (false on those of the ``no_decay``
    parameters; the zero padding decays, which leaves it zero)."""
    mask = np.ones(unit.length, bool)
    for n, o, shape in zip(unit.names, unit.offsets, unit.shapes, strict=True):
        if n in no_decay:
            mask[o:o + int(np.prod(shape, dtype=np.int64))] = False
    mine = mask[unit.lo:unit.lo + unit.k]
    return bool(mine[0]) if mine.size and (mine == mine[0]).all() else mine
