"""Writing a graph in pieces (revgraph.onnx_io.stream, used by every command that writes a derived graph): the
concatenated pieces parse to exactly the model ``revgraph.to_onnx`` builds, for every model shipped with the
onnx wheel and for gradient graphs with loops, sequences, metadata and dropout; the commands' files equal
``to_onnx`` of the same gradient; the cases that take the whole model (an untyped output, another opset, a
model over protobuf's 2 GiB) still write the same model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import DATA_DIR, model_id, shipped_models
from kit.loops import onnx_loop_model
from onnx import TensorProto

import revgraph as rg
from revgraph.cli import main
from revgraph.cli import write as cli_write
from revgraph.onnx_io import external_data
from revgraph.onnx_io.stream import pieces, prepared

SAMPLE = shipped_models()[::7]  # (every 7th: all kinds of operator and subgraph; the full list under -m slow)


def _joined(graph: rg.Graph, piece: int) -> onnx.ModelProto:
    ready = prepared(graph)
    assert ready is not None
    return onnx.ModelProto.FromString(b"".join(pieces(ready, piece=piece)))


def _assert_same(graph: rg.Graph) -> None:
    expected = rg.to_onnx(graph)
    for piece in (1, 3, 4096):  # a piece per node, a few, one for all
        assert _joined(graph, piece) == expected


@pytest.mark.parametrize("rel", SAMPLE, ids=model_id)
def test_pieces_parse_to_the_whole_model(rel):
    _assert_same(rg.load(DATA_DIR / rel))  # (every shipped model loads: tests/test_roundtrip.py)


@pytest.mark.slow
@pytest.mark.parametrize("rel", shipped_models(), ids=model_id)
def test_pieces_parse_to_the_whole_model_every_shipped_model(rel):
    test_pieces_parse_to_the_whole_model(rel)


def test_a_gradient_with_a_loop_metadata_and_dropout_is_the_same_model():
    g = rg.load(onnx_loop_model())
    gg = rg.gradient(g, "loss", ["W"])
    assert any(n.op_type == "Loop" for n in gg.nodes) and gg.metadata
    _assert_same(gg)


def test_a_sequence_output_is_the_same_model():
    g = rg.Graph(nodes=[rg.Node("SplitToSequence", ["x"], ["s"], {"axis": 0}, name="split")],
                 inputs=[rg.ValueInfo("x", np.float32, (4, 2))],
                 outputs=[rg.ValueInfo("s", np.float32, None, kind="sequence")], opsets={"": 21})
    _assert_same(g)


@pytest.mark.parametrize("command", [["grad", "--wrt", "W"], ["jvp", "--inputs", "W"]])
def test_the_written_file_is_to_onnx_of_the_same_graph(command, tmp_path, capsys):
    path, out = tmp_path / "m.onnx", tmp_path / "g.onnx"
    onnx.save(onnx_loop_model(), path)
    assert main([command[0], str(path), *command[1:], "-o", str(out)]) == 0, capsys.readouterr().err
    g = rg.load(path)
    built = rg.gradient(g, "loss", ["W"]) if command[0] == "grad" else rg.jvp(g, None, ["W"])
    written = onnx.load(out)
    cli_write.drop_unused_initializers(built)
    assert written == rg.to_onnx(built)
    forward, derived = cli_write.count_nodes([n.name for n in written.graph.node], g)
    assert f"{forward} forward + {derived} " in capsys.readouterr().out


def test_an_untyped_output_takes_the_whole_model(tmp_path, capsys):
    """An output without a dtype is typed from ONNX inference of the whole model (to_onnx): no pieces."""
    model = onnx_loop_model()
    g = rg.gradient(rg.load(model), "loss", ["W"])
    g.outputs[0] = rg.ValueInfo(g.outputs[0].name)
    assert prepared(g) is None
    out = tmp_path / "g.onnx"
    cli_write.write_graph(g, str(out), None, "gradient graph")
    written = onnx.load(out)
    assert written.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert written == rg.to_onnx(g)


def test_a_model_over_the_protobuf_limit_is_written_with_external_data(tmp_path, monkeypatch):
    """Pieces that pass protobuf's limit (lowered here to 1 KB: W is 4 KB) leave no file behind and the whole
    model is written with its large tensors in OUT.data, as before pieces."""
    g = rg.Graph(nodes=[rg.Node("MatMul", ["x", "W"], ["y"], name="mm"),
                        rg.Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, name="sum")],
                 inputs=[rg.ValueInfo("x", np.float32, (1, 32))], outputs=[rg.ValueInfo("loss", np.float32, ())],
                 initializers={"W": np.arange(1024, dtype=np.float32).reshape(32, 32) / 1024}, opsets={"": 21})
    gg = rg.gradient(g, "loss", ["W"])
    monkeypatch.setattr(external_data, "PROTOBUF_LIMIT", 1024)
    out = tmp_path / "g.onnx"
    names = cli_write.write_graph(gg, str(out), None, "gradient graph")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx", "g.onnx.data"]
    assert names == [n.name for n in onnx.load(out, load_external_data=False).graph.node]
    back = rg.load(out)
    np.testing.assert_array_equal(back.initializers["W"], g.initializers["W"])


def test_a_graph_onnx_refuses_is_not_written_by_pieces(tmp_path):
    """The full check runs on the pieces as they are written, before the file replaces OUT: a graph whose
    declared output type disagrees with its node is refused in one line naming the model's node, and the old
    OUT is left as it was."""
    g = rg.Graph(nodes=[rg.Node("Tanh", ["x"], ["y"], name="t"),
                        rg.Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, name="sum")],
                 inputs=[rg.ValueInfo("x", np.float32, (3,))], outputs=[rg.ValueInfo("loss", np.float32, ())],
                 opsets={"": 21})
    gg = rg.gradient(g, "loss", ["x"])
    gg.value_info["y"] = rg.ValueInfo("y", np.float32, (5,))  # what ONNX infers is (3,)
    out = tmp_path / "g.onnx"
    out.write_bytes(b"old")
    forward = g.copy()
    forward.value_info["y"] = gg.value_info["y"]
    with pytest.raises(rg.RevgraphError, match=r"its node 't' \(Tanh\) computes"):
        cli_write.write_graph(gg, str(out), None, "gradient graph", forward)
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx"]
