"""VJPs of normalizations and Dropout (ONNX operator spec, "BatchNormalization", "LayerNormalization",
"InstanceNormalization", "GroupNormalization", "RMSNormalization", "LpNormalization",
"MeanVarianceNormalization", "Dropout"; derivatives as in PyTorch's
``batch_norm_backward``/``native_layer_norm_backward`` in ``tools/autograd/derivatives.yaml`` and the
batch-norm paper, https://arxiv.org/abs/1502.03167, section 3).

Every normalization standardizes ``z`` over some axes: ``mu = mean(z)``, ``var = mean((z - mu)^2)``,
``inv = (var + eps)^(-1/2)``, ``zh = (z - mu) inv``. The rules recompute these statistics from the input in
the input's precision (never reading the forward's optional outputs, which ``stash_type`` may make float32
for a float64 input), so the backward graph can be differentiated again: with plain ONNX ops, or, where
onnxruntime's fused kernels are faster and exact (float32 LayerNormalization; BatchNormalization in training
mode with static shapes), with a ``LayerNormalization`` or ``BatchNormalization`` node of their own, which are
differentiable too.

Residuals (issue 24): each rule reads the input ``X`` (and the parameters) and nothing else of the forward, so
a normalization keeps ``X`` only, never a statistic or a copy (a float16 ``X`` is cast to float32 inside the
backward pass); PyTorch's ``native_layer_norm`` and ``native_batch_norm`` save the mean and inverse standard
deviation beside the input. ``Y`` is no exact function to recover ``X`` from (``Scale`` may be 0).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, cached_property

import numpy as np

from ...errors import GraphError
from ...ir import Node, ValueInfo
from ..algebra import Val, name_of, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ._common import f32_attr, optional_input, padded
from .tables import filled


def _work(ctx: Ctx, node: Node, x: str) -> Val:
    """``x`` in the precision of the statistics: float32 for a float16/bfloat16 ``x`` when ``stash_type`` is 1
    (FLOAT, the default), ``x`` itself otherwise (a float64 ``x`` keeps float64: that is the exact derivative)."""
    z = ctx.val(x)
    if node.attrs.get("stash_type", 1) == 1 and z.dtype is not None and z.dtype.itemsize < 4:
        return z.cast(np.float32)
    return z


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

    def __init__(self, z: Val, axes: list[int], eps: float):
        self.z, self.axis_list, self.eps = z, axes, eps

    @cached_property
    def axes(self) -> str:
        return self.z.ctx.e.ints(self.axis_list)

    @cached_property
    def d(self) -> Val:
        """``z - mu``."""
        return self.z - self.z.mean(self.axes)

    @cached_property
    def inv(self) -> Val:
        """``(var + eps)^(-1/2)``."""
        return ((self.d * self.d).mean(self.axes) + self.eps).sqrt().reciprocal()

    @cached_property
    def zh(self) -> Val:
        return self.d * self.inv

    def vjp(self, gzh: Val | None, g_mean: Val | None = None, g_var: Val | None = None,
            g_inv: Val | None = None) -> Val:
        """``dz`` from the cotangents of ``zh`` and of the statistics (keepdims shapes; ``None`` is zero):
        ``inv (gzh - mean(gzh) - zh mean(gzh zh))`` (PyTorch's ``batch_norm_backward``, training branch), plus
        ``g_mean / n`` and ``(g_var - inv^3 g_inv / 2) 2 (z - mu) / n`` (``dvar/dz = 2 (z - mu) / n``,
        ``dinv/dvar = -inv^3 / 2``)."""
        z = self.z
        e = z.ctx.e
        parts = []
        if gzh is not None:
            m1 = gzh.mean(self.axes)
            m2 = (gzh * self.zh).mean(self.axes)
            parts.append(self.inv * (gzh - m1 - self.zh * m2))
        n = _count(e, z.name, self.axis_list) if (g_mean or g_var or g_inv) else None
        if g_mean is not None:
            parts.append((g_mean / n).apply("Expand", e.shape_of(z.name), like=z))
        if g_inv is not None:
            from_inv = g_inv * (self.inv * self.inv * self.inv) * -0.5
            g_var = from_inv if g_var is None else g_var + from_inv
        if g_var is not None:
            parts.append(g_var * 2.0 / n * self.d)
        if not parts:
            return z.ctx.val(e.zeros_like(z.name))
        return parts[0] if len(parts) == 1 else parts[0].apply("Sum", *parts[1:], like=z)


def _back(g: Val | None, x: Val | str) -> Val | None:
    """``g`` in ``x``'s dtype (the statistics may be computed in another precision, the forward's statistics
    outputs may be float32, and BatchNormalization's inputs may have three float types); ``None`` stays."""
    if g is None or (g.dtype is not None and g.dtype == g.ctx.e.dtype(name_of(x))):
        return g
    return g.cast_like(x)


# ---------------------------------------------------------------------------------------------- LayerNorm, RMSNorm


def _trailing(e: Emitter, node: Node, x: str) -> list[int]:
    """The axes ``[axis, rank)`` that LayerNormalization and RMSNormalization normalize over."""
    rank = e.need_rank(x, node)
    axis = int(node.attrs.get("axis", -1))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise GraphError(f"{node.label()}: axis {node.attrs.get('axis')} is out of range for rank {rank}")
    return list(range(axis, rank))


def _fused_stats(e: Emitter, node: Node, s: Stats) -> None:
    """For a float32 ``z`` with static normalized dimensions, ``zh`` and ``inv`` from one
    ``LayerNormalization(z, ones)`` with its ``InvStdDev`` output (one pass over ``z``, the forward's own kernel)
    instead of the five passes of ``ReduceMean``, ``Sub``, ``Mul``, ``ReduceMean``, ``Mul``; the node is
    differentiable again (its rule reads the ``InvStdDev`` cotangent)."""
    z, axes = s.z.name, s.axis_list
    dims = e.dims(z)
    if e.dtype(z) != np.float32 or dims is None or not all(isinstance(dims[a], int) for a in axes):
        return
    ones = filled(e, [dims[a] for a in axes], 1.0, dtype=np.float32)  # ConstantOfShape when large
    zh, _mean, inv = e.op("LayerNormalization", [z, ones], 3, axis=axes[0], epsilon=s.eps, stash_type=1)
    kept = tuple(1 if a in axes else d for a, d in enumerate(dims))
    for name, shape in ((zh, dims), (_mean, kept), (inv, kept)):
        e.types[name] = ValueInfo(name, np.dtype(np.float32), shape)
    s.__dict__.update(zh=s.z.ctx.val(zh), inv=s.z.ctx.val(inv))  # the cached properties, set ahead


@vjp("LayerNormalization", bounded=True, finite=True, reads="all", mixing=True)
def layer_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """Standardization over ``[axis, rank)`` then ``Y = zh * Scale + B`` (ONNX "LayerNormalization");
    ``Scale`` and ``B`` broadcast unidirectionally, so their gradients are summed back with ``reduce_to``.
    The optional ``Mean`` and ``InvStdDev`` outputs carry gradients to ``X`` too."""
    e, (x, scale), bias = ctx.e, node.inputs[:2], optional_input(node, 2)
    gy, g_mean, g_inv = ctx.vals(*padded(cts, 3))
    axes = _trailing(e, node, x)

    @cache
    def st() -> Stats:
        s = Stats(_work(ctx, node, x), axes, f32_attr(node, "epsilon", 1e-5))
        _fused_stats(e, node, s)
        return s

    def dx() -> Val:
        z = st().z
        gzh = None if gy is None else _back(gy.apply("Mul", scale, like=x), z)
        return _back(st().vjp(gzh, _back(g_mean, z), g_inv=_back(g_inv, z)), x)

    def dscale() -> Val:
        return gy.apply("Mul", _back(st().zh, x), like=x).reduce_to(scale)

    affine = [] if gy is None else [dscale, None if bias is None else lambda: gy.reduce_to(bias)]
    return padded([dx, *affine], len(node.inputs))


@vjp("RMSNormalization", bounded=False, finite=False)
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
    def z() -> Val:
        return _work(ctx, node, x)

    @cache
    def inv() -> Val:  # r = (mean(X^2) + eps)^(-1/2)
        return ((z() * z()).mean(axes) + f32_attr(node, "epsilon", 1e-5)).sqrt().reciprocal()

    @cache
    def zh() -> Val:
        return z() * inv()

    def dx() -> Val:
        h = _back(ctx.val(gy) * scale, z())
        return _back(inv() * (h - zh() * (h * zh()).mean(axes)), x)

    def dscale() -> Val:
        return (ctx.val(gy) * _back(zh(), gy)).reduce_to(scale)

    return [dx, dscale]


@vjp("LpNormalization", bounded=False, finite=False)
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

    def dx() -> Val:
        xv, gv = ctx.vals(x, g)
        n = xv.apply("ReduceL2" if p == 2 else "ReduceL1", e.ints([axis]), like=None, keepdims=1)
        zero = n.eq(0)
        safe = where(zero, 1, n, like=None)
        y = xv / safe  # 0 on zero vectors, as the forward
        t = y if p == 2 else xv.sign()
        return where(zero, 0, (gv - t * (gv * y).sum([axis])) / safe, like=x)

    return [dx]


#: the epsilon of MeanVarianceNormalization's function body (a float32 constant)
MVN_EPSILON = float(np.float32(1e-9))


@vjp("MeanVarianceNormalization", bounded=False, finite=False)
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

    def dx() -> Val:
        xv, gv = ctx.vals(x, g)
        c = xv - xv.mean(axes)
        s = (c * c).mean(axes).sqrt()
        d = s + MVN_EPSILON
        flat = s.eq(0)
        k = where(flat, 0, (gv * c).mean(axes) / (where(flat, 1, s, like=None) * (d * d)), like=None)
        return (gv - gv.mean(axes)) / d - c * k

    return [dx]


# ---------------------------------------------------------------------------------------------- per channel


def _per_channel(v: Val, rank: int) -> Val:
    """A ``[C]`` vector as ``[1, C, 1, ..., 1]``, to broadcast along axis 1 of a rank-``rank`` tensor."""
    return v.unsqueeze([0, *range(2, rank)])


def _chan(v: Val, x: Val | str, rank: int) -> Val:
    """A ``[C]`` vector in ``x``'s dtype, shaped to broadcast along axis 1 of ``x``."""
    return _per_channel(_back(v, x), rank)


def _total(v: Val, rank: int, like: Val | str) -> Val:
    """``v`` summed over every axis but the channel's (axis 1), in ``like``'s dtype."""
    return _back(v.sum([0, *range(2, rank)], keepdims=0), like)


def _affine(node: Node, gy: Val, gy_xh: Callable[[], Val], rank: int) -> list:
    """The cotangents of ``scale`` and ``B`` (both ``[C]``, inputs 1 and 2) of ``Y = xh * scale + B``, as
    functions (``gy_xh()`` emits ``dY * xh``)."""
    scale, bias = node.inputs[1:3]
    return [lambda: _total(gy_xh(), rank, scale), lambda: _total(gy, rank, bias)]


@vjp("BatchNormalization", bounded=True, finite=True, reads="all", mixing=True)
def batch_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "BatchNormalization" (opset 15). Inference (``training_mode=0``):
    ``Y = (X - mean) inv scale + B`` with ``inv = (var + eps)^(-1/2)``, so ``dX = dY scale inv``,
    ``dmean = -sum(dY) scale inv`` and ``dvar = -sum(dY xh) scale inv^2 / 2``. Training: the statistics are
    the batch's own (population variance over every axis but 1), and ``running_mean = mean m + mu (1 - m)``,
    ``running_var = var m + sigma^2 (1 - m)`` with ``m`` the momentum carry gradients to X, input_mean and
    input_var as those formulas say. Everything is computed in X's dtype and cast back per input."""
    rank, eps = ctx.e.need_rank(node.inputs[0], node), f32_attr(node, "epsilon", 1e-5)
    if node.attrs.get("training_mode", 0):
        grads = _batch_norm_training(ctx, node, ctx.vals(*padded(cts, 3)), rank, eps)
    else:
        grads = [] if cts[0] is None else _batch_norm_inference(ctx, node, ctx.val(cts[0]), rank, eps)
    return padded(grads, len(node.inputs))


def _batch_norm_inference(ctx: Ctx, node: Node, gy: Val, rank: int, eps: float) -> list:
    """The cotangents of the five inputs for ``training_mode=0`` (the given ``mean`` and ``var``)."""
    x, scale, bias, mean, var = ctx.vals(*node.inputs[:5])

    @cache
    def inv() -> Val:
        return (_chan(var, x, rank) + eps).sqrt().reciprocal()

    @cache
    def scale_inv() -> Val:
        return _chan(scale, x, rank) * inv()

    @cache
    def dx() -> Val:
        return gy.apply("Mul", scale_inv(), like=x)

    @cache
    def gxh() -> Val:  # dY xh
        return gy.apply("Mul", (x - _chan(mean, x, rank)) * inv(), like=x)

    def dvar() -> Val:
        return _total(gxh() * (scale_inv() * inv() * -0.5), rank, var)

    return [dx, lambda: _total(gxh(), rank, scale), lambda: _total(gy, rank, bias),
            lambda: _total(dx().apply("Neg", like=x), rank, mean), dvar]


def _batch_norm_training(ctx: Ctx, node: Node, cts: list, rank: int, eps: float) -> list:
    """The cotangents of the five inputs for ``training_mode=1``, from those of ``Y`` and the running statistics."""
    e, (x, scale, bias, mean, var), (gy, g_rmean, g_rvar) = ctx.e, node.inputs[:5], cts
    momentum = f32_attr(node, "momentum", 0.9)
    if gy is not None and g_rmean is None and g_rvar is None:
        dims, dt = e.dims(x), e.dtype(x)
        if dims is not None and all(isinstance(v, int) and v > 0 for v in dims) and dt in (np.float32, np.float64) \
                and e.dtype(scale) == dt and e.dtype(bias) == dt:
            return [*_batch_norm_training_fused(ctx, x, scale, gy, rank, eps, dims[1]), None, None]
        return [*_batch_norm_training_y(ctx, x, scale, bias, gy, rank, eps), None, None]

    @cache
    def st() -> Stats:
        return Stats(ctx.val(x), [0, *range(2, rank)], eps)

    def dx() -> Val:
        def stat(g):  # a running statistic's cotangent, as the batch statistic's: times (1 - momentum)
            return None if g is None else _chan(g, x, rank) * (1.0 - momentum)
        gzh = None if gy is None else gy.apply("Mul", _chan(ctx.val(scale), x, rank), like=x)
        return st().vjp(gzh, stat(g_rmean), stat(g_rvar))

    def running(g: Val | None, like: str):  # the input statistic's share of the running one: times momentum
        return None if g is None else lambda: g.apply("Mul", momentum, like=like)

    affine = [None, None] if gy is None else _affine(node, gy, lambda: gy.apply("Mul", st().zh, like=x), rank)
    return [dx, *affine, running(g_rmean, mean), running(g_rvar, var)]


def _batch_norm_training_fused(ctx: Ctx, x: str, scale: str, gy: Val, rank: int, eps: float, c: int) -> list:
    """:func:`_batch_norm_training_y` with onnxruntime's fused batch-norm kernels doing most per-element work
    (float32/float64, static shapes, ``c`` channels). A training-mode ``BatchNormalization`` of X with scale 1,
    bias 0 and momentum 0 gives ``xh`` and, as its running variance, the batch's population variance itself
    (ONNX "BatchNormalization": ``running = input * momentum + current * (1 - momentum)``). With the sums
    ``s1 = sum(dY)`` and ``s2 = sum(dY xh)``: ``dB = s1``, ``dscale = s2``,
    ``dX = (dY - (xh s2 / n + s1 / n)) inv scale``, where ``xh s2 / n + s1 / n`` is an inference-mode
    ``BatchNormalization`` of ``xh`` with mean 0, variance 1 and epsilon 0 (exactly that affine map). 7 passes
    over X-sized tensors, 2 of them fused kernels (bench/micro.py ``batch_norm_backward``)."""
    e = ctx.e
    axes = e.ints([0, *range(2, rank)])
    dt, shape = e.dtype(x), tuple(e.dims(x))
    vec = {"shape": (c,), "dtype": dt}  # static types given, not inferred: this rule runs once per BN layer
    zero, one = filled(e, [c], 0.0, dtype=dt), filled(e, [c], 1.0, dtype=dt)
    n = e.scalar(1.0 / float(np.prod([d for i, d in enumerate(shape) if i != 1])), x)

    @cache
    def stats() -> tuple[Val, Val]:  # xh and the batch variance
        # The input statistics are multiplied by momentum 0, but onnxruntime writes the running statistics
        # into their buffers in place: they must be finite temporaries of this run that nothing else reads (a
        # shared constant would be overwritten for every later reader and run), here 0/1 flags of one [C]
        # slice of X (of X, not of dY: the VJP stays linear in its cotangent).
        corner = e.op("Slice", [x, e.ints([0] * (rank - 1)), e.ints([1] * (rank - 1)), e.ints([0, *range(2, rank)])],
                      shape=(1, c) + (1,) * (rank - 2), dtype=dt)
        corner = e.op("Reshape", [corner, e.ints([c])], **vec)
        flags = [e.op("Cast", [e.op(op, [corner], shape=(c,), dtype=np.dtype(bool))],
                      to=1 if dt == np.float32 else 11, **vec) for op in ("IsNaN", "IsInf")]
        xh, _, var = e.op("BatchNormalization", [x, one, zero, *flags], 3, training_mode=1, momentum=0.0,
                          epsilon=eps, shape=shape, dtype=dt)
        e.types[var] = ValueInfo(var, dt, (c,))
        return ctx.val(xh), ctx.val(var)

    @cache
    def s1() -> Val:
        return gy.out("ReduceSum", axes, keepdims=0, **vec)

    @cache
    def s2() -> Val:
        return gy.apply("Mul", stats()[0], like=x).out("ReduceSum", axes, keepdims=0, **vec)

    def dx() -> Val:
        xh, var = stats()
        inv = (var + eps).sqrt().reciprocal()  # [C]: the types of var
        fit = xh.apply("BatchNormalization", s2() * n, s1() * n, zero, one, epsilon=0.0, like=x)  # xh s2/n + s1/n
        k = inv.out("Mul", scale, **vec).out("Unsqueeze", e.ints([0, *range(2, rank)]),
                                             shape=(1, c) + (1,) * (rank - 2), dtype=dt)
        return gy.apply("Sub", fit, like=x).apply("Mul", k, like=x)

    return [dx, s2, s1]


def _batch_norm_training_y(ctx: Ctx, x: str, scale: str, bias: str, gy: Val, rank: int, eps: float) -> list:
    """The cotangents of X, scale and B when only ``Y`` has one (a training step): PyTorch's
    ``batch_norm_backward`` (aten/src/ATen/native/Normalization.cpp, training branch) in closed form over the
    centred input ``d = X - mean`` with ``inv = (mean(d^2) + eps)^(-1/2)``, the per-channel sums
    ``s1 = sum(dY)`` and ``s2 = sum(dY d)`` (over every axis but 1, ``n`` elements each):
    ``dB = s1``, ``dscale = s2 inv``, ``dX = (dY - s1 / n - d s2 inv^2 / n) inv scale``.
    Each sum is taken once and shared by dX and the affine cotangents, and ``xh = d inv`` is never
    materialized: 11 passes over X-sized tensors where the Stats-based form (:meth:`Stats.vjp`) takes 14."""
    e, xv = ctx.e, ctx.val(x)
    axes = e.ints([0, *range(2, rank)])
    n = _count(e, x, [0, *range(2, rank)])

    @cache
    def d() -> Val:
        return xv - xv.mean(axes)

    @cache
    def inv() -> Val:  # not ReduceSumSquare(d): onnxruntime runs it 3-4x slower than ReduceMean(d * d)
        return ((d() * d()).mean(axes) + eps).sqrt().reciprocal()

    @cache
    def s1() -> Val:
        return gy.sum(axes)

    @cache
    def s2() -> Val:
        return gy.apply("Mul", d(), like=x).sum(axes)

    def dx() -> Val:
        c, m1 = s2() * (inv() * inv()) / n, s1() / n
        centred = gy.apply("Sub", d() * c + m1, like=x)
        return centred.apply("Mul", inv() * _chan(ctx.val(scale), x, rank), like=x)

    def flat(v: Val, like: str) -> Val:  # a keepdims per-channel value as [C] in like's dtype
        return _back(v.reshape([-1]), like)

    return [dx, lambda: flat(s2() * inv(), scale), lambda: flat(s1(), bias)]


@vjp("InstanceNormalization", bounded=True, finite=True, reads="all", mixing=True)
def instance_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """Standardization over the spatial axes ``[2, rank)`` per sample and channel, then ``* scale + B`` with
    ``[C]`` vectors (ONNX "InstanceNormalization")."""
    e, (x, scale), gy = ctx.e, ctx.vals(*node.inputs[:2]), ctx.val(cts[0])
    rank = e.need_rank(x.name, node)
    if rank < 3:
        raise GraphError(f"{node.label()}: InstanceNormalization needs an input of rank >= 3, not {rank}")

    @cache
    def st() -> Stats:
        return Stats(x, list(range(2, rank)), f32_attr(node, "epsilon", 1e-5))

    return [lambda: st().vjp(gy.apply("Mul", _per_channel(scale, rank), like=x)),
            *_affine(node, gy, lambda: gy * st().zh, rank)]


@vjp("GroupNormalization", bounded=True, finite=True, reads="all", mixing=True)
def group_norm(ctx: Ctx, node: Node, cts: list) -> list:
    """X ``[N, C, ...]`` viewed as ``[N, G, C/G * ...]`` is standardized over its last axis, viewed back, then
    ``* scale + bias`` with ``[C]`` vectors (ONNX "GroupNormalization", opset 21)."""
    e, (x, scale), gy = ctx.e, node.inputs[:2], ctx.val(cts[0])
    rank = e.need_rank(x, node)
    if "num_groups" not in node.attrs:
        raise GraphError(f"{node.label()}: GroupNormalization needs the num_groups attribute")
    groups = [0, int(node.attrs["num_groups"]), -1]  # the [N, G, C/G * ...] view

    @cache
    def st() -> Stats:
        return Stats(_work(ctx, node, x).reshape(groups), [2], f32_attr(node, "epsilon", 1e-5))

    @cache
    def xshape() -> str:
        return e.shape_of(x)

    def dx() -> Val:
        gxh = gy.apply("Mul", _per_channel(ctx.val(scale), rank), like=x)
        gz = st().vjp(_back(gxh.reshape(groups), st().z))
        return _back(gz, x).reshape(xshape(), like=x)

    def gy_xh() -> Val:
        return gy * _back(st().zh, x).reshape(xshape(), like=x)

    return [dx, *_affine(node, gy, gy_xh, rank)]
