"""`revgraph grad` and `revgraph check` as DESIGN.md section 2 says, and `rg.check_gradients`."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import DATA_DIR

import revgraph as rg
from revgraph.autodiff import registry
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo

MM = DATA_DIR / "pytorch-operator" / "test_operator_mm" / "model.onnx"  # Gemm of inputs "0" [2,3] and "1" [3,4]


def _mlp_file(path, seed=0):
    rng = np.random.default_rng(seed)
    w1, b1 = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    w2 = rng.standard_normal((5, 3)).astype(np.float32)
    g = Graph(
        [
            Node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            Node("Add", ["h", "b1"], ["hb"], name="bias"),
            Node("Tanh", ["hb"], ["a"], name="act"),
            Node("MatMul", ["a", "w2"], ["logits"], name="mm2"),
            Node("Mul", ["logits", "logits"], ["sq"], name="sq"),
            Node("ReduceMean", ["sq"], ["loss"], {"keepdims": 0}, name="mean"),
        ],
        [ValueInfo("x", np.float32, ("batch", 4))],
        [ValueInfo("loss", np.float32, ()), ValueInfo("logits", np.float32, ("batch", 3))],
        {"w1": w1, "b1": b1, "w2": w2},
    )
    rg.save(g, path)
    return w1, b1, w2


def _err_line(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_grad_writes_checked_model_with_grads_equal_to_torch(tmp_path, capsys):
    model = tmp_path / "mlp.onnx"
    w1, b1, w2 = _mlp_file(model)
    out = tmp_path / "mlp.grad.onnx"
    assert main(["grad", str(model), "-o", str(out), "--loss", "loss"]) == 0
    assert "w1_grad" in capsys.readouterr().out
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto, full_check=True)
    names = [o.name for o in proto.graph.output]
    assert names == ["loss", "logits", "x_grad", "w1_grad", "b1_grad", "w2_grad"]
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    res = rg.Session(str(out)).run({"x": x})
    ref = rg.Session(str(out), backend="reference").run({"x": x})
    t = {k: torch.tensor(v, requires_grad=True) for k, v in {"x": x, "w1": w1, "b1": b1, "w2": w2}.items()}
    loss = ((torch.tanh(t["x"] @ t["w1"] + t["b1"]) @ t["w2"]) ** 2).mean()
    loss.backward()
    for k in ("x", "w1", "b1", "w2"):
        np.testing.assert_allclose(res[f"{k}_grad"], t[k].grad.numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(ref[f"{k}_grad"], res[f"{k}_grad"], rtol=1e-5, atol=1e-6)


def test_grad_wrt_seed_input_and_opset(tmp_path):
    model = tmp_path / "mlp.onnx"
    w1, b1, w2 = _mlp_file(model)
    out = tmp_path / "vjp.onnx"
    assert main(["grad", str(model), "-o", str(out), "--loss", "logits", "--wrt", "w2", "h", "--seed", "input",
                 "--opset", "18"]) == 0
    proto = onnx.load(str(out))
    assert [o.version for o in proto.opset_import if o.domain == ""] == [18]
    assert "logits_grad" in [i.name for i in proto.graph.input]
    assert [o.name for o in proto.graph.output][-2:] == ["w2_grad", "h_grad"]
    rng = np.random.default_rng(2)
    x, u = rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    res = rg.Session(str(out)).run({"x": x, "logits_grad": u})
    a = np.tanh(x @ w1 + b1)
    np.testing.assert_allclose(res["w2_grad"], a.T @ u, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res["h_grad"], (u @ w2.T) * (1 - a**2), rtol=1e-4, atol=1e-5)


def test_grad_errors_exit_2_with_one_line(tmp_path, capsys):
    model = tmp_path / "mlp.onnx"
    _mlp_file(model)
    out = tmp_path / "o.onnx"
    assert main(["grad", str(model), "-o", str(out)]) == 2
    assert "2 outputs (loss, logits)" in _err_line(capsys)
    assert main(["grad", str(model), "-o", str(out), "--loss", "los"]) == 2
    assert "did you mean 'loss'" in _err_line(capsys)
    assert main(["grad", str(model), "-o", str(out), "--loss", "loss", "--wrt", "w3"]) == 2
    assert "'w3'" in _err_line(capsys)
    assert main(["grad", str(tmp_path / "missing.onnx"), "-o", str(out)]) == 2
    assert "no such file" in _err_line(capsys)
    assert not out.exists()


def test_grad_unconnected(tmp_path, capsys):
    g = Graph([Node("Exp", ["x"], ["y"], name="exp")],
              [ValueInfo("x", np.float32, (2,)), ValueInfo("z", np.float32, (2,))], [ValueInfo("y", np.float32, (2,))])
    rg.save(g, tmp_path / "m.onnx")
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx")]) == 0
    assert "warning: no path from 'z'" in capsys.readouterr().err
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "h.onnx"), "--unconnected", "error"]) == 2
    assert "no path from 'z'" in _err_line(capsys)
    assert not (tmp_path / "h.onnx").exists()


def test_check_passes_on_shipped_model(capsys):
    assert main(["check", str(MM)]) == 0
    text = capsys.readouterr().out
    assert "all 2 gradients agree" in text


def test_check_fails_on_a_wrong_rule(tmp_path, capsys, monkeypatch):
    g = Graph([Node("Sin", ["x"], ["y"], name="sin")], [ValueInfo("x", np.float32, (3,))],
              [ValueInfo("y", np.float32, (3,))])
    rg.save(g, tmp_path / "sin.onnx")
    assert main(["check", str(tmp_path / "sin.onnx")]) == 0
    capsys.readouterr()

    def wrong(ctx, node, cts):  # d sin = sin, not cos
        e = ctx.e
        return [e.op("Mul", [cts[0], e.op("Sin", [node.inputs[0]])])]

    monkeypatch.setitem(registry.RULES, "Sin", wrong)
    assert main(["check", str(tmp_path / "sin.onnx")]) == 1
    assert "1 of 1 values disagree" in capsys.readouterr().out


def test_check_gradients_api_with_inputs_and_intermediate_wrt():
    g = rg.load(MM)
    rng = np.random.default_rng(3)
    feeds = {"0": rng.standard_normal((2, 3)).astype(np.float32), "1": rng.standard_normal((3, 4)).astype(np.float32)}
    rep = rg.check_gradients(g, wrt=["0"], inputs=feeds)
    assert rep.ok and [r.name for r in rep.rows] == ["0"]
    assert rep.rows[0].max_rel < 1e-6
    with pytest.raises(rg.InputError, match="NaN"):
        rg.check_gradients(g, inputs={**feeds, "0": np.full((2, 3), np.nan, np.float32)})


def test_check_inputs_file(tmp_path, capsys):
    rng = np.random.default_rng(4)
    np.savez(tmp_path / "in.npz", **{"0": rng.standard_normal((2, 3)).astype(np.float32),
                                    "1": rng.standard_normal((3, 4)).astype(np.float32)})
    assert main(["check", str(MM), "--inputs", str(tmp_path / "in.npz"), "--seed", "5", "--rtol", "1e-3"]) == 0
    np.savez(tmp_path / "bad.npz", **{"0": np.zeros((2, 3), np.float32)})
    assert main(["check", str(MM), "--inputs", str(tmp_path / "bad.npz")]) == 2
    capsys.readouterr()


def test_grad_checkpoint_policies_agree(tmp_path, capsys):
    from kit.loops import body, graph, loop, n

    b = body([n("Mul", ["s_in", "x"], "s_out"), n("Sin", ["s_out"], "y")], [("s_in", "s_out")], scan=["y"],
             types={"s_in": (3,), "s_out": (3,)})
    g = graph([loop(b, "M", ["s0"], ["s", "Y"]), n("ReduceSum", ["Y"], "loss", keepdims=0)],
              {"x": (3,), "s0": (3,)}, ["loss"], {"M": np.array(9, np.int64)})
    rg.save(g, tmp_path / "loop.onnx")
    feeds = {"x": np.array([0.9, 1.1, -0.5]), "s0": np.array([0.3, 0.2, 0.1])}
    results = {}
    for policy in ("store", "recompute", "sqrt", "4"):
        out = tmp_path / f"{policy}.onnx"
        assert main(["grad", str(tmp_path / "loop.onnx"), "-o", str(out), "--checkpoint", policy]) == 0
        results[policy] = rg.Session(str(out)).run(feeds)
    for policy, res in results.items():
        for k in ("x_grad", "s0_grad"):
            np.testing.assert_allclose(res[k], results["store"][k], rtol=1e-12, err_msg=f"{policy} {k}")
    capsys.readouterr()
    assert main(["grad", str(tmp_path / "loop.onnx"), "-o", str(tmp_path / "bad.onnx"), "--checkpoint", "often"]) == 2
    assert "unknown checkpoint policy 'often'" in _err_line(capsys)


def test_relative_error_is_against_the_larger_value_and_never_below_atol():
    # loss = sum(x * w) + 1e-22 * sum(b): b's gradient is 1e-22 per element, below float64's resolution of a loss
    # near 1e3, so the central difference is exactly 0; the error 1e-22 is no relative error of 1e+278 (BERT's
    # biases showed such a figure, marked "yes")
    g = Graph([Node("Mul", ["x", "w"], ["xw"], name="mul"),
               Node("ReduceSum", ["xw"], ["a"], {"keepdims": 0}, name="sa"),
               Node("Mul", ["b", "c"], ["bc"], name="tiny"),
               Node("ReduceSum", ["bc"], ["t"], {"keepdims": 0}, name="st"),
               Node("Add", ["a", "t"], ["loss"], name="add")],
              [ValueInfo("x", np.float64, (4,))], [ValueInfo("loss", np.float64, ())],
              {"w": np.full(4, 250.0), "b": np.ones(4), "c": np.array(1e-22)})
    rep = rg.check_gradients(g, wrt=["b"], inputs={"x": np.ones(4)})
    row = rep.rows[0]
    assert row.ok and row.max_abs > 0
    assert row.max_rel <= row.max_abs / 1e-6  # atol's default
