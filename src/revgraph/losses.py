"""Losses appended to a model output: :func:`loss_graph` and the registry :data:`LOSSES`.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import RevgraphError
from .graphbuild import Builder
from .ir import Graph, Node, ValueInfo
from .ssa import is_ssa, to_ssa
from .types import infer_types

#: The losses :func:`loss_graph` builds (the CLI's ``--loss`` choices read this).
LOSSES = ("cross-entropy", "mse", "bce")


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
    b = Builder(g.all_names() | {n.name for _, n in g.walk() if n.name})
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
