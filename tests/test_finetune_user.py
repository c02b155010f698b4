"""Fine-tuning as a careless user would run it: each kind of bad input found by trying the README's options in
ways it does not show is a one-line error (InputError / RevgraphError; the CLI exits 2 and writes nothing),
never a traceback, exit 3 or a silently wrong run. Small models, fast."""

import subprocess
import sys

import numpy as np
import pytest
from kit.lossdata_models import lm_data, tiny_lm

import revgraph as rg
from revgraph.errors import RevgraphError
from revgraph.tools.demo import mlp_model
from revgraph.train import lora

F32 = np.float32


def _data(n: int = 40, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 8, 8)).astype(F32), "labels": rng.integers(0, 10, n)}


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text and len(text) < 600, text
    return text


# ------------------------------------------------------------------------------------ Python API arguments

@pytest.mark.parametrize("kwargs, message", [
    ({"freeze": b"W1"}, "freeze (--freeze) must be a name or glob pattern or a list of them, got bytes"),
    # a mapping would iterate as its keys: {"W1": False} would freeze W1
    ({"freeze": {"W1": False}}, "freeze (--freeze) must be a name or glob pattern or a list of them, got dict"),
    ({"params": 5}, "params (--train) must be a name or glob pattern or a list of them, got int"),
    ({"freeze": [1]}, "freeze (--freeze) 1 is not a name or glob pattern"),
    ({"loss_options": [1]}, "loss_options must be a mapping of option names to values, got list"),
    ({"loss_options": {"smoothing": 0.1}}, "unknown loss option 'smoothing' (loss_options=); the options are"),
    ({"loss_options": {"label_smoothing": "x"}}, "--label-smoothing must be a number in [0, 1], got 'x'"),
    ({"loss_options": {"ignore_index": "x"}}, "--ignore-index must be an integer, got 'x'"),
    ({"loss_options": {"class_weights": [1.0, float("nan")] + [1.0] * 8}}, "(weight 1 is nan)"),
    ({"loss_options": {"class_weights": [1.0, -2.0] + [1.0] * 8}}, "(weight 1 is -2.0)"),
    # all zero: no target counts, the loss is 0 and nothing trains (torch's weighted mean is NaN)
    ({"loss_options": {"class_weights": np.zeros(10)}}, "--class-weights are all 0"),
    ({"output": "logits", "loss": "output:logits"}, None),  # the same output twice is no conflict
])
def test_trainer_arguments_of_the_wrong_kind_are_one_line_errors(kwargs, message):
    kwargs = dict(kwargs)
    loss = kwargs.pop("loss", "cross-entropy")
    if message is None:
        with pytest.raises(RevgraphError, match="needs a float scalar output"):  # logits are not a scalar
            rg.Trainer(mlp_model(), loss, "sgd", threads=1, **kwargs)
        return
    with pytest.raises(RevgraphError) as info:
        rg.Trainer(mlp_model(), loss, "sgd", threads=1, **kwargs)
    assert message in _one_line(info), (message, str(info.value))


def test_model_output_beside_an_output_loss_is_refused():
    """``output:NAME`` names the loss; another ``output=`` would be ignored without a word."""
    from revgraph.train.losses import loss_graph

    g = tiny_lm()
    with pytest.raises(RevgraphError) as info:
        loss_graph(g, "output:logits", output="other")
    assert "--model-output other (output=) does not go with --loss-fn output:logits" in _one_line(info)


@pytest.mark.parametrize("static, message", [
    ([1, 2], "static= must be a mapping of arrays by input name, got list"),
    ("x=foo.npy", "static= must be a mapping of arrays by input name, got str"),
    # static labels [N] beside per-sample x [N, 8, 8]: the same sample axis, fed whole, broke the step (exit 3)
    ({"labels": np.zeros(40, np.int64)}, "--static labels: its first axis 'N' is the sample axis of 'x'"),
])
def test_fit_static_of_the_wrong_kind_is_a_one_line_error(static, message):
    tr = rg.Trainer(mlp_model(), "cross-entropy", "sgd", threads=1)
    data = _data()
    if isinstance(static, dict):
        data = {"x": data["x"]}
    before = {k: np.array(v) for k, v in tr.parameters.items()}
    with pytest.raises(RevgraphError) as info:
        tr.fit(data, epochs=1, static=static)
    assert message in _one_line(info)
    assert all(np.array_equal(before[k], v) for k, v in tr.parameters.items())


def test_static_input_on_the_sample_axis_of_the_labels_is_refused():
    tr = rg.Trainer(mlp_model(), "cross-entropy", "sgd", threads=1)
    d = _data()
    with pytest.raises(RevgraphError) as info:
        tr.fit({"labels": d["labels"]}, epochs=1, static={"x": d["x"]})
    assert "--static x: its first axis 'N' is the sample axis of 'labels'" in _one_line(info)


def test_causal_lm_data_with_labels_it_would_not_read_is_refused():
    """Hugging Face data carries ``labels`` with the padding masked; causal-lm reads ``input_ids`` by default, so
    the labels (and their masks) would be ignored: refused, naming ``--labels-from labels``."""
    ids, labels = lm_data(8)
    tr = rg.Trainer(tiny_lm(), "causal-lm", "sgd", threads=1)
    with pytest.raises(RevgraphError) as info:
        tr.fit({"input_ids": ids, "labels": labels}, epochs=1, batch_size=4)
    assert "give --labels-from labels" in _one_line(info)
    tr = rg.Trainer(tiny_lm(), "causal-lm", "sgd", threads=1, loss_options={"labels_from": "labels"})
    tr.fit({"input_ids": ids, "labels": labels}, epochs=1, batch_size=4)  # the way to use them trains


@pytest.mark.parametrize("arrays, configuration", [
    ({"W1.lora_A": np.zeros((64, 4))}, {"rank": 4}),  # no format, no adapters: a KeyError before
    ({}, None),
    ({}, {"format": 1, "rank": 4, "adapters": [{"weight": "W1"}]}),  # an entry without its A and B names
    ([("W1.lora_A", np.zeros((64, 4)))], "adapters"),  # arrays not a mapping
])
def test_lora_apply_with_a_foreign_configuration_is_a_one_line_error(arrays, configuration):
    g = mlp_model()
    if configuration == "adapters":
        configuration = lora.extract(lora.add_adapters(g, 4))[1]
    with pytest.raises(RevgraphError) as info:
        lora.apply(g, arrays, configuration)
    assert "lora.apply:" in _one_line(info)


def test_no_decay_pattern_that_matches_nothing_is_refused_without_weight_decay_too():
    with pytest.raises(RevgraphError) as info:
        rg.Trainer(mlp_model(), "cross-entropy", "adam", threads=1, no_decay=("zzz",))
    assert "the --no-decay pattern 'zzz' matches no trained parameter" in _one_line(info)


# ------------------------------------------------------------------------------------------- files and CLI

def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "revgraph", *map(str, args)], check=False, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kind, message", [
    ("object", "holds an array of Python objects (dtype object, pickled), which is not read"),
    ("directory", "cannot read"),  # a directory named x.npy: "is a directory", not "no such file"
])
def test_data_directory_entries_of_the_wrong_kind(tmp_path, kind, message):
    from revgraph.train.data import read_dir

    d = tmp_path / "data"
    d.mkdir()
    np.save(d / "labels.npy", np.zeros(4, np.int64))
    if kind == "object":
        np.save(d / "x.npy", np.array([object()] * 4, dtype=object), allow_pickle=True)
    else:
        (d / "x.npy").mkdir()
        message = f"cannot read {str(d / 'x.npy')!r}: is a directory; give a .npy file"
    with pytest.raises(RevgraphError) as info:
        read_dir(d)
    assert message in _one_line(info)


@pytest.mark.parametrize("kind, message", [
    ("object", "holds an array of Python objects (a pickle), which is not read"),
    # --data x.npy: numpy gives an ndarray, and `with np.load(...)` raised a bare TypeError
    ("npy", "holds one array (a .npy file); pass an .npz file that maps input names to arrays, or a directory"),
])
def test_npz_of_the_wrong_kind_is_named(tmp_path, kind, message):
    from revgraph.cli.common import read_npz

    path = tmp_path / "d.npz"
    if kind == "object":
        np.savez(path, x=np.array([None, 1], dtype=object))
    else:
        path = tmp_path / "x.npy"
        np.save(path, np.zeros(3))
    with pytest.raises(RevgraphError) as info:
        read_npz(str(path))
    assert message in _one_line(info)


def test_resume_with_another_lora_rank_names_the_difference_and_refuses_the_override(tmp_path):
    """The record of ``revgraph.lora`` is kilobytes of JSON: the refusal names only what differs (rank, alpha),
    and an override that changes the adapters' shapes stops with one line, exit 2."""
    rg.save(mlp_model(hidden=8), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **_data(16))
    common = ["train", "m.onnx", "--data", "d.npz", "--loss", "cross-entropy", "--epochs", "1", "--batch-size",
              "8", "--checkpoint-dir", "ck", "--threads", "1"]
    assert _cli(*common, "--lora", "2", "-o", "a.onnx", cwd=tmp_path).returncode == 0
    r = _cli(*common, "--lora", "4", "-o", "b.onnx", cwd=tmp_path)
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "revgraph.lora rank 2 (now 4), alpha 2.0 (now 4.0);" in line, r.stderr
    assert "adapters" not in line and len(line) < 400
    r = _cli(*common, "--lora", "4", "--override", "revgraph.lora", "--epochs", "2", "-o", "b.onnx", cwd=tmp_path)
    assert r.returncode == 2 and "cannot be resumed: 'W1.lora_A' has shape [64, 2]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "b.onnx").exists()


def _web_prepare():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "web" / "prepare.py"
    spec = importlib.util.spec_from_file_location("web_prepare_user", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "--steps 0 and --batch-size 32 must be at least 1"),  # a page that would train nothing
    # revgraph train's own one-line error, not a CalledProcessError traceback
    ({"schedule": ("cosine", 0, 1.0)}, "revgraph: error: --min-lr 1 is above the peak learning rate"),
])
def test_web_prepare_stops_with_one_line(tmp_path, kwargs, message):
    with pytest.raises(SystemExit) as info:
        _web_prepare().prepare(tmp_path / "data", **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("dtype, shape", [(np.int32, ("B", 6)), (np.float32, ("B", 6)), (np.int64, ("B", 6, 1))])
def test_causal_lm_ids_of_another_dtype_or_rank_are_named(dtype, shape):
    """An input named by --labels-from that is not int64 [B, T] reached onnxruntime's type check (its error)."""
    from revgraph.ir import ValueInfo
    from revgraph.train.losses import loss_graph

    g = tiny_lm()
    g.inputs.append(ValueInfo("ids", dtype, shape))
    with pytest.raises(RevgraphError) as info:
        loss_graph(g, "causal-lm", labels_from="ids")
    assert "--labels-from ids: input 'ids' is" in _one_line(info) and "int64 token ids" in str(info.value)
