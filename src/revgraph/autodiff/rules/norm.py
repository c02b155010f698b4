"""VJPs of normalizations and Dropout (ONNX operator spec, "BatchNormalization", "LayerNormalization",
"InstanceNormalization", "GroupNormalization", "Dropout"; derivatives as in PyTorch's
``batch_norm_backward``/``native_layer_norm_backward`` in ``tools/autograd/derivatives.yaml`` and the
batch-norm paper, https://arxiv.org/abs/1502.03167, section 3).

Every normalization standardizes ``z`` over some axes: ``mu = mean(z)``, ``var = mean((z - mu)^2)``,
``inv = (var + eps)^(-1/2)``, ``zh = (z - mu) inv``. The rules recompute these statistics from the input in
the input's precision (never reading the forward's optional outputs, which ``stash_type`` may make float32
for a float64 input) with plain ONNX ops, so the backward graph can be differentiated again.
"""

from __future__ import annotations

import numpy as np

from ...errors import GraphError
from ...ir import Node, ValueInfo
from ..registry import Emitter, vjp


def _attr(node: Node, name: str, default: float) -> float:
    """A float attribute as the runtimes see it (ONNX float attributes are 32-bit)."""
    return float(np.float32(node.attrs.get(name, default)))


def _opt(node: Node, i: int) -> str | None:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i] else None


def _outs(out_grads: list, n: int) -> list:
    return (list(out_grads) + [None] * n)[:n]


def _work(e: Emitter, node: Node, x: str) -> str:
    """``x`` in the precision of the statistics: float32 for a float16/bfloat16 ``x`` when ``stash_type`` is 1
    (FLOAT, the default), ``x`` itself otherwise (a float64 ``x`` keeps float64: that is the exact derivative)."""
    dt = e.dtype(x)
    if node.attrs.get("stash_type", 1) == 1 and dt is not None and dt.itemsize < 4:
        return e.op("Cast", [x], to=1)
    return x


def _count(e: Emitter, z: str, axes: list[int]) -> str:
    """The number of elements of ``z`` along ``axes`` as a scalar of ``z``'s dtype (``Shape``-based when a
    dimension is not static)."""
    dims = e.dims(z)
    if dims is not None and all(isinstance(dims[a], int) for a in axes):
        return e.scalar(float(np.prod([dims[a] for a in axes])), z)
    sizes = e.op("Gather", [e.op("Shape", [z]), e.ints(axes)], axis=0)
    return e.op("CastLike", [e.op("ReduceProd", [sizes], keepdims=0), z])


class Stats:
    """The standardization of ``z`` over ``axes`` (keepdims shapes), emitted once per rule."""

    def __init__(self, e: Emitter, z: str, axes: list[int], eps: float):
        self.e, self.z, self.axes = e, z, e.ints(axes)
        self.axis_list = axes
        mu = e.op("ReduceMean", [z, self.axes], keepdims=1)
        self.d = e.op("Sub", [z, mu], like=z)
        var = e.op("ReduceMean", [e.op("Mul", [self.d, self.d], like=z), self.axes], keepdims=1)
        self.inv = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [var, e.scalar(eps, z)])])])
        self.zh = e.op("Mul", [self.d, self.inv], like=z)

    def vjp(self, gzh: str | None, g_mean: str | None = None, g_var: str | None = None,
            g_inv: str | None = None) -> str:
        """``dz`` from the cotangents of ``zh`` and of the statistics (keepdims shapes; ``None`` is zero):
        ``inv (gzh - mean(gzh) - zh mean(gzh zh))`` (PyTorch's ``batch_norm_backward``, training branch), plus
        ``g_mean / n`` and ``(g_var - inv^3 g_inv / 2) 2 (z - mu) / n`` (``dvar/dz = 2 (z - mu) / n``,
        ``dinv/dvar = -inv^3 / 2``)."""
        e, z = self.e, self.z
        parts = []
        if gzh is not None:
            m1 = e.op("ReduceMean", [gzh, self.axes], keepdims=1)
            m2 = e.op("ReduceMean", [e.op("Mul", [gzh, self.zh], like=z), self.axes], keepdims=1)
            centred = e.op("Sub", [e.op("Sub", [gzh, m1], like=z), e.op("Mul", [self.zh, m2], like=z)], like=z)
            parts.append(e.op("Mul", [self.inv, centred], like=z))
        n = _count(e, z, self.axis_list) if (g_mean or g_var or g_inv) else None
        if g_mean is not None:
            parts.append(e.op("Expand", [e.op("Div", [g_mean, n]), e.shape_of(z)], like=z))
        if g_inv is not None:
            inv3 = e.op("Mul", [e.op("Mul", [self.inv, self.inv]), self.inv])
            from_inv = e.op("Mul", [e.op("Mul", [g_inv, inv3]), e.scalar(-0.5, z)])
            g_var = from_inv if g_var is None else e.op("Add", [g_var, from_inv])
        if g_var is not None:
            coef = e.op("Div", [e.op("Mul", [g_var, e.scalar(2.0, z)]), n])
            parts.append(e.op("Mul", [coef, self.d], like=z))
        if not parts:
            return e.zeros_like(z)
        return parts[0] if len(parts) == 1 else e.op("Sum", parts, like=z)


def _back(e: Emitter, g: str | None, x: str) -> str | None:
    """``g`` in ``x``'s dtype (the statistics may be computed in another precision, the forward's statistics
    outputs may be float32, and BatchNormalization's inputs may have three float types); ``None`` stays."""
    if g is None or (e.dtype(g) is not None and e.dtype(g) == e.dtype(x)):
        return g
    return e.op("CastLike", [g, x], shape=e.dims(g), dtype=e.dtype(x))


# ---------------------------------------------------------------------------------------------- LayerNorm


@vjp("LayerNormalization")
def layer_norm(e: Emitter, node: Node, out_grads: list) -> list:
    """Standardization over ``[axis, rank)`` then ``Y = zh * Scale + B`` (ONNX "LayerNormalization");
    ``Scale`` and ``B`` broadcast unidirectionally, so their gradients are summed back with ``reduce_to``.
    The optional ``Mean`` and ``InvStdDev`` outputs carry gradients to ``X`` too."""
    x, scale = node.inputs[:2]
    bias = _opt(node, 2)
    gy, g_mean, g_inv = _outs(out_grads, 3)
    grads: list = [None] * len(node.inputs)
    rank = e.need_rank(x, node)
    axis = int(node.attrs.get("axis", -1))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise GraphError(f"{node.label()}: axis {node.attrs.get('axis')} is out of range for rank {rank}")
    if gy is not None and bias is not None and e.need[2]:
        grads[2] = e.reduce_to(gy, bias)
    if not (e.need[0] or (gy is not None and e.need[1])):
        return grads
    z = _work(e, node, x)
    st = Stats(e, z, list(range(axis, rank)), _attr(node, "epsilon", 1e-5))
    if gy is not None and e.need[1]:
        grads[1] = e.reduce_to(e.op("Mul", [gy, _back(e, st.zh, x)], like=x), scale)
    if e.need[0]:
        gzh = None if gy is None else _back(e, e.op("Mul", [gy, scale], like=x), z)
        grads[0] = _back(e, st.vjp(gzh, _back(e, g_mean, z), g_inv=_back(e, g_inv, z)), x)
    return grads


# ---------------------------------------------------------------------------------------------- per channel


def _per_channel(e: Emitter, v: str, rank: int) -> str:
    """A ``[C]`` vector as ``[1, C, 1, ..., 1]``, to broadcast along axis 1 of a rank-``rank`` tensor."""
    return e.op("Unsqueeze", [v, e.ints([0, *range(2, rank)])])


def _affine_grads(e: Emitter, node: Node, grads: list, gy: str, xh: str, rank: int) -> None:
    """Gradients of ``scale`` and ``B`` (both ``[C]``, inputs 1 and 2) of ``Y = xh * scale + B``."""
    axes = e.ints([0, *range(2, rank)])
    if e.need[1]:
        grads[1] = _back(e, e.op("ReduceSum", [e.op("Mul", [gy, xh]), axes], keepdims=0), node.inputs[1])
    if e.need[2]:
        grads[2] = _back(e, e.op("ReduceSum", [gy, axes], keepdims=0), node.inputs[2])


@vjp("BatchNormalization")
def batch_norm(e: Emitter, node: Node, out_grads: list) -> list:
    """ONNX "BatchNormalization" (opset 15). Inference (``training_mode=0``):
    ``Y = (X - mean) inv scale + B`` with ``inv = (var + eps)^(-1/2)``, so ``dX = dY scale inv``,
    ``dmean = -sum(dY) scale inv`` and ``dvar = -sum(dY xh) scale inv^2 / 2``. Training: the statistics are
    the batch's own (population variance over every axis but 1), and ``running_mean = mean m + mu (1 - m)``,
    ``running_var = var m + sigma^2 (1 - m)`` with ``m`` the momentum carry gradients to X, input_mean and
    input_var as those formulas say. Everything is computed in X's dtype and cast back per input."""
    x, scale, bias, mean, var = node.inputs[:5]
    gy, g_rmean, g_rvar = _outs(out_grads, 3)
    grads: list = [None] * len(node.inputs)
    rank = e.need_rank(x, node)
    axes = e.ints([0, *range(2, rank)])
    eps = _attr(node, "epsilon", 1e-5)

    def chan(v: str) -> str:
        return _per_channel(e, _back(e, v, x), rank)

    def total(v: str, like: str) -> str:  # sum over every axis but the channel's, in ``like``'s dtype
        return _back(e, e.op("ReduceSum", [v, axes], keepdims=0), like)

    if not node.attrs.get("training_mode", 0):
        if gy is None:
            return grads
        inv = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [chan(var), e.scalar(eps, x)])])])
        scale_inv = e.op("Mul", [chan(scale), inv])
        if e.need[0]:
            grads[0] = e.op("Mul", [gy, scale_inv], like=x)
        if e.need[1] or e.need[4]:
            xh = e.op("Mul", [e.op("Sub", [x, chan(mean)], like=x), inv], like=x)
            gxh = e.op("Mul", [gy, xh], like=x)
            grads[1] = total(gxh, scale) if e.need[1] else None
            if e.need[4]:
                half = e.op("Mul", [e.op("Mul", [scale_inv, inv]), e.scalar(-0.5, x)])
                grads[4] = total(e.op("Mul", [gxh, half], like=x), var)
        if e.need[2]:
            grads[2] = total(gy, bias)
        if e.need[3]:
            grads[3] = total(e.op("Neg", [e.op("Mul", [gy, scale_inv], like=x)], like=x), mean)
        return grads

    momentum = _attr(node, "momentum", 0.9)
    if g_rmean is not None and e.need[3]:
        grads[3] = e.op("Mul", [g_rmean, e.scalar(momentum, g_rmean)], like=mean)
    if g_rvar is not None and e.need[4]:
        grads[4] = e.op("Mul", [g_rvar, e.scalar(momentum, g_rvar)], like=var)
    if gy is not None and e.need[2]:
        grads[2] = total(gy, bias)
    if not (e.need[0] or (gy is not None and e.need[1])):
        return grads
    st = Stats(e, x, [0, *range(2, rank)], eps)
    gyzh = None if gy is None else e.op("Mul", [gy, st.zh], like=x)
    if gy is not None and e.need[1]:
        grads[1] = total(gyzh, scale)
    if e.need[0] and gy is not None and g_rmean is None and g_rvar is None:
        # Stats.vjp with gzh = gy * scale, the per-channel scale taken out of the means: two passes over x fewer
        m1 = e.op("ReduceMean", [gy, st.axes], keepdims=1)
        m2 = e.op("ReduceMean", [gyzh, st.axes], keepdims=1)
        centred = e.op("Sub", [e.op("Sub", [gy, m1], like=x), e.op("Mul", [st.zh, m2], like=x)], like=x)
        grads[0] = e.op("Mul", [centred, e.op("Mul", [st.inv, chan(scale)])], like=x)
    elif e.need[0]:
        def stat(g):  # a running statistic's cotangent, as the batch statistic's: times (1 - momentum)
            return None if g is None else e.op("Mul", [chan(g), e.scalar(1.0 - momentum, x)])
        gzh = None if gy is None else e.op("Mul", [gy, chan(scale)], like=x)
        grads[0] = st.vjp(gzh, stat(g_rmean), stat(g_rvar))
    return grads


@vjp("InstanceNormalization")
def instance_norm(e: Emitter, node: Node, out_grads: list) -> list:
    """Standardization over the spatial axes ``[2, rank)`` per sample and channel, then ``* scale + B`` with
    ``[C]`` vectors (ONNX "InstanceNormalization")."""
    x, scale = node.inputs[:2]
    gy = out_grads[0]
    grads: list = [None] * len(node.inputs)
    rank = e.need_rank(x, node)
    if rank < 3:
        raise GraphError(f"{node.label()}: InstanceNormalization needs an input of rank >= 3, not {rank}")
    if not any(e.need):
        return grads
    st = Stats(e, x, list(range(2, rank)), _attr(node, "epsilon", 1e-5))
    _affine_grads(e, node, grads, gy, st.zh, rank)
    if e.need[0]:
        grads[0] = st.vjp(e.op("Mul", [gy, _per_channel(e, scale, rank)], like=x))
    return grads


@vjp("GroupNormalization")
def group_norm(e: Emitter, node: Node, out_grads: list) -> list:
    """X ``[N, C, ...]`` viewed as ``[N, G, C/G * ...]`` is standardized over its last axis, viewed back, then
    ``* scale + bias`` with ``[C]`` vectors (ONNX "GroupNormalization", opset 21)."""
    x, scale = node.inputs[:2]
    gy = out_grads[0]
    grads: list = [None] * len(node.inputs)
    rank = e.need_rank(x, node)
    if "num_groups" not in node.attrs:
        raise GraphError(f"{node.label()}: GroupNormalization needs the num_groups attribute")
    groups = int(node.attrs["num_groups"])
    if not any(e.need):
        return grads
    z = e.op("Reshape", [_work(e, node, x), e.ints([0, groups, -1])])
    st = Stats(e, z, [2], _attr(node, "epsilon", 1e-5))
    xshape = e.shape_of(x)
    xh = e.op("Reshape", [_back(e, st.zh, x), xshape], like=x)
    _affine_grads(e, node, grads, gy, xh, rank)
    if e.need[0]:
        gxh = e.op("Mul", [gy, _per_channel(e, scale, rank)], like=x)
        gz = st.vjp(_back(e, e.op("Reshape", [gxh, e.ints([0, groups, -1])]), z))
        grads[0] = e.op("Reshape", [_back(e, gz, x), xshape], like=x)
    return grads


# ---------------------------------------------------------------------------------------------- Dropout


def _mask(e: Emitter, node: Node) -> str:
    """The forward node's mask output, added to the node when it has none, so that the backward pass uses
    the very mask the forward drew (a second Dropout would draw another)."""
    if len(node.outputs) > 1 and node.outputs[1]:
        return node.outputs[1]
    name = e.fresh(f"{node.name or 'Dropout'}/mask")
    if len(node.outputs) > 1:
        node.outputs[1] = name
    else:
        node.outputs.append(name)
    e.types[name] = ValueInfo(name, np.dtype(bool), e.dims(node.inputs[0]))
    return name


@vjp("Dropout")
def dropout(e: Emitter, node: Node, out_grads: list) -> list:
    """``output = data * mask / (1 - ratio)`` in training mode, ``data`` otherwise (ONNX "Dropout", opset 13),
    so ``ddata = dy / (1 - ratio)`` where the forward's mask is true and exactly 0 elsewhere.

    ``ratio`` (an input) gets the derivative with the mask held fixed, ``dratio = sum(dy * output) / (1 -
    ratio)``: the pathwise derivative for the uniform draws the forward made (``mask = draw >= ratio`` moves
    only where ``ratio`` crosses a draw, a set of measure zero), which central differences with a fixed seed
    reproduce. It is not the derivative of the expected loss (the mask's distribution moves with ``ratio``
    too, and ``E[output] = data`` does not depend on it); PyTorch, whose ``p`` is a Python float, gives none.
    In inference mode ``ratio`` has no effect and gets no gradient."""
    x = node.inputs[0]
    g = out_grads[0]
    rest = [None] * (len(node.inputs) - 1)
    if g is None:
        return [None, *rest]
    training, ratio = _opt(node, 2), _opt(node, 1)
    mode = e.value(training) if training else np.asarray(False)
    if mode is not None and not bool(np.asarray(mode).reshape(-1)[0]):
        return [g, *rest]
    mask = _mask(e, node)
    rv = e.value(ratio) if ratio else np.asarray(0.5)
    if rv is not None:
        r = float(np.asarray(rv).reshape(-1)[0])
        scale = e.scalar(1.0 / (1.0 - r) if r < 1.0 else 0.0, g)
    else:
        one = e.scalar(1.0, g)
        scale = e.op("Div", [one, e.op("Sub", [one, e.op("CastLike", [ratio, g])])])
    if mode is None:  # training_mode only known at run time: scale 1 when it is false (the mask is all true)
        scale = e.op("Where", [training, scale, e.scalar(1.0, g)])
    grads = [e.select(mask, e.op("Mul", [g, scale], like=x), like=x), *rest]
    if ratio and e.need[1]:
        grads[1] = _ratio_grad(e, node, g, scale, training if mode is None else None)
    return grads


def _ratio_grad(e: Emitter, node: Node, g: str, scale: str, training: str | None) -> str:
    """``sum(g * output) * scale`` (``scale = 1 / (1 - ratio)``), in the ratio's dtype and shape; 0 where the
    run-time ``training`` flag is false (``output`` is ``data`` then, whatever the ratio)."""
    ratio, y = node.inputs[1], node.outputs[0]
    total = e.op("Mul", [e.op("ReduceSum", [e.op("Mul", [g, y])], keepdims=0), scale])
    if training is not None:
        total = e.op("Where", [training, total, e.scalar(0.0, g)])
    dr = e.op("CastLike", [total, ratio])
    return dr if e.rank(ratio) == 0 else e.op("Reshape", [dr, e.shape_of(ratio)], like=ratio)
