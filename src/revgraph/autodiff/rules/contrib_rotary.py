"""VJP of onnxruntime's ``com.microsoft`` ``RotaryEmbedding`` (onnxruntime docs/ContribOperators.md; the CPU kernel
``contrib_ops/cpu/bert/rotary_embedding.cc`` and ``rotary_embedding_helper.h``), and the rotation the attention
rules with ``do_rotary`` share (:mod:`.contrib_gqa`, :mod:`.contrib_mha`). The forward keeps the node, which
onnxruntime runs; the VJP is standard ONNX operators (``Gather``, ``Slice``, ``Mul``, ``Concat``).

``RotaryEmbedding(input, position_ids, cos_cache, sin_cache)``: ``input`` is ``[B, S, H*D]`` (``num_heads``, or
``D = 2 * cos_cache.shape[1]`` when ``rotary_embedding_dim`` is 0) or ``[B, H, S, D]``. The first ``R`` features
of each head (``rotary_embedding_dim``, default ``D``; the others pass through) form pairs ``(x1, x2)``: the two
halves, or even and odd features when ``interleaved``; each pair is rotated by the angle of its position,
``(c x1 - s x2, s x1 + c x2)`` with ``c = cos_cache[p]``, ``s = sin_cache[p]``. ``position_ids`` is ``[B, S]``
(``p = position_ids[b, t]``) or one element (``p = position_ids[0] + t``). The kernel reads neither ``scale``
nor ``is_packed_batching`` (the output is the same with them; tested).

A rotation's transpose is the rotation by the opposite angle: ``dX = (c g1 + s g2, c g2 - s g1)`` and the passed
through features' cotangent as it is. The caches are differentiable as well (the output is bilinear in X and the
caches): ``dcos[p] += sum_heads(g1 x1 + g2 x2)``, ``dsin[p] += sum_heads(g2 x1 - g1 x2)``, a sparse gradient (rows
at the positions, as Gather's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ...ir.contrib_types import MS
from ..algebra import Val
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ..sparse import SparseGrad
from ._common import dim, flat_indices, int_range


@dataclass(frozen=True)
class Rotation:
    """The rotation of the first ``2 * half`` features of the last axis (``interleaved``: pairs of neighbours,
    else the two halves) by angles whose cosines and sines ``c``, ``s`` broadcast against those pairs
    (``[..., half]``)."""

    c: Val
    s: Val
    half: int
    interleaved: bool

    def pairs(self, x: Val) -> tuple[Val, Val]:
        """The two members of each rotated pair of ``x`` (``[..., half]`` each)."""
        e, r = x.ctx.e, 2 * self.half
        if self.interleaved:
            return (x.ctx.val(e.op("Slice", [x.name, e.ints([0]), e.ints([r]), e.ints([-1]), e.ints([2])])),
                    x.ctx.val(e.op("Slice", [x.name, e.ints([1]), e.ints([r]), e.ints([-1]), e.ints([2])])))
        return (x.ctx.val(e.op("Slice", [x.name, e.ints([0]), e.ints([self.half]), e.ints([-1])])),
                x.ctx.val(e.op("Slice", [x.name, e.ints([self.half]), e.ints([r]), e.ints([-1])])))

    def _join(self, x: Val, a: Val, b: Val) -> Val:
        """The features of ``x`` with its rotated pairs replaced by ``(a, b)``."""
        e = x.ctx.e
        if self.interleaved:
            both = e.op("Concat", [e.op("Unsqueeze", [a.name, e.ints([-1])]),
                                   e.op("Unsqueeze", [b.name, e.ints([-1])])], axis=-1)
            rot = e.op("Reshape", [both, e.op("Concat", [e.op("Shape", [a.name], end=-1), e.ints([2 * self.half])],
                                                        axis=0)])
        else:
            rot = e.op("Concat", [a.name, b.name], axis=-1)
        rest = e.op("Slice", [x.name, e.ints([2 * self.half]), e.ints([np.iinfo(np.int64).max]), e.ints([-1])])
        return x.ctx.val(e.op("Concat", [rot, rest], axis=-1, like=x.name))

    def apply(self, x: Val, inverse: bool = False) -> Val:
        """``x`` rotated (``inverse``: by the opposite angles, the transpose: a cotangent's way back)."""
        x1, x2 = self.pairs(x)
        c, s = self.c, self.s
        if inverse:
            return self._join(x, c * x1 + s * x2, c * x2 - s * x1)
        return self._join(x, c * x1 - s * x2, s * x1 + c * x2)

    def cache_grads(self, x: Val, g: Val) -> tuple[Val, Val]:
        """The cotangents of ``c`` and ``s`` at the shape of ``x``'s pairs (before any sum over broadcast axes),
        from ``x`` and the output's cotangent ``g``."""
        x1, x2 = self.pairs(x)
        g1, g2 = self.pairs(g)
        return g1 * x1 + g2 * x2, g2 * x1 - g1 * x2


def cache_rows(e: Emitter, table: str, positions: str) -> str:
    """The rows of a cos or sin cache ``[max_positions, R/2]`` at the int64 ``positions`` (any shape)."""
    return e.op("Gather", [table, positions], axis=0)


def half_width(e: Emitter, node: Node, table: str) -> int:
    """``R/2``: the static width of a cos/sin cache (refused in one line when not static)."""
    dims = e.dims(table)
    if dims is None or len(dims) != 2 or not isinstance(dims[1], int):
        raise GraphError(f"{node.label()}: the rotary caches need a static shape [max_positions, R/2], got "
                         f"{dims} for {table!r}")
    return dims[1]


def _split_heads(e: Emitter, node: Node, x: str, half: int) -> tuple[str, int, int]:
    """``x`` as ``[B, S, H, D]`` (3-D input) or itself (4-D ``[B, H, S, D]``), the heads axis and the sequence
    axis."""
    rank = e.need_rank(x, node)
    if rank == 4:
        return x, 1, 2
    if rank != 3:
        raise GraphError(f"{node.label()}: RotaryEmbedding takes a 3-D or 4-D input, not rank {rank}")
    heads = int(node.attrs.get("num_heads", 0))
    rdim = int(node.attrs.get("rotary_embedding_dim", 0))
    if rdim and not heads:
        raise GraphError(f"{node.label()}: rotary_embedding_dim needs num_heads (onnxruntime's kernel)")
    shape = [0, 0, -1, 2 * half] if not rdim else [0, 0, heads, -1]
    return e.op("Reshape", [x, e.ints(shape)]), 2, 1


def _positions(e: Emitter, pos: str, x4: str, seq_axis: int) -> str:
    """int64 positions ``[B, S]`` or ``[1, S]`` (one element: ``position_ids[0] + t``)."""
    p = pos if e.dtype(pos) == np.int64 else e.op("Cast", [pos], to=7)
    if e.rank(pos) == 2:
        return p
    first = e.op("Reshape", [p, e.ints([1, 1])])
    return e.op("Add", [first, e.op("Unsqueeze", [int_range(e, _len(e, x4, seq_axis)), e.ints([0])])])


def _len(e: Emitter, x: str, axis: int):
    d = e.dims(x)
    return d[axis] if d is not None and isinstance(d[axis], int) else dim(e, x, axis)


@vjp("RotaryEmbedding", domain=MS, bounded=True, finite=True, reads="all")
def rotary_embedding(ctx: Ctx, node: Node, cts: list) -> list:
    """``com.microsoft.RotaryEmbedding`` (module doc): ``dX`` rotated back; the caches' rows at the positions."""
    e, g = ctx.e, cts[0]
    x, pos, cos, sin = node.inputs[:4]
    rdim = int(node.attrs.get("rotary_embedding_dim", 0))
    half = half_width(e, node, cos)
    if rdim and rdim != 2 * half:
        raise GraphError(f"{node.label()}: rotary_embedding_dim {rdim} differs from twice the caches' width {half}")
    interleaved = bool(node.attrs.get("interleaved", 0))

    @cache
    def parts() -> tuple[Rotation, str, str, int, str]:
        x4, heads, seq = _split_heads(e, node, x, half)
        g4 = e.op("Reshape", [g, e.op("Shape", [x4])]) if x4 != x else g
        p = _positions(e, pos, x4, seq)
        c, s = (e.op("Unsqueeze", [cache_rows(e, t, p), e.ints([heads])]) for t in (cos, sin))
        return Rotation(ctx.val(c), ctx.val(s), half, interleaved), x4, g4, heads, p

    def dx() -> str:
        rot, x4, g4, _, _ = parts()
        d = rot.apply(ctx.val(g4), inverse=True).name
        return d if x4 == x else e.op("Reshape", [d, e.op("Shape", [x])], like=x)

    def dcache(k: int, table: str) -> SparseGrad:
        rot, x4, g4, heads, p = parts()
        d = rot.cache_grads(ctx.val(x4), ctx.val(g4))[k].sum([heads], keepdims=0)  # [B, S, R/2]
        rows = d.reshape([-1, half]).name
        if e.rank(pos) != 2:  # one position list for the whole batch: the batch's rows add up
            rows = d.sum([0], keepdims=0).name
        return SparseGrad(flat_indices(e, p, dim(e, table, 0)), rows, table)

    return [dx, None, lambda: dcache(0, cos), lambda: dcache(1, sin)][:len(node.inputs)]
