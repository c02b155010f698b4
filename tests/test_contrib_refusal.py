"""Operators outside ONNX's standard set (issue 41, item 5): a domain imported but used by no node loads and
differentiates; a node without a rule is refused where it must be differentiated, in one line naming the
operator and the node; ``revgraph info`` shows such files (exit 0) and names what revgraph cannot
differentiate."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

import revgraph as rg
from revgraph.autodiff.registry import contrib_operators
from revgraph.cli import main

#: the domains onnxruntime's transformer optimizer imports whatever the model uses
OPTIMIZER_DOMAINS = ("ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview.training", "com.microsoft",
                     "com.microsoft.experimental", "com.microsoft.nchwc", "com.ms.internal.nhwc", "org.pytorch.aten")
W = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [2.0, 1.0, 0.75]], np.float32)


def _model(middle: list, imports=("com.microsoft",)) -> onnx.ModelProto:
    """loss = sum(middle(x @ w)); ``middle``: nodes from ``y`` to ``z`` (empty: z is y)."""
    nodes = [h.make_node("MatMul", ["x", "w"], ["y" if middle else "z"], name="mm"), *middle,
             h.make_node("ReduceSum", ["z"], ["loss"], keepdims=0, name="total")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, [3, 3])],
                     [h.make_tensor_value_info("loss", TP.FLOAT, [])], [nh.from_array(W, "w")])
    opsets = [h.make_opsetid("", 21), *(h.make_opsetid(d, 1) for d in imports)]
    return h.make_model(g, opset_imports=opsets)


def test_domains_imported_and_unused_are_accepted(tmp_path):
    model = _model([], OPTIMIZER_DOMAINS)
    onnx.save(model, tmp_path / "m.onnx")
    x = np.arange(9, dtype=np.float32).reshape(3, 3) / 4
    out = rg.Session(rg.gradient(rg.load(tmp_path / "m.onnx"), "loss", wrt=["w"])).run({"x": x})
    # d sum(x @ w) / dw[i, j] = sum_k x[k, i]
    np.testing.assert_allclose(out["w_grad"], np.repeat(x.sum(0)[:, None], 3, axis=1), rtol=1e-6)
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx")]) == 0


def _unsupported(tmp_path) -> str:
    # com.microsoft.Inverse: a contrib operator onnxruntime runs and revgraph has no rule for
    model = _model([h.make_node("Inverse", ["y"], ["z"], name="inv7", domain="com.microsoft")])
    onnx.checker.check_model(model, full_check=True)
    path = str(tmp_path / "inv.onnx")
    onnx.save(model, path)
    return path


def test_a_contrib_node_without_a_rule_is_refused_naming_the_operator_and_node(tmp_path, capsys):
    path = _unsupported(tmp_path)
    g = rg.load(path)
    x = np.eye(3, dtype=np.float32) + 1
    np.testing.assert_allclose(rg.Session(g).run({"x": x})["loss"], np.linalg.inv(x @ W).sum(), rtol=1e-4)
    with pytest.raises(rg.GraphError) as info:
        rg.gradient(g, "loss", wrt=["w"])
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("unsupported operator com.microsoft.Inverse (node 'inv7'); supported contrib operators: ")
    assert msg.endswith(", ".join(contrib_operators()) or "none")
    capsys.readouterr()
    assert main(["grad", path, "-o", str(tmp_path / "g.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unsupported operator com.microsoft.Inverse (node 'inv7')" in err
    assert not (tmp_path / "g.onnx").exists()
    # off the path to the loss, the node is the forward's own: the gradient is written
    assert main(["grad", path, "--wrt", "x", "--loss", "y", "-o", str(tmp_path / "y.onnx")]) == 0


def test_every_unsupported_node_is_named_in_one_line():
    model = _model([h.make_node("Inverse", ["y"], ["v"], name="a", domain="com.microsoft"),
                    h.make_node("Frob", ["v"], ["z"], name="b", domain="com.acme")], ("com.microsoft", "com.acme"))
    with pytest.raises(rg.GraphError, match=r"^unsupported operators com\.microsoft\.Inverse \(node 'a'\), "
                                            r"com\.acme\.Frob \(node 'b'\); supported contrib operators: "):
        rg.gradient(rg.load(model), "loss", wrt=["w"])


def test_info_shows_a_file_with_contrib_operators(tmp_path, capsys):
    path = _unsupported(tmp_path)
    capsys.readouterr()
    assert main(["info", path]) == 0
    text = capsys.readouterr().out
    assert "com.microsoft:Inverse" in text
    assert "Operators revgraph cannot differentiate: com.microsoft.Inverse (1 node)" in text
    # a standard model: nothing listed
    onnx.save(_model([]), tmp_path / "plain.onnx")
    assert main(["info", str(tmp_path / "plain.onnx")]) == 0
    assert "cannot differentiate" not in capsys.readouterr().out


def test_onnxruntime_schemas_check_contrib_signatures():
    # onnxruntime's schemas: Inverse takes 1 input; SimplifiedLayerNormalization (written in the default domain
    # by onnxruntime-genai's builder, not an ONNX operator) loads
    bad = _model([h.make_node("Inverse", ["y", "y"], ["z"], name="inv2", domain="com.microsoft")])
    with pytest.raises(rg.GraphError, match=r"'inv2' \(Inverse\).* has 2 inputs; Inverse takes 1"):
        rg.load(bad)
    scale = nh.from_array(np.ones(3, np.float32), "gamma")
    model = _model([h.make_node("SimplifiedLayerNormalization", ["y", "gamma"], ["z"], name="sln", axis=-1,
                                epsilon=1e-6)], ())
    model.graph.initializer.append(scale)
    g = rg.load(model)
    x = np.arange(9, dtype=np.float32).reshape(3, 3) / 4 - 1
    y = x @ W
    expected = (y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6)).sum()
    np.testing.assert_allclose(rg.Session(g).run({"x": x})["loss"], expected, rtol=1e-5)
    # an operator unknown to ONNX and onnxruntime in the default domain is still refused (not valid ONNX)
    with pytest.raises(rg.GraphError, match="unknown operator 'Frobnicate'"):
        rg.load(_model([h.make_node("Frobnicate", ["y"], ["z"], name="f")], ()))
