"""VJPs of normalizations and Dropout (ONNX operator spec, "BatchNormalization", "LayerNormalization",
"InstanceNormalization", "GroupNormalization", "RMSNormalization", "LpNormalization",
"MeanVarianceNormalization", "Dropout"; derivatives as in PyTorch's
``batch_norm_backward``/``native_layer_norm_backward`` in ``tools/autograd/derivatives.yaml`` and the
batch-norm paper, https://arxiv.org/abs/1502.03167, section 3).

Every normalization standardizes ``z`` over some axes: ``mu = mean(z)``, ``var = mean((z - mu)^2)``,
``inv = (var + eps)^(-1/2)``, ``zh = (z - mu) inv``. The rules recompute these statistics from the input in
the input's precision (never reading the forward's optional outputs, which ``stash_type`` may make float32
for a float64 input) with plain ONNX ops, so the backward graph can be differentiated again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, cached_property

import numpy as np

from ...errors import GraphError
from ...ir import Node, ValueInfo
from ..context import Ctx, ForwardPatch, PatchedVJP
from ..emitter import Emitter
from ..registry import vjp


def _attr(node: Node, name: str, default: float) -> float:
    """A float attribute as the runtimes see it (ONNX float attributes are 32-bit)."""
    return float(np.float32(node.attrs.get(name, default)))


def _opt(node: Node, i: int) -> str | None:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i] else None


def _pad(values: list, n: int) -> list:
    """``values`` cut or padded with ``None`` to length ``n`` (optional outputs and inputs)."""
    return (list(values) + [None] * n)[:n]


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
    """The standardization of ``z`` over ``axes`` (keepdims shapes); each statistic is emitted once, when a
    cotangent first reads it."""

    def __init__(self, e: Emitter, z: str, axes: list[int], eps: float):
        self.e, self.z, self.axis_list, self.eps = e, z, axes, eps

    @cached_property
    def axes(self) -> str:
        return self.e.ints(self.axis_list)

    @cached_property
    def d(self) -> str:
        """``z - mu``."""
        e, z = self.e, self.z
        mu = e.op("ReduceMean", [z, self.axes], keepdims=1)
        return e.op("Sub", [z, mu], like=z)

    @cached_property
    def inv(self) -> str:
        """``(var + eps)^(-1/2)``."""
        e, z = self.e, self.z
        var = e.op("ReduceMean", [e.op("Mul", [self.d, self.d], like=z), self.axes], keepdims=1)
        return e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [var, e.scalar(self.eps, z)])])])

    @cached_property
    def zh(self) -> str:
        return self.e.op("Mul", [self.d, self.inv], like=self.z)

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


# ---------------------------------------------------------------------------------------------- LayerNorm, RMSNorm


def _trailing(e: Emitter, node: Node, x: str) -> list[int]:
    """The axes ``[axis, rank)`` that LayerNormalization and RMSNormalization normalize over."""
    rank = e.need_rank(x, node)
    axis = int(node.attrs.get("axis", -1))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise GraphError(f"{node.label()}: axis {node.attrs.get('axis')} is out of range for rank {rank}")
    return list(range(axis, rank))


@vjp("LayerNormalization")
def layer_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """Standardization over ``[axis, rank)`` then ``Y = zh * Scale + B`` (ONNX "LayerNormalization");
    ``Scale`` and ``B`` broadcast unidirectionally, so their gradients are summed back with ``reduce_to``.
    The optional ``Mean`` and ``InvStdDev`` outputs carry gradients to ``X`` too."""
    e, (x, scale), bias = ctx.e, node.inputs[:2], _opt(node, 2)
    gy, g_mean, g_inv = _pad(cts, 3)
    axes = _trailing(e, node, x)

    @cache
    def st() -> Stats:
        return Stats(e, _work(e, node, x), axes, _attr(node, "epsilon", 1e-5))

    def dx() -> str:
        z = st().z
        gzh = None if gy is None else _back(e, e.op("Mul", [gy, scale], like=x), z)
        return _back(e, st().vjp(gzh, _back(e, g_mean, z), g_inv=_back(e, g_inv, z)), x)

    def dscale() -> str:
        return e.reduce_to(e.op("Mul", [gy, _back(e, st().zh, x)], like=x), scale)

    affine = [] if gy is None else [dscale, None if bias is None else lambda: e.reduce_to(gy, bias)]
    return _pad([dx, *affine], len(node.inputs))


@vjp("RMSNormalization")
def rms_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """``Y = X r Scale`` with ``r = (mean(X^2) + eps)^(-1/2)`` over ``[axis, rank)`` (ONNX "RMSNormalization",
    opset 23; Zhang and Sennrich, https://arxiv.org/abs/1910.07467; PyTorch's ``_fused_rms_norm_backward``).
    With ``xh = X r`` and ``h = dY Scale``: ``dX = r (h - xh mean(h xh))`` (``dr/dX = -r^3 X / n``) and
    ``dScale = dY xh`` summed to Scale's unidirectionally broadcast shape. ``X`` and ``Scale`` may have different
    float types (``Y`` has Scale's); the statistics are computed in ``stash_type``'s precision as
    LayerNormalization's."""
    e, (x, scale), gy = ctx.e, node.inputs[:2], cts[0]
    if gy is None:
        return [None, None]
    axes = _trailing(e, node, x)

    @cache
    def z() -> str:
        return _work(e, node, x)

    @cache
    def axes_v() -> str:
        return e.ints(axes)

    @cache
    def inv() -> str:
        ms = e.op("ReduceMean", [e.op("Mul", [z(), z()], like=z()), axes_v()], keepdims=1)
        return e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [ms, e.scalar(_attr(node, "epsilon", 1e-5), z())])])])

    @cache
    def zh() -> str:
        return e.op("Mul", [z(), inv()], like=z())

    def dx() -> str:
        h = _back(e, e.op("Mul", [gy, scale], like=gy), z())
        m = e.op("ReduceMean", [e.op("Mul", [h, zh()], like=z()), axes_v()], keepdims=1)
        d = e.op("Mul", [inv(), e.op("Sub", [h, e.op("Mul", [zh(), m], like=z())], like=z())], like=z())
        return _back(e, d, x)

    def dscale() -> str:
        return e.reduce_to(e.op("Mul", [gy, _back(e, zh(), gy)], like=gy), scale)

    return [dx, dscale]


@vjp("LpNormalization")
def lp_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """``y = x / n`` with ``n = ||x||_p`` along ``axis``, ``p`` 1 or 2, and ``y = 0`` where ``n = 0`` (ONNX
    "LpNormalization", opset 22). ``dn/dx = t`` with ``t = y`` for ``p = 2`` and ``sign(x)`` for ``p = 1``
    (the 0 subgradient of ``|x|`` at 0), so ``dx = (dy - t sum(dy y)) / n``. At a zero vector ``y`` is
    constant 0 in no neighbourhood and ONNX has no epsilon (PyTorch's ``F.normalize`` divides by ``max(n,
    eps)``, so its gradient there is ``dy / eps``): revgraph defines the gradient there as 0."""
    e, x, g = ctx.e, node.inputs[0], cts[0]
    p = int(node.attrs.get("p", 2))
    if p not in (1, 2):
        raise GraphError(f"{node.label()}: LpNormalization's p must be 1 or 2, not {p}")
    axis = int(node.attrs.get("axis", -1))
    rank = e.rank(x)
    if rank is not None and not -rank <= axis < rank:
        raise GraphError(f"{node.label()}: axis {axis} is out of range for rank {rank}")

    def dx() -> str:
        axes = e.ints([axis])
        n = e.op("ReduceL2" if p == 2 else "ReduceL1", [x, axes], keepdims=1)
        zero = e.op("Equal", [n, e.scalar(0.0, x)])
        safe = e.op("Where", [zero, e.scalar(1.0, x), n])
        y = e.op("Div", [x, safe], like=x)  # 0 on zero vectors, as the forward
        total = e.op("ReduceSum", [e.op("Mul", [g, y], like=x), axes], keepdims=1)
        t = y if p == 2 else e.op("Sign", [x], like=x)
        d = e.op("Div", [e.op("Sub", [g, e.op("Mul", [t, total], like=x)], like=x), safe], like=x)
        return e.op("Where", [zero, e.scalar(0.0, x), d], like=x)

    return [dx]


#: the epsilon of MeanVarianceNormalization's function body (a float32 constant)
MVN_EPSILON = float(np.float32(1e-9))


@vjp("MeanVarianceNormalization")
def mean_variance_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """``y = c / d`` over ``axes`` (default ``[0, 2, 3]``), ``c = x - mean(x)``, ``d = s + 1e-9``,
    ``s = sqrt(mean(c^2))`` (ONNX "MeanVarianceNormalization", opset 13: the epsilon and the population
    variance are those of its function body). ``ds/dx = c / (n s)``, so ``dx = (dy - mean(dy)) / d -
    c mean(dy c) / (s d^2)``. Where ``s = 0`` (a constant group, ``c = 0``) ``y`` is differentiable with
    ``dx = (dy - mean(dy)) / d``: the second term is taken as 0 there, as the 0 subgradient of a norm at 0."""
    e, x, g = ctx.e, node.inputs[0], cts[0]
    rank = e.need_rank(x, node)
    axes = [int(a) for a in node.attrs.get("axes", [0, 2, 3])]
    if not all(-rank <= a < rank for a in axes):
        raise GraphError(f"{node.label()}: axes {axes} are out of range for rank {rank}")
    axes = sorted({a % rank for a in axes})

    def dx() -> str:
        av = e.ints(axes)
        zero = e.scalar(0.0, x)
        c = e.op("Sub", [x, e.op("ReduceMean", [x, av], keepdims=1)], like=x)
        s = e.op("Sqrt", [e.op("ReduceMean", [e.op("Mul", [c, c], like=x), av], keepdims=1)])
        d = e.op("Add", [s, e.scalar(MVN_EPSILON, x)])
        flat = e.op("Equal", [s, zero])
        safe = e.op("Where", [flat, e.scalar(1.0, x), s])
        mgc = e.op("ReduceMean", [e.op("Mul", [g, c], like=x), av], keepdims=1)
        k = e.op("Div", [mgc, e.op("Mul", [safe, e.op("Mul", [d, d])])])
        k = e.op("Where", [flat, zero, k])
        centred = e.op("Sub", [g, e.op("ReduceMean", [g, av], keepdims=1)], like=x)
        return e.op("Sub", [e.op("Div", [centred, d], like=x), e.op("Mul", [c, k], like=x)], like=x)

    return [dx]


# ---------------------------------------------------------------------------------------------- per channel


def _per_channel(e: Emitter, v: str, rank: int) -> str:
    """A ``[C]`` vector as ``[1, C, 1, ..., 1]``, to broadcast along axis 1 of a rank-``rank`` tensor."""
    return e.op("Unsqueeze", [v, e.ints([0, *range(2, rank)])])


def _chan(e: Emitter, v: str, x: str, rank: int) -> str:
    """A ``[C]`` vector in ``x``'s dtype, shaped to broadcast along axis 1 of ``x``."""
    return _per_channel(e, _back(e, v, x), rank)


def _total(e: Emitter, v: str, rank: int, like: str) -> str:
    """``v`` summed over every axis but the channel's (axis 1), in ``like``'s dtype."""
    return _back(e, e.op("ReduceSum", [v, e.ints([0, *range(2, rank)])], keepdims=0), like)


def _affine(e: Emitter, node: Node, gy: str, gy_xh: Callable[[], str], rank: int) -> list:
    """The cotangents of ``scale`` and ``B`` (both ``[C]``, inputs 1 and 2) of ``Y = xh * scale + B``, as
    functions (``gy_xh()`` emits ``dY * xh``)."""
    scale, bias = node.inputs[1:3]
    return [lambda: _total(e, gy_xh(), rank, scale), lambda: _total(e, gy, rank, bias)]


@vjp("BatchNormalization")
def batch_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "BatchNormalization" (opset 15). Inference (``training_mode=0``):
    ``Y = (X - mean) inv scale + B`` with ``inv = (var + eps)^(-1/2)``, so ``dX = dY scale inv``,
    ``dmean = -sum(dY) scale inv`` and ``dvar = -sum(dY xh) scale inv^2 / 2``. Training: the statistics are
    the batch's own (population variance over every axis but 1), and ``running_mean = mean m + mu (1 - m)``,
    ``running_var = var m + sigma^2 (1 - m)`` with ``m`` the momentum carry gradients to X, input_mean and
    input_var as those formulas say. Everything is computed in X's dtype and cast back per input."""
    e, rank, eps = ctx.e, ctx.e.need_rank(node.inputs[0], node), _attr(node, "epsilon", 1e-5)
    if node.attrs.get("training_mode", 0):
        grads = _batch_norm_training(e, node, _pad(cts, 3), rank, eps)
    else:
        grads = [] if cts[0] is None else _batch_norm_inference(e, node, cts[0], rank, eps)
    return _pad(grads, len(node.inputs))


def _batch_norm_inference(e: Emitter, node: Node, gy: str, rank: int, eps: float) -> list:
    """The cotangents of the five inputs for ``training_mode=0`` (the given ``mean`` and ``var``)."""
    x, scale, bias, mean, var = node.inputs[:5]

    @cache
    def inv() -> str:
        return e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [_chan(e, var, x, rank), e.scalar(eps, x)])])])

    @cache
    def scale_inv() -> str:
        return e.op("Mul", [_chan(e, scale, x, rank), inv()])

    @cache
    def dx() -> str:
        return e.op("Mul", [gy, scale_inv()], like=x)

    @cache
    def gxh() -> str:  # dY xh
        xh = e.op("Mul", [e.op("Sub", [x, _chan(e, mean, x, rank)], like=x), inv()], like=x)
        return e.op("Mul", [gy, xh], like=x)

    def dvar() -> str:
        half = e.op("Mul", [e.op("Mul", [scale_inv(), inv()]), e.scalar(-0.5, x)])
        return _total(e, e.op("Mul", [gxh(), half], like=x), rank, var)

    return [dx, lambda: _total(e, gxh(), rank, scale), lambda: _total(e, gy, rank, bias),
            lambda: _total(e, e.op("Neg", [dx()], like=x), rank, mean), dvar]


def _batch_norm_training(e: Emitter, node: Node, cts: list, rank: int, eps: float) -> list:
    """The cotangents of the five inputs for ``training_mode=1``, from those of ``Y`` and the running statistics."""
    (x, scale, _, mean, var), (gy, g_rmean, g_rvar) = node.inputs[:5], cts
    momentum = _attr(node, "momentum", 0.9)

    @cache
    def st() -> Stats:
        return Stats(e, x, [0, *range(2, rank)], eps)

    @cache
    def gyzh() -> str:
        return e.op("Mul", [gy, st().zh], like=x)

    def dx() -> str:
        if gy is not None and g_rmean is None and g_rvar is None:
            # Stats.vjp with gzh = gy * scale, the per-channel scale taken out of the means: two passes over x fewer
            m1 = e.op("ReduceMean", [gy, st().axes], keepdims=1)
            m2 = e.op("ReduceMean", [gyzh(), st().axes], keepdims=1)
            centred = e.op("Sub", [e.op("Sub", [gy, m1], like=x), e.op("Mul", [st().zh, m2], like=x)], like=x)
            return e.op("Mul", [centred, e.op("Mul", [st().inv, _chan(e, scale, x, rank)])], like=x)

        def stat(g):  # a running statistic's cotangent, as the batch statistic's: times (1 - momentum)
            return None if g is None else e.op("Mul", [_chan(e, g, x, rank), e.scalar(1.0 - momentum, x)])
        gzh = None if gy is None else e.op("Mul", [gy, _chan(e, scale, x, rank)], like=x)
        return st().vjp(gzh, stat(g_rmean), stat(g_rvar))

    def running(g: str | None, like: str):  # the input statistic's share of the running one: times momentum
        return None if g is None else lambda: e.op("Mul", [g, e.scalar(momentum, g)], like=like)

    affine = [None, None] if gy is None else _affine(e, node, gy, gyzh, rank)
    return [dx, *affine, running(g_rmean, mean), running(g_rvar, var)]


@vjp("InstanceNormalization")
def instance_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """Standardization over the spatial axes ``[2, rank)`` per sample and channel, then ``* scale + B`` with
    ``[C]`` vectors (ONNX "InstanceNormalization")."""
    e, (x, scale), gy = ctx.e, node.inputs[:2], cts[0]
    rank = e.need_rank(x, node)
    if rank < 3:
        raise GraphError(f"{node.label()}: InstanceNormalization needs an input of rank >= 3, not {rank}")

    @cache
    def st() -> Stats:
        return Stats(e, x, list(range(2, rank)), _attr(node, "epsilon", 1e-5))

    return [lambda: st().vjp(e.op("Mul", [gy, _per_channel(e, scale, rank)], like=x)),
            *_affine(e, node, gy, lambda: e.op("Mul", [gy, st().zh]), rank)]


@vjp("GroupNormalization")
def group_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """X ``[N, C, ...]`` viewed as ``[N, G, C/G * ...]`` is standardized over its last axis, viewed back, then
    ``* scale + bias`` with ``[C]`` vectors (ONNX "GroupNormalization", opset 21)."""
    e, (x, scale), gy = ctx.e, node.inputs[:2], cts[0]
    rank = e.need_rank(x, node)
    if "num_groups" not in node.attrs:
        raise GraphError(f"{node.label()}: GroupNormalization needs the num_groups attribute")
    groups = [0, int(node.attrs["num_groups"]), -1]  # the [N, G, C/G * ...] view

    @cache
    def st() -> Stats:
        return Stats(e, e.op("Reshape", [_work(e, node, x), e.ints(groups)]), [2], _attr(node, "epsilon", 1e-5))

    @cache
    def xshape() -> str:
        return e.shape_of(x)

    def dx() -> str:
        gxh = e.op("Mul", [gy, _per_channel(e, scale, rank)], like=x)
        gz = st().vjp(_back(e, e.op("Reshape", [gxh, e.ints(groups)]), st().z))
        return e.op("Reshape", [_back(e, gz, x), xshape()], like=x)

    def gy_xh() -> str:
        return e.op("Mul", [gy, e.op("Reshape", [_back(e, st().zh, x), xshape()], like=x)])

    return [dx, *_affine(e, node, gy, gy_xh, rank)]


# ---------------------------------------------------------------------------------------------- Dropout


def _mask(e: Emitter, node: Node, patch: ForwardPatch) -> str:
    """The forward node's mask output; when it has none, ``patch`` adds one, so that the backward pass uses the
    very mask the forward drew (a second Dropout would draw another)."""
    if len(node.outputs) > 1 and node.outputs[1]:
        return node.outputs[1]
    if 1 not in patch.outputs:
        patch.outputs[1] = e.fresh(f"{node.name or 'Dropout'}/mask")
        e.types[patch.outputs[1]] = ValueInfo(patch.outputs[1], np.dtype(bool), e.dims(node.inputs[0]))
    return patch.outputs[1]


@vjp("Dropout")
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
    training, ratio = _opt(node, 2), _opt(node, 1)
    mode = ctx.value(training) if training else np.asarray(False)
    if mode is not None and not bool(np.asarray(mode).reshape(-1)[0]):
        return _pad([g], n)

    @cache
    def scale() -> str:
        rv = ctx.value(ratio) if ratio else np.asarray(0.5)
        if rv is not None:
            r = float(np.asarray(rv).reshape(-1)[0])
            s = e.scalar(1.0 / (1.0 - r) if r < 1.0 else 0.0, g)
        else:
            one = e.scalar(1.0, g)
            s = e.op("Div", [one, e.op("Sub", [one, e.op("CastLike", [ratio, g])])])
        if mode is None:  # training_mode only known at run time: scale 1 when it is false (the mask is all true)
            s = e.op("Where", [training, s, e.scalar(1.0, g)])
        return s

    patch = ForwardPatch()

    def dx() -> str:
        return ctx.select(_mask(e, node, patch), e.op("Mul", [g, scale()], like=x), like=x)

    def dratio() -> str:
        return _ratio_grad(e, node, g, scale(), training if mode is None else None)

    return PatchedVJP(_pad([dx, dratio if ratio else None], n), {}, patch)


def _ratio_grad(e: Emitter, node: Node, g: str, scale: str, training: str | None) -> str:
    """``sum(g * output) * scale`` (``scale = 1 / (1 - ratio)``), in the ratio's dtype and shape; 0 where the
    run-time ``training`` flag is false (``output`` is ``data`` then, whatever the ratio)."""
    ratio, y = node.inputs[1], node.outputs[0]
    total = e.op("Mul", [e.op("ReduceSum", [e.op("Mul", [g, y])], keepdims=0), scale])
    if training is not None:
        total = e.op("Where", [training, total, e.scalar(0.0, g)])
    dr = e.op("CastLike", [total, ratio])
    return dr if e.rank(ratio) == 0 else e.op("Reshape", [dr, e.shape_of(ratio)], like=ratio)
