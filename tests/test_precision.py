"""Mixed precision (revgraph.train.precision): bf16/fp16 training steps against torch.autocast (+ GradScaler for fp16).

Where the steps run. onnxruntime 1.32's CPU provider (x86-64; each op tried alone in a session) has bfloat16
kernels for Cast, Transpose, Identity, Concat, IsInf, IsNaN and LayerNormalization only: none for MatMul, Gemm,
Conv, ConvTranspose, Einsum, Add, Mul, Sub, Div, Relu, Sigmoid, Tanh, Gelu, Erf, Sqrt, Abs, Neg, Softmax, ReduceSum,
ReduceMax, MaxPool, Greater, Equal, Max (it refuses the graph). Its float16 kernels are those and Max; every other
op above runs in float32 (its InsertCastTransformer), and the Cast pairs around it are dropped, even with all
optimizations off, so float16's rounding and overflow vanish (a Cast to float16 and back returns 70000.0). So the
low-precision steps run here on onnx's reference evaluator (``rg.Session(graph, backend="reference")``), and
``rg.Trainer(precision=)`` on the GPU (``@pytest.mark.cuda``, bench/gpu_check.sh); the engines' handling of the
loss scale's carried state is tested on onnxruntime with a model that has no low-precision node.

Tolerances. PyTorch runs the same casts (the torch reference below is the autocast module with the casts of
revgraph.train.precision written out: products in the low precision, their bias added in float32), so both sides
round the same products once to 8 (bf16) or 11 (fp16) significant bits; they differ only in the order of the
float32 accumulation inside a product, which moves a rounding across a 16-bit boundary rarely (a few elements
of a few gradients: one unit in the last place, 2^-8 relative for bf16, 2^-11 for fp16). One such flip moves an
Adam step by at most ``lr`` times that: :data:`ATOL` allows one (4e-5 for bf16, 1e-5 for fp16 with
lr 1e-2); measured here: 1e-7 for bf16 (no flip), 3.5e-6 for fp16 (three elements). The low-precision and the
fp32 trainings of the same model are 17x and more farther apart (5e-4 bf16, 1.7e-4 fp16), which each test
asserts: the match distinguishes the precisions.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.devices import gpu_test
from kit.precision import ATOL, F32, C, D, batches, mlp, reference_train, scaled_linear, torch_mlp

import revgraph as rg
from revgraph.errors import InputError
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.onnx_io.value_types import infer_types
from revgraph.runtime.devices import Device
from revgraph.train import adam, training_graph
from revgraph.train import engines as steps
from revgraph.train.precision import LOW_PRECISION_OPS, Precision, autocast

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def convnet(rng) -> Graph:
    """Conv (bias, pads 1) -> Relu -> MaxPool -> Flatten -> Gemm."""
    P = {"Wc": rng.uniform(-.3, .3, (4, 2, 3, 3)).astype(F32), "bc": rng.uniform(-.3, .3, (4,)).astype(F32),
         "W": rng.uniform(-.2, .2, (C, 4 * 3 * 3)).astype(F32), "b": rng.uniform(-.2, .2, (C,)).astype(F32)}
    nodes = [Node("Conv", ["x", "Wc", "bc"], ["c"], {"pads": [1, 1, 1, 1]}, "conv"),
             Node("Relu", ["c"], ["r"], name="relu"),
             Node("MaxPool", ["r"], ["p"], {"kernel_shape": [2, 2], "strides": [2, 2]}, "pool"),
             Node("Flatten", ["p"], ["f"], {"axis": 1}, "flat"),
             Node("Gemm", ["f", "W", "b"], ["logits"], {"transB": 1}, "fc")]
    return Graph(nodes, [ValueInfo("x", F32, ("N", 2, 6, 6))], [ValueInfo("logits", F32, ("N", C))], P)


def rounded(v, low):
    """``v`` rounded to the low precision and back: the casts (and, backward, the cotangent's casts)."""
    return v.to(low).float()


def torch_convnet(T, x, low):
    """The conv net with the casts written around float32 products: torch's CPU bfloat16 convolution backward is
    not correctly rounded (its weight gradient is one unit off in 40 of 72 elements against the exact sum rounded
    once, which onnx's reference Conv gives), so the reference rounds float32 products once, as a kernel that
    accumulates in float32 does. The forward equals ``torch.autocast``'s conv2d exactly (asserted below)."""
    c = rounded(F.conv2d(rounded(x, low), rounded(T["Wc"], low), padding=1), low) + T["bc"].view(1, -1, 1, 1)
    f = F.max_pool2d(torch.relu(c), 2).flatten(1)
    return rounded(F.linear(rounded(f, low), rounded(T["W"], low)), low) + T["b"]


def torch_train(params, forward, data, low, lr=1e-2, scaler=None):
    """Adam steps of ``forward`` under autocast; with ``scaler`` (GradScaler keyword arguments) the fp16 recipe:
    ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``. Returns parameters, losses, scales."""
    T = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.Adam(T.values(), lr=lr)
    gs = torch.amp.GradScaler("cpu", **scaler) if scaler is not None else None
    losses, scales = [], []
    for x, y in data:
        loss = F.cross_entropy(forward(T, torch.from_numpy(x), low), torch.from_numpy(y))
        opt.zero_grad()
        if gs is None:
            loss.backward()
            opt.step()
        else:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
            scales.append(gs.get_scale())
        losses.append(loss.item())
    return {k: v.detach().numpy() for k, v in T.items()}, losses, scales


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_mlp_matches_torch_autocast_over_20_steps(kind):
    rng = np.random.default_rng(0)
    model, data = mlp(rng), batches(rng, (D,))
    tg = training_graph(model, "cross-entropy", adam(lr=1e-2), precision=kind)
    ours, losses, scales = reference_train(tg, data)
    theirs, t_losses, t_scales = torch_train(model.initializers, torch_mlp, data, LOW[kind],
                                             scaler={} if kind == "fp16" else None)
    np.testing.assert_allclose(losses, t_losses, rtol=0, atol=1e-6)
    for p in tg.params:
        np.testing.assert_allclose(ours[p], theirs[p], rtol=0, atol=ATOL[kind], err_msg=p)
    assert scales == t_scales  # fp16: 2^16 throughout (no overflow, 20 < 2000 good steps)
    # the match distinguishes the precision: fp32 training of the same model lands much farther away
    fp32 = reference_train(training_graph(model, "cross-entropy", adam(lr=1e-2)), data)[0]
    assert max(np.abs(fp32[p] - theirs[p]).max() for p in tg.params) > 10 * ATOL[kind]


def test_convnet_bf16_matches_torch_autocast():
    rng = np.random.default_rng(1)
    model, data = convnet(rng), batches(rng, (2, 6, 6), steps_=20, n=8)
    kind = "bf16"
    tg = training_graph(model, "cross-entropy", adam(lr=1e-2), precision=kind)
    ours, losses, _ = reference_train(tg, data)
    theirs, t_losses, _ = torch_train(model.initializers, torch_convnet, data, torch.bfloat16)
    x, T = torch.from_numpy(data[0][0]), {k: torch.tensor(v) for k, v in model.initializers.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_conv = F.conv2d(x, T["Wc"], padding=1)
    emulated = F.conv2d(rounded(x, torch.bfloat16), rounded(T["Wc"], torch.bfloat16), padding=1).bfloat16()
    assert torch.equal(autocast_conv, emulated)
    np.testing.assert_allclose(losses, t_losses, rtol=0, atol=1e-6)
    for p in tg.params:
        np.testing.assert_allclose(ours[p], theirs[p], rtol=0, atol=ATOL[kind], err_msg=p)


def test_convnet_fp16_first_steps_match_torch():
    """A fast sample of the conv net in CI: 3 fp16 steps with loss scaling."""
    rng = np.random.default_rng(2)
    model, data = convnet(rng), batches(rng, (2, 6, 6), steps_=3, n=4)
    kind = "fp16"
    tg = training_graph(model, "cross-entropy", adam(lr=1e-2), precision=kind)
    ours, losses, _ = reference_train(tg, data)
    theirs, t_losses, _ = torch_train(model.initializers, torch_convnet, data, torch.float16, scaler={})
    np.testing.assert_allclose(losses, t_losses, rtol=0, atol=1e-6)
    for p in tg.params:
        np.testing.assert_allclose(ours[p], theirs[p], rtol=0, atol=ATOL[kind], err_msg=p)


def test_fp16_overflow_skips_steps_and_the_scale_follows_gradscaler():
    """A scale too large for float16 overflows the backward: the step is skipped (parameters, Adam state and the
    step counter unchanged) and the scale halved, step after step until it fits; after 3 good steps in a row
    (growth_interval=3) it doubles, overflows again and backs off: the same scales as GradScaler's, and the same
    parameters."""
    rng = np.random.default_rng(3)
    model, data = mlp(rng), batches(rng, (D,))
    opts, kind = {"init_scale": 2.0 ** 24, "growth_interval": 3}, "fp16"
    tg = training_graph(model, "cross-entropy", adam(lr=1e-2), precision=Precision("fp16", **opts))
    ours, losses, scales = reference_train(tg, data)
    theirs, t_losses, t_scales = torch_train(model.initializers, torch_mlp, data, torch.float16, scaler=opts)
    assert scales == t_scales
    assert scales[0] == 2.0 ** 23 and any(b > a for a, b in itertools.pairwise(scales))  # skipped, then grown
    np.testing.assert_allclose(losses, t_losses, rtol=0, atol=5 * ATOL[kind])
    for p in tg.params:  # (larger scales: more flipped roundings than in the run above, each <= lr 2^-11)
        np.testing.assert_allclose(ours[p], theirs[p], rtol=0, atol=5 * ATOL[kind], err_msg=p)
    skipped = sum(b < a for a, b in itertools.pairwise([opts["init_scale"], *scales]))
    assert int(ours[tg.step]) == len(data) - skipped  # a skipped step is not counted (torch.optim.Adam)

    # one overflowing step on its own: nothing changes but the scale
    sess = rg.Session(tg.graph, backend="reference")
    start = tg.initial_state()
    out = sess.run({**start, "x": data[0][0], "labels": data[0][1]})
    after = {i: out[o] for i, o in tg.carried()}
    for name in [*tg.params, *(s for p in tg.params for s in tg.state[p]), tg.step]:
        np.testing.assert_array_equal(after[name], start[name], err_msg=name)
    assert float(after[tg.scaling.scale]) == 2.0 ** 23 and int(after[tg.scaling.growth]) == 0


def test_graph_keeps_fp32_master_weights_and_fp32_reductions():
    rng = np.random.default_rng(4)
    tg = training_graph(mlp(rng), "cross-entropy", "adam", precision="bf16")
    types = infer_types(tg.graph)
    f32 = np.dtype(F32)
    for p in tg.params:
        assert [v.dtype for v in tg.graph.inputs if v.name == p] == [f32]
        assert [v.dtype for v in tg.graph.outputs if v.name == tg.new_params[p]] == [f32]
    low_nodes = [n for n in tg.graph.nodes if n.op_type in LOW_PRECISION_OPS]
    assert len(low_nodes) == 5  # two products forward; backward: dW1, dW2 and dh (x is no parameter)
    for n in low_nodes:  # forward and backward products run in bfloat16 ...
        assert all(types[i].dtype.name == "bfloat16" for i in n.inputs if i), n.label()
    for n in tg.graph.nodes:  # ... and nothing else does: normalization, softmax, reductions, loss, update
        if n.op_type in ("LayerNormalization", "LogSoftmax", "ReduceMean", "ReduceSum", "Tanh"):
            assert all(types[i].dtype == f32 for i in n.inputs[:1]), n.label()
    assert tg.precision == "bf16" and tg.scaling is None


@pytest.mark.parametrize("case", ["matmul3d", "einsum", "conv_transpose"])
def test_other_products_match_rounded_float32_products(case):
    """The forward of the other low-precision ops equals float32 products of rounded operands, rounded once
    (and the ConvTranspose bias added in float32): what a float32-accumulating kernel computes."""
    rng = np.random.default_rng(10)
    low = torch.bfloat16
    if case == "matmul3d":
        x, w = rng.standard_normal((2, 3, 8)).astype(F32), rng.standard_normal((8, 4)).astype(F32)
        node, attrs = "MatMul", {}
        expect = rounded(rounded(torch.from_numpy(x), low) @ rounded(torch.from_numpy(w), low), low)
        inits = {"w": w}
    elif case == "einsum":
        x, w = rng.standard_normal((2, 3, 8)).astype(F32), rng.standard_normal((4, 8)).astype(F32)
        node, attrs = "Einsum", {"equation": "bij,kj->bik"}
        expect = rounded(torch.einsum("bij,kj->bik", rounded(torch.from_numpy(x), low),
                                      rounded(torch.from_numpy(w), low)), low)
        inits = {"w": w}
    else:
        x, w = rng.standard_normal((2, 3, 4, 4)).astype(F32), rng.standard_normal((3, 2, 3, 3)).astype(F32)
        bias = rng.standard_normal(2).astype(F32)
        node, attrs = "ConvTranspose", {"strides": [2, 2]}
        expect = rounded(F.conv_transpose2d(rounded(torch.from_numpy(x), low), rounded(torch.from_numpy(w), low),
                                            stride=2), low) + torch.from_numpy(bias).view(1, -1, 1, 1)
        inits = {"w": w, "bias": bias}
    g = Graph([Node(node, ["x", *inits], ["y"], attrs, "op")], [ValueInfo("x", F32, x.shape)],
              [ValueInfo("y", F32, None)], inits)
    cast, count = autocast(g, "bf16")
    assert count == 1 and [n.op_type for n in cast.nodes].count("Cast") == 3
    y = rg.Session(cast, backend="reference").run({"x": x})["y"]
    np.testing.assert_allclose(y, expect.numpy(), rtol=1e-6, atol=1e-6)
    assert not np.allclose(y, rg.Session(g, backend="reference").run({"x": x})["y"], rtol=1e-4)  # it did round


def test_fp16_data_parallel_refusals():
    from revgraph.train.distributed.exchange import refused_combination

    assert refused_combination("none", False, "fp32", 1, precision="fp16", world_size=2) is None
    for shard, sync, what in [("optimizer", False, "--shard optimizer"), ("none", True, "--sync-batchnorm")]:
        line = refused_combination(shard, sync, "fp32", 1, precision="fp16", world_size=2)
        assert line.startswith("--precision fp16") and what in line


def test_fp32_graph_unchanged_and_no_product_warns():
    rng = np.random.default_rng(5)
    model = mlp(rng)
    assert autocast(model, "fp32") == (model, 0)
    elementwise = Graph([Node("Mul", ["x", "w"], ["logits"], name="mul")], [ValueInfo("x", F32, ("N", C))],
                        [ValueInfo("logits", F32, ("N", C))], {"w": np.ones(C, F32)})
    with pytest.warns(UserWarning, match="no float32 MatMul"):
        training_graph(elementwise, "cross-entropy", "sgd", precision="bf16")


@pytest.mark.parametrize("buffers", ["one", "two"])
def test_engines_carry_the_loss_scale(buffers):
    """The one-process engines (split with one buffer set written in place, fused with two) bind the loss scale
    into the backward, skip on an overflow and carry the scale: the same steps as the reference evaluator
    and as GradScaler on the float32 model. A scale of 2^127 overflows float32 itself."""
    rng = np.random.default_rng(6)
    model = scaled_linear(rng)
    data = [((rng.uniform(4, 8, (4, C)) * rng.choice([-1, 1], (4, C))).astype(F32), rng.integers(0, C, 4))
            for _ in range(8)]
    opts = {"init_scale": 2.0 ** 127, "growth_interval": 2}
    with pytest.warns(UserWarning):
        tg = training_graph(model, "cross-entropy", adam(lr=1e-2), precision=Precision("fp16", **opts))
    engine = steps.make_engine(tg, 1, Device.parse("cpu"), None, buffers)
    scales = []
    for x, y in data:
        engine.step({"x": x, "labels": y}, 4, 4)
        scales.append(float(engine.read([tg.scaling.scale])[tg.scaling.scale]))
    ref, _, ref_scales = reference_train(tg, data)
    assert scales == ref_scales and scales[0] == 2.0 ** 126, scales
    np.testing.assert_allclose(engine.read(["w"])["w"], ref["w"], rtol=1e-6)  # (float32 rounding)
    T = {"w": torch.tensor(model.initializers["w"], requires_grad=True)}
    opt = torch.optim.Adam(T.values(), lr=1e-2)
    gs = torch.amp.GradScaler("cpu", **opts)
    t_scales = []
    for x, y in data:
        opt.zero_grad()
        gs.scale(F.cross_entropy(torch.from_numpy(x) * T["w"], torch.from_numpy(y))).backward()
        gs.step(opt)
        gs.update()
        t_scales.append(gs.get_scale())
    assert scales == t_scales
    np.testing.assert_allclose(engine.read(["w"])["w"], T["w"].detach().numpy(), rtol=1e-6)
    assert set(engine.names) >= {tg.scaling.scale, tg.scaling.growth}  # saved in checkpoints with the step


def test_trainer_refuses_low_precision_on_the_cpu_and_bad_scaling():
    rng = np.random.default_rng(7)
    for kind in ("bf16", "fp16"):
        with pytest.raises(InputError, match=f"--precision {kind} .* needs --device cuda"):
            rg.Trainer(mlp(rng), precision=kind)
    with pytest.raises(InputError, match="unknown precision"):
        Precision("fp8")
    with pytest.raises(InputError, match="--backoff-factor"):
        Precision("fp16", backoff_factor=2.0)


def test_cli_precision_errors_exit_2_with_one_line(tmp_path, capsys):
    from revgraph.cli import main

    rng = np.random.default_rng(8)
    rg.save(mlp(rng), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, D)).astype(F32), labels=rng.integers(0, C, 8))
    base = ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "cross-entropy",
            "--epochs", "1", "-o", str(tmp_path / "o.onnx")]
    for extra, fragment in [(["--precision", "bf16"], "needs --device cuda"),
                            (["--init-scale", "1024"], "goes with --precision fp16"),
                            (["--precision", "fp16", "--growth-interval", "0"], "--growth-interval")]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "o.onnx").exists()


@gpu_test
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_trainer_on_cuda_matches_torch_autocast(kind):
    """On the GPU the Trainer runs the low-precision step in onnxruntime's CUDA kernels (cuBLAS/cuDNN accumulate
    in float32 in their own order, and may pick other algorithms): 20 steps against the CPU autocast reference."""
    rng = np.random.default_rng(9)
    model, data = mlp(rng), batches(rng, (D,))
    trainer = rg.Trainer(model, "cross-entropy", adam(lr=1e-2), device="cuda", precision=kind)
    for x, y in data:
        trainer.step({"x": x, "labels": y})
    theirs, _, _ = torch_train(model.initializers, torch_mlp, data, LOW[kind], scaler={} if kind == "fp16" else None)
    for p, a in trainer.parameters.items():
        np.testing.assert_allclose(a, theirs[p], rtol=0, atol=1e-4, err_msg=p)


def test_two_processes_scale_and_skip_like_one(tmp_path):
    """fp16 loss scaling data-parallel (2 processes x batch 4 = 1 process x batch 8): the non-finite check
    runs in the update graph after the all-reduce, so every rank skips the same steps and carries the same
    scale; parameters, Adam state, scale, good-step count and step counter equal one process's."""
    from kit.distributed import ENV, TORCHRUN, run_command
    from precision_worker import trainer as scaled_trainer

    worker = Path(__file__).resolve().parent / "precision_worker.py"
    run_command([*TORCHRUN, "--standalone", "--nproc-per-node=2", str(worker), "--out", str(tmp_path)], env=ENV)
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for name in ranks[0]:
        np.testing.assert_array_equal(ranks[1][name], ranks[0][name], err_msg=name)
    one, data = scaled_trainer(False)
    one.fit(data, 2, 8, seed=3, progress=False)
    s = one.spec.scaling
    carried = one._engine.read([s.scale, s.growth, one.spec.step])
    assert float(carried[s.scale]) < 2.0 ** 127 and int(carried[one.spec.step]) < len(one.losses)  # skips happened
    for name, value in {**one.parameters, **one.state, **carried}.items():
        np.testing.assert_allclose(ranks[0][name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    np.testing.assert_allclose(ranks[0]["losses"], one.losses, rtol=2e-5, atol=1e-6)
