"""The catalogue of bad inputs: each gives its exit code and a one-line message that names the problem, and a
failed command leaves no output file behind. (Missing, non-ONNX and truncated files, bad npz files, unknown
names, several outputs without --loss: tests/test_cli.py and tests/test_cli_grad.py.)"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from loopkit import body, graph, loop, n
from onnx import TensorProto, helper

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo


def one_line(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def raw_model(path, nodes, inputs=("x",), outputs=("y",), opsets=(("", 21),), inits=()):
    """Write a model with onnx.helper, bypassing revgraph (so it can be as broken as needed)."""
    g = helper.make_graph(
        nodes, "broken",
        [helper.make_tensor_value_info(i, TensorProto.FLOAT, [2]) for i in inputs],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2]) for o in outputs],
        initializer=list(inits),
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 10
    onnx.save(m, str(path))
    return path


def test_missing_external_data(tmp_path, capsys):
    g = Graph([Node("Add", ["x", "w"], ["y"], name="add")], [ValueInfo("x", np.float32, (1024,))],
              [ValueInfo("y", np.float32, (1024,))], {"w": np.ones(1024, np.float32)})
    model = rg.to_onnx(g)
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    assert main(["info", str(tmp_path / "m.onnx")]) == 0
    capsys.readouterr()
    os.remove(tmp_path / "m.data")
    assert main(["info", str(tmp_path / "m.onnx")]) == 2
    one_line(capsys, "external data", ".data file")


def test_cycle(tmp_path, capsys):
    path = raw_model(tmp_path / "c.onnx", [helper.make_node("Add", ["x", "b"], ["a"], name="A"),
                                           helper.make_node("Relu", ["a"], ["b"], name="B"),
                                           helper.make_node("Identity", ["b"], ["y"], name="out")])
    assert main(["grad", str(path), "-o", str(tmp_path / "g.onnx")]) == 2
    one_line(capsys, "'A' (Add)", "'b'", "'B' (Relu)", "cycle")
    assert not (tmp_path / "g.onnx").exists()


def test_name_read_but_never_written(tmp_path, capsys):
    path = raw_model(tmp_path / "u.onnx", [helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")])
    assert main(["run", str(path)]) == 2
    one_line(capsys, "'adder' (Add)", "'ghost'")


@pytest.mark.parametrize("inputs,words", [(["x", "x", "x"], "3 inputs"), (["x"], "1 inputs")])
def test_wrong_arity(tmp_path, capsys, inputs, words):
    path = raw_model(tmp_path / "a.onnx", [helper.make_node("Add", inputs, ["y"], name="adder")])
    assert main(["info", str(path)]) == 2
    one_line(capsys, "'adder' (Add)", words)


def test_unknown_op_and_unknown_domain(tmp_path, capsys):
    path = raw_model(tmp_path / "op.onnx", [helper.make_node("Frobnicate", ["x"], ["y"], name="f")])
    assert main(["info", str(path)]) == 2
    one_line(capsys, "'f' (Frobnicate)", "unknown operator")
    path = raw_model(tmp_path / "dom.onnx", [helper.make_node("Fused", ["x"], ["y"], name="f", domain="com.acme")],
                     opsets=(("", 21), ("com.acme", 1)))
    assert main(["info", str(path)]) == 2
    one_line(capsys, "'com.acme'")


def test_ops_without_rules_all_listed(tmp_path, capsys):
    nodes = [helper.make_node("Det", ["x"], ["d1"], name="det_a"), helper.make_node("Det", ["x"], ["d2"], name="det_b"),
             helper.make_node("Add", ["d1", "d2"], ["y"], name="sum")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(m, str(tmp_path / "det.onnx"))
    assert main(["grad", str(tmp_path / "det.onnx"), "-o", str(tmp_path / "g.onnx")]) == 2
    one_line(capsys, "2 node(s)", "'det_a' (Det)", "'det_b' (Det)")
    assert not (tmp_path / "g.onnx").exists()


def test_integer_wrt(tmp_path, capsys):
    g = Graph([Node("Cast", ["i"], ["f"], {"to": 1}, "cast"), Node("Mul", ["f", "x"], ["y"], name="mul")],
              [ValueInfo("i", np.int64, (2,)), ValueInfo("x", np.float32, (2,))], [ValueInfo("y", np.float32, (2,))])
    rg.save(g, tmp_path / "m.onnx")
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx"), "--wrt", "i"]) == 2
    one_line(capsys, "'i' is int64", "floating-point")


def test_seed_input_needs_the_cotangent_at_run_time(tmp_path, capsys):
    g = Graph([Node("Sin", ["x"], ["y"], name="sin")], [ValueInfo("x", np.float32, (2,))], [ValueInfo("y", np.float32, (2,))])
    rg.save(g, tmp_path / "m.onnx")
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx"), "--seed", "input"]) == 0
    capsys.readouterr()
    np.savez(tmp_path / "in.npz", x=np.ones(2, np.float32))
    assert main(["run", str(tmp_path / "g.onnx"), "--inputs", str(tmp_path / "in.npz")]) == 2
    one_line(capsys, "missing input(s) 'y_grad'")


def test_loop_whose_carried_shape_changes(tmp_path, capsys):
    b = body([n("Concat", ["s_in", "x"], "s_out", axis=0)], [("s_in", "s_out")], types={"s_in": (2,), "s_out": (4,)})
    g = graph([loop(b, "M", ["x"], ["s"]), n("ReduceSum", ["s"], "loss", keepdims=0)], {"x": (2,)}, ["loss"],
              {"M": np.array(2, np.int64)})
    with pytest.raises(rg.GraphError, match="enters an iteration with shape \\[2\\].*shape \\[4\\]"):
        rg.gradient(g)
    # declared without static shapes, it fails at run time with a one-line reason
    b = body([n("Concat", ["s_in", "x"], "s_out", axis=0), n("Sin", ["s_out"], "y")], [("s_in", "s_out")], scan=["y"])
    g = graph([loop(b, "M", ["x"], ["s", "Y"]), n("ReduceSum", ["Y"], "loss", keepdims=0)], {"x": (2,)}, ["loss"],
              {"M": np.array(2, np.int64)})
    with pytest.raises(rg.RevgraphError, match="change shape between iterations"):
        rg.Session(g).run({"x": np.ones(2)})


def test_check_with_bad_inputs(tmp_path, capsys):
    g = Graph([Node("Sin", ["x"], ["y"], name="sin")], [ValueInfo("x", np.float32, (2,))], [ValueInfo("y", np.float32, (2,))])
    rg.save(g, tmp_path / "m.onnx")
    np.savez(tmp_path / "shape.npz", x=np.ones(3, np.float32))
    assert main(["check", str(tmp_path / "m.onnx"), "--inputs", str(tmp_path / "shape.npz")]) == 2
    one_line(capsys, "'x'", "shape [3]")
    np.savez(tmp_path / "dtype.npz", x=np.ones(2, np.int32))
    assert main(["check", str(tmp_path / "m.onnx"), "--inputs", str(tmp_path / "dtype.npz")]) == 2
    one_line(capsys, "'x'", "int32")
    np.savez(tmp_path / "nan.npz", x=np.array([1.0, np.inf], np.float32))
    assert main(["check", str(tmp_path / "m.onnx"), "--inputs", str(tmp_path / "nan.npz")]) == 2
    one_line(capsys, "'x'", "NaN or infinite")


def test_save_is_atomic(tmp_path, monkeypatch):
    g = Graph([Node("Sin", ["x"], ["y"], name="sin")], [ValueInfo("x", np.float32, (2,))], [ValueInfo("y", np.float32, (2,))])
    target = tmp_path / "out.onnx"
    rg.save(g, target)
    good = target.read_bytes()

    def crash(self):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", crash)
    with pytest.raises(KeyboardInterrupt):
        rg.save(g, target)
    monkeypatch.undo()
    assert target.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]


def test_check_with_bad_tolerance_or_a_non_finite_forward(tmp_path, capsys):
    g = Graph([Node("Sqrt", ["x"], ["y"], name="sqrt")], [ValueInfo("x", np.float32, (2,))], [ValueInfo("y", np.float32, (2,))])
    rg.save(g, tmp_path / "m.onnx")
    assert main(["check", str(tmp_path / "m.onnx"), "--rtol", "-1"]) == 2
    one_line(capsys, "tolerances must be >= 0")
    np.savez(tmp_path / "neg.npz", x=np.array([-1.0, 4.0], np.float32))
    assert main(["check", str(tmp_path / "m.onnx"), "--inputs", str(tmp_path / "neg.npz")]) == 1
    assert "NaN or infinite values" in capsys.readouterr().out
    np.savez(tmp_path / "pos.npz", x=np.array([1.0, 4.0], np.float32))
    assert main(["check", str(tmp_path / "m.onnx"), "--inputs", str(tmp_path / "pos.npz")]) == 0
