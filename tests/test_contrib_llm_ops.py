"""The onnxruntime contrib operators of quantized and generated LLMs and of optimized transformers (issue 41, item
1): VJPs of ``com.microsoft`` MatMulNBits, RotaryEmbedding, GroupQueryAttention, MultiHeadAttention, Attention and
EmbedLayerNormalization against PyTorch float64 autograd of the same math, written here from onnxruntime's
docs/ContribOperators.md and CPU kernels; each case also checks that onnxruntime's forward output is that math
(float32: onnxruntime has no float64 kernel of these operators, so gradients match to ~2e-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit.contrib_cases import F32, MS, check, graph, with_loss
from kit.genai import genai_llama, unpack

import revgraph as rg
from revgraph.autodiff import registry

# ---------------------------------------------------------------------------------------------- MatMulNBits


def _unpack(b: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``bits``-wide values packed low bits first along the last axis of the uint8 ``b`` (the first
    ``count``)."""
    b = b.to(torch.int64)
    vals = [(b >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)]
    return torch.stack(vals, -1).reshape(*b.shape[:-1], -1)[..., :count]


def matmul_nbits(a, b, scales, zp=None, g_idx=None, bias=None, *, K, N, block_size, bits=4):
    """``A @ W^T + bias`` with ``W[n, k] = (q - zp) * scale`` per block of ``block_size`` along K (the docs)."""
    blocks = -(-K // block_size)
    q = _unpack(b, bits, block_size).to(torch.float64)  # [N, blocks, block]
    if zp is None:
        z = torch.full((N, blocks), float(1 << (bits - 1)), dtype=torch.float64)
    elif zp.dtype == torch.uint8:
        z = _unpack(zp, bits, blocks).to(torch.float64)
    else:
        z = zp
    w = ((q - z[..., None]) * scales[..., None]).reshape(N, -1)[:, :K]
    y = a @ w.T
    return y if bias is None else y + bias


def _nbits_inputs(rng, lead, K, N, block, bits, zp, bias):
    blocks = -(-K // block)
    ins = [("A", rng.standard_normal((*lead, K)).astype(F32)),
           ("B", rng.integers(0, 256, (N, blocks, block * bits // 8), dtype=np.uint8)),
           ("scales", (rng.random((N, blocks)) * 0.2 + 0.01).astype(F32))]
    if zp == "packed":
        ins.append(("zp", rng.integers(0, 256, (N, -(-blocks * bits // 8)), dtype=np.uint8)))
    elif zp == "float":
        ins.append(("zp", rng.uniform(0, (1 << bits) - 1, (N, blocks)).astype(F32)))
    else:
        ins.append(None)
    ins += [None, ("bias", rng.standard_normal(N).astype(F32)) if bias else None]
    return ins


@pytest.mark.parametrize(("lead", "K", "N", "block", "bits", "zp", "bias", "acc"), [
    ((2, 3), 64, 24, 32, 4, None, False, 4),  # the genai builder's int4: no zero points, accuracy_level 4
    ((2, 3), 64, 24, 32, 4, "packed", True, 0),
    ((5,), 64, 24, 16, 4, "float", False, 1),
    ((2, 3), 40, 8, 16, 4, "packed", True, 0),  # K stops inside the last block
    ((2, 3), 64, 12, 32, 2, "packed", False, 0),
    ((2, 3), 64, 12, 32, 2, "float", False, 0),
    ((1, 2, 3), 48, 12, 16, 8, None, True, 0),
    ((2, 3), 64, 12, 32, 8, "packed", False, 0),
])
def test_matmul_nbits(lead, K, N, block, bits, zp, bias, acc):
    """``dA = dY @ dequantize(B)``; the packed weight, its scales and zero points are frozen (module doc)."""
    rng = np.random.default_rng(K + N + bits)
    ins = _nbits_inputs(rng, lead, K, N, block, bits, zp, bias)
    attrs = {"K": K, "N": N, "block_size": block, "bits": bits, "accuracy_level": acc}
    kw = {k: attrs[k] for k in ("K", "N", "block_size", "bits")}
    scale = float(np.abs(ins[0][1]).sum(-1).max() * 0.2 * (1 << bits))  # (the outputs' size: a tolerance scale)
    check("MatMulNBits", ins, lambda *t: matmul_nbits(*t, **kw), attrs=attrs, wrt=["A"] + (["bias"] if bias else []),
          ftol=1e-6 * scale)


def test_matmul_nbits_weight_is_frozen():
    """No gradient reaches the packed weight, the scales or the zero points: asking for those of the scales or
    the float zero points is refused in one line naming the node and the input."""
    rng = np.random.default_rng(1)
    ins = _nbits_inputs(rng, (2,), 32, 8, 16, 4, "float", False)
    g = graph("MatMulNBits", ins, {"K": 32, "N": 8, "block_size": 16}, ["y"])
    feeds = dict(i for i in ins if i is not None)
    lg = with_loss(g, rg.Session(g).run(feeds), ["y"])
    for name, what in (("scales", "scales"), ("zp", "zero_points")):
        with pytest.raises(rg.GraphError, match=f"node 'op'.*frozen base: its {what} \\('{name}'\\) get no gradient"):
            rg.gradient(lg, loss="loss", wrt=["A", name])


@pytest.mark.parametrize(("attrs", "message"), [
    ({"bits": 3}, "bits=3 is not supported"),
    ({"weight_prepacked": 1}, "weight_prepacked=1"),
])
def test_matmul_nbits_refusals(attrs, message):
    rng = np.random.default_rng(2)
    ins = _nbits_inputs(rng, (2,), 32, 8, 16, 4, None, False)
    g = graph("MatMulNBits", ins, {"K": 32, "N": 8, "block_size": 16, **attrs}, ["y"])
    lg = with_loss(g, {"y": np.zeros((2, 8), F32)}, ["y"])
    with pytest.raises(rg.GraphError, match=f"node 'op'.*{message}|{message}"):
        rg.gradient(lg, loss="loss", wrt=["A"])


def test_contrib_llm_rules_state_their_facts():
    ops = {"MatMulNBits", "RotaryEmbedding", "GroupQueryAttention", "MultiHeadAttention", "Attention",
           "EmbedLayerNormalization"}
    contrib = {k: f for k, f in registry.DOMAIN_FACTS.items() if k[0] == MS and k[1] in ops}
    assert {op for _, op in contrib} == ops
    assert {k: f.undeclared() for k, f in contrib.items() if f.undeclared()} == {}


# ---------------------------------------------------------------------------------------------- RotaryEmbedding


def rotate(x, c, s, *, interleaved=False):
    """The pairs of the first ``2 * c.shape[-1]`` features of ``x`` rotated by ``(c, s)`` (broadcast); the rest
    passes through."""
    r = 2 * c.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(xr.shape)
    else:
        x1, x2 = xr[..., :r // 2], xr[..., r // 2:]
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    return torch.cat([out, rest], -1)


def rotary_embedding(x, pos, cos, sin, *, interleaved=0, heads=None):
    """``com.microsoft.RotaryEmbedding``: 3-D ``[B, S, H*D]`` (split into ``heads``) or 4-D ``[B, H, S, D]``;
    ``position_ids`` ``[B, S]`` or one element (``p0 + t``)."""
    four = x.dim() == 4
    x4 = x if four else x.reshape(x.shape[0], x.shape[1], heads, -1)
    seq = x4.shape[2] if four else x4.shape[1]
    p = pos if pos.dim() == 2 else pos.reshape(1, 1) + torch.arange(seq)[None]
    c, s = cos[p], sin[p]  # [B|1, S, R/2]
    c, s = (c[:, None] if four else c[:, :, None]), (s[:, None] if four else s[:, :, None])
    y = rotate(x4, c, s, interleaved=bool(interleaved))
    return y if four else y.reshape(x.shape)


def _angles(rng, positions, half):
    ang = rng.uniform(0, 6, (positions, half))
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


@pytest.mark.parametrize(("shape", "attrs", "pos"), [
    ((2, 3, 2 * 8), {"num_heads": 2}, "2d"),
    ((2, 3, 2 * 8), {"num_heads": 2, "interleaved": 1}, "2d"),
    ((2, 3, 2 * 8), {}, "1"),  # heads from the caches' width; one position: p0 + t
    ((2, 2, 3, 8), {"interleaved": 1}, "2d"),
    ((2, 2, 3, 8), {}, "scalar"),
    ((2, 3, 2 * 8), {"num_heads": 2, "rotary_embedding_dim": 4}, "2d"),  # the rest passes through
    ((2, 3, 2 * 8), {"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": 1}, "1"),
    ((2, 2, 3, 8), {"num_heads": 2, "rotary_embedding_dim": 4}, "2d"),
    ((2, 3, 2 * 8), {"num_heads": 2, "scale": 0.5, "is_packed_batching": 1}, "2d"),  # (the kernel reads neither)
])
def test_rotary_embedding(shape, attrs, pos):
    """``dX`` rotated back; the caches' gradients added at the positions (repeated positions accumulate)."""
    rng = np.random.default_rng(len(shape) + len(attrs))
    d = shape[-1] if len(shape) == 4 else 8
    half = attrs.get("rotary_embedding_dim", d) // 2
    cos, sin = _angles(rng, 12, half)
    b, s = shape[0], shape[2] if len(shape) == 4 else shape[1]
    p = {"2d": rng.integers(0, 12, (b, s)), "1": np.array([4]), "scalar": np.array(7)}[pos].astype(np.int64)
    ins = [("x", rng.standard_normal(shape).astype(F32)), ("pos", p), ("cos", cos), ("sin", sin)]
    kw = {"interleaved": attrs.get("interleaved", 0), "heads": shape[-1] // d if len(shape) == 3 else None}
    check("RotaryEmbedding", ins, lambda *t: rotary_embedding(*t, **kw), attrs=attrs)


def test_rotary_embedding_refuses_a_mismatched_dim():
    rng = np.random.default_rng(3)
    cos, sin = _angles(rng, 12, 4)
    ins = [("x", rng.standard_normal((2, 3, 16)).astype(F32)), ("pos", np.array([0], np.int64)), ("cos", cos),
           ("sin", sin)]
    g = graph("RotaryEmbedding", ins, {"num_heads": 2, "rotary_embedding_dim": 4}, ["y"])
    lg = with_loss(g, {"y": np.zeros((2, 3, 16), F32)}, ["y"])
    with pytest.raises(rg.GraphError, match=r"node 'op'.*rotary_embedding_dim 4 differs"):
        rg.gradient(lg, loss="loss", wrt=["x"])


# ---------------------------------------------------------------------------------------------- GroupQueryAttention


def _heads(x, h):
    """``[B, S, H*D]`` as ``[B, H, S, D]``."""
    return x.reshape(x.shape[0], x.shape[1], h, -1).transpose(1, 2)


def _softmax_attention(q, k, v, allowed, *, scale, softcap=0.0, bias=None, sink=None):
    """``softmax(bias + cap(scale Q K^T))`` over the allowed keys (``-inf`` elsewhere) times V, query heads
    grouped over the key/value heads; ``sink`` ``[Hq]``: ``exp(sink_h)`` added to each denominator."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    x = scale * q @ k.transpose(-1, -2)
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    if bias is not None:
        x = x + bias
    x = x.masked_fill(~allowed, -torch.inf)
    if sink is not None:
        x = torch.cat([x, sink.reshape(1, -1, 1, 1).expand(*x.shape[:3], 1)], -1)
    p = torch.softmax(x, -1)
    return p[..., :k.shape[2]] @ v


def group_query_attention(query, key, value, past_key, past_value, seqlens_k, total, cos, sin, position_ids=None,
                          bias=None, sink=None, *, num_heads, kv_num_heads, scale=0.0, softcap=0.0, do_rotary=0,
                          rotary_interleaved=0, local_window_size=-1, causal=1, smooth_softmax=0):
    """``com.microsoft.GroupQueryAttention`` as tests/... and onnxruntime's docs describe it (the rule's module doc):
    returns ``(output, present_key, present_value)``."""
    hq, hkv = num_heads, kv_num_heads
    if key is None:  # packed QKV
        q4 = _heads(query, hq + 2 * hkv)
        q4, k4, v4 = q4[:, :hq], q4[:, hq:hq + hkv], q4[:, hq + hkv:]
    else:
        q4, k4, v4 = _heads(query, hq), _heads(key, hkv), _heads(value, hkv)
    b, _, s, d = q4.shape
    tb = seqlens_k.long() + 1
    first = s == int(total)
    past_b = torch.zeros_like(tb) if first else tb - s
    qpos = past_b[:, None] + torch.arange(s)[None]
    if do_rotary:
        rpos = qpos
        if position_ids is not None:
            rpos = position_ids[:1, :1] + torch.arange(s)[None] if first else position_ids
        c, sn = cos[rpos][:, None], sin[rpos][:, None]
        q4 = rotate(q4, c, sn, interleaved=bool(rotary_interleaved))
        k4 = rotate(k4, c, sn, interleaved=bool(rotary_interleaved))
    n = 0 if past_key is None else past_key.shape[2]
    length = max(n, int(total))
    pk, pv = [], []
    for i in range(b):  # present: rows [0, P_b) of the past, the new rows after them, zeros
        p = int(past_b[i])
        for out, past, new in ((pk, past_key, k4), (pv, past_value, v4)):
            rows = [past[i, :, :p]] if p else []
            rows += [new[i], torch.zeros(hkv, length - p - s, d, dtype=new.dtype)]
            out.append(torch.cat(rows, 1))
    pk, pv = torch.stack(pk), torch.stack(pv)
    j = torch.arange(length)
    allowed = j[None, None] < tb[:, None, None]
    if causal:
        allowed = allowed & (j[None, None] <= qpos[:, :, None])
    if local_window_size > 0:
        allowed = allowed & (j[None, None] > qpos[:, :, None] - local_window_size)
    if bias is not None:
        bias = torch.nn.functional.pad(bias, (0, length - bias.shape[-1]))
    if smooth_softmax and sink is None:
        sink = torch.zeros(hq, dtype=q4.dtype)
    o = _softmax_attention(q4, pk, pv, allowed[:, None], scale=scale or 1 / np.sqrt(np.float32(d)), softcap=softcap,
                           bias=bias, sink=sink)
    return o.transpose(1, 2).reshape(b, s, -1), pk, pv


GQA_INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total", "cos", "sin", "position_ids",
              "bias", "sink")


def _gqa_case(rng, *, b=2, s=5, hq=4, hkv=2, d=16, past=0, total=None, seqlens=None, packed=False, rotary=False,
              half=None, pos=False, bias=False, sink=False):
    total = s + past if total is None else total
    seqlens = np.full(b, total - 1) if seqlens is None else np.asarray(seqlens)
    q, k, v = (rng.standard_normal((b, s, h * d)).astype(F32) for h in (hq, hkv, hkv))
    vals = {"query": np.concatenate([q, k, v], -1) if packed else q, "key": None if packed else k,
            "value": None if packed else v,
            "past_key": rng.standard_normal((b, hkv, past, d)).astype(F32),
            "past_value": rng.standard_normal((b, hkv, past, d)).astype(F32),
            "seqlens_k": seqlens.astype(np.int32), "total": np.array(total, np.int32)}
    if rotary:
        vals["cos"], vals["sin"] = _angles(rng, 32, half or d // 2)
    if pos:
        vals["position_ids"] = rng.integers(0, 32 - s, (b, s)).astype(np.int64)
    if bias:
        vals["bias"] = rng.standard_normal((b, 1, s, total)).astype(F32)
    if sink:
        vals["sink"] = rng.standard_normal(hq).astype(F32)
    return [None if vals.get(n) is None else (n, vals[n]) for n in GQA_INPUTS]


GQA_CASES = [  # (case keywords, attributes)
    ({}, {}),
    ({"packed": True}, {}),  # the genai builder's form: packed QKV, empty past, rotary
    ({"packed": True, "rotary": True}, {"do_rotary": 1}),
    ({"rotary": True}, {"do_rotary": 1, "rotary_interleaved": 1, "scale": 0.3}),
    ({"rotary": True, "d": 32, "half": 8}, {"do_rotary": 1}),  # R = 16 of 32 features rotated
    ({"seqlens": [4, 2], "rotary": True}, {"do_rotary": 1}),  # a right-padded first prompt
    ({"past": 3, "s": 1, "seqlens": [3, 2], "rotary": True}, {"do_rotary": 1}),  # a token with a ragged past
    ({"past": 6, "s": 1, "total": 5, "seqlens": [4, 2], "rotary": True}, {"do_rotary": 1}),  # a static cache
    ({"b": 1, "past": 4, "s": 3, "packed": True, "rotary": True}, {"do_rotary": 1}),  # a later prompt
    ({"rotary": True, "pos": True}, {"do_rotary": 1}),  # position_ids: the first prompt reads [0, 0]
    ({"b": 1, "past": 2, "s": 3, "rotary": True, "pos": True}, {"do_rotary": 1}),
    ({}, {"softcap": 2.0, "local_window_size": 2}),
    ({"bias": True}, {"softcap": 1.0}),
    ({"sink": True, "past": 2, "s": 1}, {}),
    ({}, {"smooth_softmax": 1, "causal": 0}),
    ({"past": 3, "s": 1, "seqlens": [3, 1]}, {"causal": 0}),
]


@pytest.mark.parametrize(("case", "attrs"), GQA_CASES)
def test_group_query_attention(case, attrs):
    """Query, key, value (rotated back), past, attention_bias and head_sink against torch float64; every output
    read by the loss (present_key and present_value carry cotangents of their own)."""
    rng = np.random.default_rng(len(case) * 7 + len(attrs))
    ins = _gqa_case(rng, **case)
    attrs = {"num_heads": 4, "kv_num_heads": 2, **attrs}
    want = [n for n, a in (i for i in ins if i is not None) if a.dtype == F32 and n not in ("cos", "sin")]
    check("GroupQueryAttention", ins, lambda *t: group_query_attention(*t, **attrs), attrs=attrs,
          outputs=("y", "pk", "pv"), wrt=want)


# ---------------------------------------------------------------------------------------------- MultiHeadAttention,
# Attention


def _additive_mask(mask, batch, s, t, past, *, fill, unidirectional, start_end=False):
    """The finite mask of onnxruntime's CPU kernels ``[B, 1, S|1, T]``: ``fill`` at padded keys (lengths ``[B]``,
    end/start positions ``[2B]``, 0/1 ``[B, T]`` or ``[B, S, T]``), plus -10000 above the causal frontier."""
    m = torch.zeros(batch, 1, 1, t, dtype=torch.float64)
    j = torch.arange(t)
    if mask is not None:
        if mask.dim() == 1 and start_end:
            hidden = (j[None] >= mask[:batch, None]) | (j[None] < mask[batch:, None])
        elif mask.dim() == 1:
            hidden = j[None] >= mask[:, None]
        else:
            hidden = mask == 0
        hidden = hidden[:, None, None] if hidden.dim() == 2 else hidden[:, None]
        m = m + hidden * fill
    if unidirectional:
        m = m + (j[None] > past + torch.arange(s)[:, None]) * -10000.0
    return m


def _attend(q4, k4, v4, m, scale):
    p = torch.softmax(scale * q4 @ k4.transpose(-1, -2) + m, -1)
    return (p @ v4).transpose(1, 2).reshape(q4.shape[0], q4.shape[2], -1)


def multi_head_attention(query, key, value, bias=None, mask=None, attention_bias=None, past_key=None, past_value=None,
                         *, num_heads, unidirectional=0, mask_filter_value=-10000.0, scale=0.0):
    """``com.microsoft.MultiHeadAttention`` (the rule's module doc): ``(output, present_key, present_value)``."""
    n = num_heads
    if key.dim() == 4:
        k4, v4 = key, value
    else:
        wq, wk = query.shape[-1], key.shape[-1]
        if bias is not None:
            query, key, value = query + bias[:wq], key + bias[wq:wq + wk], value + bias[wq + wk:]
        k4, v4 = _heads(key, n), _heads(value, n)
    q4 = _heads(query, n)
    past = 0 if past_key is None else past_key.shape[2]
    if past_key is not None:
        k4, v4 = torch.cat([past_key, k4], 2), torch.cat([past_value, v4], 2)
    m = _additive_mask(mask, q4.shape[0], q4.shape[2], k4.shape[2], past, fill=float(np.float32(mask_filter_value)),
                       unidirectional=unidirectional)
    if attention_bias is not None:
        m = m + attention_bias
    return _attend(q4, k4, v4, m, scale or 1 / np.sqrt(np.float32(q4.shape[-1]))), k4, v4


def contrib_attention(x, weights, bias=None, mask=None, past=None, attention_bias=None, *, num_heads,
                      qkv_hidden_sizes=None, unidirectional=0, mask_filter_value=-10000.0, scale=0.0):
    """``com.microsoft.Attention`` (the rule's module doc): ``(output, present)``."""
    sizes = qkv_hidden_sizes or [weights.shape[1] // 3] * 3
    y = x @ weights + (0 if bias is None else bias)
    q, k, v = torch.split(y, sizes, -1)
    q4, k4, v4 = (_heads(t, num_heads) for t in (q, k, v))
    p = 0 if past is None else past.shape[3]
    if past is not None:
        k4, v4 = torch.cat([past[0], k4], 2), torch.cat([past[1], v4], 2)
    batch = x.shape[0]
    m = _additive_mask(mask, batch, x.shape[1], k4.shape[2], p, fill=float(np.float32(mask_filter_value)),
                       unidirectional=unidirectional, start_end=mask is not None and mask.dim() == 1 and
                       mask.shape[0] == 2 * batch)
    if attention_bias is not None:
        m = m + attention_bias
    present = torch.stack([k4, v4]) if k4.shape == v4.shape else None  # (no present when V's heads differ)
    return _attend(q4, k4, v4, m, scale or 1 / np.sqrt(np.float32(q4.shape[-1]))), present


def _key_mask(rng, kind, b, s, t):
    """A padding mask that leaves every query row a visible key (a fully masked row's float32 logits, all near
    the fill value, round differently from float64's)."""
    if kind == "lengths":
        return rng.integers(1, t + 1, b).astype(np.int32)
    if kind == "start_end":
        return np.concatenate([rng.integers(2, t + 1, b), rng.integers(0, 2, b)]).astype(np.int32)
    m = (rng.random((b, t) if kind == "2d" else (b, s, t)) > 0.3).astype(np.int32)
    m[..., 0] = 1
    return m


MHA_CASES = [  # (case keywords, attributes)
    ({}, {}),
    ({"bias": True, "dv": 4}, {"scale": 0.3}),
    ({"mask": "lengths"}, {}),
    ({"mask": "2d", "bias": True}, {"unidirectional": 1, "mask_filter_value": -3.0}),
    ({"mask": "3d"}, {"mask_filter_value": -1e9}),
    ({"past": 2, "mask": "2d", "bias": True, "attn_bias": True}, {"unidirectional": 1}),
    ({"kv4": True, "attn_bias": True}, {}),
    ({"l": 5}, {}),  # cross attention: 5 keys for 3 queries
]


@pytest.mark.parametrize(("case", "attrs"), MHA_CASES)
def test_multi_head_attention(case, attrs):
    rng = np.random.default_rng(len(case) * 5 + len(attrs))
    b, s, n, h = 2, 3, 2, 8
    dv, past, l = case.get("dv", h), case.get("past", 0), case.get("l", s)
    t = past + l
    k, v = rng.standard_normal((b, l, n * h)).astype(F32), rng.standard_normal((b, l, n * dv)).astype(F32)
    if case.get("kv4"):
        k, v = (x.reshape(b, l, n, -1).transpose(0, 2, 1, 3).copy() for x in (k, v))
    vals = {"query": rng.standard_normal((b, s, n * h)).astype(F32), "key": k, "value": v,
            "bias": rng.standard_normal(2 * n * h + n * dv).astype(F32) if case.get("bias") else None,
            "mask": _key_mask(rng, case["mask"], b, s, t) if case.get("mask") else None,
            "attention_bias": rng.standard_normal((b, n, s, t)).astype(F32) if case.get("attn_bias") else None,
            "past_key": rng.standard_normal((b, n, past, h)).astype(F32) if past else None,
            "past_value": rng.standard_normal((b, n, past, dv)).astype(F32) if past else None}
    ins = [None if a is None else (name, a) for name, a in vals.items()]
    attrs = {"num_heads": n, **attrs}
    check("MultiHeadAttention", ins, lambda *t: multi_head_attention(*t, **attrs), attrs=attrs,
          outputs=("y", "pk", "pv") if past else ("y",))


ATTENTION_CASES = [
    ({}, {}),
    ({"bias": False, "sizes": [16, 16, 8]}, {"qkv_hidden_sizes": [16, 16, 8]}),
    ({"mask": "lengths"}, {"scale": 0.5, "mask_filter_value": -7.0}),
    ({"mask": "start_end"}, {}),
    ({"mask": "2d"}, {"unidirectional": 1, "mask_filter_value": -3.0}),
    ({"mask": "3d", "attn_bias": True}, {}),
    ({"past": 2, "mask": "2d"}, {"unidirectional": 1}),  # GPT-2 with past
]


@pytest.mark.parametrize(("case", "attrs"), ATTENTION_CASES)
def test_contrib_attention(case, attrs):
    rng = np.random.default_rng(len(case) * 3 + len(attrs))
    b, s, n, d_in, past = 2, 3, 2, 12, case.get("past", 0)
    sizes = case.get("sizes", [16, 16, 16])
    t = past + s
    vals = {"x": rng.standard_normal((b, s, d_in)).astype(F32),
            "weights": (rng.standard_normal((d_in, sum(sizes))) * 0.5).astype(F32),
            "bias": rng.standard_normal(sum(sizes)).astype(F32) if case.get("bias", True) else None,
            "mask": _key_mask(rng, case["mask"], b, s, t) if case.get("mask") else None,
            "past": rng.standard_normal((2, b, n, past, sizes[0] // n)).astype(F32) if past else None,
            "attention_bias": rng.standard_normal((1, n, s, t)).astype(F32) if case.get("attn_bias") else None}
    ins = [None if a is None else (name, a) for name, a in vals.items()]
    attrs = {"num_heads": n, **attrs}
    check("Attention", ins, lambda *t: contrib_attention(*t, **attrs), attrs=attrs,
          outputs=("y", "present") if past else ("y",), tol=3e-5)


@pytest.mark.parametrize(("op", "attrs", "message"), [
    ("Attention", {"do_rotary": 1}, "do_rotary=1 is not supported"),
    ("Attention", {"past_present_share_buffer": 1}, "past_present_share_buffer=1"),
])
def test_contrib_attention_refusals(op, attrs, message):
    rng = np.random.default_rng(4)
    ins = [("x", rng.standard_normal((2, 3, 12)).astype(F32)), ("weights", rng.standard_normal((12, 48)).astype(F32))]
    g = graph(op, ins, {"num_heads": 2, **attrs}, ["y"])
    lg = with_loss(g, {"y": np.zeros((2, 3, 16), F32)}, ["y"])
    with pytest.raises(rg.GraphError, match=f"node 'op'.*{message}"):
        rg.gradient(lg, loss="loss", wrt=["x"])


# ---------------------------------------------------------------------------------------------- EmbedLayerNormalization


def embed_layer_normalization(ids, seg, word, pos, seg_table, gamma, beta, mask=None, position_ids=None, *,
                              epsilon=1e-12):
    """``com.microsoft.EmbedLayerNormalization``: ``(output, mask_index, embedding_sum)`` (mask_index: not
    differentiable, ``None`` here)."""
    p = torch.arange(ids.shape[1])[None] if position_ids is None else position_ids.long()
    s = word[ids.long()] + pos[p]
    if seg is not None:
        s = s + seg_table[seg.long()]
    y = torch.nn.functional.layer_norm(s, s.shape[-1:], gamma, beta, eps=float(np.float32(epsilon)))
    return y, None, s


@pytest.mark.parametrize(("case", "outputs", "used"), [
    ({}, ("y", "mi"), ["y"]),  # (onnxruntime's schema makes every node write mask_index)
    ({"segments": True}, ("y", "mi", "sum"), ["y", "sum"]),  # embedding_sum read too: it joins the normalization's
    ({"segments": True, "mask": True, "epsilon": 1e-3}, ("y", "mi", "sum"), ["y"]),
    ({"position_ids": "2d"}, ("y", "mi", "sum"), ["sum"]),  # only the sum read: no gradient to gamma and beta
    ({"position_ids": "1", "segments": True}, ("y", "mi"), ["y"]),
])
def test_embed_layer_normalization(case, outputs, used):
    """The tables receive their rows at the indices (repeated ids accumulate); gamma and beta LayerNorm's."""
    rng = np.random.default_rng(len(case) + len(outputs))
    b, s, h, vocab, npos = 2, 5, 8, 4, 7  # (a small vocabulary: repeated ids)
    vals = {"ids": rng.integers(0, vocab, (b, s)).astype(np.int32),
            "seg": rng.integers(0, 2, (b, s)).astype(np.int32) if case.get("segments") else None,
            "word": rng.standard_normal((vocab, h)).astype(F32), "pos": rng.standard_normal((npos, h)).astype(F32),
            "seg_table": rng.standard_normal((2, h)).astype(F32) if case.get("segments") else None,
            "gamma": rng.standard_normal(h).astype(F32), "beta": rng.standard_normal(h).astype(F32),
            "mask": (np.arange(s)[None] < [[3], [5]]).astype(np.int32) if case.get("mask") else None,
            "position_ids": {"2d": rng.integers(0, npos, (b, s)), "1": rng.integers(0, npos, (1, s))}[
                case["position_ids"]].astype(np.int32) if case.get("position_ids") else None}
    ins = [None if a is None else (name, a) for name, a in vals.items()]
    attrs = {"epsilon": case["epsilon"]} if "epsilon" in case else {}
    check("EmbedLayerNormalization", ins, lambda *t: embed_layer_normalization(*t, **attrs), attrs=attrs,
          outputs=outputs, used=used)


# ---------------------------------------------------------------------------------------------- an optimized model


def _model_gradients(path, feeds: dict, wrt: list[str]) -> dict[str, np.ndarray]:
    """revgraph's gradients of ``sum(logits * u)`` (``u`` from a fixed seed) w.r.t. ``wrt``, run on onnxruntime;
    the gradient graph holds no operator outside ONNX's standard set but the model's own."""
    from kit.contrib_cases import outside_onnx

    g = rg.load(path)
    fwd = rg.Session(g).run(feeds)
    lg = with_loss(g, fwd, ["logits"])
    u = np.random.default_rng(6).standard_normal(fwd["logits"].shape).astype(F32)
    gg = rg.gradient(lg, loss="loss", wrt=wrt)
    assert set(outside_onnx(gg)) == set(outside_onnx(g))
    out = rg.Session(gg).run({**feeds, "logits_u": u})
    return {w: out[f"{w}_grad"] for w in wrt}


def test_fully_optimized_bert_has_the_gradients_of_the_export(tmp_path):
    """A tiny BERT exported by the TorchScript exporter, then fused by onnxruntime's transformer optimizer with
    every fusion (EmbedLayerNormalization, Attention with its mask_index, SkipLayerNormalization, BiasGelu): the
    gradients of every parameter equal the unfused export's (1e-5 of each gradient's scale, float32)."""
    import onnx
    from kit import torch_models as tm
    from onnxruntime.transformers import optimizer

    plain, fused = tmp_path / "plain.onnx", tmp_path / "fused.onnx"
    tm.export(tm.build("bert"), "torchscript-folded", plain)
    optimizer.optimize_model(str(plain), model_type="bert", num_heads=4, hidden_size=32).save_model_to_file(str(fused))
    ops = {nd.op_type for nd in onnx.load(str(fused)).graph.node if nd.domain == MS}
    assert {"EmbedLayerNormalization", "Attention"} <= ops
    floats = {str(p): {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(p)).graph.initializer
                       if i.data_type == onnx.TensorProto.FLOAT and len(i.dims)} for p in (plain, fused)}
    shared = sorted(set(floats[str(plain)]) & set(floats[str(fused)]))
    merged = {}  # the optimizer's merged Q|K|V weights and biases: each third is a weight of the export
    for name, a in floats[str(fused)].items():
        if name not in floats[str(plain)] and a.shape[-1] % 3 == 0:
            parts = np.split(a, 3, axis=-1)
            found = [next((n for n, b in floats[str(plain)].items() if b.shape == p.shape and np.array_equal(b, p)),
                          None) for p in parts]
            if all(found):
                merged[name] = found
    assert len(shared) >= 10 and len(merged) == 4, (shared, merged)  # 2 layers: a weight and a bias each
    feeds = {"input_ids": tm.tokens(2)}
    want = _model_gradients(plain, feeds, shared + [n for parts in merged.values() for n in parts])
    got = _model_gradients(fused, feeds, shared + list(merged))
    for name, parts in merged.items():
        want[name] = np.concatenate([want[p] for p in parts], axis=-1)
    for w in shared + list(merged):
        a = want[w]
        np.testing.assert_allclose(got[w], a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()) + 1e-8, err_msg=w)


# ---------------------------------------------------------------------------------------------- the genai builder's
# LLaMA


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "int4"])
def test_genai_builder_llama_has_pytorchs_gradients(tmp_path, precision):
    """The builder's LLaMA (GroupQueryAttention with packed QKV and rotary, SkipSimplifiedLayerNormalization, and
    MatMulNBits in int4) differentiated by revgraph against PyTorch float64 autograd of the same weights (int4:
    the dequantized ones, and accuracy_level 0, at which onnxruntime computes the exact product)."""
    path, model = genai_llama(tmp_path, precision, vocab=96)
    g = rg.load(path)
    from revgraph.train.selection import left_out
    assert {"cos_cache", "sin_cache"} <= set(left_out(g))  # (rotary tables: a full fine-tune leaves them out)
    for n in g.nodes:
        if n.op_type == "MatMulNBits":
            n.attrs["accuracy_level"] = 0
    b, s = 2, 6
    ids = np.random.default_rng(0).integers(0, 96, (b, s)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones((b, s), np.int64),
             **{f"past_key_values.{i}.{kv}": np.zeros((b, 2, 0, 16), F32) for i in range(2) for kv in ("key", "value")}}
    g.outputs = [vi for vi in g.outputs if vi.name == "logits"]
    fwd = rg.Session(g).run(feeds)
    lg = with_loss(g, fwd, ["logits"])
    u = np.random.default_rng(1).standard_normal(fwd["logits"].shape)
    names = {"model.embed_tokens.weight": "model.embed_tokens.weight",
             "model.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
             "model.layers.1.post_attention_layernorm.weight": "model.layers.1.post_attention_layernorm.weight",
             "model.layers.2.final_norm_layernorm.weight": "model.norm.weight"}
    if precision == "fp32":
        names.update({"model.layers.1.attn.o_proj.MatMul.weight": "model.layers.1.self_attn.o_proj.weight",
                      "lm_head.MatMul.weight": "lm_head.weight"})
    else:  # the torch model with the weights the int4 file holds
        with torch.no_grad():
            for name, p in model.named_parameters():  # o_proj, the MLP's, lm_head
                stem = name.removesuffix(".weight").replace("self_attn.", "attn.")
                if f"{stem}.MatMul.weight_Q4" in g.initializers:
                    q = unpack(np.asarray(g.initializers[f"{stem}.MatMul.weight_Q4"]))
                    sc = np.asarray(g.initializers[f"{stem}.MatMul.weight_scales"])
                    p.copy_(torch.tensor(((q - 8) * sc[..., None]).reshape(q.shape[0], -1)[:, :p.shape[1]]))
            for i, layer in enumerate(model.model.layers):
                q = unpack(np.asarray(g.initializers[f"model.layers.{i}.attn.qkv_proj.MatMul.weight_Q4"]))
                sc = np.asarray(g.initializers[f"model.layers.{i}.attn.qkv_proj.MatMul.weight_scales"])
                w = torch.tensor(((q - 8) * sc[..., None]).reshape(q.shape[0], -1)[:, :64])
                attn = layer.self_attn
                attn.q_proj.weight.copy_(w[:64])
                attn.k_proj.weight.copy_(w[64:96])
                attn.v_proj.weight.copy_(w[96:])
    gg = rg.gradient(lg, loss="loss", wrt=list(names))
    got = rg.Session(gg).run({**feeds, "logits_u": u.astype(F32)})
    model = model.double()
    (model(torch.tensor(ids)).logits * torch.tensor(u)).sum().backward()
    params = dict(model.named_parameters())
    for onnx_name, torch_name in names.items():
        want = params[torch_name].grad.numpy()
        want = want.T if "MatMul" in onnx_name else want
        np.testing.assert_allclose(got[f"{onnx_name}_grad"], want, rtol=2e-5,
                                   atol=2e-5 * float(np.abs(want).max()), err_msg=onnx_name)


# ---------------------------------------------------------------------------------------------- forward mode


@pytest.mark.parametrize("op", ["MatMulNBits", "GroupQueryAttention", "EmbedLayerNormalization"])
def test_forward_mode(op):
    """``rg.jvp`` (the transposed VJP) against ``torch.func.jvp`` of the same math, along the float inputs that
    carry gradient."""
    rng = np.random.default_rng(8)
    if op == "MatMulNBits":
        ins = _nbits_inputs(rng, (2, 3), 64, 12, 32, 4, "packed", True)
        attrs = {"K": 64, "N": 12, "block_size": 32, "bits": 4}
        fn, along, outs = (lambda *t: matmul_nbits(*t, K=64, N=12, block_size=32)), ["A", "bias"], ["y"]
    elif op == "GroupQueryAttention":
        ins = _gqa_case(rng, past=2, s=1, seqlens=[2, 1], rotary=True)
        attrs = {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1}
        fn, along, outs = (lambda *t: group_query_attention(*t, **attrs)), ["query", "key", "value", "past_key"], [
            "y", "pk", "pv"]
    else:
        ins = [("ids", rng.integers(0, 4, (2, 5)).astype(np.int32)), None,
               ("word", rng.standard_normal((4, 8)).astype(F32)),
               ("pos", rng.standard_normal((7, 8)).astype(F32)), None, ("gamma", rng.standard_normal(8).astype(F32)),
               ("beta", rng.standard_normal(8).astype(F32))]
        attrs, fn, along, outs = {}, embed_layer_normalization, ["word", "pos", "gamma"], ["y", "mi", "sum"]
    g = graph(op, ins, attrs, outs)
    feeds = dict(i for i in ins if i is not None)
    tangents = {n: rng.standard_normal(feeds[n].shape).astype(F32) for n in along}
    wanted = [o for o in outs if o != "mi"]
    got = rg.Session(rg.jvp(g, wanted, along)).run({**feeds, **{f"{n}_tangent": t for n, t in tangents.items()}})

    def f(*xs):
        args = [None if i is None else (xs[along.index(i[0])] if i[0] in along else torch.tensor(
            i[1].astype(np.float64) if i[1].dtype.kind == "f" else i[1])) for i in ins]
        out = fn(*args)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(o for o, name in zip(out, outs, strict=False) if name in wanted)

    primals = tuple(torch.tensor(feeds[n].astype(np.float64)) for n in along)
    _, want = torch.func.jvp(f, primals, tuple(torch.tensor(tangents[n].astype(np.float64)) for n in along))
    for o, w in zip(wanted, want, strict=True):
        w = w.numpy()
        np.testing.assert_allclose(got[f"{o}_tangent"], w, rtol=3e-5, atol=3e-5 * max(1.0, float(np.abs(w).max())),
                                   err_msg=f"{op} {o}")
