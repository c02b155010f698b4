"""``revgraph train`` with the losses and data layouts of issue 26 against PyTorch: ``--loss causal-lm`` from a
directory of .npy files, ``--static`` inputs (.npy and .npz members), ``--loss output:NAME``, ``--class-weights``
with ``--label-smoothing``; and their bad input: exit 2 with one line, before training, nothing written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.harness import one_line_error
from kit.lossdata_models import V, lm_data, static_data, static_model, tiny_lm
from kit.losses import own_loss_model, torch_lm

import revgraph as rg
from revgraph.cli import main


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps at 80 columns when not on a terminal



def trained(path) -> dict:
    return dict(rg.load(path).initializers)


def shuffled_batches(n: int, batch: int, epochs: int, seed: int = 0):
    for epoch in range(epochs):
        order = np.random.default_rng(seed + epoch).permutation(n)
        yield from (order[j:j + batch] for j in range(0, n, batch))


def test_causal_lm_from_a_npy_directory_matches_pytorch(tmp_path, capsys):
    """--loss causal-lm on the input ids alone (a directory holding input_ids.npy), 2 shuffled epochs of SGD."""
    rg.save(tiny_lm(), tmp_path / "lm.onnx")
    ids, _ = lm_data(10)
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "input_ids.npy", ids)
    test_ids, _ = lm_data(5, seed=9)
    (tmp_path / "test").mkdir()
    np.save(tmp_path / "test" / "input_ids.npy", test_ids)
    code = main(["train", str(tmp_path / "lm.onnx"), "--data", str(tmp_path / "data"), "--loss", "causal-lm",
                 "--optimizer", "sgd", "--lr", "0.5", "--epochs", "2", "--batch-size", "4",
                 "--test-data", str(tmp_path / "test"), "-o", str(tmp_path / "out.onnx")])
    out = capsys.readouterr().out
    assert code == 0, out
    p = {k: torch.tensor(v, requires_grad=True) for k, v in tiny_lm().initializers.items()}
    opt = torch.optim.SGD(p.values(), lr=0.5)
    for rows in shuffled_batches(10, 4, 2):
        i = torch.tensor(ids[rows])
        opt.zero_grad()
        F.cross_entropy(torch_lm(p, i)[:, :-1].reshape(-1, V), i[:, 1:].reshape(-1)).backward()
        opt.step()
    got = trained(tmp_path / "out.onnx")
    for k, v in p.items():
        np.testing.assert_allclose(got[k], v.detach().numpy(), rtol=2e-5, atol=1e-6, err_msg=k)
    with torch.no_grad():  # --test-data DIR: the mean over its next-token targets, and the next-token accuracy
        i = torch.tensor(test_ids)
        logits = torch_lm(p, i)
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, V), i[:, 1:].reshape(-1))
        acc = (logits[:, :-1].argmax(-1) == i[:, 1:]).double().mean()
    assert f"test data: loss {float(ref):.4g}, accuracy {float(acc):.2%}" in out, out


def test_static_inputs_class_weights_and_smoothing_match_pytorch(tmp_path, capsys):
    data, static = static_data(40)
    rg.save(static_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "data.npz", **data)
    np.save(tmp_path / "adj.npy", static["adj"])
    np.savez(tmp_path / "consts.npz", g=static["gain"])
    w = np.array([0.5, 2.0, 1.0])
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "test_x.npy", data["x"][:8])
    code = main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "data.npz"), "--loss", "cross-entropy",
                 "--static", f"adj={tmp_path / 'adj.npy'}", "--static", f"gain={tmp_path / 'consts.npz'}:g",
                 "--class-weights", str(tmp_path / "w.npy"), "--label-smoothing", "0.1", "--optimizer", "adam",
                 "--lr", "0.02", "--epochs", "2", "--batch-size", "8", "-o", str(tmp_path / "out.onnx")])
    assert code == 0, capsys.readouterr().err
    p = {k: torch.tensor(v, requires_grad=True) for k, v in static_model().initializers.items()}
    opt = torch.optim.Adam(p.values(), lr=0.02)
    x, y = torch.tensor(data["x"]), torch.tensor(data["labels"])
    adj, gain = torch.tensor(static["adj"]), torch.tensor(static["gain"])
    for rows in shuffled_batches(40, 8, 2):
        opt.zero_grad()
        F.cross_entropy(((x[rows] @ adj) @ p["W"] + p["b"]) * gain, y[rows],
                        weight=torch.tensor(w, dtype=torch.float32), label_smoothing=0.1).backward()
        opt.step()
    got = trained(tmp_path / "out.onnx")
    for k, v in p.items():
        np.testing.assert_allclose(got[k], v.detach().numpy(), rtol=2e-5, atol=1e-6, err_msg=k)


def test_output_loss_from_the_cli(tmp_path, capsys):
    rng = np.random.default_rng(7)
    x, t = rng.standard_normal((12, 3)).astype(np.float32), rng.standard_normal(12).astype(np.float32)
    rg.save(own_loss_model(), tmp_path / "own.onnx")
    np.savez(tmp_path / "d.npz", x=x, t=t)
    code = main(["train", str(tmp_path / "own.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "output:loss",
                 "--optimizer", "sgd", "--lr", "0.1", "--epochs", "3", "--batch-size", "12",
                 "--eval-data", str(tmp_path / "d.npz"), "-o", str(tmp_path / "out.onnx")])
    out = capsys.readouterr().out
    assert code == 0, out
    w = torch.tensor(own_loss_model().initializers["w"], requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        (((torch.tensor(x) @ w).reshape(-1) - torch.tensor(t)) ** 2).mean().backward()
        opt.step()
    np.testing.assert_allclose(trained(tmp_path / "out.onnx")["w"], w.detach().numpy(), rtol=2e-5, atol=1e-7)
    with torch.no_grad():
        after = (((torch.tensor(x) @ w).reshape(-1) - torch.tensor(t)) ** 2).mean()
    assert f"eval data: loss {float(after):.4g}" in out


def test_help_lists_the_registry():
    from revgraph.train.losses import LOSSES

    parser_help = __import__("subprocess").run(
        [__import__("sys").executable, "-m", "revgraph", "train", "--help"], capture_output=True, text=True,
        env={**__import__("os").environ, "COLUMNS": "250"}).stdout
    for name, kind in LOSSES.items():
        assert name in parser_help and kind.help in parser_help


def test_bad_loss_and_data_options_exit_2_with_one_line_and_write_nothing(tmp_path, capsys):
    data, static = static_data(10)
    rg.save(static_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "data.npz", **data)
    np.save(tmp_path / "adj.npy", static["adj"])
    np.save(tmp_path / "adj3.npy", np.eye(3, dtype=np.float32))
    np.save(tmp_path / "gain.npy", static["gain"])
    (tmp_path / "uneven").mkdir()
    np.save(tmp_path / "uneven" / "x.npy", data["x"])
    np.save(tmp_path / "uneven" / "labels.npy", data["labels"][:7])
    (tmp_path / "nolabels").mkdir()
    np.save(tmp_path / "nolabels" / "x.npy", data["x"])
    (tmp_path / "junk.npy").write_bytes(b"\x93NUMPY garbage")
    ok = {"--static": [f"adj={tmp_path / 'adj.npy'}", f"gain={tmp_path / 'gain.npy'}"]}
    good = [a for s in ok["--static"] for a in ("--static", s)]
    cases = [
        (["--data", str(tmp_path / "data.npz"), "--static", f"adj={tmp_path / 'adj3.npy'}", "--static",
          f"gain={tmp_path / 'gain.npy'}"],
         "static array 'adj' has shape [3, 3]; input 'adj' is declared float32[4,4]"),
        (["--data", str(tmp_path / "uneven"), *good], "arrays differ in length: x 10, labels 7"),
        (["--data", str(tmp_path / "nolabels"), *good], "the data lacks 'labels'"),
        (["--data", str(tmp_path / "data.npz"), "--static", f"adj={tmp_path / 'adj.npy'}"], "the data lacks 'gain'"),
        (["--data", str(tmp_path / "data.npz"), *good, "--static", f"mask={tmp_path / 'adj.npy'}"],
         "--static mask: the model has no input 'mask'"),
        (["--data", str(tmp_path / "data.npz"), "--static", f"adj={tmp_path / 'junk.npy'}", "--static",
          f"gain={tmp_path / 'gain.npy'}"], "--static adj: "),
        (["--data", str(tmp_path / "data.npz"), "--static", f"adj={tmp_path / 'junk.npy'}", "--static",
          f"gain={tmp_path / 'gain.npy'}"], "junk.npy' is not a readable .npy file"),
        (["--data", str(tmp_path / "data.npz"), "--static", "adj"], "write NAME=FILE.npy"),
        (["--data", str(tmp_path / "data.npz"), *good, "--class-weights", str(tmp_path / "adj.npy")],
         "--class-weights must be finite non-negative numbers of shape [classes]"),
        (["--data", str(tmp_path / "data.npz"), *good, "--class-weights", str(tmp_path / "missing.npy")],
         "--class-weights: cannot read '"),
        (["--data", str(tmp_path / "data.npz"), *good, "--label-smoothing", "2"],
         "argument --label-smoothing: invalid value '2'"),
        (["--data", str(tmp_path / "data.npz"), *good, "--labels-from", "x"], ("--labels-from (labels_from=) does not "
         "apply to --loss cross-entropy")),
        (good, "the data lacks 'x', 'labels' (it has none); give an array per model input not given as static (x)"),
        ([], "give the training data: --data"),
    ]
    for extra, message in cases:
        out = tmp_path / "out.onnx"
        code = main(["train", str(tmp_path / "m.onnx"), "--loss", "cross-entropy", "--epochs", "1", "-o", str(out),
                     *extra])
        one_line_error(code, capsys.readouterr().err, message)
        assert not out.exists()
    for loss, message in [("output:", "needs the name"), ("hinge", ("invalid choice: 'hinge' (choose from "
                                                          "cross-entropy, mse, bce, causal-lm, output:NAME)")),
                          ("output:logits", "needs a float scalar output; 'logits' is float32[N,3]")]:
        code = main(["train", str(tmp_path / "m.onnx"), "--loss", loss, "--data", str(tmp_path / "data.npz"), *good,
                     "--epochs", "1", "-o", str(tmp_path / "out.onnx")])
        one_line_error(code, capsys.readouterr().err, message)
        assert not (tmp_path / "out.onnx").exists()
