"""The terminal around a command (issue 28, part 4): no abbreviated options, a closed pipe or a closed standard
output ends a command quietly, and a name the output's encoding cannot show is escaped instead of fatal."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(__import__("pathlib").Path(rg.__file__).parents[1]),
                                                    os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A two-node model whose input, values and output have non-ASCII names (``é``, ``λ``)."""
    path = tmp_path_factory.mktemp("terminal") / "m.onnx"
    g = Graph(nodes=[Node("Tanh", ["xé"], ["hλ"], {}, "tanh"), Node("Mul", ["hλ", "w"], ["yé"], {}, "mul")],
              inputs=[ValueInfo("xé", np.float32, (3,))], outputs=[ValueInfo("yé", np.float32, (3,))],
              initializers={"w": np.array([1.0, 2.0, 3.0], np.float32)})
    rg.save(g, path)
    return str(path)


def _revgraph(*argv: str, stdin=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "revgraph", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**ENV, **kw.pop("env", {})}, **kw)


@pytest.mark.parametrize("argv", [
    ["train", "M", "--data", "d.npz", "--loss", "mse", "--epochs", "1", "-o", "o.onnx", "--npro", "2"],
    ["grad", "M", "-o", "o.onnx", "--wr", "w"],
    ["check", "M", "--rto", "1e-3"],
    ["run", "M", "--inp", "in.npz"],
    ["jacobian", "M", "-o", "o.onnx", "--mod", "forward"],
    ["lora", "apply", "M", "a.npz", "-o", "o.onnx", "--mer", "x"],
])
def test_abbreviated_options_are_unknown(argv, model, capsys, tmp_path, monkeypatch):
    """argparse would take ``--npro`` for ``--nproc`` (and torchrun then printed a 7-line usage error): every
    command refuses an abbreviation in one line, exit 2, and writes nothing."""
    monkeypatch.chdir(tmp_path)
    code = main([model if a == "M" else a for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "unrecognized arguments" in err[0] and argv[-2] in err[0], err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["info", "M"], ["check", "M"], ["run", "M"]])
def test_a_closed_pipe_ends_the_command_quietly(argv, model):
    """The reader went away before the command wrote (``revgraph check m.onnx | head -1`` exited 1, which reads
    as a failed check): the command ends with 128 + SIGPIPE, as Unix tools do, and prints nothing."""
    p = _revgraph(*[model if a == "M" else a for a in argv])
    p.stdout.close()
    err = p.stderr.read().decode()  # (run notes its random inputs on stderr)
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "error" not in err, err


@pytest.mark.parametrize("argv", [["info", "M"], ["check", "M"]])
def test_a_closed_standard_output_is_no_traceback(argv, model, tmp_path):
    """``revgraph info m.onnx >&-`` printed a traceback (the console asked a closed stdout whether it is a
    terminal): the command runs, its output goes nowhere, and its exit code is the command's own."""
    cmd = " ".join([sys.executable, "-m", "revgraph", *[model if a == "M" else a for a in argv]])
    done = subprocess.run(["bash", "-c", f"{cmd} >&-"], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "error" not in done.stderr, done.stderr


@pytest.mark.parametrize("argv", [["info", "M"], ["check", "M"], ["run", "M"]])
def test_names_the_encoding_cannot_show_are_escaped(argv, model):
    """With an ASCII-only output (``PYTHONIOENCODING=ascii``), ``é`` and ``λ`` in a model's names were a
    UnicodeEncodeError, exit 3: they are escaped as Python escapes them, and the command succeeds."""
    p = _revgraph(*[model if a == "M" else a for a in argv], env={"PYTHONIOENCODING": "ascii"})
    out, err = (s.decode("ascii") for s in p.communicate(timeout=120))
    assert p.returncode == 0, err
    assert "\\xe9" in out and "é" not in out and "Traceback" not in err


def test_a_backslash_and_a_newline_in_names_print_differently(tmp_path, capsys):
    """The names ``a<newline>b`` and ``a\\nb`` (a backslash and an n) printed the same, ``a\\nb``: the terminal
    doubles a name's own backslash (``a\\\\nb``), so that the escaping can be read back (issue 28, part 4)."""
    newline, backslash = "a\nb", "a\\nb"
    g = Graph(nodes=[Node("Neg", [newline], [backslash], {}, "neg")], inputs=[ValueInfo(newline, np.float32, (2,))],
              outputs=[ValueInfo(backslash, np.float32, (2,))])
    rg.save(g, tmp_path / "m.onnx")
    assert main(["info", str(tmp_path / "m.onnx")]) == 0
    out = capsys.readouterr().out
    assert "a\\nb" in out and "a\\\\nb" in out, out
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx"), "--wrt", "a\\x00b"]) == 2
    err = capsys.readouterr().err  # (the message quotes the name with repr; the terminal doubles its backslashes)
    from revgraph.text import literal

    assert literal(repr("a\\x00b")) in err and "\x00" not in err, err
