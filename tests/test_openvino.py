"""The gradient graphs and training-step graphs revgraph writes run on OpenVINO (CPU plugin, f32) and equal
onnxruntime's results: the bench models (bench/models.py: the MLP, the ResNet-style CNN with training-mode batch
norm, the Transformer encoder exported in training mode with ``dropout=0.0``, the RNN as an ONNX ``Loop``) at
batch 4.

OpenVINO is the optional extra ``revgraph[openvino]`` (``openvino==2026.4.1``, about 180 MB installed); the test
is skipped, saying so, when it is not installed. It is not in the ``test`` extra: the test is slow (CI does
not run it) and CI would install 180 MB for nothing.

Before ``revgraph.onnx_io.portable`` the Transformer's graphs were refused ("Training mode is not supported for Dropout
op": OpenVINO's ONNX frontend rejects every training-mode ``Dropout``, also at ratio 0); now every graph compiles.

The training graphs run Adam from a mid-training state (random first moments, positive second moments, step 5)
rather than the first step's zeros: at the first step Adam's update is ``lr * g / (|g| + eps)``, about
``lr * sign(g)``, so a gradient that is zero in exact arithmetic (the attention's key bias: softmax does not
change when a constant is added to every score) turns roundoff noise of either runtime into a full step of
``+-lr``. With ``sqrt(v)`` well above the roundoff the update is well conditioned.

Tolerance: ``rtol=1e-4`` with ``atol`` 1e-5 of each output's largest magnitude. Both run the same float32
graph, but OpenVINO fuses nodes and uses its own kernels (oneDNN convolutions and matrix products with other
blockings, its own reductions, exp and softmax), so each node differs from onnxruntime's by a few float32 ulps,
and the differences grow through deep backward passes (100 unrolled RNN steps, two attention layers); 1e-4
leaves room for that while a wrong operator or input differs by far more. The absolute part is for elements
that cancel to about zero (the key bias gradient above), which hold only roundoff next to the output's scale.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import revgraph as rg
from revgraph.train import loss_graph, params_as_inputs, training_graph

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mlp", "cnn", "transformer", "rnn")
CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}  # not bf16 on CPUs that have it: compare like with like


def _bench_models():
    spec = importlib.util.spec_from_file_location("bench_models", ROOT / "bench" / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warm_state(tg) -> dict[str, np.ndarray]:
    """Parameters as initialized, Adam moments of a run in progress, step 5 (module doc)."""
    rng = np.random.default_rng(1)
    feeds = tg.initial_state()
    for p in tg.params:
        m, v = tg.state[p]
        feeds[m] = (rng.standard_normal(feeds[m].shape) * 1e-3).astype(feeds[m].dtype)
        feeds[v] = rng.uniform(1e-4, 1e-3, feeds[v].shape).astype(feeds[v].dtype)
    feeds[tg.step] = np.array(5, np.int64)
    return feeds


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """``{(model, kind): (path, feeds)}``: each bench model's gradient and training graph, written by revgraph."""
    pytest.importorskip("openvino", reason="OpenVINO is not installed: pip install 'revgraph[openvino]' "
                                           "(openvino==2026.4.1) to run this test")
    models = _bench_models()
    out = tmp_path_factory.mktemp("openvino")
    built = {}
    for name in MODELS:
        info = models.write_step_model(name, 4, str(out))
        state, batch = models.load_npz(info["npz"])
        model = rg.load(info["path"])
        lg, spec = loss_graph(model, "cross-entropy")
        lg.outputs = lg.outputs[:1]
        params_as_inputs(lg, info["params"])
        gg = rg.gradient(lg, spec.loss, info["params"])
        tg = training_graph(model, "cross-entropy", "adam", params=info["params"])
        for kind, graph, feeds in (("grad", gg, {**batch, **{p: state[p] for p in info["params"]}}),
                                   ("train", tg.graph, {**batch, **_warm_state(tg)})):
            path = out / f"{name}.{kind}.onnx"
            rg.save(graph, path)
            built[name, kind] = path, feeds
    return built


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grad", "train"])
@pytest.mark.parametrize("name", MODELS)
def test_openvino_equals_onnxruntime(graphs, name, kind):
    import openvino as ov

    path, feeds = graphs[name, kind]
    proto = onnx.load(path)
    assert "Dropout" not in {n.op_type for n in proto.graph.node}
    feeds = {i.name: feeds[i.name] for i in proto.graph.input}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    compiled = ov.Core().compile_model(str(path), "CPU", CONFIG)
    result = compiled.create_infer_request().infer(feeds)
    got = [result[compiled.output(k)] for k in range(len(compiled.outputs))]
    assert len(got) == len(want) == len(proto.graph.output)
    for out, a, b in zip(proto.graph.output, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, out.name
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b), initial=0.0)),
                                   err_msg=f"{name} {kind}: output {out.name!r}")
