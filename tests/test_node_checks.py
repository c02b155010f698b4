"""Forward nodes whose constant inputs or attributes do not fit their inputs' shapes (issue 28, part 3): a Pad
with 80000 pads on a rank-4 input (jvp: exit 3, std::bad_alloc under a memory limit), and the models ONNX's own
inference accepts whose written gradient it refuses (ScatterND, ScatterElements, AffineGrid, Attention,
SoftmaxCrossEntropyLoss). grad and jvp refuse each with exit 2 and one line naming the node."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from kit.harness import one_line_error
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from revgraph.cli import main


def _model(op, inputs, inits=(), opset=18, **attrs):
    names = [*inputs, *[n for n, _ in inits]]
    ins = [h.make_tensor_value_info(n, T.INT64 if n in ("labels", "size") else T.FLOAT, s) for n, s in inputs.items()]
    g = h.make_graph([h.make_node(op, names, ["y"], name="n1", **attrs)], "m", ins,
                     [h.make_value_info("y", h.make_tensor_type_proto(T.FLOAT, None))], initializer=[nh.from_array(v, n) for n, v in inits])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


I = np.int64
CASES = {
    "pad_80000": (_model("Pad", {"x": [1, 3, 4, 5]}, [("pads", np.ones(80000, I))], mode="constant"), "pads has 80000 values"),
    "slice_lengths": (_model("Slice", {"x": [4, 4]}, [("s", np.zeros(3, I)), ("e", np.ones(2, I))]), "different lengths"),
    "slice_axes": (_model("Slice", {"x": [4, 4]}, [("s", np.zeros(1, I)), ("e", np.ones(1, I)), ("a", np.array([5], I))]), "out of range"),
    "slice_step_0": (_model("Slice", {"x": [4, 4]}, [("s", np.zeros(1, I)), ("e", np.ones(1, I)), ("a", np.zeros(1, I)), ("st", np.zeros(1, I))]), "steps"),
    "resize_scales": (_model("Resize", {"x": [1, 1, 4, 4]}, [("roi", np.zeros(0, np.float32)), ("sc", np.ones(3, np.float32))]), "scales has 3 values"),
    "tile_repeats": (_model("Tile", {"x": [4, 4]}, [("r", np.array([2, 2, 2], I))]), "repeats has 3 values"),
    "expand_shape": (_model("Expand", {"x": [4, 3]}, [("s", np.array([4, 5], I))]), "does not broadcast"),
    "reshape_two_minus_ones": (_model("Reshape", {"x": [4, 4]}, [("s", np.array([-1, -1], I))]), "more than one -1"),
    "transpose_perm": (_model("Transpose", {"x": [4, 4]}, perm=[0, 0]), "not a permutation"),
    "squeeze_axes": (_model("Squeeze", {"x": [1, 4]}, [("a", np.array([5], I))]), "out of range"),
    "unsqueeze_repeated": (_model("Unsqueeze", {"x": [1, 4]}, [("a", np.array([1, 1], I))]), "more than once"),
    "reducesum_axes": (_model("ReduceSum", {"x": [1, 4]}, [("a", np.array([7], I))]), "out of range"),
    "reducemean_axes_attr": (_model("ReduceMean", {"x": [1, 4]}, opset=17, axes=[-3]), "out of range"),
    "scatternd_updates": (_model("ScatterND", {"x": [4, 4, 4], "u": [3, 4, 4]}, [("i", np.zeros((2, 1), I))]), "updates have shape"),
    "scatterelements_updates": (_model("ScatterElements", {"x": [3, 3], "u": [1, 5]}, [("i", np.zeros((1, 2), I))]), "differ in shape"),
    "affinegrid_theta": (_model("AffineGrid", {"theta": [2, 5, 3]}, [("size", np.array([2, 1, 4, 4], I))], opset=20), "theta has shape"),
    "attention_mask": (_model("Attention", {"q": [1, 2, 4, 8], "k": [1, 2, 4, 8], "v": [1, 2, 4, 8], "m": [2, 2]}, opset=23), "attn_mask"),
    "attention_mask_longer_than_keys": (_model("Attention", {"q": [1, 2, 4, 8], "k": [1, 2, 4, 8], "v": [1, 2, 4, 8], "m": [4, 6]}, opset=24), "attn_mask"),
    "softmaxce_labels": (_model("SoftmaxCrossEntropyLoss", {"x": [3, 5, 6], "labels": [3, 7]}), "labels have shape"),
}


@pytest.mark.parametrize("command", ["grad", "jvp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_inconsistent_nodes_are_refused(case, command, tmp_path, capsys):
    model, _ = CASES[case]  # (revgraph's words are checked below, where ONNX's check on load does not come first)
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    code = main([command, str(path), "-o", str(out)])
    err = capsys.readouterr().err
    one_line_error(code, err)  # exit 2, one line: by ONNX's check on load, or by revgraph's naming the node
    assert "not valid ONNX" in err or "node 'n1'" in err, err
    assert not out.exists()


@pytest.mark.parametrize("command", ["grad", "jvp"])
@pytest.mark.parametrize("case", ["pad_80000", "scatternd_updates", "scatterelements_updates", "affinegrid_theta",
                                  "softmaxce_labels", "transpose_perm", "slice_lengths", "tile_repeats"])
def test_the_message_names_what_is_wrong(case, command, tmp_path, capsys):
    model, fragment = CASES[case]
    onnx.save(model, tmp_path / "m.onnx")
    code = main([command, str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx")])
    err = capsys.readouterr().err
    if "the model is not valid ONNX" not in err:  # (ONNX's check on load refuses some of them first)
        one_line_error(code, err, "node 'n1'", fragment)
    else:
        one_line_error(code, err)


def in_subgraph(model: onnx.ModelProto, where: str) -> onnx.ModelProto:
    """The node ``n1`` of a :data:`CASES` model moved into a ``Loop`` body (2 iterations, ``y`` a scan output;
    ``where="loop"`` reads the model's inputs and initializers from the enclosing graph, ``"loop-inits"`` holds
    the initializers in the body) or an ``If``'s then branch (the else branch an ``Identity`` of the first input);
    the loss is the ``ReduceSum`` of the loop's or branch's output."""
    g = model.graph
    inits = list(g.initializer)
    inner = inits if where == "loop-inits" else []
    y = h.make_value_info("y", h.make_tensor_type_proto(T.FLOAT, None))
    ins = list(g.input)
    if where.startswith("loop"):
        body = h.make_graph([g.node[0], h.make_node("Identity", ["cond"], ["cond_out"], name="body_id")], "body",
                            [h.make_tensor_value_info("iteration", T.INT64, []), h.make_tensor_value_info("cond", T.BOOL, [])],
                            [h.make_tensor_value_info("cond_out", T.BOOL, []), y], initializer=inner)
        nodes = [h.make_node("Loop", ["trip", ""], ["ys"], name="loop", body=body)]
        outer = [nh.from_array(np.array(2, I), "trip")]
    else:
        then = h.make_graph([g.node[0]], "then", [], [y], initializer=inner)
        other = h.make_graph([h.make_node("Identity", [g.input[0].name], ["y_else"], name="else_id")], "else", [],
                             [h.make_value_info("y_else", h.make_tensor_type_proto(T.FLOAT, None))])
        nodes = [h.make_node("If", ["b"], ["ys"], name="if", then_branch=then, else_branch=other)]
        outer, ins = [], [*ins, h.make_tensor_value_info("b", T.BOOL, [])]
    nodes.append(h.make_node("ReduceSum", ["ys"], ["loss"], name="sum", keepdims=0))
    graph = h.make_graph(nodes, "m", ins, [h.make_tensor_value_info("loss", T.FLOAT, [])],
                         initializer=outer + ([] if inner else inits))
    return h.make_model(graph, opset_imports=list(model.opset_import))


@pytest.mark.parametrize("command", ["grad", "jvp"])
@pytest.mark.parametrize("where", ["loop", "loop-inits", "if"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_inconsistent_nodes_in_subgraphs_are_refused(case, where, command, tmp_path, capsys):
    """Issue 28 round 3: check_nodes looked at top-level nodes only, so the same node inside a Loop body or an
    If branch was built from (exit 0 with 80000 pads, exit 3 for Slice and Tile) or refused by ONNX only after
    revgraph had written the gradient graph. Each is refused before any rule builds, naming the node and what is
    wrong (or by ONNX's check of the model on load, where that catches it)."""
    model, fragment = CASES[case]
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(in_subgraph(model, where), path)
    code = main([command, str(path), "-o", str(out)])
    err = capsys.readouterr().err
    if "the model is not valid ONNX" in err:  # ONNX's check on load, naming the node in the body
        one_line_error(code, err, "node name: n1")
    else:  # naming the body that holds it too
        holder = "in 'body' of node 'loop' (Loop)" if where.startswith("loop") else "in 'then_branch' of node 'if' (If)"
        one_line_error(code, err, "node 'n1'", fragment, holder)
    assert not out.exists()


def test_a_consistent_node_in_a_loop_body_still_differentiates(tmp_path):
    """The walk refuses only what is wrong: a Pad with the right pads inside a Loop body gets its gradient
    (d/dx of 2 iterations' sum of the padded x is 2 everywhere)."""
    import revgraph as rg

    model = _model("Pad", {"x": [1, 3, 4, 5]}, [("pads", np.ones(8, I))], mode="constant")
    onnx.save(in_subgraph(model, "loop"), tmp_path / "m.onnx")
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx")]) == 0
    x = np.random.default_rng(0).normal(0, 1, (1, 3, 4, 5)).astype(np.float32)
    got = rg.Session(rg.load(tmp_path / "g.onnx")).run({"x": x})["x_grad"]
    np.testing.assert_array_equal(got, np.full_like(x, 2.0))
