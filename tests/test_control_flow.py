"""Gradients through If (alone, inside loops, around loops) and Scan (every direction and axis), against
PyTorch on the unrolled computation, under every residual policy and both runtimes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.loops import (
    POLICIES,
    assert_close,
    body,
    body_initializer_models,
    body_initializer_reference,
    branch,
    const,
    grads,
    graph,
    if_node,
    loop,
    n,
    scan_graph,
    torch_grads,
)

import revgraph as rg
from revgraph.errors import RevgraphError
from revgraph.ir import Graph, Node, ValueInfo


@pytest.mark.parametrize("x", [-1.0, 0.0, 4.0])
def test_if_with_nan_prone_branch(x):
    # y = sqrt(x) if x > 0 else x: at x = -1 the untaken branch would give NaN; the gradient is 1
    then = branch([n("Sqrt", ["x"], "r")], ["r"], "then")
    other = branch([n("Identity", ["x"], "r2")], ["r2"], "else")
    g = graph([const("zero", 0.0), n("Greater", ["x", "zero"], "pos"), if_node("pos", then, other, ["y"])],
              {"x": ()}, ["y"])
    ours = grads(g, {"x": np.array(x)}, ["x"])
    np.testing.assert_allclose(ours["x"], 0.5 / np.sqrt(x) if x > 0 else 1.0)


def test_if_captured_in_one_branch_only():
    then = branch([n("Mul", ["a", "b"], "r")], ["r"], "then")
    other = branch([n("Sin", ["a"], "r2")], ["r2"], "else")
    g = graph([n("If", ["c"], ["y"], "if", then_branch=then, else_branch=other),
               n("ReduceSum", ["y"], "loss", keepdims=0)], {"a": (3,), "b": (3,)}, ["loss"], {"c": np.array(False)})
    feeds = {"a": np.array([0.1, 0.2, 0.3]), "b": np.array([1.0, 2.0, 3.0])}
    ours = grads(g, feeds, ["a", "b"])
    np.testing.assert_allclose(ours["a"], np.cos(feeds["a"]))
    np.testing.assert_array_equal(ours["b"], np.zeros(3))


@pytest.mark.parametrize("policy", POLICIES)
def test_if_inside_a_loop(policy):
    # s <- s * x if sum(s) > 1 else s + x
    then = branch([n("Mul", ["s_in", "x"], "r")], ["r"], "then")
    other = branch([n("Add", ["s_in", "x"], "r2")], ["r2"], "else")
    b = body([n("ReduceSum", ["s_in"], "tot", keepdims=0), const("onef", 1.0), n("Greater", ["tot", "onef"], "big"),
              if_node("big", then, other, ["s_out"])], [("s_in", "s_out")])
    g = graph([loop(b, "M", ["s0"], ["s"]), n("ReduceSum", ["s"], "loss", keepdims=0)], {"x": (2,), "s0": (2,)},
              ["loss"], {"M": np.array(5, np.int64)})
    feeds = {"x": np.array([0.9, 0.7]), "s0": np.array([0.1, 0.2])}

    def unrolled(x, s0):
        s = s0
        for _ in range(5):
            s = s * x if s.sum() > 1 else s + x
        return s.sum()

    assert_close(grads(g, feeds, ["x", "s0"], policy=policy), torch_grads(unrolled, feeds, ["x", "s0"]))


@pytest.mark.parametrize("policy", POLICIES)
def test_loops_inside_if_branches(policy):
    # if c: 3 steps of s <- s * x  else: 2 steps of s <- sin(s) + x
    mul = body([n("Mul", ["s_in", "x"], "s_out")], [("s_in", "s_out")])
    sin = body([n("Sin", ["t_in"], "st"), n("Add", ["st", "x"], "t_out")], [("t_in", "t_out")], iter_name="j",
               cond_name="cj")
    then = branch([loop(mul, "M3", ["s0"], ["r"], "loop_then")], ["r"], "then")
    other = branch([loop(sin, "M2", ["s0"], ["r2"], "loop_else")], ["r2"], "else")
    g = graph([if_node("c", then, other, ["y"]), n("ReduceSum", ["y"], "loss", keepdims=0)], {"x": (2,), "s0": (2,)},
              ["loss"], {"M3": np.array(3, np.int64), "M2": np.array(2, np.int64), "c": np.array(True)})
    feeds = {"x": np.array([0.9, -0.7]), "s0": np.array([0.5, 0.25])}
    for c in (True, False):
        g.initializers["c"] = np.array(c)

        def unrolled(x, s0, c=c):  # (c bound now: the reference of this iteration)
            s = s0
            for _ in range(3 if c else 2):
                s = s * x if c else torch.sin(s) + x
            return s.sum()

        assert_close(grads(g, feeds, ["x", "s0"], policy=policy), torch_grads(unrolled, feeds, ["x", "s0"]))


@settings(max_examples=6, deadline=None)
@given(in_dir=st.integers(0, 1), out_dir=st.integers(0, 1), in_axis=st.integers(0, 1),
       out_axis=st.sampled_from([0, 1, -1]), t=st.integers(1, 4), policy=st.sampled_from(POLICIES))
def test_scan_every_direction_and_axis(in_dir, out_dir, in_axis, out_axis, t, policy):
    shape_x = (t, 3) if in_axis == 0 else (3, t)
    g, u = scan_graph(in_dir, out_dir, in_axis, out_axis, shape_x)
    rng = np.random.default_rng(t)
    feeds = {"h0": rng.standard_normal(3), "x": rng.standard_normal(shape_x), "w": rng.standard_normal(3)}

    def unrolled(h0, x, w):
        xs = x if in_axis == 0 else x.T
        order = range(t - 1, -1, -1) if in_dir else range(t)
        h, ys = h0, []
        for i in order:
            h = torch.tanh(h * w + xs[i])
            ys.append(h * 2)
        y = torch.stack(ys[::-1] if out_dir else ys)
        y = y if out_axis == 0 else y.T
        return (y * torch.tensor(u)).sum() + h.sum()

    assert_close(grads(g, feeds, ["h0", "x", "w"], policy=policy), torch_grads(unrolled, feeds, ["h0", "x", "w"]))


# ---------------------------------------------------------------------------------------------- untyped sequences


def _untyped_sequence_loop(opset: int):
    """torch.onnx dynamo's nn.EmbeddingBag pattern, ``SequenceEmpty -> Loop(SequenceInsert) ->
    ConcatFromSequence``, the carried sequence untyped in the body (issue 27); ``loss = sum_i sum(x[i] * x[i])``."""
    from onnx import TensorProto, helper, numpy_helper

    body = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["row"], axis=0), helper.make_node("Mul", ["row", "row"], ["r2"]),
         helper.make_node("SequenceInsert", ["s_in", "r2"], ["s_out"]),
         helper.make_node("Identity", ["c_in"], ["c_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []), onnx.ValueInfoProto(name="s_in")],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), onnx.ValueInfoProto(name="s_out")])
    g = helper.make_graph(
        [helper.make_node("SequenceEmpty", [], ["s0"], dtype=TensorProto.DOUBLE),
         helper.make_node("Loop", ["trips", "go", "s0"], ["s"], body=body),
         helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0),
         helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 2])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(np.array(3, np.int64), "trips"), numpy_helper.from_array(np.array(True), "go")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)  # valid ONNX, as the exported file is
    return model


@pytest.mark.parametrize("opset", [18, 21, 23])
def test_a_loop_carrying_an_untyped_sequence(opset, tmp_path):
    # d/dx sum(x * x) = 2 x, at every opset (18 is converted to 21 on load; 21 and 23 were refused)
    import revgraph as rg
    from revgraph.cli import main

    model = _untyped_sequence_loop(opset)
    x = np.arange(6.0).reshape(3, 2)
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(rg.gradient(rg.load(model), "loss", ["x"]), backend=backend).run({"x": x})
        np.testing.assert_array_equal(out["x_grad"], 2 * x)
    src = tmp_path / "bag.onnx"
    onnx.save(model, str(src))
    assert main(["grad", str(src), "-o", str(tmp_path / "bag_grad.onnx")]) == 0


# ------------------------------------------------------------------------------------------ nesting depth


def _nested_ifs(levels: int) -> Graph:
    """``levels`` Ifs, each in the previous one's then-branch: with c true the loss is sum(sin^(levels+1)(x)),
    each level computing one Sin before its If; with c false at the top, sum(2 x)."""
    F64_ = np.float64

    def level(k: int) -> Graph:
        if k > levels:
            return Graph([Node("Sin", [f"v{k - 1}"], [f"o{k}"], name=f"leaf{k}")], [], [ValueInfo(f"o{k}", F64_, (2,))],
                         name=f"leaf{k}")
        other = Graph([Node("Mul", [f"v{k - 1}", "two"], [f"e{k}"], name=f"mul{k}")], [],
                      [ValueInfo(f"e{k}", F64_, (2,))], name=f"else{k}")
        return Graph([Node("Sin", [f"v{k - 1}"], [f"v{k}"], name=f"sin{k}"),
                      Node("If", ["c"], [f"o{k}"], {"then_branch": level(k + 1), "else_branch": other}, name=f"if{k}")],
                     [], [ValueInfo(f"o{k}", F64_, (2,))], name=f"then{k}")

    top = level(1)
    top.nodes[0].inputs = ["x"]  # v0 is x
    top.nodes[1].attrs["else_branch"].nodes[0].inputs[0] = "x"
    return Graph([*top.nodes, Node("ReduceSum", ["o1"], ["loss"], {"keepdims": 0}, "sum")],
                 [ValueInfo("x", F64_, (2,)), ValueInfo("c", np.bool_, ())], [ValueInfo("loss")],
                 {"two": np.array(2.0)})


def test_ifs_nested_to_the_limit_differentiate_and_one_level_more_is_refused(tmp_path):
    # issue 39: If nested 31 deep (the most an ONNX file holds, limits.MAX_SUBGRAPH_NESTING): grad, hvp and jvp
    # work and equal PyTorch; jacobian and hessian add a Loop around it, one level too many: exit 2, one line
    # (they exited 3 with protobuf's "Unable to parse proto")
    from kit.harness import one_line_error

    from revgraph.cli import main
    from revgraph.limits import MAX_SUBGRAPH_NESTING

    g = _nested_ifs(MAX_SUBGRAPH_NESTING)
    path = tmp_path / "deep.onnx"
    rg.save(g, path)
    x = np.array([0.3, -1.2])
    xt = torch.tensor(x, requires_grad=True)
    y = xt
    for _ in range(MAX_SUBGRAPH_NESTING + 1):
        y = torch.sin(y)
    (want,) = torch.autograd.grad(y.sum(), xt)
    got = rg.Session(rg.gradient(rg.load(path), "loss", wrt=["x"])).run({"x": x, "c": np.array(True)})["x_grad"]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12)
    for cmd in ("grad", "hvp", "jvp"):
        assert main([cmd, str(path), "-o", str(tmp_path / f"{cmd}.onnx")]) == 0
    for cmd in ("jacobian", "hessian"):
        proc = subprocess.run([sys.executable, "-m", "revgraph", cmd, str(path), "-o", str(tmp_path / f"{cmd}.onnx")],
                              capture_output=True, text=True, timeout=300, check=False)
        one_line_error(proc.returncode, proc.stderr, "nests subgraphs 32 deep", "'basis/Loop'")
        assert not (tmp_path / f"{cmd}.onnx").exists()
    with pytest.raises(RevgraphError, match="nests subgraphs 32 deep"):
        rg.save(_nested_ifs(MAX_SUBGRAPH_NESTING + 1), tmp_path / "deeper.onnx")


# ------------------------------------------------------------------------------------------ body initializers


@pytest.mark.parametrize("policy", ["store", "recompute", "sqrt"])
@pytest.mark.parametrize("name", ["loop", "if", "scan"])
def test_subgraphs_holding_their_own_initializers(tmp_path, name, policy):
    # issue 41: the backward loop referred to the body's initializer names from outside the body (onnxruntime
    # refused the graph; revgraph grad exited 3): they become Constant nodes of the body first
    import warnings

    model = body_initializer_models()[name]
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp_path / "m.onnx")
    g = rg.load(tmp_path / "m.onnx")
    x, w = np.array([0.3, -0.2]), np.array([0.1, 0.2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = rg.Session(rg.gradient(g, "loss", wrt=["x", "w"], checkpoint=policy)).run({"x": x, "w": w})
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    body_initializer_reference(name, tx, tw).backward()
    np.testing.assert_allclose(out["x_grad"], tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(out["w_grad"], tw.grad.numpy(), rtol=1e-12)
    if policy == "store":
        from revgraph.cli import main

        assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx")]) == 0
