"""Written graphs lose the Dropout nodes that draw nothing (portable.py, through onnx_io.to_onnx): a ratio that
is a constant 0, or a training mode absent or a constant false. The gradient written by ``revgraph grad`` and
the training graph of ``Trainer.save_training_graph`` have no Dropout left and still equal PyTorch; a Dropout
that draws (ratio 0.5 in training mode, or a ratio given at run time) is kept."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.onnx_io.portable import identity_dropouts

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 5)).astype(np.float32)
W = RNG.standard_normal((5, 3)).astype(np.float32)


def _model(ratio, training, mask_read: bool = False) -> Graph:
    """``loss = sum(relu(Dropout(x W)))`` (plus ``sum(cast(mask))`` when ``mask_read``); ``ratio`` /
    ``training``: a float or bool (initializers), ``"input"`` (a graph input) or ``None`` (absent)."""
    inits = {"W": W}
    inputs = [ValueInfo("x", np.float32, X.shape)]
    names = []
    for key, value, dtype in (("ratio", ratio, np.float32), ("training", training, np.bool_)):
        if value is None:
            names.append("")
        elif value == "input":
            inputs.append(ValueInfo(key, dtype, ()))
            names.append(key)
        else:
            inits[key] = np.array(value, dtype)
            names.append(key)
    while names and not names[-1]:
        names.pop()
    nodes = [Node("MatMul", ["x", "W"], ["h"], name="mm"),
             Node("Dropout", ["h", *names], ["d", "mask"] if mask_read else ["d"], {"seed": 3}, "drop"),
             Node("Relu", ["d"], ["r"], name="relu"), Node("ReduceSum", ["r"], ["loss"], {"keepdims": 0}, "sum")]
    if mask_read:
        nodes += [Node("Cast", ["mask"], ["mf"], {"to": 1}, "cast"),
                  Node("ReduceSum", ["mf"], ["count"], {"keepdims": 0}, "count"),
                  Node("Add", ["loss", "count"], ["total"], name="add")]
    out = "total" if mask_read else "loss"
    return Graph(nodes, inputs, [ValueInfo(out, np.float32, ())], inits)


def _torch_grad_w() -> np.ndarray:
    """d sum(relu(x W)) / dW (Dropout at p = 0 is the identity in PyTorch too)."""
    w = torch.tensor(W, requires_grad=True)
    torch.nn.functional.dropout(torch.tensor(X) @ w, p=0.0, training=True).relu().sum().backward()
    return w.grad.numpy()


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("ratio,training", [(0.0, True), (0.3, None), (0.3, False), (None, None)])
def test_grad_cli_writes_no_dropout_and_the_same_gradient(tmp_path, ratio, training):
    src, out = tmp_path / "m.onnx", tmp_path / "g.onnx"
    onnx.save(onnx.helper.make_model(rg.onnx_io.graph_to_proto(_model(ratio, training)),
                                     opset_imports=[onnx.helper.make_opsetid("", 21)]), src)
    assert main(["grad", str(src), "-o", str(out), "--loss", "loss", "--wrt", "W"]) == 0
    written = onnx.load(out)
    assert "Dropout" not in _ops(written)
    sess = ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, dw = sess.run(None, {"x": X})
    np.testing.assert_allclose(dw, _torch_grad_w(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(loss, np.maximum(X @ W, 0).sum(), rtol=1e-6)


def test_a_read_mask_becomes_all_true():
    g = _model(0.0, True, mask_read=True)
    rewritten = identity_dropouts(g)
    assert [n.op_type for n in g.nodes].count("Dropout") == 1  # the caller's graph is not changed
    assert "Dropout" not in [n.op_type for n in rewritten.nodes]
    got = rg.Session(rewritten).run({"x": X})["total"]
    # ORT runs the original training-mode Dropout at ratio 0: the mask is all true (12 elements)
    proto = onnx.helper.make_model(rg.onnx_io.graph_to_proto(g), opset_imports=[onnx.helper.make_opsetid("", 21)])
    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got, np.maximum(X @ W, 0).sum() + X.shape[0] * W.shape[1], rtol=1e-6)


@pytest.mark.parametrize("ratio,training", [(0.5, True), (None, True), ("input", True), (0.5, "input")])
def test_dropouts_that_may_draw_are_kept(ratio, training):
    g = _model(ratio, training)
    assert identity_dropouts(g) is g
    assert "Dropout" in _ops(rg.to_onnx(g))


def test_training_graph_has_no_dropout_and_trains_as_torch(tmp_path):
    """A training-mode Dropout at ratio 0 in a model trained one SGD step: the saved step graph has none, and
    its new weight equals torch.optim.SGD's."""
    g = _model(0.0, True)
    g.outputs = [ValueInfo("r", np.float32, (4, 3))]
    trainer = rg.Trainer(g, "mse", "sgd", params=["W"])  # (ratio, a float initializer, stays fixed)
    path = tmp_path / "step.onnx"
    trainer.save_training_graph(path)
    written = onnx.load(path)
    assert "Dropout" not in _ops(written)
    tg = trainer.spec
    target = RNG.standard_normal((4, 3)).astype(np.float32)
    feeds = {**tg.initial_state(), "x": X, tg.labels: target}
    sess = ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    w = torch.tensor(W, requires_grad=True)
    opt = torch.optim.SGD([w], lr=tg.optimizer.lr)
    torch.nn.functional.mse_loss(torch.relu(torch.tensor(X) @ w), torch.tensor(target)).backward()
    opt.step()
    np.testing.assert_allclose(got[tg.new_params["W"]], w.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_constants_only_the_dropout_read_go():
    g = _model(0.0, True)
    g.nodes.insert(0, Node("Constant", [], ["ratio2"], {"value": np.array(0.0, np.float32)}, "c"))
    g.nodes[2].inputs[1] = "ratio2"  # the Dropout reads a Constant node's ratio; "training" stays read by Not
    del g.initializers["ratio"]
    g.nodes.append(Node("Not", ["training"], ["nt"], name="not"))
    g.outputs.append(ValueInfo("nt", np.bool_, ()))
    s = identity_dropouts(g)
    assert [n.op_type for n in s.nodes] == ["MatMul", "Identity", "Relu", "ReduceSum", "Not"]
    assert sorted(s.initializers) == ["W", "training"]
    assert [n.op_type for n in g.nodes][:3] == ["Constant", "MatMul", "Dropout"]  # the caller's graph is kept
    np.testing.assert_allclose(rg.Session(s).run({"x": X})["loss"], np.maximum(X @ W, 0).sum(), rtol=1e-6)
