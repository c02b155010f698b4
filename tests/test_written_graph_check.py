"""ONNX's full check of a written graph runs on the temporary file before it replaces OUT (onnx infers a file's
shapes in place, a model given as bytes on a copy: half the check's memory; docs/benchmarks.md, "Build
memory"): every written graph still passes ``check_model(full_check=True)``, a graph that fails it leaves
nothing behind, and a FIFO or device output is checked from the bytes before anything is written to it."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx.checker
from harness import one_line_error
from onnx import TensorProto, helper, numpy_helper

from revgraph.cli import main


def small_model(path) -> str:
    """y = ReduceSum(Tanh(x @ W)); x float32[2, 3], W [3, 2]."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Tanh", ["h"], ["t"], name="t"),
         helper.make_node("ReduceSum", ["t"], ["y"], keepdims=0, name="sum")], "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) / 7, "W")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return str(path)


def hidden_contradiction(path) -> str:
    """A model whose declared output rank (1) a Loop hides from ONNX's check of the model; the gradient graph's
    full check finds it at the model's node 'sum' (bad input)."""
    b = helper.make_graph(
        [helper.make_node("Mul", ["h_in", "w"], ["m"]), helper.make_node("Sin", ["m"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [3])])
    g = helper.make_graph(
        [helper.make_node("Loop", ["trip", "", "x"], ["h"], body=b, name="loop"),
         helper.make_node("ReduceSum", ["h"], ["y"], keepdims=0, name="sum")], "hidden",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=[helper.make_tensor("trip", TensorProto.INT64, [], [3]),
                     helper.make_tensor("w", TensorProto.FLOAT, [3], [0.5, 1.0, 1.5])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return str(path)


def test_the_temporary_file_is_fully_checked_before_it_replaces_out(tmp_path, monkeypatch):
    seen = []
    real = onnx.checker.check_model

    def spy(model, full_check=False, *args, **kwargs):
        if isinstance(model, (str, os.PathLike)):
            seen.append((os.path.basename(model), full_check, os.path.exists(tmp_path / "g.onnx")))
        else:
            seen.append((type(model).__name__, full_check, os.path.exists(tmp_path / "g.onnx")))
        return real(model, full_check, *args, **kwargs)

    monkeypatch.setattr(onnx.checker, "check_model", spy)
    assert main(["grad", small_model(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx")]) == 0
    files = [s for s in seen if s[0].startswith(".revgraph-")]
    assert len(files) == 1 and files[0][1] is True and files[0][2] is False  # checked before the rename
    assert sorted(os.listdir(tmp_path)) == ["g.onnx", "m.onnx"]
    written = onnx.load(str(tmp_path / "g.onnx"))
    real(written, full_check=True)
    assert {o.name for o in written.graph.output} == {"y", "x_grad", "W_grad"}


def test_a_graph_failing_the_check_leaves_out_and_no_temporary_file(tmp_path, capsys):
    model = hidden_contradiction(tmp_path / "m.onnx")
    out = tmp_path / "g.onnx"
    out.write_bytes(b"old")
    one_line_error(main(["grad", model, "-o", str(out)]), capsys.readouterr().err, "declared types disagree", "'sum'")
    assert out.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["g.onnx", "m.onnx"]


def test_a_fifo_output_is_checked_before_it_is_written(tmp_path, capsys):
    # the FIFO has no reader: a graph that fails the check is refused at the check, before the wait for one
    os.mkfifo(tmp_path / "f.onnx")
    one_line_error(main(["grad", hidden_contradiction(tmp_path / "m.onnx"), "-o", str(tmp_path / "f.onnx")]),
                   capsys.readouterr().err, "declared types disagree")
    assert sorted(os.listdir(tmp_path)) == ["f.onnx", "m.onnx"]


def test_dev_null_output_gets_a_checked_graph(tmp_path, capsys):
    assert main(["grad", small_model(tmp_path / "m.onnx"), "-o", os.devnull]) == 0
    assert "wrote /dev/null" in capsys.readouterr().out
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
