"""The onnx wheel's light/ models (ResNet-50, Inception v1 and v2, DenseNet-121, ShuffleNet, SqueezeNet, VGG-19,
ZFNet-512, AlexNet), with their ConstantOfShape weights lifted into initializers and given random values: the
gradient graph builds, passes the ONNX checker and runs under onnxruntime; for three of them the gradients
of several weight tensors agree with float64 central differences of the output projected on a random
cotangent (the VJP that `--seed input` builds), and every ResNet-50 weight gradient equals PyTorch's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from kit.light_models import MODELS, lifted

import revgraph as rg
from revgraph.tools.check import to_float64


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


# The float64 forward runs on the reference backend (onnxruntime has no float64 Conv): a few seconds per pass
# for these three; the larger models would take minutes.
@pytest.mark.parametrize("name", ["squeezenet", "shufflenet", "resnet50"])
def test_weight_gradients_agree_with_central_differences(name):
    g, names = lifted(name)
    chosen = [names[0], names[len(names) // 2], names[-1]]
    if name == "resnet50":
        # A step in conv1's weights moves some of the million pre-activations downstream across their ReLU
        # kink, which spoils central differences of the whole net there (not the gradient: the next test
        # compares every ResNet-50 weight gradient with PyTorch). Deeper weights reach fewer kinks.
        chosen = [names[len(names) // 2], names[-3], names[-1]]
    # a small step: with a million ReLUs, a larger one moves some pre-activations across their kink
    report = rg.check_gradients(g, wrt=chosen, seed=3, directions=1, rtol=1e-4, atol=1e-7, step=1e-8)
    assert [r.name for r in report.rows] == chosen
    assert report.ok, [(r.name, r.max_abs, r.max_rel) for r in report.rows]


def _torch_forward(g: rg.Graph, x: np.ndarray, params: dict):
    """ResNet-50's operators in PyTorch, node by node (float64), reading weights from ``params``."""
    F = torch.nn.functional
    env = {**params, g.inputs[0].name: torch.tensor(x)}
    for node in g.nodes:
        i, a = [env.get(name) for name in node.inputs], node.attrs
        if node.op_type == "Conv":
            p = a.get("pads", [0, 0, 0, 0])
            assert p[:2] == p[2:]
            y = F.conv2d(i[0], i[1], i[2] if len(i) > 2 else None, stride=a.get("strides", [1, 1]), padding=p[:2])
        elif node.op_type == "BatchNormalization":
            scale, bias, mean, var = (t[None, :, None, None] for t in i[1:5])
            y = (i[0] - mean) / torch.sqrt(var + a.get("epsilon", 1e-5)) * scale + bias
        elif node.op_type == "Relu":
            y = torch.relu(i[0])
        elif node.op_type in ("MaxPool", "AveragePool"):
            p = a.get("pads", [0, 0, 0, 0])
            if node.op_type == "MaxPool":
                y = F.max_pool2d(F.pad(i[0], (p[1], p[3], p[0], p[2]), value=-float("inf")), a["kernel_shape"],
                                 a["strides"])
            else:
                y = F.avg_pool2d(i[0], a["kernel_shape"], a["strides"])
        elif node.op_type == "Sum":
            y = sum(i)
        elif node.op_type == "Reshape":
            y = i[0].reshape([int(d) for d in g.initializers[node.inputs[1]]])
        elif node.op_type == "Gemm":
            w = i[1].T if a.get("transB", 0) else i[1]
            y = i[0] @ w + i[2]
        elif node.op_type == "Softmax":
            y = torch.softmax(i[0], dim=a.get("axis", -1))
        else:
            raise AssertionError(f"no PyTorch translation for {node.op_type}")
        env[node.outputs[0]] = y
    return env[g.output_names[0]]


def test_resnet50_weight_gradients_match_pytorch():
    g, _ = lifted("resnet50")
    read = {name for node in g.nodes for name in node.inputs}  # the model carries one unused blob
    weights = [k for k, w in g.initializers.items() if w.dtype.kind == "f" and w.ndim >= 2 and k in read]
    gg = rg.gradient(g, wrt=weights, seed="input")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 3, 224, 224))
    u = rng.standard_normal((1, 1000))
    out = rg.Session(to_float64(gg), backend="reference").run({g.inputs[0].name: x, gg.inputs[-1].name: u})
    params = {k: torch.tensor(np.asarray(w, np.float64), requires_grad=k in weights)
              for k, w in g.initializers.items() if w.dtype.kind == "f"}
    expected = torch.autograd.grad((_torch_forward(g, x, params) * torch.tensor(u)).sum(), [params[k] for k in weights])
    for k, grad_name, t in zip(weights, gg.output_names[len(g.outputs):], expected, strict=True):
        np.testing.assert_allclose(out[grad_name], t.numpy(), rtol=1e-9, atol=1e-12 * float(np.abs(t.numpy()).max()),
                                   err_msg=k)
