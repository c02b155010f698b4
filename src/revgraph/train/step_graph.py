"""The training-step graph's record: :class:`TrainingGraph`, the graph and the names of its inputs and outputs.

It sits under every module that builds or reads a step (:mod:`.optimizers` and :mod:`.precision` are below it;
:mod:`.update_nodes`, :mod:`.graphs`, the engines above), so that none of them needs an import back up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ir import Graph, ValueInfo
from .losses import LossSpec
from .optimizers import Optimizer


@dataclass
class TrainingGraph:
    """A training-step graph and the names of its inputs and outputs (see the module doc).

    ``inputs`` are the model's inputs (the batch) and ``labels`` the targets; ``params`` the parameters
    (graph inputs of their initial dtype and shape); ``state[p]`` the state inputs of parameter ``p`` (one
    per :attr:`Optimizer.slots`, of ``p``'s shape); ``step`` an int64 scalar, the number of steps taken
    before this one. Outputs: ``loss`` (float scalar), ``new_params[p]``, ``new_state[p]`` (aligned with
    ``state[p]``) and ``new_step`` (``step + 1``), last ``grad_norm`` with clipping. ``sparse`` lists the parameters
    updated row by row. ``initial`` holds the initial parameter values (the model's initializers).
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
    #: the parameters weight decay is not applied to (:func:`revgraph.train.schedules.excluded`)
    no_decay: list[str] = field(default_factory=list)
    #: linear and cosine schedules: the int64 scalar input of the schedule's total steps and its output (carried
    #: unchanged from step to step; :meth:`revgraph.Trainer.fit` sets it), else ``None``
    total: str | None = None
    new_total: str | None = None
    #: the step's precision (:data:`revgraph.train.precision.PRECISIONS`): ``"fp32"``, or ``"bf16"``/``"fp16"``
    #: products with float32 master weights (:mod:`revgraph.train.precision`)
    precision: str = "fp32"
    #: fp16: the dynamic loss scaling's names (:class:`revgraph.train.precision.LossScale`; carried state), or None
    scaling: object = None
    #: quantization-aware training: QuantizeLinear -> DequantizeLinear pairs differentiated with the
    #: straight-through estimator (recorded in a snapshot: it changes the gradients)
    straight_through: bool = False
    #: with clipping: the output of the gradients' global L2 norm before clipping (float64 scalar; what
    #: ``torch.nn.utils.clip_grad_norm_`` returns), else ``None``
    grad_norm: str | None = None

    @property
    def labels(self) -> str | None:
        """The labels input, or ``None`` when the loss has none (``output:NAME``, causal-lm on its input ids)."""
        return self.loss.labels

    def initial_state(self) -> dict[str, np.ndarray]:
        """Feeds for the first step besides the batch: the initial parameters, zero state and step 0."""
        feeds = {p: np.array(self.initial[p]) for p in self.params}
        for p in self.params:
            feeds.update({s: np.zeros_like(self.initial[p]) for s in self.state[p]})
        feeds[self.step] = np.array(0, dtype=np.int64)
        if self.total:
            feeds[self.total] = np.array(self.optimizer.schedule.total_steps or 0, dtype=np.int64)
        if self.scaling is not None:  # the fp16 loss scale and its count of good steps
            feeds.update(self.scaling.initial())
        return feeds

    def carried(self) -> list[tuple[str, str]]:
        """``(input, output)`` pairs that one step hands to the next: parameters, state and step (and the fp16
        loss scale and its count of good steps)."""
        pairs = [(p, self.new_params[p]) for p in self.params]
        for p in self.params:
            pairs += list(zip(self.state[p], self.new_state[p], strict=True))
        pairs = [*pairs, (self.step, self.new_step), *([(self.total, self.new_total)] if self.total else [])]
        return [*pairs, *(self.scaling.pairs() if self.scaling is not None else [])]

    def backward_reads(self) -> list[str]:
        """The carried inputs the forward and backward read (the grad graph of :func:`split_step`): the
        parameters, and the fp16 loss scale that seeds the backward."""
        return [*self.params, *([self.scaling.scale] if self.scaling is not None else [])]
