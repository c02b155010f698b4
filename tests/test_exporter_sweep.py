"""A sweep over the files of the exporters revgraph is used with (issue 41, item 9; ``-m slow``): per source a
small model generated here from a config, revgraph's gradient of the scalar ``sum(output * u)`` against the
source framework's own autodiff (torch autograd in float64 through the original module, ``jax.grad``, central
differences in float64 of scikit-learn's ``predict``), and a 3-step ``rg.Trainer`` run with finite losses. A source
whose exporter is not installed here is skipped with the ``pip install`` that brings it. Each test prints a
``SWEEP`` line (source, worst norm-relative difference, losses): docs/exporters.md, "Exporter sweep", holds
the numbers measured.

TensorFlow, paddle2onnx and Optimum are not installed in the main environment (TensorFlow's size; Optimum's
``optimum-onnx`` pins transformers < 4.58; paddle2onnx pins onnx 1.17 but runs with the newer onnx when installed
with ``--no-deps``): each runs in a side virtual environment that sees the main one's packages and shadows only
what it installs, e.g. ``python3 -m venv --system-site-packages /tmp/venv-tf && /tmp/venv-tf/bin/pip install
tensorflow-cpu tf2onnx && /tmp/venv-tf/bin/python -m pytest -m slow tests/test_exporter_sweep.py -k keras``
(the skip reasons give each one's commands)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from kit import torch_models as tm  # (tests/ is on sys.path)
from kit.harness import with_loss

import revgraph as rg

pytestmark = pytest.mark.slow
F32, F64 = np.float32, np.float64


def _grads(g: rg.Graph, feeds: dict, out: str, u: np.ndarray, wrt: list[str], **kw) -> dict[str, np.ndarray]:
    """revgraph's gradients of ``sum(g[out] * u)`` with respect to ``wrt`` (inputs or initializers)."""
    g = g.copy()
    g.outputs = [vi for vi in g.outputs if vi.name == out]
    fwd = rg.Session(g).run(feeds)
    lg, _ = with_loss(g, fwd, [out])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gg = rg.gradient(lg, loss="loss", wrt=wrt, **kw)
    got = rg.Session(gg).run({**feeds, f"{out}_u": u.astype(fwd[out].dtype)})
    return {w: got[f"{w}_grad"] for w in wrt}


def _worst(got: dict, want: dict, source: str, tol: float) -> float:
    """The largest ``|got - want| / |want|`` (Frobenius norms) over the tensors; asserts it is under ``tol``
    and prints how many tensors were compared."""
    worst = 0.0
    for w, a in want.items():
        rel = float(np.linalg.norm(np.asarray(got[w], F64) - a) / max(np.linalg.norm(a), 1e-30))
        assert rel < tol, (source, w, rel)
        worst = max(worst, rel)
    assert want, source
    print(f"\nSWEEP {source}: compared {len(want)} gradients")
    return worst


def _train(g, data: dict, source: str, worst: float, loss: str = "mse", lr: float = 1e-2, **kw) -> None:
    """3 full-batch SGD steps of ``rg.Trainer``: three finite losses; prints the sweep's line."""
    from revgraph.train import sgd

    n = len(next(iter(data.values())))
    trainer = rg.Trainer(g, loss, sgd(lr=lr), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(data, epochs=3, batch_size=n, shuffle=False, progress=False)
    losses = [float(x) for x in trainer.losses]
    assert len(losses) == 3 and np.all(np.isfinite(losses)), (source, losses)
    print(f"\nSWEEP {source}: worst={worst:.2e} params={len(trainer.parameters)} losses={losses}")


def _torch_param_grads(model: torch.nn.Module, ids: np.ndarray, u: np.ndarray) -> dict[str, np.ndarray]:
    """torch autograd in float64 of ``sum(model(ids) * u)`` for every parameter, by name."""
    model = model.double()
    model.zero_grad()
    (model(torch.tensor(ids)) * torch.tensor(u, dtype=torch.float64)).sum().backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _matched(g: rg.Graph, theirs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The torch gradients of the parameters the file holds under the parameter's own name (transposed where the
    file holds the transpose)."""
    out = {}
    for n, a in theirs.items():
        if n in g.initializers:
            shape = np.shape(g.initializers[n])
            out[n] = a if shape == a.shape else a.T
    return out


def _tied_grads(g: rg.Graph, feeds: dict, u: np.ndarray, want: dict) -> dict[str, np.ndarray]:
    """revgraph's gradients of ``sum(logits * u)`` for ``want``'s names, where the GPT-2 file's LM head reads a
    folded transpose of the tied embedding (the TorchScript exporter's constant folding): that copy's gradient,
    transposed, is added to the embedding's, as torch sums the two uses of the one tensor."""
    wte = "transformer.wte.weight"
    head = [n for n, v in g.initializers.items() if n != wte and np.shape(v) == np.shape(g.initializers[wte])[::-1]
            and np.array_equal(v, np.asarray(g.initializers[wte]).T)]
    got = _grads(g, feeds, "logits", u, list(want) + head)
    for n in head:
        got[wte] = got[wte] + got[n].T
    return got


# ---------------------------------------------------------------------------------------------- PyTorch


@pytest.mark.parametrize("how", ["dynamo", "torchscript"])
def test_pytorch(tmp_path, how):
    """GPT-2 (tied LM head) from torch.onnx, dynamo and TorchScript: every parameter's gradient against torch."""
    model = tm.build("gpt2")
    path = tmp_path / "m.onnx"
    tm.export(model, how, path)
    g = rg.load(path)
    ids = tm.tokens(2)
    u = np.random.default_rng(1).standard_normal((2, tm.T, tm.VOCAB))
    want = _matched(g, _torch_param_grads(model, ids, u))
    got = _grads(g, {"input_ids": ids}, "logits", u, list(want))
    worst = _worst(got, want, f"pytorch-{how}", 1e-4)
    _train(rg.load(path), {"input_ids": tm.tokens(8)}, f"pytorch-{how}", worst, loss="causal-lm")


# ---------------------------------------------------------------------------------------------- Keras / TF, Paddle,
# Optimum


def _venv(name: str, installs: list[str], why: str) -> str:
    """The skip reason of a source that runs in a side environment ``/tmp/venv-<name>`` (module doc): the
    commands that make it and run this file in it."""
    bin_ = f"/tmp/venv-{name}/bin"
    pips = " && ".join(f"{bin_}/pip install {i}" for i in installs)
    return (f"not installed ({why}); in a side environment: python3 -m venv --system-site-packages /tmp/venv-{name}"
            f" && {pips}, then {bin_}/python -m pytest -m slow tests/test_exporter_sweep.py")


def _mlp_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """16 inputs ``[16, 8]``, cotangents ``u`` ``[16, 3]`` and regression targets ``[16, 3]``, float32."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(F32) for s in ((16, 8), (16, 3), (16, 3)))


def _by_value(g: rg.Graph, arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """``{initializer: key}`` for each array of ``arrays`` that the file holds as an initializer, by value."""
    return {n: k for n, v in g.initializers.items() for k, a in arrays.items()
            if np.shape(v) == a.shape and np.array_equal(v, a)}


@pytest.mark.parametrize("how", ["tf2onnx", "keras-export"])
def test_keras(tmp_path, how):
    """A Keras MLP (8 -> 16 tanh -> 3, random biases) through tf2onnx's ``from_keras`` and Keras 3's
    ``model.export(format="onnx")``: the gradients of the input and of the 4 weights (found in the file by value)
    against ``tf.GradientTape``. TensorFlow lives in a side environment (module doc: ``_VENV``)."""
    tf = pytest.importorskip("tensorflow", reason=_venv("tf", ["tensorflow-cpu tf2onnx"], "TensorFlow is over 300 MB"))
    keras = tf.keras
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "tanh", bias_initializer="random_normal"),
                          keras.layers.Dense(3, bias_initializer="random_normal")])  # (zero biases are folded away)
    x, u, y = _mlp_data()
    if how == "tf2onnx":
        tf2onnx = pytest.importorskip("tf2onnx", reason=_venv("tf", ["tensorflow-cpu tf2onnx"], "tf2onnx"))
        m.output_names = ["y"]  # (tf2onnx 1.17's from_keras looks Keras 3's output tensors up by these names)
        proto, _ = tf2onnx.convert.from_keras(m, input_signature=(tf.TensorSpec((None, 8), tf.float32, "x"),),
                                              opset=17)
        g = rg.load(proto)
    else:
        m(x[:1])  # (Keras 3 exports only a model that has been called)
        m.export(str(tmp_path / "k.onnx"), format="onnx", verbose=False)
        g = rg.load(tmp_path / "k.onnx")
    inp, out = g.input_names[0], g.output_names[0]
    held = _by_value(g, {w.path: w.numpy() for w in m.trainable_weights})
    assert len(held) == 4, list(g.initializers)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        s = tf.reduce_sum(m(xt) * u)
    grads = dict(zip([w.path for w in m.trainable_weights] + [inp],
                     tape.gradient(s, [*m.trainable_weights, xt]), strict=True))
    want = {inp: grads[inp].numpy(), **{n: grads[k].numpy() for n, k in held.items()}}
    worst = _worst(_grads(g, {inp: x}, out, u, list(want)), want, f"keras-{how}", 1e-4)
    _train(g, {inp: x, "labels": y}, f"keras-{how}", worst)


def test_paddle2onnx(tmp_path):
    """A PaddlePaddle MLP (8 -> 16 tanh -> 3) through ``paddle.onnx.export`` (paddle2onnx): the file holds the
    weights as ``Constant`` nodes, which ``lift_constants`` makes initializers; the gradients of the input and of
    the 4 weights (found by value) against paddle's autograd."""
    why = "paddle2onnx 2.1 pins onnx 1.17; --no-deps keeps the newer onnx, with which it exports"
    paddle = pytest.importorskip("paddle", reason=_venv("paddle", ["paddlepaddle", "--no-deps paddle2onnx"], why))
    pytest.importorskip("paddle2onnx", reason=_venv("paddle", ["paddlepaddle", "--no-deps paddle2onnx"], why))
    from revgraph.autodiff.lift import lift_constants

    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 3))
    paddle.onnx.export(net, str(tmp_path / "p"), opset_version=17,
                       input_spec=[paddle.static.InputSpec([None, 8], "float32", "x")])
    g, lifted = lift_constants(rg.load(tmp_path / "p.onnx"))
    held = _by_value(g, {p.name: p.numpy() for p in net.parameters()})
    assert len(held) == 4 and set(held) <= set(lifted), (lifted, list(g.initializers))
    x, u, y = _mlp_data()
    xt = paddle.to_tensor(x, stop_gradient=False)
    (net(xt) * paddle.to_tensor(u)).sum().backward()
    grads = {p.name: p.grad.numpy() for p in net.parameters()}
    inp, out = g.input_names[0], g.output_names[0]
    want = {inp: xt.grad.numpy(), **{n: grads[k] for n, k in held.items()}}
    worst = _worst(_grads(g, {inp: x}, out, u, list(want)), want, "paddle2onnx", 1e-4)
    _train(g, {inp: x, "labels": y}, "paddle2onnx", worst)


def test_optimum(tmp_path):
    """GPT-2 (tests/kit/torch_models.py's config) through Optimum's ``main_export`` (text-generation, no KV
    cache): the gradients of the parameters the file keeps under their torch names, the tied embedding's including
    its LM head's folded transpose, against torch."""
    exporters = pytest.importorskip("optimum.exporters.onnx", reason=_venv(
        "optimum", ["optimum-onnx"], "optimum-onnx pins transformers < 4.58 and optimum 2.1; transformers 5 "
        "lacks what it imports"))
    model = tm.build("gpt2")
    model.save_pretrained(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exporters.main_export(str(tmp_path / "hf"), output=tmp_path / "onnx", task="text-generation",
                              no_post_process=True)
    g = rg.load(tmp_path / "onnx" / "model.onnx")

    def feeds(ids):
        known = {"input_ids": ids, "attention_mask": np.ones_like(ids),
                 "position_ids": np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()}
        return {n: known[n] for n in g.input_names}

    ids = tm.tokens(2)
    u = np.random.default_rng(1).standard_normal((2, tm.T, tm.VOCAB))
    want = _matched(g, _torch_param_grads(model, ids, u))
    worst = _worst(_tied_grads(g, feeds(ids), u, want), want, "optimum", 1e-4)
    _train(g, feeds(tm.tokens(8)), "optimum", worst, loss="causal-lm", output="logits")


# ---------------------------------------------------------------------------------------------- JAX


def test_jax2onnx():
    """An MLP (tanh) written by jax2onnx, its weights closed over (initializers): the gradient of the input and of
    both weights against ``jax.grad``."""
    pytest.importorskip("jax2onnx", reason="not installed: pip install jax2onnx")
    import jax
    import jax.numpy as jnp
    from jax2onnx import to_onnx

    rng = np.random.default_rng(0)
    w1, w2 = (0.5 * rng.standard_normal((8, 16))).astype(F32), (0.5 * rng.standard_normal((16, 3))).astype(F32)

    def f(x, a=w1, b=w2):
        return jnp.tanh(x @ a) @ b

    g = rg.load(to_onnx(f, [("B", 8)]))  # (a symbolic batch: the trainer batches 16)
    x, u = rng.standard_normal((4, 8)).astype(F32), rng.standard_normal((4, 3)).astype(F32)
    (inp,), out = g.input_names, g.output_names[0]
    by_value = {n: k for n, v in g.initializers.items() for k, w in (("a", w1), ("b", w2))
                if np.shape(v) == w.shape and np.array_equal(v, w)}
    assert sorted(by_value.values()) == ["a", "b"], list(g.initializers)
    ref = jax.grad(lambda x, a, b: jnp.sum(f(x, a, b) * u), argnums=(0, 1, 2))(x, w1, w2)
    want = {inp: np.asarray(ref[0], F64), **{n: np.asarray(ref[" ab".index(k)], F64) for n, k in by_value.items()}}
    worst = _worst(_grads(g, {inp: x}, out, u, list(want)), want, "jax2onnx", 1e-5)
    xs = rng.standard_normal((16, 8)).astype(F32)
    _train(g, {inp: xs, "labels": rng.standard_normal((16, 3)).astype(F32)}, "jax2onnx", worst)


# ---------------------------------------------------------------------------------------------- scikit-learn


def test_skl2onnx():
    """skl2onnx's MLPRegressor (tanh, one target): the gradients of the input and of the coefficient matrices the
    file holds (found by value) against central differences in float64 of scikit-learn's ``predict``; the file's
    coefficients train."""
    from skl2onnx import to_onnx  # (skl2onnx is in the test extra)
    from sklearn.neural_network import MLPRegressor

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4))
    y = np.sin(x[:, 0]) + x[:, 1] * x[:, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MLPRegressor(hidden_layer_sizes=(8,), activation="tanh", max_iter=50, random_state=0).fit(x, y)
        g = rg.load(to_onnx(model, x[:1].astype(F32)))
    (inp,), out = g.input_names, g.output_names[0]
    xs, u = x[:4], rng.standard_normal(4)

    def central(a: np.ndarray, f, h: float = 1e-6) -> np.ndarray:
        """d sum(f() * u) / d a by central differences, ``a`` perturbed in place (and restored)."""
        d = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            v = a[i]
            a[i] = v + h
            up = f()
            a[i] = v - h
            d[i] = np.sum((up - f()) * u) / (2 * h)
            a[i] = v
        return d

    xp = xs.copy()
    want = {inp: central(xp, lambda: model.predict(xp))}
    coefs = _by_value(g, {str(k): c.astype(F32) for k, c in enumerate(model.coefs_)})
    assert len(coefs) == 2, list(g.initializers)
    for n, k in coefs.items():
        want[n] = central(model.coefs_[int(k)], lambda: model.predict(xs))
    got = _grads(g, {inp: xs.astype(F32)}, out, u[:, None], list(want))  # (the file's output is [N, 1])
    worst = _worst(got, want, "skl2onnx", 1e-4)
    _train(g, {inp: x.astype(F32), "labels": y[:, None].astype(F32)}, "skl2onnx", worst)


# ---------------------------------------------------------------------------------------------- onnxruntime's tools


def test_onnxruntime_transformer_optimizer(tmp_path):
    """GPT-2 exported by TorchScript, then fused by onnxruntime's transformer optimizer (SkipLayerNormalization,
    FastGelu): the gradient of every parameter the fused file keeps under its torch name against torch."""
    from onnxruntime.transformers import optimizer
    model = tm.build("gpt2")
    plain, fused = tmp_path / "plain.onnx", tmp_path / "fused.onnx"
    tm.export(model, "torchscript", plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer.optimize_model(str(plain), model_type="gpt2", num_heads=4, hidden_size=32).save_model_to_file(
            str(fused))
    g = rg.load(fused)
    assert {n.op_type for n in g.nodes} & {"SkipLayerNormalization", "FastGelu"}
    ids = tm.tokens(2)
    u = np.random.default_rng(1).standard_normal((2, tm.T, tm.VOCAB))
    want = _matched(g, _torch_param_grads(model, ids, u))
    got = _tied_grads(g, {"input_ids": ids}, u, want)  # (the optimizer keeps the folded transpose of the LM head)
    worst = _worst(got, want, "ort-transformer-optimizer", 1e-4)
    _train(rg.load(fused), {"input_ids": tm.tokens(8)}, "ort-transformer-optimizer", worst, loss="causal-lm")


def _mlp_file(path) -> tuple[torch.nn.Module, np.ndarray]:
    """A torch MLP (8 -> 16 tanh -> 3) exported by TorchScript (Gemm nodes, dynamic batch), and 16 inputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).eval()
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(F32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.tensor(x[:2]),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    return model, x


def _torch_ste(model: onnx.ModelProto, x: torch.Tensor) -> torch.Tensor:
    """The QDQ file evaluated in torch float64: ``QuantizeLinear`` rounds with the straight-through estimator's
    gradient (identity; the calibration data covers the inputs, so nothing clips), ``DequantizeLinear`` is
    ``(q - zero_point) * scale``, and Gemm / MatMul / Add / Tanh as ONNX defines them."""
    env = {t.name: torch.tensor(onnx.numpy_helper.to_array(t).astype(F64)) for t in model.graph.initializer}
    env[model.graph.input[0].name] = x
    for nd in model.graph.node:
        a = [env[i] if i else None for i in nd.input]
        at = {t.name: onnx.helper.get_attribute_value(t) for t in nd.attribute}
        if nd.op_type == "QuantizeLinear":
            zp = a[2] if len(a) > 2 else 0.0
            lo, hi = (-128, 127) if model.graph.initializer and _int8(model, nd.input[2]) else (0, 255)
            q = torch.clamp(torch.round(a[0] / a[1]) + zp, lo, hi)
            r = a[0] / a[1] + zp
            r = r + (q - r).detach()
        elif nd.op_type == "DequantizeLinear":
            r = (a[0] - (a[2] if len(a) > 2 and a[2] is not None else 0.0)) * a[1]
        elif nd.op_type == "Gemm":
            b = a[1].T if at.get("transB") else a[1]
            r = a[0] @ b + (a[2] if len(a) > 2 else 0.0)
        elif nd.op_type == "MatMul":
            r = a[0] @ a[1]
        elif nd.op_type == "Add":
            r = a[0] + a[1]
        elif nd.op_type == "Tanh":
            r = torch.tanh(a[0])
        else:
            raise AssertionError(f"the QDQ reference has no {nd.op_type}")
        env[nd.output[0]] = r
    return env[model.graph.output[0].name]


def _int8(model: onnx.ModelProto, name: str) -> bool:
    return any(t.name == name and t.data_type == onnx.TensorProto.INT8 for t in model.graph.initializer)


def test_onnxruntime_quantize_static_qdq(tmp_path):
    """``quantize_static(quant_format=QDQ)`` of a torch MLP (int8 weights, uint8/int8 activations calibrated on the
    data): the input's gradient with the straight-through estimator against torch evaluating the same QDQ file with
    its rounding's straight-through gradient; the trainer (straight-through) runs."""
    from onnxruntime import quantization as q
    _, x = _mlp_file(tmp_path / "f.onnx")

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": x}])

        def get_next(self):
            return next(self.it, None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.quantize_static(str(tmp_path / "f.onnx"), str(tmp_path / "qdq.onnx"), Reader(),
                          quant_format=q.QuantFormat.QDQ, per_channel=False)
    proto = onnx.load(str(tmp_path / "qdq.onnx"))
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in proto.graph.node}
    g = rg.load(proto)
    u = np.random.default_rng(1).standard_normal((16, 3))
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    (_torch_ste(proto, xt) * torch.tensor(u)).sum().backward()
    want = {"x": xt.grad.numpy()}
    worst = _worst(_grads(g, {"x": x}, "y", u, ["x"], straight_through=True), want, "ort-qdq", 1e-4)
    y = np.random.default_rng(2).standard_normal((16, 3)).astype(F32)
    scales = [n for n in g.initializers if n.endswith("weight_scale")]  # (the int8 weights are frozen: their
    assert len(scales) == 2, list(g.initializers)  # scales train, as in learned-step-size quantization)
    _train(g, {"x": x, "labels": y}, "ort-qdq", worst, lr=1e-6, straight_through=True,
           params=scales)


def test_onnxruntime_quantize_dynamic(tmp_path):
    """``quantize_dynamic`` of a torch MLP (DynamicQuantizeLinear + MatMulInteger, int8 weights, float biases):
    the last bias's gradient (the float tail after the integer product) against torch, and the trainer
    (straight-through) trains the float biases."""
    from onnxruntime import quantization as q
    model, x = _mlp_file(tmp_path / "f.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.quantize_dynamic(str(tmp_path / "f.onnx"), str(tmp_path / "dyn.onnx"), weight_type=q.QuantType.QInt8)
    g = rg.load(tmp_path / "dyn.onnx")
    assert "MatMulInteger" in {n.op_type for n in g.nodes}
    u = np.random.default_rng(1).standard_normal((16, 3))
    bias = next(n for n, v in g.initializers.items() if np.shape(v) == (3,) and np.asarray(v).dtype == F32)
    want = {bias: u.sum(0)}  # d sum(y u) / d b2 (torch autograd agrees: y = h W2 + b2)
    model = model.double()
    (model(torch.tensor(x, dtype=torch.float64)) * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(model[2].bias.grad.numpy(), want[bias])
    worst = _worst(_grads(g, {"x": x}, "y", u, [bias], straight_through=True), want, "ort-dynamic", 1e-5)
    y = np.random.default_rng(2).standard_normal((16, 3)).astype(F32)
    _train(g, {"x": x, "labels": y}, "ort-dynamic", worst, straight_through=True)


# ---------------------------------------------------------------------------------------------- onnxruntime-genai


def test_onnxruntime_genai_builder(tmp_path):
    """The model builder's fp32 LLaMA (GroupQueryAttention, SkipSimplifiedLayerNormalization), from the config
    of tests/kit/genai.py: the gradients of the parameters the builder keeps whole against torch autograd through
    the transformers model; causal-LM training on its inputs."""
    from kit.genai import genai_llama, token_data

    path, model = genai_llama(tmp_path, "fp32", vocab=96)
    g = rg.load(path)
    ids = np.random.default_rng(0).integers(0, 96, (2, 6))
    u = np.random.default_rng(1).standard_normal((2, 6, 96))
    names = {"model.embed_tokens.weight": "model.embed_tokens.weight",
             "model.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
             "model.layers.1.post_attention_layernorm.weight": "model.layers.1.post_attention_layernorm.weight",
             "model.layers.2.final_norm_layernorm.weight": "model.norm.weight",
             "model.layers.1.attn.o_proj.MatMul.weight": "model.layers.1.self_attn.o_proj.weight",
             "model.layers.0.mlp.down_proj.MatMul.weight": "model.layers.0.mlp.down_proj.weight",
             "lm_head.MatMul.weight": "lm_head.weight"}
    model = model.double()
    (model(torch.tensor(ids)).logits * torch.tensor(u)).sum().backward()
    params = dict(model.named_parameters())
    want = {o: params[t].grad.numpy().T if "MatMul" in o else params[t].grad.numpy() for o, t in names.items()}
    worst = _worst(_grads(g, token_data(ids), "logits", u, list(want)), want, "onnxruntime-genai", 1e-4)
    _train(g, token_data(np.random.default_rng(2).integers(0, 96, (4, 8))), "onnxruntime-genai", worst,
           loss="causal-lm", output="logits")
