"""Optimizers as ONNX nodes: :class:`Optimizer`, its factories and the registry :data:`OPTIMIZERS`, and the
update formulas appended to a training graph (:func:`update`, :func:`sparse_update`, :func:`group_update`).

Each optimizer is a :class:`Method` subclass registered by name (:func:`register`): its state tensors
(:meth:`Method.slots`), the hyperparameters it reads, PyTorch's defaults for :func:`make_optimizer`, and its
update written as graph nodes (:meth:`Method.update`, given a :class:`Step`: the builder, the dtype, this
step's learning rate, the weight decay that applies). :class:`Optimizer` holds the hyperparameters and names
its method by ``kind``. The CLI's ``--optimizer`` choices and help, snapshot checks and the argument checks
read the registry, so adding an optimizer is one class here (and its line in README.md, which a test holds
to the registry).

Optimizers (``g`` the gradient, ``p`` the parameter, ``t = step + 1`` the 1-based step number):

- ``sgd`` -- ONNX ``ai.onnx.preview.training.Momentum`` in standard mode with ``alpha = momentum``,
  ``beta = 1``, ``norm_coefficient = weight_decay``, which is ``torch.optim.SGD(momentum, dampening=0,
  nesterov=False, weight_decay)``: ``g' = g + wd * p``; ``v' = momentum * v + g'`` (the buffer starts at zero,
  so the first step gives ``v' = g'``, as PyTorch's first step does); ``p' = p - lr * v'``. Without momentum
  there is no state and ``p' = p - lr * g'``.
- ``adam`` -- ONNX ``ai.onnx.preview.training.Adam`` (``alpha = beta1``, ``beta = beta2``,
  ``norm_coefficient = weight_decay``) with ``epsilon`` placed as ``torch.optim.Adam`` places it:
  ``g' = g + wd * p``; ``m' = b1 m + (1 - b1) g'``; ``v' = b2 v + (1 - b2) g'^2``;
  ``p' = p - lr / (1 - b1^t) * m' / (sqrt(v') / sqrt(1 - b2^t) + eps)``. (ONNX divides by
  ``sqrt(v') + eps`` and scales the step by ``sqrt(1 - b2^t)``; the two differ only where ``sqrt(v')`` is
  of the order of ``eps``.) The bias corrections are computed in float64, as PyTorch computes them in Python.
- ``adamw`` -- ``torch.optim.AdamW``: Adam without ``g' = g + wd p``, and the decoupled decay applied before
  the step, ``p <- p * (1 - lr * wd)``. (ONNX Adam's ``norm_coefficient_post`` decays after the step instead,
  which differs by a factor ``1 - lr * wd`` on the step.)

With :mod:`revgraph.train.schedules`, ``lr`` above is this step's scheduled rate (``Optimizer.lr`` is the peak), ``g``
is the clipped gradient, and ``wd`` is 0 for the parameters weight decay skips (``Optimizer.no_decay``).

Small dense parameters (:data:`GROUP_ELEMENTS`) of one dtype and one shape but the first axis are updated as
one concatenation, split back: the same formulas element by element, in fewer onnxruntime nodes.

Sparse tables. A parameter read only through ``Gather`` (an embedding table) gets its gradient as rows
(``revgraph.gradient(..., sparse=True)``); the row indices are made unique (``Unique``; repeated rows have their
gradients added). ``Optimizer.embedding_update`` says how the table is updated from them (:func:`sparse_update`):

- ``"dense"`` (default): exactly ``torch.optim.SGD/Adam/AdamW`` on the dense gradient, whose rows outside the
  batch are zero, without building that ``[R, ...]`` gradient: the formula above runs once over the whole table
  with the zero-gradient terms left out (``m' = b1 m``, ``v' = b2 v``, ``v' = momentum * v``, weight decay, and
  the parameter step that the decayed moments still take), once on the gathered rows with their gradient, and
  ``ScatterND`` writes those rows over the first result. Plain SGD without weight decay leaves the other rows
  unchanged, so it is the row update alone. (A registered method that is not ``Method.elementwise`` gets the
  rows scattered into a dense gradient instead.)
- ``"lazy"``: the row update alone, ``torch.optim.SparseAdam``'s semantics: rows not in the batch keep their
  parameter and state unchanged (their moments do not decay, weight decay does not shrink them), and the bias
  correction uses the global step. Cheaper for a large table (no pass over it), but not torch's dense update
  with momentum, Adam or weight decay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx

from .. import validate as V
from ..errors import RevgraphError
from .graphbuild import Builder
from .schedules import Schedule, check_clip, check_no_decay, check_schedule, coalesce, learning_rate


class Step:
    """What an optimizer's update formula gets besides the parameter, its gradient and its state: the builder
    ``b``, the graph's shared scalars ``s`` (:class:`Scalars`: this step's learning rate, Adam's bias
    corrections), the dtype ``dt`` of the tensor, and the weight decay that applies to it: ``wd`` (0 where
    :func:`revgraph.train.schedules.excluded` skips the tensor) and ``mask`` (``None``, or a boolean mask of the
    tensor's shape: the elements of a flat shard that belong to decayed parameters,
    :mod:`revgraph.train.distributed.sharding`)."""

    def __init__(self, b: Builder, s: Scalars, dt, decay: bool | np.ndarray = True):
        self.b, self.s, self.dt = b, s, dt
        mask = None if isinstance(decay, bool) else np.asarray(decay, bool)
        self.wd = s.opt.weight_decay if (mask is None and decay) or (mask is not None and mask.any()) else 0.0
        self.mask = None if mask is not None and mask.all() else mask

    @property
    def opt(self) -> Optimizer:
        """The optimizer's hyperparameters."""
        return self.s.opt

    def c(self, value: float) -> str:
        """The constant ``value`` in the tensor's dtype."""
        return self.s.c(value, self.dt)

    def lr(self) -> str:
        """This step's learning rate in the tensor's dtype (a constant unless scheduled)."""
        return self.s.lr(self.dt)

    def l2(self, g: str | None, p: str) -> str | None:
        """``g + wd * p``: the gradient of the L2 penalty ``0.5 * wd * ||p||^2`` added (ONNX ``Momentum``'s and
        ``Adam``'s ``norm_coefficient``); ``g`` where no decay applies. ``g=None`` is a zero gradient:
        ``wd * p``, or ``None`` without decay."""
        if not self.wd:
            return g
        b = self.b
        coefficient = (self.c(self.wd) if self.mask is None
                       else b.const(np.where(self.mask, self.wd, 0).astype(self.dt), self.dt))
        decay = b.op("Mul", [coefficient, p])
        return decay if g is None else b.op("Add", [g, decay])

    def decoupled(self, p: str) -> str:
        """``p * (1 - lr * wd)``: decoupled weight decay (``torch.optim.AdamW``), 1 where the mask excludes;
        ``p`` where no decay applies."""
        if not self.wd:
            return p
        b, factor = self.b, self.s.decay_factor(self.dt)
        if self.mask is not None:  # 1 where the mask excludes: those elements are multiplied by one, unchanged
            factor = b.op("Where", [b.const(self.mask, np.bool_), factor, self.c(1.0)])
        return b.op("Mul", [p, factor])


class Method:
    """An optimizer algorithm, registered in :data:`OPTIMIZERS` under :attr:`name` (:func:`register`).

    ``hyperparameters``: the :class:`Optimizer` fields it reads besides ``lr`` and ``weight_decay`` (a
    ``momentum`` given to a method that does not read it is refused). ``defaults``: :func:`make_optimizer`'s
    values for ``lr`` and ``weight_decay`` (PyTorch's). ``decay``: how it applies ``weight_decay``, ``"L2
    penalty"`` or ``"decoupled decay"`` (the CLI's help says so). ``nonnegative``: the state slots that stay
    >= 0, with what each is (a snapshot holding a negative one is refused, :mod:`revgraph.train.snapshot_checks`).
    ``elementwise``: :meth:`update` computes each element from the same element of ``p``, ``g`` and the state
    (and scalars), and takes ``g=None``; :func:`sparse_update` then updates a table without its dense gradient
    (otherwise it scatters the rows into one, which is right for any formula).
    """

    name: ClassVar[str]
    hyperparameters: ClassVar[tuple[str, ...]] = ()
    defaults: ClassVar[dict[str, float]] = {"lr": 1e-3, "weight_decay": 0.0}
    decay: ClassVar[str] = "L2 penalty"
    nonnegative: ClassVar[dict[str, str]] = {}
    elementwise: ClassVar[bool] = False

    def slots(self, opt: Optimizer) -> tuple[str, ...]:
        """Names of the per-parameter state tensors (each of the parameter's shape, zero at the start)."""
        return ()

    def checks(self, opt: Optimizer) -> list[tuple[bool, str]]:
        """``(ok, message)`` checks of ``opt``'s values that this method adds to :class:`Optimizer`'s."""
        return []

    def update(self, step: Step, p: str, g: str | None, state: list[str]) -> tuple[str, list[str]]:
        """The nodes of one update of parameter ``p`` from gradient ``g`` and ``state`` (one name per slot):
        ``(new p, [new state])``, emitted with ``step.b``. ``g=None`` (asked of :attr:`elementwise` methods
        only) is a zero gradient, whose terms are left out (the rows of a table outside the batch,
        :func:`sparse_update`); a value it leaves unchanged is returned as the same name."""
        raise NotImplementedError


#: The optimizers :class:`Optimizer` knows, by name: each one's :class:`Method` (the CLI's ``--optimizer``
#: choices, the snapshot checks and the argument checks read this).
OPTIMIZERS: dict[str, Method] = {}


def register(cls: type[Method]) -> type[Method]:
    """Register the :class:`Method` subclass ``cls`` under ``cls.name`` (a class decorator)."""
    OPTIMIZERS[cls.name] = cls()
    return cls


def listed(names: list[str]) -> str:
    """``"a, b and c"``: ``names`` as a sentence lists them (for messages and help texts)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def takers(field: str) -> list[str]:
    """The registered optimizers that read the hyperparameter ``field`` (``"momentum"``)."""
    return [k for k, m in OPTIMIZERS.items() if field in m.hyperparameters]


@register
class SGD(Method):
    """``sgd`` (module doc): ``v' = momentum * v + g'``, ``p' = p - lr * v'``; no state without momentum."""

    name = "sgd"
    hyperparameters = ("momentum",)
    elementwise = True
    defaults: ClassVar[dict[str, float]] = {"lr": 0.01, "weight_decay": 0.0}

    def slots(self, opt: Optimizer) -> tuple[str, ...]:
        return ("momentum",) if opt.momentum else ()

    def update(self, step: Step, p: str, g: str | None, state: list[str]) -> tuple[str, list[str]]:
        b = step.b
        g = step.l2(g, p)
        if not step.opt.momentum:
            return (p if g is None else b.op("Sub", [p, b.op("Mul", [step.lr(), g])])), []
        v = b.op("Mul", [step.c(step.opt.momentum), state[0]])
        v = v if g is None else b.op("Add", [v, g])
        return b.op("Sub", [p, b.op("Mul", [step.lr(), v])]), [v]


@register
class Adam(Method):
    """``adam`` (module doc): first and second moments ``m``, ``v``; bias-corrected step."""

    name = "adam"
    hyperparameters = ("betas", "eps")
    elementwise = True
    nonnegative: ClassVar[dict[str, str]] = {"v": "Adam's second moment"}

    def slots(self, opt: Optimizer) -> tuple[str, ...]:
        return ("m", "v")

    def checks(self, opt: Optimizer) -> list[tuple[bool, str]]:
        return [(opt.momentum == 0, f"momentum applies to {listed(takers('momentum'))} only; Adam has betas")]

    def decayed(self, step: Step, p: str, g: str | None) -> tuple[str, str | None]:
        """``(p, g)`` with weight decay applied: Adam's L2 penalty on the gradient."""
        return p, step.l2(g, p)

    def update(self, step: Step, p: str, g: str | None, state: list[str]) -> tuple[str, list[str]]:
        """The formulas of :func:`update`'s doc: 12 nodes per tensor (14 with weight decay, 13 for AdamW);
        with ``g=None`` (a zero gradient, no L2 term) ``m' = b1 m`` and ``v' = b2 v``: 7 nodes."""
        b, (b1, b2) = step.b, step.opt.betas
        p, g = self.decayed(step, p, g)
        m = b.op("Mul", [step.c(b1), state[0]])
        m = m if g is None else b.op("Add", [m, b.op("Mul", [step.c(1.0 - b1), g])])
        v = b.op("Mul", [step.c(b2), state[1]])
        v = v if g is None else b.op("Add", [v, b.op("Mul", [b.op("Mul", [g, step.c(1.0 - b2)]), g])])
        step_size, eps = step.s.bias(step.dt)
        denom = b.op("Add", [b.op("Sqrt", [v]), eps])
        return b.op("Sub", [p, b.op("Mul", [step_size, b.op("Div", [m, denom])])]), [m, v]


@register
class AdamW(Adam):
    """``adamw`` (module doc): Adam with decoupled weight decay, applied before the step."""

    name = "adamw"
    defaults: ClassVar[dict[str, float]] = {"lr": 1e-3, "weight_decay": 0.01}
    decay = "decoupled decay"

    def decayed(self, step: Step, p: str, g: str | None) -> tuple[str, str | None]:
        return step.decoupled(p), g


#: ``Optimizer.embedding_update``'s values (module doc): torch's dense update of a gathered table, or the
#: lazy update of the batch's rows (``torch.optim.SparseAdam``).
EMBEDDING_UPDATES = ("dense", "lazy")


@dataclass(frozen=True)
class Optimizer:
    """An optimizer's kind and hyperparameters (formulas in the module doc).

    ``kind`` names its :class:`Method` in :data:`OPTIMIZERS` (``"sgd"``, ``"adam"``, ``"adamw"``); ``lr > 0`` (the peak
    rate when scheduled); ``momentum`` in [0, 1) (SGD only); ``betas`` in [0, 1) and ``eps > 0`` (Adam, AdamW);
    ``weight_decay >= 0``.
    :mod:`revgraph.train.schedules`: ``schedule`` (a :class:`~revgraph.train.schedules.Schedule`, ``None``: constant),
    ``clip_grad_norm`` (``None`` or the global-norm threshold ``> 0``) and ``no_decay`` (the parameters weight
    decay skips: ``"default"`` biases and 1-D parameters, ``"none"``, name patterns or a predicate).
    ``embedding_update``: how a table read only through ``Gather`` is updated from its gradient rows (module
    doc, :data:`EMBEDDING_UPDATES`): ``"dense"``, torch's dense update, or ``"lazy"``, the batch's rows only
    (``torch.optim.SparseAdam``). Raises :class:`RevgraphError` for values outside these ranges. Build one with
    :func:`sgd`, :func:`adam`,
    :func:`adamw` or :func:`make_optimizer`.
    """

    kind: str
    lr: float
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: Schedule | None = None
    clip_grad_norm: float | None = None
    no_decay: str | tuple[str, ...] | Callable = "default"
    embedding_update: str = "dense"

    def __post_init__(self) -> None:
        if not isinstance(self.embedding_update, str) or self.embedding_update not in EMBEDDING_UPDATES:
            raise RevgraphError(f"embedding update (--embedding-update, embedding_update=) must be "
                                f"{' or '.join(EMBEDDING_UPDATES)}, got {self.embedding_update!r}")
        object.__setattr__(self, "clip_grad_norm", check_clip(self.clip_grad_norm))
        object.__setattr__(self, "no_decay", check_no_decay(self.no_decay))
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            raise RevgraphError(f"schedule must be a revgraph.train.schedules.Schedule, got {self.schedule!r}")
        if not isinstance(self.kind, str) or self.kind not in OPTIMIZERS:
            raise RevgraphError(f"unknown optimizer {self.kind!r}; choose one of {', '.join(OPTIMIZERS)}")
        from ..validate import is_number

        # lr="0.1" was a TypeError in the comparisons below (finiteness and ranges: checked there, with the option)
        values = {"lr": self.lr, "momentum": self.momentum, "eps": self.eps, "weight_decay": self.weight_decay}
        bad = [k for k, v in values.items() if not is_number(v)]
        if bad or not isinstance(self.betas, tuple | list) or len(self.betas) != 2 or \
                not all(is_number(b) for b in self.betas):
            what = f"{bad[0]}={values[bad[0]]!r}: give a number" if bad else \
                f"betas={self.betas!r}: give two numbers in [0, 1)"
            raise RevgraphError(what)
        checks = [
            (self.lr > 0, f"learning rate must be positive (--lr, lr=), got {self.lr}"),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            *self.method.checks(self),
            (all(0 <= b < 1 for b in self.betas), f"betas must be in [0, 1), got {self.betas}"),
            (self.eps > 0, f"eps must be positive, got {self.eps}"),
            (self.weight_decay >= 0, f"weight decay must be >= 0, got {self.weight_decay}"),
        ]
        values = {"lr": self.lr, "momentum": self.momentum, "eps": self.eps, "weight_decay": self.weight_decay,
                  "betas": self.betas}
        bad = [k for k, v in values.items() if not np.isfinite(v).all()]
        if bad:  # (name the option and its value: `--lr nan` once said only "hyperparameters must be finite")
            raise RevgraphError(f"optimizer hyperparameters must be finite numbers: {bad[0]} "
                                f"(--{bad[0].replace('_', '-')}) is {values[bad[0]]}")
        for ok, message in checks:
            if not ok:
                raise RevgraphError(message)
        check_schedule(self.schedule, self.lr)

    @property
    def method(self) -> Method:
        """The algorithm ``kind`` names (:data:`OPTIMIZERS`)."""
        return OPTIMIZERS[self.kind]

    @property
    def slots(self) -> tuple[str, ...]:
        """Names of the per-parameter state tensors (each of the parameter's shape, zero at the start)."""
        return self.method.slots(self)

    def settings(self) -> dict:
        """Every setting of this optimizer that changes the numbers a step computes, JSON-able (tuples as lists),
        under the names a snapshot records them (:func:`revgraph.train.run_record.record`): ``"optimizer"`` (the kind),
        each hyperparameter field, and the schedule's ``lr_schedule``, ``warmup_steps`` and ``min_lr``. The one
        description of the optimizer that the snapshot record, the snapshot checks (:func:`setting_types`) and the
        data-parallel ranks' comparison read, so a new field is recorded, checked and compared with no list to
        update. (``no_decay`` is recorded as the parameters it resolves to, by the training graph.)"""
        import dataclasses

        out: dict = {"optimizer": self.kind}
        for f in dataclasses.fields(self):
            if f.name not in _NOT_SETTINGS:
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        s = self.schedule
        out.update(lr_schedule=s.kind if s else "constant", warmup_steps=s.warmup_steps if s else 0,
                   min_lr=s.min_lr if s else 0.0)
        return out


#: Optimizer fields that are not recorded as themselves (the kind is "optimizer"; the schedule is recorded by its
#: fields; no_decay by the parameters it names, which may come from a predicate)
_NOT_SETTINGS = ("kind", "schedule", "no_decay")


def setting_types() -> dict[str, tuple[type, ...]]:
    """The JSON types of :meth:`Optimizer.settings`' entries, read from the fields' defaults (a snapshot's record
    is checked against them: :mod:`revgraph.train.snapshot_checks`)."""
    import dataclasses

    number, optional = (int, float), (int, float, type(None))
    types: dict[str, tuple[type, ...]] = {"optimizer": (str,), "lr_schedule": (str,), "warmup_steps": (int,),
                                          "min_lr": number}
    for f in dataclasses.fields(Optimizer):
        if f.name in _NOT_SETTINGS:
            continue
        default = f.default
        types[f.name] = (list,) if isinstance(default, tuple) else (str,) if isinstance(default, str) else \
            (bool,) if isinstance(default, bool) else optional if default is None else number
    return types


def sgd(lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0, **settings) -> Optimizer:
    """``torch.optim.SGD(lr, momentum, dampening=0, weight_decay, nesterov=False)``; ``settings``: those of
    :func:`configure` (schedule, clipping, weight-decay exclusions, embedding update)."""
    return configure(Optimizer("sgd", lr, momentum=momentum, weight_decay=weight_decay), **settings)


@V.arguments(betas=V.BETAS)
def adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, **settings) -> Optimizer:
    """``torch.optim.Adam(lr, betas, eps, weight_decay)`` (L2 penalty added to the gradient); ``settings`` as
    :func:`sgd`'s."""
    return configure(Optimizer("adam", lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), **settings)


@V.arguments(betas=V.BETAS)
def adamw(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, **settings) -> Optimizer:
    """``torch.optim.AdamW(lr, betas, eps, weight_decay)`` (decoupled weight decay; PyTorch's default 0.01);
    ``settings`` as :func:`sgd`'s."""
    return configure(Optimizer("adamw", lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), **settings)


@V.arguments(name=V.TEXT, lr=V.OPTIONAL_POSITIVE, momentum=V.OPTIONAL_NON_NEGATIVE,
             weight_decay=V.OPTIONAL_NON_NEGATIVE)
def make_optimizer(name: str, *, lr: float | None = None, momentum: float | None = None,
                   weight_decay: float | None = None, **schedule) -> Optimizer:
    """The optimizer called ``name`` with PyTorch's defaults for the arguments left ``None`` (SGD: lr 0.01,
    the others 1e-3; AdamW weight decay 0.01). ``schedule``: the settings of :func:`configure`
    (``schedule=``, ``clip_grad_norm=``, ``no_decay=``, ``embedding_update=``). Raises :class:`RevgraphError` for an
    unknown name or values out of range."""
    if name not in OPTIMIZERS:
        raise RevgraphError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    method = OPTIMIZERS[name]
    if momentum and "momentum" not in method.hyperparameters:
        uses = f"uses betas {Optimizer.betas}" if "betas" in method.hyperparameters else "takes no momentum"
        raise RevgraphError(f"--momentum applies to {listed(takers('momentum'))} only; {name} {uses}")
    given = {k: v for k, v in (("lr", lr), ("weight_decay", weight_decay)) if v is not None}
    extra = {"momentum": momentum or 0.0} if "momentum" in method.hyperparameters else {}
    opt = Optimizer(name, **{**method.defaults, **given, **extra})
    return configure(opt, **schedule)


def configure(opt: Optimizer, *, schedule: Schedule | None = None, clip_grad_norm: float | None = None,
              no_decay=None, embedding_update: str | None = None) -> Optimizer:
    """``opt`` with the settings that are given (not ``None``) replaced: the :mod:`revgraph.train.schedules` ones,
    ``schedule`` (a :class:`~revgraph.train.schedules.Schedule`), ``clip_grad_norm``, ``no_decay`` (``"default"``,
    ``"none"``, patterns or a predicate), and ``embedding_update`` (``"dense"`` or ``"lazy"``,
    :data:`EMBEDDING_UPDATES`). Raises :class:`RevgraphError` for values out of range."""
    from dataclasses import replace

    given = {k: v for k, v in (("schedule", schedule), ("clip_grad_norm", clip_grad_norm), ("no_decay", no_decay),
                               ("embedding_update", embedding_update)) if v is not None}
    return replace(opt, **given) if given else opt


def check_representable(opt: Optimizer, dtypes: dict[str, np.dtype]) -> None:
    """Raise :class:`RevgraphError` when a hyperparameter overflows the dtype of a parameter it updates (a
    learning rate of 1e308 is infinite in float32, and would train to NaN weights)."""
    values = {"learning rate": opt.lr, "momentum": opt.momentum, "weight decay": opt.weight_decay, "eps": opt.eps}
    for p, dt in dtypes.items():
        for what, v in values.items():
            if abs(v) > float(np.finfo(dt).max):
                raise RevgraphError(f"the {what} {v:g} does not fit in {np.dtype(dt).name}, the dtype of parameter "
                                    f"{p!r}; choose a value below {np.finfo(dt).max:.3g}")


class Scalars:
    """The optimizer's constants per dtype, the scheduled learning rate and Adam's bias corrections, computed
    once per graph. ``total``: the int64 scalar of the schedule's total steps (linear and cosine schedules)."""

    def __init__(self, b: Builder, opt: Optimizer, step: str, total: str | None = None):
        self.b, self.opt, self.step, self.total = b, opt, step, total
        self._bias: dict[np.dtype, tuple[str, str]] = {}
        self._cast: dict[tuple, str] = {}
        self._lr64: str | None = None

    def c(self, value: float, dtype) -> str:
        return self.b.const(value, dtype)

    @property
    def scheduled(self) -> bool:
        """Whether the learning rate is a graph value computed from ``step`` (:mod:`revgraph.train.schedules`)."""
        return self.opt.schedule is not None and self.opt.schedule.varies

    def lr64(self) -> str:
        """The learning rate of this step as a float64 scalar: the constant, or the schedule's value."""
        if not self.scheduled:
            return self.b.const(self.opt.lr, np.float64)
        if self._lr64 is None:
            self._lr64 = learning_rate(self.b, self.opt.schedule, self.opt.lr, self.step, self.total)
        return self._lr64

    def _in(self, what: str, value64, dtype) -> str:
        """A float64 scalar ``value64()`` cast to ``dtype``, once per ``what`` and dtype."""
        key = (what, np.dtype(dtype))
        if key not in self._cast:
            to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
            self._cast[key] = self.b.op("Cast", [value64()], to=to)
        return self._cast[key]

    def lr(self, dtype) -> str:
        """The learning rate in ``dtype`` (a constant unless scheduled)."""
        if not self.scheduled:
            return self.c(self.opt.lr, dtype)
        return self._in("lr", self.lr64, dtype)

    def decay_factor(self, dtype) -> str:
        """AdamW's ``1 - lr * wd`` in ``dtype``, computed in float64 as PyTorch does in Python floats."""
        if not self.scheduled:
            return self.c(1.0 - self.opt.lr * self.opt.weight_decay, dtype)
        b = self.b
        return self._in("decay", lambda: b.op("Sub", [b.const(1.0, np.float64), b.op(
            "Mul", [self.lr64(), b.const(self.opt.weight_decay, np.float64)])]), dtype)

    def bias(self, dtype) -> tuple[str, str]:
        """``(lr * sqrt(1 - b2^t) / (1 - b1^t), eps * sqrt(1 - b2^t))`` in ``dtype``, computed in float64 from
        ``t = step + 1`` (as PyTorch computes its bias corrections in Python floats): the step of
        :func:`update` with both bias corrections moved onto these two scalars. ``lr`` is this step's (scheduled)
        learning rate, as ``torch.optim.Adam`` reads ``group["lr"]`` that ``LambdaLR`` set."""
        if dtype not in self._bias:
            b, (b1, b2) = self.b, self.opt.betas
            lr = self.lr64()
            with b.scope("optim/bias_correction"):
                f64 = np.float64
                t = b.op("Cast", [b.op("Add", [self.step, b.const(1, np.int64)])], to=onnx.TensorProto.DOUBLE)
                bc1 = b.op("Sub", [b.const(1.0, f64), b.op("Pow", [b.const(b1, f64), t])])
                sqrt_bc2 = b.op("Sqrt", [b.op("Sub", [b.const(1.0, f64), b.op("Pow", [b.const(b2, f64), t])])])
                to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
                step = b.op("Div", [b.op("Mul", [lr, sqrt_bc2]), bc1])
                eps = b.op("Mul", [b.const(self.opt.eps, f64), sqrt_bc2])
                self._bias[dtype] = (b.op("Cast", [step], to=to), b.op("Cast", [eps], to=to))
        return self._bias[dtype]


def update(b: Builder, s: Scalars, p: str, g: str | None, state: list[str], dt,
           decay: bool | np.ndarray = True) -> tuple[str, list[str]]:
    """The dense update of ``p`` (any shape) from gradient ``g``: ``(new p, new state)`` (module doc);
    ``g=None``: a zero gradient, its terms left out (:meth:`Method.update`).

    ``decay``: whether weight decay applies (:func:`revgraph.train.schedules.excluded`), or a boolean mask of ``p``'s
    shape (elements of a flat shard that belong to decayed parameters: :mod:`revgraph.train.distributed.sharding`).
    Each node is one pass over the tensor, so the formulas are arranged for few passes with the same math
    as ``torch.optim`` (``torch/optim/adam.py``, ``_single_tensor_adam``): ``m' = b1 m + (1 - b1) g`` (PyTorch's
    ``lerp(m, g, 1 - b1)`` to rounding; measured a little faster than ``m + (1 - b1)(g - m)``, which reads
    one tensor more); ``v' = b2 v + ((1 - b2) g) g`` (``addcmul``); ``p' = p - a * (m' / (sqrt(v') + e))`` with the
    scalars ``a = lr sqrt(bc2) / bc1`` and ``e = eps sqrt(bc2)`` (:meth:`Scalars.bias`), which is
    PyTorch's ``p - lr / bc1 * m' / (sqrt(v') / sqrt(bc2) + eps)`` multiplied through by ``sqrt(bc2)``.
    Adam: 12 nodes per tensor (14 with weight decay, 13 for AdamW); SGD with momentum: 4 (6 with decay).
    """
    return s.opt.method.update(Step(b, s, dt, decay), p, g, state)


def sparse_update(b: Builder, s: Scalars, p: str, idx: str, rows: str, state: list[str],
                  dt, *, unique: bool = False, decay: bool = True) -> tuple[str, list[str]]:
    """The update of table ``p`` (``[R, ...]``) from gradient rows ``idx`` (int64 ``[K]``, in ``[0, R)``, maybe
    repeated) and ``rows`` (``[K, ...]``), as ``s.opt.embedding_update`` says (module doc): coalesce, gather the
    rows of ``p`` and its state, update them, and ``ScatterND`` them over ``p`` and its state (``"lazy"``) or
    over the update of the whole table with a zero gradient (``"dense"``: equal to :func:`update` on the dense
    gradient, ``torch.optim``'s update, without that ``[R, ...]`` gradient; a method that is not
    ``Method.elementwise`` gets the rows scattered into zeros and :func:`update`). ``unique=True``: ``idx`` and
    ``rows`` are coalesced already (:func:`revgraph.train.schedules.coalesce`, as the clipping does before it takes
    the norm). ``decay``: whether weight decay applies to ``p``. Returns ``(new p, [new state])``."""
    if unique:
        g = rows
    else:  # repeated indices add their rows into zeros of [U, ...] (add_rows: ScatterElements, race free)
        idx, g = coalesce(b, idx, rows, dt)
    at = b.op("Unsqueeze", [idx, b.const([1], np.int64)])  # unique indices: ScatterND without reduction is well defined
    dense = s.opt.embedding_update == "dense"
    if dense and not s.opt.method.elementwise:  # a formula over the whole tensor: give it the whole gradient
        zeros = b.op("ConstantOfShape", [b.op("Shape", [p])], value=np.zeros(1, dtype=dt))
        return update(b, s, p, b.op("ScatterND", [zeros, at, g]), state, dt, decay=decay)
    p_rows = b.op("Gather", [p, idx], axis=0)
    s_rows = [b.op("Gather", [v, idx], axis=0) for v in state]
    new_p_rows, new_s_rows = update(b, s, p_rows, g, s_rows, dt, decay=decay)
    # the rows outside the batch: unchanged (lazy), or the dense formula's step with their zero gradient, which
    # is also "unchanged" for plain SGD without decay (update returns p and the state themselves then)
    base_p, base_s = update(b, s, p, None, state, dt, decay=decay) if dense else (p, state)
    new_p = b.op("ScatterND", [base_p, at, new_p_rows])
    return new_p, [b.op("ScatterND", [v, at, r]) for v, r in zip(base_s, new_s_rows, strict=True)]
