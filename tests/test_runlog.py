"""The run's record users look at (issue 38, item 4): ``revgraph.train.runlog``'s writers read back with the
standard readers (json, csv, TensorBoard's event accumulator, an XML parser), and ``revgraph train --log
--tensorboard --loss-curve`` end to end: the logged losses are ``Trainer.fit``'s of the same run, the learning
rate follows the schedule's formula computed here, a resumed run continues its log, bad paths exit 2."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from kit.harness import fill_disk, mount_tmpfs, one_line_error, umount  # (tests/ is on sys.path)
from kit.training import mlp, torch_mlp

import revgraph as rg
from revgraph.cli import main
from revgraph.cli.runlog import run_logs
from revgraph.errors import RevgraphError
from revgraph.train.graphs import make_optimizer
from revgraph.train.runlog import FIELDS, CsvLog, JsonlLog, LossCurve, TensorBoardLog, log_writer
from revgraph.train.schedules import Schedule

F32 = np.float32
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps at 80 columns when not on a terminal


def records(n: int = 6, evals=(3, 6)) -> list[dict]:
    """Records as ``Trainer.fit`` hands them to callbacks: step 4's loss NaN, grad_norm None but at step 2."""
    out = []
    for s in range(1, n + 1):
        r = {"step": s, "epoch": 1 + (s - 1) // 4, "loss": 2.0 / s + 0.1, "lr": 0.001 * s / 3, "grad_norm": None,
             "samples_per_s": 1000.0 + s, "samples": 8 if s % 4 else 5}
        if s == 2:
            r["grad_norm"] = 0.75
        if s == 4:
            r["loss"] = float("nan")
        if s in evals:
            r.update(eval_loss=1.0 / s, eval_accuracy=None if s == 3 else 0.5)
        out.append(r)
    return out


def write(writer, recs) -> None:
    with writer as w:
        for r in recs:
            w(r)


# ---------------------------------------------------------------------------------------------- the writers


def test_jsonl_log_reads_back(tmp_path):
    path = tmp_path / "run.jsonl"
    recs = records()
    write(JsonlLog(path), recs)
    lines = path.read_text().splitlines()
    assert len(lines) == len(recs)
    for line, r in zip(lines, recs, strict=True):
        got = json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
        assert list(got) == list(r)  # the record's keys, in its order, the eval fields only where evaluated
        for k, v in r.items():
            assert got[k] == (None if isinstance(v, float) and math.isnan(v) else v), k


def test_csv_log_reads_back(tmp_path):
    path = tmp_path / "run.csv"
    recs = records()
    write(CsvLog(path), recs)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(path, newline="") as f:
        assert next(csv.reader(f)) == list(FIELDS)
    assert len(rows) == len(recs)
    for row, r in zip(rows, recs, strict=True):
        for k in FIELDS:
            v = r.get(k)
            if v is None:
                assert row[k] == "", k
            elif isinstance(v, float) and math.isnan(v):
                assert math.isnan(float(row[k]))
            else:
                assert type(v)(row[k]) == v, k  # all the digits: the float reads back equal


def test_each_line_is_on_disk_before_the_next_step(tmp_path):
    """Flushed per line: a run that crashes keeps the lines of its steps (read while the writer is open)."""
    for writer, count in ((JsonlLog(tmp_path / "a.jsonl"), lambda t: len(t.splitlines())),
                          (CsvLog(tmp_path / "a.csv"), lambda t: len(t.splitlines()) - 1)):
        for i, r in enumerate(records(3), 1):
            writer(r)
            with open(writer.path) as f:
                assert count(f.read()) == i
        writer.close()
        writer.close()  # (twice: nothing to do)


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_log_continues_from_the_first_step(tmp_path, kind):
    """A resumed run (first step 4) keeps the records of steps 1..3 and replaces the rest, a torn last line
    included; a run from step 1 replaces the file; a file that is not such a log is replaced whole."""
    path = tmp_path / f"run.{kind}"
    cls = JsonlLog if kind == "jsonl" else CsvLog
    first = records(6)
    write(cls(path), first)
    with open(path, "a") as f:
        f.write('{"step": 7, "lo' if kind == "jsonl" else "7,2,0.5")  # a crash in the middle of a line
    resumed = [dict(r, loss=r["loss"] * 10) for r in records(8)[3:]]  # steps 4..8, other losses
    write(cls(path), resumed)
    steps, losses = _read_log(path)
    assert steps == list(range(1, 9))
    np.testing.assert_array_equal(losses[:3], [r["loss"] for r in first[:3]])
    np.testing.assert_array_equal(losses[4:], [r["loss"] for r in resumed[1:]])
    write(cls(path), records(2))  # from step 1 again: replaced
    assert _read_log(path)[0] == [1, 2]
    path.write_text("not a log\nat all\n")
    write(cls(path), records(5)[2:])
    assert _read_log(path)[0] == [3, 4, 5]


def _jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _read_log(path):
    if str(path).endswith(".jsonl"):
        objs = _jsonl(path)
        return [o["step"] for o in objs], [math.nan if o["loss"] is None else o["loss"] for o in objs]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows]


def test_nothing_is_written_before_the_first_record(tmp_path):
    for w in (JsonlLog(tmp_path / "a.jsonl"), CsvLog(tmp_path / "a.csv"), LossCurve(tmp_path / "a.svg"),
              TensorBoardLog(tmp_path / "tb")):
        w.close()
    assert os.listdir(tmp_path) == []


def test_log_writer_picks_the_format_by_suffix(tmp_path):
    assert isinstance(log_writer(tmp_path / "a.jsonl"), JsonlLog)
    assert isinstance(log_writer(tmp_path / "a.CSV"), CsvLog)
    with pytest.raises(RevgraphError, match=r"--log '.*a\.json': give a file ending in \.jsonl .* or \.csv"):
        log_writer(str(tmp_path / "a.json"), "--log")


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """The scalars of ``logdir`` by tag, as TensorBoard reads them (purged steps left out)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_log_reads_back(tmp_path):
    recs = records()
    write(TensorBoardLog(tmp_path / "tb" / "run1"), recs)  # (the directory is made)
    got = _scalars(tmp_path / "tb" / "run1")
    tags = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
            "train/samples_per_s": "samples_per_s", "eval/loss": "eval_loss", "eval/accuracy": "eval_accuracy"}
    assert set(got) == set(tags)
    for tag, key in tags.items():
        want = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        assert [s for s, _ in got[tag]] == [s for s, _ in want], tag
        np.testing.assert_array_equal([v for _, v in got[tag]], np.array([v for _, v in want], F32), err_msg=tag)


def test_tensorboard_hides_the_steps_a_resumed_run_writes_again(tmp_path):
    """``purge_step``: a second writer from step 4 replaces steps 4.. of the first in what TensorBoard shows."""
    write(TensorBoardLog(tmp_path), records(6))
    write(TensorBoardLog(tmp_path), [dict(r, loss=100.0 + r["step"]) for r in records(5)[3:]])
    loss = _scalars(tmp_path)["train/loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5]
    assert [v for _, v in loss][3:] == [104.0, 105.0]
    np.testing.assert_array_equal([v for _, v in loss][:3], np.array([r["loss"] for r in records(3)], F32))


def test_tensorboard_without_tensorboardx(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # (an import of it raises ImportError)
    with pytest.raises(RevgraphError, match=r'pip install "revgraph\[tensorboard\]"'):
        TensorBoardLog(tmp_path)
    m, d = _model_and_data(tmp_path)
    code = main(["train", m, "--data", d, "--loss", "cross-entropy", "--epochs", "1", "-o", str(tmp_path / "t.onnx"),
                 "--tensorboard", str(tmp_path / "tb")])
    one_line_error(code, capsys.readouterr().err, "--tensorboard", 'pip install "revgraph[tensorboard]"')
    assert not (tmp_path / "t.onnx").exists()


def _polylines(path) -> list[list[tuple[float, float]]]:
    root = ET.parse(path).getroot()
    return [[tuple(map(float, p.split(","))) for p in line.get("points").split()]
            for line in root.iter(f"{SVG}polyline")]


def test_loss_curve_is_svg_with_one_polyline_per_curve(tmp_path):
    curve = LossCurve(tmp_path / "c.svg", "a <title> & more")
    write(curve, records(6))
    root = ET.parse(tmp_path / "c.svg").getroot()
    assert root.tag == f"{SVG}svg"
    assert "a <title> & more" in [t.text for t in root.iter(f"{SVG}text")]
    train, evals = _polylines(tmp_path / "c.svg")
    assert len(train) == 5  # 6 steps, the NaN loss of step 4 left out
    assert [x for x, _ in train] == sorted(x for x, _ in train)
    # the y of a point falls as the loss rises (SVG's y axis points down): the order of the finite losses
    finite = [r["loss"] for r in records(6) if not math.isnan(r["loss"])]
    assert np.argsort([-y for _, y in train]).tolist() == np.argsort(finite).tolist()
    assert len(evals) == 2 and len(list(root.iter(f"{SVG}circle"))) == 2
    only_train = LossCurve(tmp_path / "d.svg")
    write(only_train, records(3, evals=()))
    assert len(_polylines(tmp_path / "d.svg")) == 1


@pytest.mark.parametrize("cls", [JsonlLog, CsvLog])
def test_a_resumed_loss_curve_gets_the_earlier_steps_from_the_log(tmp_path, cls):
    """A resumed run's curve gets steps 1..3 (and their evaluation) from the log file it continues: the
    snapshot holds no per-step losses; the log's later records (a crashed attempt's) are not drawn."""
    path = tmp_path / f"r.{'jsonl' if cls is JsonlLog else 'csv'}"
    write(cls(path), [dict(r, loss=v) for r, v in zip(records(5, evals=(2,)), [3.0, 2.0, 1.5, 9.0, 9.0],
                                                          strict=True)])
    log, curve = cls(path), LossCurve(tmp_path / "c.svg")
    for r in records(6, evals=())[3:]:  # steps 4..6 of this run
        log(dict(r, loss=1.0))
        curve(dict(r, loss=1.0))
    log.close()
    curve.prepend(log.kept)
    curve.close()
    assert [s for s, _ in curve.train] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in curve.train] == [3.0, 2.0, 1.5, 1.0, 1.0, 1.0]
    assert [s for s, _ in curve.eval] == [2]
    assert len(_polylines(tmp_path / "c.svg")[0]) == 6


def test_the_writers_are_closed_when_training_stops_with_an_error(tmp_path):
    """``run_logs`` closes every writer when ``fit`` raises (the SVG of the steps so far is written) and lets
    the training's error through."""
    import argparse

    args = argparse.Namespace(log=str(tmp_path / "r.jsonl"), tensorboard=None, loss_curve=str(tmp_path / "c.svg"),
                              model="m.onnx", loss="mse")
    trainer = argparse.Namespace(is_main=True, losses=[1.0, 0.5])
    with pytest.raises(KeyboardInterrupt), run_logs(args, trainer) as logs:
        for r in records(2, evals=()):
            for w in logs:
                w(r)
        raise KeyboardInterrupt
    assert len(_polylines(tmp_path / "c.svg")[0]) == 2
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2
    trainer.is_main = False  # another rank writes nothing
    with run_logs(args, trainer) as logs:
        assert logs == []


# ------------------------------------------------------------------------------------- revgraph train, end to end


def _model_and_data(tmp_path, n: int = 44):
    rng = np.random.default_rng(0)
    rg.save(mlp(rng), tmp_path / "model.onnx")
    np.savez(tmp_path / "data.npz", x=rng.normal(0, 1, (n, 6)).astype(F32), labels=rng.integers(0, 3, n))
    return str(tmp_path / "model.onnx"), str(tmp_path / "data.npz")


def test_train_log_is_the_runs_record(tmp_path, capsys):
    """``--log x.jsonl`` and the same run in the API: the logged losses are ``trainer.losses`` of the same run
    (steps 1..N), the learning rate is the linear schedule with warmup computed here, the samples those of each
    batch (44 samples in batches of 8: 8, 8, 8, 8, 8, 4 per epoch), the last evaluation's loss and accuracy those
    of the trained model computed in PyTorch; the CSV holds the same; the SVG has the N losses and the evals."""
    m, d = _model_and_data(tmp_path)
    lr, warmup, epochs, batch = 0.01, 3, 2, 8
    common = ["--loss", "cross-entropy", "--lr", str(lr), "--lr-schedule", "linear", "--warmup-steps", str(warmup),
              "--epochs", str(epochs), "--batch-size", str(batch), "--eval-data", d, "--eval-every", "5"]
    argv = ["train", m, "--data", d, *common, "-o", str(tmp_path / "t.onnx")]
    assert main([*argv, "--log", str(tmp_path / "x.jsonl"), "--loss-curve", str(tmp_path / "c.svg")]) == 0
    assert main([*argv, "--log", str(tmp_path / "x.csv")]) == 0
    capsys.readouterr()
    logged = _jsonl(tmp_path / "x.jsonl")

    trainer = rg.Trainer(rg.load(m), "cross-entropy",
                         make_optimizer("adam", lr=lr, schedule=Schedule("linear", warmup)))
    trainer.fit(dict(np.load(d)), epochs, batch, progress=False)
    steps = epochs * 6
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    assert [r["loss"] for r in logged] == trainer.losses
    assert [r["epoch"] for r in logged] == [1] * 6 + [2] * 6
    assert [r["samples"] for r in logged] == [8, 8, 8, 8, 8, 4] * 2
    # transformers' get_linear_schedule_with_warmup at the step counter s = step - 1
    want = [lr * (s / warmup if s < warmup else max(0.0, (steps - s) / (steps - warmup))) for s in range(steps)]
    np.testing.assert_allclose([r["lr"] for r in logged], want, rtol=1e-12, atol=0)
    assert all(r["grad_norm"] is None and r["samples_per_s"] > 0 for r in logged)
    assert [r["step"] for r in logged if "eval_loss" in r] == [5, 10, 12]  # every 5 steps and at the end
    params = {k: torch.tensor(v) for k, v in rg.load(tmp_path / "t.onnx").initializers.items()}
    data = np.load(d)
    logits = torch_mlp(params, torch.tensor(data["x"]))
    labels = torch.tensor(data["labels"])
    np.testing.assert_allclose(logged[-1]["eval_loss"], torch.nn.functional.cross_entropy(logits, labels).item(),
                               rtol=1e-5)
    assert logged[-1]["eval_accuracy"] == pytest.approx((logits.argmax(1) == labels).double().mean().item())

    with open(tmp_path / "x.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss"]) for r in rows] == trainer.losses  # (the same run again: deterministic)
    assert [r["grad_norm"] for r in rows] == [""] * steps
    assert [r["eval_loss"] != "" for r in rows] == [s in (5, 10, 12) for s in range(1, steps + 1)]
    train, evals = _polylines(tmp_path / "c.svg")
    assert len(train) == steps and len(evals) == 3


def test_a_resumed_run_continues_its_log(tmp_path, capsys):
    """One epoch with a snapshot, then two from it: the log holds steps 1..12 once, the lines a crashed attempt
    wrote after the snapshot replaced, with the losses of an uninterrupted run; the loss curve has all 12."""
    m, d = _model_and_data(tmp_path)
    log, snap = tmp_path / "x.jsonl", str(tmp_path / "snap")
    argv = ["train", m, "--data", d, "--loss", "cross-entropy", "--batch-size", "8", "-o", str(tmp_path / "t.onnx"),
            "--snapshot-dir", snap, "--log", str(log)]
    assert main([*argv, "--epochs", "1"]) == 0
    with open(log, "a") as f:  # what an attempt that crashed after the snapshot wrote
        f.write('{"step": 7, "epoch": 2, "loss": 99.0}\n{"step": 8, "ep')
    assert main([*argv, "--epochs", "2", "--loss-curve", str(tmp_path / "c.svg")]) == 0
    assert "resumed from" in capsys.readouterr().out
    logged = _jsonl(log)
    trainer = rg.Trainer(rg.load(m), "cross-entropy", make_optimizer("adam"))
    trainer.fit(dict(np.load(d)), 2, 8, progress=False)
    assert [r["step"] for r in logged] == list(range(1, 13))
    assert [r["loss"] for r in logged] == trainer.losses
    assert len(_polylines(tmp_path / "c.svg")[0]) == 12


def test_bad_log_paths_exit_2_before_training(tmp_path, capsys):
    m, d = _model_and_data(tmp_path)
    (tmp_path / "adir.jsonl").mkdir()
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "data.npz", tmp_path / "data.jsonl")
    (tmp_path / "c.svg").write_text("mine")
    os.symlink(tmp_path / "c.svg", tmp_path / "c.csv")
    os.symlink(m, tmp_path / "model.svg")
    out = str(tmp_path / "t.onnx")
    base = ["train", m, "--data", d, "--loss", "cross-entropy", "--epochs", "1", "-o", out]
    cases = [
        (["--log", str(tmp_path / "x.txt")], ("--log", "x.txt", ".jsonl", ".csv")),
        (["--log", str(tmp_path / "adir.jsonl")], ("--log", "adir.jsonl", "directory")),
        (["--log", str(tmp_path / "missing" / "x.jsonl")], ("--log", "does not exist")),
        (["--log", str(tmp_path / "data.jsonl")], ("--log", "same file as --data")),
        (["--log", str(tmp_path / "c.csv"), "--loss-curve", str(tmp_path / "c.svg")], ("--loss-curve", "--log")),
        (["--loss-curve", str(tmp_path / "c.png")], ("--loss-curve", "c.png", ".svg")),
        (["--loss-curve", str(tmp_path / "model.svg")], ("--loss-curve", "same file as the model")),
        (["--tensorboard", str(tmp_path / "file")], ("--tensorboard", "not a directory")),
        (["--tensorboard", d], ("--tensorboard", "--data")),
        (["--tensorboard", str(tmp_path / "file" / "tb")], ("--tensorboard", "not a writable directory")),
    ]
    for extra, fragments in cases:
        one_line_error(main([*base, *extra]), capsys.readouterr().err, *fragments)
        assert not os.path.exists(out), extra
    assert (tmp_path / "data.jsonl").resolve().read_bytes()[:2] == b"PK"  # the data is untouched
    assert (tmp_path / "c.svg").read_text() == "mine"


def test_a_data_parallel_run_is_logged_once_by_rank_0(tmp_path, capsys):
    """``--nproc 2 --batch-size 4 --clip-grad-norm 0.5``: one line per step (rank 0 writes, the other rank
    nothing), the global batch's sample count, and the losses and gradient norms (of the all-reduced gradients,
    before clipping) of one process at ``--batch-size 8`` (the same global batches)."""
    m, d = _model_and_data(tmp_path, n=40)
    base = ["train", m, "--data", d, "--loss", "cross-entropy", "--epochs", "1", "--clip-grad-norm", "0.5",
            "-o", str(tmp_path / "t.onnx")]
    assert main([*base, "--batch-size", "4", "--nproc", "2", "--log", str(tmp_path / "dp.jsonl")]) == 0
    capsys.readouterr()
    logged = _jsonl(tmp_path / "dp.jsonl")
    trainer = rg.Trainer(rg.load(m), "cross-entropy", make_optimizer("adam", clip_grad_norm=0.5))
    records = []
    trainer.fit(dict(np.load(d)), 1, 8, progress=False, callbacks=[records.append])
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    assert [r["samples"] for r in logged] == [8] * 5
    np.testing.assert_allclose([r["loss"] for r in logged], trainer.losses, rtol=1e-6)
    assert all(r["grad_norm"] > 0 for r in records)
    np.testing.assert_allclose([r["grad_norm"] for r in logged], [r["grad_norm"] for r in records], rtol=1e-5)


@pytest.mark.parametrize("option", ["--log", "--loss-curve"])
def test_a_full_disk_stops_the_run_in_one_line(tmp_path, capsys, option):
    """A log line or the SVG that cannot be written: one line naming the file, exit 2 (the log at its first
    step, the curve when training ends); the SVG's temporary file removed."""
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt):
        pytest.skip("needs root to mount a tmpfs")
    try:
        m, d = _model_and_data(tmp_path)
        fill_disk(mnt)
        target = mnt / ("x.jsonl" if option == "--log" else "c.svg")
        code = main(["train", m, "--data", d, "--loss", "cross-entropy", "--epochs", "1", "-o",
                     str(tmp_path / "t.onnx"), option, str(target)])
        one_line_error(code, capsys.readouterr().err, "no space left on the device writing", target.name)
        assert sorted(os.listdir(mnt)) == (["filler", "x.jsonl"] if option == "--log" else ["filler"])
    finally:
        umount(mnt)
