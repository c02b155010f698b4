"""The IR: ``Graph.check`` errors, 100,000-node chains, and one-line refusals on load."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_proto_ssa
from onnx import TensorProto, helper

import revgraph as rg
from revgraph import Graph, GraphError, Node, ValueInfo

F32 = np.float32
N_CHAIN = 100_000


def f32(name, shape=(3,)):
    return ValueInfo(name, F32, shape)


def check_error(graph: Graph, *fragments: str) -> str:
    """``graph.check()`` raises a one-line GraphError containing every fragment; returns the message."""
    with pytest.raises(GraphError) as info:
        graph.check()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# -------------------------------------------------------------------------------------- long chains


def test_chain_of_100k_nodes_checks_saves_loads_and_runs(tmp_path):
    nodes, prev = [], "x"
    for k in range(N_CHAIN):
        out = "y" if k == N_CHAIN - 1 else f"h{k}"
        nodes.append(Node("Add", [prev, "one"], [out]) if k % 2 == 0 else Node("Identity", [prev], [out]))
        prev = out
    g = Graph(nodes, [f32("x")], [f32("y")], {"one": np.ones(3, F32)})
    g.check()
    path = tmp_path / "chain.onnx"
    rg.save(g, path)
    onnx.checker.check_model(str(path), full_check=True)
    back = rg.load(path)
    back.check()
    assert len(back.nodes) == N_CHAIN
    assert back.input_names == ["x"] and back.output_names == ["y"]
    assert [n.op_type for n in back.nodes] == [n.op_type for n in g.nodes]
    assert back.nodes[0].inputs == ["x", "one"] and back.nodes[-1].outputs == ["y"]
    assert all(b.inputs[0] == a.outputs[0] for a, b in zip(back.nodes, back.nodes[1:], strict=False))
    np.testing.assert_array_equal(back.initializers["one"], np.ones(3, F32))


def test_chain_of_10k_nodes_runs():
    # The same chain, shorter, executed (an onnxruntime session over 100k nodes alone takes ~10 s).
    n = 10_000
    nodes = [Node("Add", ["h", "one"], ["h"]) if k % 2 == 0 else Node("Identity", ["h"], ["h"]) for k in range(n)]
    g = Graph(
        [Node("Identity", ["x"], ["h"]), *nodes, Node("Identity", ["h"], ["y"])],
        [f32("x")],
        [f32("y")],
        {"one": np.ones(3, F32)},
    )
    x = np.array([0.0, 1.5, -2.25], F32)
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_array_equal(rg.Session(g, backend=backend).run({"x": x})["y"], x + n // 2)  # exact in float32


def test_in_place_chain_of_100k_nodes(tmp_path):
    nodes = [Node("Add", ["h", "one"], ["h"]) if k % 2 == 0 else Node("Neg", ["h"], ["h"]) for k in range(N_CHAIN)]
    g = Graph(nodes, [f32("x")], [f32("out")], {"one": np.ones(3, F32)})
    g.nodes.insert(0, Node("Identity", ["x"], ["h"]))
    g.nodes.append(Node("Identity", ["h"], ["out"]))
    g.check()
    info = rg.analyze_ssa(g)
    assert len(info.versions["h"]) == N_CHAIN + 1
    assert info.versions["h"][-1].readers == [(g.nodes[-1], 0)]
    assert info.versions["h"][5].producer is g.nodes[5]
    ssa = rg.to_ssa(g)
    assert rg.is_ssa(ssa)
    written = [o for n in ssa.nodes for o in n.outputs]
    assert len(set(written)) == len(written) == N_CHAIN + 2
    path = tmp_path / "inplace.onnx"
    rg.save(g, path)
    assert_proto_ssa(onnx.load(str(path)))
    back = rg.load(path)
    assert len(back.nodes) == N_CHAIN + 2
    assert back.output_names == ["out"]


# ------------------------------------------------------------------------------------ check() errors


def test_a_valid_graph_passes():
    Graph([Node("Relu", ["x"], ["y"], name="r")], [f32("x")], [f32("y")]).check()


def test_name_read_before_any_write():
    g = Graph([Node("Relu", ["ghost"], ["y"], name="r")], [f32("x")], [f32("y")])
    check_error(g, "'r'", "Relu", "'ghost'")


def test_name_read_before_its_producer():
    g = Graph(
        [Node("Neg", ["t"], ["y"], name="early"), Node("Relu", ["x"], ["t"], name="late")], [f32("x")], [f32("y")]
    )
    check_error(g, "'early'", "Neg", "'t'", "'late' (Relu) writes only later", "cycle")


def test_too_many_inputs():
    g = Graph([Node("Relu", ["x", "x"], ["y"], name="r2")], [f32("x")], [f32("y")])
    check_error(g, "'r2'", "Relu", "2 inputs")


def test_too_few_inputs():
    g = Graph([Node("Add", ["x"], ["y"], name="half_add")], [f32("x")], [f32("y")])
    check_error(g, "'half_add'", "Add", "1 inputs")


def test_too_many_outputs():
    g = Graph([Node("Relu", ["x"], ["y", "z"], name="two_out")], [f32("x")], [f32("y")])
    check_error(g, "'two_out'", "Relu", "2 outputs")


def test_unknown_operator():
    g = Graph([Node("Frobnicate", ["x"], ["y"], name="frob")], [f32("x")], [f32("y")])
    check_error(g, "'frob'", "Frobnicate", "unknown operator")


def test_operator_of_a_domain_the_graph_does_not_import():
    g = Graph([Node("Relu", ["x"], ["y"], name="custom", domain="com.example")], [f32("x")], [f32("y")])
    check_error(g, "'custom'", "com.example")


def test_operator_unknown_at_the_graph_opset():
    # Gelu exists from opset 20 on
    g = Graph([Node("Gelu", ["x"], ["y"], name="gelu")], [f32("x")], [f32("y")], opsets={"": 17})
    check_error(g, "'gelu'", "Gelu", "17")


def _body(n_in: int, n_out: int) -> Graph:
    ins = [ValueInfo("i", np.int64, ()), ValueInfo("c", np.bool_, ()), f32("a"), f32("extra")][:n_in]
    nodes = [Node("Identity", ["c"], ["c_out"], name="b_cond"), Node("Neg", ["a"], ["a_out"], name="b_neg")]
    outs = [ValueInfo("c_out", np.bool_, ()), f32("a_out"), f32("a_out")][:n_out]
    return Graph(nodes, ins, outs, name="body")


def _loop(body: Graph) -> Graph:
    return Graph(
        [Node("Loop", ["M", "go", "x"], ["y"], {"body": body}, name="lp")],
        [f32("x")],
        [f32("y")],
        {"M": np.array(2, np.int64), "go": np.array(True)},
    )


def test_loop_body_ok():
    g = _loop(_body(3, 2))
    g.check()
    np.testing.assert_allclose(rg.Session(g).run({"x": np.ones(3, F32)})["y"], np.ones(3, F32))


def test_loop_body_with_wrong_input_count():
    check_error(_loop(_body(4, 2)), "body", "'lp'", "Loop", "4 inputs", "needs 3")
    check_error(_loop(_body(2, 2)), "body", "'lp'", "Loop", "2 inputs", "needs 3")


def test_loop_body_with_wrong_output_count():
    check_error(_loop(_body(3, 1)), "body", "'lp'", "Loop", "1 outputs")
    check_error(_loop(_body(3, 3)), "body", "'lp'", "Loop", "3 outputs")


def test_loop_without_body():
    g = Graph(
        [Node("Loop", ["M", "go", "x"], ["y"], name="lp")],
        [f32("x")],
        [f32("y")],
        {"M": np.array(2, np.int64), "go": np.array(True)},
    )
    check_error(g, "'lp'", "Loop", "'body'")


def _if(n_then: int, n_else: int, inputs_in_then: bool = False) -> Graph:
    def branch(n: int, name: str, with_input: bool) -> Graph:
        outs = [f32(f"{name}{k}") for k in range(n)]
        nodes = [Node("Neg", ["x"], [o.name], name=f"{name}_neg{k}") for k, o in enumerate(outs)]
        return Graph(nodes, [f32("unexpected")] if with_input else [], outs, name=name)

    return Graph(
        [
            Node(
                "If",
                ["c"],
                ["y"],
                {"then_branch": branch(n_then, "t", inputs_in_then), "else_branch": branch(n_else, "e", False)},
                name="cond",
            )
        ],
        [f32("x"), ValueInfo("c", np.bool_, ())],
        [f32("y")],
    )


def test_if_branch_ok():
    _if(1, 1).check()


def test_if_branch_with_wrong_output_count():
    check_error(_if(2, 1), "then_branch", "'cond'", "If", "2 outputs", "needs 0 and 1")
    check_error(_if(1, 0), "else_branch", "'cond'", "If", "0 outputs")


def test_if_branch_with_inputs():
    check_error(_if(1, 1, inputs_in_then=True), "then_branch", "'cond'", "If", "1 inputs")


def _scan(n_body_in: int, n_body_out: int) -> Graph:
    ins = [f32("s_in", ()), f32("x_t", ()), f32("spare", ())][:n_body_in]
    nodes = [Node("Add", ["s_in", "x_t"], ["s_out"], name="sc_add"), Node("Identity", ["s_out"], ["y_t"], name="sc_id")]
    outs = [f32("s_out", ()), f32("y_t", ()), f32("spare_out", ())][:n_body_out]
    if n_body_out > 2:
        nodes.append(Node("Identity", ["s_out"], ["spare_out"], name="sc_spare"))
    body = Graph(nodes, ins, outs, name="scan_body")
    return Graph(
        [Node("Scan", ["s0", "xs"], ["s_final", "ys"], {"body": body, "num_scan_inputs": 1}, name="sc")],
        [f32("s0", ()), f32("xs", (4,))],
        [f32("s_final", ()), f32("ys", (4,))],
    )


def test_scan_body_ok():
    g = _scan(2, 2)
    g.check()
    got = rg.Session(g).run({"s0": np.array(1.0, F32), "xs": np.array([1, 2, 3, 4], F32)})
    np.testing.assert_allclose(got["ys"], [2, 4, 7, 11])
    np.testing.assert_allclose(got["s_final"], 11)


def test_scan_body_mismatch():
    check_error(_scan(3, 2), "body", "'sc'", "Scan", "3 inputs", "needs 2 and 2")
    check_error(_scan(2, 3), "body", "'sc'", "Scan", "3 outputs", "needs 2 and 2")


def test_errors_inside_subgraphs_name_where_they_are():
    body = _body(3, 2)
    body.nodes[1] = Node("Neg", ["nowhere"], ["a_out"], name="b_neg")
    check_error(_loop(body), "'b_neg'", "'nowhere'", "body of node 'lp' (Loop)")


def test_graph_output_never_produced():
    g = Graph([Node("Relu", ["x"], ["y"], name="r")], [f32("x")], [f32("y"), f32("missing")])
    check_error(g, "'missing'", "never produced")


def test_subgraph_output_never_produced():
    body = _body(3, 2)
    body.outputs[1] = f32("not_there")
    check_error(_loop(body), "'not_there'", "never produced", "body of node 'lp' (Loop)")


# ------------------------------------------------------------------------------------- load refusals


def _model(domain: str = "", op: str = "Relu", **graph_kwargs) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], name="n0", domain=domain or None)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        **graph_kwargs,
    )
    imports = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=imports)


def test_load_accepts_a_custom_domain_and_gradient_refuses_its_node_in_one_line():
    g = rg.load(_model("com.example", "Frob"))  # valid ONNX (issue 41: the domain was refused)
    with pytest.raises(rg.GraphError) as info:
        rg.gradient(g, "y", wrt=["x"])
    assert "\n" not in str(info.value) and "unsupported operator com.example.Frob (node 'n0')" in str(info.value)


def test_load_refuses_a_map_typed_input_in_one_line():
    model = _model()
    model.graph.input.append(
        helper.make_value_info(
            "m", helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
        )
    )
    with pytest.raises(rg.UnsupportedModelError) as info:
        rg.load(model)
    assert "\n" not in str(info.value) and "'m'" in str(info.value) and "map" in str(info.value)


def test_load_accepts_bytes_and_converts_the_opset():
    g = rg.load(_model().SerializeToString())
    assert g.opset == rg.TARGET_OPSET and g.source_opset == 17
    assert [n.op_type for n in g.nodes] == ["Relu"]
    np.testing.assert_array_equal(rg.Session(g).run({"x": np.array([-1, 2], F32)})["y"], [0, 2])


def test_session_refuses_an_unknown_backend():
    g = Graph([Node("Relu", ["x"], ["y"], name="r")], [f32("x")], [f32("y")])
    with pytest.raises(rg.RevgraphError, match="'tensorflow'"):
        rg.Session(g, backend="tensorflow")


def test_sequence_output_comes_back_as_a_list_of_arrays():
    # Ragged pieces: np.asarray on the sequence would fail; equal pieces would be stacked into one array.
    g = Graph(
        [Node("SplitToSequence", ["x", "split"], ["seq"], name="sp")],
        [f32("x", (5,))],
        [ValueInfo("seq", F32, None, kind="sequence")],
        {"split": np.array([2, 3], np.int64)},
    )
    x = np.arange(5, dtype=F32)
    for backend in ("onnxruntime", "reference"):
        got = rg.Session(g, backend=backend).run({"x": x})["seq"]
        assert isinstance(got, list) and len(got) == 2
        np.testing.assert_array_equal(got[0], [0, 1])
        np.testing.assert_array_equal(got[1], [2, 3, 4])


def test_sequence_input_is_fed_as_a_list():
    g = Graph(
        [Node("ConcatFromSequence", ["seq"], ["y"], {"axis": 0}, name="cat")],
        [ValueInfo("seq", F32, (None,), kind="sequence")],
        [f32("y", (None,))],
    )
    pieces = [np.array([1, 2], F32), np.array([3, 4], F32)]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_array_equal(rg.Session(g, backend=backend).run({"seq": pieces})["y"], [1, 2, 3, 4])
