"""Optimizers as ONNX nodes: :class:`Optimizer`, its factories and the registry :data:`OPTIMIZERS`, and the
update formulas appended to a training graph (:func:`update`, :func:`sparse_update`, :func:`group_update`).

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

Small dense parameters (:data:`GROUP_ELEMENTS`) of one dtype and one shape but the first axis are updated as
one concatenation, split back: the same formulas element by element, in fewer onnxruntime nodes.

Sparse tables. A parameter read only through ``Gather`` (an embedding table) gets its gradient as rows
(``revgraph.gradient(..., sparse=True)``). Its update touches the gathered rows only: the row indices are
made unique (``Unique``; repeated rows have their gradients added), the rows of the parameter and of its
state are gathered, the dense formula above runs on them, and ``ScatterND`` writes them back. For plain SGD
without weight decay this is exactly the dense update (the other rows have a zero gradient). With momentum,
Adam or weight decay it is a *lazy* update, as ``torch.optim.SparseAdam`` does: rows not in the batch keep
their parameter and state unchanged (their momentum does not decay, weight decay does not shrink them),
and the bias correction uses the global step.

Small dense parameters (:data:`GROUP_ELEMENTS`) of one dtype and one shape but the first axis are updated as
one concatenation, split back: the same formulas element by element, in fewer onnxruntime nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx

from .errors import RevgraphError
from .graphbuild import Builder, name_outputs
from .ir import Node

if TYPE_CHECKING:
    from .train import TrainingGraph

#: The optimizers :class:`Optimizer` knows (the CLI's ``--optimizer`` choices read this).
OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclass(frozen=True)
class Optimizer:
    """An optimizer's kind and hyperparameters (formulas in the module doc).

    ``kind`` is ``"sgd"``, ``"adam"`` or ``"adamw"``; ``lr > 0``; ``momentum`` in [0, 1) (SGD only);
    ``betas`` in [0, 1) and ``eps > 0`` (Adam, AdamW); ``weight_decay >= 0``. Raises :class:`RevgraphError`
    for values outside these ranges. Build one with :func:`sgd`, :func:`adam`, :func:`adamw` or
    :func:`make_optimizer`.
    """

    kind: str
    lr: float
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise RevgraphError(f"unknown optimizer {self.kind!r}; choose one of {', '.join(OPTIMIZERS)}")
        checks = [
            (self.lr > 0, f"learning rate must be positive, got {self.lr}"),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            (self.kind == "sgd" or self.momentum == 0, "momentum applies to sgd only; Adam has betas"),
            (all(0 <= b < 1 for b in self.betas), f"betas must be in [0, 1), got {self.betas}"),
            (self.eps > 0, f"eps must be positive, got {self.eps}"),
            (self.weight_decay >= 0, f"weight decay must be >= 0, got {self.weight_decay}"),
        ]
        if not np.isfinite([self.lr, self.momentum, self.eps, self.weight_decay, *self.betas]).all():
            raise RevgraphError("optimizer hyperparameters must be finite numbers")
        for ok, message in checks:
            if not ok:
                raise RevgraphError(message)

    @property
    def slots(self) -> tuple[str, ...]:
        """Names of the per-parameter state tensors (each of the parameter's shape, zero at the start)."""
        if self.kind == "sgd":
            return ("momentum",) if self.momentum else ()
        return ("m", "v")


def sgd(lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0) -> Optimizer:
    """``torch.optim.SGD(lr, momentum, dampening=0, weight_decay, nesterov=False)``."""
    return Optimizer("sgd", lr, momentum=momentum, weight_decay=weight_decay)


def adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0) -> Optimizer:
    """``torch.optim.Adam(lr, betas, eps, weight_decay)`` (L2 penalty added to the gradient)."""
    return Optimizer("adam", lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


def adamw(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01) -> Optimizer:
    """``torch.optim.AdamW(lr, betas, eps, weight_decay)`` (decoupled weight decay; PyTorch's default 0.01)."""
    return Optimizer("adamw", lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


def make_optimizer(name: str, *, lr: float | None = None, momentum: float | None = None,
                   weight_decay: float | None = None) -> Optimizer:
    """The optimizer called ``name`` with PyTorch's defaults for the arguments left ``None`` (SGD: lr 0.01,
    the others 1e-3; AdamW weight decay 0.01). Raises :class:`RevgraphError` for an unknown name or values
    out of range."""
    if name not in OPTIMIZERS:
        raise RevgraphError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    kw = {k: v for k, v in (("lr", lr), ("weight_decay", weight_decay)) if v is not None}
    if name == "sgd":
        return sgd(momentum=momentum or 0.0, **kw)
    if momentum:
        raise RevgraphError(f"--momentum applies to sgd only; {name} uses betas (0.9, 0.999)")
    return adam(**kw) if name == "adam" else adamw(**kw)


def check_representable(opt: Optimizer, dtypes: dict[str, np.dtype]) -> None:
    """Raise :class:`RevgraphError` when a hyperparameter overflows the dtype of a parameter it updates (a
    learning rate of 1e308 is infinite in float32, and would train to NaN weights)."""
    values = {"learning rate": opt.lr, "momentum": opt.momentum, "weight decay": opt.weight_decay, "eps": opt.eps}
    for p, dt in dtypes.items():
        for what, v in values.items():
            if abs(v) > float(np.finfo(dt).max):
                raise RevgraphError(f"the {what} {v:g} does not fit in {np.dtype(dt).name}, the dtype of parameter "
                                    f"{p!r}; choose a value below {np.finfo(dt).max:.3g}")


#: Dense parameters of at most this many elements are updated together, per dtype and trailing shape: one
#: ``Concat`` per input, one flat update, one ``Split`` per output, instead of an update per tensor. Each node
#: costs onnxruntime a fixed overhead, which dominates the passes over a small tensor; the concatenation and
#: the split are two more copies, which dominate for a large one.
GROUP_ELEMENTS = 4096


def update_groups(tg: TrainingGraph) -> dict[str, list[str]]:
    """The dense parameters updated in a group (:data:`GROUP_ELEMENTS`): each one's group, in parameter
    order, for groups of two or more tensors of one dtype and one shape but the first axis."""
    by_kind: dict[tuple, list[str]] = {}
    for p in tg.params:
        a = tg.initial[p]
        if p not in tg.sparse and a.ndim >= 1 and 0 < a.size <= GROUP_ELEMENTS:
            by_kind.setdefault((a.dtype.str, a.shape[1:]), []).append(p)
    return {p: group for group in by_kind.values() if len(group) > 1 for p in group}


def group_update(b: Builder, s: Scalars, tg: TrainingGraph, group: list[str]) -> None:
    """The dense update of the parameters ``group`` (one dtype, one shape but the first axis) as one update
    of their concatenation along axis 0, split back into each parameter's new value and state."""
    b.prefix, start = f"optim/group/{group[0]}+{len(group) - 1}", len(b.nodes)
    cat = lambda values: b.op("Concat", values, axis=0)
    new_p, new_s = update(b, s, cat(group), cat([tg.grads[p][0] for p in group]),
                           [cat([tg.state[p][j] for p in group]) for j in range(len(s.opt.slots))],
                           tg.initial[group[0]].dtype)
    sizes = b.const([tg.initial[p].shape[0] for p in group], np.int64)
    parts = []
    for value in (new_p, *new_s):
        outs = [b.fresh(f"{b.prefix}/Split") for _ in group]
        b.nodes.append(Node("Split", [value, sizes], outs, {"axis": 0}, outs[0]))
        parts.append(outs)
    names = name_outputs(b, start, [(part[i], f"{base}.new") for i, p in enumerate(group)
                                for part, base in zip(parts, [p, *tg.state[p]], strict=True)])
    for i, p in enumerate(group):
        tg.new_params[p], *tg.new_state[p] = names[i * len(parts):(i + 1) * len(parts)]


class Scalars:
    """The optimizer's constants per dtype, and Adam's bias corrections computed once per graph."""

    def __init__(self, b: Builder, opt: Optimizer, step: str):
        self.b, self.opt, self.step = b, opt, step
        self._bias: dict[np.dtype, tuple[str, str]] = {}

    def c(self, value: float, dtype) -> str:
        return self.b.const(value, dtype)

    def bias(self, dtype) -> tuple[str, str]:
        """``(lr * sqrt(1 - b2^t) / (1 - b1^t), eps * sqrt(1 - b2^t))`` in ``dtype``, computed in float64 from
        ``t = step + 1`` (as PyTorch computes its bias corrections in Python floats): the step of
        :func:`update` with both bias corrections moved onto these two scalars."""
        if dtype not in self._bias:
            b, (b1, b2) = self.b, self.opt.betas
            with b.scope("optim/bias_correction"):
                f64 = np.float64
                t = b.op("Cast", [b.op("Add", [self.step, b.const(1, np.int64)])], to=onnx.TensorProto.DOUBLE)
                bc1 = b.op("Sub", [b.const(1.0, f64), b.op("Pow", [b.const(b1, f64), t])])
                sqrt_bc2 = b.op("Sqrt", [b.op("Sub", [b.const(1.0, f64), b.op("Pow", [b.const(b2, f64), t])])])
                to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
                step = b.op("Div", [b.op("Mul", [b.const(self.opt.lr, f64), sqrt_bc2]), bc1])
                eps = b.op("Mul", [b.const(self.opt.eps, f64), sqrt_bc2])
                self._bias[dtype] = (b.op("Cast", [step], to=to), b.op("Cast", [eps], to=to))
        return self._bias[dtype]


def update(b: Builder, s: Scalars, p: str, g: str, state: list[str], dt) -> tuple[str, list[str]]:
    """The dense update of ``p`` (any shape) from gradient ``g``: ``(new p, new state)`` (module doc).

    Each node is one pass over the tensor, so the formulas are arranged for few passes with the same math
    as ``torch.optim`` (``torch/optim/adam.py``, ``_single_tensor_adam``): ``m' = b1 m + (1 - b1) g`` (PyTorch's
    ``lerp(m, g, 1 - b1)`` to rounding; measured a little faster than ``m + (1 - b1)(g - m)``, which reads
    one tensor more); ``v' = b2 v + ((1 - b2) g) g`` (``addcmul``); ``p' = p - a * (m' / (sqrt(v') + e))`` with the
    scalars ``a = lr sqrt(bc2) / bc1`` and ``e = eps sqrt(bc2)`` (:meth:`Scalars.bias`), which is
    PyTorch's ``p - lr / bc1 * m' / (sqrt(v') / sqrt(bc2) + eps)`` multiplied through by ``sqrt(bc2)``.
    Adam: 12 nodes per tensor (14 with weight decay, 13 for AdamW); SGD with momentum: 4 (6 with decay).
    """
    opt = s.opt
    wd = opt.weight_decay
    if opt.kind == "sgd":
        if wd:  # Momentum's norm_coefficient: the gradient of 0.5 * wd * ||p||^2 added to g
            g = b.op("Add", [g, b.op("Mul", [s.c(wd, dt), p])])
        if not opt.momentum:
            return b.op("Sub", [p, b.op("Mul", [s.c(opt.lr, dt), g])]), []
        v = b.op("Add", [b.op("Mul", [s.c(opt.momentum, dt), state[0]]), g])
        return b.op("Sub", [p, b.op("Mul", [s.c(opt.lr, dt), v])]), [v]
    b1, b2 = opt.betas
    if opt.kind == "adam" and wd:
        g = b.op("Add", [g, b.op("Mul", [s.c(wd, dt), p])])
    if opt.kind == "adamw" and wd:  # decoupled decay, before the step (torch.optim.AdamW)
        p = b.op("Mul", [p, s.c(1.0 - opt.lr * wd, dt)])
    m = b.op("Add", [b.op("Mul", [s.c(b1, dt), state[0]]), b.op("Mul", [s.c(1.0 - b1, dt), g])])
    v = b.op("Add", [b.op("Mul", [s.c(b2, dt), state[1]]), b.op("Mul", [b.op("Mul", [g, s.c(1.0 - b2, dt)]), g])])
    step_size, eps = s.bias(dt)
    denom = b.op("Add", [b.op("Sqrt", [v]), eps])
    return b.op("Sub", [p, b.op("Mul", [step_size, b.op("Div", [m, denom])])]), [m, v]


def sparse_update(b: Builder, s: Scalars, p: str, idx: str, rows: str, state: list[str],
                   dt) -> tuple[str, list[str]]:
    """The lazy row update of table ``p`` (``[R, ...]``) from gradient rows ``idx`` (int64 ``[K]``, in
    ``[0, R)``, maybe repeated) and ``rows`` (``[K, ...]``): coalesce, gather, update, scatter back."""
    from .autodiff.sparse import add_rows  # the race-free row scatter

    unique = b.fresh(f"{b.prefix}/Unique")
    inverse = b.fresh(f"{unique}:inverse")
    b.nodes.append(Node("Unique", [idx], [unique, "", inverse], {"sorted": 1}, unique))
    # Coalesce: repeated indices add their rows into zeros of [U, ...] (add_rows: ScatterElements, race free).
    row_shape = b.op("Shape", [rows], start=1)
    zeros = b.op("ConstantOfShape", [b.op("Concat", [b.op("Shape", [unique]), row_shape], axis=0)],
                 value=np.zeros(1, dtype=dt))
    axis1 = b.const([1], np.int64)
    g = add_rows(b, zeros, inverse, rows)
    p_rows = b.op("Gather", [p, unique], axis=0)
    s_rows = [b.op("Gather", [v, unique], axis=0) for v in state]
    new_p_rows, new_s_rows = update(b, s, p_rows, g, s_rows, dt)
    at = b.op("Unsqueeze", [unique, axis1])  # unique indices: ScatterND without reduction is well defined
    new_p = b.op("ScatterND", [p, at, new_p_rows])
    return new_p, [b.op("ScatterND", [v, at, r]) for v, r in zip(state, new_s_rows, strict=True)]
