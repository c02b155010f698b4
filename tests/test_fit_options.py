"""Issue 38, item 3 and the callbacks of item 4: ``fit(max_steps=, shuffle=False, eval_data=, eval_every=,
eval_batch_size=, callbacks=)`` and ``revgraph train --max-steps/--no-shuffle/--eval-data/--eval-every`` against
PyTorch: the same steps on the same batches, the scheduled learning rate of ``transformers``' cosine schedule, and
evaluations equal to the loss of the parameters at that step computed in PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.training import F32, assert_params_close, mlp, torch_mlp

import revgraph as rg
from revgraph import train as T
from revgraph.cli import main
from revgraph.errors import InputError


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (22, 6)).astype(F32)
    y = rng.integers(0, 3, 22)
    return mlp(rng), x, y


def _torch_run(model, x, y, batch, steps, lr=0.01, schedule=None, every=None, clip=None, norms=None):
    """Adam on consecutive batches of ``batch`` (epochs wrap around, the last batch of an epoch shorter), as
    ``fit(shuffle=False)`` orders them; the learning rate of each step (``schedule``: a ``LambdaLR`` factor);
    the mean cross-entropy over the whole set after every ``every`` steps and at the end."""
    P = {k: torch.tensor(np.asarray(v), requires_grad=True) for k, v in model.initializers.items()}
    opt = torch.optim.Adam(list(P.values()), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    starts = list(range(0, len(x), batch))
    losses, lrs, evals = [], [], {}
    for k in range(steps):
        s = starts[k % len(starts)]
        xb, yb = torch.tensor(x[s:s + batch]), torch.tensor(y[s:s + batch])
        opt.zero_grad()
        loss = F.cross_entropy(torch_mlp(P, xb), yb)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(P.values()), clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched:
            sched.step()
        losses.append(float(loss))
        if (every and (k + 1) % every == 0) or k + 1 == steps:
            with torch.no_grad():
                evals[k + 1] = float(F.cross_entropy(torch_mlp(P, torch.tensor(x)), torch.tensor(y)))
    return {k: v.detach().numpy() for k, v in P.items()}, losses, lrs, evals


def test_max_steps_no_shuffle_and_records_follow_torch(problem):
    """7 steps of batch 5 over 22 samples (epochs of 5 steps, the 5th of 2 samples): the steps cross an epoch and
    stop inside the second; with a cosine schedule over the 7 steps (transformers' formula) and evaluation every
    3 steps, every record (step, epoch, loss, lr, samples, evaluation) equals PyTorch's run."""
    from transformers import get_cosine_schedule_with_warmup

    model, x, y = problem
    sched = T.Schedule("cosine", warmup_steps=2)
    trainer = rg.Trainer(model, "cross-entropy", T.adam(lr=0.01, schedule=sched, no_decay="none"))
    records = []
    means = trainer.fit({"x": x, "labels": y}, batch_size=5, shuffle=False, max_steps=7, progress=False,
                        eval_data={"x": x, "labels": y}, eval_every=3, eval_batch_size=4, callbacks=[records.append])
    probe = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.01)  # (to read transformers' factor)
    factor = get_cosine_schedule_with_warmup(probe, 2, 7).lr_lambdas[0]
    ref_params, ref_losses, ref_lrs, ref_evals = _torch_run(model, x, y, 5, 7, schedule=factor, every=3)
    assert trainer.steps == 7 and [r["step"] for r in records] == list(range(1, 8))
    assert [r["epoch"] for r in records] == [1] * 5 + [2] * 2
    assert [r["samples"] for r in records] == [5, 5, 5, 5, 2, 5, 5]
    np.testing.assert_allclose([r["loss"] for r in records], ref_losses, rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in records], trainer.losses, rtol=0)
    np.testing.assert_allclose([r["lr"] for r in records], ref_lrs, rtol=1e-12, atol=1e-15)
    evaluated = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evaluated) == [3, 6, 7]
    np.testing.assert_allclose([evaluated[k] for k in sorted(evaluated)], [ref_evals[k] for k in sorted(evaluated)],
                               rtol=1e-5)
    assert all(r["grad_norm"] is None and r["samples_per_s"] > 0 for r in records)  # (no clipping)
    assert_params_close(trainer.parameters, ref_params, rtol=1e-5)
    # the epoch means: the first epoch whole, the second over its two batches trained
    first = (sum(ref_losses[k] * n for k, n in zip(range(5), [5, 5, 5, 5, 2], strict=True))) / 22
    np.testing.assert_allclose(means, [first, (ref_losses[5] + ref_losses[6]) / 2], rtol=1e-5)


@pytest.mark.parametrize("buffers", ["one", "two"])
def test_the_record_holds_the_gradient_norm_before_clipping(problem, buffers):
    """With clip_grad_norm, each record's grad_norm is what torch.nn.utils.clip_grad_norm_ returns for that step
    (the norm before clipping), and the steps are PyTorch's clipped ones; without clipping it is None."""
    model, x, y = problem
    trainer = rg.Trainer(model, "cross-entropy", T.adam(lr=0.01, no_decay="none"), clip_grad_norm=0.3,
                         buffers=buffers)
    records = []
    trainer.fit({"x": x, "labels": y}, batch_size=5, shuffle=False, max_steps=6, progress=False,
                callbacks=[records.append])
    norms = []
    params, losses, _, _ = _torch_run(model, x, y, 5, 6, clip=0.3, norms=norms)
    assert min(norms) > 0.3  # (every step is clipped: the norm is not the threshold's)
    np.testing.assert_allclose([r["grad_norm"] for r in records], norms, rtol=1e-5)
    np.testing.assert_allclose(trainer.losses, losses, rtol=1e-5)
    assert_params_close(trainer.parameters, params, rtol=1e-5)
    plain = []
    rg.Trainer(model, "cross-entropy", "adam").fit({"x": x, "labels": y}, batch_size=5, max_steps=2, progress=False,
                                                  callbacks=[plain.append])
    assert [r["grad_norm"] for r in plain] == [None, None]


def test_max_steps_resumes_where_the_uninterrupted_run_stops(problem, tmp_path):
    """A run of max_steps 4 snapshotted, then the same run with max_steps 9 from the snapshot: the parameters of
    one uninterrupted run of 9 steps (shuffled, constant rate)."""
    model, x, y = problem
    data = {"x": x, "labels": y}
    opt = T.adam(lr=0.01, no_decay="none")
    whole = rg.Trainer(model, "cross-entropy", opt)
    whole.fit(data, batch_size=5, max_steps=9, progress=False)
    first = rg.Trainer(model, "cross-entropy", opt)
    first.fit(data, batch_size=5, max_steps=4, progress=False, snapshot_dir=tmp_path / "s")
    second = rg.Trainer(model, "cross-entropy", opt)
    second.fit(data, batch_size=5, max_steps=9, progress=False, snapshot_dir=tmp_path / "s")
    assert second.steps == 9 and second.resumed
    assert_params_close(second.parameters, whole.parameters, rtol=1e-6)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"epochs": 2, "max_steps": 3}, "not both"),
    ({"max_steps": 0}, "max_steps"),
    ({"eval_every": 2}, "eval_data"),
    ({"callbacks": [3]}, "callbacks must be callables"),
])
def test_fit_refuses_bad_run_options_in_one_line(problem, kwargs, message):
    model, x, y = problem
    trainer = rg.Trainer(model, "cross-entropy", "adam")
    with pytest.raises(rg.RevgraphError, match=message) as info:
        trainer.fit({"x": x, "labels": y}, batch_size=4, progress=False, **kwargs)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, InputError | rg.RevgraphError) and trainer.steps == 0


def test_cli_max_steps_no_shuffle_and_eval_data(problem, tmp_path, capsys):
    """``revgraph train --max-steps 7 --no-shuffle --eval-data --eval-every 3`` trains PyTorch's 7 steps and
    prints each evaluation and the last; the training set is not evaluated unless given as --eval-data."""
    model, x, y = problem
    rg.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=x, labels=y)
    code = main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "cross-entropy",
                 "--lr", "0.01", "--max-steps", "7", "--batch-size", "5", "--no-shuffle", "--eval-data",
                 str(tmp_path / "d.npz"), "--eval-every", "3", "-o", str(tmp_path / "o.onnx")])
    out = capsys.readouterr().out
    assert code == 0, out
    params, _, _, evals = _torch_run(model, x, y, 5, 7, every=3)
    trained = rg.load(tmp_path / "o.onnx")
    assert_params_close({k: trained.initializers[k] for k in params}, params, rtol=1e-5)
    for step in (3, 6):
        assert f"step {step}: eval loss {evals[step]:.4g}" in out
    assert f"eval data: loss {evals[7]:.4g}" in out
    assert "7 steps of adam (2 epochs" in out and "training data" not in out


@pytest.mark.parametrize(("args", "message"), [
    ([], "give the run's length"),
    (["--epochs", "1", "--max-steps", "2"], "not both"),
    (["--epochs", "1", "--eval-every", "2"], "--eval-every has no effect without --eval-data"),
    (["--epochs", "1", "--eval-batch-size", "2"], "--eval-batch-size has no effect"),
    (["--max-steps", "0"], "--max-steps"),
])
def test_cli_run_options_bad_input_exit_2(problem, tmp_path, capsys, args, message):
    model, x, y = problem
    rg.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=x, labels=y)
    code = main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "cross-entropy", *args,
                 "-o", str(tmp_path / "o.onnx")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.onnx").exists()
