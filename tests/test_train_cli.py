"""``revgraph train`` against PyTorch, its one-line errors, and ``revgraph demo`` (quick and full)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA_DIR
from kit.harness import one_line_error
from kit.training import OPTIMIZERS, assert_params_close, mlp, torch_mlp, torch_train

import revgraph as rg
from revgraph.cli import main
from revgraph.tools import demo
from revgraph.train.optimizers import listed, takers

F32 = np.float32
README = Path(__file__).resolve().parent.parent / "README.md"
#: Gemm of x float32[4, 10] (a batch of 4, fixed) with a weight and a bias: y float32[4, 8]
FIXED_BATCH = DATA_DIR / "pytorch-converted" / "test_Linear" / "model.onnx"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps at 80 columns when not on a terminal


@pytest.fixture
def model_and_data(tmp_path):
    rng = np.random.default_rng(0)
    g = mlp(rng)
    rg.save(g, tmp_path / "model.onnx")
    x = rng.normal(0, 1, (48, 6)).astype(F32)
    y = rng.integers(0, 3, 48)
    np.savez(tmp_path / "data.npz", x=x, labels=y)
    return g, x, y, tmp_path



@pytest.mark.parametrize("name", OPTIMIZERS)
def test_train_command_matches_pytorch(model_and_data, capsys, name):
    """20 epochs of one full batch = 20 steps; the same steps in PyTorch give the same weights."""
    g, x, y, tmp = model_and_data
    opt = OPTIMIZERS[name]
    args = ["train", str(tmp / "model.onnx"), "--data", str(tmp / "data.npz"), "--loss", "cross-entropy",
            "--optimizer", name, "--lr", str(opt.lr), "--weight-decay", str(opt.weight_decay), "--decay-all",
            "--epochs", "20", "--batch-size", "48", "-o", str(tmp / "trained.onnx"),
            "--save-training-graph", str(tmp / "step.onnx")]
    if opt.momentum:
        args += ["--momentum", str(opt.momentum)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "20 steps of " + name in text and f"wrote {tmp / 'trained.onnx'}" in text
    theirs, losses = torch_train(g.initializers, torch_mlp, "cross-entropy", opt, [(x, y)] * 20)
    trained = rg.load(tmp / "trained.onnx")
    assert_params_close(trained.initializers, theirs)
    assert f"last epoch's mean loss {losses[-1]:.4g}" in text
    step = rg.load(tmp / "step.onnx")
    assert "labels" in step.input_names and step.output_names[0] == "loss"


def test_train_command_with_named_inputs_and_test_data(tmp_path, capsys):
    """Data named after the model's input plus 'labels'; mse; a held-out file reports its loss."""
    rng = np.random.default_rng(1)
    g = mlp(rng)
    g.inputs[0].name = "features"
    g.nodes[0].inputs[0] = "features"
    rg.save(g, tmp_path / "m.onnx")
    x = rng.normal(0, 1, (40, 6)).astype(np.float64)  # float64 on disk: cast to the model's float32
    y = np.tanh(x[:, :3]).astype(F32)
    np.savez(tmp_path / "d.npz", features=x, labels=y)
    np.savez(tmp_path / "t.npz", features=x[:10], labels=y[:10])
    code = main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "mse",
                 "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.5", "--epochs", "30", "--batch-size", "8",
                 "--test-data", str(tmp_path / "t.npz"), "--eval-data", str(tmp_path / "d.npz"),
                 "-o", str(tmp_path / "out.onnx")])
    assert code == 0
    text = capsys.readouterr().out
    untrained = rg.Session(rg.load(tmp_path / "m.onnx")).run({"features": x.astype(F32)})["y"]
    trained = rg.load(tmp_path / "out.onnx")
    pred = rg.Session(trained).run({"features": x.astype(F32)})["y"]
    after = float(re.search(r"eval data: loss (\S+)", text).group(1))
    assert after == pytest.approx(float(np.mean((pred - y) ** 2)), rel=1e-3)  # the whole training set, trained
    assert after < 0.5 * float(np.mean((untrained - y) ** 2))
    test_loss = float(np.mean((pred[:10] - y[:10]) ** 2))
    assert f"test data: loss {test_loss:.4g}" in text


def test_train_command_bad_input_exits_2_with_one_line(model_and_data, capsys):
    _, x, y, tmp = model_and_data
    model, data, out = str(tmp / "model.onnx"), str(tmp / "data.npz"), str(tmp / "o.onnx")
    base = ["--loss", "cross-entropy", "--epochs", "1", "-o", out]
    np.savez(tmp / "nolabels.npz", x=x)
    np.savez(tmp / "badlabels.npz", x=x, labels=y + 5)
    np.savez(tmp / "short.npz", x=x, labels=y[:10])
    cases = [
        (["train", model, "--data", str(tmp / "missing.npz"), *base], "no such file"),
        (["train", model, "--data", str(tmp / "nolabels.npz"), *base], "lacks 'labels'"),
        (["train", model, "--data", str(tmp / "badlabels.npz"), *base], "not a class index"),
        (["train", model, "--data", str(tmp / "short.npz"), *base], "member 'x' declares 48 samples but 'labels' 10"),
        (["train", model, "--data", data, *base, "--lr", "-1"], "argument --lr: invalid value '-1'"),
        (["train", model, "--data", data, *base, "--optimizer", "adam", "--momentum", "0.9"],
         f"{listed(takers('momentum'))} only"),
        (["train", model, "--data", data, *base, "--batch-size", "0"], "argument --batch-size: invalid value '0'"),
        (["train", model, "--data", data, "--loss", "hinge", "--epochs", "1", "-o", out], "invalid choice"),
        (["train", model, "--data", data, *base[:-1], str(tmp / "nodir" / "o.onnx")], "does not exist"),
        (["train", model, "--data", data, *base, "--model-output", "nope"], "no output 'nope'"),
        (["train", str(tmp / "data.npz"), "--data", data, *base], "not a readable ONNX model"),
        (["train", str(FIXED_BATCH), "--data", str(tmp / "lin.npz"), *base[2:], "--loss", "mse"],
         "fixed first dimension 4: train with batch size 4 (--batch-size 4)"),
    ]
    np.savez(tmp / "lin.npz", x=np.zeros((8, 10), F32), y=np.zeros((8, 8), F32))
    for argv, fragment in cases:
        code = main(argv)
        one_line_error(code, capsys.readouterr().err, fragment)


def _accuracies(text: str) -> dict[str, float]:
    found = re.findall(r"^(recurrent|MLP) .*test accuracy ([\d.]+)%", text, flags=re.MULTILINE)
    return {k: float(v) / 100 for k, v in found}


def _check_outputs(text: str, directory) -> None:
    assert "gradient check" in text
    for param in ("W", "U", "b", "V", "c", "W1", "b1", "W2", "b2"):
        assert re.search(rf"^\s*(rnn|mlp)\s+│\s+{param}\s+│.*│\s+yes\s*$", text, flags=re.MULTILINE), param
    assert "NO" not in text
    assert re.search(r"training graph \S+rnn\.train\.onnx: \d+ nodes \(\d+ in loop bodies\), \d+ initializers, "
                     r"[\d,]+ bytes", text)
    assert "samples/s" in text
    for name in ("rnn.train.onnx", "mlp.train.onnx", "rnn.onnx", "mlp.onnx", "loss.svg"):
        assert (directory / name).is_file(), name
    assert f"loss curves: {directory / 'loss.svg'}" in text
    svg = ET.parse(directory / "loss.svg").getroot()
    assert svg.tag.endswith("svg")
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 4  # per step and per epoch, two models
    loop = rg.load(directory / "rnn.train.onnx")
    assert any(n.op_type == "Loop" for n in loop.nodes)


def test_demo_quick(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    _check_outputs(text, out)
    acc = _accuracies(text)
    assert acc["recurrent"] > 0.5 and acc["MLP"] > 0.5  # a few epochs: well above chance (0.1), not the target
    test = demo.digits(0)[1]
    logits = rg.Session(rg.load(out / "rnn.onnx")).run({"x": test["x"]})["logits"]
    assert acc["recurrent"] == pytest.approx(float(np.mean(logits.argmax(1) == test["labels"])), abs=1e-4)


def test_demo_full_reaches_90_percent(tmp_path, capsys):
    """The default demo: the recurrent classifier reaches at least 90% test accuracy."""
    assert main(["demo", "-o", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    _check_outputs(text, tmp_path)
    acc = _accuracies(text)
    assert acc["recurrent"] >= 0.90 and acc["MLP"] >= 0.90


def test_demo_models_match_pytorch_forward():
    """The demo's Loop model computes the recurrence it documents."""
    g = demo.rnn_model(hidden=7, seed=3)
    x = np.random.default_rng(0).random((5, 8, 8)).astype(F32)
    ours = rg.Session(g).run({"x": x})["logits"]
    P = {k: torch.tensor(v) for k, v in g.initializers.items() if v.dtype == F32}
    np.testing.assert_allclose(ours, torch_rnn_logits(P, torch.tensor(x)), rtol=1e-5, atol=1e-6)


def torch_rnn_logits(P, x):
    h = torch.zeros(x.shape[0], P["U"].shape[0])
    for t in range(8):
        h = torch.tanh(x[:, t] @ P["W"] + h @ P["U"] + P["b"])
    return (h @ P["V"] + P["c"]).numpy()


def test_loss_svg_is_well_formed():
    text = demo.loss_svg({"a <b>": ([2.0, 1.0, 0.5, 0.25], 2), "c": ([1.0] * 6, 3)}, "t & t")
    root = ET.fromstring(text)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "a <b>" in texts and "t & t" in texts and "epoch" in texts


def test_readme_quick_start_and_train_example(tmp_path, monkeypatch, capsys):
    """The README's set-up commands are the demo and CI's test command, and the train guide's first `revgraph
    train` example runs as printed."""
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    assert blocks[0].strip() == "pip install . && revgraph demo"
    assert blocks[1].strip() == 'pip install -e ".[test]" && python -m pytest -q'
    guide = (README.parent / "docs" / "guides" / "train.md").read_text()
    section = guide[guide.index("## `revgraph train"):]
    make_data, command = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL).group(1).strip().splitlines()
    monkeypatch.chdir(tmp_path)
    code = shlex.split(make_data)
    assert code[:2] == ["python", "-c"]
    subprocess.run([sys.executable, "-c", code[2]], check=True)
    argv = shlex.split(command)
    assert argv[0] == "revgraph" and main(argv[1:]) == 0
    out = capsys.readouterr().out
    accuracy = float(re.search(r"test data: loss \S+, accuracy ([\d.]+)%", out).group(1))
    assert accuracy > 95
    assert (tmp_path / "mlp.trained.onnx").is_file()


def test_train_command_on_a_model_with_a_fixed_batch(tmp_path, capsys):
    """A model exported with a fixed batch (4) trains with that batch size, here to the exact solution."""
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (64, 10)).astype(F32)
    y = x @ rng.normal(0, 1, (10, 8)).astype(F32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    assert main(["train", str(FIXED_BATCH), "--data", str(tmp_path / "d.npz"), "--loss", "mse", "--optimizer", "sgd",
                 "--lr", "0.05", "--momentum", "0.9", "--epochs", "30", "--batch-size", "4",
                 "-o", str(tmp_path / "o.onnx")]) == 0
    trained = rg.load(tmp_path / "o.onnx")
    pred = np.concatenate([rg.Session(trained).run({"0": x[k:k + 4]})["3"] for k in range(0, 64, 4)])
    np.testing.assert_allclose(pred, y, atol=1e-3)


COMBINATIONS = [  # issue 40, item 4: options that would do nothing, each refused in one line before any work
    (["--snapshot-every", "1"], "--snapshot-every has no effect without --snapshot-dir DIR"),
    (["--checkpoint-every=2"], "--checkpoint-every has no effect without --snapshot-dir DIR"),
    (["--snapshot-dir", "A", "--checkpoint-dir", "B"], "--snapshot-dir and --checkpoint-dir are the same option"),
    (["--snapshot-dir", "A", "--snapshot-every", "2", "--checkpoint-every", "3"],
     "--snapshot-every and --checkpoint-every are the same option"),
    (["--sync-batchnorm"], "--sync-batchnorm has no effect without --nproc N"),
    (["--bucket-mb", "4"], "--bucket-mb has no effect without --nproc N"),
    (["--reduce-dtype", "bf16"], "--reduce-dtype has no effect without --nproc N"),
    (["--overlap", "on"], "--overlap has no effect without --nproc N"),
    (["--timeout", "30"], "--timeout has no effect without --nproc N"),
    (["--no-decay", "b*"], "--no-decay has no effect with a weight decay of 0 (adam's default)"),
    (["--optimizer", "sgd", "--decay-all"], "--decay-all has no effect with a weight decay of 0 (sgd's default)"),
    (["--override", "lr"], "--override goes with --snapshot-dir"),
]


@pytest.mark.parametrize(("extra", "fragment"), COMBINATIONS)
def test_an_option_without_effect_is_refused(model_and_data, capsys, monkeypatch, extra, fragment):
    _, _, _, tmp = model_and_data
    monkeypatch.chdir(tmp)
    argv = ["train", "model.onnx", "--data", "data.npz", "--loss", "cross-entropy", "--epochs", "1", "-o", "o.onnx",
            *extra]
    one_line_error(main(argv), capsys.readouterr().err, fragment)
    assert sorted(p.name for p in tmp.iterdir()) == ["data.npz", "model.onnx"]  # nothing trained or written


def test_the_options_with_what_they_need_are_accepted(model_and_data, capsys, monkeypatch):
    _, _, _, tmp = model_and_data
    monkeypatch.chdir(tmp)
    argv = ["train", "model.onnx", "--data", "data.npz", "--loss", "cross-entropy", "--epochs", "1", "-o", "o.onnx",
            "--snapshot-dir", "snap", "--snapshot-every", "1", "--optimizer", "adamw", "--no-decay", "b*"]
    assert main(argv) == 0
    assert (tmp / "o.onnx").exists() and any((tmp / "snap").iterdir())


def test_ignored_data_files_and_boolean_labels_get_a_note(model_and_data, capsys, monkeypatch):
    # issue 40, item 7: an extra .npy in a data directory was ignored, and boolean labels read as classes 0 and
    # 1, without a word; each is one note line now (training goes on)
    _, x, y, tmp = model_and_data
    monkeypatch.chdir(tmp)
    (tmp / "d").mkdir()
    np.save(tmp / "d" / "x.npy", x)
    np.save(tmp / "d" / "labels.npy", y % 2 == 1)
    np.save(tmp / "d" / "weights.npy", np.ones(len(y)))
    assert main(["train", "model.onnx", "--data", "d", "--loss", "cross-entropy", "--epochs", "1", "-o", "o.onnx"]) == 0
    err = capsys.readouterr().err
    assert "note: --data d: ignored weights.npy: no model input nor labels of that name" in err
    assert "note: --data d: the labels are booleans, read as the classes 0 (False) and 1 (True)" in err


def _pow_model() -> rg.Graph:
    """Issue 38's reproduction: y = Pow(Mul(x, w), two) with ``two`` a float initializer of shape [] (as the
    dynamo export keeps RMSNorm's exponent), loss = mean(y)."""
    from revgraph.ir import Graph, Node, ValueInfo

    return Graph([Node("Mul", ["x", "w"], ["m"], name="mul"), Node("Pow", ["m", "two"], ["p"], name="pow"),
                  Node("ReduceMean", ["p"], ["y"], {"keepdims": 0}, "mean")],
                 [ValueInfo("x", F32, ("N", 4))], [ValueInfo("y", F32, ())],
                 {"w": np.array([0.5, -1.0, 2.0, 0.25], F32), "two": np.array(2.0, F32), "eps": np.ones(1, F32)})


def test_one_element_constants_do_not_train_by_default():
    # issue 38, item 2: the exponent trained too and its gradient x^p ln x is NaN for negative x: the loss was NaN
    # at step 2. The default set leaves 0-d and one-element initializers out (named, they train)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(F32)
    tr = rg.Trainer(_pow_model(), "output:y", "adam")
    assert list(tr.parameters) == ["w"]
    losses = [tr.step({"x": x}) for _ in range(5)]
    wt = torch.tensor(_pow_model().initializers["w"], requires_grad=True)
    opt = torch.optim.Adam([wt], lr=1e-3)
    for k in range(5):
        opt.zero_grad()
        loss = ((torch.tensor(x) * wt) ** 2).mean()
        loss.backward()
        opt.step()
        np.testing.assert_allclose(losses[k], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(tr.parameters["w"], wt.detach().numpy(), rtol=1e-5)
    assert list(rg.Trainer(_pow_model(), "output:y", "adam", params=["w", "two"]).parameters) == ["w", "two"]


def test_train_says_what_it_trains_and_what_it_left_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rg.save(_pow_model(), "m.onnx")
    np.savez("d.npz", x=np.ones((8, 4), F32))
    assert main(["train", "m.onnx", "--data", "d.npz", "--loss", "output:y", "--epochs", "1", "-o", "o.onnx"]) == 0
    assert ("parameters: 4 trainable in 1 tensor (66.7%), 2 frozen in 2 tensors; left out by default (--train NAME "
            "trains one): one-element constants: two, eps") in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth", ".npz", ".NPY", ".json"])
def test_a_model_is_never_written_under_another_formats_name(model_and_data, capsys, monkeypatch, suffix):
    # issue 38, item 7: Trainer.export("x.safetensors") wrote ONNX under that name without a word; the CLI
    # refuses such an -o before training, the API before writing
    g, _, _, tmp = model_and_data
    monkeypatch.chdir(tmp)
    tr = rg.Trainer(g, "cross-entropy", "sgd")
    with pytest.raises(rg.RevgraphError,
                       match=r"names .*, but this writes an ONNX model: give a name ending in \.onnx"):
        tr.export(f"m{suffix}")
    for flag in ("-o", "--save-training-graph"):
        argv = ["train", "model.onnx", "--data", "data.npz", "--loss", "cross-entropy", "--epochs", "1",
                *(["-o", f"m{suffix}"] if flag == "-o" else ["-o", "t.onnx", flag, f"g{suffix}"])]
        one_line_error(main(argv), capsys.readouterr().err, f"{flag} ", "but it gets an ONNX model")
    one_line_error(main(["grad", "model.onnx", "-o", f"g{suffix}"]), capsys.readouterr().err, "but it gets an ONNX")
    assert sorted(p.name for p in tmp.iterdir()) == ["data.npz", "model.onnx"]


def test_fit_takes_an_npz_path_and_a_torch_module_gets_one_line(model_and_data):
    # issue 38, item 7: fit("train.npz") was refused with a message naming the CLI flag; an nn.Module printed
    # itself over several lines
    g, x, y, tmp = model_and_data
    a, b = rg.Trainer(g, "cross-entropy", "sgd"), rg.Trainer(g, "cross-entropy", "sgd")
    assert a.fit(str(tmp / "data.npz"), 1, 16, progress=False) == b.fit({"x": x, "labels": y}, 1, 16, progress=False)
    with pytest.raises(rg.RevgraphError) as info:
        rg.Trainer(torch.nn.Sequential(torch.nn.Linear(6, 3)), "cross-entropy", "sgd")
    assert "\n" not in str(info.value)
    assert "is a PyTorch module (Sequential); export it to ONNX first" in str(info.value)
