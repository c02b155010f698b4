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
    feeds = {n: a for n, a in (i for i in ins if i is not None)}
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
    ops = {"MatMulNBits", "RotaryEmbedding"}
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
    with pytest.raises(rg.GraphError, match="node 'op'.*rotary_embedding_dim 4 differs"):
        rg.gradient(lg, loss="loss", wrt=["x"])
