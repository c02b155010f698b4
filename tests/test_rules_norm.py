"""VJP rules of normalizations and Dropout (rules/norm.py), three ways (central differences, PyTorch, second
order) on random ranks, shapes and attributes; the optional statistics outputs; Dropout's reused mask;
RMSNormalization at opset 23, LpNormalization's zero vectors, MeanVarianceNormalization's constant groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.harness import check_rule, double_backward, one_node_graph, with_loss
from kit.rules import torch_check

import revgraph as rg
from revgraph.autodiff.simplify import simplify
from revgraph.errors import GraphError
from revgraph.ir import Graph, Node, ValueInfo

F = torch.nn.functional
SETTINGS = settings(max_examples=6, deadline=None)
SEEDS = st.integers(0, 2**16)
EPS = st.sampled_from([1e-5, 0.25])  # 0.25 makes epsilon matter; both as float32, as ONNX stores them


def f32(v: float) -> float:
    return float(np.float32(v))


def _shape(draw, min_rank: int, max_rank: int = 4):
    return tuple(draw(st.lists(st.integers(1, 3), min_size=min_rank, max_size=max_rank)))


def _chan(v: torch.Tensor, rank: int) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (rank - 2))


def _declare(g: Graph, name: str, like: np.ndarray) -> None:
    """Declare the type of output ``name``, as an exporter would: ONNX shape inference leaves the output of
    GroupNormalization untyped, and onnxruntime refuses an untyped function output."""
    g.outputs = [ValueInfo(o.name, like.dtype, like.shape) if o.name == name else o for o in g.outputs]
    g.value_info[name] = ValueInfo(name, like.dtype, like.shape)


# -------------------------------------------------------------------------------------- BatchNormalization


@SETTINGS
@given(data=st.data(), eps=EPS, seed=SEEDS)
def test_batch_norm_inference(data, eps, seed):
    shape = _shape(data.draw, 2)
    rng = np.random.default_rng(seed)
    c = shape[1]
    feeds = {"x": rng.standard_normal(shape), "scale": rng.standard_normal(c), "bias": rng.standard_normal(c),
             "mean": rng.standard_normal(c), "var": rng.uniform(0.5, 2.0, c)}
    g = one_node_graph("BatchNormalization", feeds, {"epsilon": eps})
    r = len(shape)

    def fn(x, scale, bias, mean, var):  # the spec's formula; F.batch_norm has no gradient for mean and var
        return (x - _chan(mean, r)) / torch.sqrt(_chan(var, r) + f32(eps)) * _chan(scale, r) + _chan(bias, r)

    check_rule(g, feeds, fn)


def test_batch_norm_inference_like_pytorch():
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 2, 4)), "scale": rng.standard_normal(2), "bias": rng.standard_normal(2),
             "mean": rng.standard_normal(2), "var": rng.uniform(0.5, 2.0, 2)}
    g = one_node_graph("BatchNormalization", feeds, float_inputs=["x", "scale", "bias"])
    fd = {k: feeds[k] for k in ("x", "scale", "bias")}
    check_rule(g, fd, lambda x, scale, bias: F.batch_norm(x, torch.tensor(feeds["mean"]), torch.tensor(feeds["var"]),
                                                          scale, bias, training=False, eps=f32(1e-5)))


@SETTINGS
@given(data=st.data(), eps=EPS, seed=SEEDS)
def test_batch_norm_training_y(data, eps, seed):
    shape = _shape(data.draw, 2)
    shape = (shape[0] + 1, *shape[1:])  # at least two values per channel: a variance of one value is 0
    rng = np.random.default_rng(seed)
    c = shape[1]
    feeds = {"x": rng.standard_normal(shape), "scale": rng.standard_normal(c), "bias": rng.standard_normal(c)}
    stats = {"mean": rng.standard_normal(c), "var": rng.uniform(0.5, 2.0, c)}
    # ONNX requires all three outputs in training mode; the loss reads Y only
    g = one_node_graph("BatchNormalization", {**feeds, **stats}, {"epsilon": eps, "training_mode": 1},
                       n_out=3, float_inputs=list(feeds))
    check_rule(g, feeds, lambda x, scale, bias: F.batch_norm(x, None, None, scale, bias, training=True, eps=f32(eps)),
               outputs=["y0"])


def _bn_y_only(feeds: dict, rng) -> Graph:
    c = feeds["x"].shape[1]
    dt = feeds["x"].dtype
    stats = {"mean": rng.standard_normal(c).astype(dt), "var": rng.uniform(0.5, 2.0, c).astype(dt)}
    return one_node_graph("BatchNormalization", {**feeds, **stats}, {"training_mode": 1}, n_out=3,
                          float_inputs=list(feeds))


def test_batch_norm_training_y_symbolic_batch():
    """Y only with a symbolic batch: the form of single passes (rules/norm.py ``_batch_norm_training_y``), not
    the one through onnxruntime's fused batch-norm kernels, which needs static shapes."""
    rng = np.random.default_rng(13)
    feeds = {"x": rng.standard_normal((3, 4, 5)), "scale": rng.standard_normal(4), "bias": rng.standard_normal(4)}
    g = _symbolic(_bn_y_only(feeds, rng), {"x": ("N", 4, "L")})
    check_rule(g, feeds, lambda x, scale, bias: F.batch_norm(x, None, None, scale, bias, training=True, eps=f32(1e-5)),
               outputs=["y0"])
    gg = rg.gradient(with_loss(g, rg.Session(g, backend="reference").run(feeds), ["y0"])[0], loss="loss", wrt=["x"])
    assert not any(n.op_type == "BatchNormalization" for n in gg.nodes if n.name.startswith("grad/"))


def test_batch_norm_training_y_runs_are_independent():
    """The fused form's helper BatchNormalization writes its running statistics into its statistics inputs in
    place under onnxruntime: a run whose input holds inf (NaN statistics) must not change the next run's
    gradients, which are those of a fresh session."""
    rng = np.random.default_rng(14)
    feeds = {"x": rng.standard_normal((4, 3, 2)).astype(np.float32),
             "scale": rng.standard_normal(3).astype(np.float32), "bias": rng.standard_normal(3).astype(np.float32)}
    g = _bn_y_only(feeds, rng)
    lg, _ = with_loss(g, rg.Session(g, backend="reference").run(feeds), ["y0"])
    gg = rg.gradient(lg, loss="loss", wrt=["x", "scale", "bias"])
    assert any(n.op_type == "BatchNormalization" for n in gg.nodes if n.name.startswith("grad/"))
    u = {"y0_u": rng.standard_normal((4, 3, 2)).astype(np.float32)}
    fresh = rg.Session(gg).run({**feeds, **u})
    sess = rg.Session(gg)
    bad = feeds["x"].copy()
    bad[0, :, 0] = np.inf
    sess.run({**feeds, "x": bad, **u})
    again = sess.run({**feeds, **u})
    for k, v in fresh.items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)
    ref = rg.Session(gg, backend="reference").run({**feeds, **u})
    for k in ("x_grad", "scale_grad", "bias_grad"):
        np.testing.assert_allclose(fresh[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


@SETTINGS
@given(data=st.data(), momentum=st.sampled_from([0.9, 0.5, 0.0]), seed=SEEDS)
def test_batch_norm_training_running_stats(data, momentum, seed):
    shape = _shape(data.draw, 2)
    shape = (shape[0] + 1, *shape[1:])
    rng = np.random.default_rng(seed)
    c = shape[1]
    feeds = {"x": rng.standard_normal(shape), "scale": rng.standard_normal(c), "bias": rng.standard_normal(c),
             "mean": rng.standard_normal(c), "var": rng.uniform(0.5, 2.0, c)}
    g = one_node_graph("BatchNormalization", feeds, {"training_mode": 1, "momentum": momentum}, n_out=3)
    r, m = len(shape), f32(momentum)
    axes = [0, *range(2, r)]

    def fn(x, scale, bias, mean, var):  # the spec's formulas, population variance
        mu, sigma2 = x.mean(axes), x.var(axes, unbiased=False)
        y = (x - _chan(mu, r)) / torch.sqrt(_chan(sigma2, r) + f32(1e-5)) * _chan(scale, r) + _chan(bias, r)
        return y, mean * m + mu * (1 - m), var * m + sigma2 * (1 - m)

    check_rule(g, feeds, fn)
    # the running statistics alone reach X, mean and var (the harness pairs torch's outputs with ``outputs``)
    check_rule(g, feeds, lambda **t: fn(**t)[1:], outputs=["y1", "y2"], wrt=["x", "mean", "var"])


def test_session_leaves_fed_running_statistics_alone():
    # onnxruntime computes a training BatchNormalization's running statistics in place, into the buffer of
    # input_mean/input_var when it may: Session.run must not hand it the caller's arrays.
    rng = np.random.default_rng(9)
    feeds = {"x": rng.standard_normal((3, 2)), "scale": rng.standard_normal(2), "bias": rng.standard_normal(2),
             "mean": rng.standard_normal(2), "var": rng.uniform(0.5, 2.0, 2)}
    g = one_node_graph("BatchNormalization", feeds, {"training_mode": 1}, n_out=3)
    lg, _ = with_loss(g, rg.Session(g).run(feeds))
    gg = rg.gradient(lg, loss="loss", wrt=list(feeds))
    kept = {k: v.copy() for k, v in feeds.items()}
    us = {f"y{i}_u": np.ones(s) for i, s in enumerate([(3, 2), (2,), (2,)])}
    rg.Session(gg).run({**feeds, **us})
    for k, v in kept.items():
        np.testing.assert_array_equal(feeds[k], v, err_msg=k)


def test_batch_norm_needs_rank():
    g = Graph([Node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn")],
              [ValueInfo("x", np.float64, None)], [ValueInfo("y")],
              {k: np.ones(3) for k in ("s", "b", "m", "v")})
    with pytest.raises(GraphError, match=r"'bn'.*rank"):
        rg.gradient(g, wrt=["x"])


# -------------------------------------------------------------------------------------- LayerNormalization


@st.composite
def layer_norm_case(draw):
    """X's shape, the axis (negative or not), and Scale/B shapes unidirectionally broadcastable to X."""
    shape = _shape(draw, 1)
    r = len(shape)
    axis = draw(st.integers(-r, r - 1))

    def param():
        k = draw(st.integers(0, r))
        return tuple(d if draw(st.booleans()) else 1 for d in shape[r - k:])

    return shape, axis, param(), (param() if draw(st.booleans()) else None)


@SETTINGS
@given(case=layer_norm_case(), eps=EPS, seed=SEEDS)
def test_layer_norm(case, eps, seed):
    shape, axis, sshape, bshape = case
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal(shape), "scale": rng.standard_normal(sshape)}
    if bshape is not None:
        feeds["bias"] = rng.standard_normal(bshape)
    attrs = {"epsilon": eps} if axis == -1 else {"epsilon": eps, "axis": axis}
    g = one_node_graph("LayerNormalization", feeds, attrs)
    a = axis % len(shape)

    def fn(x, scale, bias=None):
        y = F.layer_norm(x, x.shape[a:], eps=f32(eps)) * scale
        return y if bias is None else y + bias

    check_rule(g, feeds, fn)


@pytest.mark.parametrize("axis,outputs",
                         [(-1, ["y0", "mean", "inv"]), (1, ["mean", "inv"]), (-2, ["inv"]), (0, ["mean"])])
def test_layer_norm_mean_and_inv_std_dev_outputs(axis, outputs):
    # With the default stash_type, Mean and InvStdDev are float32 for a float64 X (onnxruntime computes them so):
    # no central differences through them. The loss reads them cast to float64, and the gradient (computed in
    # float64 by the rule) is compared with PyTorch doing the same casts.
    rng = np.random.default_rng(axis + 7)
    feeds = {"x": rng.standard_normal((2, 3, 4)), "scale": rng.standard_normal(4), "bias": rng.standard_normal(4)}
    nodes = [Node("LayerNormalization", ["x", "scale", "bias"], ["y0", "m32", "i32"], {"axis": axis}, "op"),
             Node("Cast", ["m32"], ["mean"], {"to": 11}, "mean"), Node("Cast", ["i32"], ["inv"], {"to": 11}, "inv")]
    g = Graph(nodes, [ValueInfo(k, v.dtype, v.shape) for k, v in feeds.items()],
              [ValueInfo(o) for o in ("y0", "mean", "inv")])

    def fn(x, scale, bias):
        dims = list(range(axis % x.dim(), x.dim()))
        mu = x.mean(dims, keepdim=True)
        inv = 1 / torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + f32(1e-5))
        every = {"y0": (x - mu) * inv * scale + bias, "mean": mu.float().double(), "inv": inv.float().double()}
        return [every[o] for o in outputs]

    wrt = ["x", "scale", "bias"] if "y0" in outputs else ["x"]  # the statistics do not depend on scale, bias
    torch_check(g, feeds, fn, wrt=wrt, outputs=outputs, rtol=1e-6, atol=1e-8)


def test_layer_norm_float16_computes_in_float32():
    rng = np.random.default_rng(5)
    x, scale = rng.standard_normal((3, 8)).astype(np.float16), rng.standard_normal(8).astype(np.float16)
    u = rng.standard_normal((3, 8)).astype(np.float16)
    g = one_node_graph("LayerNormalization", {"x": x, "scale": scale})
    lg, _ = with_loss(g, {"y0": x})
    gg = rg.gradient(lg, loss="loss", wrt=["x", "scale"])
    assert any(n.op_type == "Cast" and n.attrs.get("to") == 1 for n in gg.nodes)  # stage one in float32
    got = rg.Session(gg).run({"x": x, "scale": scale, "y0_u": u})
    tx, ts = torch.tensor(x, dtype=torch.float64, requires_grad=True), torch.tensor(scale, dtype=torch.float64,
                                                                                      requires_grad=True)
    (F.layer_norm(tx, (8,), eps=f32(1e-5)) * ts * torch.tensor(u, dtype=torch.float64)).sum().backward()
    assert got["x_grad"].dtype == np.float16
    np.testing.assert_allclose(got["x_grad"], tx.grad.numpy(), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got["scale_grad"], ts.grad.numpy(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_float32_recomputes_statistics_with_one_node(axis):
    # float32: zh and InvStdDev from one LayerNormalization(x, ones); first and second order against float64 torch
    rng = np.random.default_rng(8)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in
             (("x", (4, 6, 8)), ("scale", (4, 6, 8)[axis:]), ("bias", (4, 6, 8)[axis:]), ("y0_u", (4, 6, 8)))}
    lg, _ = with_loss(one_node_graph("LayerNormalization", {k: feeds[k] for k in ("x", "scale", "bias")},
                                     {"axis": axis}), {"y0": feeds["x"]})
    gg = rg.gradient(lg, loss="loss", wrt=["x", "scale", "bias"])
    assert any(n.op_type == "LayerNormalization" and len(n.outputs) == 3 for n in gg.nodes)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k != "y0_u") for k, v in feeds.items()}
    y = F.layer_norm(t["x"], t["scale"].shape, t["scale"], t["bias"], eps=f32(1e-5))
    want = torch.autograd.grad((y * t["y0_u"]).sum(), [t["x"], t["scale"], t["bias"]], create_graph=True)
    for backend in ["onnxruntime", "reference"]:
        got = rg.Session(gg, backend=backend).run(feeds)
        for k, w in zip(("x", "scale", "bias"), want, strict=True):
            np.testing.assert_allclose(got[f"{k}_grad"], w.detach().numpy(), rtol=2e-4, atol=2e-5, err_msg=k)
    v, hv = rng.standard_normal((4, 6, 8)).astype(np.float32), double_backward(gg, ["x"], feeds)
    (hvp,) = torch.autograd.grad((want[0] * torch.tensor(v, dtype=torch.float64)).sum(), [t["x"]])
    got = rg.Session(hv, backend="onnxruntime").run({**feeds, "x_v": v})
    np.testing.assert_allclose(got[hv.output_names[-1]], hvp.numpy(), rtol=1e-3, atol=1e-4)


# -------------------------------------------------------------------------------------- RMSNormalization


def _opset(g: Graph, version: int) -> Graph:
    g.opsets = {"": version}
    return g


@SETTINGS
@given(case=layer_norm_case(), eps=EPS, seed=SEEDS)
def test_rms_norm(case, eps, seed):
    shape, axis, sshape, _ = case
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal(shape), "scale": rng.standard_normal(sshape)}
    attrs = {"epsilon": eps} if axis == -1 else {"epsilon": eps, "axis": axis}
    g = _opset(one_node_graph("RMSNormalization", feeds, attrs), 23)
    dims = list(range(axis % len(shape), len(shape)))

    def fn(x, scale):  # the spec's formula (F.rms_norm takes a scale of the normalized shape only)
        return x * torch.rsqrt((x * x).mean(dims, keepdim=True) + f32(eps)) * scale

    check_rule(g, feeds, fn)


def test_rms_norm_like_pytorch():
    rng = np.random.default_rng(21)
    feeds = {"x": rng.standard_normal((2, 3, 4)), "scale": rng.standard_normal((3, 4))}
    g = _opset(one_node_graph("RMSNormalization", feeds, {"axis": -2}), 23)
    check_rule(g, feeds, lambda x, scale: F.rms_norm(x, (3, 4), scale, eps=f32(1e-5)))


def test_rms_norm_float16_computes_in_float32():
    rng = np.random.default_rng(22)
    x, scale = rng.standard_normal((3, 8)).astype(np.float16), rng.standard_normal(8).astype(np.float16)
    u = rng.standard_normal((3, 8)).astype(np.float16)
    g = _opset(one_node_graph("RMSNormalization", {"x": x, "scale": scale}), 23)
    lg, _ = with_loss(g, {"y0": x})
    gg = rg.gradient(lg, loss="loss", wrt=["x", "scale"])
    assert any(n.op_type == "Cast" and n.attrs.get("to") == 1 for n in gg.nodes)
    got = rg.Session(gg).run({"x": x, "scale": scale, "y0_u": u})
    tx, ts = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, scale))
    (F.rms_norm(tx, (8,), ts, eps=f32(1e-5)) * torch.tensor(u, dtype=torch.float64)).sum().backward()
    assert got["x_grad"].dtype == np.float16 and got["scale_grad"].dtype == np.float16
    np.testing.assert_allclose(got["x_grad"], tx.grad.numpy(), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got["scale_grad"], ts.grad.numpy(), rtol=2e-2, atol=2e-2)


def test_rms_norm_symbolic_dims():
    rng = np.random.default_rng(23)
    feeds = {"x": rng.standard_normal((3, 2, 5)), "scale": rng.standard_normal((2, 1))}
    g = _symbolic(_opset(one_node_graph("RMSNormalization", feeds, {"axis": 1}), 23), {"x": ("N", 2, "L")})
    check_rule(g, feeds, lambda x, scale: x * torch.rsqrt((x * x).mean([1, 2], keepdim=True) + f32(1e-5)) * scale)


# -------------------------------------------------------------------------------------- LpNormalization


@pytest.mark.parametrize("p", [1, 2])
@SETTINGS
@given(data=st.data(), seed=SEEDS)
def test_lp_norm(p, data, seed):
    shape = _shape(data.draw, 1)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = np.random.default_rng(seed).standard_normal(shape)
    x = np.where(np.abs(x) < 1e-3, 0.5, x)  # |x| has a kink at 0 (p = 1)
    attrs = {"p": p, "axis": axis} if (p, axis) != (2, -1) else {}
    g = _opset(one_node_graph("LpNormalization", {"x": x}, attrs), 22)
    check_rule(g, {"x": x}, lambda x: F.normalize(x, p=p, dim=axis, eps=0.0))


def test_lp_norm_opset_21():
    x = np.random.default_rng(24).standard_normal((3, 4))
    g = one_node_graph("LpNormalization", {"x": x}, {"axis": 0})
    check_rule(g, {"x": x}, lambda x: F.normalize(x, dim=0, eps=0.0))


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the reference forward's 0 / 0
@pytest.mark.parametrize("p", [1, 2])
def test_lp_norm_zero_vector_gets_zero_gradient(p):
    # ONNX defines the output at a zero vector as 0 and has no epsilon; revgraph defines the gradient there
    # as 0 (PyTorch's F.normalize gives dy / eps). The other rows are PyTorch's; a zero element of a nonzero row
    # takes the 0 subgradient of |x| for p = 1 (as torch.abs).
    x = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, -2.0], [0.5, 3.0, -1.0]])
    u = np.random.default_rng(25).standard_normal(x.shape)
    g = _opset(one_node_graph("LpNormalization", {"x": x}, {"p": p}), 22)
    lg, _ = with_loss(g, {"y0": x})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    out = [rg.Session(gg, backend=b).run({"x": x, "y0_u": u}) for b in ("onnxruntime", "reference")]
    np.testing.assert_allclose(out[0]["x_grad"], out[1]["x_grad"], rtol=1e-12)
    got = out[0]["x_grad"]
    np.testing.assert_array_equal(got[0], 0.0)
    tx = torch.tensor(x[1:], requires_grad=True)
    (F.normalize(tx, p=p, dim=-1) * torch.tensor(u[1:])).sum().backward()
    np.testing.assert_allclose(got[1:], tx.grad.numpy(), rtol=1e-12)


def test_lp_norm_bad_p():
    g = _opset(one_node_graph("LpNormalization", {"x": np.ones((2, 2))}, {"p": 3}), 22)
    with pytest.raises(GraphError, match="p must be 1 or 2"):
        rg.gradient(g, loss="y0", wrt=["x"])


# -------------------------------------------------------------------------------------- MeanVarianceNormalization
# Neither runtime has a float64 MeanVarianceNormalization (onnxruntime: float32 only; the reference evaluator runs
# the function body, whose float32 epsilon it refuses to add to a float64 value), so float64 is checked on the
# gradient graph alone (the forward node pruned): against PyTorch autograd, and second order against central
# differences of the gradient graph and PyTorch's double backward. float32 runs end to end in onnxruntime.


def _mvn_torch(axes):
    def fn(x):
        c = x - x.mean(axes, keepdim=True)
        return c / (c.pow(2).mean(axes, keepdim=True).sqrt() + f32(1e-9))

    return fn


def _backward_only(g: Graph, x: np.ndarray, u: np.ndarray) -> Graph:
    _declare(g, "y0", x)
    lg, _ = with_loss(g, {"y0": x})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    gg.outputs = [o for o in gg.outputs if o.name == "x_grad"]
    gg = simplify(gg)
    assert not any(n.op_type == "MeanVarianceNormalization" for n in gg.nodes)
    return gg


def _mvn_check(g: Graph, x: np.ndarray, axes: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    u, v = rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    gg = _backward_only(g, x, u)
    got = [rg.Session(gg, backend=b).run({"x": x, "y0_u": u})["x_grad"] for b in ("onnxruntime", "reference")]
    np.testing.assert_allclose(got[0], got[1], rtol=1e-10, atol=1e-12)
    tx = torch.tensor(x, requires_grad=True)
    (tg,) = torch.autograd.grad((_mvn_torch(axes)(tx) * torch.tensor(u)).sum(), [tx], create_graph=True)
    np.testing.assert_allclose(got[0], tg.detach().numpy(), rtol=1e-9, atol=1e-10)
    (th,) = torch.autograd.grad((tg * torch.tensor(v)).sum(), [tx])
    hv = gg.copy()
    hv.inputs.append(ValueInfo("v", x.dtype, x.shape))
    hv.nodes += [Node("Mul", ["x_grad", "v"], ["gv"], name="hv/mul"),
                 Node("ReduceSum", ["gv"], ["s"], {"keepdims": 0}, "hv/sum")]
    hv.outputs = [ValueInfo("s")]
    hvp = rg.gradient(hv, loss="s", wrt=["x"])
    run = rg.Session(gg).run
    numeric = (run({"x": x + 1e-6 * v, "y0_u": u})["x_grad"] - run({"x": x - 1e-6 * v, "y0_u": u})["x_grad"]) / 2e-6
    got_h = rg.Session(hvp).run({"x": x, "y0_u": u, "v": v})[hvp.output_names[-1]]
    np.testing.assert_allclose(got_h, th.numpy(), rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(got_h, numeric, rtol=1e-4, atol=1e-5)
    return got[0], u


@pytest.mark.parametrize("shape,axes", [((2, 3, 4, 2), None), ((2, 3, 4), [1]), ((3, 4), [-1, 0]),
                                        ((2, 2, 3, 2), [0, 1, 2, 3]), ((4, 3), [0])])
def test_mean_variance_norm(shape, axes):
    x = np.random.default_rng(len(shape)).standard_normal(shape)
    g = one_node_graph("MeanVarianceNormalization", {"x": x}, {} if axes is None else {"axes": axes})
    _mvn_check(g, x, [a % len(shape) for a in (axes or [0, 2, 3])])


def test_mean_variance_norm_float32():
    x = np.random.default_rng(26).standard_normal((2, 3, 4, 2)).astype(np.float32)
    g = one_node_graph("MeanVarianceNormalization", {"x": x})
    _declare(g, "y0", x)
    torch_check(g, {"x": x}, _mvn_torch([0, 2, 3]), wrt=["x"], backends=("onnxruntime",), rtol=2e-4, atol=2e-5)


def test_mean_variance_norm_constant_group():
    # Channel 1 is constant: c = 0 and s = 0 there, y = c / (s + eps) is differentiable with dx = (dy - mean dy) /
    # eps (the sqrt's infinite slope meets c = 0); PyTorch's autograd gives NaN there.
    x = np.random.default_rng(27).standard_normal((2, 3, 2, 2))
    x[:, 1] = 3.0
    g = one_node_graph("MeanVarianceNormalization", {"x": x})
    u = np.random.default_rng(28).standard_normal(x.shape)
    gg = _backward_only(g, x, u)
    got = rg.Session(gg).run({"x": x, "y0_u": u})["x_grad"]
    assert np.isfinite(got).all()
    uc = u[:, 1]
    np.testing.assert_allclose(got[:, 1], (uc - uc.mean()) / f32(1e-9), rtol=1e-12)
    tx = torch.tensor(x[:, [0, 2]], requires_grad=True)
    (_mvn_torch([0, 2, 3])(tx) * torch.tensor(u[:, [0, 2]])).sum().backward()
    np.testing.assert_allclose(got[:, [0, 2]], tx.grad.numpy(), rtol=1e-9)


# -------------------------------------------------------------------------------------- Instance, Group


@SETTINGS
@given(data=st.data(), eps=EPS, seed=SEEDS)
def test_instance_norm(data, eps, seed):
    shape = _shape(data.draw, 3)
    shape = (*shape[:2], shape[2] + 1, *shape[3:])  # at least two values per instance and channel
    rng = np.random.default_rng(seed)
    c = shape[1]
    feeds = {"x": rng.standard_normal(shape), "scale": rng.standard_normal(c), "bias": rng.standard_normal(c)}
    g = one_node_graph("InstanceNormalization", feeds, {"epsilon": eps})
    check_rule(g, feeds, lambda x, scale, bias: F.instance_norm(x, weight=scale, bias=bias, eps=f32(eps)))


@SETTINGS
@given(data=st.data(), groups=st.integers(1, 3), per_group=st.integers(1, 2), eps=EPS, seed=SEEDS)
def test_group_norm(data, groups, per_group, eps, seed):
    shape = _shape(data.draw, 2, 3)
    spatial = shape[2:]
    if per_group * int(np.prod(spatial)) == 1:  # PyTorch refuses a group of one value
        spatial = (2,)
    shape = (shape[0], groups * per_group, *spatial)
    rng = np.random.default_rng(seed)
    c = shape[1]
    feeds = {"x": rng.standard_normal(shape), "scale": rng.standard_normal(c), "bias": rng.standard_normal(c)}
    # stash_type 11 (DOUBLE): the default (FLOAT) computes stage one in float32, too coarse for differences
    g = one_node_graph("GroupNormalization", feeds, {"epsilon": eps, "num_groups": groups, "stash_type": 11})
    _declare(g, "y0", feeds["x"])
    check_rule(g, feeds, lambda x, scale, bias: F.group_norm(x, groups, scale, bias, eps=f32(eps)))


def test_group_norm_default_stash_float32():
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 4, 3)).astype(np.float32), "scale": rng.standard_normal(4).astype(np.float32),
             "bias": rng.standard_normal(4).astype(np.float32)}
    g = one_node_graph("GroupNormalization", feeds, {"num_groups": 2})
    _declare(g, "y0", feeds["x"])
    torch_check(g, feeds, lambda x, scale, bias: F.group_norm(x, 2, scale, bias, eps=f32(1e-5)),
                wrt=["x", "scale", "bias"], rtol=2e-4, atol=2e-5)


# -------------------------------------------------------------------------------------- Dropout


def _symbolic(g: Graph, dims: dict[str, tuple]) -> Graph:
    """``g`` with the named inputs declared with symbolic dimensions (the rules must use Shape-based ops)."""
    g.inputs = [ValueInfo(v.name, v.dtype, dims.get(v.name, v.shape)) for v in g.inputs]
    return g


@pytest.mark.parametrize("op", ["BatchNormalization", "InstanceNormalization", "GroupNormalization"])
def test_symbolic_dims(op):
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal((3, 4, 5)), "scale": rng.standard_normal(4), "bias": rng.standard_normal(4)}
    if op == "BatchNormalization":
        feeds.update(mean=rng.standard_normal(4), var=rng.uniform(0.5, 2.0, 4))
        g = one_node_graph(op, feeds, {"training_mode": 1}, n_out=3)

        def fn(x, scale, bias, mean, var):
            mu, sigma2 = x.mean([0, 2]), x.var([0, 2], unbiased=False)
            y = F.batch_norm(x, None, None, scale, bias, training=True, eps=f32(1e-5))
            return y, mean * f32(0.9) + mu * (1 - f32(0.9)), var * f32(0.9) + sigma2 * (1 - f32(0.9))
    elif op == "InstanceNormalization":
        g = one_node_graph(op, feeds)

        def fn(x, scale, bias):
            return F.instance_norm(x, weight=scale, bias=bias, eps=f32(1e-5))
    else:
        g = one_node_graph(op, feeds, {"num_groups": 2, "stash_type": 11})
        g.outputs = [ValueInfo("y0", np.float64, ("N", 4, "L"))]
        g.value_info["y0"] = g.outputs[0]

        def fn(x, scale, bias):
            return F.group_norm(x, 2, scale, bias, eps=f32(1e-5))
    _symbolic(g, {"x": ("N", 4, "L")})
    check_rule(g, feeds, fn)
    gg = rg.gradient(with_loss(g, rg.Session(g, backend="reference").run(feeds))[0], loss="loss", wrt=["x"])
    if op != "InstanceNormalization":  # group sizes and the shape to restore are read at run time
        assert any(n.op_type == "Shape" and n.name.startswith("grad/op/") for n in gg.nodes)


def test_symbolic_dims_layer_norm_statistics():
    rng = np.random.default_rng(12)
    feeds = {"x": rng.standard_normal((3, 2, 5)), "scale": rng.standard_normal(1)}
    nodes = [Node("LayerNormalization", ["x", "scale"], ["y0", "m32"], {"axis": 1}, "op"),
             Node("Cast", ["m32"], ["mean"], {"to": 11}, "mean")]
    g = Graph(nodes, [ValueInfo("x", np.float64, ("N", 2, "L")), ValueInfo("scale", np.float64, (1,))],
              [ValueInfo("y0"), ValueInfo("mean")])

    def fn(x, scale):
        return F.layer_norm(x, x.shape[1:], eps=f32(1e-5)) * scale, x.mean([1, 2], keepdim=True).float().double()

    torch_check(g, feeds, fn, wrt=["x", "scale"], outputs=["y0", "mean"])
