"""Output safety: names from a model are printed literally, and revgraph never destroys the user's files
(outputs that are inputs, late output checks, SIGTERM/SIGHUP, external data, npz member names, unused
initializers). These are issue 12, sections 4 and 5."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import DATA_DIR
from onnx import TensorProto, helper, numpy_helper

import revgraph as rg
from revgraph.autodiff.lift import lift_constants
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.onnx_io import external_data
from revgraph.onnx_io.npz import NAMES, member_names, read_outputs
from revgraph.text import LiteralConsole, literal

ESC_X = "\x1b[2J\x1b]0;pwned\x07x\r\nX"  # clear screen, set the window title, carriage return, newline
MARKUP_Y = "[bold red]y[/]"
LINK_W = "[link=file:///etc/passwd]w[/link]\u202e"  # Rich link markup and a right-to-left override
BAD_Z = "x[/oops]:smile:"  # a closing tag Rich cannot match (it raised MarkupError) and an emoji code
CONTROL = ("\x1b", "\r", "\x07", "\u202e")


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")


def evil_model(path: Path) -> Path:
    """y = sum(x * w) with hostile names (written with onnx.helper: revgraph never sees them first)."""
    nodes = [helper.make_node("Mul", [ESC_X, LINK_W], [BAD_Z], name="n\n1"),
             helper.make_node("ReduceSum", [BAD_Z], [MARKUP_Y], name="r\x1b[31m", keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(ESC_X, TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info(MARKUP_Y, TensorProto.FLOAT, [])],
                          initializer=[numpy_helper.from_array(np.ones(3, np.float32), LINK_W)])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def assert_literal(text: str, *names: str) -> None:
    """No character a terminal acts on, and each name shown escaped exactly as literal() writes it."""
    for ch in CONTROL:
        assert ch not in text, (ch, text)
    for name in names:
        assert literal(name) in text, (literal(name), text)


# ------------------------------------------------------------------------------------ 4. terminal safety


def test_literal_escapes_what_a_terminal_acts_on():
    assert literal("plain name/with.dots é 中") == "plain name/with.dots é 中"
    assert literal(ESC_X) == "\\x1b[2J\\x1b]0;pwned\\x07x\\r\\nX"
    assert literal("a\u2028b\u202ec\x9bd\x7f") == "a\\u2028b\\u202ec\\x9bd\\x7f"
    assert literal("\udcff") == "\\udcff"  # a lone surrogate (surrogateescape) would not even encode
    assert literal("tab\there") == "tab\\there"


def test_literal_console_shows_markup_as_written():
    console = LiteralConsole(force_terminal=True, width=200, color_system="truecolor", highlight=False)
    with console.capture() as cap:
        console.print(f"{MARKUP_Y} {LINK_W} {BAD_Z} {ESC_X}")
    shown = cap.get()
    assert "[bold red]y[/]" in shown and "[link=file:///etc/passwd]w[/link]" in shown and ":smile:" in shown
    assert "\x1b" not in shown  # no link (OSC 8), no clear screen, no title, no style from the markup
    assert shown.count("\n") == 1


@pytest.mark.parametrize("command", ["info", "run", "grad", "check", "show"])
def test_hostile_names_are_printed_literally(tmp_path, capsys, command):
    model = evil_model(tmp_path / "evil.onnx")
    args = {"info": [], "run": [], "grad": ["-o", str(tmp_path / "g.onnx")], "check": [],
            "show": ["--grad", "-o", str(tmp_path / "g.dot")]}[command]
    assert main([command, str(model), *args]) == 0
    out, err = capsys.readouterr()
    expected = {"info": (ESC_X, MARKUP_Y, "Mul"), "run": (MARKUP_Y,), "grad": (ESC_X + "_grad", LINK_W + "_grad"),
                "check": (ESC_X, LINK_W), "show": ()}[command]
    assert_literal(out + err, *expected)
    if command == "check":  # the rows and the title keep their brackets: no markup was read
        assert repr(MARKUP_Y) in out and "all 2 gradients agree" in out


def test_error_lines_and_warnings_are_literal(tmp_path, capsys):
    model = evil_model(tmp_path / "evil.onnx")
    assert main(["grad", str(model), "-o", str(tmp_path / "g.onnx"), "--wrt", "\x1b]0;title\x07q\nz"]) == 2
    err = capsys.readouterr().err
    # (the message quotes the name with repr, which escapes it; the terminal then doubles repr's backslashes,
    # as it doubles every backslash so that a name's own backslash is not read as an escape: issue 28, part 4)
    assert len(err.strip().splitlines()) == 1 and literal(repr("\x1b]0;title\x07q\nz")) in err
    assert_literal(err)
    assert main(["info", str(tmp_path / "no\x1b[2Jsuch.onnx")]) == 2  # a path from argv, too
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and literal(repr("no\x1b[2Jsuch.onnx"))[1:-1] in err


def test_train_prints_names_literally(tmp_path, capsys):
    w = helper.make_tensor_value_info  # logits[4, 3] = x @ W with a hostile output name
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], [ESC_X])], "g",
                          [w("x", TensorProto.FLOAT, [None, 2])], [w(ESC_X, TensorProto.FLOAT, [None, 3])],
                          initializer=[numpy_helper.from_array(np.ones((2, 3), np.float32), "W")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "d.npz", x=np.ones((4, 2), np.float32), labels=np.array([0, 1, 2, 0]))
    base = ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "cross-entropy",
            "--epochs", "1", "-o", str(tmp_path / "t.onnx")]
    assert main([*base, "--model-output", MARKUP_Y]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and MARKUP_Y in err
    assert main(base) == 0
    out, err = capsys.readouterr()
    assert_literal(out + err)


# ----------------------------------------------------------------------- 5. outputs that are input files


@pytest.fixture
def files(tmp_path):
    """A model with its training data, and links to both."""
    rng = np.random.default_rng(0)
    g = Graph([Node("MatMul", ["x", "W"], ["logits"])], [ValueInfo("x", np.float32, ("N", 2))],
              [ValueInfo("logits", np.float32, ("N", 3))], {"W": rng.standard_normal((2, 3)).astype(np.float32)})
    rg.save(g, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 2)).astype(np.float32), labels=rng.integers(0, 3, 8))
    os.symlink(tmp_path / "m.onnx", tmp_path / "link.onnx")
    os.link(tmp_path / "m.onnx", tmp_path / "hard.onnx")
    os.symlink(tmp_path / "d.npz", tmp_path / "dlink.npz")
    return tmp_path


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _refused(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("would destroy" in err or "same file" in err), err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("out", ["m.onnx", "link.onnx", "hard.onnx", "./m.onnx"])
def test_grad_refuses_to_overwrite_its_model(files, capsys, out):
    before = _snapshot(files)
    _refused(capsys, ["grad", str(files / "m.onnx"), "-o", str(files / out)], "-o", "the model")
    assert _snapshot(files) == before


def test_run_and_show_refuse_their_inputs(files, capsys):
    before = _snapshot(files)
    np.savez(files / "in.npz", x=np.ones((1, 2), np.float32))
    before = _snapshot(files)
    _refused(capsys, ["run", str(files / "m.onnx"), "--inputs", str(files / "in.npz"), "-o", str(files / "in.npz")],
             "--inputs")
    _refused(capsys, ["run", str(files / "m.onnx"), "-o", str(files / "hard.onnx")], "the model")
    os.symlink(files / "m.onnx", files / "pic.dot")
    _refused(capsys, ["show", str(files / "m.onnx"), "-o", str(files / "pic.dot")], "the model")
    assert {k: v for k, v in _snapshot(files).items() if k != "pic.dot"} == before


@pytest.mark.parametrize("extra, needle", [
    (["-o", "m.onnx"], "the model"),
    (["-o", "d.npz"], "--data"),
    (["-o", "dlink.npz"], "--data"),
    (["-o", "t.onnx", "--save-training-graph", "hard.onnx"], "the model"),
    (["-o", "t.onnx", "--save-training-graph", "d.npz"], "--data"),
    (["-o", "t.onnx", "--test-data", "dlink.npz", "--save-training-graph", "d.npz"], "--data"),
    (["-o", "t.onnx", "--save-training-graph", "t.onnx"], "same file"),
])
def test_train_refuses_outputs_that_are_inputs(files, capsys, extra, needle):
    before = _snapshot(files)
    args = ["train", str(files / "m.onnx"), "--data", str(files / "d.npz"), "--loss", "cross-entropy", "--epochs", "1"]
    args += [a if a.startswith("-") else str(files / a) for a in extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert _snapshot(files) == before and not (files / "t.onnx").exists()


def test_train_refuses_a_checkpoint_that_is_an_input(files, capsys):
    (files / "ck").mkdir()
    np.savez(files / "ck" / "checkpoint.npz", x=np.ones((8, 2), np.float32), labels=np.zeros(8, np.int64))
    before = (files / "ck" / "checkpoint.npz").read_bytes()
    args = ["train", str(files / "m.onnx"), "--data", str(files / "ck" / "checkpoint.npz"), "--loss", "cross-entropy",
            "--epochs", "1", "-o", str(files / "t.onnx"), "--checkpoint-dir", str(files / "ck")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the checkpoint file" in err and "--data" in err
    assert (files / "ck" / "checkpoint.npz").read_bytes() == before
    args[3], args[-1] = str(files / "d.npz"), str(files / "m.onnx")  # --checkpoint-dir names a file
    assert main(args) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("graph_path, needle", [("missing/step.onnx", "does not exist"), (".", "is a directory"),
                                                 ("", "is empty")])
def test_train_checks_every_output_before_training(files, capsys, graph_path, needle):
    args = ["train", str(files / "m.onnx"), "--data", str(files / "d.npz"), "--loss", "cross-entropy", "--epochs", "1",
            "-o", str(files / "t.onnx"), "--save-training-graph", str(files / graph_path) if graph_path else ""]
    start = time.perf_counter()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--save-training-graph" in err and needle in err and len(err.strip().splitlines()) == 1
    assert not (files / "t.onnx").exists()  # -o was not written first
    assert time.perf_counter() - start < 5


def test_an_output_that_is_the_models_external_data(tmp_path, capsys):
    g = Graph([Node("Mul", ["x", "w"], ["y"])], [ValueInfo("x", np.float32, (512,))],
              [ValueInfo("y", np.float32, (512,))], {"w": np.arange(512, dtype=np.float32)})
    onnx.save_model(rg.to_onnx(g), str(tmp_path / "m.onnx"), save_as_external_data=True, location="weights.bin",
                    size_threshold=0)
    data = (tmp_path / "weights.bin").read_bytes()
    _refused(capsys, ["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "weights.bin")], "external data")
    assert (tmp_path / "weights.bin").read_bytes() == data


# ------------------------------------------------------------------------------------- SIGTERM and SIGHUP

_WRITER = textwrap.dedent("""
    import os, signal, sys, time
    from revgraph.onnx_io.atomic import atomic_path
    with atomic_path(sys.argv[1]) as tmp:
        open(tmp, "wb").write(b"partial")
        print("writing", flush=True)
        time.sleep(30)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_write_removes_the_temporary_file_and_kills(tmp_path, sig):
    target = tmp_path / "out.onnx"
    # (the signal's default action in the writer, whatever this process inherited: under nohup SIGHUP is ignored,
    # which test_an_ignored_sighup_stays_ignored covers)
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)], stdout=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))  # noqa: PLW1509 (sets one signal)
    assert p.stdout.readline().strip() == "writing"
    assert [f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")]  # the temporary file exists
    start = time.perf_counter()
    p.send_signal(sig)
    assert p.wait(10) == -sig  # died of the signal, as torchrun expects of a worker
    assert time.perf_counter() - start < 2
    assert list(tmp_path.iterdir()) == []


def test_an_ignored_sighup_stays_ignored(tmp_path):
    target = tmp_path / "out.onnx"
    p = subprocess.Popen([sys.executable, "-c", _WRITER.replace("time.sleep(30)", "time.sleep(1)"), str(target)],
                         stdout=subprocess.PIPE, text=True,  # (preexec_fn: as nohup does)
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # noqa: PLW1509
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGHUP)
    assert p.wait(10) == 0  # nohup's choice is kept: the write finished
    assert [f.name for f in tmp_path.iterdir()] == ["out.onnx"]


def test_handlers_are_installed_only_while_writing(tmp_path):
    from revgraph.onnx_io.atomic import atomic_path

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}  # (SIGHUP: ignored under nohup)
    assert before[signal.SIGTERM] == signal.SIG_DFL
    with atomic_path(tmp_path / "a") as a, atomic_path(tmp_path / "b") as b:
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        assert signal.getsignal(signal.SIGHUP) != signal.SIG_DFL  # handled, or left ignored
        Path(a).write_text("a")
        Path(b).write_text("b")
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_sigterm_during_grad_leaves_no_temporary_file(tmp_path):
    """The command itself: its write slowed down, SIGTERM as soon as the temporary file appears."""
    evil_model(tmp_path / "m.onnx")
    script = textwrap.dedent("""
        import sys, time
        import revgraph.cli.write as cli_write, revgraph.onnx_io as io
        real_open = open
        def slow_open(path, mode="r", *a, **k):
            f = real_open(path, mode, *a, **k)
            if "w" in mode and str(path).endswith(".tmp"):
                time.sleep(30)
            return f
        io.open = cli_write.open = slow_open  # (the command writes through cli_write, the API through onnx_io)
        from revgraph.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    p = subprocess.Popen([sys.executable, "-c", script, "grad", str(tmp_path / "m.onnx"),
                          "-o", str(tmp_path / "g.onnx")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(f.name.endswith(".tmp") for f in tmp_path.iterdir()):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    p.terminate()
    assert p.wait(10) == -signal.SIGTERM
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m.onnx"]


# ----------------------------------------------------------------------------------- models over 2 GiB


def _weights_model(sizes: dict[str, int], constant: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """y = x * (sum(w1) + ...) for float32 initializers of the given element counts, and a Constant node of
    ``constant`` elements named ``c`` if asked (built with onnx.helper)."""
    rng = np.random.default_rng(0)
    weights = {k: rng.standard_normal(n).astype(np.float32) for k, n in sizes.items()}
    nodes, terms = [], []
    if constant:
        c = rng.standard_normal(constant).astype(np.float32)
        nodes.append(helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c)))
        nodes.append(helper.make_node("ReduceSum", ["c"], ["c_sum"], keepdims=0))
        terms.append("c_sum")
    for k in weights:
        nodes.append(helper.make_node("ReduceSum", [k], [f"{k}_sum"], keepdims=0))
        terms.append(f"{k}_sum")
    nodes.append(helper.make_node("Sum", terms, ["total"]))
    nodes.append(helper.make_node("Mul", ["x", "total"], ["y"]))
    g = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                          initializer=[numpy_helper.from_array(w, k) for k, w in weights.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    return model, {**weights, **({"c": c} if constant else {})}


def _fingerprint(model: onnx.ModelProto) -> list:
    """What a save could change in a model (a model over 2 GiB cannot be serialized to compare it whole)."""
    return [(t.name, t.data_location, [(e.key, e.value) for e in t.external_data],
             hashlib.sha256(t.raw_data).hexdigest()) for t in model.graph.initializer] + [
        len(model.graph.node), model.graph.output[0].name]


def _digest(weights: dict[str, np.ndarray]) -> dict[str, tuple[float, str, int]]:
    """Each array's float64 sum, hash and size: enough to check a 2 GiB model after its arrays are freed."""
    return {k: (float(w.astype(np.float64).sum()), hashlib.sha256(w.tobytes()).hexdigest(), w.nbytes)
            for k, w in weights.items()}


def _check_external_save(tmp_path, box, digest, run_proto=True):
    """Save the model in ``box`` (a one-element list: over the limit) and check the files, the loaded weights
    and a Session's result; the model is dropped on the way when ``run_proto`` is false (a 2 GiB model held
    twice is too much memory)."""
    model = box.pop()
    x = np.array([1.0, -2.0], np.float32)
    expected = x.astype(np.float64) * sum(total for total, _, _ in digest.values())
    (tmp_path / "out.onnx.data").write_bytes(b"an unrelated file that must not be appended to")
    before = _fingerprint(model)
    rg.save(model, tmp_path / "out.onnx")
    assert _fingerprint(model) == before  # the caller's ModelProto is unchanged
    data = (tmp_path / "out.onnx.data").read_bytes()
    assert not data.startswith(b"an unrelated")
    assert len(data) < sum(n for _, _, n in digest.values()) + 4096 * len(digest)  # replaced, not appended
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out.onnx.data").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "out.onnx.data"]
    stored = onnx.load(str(tmp_path / "out.onnx"), load_external_data=False)
    inits = {t.name for t in stored.graph.initializer}
    assert {t.name for t in stored.graph.initializer if t.data_location == TensorProto.EXTERNAL} == {
        k for k, (_, _, n) in digest.items() if n >= external_data.THRESHOLD and k in inits}
    constants = [n.attribute[0].t for n in stored.graph.node if n.op_type == "Constant"]
    assert all(t.data_location == TensorProto.EXTERNAL for t in constants)  # attribute tensors go out too
    loaded = rg.load(tmp_path / "out.onnx")
    assert _digest({k: loaded.initializers[k] for k in inits}) == {k: digest[k] for k in inits}
    del loaded, data
    sources = [str(tmp_path / "out.onnx")] + ([model] if run_proto else [])  # a path and a ModelProto
    if not run_proto:
        del model
    for source in sources:
        y = rg.Session(source).run({"x": x})["y"]
        np.testing.assert_allclose(y, expected, rtol=1e-4)
    if run_proto:
        size = (tmp_path / "out.onnx.data").stat().st_size
        rg.save(sources[1], tmp_path / "out.onnx")  # saving again gives the same files, not a longer .data
        assert (tmp_path / "out.onnx.data").stat().st_size == size


def test_external_data_save_below_a_lowered_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(external_data, "PROTOBUF_LIMIT", 100_000)
    model, weights = _weights_model({"w1": 20_000, "w2": 15_000, "small": 3}, constant=2_000)
    assert external_data.too_large(model)
    _check_external_save(tmp_path, [model], _digest(weights))


@pytest.mark.slow
def test_a_model_just_over_2_gib(tmp_path):
    """The real limit: three float32 initializers of 2^31 + 12 MiB in all (about 9 GiB of memory at the peak,
    6.5 GiB of disk, a few minutes)."""
    free = os.statvfs(tmp_path)
    if free.f_bavail * free.f_frsize < 7 << 30:
        pytest.fail("this test needs 7 GiB free in the temporary directory")
    n = (2**31 + (12 << 20)) // 4 // 3
    model, weights = _weights_model({"w1": n, "w2": n, "w3": n})
    digest = _digest(weights)
    del weights
    assert external_data.too_large(model)
    box = [model]
    del model
    try:
        _check_external_save(tmp_path, box, digest, run_proto=False)
    finally:  # 2 GiB of files: not left for pytest's retention of temporary directories
        for f in tmp_path.iterdir():
            f.unlink()


# -------------------------------------------------------------------------------------- run -o out.npz


HOSTILE_OUTPUTS = ["../../x", "/abs", "file", "allow_pickle", NAMES, "Y", "y", "a/b", "..", "", "ok_name", "seq[0]",
                   "output_0", "x" * 300]


def test_npz_member_names_are_safe_and_unique():
    members = member_names(HOSTILE_OUTPUTS)
    assert len({m.casefold() for m in members}) == len(members) and NAMES not in members
    for m in members:
        assert "/" not in m and not m.startswith(".") and m and len(m) <= 200
    assert members[HOSTILE_OUTPUTS.index("ok_name")] == "ok_name"  # plain names stay readable as they are
    assert members[HOSTILE_OUTPUTS.index("Y")] == "Y" and members[HOSTILE_OUTPUTS.index("y")] != "y"


def test_run_writes_hostile_output_names_safely(tmp_path, capsys):
    names = HOSTILE_OUTPUTS[:-1]
    nodes = [helper.make_node("Mul", ["x", f"c{i}"], [n]) for i, n in enumerate(names) if n]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in names if n],
                          initializer=[numpy_helper.from_array(np.array([i, i + 1], np.float32), f"c{i}")
                                       for i in range(len(names))])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    x = np.array([2.0, 3.0], np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    assert main(["run", str(tmp_path / "m.onnx"), "--inputs", str(tmp_path / "in.npz"),
                 "-o", str(tmp_path / "o.npz")]) == 0
    with zipfile.ZipFile(tmp_path / "o.npz") as zf:
        for member in zf.namelist():
            assert "/" not in member and ".." not in member.removesuffix(".npy"), member
    z = np.load(tmp_path / "o.npz")  # the loader the README and --help give
    outputs = {name: z[member] for member, name in z["revgraph_names"]}
    expected = {n: x * np.array([i, i + 1], np.float32) for i, n in enumerate(names) if n}
    assert outputs.keys() == expected.keys()
    for n, want in expected.items():
        np.testing.assert_array_equal(outputs[n], want)
    np.testing.assert_array_equal(z["ok_name"], expected["ok_name"])
    assert read_outputs(tmp_path / "o.npz").keys() == expected.keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz", "m.onnx", "o.npz"]


def test_string_outputs_are_stored_without_pickle(tmp_path):
    from revgraph.onnx_io.npz import write_outputs

    write_outputs(tmp_path / "s.npz", {"s": np.array(["a", "bé"], dtype=object), "file": np.arange(3)})
    back = read_outputs(tmp_path / "s.npz")  # np.load with allow_pickle=False inside
    assert back["s"].tolist() == ["a", "bé"] and back["file"].tolist() == [0, 1, 2]


# ------------------------------------------------------------------------------- unused initializers


LIGHT = DATA_DIR / "light" / "light_resnet50.onnx"


def test_lift_drops_the_shapes_it_orphans():
    shape = np.array([2, 3], np.int64)
    g = Graph([Node("ConstantOfShape", ["s"], ["w"], {"value": np.array([0.5], np.float32)}),
               Node("ConstantOfShape", ["t"], ["v"], {"value": np.array([1.0], np.float32)}),
               Node("Reshape", ["x", "t"], ["xr"]), Node("Mul", ["xr", "w"], ["m"]), Node("Add", ["m", "v"], ["y"])],
              [ValueInfo("x", np.float32, (6,))], [ValueInfo("y", np.float32, (2, 3))], {"s": shape, "t": shape.copy()})
    lifted, names = lift_constants(g)
    assert names == ["w", "v"]
    assert set(lifted.initializers) == {"t", "w", "v"}  # s only fed a lifted node; t is still read by Reshape
    np.testing.assert_array_equal(lifted.initializers["w"], np.full((2, 3), 0.5, np.float32))


def test_lifted_gradient_graph_has_no_unused_initializer(tmp_path):
    out = tmp_path / "g.onnx"
    assert main(["grad", str(LIGHT), "-o", str(out), "--lift-constants"]) == 0
    m = onnx.load(str(out))
    read = {i for n in m.graph.node for i in n.input} | {o.name for o in m.graph.output}
    assert [t.name for t in m.graph.initializer if t.name not in read] == []
    script = ("import onnxruntime as ort, sys; o = ort.SessionOptions(); o.log_severity_level = 2; "
              "ort.InferenceSession(sys.argv[1], o)")
    err = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, check=True).stderr
    warnings = [ln for ln in err.splitlines() if "[W:" in ln]
    assert warnings == [], warnings[:3]
