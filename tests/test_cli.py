"""The ``revgraph`` command: ``info`` and ``run``, and exit code 2 with one stderr line on bad input."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import DATA_DIR, graph_inputs

from revgraph.cli import main

#: Where pip puts the console scripts of the environment running the tests: its scripts directory (``bin/`` of a
#: virtual environment), the interpreter's own directory, and the user scheme's (``pip install --user``) where
#: this interpreter reads user site-packages (never in a virtual environment). The test runs the script found
#: there, never one of another environment that happens to be on PATH.
_USER_SCRIPTS = [sysconfig.get_path("scripts", f"{os.name}_user")] if site.ENABLE_USER_SITE else []
SCRIPT_DIRS = list(dict.fromkeys([sysconfig.get_path("scripts"), str(Path(sys.executable).parent), *_USER_SCRIPTS]))
#: 3 float inputs X[2,3,4], Y[1,3,4], Z[3,3,4]; 2 initializers; SequenceEmpty/SequenceInsert x3/SequenceAt; opset 12
SEQ_MODEL = DATA_DIR / "simple" / "test_sequence_model1" / "model.onnx"
#: one float input; Conv with weight and bias initializers; opset 6
CONV_MODEL = DATA_DIR / "pytorch-converted" / "test_Conv2d" / "model.onnx"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    # rich wraps at the terminal width (80 when not a tty); long data paths would be folded mid-word.
    monkeypatch.setenv("COLUMNS", "250")


def feeds_for(model_path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in graph_inputs(onnx.load(str(model_path))):
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(
            onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        )
    return feeds


def direct_ort(model_path: Path, feeds: dict) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("revgraph: error:")
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


# -------------------------------------------------------------------------------------------- info


def test_info_prints_inputs_outputs_opset_ops_and_initializers(capsys):
    original = onnx.load(str(SEQ_MODEL))
    assert main(["info", str(SEQ_MODEL)]) == 0
    out = capsys.readouterr().out
    source = next(o.version for o in original.opset_import if o.domain in ("", "ai.onnx"))
    assert re.search(rf"opset 21 \(converted from {source}\)", out)
    lines = out.splitlines()
    for vi in [*graph_inputs(original), *original.graph.output]:
        dims = ", ".join(str(d.dim_value) if d.HasField("dim_value") else "?" for d in vi.type.tensor_type.shape.dim)
        assert any(re.search(rf"^\s*{vi.name}\s.*float32.*\[{dims}\]", ln) for ln in lines), (vi.name, out)
    assert f"Initializers: {len(original.graph.initializer)}" in out
    ops = Counter(n.op_type for n in original.graph.node)
    assert f"Operators: {sum(ops.values())} nodes" in out
    for op, count in ops.items():
        assert any(re.search(rf"^\s*{op}\b\D*\b{count}\s*$", ln) for ln in lines), (op, out)
    inputs_at = out.index("Inputs")
    assert inputs_at < out.index("Outputs") < out.index("Initializers") < out.index("Operators")


def test_info_counts_nodes_inside_subgraphs(tmp_path, capsys):
    from onnx import TensorProto, helper

    then = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["a"])],
        "then",
        [],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
    )
    other = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["b"])],
        "else",
        [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    path = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Operators: 3 nodes, 2 of them in subgraphs" in out
    assert "converted" not in out and "Initializers: 0" in out


def test_info_and_run_print_brackets_in_paths_and_names_verbatim(tmp_path, capsys):
    # rich would read "[/x]" as a closing markup tag (MarkupError) and "[bold]" as a style
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Neg", ["x[0]"], ["y[/b]"])],
        "g",
        [helper.make_tensor_value_info("x[0]", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y[/b]", TensorProto.FLOAT, [2])],
    )
    (tmp_path / "d[").mkdir()
    path = tmp_path / "d[" / "x][bold].onnx"  # the path reads ".../d[/x][bold].onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "x[0]" in out and "y[/b]" in out
    assert main(["run", str(path)]) == 0
    assert "y[/b]" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- run


@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_run_with_random_inputs_prints_the_note_and_a_summary(backend, capsys):
    assert main(["run", str(SEQ_MODEL), "--backend", backend, "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert "note: no --inputs given; used random inputs (seed 3)" in captured.err
    for name, shape in (("X", "[2, 3, 4]"), ("Y", "[1, 3, 4]"), ("Z", "[3, 3, 4]")):
        assert f"{name} float32{shape}" in captured.err
    assert re.search(r"^\s*out\s.*float32.*\[1, 3, 4\]", captured.out, re.MULTILINE), captured.out


def test_run_that_fails_on_random_inputs_is_one_line(tmp_path, capsys):
    """A run refused on the random inputs it made up printed the note naming them and then the error: two lines.
    The refusal alone is printed, saying the inputs were random (issue 28: one line on bad input)."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.ones((0, 2), np.float32), "T")  # (no row: every index out of range)
    g = helper.make_graph([helper.make_node("Gather", ["T", "i"], ["y"], name="g")], "g",
                          [helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], [table])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "m.onnx")
    code = main(["run", str(tmp_path / "m.onnx"), "--seed", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "on random inputs, seed 0: give --inputs" in err, err


@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
@pytest.mark.parametrize("model", [SEQ_MODEL, CONV_MODEL], ids=["sequence_model1", "Conv2d"])
def test_run_with_npz_inputs_writes_the_outputs(model, backend, tmp_path, capsys):
    feeds = feeds_for(model, seed=7)
    np.savez(tmp_path / "in.npz", **feeds)
    code = main(
        ["run", str(model), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz"), "--backend", backend]
    )
    assert code == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "note:" not in captured.err
    assert str(tmp_path / "out.npz") in captured.out
    expected = direct_ort(model, feeds)
    with np.load(tmp_path / "out.npz") as got:  # plain names are their own members; revgraph_names maps them
        assert sorted(got.files) == sorted([*expected, "revgraph_names"])
        assert {name: member for member, name in got["revgraph_names"]} == {name: name for name in expected}
        for name, want in expected.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path, capsys):
    code = main(["info", str(tmp_path / "nope.onnx")])
    assert_one_line_error(code, capsys.readouterr().err, "nope.onnx", "no such file")


def test_non_onnx_file(tmp_path, capsys):
    path = tmp_path / "notes.onnx"
    path.write_text("these are not the bytes you are looking for\n")
    for command in (["info", str(path)], ["run", str(path)]):
        code = main(command)
        assert_one_line_error(code, capsys.readouterr().err, "notes.onnx")


def test_directory_instead_of_file(tmp_path, capsys):
    code = main(["info", str(tmp_path)])
    assert_one_line_error(code, capsys.readouterr().err, "directory")


@pytest.mark.parametrize(
    "model", [CONV_MODEL, DATA_DIR / "light" / "light_squeezenet.onnx"], ids=["Conv2d", "squeezenet"]
)
def test_truncated_onnx_file(model, tmp_path, capsys):
    data = model.read_bytes()
    path = tmp_path / "half.onnx"
    path.write_bytes(data[: len(data) // 2])
    code = main(["info", str(path)])
    assert_one_line_error(code, capsys.readouterr().err, "half.onnx")


def test_unknown_subcommand(capsys):
    code = main(["frobnicate", str(CONV_MODEL)])
    assert_one_line_error(code, capsys.readouterr().err, "'frobnicate'")


def test_no_subcommand(capsys):
    assert_one_line_error(main([]), capsys.readouterr().err)


def test_usage_error_with_brackets_is_printed_verbatim(capsys):
    # argparse echoes the stray argument; it must not be read as rich markup ("[/x]" would raise MarkupError)
    code = main(["info", str(CONV_MODEL), "[/x]", "[bold]"])
    assert_one_line_error(code, capsys.readouterr().err, "[/x]", "[bold]")


def test_unknown_backend(capsys):
    code = main(["run", str(CONV_MODEL), "--backend", "tensorflow"])
    assert_one_line_error(code, capsys.readouterr().err, "'tensorflow'", "onnxruntime", "reference")


def test_missing_inputs_in_npz(tmp_path, capsys):
    feeds = feeds_for(SEQ_MODEL)
    del feeds["Z"]
    np.savez(tmp_path / "in.npz", **feeds)
    code = main(["run", str(SEQ_MODEL), "--inputs", str(tmp_path / "in.npz")])
    assert_one_line_error(code, capsys.readouterr().err, "missing input", "'Z'")


def test_unknown_input_in_npz(tmp_path, capsys):
    feeds = feeds_for(CONV_MODEL)
    feeds["extra"] = np.zeros(2, np.float32)
    np.savez(tmp_path / "in.npz", **feeds)
    code = main(["run", str(CONV_MODEL), "--inputs", str(tmp_path / "in.npz")])
    assert_one_line_error(code, capsys.readouterr().err, "'extra'")


def test_wrong_dtype_in_npz(tmp_path, capsys):
    feeds = feeds_for(SEQ_MODEL)
    feeds["X"] = feeds["X"].astype(np.float64)
    np.savez(tmp_path / "in.npz", **feeds)
    code = main(["run", str(SEQ_MODEL), "--inputs", str(tmp_path / "in.npz")])
    assert_one_line_error(code, capsys.readouterr().err, "'X'", "float64", "float32")


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3), (1, 2, 3, 4)])
def test_wrong_shape_in_npz(shape, tmp_path, capsys):
    feeds = feeds_for(SEQ_MODEL)
    feeds["X"] = np.zeros(shape, np.float32)
    np.savez(tmp_path / "in.npz", **feeds)
    code = main(["run", str(SEQ_MODEL), "--inputs", str(tmp_path / "in.npz")])
    assert_one_line_error(code, capsys.readouterr().err, "'X'", str(list(shape)), "[2,3,4]")


def test_inputs_file_missing_or_not_npz(tmp_path, capsys):
    code = main(["run", str(CONV_MODEL), "--inputs", str(tmp_path / "absent.npz")])
    assert_one_line_error(code, capsys.readouterr().err, "absent.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip file at all")
    code = main(["run", str(CONV_MODEL), "--inputs", str(tmp_path / "bad.npz")])
    assert_one_line_error(code, capsys.readouterr().err, "bad.npz")


def test_output_directory_missing(tmp_path, capsys):
    np.savez(tmp_path / "in.npz", **feeds_for(CONV_MODEL))
    target = tmp_path / "no" / "such" / "dir" / "out.npz"
    code = main(["run", str(CONV_MODEL), "--inputs", str(tmp_path / "in.npz"), "-o", str(target)])
    assert_one_line_error(code, capsys.readouterr().err, "does not exist")


def installed_script() -> str:
    found = shutil.which("revgraph", path=os.pathsep.join(SCRIPT_DIRS))
    assert found, (f"no revgraph console script in {' or '.join(SCRIPT_DIRS)} (the environment of {sys.executable}); "
                   'install the package into it: pip install -e ".[test]"')
    return found


def test_installed_console_script(tmp_path):
    script = installed_script()
    feeds = feeds_for(CONV_MODEL, seed=11)
    np.savez(tmp_path / "in.npz", **feeds)
    ok = subprocess.run(
        [script, "run", str(CONV_MODEL), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    expected = direct_ort(CONV_MODEL, feeds)
    with np.load(tmp_path / "out.npz") as got:
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)

    data = CONV_MODEL.read_bytes()
    (tmp_path / "half.onnx").write_bytes(data[: len(data) // 2])
    bad = subprocess.run(
        [script, "info", str(tmp_path / "half.onnx")], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "half.onnx" in bad.stderr
    assert bad.stdout == ""


def test_run_a_model_with_a_sequence_output(tmp_path, capsys):
    import revgraph as rg
    from revgraph.ir import Graph, Node, ValueInfo

    g = Graph([Node("SplitToSequence", ["x", "sizes"], ["parts"], {"axis": 0}, "split")],
              [ValueInfo("x", np.float32, (3, 2))], [ValueInfo("parts", np.float32, None, kind="sequence")],
              {"sizes": np.array([1, 2], np.int64)})
    rg.save(g, tmp_path / "seq.onnx")
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.savez(tmp_path / "in.npz", x=x)
    assert main(["run", str(tmp_path / "seq.onnx"), "--inputs", str(tmp_path / "in.npz")]) == 0
    assert "parts[1]" in capsys.readouterr().out
    assert main(["run", str(tmp_path / "seq.onnx"), "--inputs", str(tmp_path / "in.npz"),
                 "-o", str(tmp_path / "o.npz")]) == 0
    with np.load(tmp_path / "o.npz") as got:
        np.testing.assert_array_equal(got["parts[0]"], x[:1])
        np.testing.assert_array_equal(got["parts[1]"], x[1:])


def test_check_refuses_a_model_over_its_size_bound(tmp_path, capsys, monkeypatch):
    # issue 40, item 6: a 200,000-node check took over 300 CPU s; check takes at most limits.MAX_CHECK_NODES
    # (100,000: 80 CPU s) and refuses more in one line (the bound lowered here, the model small)
    from kit.harness import one_line_error

    import revgraph as rg
    from revgraph import limits
    from revgraph.ir import Graph, Node, ValueInfo

    g = Graph([Node("Sin", ["x"], ["s"], name="sin"), Node("ReduceSum", ["s"], ["y"], {"keepdims": 0}, "r")],
              [ValueInfo("x", np.float64, (3,))], [ValueInfo("y")])
    rg.save(g, tmp_path / "m.onnx")
    monkeypatch.setattr(limits, "MAX_CHECK_NODES", 1)
    one_line_error(main(["check", str(tmp_path / "m.onnx")]), capsys.readouterr().err,
                   "has 2 nodes; check takes at most 1")
    monkeypatch.setattr(limits, "MAX_CHECK_NODES", 2)
    assert main(["check", str(tmp_path / "m.onnx")]) == 0


def test_ctrl_c_while_revgraph_loads_is_one_line(monkeypatch, capsys):
    # issue 40, item 6: the console script imported revgraph.cli (numpy, onnx, onnxruntime: seconds) before any
    # handler of revgraph's was installed, so a Ctrl-C then printed a traceback. Its entry point now catches the
    # interrupt around that import: here an import of revgraph.cli that is interrupted
    import importlib.abc

    import revgraph_entry

    class Interrupt(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "revgraph.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "revgraph.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupt(), *sys.meta_path])
    assert revgraph_entry.main() == 130
    assert capsys.readouterr().err == "revgraph: interrupted\n"


def test_the_console_script_runs_the_entry_point():
    script = next(Path(d) / "revgraph" for d in SCRIPT_DIRS if (Path(d) / "revgraph").exists())
    assert "revgraph_entry" in script.read_text(errors="replace"), script
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("revgraph "), proc.stderr


def test_run_refuses_a_seed_with_inputs(tmp_path, capsys):
    # issue 40, item 4 (its siblings): --seed seeds random inputs, so with --inputs it would do nothing
    from kit.harness import one_line_error

    np.savez(tmp_path / "in.npz", X=np.zeros((2, 3, 4), np.float32))  # (refused before it is read)
    code = main(["run", str(SEQ_MODEL), "--inputs", str(tmp_path / "in.npz"), "--seed", "3"])
    one_line_error(code, capsys.readouterr().err, "--seed seeds the random inputs: it has no effect with --inputs")
