"""ONNX's full check in parts (revgraph.onnx_io.part_check, what every command that writes a derived graph and
``check_valid`` run): for every sampled model shipped with the onnx wheel, for gradient graphs with loops and
for each kind of fault ONNX's checker finds (a declared type contradicting a node, a node before its input's
producer, a name written twice, a graph output nobody writes, an undefined input), the check in pieces of 1, 2
and 5 nodes refuses exactly when ``onnx.checker.check_model(model, full_check=True)`` of the whole model does,
naming the same node."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from conftest import DATA_DIR, model_id, shipped_models

import revgraph as rg
from revgraph.onnx_io import as_written
from revgraph.onnx_io.part_check import check_in_parts

SAMPLE = shipped_models()[::5]
ERRORS = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def _whole(graph: rg.Graph) -> str | None:
    """ONNX's verdict on the whole model: None, or the failing node's name (or the error's class)."""
    try:
        onnx.checker.check_model(rg.to_onnx(graph), full_check=True)
    except ERRORS as exc:
        return _culprit(exc)
    return None


def _culprit(exc: Exception) -> str:
    """The first node ONNX's message names (the check of the whole model goes on after a failing node and
    names every one; a piece's check stops at its first failing piece), or the error's class."""
    named = re.findall(r"node name: ([^)]*)\)", str(exc)) or re.findall(r"name: (\S+) OpType", str(exc))
    return named[0] if named else type(exc).__name__


def _parts(graph: rg.Graph, piece: int) -> str | None:
    try:
        check_in_parts(as_written(graph), piece)
    except ERRORS as exc:
        return _culprit(exc)
    return None


def _assert_agree(graph: rg.Graph, expect_failure: bool | None = None) -> None:
    whole = _whole(graph)
    if expect_failure is not None:
        assert (whole is not None) == expect_failure, whole  # (the fault is one ONNX's own check finds)
    for piece in (1, 2, 5):
        assert _parts(graph, piece) == whole, piece


@pytest.mark.parametrize("rel", SAMPLE, ids=model_id)
def test_parts_agree_with_the_whole_check_on_shipped_models(rel):
    _assert_agree(rg.load(DATA_DIR / rel), expect_failure=False)


def _chain(n: int = 12) -> rg.Graph:
    """MatMul, Add, Tanh, Mul cycling on a [2, 2] value, then ReduceSum: bench/build_memory.py's chain."""
    nodes, prev = [], "x"
    for i in range(n - 1):
        op, extra = (("MatMul", "W"), ("Add", "b"), ("Tanh", None), ("Mul", "c"))[i % 4]
        nodes.append(rg.Node(op, [prev] + ([extra] if extra else []), [f"v{i}"], name=f"n{i}"))
        prev = f"v{i}"
    nodes.append(rg.Node("ReduceSum", [prev], ["loss"], {"keepdims": 0}, name="loss"))
    inits = {"W": np.array([[0.6, -0.3], [0.2, 0.5]], np.float32), "b": np.array([0.1, -0.1], np.float32),
             "c": np.array(0.9, np.float32), "big": np.ones((80, 80), np.float32)}  # (big: a typed input)
    g = rg.Graph(nodes, [rg.ValueInfo("x", np.float32, (2, 2))], [rg.ValueInfo("loss", np.float32, ())], inits,
                 opsets={"": 21})
    return rg.load(rg.to_onnx(g))  # (typed by shape inference, as a loaded model is)


def _gradient() -> rg.Graph:
    return rg.gradient(_chain(), "loss", ["W", "b", "c"])


def test_gradient_graphs_pass_in_parts():
    _assert_agree(_gradient(), expect_failure=False)
    from kit.loops import onnx_loop_model  # a Loop whose body reads outer values across pieces

    loop = rg.load(onnx_loop_model())
    _assert_agree(loop, expect_failure=False)
    _assert_agree(rg.gradient(loop, "loss", ["W"]), expect_failure=False)


def _wrong_type(g: rg.Graph) -> rg.Graph:
    g.value_info["v5"] = rg.ValueInfo("v5", np.float32, (3, 2))  # Tanh of a [2, 2] value
    return g


def _untyped_then_wrong(g: rg.Graph) -> rg.Graph:
    """v4 has no declared type (its readers' pieces take what inference found for it), and v6 a wrong one."""
    del g.value_info["v4"]
    g.value_info["v6"] = rg.ValueInfo("v6", np.float32, (2, 7))
    return g


def _wrong_output(g: rg.Graph) -> rg.Graph:
    g.outputs[0] = rg.ValueInfo(g.outputs[0].name, np.float32, (4,))
    return g


def _swapped(g: rg.Graph) -> rg.Graph:
    g.nodes[2], g.nodes[7] = g.nodes[7], g.nodes[2]  # n7 reads v6 before n6 writes it
    return g


def _written_twice(g: rg.Graph) -> rg.Graph:
    g.nodes[8].outputs[0] = g.nodes[1].outputs[0]
    return g


def _output_unwritten(g: rg.Graph) -> rg.Graph:
    g.outputs.append(rg.ValueInfo("nowhere", np.float32, (2,)))
    return g


def _undefined_input(g: rg.Graph) -> rg.Graph:
    g.nodes[6].inputs[0] = "nowhere"
    return g


FAULTS = [_wrong_type, _untyped_then_wrong, _wrong_output, _swapped, _written_twice, _output_unwritten,
          _undefined_input]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("graph", [_chain, _gradient], ids=["forward", "gradient"])
def test_each_fault_is_found_in_parts_as_in_the_whole(graph, fault):
    g = graph()
    if fault in (_written_twice, _swapped):  # (to_onnx renames a graph out of SSA form: compare as written)
        g = as_written(g)
    _assert_agree(fault(g), expect_failure=True)


def test_a_written_graph_is_not_checked_whole(tmp_path, monkeypatch):
    """`revgraph grad` on a 3,000-node chain: no check of more than one piece (4,096 nodes) at a time."""
    from revgraph.cli import main

    sizes = []
    real = onnx.checker.check_model

    def spy(model, *args, **kwargs):
        if isinstance(model, onnx.ModelProto):
            sizes.append(len(model.graph.node))
        else:
            sizes.append(10**9)  # a path or bytes: the whole file
        return real(model, *args, **kwargs)

    path = tmp_path / "m.onnx"
    rg.save(_chain(3000), path)
    monkeypatch.setattr(onnx.checker, "check_model", spy)
    assert main(["grad", str(path), "--wrt", "W", "-o", str(tmp_path / "g.onnx")]) == 0
    assert len(sizes) >= 4 and max(sizes) <= 4096, sizes
    real(onnx.load(tmp_path / "g.onnx"), full_check=True)


def _reshaped(wrong: bool) -> rg.Graph:
    """y = Reshape(x, s) of unknown rank (s: a shape of unknown length), read by the next piece; with ``wrong``,
    z = Relu(y) is declared an int64."""
    g = rg.Graph([rg.Node("Reshape", ["x", "s"], ["y"], name="reshape"), rg.Node("Relu", ["y"], ["z"], name="relu"),
                  rg.Node("ReduceSum", ["z"], ["loss"], {"keepdims": 0}, name="sum")],
                 [rg.ValueInfo("x", np.float32, (2, 3)), rg.ValueInfo("s", np.int64, (None,))],
                 [rg.ValueInfo("loss", np.float32, ())], opsets={"": 21})
    g.value_info["y"] = rg.ValueInfo("y", np.float32, None)
    if wrong:
        g.value_info["z"] = rg.ValueInfo("z", np.int64, None)
    return g


@pytest.mark.parametrize("wrong", [False, True])
def test_a_value_of_unknown_rank_crosses_a_boundary(wrong):
    """ONNX wants a shape for every model input: a piece computes such a value from an input of its own."""
    _assert_agree(_reshaped(wrong), expect_failure=wrong)


def test_a_value_of_no_known_type_takes_the_whole_check(monkeypatch):
    """An operator of a domain ONNX does not know writes a value no one types: the pieces after it cannot be
    checked alone, so the whole model is (and passes, as ONNX's own check of it does)."""
    g = rg.Graph([rg.Node("Relu", ["x"], ["a"], name="relu"),
                  rg.Node("Mystery", ["a"], ["b"], name="mystery", domain="example.custom"),
                  rg.Node("Identity", ["b"], ["y"], name="copy")],
                 [rg.ValueInfo("x", np.float32, (2,))], [rg.ValueInfo("y", np.float32, (2,))],
                 opsets={"": 21, "example.custom": 1})
    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model",
                        lambda m, *a, **k: (seen.append(len(m.graph.node)), real(m, *a, **k)))
    _assert_agree(g, expect_failure=False)
    assert 3 in seen  # (the whole model's three nodes, checked together after the pieces could not be)
