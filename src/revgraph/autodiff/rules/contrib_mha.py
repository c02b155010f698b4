"""VJPs of onnxruntime's ``com.microsoft`` ``MultiHeadAttention`` and ``Attention``, the attention operators of
the transformer optimizer's BERT, GPT-2 and T5 files (onnxruntime docs/ContribOperators.md; the CPU kernels
``contrib_ops/cpu/bert/multihead_attention.cc``, ``attention.cc``, ``attention_cpu_base.h`` and
``attention_utils.cc``). The forward keeps the node, which onnxruntime runs; the VJPs are standard ONNX
operators: Q, K, V and the additive mask are rebuilt in the backward graph as 4-D values and the default-domain
``Attention`` rule's backward (rules/attention.py) runs on them.

The math (checked against onnxruntime 1.32's CPU kernels in tests/test_contrib_llm_ops.py): ``softmax(scale Q
K^T + M + attention_bias) V`` per head (``scale`` default ``1/sqrt(head_size)``), where the mask ``M`` is finite:

- a key padding mask adds ``mask_filter_value`` (default -10000) at the masked keys: int32 lengths ``[B]`` (keys
  ``j >= len_b``), end and start positions ``[2B]`` (``Attention`` only: ``j >= end_b`` or ``j < start_b``), or
  0/1 values ``[B, T]`` or ``[B, S, T]`` (0 masks);
- ``unidirectional`` adds -10000 (the kernels' constant, whatever ``mask_filter_value`` is) at keys
  ``j > past + i``, on top of the padding's.

``MultiHeadAttention(query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value)``: Q, K, V
are the 3-D inputs plus their slices of ``bias`` split into heads, or K and V given as ``[B, N, L, H]`` (used as
they are, no bias); ``present_key = Concat(past_key, K)`` along the sequence, and so for V. ``Attention(input,
weights, bias, mask_index, past, attention_bias)``: ``Q|K|V = input @ weights + bias`` split by
``qkv_hidden_sizes`` (default three equal parts); ``present = Stack(Concat(past[0], K), Concat(past[1], V))``.
Gradients reach every float input (weights and biases, the past, attention_bias) and the present outputs'
cotangents join K's and V's.

Refused in one line naming the node: packed QKV or KV (5-D, which the CPU kernel does not run either),
``past_sequence_length`` and ``cache_indirection`` (buffer sharing, beam search), ``past_present_share_buffer``,
``do_rotary`` (not run by the CPU kernel, which asks for MultiHeadAttention + RotaryEmbedding instead), a 4-D or
``3B + 2`` mask (CUDA formats), and a cotangent of the ``qk`` output.
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

#: the additive value of the unidirectional (causal) mask in onnxruntime's CPU kernels
CAUSAL_FILL = -10000.0


def _refuse_inputs(node: Node, inputs: dict[int, str]) -> None:
    for i, what in inputs.items():
        if optional_input(node, i) is not None:
            raise GraphError(f"{node.label()}: {node.op_type} with the input {what} is not supported")


class _Core:
    """What the two operators share: heads, the additive mask, and the default-domain Attention rule's backward
    on the rebuilt 4-D node. Subclasses give ``q4``, ``k_all``, ``v_all`` (``[B, N, T, H]``), the past length and
    the mask input."""

    def __init__(self, ctx: Ctx, node: Node, cts: list, mask: str | None, bias: str | None):
        self.ctx, self.e, self.node = ctx, ctx.e, node
        self.heads = int(node.attrs["num_heads"])
        self.mask_in, self.attn_bias = mask, bias
        self.gy = cts[0] if cts else None
        self.unidirectional = bool(int(node.attrs.get("unidirectional", 0)))
        self.fill = float(np.float32(node.attrs.get("mask_filter_value", -10000.0)))

    def val(self, name: str) -> Val:
        return self.ctx.val(name)

    def heads4(self, x: str) -> str:
        """``[B, S, N*H]`` as ``[B, N, S, H]``."""
        e = self.e
        return e.op("Transpose", [e.op("Reshape", [x, e.ints([0, 0, self.heads, -1])])], perm=[0, 2, 1, 3])

    def flat3(self, x4: str, like: str | None = None) -> str:
        """``[B, N, S, H]`` as ``[B, S, N*H]``."""
        e = self.e
        return e.op("Reshape", [e.op("Transpose", [x4], perm=[0, 2, 1, 3]), e.ints([0, 0, -1])], like=like)

    def seq_len(self, x: str, axis: int) -> str:
        e = self.e
        return e.op("Squeeze", [e.op("Shape", [x], start=axis, end=axis + 1)], shape=(), dtype=np.int64)

    # ------------------------------------------------------------------------------------------ the mask

    def _arange(self, n: str, axes: list[int]) -> Val:
        e = self.e
        r = e.op("Range", [e.const(np.int64(0)), n, e.const(np.int64(1))])
        return self.val(e.op("Unsqueeze", [r, e.ints(axes)]))

    def _i64(self, x: str) -> Val:
        return self.val(x if self.e.dtype(x) == np.int64 else self.e.op("Cast", [x], to=7))

    @cached_property
    def key_mask(self) -> Val | None:
        """bool ``[B, 1, 1|S, T]``: the keys the padding mask hides (``None``: no mask)."""
        m, e = self.mask_in, self.e
        if m is None:
            return None
        rank = e.need_rank(m, self.node)
        j = self._arange(self.total, [0])  # [1, T]
        if rank == 1:
            dims, batch = e.dims(m), e.dims(self.q4)
            n, b = (dims or [None])[0], (batch or [None])[0]
            pairs = self.node.op_type == "Attention"
            if isinstance(n, int) and isinstance(b, int) and n not in ((b, 2 * b) if pairs else (b,)):
                raise GraphError(f"{self.node.label()}: a 1-D mask of {n} entries for batch {b} is not supported "
                                 "(lengths [B]" + (" or end and start positions [2B]" if pairs else "") + ")")
            # [B] lengths and [2B] end and start positions in one formula, the batch known at run time: the
            # starts of the mask padded with zeros (a start of 0 hides nothing)
            ext = e.op("Concat", [m, e.op("Expand", [e.const(np.zeros(1, np.int32)), e.op("Shape", [m])])], axis=0)
            bsz = e.op("Shape", [self.q4], start=0, end=1)
            end = self._i64(e.op("Slice", [ext, e.ints([0]), bsz])).unsqueeze([1])
            start = self._i64(e.op("Slice", [ext, bsz, e.op("Add", [bsz, bsz])])).unsqueeze([1])
            hidden = j.ge(end) | j.lt(start)
            return hidden.unsqueeze([1, 2])
        if rank == 2:
            return self._i64(m).eq(self.val(e.const(np.int64(0)))).unsqueeze([1, 2])
        if rank == 3:
            return self._i64(m).eq(self.val(e.const(np.int64(0)))).unsqueeze([1])
        raise GraphError(f"{self.node.label()}: a {rank}-D attention mask is not supported (onnxruntime's CPU kernel "
                         "reads 1-D, 2-D and 3-D masks)")

    @cached_property
    def mask(self) -> str | None:
        """The additive mask ``M + attention_bias`` (module doc), at its broadcast shape; ``None`` when zero."""
        e = self.e
        q4 = self.q4
        zero = self.val(e.scalar(0.0, q4))
        parts = []
        if self.key_mask is not None:
            parts.append(where(self.key_mask, self.val(e.scalar(self.fill, q4)), zero, like=None))
        if self.unidirectional:
            rows = self._arange(self.seq_len(q4, 2), [1]) + self.val(self.past_len)  # [S, 1]
            later = self._arange(self.total, [0]).gt(rows)  # [S, T]
            parts.append(where(later, self.val(e.scalar(CAUSAL_FILL, q4)), zero, like=None))
        if self.attn_bias is not None:
            parts.append(self.val(self.attn_bias))
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out.name

    # ------------------------------------------------------------------------------------------ the core

    @cached_property
    def total(self) -> str:
        return self.seq_len(self.k_all, 2)

    @cached_property
    def scale(self) -> float:
        s = float(np.float32(self.node.attrs.get("scale", 0.0)))
        if s != 0.0:
            return s
        d = self.e.dims(self.q4)
        if d is None or not isinstance(d[3], int):
            raise GraphError(f"{self.node.label()}: the default scale 1/sqrt(head_size) needs a static head size")
        return float(np.float32(1.0) / np.sqrt(np.float32(d[3])))

    @cached_property
    def core(self) -> list | None:
        """The Attention rule's lazy cotangents ``[dQ, dK_all, dV_all, dmask]`` (``None`` without a cotangent of
        the output)."""
        if self.gy is None:
            return None
        y4 = self.heads4(self.node.outputs[0])
        inputs = [self.q4, self.k_all, self.v_all, *([self.mask] if self.mask is not None else [])]
        inner = Node("Attention", inputs, [y4], {"scale": self.scale}, name=self.node.name)
        return RULES["Attention"](self.ctx, inner, [self.heads4(self.gy)])

    def d(self, i: int) -> str | None:
        return None if self.core is None else self.val(self.core[i]()).name

    def with_present(self, i: int, g_present: str | None) -> str | None:
        """The cotangent of K (``i`` 1) or V (2) after the past: the core's plus the present output's."""
        parts = [p for p in (self.d(i), g_present) if p is not None]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else self.e.op("Add", parts)

    def split_past(self, d: str | None, x4: str, past: str | None) -> tuple[str, str | None]:
        """A ``[B, N, T, H]`` cotangent split into the new rows' (zeros of ``x4`` when ``None``) and the past's."""
        e = self.e
        if d is None:
            return e.zeros_like(x4), (None if past is None else e.zeros_like(past))
        if past is None:
            return d, None
        n = e.op("Unsqueeze", [self.past_len, e.ints([0])])
        return (e.op("Slice", [d, n, e.ints([np.iinfo(np.int64).max]), e.ints([2])], like=x4),
                e.op("Slice", [d, e.ints([0]), n, e.ints([2])], like=past))

    def dbias(self) -> str:
        d = self.d(3)
        return self.e.zeros_like(self.attn_bias) if d is None else self.e.reduce_to(d, self.attn_bias)


class _Mha(_Core):
    """``MultiHeadAttention`` (module doc)."""

    def __init__(self, ctx: Ctx, node: Node, cts: list):
        _refuse_inputs(node, {8: "past_sequence_length (a shared past/present buffer)",
                              9: "cache_indirection (beam search)"})
        super().__init__(ctx, node, cts, optional_input(node, 4), optional_input(node, 5))
        self.q, self.k, self.v = node.inputs[0], optional_input(node, 1), optional_input(node, 2)
        self.proj_bias = optional_input(node, 3)
        self.past_k, self.past_v = optional_input(node, 6), optional_input(node, 7)
        self.gpk, self.gpv = padded(cts, 4)[1:3]
        e = self.e
        if e.need_rank(self.q, node) != 3 or self.k is None or self.v is None:
            raise GraphError(f"{node.label()}: MultiHeadAttention with packed QKV (a 5-D query) is not supported "
                             "(onnxruntime's CPU kernel does not run it either)")
        self.kv4 = e.need_rank(self.k, node) == 4
        if e.need_rank(self.k, node) == 5:
            raise GraphError(f"{node.label()}: MultiHeadAttention with packed KV (a 5-D key) is not supported")
        if self.kv4 and (self.proj_bias is not None or self.past_k is not None):
            raise GraphError(f"{node.label()}: MultiHeadAttention with [B, N, L, H] key and value takes no bias "
                             "and no past")

    @cached_property
    def widths(self) -> list[int]:
        """The widths of Q's, K's and V's parts of the projection bias."""
        dims = [self.e.dims(x) for x in (self.q, self.k, self.v)]
        if any(d is None or not isinstance(d[-1], int) for d in dims):
            raise GraphError(f"{self.node.label()}: a projection bias needs static hidden sizes of query, key and "
                             "value")
        return [d[-1] for d in dims]

    def _biased(self, x: str, k: int) -> str:
        if self.proj_bias is None:
            return x
        e, w = self.e, self.widths
        part = e.op("Slice", [self.proj_bias, e.ints([sum(w[:k])]), e.ints([sum(w[:k + 1])])])
        return e.op("Add", [x, part], like=x)

    @cached_property
    def q4(self) -> str:
        return self.heads4(self._biased(self.q, 0))

    @cached_property
    def new_kv(self) -> tuple[str, str]:
        if self.kv4:
            return self.k, self.v
        return self.heads4(self._biased(self.k, 1)), self.heads4(self._biased(self.v, 2))

    @cached_property
    def k_all(self) -> str:
        k4 = self.new_kv[0]
        return k4 if self.past_k is None else self.e.op("Concat", [self.past_k, k4], axis=2)

    @cached_property
    def v_all(self) -> str:
        v4 = self.new_kv[1]
        return v4 if self.past_v is None else self.e.op("Concat", [self.past_v, v4], axis=2)

    @cached_property
    def past_len(self) -> str:
        return self.e.const(np.int64(0)) if self.past_k is None else self.seq_len(self.past_k, 2)

    @cached_property
    def kv_grads(self) -> tuple:
        """``(dK4, dpast_k, dV4, dpast_v)``."""
        k4, v4 = self.new_kv
        return (*self.split_past(self.with_present(1, self.gpk), k4, self.past_k),
                *self.split_past(self.with_present(2, self.gpv), v4, self.past_v))

    def dq(self) -> str:
        d = self.d(0)
        return self.e.zeros_like(self.q) if d is None else self.flat3(d, self.q)

    def dkv(self, k: int) -> str:
        d, x = (self.kv_grads[0], self.k) if k == 1 else (self.kv_grads[2], self.v)
        return d if self.kv4 else self.flat3(d, x)

    def dproj_bias(self) -> str:
        e = self.e
        parts = [e.op("ReduceSum", [g, e.ints([0, 1])], keepdims=0) for g in (self.dq(), self.dkv(1), self.dkv(2))]
        return e.op("Concat", parts, axis=0, like=self.proj_bias)


@vjp("MultiHeadAttention", domain=MS, bounded=True, finite=True, reads="all", mixing=True)
def multi_head_attention(ctx: Ctx, node: Node, cts: list) -> list:
    """``com.microsoft.MultiHeadAttention`` (module doc)."""
    if len(cts) > 3 and cts[3] is not None:
        raise GraphError(f"{node.label()}: the gradient through MultiHeadAttention's qk output is not supported")
    a = _Mha(ctx, node, cts)
    grads = [a.dq, lambda: a.dkv(1), lambda: a.dkv(2), None if a.proj_bias is None else a.dproj_bias,
             None,  # key_padding_mask: integers
             None if a.attn_bias is None else a.dbias,
             None if a.past_k is None else lambda: a.kv_grads[1],
             None if a.past_v is None else lambda: a.kv_grads[3]]
    return (grads + [None] * len(node.inputs))[:len(node.inputs)]


class _Attn(_Core):
    """``Attention`` (module doc)."""

    def __init__(self, ctx: Ctx, node: Node, cts: list):
        _refuse_inputs(node, {6: "past_sequence_length (a shared past/present buffer)"})
        a = node.attrs
        for attr, why in (("do_rotary", ("onnxruntime's CPU kernel does not run it; fuse MultiHeadAttention + "
                                        "RotaryEmbedding instead")),
                          ("past_present_share_buffer", "a shared past/present buffer")):
            if int(a.get(attr, 0)):
                raise GraphError(f"{node.label()}: Attention with {attr}=1 is not supported ({why})")
        super().__init__(ctx, node, cts, optional_input(node, 3), optional_input(node, 5))
        self.x, self.w = node.inputs[:2]
        self.b, self.past = optional_input(node, 2), optional_input(node, 4)
        self.gpresent = padded(cts, 2)[1]

    @cached_property
    def sizes(self) -> list[int]:
        """The widths of Q, K and V in the product (``qkv_hidden_sizes``, or three equal parts)."""
        given = self.node.attrs.get("qkv_hidden_sizes")
        if given:
            return [int(s) for s in given]
        d = self.e.dims(self.w)
        if d is None or not isinstance(d[1], int):
            raise GraphError(f"{self.node.label()}: Attention needs qkv_hidden_sizes or a static weights shape")
        return [d[1] // 3] * 3

    @cached_property
    def qkv(self) -> list[str]:
        """Q, K, V ``[B, N, S, H]``: ``input @ weights + bias`` split and into heads."""
        e = self.e
        y = e.op("MatMul", [self.x, self.w])
        if self.b is not None:
            y = e.op("Add", [y, self.b])
        parts = e.op("Split", [y, e.ints(self.sizes)], n_out=3, axis=2)
        return [self.heads4(p) for p in parts]

    @property
    def q4(self) -> str:
        return self.qkv[0]

    def _past(self, k: int) -> str:
        e = self.e
        return e.op("Squeeze", [e.op("Slice", [self.past, e.ints([k]), e.ints([k + 1]), e.ints([0])]), e.ints([0])])

    @cached_property
    def k_all(self) -> str:
        k4 = self.qkv[1]
        return k4 if self.past is None else self.e.op("Concat", [self._past(0), k4], axis=2)

    @cached_property
    def v_all(self) -> str:
        v4 = self.qkv[2]
        return v4 if self.past is None else self.e.op("Concat", [self._past(1), v4], axis=2)

    @cached_property
    def past_len(self) -> str:
        return self.e.const(np.int64(0)) if self.past is None else self.seq_len(self.past, 3)

    def _g_present(self, k: int) -> str | None:
        if self.gpresent is None:
            return None
        return self._take(self.gpresent, k)

    def _take(self, x: str, k: int) -> str:
        e = self.e
        return e.op("Squeeze", [e.op("Slice", [x, e.ints([k]), e.ints([k + 1]), e.ints([0])]), e.ints([0])])

    @cached_property
    def grads(self) -> tuple:
        """``(dQ4, dK4, dpast_k, dV4, dpast_v)``."""
        e = self.e
        past_k = None if self.past is None else self._past(0)
        past_v = None if self.past is None else self._past(1)
        dk, dpk = self.split_past(self.with_present(1, self._g_present(0)), self.qkv[1], past_k)
        dv, dpv = self.split_past(self.with_present(2, self._g_present(1)), self.qkv[2], past_v)
        dq = self.d(0)
        return (dq if dq is not None else e.zeros_like(self.qkv[0]), dk, dpk, dv, dpv)

    @cached_property
    def dqkv(self) -> str:
        """The cotangent of ``input @ weights + bias``, ``[B, S, Dq + Dk + Dv]``."""
        dq, dk, _, dv, _ = self.grads
        return self.e.op("Concat", [self.flat3(dq), self.flat3(dk), self.flat3(dv)], axis=2)

    def dx(self) -> str:
        e = self.e
        return e.op("MatMul", [self.dqkv, e.op("Transpose", [self.w], perm=[1, 0])], like=self.x)

    def dw(self) -> str:
        e = self.e
        x2, g2 = (e.op("Reshape", [t, e.op("Concat", [e.ints([-1]), e.op("Shape", [t], start=2)], axis=0)])
                  for t in (self.x, self.dqkv))  # [B*S, Din], [B*S, Dq+Dk+Dv]
        return e.op("MatMul", [e.op("Transpose", [x2], perm=[1, 0]), g2], like=self.w)

    def db(self) -> str:
        e = self.e
        return e.op("ReduceSum", [self.dqkv, e.ints([0, 1])], keepdims=0, like=self.b)

    def dpast(self) -> str:
        e = self.e
        _, _, dpk, _, dpv = self.grads
        return e.op("Concat", [e.op("Unsqueeze", [dpk, e.ints([0])]), e.op("Unsqueeze", [dpv, e.ints([0])])], axis=0,
                    like=self.past)


@vjp("Attention", domain=MS, bounded=True, finite=True, reads="all", mixing=True)
def attention(ctx: Ctx, node: Node, cts: list) -> list:
    """``com.microsoft.Attention`` (module doc)."""
    a = _Attn(ctx, node, cts)
    grads = [a.dx, a.dw, None if a.b is None else a.db,
             None,  # mask_index: integers
             None if a.past is None else a.dpast,
             None if a.attn_bias is None else a.dbias]
    return (grads + [None] * len(node.inputs))[:len(node.inputs)]
