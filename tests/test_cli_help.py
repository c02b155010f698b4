"""The command line as a user meets it (issue 44, item 5): argument groups and examples in every ``--help``, one
meaning per option name (renamed options keep their old spelling, hidden), ``--quiet`` and ``--verbose``, shell
completion (shtab), and a progress bar without ``nan`` before the first loss that keeps the step count on narrow
terminals."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console
from rich.text import Text

from revgraph.cli import main
from revgraph.cli.layout import LAYOUT
from revgraph.train.progress_bar import Bar

W = np.array([[0.5, -1.0, 0.25], [1.5, 0.75, -0.5], [-0.25, 2.0, 1.0], [0.1, -0.3, 0.6]], np.float32)
X = np.array([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, -1.0, 2.0]], np.float32)


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command.split(), "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.fixture
def model(tmp_path):
    """logits = x @ W, x [N, 4], W [4, 3] (onnx.helper)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 3])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["logits"])], "g", [x], [y],
                          initializer=[numpy_helper.from_array(W, "W")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "d.npz"
    np.savez(path, x=rng.normal(size=(64, 4)).astype(np.float32), labels=rng.integers(0, 3, 64))
    return path


# ----------------------------------------------------------------------------------------------- --help


@pytest.mark.parametrize("command", list(LAYOUT))
def test_every_help_has_its_groups_and_examples(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = _help(capsys, command)
    for title in LAYOUT[command]:
        assert f"\n{title}:\n" in text, title
    examples = text[text.index("\nexamples:\n"):]
    shown = [line for line in examples.splitlines()[1:] if line.strip().startswith("revgraph ")]
    assert 2 <= len(shown) <= 3
    assert all(line.split()[:len(command.split()) + 1] == ["revgraph", *command.split()] for line in shown)
    assert max(len(line) for line in examples.splitlines()) <= 80  # continued with "\", not wrapped by argparse
    assert ("-q, --quiet" in text and "-v, --verbose" in text) or command == "lora"


def test_revgraph_help_has_examples_and_names_quiet_and_verbose(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "\nexamples:\n  revgraph demo\n" in text and "--print-completion" in text
    assert "-q/--quiet" in text and "-v/--verbose" in text


def test_train_help_is_grouped_and_names_no_old_spelling(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = _help(capsys, "train")
    options = text[text.index("\noptions:\n"):text.index("\ndata:\n")]
    assert "--lr" not in options and "--data" not in options  # the flat list is gone: only -h, -q, -v there
    for old in ("--checkpoint-dir", "--checkpoint-every", "--loss ", "--loss\n"):
        assert old not in text
    assert text.index("\ndata:\n") < text.index("\nloss:\n") < text.index("\noptimizer:\n") < \
        text.index("\nschedule:\n") < text.index("\nmemory:\n") < text.index("\ndistributed:\n") < \
        text.index("\noutput:\n")


RUN_AS_PRINTED = ("info", "run", "grad", "check", "show", "jvp", "hvp", "jacobian", "hessian")


def test_the_examples_run_as_printed(tmp_path, monkeypatch):
    """Every example of the differentiation commands (and train's first) exits 0 on a model with the names they
    use: x -> logits = x W1 + b1 -> loss = sum(tanh(logits)^2), and an MLP on 256 of scikit-learn's digits.
    (show's SVG example needs Graphviz and is left to test_viz; the other train and lora examples need a
    LLaMA or two processes.)"""
    from sklearn.datasets import load_digits

    from revgraph.cli.examples import EXAMPLES

    rng = np.random.default_rng(0)
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["logits"]),
             helper.make_node("Tanh", ["logits"], ["t"]),
             helper.make_node("ReduceSumSquare", ["t"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [2, 4])], [vi("loss", TensorProto.FLOAT, [])],
                          initializer=[numpy_helper.from_array(W, "W1"),
                                       numpy_helper.from_array(np.array([0.1, -0.2, 0.3], np.float32), "b1")])
    monkeypatch.chdir(tmp_path)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "model.onnx")
    np.savez("in.npz", x=rng.normal(size=(2, 4)).astype(np.float32))
    digits = load_digits()
    np.savez("digits.npz", x=(digits.data[:256] / 16).astype(np.float32), labels=digits.target[:256])
    mlp = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["logits"])], "mlp",
                            [vi("x", TensorProto.FLOAT, [None, 64])], [vi("logits", TensorProto.FLOAT, [None, 10])],
                            initializer=[numpy_helper.from_array(np.zeros((64, 10), np.float32), "W")])
    onnx.save(helper.make_model(mlp, opset_imports=[helper.make_opsetid("", 17)]), "mlp.onnx")
    commands = [c for name in ("grad", *RUN_AS_PRINTED) for c, _ in EXAMPLES[name] if not c.endswith(".svg")]
    for command in [*dict.fromkeys(commands), EXAMPLES["train"][0][0]]:
        assert main(command.split()[1:]) == 0, command
    accuracy = (np.load("digits.npz")["x"] @ numpy_helper.to_array(onnx.load("mlp.trained.onnx").graph.initializer[0])
                ).argmax(1) == digits.target[:256]
    assert accuracy.mean() > 0.9  # 20 epochs of Adam on the training images themselves


# --------------------------------------------------------------------------------------- renamed options


@pytest.mark.parametrize("command,new,old", [("grad", "--cotangent", "--seed"), ("jvp", "--wrt", "--inputs"),
                                             ("jacobian", "--wrt", "--inputs"), ("train", "--loss-fn", "--loss")])
def test_an_old_spelling_is_hidden_from_help_and_completion(command, new, old, capsys):
    text = _help(capsys, command)
    assert f"  {new} " in text and f"{old} " not in text.replace(f"{old}-", "")
    with pytest.raises(SystemExit):
        main(["--print-completion", "bash"])
    script = capsys.readouterr().out
    line = next(s for s in script.splitlines() if s.startswith(f"_shtab_revgraph_{command}_option_strings="))
    assert f" {new} " in line and f" {old} " not in line


def test_grad_cotangent_under_both_spellings(model, tmp_path):
    """--cotangent input (and the old --seed input) adds the input logits_grad: W_grad = x^T c, x_grad = c W^T."""
    c = np.array([[1.0, 0.5, -2.0], [3.0, -1.0, 0.25]], np.float32)
    for flag in ("--cotangent", "--seed"):
        out = tmp_path / f"g{flag}.onnx"
        assert main(["grad", str(model), "-o", str(out), flag, "input"]) == 0
        sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": X, "logits_grad": c}), strict=True))
        np.testing.assert_allclose(got["W_grad"], X.T.astype(np.float64) @ c, rtol=1e-6)
        np.testing.assert_allclose(got["x_grad"], c.astype(np.float64) @ W.T, rtol=1e-6)


def test_jvp_wrt_under_both_spellings(model, tmp_path):
    """jvp --wrt x (and the old --inputs x): logits_tangent = t W, with no W_tangent input."""
    t = np.array([[0.5, 1.0, -1.0, 2.0], [1.0, 0.0, 0.0, -3.0]], np.float32)
    for flag in ("--wrt", "--inputs"):
        out = tmp_path / f"j{flag}.onnx"
        assert main(["jvp", str(model), "-o", str(out), flag, "x"]) == 0
        sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        assert sorted(i.name for i in sess.get_inputs()) == ["x", "x_tangent"]
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": X, "x_tangent": t}), strict=True))
        np.testing.assert_allclose(got["logits_tangent"], t.astype(np.float64) @ W, rtol=1e-6)


def test_train_loss_fn_under_both_spellings(model, data, tmp_path, capsys):
    """One full-batch SGD step on the cross-entropy under --loss-fn and under --loss: the same weights, those of
    W - lr * x^T (softmax(x W) - onehot) / N."""
    z = np.load(data)
    x, labels = z["x"].astype(np.float64), z["labels"]
    logits = x @ W
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(labels)), labels] -= 1
    expected = W - 0.1 * x.T @ p / len(labels)
    for flag in ("--loss-fn", "--loss"):
        out = tmp_path / f"t{flag}.onnx"
        assert main(["train", str(model), "--data", str(data), flag, "cross-entropy", "--optimizer", "sgd",
                     "--lr", "0.1", "--batch-size", "64", "--max-steps", "1", "-o", str(out), "-q"]) == 0
        trained = numpy_helper.to_array(onnx.load(str(out)).graph.initializer[0])
        np.testing.assert_allclose(trained, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv,words", [
    (["grad", "{m}", "-o", "{t}/g.onnx", "--cotangent", "input", "--seed", "ones"],
     "--cotangent and --seed are the same option (--seed is its old name): give one"),
    (["jvp", "{m}", "-o", "{t}/j.onnx", "--wrt", "x", "--inputs", "x"], "--wrt and --inputs are the same option"),
    (["train", "{m}", "--data", "{d}", "--max-steps", "1", "-o", "{t}/t.onnx"],
     "the following arguments are required: --loss-fn"),
    (["train", "{m}", "--data", "{d}", "--loss", "hinge", "--max-steps", "1", "-o", "{t}/t.onnx"],
     "argument --loss: invalid choice: 'hinge'"),
    (["train", "{m}", "--data", "{d}", "--loss-fn", "hinge", "--max-steps", "1", "-o", "{t}/t.onnx"],
     "argument --loss-fn: invalid choice: 'hinge'"),
])
def test_renamed_option_errors_are_one_line(argv, words, model, data, tmp_path, capsys):
    argv = [a.format(m=model, d=data, t=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err
    assert not any(p.suffix == ".onnx" and p.name != "m.onnx" for p in tmp_path.iterdir())


# -------------------------------------------------------------------------------------- --quiet, --verbose


def test_train_quiet_prints_only_the_results(model, data, tmp_path, capsys):
    args = ["train", str(model), "--data", str(data), "--loss-fn", "cross-entropy", "--epochs", "1",
            "--eval-data", str(data), "--eval-every", "1", "-o", str(tmp_path / "t.onnx")]
    assert main(args) == 0
    loud = capsys.readouterr().out
    assert "parameters:" in loud and "step 1: eval loss" in loud and "samples/s" in loud
    assert main([*args, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.out.splitlines() == [line for line in loud.splitlines() if line.startswith(
        ("2 steps of adam", "eval data:", "wrote "))]
    assert len(quiet.out.splitlines()) == 3 and quiet.err == ""


def test_demo_quiet_drops_the_progress_bars(tmp_path, capsys):
    assert main(["demo", "--quick", "-o", str(tmp_path / "demo"), "-q"]) == 0
    out = capsys.readouterr().out
    assert "samples/s" not in out and out.count("test accuracy") == 2


def test_run_quiet_drops_the_note(model, capsys):
    assert main(["run", str(model)]) == 0
    assert "note: no --inputs given" in capsys.readouterr().err
    assert main(["run", str(model), "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "logits" in captured.out


def test_verbose_adds_settings_names_and_time(tmp_path, capsys):
    """grad -v: the settings line (defaults included), every gradient output (not 'N more'), the time."""
    names = [f"w{i}" for i in range(9)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Sum", ["x", *names], ["y"])]
    g = helper.make_graph(nodes, "g", [x], [y], initializer=[numpy_helper.from_array(np.ones(2, np.float32), n)
                                                             for n in names])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    argv = ["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx")]
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert "(4 more)" in plain.out and plain.err == ""
    assert main([*argv, "--verbose"]) == 0
    loud = capsys.readouterr()
    assert "more)" not in loud.out and all(f"{n}_grad" in loud.out for n in ["x", *names])
    settings, timing = loud.err.strip().splitlines()
    assert settings.startswith("revgraph grad: ") and "cotangent=ones" in settings and "unconnected=zero" in settings
    assert timing.startswith("revgraph grad: ") and timing.endswith(" s")


def test_quiet_and_verbose_exclude_each_other(model, capsys):
    assert main(["info", str(model), "-q", "-v"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ completion


@pytest.mark.parametrize("shell,marker", [("bash", "-F _shtab_revgraph revgraph"), ("zsh", "#compdef revgraph"),
                                          ("tcsh", "complete revgraph")])
def test_completion_scripts(shell, marker, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--print-completion", shell])
    assert exit_.value.code == 0
    script = capsys.readouterr().out
    assert marker in script
    for word in ("train", "grad", "loss-fn", "cotangent", "snapshot-dir"):  # (tcsh's list has no "--")
        assert word in script


# --------------------------------------------------------------------------------------------- progress


def _frames(width: int, monkeypatch) -> list[str]:
    """The bar before the first step and after a step with loss 0.123456 at 1234.5 samples/s, on a terminal
    ``width`` columns wide (COLUMNS, as a shell sets it)."""
    monkeypatch.setenv("COLUMNS", str(width))
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, color_system="standard")  # (no colors: no bar drawn)
    assert console.width == width
    bar = Bar(True, console, "training", 100)
    console.print(bar.progress.get_renderable())
    bar.advance("training epoch 1/3", 0.123456, 1234.5)
    console.print(bar.progress.get_renderable())
    return [Text.from_ansi(line).plain for line in buffer.getvalue().splitlines()]


@pytest.mark.parametrize("width", [120, 80, 60, 40, 24])
def test_progress_bar_frames(width, monkeypatch):
    first, second = _frames(width, monkeypatch)
    assert "nan" not in first and "loss -" in first and "0/100" in first
    assert "1/100" in second and f"loss {0.123456:.4f}" in second
    assert max(len(first), len(second)) <= width  # nothing wraps or is cut: the step count stays whole
    if width >= 80:
        assert "training epoch 1/3" in second and "1,234 samples/s" in second and "0:00:00" in second
        assert "━" in second  # the bar itself
    if width >= 40:
        assert "training epoch 1/3" in second
