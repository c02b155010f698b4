"""VJP rules of Attention (rules/attention.py) and RotaryEmbedding (rules/rotary.py), opsets 23-25.

Attention is checked three ways by ``check_rule`` in float64 (onnxruntime has float64 Attention kernels):
central differences of onnxruntime's forward, PyTorch autograd of ``F.scaled_dot_product_attention`` (or, for
what SDPA does not have: softcap, the fourth output, windows, the explicit formula in torch), and second
order; onnxruntime and the reference evaluator must agree on the gradient graph. Every variant of the spec:
3-D and 4-D inputs, MHA/GQA/MQA, ``is_causal``, bool and float masks (fully masked rows included), ``scale``,
``softcap``, past key/value with the present outputs, ``qk_matmul_output_mode`` 0-3, ``softmax_precision``,
``nonpad_kv_seqlen`` (24) and sliding windows (25).

RotaryEmbedding has no float64 in the spec (nor in onnxruntime): float32 graphs, compared with PyTorch
autograd of the spec's algorithm in float64, and with central differences of onnxruntime's float32 forward
with a large step, exact for a function that is quadratic in its inputs (the loss is bilinear in X and the
caches).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from kit.harness import check_rule, double_backward, one_node_graph, with_loss

import revgraph as rg
from revgraph.ir import Graph, ValueInfo

F = torch.nn.functional
INF = float("inf")


def sqrt_scale(scale: float | None, d: int) -> float:
    """The factor applied to Q and K as onnxruntime and the spec's function body compute it (float32)."""
    s = np.float32(1.0) / np.sqrt(np.float32(d)) if scale is None else np.float32(scale)
    return float(np.float32(np.sqrt(np.float32(s))))


def attention_graph(feeds: dict, attrs: dict, outputs=("y0",), opset: int = 23, inputs: list | None = None) -> Graph:
    """A one-node Attention graph (float arrays as inputs, others as initializers); ``inputs`` and ``outputs``
    list the node's by position, "" for absent ones."""
    g = one_node_graph("Attention", feeds, attrs)
    node = g.nodes[0]
    node.inputs = list(inputs or feeds)
    node.outputs = list(outputs)
    g.outputs = [ValueInfo(o) for o in outputs if o]
    g.opsets = {"": opset}
    return g


def reference(q, k, v, mask=None, past_k=None, past_v=None, nonpad=None, *, causal=False, scale=None, softcap=0.0,
              hq=None, hkv=None, mode=None, left=-1, right=-1, sdpa=True):
    """ONNX Attention in torch: ``(Y, present_key, present_value, qk_matmul_output)``. ``sdpa``: through
    ``F.scaled_dot_product_attention`` (no softcap, no fourth output); otherwise the explicit formula."""
    rank3 = q.dim() == 3
    if rank3:
        b, lq = q.shape[:2]
        q = q.reshape(b, lq, hq, -1).transpose(1, 2)
        k = k.reshape(b, k.shape[1], hkv, -1).transpose(1, 2)
        v = v.reshape(b, v.shape[1], hkv, -1).transpose(1, 2)
    if past_k is not None:
        k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
    present_k, present_v = k, v
    lq, s = q.shape[2], k.shape[2]
    ss = sqrt_scale(scale, q.shape[-1])
    allowed, fmask = None, None
    if mask is not None:
        if mask.shape[-1] < s:  # opset 24+: a short mask is padded with -inf / False
            pad = (0, s - mask.shape[-1])
            mask = F.pad(mask, pad, value=False) if mask.dtype == torch.bool else F.pad(mask, pad, value=-INF)
        mask = mask.reshape(1, -1) if mask.dim() == 1 else mask  # SDPA takes masks of rank 2 or more
        if mask.dtype == torch.bool:
            allowed = mask
        else:
            fmask = mask
    rows, cols = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    if past_k is None and nonpad is not None:
        pos = rows + (nonpad.reshape(-1, 1, 1, 1) - lq)
    else:
        pos = rows + (0 if past_k is None else past_k.shape[2])

    def both(a, c):
        return c if a is None else a & c
    if causal:
        allowed = both(allowed, cols <= pos)
    if left >= 0:
        allowed = both(allowed, pos - cols <= left)
    if right >= 0:
        allowed = both(allowed, cols - pos <= right)
    if nonpad is not None:
        allowed = both(allowed, cols < nonpad.reshape(-1, 1, 1, 1))
    bias = fmask
    if allowed is not None:
        base = fmask if fmask is not None else torch.zeros((), dtype=q.dtype)
        bias = torch.where(allowed, base, torch.tensor(-INF, dtype=q.dtype))
    if sdpa:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=ss * ss, enable_gqa=True)
        qk = None
    else:
        g = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        raw = (q * ss) @ (kr * ss).transpose(-1, -2)
        capped = softcap * torch.tanh(raw / softcap) if softcap else raw
        keep = None
        if bias is None:
            biased = capped
        else:
            keep = bias.amax(-1, keepdim=True) > -INF
            biased = capped + torch.where(keep, bias, torch.zeros((), dtype=q.dtype))
        p = torch.softmax(biased, -1)
        if keep is not None:
            p = torch.where(keep, p, torch.zeros((), dtype=q.dtype))
        y = p @ vr
        qk = {0: raw, 1: capped, 2: capped if bias is None else capped + bias, 3: p}.get(mode)
    if rank3:
        y = y.transpose(1, 2).reshape(y.shape[0], lq, -1)
    return y, present_k, present_v, qk


def rnd(rng, *shape):
    return rng.standard_normal(shape)


def qkv(rng, b=2, hq=4, hkv=2, lq=3, s=5, d=16, dv=3, rank=4):
    """Q, K, V. The head size 16 makes the default scale exact in float32 (sqrt(1/4)): onnxruntime computes it
    in float32 as the spec's function body does, onnx's reference kernel in float64 (revgraph's corrected one
    in float32, reference_ops.py), and the gradient graph holds the forward node (the VJP reads Y)."""
    if rank == 3:
        return {"q": rnd(rng, b, lq, hq * d), "k": rnd(rng, b, s, hkv * d), "v": rnd(rng, b, s, hkv * dv)}
    return {"q": rnd(rng, b, hq, lq, d), "k": rnd(rng, b, hkv, s, d), "v": rnd(rng, b, hkv, s, dv)}


def run(feeds, attrs, fn, *, inputs=None, outputs=("y0",), opset=23, wrt=None, second_order=True,
        loss_outputs=None):
    """``check_rule`` on a one-node Attention graph; ``fn`` gets every feed (the integer and bool ones, which
    are initializers, as constant tensors)."""
    consts = {k: torch.tensor(v) for k, v in feeds.items() if v.dtype.kind != "f"}
    floats = {k: v for k, v in feeds.items() if v.dtype.kind == "f"}
    g = attention_graph(feeds, attrs, outputs, opset, inputs)
    return check_rule(g, floats, lambda **kw: fn(**kw, **consts), wrt=wrt, outputs=loss_outputs,
                      second_order=second_order)


# ---------------------------------------------------------------------------------------------- heads, scale


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("rank", [3, 4])
def test_heads(hq, hkv, rank):
    """MHA, GQA and MQA with 3-D and 4-D inputs, against SDPA (``enable_gqa``), default scale."""
    rng = np.random.default_rng(hq * 10 + hkv + rank)
    feeds = qkv(rng, hq=hq, hkv=hkv, rank=rank)
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv} if rank == 3 else {}
    run(feeds, attrs, lambda q, k, v: reference(q, k, v, hq=hq, hkv=hkv)[0], second_order=hq == 4 and hkv == 2)


@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_scale_and_cross_lengths(scale):
    """An explicit scale; query and key lengths differ; value head size differs from the key's."""
    rng = np.random.default_rng(1)
    feeds = qkv(rng, lq=6, s=2, d=5, dv=2)
    run(feeds, {"scale": scale}, lambda q, k, v: reference(q, k, v, scale=scale)[0], second_order=False)


# ---------------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("lq,s", [(3, 5), (5, 3), (4, 4)])
def test_causal(rank, lq, s):
    """Top-left causal without a cache (also with more queries than keys), GQA."""
    rng = np.random.default_rng(lq * s + rank)
    feeds = qkv(rng, lq=lq, s=s, rank=rank)
    attrs = {"is_causal": 1, **({"q_num_heads": 4, "kv_num_heads": 2} if rank == 3 else {})}
    run(feeds, attrs, lambda q, k, v: reference(q, k, v, causal=True, hq=4, hkv=2)[0],
        second_order=rank == 4 and lq == 3)


def bool_mask(rng, shape, full_rows=True):
    m = rng.random(shape) > 0.4
    if full_rows:
        m[..., 1, :] = False  # a fully masked query row
    return m


@pytest.mark.parametrize("shape", [(2, 1, 3, 5), (3, 5), (4, 3, 5), (5,)])
def test_bool_mask(shape):
    """A bool mask of every broadcast rank, with a fully masked row where it has one (zeros, not NaN)."""
    rng = np.random.default_rng(len(shape))
    feeds = {**qkv(rng), "m": bool_mask(rng, shape, full_rows=len(shape) > 1)}
    grads = run(feeds, {}, lambda q, k, v, m: reference(q, k, v, m)[0], wrt=["q", "k", "v"],
                second_order=len(shape) == 4)
    assert all(np.isfinite(g).all() for g in grads.values())
    if len(shape) == 4:
        assert not grads["q"][0, :, 1].any()  # the fully masked row: exact zeros


@pytest.mark.parametrize("shape", [(3, 5), (2, 4, 3, 5), (1, 3, 5)])
def test_float_mask(shape):
    """An additive float mask, differentiated too, with -inf entries and a fully masked row: exact zeros there."""
    rng = np.random.default_rng(7)
    m = rng.standard_normal(shape)
    m[..., 0, 1] = -INF
    m[..., 2, :] = -INF
    m[..., 4] = -INF  # a key no query sees
    feeds = {**qkv(rng), "m": m}
    grads = run(feeds, {}, lambda q, k, v, m: reference(q, k, v, m)[0], second_order=len(shape) == 2)
    assert all(np.isfinite(g).all() for g in grads.values())
    assert not grads["m"][..., 0, 1].any() and not grads["m"][..., 2, :].any() and not grads["m"][..., 4].any()
    assert not grads["q"][:, :, 2].any()
    assert not grads["k"][:, :, 4].any() and not grads["v"][:, :, 4].any()


def test_fully_masked_row_nonfinite_cotangent():
    """A fully masked row's output is a constant 0: an inf or NaN cotangent there gives exact zeros (a
    selection), and nothing of it reaches K, V or the mask."""
    rng = np.random.default_rng(17)
    m = rng.standard_normal((2, 1, 3, 5))
    m[0, 0, 1] = -INF
    feeds = {**qkv(rng), "m": m}
    g = attention_graph(feeds, {})
    gg = rg.gradient(g, loss="y0", wrt=["q", "k", "v", "m"], seed="input")
    dy = rng.standard_normal((2, 4, 3, 3))
    dy[0, :, 1] = [INF, -INF, np.nan]
    sess = ort.InferenceSession(rg.to_onnx(gg).SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, "y0_grad": dy}), strict=True))
    dy[0, :, 1] = 0
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, "y0_grad": dy}), strict=True))
    for w in ("q", "k", "v", "m"):
        np.testing.assert_array_equal(got[f"{w}_grad"], want[f"{w}_grad"], err_msg=w)
    assert not got["q_grad"][0, :, 1].any()


def test_causal_with_masks():
    """The causal frontier composed with a bool mask and with a float mask (intersection / sum of biases)."""
    rng = np.random.default_rng(3)
    feeds = {**qkv(rng, lq=4, s=4), "m": bool_mask(rng, (2, 1, 4, 4))}
    run(feeds, {"is_causal": 1}, lambda q, k, v, m: reference(q, k, v, m, causal=True)[0], wrt=["q", "k", "v"],
        second_order=False)
    feeds = {**qkv(rng, lq=4, s=4), "m": rng.standard_normal((4, 4))}
    run(feeds, {"is_causal": 1}, lambda q, k, v, m: reference(q, k, v, m, causal=True)[0], second_order=False)


def test_constant_mask_without_full_rows():
    """A constant mask with a visible key in every row needs no row guard (its ReduceMax and Where)."""
    rng = np.random.default_rng(4)
    m = rng.random((3, 5)) > 0.5
    m[:, 0] = True
    feeds = qkv(rng)
    run({**feeds, "m": m}, {}, lambda q, k, v, m: reference(q, k, v, m)[0], second_order=False)
    g = attention_graph({**feeds, "m": m}, {})
    lg, _ = with_loss(g, {"y0": np.zeros((2, 4, 3, 3))})
    gg = rg.gradient(lg, loss="loss", wrt=["q"])
    assert not [n for n in gg.nodes if n.op_type == "ReduceMax"]


# ---------------------------------------------------------------------------------------------- cache


@pytest.mark.parametrize("rank", [3, 4])
def test_past_key_value(rank):
    """past_key/past_value with the present outputs in the loss, causal with the cache offset (bottom-right)."""
    rng = np.random.default_rng(5)
    feeds = {**qkv(rng, lq=2, s=2, rank=rank), "pk": rnd(rng, 2, 2, 3, 16), "pv": rnd(rng, 2, 2, 3, 3)}
    attrs = {"is_causal": 1, **({"q_num_heads": 4, "kv_num_heads": 2} if rank == 3 else {})}
    inputs = ["q", "k", "v", "", "pk", "pv"]

    def fn(q, k, v, pk, pv):
        return reference(q, k, v, None, pk, pv, causal=True, hq=4, hkv=2)[:3]
    run(feeds, attrs, fn, inputs=inputs, outputs=["y0", "y1", "y2"], second_order=rank == 4)


def test_past_with_float_mask():
    """A float mask over past and new keys, the cache not causal."""
    rng = np.random.default_rng(6)
    feeds = {**qkv(rng, lq=3, s=2), "m": rnd(rng, 3, 5), "pk": rnd(rng, 2, 2, 3, 16), "pv": rnd(rng, 2, 2, 3, 3)}
    run(feeds, {}, lambda q, k, v, m, pk, pv: reference(q, k, v, m, pk, pv)[0], second_order=False)


# ---------------------------------------------------------------------------------------------- softcap, outputs


@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_qk_output(mode, softcap):
    """The fourth output in the loss with Y, for each mode, with and without softcap; the mask has -inf
    entries and a fully masked row (finite in mode 2, whose output holds the bias: -inf would make the loss
    NaN)."""
    rng = np.random.default_rng(mode)
    m = rng.standard_normal((3, 5))
    if mode != 2:
        m[1] = -INF
        m[0, 2] = -INF
    feeds = {**qkv(rng), "m": m}

    def fn(q, k, v, m):
        y, _, _, qk = reference(q, k, v, m, softcap=softcap, mode=mode, sdpa=False)
        return y, qk
    grads = run(feeds, {"qk_matmul_output_mode": mode, "softcap": softcap}, fn, outputs=["y0", "", "", "y3"],
                loss_outputs=["y0", "y3"], second_order=mode == 3)
    assert all(np.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_qk_output_read(mode):
    """A forward that writes the logits (modes 0-2, no softcap, no row guard) or the softmax (3) saves the
    VJP the Q K^T product: four MatMul instead of five; with mode 3 no Softmax either. Second order goes
    through the fourth output's cotangent."""
    rng = np.random.default_rng(8 + mode)
    feeds = qkv(rng)
    attrs = {"qk_matmul_output_mode": mode, "is_causal": 1}
    g = run(feeds, attrs, lambda q, k, v: reference(q, k, v, causal=True)[0], outputs=["y0", "", "", "y3"],
            loss_outputs=["y0"], second_order=mode in (0, 3))
    g = attention_graph(feeds, attrs, outputs=["y0", "", "", "y3"])
    lg, _ = with_loss(g, {"y0": np.zeros((2, 4, 3, 3))}, ["y0"])
    ops = [n.op_type for n in rg.gradient(lg, loss="loss", wrt=["q", "k", "v"]).nodes]
    assert ops.count("MatMul") == 4, ops
    assert ("Softmax" in ops) == (mode != 3)


@pytest.mark.parametrize("softcap", [0.5, 3.0])
def test_softcap(softcap):
    rng = np.random.default_rng(9)
    feeds = {**qkv(rng), "m": bool_mask(rng, (2, 1, 3, 5))}
    run(feeds, {"softcap": softcap, "is_causal": 0},
        lambda q, k, v, m: reference(q, k, v, m, softcap=softcap, sdpa=False)[0], wrt=["q", "k", "v"],
        second_order=softcap == 0.5)


# ---------------------------------------------------------------------------------------------- opsets 24, 25


@pytest.mark.parametrize("causal", [0, 1])
def test_nonpad_kv_seqlen(causal):
    """Opset 24: the padding of nonpad_kv_seqlen, and the per-batch causal offset (nonpad - L); a batch with
    fewer valid keys than queries has fully masked leading rows."""
    rng = np.random.default_rng(10 + causal)
    feeds = {**qkv(rng, lq=3, s=5), "n": np.array([2, 5], np.int64)}
    run(feeds, {"is_causal": causal}, lambda q, k, v, n: reference(q, k, v, nonpad=n, causal=bool(causal))[0],
        inputs=["q", "k", "v", "", "", "", "n"], opset=24, second_order=False)


def test_short_mask_opset24():
    """Opset 24: a float mask shorter than the keys is padded with -inf; its gradient has its own shape."""
    rng = np.random.default_rng(12)
    feeds = {**qkv(rng), "m": rnd(rng, 3, 3)}
    grads = run(feeds, {}, lambda q, k, v, m: reference(q, k, v, m)[0], opset=24, second_order=False)
    assert grads["m"].shape == (3, 3)


@pytest.mark.parametrize("left,right,causal", [(1, -1, 1), (1, 1, 0), (-1, 0, 0)])
def test_windows_opset25(left, right, causal):
    rng = np.random.default_rng(13)
    feeds = qkv(rng, lq=4, s=6)
    attrs = {"left_window_size": left, "right_window_size": right, "is_causal": causal}
    run(feeds, attrs, lambda q, k, v: reference(q, k, v, causal=bool(causal), left=left, right=right)[0],
        opset=25, second_order=False)


# ---------------------------------------------------------------------------------------------- precision, shapes


def test_softmax_precision_float16():
    """float16 inputs with the softmax in float32: against torch in float64 at float16 tolerances."""
    rng = np.random.default_rng(14)
    feeds = {k: v.astype(np.float16) for k, v in qkv(rng).items()}
    g = attention_graph(feeds, {"softmax_precision": 1, "is_causal": 1})
    lg, _ = with_loss(g, {"y0": np.zeros((2, 4, 3, 3), np.float16)})
    u = rng.standard_normal((2, 4, 3, 3)).astype(np.float16)
    gg = rg.gradient(lg, loss="loss", wrt=["q", "k", "v"])
    assert any(n.op_type == "Cast" for n in gg.nodes)
    sess = ort.InferenceSession(rg.to_onnx(gg).SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, "y0_u": u}), strict=True))
    tin = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in feeds.items()}
    y = reference(**tin, causal=True)[0]
    tg = torch.autograd.grad((y * torch.tensor(u.astype(np.float64))).sum(), list(tin.values()))
    for k, t in zip(tin, tg, strict=True):
        np.testing.assert_allclose(got[f"{k}_grad"].astype(np.float64), t.numpy(), rtol=2e-2, atol=1e-2, err_msg=k)


def test_float32_against_sdpa():
    """float32, larger: the gradient graph against SDPA's backward in float32."""
    rng = np.random.default_rng(15)
    feeds = {k: v.astype(np.float32) for k, v in qkv(rng, b=2, hq=8, hkv=2, lq=16, s=16, d=8, dv=8).items()}
    g = attention_graph(feeds, {"is_causal": 1})
    u = rng.standard_normal((2, 8, 16, 8)).astype(np.float32)
    lg, _ = with_loss(g, {"y0": u})
    gg = rg.gradient(lg, loss="loss", wrt=["q", "k", "v"])
    sess = ort.InferenceSession(rg.to_onnx(gg).SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, "y0_u": u}), strict=True))
    tin = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    y = F.scaled_dot_product_attention(*tin.values(), is_causal=True, enable_gqa=True)
    tg = torch.autograd.grad((y * torch.tensor(u)).sum(), list(tin.values()))
    for k, t in zip(tin, tg, strict=True):
        np.testing.assert_allclose(got[f"{k}_grad"], t.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


def test_dynamic_shapes():
    """Symbolic batch and sequence lengths, then every dimension symbolic: the default scale, the cache offset,
    the mask's padding (opset 24: shorter than the keys) and GQA's head counts are read at run time."""
    rng = np.random.default_rng(16)
    feeds = {**qkv(rng, lq=2, s=2), "m": rnd(rng, 1, 1, 2, 3), "pk": rnd(rng, 2, 2, 3, 16), "pv": rnd(rng, 2, 2, 3, 3)}
    g = attention_graph(feeds, {"is_causal": 1}, opset=24, inputs=["q", "k", "v", "m", "pk", "pv"])

    def fn(q, k, v, m, pk, pv):
        return reference(q, k, v, m, pk, pv, causal=True)[0]
    for vi in g.inputs:
        shape = list(vi.shape)
        shape[0] = "batch" if vi.name != "m" else 1
        shape[-2 if vi.name != "m" else -1] = f"len_{vi.name}"
        vi.shape = tuple(shape)
    check_rule(g, feeds, fn)
    for vi in g.inputs:
        vi.shape = tuple(f"{vi.name}{i}" for i in range(len(vi.shape)))
    check_rule(g, feeds, fn, second_order=False)
    ops = [n.op_type for n in rg.gradient(with_loss(g, {"y0": np.zeros((2, 4, 2, 3))})[0], loss="loss").nodes]
    assert "Pad" in ops and "Sqrt" in ops


# ---------------------------------------------------------------------------------------------- a wider sweep


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_attention_sweep(seed):
    """Random combinations of rank, heads, lengths, scale, causal, mask kind and cache, second order included."""
    rng = np.random.default_rng(100 + seed)
    rank = int(rng.choice([3, 4]))
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2, 3]))
    lq, s, d, dv = (int(x) for x in rng.integers(1, 5, 4))
    scale = None if rng.integers(2) else float(rng.uniform(0.2, 1.5))
    d = 16 if scale is None else d  # see qkv
    feeds = qkv(rng, b=2, hq=hq, hkv=hkv, lq=lq, s=s, d=d, dv=dv, rank=rank)
    causal = bool(rng.integers(2))
    past = bool(rng.integers(2))
    total = s + (2 if past else 0)
    kind = rng.choice(["none", "bool", "float"])
    inputs = ["q", "k", "v"]
    if kind == "bool":
        feeds["m"] = rng.random((2, 1, lq, total)) > 0.3
    elif kind == "float":
        feeds["m"] = rng.standard_normal((lq, total))
    if kind != "none" or past:
        inputs.append("m" if kind != "none" else "")
    if past:
        feeds["pk"], feeds["pv"] = rnd(rng, 2, hkv, 2, d), rnd(rng, 2, hkv, 2, dv)
        inputs += ["pk", "pv"]
    attrs = {"is_causal": int(causal), **({"scale": scale} if scale else {}),
             **({"q_num_heads": hq, "kv_num_heads": hkv} if rank == 3 else {})}

    def fn(q, k, v, m=None, pk=None, pv=None):
        return reference(q, k, v, m, pk, pv, causal=causal, scale=scale, hq=hq, hkv=hkv)[0]
    run(feeds, attrs, fn, inputs=inputs, wrt=[k for k in feeds if feeds[k].dtype == np.float64])


# ---------------------------------------------------------------------------------------------- RotaryEmbedding


def rope_reference(x, cos, sin, pos=None, *, interleaved=0, dim=0, num_heads=0):
    """The spec's algorithm in torch."""
    shape = x.shape
    if x.dim() == 4:
        x = x.transpose(1, 2)
    else:
        x = x.reshape(shape[0], shape[1], num_heads, -1)
    r = dim or x.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, -1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    rot = torch.stack([real, imag], -1).reshape(rot.shape) if interleaved else torch.cat([real, imag], -1)
    out = torch.cat([rot, rest], -1)
    return out.reshape(shape) if len(shape) == 3 else out.transpose(1, 2)


def check_rope(feeds: dict, attrs: dict, seed: int = 0) -> dict:
    """float32 gradients of ``sum(u * RotaryEmbedding(...))`` (onnxruntime, and the reference evaluator) against
    torch float64 autograd, central differences (exact for a quadratic loss, so a step of 0.5) and second
    order (Hessian-vector products against differences of the gradient graph, linear in the inputs)."""
    rng = np.random.default_rng(seed)
    names = ["x", "cos", "sin"] + (["pos"] if "pos" in feeds else [])
    g = one_node_graph("RotaryEmbedding", feeds, attrs)
    g.nodes[0].inputs = names
    g.opsets = {"": 23}
    wrt = ["x", "cos", "sin"]
    tfeeds, feeds = feeds, {k: v for k, v in feeds.items() if k != "pos"}
    u = rng.standard_normal(feeds["x"].shape).astype(np.float32)
    lg, _ = with_loss(g, {"y0": u})
    gg = rg.gradient(lg, loss="loss", wrt=wrt)

    def session(graph):
        return ort.InferenceSession(rg.to_onnx(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    s_grad, s_loss = session(gg), session(lg)

    def run_grad(f):
        return dict(zip([o.name for o in s_grad.get_outputs()], s_grad.run(None, f), strict=True))
    got = run_grad({**feeds, "y0_u": u})
    ref = rg.Session(gg, backend="reference").run({**feeds, "y0_u": u})
    for w in wrt:
        np.testing.assert_allclose(ref[f"{w}_grad"], got[f"{w}_grad"], rtol=1e-5, atol=1e-5, err_msg=f"reference {w}")
    # torch, float64
    tin = {k: torch.tensor(v.astype(np.float64) if k != "pos" else v, requires_grad=k in wrt)
           for k, v in tfeeds.items()}
    y = rope_reference(**tin, interleaved=attrs.get("interleaved", 0), dim=attrs.get("rotary_embedding_dim", 0),
                       num_heads=attrs.get("num_heads", 0))
    tg = torch.autograd.grad((y * torch.tensor(u.astype(np.float64))).sum(), [tin[w] for w in wrt])
    for w, t in zip(wrt, tg, strict=True):
        np.testing.assert_allclose(got[f"{w}_grad"], t.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"torch {w}")
    # central differences, exact up to rounding for a quadratic
    h = 0.5
    for _ in range(2):
        v = {w: rng.standard_normal(feeds[w].shape).astype(np.float32) for w in wrt}
        f = [float(s_loss.run(None, {**feeds, "y0_u": u, **{w: feeds[w] + sg * h * v[w] for w in wrt}})[0])
             for sg in (1, -1)]
        analytic = sum(float(np.sum(got[f"{w}_grad"].astype(np.float64) * v[w])) for w in wrt)
        np.testing.assert_allclose(analytic, (f[0] - f[1]) / (2 * h), rtol=1e-4, atol=1e-3)
    # second order
    hvp = double_backward(gg, wrt, feeds, np.float32)
    vs = {f"{w}_v": rng.standard_normal(feeds[w].shape).astype(np.float32) for w in wrt}
    s_hvp = session(hvp)
    out = dict(zip([o.name for o in s_hvp.get_outputs()], s_hvp.run(None, {**feeds, "y0_u": u, **vs}), strict=True))
    out = dict(zip(wrt, (out[n] for n in hvp.output_names[-len(wrt):]), strict=True))
    plus = run_grad({**feeds, "y0_u": u, **{w: feeds[w] + h * vs[f"{w}_v"] for w in wrt}})
    minus = run_grad({**feeds, "y0_u": u, **{w: feeds[w] - h * vs[f"{w}_v"] for w in wrt}})
    for w in wrt:
        numeric = (plus[f"{w}_grad"] - minus[f"{w}_grad"]) / (2 * h)
        np.testing.assert_allclose(out[w], numeric, rtol=1e-4, atol=1e-4, err_msg=f"second order {w}")
    return got


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("partial", [False, True])
def test_rotary_embedding_positions(interleaved, rank, partial):
    """With position_ids (repeated positions accumulate in the caches' gradients), full and partial rotation."""
    rng = np.random.default_rng(interleaved + 2 * rank + 4 * partial)
    b, h, seq, d = 2, 3, 4, 8
    r = 4 if partial else d
    x = rng.standard_normal((b, h, seq, d) if rank == 4 else (b, seq, h * d)).astype(np.float32)
    feeds = {"x": x, "cos": rng.standard_normal((6, r // 2)).astype(np.float32),
             "sin": rng.standard_normal((6, r // 2)).astype(np.float32),
             "pos": np.array([[0, 1, 2, 1], [5, 5, 3, 0]], np.int64)}
    attrs = {"interleaved": interleaved, **({"rotary_embedding_dim": r} if partial else {}),
             **({"num_heads": h} if rank == 3 else {})}
    check_rope(feeds, attrs)


@pytest.mark.parametrize("interleaved,rank", [(0, 4), (1, 4), (1, 3)])
def test_rotary_embedding_no_positions(interleaved, rank):
    """Without position_ids: the caches are [B, L, R/2]."""
    rng = np.random.default_rng(20 + interleaved + rank)
    x = rng.standard_normal((2, 3, 4, 6) if rank == 4 else (2, 4, 18)).astype(np.float32)
    feeds = {"x": x, "cos": rng.standard_normal((2, 4, 3)).astype(np.float32),
             "sin": rng.standard_normal((2, 4, 3)).astype(np.float32)}
    check_rope(feeds, {"interleaved": interleaved, **({"num_heads": 3} if rank == 3 else {})})


def test_rotary_embedding_dx_is_one_node():
    """dX is one RotaryEmbedding with the sine negated: no slices or products when only X needs a gradient."""
    rng = np.random.default_rng(22)
    feeds = {"x": rng.standard_normal((1, 2, 3, 4)).astype(np.float32), "cos": np.ones((3, 2), np.float32),
             "sin": np.zeros((3, 2), np.float32), "pos": np.zeros((1, 3), np.int64)}
    g = one_node_graph("RotaryEmbedding", feeds, float_inputs=["x"])
    g.opsets = {"": 23}
    lg, _ = with_loss(g, {"y0": feeds["x"]})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    ops = [n.op_type for n in gg.nodes]
    assert ops.count("RotaryEmbedding") == 2 and "Slice" not in ops, ops


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_attention_sweep_variants(seed):
    """Random softcap, fourth-output mode (in the loss), GQA, float mask with -inf entries, and at opset 24 the
    nonpad_kv_seqlen padding with causal offsets."""
    rng = np.random.default_rng(200 + seed)
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2]))
    lq, s = (int(x) for x in rng.integers(1, 5, 2))
    feeds = qkv(rng, b=2, hq=hq, hkv=hkv, lq=lq, s=s, dv=2)
    mode = int(rng.integers(4))
    softcap = float(rng.choice([0.0, 0.7, 2.0]))
    causal = bool(rng.integers(2))
    nonpad = bool(rng.integers(2))
    m = rng.standard_normal((lq, s))
    if mode != 2:
        m[rng.random((lq, s)) < 0.3] = -INF
    feeds["m"] = m
    inputs = ["q", "k", "v", "m"]
    if nonpad:
        feeds["n"] = rng.integers(0, s + 1, 2).astype(np.int64)
        inputs += ["", "", "n"]
    y3 = mode != 2 or (not causal and not nonpad)  # mode 2 holds the bias: -inf would make the loss NaN

    def fn(q, k, v, m, n=None):
        y, _, _, qk = reference(q, k, v, m, nonpad=n, causal=causal, softcap=softcap, mode=mode, sdpa=False)
        return (y, qk) if y3 else y
    run(feeds, {"qk_matmul_output_mode": mode, "softcap": softcap, "is_causal": int(causal)}, fn, inputs=inputs,
        outputs=["y0", "", "", "y3"], loss_outputs=["y0", "y3"] if y3 else ["y0"], opset=24 if nonpad else 23)
