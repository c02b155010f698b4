"""The update nodes of a training step around the optimizer's formulas (:mod:`.optimizers`): dense parameters
updated in groups (one ``Concat``, one update, one ``Split``), and fp16's dynamic loss scaling wrapped around the
update (:mod:`.precision` holds its formulas and state). Both edit a :class:`.step_graph.TrainingGraph` in place,
so they sit above it, and :mod:`.graphs` calls them while it builds the step.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..ir import Node, ValueInfo
from .graphbuild import Builder, name_outputs
from .optimizers import Scalars, update
from .precision import LossScale
from .step_graph import TrainingGraph

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
        if p not in tg.sparse and a.ndim >= 1 and 0 < a.size <= GROUP_ELEMENTS:  # (decayed or not: one formula)
            by_kind.setdefault((a.dtype.str, a.shape[1:], p in tg.no_decay), []).append(p)
    return {p: group for group in by_kind.values() if len(group) > 1 for p in group}


def group_update(b: Builder, s: Scalars, tg: TrainingGraph, group: list[str],
                 grads: dict[str, list[str]] | None = None) -> None:
    """The dense update of the parameters ``group`` (one dtype, one shape but the first axis, all decayed or
    none) as one update of their concatenation along axis 0, split back into each parameter's new value and
    state. ``grads``: the gradients to use (default ``tg.grads``; the clipped ones)."""
    grads = grads or tg.grads
    b.prefix, start = f"optim/group/{group[0]}+{len(group) - 1}", len(b.nodes)
    cat = lambda values: b.op("Concat", values, axis=0)
    new_p, new_s = update(b, s, cat(group), cat([grads[p][0] for p in group]),
                           [cat([tg.state[p][j] for p in group]) for j in range(len(s.opt.slots))],
                           tg.initial[group[0]].dtype, decay=group[0] not in tg.no_decay)
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


def add_loss_scaling(tg: TrainingGraph, scaling: LossScale) -> None:
    """Insert the unscaling, the non-finite check, the skip and the scale update around the update nodes of
    ``tg`` (module doc), in place: the update reads unscaled gradients, every new parameter, state and step is
    ``Where(found, old, new)``, and ``scale``/``growth`` become carried state."""
    gg, prec = tg.graph, scaling.precision
    cut = len(gg.nodes) - tg.n_update_nodes
    head, update = gg.nodes[:cut], gg.nodes[cut:]
    b = Builder(gg.names_in_use())
    b.prefix = "loss_scale/unscale"
    dt = scaling.dtype
    inv = b.op("Reciprocal", [scaling.scale])
    unscaled: dict[str, str] = {}
    checks = []
    for p in tg.params:
        g = tg.grads[p][-1]  # the dense gradient, or a sparse table's rows
        gdt = tg.grad_types[g].dtype if g in tg.grad_types and tg.grad_types[g].dtype is not None else dt
        to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(gdt))
        factor = inv if np.dtype(gdt) == dt else b.op("Cast", [inv], to=to)
        unscaled[g] = b.op("Mul", [g, factor])
        # sum(g * 0) is NaN exactly when g holds an infinity or a NaN (and 0 for empty rows)
        total = b.op("ReduceSum", [b.op("Mul", [g, b.const(0.0, gdt)])], keepdims=0)
        to = onnx.helper.np_dtype_to_tensor_dtype(dt)
        checks.append(total if np.dtype(gdt) == dt else b.op("Cast", [total], to=to))
    found = b.op("IsNaN", [checks[0] if len(checks) == 1 else b.op("Sum", checks)])
    scaling.found = found
    pre = b.nodes
    for n in update:
        n.inputs = [unscaled.get(i, i) for i in n.inputs]
    # The skip: each new value computed under another name, then Where(found, old, new).
    olds = [(p, tg.new_params[p]) for p in tg.params]
    olds += [pair for p in tg.params for pair in zip(tg.state[p], tg.new_state[p], strict=True)]
    olds.append((tg.step, tg.new_step))
    b.nodes = []
    b.prefix = "loss_scale/skip"
    raw = {new: b.fresh(f"{new}.unchecked") for _, new in olds}
    for n in update:
        n.inputs = [raw.get(i, i) for i in n.inputs]
        n.outputs = [raw.get(o, o) for o in n.outputs]
    for old, new in olds:
        b.nodes.append(Node("Where", [found, old, raw[new]], [new], name=b.fresh(f"{b.prefix}/Where")))
    b.prefix = "loss_scale/update"
    s, good = scaling.scale, scaling.growth
    zero = b.const(0, np.int64)
    counted = b.op("Add", [good, b.const(1, np.int64)])
    grow = b.op("GreaterOrEqual", [counted, b.const(int(prec.growth_interval), np.int64)])
    grown = b.op("Mul", [s, b.const(prec.growth_factor, dt)])
    grown = b.op("Where", [b.op("IsInf", [grown]), s, grown])  # a scale that would overflow stays
    scaling.new_scale, scaling.new_growth = b.fresh(f"{s}.new"), b.fresh(f"{good}.new")
    kept = b.op("Where", [grow, grown, s])
    b.nodes.append(Node("Where", [found, b.op("Mul", [s, b.const(prec.backoff_factor, dt)]), kept],
                        [scaling.new_scale], name=b.fresh(f"{b.prefix}/Where")))
    b.nodes.append(Node("Where", [found, zero, b.op("Where", [grow, zero, counted])], [scaling.new_growth],
                        name=b.fresh(f"{b.prefix}/Where")))
    post = b.nodes
    consts = [n for n in post if n.op_type == "Constant"]
    gg.nodes = head + pre + consts + update + [n for n in post if n.op_type != "Constant"]
    tg.n_update_nodes = len(gg.nodes) - cut
    gg.inputs.append(ValueInfo(good, np.int64, ()))
    if not any(v.name == s for v in gg.inputs):
        gg.inputs.append(ValueInfo(s, dt, ()))
    gg.outputs += [ValueInfo(scaling.new_scale, dt, ()), ValueInfo(scaling.new_growth, np.int64, ())]
    tg.scaling = scaling
