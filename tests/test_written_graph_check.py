"""ONNX's full check of a written graph runs on the temporary file before it replaces OUT (onnx infers a file's
shapes in place, a model given as bytes on a copy: half the check's memory; docs/benchmarks.md, "Build
memory"): every written graph still passes ``check_model(full_check=True)``, a graph that fails it leaves
nothing behind, and a FIFO or device output is checked from the bytes before anything is written to it."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx.checker
import pytest
from kit.harness import one_line_error
from onnx import TensorProto, helper, numpy_helper

from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo


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


def test_the_written_graph_is_fully_checked_before_it_replaces_out(tmp_path, monkeypatch):
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
    # checked in parts as the pieces are written (onnx_check.PartCheck): the skeleton, then the one piece of
    # nodes, each with strict shape inference and before the rename
    pieces = [s for s in seen if s[0] == "ModelProto"]
    assert len(pieces) >= 2 and all(full and not renamed for _, full, renamed in pieces), seen
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


# ------------------------------------------- attributing a failed check to the model's node (issue 28 round 3)

def _loop_body() -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Mul", ["h_in", "w"], ["m"], name="body_mul"),
         helper.make_node("Sin", ["m"], ["h_out"], name="body_sin"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_id")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [3])])


def _save(path, nodes, inputs, outputs, value_info=()) -> str:
    g = helper.make_graph(nodes, "m", inputs, outputs, value_info=list(value_info),
                          initializer=[helper.make_tensor("trip", TensorProto.INT64, [], [3]),
                                       helper.make_tensor("w", TensorProto.FLOAT, [3], [0.5, 1.0, 1.5])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return str(path)


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])


def contradiction_in_if(path) -> str:
    """The hidden contradiction (a Loop, then ReduceSum 'inner_sum' declared rank 1) inside an If branch: ONNX's
    message names the backward If (revgraph's) first and 'inner_sum' innermost (was exit 3)."""
    then = helper.make_graph([helper.make_node("Loop", ["trip", "", "x"], ["hT"], body=_loop_body(), name="loop"),
                              helper.make_node("ReduceSum", ["hT"], ["r"], keepdims=0, name="inner_sum")], "then", [],
                             [helper.make_tensor_value_info("r", TensorProto.FLOAT, [1])])
    other = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["r2"], keepdims=1, name="else_sum")], "else", [],
                              [helper.make_tensor_value_info("r2", TensorProto.FLOAT, [1])])
    return _save(path, [helper.make_node("If", ["b"], ["y"], then_branch=then, else_branch=other, name="if")],
                 [X, helper.make_tensor_value_info("b", TensorProto.BOOL, [])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])


def contradiction_in_loop_body(path) -> str:
    """The same inside an outer Loop's body (the inner sum's output declared rank 1 in the body's value_info):
    ONNX reports several errors, the first naming 'outer_loop' then 'inner_sum' (jacobian: was exit 3)."""
    body = helper.make_graph(
        [helper.make_node("Loop", ["trip", "", "g_in"], ["g_t"], body=_loop_body(), name="inner_loop"),
         helper.make_node("ReduceSum", ["g_t"], ["r"], keepdims=0, name="inner_sum"),
         helper.make_node("Add", ["g_in", "r"], ["g_out"], name="outer_add"),
         helper.make_node("Identity", ["c_in"], ["c_out"], name="outer_id")], "outer_body",
        [helper.make_tensor_value_info("j", TensorProto.INT64, []),
         helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("g_in", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("g_out", TensorProto.FLOAT, [3])],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [1])])
    return _save(path, [helper.make_node("Loop", ["trip", "", "x"], ["gT"], body=body, name="outer_loop"),
                        helper.make_node("ReduceSum", ["gT"], ["y"], keepdims=0, name="sum")],
                 [X], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])


@pytest.mark.parametrize("command", ["grad", "hvp", "jacobian"])
@pytest.mark.parametrize("build, node", [(hidden_contradiction, "sum"), (contradiction_in_if, "inner_sum"),
                                         (contradiction_in_loop_body, "inner_sum")],
                         ids=["top level", "in an If branch", "in a Loop body"])
def test_a_failed_check_caused_by_the_models_node_names_it(tmp_path, capsys, build, node, command):
    """ONNX's model check passes each model (a Loop hides its carried shapes); the written graph's check fails at
    the model's node, at any depth, and that is bad input: exit 2 naming the node, nothing written. (A command
    whose graph never reaches the contradiction writes a graph that passes the check: exit 0.)"""
    model = build(tmp_path / "m.onnx")
    onnx.checker.check_model(onnx.load(model), full_check=True)  # the model alone passes
    code = main([command, model, "-o", str(tmp_path / "g.onnx")])
    err = capsys.readouterr().err
    if code == 0:
        onnx.checker.check_model(onnx.load(tmp_path / "g.onnx"), full_check=True)
        return
    one_line_error(code, err, "declared types disagree", f"its node {node!r} (ReduceSum)", "(0) vs (1)")
    assert not (tmp_path / "g.onnx").exists()


def _fake(text: str) -> Exception:
    return onnx.shape_inference.InferenceError(text)


def _graph_with(declared_shape) -> Graph:
    """A model node 'mm' (MatMul of x [2, 3] and W [3, 4]) whose output is declared ``declared_shape``, and a
    node revgraph built from it ('grad/mm/Transpose')."""
    return Graph([Node("MatMul", ["x", "W"], ["z"], {}, "mm"),
                  Node("Transpose", ["z"], ["t"], {}, "grad/mm/Transpose")],
                 [ValueInfo("x", np.float32, (2, 3))], [ValueInfo("t", np.float32, None)],
                 {"W": np.ones((3, 4), np.float32)}, {"z": ValueInfo("z", np.float32, declared_shape)})


def test_a_failure_at_revgraphs_node_built_from_an_inconsistent_node_names_that_node():
    """The failing node is revgraph's ('grad/mm/...'), built from the model's node 'mm' whose declared output
    type disagrees with what ONNX infers from its inputs: exit 2 naming 'mm' and what is wrong. Built from a
    consistent node, the same failure is revgraph's own (nothing raised here: the caller's exit 3)."""
    from revgraph.cli.write import refuse_inconsistent_model
    from revgraph.errors import RevgraphError

    exc = _fake("[ShapeInferenceError] Inference error(s): (op_type:Transpose, node name: grad/mm/Transpose): "
                "[ShapeInferenceError] something about perm")
    bad = _graph_with((2, 5))
    with pytest.raises(RevgraphError, match=r"node 'mm' \(MatMul\) of the model declares its output 'z' as "
                                            r"float32\[2,5\] but computes float32\[2,4\] from its inputs; ONNX's "
                                            r"check fails at 'grad/mm/Transpose'"):
        refuse_inconsistent_model(exc, bad, "gradient graph", bad)
    good = _graph_with((2, 4))
    refuse_inconsistent_model(exc, good, "gradient graph", good)  # consistent: revgraph's bug, not refused
    # a node of the model named by the message (any depth, innermost first) is refused as before
    exc = _fake("[ShapeInferenceError] Inference error(s): (op_type:Loop, node name: grad/loop/Loop): "
                "[ShapeInferenceError] Inference error(s): (op_type:MatMul, node name: mm): Inferred shape differs")
    with pytest.raises(RevgraphError, match=r"its node 'mm' \(MatMul\) computes \(Inferred shape differs\)"):
        refuse_inconsistent_model(exc, good, "gradient graph", good)
