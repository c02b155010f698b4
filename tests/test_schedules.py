"""Learning-rate schedules, clipping by the global norm and weight-decay exclusions (revgraph.train.schedules) against
PyTorch: torch.optim.SGD/Adam/AdamW with parameter groups without decay, torch.optim.lr_scheduler.LambdaLR with
transformers' schedule formulas (written below) and torch.nn.utils.clip_grad_norm_, over 24 steps; resuming
mid-schedule; the checkpoint's record of every hyperparameter (revgraph.train.run_record) and its refusals."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch.nn.functional as F
from kit.harness import crash_after  # (tests/ is on sys.path)
from kit.schedules import (
    check_schedule_trains_like_torch,
    check_schedule_values,
    graph_learning_rate,
    hf_lambda,
    torch_run,
)
from kit.training import OPTIMIZERS, assert_params_close, embedding_model, mlp, torch_mlp

import revgraph as rg
from revgraph import train as T
from revgraph.errors import InputError, RevgraphError
from revgraph.train import snapshots as checkpoints
from revgraph.train.run_record import record
from revgraph.train.schedules import SCHEDULES, Schedule

F32 = np.float32
N, BATCH, EPOCHS = 48, 8, 4  # 6 steps per epoch, 24 steps
CLIP = 1.0


def data_mlp(rng):
    return {"x": rng.normal(0, 1, (N, 6)).astype(F32), "labels": rng.integers(0, 3, N)}


def batches_of(data, key):
    return [(data[key][i:i + BATCH], data["labels"][i:i + BATCH]) for _ in range(EPOCHS) for i in range(0, N, BATCH)]


def _ours(g, opt, data, **how) -> rg.Trainer:
    tr = rg.Trainer(g, "cross-entropy", opt, threads=1, **how)
    tr.fit(data, EPOCHS, BATCH, shuffle=False, progress=False)
    return tr


# ------------------------------------------------------------------------------ parity

@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_schedule_clipping_and_exclusions_match_pytorch(name, kind):
    """24 steps of the MLP: warmup 5 then the schedule down to min-lr (a tenth of the peak), the global norm
    clipped to 1, no weight decay on the biases (the default): parameters and losses equal PyTorch's."""
    check_schedule_trains_like_torch(OPTIMIZERS[name], kind, lambda w, t, r: hf_lambda(kind, w, t, r))


def test_decay_all_without_clipping_matches_pytorch():
    """--decay-all: weight decay on every parameter (one torch group); a linear schedule without warmup."""
    rng = np.random.default_rng(1)
    g, data = mlp(rng), data_mlp(rng)
    opt = OPTIMIZERS["adamw"]
    tr = _ours(g, opt, data, schedule=Schedule("linear"), no_decay="none")
    assert tr.spec.no_decay == []
    theirs, losses, _ = torch_run(g.initializers, torch_mlp, opt, batches_of(data, "x"),
                                  hf_lambda("linear", 0, N // BATCH * EPOCHS), None, set())
    np.testing.assert_allclose(tr.losses, losses, rtol=1e-4)
    assert_params_close(tr.parameters, theirs)


def test_sparse_table_is_clipped_by_its_coalesced_rows():
    """An embedding table read through Gather gets its gradient as rows with repeated indices; the global norm
    must add the repeats before squaring (the dense gradient torch sees). Plain SGD (exact for sparse rows), a
    cosine schedule with warmup, clipping to 0.3: equal to torch with a dense embedding and clip_grad_norm_."""
    rng = np.random.default_rng(2)
    g = embedding_model(rng)
    ids = rng.integers(0, 12, (N, 5)).astype(np.int64)
    data = {"ids": ids, "labels": rng.integers(0, 3, N)}
    assert any(len(set(ids[i:i + BATCH].ravel())) < ids[i:i + BATCH].size for i in range(0, N, BATCH))
    opt = T.sgd(lr=0.5)
    tr = _ours(g, opt, data, schedule=Schedule("cosine", 3), clip_grad_norm=0.3)
    assert tr.spec.sparse == ["E"]

    def forward(P, x):
        return F.embedding(x, P["E"]).mean(1) @ P["Wo"] + P["bo"]

    theirs, losses, norms = torch_run(g.initializers, forward, opt, batches_of(data, "ids"),
                                      hf_lambda("cosine", 3, N // BATCH * EPOCHS), 0.3, set())
    assert sum(n > 0.3 for n in norms) >= 12  # clipped at most steps: the norm decides those updates
    np.testing.assert_allclose(tr.losses, losses, rtol=1e-5)
    assert_params_close(tr.parameters, theirs, rtol=1e-5)


@pytest.mark.parametrize("kind", SCHEDULES)
def test_graph_learning_rate_follows_the_formulas(kind):
    """The schedule's nodes alone, fed every step of a run: lr(s) as transformers' lambdas, in the graph and in
    Python."""
    check_schedule_values(kind, hf_lambda(kind, 4, 30, 0.1))


def test_decay_stays_at_min_lr_after_the_run():
    """Past the planned total, linear and cosine stay at min-lr (where transformers' cosine would rise again)."""
    for kind in ("linear", "cosine"):
        lr = graph_learning_rate(T.adam(lr=0.02, schedule=Schedule(kind, 4, 0.002)))
        assert [lr(s, 30) for s in (30, 31, 45, 59)] == pytest.approx([0.002] * 4, rel=1e-12)


def test_no_decay_rules():
    rng = np.random.default_rng(3)
    g = mlp(rng)
    spec = lambda nd: rg.Trainer(g, "cross-entropy", T.adamw(no_decay=nd)).spec.no_decay
    assert spec("default") == ["b1", "b2"] and spec("none") == [] and spec(("W*",)) == ["W1", "W2"]
    assert spec(lambda name, a: name.endswith("2")) == ["W2", "b2"]
    assert rg.Trainer(g, "cross-entropy", T.adam()).spec.no_decay == []  # no weight decay: nothing to exclude
    with pytest.raises(RevgraphError, match="the --no-decay pattern 'gamma' matches no trained parameter"):
        spec(("gamma",))


@pytest.mark.parametrize("kwargs, message", [
    ({"clip_grad_norm": -1.0}, "--clip-grad-norm must be a finite number > 0"),
    ({"clip_grad_norm": float("nan")}, "--clip-grad-norm must be a finite number > 0"),
    ({"schedule": Schedule("cosine", 0, 0.5)}, "--min-lr 0.5 is above the peak learning rate"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(RevgraphError, match=message):
        T.adam(lr=0.01, **kwargs)


def test_bad_schedules():
    with pytest.raises(RevgraphError, match="unknown learning-rate schedule 'step'"):
        Schedule("step")
    with pytest.raises(RevgraphError, match="--warmup-steps must be an integer >= 0"):
        Schedule("linear", -1)
    with pytest.raises(RevgraphError, match="--min-lr applies to the linear and cosine schedules"):
        Schedule("constant", 0, 1e-4)


def test_step_without_fit_needs_the_total():
    rng = np.random.default_rng(4)
    data = data_mlp(rng)
    tr = rg.Trainer(mlp(rng), "cross-entropy", T.adam(schedule=Schedule("linear")))
    with pytest.raises(InputError, match="the linear schedule needs its total steps"):
        tr.step(data)
    given = rg.Trainer(mlp(rng), "cross-entropy", T.adam(schedule=Schedule("linear", total_steps=10)))
    given.step(data)
    assert given.steps == 1


def test_warmup_longer_than_the_run_warns():
    rng = np.random.default_rng(5)
    tr = rg.Trainer(mlp(rng), "cross-entropy", T.adam(schedule=Schedule("cosine", 100)))
    with pytest.warns(UserWarning, match=r"the warmup \(100 steps, --warmup-steps\) is longer than the run \(6 "):
        tr.fit(data_mlp(rng), 1, BATCH, progress=False)


# ------------------------------------------------------------------------------ resuming

def _cosine_trainer(**how):
    rng = np.random.default_rng(6)
    opt = T.adamw(lr=0.01, weight_decay=0.1, **{"schedule": Schedule("cosine", 4, 1e-3), "clip_grad_norm": 0.5, **how})
    return rg.Trainer(mlp(rng), "cross-entropy", opt, threads=1), data_mlp(rng)


def test_resume_mid_schedule_equals_the_uninterrupted_run(tmp_path):
    """A cosine run with warmup and clipping that dies at step 11 and resumes from its checkpoint (every 4 steps)
    ends bitwise equal to the uninterrupted run: the step and the total steps are in the checkpoint."""
    ref, data = _cosine_trainer()
    ref.fit(data, EPOCHS, BATCH, seed=2, progress=False)
    crashing, _ = _cosine_trainer()
    crash_after(crashing, 11)
    with pytest.raises(KeyboardInterrupt):
        crashing.fit(data, EPOCHS, BATCH, seed=2, progress=False, checkpoint_dir=tmp_path, checkpoint_every=4)
    arrays, meta = checkpoints.load(tmp_path)
    assert int(arrays[crashing.spec.total]) == 24 and meta["hyperparameters"]["total_steps"] == 24
    resumed, _ = _cosine_trainer()
    resumed.fit(data, EPOCHS, BATCH, seed=2, progress=False, checkpoint_dir=tmp_path, checkpoint_every=4)
    assert resumed.resumed and resumed.steps == 24 and resumed.losses == ref.losses[8:]  # (those after the snapshot)
    for name, value in {**ref.parameters, **ref.state}.items():
        np.testing.assert_array_equal({**resumed.parameters, **resumed.state}[name], value, err_msg=name)


CHANGES = {  # recorded name: (Trainer/optimizer settings now, what the refusal says)
    "lr": ({"lr": 0.02}, "lr 0.01 (now 0.02)"),
    "betas": ({"betas": (0.8, 0.999)}, "betas [0.9, 0.999] (now [0.8, 0.999])"),
    "eps": ({"eps": 1e-6}, "eps 1e-08 (now 1e-06)"),
    "weight_decay": ({"weight_decay": 0.2}, "weight_decay 0.1 (now 0.2)"),
    "no_decay": ({"no_decay": "none"}, "no_decay ['b1', 'b2'] (now [])"),
    "lr_schedule": ({"schedule": Schedule("linear", 4, 1e-3)}, "lr_schedule 'cosine' (now 'linear')"),
    "warmup_steps": ({"schedule": Schedule("cosine", 2, 1e-3)}, "warmup_steps 4 (now 2)"),
    "min_lr": ({"schedule": Schedule("cosine", 4, 0.0)}, "min_lr 0.001 (now 0.0)"),
    "clip_grad_norm": ({"clip_grad_norm": 1.0}, "clip_grad_norm 0.5 (now 1.0)"),
    "total_steps": ("epochs", "total_steps 24 (now 30)"),
    "loss": ("loss", ("'label_smoothing': 0.0, 'class_weights': None} (now {'kind': 'cross-entropy', 'output': 'y', "
                      "'ignore_index': None, 'label_smoothing': 0.1,")),
    "precision": ("precision", "precision 'fp32' (now 'bf16')"),
    "revgraph.lora": ("lora", "revgraph.lora None (now '{\"rank\": 4}')"),
}


def _changed(name: str):
    """A trainer with the recorded setting ``name`` changed, and the fit epochs."""
    how, _ = CHANGES[name]
    opt = dict(how) if isinstance(how, dict) else {}
    tr, data = _cosine_trainer(**{k: v for k, v in opt.items() if k in ("schedule", "clip_grad_norm", "no_decay")})
    if isinstance(how, dict) and set(opt) - {"schedule", "clip_grad_norm", "no_decay"}:
        rng = np.random.default_rng(6)
        base = {"lr": 0.01, "weight_decay": 0.1, "schedule": Schedule("cosine", 4, 1e-3), "clip_grad_norm": 0.5}
        tr = rg.Trainer(mlp(rng), "cross-entropy", T.adamw(**{**base, **opt}), threads=1)
    if how == "loss":  # LossSpec.settings: the same model and optimizer, a smoothed loss
        rng = np.random.default_rng(6)
        opt = T.adamw(lr=0.01, weight_decay=0.1, schedule=Schedule("cosine", 4, 1e-3), clip_grad_norm=0.5)
        tr = rg.Trainer(mlp(rng), "cross-entropy", opt, threads=1, loss_options={"label_smoothing": 0.1})
    if how == "precision":  # (the mixed-precision helper's TrainingGraph.precision)
        tr.spec.precision = "bf16"
    if how == "lora":  # (the LoRA helper's Graph.metadata)
        tr.spec.model.metadata = {"revgraph.lora": '{"rank": 4}'}
    return tr, data, 5 if how == "epochs" else EPOCHS


@pytest.mark.parametrize("name", CHANGES)
def test_resume_with_another_hyperparameter_is_refused_unless_overridden(tmp_path, name):
    """Each recorded setting: resuming with another value is refused in one line naming it (then and now);
    ``override=[name]`` trains on with the new value and says so in one line; the new checkpoint records it."""
    first, data = _cosine_trainer()
    crash_after(first, 7)
    with pytest.raises(KeyboardInterrupt):
        first.fit(data, EPOCHS, BATCH, progress=False, checkpoint_dir=tmp_path, checkpoint_every=6)
    tr, _, epochs = _changed(name)
    with pytest.raises(RevgraphError) as info:
        tr.fit(data, epochs, BATCH, progress=False, checkpoint_dir=tmp_path)
    text = str(info.value)
    assert "\n" not in text and CHANGES[name][1] in text and f"--override {name}" in text, text
    assert tr.steps == 0 and checkpoints.load(tmp_path)[1]["epoch"] == 1  # nothing trained, nothing written
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.fit(data, epochs, BATCH, progress=False, checkpoint_dir=tmp_path, override=[name])
    said = [str(w.message) for w in caught if "overridden" in str(w.message)]
    assert len(said) == 1 and name in said[0], said
    assert tr.resumed and tr.steps == 6 * epochs
    meta = checkpoints.load(tmp_path)[1]
    assert meta["hyperparameters"] == record(tr.spec, 6 * epochs)


def test_resume_with_another_momentum_is_refused_unless_overridden(tmp_path):
    rng = np.random.default_rng(9)
    data = data_mlp(rng)
    rg.Trainer(mlp(rng), "cross-entropy", T.sgd(momentum=0.9)).fit(data, 1, BATCH, progress=False,
                                                                     checkpoint_dir=tmp_path)
    tr = rg.Trainer(mlp(np.random.default_rng(9)), "cross-entropy", T.sgd(momentum=0.5))
    with pytest.raises(RevgraphError, match=r"was written with momentum 0.9 \(now 0.5\); .* --override momentum"):
        tr.fit(data, 2, BATCH, progress=False, checkpoint_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"with momentum 0.5 instead of 0.9 \(overridden\)"):
        tr.fit(data, 2, BATCH, progress=False, checkpoint_dir=tmp_path, override=["momentum"])
    assert tr.steps == 12


def test_override_of_an_unknown_name_is_refused(tmp_path):
    tr, data = _cosine_trainer()
    with pytest.raises(RevgraphError, match="--override learning_rate: not a recorded setting; the checkpoint records "
                                            "optimizer, lr, momentum"):
        tr.fit(data, 1, BATCH, progress=False, checkpoint_dir=tmp_path, override=["learning_rate"])


def test_checkpoint_without_a_record_resumes_with_defaults(tmp_path):
    """A checkpoint written before the record existed: its missing settings are the defaults (no schedule, no
    clipping, weight decay on every parameter), so a run with those resumes and one with a warmup is refused."""
    rng = np.random.default_rng(7)
    data = data_mlp(rng)
    old = rg.Trainer(mlp(rng), "cross-entropy", T.adam(lr=0.01), threads=1)
    old.fit(data, 1, BATCH, progress=False, checkpoint_dir=tmp_path)
    arrays, meta = checkpoints.load(tmp_path)
    del meta["hyperparameters"]
    checkpoints.save(tmp_path, arrays, {k: v for k, v in meta.items() if k not in ("format", "names")})
    same = rg.Trainer(mlp(np.random.default_rng(7)), "cross-entropy", T.adam(lr=0.01), threads=1)
    same.fit(data, 2, BATCH, progress=False, checkpoint_dir=tmp_path)
    assert same.resumed and same.steps == 12
    checkpoints.save(tmp_path, arrays, {k: v for k, v in meta.items() if k not in ("format", "names")})
    warm = rg.Trainer(mlp(np.random.default_rng(7)), "cross-entropy", T.adam(lr=0.01, schedule=Schedule("constant", 3)))
    with pytest.raises(RevgraphError, match=r"warmup_steps 0 \(now 3\)"):
        warm.fit(data, 2, BATCH, progress=False, checkpoint_dir=tmp_path)


# ------------------------------------------------------------------------------ CLI

def _cli(tmp_path, *args):
    rng = np.random.default_rng(8)
    if not (tmp_path / "m.onnx").exists():
        rg.save(mlp(rng), tmp_path / "m.onnx")
        np.savez(tmp_path / "d.npz", x=rng.normal(0, 1, (N, 6)).astype(F32), y=rng.integers(0, 3, N))
    return subprocess.run([sys.executable, "-m", "revgraph", "train", str(tmp_path / "m.onnx"), "--data",
                           str(tmp_path / "d.npz"), "--loss", "cross-entropy", "--threads", "1", "-o",
                           str(tmp_path / "o.onnx"), "--batch-size", str(BATCH), *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_schedule_clipping_and_exclusions(tmp_path):
    """The options reach the trainer: the CLI's run equals the API's, and it names the excluded parameters."""
    r = _cli(tmp_path, "--epochs", "2", "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1",
             "--lr-schedule", "cosine", "--warmup-steps", "3", "--min-lr", "0.001", "--clip-grad-norm", "0.5")
    assert r.returncode == 0, r.stderr
    assert "weight decay 0.1 on 2 parameters, not on 2 (biases and 1-D parameters): b1, b2" in r.stdout
    z = np.load(tmp_path / "d.npz")
    api = rg.Trainer(rg.load(tmp_path / "m.onnx"), "cross-entropy", T.adamw(
        lr=0.01, weight_decay=0.1, schedule=Schedule("cosine", 3, 0.001), clip_grad_norm=0.5))
    api.fit({"x": z["x"], "labels": z["y"]}, 2, BATCH, progress=False)
    trained = rg.load(tmp_path / "o.onnx").initializers
    for k, v in api.parameters.items():
        np.testing.assert_allclose(trained[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("args, message", [
    (["--clip-grad-norm", "0"], "argument --clip-grad-norm: invalid value '0': give a finite number > 0"),
    (["--warmup-steps", "-2"], "argument --warmup-steps: invalid value '-2'"),
    (["--lr-schedule", "linear", "--lr", "0.01", "--min-lr", "0.1"], "--min-lr 0.1 is above the peak"),
    (["--min-lr", "0.001"], "--min-lr applies to the linear and cosine schedules"),
    (["--decay-all", "--no-decay", "b*"], "--decay-all and --no-decay contradict each other"),
    (["--weight-decay", "0.1", "--no-decay", "gamma"], "the --no-decay pattern 'gamma' matches no trained parameter"),
    (["--override", "lr"], "--override goes with --snapshot-dir"),
])
def test_cli_bad_settings_exit_2(tmp_path, args, message):
    r = _cli(tmp_path, "--epochs", "1", *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_cli_resume_with_another_lr_exits_2_unless_overridden(tmp_path):
    ck = str(tmp_path / "ck")
    assert _cli(tmp_path, "--epochs", "1", "--lr", "0.01", "--checkpoint-dir", ck).returncode == 0
    (tmp_path / "o.onnx").unlink()
    r = _cli(tmp_path, "--epochs", "2", "--lr", "0.02", "--checkpoint-dir", ck)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "was written with lr 0.01 (now 0.02); resume with the same value, or give --override lr" in r.stderr
    assert not (tmp_path / "o.onnx").exists()
    r = _cli(tmp_path, "--epochs", "2", "--lr", "0.02", "--checkpoint-dir", ck, "--override", "lr")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if "overridden" in line] == [
        f"resuming {ck}/checkpoint.npz with lr 0.02 instead of 0.01 (overridden)"]
    r = _cli(tmp_path, "--epochs", "3", "--lr", "0.02", "--checkpoint-dir", ck, "--override", "momentum")
    assert r.returncode == 0, r.stderr  # (the checkpoint now records lr 0.02; an override that changes nothing)


# ------------------------------------------------------------------------------ data-parallel

SCHEDULED = ("--lr-schedule", "cosine", "--warmup-steps", "3", "--min-lr", "0.001", "--clip-grad-norm", "0.5")


def _dp_reference(model: str, optimizer: str, hidden: int, **how):
    from distributed_worker import schedule_options, trainer

    tr, data = trainer(model, optimizer, 97, False, hidden, **schedule_options(**how))
    tr.fit(data, 2, 16, seed=3, progress=False)
    return tr


@pytest.mark.parametrize("model,optimizers,shard", [
    pytest.param("mlp", "sgd,adam,adamw", "none", marks=pytest.mark.slow), ("embedding", "adam,sgd0", "none"),
    ("mlp", "sgd,adamw", "optimizer"), pytest.param("mlp", "adam,adamw", "gradients", marks=pytest.mark.slow)])
def test_data_parallel_schedule_clipping_and_exclusions_equal_one_process(tmp_path, model, optimizers, shard):
    """2 processes x batch 8 = 1 process x batch 16 with a cosine schedule, warmup, clipping to 0.5 and no decay
    on biases: unsharded (gradients all-reduced, sparse rows all-gathered, then clipped in the update graph) and
    sharded (ZeRO-1/2: the squared norms of every rank's shards all-reduced; units of 1 KiB mixing weights and
    biases, so weight decay is masked inside a shard)."""
    import torch.distributed.run  # noqa: F401  (in the test extra)
    from kit.distributed import TORCHRUN, WORKER, run_command

    hidden = 13
    run_command([*TORCHRUN, "--standalone", "--nproc-per-node=2", str(WORKER), "--model", model, "--optimizer",
                 optimizers, "--hidden", str(hidden), "--shard", shard, "--bucket-bytes", "1024",
                 "--out", str(tmp_path), "--lr-schedule", "cosine", "--warmup-steps", "3", "--min-lr", "0.001",
                 "--clip-grad-norm", "0.5"])
    how = {"kind": "cosine", "warmup": 3, "min_lr": 0.001, "clip": 0.5}
    for opt in optimizers.split(","):
        ranks = [dict(np.load(tmp_path / f"rank{r}-{opt}.npz")) for r in range(2)]
        ref = _dp_reference(model, opt, hidden, **how)
        if ref.spec.optimizer.weight_decay:  # (AdamW here) the biases are excluded
            assert ref.spec.no_decay == (["b1", "b2"] if model == "mlp" else ["b"])
        unclipped = _dp_reference(model, opt, hidden, **{**how, "clip": None})
        assert not np.allclose(unclipped.losses, ref.losses, rtol=1e-3)  # the clipping changes the run
        for name, value in {**ref.parameters, **ref.state}.items():
            np.testing.assert_array_equal(ranks[1][name], ranks[0][name], err_msg=name)
            np.testing.assert_allclose(ranks[0][name], value, rtol=2e-5, atol=2e-6, err_msg=f"{opt} {name}")
        np.testing.assert_allclose(ranks[0]["losses"], ref.losses, rtol=2e-5, atol=1e-6)
