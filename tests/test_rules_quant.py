"""VJP rules of quantization (rules/quant.py): DequantizeLinear's exact scale gradient, and the straight-through
estimator through QuantizeLinear -> DequantizeLinear pairs (``straight_through=True``) against PyTorch's
``fake_quantize`` backward (per tensor and per channel, learnable scale: LSQ), and against the estimator written
in PyTorch (``x + (round(x) - x).detach()``) for blocked quantization, separate scales, int4 and float8 types;
the refusal without the option.

QuantizeLinear takes float32/float16/bfloat16 only (no float64): these tests compare float32 values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from kit.harness import ort_runner, with_loss

import revgraph as rg
from revgraph.errors import GraphError
from revgraph.ir import Graph, Node, ValueInfo


def qdq_graph(x: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, attrs: dict | None = None,
              dq_scale: np.ndarray | None = None, learn_scale: bool = True) -> Graph:
    """x -> QuantizeLinear(x, s, zp) -> DequantizeLinear(q, s or s_d, zp) -> y0; ``s`` (and ``s_d``) graph inputs
    when ``learn_scale``."""
    attrs = attrs or {}
    zps = ["zp"] if zp is not None else []
    s_d = "s_d" if dq_scale is not None else "s"
    inputs = [ValueInfo("x", x.dtype, x.shape)]
    inits = {} if zp is None else {"zp": zp}
    for name, v in [("s", scale), ("s_d", dq_scale)]:
        if v is None:
            continue
        if learn_scale:
            inputs.append(ValueInfo(name, v.dtype, v.shape))
        else:
            inits[name] = v
    return Graph(nodes=[Node("QuantizeLinear", ["x", "s", *zps], ["q"], dict(attrs), "quant"),
                        Node("DequantizeLinear", ["q", s_d, *zps], ["y0"], dict(attrs), "dequant")],
                 inputs=inputs, outputs=[ValueInfo("y0")], initializers=inits)


def grads_of(g: Graph, feeds: dict, wrt: list[str], seed: int = 0, **kwargs) -> tuple[dict, np.ndarray]:
    """The gradients of ``sum(y0 * u)`` (onnxruntime) and ``u``."""
    fwd = ort_runner(g)(feeds)
    lg, _ = with_loss(g, fwd)
    u = np.random.default_rng(seed).standard_normal(fwd["y0"].shape).astype(fwd["y0"].dtype)
    gg = rg.gradient(lg, loss="loss", wrt=wrt, **kwargs)
    out = ort_runner(gg)({**feeds, "y0_u": u})
    return {w: out[f"{w}_grad"] for w in wrt}, u


def ste(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, lo: float, hi: float,
        dq_scale: torch.Tensor | None = None, integer: bool = True) -> torch.Tensor:
    """DequantizeLinear(QuantizeLinear(x)) with the straight-through estimator, written in PyTorch (the scale and
    zero point already broadcast against x)."""
    v = x / scale
    level = v + (torch.round(v) - v).detach() if integer else v
    q = torch.clamp(level + zp, lo, hi)
    return (q - zp) * (scale if dq_scale is None else dq_scale)


# -------------------------------------------------------------------------------------------- per tensor


@pytest.mark.parametrize("zp_value, dtype", [(4, np.int8), (-128, np.int8), (128, np.uint8), (None, np.uint8)])
def test_per_tensor_like_pytorch(zp_value, dtype):
    """x (saturating at both ends) against PyTorch's ``fake_quantize_per_tensor_affine``; the shared scale against
    the estimator in PyTorch and against PyTorch's learnable fake quantization (LSQ). That kernel rounds
    ``x / s + z`` where ONNX rounds ``x / s`` (ties differ for an odd zero point) and gives saturated values at
    ``z = q_min`` another scale gradient than LSQ's ``q_min - z``: compared for the other zero points."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3, 5)) * 40).astype(np.float32)
    x[0, 0, :3] = [0.625, 0.875, 1e3]  # ties (round half to even: 2 and 4) and a saturated value
    scale = np.array(0.25, dtype=np.float32)  # exact: x / s (ONNX) and x * (1 / s) (PyTorch) round alike
    zp = None if zp_value is None else np.array(zp_value, dtype=dtype)
    lo, hi = int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)
    grads, u = grads_of(qdq_graph(x, scale, zp), {"x": x, "s": scale}, ["x", "s"], straight_through=True)
    z = float(zp_value or 0)
    plain = torch.tensor(x, requires_grad=True)
    (torch.fake_quantize_per_tensor_affine(plain, float(scale), int(z), lo, hi) * torch.tensor(u)).sum().backward()
    np.testing.assert_array_equal(grads["x"], plain.grad.numpy())
    tx, ts = torch.tensor(x, requires_grad=True), torch.tensor(scale, requires_grad=True)
    (ste(tx, ts, torch.tensor(z), lo, hi) * torch.tensor(u)).sum().backward()
    np.testing.assert_array_equal(grads["x"], tx.grad.numpy())
    np.testing.assert_allclose(grads["s"], ts.grad.numpy(), rtol=1e-4)  # float32 sums in another order
    if zp_value != lo:
        ts = torch.tensor(scale.reshape(1), requires_grad=True)
        y = torch._fake_quantize_learnable_per_tensor_affine(torch.tensor(x), ts, torch.tensor([z]), lo, hi, 1.0)
        (y * torch.tensor(u)).sum().backward()
        np.testing.assert_allclose(grads["s"], ts.grad.numpy()[0], rtol=1e-4)


def test_per_channel_like_pytorch():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 4, 3)) * 3).astype(np.float32)
    scale = np.array([0.02, 0.05, 0.1, 0.5], dtype=np.float32)
    zp = np.array([0, 5, -3, 100], dtype=np.int8)
    grads, u = grads_of(qdq_graph(x, scale, zp, {"axis": 1}), {"x": x, "s": scale}, ["x", "s"], straight_through=True)
    tx, ts = torch.tensor(x, requires_grad=True), torch.tensor(scale, requires_grad=True)
    y = torch._fake_quantize_learnable_per_channel_affine(tx, ts, torch.tensor(zp, dtype=torch.float32), 1, -128, 127,
                                                          1.0)
    (y * torch.tensor(u)).sum().backward()
    np.testing.assert_array_equal(grads["x"], tx.grad.numpy())
    np.testing.assert_allclose(grads["s"], ts.grad.numpy(), rtol=1e-4)


def test_negative_axis_and_frozen_scale():
    """``axis=-1``; a constant scale (an initializer) gets nothing, x its masked cotangent."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 4)) * 2).astype(np.float32)
    scale = np.array([0.01, 0.02, 0.03, 0.04], dtype=np.float32)
    zp = np.zeros(4, dtype=np.uint8)
    grads, u = grads_of(qdq_graph(x, scale, zp, {"axis": -1}, learn_scale=False), {"x": x}, ["x"],
                        straight_through=True)
    inside = (np.round(x / scale) >= 0) & (np.round(x / scale) <= 255)
    np.testing.assert_array_equal(grads["x"], np.where(inside, u, 0))


# -------------------------------------------------------------------------------------------- other forms


def test_blocked():
    """Blocked quantization (opset 21): a scale per block of 3 along axis 1 (the last block short)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 7)) * 2).astype(np.float32)
    scale = rng.uniform(0.01, 0.1, (2, 3)).astype(np.float32)
    zp = rng.integers(-5, 5, (2, 3)).astype(np.int8)
    grads, u = grads_of(qdq_graph(x, scale, zp, {"axis": 1, "block_size": 3}), {"x": x, "s": scale}, ["x", "s"],
                        straight_through=True)
    tx, ts = torch.tensor(x, requires_grad=True), torch.tensor(scale, requires_grad=True)
    spread = ts.repeat_interleave(3, dim=1)[:, :7]
    y = ste(tx, spread, torch.tensor(zp, dtype=torch.float32).repeat_interleave(3, dim=1)[:, :7], -128, 127)
    (y * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(grads["s"], ts.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_separate_scales():
    """QuantizeLinear and DequantizeLinear with scales of their own (uint8, no zero points; the dequantization
    per row): dx = dy s_d / s_q inside the range."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 4)) * 3 + 2).astype(np.float32)
    s_q, s_d = np.array(0.02, dtype=np.float32), np.array([0.5, 1.0, 2.0], dtype=np.float32)
    g = qdq_graph(x, s_q, None, dq_scale=s_d)
    g.nodes[1].attrs["axis"] = 0
    grads, u = grads_of(g, {"x": x, "s": s_q, "s_d": s_d}, ["x", "s", "s_d"], straight_through=True)
    tx, tq, td = (torch.tensor(v, requires_grad=True) for v in (x, s_q, s_d))
    y = ste(tx, tq, torch.tensor(0.0), 0, 255, dq_scale=td[:, None])
    (y * torch.tensor(u)).sum().backward()
    for name, t in [("x", tx), ("s", tq), ("s_d", td)]:
        np.testing.assert_allclose(grads[name], t.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("kind", ["int4", "uint4", "float8_e4m3fn"])
def test_narrow_types(kind):
    """int4/uint4 saturate at [-8, 7] / [0, 15]; float8 e4m3fn does not round to integers and saturates at 448."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 6)) * 5).astype(np.float32)
    scale = np.array(0.5 if kind != "float8_e4m3fn" else 0.01, dtype=np.float32)
    dt = np.dtype(getattr(ml_dtypes, kind))
    zp = np.zeros((), dtype=dt)
    grads, u = grads_of(qdq_graph(x, scale, zp), {"x": x, "s": scale}, ["x"], straight_through=True)
    info = ml_dtypes.finfo(dt) if kind.startswith("float") else ml_dtypes.iinfo(dt)
    level = x / scale if kind.startswith("float") else np.round(x / scale)
    inside = (level >= float(info.min)) & (level <= float(info.max))
    assert 0 < inside.sum() < inside.size
    np.testing.assert_array_equal(grads["x"], np.where(inside, u, 0))


# -------------------------------------------------------------------------------------------- DequantizeLinear


def test_dequantize_scale_exact():
    """Quantized weights (an int8 initializer) with a learnable per-channel scale: the exact gradient
    ``sum(dy (q - z))``, no option needed."""
    rng = np.random.default_rng(6)
    q = rng.integers(-128, 128, (3, 5)).astype(np.int8)
    scale, zp = rng.uniform(0.1, 1.0, 3).astype(np.float32), np.array([1, -2, 0], dtype=np.int8)
    g = Graph(nodes=[Node("DequantizeLinear", ["q", "s", "zp"], ["y0"], {"axis": 0}, "dequant")],
              inputs=[ValueInfo("s", scale.dtype, scale.shape)], outputs=[ValueInfo("y0")],
              initializers={"q": q, "zp": zp})
    grads, u = grads_of(g, {"s": scale}, ["s"])
    expected = (u * (q.astype(np.float32) - zp[:, None])).sum(axis=1)
    np.testing.assert_allclose(grads["s"], expected, rtol=1e-5)


def test_refused_without_the_option():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    g = qdq_graph(x, np.array(0.1, dtype=np.float32), np.array(0, dtype=np.int8), learn_scale=False)
    lg, _ = with_loss(g, ort_runner(g)({"x": x}))
    with pytest.raises(GraphError, match=r"'dequant'.*'quant'.*straight_through=True.*--straight-through"):
        rg.gradient(lg, loss="loss", wrt=["x"])


@pytest.mark.parametrize("transform", ["jvp", "hessian", "jacobian_forward"])
def test_forward_mode_refuses_a_pair_too(transform):
    """Forward mode reached the DequantizeLinear only through the QuantizeLinear, which it skipped as not
    differentiable: a zero tangent with a "no path" warning, where reverse mode refuses. The pair reads the
    QuantizeLinear's inputs in forward mode too, so its rule refuses alike."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    g = qdq_graph(x, np.array(0.1, dtype=np.float32), np.array(0, dtype=np.int8), learn_scale=False)
    lg, _ = with_loss(g, ort_runner(g)({"x": x}))
    call = {"jvp": lambda: rg.jvp(lg, inputs=["x"]), "hessian": lambda: rg.hessian(lg, "loss", ["x"]),
            "jacobian_forward": lambda: rg.jacobian(lg, ["loss"], ["x"], mode="forward")}[transform]
    with pytest.raises(GraphError, match=r"'dequant'.*'quant'.*straight-through.*forward mode"):
        call()


def test_option_default_off():
    from revgraph.autodiff.context import Options

    assert Options().straight_through is False


def test_the_cli_refuses_a_qdq_pair_without_the_option_and_differentiates_it_with_it(tmp_path, capsys):
    """``revgraph grad``: without --straight-through, exit 2 and one line naming the option; with it, x's gradient
    is 1 inside the representable range and 0 where the value saturates (hand-derived: scale 0.1, uint8, zero
    point 0 -> range [0, 25.5])."""
    from revgraph.cli import main

    x = np.array([-1.0, 0.05, 3.0, 30.0], np.float32)
    g = qdq_graph(x, np.array(0.1, np.float32), np.array(0, np.uint8), learn_scale=False)
    lg, _ = with_loss(g, {"y0": x})
    rg.save(lg, tmp_path / "qdq.onnx")
    assert main(["grad", str(tmp_path / "qdq.onnx"), "--loss", "loss", "--wrt", "x",
                 "-o", str(tmp_path / "g.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--straight-through" in err[0] and not (tmp_path / "g.onnx").exists()
    assert main(["grad", str(tmp_path / "qdq.onnx"), "--loss", "loss", "--wrt", "x", "--straight-through",
                 "-o", str(tmp_path / "g.onnx")]) == 0
    out = rg.Session(rg.load(tmp_path / "g.onnx")).run({"x": x, "y0_u": np.ones(4, np.float32)})
    np.testing.assert_array_equal(out["x_grad"], [0.0, 1.0, 1.0, 0.0])
