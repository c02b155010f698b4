"""Training graphs: a loss appended to a model output and an optimizer step, as standard ONNX nodes.

:func:`training_graph` turns an inference model into one graph that does a whole training step::

    inputs : the batch (the model's inputs), labels, every parameter, the optimizer state of each, step
    outputs: loss, the new parameters, the new optimizer state, step + 1

It is built from :func:`loss_graph` (the model plus loss nodes) and :func:`revgraph.gradient`, with the
optimizer's formulas appended as default-domain ONNX nodes (no ``ai.onnx.preview.training`` operators, so any
ONNX runtime runs it). :class:`revgraph.trainer.Trainer` runs such a graph step after step.

Losses (``labels`` is the graph input holding the targets; every loss is the mean over all elements, as the
PyTorch losses with ``reduction="mean"``):

- ``"cross-entropy"``: logits ``[..., C]`` float, labels int64 ``[...]`` (class indices in ``[0, C)``);
  ``-mean(log_softmax(logits)[..., label])`` (``torch.nn.functional.cross_entropy`` for ``[N, C]`` logits).
- ``"mse"``: output and labels of the same shape and float dtype; ``mean((output - labels)^2)``.
- ``"bce"``: logits and labels (probabilities in [0, 1]) of the same shape and float dtype;
  ``mean(softplus(z) - z * y)`` = ``torch.nn.functional.binary_cross_entropy_with_logits``. ``softplus(z)``
  is written ``m + log(exp(-m) + exp(z - m))`` with ``m = max(z, 0)``: no overflow for large ``|z|``, and the
  exact gradient ``sigmoid(z)`` also at ``z = 0`` (the derivative with respect to ``m`` vanishes, so the
  tie convention of ``Max`` does not matter).

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
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx

from .autodiff.api import gradient
from .autodiff.emitter import Emitter
from .autodiff.policies import CheckpointPolicy
from .errors import RevgraphError
from .ir import Graph, Node, ValueInfo, fresh_name
from .onnx_io import load
from .ssa import is_ssa, to_ssa
from .sync_batchnorm import inference_batchnorms
from .types import infer_types

LOSSES = ("cross-entropy", "mse", "bce")
OPTIMIZERS = ("sgd", "adam", "adamw")


# -------------------------------------------------------------------------------------------- optimizers


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


# ---------------------------------------------------------------------------------------------- building


class _Builder:
    """Appends nodes with fresh names under a prefix; shares identical constants."""

    def __init__(self, used: set[str]):
        self.used = used
        self.nodes: list[Node] = []
        self.prefix = "train"
        self._consts: dict[tuple, str] = {}

    def fresh(self, base: str) -> str:
        """A value or node name not used anywhere yet, starting with ``base``."""
        return fresh_name(base, self.used)

    scope = Emitter.scope  # ``with b.scope(prefix):`` names what is emitted inside ``<prefix>/<OpType>``

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.fresh(f"{self.prefix}/{op_type}")
        self.nodes.append(Node(op_type, inputs, [out], attrs, out))
        return out

    def const(self, value, dtype) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh("train/const")
            self.nodes.append(Node("Constant", [], [name], {"value": arr}, name))
            self._consts[key] = name
        return self._consts[key]


@dataclass
class LossSpec:
    """What :func:`loss_graph` added: the loss (a float scalar), the labels input, the model output used."""

    loss: str
    labels: str
    output: str
    kind: str


def resolve_output(model: Graph, output: str | None) -> str:
    """The model output the loss reads: ``output`` or the only output; one-line errors otherwise."""
    names = model.output_names
    if output is None:
        if len(names) == 1:
            return names[0]
        raise RevgraphError(f"the model has {len(names)} outputs ({', '.join(names)}); choose one for the loss "
                            "(--model-output NAME, or output=NAME)")
    if output not in names:
        raise RevgraphError(f"the model has no output {output!r}; its outputs are {', '.join(names)}")
    return output


def loss_graph(model: Graph, loss: str = "cross-entropy", *, output: str | None = None) -> tuple[Graph, LossSpec]:
    """A copy of ``model`` (in SSA form) with an input for the labels and a scalar loss of ``output``.

    The result's outputs are ``[loss, output]``; parameters stay initializers (so ``revgraph.check_gradients``
    can check the loss with ``wrt`` = the parameters). Labels: int64 with the logits' shape minus the last
    axis for ``"cross-entropy"``, the output's dtype and shape for ``"mse"`` and ``"bce"``. Raises
    :class:`RevgraphError` for an unknown loss, an unknown output, or an output that is not a float tensor of
    known rank (cross-entropy needs the class axis).
    """
    if loss not in LOSSES:
        raise RevgraphError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    g = (model if is_ssa(model) else to_ssa(model)).copy()
    out = resolve_output(g, output)
    vi = infer_types(g).get(out) or ValueInfo(out)
    if not vi.is_float:
        raise RevgraphError(f"the loss needs a floating-point model output; {out!r} is {vi.describe()}")
    b = _Builder(g.all_names() | {n.name for _, n in g.walk() if n.name})
    b.prefix = f"loss/{loss}"
    dt = vi.dtype
    labels = b.fresh("labels")
    if loss == "cross-entropy":
        if vi.shape is None or len(vi.shape) < 2:
            raise RevgraphError(f"cross-entropy needs logits of shape [..., classes]; {out!r} is {vi.describe()}")
        axis = len(vi.shape) - 1
        g.inputs.append(ValueInfo(labels, np.int64, vi.shape[:-1]))
        logp = b.op("LogSoftmax", [out], axis=axis)
        picked = b.op("GatherElements", [logp, b.op("Unsqueeze", [labels, b.const([axis], np.int64)])], axis=axis)
        value = b.op("Neg", [b.op("ReduceMean", [picked], keepdims=0)])
    elif loss == "mse":
        g.inputs.append(ValueInfo(labels, dt, vi.shape))
        d = b.op("Sub", [out, labels])
        value = b.op("ReduceMean", [b.op("Mul", [d, d])], keepdims=0)
    else:  # bce with logits: softplus(z) - z*y, softplus written without overflow (module doc)
        g.inputs.append(ValueInfo(labels, dt, vi.shape))
        m = b.op("Max", [out, b.const(0.0, dt)])
        lse = b.op("Log", [b.op("Add", [b.op("Exp", [b.op("Neg", [m])]), b.op("Exp", [b.op("Sub", [out, m])])])])
        value = b.op("ReduceMean", [b.op("Sub", [b.op("Add", [m, lse]), b.op("Mul", [out, labels])])], keepdims=0)
    name = b.fresh("loss")
    b.nodes.append(Node("Identity", [value], [name], name=b.fresh(f"loss/{loss}/output")))
    g.nodes.extend(b.nodes)
    g.outputs = [ValueInfo(name, dt, ()), ValueInfo(out, vi.dtype, vi.shape)]
    return g, LossSpec(name, labels, out, loss)


def trainable(model: Graph, params: Iterable[str] | None = None) -> list[str]:
    """The parameters: ``params``, checked, or every floating-point initializer in declaration order."""
    if params is None:
        names = [k for k, a in model.initializers.items() if np.asarray(a).dtype.kind == "f"]
        if not names:
            raise RevgraphError("the model has no floating-point initializers to train")
        return names
    names = list(dict.fromkeys(params))
    for p in names:
        if p not in model.initializers:
            raise RevgraphError(f"{p!r} is not an initializer of the model; parameters are its initializers")
        if np.asarray(model.initializers[p]).dtype.kind != "f":
            raise RevgraphError(f"parameter {p!r} is {np.asarray(model.initializers[p]).dtype}; only floats train")
    return names


def params_as_inputs(g: Graph, params: list[str]) -> None:
    """Turn the initializers ``params`` of ``g`` into graph inputs of the same dtype and shape (in place)."""
    for p in params:
        arr = np.asarray(g.initializers.pop(p))
        g.inputs.append(ValueInfo(p, arr.dtype, arr.shape))


@dataclass
class TrainingGraph:
    """A training-step graph and the names of its inputs and outputs (see the module doc).

    ``inputs`` are the model's inputs (the batch) and ``labels`` the targets; ``params`` the parameters
    (graph inputs of their initial dtype and shape); ``state[p]`` the state inputs of parameter ``p`` (one
    per :attr:`Optimizer.slots`, of ``p``'s shape); ``step`` an int64 scalar, the number of steps taken
    before this one. Outputs: ``loss`` (float scalar), ``new_params[p]``, ``new_state[p]`` (aligned with
    ``state[p]``) and ``new_step`` (``step + 1``). ``sparse`` lists the parameters updated row by row.
    ``initial`` holds the initial parameter values (the model's initializers).
    """

    graph: Graph
    model: Graph
    optimizer: Optimizer
    loss: LossSpec
    inputs: list[str]
    params: list[str]
    state: dict[str, list[str]]
    step: str
    new_params: dict[str, str]
    new_state: dict[str, list[str]]
    new_step: str
    sparse: list[str] = field(default_factory=list)
    initial: dict[str, np.ndarray] = field(default_factory=dict)
    #: the gradient of each parameter as the backward pass writes it: ``[g]`` (dense, of the parameter's shape)
    #: or ``[indices, rows]`` for a sparse table (int64 ``[K]``, ``[K, *shape[1:]]``)
    grads: dict[str, list[str]] = field(default_factory=dict)
    #: how many nodes at the end of ``graph`` are the optimizer's (they read only parameters, state, step
    #: and gradients): :func:`split_step` cuts the graph there
    n_update_nodes: int = 0
    #: the declared types of the gradients (shapes may be symbolic: the rows of a sparse gradient)
    grad_types: dict[str, ValueInfo] = field(default_factory=dict)
    #: ``training_graph(..., loss_seed=True)``: the scalar input scaling the loss's cotangent (gradients of
    #: ``seed * loss``; data-parallel ranks with sync_batchnorm feed their share ``n_r / N``)
    seed: str | None = None

    @property
    def labels(self) -> str:
        return self.loss.labels

    def initial_state(self) -> dict[str, np.ndarray]:
        """Feeds for the first step besides the batch: the initial parameters, zero state and step 0."""
        feeds = {p: np.array(self.initial[p]) for p in self.params}
        for p in self.params:
            feeds.update({s: np.zeros_like(self.initial[p]) for s in self.state[p]})
        feeds[self.step] = np.array(0, dtype=np.int64)
        return feeds

    def carried(self) -> list[tuple[str, str]]:
        """``(input, output)`` pairs that one step hands to the next: parameters, state and step."""
        pairs = [(p, self.new_params[p]) for p in self.params]
        for p in self.params:
            pairs += list(zip(self.state[p], self.new_state[p], strict=True))
        return [*pairs, (self.step, self.new_step)]


def training_graph(model: Graph | onnx.ModelProto | str | os.PathLike, loss: str = "cross-entropy",
                   optimizer: Optimizer | str = "adam", *, output: str | None = None,
                   params: Iterable[str] | None = None, checkpoint: str | int | CheckpointPolicy = "store",
                   memory=None, loss_seed: bool = False) -> TrainingGraph:
    """The training-step graph of ``model`` (module doc): loss, gradients, optimizer update, as ONNX nodes.

    ``model`` is a :class:`Graph`, a ModelProto or a path; ``loss`` one of :data:`LOSSES`; ``optimizer`` an
    :class:`Optimizer` or a name (PyTorch's default hyperparameters); ``output`` the model output the loss
    reads (default: the only one); ``params`` the initializers to train (default: every float one; the
    others stay initializers); ``checkpoint`` the loop residual policy and ``memory`` the residual budget of
    :func:`revgraph.gradient` (a fraction, bytes or a ``revgraph.Budget``; the plan is ``graph.memory_plan``).
    ``loss_seed=True`` adds the scalar input ``TrainingGraph.seed`` that multiplies the loss's cotangent.
    Raises :class:`RevgraphError` (one line) for bad names or values, and what :func:`revgraph.gradient`
    raises for a model it cannot differentiate.
    """
    model = model if isinstance(model, Graph) else load(model)
    opt = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    model = model if is_ssa(model) else to_ssa(model)
    names = trainable(model, params)
    lg, spec = loss_graph(model, loss, output=output)
    params_as_inputs(lg, names)
    lg.outputs = lg.outputs[:1]
    gg = gradient(lg, spec.loss, names, sparse=True, checkpoint=checkpoint, memory=memory,
                  seed="input" if loss_seed else "ones")
    seed = next(v.name for v in gg.inputs if v.name not in set(lg.input_names)) if loss_seed else None
    b = _Builder(gg.all_names() | {n.name for _, n in gg.walk() if n.name})
    step = b.fresh("step")
    grads = grad_outputs = gg.outputs[1:]
    gg.outputs = gg.outputs[:1]
    tg = TrainingGraph(gg, model, opt, spec, list(model.input_names), names, {}, step, {}, {}, "",
                       initial={p: np.asarray(model.initializers[p]) for p in names})
    _check_representable(opt, {p: tg.initial[p].dtype for p in names})
    scalars = _Scalars(b, opt, step)
    for p in names:
        vi = ValueInfo(p, tg.initial[p].dtype, tg.initial[p].shape)
        tg.state[p] = [b.fresh(f"{p}.{slot}") for slot in opt.slots]
        gg.inputs.extend(ValueInfo(s, vi.dtype, vi.shape) for s in tg.state[p])
        if grads[0].dtype == np.dtype(np.int64):  # a gathered table: (indices, values) rows
            tg.grads[p], grads = [grads[0].name, grads[1].name], grads[2:]
            tg.sparse.append(p)
        else:
            tg.grads[p], grads = [grads[0].name], grads[1:]
    groups = _groups(tg)
    for p in names:
        if p in groups:
            continue
        b.prefix = f"optim/{p}"
        start = len(b.nodes)
        if p in tg.sparse:
            new_p, new_s = _sparse_update(b, scalars, p, *tg.grads[p], tg.state[p], tg.initial[p].dtype)
        else:
            new_p, new_s = _update(b, scalars, p, tg.grads[p][0], tg.state[p], tg.initial[p].dtype)
        tg.new_params[p], *tg.new_state[p] = _outputs(b, start, [(new_p, f"{p}.new"), *(
            (v, f"{s}.new") for s, v in zip(tg.state[p], new_s, strict=True))])
    for group in dict.fromkeys(tuple(g) for g in groups.values()):
        _group_update(b, scalars, tg, list(group))
    tg.new_params = {p: tg.new_params[p] for p in names}  # in parameter order, as the outputs
    tg.new_state = {p: tg.new_state[p] for p in names}
    b.prefix = "optim/step"
    start = len(b.nodes)
    tg.new_step = _outputs(b, start, [(b.op("Add", [step, b.const(1, np.int64)]), f"{step}.new")])[0]
    gg.nodes.extend(b.nodes)
    tg.n_update_nodes = len(b.nodes)
    tg.grad_types = {o.name: o for o in grad_outputs}
    tg.seed = seed
    # Inputs and outputs in the order of the module doc: batch, labels, parameters, state, step.
    gg.inputs.append(ValueInfo(step, np.int64, ()))
    for p in names:
        gg.outputs.append(ValueInfo(tg.new_params[p], tg.initial[p].dtype, tg.initial[p].shape))
    for p in names:
        gg.outputs.extend(ValueInfo(s, tg.initial[p].dtype, tg.initial[p].shape) for s in tg.new_state[p])
    gg.outputs.append(ValueInfo(tg.new_step, np.int64, ()))
    return tg


def split_step(tg: TrainingGraph) -> tuple[Graph, Graph]:
    """The training step as two graphs, for data-parallel training (gradients are exchanged between them).

    ``grad graph``: inputs the batch, labels and parameters (and ``tg.seed`` when there is one); outputs ``loss`` then the gradients in the order
    of ``tg.params`` (``tg.grads[p]``: one dense gradient, or ``indices`` and ``rows`` of a sparse table).
    ``update graph``: inputs the parameters, the optimizer state, ``step`` and those gradients; outputs the new
    parameters, the new state and ``step + 1`` (the outputs of ``tg.graph`` but the loss). Running the update
    graph on the grad graph's outputs is the fused step ``tg.graph``: the same nodes, cut in two.
    """
    cut = len(tg.graph.nodes) - tg.n_update_nodes
    grads = [g for p in tg.params for g in tg.grads[p]]
    grad_graph = tg.graph.copy()
    grad_graph.nodes = grad_graph.nodes[:cut]
    grad_graph.inputs = [v for v in grad_graph.inputs if v.name in {*tg.inputs, tg.labels, *tg.params, tg.seed}]
    grad_graph.outputs = [tg.graph.outputs[0], *(tg.grad_types[g] for g in grads)]
    update = tg.graph.copy()
    update.nodes = update.nodes[cut:]
    update.initializers = {}
    update.inputs = [v for v in update.inputs if v.name not in {*tg.inputs, tg.labels}]
    update.inputs += [tg.grad_types[g] for g in grads]
    update.outputs = update.outputs[1:]
    return grad_graph, update


def _check_representable(opt: Optimizer, dtypes: dict[str, np.dtype]) -> None:
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


def _groups(tg: TrainingGraph) -> dict[str, list[str]]:
    """The dense parameters updated in a group (:data:`GROUP_ELEMENTS`): each one's group, in parameter
    order, for groups of two or more tensors of one dtype and one shape but the first axis."""
    by_kind: dict[tuple, list[str]] = {}
    for p in tg.params:
        a = tg.initial[p]
        if p not in tg.sparse and a.ndim >= 1 and 0 < a.size <= GROUP_ELEMENTS:
            by_kind.setdefault((a.dtype.str, a.shape[1:]), []).append(p)
    return {p: group for group in by_kind.values() if len(group) > 1 for p in group}


def _group_update(b: _Builder, s: _Scalars, tg: TrainingGraph, group: list[str]) -> None:
    """The dense update of the parameters ``group`` (one dtype, one shape but the first axis) as one update
    of their concatenation along axis 0, split back into each parameter's new value and state."""
    b.prefix, start = f"optim/group/{group[0]}+{len(group) - 1}", len(b.nodes)
    cat = lambda values: b.op("Concat", values, axis=0)
    new_p, new_s = _update(b, s, cat(group), cat([tg.grads[p][0] for p in group]),
                           [cat([tg.state[p][j] for p in group]) for j in range(len(s.opt.slots))],
                           tg.initial[group[0]].dtype)
    sizes = b.const([tg.initial[p].shape[0] for p in group], np.int64)
    parts = []
    for value in (new_p, *new_s):
        outs = [b.fresh(f"{b.prefix}/Split") for _ in group]
        b.nodes.append(Node("Split", [value, sizes], outs, {"axis": 0}, outs[0]))
        parts.append(outs)
    names = _outputs(b, start, [(part[i], f"{base}.new") for i, p in enumerate(group)
                                for part, base in zip(parts, [p, *tg.state[p]], strict=True)])
    for i, p in enumerate(group):
        tg.new_params[p], *tg.new_state[p] = names[i * len(parts):(i + 1) * len(parts)]


def _outputs(b: _Builder, start: int, values: list[tuple[str, str]]) -> list[str]:
    """Name each ``(value, base)`` a graph output called ``base`` (made fresh); returns the names.

    The node among ``b.nodes[start:]`` that computes the value writes the output name itself, and the nodes
    after it read that name: an ``Identity`` would be one more copy of the tensor each step. An ``Identity`` is
    kept only where it is needed: for a value no such node computes (a graph input or a value computed before
    ``start``) and for a value already named as another output (two outputs of one value).
    """
    nodes = b.nodes[start:]
    producer = {o: n for n in nodes for o in n.outputs if o}
    renamed: dict[str, str] = {}
    names = []
    for value, base in values:
        name = b.fresh(base)
        node = producer.get(value)
        if node is None or value in renamed:
            b.nodes.append(Node("Identity", [renamed.get(value, value)], [name], name=b.fresh(f"{b.prefix}/output")))
        else:
            node.outputs = [name if o == value else o for o in node.outputs]
            renamed[value] = name
        names.append(name)
    if renamed:
        for n in nodes:
            n.inputs = [renamed.get(i, i) for i in n.inputs]
    return names


class _Scalars:
    """The optimizer's constants per dtype, and Adam's bias corrections computed once per graph."""

    def __init__(self, b: _Builder, opt: Optimizer, step: str):
        self.b, self.opt, self.step = b, opt, step
        self._bias: dict[np.dtype, tuple[str, str]] = {}

    def c(self, value: float, dtype) -> str:
        return self.b.const(value, dtype)

    def bias(self, dtype) -> tuple[str, str]:
        """``(lr * sqrt(1 - b2^t) / (1 - b1^t), eps * sqrt(1 - b2^t))`` in ``dtype``, computed in float64 from
        ``t = step + 1`` (as PyTorch computes its bias corrections in Python floats): the step of
        :func:`_update` with both bias corrections moved onto these two scalars."""
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


def _update(b: _Builder, s: _Scalars, p: str, g: str, state: list[str], dt) -> tuple[str, list[str]]:
    """The dense update of ``p`` (any shape) from gradient ``g``: ``(new p, new state)`` (module doc).

    Each node is one pass over the tensor, so the formulas are arranged for few passes with the same math
    as ``torch.optim`` (``torch/optim/adam.py``, ``_single_tensor_adam``): ``m' = b1 m + (1 - b1) g`` (PyTorch's
    ``lerp(m, g, 1 - b1)`` to rounding; measured a little faster than ``m + (1 - b1)(g - m)``, which reads
    one tensor more); ``v' = b2 v + ((1 - b2) g) g`` (``addcmul``); ``p' = p - a * (m' / (sqrt(v') + e))`` with the
    scalars ``a = lr sqrt(bc2) / bc1`` and ``e = eps sqrt(bc2)`` (:meth:`_Scalars.bias`), which is
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


def _sparse_update(b: _Builder, s: _Scalars, p: str, idx: str, rows: str, state: list[str],
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
    new_p_rows, new_s_rows = _update(b, s, p_rows, g, s_rows, dt)
    at = b.op("Unsqueeze", [unique, axis1])  # unique indices: ScatterND without reduction is well defined
    new_p = b.op("ScatterND", [p, at, new_p_rows])
    return new_p, [b.op("ScatterND", [v, at, r]) for v, r in zip(state, new_s_rows, strict=True)]


def eval_graph(tg: TrainingGraph) -> Graph:
    """The model plus its loss with the parameters as inputs: outputs ``[loss, model output]`` (what
    :meth:`Trainer.evaluate` runs with the current parameters). Training-mode ``BatchNormalization`` nodes
    normalize with their running statistics here (``torch.nn.Module.eval()``;
    :func:`revgraph.sync_batchnorm.inference_batchnorms`)."""
    g, _ = loss_graph(tg.model, tg.loss.kind, output=tg.loss.output)
    inference_batchnorms(g)
    params_as_inputs(g, tg.params)
    return g


def graph_size(graph: Graph | onnx.ModelProto) -> tuple[int, int, int, int]:
    """``(nodes, nodes in subgraphs, initializers, serialized bytes)`` of a graph, for reports."""
    from .onnx_io import to_onnx

    model = graph if isinstance(graph, onnx.ModelProto) else to_onnx(graph)
    total = top = len(model.graph.node)
    stack = list(model.graph.node)
    while stack:
        node = stack.pop()
        for a in node.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for sub in subs:
                total += len(sub.node)
                stack.extend(sub.node)
    return total, total - top, len(model.graph.initializer), model.ByteSize()
