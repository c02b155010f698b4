"""The onnx wheel's light/ models (ResNet-50, Inception v1 and v2, DenseNet-121, ShuffleNet, SqueezeNet, VGG-19,
ZFNet-512, AlexNet), with their ConstantOfShape weights lifted into initializers and given random values: the
gradient graph builds, passes the ONNX checker and runs under onnxruntime; for three of them the gradients
of several weight tensors agree with float64 central differences of the output projected on a random
cotangent (the VJP that `--seed input` builds)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import DATA_DIR

import revgraph as rg
from revgraph.lift import lift_constants

MODELS = ["resnet50", "inception_v1", "inception_v2", "densenet121", "shufflenet", "squeezenet", "vgg19",
          "zfnet512", "bvlc_alexnet"]


def random_weights(g: rg.Graph, seed: int) -> rg.Graph:
    """Weights of a sensible scale: N(0, 1/fan_in) for kernels and matrices, 1 + N(0, 0.1) for per-channel
    vectors (batch-norm scales and variances stay positive)."""
    rng = np.random.default_rng(seed)
    for name, w in list(g.initializers.items()):
        if w.dtype.kind != "f" or w.size <= 1:
            continue
        if w.ndim >= 2:
            fan_in = int(np.prod(w.shape[1:]))
            g.initializers[name] = (rng.standard_normal(w.shape) / np.sqrt(fan_in)).astype(w.dtype)
        else:
            g.initializers[name] = (1 + 0.1 * rng.standard_normal(w.shape)).astype(w.dtype)
    return g


def lifted(name: str) -> tuple[rg.Graph, list[str]]:
    g, names = lift_constants(rg.load(DATA_DIR / "light" / f"light_{name}.onnx"))
    return random_weights(g, 0), names


@pytest.mark.parametrize("name", MODELS)
def test_gradient_graph_builds_checks_and_runs(name):
    g, names = lifted(name)
    assert len(names) > 10  # the weights were ConstantOfShape nodes
    gg = rg.gradient(g, seed="input")
    proto = rg.to_onnx(gg)
    onnx.checker.check_model(proto, full_check=True)
    assert {o.domain for o in proto.opset_import} == {""}
    rng = np.random.default_rng(1)
    feeds = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in gg.inputs}
    out = rg.Session(gg).run(feeds)
    grads = gg.output_names[len(g.outputs):]
    assert len(grads) == len([w for w in g.initializers.values() if w.dtype.kind == "f"]) + len(g.inputs)
    for gname in grads:
        assert np.all(np.isfinite(out[gname])), gname
    assert any(np.abs(out[n]).max() > 0 for n in grads)


# Not AlexNet, Inception v1 or ZFNet here: their float64 forward runs on onnx.reference (onnxruntime has no
# float64 Conv), whose LRN loops over the batch instead of the channels (onnx 1.23), so central differences
# of it measure another function. LRN's rule is checked against PyTorch in tests/test_rules_pool.py.
@pytest.mark.parametrize("name", ["squeezenet", "shufflenet", "resnet50"])
def test_weight_gradients_agree_with_central_differences(name):
    g, names = lifted(name)
    chosen = [names[0], names[len(names) // 2], names[-1]]
    # a small step: with a million ReLUs, a larger one moves some pre-activations across their kink
    report = rg.check_gradients(g, wrt=chosen, seed=3, directions=1, rtol=1e-4, atol=1e-7, step=1e-8)
    assert [r.name for r in report.rows] == chosen
    assert report.ok, [(r.name, r.max_abs, r.max_rel) for r in report.rows]
