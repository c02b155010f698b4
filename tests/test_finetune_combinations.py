"""Issue 26's features together (each is tested alone in its own file): fp16 loss scaling with clipping and with
a schedule (against torch.autocast + GradScaler on onnx's reference evaluator, the harness of
tests/test_precision.py), causal-lm with padding + accumulation + schedule + clipping and ``output:NAME``
data-parallel (2 processes against one on the same global batch), static inputs with a schedule resumed from a
checkpoint, the saved training graph of a schedule run by the web example's feeds, and every new ``revgraph
train`` option given a bad value."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.harness import crash_after  # (tests/ is on sys.path)
from kit.precision import ATOL, C, D, batches, mlp, reference_train, torch_mlp
from kit.schedules import hf_lambda

import revgraph as rg
from revgraph.errors import RevgraphError
from revgraph.train import adam, training_graph
from revgraph.train.precision import Precision
from revgraph.train.schedules import Schedule

F32 = np.float32
LR, CLIP = 1e-2, 0.5
#: a scale too large for float16 (the first steps overflow and are skipped), growing after 3 good steps
SCALER = {"init_scale": 2.0 ** 24, "growth_interval": 3}


def torch_scaled(params, data, clip=None, lam=None, advance="good"):
    """PyTorch's fp16 recipe with clipping (the documented order, torch.amp docs "Gradient clipping"):
    ``scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_; scaler.step(opt); scaler.update()``.
    ``lam``: a LambdaLR lambda, stepped after good steps only (``advance="good"``: what revgraph's graph does,
    the rate follows the optimizer's step count) or after every iteration (``"every"``: the usual loop).
    Returns parameters, losses, scales and the global norms (after unscaling, before clipping) of good steps."""
    T = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.Adam(T.values(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam) if lam else None
    gs = torch.amp.GradScaler("cpu", **SCALER)
    losses, scales, norms = [], [], []
    for x, y in data:
        loss = F.cross_entropy(torch_mlp(T, torch.from_numpy(x), torch.float16), torch.from_numpy(y))
        opt.zero_grad()
        gs.scale(loss).backward()
        gs.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(list(T.values()), clip)) if clip else None
        before = gs.get_scale()
        gs.step(opt)
        gs.update()
        good = gs.get_scale() >= before
        if good and norm is not None:
            norms.append(norm)
        if sched is not None and (good or advance == "every"):
            with np.errstate(all="ignore"):
                sched.step()
        scales.append(gs.get_scale())
        losses.append(loss.item())
    return {k: v.detach().numpy() for k, v in T.items()}, losses, scales, norms


def test_fp16_loss_scaling_with_clipping_matches_gradscaler_unscale_then_clip():
    """The unscaling comes before the clipping (the norm is that of the true gradients), the skipped steps
    (overflow) clip nothing and change nothing: 20 steps equal GradScaler + unscale_ + clip_grad_norm_."""
    rng = np.random.default_rng(3)
    model, data = mlp(rng), batches(rng, (D,))
    opt = adam(lr=LR)
    opt = type(opt)(**{**opt.__dict__, "clip_grad_norm": CLIP})
    tg = training_graph(model, "cross-entropy", opt, precision=Precision("fp16", **SCALER))
    ours, losses, scales = reference_train(tg, data)
    theirs, t_losses, t_scales, norms = torch_scaled(model.initializers, data, clip=CLIP)
    assert scales == t_scales
    skipped = sum(b < a for a, b in zip([SCALER["init_scale"], *scales], scales, strict=False))
    assert skipped >= 2 and int(ours[tg.step]) == len(data) - skipped
    assert min(norms) > CLIP  # every good step was clipped: the clipping is in the comparison
    np.testing.assert_allclose(losses, t_losses, rtol=0, atol=5 * ATOL["fp16"])
    for p in tg.params:
        np.testing.assert_allclose(ours[p], theirs[p], rtol=0, atol=5 * ATOL["fp16"], err_msg=p)
    # clipping the scaled gradients (before unscaling) would clip by a norm 2^k too large: a different run
    wrong = dict(torch_scaled(model.initializers, data, clip=CLIP * scales[-1])[0].items())
    assert max(np.abs(wrong[p] - theirs[p]).max() for p in tg.params) > 20 * ATOL["fp16"]


def test_fp16_skipped_steps_do_not_advance_the_schedule():
    """README (Mixed precision): a skipped step is not counted in ``step``, and the schedule reads ``step``, so
    a skipped step does not advance the schedule either: equal to PyTorch with ``scheduler.step()`` after good
    steps only, and not to the usual loop that steps the scheduler every iteration."""
    rng = np.random.default_rng(4)
    model, data = mlp(rng), batches(rng, (D,))
    total, warmup = len(data), 4
    opt = adam(lr=LR)
    opt = type(opt)(**{**opt.__dict__, "clip_grad_norm": CLIP,
                       "schedule": Schedule("cosine", warmup, 1e-3, total_steps=total)})
    tg = training_graph(model, "cross-entropy", opt, precision=Precision("fp16", **SCALER))
    ours, losses, scales = reference_train(tg, data)
    lam = hf_lambda("cosine", warmup, total, 1e-3 / LR)
    theirs, t_losses, t_scales, _ = torch_scaled(model.initializers, data, clip=CLIP, lam=lam)
    assert scales == t_scales
    skipped = sum(b < a for a, b in zip([SCALER["init_scale"], *scales], scales, strict=False))
    assert skipped >= 2 and int(ours[tg.step]) == total - skipped  # the schedule stopped short of its end
    assert int(ours[tg.total]) == total
    np.testing.assert_allclose(losses, t_losses, rtol=0, atol=5 * ATOL["fp16"])
    for p in tg.params:
        np.testing.assert_allclose(ours[p], theirs[p], rtol=0, atol=5 * ATOL["fp16"], err_msg=p)
    every = torch_scaled(model.initializers, data, clip=CLIP, lam=lam, advance="every")[0]
    assert max(np.abs(every[p] - theirs[p]).max() for p in tg.params) > 20 * ATOL["fp16"]
    assert math.isclose(opt.schedule.factor(total - skipped, total, LR), lam(total - skipped))


@pytest.mark.parametrize("accumulate", [2, 4])
def test_fp16_gradient_accumulation_matches_gradscaler_accumulation(accumulate):
    """``fit(accumulate_steps=K)`` with fp16 loss scaling, clipping and a schedule, as PyTorch accumulates under
    GradScaler: ``scaler.scale(loss / K).backward()`` per micro-batch, then one unscale, clip, step and update.
    A scale of 2^127 overflows float32 itself (a model without products: the step runs on onnxruntime's CPU), so
    which micro-batch overflows decides the skips: each micro-batch's backward must be seeded with scale / K
    (it was seeded with the whole scale and weighted after, which skipped more steps and ended elsewhere)."""
    import warnings

    from kit.precision import scaled_linear

    rng = np.random.default_rng(6)
    x = (rng.uniform(4, 8, (32, C)) * rng.choice([-1, 1], (32, C))).astype(F32)
    y = rng.integers(0, C, 32)
    opts = {"init_scale": 2.0 ** 127, "growth_interval": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no product to run in float16)
        tr = rg.Trainer(scaled_linear(np.random.default_rng(6)), "cross-entropy", adam(lr=LR), threads=1,
                        precision=Precision("fp16", **opts), clip_grad_norm=2.0,
                        schedule=Schedule("cosine", warmup_steps=1, min_lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (an overflow in the sums is expected, not a warning)
        tr.fit({"x": x, "labels": y}, 2, 8 // accumulate, shuffle=False, progress=False,
               accumulate_steps=accumulate)
    w = torch.tensor(scaled_linear(np.random.default_rng(6)).initializers["w"], requires_grad=True)
    opt = torch.optim.Adam([w], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, hf_lambda("cosine", 1, 8, 1e-3 / LR))
    gs = torch.amp.GradScaler("cpu", **opts)
    scales = []
    for _ in range(2):
        for i in range(0, 32, 8):
            opt.zero_grad()
            for j in range(i, i + 8, 8 // accumulate):
                xb, yb = torch.from_numpy(x[j:j + 8 // accumulate]), torch.from_numpy(y[j:j + 8 // accumulate])
                gs.scale(F.cross_entropy(xb * w, yb) / accumulate).backward()
            gs.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([w], 2.0)
            before = gs.get_scale()
            gs.step(opt)
            gs.update()
            if gs.get_scale() >= before:  # (revgraph's schedule follows the steps taken: README)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    sched.step()
            scales.append(gs.get_scale())
    s = tr.spec.scaling
    carried = tr._engine.read([s.scale, tr.spec.step])
    assert float(carried[s.scale]) == scales[-1] and scales[0] < 2.0 ** 127  # skipped at first
    assert int(carried[tr.spec.step]) == sum(b >= a for a, b in zip([2.0 ** 127, *scales], scales, strict=False))
    np.testing.assert_allclose(tr.parameters["w"], w.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_fp16_scaled_run_with_a_schedule_resumed_mid_run_equals_the_uninterrupted_run(tmp_path):
    """fp16 loss scaling (skips and scale changes) + cosine schedule + clipping, killed at step 7 and resumed from
    its checkpoint of step 6: the loss scale, its good-step count, ``step`` and ``total_steps`` come back, so the
    run ends bitwise equal to the uninterrupted one."""
    import warnings

    from kit.precision import scaled_linear

    from revgraph.train import snapshots as checkpoints

    rng = np.random.default_rng(8)
    data = {"x": (rng.uniform(4, 8, (40, C)) * rng.choice([-1, 1], (40, C))).astype(F32),
            "labels": rng.integers(0, C, 40)}

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (no product to run in float16)
            return rg.Trainer(scaled_linear(np.random.default_rng(8)), "cross-entropy", adam(lr=LR), threads=1,
                              precision=Precision("fp16", init_scale=2.0 ** 127, growth_interval=2),
                              clip_grad_norm=2.0, schedule=Schedule("cosine", warmup_steps=2, min_lr=1e-3))

    how = {"epochs": 3, "batch_size": 8, "seed": 1, "progress": False}
    ref = run()
    ref.fit(data, **how)
    crashing = run()
    crash_after(crashing, 7)
    with pytest.raises(KeyboardInterrupt):
        crashing.fit(data, **how, checkpoint_dir=tmp_path, checkpoint_every=3)
    arrays, meta = checkpoints.load(tmp_path)
    s = crashing.spec.scaling
    assert float(arrays[s.scale]) < 2.0 ** 127 and int(arrays[crashing.spec.step]) == 6  # (skips are not steps)
    assert meta["hyperparameters"]["precision"] == "fp16"
    resumed = run()
    resumed.fit(data, **how, checkpoint_dir=tmp_path, checkpoint_every=3)
    # (a snapshot holds no per-step losses: the resumed trainer has those of the batches after it)
    assert (resumed.resumed and resumed.losses == ref.losses[meta["steps_taken"]:]
            and resumed.steps_taken == len(ref.losses))
    names = [s.scale, s.growth, ref.spec.step, ref.spec.total]
    for name, value in {**ref.parameters, **ref.state, **ref._engine.read(names)}.items():
        got = {**resumed.parameters, **resumed.state, **resumed._engine.read(names)}[name]
        np.testing.assert_array_equal(got, value, err_msg=name)



def test_fp16_resumed_with_other_loss_scaling_options_is_refused_unless_overridden(tmp_path):
    """GradScaler's growth and backoff options change every later scale: they are recorded, and resuming with
    another one is refused in one line naming it (then and now) unless ``override`` names it."""
    import warnings

    from kit.precision import scaled_linear

    rng = np.random.default_rng(8)
    data = {"x": rng.normal(size=(16, C)).astype(F32), "labels": rng.integers(0, C, 16)}

    def run(**scaling):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (no product to run in float16)
            return rg.Trainer(scaled_linear(np.random.default_rng(8)), "cross-entropy", adam(lr=LR), threads=1,
                              precision=Precision("fp16", **scaling))

    run(growth_interval=2).fit(data, 1, 8, progress=False, checkpoint_dir=tmp_path)
    for name, value in (("growth_interval", 3), ("growth_factor", 4.0), ("backoff_factor", 0.25)):
        tr = run(**{"growth_interval": 2, name: value})
        with pytest.raises(RevgraphError) as info:
            tr.fit(data, 2, 8, progress=False, checkpoint_dir=tmp_path)
        text = str(info.value)
        assert "\n" not in text and f"{name} " in text and f"(now {value!r})" in text, text
        assert tr.steps == 0
    tr = run(growth_interval=3)
    tr.fit(data, 2, 8, progress=False, checkpoint_dir=tmp_path, override=["growth_interval"])
    assert tr.resumed and tr.steps == 4

# ------------------------------------------------------------------------------ the CLI, bad values

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small MLP and its data, the static-input model with its data, a .npy directory of unequal lengths."""
    from kit import lossdata_models


    t = tmp_path_factory.mktemp("bad")
    rng = np.random.default_rng(0)
    rg.save(mlp(rng), t / "m.onnx")
    np.savez(t / "d.npz", x=rng.standard_normal((16, D)).astype(F32), labels=rng.integers(0, C, 16))
    np.save(t / "w3.npy", np.ones(3, F32))  # class weights for 3 classes; the model has 5
    rg.save(lossdata_models.static_model(), t / "s.onnx")
    data, static = lossdata_models.static_data(16)
    np.savez(t / "sd.npz", **data)
    np.save(t / "adj.npy", np.eye(3, dtype=F32))  # declared [4, 4]
    np.save(t / "gain.npy", static["gain"])
    (t / "dir").mkdir()
    np.save(t / "dir" / "x.npy", rng.standard_normal((16, D)).astype(F32))
    np.save(t / "dir" / "labels.npy", rng.integers(0, C, 15))
    return t


BAD = {  # case: (extra arguments, a fragment of the one line)
    "lr negative": (["--lr", "-0.1"], "argument --lr: invalid value '-0.1'"),
    "lr nan": (["--lr", "nan"], "argument --lr: invalid value 'nan'"),
    "lr inf": (["--lr", "inf"], "argument --lr: invalid value 'inf'"),
    "min-lr negative": (["--lr-schedule", "cosine", "--min-lr", "-1"], "argument --min-lr: invalid value '-1'"),
    "min-lr nan": (["--lr-schedule", "cosine", "--min-lr", "nan"], "argument --min-lr: invalid value 'nan'"),
    "min-lr above lr": (["--lr", "0.01", "--lr-schedule", "linear", "--min-lr", "0.1"], "--min-lr 0.1 is above"),
    "warmup negative": (["--warmup-steps", "-1"], "argument --warmup-steps: invalid value '-1'"),
    "clip 0": (["--clip-grad-norm", "0"], "argument --clip-grad-norm: invalid value '0'"),
    "clip -1": (["--clip-grad-norm", "-1"], "argument --clip-grad-norm: invalid value '-1'"),
    "clip nan": (["--clip-grad-norm", "nan"], "argument --clip-grad-norm: invalid value 'nan'"),
    "label smoothing 1.5": (["--label-smoothing", "1.5"], "argument --label-smoothing: invalid value '1.5'"),
    "class weights length": (["--class-weights", "{t}/w3.npy"], "--class-weights holds 3 weights"),
    "ignore-index with mse": (["--loss", "mse", "--ignore-index", "0"], "does not apply to --loss mse"),
    "fp16 with --shard": (["--precision", "fp16", "--shard", "optimizer", "--nproc", "2"],
                          "--precision fp16 (precision='fp16') does not combine with --shard optimizer"),
    "override unknown": (["--override", "learning_rate", "--checkpoint-dir", "{t}/ck"],
                         "--override learning_rate: not a recorded setting"),
    "static shape": (["--model", "{t}/s.onnx", "--data", "{t}/sd.npz", "--static", "adj={t}/adj.npy", "--static",
                      "gain={t}/gain.npy"],
                     "static array 'adj' has shape [3, 3]; input 'adj' is declared float32[4,4]"),
    "data dir unequal": (["--data", "{t}/dir"], "x 16, labels 15"),
}


@pytest.mark.parametrize("case", BAD)
def test_cli_bad_values_exit_2_with_one_line_before_training(files, case, capsys):
    """Every new option with a bad value: exit 2, one line on stderr naming it, nothing on stdout but the count
    of trainable parameters (no training started), no file written (neither -o, nor the training graph, nor a
    checkpoint)."""
    from revgraph.cli import main

    extra, fragment = BAD[case]
    extra = [a.format(t=files) for a in extra]
    model = str(files / "m.onnx")
    if "--model" in extra:
        at = extra.index("--model")
        model, extra = extra[at + 1], extra[:at] + extra[at + 2:]
    args = {"--data": str(files / "d.npz"), "--loss": "cross-entropy"}
    for k in list(args):
        if k in extra:
            del args[k]
    argv = ["train", model, *(x for kv in args.items() for x in kv), "--epochs", "1", "--batch-size", "8",
            "--save-training-graph", str(files / "g.onnx"), "-o", str(files / "o.onnx"), *extra]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in err, err
    # nothing on stdout but, for a refusal at the resume (--override), the count of what trains: no step ran
    assert [ln for ln in out.splitlines() if not ln.startswith("parameters: ")] == [], out
    assert not any((files / f).exists() for f in ("o.onnx", "g.onnx", "ck"))


def test_cli_warmup_longer_than_the_run_warns_and_trains(files, capsys):
    from revgraph.cli import main

    argv = ["train", str(files / "m.onnx"), "--data", str(files / "d.npz"), "--loss", "cross-entropy", "--epochs", "1",
            "--batch-size", "8", "--lr-schedule", "cosine", "--warmup-steps", "100", "-o", str(files / "w.onnx")]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("parameters: ")  # the count of trainable parameters, then the warning
    first = out.splitlines()[1]
    assert first.startswith("warning: the warmup (100 steps, --warmup-steps) is longer than the run (2 steps)"), out
    assert (files / "w.onnx").exists()


# ------------------------------------------------------------------------------ data-parallel, resuming

COMBINED = {"kind": "cosine", "warmup": 3, "min_lr": 1e-3, "clip": 0.5}


def _two_processes(tmp_path, model, optimizer, *extra):
    from pathlib import Path

    import torch.distributed.run  # noqa: F401  (in the test extra)
    from kit.distributed import TORCHRUN, run_command

    worker = Path(__file__).resolve().parent / "combinations_worker.py"
    run_command([*TORCHRUN, "--standalone", "--nproc-per-node=2", str(worker), "--model", model, "--optimizer",
                 optimizer, "--out", str(tmp_path), *extra])
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]


def _one_process(model, optimizer, accumulate=1, **how):
    import combinations_worker  # noqa: F401 (registers the models)
    from distributed_worker import schedule_options, trainer

    tr, data = trainer(model, optimizer, 97, False, **schedule_options(**how))
    tr.fit(data, 2, 16 // accumulate, seed=3, progress=False, accumulate_steps=accumulate)
    return tr


def _same(ranks, ref):
    for name, value in {**ref.parameters, **ref.state}.items():
        np.testing.assert_array_equal(ranks[1][name], ranks[0][name], err_msg=name)
        np.testing.assert_allclose(ranks[0][name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    np.testing.assert_allclose(ranks[0]["losses"], ref.losses, rtol=2e-5, atol=1e-6)


def test_two_processes_causal_lm_padding_accumulation_cosine_clipping_equal_one(tmp_path):
    """causal-lm on padded input ids (``ignore_index=0``: the ranks count different numbers of tokens) with 2
    accumulated micro-batches, a cosine schedule with warmup and clipping: 2 processes x batch 4 x 2 = 1 process x
    batch 16 (the last step of each epoch, 1 sample, leaves rank 1 and a micro-batch empty)."""
    ranks = _two_processes(tmp_path, "lmpad", "adam", "--batch-size", "4", "--accumulate-steps", "2",
                           "--lr-schedule", "cosine", "--warmup-steps", "3", "--min-lr", "0.001",
                           "--clip-grad-norm", "0.5")
    ref = _one_process("lmpad", "adam", **COMBINED)
    assert ref.steps == 14 and ref.spec.loss.settings["ignore_index"] == 0
    unclipped = _one_process("lmpad", "adam", **{**COMBINED, "clip": None})
    assert not np.allclose(unclipped.losses, ref.losses, rtol=1e-3)  # the clipping is in the comparison
    _same(ranks, ref)
    accumulated = _one_process("lmpad", "adam", accumulate=4, **COMBINED)  # one process, 4 x 4 = 16 too
    for name, value in ref.parameters.items():
        np.testing.assert_allclose(accumulated.parameters[name], value, rtol=2e-5, atol=2e-6, err_msg=name)


def test_two_processes_output_loss_equal_one(tmp_path):
    """``--loss output:loss`` (the model's own mean over its share of the batch) data-parallel, scheduled and
    clipped: the ranks' losses weighted by their samples are the global batch's mean, also at the last step of
    each epoch where rank 1 has no sample (its own ReduceMean over nothing is NaN)."""
    ranks = _two_processes(tmp_path, "own", "sgd", "--lr-schedule", "linear", "--warmup-steps", "2",
                           "--clip-grad-norm", "0.5")
    ref = _one_process("own", "sgd", kind="linear", warmup=2, clip=0.5)
    assert ref.spec.labels is None and ref.steps == 14
    _same(ranks, ref)


def test_two_processes_fp16_accumulation_clipping_schedule_equal_one(tmp_path):
    """fp16 loss scaling (overflowing: skips and scale changes) with 2 accumulated micro-batches, clipping and a
    cosine schedule: 2 processes x batch 2 x 2 = 1 process x batch 8, the non-finite check and the clipping
    after the all-reduce of the accumulated gradients; the same scale, good-step count, step and parameters."""
    from pathlib import Path

    import torch.distributed.run  # noqa: F401  (in the test extra)
    from combinations_worker import scaled_trainer
    from kit.distributed import ENV, TORCHRUN, run_command

    worker = Path(__file__).resolve().parent / "combinations_worker.py"
    run_command([*TORCHRUN, "--standalone", "--nproc-per-node=2", str(worker), "--fp16", "--out", str(tmp_path)],
                env=ENV)
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    one, data = scaled_trainer(False)
    one.fit(data, 2, 8, seed=3, progress=False)
    s = one.spec.scaling
    carried = one._engine.read([s.scale, s.growth, one.spec.step])
    assert float(carried[s.scale]) < 2.0 ** 127 and int(carried[one.spec.step]) < 12  # skips happened
    for name, value in {**one.parameters, **one.state, **carried}.items():
        np.testing.assert_array_equal(ranks[1][name], ranks[0][name], err_msg=name)
        np.testing.assert_allclose(ranks[0][name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    np.testing.assert_allclose(ranks[0]["losses"], one.losses, rtol=2e-5, atol=1e-6)


def test_static_inputs_with_a_schedule_resumed_mid_run_equal_the_uninterrupted_run(tmp_path):
    """Static inputs (a mixing matrix and a scalar gain fed whole to every step) with a cosine schedule, warmup and
    clipping: a run that dies at step 9 and resumes from its checkpoint (every 4 steps, so it repeats step 8) ends
    bitwise equal to the uninterrupted run (the statics are not in the checkpoint: they are given again)."""
    from kit import lossdata_models

    from revgraph.train import snapshots as checkpoints

    data, static = lossdata_models.static_data(40)

    def run(**fit):
        opt = adam(lr=0.02, weight_decay=0.01)
        tr = rg.Trainer(lossdata_models.static_model(), "cross-entropy", opt, threads=1, clip_grad_norm=0.5,
                        schedule=Schedule("cosine", warmup_steps=3, min_lr=1e-3))
        return tr, dict(epochs=3, batch_size=8, seed=5, progress=False, static=static, **fit)

    ref, how = run()
    ref.fit(data, **how)
    assert ref.steps == 15
    crashing, how = run(checkpoint_dir=tmp_path, checkpoint_every=4)
    crash_after(crashing, 9)
    with pytest.raises(KeyboardInterrupt):
        crashing.fit(data, **how)
    arrays, meta = checkpoints.load(tmp_path)
    assert meta["hyperparameters"]["total_steps"] == 15
    assert int(arrays[crashing.spec.step]) == 8 and int(arrays[crashing.spec.total]) == 15
    assert not set(static) & set(arrays)
    resumed, how = run(checkpoint_dir=tmp_path, checkpoint_every=4)
    resumed.fit(data, **how)
    assert resumed.resumed and resumed.steps == 15 and resumed.losses == ref.losses[8:]  # (after the snapshot's)
    for name, value in {**ref.parameters, **ref.state}.items():
        np.testing.assert_array_equal({**resumed.parameters, **resumed.state}[name], value, err_msg=name)


# ------------------------------------------------------------------------------ the saved graph of a schedule

def test_web_example_feeds_a_scheduled_graph_its_total_steps(tmp_path):
    """``--save-training-graph`` with a cosine schedule writes the extra int64 input ``total_steps``;
    examples/web/prepare.py feeds it the page's number of steps (not 0, which ends the decay at once), and the
    graph run on those feeds (Python onnxruntime, what the page runs) equals PyTorch's Adam + LambdaLR(cosine
    with warmup) + clip_grad_norm_ on the same batches. (tests/test_web.py runs it in Chromium, slow.)"""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "web" / "prepare.py"
    spec = importlib.util.spec_from_file_location("web_prepare", path)
    web = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(web)
    steps, warmup, lr, min_lr, clip = 12, 3, 0.003, 1e-4, 0.05
    web.prepare(tmp_path, steps=steps, batch_size=16, lr=lr, schedule=("cosine", warmup, min_lr), clip=clip)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert ["total_steps", "total_steps.new"] in manifest["carried"]
    state_blob, batch_blob = (tmp_path / "state.bin").read_bytes(), (tmp_path / "batches.bin").read_bytes()
    assert int(web._view(state_blob, manifest["state"]["total_steps"])) == steps
    ours = web.python_losses(tmp_path)

    P = {k: torch.tensor(web._view(state_blob, manifest["state"][k]), requires_grad=True)
         for k in ("W1", "b1", "W2", "b2")}
    opt = torch.optim.Adam(P.values(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, hf_lambda("cosine", warmup, steps, min_lr / lr))
    theirs, norms = [], []
    for entries in manifest["batches"]:
        x, y = (torch.from_numpy(web._view(batch_blob, entries[k])) for k in ("x", "labels"))
        logits = torch.relu(x.flatten(1) @ P["W1"] + P["b1"]) @ P["W2"] + P["b2"]
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(P.values()), clip)))
        opt.step()
        sched.step()
        theirs.append(loss.item())
    assert sum(n > clip for n in norms) >= steps // 2  # the clipping is in the comparison
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-6)
