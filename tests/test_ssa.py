"""SSA: versions, producers and readers of names written more than once, and the renaming into SSA form.

Each in-place net is checked three ways: the structure :func:`revgraph.ir.ssa.analyze` reports (versions,
producers, readers with node identity and input position), the SSA form :func:`revgraph.to_ssa` writes, and
the numbers: a Session (which renames to SSA on its way to ONNX) on both backends against numpy or a
hand-written SSA graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import assert_proto_ssa
from onnx import TensorProto, helper

import revgraph as rg
from revgraph import Graph, Node, ValueInfo
from revgraph.ir.ssa import CAPTURED, analyze

BACKENDS = ("onnxruntime", "reference")
F32 = np.float32


def f32(name, shape):
    return ValueInfo(name, F32, shape)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(F32)


def nodes_by_name(graph: Graph) -> dict[str, Node]:
    return {n.name: n for n in graph.nodes}


def producers(info, name):
    return [v.producer.name if v.producer is not None else None for v in info.versions[name]]


def readers(info, graph, name):
    """Readers of every version of ``name`` as ``[(node name, position), ...]``, checking node identity."""
    by_name = nodes_by_name(graph)
    out = []
    for v in info.versions[name]:
        for node, _ in v.readers:
            assert node is by_name[node.name], "readers hold the graph's own Node objects"
        out.append([(node.name, pos) for node, pos in v.readers])
    return out


def check_ssa_form(graph: Graph) -> Graph:
    """The common checks: the in-place graph is valid but not SSA; its SSA form is SSA, valid, keeps the
    input and output names (outputs that are not inputs), and its ONNX passes the full checker."""
    graph.check()
    assert not rg.is_ssa(graph)
    ssa = rg.to_ssa(graph)
    assert rg.is_ssa(ssa)
    ssa.check()
    assert ssa.input_names == graph.input_names
    kept = [n for n in graph.output_names if n not in graph.input_names]
    assert [n for n in ssa.output_names if n in kept] == kept
    assert not rg.is_ssa(graph), "to_ssa does not modify its argument"
    onnx.checker.check_model(rg.to_onnx(graph), full_check=True)
    return ssa


def run_both(graph: Graph, feeds: dict) -> dict[str, dict[str, np.ndarray]]:
    return {b: rg.Session(graph, backend=b).run(feeds) for b in BACKENDS}


def assert_outputs(graph: Graph, feeds: dict, expected: dict[str, np.ndarray]) -> None:
    for backend, got in run_both(graph, feeds).items():
        assert set(got) == set(expected), backend
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{backend}: {name}")


# ------------------------------------------------------------------------------------------------ nets


def test_relu_in_place():
    g = Graph(
        [Node("Relu", ["x"], ["x"], name="r"), Node("Neg", ["x"], ["y"], name="n")],
        [f32("x", (2, 3))],
        [f32("y", (2, 3))],
    )
    info = analyze(g)
    assert len(info.versions["x"]) == 2
    assert producers(info, "x") == [None, "r"]
    assert readers(info, g, "x") == [[("r", 0)], [("n", 0)]]
    assert info.multi_written == ["x"]
    r, n = g.nodes
    assert info.read(n, 0) is info.written(r, 0) is info.final("x")
    ssa = check_ssa_form(g)
    assert ssa.nodes[1].inputs == ssa.nodes[0].outputs != ["x"]
    x = rand(2, 3)
    expected = -np.maximum(x, 0)
    assert_outputs(g, {"x": x}, {"y": expected})
    hand = Graph([Node("Relu", ["x"], ["x1"]), Node("Neg", ["x1"], ["y"])], [f32("x", (2, 3))], [f32("y", (2, 3))])
    assert_outputs(hand, {"x": x}, {"y": expected})


def test_add_in_place_twice():
    g = Graph(
        [
            Node("Add", ["x", "y"], ["x"], name="a1"),
            Node("Add", ["x", "y"], ["x"], name="a2"),
            Node("Mul", ["x", "y"], ["z"], name="m"),
        ],
        [f32("x", (4,)), f32("y", (4,))],
        [f32("z", (4,))],
    )
    info = analyze(g)
    assert len(info.versions["x"]) == 3 and len(info.versions["y"]) == 1
    assert producers(info, "x") == [None, "a1", "a2"]
    assert readers(info, g, "x") == [[("a1", 0)], [("a2", 0)], [("m", 0)]]
    assert readers(info, g, "y") == [[("a1", 1), ("a2", 1), ("m", 1)]]
    assert [v.index for v in info.versions["x"]] == [0, 1, 2]
    check_ssa_form(g)
    x, y = rand(4, seed=1), rand(4, seed=2)
    assert_outputs(g, {"x": x, "y": y}, {"z": (x + 2 * y) * y})


def test_value_read_twice_by_one_node():
    g = Graph(
        [
            Node("Mul", ["x", "x"], ["x"], name="m1"),
            Node("Mul", ["x", "x"], ["x"], name="m2"),
            Node("Sub", ["x", "one"], ["out"], name="s"),
        ],
        [f32("x", (5,))],
        [f32("out", (5,))],
        initializers={"one": np.ones(5, F32)},
    )
    info = analyze(g)
    assert len(info.versions["x"]) == 3
    assert producers(info, "x") == [None, "m1", "m2"]
    assert readers(info, g, "x") == [[("m1", 0), ("m1", 1)], [("m2", 0), ("m2", 1)], [("s", 0)]]
    assert readers(info, g, "one") == [[("s", 1)]]
    m1 = g.nodes[0]
    assert info.read(m1, 0) is info.read(m1, 1) is info.versions["x"][0]
    check_ssa_form(g)
    x = rand(5, seed=3)
    assert_outputs(g, {"x": x}, {"out": x**4 - 1})


def test_name_overwritten_by_a_node_that_does_not_read_it():
    g = Graph(
        [
            Node("Neg", ["a"], ["t"], name="n1"),
            Node("Exp", ["b"], ["t"], name="n2"),  # overwrites t, never read its first version
            Node("Add", ["t", "a"], ["out"], name="n3"),
            Node("Sigmoid", ["b"], ["a"], name="n4"),  # overwrites the graph input a without reading it
            Node("Mul", ["t", "a"], ["z"], name="n5"),
        ],
        [f32("a", (3,)), f32("b", (3,))],
        [f32("out", (3,)), f32("z", (3,))],
    )
    info = analyze(g)
    assert producers(info, "t") == ["n1", "n2"]
    assert readers(info, g, "t") == [[], [("n3", 0), ("n5", 0)]]
    assert producers(info, "a") == [None, "n4"]
    assert readers(info, g, "a") == [[("n1", 0), ("n3", 1)], [("n5", 1)]]
    check_ssa_form(g)
    a, b = rand(3, seed=4), rand(3, seed=5)
    assert_outputs(g, {"a": a, "b": b}, {"out": np.exp(b) + a, "z": np.exp(b) / (1 + np.exp(-b))})


def test_chain_of_in_place_writes_each_read_several_times():
    g = Graph(
        [
            Node("Sin", ["h"], ["s1"], name="u1"),
            Node("Cos", ["h"], ["c1"], name="u2"),
            Node("Add", ["s1", "c1"], ["h"], name="w1"),
            Node("Tanh", ["h"], ["s2"], name="u3"),
            Node("Mul", ["h", "h"], ["c2"], name="u4"),
            Node("Sub", ["s2", "c2"], ["h"], name="w2"),
            Node("Abs", ["h"], ["s3"], name="u5"),
            Node("Add", ["h", "s3"], ["h"], name="w3"),
            Node("Mul", ["h", "s1"], ["out"], name="u6"),
            Node("Add", ["h", "h"], ["out2"], name="u7"),
        ],
        [f32("h", (6,))],
        [f32("out", (6,)), f32("out2", (6,))],
    )
    info = analyze(g)
    assert len(info.versions["h"]) == 4
    assert producers(info, "h") == [None, "w1", "w2", "w3"]
    assert readers(info, g, "h") == [
        [("u1", 0), ("u2", 0)],
        [("u3", 0), ("u4", 0), ("u4", 1)],
        [("u5", 0), ("w3", 0)],
        [("u6", 0), ("u7", 0), ("u7", 1)],
    ]
    assert readers(info, g, "s1") == [[("w1", 0), ("u6", 1)]]
    check_ssa_form(g)
    h0 = rand(6, seed=6)
    h1 = np.sin(h0) + np.cos(h0)
    h2 = np.tanh(h1) - h1 * h1
    h3 = h2 + np.abs(h2)
    assert_outputs(g, {"h": h0}, {"out": h3 * np.sin(h0), "out2": 2 * h3})


def test_graph_output_overwritten_keeps_its_name_as_last_version():
    g = Graph(
        [
            Node("Neg", ["x"], ["y"], name="n1"),
            Node("Identity", ["y"], ["z"], name="i1"),
            Node("Exp", ["y"], ["y"], name="n2"),
            Node("Add", ["y", "x"], ["y"], name="n3"),
        ],
        [f32("x", (4,))],
        [f32("y", (4,)), f32("z", (4,))],
    )
    info = analyze(g)
    assert producers(info, "y") == ["n1", "n2", "n3"]
    assert readers(info, g, "y") == [[("i1", 0), ("n2", 0)], [("n3", 0)], []]
    assert info.final("y") is info.written(g.nodes[3], 0)
    ssa = check_ssa_form(g)
    assert ssa.output_names == ["y", "z"]
    producer_of = {o: n for n in ssa.nodes for o in n.outputs}
    assert producer_of["y"].name == "n3" and producer_of["z"].name == "i1"
    assert producer_of[ssa.nodes[1].inputs[0]].name == "n1"
    x = rand(4, seed=7)
    expected = {"y": np.exp(-x) + x, "z": -x}
    assert_outputs(g, {"x": x}, expected)
    hand = Graph(
        [
            Node("Neg", ["x"], ["y1"]),
            Node("Identity", ["y1"], ["z"]),
            Node("Exp", ["y1"], ["y2"]),
            Node("Add", ["y2", "x"], ["y"]),
        ],
        [f32("x", (4,))],
        [f32("y", (4,)), f32("z", (4,))],
    )
    assert_outputs(hand, {"x": x}, expected)
    model = rg.to_onnx(g)
    assert [o.name for o in model.graph.output] == ["y", "z"]


def _loop_net() -> Graph:
    body = Graph(
        [
            Node("Add", ["a", "w"], ["w"], name="b1"),  # reads the OUTER w (w*w), writes a body-local w
            Node("Mul", ["w", "a"], ["a"], name="b2"),
            Node("Identity", ["cond"], ["cond_out"], name="b3"),
            Node("Identity", ["w"], ["s"], name="b4"),
        ],
        [ValueInfo("i", np.int64, ()), ValueInfo("cond", np.bool_, ()), f32("a", (3,))],
        [ValueInfo("cond_out", np.bool_, ()), f32("a", (3,)), f32("s", (3,))],
        name="body",
    )
    return Graph(
        [
            Node("Mul", ["w", "w"], ["w"], name="o1"),
            # (an explicit condition: onnx.reference's Loop runs no iteration when the condition is omitted)
            Node("Loop", ["M", "go", "acc0"], ["acc", "scan"], {"body": body}, name="loop"),
            Node("Neg", ["w"], ["w"], name="o2"),
            Node("Add", ["acc", "w"], ["out"], name="o3"),
        ],
        [f32("w", (3,)), f32("acc0", (3,))],
        [f32("out", (3,)), f32("scan", (3, 3))],
        initializers={"M": np.array(3, np.int64), "go": np.array(True)},
    )


def test_in_place_writes_inside_a_loop_body_capturing_an_overwritten_outer_name():
    g = _loop_net()
    _, loop, _, _ = g.nodes
    body = loop.attrs["body"]
    info = analyze(g)
    assert producers(info, "w") == [None, "o1", "o2"]
    assert readers(info, g, "w") == [[("o1", 0), ("o1", 1)], [("loop", CAPTURED), ("o2", 0)], [("o3", 1)]]
    binfo = analyze(body)
    assert producers(binfo, "w") == [None, "b1"]  # version 0: the value of the enclosing graph
    assert readers(binfo, body, "w") == [[("b1", 1)], [("b2", 0), ("b4", 0)]]
    assert producers(binfo, "a") == [None, "b2"]
    assert readers(binfo, body, "a") == [[("b1", 0), ("b2", 1)], []]

    ssa = check_ssa_form(g)
    sbody = ssa.nodes[1].attrs["body"]
    assert sbody.nodes[0].inputs[1] == ssa.nodes[0].outputs[0], "the body reads the version the loop sees"
    assert sbody.nodes[0].outputs[0] not in {ssa.nodes[0].outputs[0], ssa.nodes[2].outputs[0], "w"}

    w, acc0 = rand(3, seed=8), rand(3, seed=9)
    big_w, a, scans = w * w, acc0, []
    for _ in range(3):
        t = a + big_w
        scans.append(t)
        a = t * a
    assert_outputs(g, {"w": w, "acc0": acc0}, {"out": a - big_w, "scan": np.stack(scans)})


def _if_net() -> Graph:
    then = Graph([Node("Add", ["x", "x"], ["r"], name="t1")], [], [f32("r", (4,))], name="then")
    other = Graph([Node("Exp", ["x"], ["r"], name="e1")], [], [f32("r", (4,))], name="else")
    return Graph(
        [
            Node("Neg", ["x"], ["x"], name="n1"),
            Node("If", ["c"], ["x"], {"then_branch": then, "else_branch": other}, name="if"),  # reads and writes x
            Node("Mul", ["x", "x"], ["y"], name="n3"),
        ],
        [f32("x", (4,)), ValueInfo("c", np.bool_, ())],
        [f32("y", (4,))],
    )


@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_capture_the_version_before_the_if_overwrites_it(cond):
    g = _if_net()
    info = analyze(g)
    assert producers(info, "x") == [None, "n1", "if"]
    # both branches read x, but a read inside a node's subgraphs is one reader: (node, CAPTURED)
    assert readers(info, g, "x") == [[("n1", 0)], [("if", CAPTURED)], [("n3", 0), ("n3", 1)]]
    ssa = check_ssa_form(g)
    neg_out = ssa.nodes[0].outputs[0]
    for attr in ("then_branch", "else_branch"):
        assert neg_out in ssa.nodes[1].attrs[attr].nodes[0].inputs
    x = rand(4, seed=10)
    inner = 2 * -x if cond else np.exp(-x)
    assert_outputs(g, {"x": x, "c": np.array(cond)}, {"y": inner * inner})


def test_fresh_names_do_not_clash_with_existing_names():
    # "x__v2" is already taken by a graph input: renaming x's second version must pick another name
    g = Graph(
        [Node("Relu", ["x"], ["x"], name="r"), Node("Add", ["x", "x__v2"], ["y"], name="a")],
        [f32("x", (3,)), f32("x__v2", (3,))],
        [f32("y", (3,))],
    )
    ssa = check_ssa_form(g)
    assert ssa.nodes[0].outputs[0] not in {"x", "x__v2"}
    assert ssa.nodes[1].inputs == [ssa.nodes[0].outputs[0], "x__v2"]
    x, x2 = rand(3, seed=11), rand(3, seed=12)
    assert_outputs(g, {"x": x, "x__v2": x2}, {"y": np.maximum(x, 0) + x2})


def test_ssa_graph_is_left_as_is():
    g = Graph([Node("Relu", ["x"], ["y"], name="r")], [f32("x", (2,))], [f32("y", (2,))])
    assert rg.is_ssa(g)
    info = analyze(g)
    assert info.multi_written == []
    assert rg.to_ssa(g).nodes[0].inputs == ["x"] and rg.to_ssa(g).nodes[0].outputs == ["y"]


# ------------------------------------------------------------------------------------ ONNX in and out


@pytest.mark.parametrize("opset", [13, rg.TARGET_OPSET])
def test_load_accepts_a_model_proto_that_writes_a_name_twice(opset, tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["t"], name="relu"),
        helper.make_node("Neg", ["t"], ["t"], name="neg"),
        helper.make_node("Add", ["t", "x"], ["t"], name="add"),
        helper.make_node("Mul", ["t", "t"], ["x2"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes,
        "inplace",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [
            helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("x2", TensorProto.FLOAT, [2, 3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    # (onnx.checker would refuse this model: t is written three times)
    g = rg.load(model)
    assert rg.is_ssa(g)
    assert g.input_names == ["x"] and g.output_names == ["t", "x2"]
    assert g.opset == rg.TARGET_OPSET
    path = tmp_path / "saved.onnx"
    rg.save(g, path)
    onnx.checker.check_model(str(path), full_check=True)
    saved = onnx.load(str(path))
    assert_proto_ssa(saved)
    assert len([o for n in saved.graph.node for o in n.output]) == 4
    x = rand(2, 3, seed=13)
    t = -np.maximum(x, 0) + x
    y_t, y_x2 = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["t", "x2"], {"x": x})
    np.testing.assert_allclose(y_t, t, rtol=1e-6)
    np.testing.assert_allclose(y_x2, t * t, rtol=1e-6)
    for got in run_both(g, {"x": x}).values():
        np.testing.assert_allclose(got["t"], t, rtol=1e-6)


def test_save_writes_ssa_from_an_in_place_graph(tmp_path):
    g = _loop_net()
    path = tmp_path / "loop.onnx"
    rg.save(g, path)
    onnx.checker.check_model(str(path), full_check=True)
    assert_proto_ssa(onnx.load(str(path)))
    w, acc0 = rand(3, seed=14), rand(3, seed=15)
    want = rg.Session(g, backend="reference").run({"w": w, "acc0": acc0})
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"w": w, "acc0": acc0})
    for name, value in zip(["out", "scan"], got, strict=True):
        np.testing.assert_allclose(value, want[name], rtol=1e-5)
