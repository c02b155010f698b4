"""The gradient graph's clean-up pass (autodiff/simplify.py): each rewrite keeps every output's value and the
graph's interface, and random operators or values read by subgraphs are left alone."""

from __future__ import annotations

import numpy as np

import revgraph as rg
from revgraph.autodiff.simplify import simplify
from revgraph.ir import Graph, Node, ValueInfo


def _same_outputs(g: Graph, feeds: dict) -> Graph:
    before = rg.Session(g.copy(), backend="reference").run(feeds)
    s = simplify(g.copy())
    s.check()
    after = rg.Session(s, backend="reference").run(feeds)
    assert list(after) == list(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    return s


def _ops(g: Graph) -> list[str]:
    return [n.op_type for n in g.nodes]


X = ValueInfo("x", np.float32, (2, 3, 4))
FEEDS = {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 7}


def test_common_subexpressions_merge():
    g = Graph([Node("Shape", ["x"], ["s1"], name="a"), Node("Shape", ["x"], ["s2"], name="b"),
               Node("Reshape", ["x", "s1"], ["r1"], name="c"), Node("Reshape", ["x", "s2"], ["r2"], name="d"),
               Node("Add", ["r1", "r2"], ["y"], name="e")], [X], [ValueInfo("y")])
    s = _same_outputs(g, FEEDS)
    assert _ops(s) == ["Shape", "Reshape", "Add"]
    assert s.nodes[-1].inputs == ["r1", "r1"]


def test_constants_with_equal_values_merge_and_different_ones_do_not():
    g = Graph([Node("Constant", [], ["c1"], {"value": np.array([2.0], np.float32)}, "c1"),
               Node("Constant", [], ["c2"], {"value": np.array([2.0], np.float32)}, "c2"),
               Node("Constant", [], ["c3"], {"value": np.array([2.0], np.float64)}, "c3"),
               Node("Mul", ["x", "c1"], ["a"], name="m1"), Node("Mul", ["x", "c2"], ["b"], name="m2"),
               Node("Cast", ["c3"], ["c4"], {"to": 1}, "cast"), Node("Sub", ["a", "b"], ["d"], name="sub"),
               Node("Add", ["d", "c4"], ["y"], name="add")], [X], [ValueInfo("y")])
    s = _same_outputs(g, FEEDS)
    assert _ops(s).count("Constant") == 2 and _ops(s).count("Mul") == 1


def test_random_operators_never_merge():
    g = Graph([Node("Dropout", ["x", "r", "t"], ["d1", "m1"], name="a"),
               Node("Dropout", ["x", "r", "t"], ["d2", "m2"], name="b"),
               Node("Sub", ["d1", "d2"], ["y"], name="c")], [X], [ValueInfo("y")],
              {"r": np.array(0.5, np.float32), "t": np.array(True)})
    s = simplify(g.copy())
    assert _ops(s) == ["Dropout", "Dropout", "Sub"]


def test_transpose_pairs_fold_and_cancel():
    g = Graph([Node("Transpose", ["x"], ["t1"], {"perm": [1, 2, 0]}, "a"),
               Node("Transpose", ["t1"], ["t2"], {"perm": [2, 0, 1]}, "b"),  # back to x
               Node("Transpose", ["t1"], ["t3"], {"perm": [0, 2, 1]}, "c"),  # x with axes (1, 0, 2)
               Node("Identity", ["t2"], ["i"], name="d"), Node("Mul", ["i", "i"], ["y"], name="e")],
              [X], [ValueInfo("y"), ValueInfo("t3")])
    s = _same_outputs(g, FEEDS)
    assert _ops(s) == ["Transpose", "Mul"]
    assert s.nodes[0].inputs == ["x"] and s.nodes[0].attrs["perm"] == [1, 0, 2]
    assert s.nodes[1].inputs == ["x", "x"]


def test_dead_nodes_go_and_outputs_stay():
    g = Graph([Node("Neg", ["x"], ["unused"], name="dead"), Node("Abs", ["x"], ["a"], name="abs"),
               Node("Identity", ["a"], ["y"], name="out"), Node("Identity", ["x"], ["z"], name="passthrough")],
              [X], [ValueInfo("y"), ValueInfo("z")])
    s = _same_outputs(g, FEEDS)
    assert _ops(s) == ["Abs", "Identity"]  # Abs writes y itself; z = x stays an Identity (x is an input)
    assert s.nodes[0].outputs == ["y"]


def test_values_read_by_a_subgraph_are_not_renamed():
    body = Graph([Node("Add", ["h", "s2"], ["h2"], name="add"), Node("Identity", ["cond"], ["c2"], name="c")],
                 [ValueInfo("i", np.int64, ()), ValueInfo("cond", np.bool_, ()), ValueInfo("h", np.float32, (2, 3, 4))],
                 [ValueInfo("c2", np.bool_, ()), ValueInfo("h2", np.float32, (2, 3, 4))])
    g = Graph([Node("Abs", ["x"], ["s1"], name="a1"), Node("Abs", ["x"], ["s2"], name="a2"),
               Node("Loop", ["n", "", "s1"], ["y"], {"body": body}, "loop")],
              [X], [ValueInfo("y")], {"n": np.array(3, np.int64)})
    s = _same_outputs(g, FEEDS)
    assert _ops(s) == ["Abs", "Abs", "Loop"]


def test_gradient_graphs_are_simplified():
    # y = sum(tanh(x)^T ...): two VJPs need Shape(x); the backward pass of a transpose chain cancels.
    g = Graph([Node("Transpose", ["x"], ["t"], {"perm": [2, 0, 1]}, "tr"), Node("Tanh", ["t"], ["h"], name="tanh"),
               Node("Transpose", ["h"], ["u"], {"perm": [1, 2, 0]}, "back"), Node("Mul", ["u", "x"], ["m"], name="mul"),
               Node("ReduceSum", ["m"], ["loss"], {"keepdims": 0}, "sum")], [X], [ValueInfo("loss")])
    gg = rg.gradient(g, wrt=["x"])
    assert "Identity" not in _ops(gg)
    pairs = [(n.inputs[0], n) for n in gg.nodes if n.op_type == "Transpose"]
    producers = {o: n for n in gg.nodes for o in n.outputs}
    assert not any(i in producers and producers[i].op_type == "Transpose" for i, _ in pairs)
    x = FEEDS["x"].astype(np.float64) / 10
    g64 = Graph(g.nodes, [ValueInfo("x", np.float64, (2, 3, 4))], g.outputs)
    got = rg.Session(rg.gradient(g64, wrt=["x"])).run({"x": x})["x_grad"]
    np.testing.assert_allclose(got, np.tanh(x) + x * (1 - np.tanh(x) ** 2), rtol=1e-12)


def test_zero_and_negative_zero_constants_stay_apart():
    g = Graph([Node("Constant", [], ["pz"], {"value_float": 0.0}, "pz"),
               Node("Constant", [], ["nz"], {"value_float": -0.0}, "nz"),
               Node("Div", ["one", "pz"], ["a"], name="d1"), Node("Div", ["one", "nz"], ["b"], name="d2")],
              [X], [ValueInfo("a"), ValueInfo("b")], {"one": np.array(1.0, np.float32)})
    with np.errstate(divide="ignore"):
        s = _same_outputs(g, FEEDS)  # 1 / 0.0 = inf and 1 / -0.0 = -inf
    assert _ops(s).count("Constant") == 2


def _const(name, value):
    return Node("Constant", [], [name], {"value": np.asarray(value, np.int64)}, name=f"{name}/c")


def test_zero_pads_of_zero_pads_fold_into_one():
    g = Graph([_const("p", [0, 1, 0, 0, 2, 1]), _const("q", [1, 0, 2, 0, 0, 0]),
               Node("Pad", ["x", "p"], ["a"], name="pa"), Node("Pad", ["a", "q"], ["y"], name="pb")],
              [X], [ValueInfo("y")])
    s = _same_outputs(g, FEEDS)
    assert _ops(s).count("Pad") == 1
    np.testing.assert_array_equal(rg.Session(s).run(FEEDS)["y"],
                                  np.pad(FEEDS["x"], [(1, 0), (1, 2), (2, 1)]))


def test_pads_with_a_value_or_another_mode_do_not_fold():
    # padding with 1.0, or repeating edges, is not zero-padding: the amounts do not add
    for value, mode in (("one", "constant"), ("", "edge")):
        g = Graph([_const("p", [0, 0, 1, 0, 0, 0]),
                   Node("Constant", [], ["one"], {"value": np.array(1.0, np.float32)}, "one/c"),
                   Node("Pad", ["x", "p"], ["a"], name="pa"),
                   Node("Pad", ["a", "p", value], ["y"], {"mode": mode}, name="pb")],
                  [X], [ValueInfo("y")])
        assert _ops(_same_outputs(g, FEEDS)).count("Pad") == 2
    # negative amounts crop: a crop then a pad turns the cropped values into zeros, so it never folds (checked
    # structurally: the reference evaluator refuses negative pads)
    g = Graph([_const("p", [0, 0, -1, 0, 0, 0]), _const("q", [0, 0, 1, 0, 0, 0]),
               Node("Pad", ["x", "p"], ["a"], name="pa"), Node("Pad", ["a", "q"], ["y"], name="pb")],
              [X], [ValueInfo("y")])
    assert _ops(simplify(g)).count("Pad") == 2


def test_a_padded_convolution_weight_runs_on_onnxruntime():
    # onnxruntime 1.32's Pad_Fusion folds a Pad feeding a Conv's *weight* into the Conv's pads and then rejects
    # the graph; forward mode writes such Pads (the transpose of a strided convolution's weight crop)
    x, w = ValueInfo("x", np.float32, (1, 3, 12, 12)), ValueInfo("w", np.float32, (4, 3, 3, 3))
    g = Graph([_const("p", [0, 0, 0, 0, 0, 0, 1, 1]), Node("Pad", ["w", "p"], ["wp"], name="pad"),
               Node("Conv", ["x", "wp"], ["y"], {"strides": [2, 2], "pads": [1, 1, 1, 1]}, name="conv")],
              [x, w], [ValueInfo("y")])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32),
             "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}
    s = _same_outputs(g, feeds)
    expected = rg.Session(g, backend="reference").run(feeds)["y"]
    np.testing.assert_allclose(rg.Session(s).run(feeds)["y"], expected, rtol=1e-5, atol=1e-5)
