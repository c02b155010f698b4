"""LoRA adapters (revgraph.train.lora) and the choice of what trains (revgraph.train.selection), against PyTorch: a
PEFT-style LoRA Linear module written here, torch autograd, and the one-line errors of the command line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from kit.lora import ALPHA, F32, RANK, LoraLinear, mixed_model, run
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Node, ValueInfo
from revgraph.train import lora

SCALING = ALPHA / RANK


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")


def torch_mixed(P: dict, ad: dict, x: torch.Tensor, scaling: float = SCALING):
    """The mixed model with PEFT-style LoRA layers. ``ad[w] = (A, B)`` per base weight. Gemm's ``alpha`` scales
    its product, weight and update alike (what merging W + s A B into the Gemm gives); ``beta`` scales the bias."""
    w3 = (P["q3"].astype(np.float64) - float(P["z3"])) * float(P["s3"])  # DequantizeLinear
    mods = {"W1": LoraLinear(P["W1"].T, None, *ad["W1"], scaling), "W2": LoraLinear(P["W2"], None, *ad["W2"], scaling),
            "q3": LoraLinear(w3.T, None, *ad["q3"], scaling), "W4": LoraLinear(P["W4"].T, None, *ad["W4"], scaling),
            "W5": LoraLinear(P["W5"], None, *ad["W5"], scaling)}
    r1 = torch.relu(mods["W1"](x))
    r2 = torch.tanh(0.7 * mods["W2"](r1) + 0.5 * torch.tensor(P["b2"], dtype=torch.float64))
    t = r2.T
    y = mods["q3"](r2) + mods["W4"](t.T) + mods["W5"](r2)
    return y, mods


def numpy_mixed(P: dict, x: np.ndarray) -> np.ndarray:
    """The base mixed model in float64 (no adapters)."""
    P = {k: np.asarray(v, np.float64) for k, v in P.items()}
    r2 = np.tanh(0.7 * (np.maximum(x @ P["W1"], 0) @ P["W2"].T) + 0.5 * P["b2"])
    return r2 @ ((P["q3"] - P["z3"]) * P["s3"]) + r2 @ P["W4"] + r2 @ P["W5"].T


def random_b(g: rg.Graph, seed: int = 1) -> rg.Graph:
    """``g`` with every ``lora_B`` random (B = 0 makes A's gradient zero: nothing to compare)."""
    rng = np.random.default_rng(seed)
    g = g.copy()
    for a in lora.config(g)["adapters"]:
        g.initializers[a["B"]] = rng.normal(0, 0.3, g.initializers[a["B"]].shape).astype(F32)
    return g


# ---------------------------------------------------------------------------------------------- the rewrite


def test_adapted_model_equals_the_base_before_training():
    g = mixed_model()
    a = lora.add_adapters(g, RANK, alpha=ALPHA)
    c = lora.config(a)
    assert [ad["weight"] for ad in c["adapters"]] == ["W1", "W2", "q3", "W4", "W5"]
    assert c["rank"] == RANK and c["scaling"] == SCALING and set(g.initializers) < set(a.initializers)
    assert "revgraph.lora" not in g.metadata  # the input graph is not changed
    x = np.random.default_rng(3).normal(0, 1, (5, 8)).astype(F32)
    want = numpy_mixed(g.initializers, x.astype(np.float64))
    np.testing.assert_allclose(run(a, x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(run(a, x, False), run(g, x, False))
    for ad in c["adapters"]:  # A as PEFT's kaiming_uniform_(a=sqrt(5)) on lora_A [r, in]: U(+-1/sqrt(in)); B = 0
        A, B = a.initializers[ad["A"]], a.initializers[ad["B"]]
        assert A.shape == (ad["in"], RANK) and B.shape == (RANK, ad["out"]) and not B.any()
        torch_bound = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(RANK, ad["in"]))[0] ** -0.5
        assert np.abs(A).max() <= torch_bound and np.abs(A).max() > 0.5 * torch_bound
    same = lora.add_adapters(g, RANK, alpha=ALPHA)  # seeded
    assert all(np.array_equal(same.initializers[k], a.initializers[k]) for k in lora.adapter_names(a))


def test_adapter_gradients_equal_pytorch():
    """d loss / d A and d B through the adapted graph (revgraph.gradient) = torch autograd on PEFT-style LoRA
    layers with the same values; loss = sum(y * R)."""
    g = random_b(lora.add_adapters(mixed_model(), RANK, alpha=ALPHA))
    rng = np.random.default_rng(4)
    x, R = rng.normal(0, 1, (5, 8)).astype(F32), rng.normal(0, 1, (5, 6)).astype(F32)
    lg = g.copy()
    lg.nodes += [Node("Mul", ["y", "R"], ["yr"], name="lossmul"), Node("ReduceSum", ["yr"], ["loss"], {"keepdims": 0},
                                                                      name="losssum")]
    lg.inputs.append(ValueInfo("R", F32, (5, 6)))
    lg.outputs = [ValueInfo("loss", F32, ())]
    names = lora.adapter_names(g)
    gg = rg.gradient(lg, "loss", names)
    got = rg.Session(gg).run({"x": x, "R": R})
    ad = {a["weight"]: (g.initializers[a["A"]], g.initializers[a["B"]]) for a in lora.config(g)["adapters"]}
    y, mods = torch_mixed(g.initializers, ad, torch.as_tensor(x, dtype=torch.float64))
    (y * torch.as_tensor(R, dtype=torch.float64)).sum().backward()
    for a in lora.config(g)["adapters"]:
        m = mods[a["weight"]]
        np.testing.assert_allclose(got[a["A"] + "_grad"], m.lora_A.weight.grad.numpy().T, rtol=2e-4, atol=1e-5)
        np.testing.assert_allclose(got[a["B"] + "_grad"], m.lora_B.weight.grad.numpy().T, rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(got["loss"], (y * torch.as_tensor(R, dtype=torch.float64)).sum().item(), rtol=1e-5)


def test_fit_changes_only_the_adapters():
    g = lora.add_adapters(mixed_model(), RANK, alpha=ALPHA)
    rng = np.random.default_rng(5)
    data = {"x": rng.normal(0, 1, (32, 8)).astype(F32), "labels": rng.normal(0, 1, (32, 6)).astype(F32)}
    tr = rg.Trainer(g, "mse", "adam")
    assert tr.spec.params == lora.adapter_names(g)  # the adapters are what trains by default
    before = tr.evaluate(data)["loss"]
    tr.fit(data, epochs=3, batch_size=8, progress=False)
    trained = tr.parameters
    for k, v in g.initializers.items():
        if k in trained:
            assert not np.array_equal(trained[k], v), k
    assert tr.evaluate(data)["loss"] < before
    frozen = {k for k in g.initializers if k not in trained}
    assert frozen == set(mixed_model().initializers)
    for k in frozen:  # the frozen base is what the step graph holds, untouched
        assert np.array_equal(tr.spec.model.initializers[k], g.initializers[k]), k


def test_merge_equals_the_unmerged_outputs():
    g = random_b(lora.add_adapters(mixed_model(), RANK, alpha=ALPHA))
    x = np.random.default_rng(6).normal(0, 1, (5, 8)).astype(F32)
    merged = lora.merge_adapters(g)
    assert "revgraph.lora" not in merged.metadata and not any(n.name.startswith("lora/") for n in merged.nodes)
    assert not any(k.endswith((".lora_A", ".lora_B")) for k in merged.initializers)
    # the quantized base became a float weight (the dequantized int8 + the update); DequantizeLinear is gone
    assert "q3.merged" in merged.initializers and not any(n.op_type == "DequantizeLinear" for n in merged.nodes)
    np.testing.assert_allclose(run(merged, x), run(g, x, False), rtol=1e-5, atol=1e-5)
    ad = {a["weight"]: (g.initializers[a["A"]], g.initializers[a["B"]]) for a in lora.config(g)["adapters"]}
    y, _ = torch_mixed(g.initializers, ad, torch.as_tensor(x, dtype=torch.float64))
    np.testing.assert_allclose(run(merged, x), y.detach().numpy(), rtol=1e-4, atol=1e-5)


def test_metadata_round_trips_through_save_and_load(tmp_path):
    g = lora.add_adapters(mixed_model(), 2, targets=["W1", "gemm*"])
    assert [a["weight"] for a in lora.config(g)["adapters"]] == ["W1", "W2", "W4"]
    assert g.copy().metadata == g.metadata
    rg.save(g, tmp_path / "a.onnx")
    back = rg.load(tmp_path / "a.onnx")
    assert back.metadata == g.metadata and json.loads(back.metadata["revgraph.lora"])["alpha"] == 2.0


@pytest.mark.parametrize("suffix", [".npz", ".onnx"])
def test_extract_and_apply_round_trip(tmp_path, suffix):
    base = mixed_model()
    rng = np.random.default_rng(7)
    data = {"x": rng.normal(0, 1, (16, 8)).astype(F32), "labels": rng.normal(0, 1, (16, 6)).astype(F32)}
    tr = rg.Trainer(lora.add_adapters(base, RANK, alpha=ALPHA), "mse", "adam")
    tr.fit(data, epochs=2, batch_size=8, progress=False)
    trained = tr.export(tmp_path / "trained.onnx")
    lora.save_adapters(tmp_path / f"ad{suffix}", rg.load(tmp_path / "trained.onnx"))
    arrays, c = lora.load_adapters(tmp_path / f"ad{suffix}")
    assert sorted(arrays) == sorted(lora.adapter_names(trained)) and c == lora.config(trained)
    applied = lora.apply(base, arrays, c)
    x = data["x"]
    np.testing.assert_array_equal(run(applied, x, False), run(trained, x, False))
    np.testing.assert_allclose(run(lora.apply(base, arrays, c, merge=True), x), run(trained, x, False), rtol=1e-5,
                               atol=1e-5)


def test_api_errors_name_the_problem():
    g = mixed_model()
    for kwargs, fragment in [({"targets": ["nope*"]}, "'nope*' matches no initializer"),
                             ({"targets": ["b2"]}, "none of them the weight of a MatMul or Gemm"),
                             ({"targets": []}, "targets is empty")]:
        with pytest.raises(rg.RevgraphError, match=fragment.replace("*", r"\*")):
            lora.add_adapters(g, 2, **kwargs)
    for rank, alpha, fragment in [(0, None, "integer >= 1"), (2.5, None, "integer >= 1"), (2, math.inf, "finite"),
                                  (2, math.nan, "finite"), (7, None, "exceeds min")]:
        with pytest.raises(rg.RevgraphError, match=fragment):
            lora.add_adapters(g, rank, alpha=alpha)
    with pytest.raises(rg.RevgraphError, match="already has LoRA adapters"):
        lora.add_adapters(lora.add_adapters(g, 2), 2)
    with pytest.raises(rg.RevgraphError, match="no LoRA adapters"):
        lora.merge_adapters(g)


def batched_weight_model() -> rg.Graph:
    """x [N, 2, 4] MatMul a 3-D weight [2, 4, 4] (not a LoRA target) then MatMul a 2-D one [4, 3]."""
    rng = np.random.default_rng(0)
    inits = {"Wb": rng.normal(0, 1, (2, 4, 4)).astype(F32), "Wo": rng.normal(0, 1, (4, 3)).astype(F32)}
    nodes = [Node("MatMul", ["x", "Wb"], ["hb"], name="batched"), Node("MatMul", ["hb", "Wo"], ["y"], name="out")]
    return rg.Graph(nodes, [ValueInfo("x", F32, ("N", 2, 4))], [ValueInfo("y", F32, ("N", 2, 3))], inits)


def test_a_weight_that_is_not_2d_is_refused_when_targeted_and_skipped_by_default():
    g = batched_weight_model()
    assert [a["weight"] for a in lora.config(lora.add_adapters(g, 2))["adapters"]] == ["Wo"]
    with pytest.raises(rg.RevgraphError, match=r"'Wb'.*shape \[2, 4, 4\].*2-D weights only"):
        lora.add_adapters(g, 2, targets=["W*"])


# ---------------------------------------------------------------------------------------------- what trains


def test_train_and_freeze_globs_against_full_training():
    """Frozen values stay, trained ones change, and the first SGD step of the trained ones is the full model's
    (lr * the same gradient: freezing cuts nothing out of their gradient)."""
    from kit.training import mlp

    g = mlp(np.random.default_rng(0))
    rng = np.random.default_rng(8)
    data = {"x": rng.normal(0, 1, (16, 6)).astype(F32), "labels": rng.integers(0, 3, 16)}
    full = rg.Trainer(g, "cross-entropy", rg.train.sgd(lr=0.1))
    part = rg.Trainer(g, "cross-entropy", rg.train.sgd(lr=0.1), params=["W*", "b?"], freeze=["b1", "W2"])
    assert part.spec.params == ["W1", "b2"]
    full.fit(data, epochs=1, batch_size=16, shuffle=False, progress=False)
    part.fit(data, epochs=1, batch_size=16, shuffle=False, progress=False)
    for k in ("W1", "b2"):
        np.testing.assert_allclose(part.parameters[k], full.parameters[k], rtol=1e-6, atol=1e-7)
        assert not np.array_equal(part.parameters[k], g.initializers[k])
    # and the full model's step is torch's (autograd of the same MLP)
    P = {k: torch.tensor(v, requires_grad=True) for k, v in g.initializers.items()}
    logits = torch.tanh(torch.as_tensor(data["x"]) @ P["W1"] + P["b1"]) @ P["W2"] + P["b2"]
    torch.nn.functional.cross_entropy(logits, torch.as_tensor(data["labels"])).backward()
    for k in ("W1", "b2"):
        np.testing.assert_allclose(part.parameters[k], g.initializers[k] - 0.1 * P[k].grad.numpy(), rtol=1e-5,
                                   atol=1e-6)
    for k in ("b1", "W2"):
        assert np.array_equal(part.spec.model.initializers[k], g.initializers[k])
    with pytest.raises(rg.RevgraphError, match="'Z\\*' matches no initializer"):
        rg.Trainer(g, "mse", params=["Z*"])
    with pytest.raises(rg.RevgraphError, match=r"freeze .*'q' matches no initializer"):
        rg.Trainer(g, "mse", freeze=["q"])
    with pytest.raises(rg.RevgraphError, match="leave no initializer to train"):
        rg.Trainer(g, "mse", freeze=["*"])


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.fixture
def files(tmp_path):
    rg.save(mixed_model(), tmp_path / "base.onnx")
    rng = np.random.default_rng(9)
    np.savez(tmp_path / "d.npz", x=rng.normal(0, 1, (24, 8)).astype(F32), labels=rng.normal(0, 1, (24, 6)).astype(F32))
    return tmp_path


def test_cli_lora_train_extract_apply(files, capsys):
    t = files
    common = ["--data", str(t / "d.npz"), "--loss", "mse", "--epochs", "2", "--batch-size", "8", "--lr", "0.01"]
    assert main(["train", str(t / "base.onnx"), *common, "--lora", "4", "--lora-alpha", "8", "-o",
                 str(t / "trained.onnx")]) == 0
    text = capsys.readouterr().out
    base = mixed_model()
    a = (8 + 16) * 4 + (16 + 12) * 4 + 3 * (12 + 6) * 4  # (in + out) * r per adapter
    frozen = [v.size for k, v in base.initializers.items() if v.dtype == F32 or k == "q3"]  # q3: the int8 base
    assert (f"parameters: {a:,} trainable in 10 tensors ({100 * a / (a + sum(frozen)):.3g}%), {sum(frozen):,} frozen "
            f"in {len(frozen)} tensors") in text, text
    trained = rg.load(t / "trained.onnx")
    assert lora.config(trained)["alpha"] == 8.0 and any(n.name.startswith("lora/") for n in trained.nodes)
    for k, v in base.initializers.items():
        assert np.array_equal(trained.initializers[k], v), k
    x = np.load(t / "d.npz")["x"]
    assert main(["lora", "extract", str(t / "trained.onnx"), "-o", str(t / "ad.npz")]) == 0
    assert main(["lora", "apply", str(t / "base.onnx"), str(t / "ad.npz"), "-o", str(t / "applied.onnx")]) == 0
    assert main(["lora", "apply", str(t / "base.onnx"), str(t / "ad.npz"), "-o", str(t / "merged.onnx"),
                 "--merge"]) == 0
    assert "5 adapters (10 tensors, 424 elements; rank 4, alpha 8)" in capsys.readouterr().out
    want = run(trained, x, False)
    np.testing.assert_array_equal(run(rg.load(t / "applied.onnx"), x, False), want)
    np.testing.assert_allclose(run(rg.load(t / "merged.onnx"), x), want, rtol=1e-5, atol=1e-5)
    assert main(["train", str(t / "base.onnx"), *common, "--lora", "4", "--lora-alpha", "8", "--merge-adapters",
                 "-o", str(t / "trained_merged.onnx")]) == 0
    np.testing.assert_allclose(run(rg.load(t / "trained_merged.onnx"), x), want, rtol=1e-5, atol=1e-5)


def test_cli_train_and_freeze_print_the_counts(tmp_path, capsys):
    from kit.training import mlp

    rg.save(mlp(np.random.default_rng(0)), tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "d.npz", x=rng.normal(0, 1, (16, 6)).astype(F32), labels=rng.integers(0, 3, 16))
    assert main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "cross-entropy",
                 "--epochs", "1", "--train", "W*", "--freeze", "W2", "-o", str(tmp_path / "t.onnx")]) == 0
    assert "parameters: 48 trainable in 1 tensor (57.8%), 35 frozen in 3 tensors" in capsys.readouterr().out
    t = rg.load(tmp_path / "t.onnx")
    g = mlp(np.random.default_rng(0))
    assert not np.array_equal(t.initializers["W1"], g.initializers["W1"])
    assert all(np.array_equal(t.initializers[k], g.initializers[k]) for k in ("W2", "b1", "b2"))


@pytest.mark.parametrize("extra, fragment", [
    (["--lora", "2", "--lora-targets", "nope*"], "'nope*' matches no initializer"),
    (["--lora", "2", "--lora-targets", "b2"], "none of them the weight"),
    (["--lora", "0"], "argument --lora: invalid value '0': give a whole number from 1"),
    (["--lora", "-3"], "argument --lora: invalid value '-3'"),
    (["--lora", "7"], "LoRA rank 7 exceeds min(in, out) = 6"),
    (["--lora", "2", "--lora-alpha", "nan"], "argument --lora-alpha: invalid value 'nan'"),
    (["--lora", "2", "--lora-alpha", "inf"], "argument --lora-alpha: invalid value 'inf'"),
    (["--lora-alpha", "2"], "--lora-alpha goes with --lora"),
    (["--merge-adapters"], "--merge-adapters goes with --lora"),
    (["--train", "zz*"], "--train) pattern 'zz*' matches no initializer"),
    (["--freeze", "zz"], "--freeze) pattern 'zz' matches no initializer"),
])
def test_cli_bad_lora_and_selection_input_exits_2(files, capsys, extra, fragment):
    out = files / "out.onnx"
    code = main(["train", str(files / "base.onnx"), "--data", str(files / "d.npz"), "--loss", "mse", "--epochs", "1",
                 *extra, "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("revgraph: error:") and fragment in lines[0], err
    assert not out.exists()


def test_cli_not_2d_target_and_lora_command_errors(tmp_path, capsys, files):
    rg.save(batched_weight_model(), tmp_path / "b.onnx")
    np.savez(tmp_path / "db.npz", x=np.zeros((4, 2, 4), F32), labels=np.zeros((4, 2, 3), F32))
    cases = [(["train", str(tmp_path / "b.onnx"), "--data", str(tmp_path / "db.npz"), "--loss", "mse", "--epochs", "1",
               "--lora", "2", "--lora-targets", "Wb", "-o", str(tmp_path / "o.onnx")], "2-D weights only"),
             (["lora", "extract", str(files / "base.onnx"), "-o", str(tmp_path / "o.npz")], "no LoRA adapters"),
             (["lora", "extract", str(files / "base.onnx"), "-o", str(tmp_path / "o.txt")], "ending in .npz or .onnx"),
             (["lora", "apply", str(files / "base.onnx"), str(files / "d.npz"), "-o", str(tmp_path / "o.onnx")],
              "holds no LoRA configuration")]
    for argv, fragment in cases:
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err
    assert not any(p.name.startswith("o.") for p in tmp_path.iterdir())


def test_guide_lora_walkthrough_runs_as_printed(tmp_path, monkeypatch, capsys):
    """The LoRA guide's (docs/guides/lora.md) "LoRA and frozen weights" commands, on the digits MLP as the train
    guide makes it: the printed counts and files are what the guide shows, and the test accuracy is high."""
    import re
    import shlex
    from pathlib import Path

    from revgraph.tools import demo

    text = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "lora.md").read_text()
    section = text[text.index("# LoRA and frozen weights"):]
    section = section[:section.index("\n## LoRA on an int4")]
    commands = [c for block in re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
                for c in block.strip().splitlines() if c.startswith("revgraph ")]
    shown = [ln for block in re.findall(r"```(?:text|bash)\n(.*?)```", section, flags=re.DOTALL)
             for ln in block.splitlines() if ln.lstrip("# ").startswith(("parameters:", "wrote"))]
    monkeypatch.chdir(tmp_path)
    train, test = demo.digits()
    np.savez("digits.npz", **train)
    np.savez("digits-test.npz", **test)
    rg.save(demo.mlp_model(), "mlp.onnx")
    printed = ""
    for command in commands:
        argv = shlex.split(command)
        assert main(argv[1:]) == 0, command
        printed += capsys.readouterr().out
    assert len(commands) == 4 and len(shown) == 5
    for line in shown:
        assert line.lstrip("# ") in printed, line
    accuracies = [float(a) for a in re.findall(r"test data: loss \S+, accuracy ([\d.]+)%", printed)]
    assert len(accuracies) == 2 and accuracies[1] > 95, printed


def test_a_shared_weight_gets_one_adapter_and_a_tied_reader_keeps_the_base_value():
    """W is read by two MatMuls (one directly, one through a Transpose) and by a Gather (a tied embedding):
    naming one MatMul adapts both (one adapter per weight, as one PEFT module called twice), and merging leaves
    the Gather's W as it was (the MatMuls read a merged copy)."""
    rng = np.random.default_rng(10)
    inits = {"W": rng.normal(0, 0.5, (8, 8)).astype(F32), "idx": np.array([2], np.int64)}
    nodes = [Node("MatMul", ["x", "W"], ["h"], name="mm"),
             Node("Transpose", ["W"], ["wt"], {"perm": [1, 0]}, name="tr"),
             Node("MatMul", ["h", "wt"], ["h2"], name="mm_t"), Node("Gather", ["W", "idx"], ["row"], name="tied"),
             Node("Add", ["h2", "row"], ["y"], name="add")]
    g = rg.Graph(nodes, [ValueInfo("x", F32, ("N", 8))], [ValueInfo("y", F32, ("N", 8))], inits)
    a = random_b(lora.add_adapters(g, 2, targets=["mm"]))
    (ad,) = lora.config(a)["adapters"]
    assert [s["node"] for s in ad["sites"]] == ["mm", "mm_t"]
    x = rng.normal(0, 1, (3, 8)).astype(F32)
    A, B = a.initializers[ad["A"]].astype(np.float64), a.initializers[ad["B"]].astype(np.float64)
    W = inits["W"].astype(np.float64)

    def lin(v, w):  # PEFT's forward with alpha = r (scaling 1)
        return v @ w + (v @ A) @ B

    want = lin(lin(x, W), W.T) + W[2]
    np.testing.assert_allclose(run(a, x), want, rtol=1e-5, atol=1e-5)
    merged = lora.merge_adapters(a)
    assert np.array_equal(merged.initializers["W"], inits["W"]) and "W.merged" in merged.initializers
    np.testing.assert_allclose(run(merged, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cli_lora_data_parallel_equals_one_process(files, capsys):
    """--lora under --nproc 2 (gloo) trains the adapters of one process with the same global batch."""
    t = files
    common = ["train", str(t / "base.onnx"), "--data", str(t / "d.npz"), "--loss", "mse", "--epochs", "2",
              "--lora", "4"]
    assert main([*common, "--batch-size", "4", "--nproc", "2", "-o", str(t / "dp.onnx")]) == 0
    assert main([*common, "--batch-size", "8", "-o", str(t / "one.onnx")]) == 0
    dp, one = rg.load(t / "dp.onnx"), rg.load(t / "one.onnx")
    assert lora.config(dp) == lora.config(one)
    for k in lora.adapter_names(one):
        np.testing.assert_allclose(dp.initializers[k], one.initializers[k], rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["uint8 per-axis", "int4 blocked", "int8 Gemm transB"])
def test_quantized_bases_against_pytorch(kind):
    """QLoRA-style: adapters over DequantizeLinear of uint8 (per-output-column scales and zero points), int4
    (blocked scales, opset 21) and int8 read by Gemm(transB=1); gradients of A and B and the merged model against
    PEFT-style layers over the dequantized weight computed here."""
    rng = np.random.default_rng(11)
    if kind == "uint8 per-axis":
        q = rng.integers(0, 256, (12, 6))
        s, z = rng.uniform(0.005, 0.02, 6).astype(F32), rng.integers(100, 150, 6)
        tensors = [h.make_tensor("q", T.UINT8, (12, 6), q.flatten().tolist()), nh.from_array(s, "s"),
                   h.make_tensor("z", T.UINT8, (6,), z.tolist())]
        dq = h.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=1, name="dq")
        w = (q - z) * s.astype(np.float64)
    elif kind == "int4 blocked":
        q = rng.integers(-8, 8, (12, 6))
        s = rng.uniform(0.01, 0.05, (2, 6)).astype(F32)  # a scale per block of 6 rows and column
        tensors = [h.make_tensor("q", T.INT4, (12, 6), q.flatten().tolist()), nh.from_array(s, "s")]
        dq = h.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=0, block_size=6, name="dq")
        w = q * np.repeat(s.astype(np.float64), 6, axis=0)
    else:
        q = rng.integers(-128, 128, (6, 12))  # [out, in], read with transB=1
        tensors = [h.make_tensor("q", T.INT8, (6, 12), q.flatten().tolist()), nh.from_array(np.array(0.01, F32), "s")]
        dq = h.make_node("DequantizeLinear", ["q", "s"], ["w"], name="dq")
        w = (q * 0.01).T
    op = h.make_node("Gemm", ["x", "w"], ["y"], transB=1, name="mm") if kind.endswith("transB") else \
        h.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    graph = h.make_graph([dq, op], "q", [h.make_tensor_value_info("x", T.FLOAT, [5, 12])],
                         [h.make_tensor_value_info("y", T.FLOAT, [5, 6])], tensors)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    g = random_b(lora.add_adapters(rg.load(model), 3, alpha=6.0))
    (ad,) = lora.config(g)["adapters"]
    assert ad["quantized"] and ad["weight"] == "q" and (ad["in"], ad["out"]) == (12, 6)
    x, R = rng.normal(0, 1, (5, 12)).astype(F32), rng.normal(0, 1, (5, 6)).astype(F32)
    layer = LoraLinear(w.T, None, g.initializers[ad["A"]], g.initializers[ad["B"]], 2.0)
    y = layer(torch.as_tensor(x, dtype=torch.float64))
    (y * torch.as_tensor(R, dtype=torch.float64)).sum().backward()
    lg = g.copy()
    lg.nodes += [Node("Mul", ["y", "R"], ["yr"], name="lm"), Node("ReduceSum", ["yr"], ["loss"], {"keepdims": 0},
                                                                  name="ls")]
    lg.inputs.append(ValueInfo("R", F32, (5, 6)))
    lg.outputs = [ValueInfo("loss", F32, ())]
    got = rg.Session(rg.gradient(lg, "loss", [ad["A"], ad["B"]])).run({"x": x, "R": R})
    np.testing.assert_allclose(got[ad["A"] + "_grad"], layer.lora_A.weight.grad.numpy().T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[ad["B"] + "_grad"], layer.lora_B.weight.grad.numpy().T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(run(g, x), y.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(lora.merge_adapters(g), x), y.detach().numpy(), rtol=1e-5, atol=1e-5)
