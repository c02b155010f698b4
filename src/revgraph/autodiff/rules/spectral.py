"""VJPs of the Fourier transforms (ONNX operator spec, "DFT" (opsets 17 and 20) and "STFT" (opset 17);
derivatives as in PyTorch's ``fft_r2c_backward``/``fft_c2r_backward``/``fft_c2c`` in
``tools/autograd/derivatives.yaml`` and ``torch/_refs/fft.py``, and JAX's ``jax._src.fft`` transpose rules).

A DFT is linear. With complex values as pairs ``[..., 2]`` (real, imaginary), the adjoint of ``y = F x`` under
the real inner product ``sum(Re(y) dRe + Im(y) dIm)`` is ``F^H dy``, the conjugate-transposed matrix, so

- forward DFT (``y_k = sum_n x_n e^{-2 pi i k n / L}``): ``dx = F^H dy = conj(F conj(dy))``, a forward DFT of
  the conjugate direction, conjugated back; one-sided (``k <= L/2``): the same with ``dy`` zero-extended to L
  bins, which the inner DFT's ``dft_length = L`` does itself; a real ``x`` takes the real part;
- inverse DFT (``y_n = (1/L) sum_k x_k e^{+2 pi i k n / L}``): ``dx = (1/L) F dy``, a forward DFT;
- inverse one-sided DFT (IRFFT: a real signal of length L from the bins ``k < L//2 + 1`` of a Hermitian
  spectrum; the imaginary parts of bin 0 and of bin L/2 for an even L are discarded): ``y = (1/L) Re(sum_k c_k
  x_k e^{2 pi i k n / L})`` with ``c_0 = 1``, ``c_{L/2} = 1`` for an even L and ``c_k = 2`` otherwise, so
  ``dx_k = (c_k / L) (F dy)_k``, a one-sided forward DFT of the real ``dy`` (PyTorch ``fft_c2r_backward``:
  ``rfft`` and the doubled middle bins).

``dft_length`` pads the signal with zeros or truncates it along the axis; its adjoint truncates the gradient to
the input's length or pads it with zeros (the truncated samples get 0). The backward graphs use forward DFTs
only: onnxruntime computes inverse DFTs in float64 with ~1e-8 relative error (its forward DFTs are exact to
rounding), and its IRFFT ignores a ``dft_length`` other than ``2 (n - 1)`` (it reads other bins than the spec,
numpy's ``irfft`` and the onnx reference evaluator); the IRFFT VJP follows the spec.

STFT frames the signal (frame f is samples ``f * step + t``, ``t < frame_length``), multiplies each frame by the
window and takes each frame's DFT of length ``frame_length`` (one-sided by default). Its VJP is the DFT's per
frame, then: the signal gets the window times the frames' cotangents overlap-added back (a sequential
``ScatterElements`` add, as Gather's VJP), the window the frames times their cotangents, summed.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ._common import optional_input
from .tables import small


def _int_input(e: Emitter, node: Node, i: int, what: str) -> int | None:
    """The constant integer scalar input ``i``; ``None`` when absent; :class:`GraphError` when not constant."""
    name = optional_input(node, i)
    if name is None:
        return None
    v = e.value(name)
    if v is None:
        raise GraphError(f"{node.label()}: the {node.op_type} VJP needs a constant {what}; {name!r} is computed")
    return int(np.asarray(v).reshape(-1)[0])


def _complex_dim(e: Emitter, node: Node, x: str) -> int:
    dims = e.dims(x)
    last = dims[-1] if dims else None
    if last not in (1, 2):
        raise GraphError(f"{node.label()}: the last dimension of {x!r} must be 1 (real) or 2 (complex) and known, "
                         f"got {last!r}")
    return last


def emit_dft(e: Emitter, z: str, axis: int, length: int | str | None = None, inverse: int = 0,
             onesided: int = 0) -> str:
    """A ``DFT`` node over ``axis`` (non-negative) at the emitter's opset (the axis an input from opset 20, an
    attribute before); ``length``: an int, a scalar integer value, or ``None`` (the axis' length)."""
    n = "" if length is None else e.const(np.int64(length)) if isinstance(length, int) else length
    attrs = {"inverse": inverse or None, "onesided": onesided or None}
    if e.opset >= 20:
        return e.op("DFT", [z, n, e.const(np.int64(axis))], **attrs)
    return e.op("DFT", [z, n] if n else [z], axis=axis, **attrs)


def _conj(z: Val) -> Val:
    """The complex conjugate of ``z`` (``[..., 2]``): ``z * [1, -1]``."""
    return z.apply("Mul", np.asarray([1.0, -1.0], dtype=z.dtype or np.float32))


def _real(z: Val) -> Val:
    """The real parts of ``z`` (``[..., 2]``) as ``[..., 1]``."""
    e = z.ctx.e
    return z.apply("Slice", e.ints([0]), e.ints([1]), e.ints([-1]), like=None)


def _dft(z: Val, axis: int, length: int | str | None = None, inverse: int = 0, onesided: int = 0) -> Val:
    """:func:`emit_dft` of a value."""
    return z.ctx.val(emit_dft(z.ctx.e, z.name, axis, length, inverse, onesided))


class _Length:
    """A length along the transformed axis: an int when known while building, else an int64 ``[1]`` value."""

    def __init__(self, e: Emitter, static: int | None, value: str | None = None):
        self.e, self.static = e, static
        self._value = value

    @property
    def value(self) -> str:
        """int64 ``[1]``."""
        if self.static is not None:
            return self.e.ints([self.static])
        return self._value

    def scalar(self, like: str) -> str:
        """The length as a scalar of ``like``'s dtype."""
        e = self.e
        if self.static is not None:
            return e.scalar(float(self.static), like)
        return e.op("CastLike", [e.op("Squeeze", [self.value, e.ints([0])]), like])


def _axis_length(e: Emitter, x: str, axis: int) -> _Length:
    dims = e.dims(x)
    d = dims[axis] if dims is not None else None
    if isinstance(d, int):
        return _Length(e, d)
    return _Length(e, None, e.op("Shape", [x], start=axis, end=axis + 1, shape=(1,), dtype=np.dtype(np.int64)))


def _fit(e: Emitter, z: Val, axis: int, have: _Length, want: _Length) -> Val:
    """``z`` (length ``have`` along ``axis``) truncated or zero-padded at the end to length ``want``: the adjoint
    of padding or truncating a signal from ``want`` samples to ``have``."""
    ax = e.ints([axis])
    if have.static is not None and want.static is not None:
        if have.static == want.static:
            return z
        if want.static < have.static:
            return z.apply("Slice", e.ints([0]), e.ints([want.static]), ax, like=None)
        return z.apply("Pad", e.ints([0, want.static - have.static]), "", ax, like=None)
    cut = z.apply("Slice", e.ints([0]), want.value, ax, like=None)
    extra = (z.ctx.val(want.value) - have.value).apply("Max", e.ints([0]))
    return cut.apply("Pad", e.op("Concat", [e.ints([0]), extra.name], axis=0), "", ax, like=None)


def _irfft_weights(e: Emitter, length: _Length, like: Val, trailing: int) -> Val:
    """``c_k / L`` for the ``L//2 + 1`` bins of an IRFFT of length L (1 for bin 0 and, L even, bin L/2; 2
    otherwise), shaped ``[L//2 + 1, 1 * trailing]`` to broadcast along the transformed axis."""
    shape = [-1] + [1] * trailing
    if length.static is not None and small([length.static // 2 + 1]):
        n = length.static
        c = np.full(n // 2 + 1, 2.0)
        c[0] = 1.0
        if n % 2 == 0:
            c[-1] = 1.0
        return like.ctx.val(e.const((c / n).astype(like.dtype or np.float32).reshape(shape)))
    ctx = like.ctx
    n = ctx.val(length.value).squeeze([0])
    k = ctx.val(e.op("Range", [e.const(np.int64(0)), (n / 2 + 1).name, e.const(np.int64(1))]))  # the bins
    c = where(k.eq(0) | (k * 2).eq(n), ctx.val(e.scalar(1.0, like.name)), 2.0, like=None)
    return (c / length.scalar(like.name)).reshape(shape)


def _dft_attrs(ctx: Ctx, node: Node, x: str) -> tuple[int, int, int, int]:
    """``(rank, axis, inverse, onesided)`` of a DFT node; the axis non-negative, in ``[0, rank - 2]``."""
    e = ctx.e
    rank = e.need_rank(x, node)
    axis = _int_input(e, node, 2, "axis")
    if axis is None:
        axis = int(node.attrs.get("axis", -2 if e.opset >= 20 else 1))
    a = axis + rank if axis < 0 else axis
    if not 0 <= a <= rank - 2:
        raise GraphError(f"{node.label()}: DFT axis {axis} is out of range for rank {rank}")
    return rank, a, int(node.attrs.get("inverse", 0)), int(node.attrs.get("onesided", 0))


@vjp("DFT", bounded=False, finite=False)
def dft(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "DFT": the adjoint transforms of the module doc, then the gradient cut or padded back to the input's
    length along the axis (the adjoint of ``dft_length``'s padding or truncation). ``dft_length`` may be
    computed in the graph; ``axis`` must be constant. The integer inputs get no gradient."""
    e, x, g = ctx.e, node.inputs[0], ctx.val(cts[0])
    rank, a, inverse, onesided = _dft_attrs(ctx, node, x)
    last = _complex_dim(e, node, x)

    def length_of(n: _Length) -> _Length:  # L: dft_length, else the input's length (IRFFT: 2 (n - 1))
        dft_len = optional_input(node, 1)
        if dft_len is None:
            if not (inverse and onesided):
                return n
            if n.static is not None:
                return _Length(e, 2 * (n.static - 1))
            return _Length(e, None, ((ctx.val(n.value) - e.ints([1])) * e.ints([2])).name)
        if e.value(dft_len) is not None:
            return _Length(e, int(np.asarray(e.value(dft_len)).reshape(-1)[0]))
        return _Length(e, None, ctx.val(dft_len).cast(np.int64).reshape([1]).name)

    def dx() -> Val:
        n = _axis_length(e, x, a)
        length = length_of(n)
        size = length.static if length.static is not None else e.op("Squeeze", [length.value, e.ints([0])])
        real = (lambda z: z) if last == 2 else _real
        if not inverse:  # F^H dy = conj(F conj(dy)); one-sided: dy zero-extended to L bins by dft_length
            z = _dft(_conj(g), a, size if onesided else None)
            return _fit(e, _conj(z) if last == 2 else _real(z), a, length, n)
        if not onesided:  # (1/L) F dy
            return _fit(e, real(_dft(g, a) * ctx.val(length.scalar(g.name)).reciprocal()), a, length, n)
        # IRFFT: (c_k / L) rfft(dy), L//2 + 1 bins
        z = _dft(g, a, None, onesided=1) * _irfft_weights(e, length, g, rank - 1 - a)
        bins = _Length(e, length.static // 2 + 1) if length.static is not None else \
            _Length(e, None, (ctx.val(length.value) / e.ints([2]) + e.ints([1])).name)
        return _fit(e, real(z), a, bins, n)

    return [dx, *[None] * (len(node.inputs) - 1)]


# ------------------------------------------------------------------------------------------------------ STFT


@vjp("STFT", bounded=False, finite=False)
def stft(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "STFT": with ``z[b, f, t] = signal[b, f * step + t] * window[t]`` and ``Y[b, f] = DFT(z[b, f])``
    (one-sided by default), ``dz = F^H dY`` per frame (the DFT VJP), ``dsignal`` overlap-adds ``window * dz``
    (ScatterElements, race free) and ``dwindow[t] = sum_{b, f} Re(frames * dz)``. ``frame_step`` and the frame
    length (``frame_length``, or the window's static length, or the signal's) must be known while building."""
    e, signal, g = ctx.e, node.inputs[0], ctx.val(cts[0])
    window = optional_input(node, 2)
    rank = e.need_rank(signal, node)
    if rank != 3:
        raise GraphError(f"{node.label()}: STFT needs a signal of rank 3, got rank {rank}")
    last = _complex_dim(e, node, signal)
    step = _int_input(e, node, 1, "frame_step")
    length = _int_input(e, node, 3, "frame_length")
    if length is None:
        src = window if window is not None else signal
        dims = e.dims(src)
        length = dims[0 if window is not None else 1] if dims is not None else None
        if not isinstance(length, int):
            raise GraphError(f"{node.label()}: the STFT VJP needs the frame length: give frame_length as a constant "
                             f"or {src!r} a static shape")
    onesided = int(node.attrs.get("onesided", 1))

    @cache
    def dz() -> Val:  # [B, F, length, last]: the cotangent of the windowed frames
        z = _dft(_conj(g), 2, length if onesided else None)
        return _conj(z) if last == 2 else _real(z)

    @cache
    def positions() -> str:  # int64 [F, length]: frame f reads samples f * step + t
        dims = g.dims
        frames = dims[1] if dims is not None and isinstance(dims[1], int) else None
        if frames is not None and small([frames, length]):
            pos = np.arange(frames)[:, None] * step + np.arange(length)[None, :]
            return e.const(pos.astype(np.int64))
        count = e.const(np.int64(frames)) if frames is not None else \
            e.op("Squeeze", [e.op("Shape", [g.name], start=1, end=2), e.ints([0])])
        starts = e.op("Mul", [e.op("Range", [e.const(np.int64(0)), count, e.const(np.int64(1))]),
                              e.const(np.int64(step))])
        ramp = e.op("Range", [e.const(np.int64(0)), e.const(np.int64(length)), e.const(np.int64(1))])
        return e.op("Add", [e.op("Unsqueeze", [starts, e.ints([1])]), e.op("Unsqueeze", [ramp, e.ints([0])])])

    def dsignal() -> str:
        upd = dz() if window is None else dz() * ctx.val(window).reshape([-1, 1])
        upd = upd.reshape([0, -1, last]).name  # [B, F * length, last]
        index = e.op("Expand", [e.op("Reshape", [positions(), e.ints([1, -1, 1])]), e.op("Shape", [upd])])
        return e.op("ScatterElements", [e.zeros_like(signal), index, upd], axis=1, reduction="add", like=signal)

    def dwindow() -> Val:
        frames = ctx.val(e.op("Gather", [signal, positions()], axis=1))  # [B, F, length, last]
        return (frames * dz()).sum([0, 1, 3], keepdims=0)

    return [dsignal, None, None if window is None else dwindow, *[None] * (len(node.inputs) - 3)][:len(node.inputs)]
