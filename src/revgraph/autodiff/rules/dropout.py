"""VJP of Dropout (ONNX operator spec, "Dropout"; PyTorch ``native_dropout_backward``): the cotangent times
the forward's mask and scale. The forward node is patched to write its mask output, so the backward pass reuses
the mask the forward drew rather than drawing another; a ratio that is a constant 0 passes the cotangent
through.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ...ir import Node, ValueInfo
from ..algebra import Val, where
from ..context import Ctx, ForwardPatch, PatchedVJP
from ..emitter import Emitter
from ..registry import vjp
from ._common import optional_input, padded


def _mask(e: Emitter, node: Node, patch: ForwardPatch) -> str:
    """The forward node's mask output; when it has none, ``patch`` adds one, so that the backward pass uses the
    very mask the forward drew (a second Dropout would draw another)."""
    if len(node.outputs) > 1 and node.outputs[1]:
        return node.outputs[1]
    if 1 not in patch.outputs:
        patch.outputs[1] = e.fresh(f"{node.name or 'Dropout'}/mask")
        e.types[patch.outputs[1]] = ValueInfo(patch.outputs[1], np.dtype(bool), e.dims(node.inputs[0]))
    return patch.outputs[1]


@vjp("Dropout", bounded=True, finite=True, reads=(1,), moves=True)
def dropout(ctx: Ctx, node: Node, cts: list) -> list | PatchedVJP:
    """``output = data * mask / (1 - ratio)`` in training mode, ``data`` otherwise (ONNX "Dropout", opset 13),
    so ``ddata = dy / (1 - ratio)`` where the forward's mask is true and exactly 0 elsewhere.

    ``ratio`` (an input) gets the derivative with the mask held fixed, ``dratio = sum(dy * output) / (1 -
    ratio)``: the pathwise derivative for the uniform draws the forward made (``mask = draw >= ratio`` moves
    only where ``ratio`` crosses a draw, a set of measure zero), which central differences with a fixed seed
    reproduce. It is not the derivative of the expected loss (the mask's distribution moves with ``ratio``
    too, and ``E[output] = data`` does not depend on it); PyTorch, whose ``p`` is a Python float, gives none.
    In inference mode ``ratio`` has no effect and gets no gradient."""
    e, x, g = ctx.e, node.inputs[0], cts[0]
    n = len(node.inputs)
    if g is None:
        return [None] * n
    training, ratio = optional_input(node, 2), optional_input(node, 1)
    mode = ctx.value(training) if training else np.asarray(False)
    if mode is not None and not bool(np.asarray(mode).reshape(-1)[0]):
        return padded([g], n)
    g = ctx.val(g)
    run_time = None if mode is not None else ctx.val(training)  # training_mode known only at run time

    @cache
    def scale() -> Val:  # 1 / (1 - ratio); 1 where the run-time training_mode is false (the mask is all true)
        rv = ctx.value(ratio) if ratio else np.asarray(0.5)
        if rv is not None:
            r = float(np.asarray(rv).reshape(-1)[0])
            s = ctx.val(e.scalar(1.0 / (1.0 - r) if r < 1.0 else 0.0, g.name))
        else:
            s = 1 / (1 - ctx.val(ratio).cast_like(g))
        return s if run_time is None else where(run_time, s, 1, like=None)

    rv = ctx.value(ratio) if ratio else np.asarray(0.5)
    if rv is not None and float(np.asarray(rv).reshape(-1)[0]) == 0.0:
        # ratio 0: the mask is all true and the scale 1 (``output = data``), so ``ddata = dy``: no mask pass and no
        # multiply (PyTorch's ``dropout`` returns its input for p = 0 too)
        one = lambda: ctx.val(e.scalar(1.0, g.name))
        return padded([g, (lambda: _ratio_grad(ctx, node, g, one(), run_time)) if ratio else None], n)

    patch = ForwardPatch()
    return PatchedVJP(padded([lambda: (g * scale()).select(_mask(e, node, patch), like=x),
                              (lambda: _ratio_grad(ctx, node, g, scale(), run_time)) if ratio else None], n),
                      {}, patch)


def _ratio_grad(ctx: Ctx, node: Node, g: Val, scale: Val, training: Val | None) -> Val:
    """``sum(g * output) * scale`` (``scale = 1 / (1 - ratio)``), in the ratio's dtype and shape; 0 where the
    run-time ``training`` flag is false (``output`` is ``data`` then, whatever the ratio)."""
    ratio, y = node.inputs[1], node.outputs[0]
    total = (g * y).sum(keepdims=0) * scale
    if training is not None:
        total = where(training, total, 0, like=None)
    dr = total.cast_like(ratio)
    return dr if ctx.e.rank(ratio) == 0 else dr.reshape(ctx.e.shape_of(ratio), like=ratio)
