"""VJP of onnxruntime's ``com.microsoft`` ``GroupQueryAttention`` (onnxruntime docs/ContribOperators.md; the CPU
kernel ``contrib_ops/cpu/bert/group_query_attention.cc``, ``gqa_attention_base.h`` and
``group_query_attention_helper.h``), the attention of the onnxruntime-genai model builder's LLMs. The forward
keeps the node, which onnxruntime runs; the VJP is standard ONNX operators: the node's math is rebuilt in the
backward graph as 4-D Q, K, V, a float bias and the default-domain ``Attention`` rule's backward
(rules/attention.py: FlashAttention-2's, grouped query heads without copies), called on that node.

The math (checked against onnxruntime 1.32's kernel in tests/test_contrib_llm_ops.py), per batch entry ``b``:
``query`` is ``[B, S, Hq*D]`` with ``key``/``value`` ``[B, S, Hkv*D]``, or packed ``[B, S, (Hq + 2 Hkv) D]``. With
``T_b = seqlens_k[b] + 1`` keys in the cache after the step: the first prompt (``S == total_sequence_length``)
has ``P_b = 0`` cached tokens before it, any later step ``P_b = T_b - S``. Query row ``t`` sits at position
``P_b + t``. With ``do_rotary``, Q and K are rotated (:class:`.contrib_rotary.Rotation`, ``rotary_interleaved``,
``R = 2 * cos_cache.shape[1]`` features) at the positions ``P_b + t``, or at ``position_ids[b, t]`` (the first
prompt: ``position_ids[0, 0] + t``). ``present_key`` (``[B, Hkv, max(past, total), D]``) holds rows
``[0, P_b)`` of ``past_key`` and the new keys at ``[P_b, P_b + S)``; the rest is masked. Row ``t`` attends key
``j`` when ``j < T_b`` and, with ``causal`` (default), ``j <= P_b + t``, and with ``local_window_size = W > 0``,
``j > P_b + t - W``. Scores: ``softmax(mask + attention_bias + cap(scale Q K^T))`` (``scale`` 0 means
``1/sqrt(D)``, ``softcap`` ``c tanh(x / c)``); ``head_sink`` (or ``smooth_softmax``: a sink of 0) adds
``exp(sink_h)`` to each softmax denominator, which is a zero key and value whose bias is the sink, so its
gradient comes from the same backward. Rows of a first prompt past ``T_b`` (right padding) are computed by the
kernel as this math says (over the ``T_b`` keys) and differentiated so.

Gradients: query, key and value (rotated back); past_key and past_value for their rows ``[0, P_b)`` (with the
cotangents of present_key and present_value); attention_bias; head_sink. The rotary caches are refused in one
line when asked for (they are tables, not weights). Refused in one line naming the node: a quantized KV cache
(``k_scale``, ``v_scale``, ``k_quant_type``, ``kv_cache_bit_width``), ``sliding_window_cache``, ``query_seqlens``,
``q_norm_weight``/``k_norm_weight`` (kernels other than the CPU one), and a cotangent of ``output_qk``.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ...ir.contrib_types import MS
from ..algebra import Val, where
from ..context import Ctx
from ..registry import RULES, vjp
from ._common import optional_input, padded
from .contrib_rotary import Rotation, cache_rows, half_width

#: the inputs refused when present, by position: (name, why)
_UNSUPPORTED = {12: "k_scale (a quantized KV cache)", 13: "v_scale (a quantized KV cache)",
                14: "q_norm_weight (not run by onnxruntime's CPU kernel)",
                15: "k_norm_weight (not run by onnxruntime's CPU kernel)", 16: "query_seqlens (right-padded chunks)"}


def _check(node: Node, cts: list) -> None:
    """Refuse, in one line naming the node, what the rule does not cover (module doc)."""
    for i, what in _UNSUPPORTED.items():
        if optional_input(node, i) is not None:
            raise GraphError(f"{node.label()}: GroupQueryAttention with the input {what} is not supported")
    a = node.attrs
    for attr in ("sliding_window_cache", "kv_cache_bit_width"):
        if int(a.get(attr, 0)):
            raise GraphError(f"{node.label()}: GroupQueryAttention with {attr}={a[attr]} is not supported")
    for attr in ("k_quant_type", "v_quant_type"):
        v = a.get(attr, "NONE")
        v = v.decode() if isinstance(v, bytes) else str(v)
        if v not in ("", "NONE"):
            raise GraphError(f"{node.label()}: GroupQueryAttention with {attr}={v} (a quantized KV cache) is not "
                             "supported")
    if len(cts) > 3 and cts[3] is not None:
        raise GraphError(f"{node.label()}: the gradient through GroupQueryAttention's output_qk (qk_output="
                         f"{a.get('qk_output', 0)}) is not supported; read the attention output instead")


class _Gqa:
    """One GroupQueryAttention node's backward graph; each value is emitted once, when first read."""

    def __init__(self, ctx: Ctx, node: Node, cts: list):
        self.ctx, self.e, self.node = ctx, ctx.e, node
        a = node.attrs
        self.hq, self.hkv = int(a["num_heads"]), int(a["kv_num_heads"])
        self.q, self.k, self.v = node.inputs[0], optional_input(node, 1), optional_input(node, 2)
        self.packed = self.k is None
        self.past_k, self.past_v = optional_input(node, 3), optional_input(node, 4)
        self.seqlens, self.total = node.inputs[5], node.inputs[6]
        self.cos, self.sin, self.pos = (optional_input(node, i) for i in (7, 8, 9))
        self.bias, self.sink = optional_input(node, 10), optional_input(node, 11)
        self.gy, self.gpk, self.gpv = padded(cts, 3)
        self.causal = bool(int(a.get("causal", 1)))
        self.window = int(a.get("local_window_size", -1))
        self.rotary = bool(int(a.get("do_rotary", 0)))
        self.smooth = bool(int(a.get("smooth_softmax", 0)))
        if self.rotary and (self.cos is None or self.sin is None):
            raise GraphError(f"{node.label()}: do_rotary=1 needs cos_cache and sin_cache")
        if self.packed != (self.v is None):
            raise GraphError(f"{node.label()}: GroupQueryAttention needs both key and value, or neither (packed)")

    def val(self, name: str) -> Val:
        return self.ctx.val(name)

    def i64(self, x: str) -> str:
        return x if self.e.dtype(x) == np.int64 else self.e.op("Cast", [x], to=7)

    # ------------------------------------------------------------------------------------------ layouts

    def heads4(self, x: str, h: int) -> str:
        """``[B, S, H*D]`` as ``[B, H, S, D]``."""
        e = self.e
        return e.op("Transpose", [e.op("Reshape", [x, e.ints([0, 0, h, -1])])], perm=[0, 2, 1, 3])

    def flat3(self, x4: str, like: str) -> str:
        """``[B, H, S, D]`` as ``[B, S, H*D]`` (``like``'s type)."""
        e = self.e
        return e.op("Reshape", [e.op("Transpose", [x4], perm=[0, 2, 1, 3]), e.ints([0, 0, -1])], like=like)

    @cached_property
    def qkv4(self) -> tuple[str, str, str]:
        """Q ``[B, Hq, S, D]``, K and V ``[B, Hkv, S, D]`` as the node reads them (before the rotation)."""
        if not self.packed:
            return self.heads4(self.q, self.hq), self.heads4(self.k, self.hkv), self.heads4(self.v, self.hkv)
        e = self.e
        x4 = self.heads4(self.q, self.hq + 2 * self.hkv)
        return tuple(e.op("Split", [x4, e.ints([self.hq, self.hkv, self.hkv])], n_out=3, axis=1))

    @cached_property
    def head_size(self) -> int | None:
        d = self.e.dims(self.qkv4[0])
        return d[3] if d is not None and isinstance(d[3], int) else None

    # ------------------------------------------------------------------------------------------ positions

    @cached_property
    def seq(self) -> str:
        """``S`` as an int64 scalar."""
        e = self.e
        return e.op("Squeeze", [e.op("Shape", [self.q], start=1, end=2)], shape=(), dtype=np.int64)

    @cached_property
    def tb(self) -> Val:
        """``T_b = seqlens_k + 1``, int64 ``[B]``."""
        return self.val(self.i64(self.seqlens)) + self.val(self.e.const(np.int64(1)))

    @cached_property
    def first(self) -> Val:
        """Whether this is the first prompt: ``S == total_sequence_length`` (a bool scalar)."""
        total = self.e.op("Reshape", [self.i64(self.total), self.e.ints([])])
        return self.val(self.seq).eq(total)

    @cached_property
    def past_b(self) -> Val:
        """``P_b``, int64 ``[B]``: 0 in the first prompt, ``T_b - S`` after it."""
        zero = self.val(self.e.const(np.int64(0)))
        return where(self.first, zero, self.tb - self.seq, like=None)

    @cached_property
    def rows(self) -> Val:
        """``[0, S)`` as int64 ``[1, S]``."""
        e = self.e
        r = e.op("Range", [e.const(np.int64(0)), self.seq, e.const(np.int64(1))])
        return self.val(e.op("Unsqueeze", [r, e.ints([0])]))

    @cached_property
    def query_pos(self) -> Val:
        """The absolute position ``P_b + t`` of each query row, int64 ``[B, S]``."""
        return self.past_b.unsqueeze([1]) + self.rows

    @cached_property
    def rotation(self) -> Rotation:
        """The rotation of Q and K: at ``query_pos``, or at ``position_ids`` (the first prompt: its first element
        plus ``t``)."""
        e = self.e
        pos = self.query_pos
        if self.pos is not None:
            given = self.val(self.i64(self.pos))
            start = self.val(e.op("Slice", [given.name, e.ints([0, 0]), e.ints([1, 1]), e.ints([0, 1])]))
            pos = where(self.first, start + self.rows, given, like=None)
        c, s = (self.val(e.op("Unsqueeze", [cache_rows(e, t, pos.name), e.ints([1])])) for t in (self.cos, self.sin))
        interleaved = bool(int(self.node.attrs.get("rotary_interleaved", 0)))
        return Rotation(c, s, half_width(e, self.node, self.cos), interleaved)

    @cached_property
    def qk_rot(self) -> tuple[str, str]:
        q4, k4, _ = self.qkv4
        if not self.rotary:
            return q4, k4
        return self.rotation.apply(self.val(q4)).name, self.rotation.apply(self.val(k4)).name

    # ------------------------------------------------------------------------------------------ the cache

    @cached_property
    def past_len(self) -> str:
        e = self.e
        if self.past_k is None:
            return e.const(np.int64(0))
        return e.op("Squeeze", [e.op("Shape", [self.past_k], start=2, end=3)], shape=(), dtype=np.int64)

    @cached_property
    def present_len(self) -> str:
        """``max(past length, total_sequence_length)``: the length of present_key."""
        e = self.e
        total = e.op("Reshape", [self.i64(self.total), e.ints([])])
        return e.op("Max", [self.past_len, total])

    @cached_property
    def keys(self) -> Val:
        """``j``, int64 ``[1, L]`` over present_key's rows."""
        e = self.e
        r = e.op("Range", [e.const(np.int64(0)), self.present_len, e.const(np.int64(1))])
        return self.val(e.op("Unsqueeze", [r, e.ints([0])]))

    @cached_property
    def gather_index(self) -> Val:
        """``[B, L]``: for row ``j`` of present_key its row in ``Concat(past, new, zero row)``: ``j`` below
        ``P_b``, ``past + j - P_b`` for the new keys, the zero row after them."""
        pb, j, n = self.past_b.unsqueeze([1]), self.keys, self.val(self.past_len)
        new = where(j.lt(pb + self.seq), n + j - pb, n + self.seq, like=None)
        return where(j.lt(pb), j, new, like=None)

    @cached_property
    def scatter_index(self) -> Val:
        """``[B, past + S]``: for row ``i`` of ``Concat(past, new)`` its row in present_key (``L``, a zero row
        appended to the cotangent, for a past row at or after ``P_b``, which the node does not read)."""
        e = self.e
        n = self.val(self.past_len)
        i = self.val(e.op("Unsqueeze", [e.op("Range", [e.const(np.int64(0)), (n + self.seq).name,
                                                       e.const(np.int64(1))]), e.ints([0])]))
        pb = self.past_b.unsqueeze([1])
        past_row = where(i.lt(pb), i, self.val(self.present_len), like=None)
        return where(i.lt(n), past_row, pb + i - n, like=None)

    def _expand(self, idx: Val, like: str) -> str:
        """``idx [B, L]`` as ``[B, H, L, D]`` (the shape of ``like`` along the last axes)."""
        e = self.e
        shape = e.op("Concat", [e.op("Shape", [like], end=2), e.op("Shape", [idx.name], start=1),
                                e.op("Shape", [like], start=3)], axis=0)
        return e.op("Expand", [e.op("Unsqueeze", [idx.name, e.ints([1, 3])]), shape])

    def _zero_row(self, x: str) -> str:
        """Zeros ``[B, H, 1, D]`` of ``x``'s type."""
        e = self.e
        shape = e.op("Concat", [e.op("Shape", [x], end=2), e.ints([1]), e.op("Shape", [x], start=3)], axis=0)
        return e.op("Expand", [e.scalar(0.0, x), shape])

    def present(self, new4: str, past: str | None) -> str:
        """present_key (or present_value) ``[B, Hkv, L, D]`` from the new rows and the past (module doc)."""
        e = self.e
        src = e.op("Concat", [*([past] if past else []), new4, self._zero_row(new4)], axis=2)
        return e.op("GatherElements", [src, self._expand(self.gather_index, new4)], axis=2)

    def back(self, d_present: str, new4: str) -> tuple[str, str | None]:
        """The cotangent of present_key split into those of the new rows ``[B, Hkv, S, D]`` and of the past."""
        e = self.e
        src = e.op("Concat", [d_present, self._zero_row(d_present)], axis=2)
        d = e.op("GatherElements", [src, self._expand(self.scatter_index, new4)], axis=2)
        if self.past_k is None:
            return d, None
        big = e.ints([np.iinfo(np.int64).max])
        n = e.op("Unsqueeze", [self.past_len, e.ints([0])])
        return e.op("Slice", [d, n, big, e.ints([2])]), e.op("Slice", [d, e.ints([0]), n, e.ints([2])])

    # ------------------------------------------------------------------------------------------ the core

    @cached_property
    def mask(self) -> str:
        """The float bias ``[B, Hq|1, S, L(+1)]``: attention_bias (padded to ``L`` keys) where a key is visible,
        ``-inf`` elsewhere; with a sink, one more column holding it."""
        e = self.e
        pos, j = self.query_pos.unsqueeze([2]), self.keys.unsqueeze([0])  # [B, S, 1], [1, 1, L]
        ok = j.lt(self.tb.unsqueeze([1, 2]))
        if self.causal:
            ok = ok & j.le(pos)
        if self.window > 0:
            ok = ok & (pos - self.window).lt(j)
        ok = ok.unsqueeze([1])  # [B, 1, S, L]
        q4 = self.qkv4[0]
        base = self.val(e.scalar(0.0, q4))
        if self.bias is not None:
            width = e.op("Shape", [self.bias], start=3, end=4)
            pads = e.op("Concat", [e.ints([0, 0, 0, 0, 0, 0, 0]), e.op("Sub", [e.op(
                "Unsqueeze", [self.present_len, e.ints([0])]), width])], axis=0)
            base = self.val(e.op("Pad", [self.bias, pads], mode="constant"))
        m = where(ok, base, self.val(e.const(np.asarray(-np.inf, dtype=e.dtype(q4)))), like=None)
        if self.sink is None and not self.smooth:
            return m.name
        sink = self.val(self.sink).reshape([1, -1, 1, 1]) if self.sink is not None else self.val(
            e.op("Expand", [e.scalar(0.0, q4), e.ints([1, self.hq, 1, 1])]))
        full = e.op("Shape", [e.op("Add", [m.name, sink.name])])  # [B, Hq, S, L]
        col = e.op("Concat", [e.op("Slice", [full, e.ints([0]), e.ints([3])]), e.ints([1])], axis=0)
        return e.op("Concat", [e.op("Expand", [m.name, full]), e.op("Expand", [sink.name, col])], axis=3)

    @cached_property
    def sinked(self) -> bool:
        return self.sink is not None or self.smooth

    @cached_property
    def kv_all(self) -> tuple[str, str]:
        """present_key and present_value as the node computes them (with a zero row for a sink)."""
        _, k_rot = self.qk_rot
        k_all, v_all = self.present(k_rot, self.past_k), self.present(self.qkv4[2], self.past_v)
        if self.sinked:
            e = self.e
            k_all, v_all = (e.op("Concat", [x, self._zero_row(x)], axis=2) for x in (k_all, v_all))
        return k_all, v_all

    @cached_property
    def scale(self) -> float:
        s = float(np.float32(self.node.attrs.get("scale", 0.0)))
        if s != 0.0:
            return s
        if self.head_size is None:
            raise GraphError(f"{self.node.label()}: the default scale 1/sqrt(head_size) needs a static head size")
        return float(np.float32(1.0) / np.sqrt(np.float32(self.head_size)))

    @cached_property
    def core(self) -> list:
        """The default-domain Attention rule's lazy cotangents ``[dQ, dK, dV, dmask]`` of the 4-D node."""
        q_rot, _ = self.qk_rot
        k_all, v_all = self.kv_all
        y4 = self.heads4(self.node.outputs[0], self.hq)
        gy4 = None if self.gy is None else self.heads4(self.gy, self.hq)
        attrs = {"scale": self.scale}
        cap = float(np.float32(self.node.attrs.get("softcap", 0.0)))
        if cap > 0:
            attrs["softcap"] = cap
        inner = Node("Attention", [q_rot, k_all, v_all, self.mask], [y4], attrs, name=self.node.name)
        return RULES["Attention"](self.ctx, inner, [gy4])

    def _core(self, i: int) -> str | None:
        return None if self.gy is None else self.ctx.val(self.core[i]()).name

    def d_present(self, i: int, g_present: str | None) -> str | None:
        """The cotangent of present_key (``i`` 1) or present_value (2): the core's (without the sink's row) plus
        the output's own."""
        e = self.e
        d = self._core(i)
        if d is not None and self.sinked:
            d = e.op("Slice", [d, e.ints([0]), e.op("Unsqueeze", [self.present_len, e.ints([0])]), e.ints([2])])
        parts = [p for p in (d, g_present) if p is not None]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else e.op("Add", parts)

    @cached_property
    def dkv(self) -> tuple:
        """``(dK4, dpast_k, dV4, dpast_v)``, the new rows' cotangents before K's rotation is undone."""
        out = []
        for i, g_present, new4 in ((1, self.gpk, self.qkv4[1]), (2, self.gpv, self.qkv4[2])):
            d = self.d_present(i, g_present)
            out += [None, None] if d is None else list(self.back(d, new4))
        return tuple(out)

    def _unrotate(self, d: str | None) -> str | None:
        return d if d is None or not self.rotary else self.rotation.apply(self.val(d), inverse=True).name

    def _zeros4(self, x4: str) -> str:
        return self.e.zeros_like(x4)

    @cached_property
    def d4(self) -> tuple[str, str, str]:
        """The cotangents of Q, K, V ``[B, H, S, D]`` as the node reads them (zeros where none flows)."""
        q4, k4, v4 = self.qkv4
        dq = self._unrotate(self._core(0))
        dk = self._unrotate(self.dkv[0])
        dv = self.dkv[2]
        return tuple(d if d is not None else self._zeros4(x) for d, x in ((dq, q4), (dk, k4), (dv, v4)))

    def dquery(self) -> str:
        if not self.packed:
            return self.flat3(self.d4[0], self.q)
        return self.flat3(self.e.op("Concat", list(self.d4), axis=1), self.q)

    def dpast(self, k: int, past: str) -> str:
        d = self.dkv[1 if k == 0 else 3]
        return d if d is not None else self.e.zeros_like(past)

    def dmask(self) -> Val | None:
        if self.gy is None:
            return None
        return self.val(self.core[3]())

    def dbias(self) -> str:
        e = self.e
        d = self.dmask()
        if d is None:
            return e.zeros_like(self.bias)
        width = e.op("Shape", [self.bias], start=3, end=4)
        d = e.op("Slice", [d.name, e.ints([0]), width, e.ints([3])])
        return e.reduce_to(d, self.bias)

    def dsink(self) -> str:
        e = self.e
        d = self.dmask()
        if d is None:
            return e.zeros_like(self.sink)
        col = e.op("Slice", [d.name, e.op("Unsqueeze", [self.present_len, e.ints([0])]),
                             e.ints([np.iinfo(np.int64).max]), e.ints([3])])
        return e.op("Reshape", [e.op("ReduceSum", [col, e.ints([0, 2, 3])], keepdims=0), e.ints([-1])], like=self.sink)


def _table(node: Node, i: int):
    def refuse() -> None:
        raise GraphError(f"{node.label()}: GroupQueryAttention's rotary caches ({node.inputs[i]!r}) get no "
                         "gradient (tables of the positions' angles, not weights); leave them out of the "
                         "parameters (--freeze)")

    return refuse


@vjp("GroupQueryAttention", domain=MS, bounded=True, finite=True, reads="all", mixing=True)
def group_query_attention(ctx: Ctx, node: Node, cts: list) -> list:
    """``com.microsoft.GroupQueryAttention`` (module doc): the node's math rebuilt and the default-domain
    Attention rule's backward."""
    _check(node, cts)
    a = _Gqa(ctx, node, cts)
    grads = [a.dquery,
             None if a.packed else lambda: a.flat3(a.d4[1], a.k),
             None if a.packed else lambda: a.flat3(a.d4[2], a.v),
             None if a.past_k is None else lambda: a.dpast(0, a.past_k),
             None if a.past_v is None else lambda: a.dpast(1, a.past_v),
             None, None,  # seqlens_k, total_sequence_length: integers
             None if a.cos is None else _table(node, 7), None if a.sin is None else _table(node, 8),
             None,  # position_ids: integers
             None if a.bias is None else a.dbias,
             None if a.sink is None else a.dsink]
    return (grads + [None] * len(node.inputs))[:len(node.inputs)]

