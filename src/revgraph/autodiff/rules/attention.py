"""VJP of the attention operator of opsets 23-26 (ONNX operator spec, "Attention" 23/24/25). The rotary
position embedding, "RotaryEmbedding" 23, is in :mod:`.rotary`.

**Attention.** ``Y = P V`` with ``P = softmax(bias + cap(scale Q K^T))`` per head, ``cap(x) = c tanh(x / c)``
when ``softcap = c > 0``. The backward pass is the standard one of FlashAttention-2 (Dao, 2023,
https://arxiv.org/abs/2307.08691, algorithm 2; PyTorch's ``tools/autograd/derivatives.yaml``:
``_scaled_dot_product_flash_attention_for_cpu_backward``):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dO * O)),   dQ = scale dS' K,   dK = scale dS'^T Q

with ``dS' = dS (1 - tanh^2)`` under a softcap. ``rowsum(dO * O)`` equals ``rowsum(P * dP)`` (``O = P V``) and
costs a pass over ``[L, Dv]`` instead of ``[L, S]``. ``P`` is the forward's optional fourth output when the
forward writes it in mode 3 (the softmax), and is otherwise recomputed from Q and K with the same scale,
softcap and bias; modes 0 and 1 give the (capped) logits and save the ``Q K^T`` product. Grouped-query
attention (``kv_num_heads < q_num_heads``, query head ``h`` reads key/value head ``h // G``) never repeats
K or V: Q's ``[B, Hq, L, D]`` is read as ``[B, Hkv, G*L, D]`` (a free reshape), so every product runs per
key/value head and the cotangents of K and V come out summed over the G query heads of their group inside
the contractions (no per-head copies and no separate reduction).

The bias combines, as the spec does, a float ``attn_mask`` (added), a bool one (``False`` is ``-inf``), the
causal frontier ``j <= i + offset`` (``offset`` = the ``past_key`` length, or ``nonpad_kv_seqlen - L`` per
batch in opset 24+), the padding of ``nonpad_kv_seqlen`` and the windows of opset 25; a mask shorter than
the keys is padded with ``-inf``. A float mask receives ``dS`` summed over its broadcast axes (a learned
relative-position bias, T5's, is passed that way). ``present_key``/``present_value`` are
``Concat(past, new)`` along the sequence: their cotangents add to K's and V's and are split between the
past and the new keys. The cotangent of the fourth output adds to the stage it exposes (mode 0: the logits,
1: after the softcap, 2: the softmax input, also the mask's gradient, 3: ``P``).

Zeros: a masked key has ``P = 0`` exactly, so it gets exact zeros (``dS = 0``, no contribution to dK, dV or
the mask) for finite cotangents. A fully masked query row (every key's bias ``-inf``) is a zero row in the
forward (the spec's guard, as PyTorch's ``_safe_softmax``), constant in Q, K and V: its output cotangent is
replaced by zeros (``Where``, exact even for inf or NaN) and its bias by zeros, so the recomputed softmax
stays finite and the row contributes nothing, instead of NaN. Otherwise products follow IEEE arithmetic as
the other contractions do (DESIGN.md section 5).

The scale is the one onnxruntime and the spec's function body use: ``sqrt(scale)`` rounded to float32 (the
default ``1/sqrt(head_size)`` computed in float32), applied to Q and K; the rule multiplies Q once by its
square.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ..algebra import Val, name_of, where
from ..context import Ctx
from ..registry import vjp
from ._common import dim, optional_input

_CANON = "bhld"  # [batch, heads, sequence, features]: the 4-D layout of the spec
_SPLIT = "blhd"  # a 3-D input [B, L, H*D] reshaped to [B, L, H, D]
_NEG_INF = -np.inf


def _perm(src: str, dst: str) -> list[int]:
    return [src.index(c) for c in dst]


def _tr(x: Val, src: str, dst: str) -> Val:
    """``x`` (axes named by ``src``) with its axes in the order ``dst``."""
    return x if src == dst else x.transpose(_perm(src, dst))


def _t(x: Val) -> Val:
    """``x^T`` of a batch of matrices ``[B, H, M, N]``."""
    return x.transpose([0, 1, 3, 2])


class _Attention:
    """One Attention node's backward pass; every intermediate is emitted once, when first read."""

    def __init__(self, ctx: Ctx, node: Node, cts: list):
        e = self.e = ctx.e
        self.val = ctx.val
        self.node = node
        self.q, self.k, self.v = node.inputs[:3]
        self.mask, self.past_k, self.past_v, self.nonpad = (optional_input(node, i) for i in range(3, 7))
        self.gy, self.gpk, self.gpv, self.gqk = (list(cts) + [None] * 4)[:4]
        self.y = node.outputs[0]
        outs = list(node.outputs) + [""] * 4
        self.qk_out = outs[3] or None
        a = node.attrs
        self.mode = int(a.get("qk_matmul_output_mode", 0))
        self.cap = float(np.float32(a.get("softcap", 0.0)))
        self.causal = bool(a.get("is_causal", 0))
        self.left, self.right = int(a.get("left_window_size", -1)), int(a.get("right_window_size", -1))
        self.dt = e.dtype(self.q)
        self.t1 = e.onnx_dtype(self.q)
        sp = a.get("softmax_precision")
        self.sp = None if sp is None or int(sp) == self.t1 else int(sp)
        self.rank = e.need_rank(self.q, node)
        if self.rank not in (3, 4):
            raise GraphError(f"{node.label()}: Attention takes 3-D or 4-D Q, K and V, not rank {self.rank}")
        if self.rank == 3:
            if "q_num_heads" not in a or "kv_num_heads" not in a:
                raise GraphError(f"{node.label()}: 3-D Attention inputs need q_num_heads and kv_num_heads")
            self.hq, self.hkv = int(a["q_num_heads"]), int(a["kv_num_heads"])
        else:
            dq, dk = e.dims(self.q), e.dims(self.k)
            self.hq = dq[1] if dq is not None and isinstance(dq[1], int) else None
            self.hkv = dk[1] if dk is not None and isinstance(dk[1], int) else None
        self.grouped = not (self.hq is not None and self.hq == self.hkv)
        self.layout = _SPLIT if self.rank == 3 else _CANON

    # ------------------------------------------------------------------------------------------ layouts

    def heads(self, x: str, h: int | None, dst: str = _CANON) -> str:
        """An input ``x`` (3-D ``[B, L, H*D]`` or 4-D ``[B, H, L, D]``) as a 4-D tensor with axes ``dst``."""
        x = self.val(x)
        if self.rank == 3:
            x = x.reshape([0, 0, h, -1])
        return _tr(x, self.layout, dst).name

    def unheads(self, g: Val | str, src: str, like: str) -> str:
        """The cotangent ``g`` (4-D, axes ``src``) in the layout of the input ``like``."""
        g = _tr(self.val(name_of(g)), src, self.layout)
        if self.rank == 3:
            g = g.reshape([0, 0, -1], like=like)
        return g.name

    def _heads_dim(self, n: int | None, x: str) -> str:
        """A 1-element int64 value: ``n`` or, when unknown, dimension 1 of the 4-D input ``x``."""
        return self.e.ints([n]) if n is not None else self.e.op("Shape", [x], start=1, end=2)

    def group(self, x: Val | str) -> str:
        """``[B, Hq, L, F]`` as ``[B, Hkv, G*L, F]`` (query head ``h`` = ``kv * G + g``): a reshape."""
        return self._heads(x, self.hkv, self.k)

    def ungroup(self, x: Val | str) -> str:
        """The inverse of :meth:`group`."""
        return self._heads(x, self.hq, self.q)

    def _heads(self, x: Val | str, n: int | None, ref: str) -> str:
        """``x`` reshaped to ``n`` heads (dimension 1 of ``ref`` when unknown), the rest folded into axis 2."""
        x = name_of(x)
        if not self.grouped:
            return x
        e = self.e
        shape = e.ints([0, n, -1, 0]) if n is not None else \
            e.op("Concat", [e.ints([0]), self._heads_dim(n, ref), e.ints([-1, 0])], axis=0)
        return self.val(x).reshape(shape).name

    @cached_property
    def zero(self) -> str:
        return self.e.const(np.zeros((), dtype=self.dt))

    def _cast(self, x: Val, to: int | None) -> Val:
        return x if to is None else x.cast(to)

    # ------------------------------------------------------------------------------------------ operands

    @cached_property
    def head_size(self) -> int | None:
        d = self.e.dims(self.q)
        if d is None or not isinstance(d[-1], int):
            return None
        return d[-1] // self.hq if self.rank == 3 else d[-1]

    @cached_property
    def scale(self) -> str:
        """The factor of ``Q K^T`` as the forward applies it: ``sqrt(scale)`` in float32 (``scale`` defaults
        to ``1/sqrt(head_size)``, computed in float32 as in the spec's function body), then in Q's dtype,
        squared."""
        e, node = self.e, self.node
        s = node.attrs.get("scale")
        if s is None and self.head_size is None:  # the function body's arithmetic, at run time
            d = self.val(e.op("Shape", [self.q4], start=3, end=4))
            root = d.cast(np.float32).sqrt().reciprocal().sqrt().cast(self.t1)
            return (root * root).name
        if s is None:
            s = np.float32(1.0) / np.sqrt(np.float32(self.head_size))
        root = self.dt.type(np.float32(np.sqrt(np.float32(s))))
        return e.const(np.asarray(root * root, dtype=self.dt))

    @cached_property
    def q4(self) -> str:
        return self.heads(self.q, self.hq)

    @cached_property
    def qs(self) -> str:
        """``scale Q``, grouped ``[B, Hkv, G*L, D]``."""
        return (self.val(self.group(self.q4)) * self.scale).name

    def total(self, x: str, past: str | None, h: int | None) -> str:
        """``[B, Hkv, S, F]``: the new keys or values after the past ones (``present_key``/``present_value``)."""
        x4 = self.heads(x, h)
        return x4 if past is None else self.val(past).apply("Concat", x4, like=None, axis=2).name

    @cached_property
    def kt(self) -> str:
        return self.total(self.k, self.past_k, self.hkv)

    @cached_property
    def vt(self) -> str:
        return self.total(self.v, self.past_v, self.hkv)

    # ------------------------------------------------------------------------------------------ the bias

    def _len(self, x: str, axis: int) -> str:
        """Dimension ``axis`` of ``x`` as an int64 scalar."""
        return dim(self.e, x, axis)

    @cached_property
    def q_len(self) -> str:
        return self._len(self.q, 1 if self.rank == 3 else 2)

    @cached_property
    def kv_len(self) -> str:
        return self._len(self.kt, 2)

    @cached_property
    def past_len(self) -> str:
        return self._len(self.past_k, 2) if self.past_k is not None else self.e.const(np.int64(0))

    def _arange(self, n: str, shape: list[int]) -> str:
        e = self.e
        return self.val(e.op("Range", [e.const(np.int64(0)), n, e.const(np.int64(1))])).reshape(shape).name

    @cached_property
    def mask_full(self) -> str | None:
        """``attn_mask`` padded along its last axis to the S keys (with ``-inf`` or ``False``; opset 24+ allows a
        shorter mask)."""
        e, m = self.e, self.mask
        if m is None:
            return None
        dm, dk = e.dims(m), e.dims(self.kt)
        if e.opset < 24 or (dm is not None and dk is not None and dm[-1] == dk[2] and dm[-1] is not None):
            return m  # opset 23 requires the full length
        r = e.need_rank(m, self.node)
        pad_value = e.const(np.asarray(False)) if self.mask_is_bool else e.scalar(_NEG_INF, m)
        if dm is not None and dk is not None and isinstance(dm[-1], int) and isinstance(dk[2], int):
            pads = e.ints([0] * (2 * r - 1) + [dk[2] - dm[-1]])
        else:
            short = self.val(self.kv_len) - self._len(m, r - 1)
            pads = e.op("Concat", [e.ints([0] * (2 * r - 1)), short.unsqueeze([0]).name], axis=0)
        return self.val(m).apply("Pad", pads, pad_value, like=None, mode="constant").name

    @cached_property
    def mask_is_bool(self) -> bool:
        dt = self.e.dtype(self.mask) if self.mask is not None else None
        return dt is not None and dt.kind == "b"

    @cached_property
    def allowed(self) -> str | None:
        """The bool conditions of the bias (causal frontier, windows, ``nonpad_kv_seqlen`` padding, a bool mask),
        combined; ``None`` when there are none."""
        conds = []
        if self.mask is not None and self.mask_is_bool:
            conds.append(self.val(self.mask_full))
        windows = self.left >= 0 or self.right >= 0
        if self.causal or windows:
            rows = self.val(self._arange(self.q_len, [-1, 1]))
            cols = self.val(self._arange(self.kv_len, [1, -1]))
            if self.past_k is None and self.nonpad is not None:  # per batch: offset = nonpad - L, [B, 1, 1, 1]
                off = (self.val(self.nonpad).cast(np.int64) - self.q_len).reshape([-1, 1, 1, 1])
            else:
                off = self.past_len
            pos = rows + off  # the query's absolute position
            if self.causal:
                conds.append(cols.le(pos))
            if self.left >= 0:
                conds.append((pos - cols).le(self.left))
            if self.right >= 0:
                conds.append((cols - pos).le(self.right))
        if self.nonpad is not None:
            n = self.val(self.nonpad).cast(np.int64).reshape([-1, 1, 1, 1])
            conds.append(self.val(self._arange(self.kv_len, [1, -1])).lt(n))
        if not conds:
            return None
        out = conds[0]
        for c in conds[1:]:
            out = out & c
        return out.name

    @cached_property
    def bias(self) -> str | None:
        """The additive bias (``-inf`` where not allowed), at its own broadcast shape; ``None`` when zero."""
        fm = None if self.mask is None or self.mask_is_bool else self.mask_full
        if self.allowed is None:
            return fm
        base = self.val(fm if fm is not None else self.zero)
        return where(self.val(self.allowed), base, self.e.const(np.asarray(_NEG_INF, dtype=self.dt)), like=None).name

    @cached_property
    def may_mask_rows(self) -> bool:
        """May a query row have every key's bias ``-inf``? Not for the causal frontier alone (key 0 is always
        visible); a constant mask is checked."""
        if self.mask is None and self.nonpad is None and self.left < 0 and self.right < 0:
            return False
        if self.nonpad is not None or self.left >= 0 or self.right >= 0:
            return True
        m = self.e.value(self.mask)
        dq, dk = self.e.dims(self.q), self.e.dims(self.kt)
        if m is None or dq is None or dk is None or not isinstance(dk[2], int) or m.shape[-1] != dk[2]:
            return True
        lq = dq[1] if self.rank == 3 else dq[2]
        if not isinstance(lq, int):
            return True
        past = 0
        if self.past_k is not None:
            dp = self.e.dims(self.past_k)
            if dp is None or not isinstance(dp[2], int):
                return True
            past = dp[2]
        ok = m if m.dtype == bool else m > -np.inf
        if self.causal:
            ok = ok & (np.arange(dk[2])[None, :] <= np.arange(lq)[:, None] + past)
        ok = np.broadcast_to(ok, np.broadcast_shapes(ok.shape, (lq, dk[2])))
        return not ok.any(axis=-1).all()

    @cached_property
    def keep(self) -> str:
        """bool ``[..., L, 1]``: the query rows with some visible key (the spec's fully-masked-row guard)."""
        return (~self.val(self.bias).max([-1]).eq(_NEG_INF)).name

    @cached_property
    def safe_bias(self) -> str | None:
        """The bias with fully masked rows set to 0, so that the recomputed softmax stays finite there."""
        if self.bias is None or not self.may_mask_rows:
            return self.bias
        return where(self.val(self.keep), self.val(self.bias), self.zero, like=None).name

    # ------------------------------------------------------------------------------------------ forward

    def _qk(self, mode: int) -> str | None:
        """The forward's fourth output as ``[B, Hkv, G*L, S]`` when it exposes stage ``mode``."""
        if self.qk_out is None or self.mode != mode:
            return None
        return self.group(self.qk_out)

    @cached_property
    def raw(self) -> str:
        """``scale Q K^T``, grouped."""
        if self.cap == 0.0:  # modes 0 and 1 are the same then (onnx's reference writes mode 0 after a softcap)
            got = self._qk(0) or self._qk(1)
            if got is not None:
                return got
        return (self.val(self.qs) @ _t(self.val(self.kt))).name

    @cached_property
    def tanh(self) -> str:
        got = self._qk(1)
        if got is not None:  # tanh = capped / c
            return (self.val(got) / self.cap).name
        return (self.val(self.raw) / self.cap).tanh().name

    @cached_property
    def capped(self) -> str:
        if self.cap == 0.0:
            return self.raw
        got = self._qk(1)
        return got if got is not None else (self.val(self.tanh) * self.cap).name

    @cached_property
    def p_sp(self) -> str:
        """``P`` grouped, in the softmax precision."""
        got = self._qk(3) if self.sp is None else None
        if got is not None:
            return got
        got = self._qk(2) if not self.may_mask_rows else None
        if got is None:
            got = self.capped
            if self.safe_bias is not None:
                got = self.group(self.val(self.ungroup(got)) + self.safe_bias)
        return self._cast(self.val(got), self.sp).apply("Softmax", like=None, axis=-1).name

    @cached_property
    def p(self) -> str:
        """``P`` grouped, in Q's dtype."""
        return self._cast(self.val(self.p_sp), None if self.sp is None else self.t1).name

    # ------------------------------------------------------------------------------------------ backward

    @cached_property
    def do(self) -> Val | None:
        """``dY`` as ``[B, Hq, L, Dv]`` with fully masked rows zeroed, or ``None``."""
        if self.gy is None:
            return None
        return self._kept(self.val(self.heads(self.gy, self.hq)))

    def _kept(self, g: Val) -> Val:
        """``g`` with the fully masked query rows set to 0 (they are constant zeros in the forward)."""
        return where(self.val(self.keep), g, self.zero, like=None) if self.may_mask_rows else g

    @cached_property
    def delta(self) -> Val | None:
        """``rowsum(dO * O)`` as ``[B, Hkv, G*L, 1]`` (computed in the layout of Y)."""
        if self.gy is None:
            return None
        prod = self.val(self.gy) * self.y
        if self.rank == 3:
            prod = prod.reshape([0, 0, self.hq, -1])
        return self.val(self.group(self._kept(_tr(prod.sum([-1]), self.layout, _CANON))))

    @cached_property
    def gqk_kept(self) -> Val:
        """The cotangent of the mode-3 output with fully masked rows (constant zeros there) dropped."""
        return self._kept(self.val(self.gqk))

    @cached_property
    def ds(self) -> Val | None:
        """The cotangent of the softmax input, grouped, in Q's dtype: ``P * (dP - delta)`` plus the mode-2
        output's cotangent (``None``: zero)."""
        dp, delta = [], []
        if self.gy is not None:
            dp.append(self.val(self.group(self.do)) @ _t(self.val(self.vt)))
            delta.append(self.delta)
        if self.gqk is not None and self.mode == 3:
            g = self.val(self.group(self.gqk_kept))
            dp.append(g)
            delta.append((self.val(self.p) * g).sum([-1]))
        parts = []
        if dp:
            diff = self._cast(self._sum(dp, "Add") - self._sum(delta, "Add"), self.sp)
            parts.append(self._cast(self.val(self.p_sp) * diff, None if self.sp is None else self.t1))
        if self.gqk is not None and self.mode == 2:
            parts.append(self.val(self.group(self.gqk)))
        return self._sum(parts)

    def _sum(self, parts: list[Val | None], op: str = "Sum") -> Val | None:
        """The sum of the cotangents ``parts`` that are not ``None`` (``None``: zero)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else parts[0].apply(op, *parts[1:], like=None)

    def _gqk(self, mode: int) -> Val | None:
        """The cotangent of the fourth output, grouped, when it exposes stage ``mode``."""
        return self.val(self.group(self.gqk)) if self.gqk is not None and self.mode == mode else None

    @cached_property
    def draw(self) -> Val | None:
        """The cotangent of ``scale Q K^T``, grouped (``None``: zero)."""
        dcap = self._sum([self.ds, self._gqk(1)])
        if self.cap != 0.0 and dcap is not None:
            t = self.val(self.tanh)
            dcap = dcap * (1 - t * t)
        return self._sum([dcap, self._gqk(0)])

    def dq(self) -> str:
        if self.draw is None:
            return self.e.zeros_like(self.q)
        return self.unheads(self.ungroup(self.draw @ self.kt * self.scale), _CANON, self.q)

    @cached_property
    def dkt(self) -> str:
        """The cotangent of ``present_key`` ``[B, Hkv, S, D]``: ``dS'^T (scale Q)`` plus ``present_key``'s own."""
        ds_q = None if self.draw is None else _t(self.draw) @ self.qs
        got = self._sum([ds_q, None if self.gpk is None else self.val(self.gpk)])
        return got.name if got is not None else self.e.zeros_like(self.kt)

    @cached_property
    def dvt(self) -> str:
        """The cotangent of ``present_value`` ``[B, Hkv, S, Dv]``: ``P^T dO`` plus ``present_value``'s own."""
        p_do = None if self.gy is None else _t(self.val(self.p)) @ self.group(self.do)
        got = self._sum([p_do, None if self.gpv is None else self.val(self.gpv)])
        return got.name if got is not None else self.e.zeros_like(self.vt)

    def _new(self, g: str, past: str | None, like: str) -> str:
        """The part of a ``[B, Hkv, S, F]`` cotangent for the new keys or values, in ``like``'s layout."""
        e = self.e
        if past is not None:
            g = self.val(g).apply("Slice", self.val(self.past_len).unsqueeze([0]), e.ints([np.iinfo(np.int64).max]),
                                  e.ints([2]), like=None).name
        return self.unheads(g, _CANON, like)

    def _past(self, g: str) -> str:
        e = self.e
        return self.val(g).apply("Slice", e.ints([0]), self.val(self.past_len).unsqueeze([0]), e.ints([2]),
                                 like=None).name

    def dmask(self) -> str:
        """``dS`` summed over the mask's broadcast axes (and cut to its keys when it was padded)."""
        e, m = self.e, self.mask
        if self.ds is None:
            return e.zeros_like(m)
        g = self.val(self.ungroup(self.ds))
        if self.mask_full != m:
            r = e.need_rank(m, self.node)
            g = g.apply("Slice", e.ints([0]), self._len(m, r - 1) if e.dims(m) is None else
                        e.op("Shape", [m], start=r - 1, end=r), e.ints([-1]), like=None)
        return g.reduce_to(m).name  # (a name: contrib_mha's Attention reads it as one)


@vjp("Attention", bounded=True, finite=True, reads="all", mixing=True)
def attention(ctx: Ctx, node: Node, cts: list) -> list:
    """ONNX "Attention" (opsets 23-25); see the module docstring for the math, the masks and the zeros."""
    a = _Attention(ctx, node, cts)
    grads = [
        a.dq,
        lambda: a._new(a.dkt, a.past_k, a.k),
        lambda: a._new(a.dvt, a.past_v, a.v),
        None if a.mask is None or a.mask_is_bool else a.dmask,
        None if a.past_k is None else lambda: a._past(a.dkt),
        None if a.past_v is None else lambda: a._past(a.dvt),
        None,  # nonpad_kv_seqlen: integers
    ]
    return grads[: len(node.inputs)]
