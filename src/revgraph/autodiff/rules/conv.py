"""VJPs of convolutions (ONNX operator spec, "Conv", "ConvTranspose"; the derivatives are PyTorch's
``convolution_backward``, ``aten/src/ATen/native/Convolution.cpp``, and JAX's
``_conv_general_dilated_transpose_lhs`` / ``_rhs`` in ``jax/_src/lax/convolution.py``).

Geometry along one spatial axis: a Conv reads the zero-padded input at ``o*s + k*d`` for output ``o`` and
kernel tap ``k``; the input occupies padded positions ``pb .. pb+D-1``. So

- the input gradient scatters ``dy[o] * w[k]`` back to ``o*s + k*d - pb``: a ``ConvTranspose`` with the same
  weight, pads and strides, whose ``output_padding`` (or an extra end pad) makes its length ``D``;
- the weight gradient ``dw[m, c, k] = sum_{n,o} dy[n, m, o] x_pad[n, c, o*s + k*d]`` is, for an ungrouped
  Conv with static shapes and at most 9 kernel taps, one batched MatMul per tap ``k`` (the strided slice of
  ``x_pad`` the tap reads times ``dy``) summed over the batch; otherwise a Conv of the input (channels as
  batch) with the output gradient (batch as input channels) as its kernel: stride ``d``, dilation ``s``, the
  same pads, cut to the kernel size (onnxruntime runs that Conv about 2x slower: a GEMM a few columns wide);
- the bias gradient sums ``dy`` over every axis but the channels.

ConvTranspose is the adjoint of Conv, so its input gradient is a Conv and its weight gradient the same
Conv-of-input-with-gradient construction with the roles of input and output exchanged.

Backward graphs emit ``ConvTranspose`` only with ``group=1``: onnx's reference evaluator computes grouped
ConvTranspose wrongly (onnx 1.23 ``op_conv_transpose.py`` slices the per-group weights and writes the per-group
outputs with the wrong extents), and a backward graph must give the same numbers under onnxruntime and the
reference evaluator (DESIGN.md section 2). A grouped input gradient is therefore a ``Conv`` of the
zero-interleaved output gradient with the flipped, group-transposed weight.

Every node here is data movement or a contraction with explicit geometry (Conv, ConvTranspose, MatMul, Pad,
Slice, Reshape, Transpose), written as :class:`~revgraph.autodiff.algebra.Val` methods; the helpers take an
:class:`~revgraph.autodiff.emitter.Emitter` (pool, deform, resize and roi call them outside a rule) and build
their values through :class:`._common.EmitterContext`. Shape values (``shape_cat``) stay ``Emitter.op``.

This module also holds the geometry and gradient helpers of the convolution family, which other rule modules
(:mod:`.pool`, :mod:`.deform`, ...) import. Col2Im and DeformConv, whose VJPs move image patches as explicit
columns, are in :mod:`.deform`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ._common import EmitterContext, optional_input, shape_part
from .tables import filled

INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)
#: kernels with at most this many taps get their weight gradient as per-tap GEMMs (:func:`weight_grad_taps`)
MAX_TAPS = 9


# ------------------------------------------------------------------------------------------ geometry


@dataclass
class Geometry:
    """Per spatial axis: kernel size, stride, dilation, and the pads before (``pb``) and after (``pe``)."""

    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    pb: list[int]
    pe: list[int]

    @property
    def span(self) -> list[int]:
        """The extent of the dilated kernel, ``(k - 1) * d + 1``."""
        return [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations, strict=True)]

    def out(self, dims: list[int], ceil: bool = False) -> list[int]:
        """Output sizes for spatial input sizes ``dims`` (ONNX "Conv"/"MaxPool" output shape; in ceil mode a
        last window that would start in the end padding is dropped, as PyTorch and onnxruntime do)."""
        res = []
        for d, k, s, b, a in zip(dims, self.span, self.strides, self.pb, self.pe, strict=True):
            if ceil:
                o = -(-(d + b + a - k) // s) + 1
                o -= (o - 1) * s >= d + b
            else:
                o = (d + b + a - k) // s + 1
            res.append(o)
        return res

    def attrs(self) -> dict:
        return {"strides": list(self.strides), "dilations": list(self.dilations), "pads": [*self.pb, *self.pe]}


def ints_attr(node: Node, name: str, default: list[int]) -> list[int]:
    v = node.attrs.get(name)
    return [int(a) for a in v] if v is not None and len(v) else list(default)


def spatial(e: Emitter, x: str) -> list[int] | None:
    """The static spatial dimensions (axes 2..) of ``x``, or ``None`` if one of them is unknown."""
    d = e.dims(x)
    if d is None or not all(isinstance(v, int) for v in d[2:]):
        return None
    return list(d[2:])


def need_spatial(e: Emitter, node: Node, x: str, why: str) -> list[int]:
    dims = spatial(e, x)
    if dims is None:
        raise GraphError(f"{node.label()}: {why} needs the spatial dimensions of {x!r}, which are unknown; "
                         "declare the shapes of the graph inputs")
    return dims


def kernel_of(e: Emitter, node: Node, w: str | None, k: int) -> list[int]:
    """``kernel_shape``, or the spatial dimensions of the weight ``w``."""
    dims = spatial(e, w) if w else None
    if node.attrs.get("kernel_shape"):
        kernel = [int(a) for a in node.attrs["kernel_shape"]]
        if dims is not None and all(isinstance(d, int) for d in dims) and list(dims) != kernel:
            # an invalid model (ONNX's shape inference does not compare them): refused, not built into a
            # backward graph that shape inference then rejects
            raise GraphError(f"{node.label()}: kernel_shape {kernel} disagrees with the spatial shape "
                             f"{list(dims)} of the weight {w!r}; fix one of them")
        return kernel
    if dims is None or len(dims) != k:
        raise GraphError(f"{node.label()}: the kernel shape is unknown (no kernel_shape attribute and the weight "
                         f"{w!r} has no static shape), and its VJP needs it")
    return dims


def split_pads(total: list[int], auto: str) -> tuple[list[int], list[int]]:
    """Begin/end pads from total pads: SAME_UPPER puts the odd one at the end, otherwise at the beginning."""
    small, big = [t // 2 for t in total], [t - t // 2 for t in total]
    return (small, big) if auto == "SAME_UPPER" else (big, small)


def explicit_pads(node: Node, auto: str, k: int) -> tuple[list[int], list[int]]:
    """Begin/end pads of ``VALID`` (none) or of the ``pads`` attribute (default none)."""
    if auto == "VALID":
        return [0] * k, [0] * k
    pads = ints_attr(node, "pads", [0] * (2 * k))
    return pads[:k], pads[k:]


def resolve_pads(e: Emitter, node: Node, x: str, kernel: list[int], strides: list[int],
                 dilations: list[int]) -> tuple[list[int], list[int]]:
    """Explicit begin/end pads for Conv and the pools (ONNX "Conv", ``auto_pad``: SAME_* gives
    ``ceil(D / s)`` outputs, the odd pad going to the end for SAME_UPPER and the beginning for SAME_LOWER)."""
    k = len(kernel)
    auto = node.attrs.get("auto_pad", "NOTSET") or "NOTSET"
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        dims = need_spatial(e, node, x, f"auto_pad={auto}")
        total = []
        for d, kk, s, dl in zip(dims, kernel, strides, dilations, strict=True):
            total.append(max(0, (-(-d // s) - 1) * s + (kk - 1) * dl + 1 - d))
        return split_pads(total, auto)
    return explicit_pads(node, auto, k)


def conv_geometry(e: Emitter, node: Node, x: str, w: str | None, k: int) -> Geometry:
    kernel = kernel_of(e, node, w, k)
    strides, dilations = ints_attr(node, "strides", [1] * k), ints_attr(node, "dilations", [1] * k)
    pb, pe = resolve_pads(e, node, x, kernel, strides, dilations)
    return Geometry(kernel, strides, dilations, pb, pe)


# ------------------------------------------------------------------------------------------ helpers


def shape_cat(e: Emitter, parts: list) -> str:
    """A 1-D int64 shape from ``parts`` (int lists or 1-D int64 value names); a constant when all are ints."""
    if all(isinstance(p, list) for p in parts):
        return e.ints([v for p in parts for v in p])
    names = [e.ints(p) if isinstance(p, list) else p for p in parts if not (isinstance(p, list) and not p)]
    return names[0] if len(names) == 1 else e.op("Concat", names, axis=0)


dims_part = shape_part  # (``shape(x)[start:end]``; the name the geometry rules use)


def ones(e: Emitter, shape: list[int], like: str) -> str:
    """Ones of static ``shape`` with the dtype of ``like``: a constant when small, else a ``ConstantOfShape``
    (a kernel of a 40000 x 40000 AveragePool: :mod:`.tables`)."""
    return filled(e, shape, 1.0, like)


def _axes(k: int) -> list[int]:
    return list(range(2, k + 2))


def fit(e: Emitter, v: str, x: str, extra: list[int], like: str | None) -> str:
    """``v`` with ``extra`` zeros appended on each spatial axis, then cut to the spatial size of ``x``: the
    fallback when static sizes cannot give an exact ``output_padding``."""
    k, v = len(extra), EmitterContext(e).val(v)
    if any(extra):
        v = v.apply("Pad", e.ints([0] * (k + 2) + [0, 0] + extra), like=None)
    ends = dims_part(e, x, 2)
    return v.apply("Slice", e.ints([0] * k), ends if isinstance(ends, str) else e.ints(ends), e.ints(_axes(k)),
                   like=like).name


def dilate(e: Emitter, g: str, strides: list[int], out: list[int] | None) -> str:
    """``g`` with ``s - 1`` zeros between neighbours along each spatial axis (length ``s*(O-1)+1``): a
    ``ConvTranspose`` with a 1x..x1 kernel of ones on the batch-and-channel-flattened ``g``."""
    k = len(strides)
    if all(s == 1 for s in strides):
        return g
    flat = EmitterContext(e).val(g).reshape(
        shape_cat(e, [[-1, 1], out if out is not None else e.op("Shape", [g], start=2)]))
    up = flat.apply("ConvTranspose", ones(e, [1, 1] + [1] * k, g), like=None, strides=list(strides))
    if out is not None:
        grown: list[int] | str = [s * (o - 1) + 1 for s, o in zip(strides, out, strict=True)]
    else:
        grown = e.op("Shape", [up.name], start=2)
    return up.reshape(shape_cat(e, [dims_part(e, g, 0, 2), grown])).name


def flip(e: Emitter, w: str, k: int) -> str:
    """``w`` reversed along its spatial axes."""
    return EmitterContext(e).val(w).apply("Slice", e.ints([-1] * k), e.ints([INT64_MIN] * k), e.ints(_axes(k)),
                                          e.ints([-1] * k)).name


def group_transpose(e: Emitter, w: str, group: int, cg: int, kernel: list[int]) -> str:
    """A grouped weight ``(M, C/g, K..)`` as the weight ``(C, M/g, K..)`` of the transposed grouped map."""
    r = EmitterContext(e).val(w).reshape([group, -1, cg, *kernel])
    return r.transpose([0, 2, 1, *range(3, len(kernel) + 3)]).reshape([group * cg, -1, *kernel]).name


def channels_per_group(e: Emitter, node: Node, w: str, x: str, group: int) -> int:
    """``C / group``: dimension 1 of the weight (or of ``x`` divided by ``group``)."""
    dw, dx = e.dims(w), e.dims(x)
    if dw is not None and isinstance(dw[1], int):
        return dw[1]
    if dx is not None and isinstance(dx[1], int):
        return dx[1] // group
    raise GraphError(f"{node.label()}: the number of channels per group is unknown (neither {w!r} nor {x!r} "
                     "has a static dimension 1), and the grouped VJP needs it")


# ------------------------------------------------------------------------------------------ the three gradients


def input_grad(e: Emitter, node: Node, g: str, w: str, x: str, geo: Geometry, group: int,
               out: list[int] | None, cg: int | None = None, like: str | None = None) -> str:
    """The adjoint of ``Conv(x, w)`` (geometry ``geo``, output sizes ``out`` when static) applied to ``g``:
    ``dx[i] = sum dy[o] w[k]`` over ``o*s + k*d = i + pb`` (PyTorch ``convolution_backward``, grad_input).
    ``x`` only supplies the spatial sizes; ``like`` records the result's type."""
    k, val = len(geo.kernel), EmitterContext(e).val
    dims = spatial(e, x)
    if group == 1:
        if dims is not None and out is not None:
            # The transposed conv spans F = s*(O-1) + span positions; F - pb - D of them lie past the input.
            end = [s * (o - 1) + sp - b - d
                   for s, o, sp, b, d in zip(geo.strides, out, geo.span, geo.pb, dims, strict=True)]
            outpad = [max(0, -v) for v in end]
            return val(g).apply("ConvTranspose", w, like=like, strides=geo.strides, dilations=geo.dilations,
                                pads=[*geo.pb, *(max(0, v) for v in end)],
                                output_padding=outpad if any(outpad) else None).name
        full = val(g).apply("ConvTranspose", w, like=None, strides=geo.strides, dilations=geo.dilations,
                            pads=[*geo.pb, *[0] * k])
        return fit(e, full.name, x, [s - 1 for s in geo.strides], like)
    # Grouped: correlate the zero-interleaved gradient with the flipped group-transposed weight.
    up = val(dilate(e, g, geo.strides, out))
    wt = flip(e, group_transpose(e, w, group, cg, geo.kernel), k)
    lead = [sp - 1 - b for sp, b in zip(geo.span, geo.pb, strict=True)]
    cut = [max(0, -v) for v in lead]
    lead = [max(0, v) for v in lead]
    if any(cut):  # a pad wider than the kernel span: the first outputs read padding only, no input gets theirs
        up = up.apply("Slice", e.ints(cut), e.ints([INT64_MAX] * k), e.ints(_axes(k)), like=None)
    if dims is not None and out is not None:
        length = [s * (o - 1) + 1 - c for s, o, c in zip(geo.strides, out, cut, strict=True)]
        tail = [d + sp - 1 - n - v for d, sp, n, v in zip(dims, geo.span, length, lead, strict=True)]
        if any(t < 0 for t in tail):
            ends = [n + min(t, 0) for n, t in zip(length, tail, strict=True)]
            up = up.apply("Slice", e.ints([0] * k), e.ints(ends), e.ints(_axes(k)), like=None)
        return up.apply("Conv", wt, like=like, dilations=geo.dilations, pads=[*lead, *(max(0, t) for t in tail)],
                        group=group).name
    tail = [sp - 1 + s - 1 for sp, s in zip(geo.span, geo.strides, strict=True)]
    wide = up.apply("Conv", wt, like=None, dilations=geo.dilations, pads=[*lead, *tail], group=group)
    return fit(e, wide.name, x, [0] * k, like)


def weight_grad(e: Emitter, x: str, g: str, geo: Geometry, group: int, cg: int, trim: bool,
                like: str | None) -> str:
    """``dw[m, c, k] = sum_{n,o} g[n, m, o] x_pad[n, group(m)*cg + c, o*s + k*d]`` for ``Conv(x, w)`` with
    geometry ``geo`` (PyTorch ``convolution_backward``, grad_weight): a grouped Conv of ``x`` laid out as
    ``(cg, group*N, ..)`` with ``g`` laid out as ``(M, N, ..)`` as the kernel, stride ``d`` and dilation ``s``.
    ``trim``: cut the result to the kernel size (it can be larger when the windows do not reach the end)."""
    k, val = len(geo.kernel), EmitterContext(e).val
    sp = _axes(k)
    if group == 1:
        xr = val(x).transpose([1, 0, *sp])
    elif (xs := e.shape(x)) is not None:  # explicit sizes: a -1 is ambiguous when a spatial size is 0
        grouped = val(x).apply("Reshape", e.ints([xs[0], group, cg, int(np.prod(xs[2:]))]), like=None, allowzero=1)
        xr = grouped.transpose([2, 1, 0, 3]).apply("Reshape", e.ints([cg, group * xs[0], *xs[2:]]), like=None,
                                                    allowzero=1)
    else:
        moved = val(x).reshape([0, group, cg, -1]).transpose([2, 1, 0, 3])
        xr = moved.reshape(shape_cat(e, [[cg, -1], dims_part(e, x, 2)]))
    gr = val(g).transpose([1, 0, *sp])
    c = xr.apply("Conv", gr, like=None, strides=geo.dilations, dilations=geo.strides, pads=[*geo.pb, *geo.pe],
                 group=group)
    if not trim:
        return c.apply("Transpose", like=like, perm=[1, 0, *sp]).name
    dw = c.transpose([1, 0, *sp])
    return dw.apply("Slice", e.ints([0] * k), e.ints(geo.kernel), e.ints(sp), like=like).name


def weight_grad_taps(e: Emitter, x: str, g: str, geo: Geometry, out: list[int], like: str | None) -> str:
    """The weight gradient of an ungrouped Conv, ``dw[m, c, k] = sum_{n,o} g[n, m, o] x_pad[n, c, o*s + k*d]``,
    as one batched ``MatMul`` per kernel tap ``k`` (the strided slice of ``x_pad`` that tap reads, as
    ``[N, C, O]``, times ``g`` transposed once to ``[N, O, M]``) and a sum over the batch. onnxruntime's Conv
    with the whole output gradient as its kernel (:func:`weight_grad`) runs about 2x slower than these GEMMs
    on 3x3 and 1x1 layers (bench/micro.py); ``out`` are the static output sizes."""
    k, val = len(geo.kernel), EmitterContext(e).val
    sp = _axes(k)
    xp = val(x)
    if any(geo.pb) or any(geo.pe):
        xp = xp.apply("Pad", e.ints([0, 0, *geo.pb, 0, 0, *geo.pe]), like=None)
    dims = spatial(e, xp.name)
    gt = val(g).reshape([0, 0, -1]).transpose([0, 2, 1])  # [N, O, M]
    taps: list[Val] = []
    for tap in itertools.product(*(range(n) for n in geo.kernel)):
        starts = [t * d for t, d in zip(tap, geo.dilations, strict=True)]
        ends = [b + (o - 1) * s + 1 for b, o, s in zip(starts, out, geo.strides, strict=True)]
        xs = xp
        if any(starts) or ends != dims or any(s != 1 for s in geo.strides):
            xs = xp.apply("Slice", e.ints(starts), e.ints(ends), e.ints(sp), e.ints(geo.strides), like=None)
        taps.append(xs.reshape([0, 0, -1]) @ gt)  # [N, C, M]
    stacked = taps[0] if len(taps) == 1 else taps[0].apply("Concat", *taps[1:], like=None, axis=1)  # [N, taps*C, M]
    by_tap = stacked.sum([0]).reshape([len(taps), -1, 0])  # [1, taps * C, M] summed over the batch, as [taps, C, M]
    return by_tap.transpose([2, 1, 0]).reshape([0, 0, *geo.kernel], like=like).name


def bias_grad(e: Emitter, g: str, k: int, b: str) -> str:
    """``db = sum of dy over every axis but 1`` (the channels)."""
    return EmitterContext(e).val(g).sum([0, *_axes(k)], keepdims=0, like=b).name


# ------------------------------------------------------------------------------------------ rules


@vjp("Conv", bounded=True, finite=True, product=True, mixing=True)
def conv(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Conv" (groups, strides, dilations, pads/auto_pad, any spatial rank, optional bias): input
    gradient by the transposed convolution, weight gradient by a convolution of the input with the output
    gradient, bias gradient by a sum (module docstring)."""
    e, g = ctx.e, cts[0]
    x, w, b = node.inputs[0], node.inputs[1], optional_input(node, 2)
    k = e.need_rank(x, node) - 2
    group = int(node.attrs.get("group", 1))
    geo = conv_geometry(e, node, x, w, k)
    dims = spatial(e, x)
    out = geo.out(dims) if dims is not None else None
    cg = channels_per_group(e, node, w, x, group) if group > 1 else 1

    def dw() -> str:
        # (not in 16-bit floats: the taps' sum over the batch would round each sample's product to 8 or 11 bits,
        # where one Conv accumulates the whole sum in float32 and rounds once, as torch's convolution_backward)
        low = e.dtype(x) is not None and np.dtype(e.dtype(x)).itemsize == 2
        if group == 1 and out is not None and int(np.prod(geo.kernel)) <= MAX_TAPS and not low:
            return weight_grad_taps(e, x, g, geo, out, like=w)
        return weight_grad(e, x, g, geo, group, cg, trim=True, like=w)

    grads = [lambda: input_grad(e, node, g, w, x, geo, group, out, cg, like=x), dw, lambda: bias_grad(e, g, k, b)]
    return grads[:len(node.inputs)]


def transpose_pads(e: Emitter, node: Node, x: str, geo_kernel: list[int], strides: list[int],
                   dilations: list[int], outpad: list[int]) -> tuple[list[int], list[int]]:
    """Explicit pads of a ConvTranspose (ONNX "ConvTranspose": with ``output_shape`` or SAME_*, the total
    padding is ``s*(D-1) + output_padding + span - out``; SAME_UPPER puts the smaller half first, otherwise
    the larger half goes first; SAME_* without ``output_shape`` targets ``out = D * s``)."""
    k = len(geo_kernel)
    auto = node.attrs.get("auto_pad", "NOTSET") or "NOTSET"
    target = node.attrs.get("output_shape")
    if (target is not None and len(target)) or auto in ("SAME_UPPER", "SAME_LOWER"):
        dims = need_spatial(e, node, x, "output_shape" if target is not None and len(target) else f"auto_pad={auto}")
        if target is not None and len(target):
            want = [int(t) for t in target][-k:]
        else:
            want = [d * s for d, s in zip(dims, strides, strict=True)]
        total = [s * (d - 1) + op + (kk - 1) * dl + 1 - t
                 for s, d, op, kk, dl, t in zip(strides, dims, outpad, geo_kernel, dilations, want, strict=True)]
        if any(t < 0 for t in total):
            raise GraphError(f"{node.label()}: output_shape {want} is larger than the transposed convolution can "
                             "produce; its VJP does not handle negative padding")
        return split_pads(total, auto)
    return explicit_pads(node, auto, k)


@vjp("ConvTranspose", bounded=True, finite=True, product=True, mixing=True)
def conv_transpose(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "ConvTranspose" is the adjoint of a Conv with the same weight and geometry, written into an
    output of ``s*(D-1) + output_padding + span`` positions cut by the pads (PyTorch ``convolution_backward``
    with ``transposed=True``). So the input gradient is ``Conv(dy, w)`` and the weight gradient the Conv
    construction of :func:`weight_grad` with ``dy`` as the input and ``x`` as the output gradient. The
    ``output_padding`` positions beyond the full extent hold no data: their gradient rows are dropped."""
    e, g = ctx.e, cts[0]
    x, w, b = node.inputs[0], node.inputs[1], optional_input(node, 2)
    k = e.need_rank(x, node) - 2
    group = int(node.attrs.get("group", 1))
    kernel = kernel_of(e, node, w, k)
    strides, dilations = ints_attr(node, "strides", [1] * k), ints_attr(node, "dilations", [1] * k)
    outpad = ints_attr(node, "output_padding", [0] * k)
    pb, pe = transpose_pads(e, node, x, kernel, strides, dilations, outpad)
    cut = [max(0, o - a) for o, a in zip(outpad, pe, strict=True)]
    geo = Geometry(kernel, strides, dilations, pb, [max(0, a - o) for o, a in zip(outpad, pe, strict=True)])

    @cache
    def dy() -> str:
        """``g`` without the ``output_padding`` positions that hold no data."""
        if not any(cut):
            return g
        ends = [-c if c else INT64_MAX for c in cut]
        return ctx.val(g).apply("Slice", e.ints([0] * k), e.ints(ends), e.ints(_axes(k)), like=None).name

    def dw() -> str:
        cg = 1
        if group > 1:
            dims = e.dims(w)
            if dims is None or not isinstance(dims[1], int):
                raise GraphError(f"{node.label()}: dimension 1 of the weight {w!r} is unknown, and the grouped "
                                 "VJP needs it")
            cg = dims[1]
        return weight_grad(e, dy(), x, geo, group, cg, trim=False, like=w)

    grads = [lambda: ctx.val(dy()).apply("Conv", w, like=x, group=group, **geo.attrs()), dw,
             lambda: bias_grad(e, g, k, b)]
    return grads[:len(node.inputs)]
