"""Training graphs: a loss appended to a model output and an optimizer step, as standard ONNX nodes.

:func:`training_graph` turns an inference model into one graph that does a whole training step::

    inputs : the batch (the model's inputs), labels, every parameter, the optimizer state of each, step
    outputs: loss, the new parameters, the new optimizer state, step + 1 (and, with gradient clipping,
             grad_norm: the gradients' global L2 norm before clipping, float64, as clip_grad_norm_ returns it)

It is built from :func:`loss_graph` (the model plus loss nodes) and :func:`revgraph.gradient`, with the
optimizer's formulas appended as default-domain ONNX nodes (no ``ai.onnx.preview.training`` operators, so any
ONNX runtime runs it). :class:`revgraph.train.trainer.Trainer` runs such a graph step after step.

Losses are in :mod:`revgraph.train.losses`, optimizers and their update formulas in :mod:`revgraph.train.optimizers`.

Sparse tables. A parameter read only through ``Gather`` (an embedding table) gets its gradient as rows
(``revgraph.gradient(..., sparse=True)``), never a dense ``[R, ...]`` gradient; its update
(:func:`revgraph.train.optimizers.sparse_update`) is torch's dense update by default, or the lazy row update of
``torch.optim.SparseAdam`` with ``Optimizer.embedding_update="lazy"`` (:mod:`revgraph.train.optimizers`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import numpy as np
import onnx

from .. import validate as V
from ..autodiff.api import gradient
from ..autodiff.memory.budget import BUDGET
from ..autodiff.policies import POLICY, CheckpointPolicy, PerLoop, Recompute, parse_policy
from ..errors import RevgraphError
from ..ir import Graph, ValueInfo
from ..ir.arguments import GRAPH, MODEL, SAVABLE
from ..ir.ssa import is_ssa, to_ssa
from ..onnx_io import load
from ..onnx_io.torch_names import padding_rows
from .distributed.sync_batchnorm import inference_batchnorms
from .graphbuild import Builder, name_outputs
from .losses import LOSSES, LossSpec, loss_graph, resolve_output
from .optimizers import (
    OPTIMIZERS,
    Optimizer,
    Scalars,
    adam,
    adamw,
    check_representable,
    make_optimizer,
    sgd,
    sparse_update,
    update,
)
from .padding import mask_padding_rows, renamed_types
from .precision import autocast, make_precision, seed_with_scale
from .schedules import SCHEDULES, Schedule, clipped_gradients, excluded
from .step_graph import TrainingGraph
from .update_nodes import GROUP_ELEMENTS, add_loss_scaling, group_update, update_groups

__all__ = ["GROUP_ELEMENTS", "LOSSES", "OPTIMIZERS", "SCHEDULES", "LossSpec", "Optimizer", "Schedule",
           "TrainingGraph", "adam", "adamw",
           "eval_graph", "graph_size", "loss_graph", "make_optimizer", "params_as_inputs", "resolve_output", "sgd",
           "split_step", "trainable", "training_graph"]


@V.arguments(model=GRAPH)  # (params, freeze: revgraph.train.selection)
def trainable(model: Graph, params: Iterable[str] | None = None, freeze: Iterable[str] | None = None) -> list[str]:
    """The parameters: ``params`` (names or fnmatch globs over initializer names), or by default the LoRA
    adapters of a model that has them, else every floating-point initializer; less those ``freeze`` names, in
    declaration order. See :func:`revgraph.train.selection.select` (the errors it raises)."""
    from .selection import select

    return select(model, params, freeze)


@V.arguments(g=GRAPH, params=V.OPTIONAL_NAMES)
def params_as_inputs(g: Graph, params: list[str]) -> None:
    """Turn the initializers ``params`` of ``g`` into graph inputs of the same dtype and shape (in place)."""
    for p in params:
        arr = np.asarray(g.initializers.pop(p))
        g.inputs.append(ValueInfo(p, arr.dtype, arr.shape))


# (params, freeze: checked by revgraph.train.selection; loss_options: by revgraph.train.losses)
@V.arguments(model=MODEL, loss=V.TEXT, optimizer=V.OPTIMIZER, output=V.NAME, checkpoint=POLICY,
             memory=BUDGET, loss_seed=V.FLAG, straight_through=V.FLAG)
def training_graph(model: Graph | onnx.ModelProto | str | os.PathLike, loss: str = "cross-entropy",
                   optimizer: Optimizer | str = "adam", *, output: str | None = None,
                   params: Iterable[str] | None = None, checkpoint: str | int | CheckpointPolicy = "store",
                   memory=None, loss_seed: bool = False, loss_options: dict | None = None,
                   precision=None, freeze: Iterable[str] | None = None,
                   straight_through: bool = False) -> TrainingGraph:
    """The training-step graph of ``model`` (module doc): loss, gradients, optimizer update, as ONNX nodes.

    ``model`` is a :class:`Graph`, a ModelProto or a path; ``loss`` one of :data:`LOSSES` (``"output:NAME"``
    included) and ``loss_options`` its options (:func:`revgraph.train.losses.loss_graph`); ``optimizer`` an
    :class:`Optimizer` or a name (PyTorch's default hyperparameters); ``output`` the model output the loss
    reads (default: the only one); ``params`` the initializers to train, names or ``fnmatch`` globs, and
    ``freeze`` globs of those not to train (default: every float one, or the LoRA adapters of an adapted model;
    the others stay initializers; :func:`revgraph.train.selection.select`); ``checkpoint`` the loop residual policy and
    ``memory`` the residual budget of
    :func:`revgraph.gradient` (a fraction, bytes or a ``revgraph.Budget``; the plan is ``graph.memory_plan``),
    under which the loss option ``chunk_tokens="auto"`` (the default) may compute the output projection and the loss
    in chunks of tokens (:mod:`revgraph.train.chunked_loss`; a chunk loop is differentiated with ``recompute``).
    ``loss_seed=True`` adds the scalar input ``TrainingGraph.seed`` that multiplies the loss's cotangent.
    ``precision``: ``"fp32"`` (default), ``"bf16"``, ``"fp16"`` or a :class:`revgraph.train.precision.Precision`
    (mixed precision, fp16 with dynamic loss scaling: :mod:`revgraph.train.precision`). ``straight_through``: the
    straight-through estimator through ``QuantizeLinear -> DequantizeLinear`` pairs (quantization-aware
    training; :func:`revgraph.gradient`'s option, refused without it).
    Raises :class:`RevgraphError` (one line) for bad names or values, and what :func:`revgraph.gradient`
    raises for a model it cannot differentiate.
    """
    model = model if isinstance(model, Graph) else load(model)
    opt = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    model = model if is_ssa(model) else to_ssa(model)
    names = trainable(model, params, freeze)
    prec = make_precision(precision)
    if loss_options is not None and not isinstance(loss_options, Mapping):  # ** of a list: a TypeError
        raise RevgraphError(f"loss_options must be a mapping of option names to values, got "
                            f"{type(loss_options).__name__}")
    lg, spec = loss_graph(autocast(model, prec)[0], loss, output=output, memory=memory, **(loss_options or {}))
    if spec.recompute:  # a chunked loss: its loop keeps only the carried sum (revgraph.train.chunked_loss)
        checkpoint = PerLoop(parse_policy(checkpoint), dict.fromkeys(spec.recompute, Recompute()))
    params_as_inputs(lg, names)
    lg.outputs = lg.outputs[:1]
    # the parameters are finite: training stops at a non-finite loss and never steps with a non-finite
    # parameter (Trainer.fit), so the strong-zero guards need not follow them (issue 39: 126 of a LLaMA
    # step's 885 backward nodes tested for zeros behind the embedding table)
    gg = gradient(lg, spec.loss, names, sparse=True, checkpoint=checkpoint, memory=memory,
                  seed="input" if loss_seed or prec.scaled else "ones", finite_inputs=names,
                  straight_through=straight_through)
    seed = next(v.name for v in gg.inputs if v.name not in set(lg.input_names)) if loss_seed or prec.scaled else None
    scaling = seed_with_scale(gg, seed, loss_seed, prec, lg.outputs[0].dtype) if prec.scaled else None
    seed = seed if loss_seed else None
    b = Builder(gg.names_in_use())
    step = b.fresh("step")
    grads = grad_outputs = gg.outputs[1:]
    gg.outputs = gg.outputs[:1]
    tg = TrainingGraph(gg, model, opt, spec, list(model.input_names), names, {}, step, {}, {}, "",
                       initial={p: np.asarray(model.initializers[p]) for p in names})
    check_representable(opt, {p: tg.initial[p].dtype for p in names})
    # the patterns are checked without weight decay too: a --no-decay that matches nothing is a typo either way
    no_decay = excluded(opt.no_decay, tg.initial)
    tg.no_decay = no_decay if opt.weight_decay else []
    if opt.schedule is not None and opt.schedule.needs_total:
        tg.total = b.fresh("total_steps")
    scalars = Scalars(b, opt, step, tg.total)
    for p in names:
        vi = ValueInfo(p, tg.initial[p].dtype, tg.initial[p].shape)
        tg.state[p] = [b.fresh(f"{p}.{slot}") for slot in opt.slots]
        gg.inputs.extend(ValueInfo(s, vi.dtype, vi.shape) for s in tg.state[p])
        if grads[0].dtype == np.dtype(np.int64):  # a gathered table: (indices, values) rows
            tg.grads[p], grads = [grads[0].name, grads[1].name], grads[2:]
            tg.sparse.append(p)
        else:
            tg.grads[p], grads = [grads[0].name], grads[1:]
    padding = padding_rows(model.metadata or {})
    if padding:  # PyTorch's padding_idx: zero gradient rows (in the grad part: the exchange reads them masked)
        mb = Builder(b.used)
        renamed = mask_padding_rows(mb, tg, padding)
        gg.nodes.extend(mb.nodes)
        grad_outputs = renamed_types(grad_outputs, renamed)
    groups = update_groups(tg)
    # clipping: the first update nodes, reading the gradients by name (data-parallel: the exchanged ones)
    grads = clipped_gradients(b, tg, opt.clip_grad_norm) if opt.clip_grad_norm else tg.grads
    for p in names:
        if p in groups:
            continue
        b.prefix = f"optim/{p}"
        start = len(b.nodes)
        decay = p not in tg.no_decay
        if p in tg.sparse:
            new_p, new_s = sparse_update(b, scalars, p, *grads[p], tg.state[p], tg.initial[p].dtype,
                                         unique=bool(opt.clip_grad_norm), decay=decay)
        else:
            new_p, new_s = update(b, scalars, p, grads[p][0], tg.state[p], tg.initial[p].dtype, decay=decay)
        tg.new_params[p], *tg.new_state[p] = name_outputs(b, start, [(new_p, f"{p}.new"), *(
            (v, f"{s}.new") for s, v in zip(tg.state[p], new_s, strict=True))])
    for group in dict.fromkeys(tuple(g) for g in groups.values()):
        group_update(b, scalars, tg, list(group), grads)
    tg.new_params = {p: tg.new_params[p] for p in names}  # in parameter order, as the outputs
    tg.new_state = {p: tg.new_state[p] for p in names}
    if tg.grad_norm:  # (named in place: the node computing the norm writes the output)
        tg.grad_norm = name_outputs(b, 0, [(tg.grad_norm, "grad_norm")])[0]
    b.prefix = "optim/step"
    start = len(b.nodes)
    tg.new_step = name_outputs(b, start, [(b.op("Add", [step, b.const(1, np.int64)]), f"{step}.new")])[0]
    if tg.total:
        start = len(b.nodes)
        tg.new_total = name_outputs(b, start, [(tg.total, f"{tg.total}.new")])[0]
    gg.nodes.extend(b.nodes)
    tg.n_update_nodes = len(b.nodes)
    tg.grad_types = {o.name: o for o in grad_outputs}
    tg.seed = seed
    # Inputs and outputs in the order of the module doc: batch, labels, parameters, state, step.
    gg.inputs.append(ValueInfo(step, np.int64, ()))
    if tg.total:
        gg.inputs.append(ValueInfo(tg.total, np.int64, ()))
    for p in names:
        gg.outputs.append(ValueInfo(tg.new_params[p], tg.initial[p].dtype, tg.initial[p].shape))
    for p in names:
        gg.outputs.extend(ValueInfo(s, tg.initial[p].dtype, tg.initial[p].shape) for s in tg.new_state[p])
    gg.outputs.append(ValueInfo(tg.new_step, np.int64, ()))
    if tg.total:
        gg.outputs.append(ValueInfo(tg.new_total, np.int64, ()))
    if tg.grad_norm:
        gg.outputs.append(ValueInfo(tg.grad_norm, np.float64, ()))
    tg.precision = prec.kind
    tg.straight_through = bool(straight_through)
    if scaling is not None:
        add_loss_scaling(tg, scaling)
    return tg


@V.arguments(tg=V.TRAINING_GRAPH)
def split_step(tg: TrainingGraph) -> tuple[Graph, Graph]:
    """The training step as two graphs, for data-parallel training (gradients are exchanged between them).

    ``grad graph``: inputs the batch, labels and parameters (and ``tg.seed`` when there is one); outputs ``loss`` then
    the gradients in the order of ``tg.params`` (``tg.grads[p]``: one dense gradient, or ``indices`` and ``rows`` of a
    sparse table). ``update graph``: inputs the parameters, the optimizer state, ``step`` and those gradients; outputs
    the new parameters, the new state and ``step + 1`` (the outputs of ``tg.graph`` but the loss). Running the update
    graph on the grad graph's outputs is the fused step ``tg.graph``: the same nodes, cut in two.
    """
    cut = len(tg.graph.nodes) - tg.n_update_nodes
    grads = [g for p in tg.params for g in tg.grads[p]]
    grad_graph = tg.graph.copy()
    grad_graph.nodes = grad_graph.nodes[:cut]
    reads = {*tg.inputs, tg.labels, *tg.backward_reads(), tg.seed} - {None}  # (backward_reads: the fp16 loss scale too)
    grad_graph.inputs = [v for v in grad_graph.inputs if v.name in reads]
    grad_graph.outputs = [tg.graph.outputs[0], *(tg.grad_types[g] for g in grads)]
    update = tg.graph.copy()
    update.nodes = update.nodes[cut:]
    update.initializers = {}
    update.inputs = [v for v in update.inputs if v.name not in {*tg.inputs, tg.labels}]
    update.inputs += [tg.grad_types[g] for g in grads]
    update.outputs = update.outputs[1:]
    return grad_graph, update


@V.arguments(tg=V.TRAINING_GRAPH)
def eval_graph(tg: TrainingGraph) -> Graph:
    """The model plus its loss with the parameters as inputs: outputs ``[loss, model output]`` (what
    :meth:`Trainer.evaluate` runs with the current parameters). Training-mode ``BatchNormalization`` nodes
    normalize with their running statistics here (``torch.nn.Module.eval()``;
    :func:`revgraph.train.distributed.sync_batchnorm.inference_batchnorms`)."""
    loss, options = tg.loss.rebuild()
    g, _ = loss_graph(tg.model, loss, **options)
    inference_batchnorms(g)
    params_as_inputs(g, tg.params)
    return g


@V.arguments(graph=SAVABLE)
def graph_size(graph: Graph | onnx.ModelProto) -> tuple[int, int, int, int]:
    """``(nodes, nodes in subgraphs, initializers, serialized bytes)`` of a graph, for reports."""
    from ..onnx_io import to_onnx

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
