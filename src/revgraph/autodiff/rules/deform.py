"""VJPs of the two convolutions that move image patches explicitly, as columns (ONNX operator spec, "Col2Im",
"DeformConv"): Col2Im folds columns into an image, DeformConv unfolds bilinear samples of the input into columns
and contracts them with the weight. The plain convolutions, Conv and ConvTranspose, and the geometry and
gradient helpers both modules use are in :mod:`.conv`.

Col2Im (fold) is the adjoint of im2col (unfold), so its VJP is an im2col: a Conv with an identity kernel.
DeformConv samples the input bilinearly at offset positions (:func:`deform_conv`); its VJP recomputes the
samples with a Gather of rows and adds the input gradient back with the race-free row scatter of
``autodiff/sparse.py``. Each cotangent, and each step of the sampling, is a function of its own; the rule
:func:`deform_conv` only wires them (:class:`_DeformTerms` emits every shared intermediate once, when first read).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import onnx

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ..sparse import add_rows
from ._common import optional_input, product, zeros_of_shape
from .conv import Geometry, bias_grad, dims_part, ints_attr, kernel_of, shape_cat

# ------------------------------------------------------------------------------------------ Col2Im


@vjp("Col2Im", bounded=False, finite=False)
def col2im(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Col2Im" (PyTorch ``fold``) adds each column entry ``x[n, c*K + k, l]`` into the image at
    ``l*s + k*d - pb`` (dropped in the padding). Its transpose reads those positions back, im2col (PyTorch
    derivatives.yaml: ``col2im_backward`` is ``im2col``): the image planes as ``[N*C, 1, *image]`` convolved
    with the identity kernel ``[K, 1, *block]`` (tap ``k`` copies its pixel to channel ``k``) with the same
    strides, dilations and pads give ``[N*C, K, *blocks]``, which is ``x``'s ``[N, C*K, L]``. The kernel is a
    constant when ``block_shape`` is; otherwise it is built in the graph (``EyeLike``), and the gradient
    graph cannot be differentiated again (the Conv VJP needs a static kernel size)."""
    e, (x, _, block), g = ctx.e, node.inputs, ctx.val(cts[0])

    def dx() -> Val:
        k = e.need_rank(g.name, node) - 2
        planes = g.reshape(shape_cat(e, [[-1, 1], dims_part(e, g.name, 2)]))
        attrs = {"strides": ints_attr(node, "strides", [1] * k), "dilations": ints_attr(node, "dilations", [1] * k),
                 "pads": ints_attr(node, "pads", [0] * (2 * k))}
        cols = planes.apply("Conv", _identity_kernel(e, block, x), like=None, **attrs)
        return cols.reshape(e.shape_of(x), like=x)

    return [dx, None, None]


def _identity_kernel(e: Emitter, block: str, like: str) -> str:
    """``[K, 1, *block]`` with a one at tap ``k`` of output channel ``k`` (K = prod(block)), in ``like``'s dtype."""
    dt = e.dtype(like)
    bv = e.value(block)
    if bv is not None:
        kernel = [int(v) for v in np.asarray(bv).reshape(-1)]
        eye = np.eye(int(np.prod(kernel))).reshape(-1, 1, *kernel)
        return e.const(eye.astype(dt)) if dt is not None else e.op("CastLike", [e.const(eye.astype(np.float32)), like])
    block = e.op("Cast", [block], to=onnx.TensorProto.INT64) if e.dtype(block) != np.int64 else block
    taps = e.op("ReduceProd", [block], keepdims=1)
    square = e.op("ConstantOfShape", [e.op("Concat", [taps, taps], axis=0)],
                  value=np.zeros(1, dtype=dt if dt is not None else np.float32))
    eye = e.op("EyeLike", [square])
    eye = eye if dt is not None else e.op("CastLike", [eye, like])
    return e.op("Reshape", [eye, e.op("Concat", [taps, e.ints([1]), block], axis=0)])


# ------------------------------------------------------------------------------------------ DeformConv: sizes


@dataclass
class _Deform:
    """Static sizes of a DeformConv: batch ``n`` (``None`` when unknown), channels ``c``, output channels ``m``,
    spatial input sizes ``dims``, kernel, output sizes ``out``, ``group`` and ``og`` (offset groups)."""

    n: int | None
    c: int
    m: int
    dims: list[int]
    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    pb: list[int]
    out: list[int]
    group: int
    og: int

    @property
    def taps(self) -> int:
        return int(np.prod(self.kernel))

    @property
    def length(self) -> int:
        return int(np.prod(self.out))

    @property
    def pixels(self) -> int:
        return int(np.prod(self.dims))

    @property
    def cog(self) -> int:
        """Channels per offset group."""
        return self.c // self.og

    @property
    def cg(self) -> int:
        """Input channels per group."""
        return self.c // self.group

    @property
    def mg(self) -> int:
        """Output channels per group."""
        return self.m // self.group


def _deform_sizes(e: Emitter, node: Node, x: str, w: str) -> _Deform:
    dx, dw = e.dims(x), e.dims(w)
    if dx is None or dw is None or not all(isinstance(v, int) for v in dx[1:]) or not isinstance(dw[0], int):
        raise GraphError(f"{node.label()}: the DeformConv VJP needs static channel and spatial dimensions of "
                         f"{x!r} and the number of output channels of {w!r}; declare the shapes of the graph inputs")
    k = len(dx) - 2
    kernel = kernel_of(e, node, w, k)
    strides, dilations = ints_attr(node, "strides", [1] * k), ints_attr(node, "dilations", [1] * k)
    pads = ints_attr(node, "pads", [0] * (2 * k))
    geo = Geometry(kernel, strides, dilations, pads[:k], pads[k:])
    return _Deform(dx[0] if isinstance(dx[0], int) else None, dx[1], dw[0], list(dx[2:]), kernel, strides,
                   dilations, pads[:k], geo.out(list(dx[2:])), int(node.attrs.get("group", 1)),
                   int(node.attrs.get("offset_group", 1)))


def _fconst(e: Emitter, a: np.ndarray, like: str) -> str:
    """The float constant ``a`` in ``like``'s dtype."""
    dt = e.dtype(like)
    return e.const(a.astype(dt)) if dt is not None else e.op("CastLike", [e.const(a.astype(np.float32)), like])


# ------------------------------------------------------------------------------------------ DeformConv: sampling


def _batch_rows(e: Emitter, x: str, sz: _Deform) -> str:
    """``[N * offset_group, 1, 1]``: the first row ``(n * og + q) * pixels`` of each image and offset group in
    the ``[N * og * pixels, C / og]`` table of the input."""
    if sz.n is not None:
        return e.const((np.arange(sz.n * sz.og, dtype=np.int64) * sz.pixels).reshape(-1, 1, 1))
    count = e.op("Mul", [e.op("Squeeze", [e.op("Shape", [x], start=0, end=1), e.ints([0])]),
                         e.const(np.int64(sz.og * sz.pixels))])
    ramp = e.op("Range", [e.const(np.int64(0)), count, e.const(np.int64(sz.pixels))])
    return e.op("Reshape", [ramp, e.ints([-1, 1, 1])])


def _axis_neighbours(ctx: Ctx, x: str, sz: _Deform, part: Val, base: np.ndarray, j: int,
                     sign: Val) -> tuple[Val, Val, Val]:
    """Spatial axis ``j`` of every sample, its two neighbours stacked on a corner axis of their own
    (``[1.., 2, ..1, N * offset_group, K, L]``): their linear weights (``1 - frac`` and ``frac``, 0 outside
    the input), the derivatives of the weights with respect to ``p_j`` (``sign``: -1 and +1, 0 outside), and
    their clipped positions times the row stride of axis ``j``. ``part`` is the axis' offsets and ``base`` the
    undeformed positions ``o*s - pb + k*d`` (``[K, L]``)."""
    e, k = ctx.e, len(sz.dims)
    p = part.reshape([-1, sz.taps, sz.length]) + _fconst(e, base, x)
    fl = p.apply("Floor", like=None)
    frac = (p - fl).unsqueeze([0])
    near = fl.cast(np.int64).unsqueeze([0]) + np.array([0, 1], dtype=np.int64).reshape(2, 1, 1, 1)
    top = sz.dims[j] - 1
    inside = (near.ge(0) & near.le(top)).cast_like(x)
    lin = ctx.val(_fconst(e, np.array([1.0, 0.0]).reshape(2, 1, 1, 1), x)) + sign * frac  # 1 - frac, frac
    axes = [i for i in range(k) if i != j]
    place = (lambda v: v.unsqueeze(axes)) if k > 1 else (lambda v: v)
    clipped = near.apply("Min", top).apply("Max", 0)
    stride = int(np.prod(sz.dims[j + 1:]))
    return place(lin * inside), place(sign * inside), place(clipped if stride == 1 else clipped * stride)


def _sampling(ctx: Ctx, x: str, off: str, sz: _Deform) -> tuple[Val, Val, list[Val]]:
    """``(rows, weights, slopes)``: for every corner (axis 0, ``2^k``, the first spatial axis slowest) and
    sample ``r`` (axis 1: ``R = N * offset_group * K * L`` in that order): the input row it reads (int64),
    its multilinear weight (0 outside the input), and per spatial axis ``j`` the derivative of that weight
    with respect to ``p_j``. The corners are the broadcast products of the axes' neighbours
    (:func:`_axis_neighbours`)."""
    e, k = ctx.e, len(sz.dims)
    split = e.op("Reshape", [off, e.ints([-1, k, sz.length])])
    parts = e.op("Split", [split, e.ints([1] * k)], n_out=k, axis=1) if k > 1 else [split]
    grid = np.indices(sz.kernel + sz.out).reshape(2 * k, sz.taps, sz.length)
    sign = ctx.val(_fconst(e, np.array([-1.0, 1.0]).reshape(2, 1, 1, 1), x))  # d weight / d frac: low, high
    pos = ctx.val(_batch_rows(e, x, sz))
    weights, slopes = [], []
    for j in range(k):
        base = grid[k + j] * sz.strides[j] - sz.pb[j] + grid[j] * sz.dilations[j]
        weight, slope, at = _axis_neighbours(ctx, x, sz, ctx.val(parts[j]), base, j, sign)
        weights.append(weight)
        slopes.append(slope)
        pos = pos + at
    flat = [2**k, -1]
    return pos.reshape(flat), product(weights).reshape(flat), \
        [product([sl, *weights[:j], *weights[j + 1:]]).reshape(flat) for j, sl in enumerate(slopes)]


def _samples(x: Val, rows: Val, sz: _Deform) -> Val:
    """``[2^k, R, C/og]``: the input at every corner of every sample (a Gather of rows)."""
    table = x.reshape([-1, sz.og, sz.cog, sz.pixels]).transpose([0, 1, 3, 2]).reshape([-1, sz.cog])
    return table.apply("Gather", rows.reshape([-1]), like=None, axis=0).reshape([2 ** len(sz.dims), -1, sz.cog])


def _values(samples: Val, weights: Val) -> Val:
    """``[R, C/og]``: the bilinear samples ``v``, the corners' values times their weights, summed."""
    return (samples * weights.unsqueeze([2])).sum([0], keepdims=0)


def _cols(v: Val, sz: _Deform) -> Val:
    """``[N, group, C/group * K, L]``: the masked samples ``v`` laid out for the contraction."""
    lay = v.reshape([-1, sz.og, sz.taps, sz.length, sz.cog]).transpose([0, 1, 4, 2, 3])
    return lay.reshape([-1, sz.group, sz.cg * sz.taps, sz.length])


# ------------------------------------------------------------------------------------------ DeformConv: cotangents


def _dcols(w: Val, grad_out: Val, sz: _Deform) -> Val:
    """``[R, C/og]``: the cotangent of the masked samples, ``w^T g`` in the samples' layout."""
    d = w.reshape([sz.group, sz.mg, sz.cg * sz.taps]).transpose([0, 2, 1]) @ grad_out
    lay = d.reshape([-1, sz.og, sz.cog, sz.taps, sz.length]).transpose([0, 1, 3, 4, 2])
    return lay.reshape([-1, sz.cog])


def _zero_table(e: Emitter, x: str, sz: _Deform) -> str:
    """Zeros of the ``[N * og * pixels, C / og]`` row table of ``x``, in ``x``'s dtype."""
    if sz.n is not None:
        shape = e.ints([sz.n * sz.og * sz.pixels, sz.cog])
    else:
        batch = e.op("Shape", [x], start=0, end=1)
        shape = e.op("Concat", [e.op("Mul", [batch, e.ints([sz.og * sz.pixels])]), e.ints([sz.cog])], axis=0)
    return zeros_of_shape(e, shape, x)


def _input_grad(x: Val, rows: Val, weights: Val, dv: Val, sz: _Deform) -> Val:
    """``dx``: ``dv`` times each corner's weight, added at the corner's row
    (:func:`~revgraph.autodiff.sparse.add_rows`)."""
    e = x.ctx.e
    contrib = weights.unsqueeze([2]) * dv.unsqueeze([0])
    table = x.ctx.val(add_rows(e, _zero_table(e, x.name, sz), rows.reshape([-1]).name,
                               contrib.reshape([-1, sz.cog]).name))
    lay = table.reshape([-1, sz.og, sz.pixels, sz.cog]).transpose([0, 1, 3, 2])
    return lay.reshape(e.shape_of(x.name), like=x)


def _weight_grad(w: Val, cols: Val, grad_out: Val) -> Val:
    """``dw[m, c, k] = sum_{n, o} g[n, m, o] cols[n, c, k, o]``: a batched MatMul summed over the batch."""
    per_batch = cols @ grad_out.transpose([0, 1, 3, 2])  # [N, group, C/group * K, M/group]
    return per_batch.sum([0], keepdims=0).transpose([0, 2, 1]).reshape(w.ctx.e.shape_of(w.name), like=w)


def _offset_grad(off: Val, samples: Val, slopes: list[Val], dv: Val, length: int) -> Val:
    """``doffset`` along axis ``j``: per corner and sample, the sum over the group's channels of ``dv`` times
    the corner's value, times the derivative of the corner's weight along ``j``, summed over the corners."""
    e = off.ctx.e
    s = (samples * dv.unsqueeze([0])).sum([2], keepdims=0)
    per_axis = [(s * sl).sum([0], keepdims=0).reshape([-1, 1, length]) for sl in slopes]
    d = per_axis[0] if len(slopes) == 1 else off.ctx.val(e.op("Concat", [v.name for v in per_axis], axis=1))
    return d.reshape(e.shape_of(off.name), like=off)


def _mask_grad(mask: Val, dcols: Val, values: Val) -> Val:
    """``dmask = sum_{c in q} dcols * v``."""
    return (dcols * values).sum([1], keepdims=0).reshape(mask.ctx.e.shape_of(mask.name), like=mask)


# ------------------------------------------------------------------------------------------ DeformConv: the rule


class _DeformTerms:
    """The intermediates of one DeformConv's backward pass, each emitted once, when first read."""

    def __init__(self, ctx: Ctx, node: Node, g: str):
        self.ctx, self.g = ctx, ctx.val(g)
        self.x, self.w, self.off = ctx.vals(*node.inputs[:3])
        mask = optional_input(node, 4)
        self.mask = None if mask is None else ctx.val(mask)
        self.sz = _deform_sizes(ctx.e, node, self.x.name, self.w.name)

    @cached_property
    def sampling(self) -> tuple[Val, Val, list[Val]]:
        return _sampling(self.ctx, self.x.name, self.off.name, self.sz)

    @cached_property
    def samples(self) -> Val:
        return _samples(self.x, self.sampling[0], self.sz)

    @cached_property
    def values(self) -> Val:
        return _values(self.samples, self.sampling[1])

    @cached_property
    def mask_rows(self) -> Val | None:
        """The mask as ``[R, 1]``, or ``None``."""
        return None if self.mask is None else self.mask.reshape([-1]).unsqueeze([1])

    @cached_property
    def grad_out(self) -> Val:
        return self.g.reshape([-1, self.sz.group, self.sz.mg, self.sz.length])

    @cached_property
    def dcols(self) -> Val:
        return _dcols(self.w, self.grad_out, self.sz)

    @cached_property
    def dvalues(self) -> Val:
        """``dv = dcols * mask``."""
        return self.dcols if self.mask is None else self.dcols * self.mask_rows

    def dx(self) -> Val:
        rows, weights, _ = self.sampling
        return _input_grad(self.x, rows, weights, self.dvalues, self.sz)

    def dw(self) -> Val:
        v = self.values if self.mask is None else self.values * self.mask_rows
        return _weight_grad(self.w, _cols(v, self.sz), self.grad_out)

    def doffset(self) -> Val:
        return _offset_grad(self.off, self.samples, self.sampling[2], self.dvalues, self.sz.length)

    def dmask(self) -> Val:
        return _mask_grad(self.mask, self.dcols, self.values)


@vjp("DeformConv", bounded=False, finite=False)
def deform_conv(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "DeformConv" (Dai et al. 2017, arXiv:1703.06211; the mask of v2, arXiv:1811.11168): for output
    position ``o`` and kernel tap ``k`` each input channel of offset group ``q`` is sampled bilinearly (zero
    outside the input) at ``p = o*s - pb + k*d + offset[n, q, k, :, o]``, the sample ``v`` is multiplied by
    ``mask[n, q, k, o]``, and the columns ``cols = v * mask`` are contracted with the weight as in a grouped
    Conv: ``y[n, m, o] = sum_{c, k} w[m, c, k] cols[n, c, k, o] + b[m]``. The gradients, as torchvision's
    ``deform_conv2d`` backward (``deformable_col2im``, ``deformable_col2im_coord``):

    - ``db = sum g``; ``dw[m, c, k] = sum_{n, o} g[n, m, o] cols[n, c, k, o]`` (a batched MatMul);
    - ``dcols = w^T g``; ``dmask = sum_{c in q} dcols * v``; ``dv = dcols * mask``;
    - ``dx``: ``dv`` times each corner's bilinear weight, added at the corner (rows of the input viewed as
      ``[N * offset_group * pixels, C / offset_group]``, the race-free row scatter
      :func:`~revgraph.autodiff.sparse.add_rows`);
    - ``doffset`` along axis ``j``: ``sum_{c in q} dv * dv/dp_j``, ``dv/dp_j`` the sum over corners of the
      corner's value times the derivative of its weight (``-1`` or ``+1`` along ``j`` times the other axes'
      weights), the one-sided derivative at integer positions, as torchvision's.

    The samples are recomputed in the backward graph with one ``Gather`` of rows over all ``2^k`` corners.
    Any spatial rank (multilinear sampling); needs static channel and spatial sizes (the batch may vary)."""
    e, g = ctx.e, cts[0]
    b = optional_input(node, 3)
    t = _DeformTerms(ctx, node, g)
    k = len(t.sz.dims)
    grads = [t.dx, t.dw, t.doffset, (lambda: bias_grad(e, g, k, b)) if b else None, t.dmask if t.mask else None]
    return grads[:len(node.inputs)]
