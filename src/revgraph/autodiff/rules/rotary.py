"""VJP of rotary position embedding (ONNX operator spec, "RotaryEmbedding" 23), moved out of :mod:`.attention`.

Each pair ``(x1, x2)`` (halves, or even/odd elements when ``interleaved``) of the first ``rotary_embedding_dim``
features is rotated: ``(c x1 - s x2, s x1 + c x2)``. A rotation's transpose is the rotation by the opposite
angle, so ``dX = RotaryEmbedding(dY, cos, -sin)`` (one fused kernel; the features beyond
``rotary_embedding_dim`` pass through in both). The caches are differentiable too (the output is bilinear in X
and the caches): ``dcos = sum_heads(g1 x1 + g2 x2)``, ``dsin = sum_heads(g2 x1 - g1 x2)``, gathered rows added
back at ``position_ids`` (a sparse gradient, as Gather's) when given. ``position_ids`` is an integer input.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ..sparse import SparseGrad
from ._common import dim, flat_indices, optional_input


def _input_grad(node: Node, g: Val, x: str, cos: str, sin: Val, pos: str | None) -> Val:
    """``dX``: ``dY`` rotated back, the same operator with the sine negated."""
    return g.apply("RotaryEmbedding", cos, -sin, *([pos] if pos else []), like=x, **node.attrs)


def _heads(e: Emitter, node: Node, x: str, g: str) -> tuple[str, str, int, int | None]:
    """``x`` and ``g`` with a heads axis (a 3-D ``[B, L, H*D]`` input as ``[B, L, H, D]``), that axis and the
    head size (``None`` when unknown)."""
    rank = e.need_rank(x, node)
    dims = e.dims(x)
    if rank != 3:
        return x, g, 1, None if dims is None or not isinstance(dims[3], int) else dims[3]
    nh = int(node.attrs.get("num_heads", 0))
    if nh <= 0:
        raise GraphError(f"{node.label()}: a 3-D RotaryEmbedding input needs num_heads")
    xs = e.op("Reshape", [x, e.ints([0, 0, nh, -1])])
    gs = e.op("Reshape", [g, e.ints([0, 0, nh, -1])])
    return xs, gs, 2, None if dims is None or not isinstance(dims[2], int) else dims[2] // nh


def _rotary_dim(node: Node, head: int | None) -> int:
    """The number ``R`` of rotated features: ``rotary_embedding_dim``, or the whole head."""
    r = int(node.attrs.get("rotary_embedding_dim", 0)) or head
    if r is None:
        raise GraphError(f"{node.label()}: the cache gradients of RotaryEmbedding need a static head size "
                         "or rotary_embedding_dim")
    return r


def _halves(e: Emitter, t: str, r: int, interleaved: bool) -> tuple[str, str]:
    """The two members of each rotated pair of the first ``r`` features of ``t``: even and odd features when
    ``interleaved``, else the two halves."""
    if interleaved:
        return (e.op("Slice", [t, e.ints([0]), e.ints([r]), e.ints([-1]), e.ints([2])]),
                e.op("Slice", [t, e.ints([1]), e.ints([r]), e.ints([-1]), e.ints([2])]))
    half = r // 2
    return (e.op("Slice", [t, e.ints([0]), e.ints([half]), e.ints([-1])]),
            e.op("Slice", [t, e.ints([half]), e.ints([r]), e.ints([-1])]))


def _pairs(e: Emitter, node: Node, x: str, g: str) -> tuple[str, str, str, str, int, int]:
    """``x1, x2, g1, g2`` (``[B, H, L, R/2]`` or ``[B, L, H, R/2]``), the heads axis and ``R/2``."""
    interleaved = bool(node.attrs.get("interleaved", 0))
    xs, gs, axis, head = _heads(e, node, x, g)
    r = _rotary_dim(node, head)
    return (*_halves(e, xs, r, interleaved), *_halves(e, gs, r, interleaved), axis, r // 2)


def _dcos(x1: Val, x2: Val, g1: Val, g2: Val) -> Val:
    """The cotangent of ``cos`` per head: ``g1 x1 + g2 x2``."""
    return g1 * x1 + g2 * x2


def _dsin(x1: Val, x2: Val, g1: Val, g2: Val) -> Val:
    """The cotangent of ``sin`` per head: ``g2 x1 - g1 x2``."""
    return g2 * x1 - g1 * x2


def _cache_grad(e: Emitter, d: Val, axis: int, half: int, table: str, pos: str | None) -> SparseGrad | Val:
    """The per-head cotangent ``d`` of a cache summed over the heads, then reduced to the cache's shape, or,
    with ``position_ids``, its rows added back at those positions (a sparse gradient)."""
    d = d.sum([axis], keepdims=0)  # [B, L, R/2]
    if pos is None:
        return d.reduce_to(table)
    return SparseGrad(flat_indices(e, pos, dim(e, table, 0)), d.reshape([-1, half]).name, table)


@vjp("RotaryEmbedding", bounded=False, finite=False)
def rotary_embedding(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "RotaryEmbedding" (opset 23): ``dX`` is the inverse rotation of ``dY`` (the same operator with the
    sine negated); the caches get ``sum_heads(g1 x1 + g2 x2)`` (cos) and ``sum_heads(g2 x1 - g1 x2)`` (sin),
    added back at ``position_ids`` when given (see the module docstring)."""
    e, g = ctx.e, cts[0]
    x, cos, sin = node.inputs[:3]
    pos = optional_input(node, 3)

    @cache
    def pairs() -> tuple[str, str, str, str, int, int]:
        return _pairs(e, node, x, g)

    def dcache(term: Callable[..., Val], table: str) -> SparseGrad | Val:
        *halves, axis, half = pairs()
        return _cache_grad(e, term(*ctx.vals(*halves)), axis, half, table, pos)

    out = [lambda: _input_grad(node, ctx.val(g), x, cos, ctx.val(sin), pos), lambda: dcache(_dcos, cos),
           lambda: dcache(_dsin, sin), None]
    return out[: len(node.inputs)]
