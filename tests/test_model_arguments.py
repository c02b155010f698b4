"""The API takes what users have (issue 44, item 6): a path (``str`` or ``pathlib.Path``), an ``onnx.ModelProto``
or a :class:`revgraph.Graph` wherever a model is expected, as ``rg.Trainer`` does; a one-line ``repr`` of a
graph with the long form behind :meth:`Graph.describe`; ``Trainer.evaluate`` gives Python numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 3)).astype(np.float32)
W = RNG.standard_normal((3, 2)).astype(np.float32)


def _graph() -> Graph:
    """``loss = ReduceSum(Tanh(x @ w))``: x float32 [4, 3] an input, w [3, 2] an initializer."""
    return Graph(nodes=[Node("MatMul", ["x", "w"], ["h"], {}, "mm"), Node("Tanh", ["h"], ["t"], {}, "tanh"),
                        Node("ReduceSum", ["t"], ["loss"], {"keepdims": 0}, "sum")],
                 inputs=[ValueInfo("x", np.float32, (4, 3))], outputs=[ValueInfo("loss", np.float32, ())],
                 initializers={"w": W.copy()}, name="tiny")


@pytest.fixture
def forms(tmp_path) -> dict[str, object]:
    """The same model as each thing a user may have."""
    path = tmp_path / "tiny.onnx"
    rg.save(_graph(), path)
    return {"Graph": _graph(), "ModelProto": onnx.load(path), "str": str(path), "Path": Path(path)}


def _w_grad() -> np.ndarray:
    """d loss / d w = x^T (1 - tanh(x w)^2), in float64."""
    t = np.tanh(X.astype(np.float64) @ W.astype(np.float64))
    return X.astype(np.float64).T @ (1 - t**2)


def _run(graph, names=None) -> dict[str, np.ndarray]:
    return rg.Session(graph).run({"x": X}, names)


@pytest.mark.parametrize("kind", ["Graph", "ModelProto", "str", "Path"])
def test_gradient_of_each_form_is_the_analytic_gradient(forms, kind):
    gg = rg.gradient(forms[kind], loss="loss", wrt=["w"])
    np.testing.assert_allclose(_run(gg, ["w_grad"])["w_grad"], _w_grad(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["ModelProto", "str", "Path"])
def test_every_derivative_function_takes_each_form(forms, kind):
    """jvp, hvp, jacobian, hessian and check_gradients give what they give for the Graph itself; the Jacobian
    is checked against the analytic one too."""
    calls = {"jvp": lambda m: rg.jvp(m, outputs=["loss"], inputs=["x"]),
             "hvp": lambda m: rg.hvp(m, loss="loss", wrt=["x"]),
             "jacobian": lambda m: rg.jacobian(m, outputs=["loss"], inputs=["x"]),
             "hessian": lambda m: rg.hessian(m, loss="loss", wrt=["x"])}
    for name, call in calls.items():
        want, got = call(forms["Graph"]), call(forms[kind])
        feeds = {v.name: np.full(v.shape, 0.5, v.dtype) if v.name != "x" else X for v in want.inputs}
        a, b = rg.Session(want).run(feeds), rg.Session(got).run(feeds)
        assert a.keys() == b.keys(), name
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name} {k}")
    jac = rg.Session(rg.jacobian(forms[kind], outputs=["loss"], inputs=["x"])).run({"x": X})
    (j,) = [v for k, v in jac.items() if k != "loss"]
    t = np.tanh(X.astype(np.float64) @ W.astype(np.float64))
    np.testing.assert_allclose(np.reshape(j, X.shape), (1 - t**2) @ W.astype(np.float64).T, rtol=1e-5, atol=1e-6)
    report = rg.check_gradients(forms[kind], loss="loss", wrt=["w"])
    assert report.ok


@pytest.mark.parametrize("kind", ["ModelProto", "str", "Path"])
def test_memory_functions_and_session_take_each_form(forms, kind, tmp_path):
    gg = rg.gradient(forms["Graph"], loss="loss", wrt=["w"])
    path = tmp_path / "tiny.grad.onnx"
    rg.save(gg, path)
    given = {"ModelProto": onnx.load(path), "str": str(path), "Path": path}[kind]
    # the residual here is tanh(x w), kept for the Tanh VJP: 4 x 2 float32
    assert rg.saved_bytes(given) == rg.saved_bytes(gg) == 4 * 2 * 4
    assert rg.plan_memory(forms[kind]).saved_before == rg.plan_memory(forms["Graph"]).saved_before
    np.testing.assert_allclose(_run(given, ["w_grad"])["w_grad"], _w_grad(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("given,needle", [(5, "graph=5 (int): give a revgraph.Graph, an onnx.ModelProto or the path"),
                                          ("no/such/model.onnx", "no/such/model.onnx")])
def test_what_is_not_a_model_is_refused_in_one_line(given, needle):
    for f in (rg.gradient, rg.hessian, rg.jacobian, rg.saved_bytes, rg.check_gradients):
        with pytest.raises(rg.RevgraphError) as exc:
            f(given)
        assert needle in str(exc.value) and "\n" not in str(exc.value), (f.__name__, str(exc.value))


def test_graph_repr_is_one_line_of_counts_and_describe_is_the_long_form(forms):
    proto = forms["ModelProto"]
    g = rg.load(proto)
    want = (f"Graph('tiny', opset {proto.opset_import[0].version}, {len(proto.graph.node)} nodes, "
            f"{len(proto.graph.input)} input, {len(proto.graph.output)} output, {len(proto.graph.initializer)} "
            "initializer)")
    assert repr(g) == want == "Graph('tiny', opset 21, 3 nodes, 1 input, 1 output, 1 initializer)"
    long = g.describe()
    assert long.startswith("Graph(nodes=[") and "Tanh" in long and "name='tiny'" in long
    assert np.array2string(W, separator=", ")[:8] in long  # the initializer's values are in the long form
    two = Graph(nodes=[], inputs=[ValueInfo("a", np.float32, ()), ValueInfo("b", np.float32, ())],
                outputs=[], name="e", opsets={"": 23})
    assert repr(two) == "Graph('e', opset 23, 0 nodes, 2 inputs, 0 outputs, 0 initializers)"


def test_evaluate_returns_python_numbers():
    x = RNG.standard_normal((10, 3)).astype(np.float32)
    labels = RNG.integers(0, 2, 10).astype(np.int64)
    model = Graph(nodes=[Node("MatMul", ["x", "w"], ["logits"], {}, "mm")],
                  inputs=[ValueInfo("x", np.float32, ("N", 3))], outputs=[ValueInfo("logits", np.float32, ("N", 2))],
                  initializers={"w": W.copy()})
    result = rg.Trainer(model, "cross-entropy", optimizer="sgd").evaluate({"x": x, "labels": labels}, batch_size=4)
    assert type(result["loss"]) is float and type(result["accuracy"]) is float
    assert type(result["samples"]) is int and type(result["nonfinite"]) is int
    logits = torch.from_numpy(x.astype(np.float64) @ W.astype(np.float64))
    want = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels)).item()
    assert result["loss"] == pytest.approx(want, rel=1e-5)
    assert result["accuracy"] == pytest.approx(float(np.mean(logits.argmax(1).numpy() == labels)))
    assert json.loads(json.dumps(result)) == result  # (json.dumps refuses numpy scalars)


@pytest.mark.parametrize("kind", ["ModelProto", "str", "Path"])
def test_lora_functions_take_each_form(forms, kind, tmp_path):
    """rg.lora.add_adapters (and config, extract, merge_adapters, apply, save_adapters on its result's file) take
    a path or a ModelProto as they take the Graph: the adapters are at zero, so the model's output is unchanged,
    and with A and B set the merged weight is W + (alpha / r) A B."""
    lg = rg.lora.add_adapters(forms[kind], 1, 1.0, targets="w")
    assert rg.lora.config(lg)["rank"] == 1
    np.testing.assert_allclose(_run(lg)["loss"], _run(_graph())["loss"], rtol=1e-6)
    arrays, configuration = rg.lora.extract(lg)
    a, b = (n for n in sorted(arrays))
    arrays = {a: np.full(arrays[a].shape, 0.5, np.float32), b: np.full(arrays[b].shape, 0.25, np.float32)}
    rg.save(_graph(), tmp_path / "base.onnx")
    applied = rg.lora.apply(forms[kind], arrays, configuration, merge=True)
    low_rank = arrays[a] @ arrays[b] if arrays[a].shape[0] == W.shape[0] else (arrays[b] @ arrays[a])
    np.testing.assert_allclose(applied.initializers["w"], W + low_rank, rtol=1e-6)
    rg.save(rg.lora.apply(_graph(), arrays, configuration), tmp_path / "adapted.onnx")
    merged = rg.lora.merge_adapters(str(tmp_path / "adapted.onnx"))
    np.testing.assert_allclose(merged.initializers["w"], W + low_rank, rtol=1e-6)
    assert rg.lora.save_adapters(tmp_path / "adapters.npz", str(tmp_path / "adapted.onnx"))[0] == 2
