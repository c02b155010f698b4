"""A training snapshot (``--checkpoint-dir``: checkpoint.npz and its JSON metadata) is untrusted input
(issue 28, part 1; revgraph.train.snapshot_checks).

One real snapshot of a one-process run (an MLP with Adam, 24 samples in batches of 8: 3 steps an epoch, saved
every 2 steps, killed before step 5: epoch 1, batch 1, 4 steps) is damaged field by field and kind by kind:
every metadata field with a wrong type, out of range, inconsistent with the run, missing; an unknown field and
member; the archive truncated, a bit flipped, a member missing, twice, of another shape or dtype, pickled,
declaring more than it holds; NaN in a parameter, a negative second moment, a step counter that disagrees.
Each is refused before any step through the Python API (``RevgraphError`` naming the file and the field) and
the command line (exit 2, one line), with nothing written and the snapshot left as it was. The snapshot
undamaged (and the changes a snapshot may legitimately carry) resumes to exactly the uninterrupted run.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from kit.harness import crash_after, one_line_error  # (tests/ is on sys.path)
from kit.training import mlp

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.train import snapshots as checkpoints

F32 = np.float32
N, BATCH, EPOCHS = 24, 8, 3
SRC = Path(__file__).resolve().parent.parent / "src"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def _data():
    rng = np.random.default_rng(5)
    return {"x": rng.normal(0, 1, (N, 6)).astype(F32), "labels": rng.integers(0, 3, N)}


def _trainer() -> rg.Trainer:
    return rg.Trainer(mlp(np.random.default_rng(3)), "cross-entropy", "adam", threads=1)


def _fit(tr, ck, **how):
    return tr.fit(_data(), EPOCHS, BATCH, progress=False, checkpoint_dir=ck, checkpoint_every=2, **how)


_LOSSES: list[float] = []


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The snapshot's bytes, the files the CLI reads, and the uninterrupted run (parameters, state, means)."""
    root = tmp_path_factory.mktemp("snapshot")
    crashing = _trainer()
    crash_after(crashing, 4)
    with pytest.raises(KeyboardInterrupt):
        _fit(crashing, root / "ck")
    ref = _trainer()
    means = ref.fit(_data(), EPOCHS, BATCH, progress=False)
    rg.save(mlp(np.random.default_rng(3)), root / "m.onnx")
    d = _data()
    np.savez(root / "d.npz", x=d["x"], y=d["labels"])
    _LOSSES[:] = ref.losses  # (the crashed run's first 4 are the same: for snapshots in the older form, _old)
    return {"root": root, "bytes": checkpoints.path_in(root / "ck").read_bytes(),
            "ref": {**ref.parameters, **ref.state}, "means": means, "losses": list(ref.losses)}


def _copy(base, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    ck.mkdir()
    checkpoints.path_in(ck).write_bytes(base["bytes"])
    for f in ("m.onnx", "d.npz"):
        shutil.copy(base["root"] / f, tmp_path / f)
    return ck


def _cli_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "cross-entropy",
            "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--threads", "1", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path / "ck"), "-o", str(tmp_path / "t.onnx"), *extra]


# ------------------------------------------------------------------------------------------ writing damage

def _members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def _npy(a) -> bytes:
    f = io.BytesIO()
    np.save(f, a, allow_pickle=True)
    return f.getvalue()


def _zip(members: list[tuple[str, bytes]], method=zipfile.ZIP_STORED) -> bytes:
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w", method) as z:
        for name, data in members:
            z.writestr(name, data)
    return f.getvalue()


def _arrays(data: bytes) -> tuple[dict, dict]:
    m = _members(data)
    meta = json.loads(str(np.load(io.BytesIO(m["meta.npy"]))))
    return {n: np.load(io.BytesIO(m[f"a{i}.npy"])) for i, n in enumerate(meta["names"])}, meta


def _meta(change):
    """Damage that edits the metadata (a dict, in place) and rewrites the file as the writer would."""
    def apply(data: bytes) -> bytes:
        arrays, meta = _arrays(data)
        names = list(meta["names"])
        change(meta)
        return _zip([("meta.npy", _npy(np.array(json.dumps(meta)))),
                     *((f"a{i}.npy", _npy(arrays[n])) for i, n in enumerate(names))])
    return apply


def _old(change=lambda m: None):
    """A snapshot in the form written before issue 38 (the per-step ``losses`` and ``earlier_losses`` instead of
    ``steps_taken``), then ``change`` to its metadata."""
    def convert(meta: dict) -> None:
        taken = meta.pop("steps_taken")
        meta.update(losses=list(_LOSSES[:taken]), earlier_losses=0)
        change(meta)
    return _meta(convert)


def _set(field, value):
    def change(meta):
        meta[field] = value
    return _meta(change)


def _drop(field):
    return _meta(lambda meta: meta.pop(field))


def _hp(field, value):
    def change(meta):
        meta["hyperparameters"][field] = value
    return _meta(change)


def _array(name, change):
    """Damage that replaces the array ``name`` by ``change(array)``."""
    def apply(data: bytes) -> bytes:
        members = _members(data)
        meta = json.loads(str(np.load(io.BytesIO(members["meta.npy"]))))
        k = meta["names"].index(name)
        members[f"a{k}.npy"] = _npy(change(np.load(io.BytesIO(members[f"a{k}.npy"]))))
        return _zip(list(members.items()))
    return apply


def _set_at(a, value, index=(0,)):
    a = a.copy()
    a[index] = value
    return a


def _raw_member(change):
    def apply(data: bytes) -> bytes:
        return _zip(change(list(_members(data).items())))
    return apply


def _flip_in(member):
    """One bit flipped in the stored data of ``member`` (the CRC no longer matches)."""
    def apply(data: bytes) -> bytes:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            info = z.getinfo(member)
        b = bytearray(data)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        b[start + info.file_size - 3] ^= 0x10
        return bytes(b)
    return apply


def _bomb(data: bytes) -> bytes:
    """a0 (W1, 6 x 8 float32) declaring 64 MiB (zeros, deflated to kilobytes)."""
    members = _members(data)
    members["a0.npy"] = members["a0.npy"] + bytes(64 << 20)
    return _zip(list(members.items()), zipfile.ZIP_DEFLATED)


def _npy_v3(data: bytes) -> bytes:
    members = _members(data)
    raw = bytearray(members["a0.npy"])
    raw[6] = 3  # major version 3 (numpy writes 1.0, or 2.0 for huge headers)
    members["a0.npy"] = bytes(raw)
    return _zip(list(members.items()))


def _huge_shape(data: bytes) -> bytes:
    """a0's header declaring [10^6, 10^6] float32 (4 TB) over its 192 bytes of data."""
    members = _members(data)
    raw = members["a0.npy"]
    header = raw[10:10 + int.from_bytes(raw[8:10], "little")].decode("latin1").replace("(6, 8)", "(1000000, 1000000)")
    header = header.rstrip().ljust(len(raw[10:10 + int.from_bytes(raw[8:10], "little")]) - 1) + "\n"
    members["a0.npy"] = raw[:10] + header.encode("latin1") + raw[10 + len(header):]
    return _zip(list(members.items()))


def _long_meta(data: bytes) -> bytes:
    members = _members(data)
    members["meta.npy"] = _npy(np.array("x" * (3 << 20)))
    return _zip(list(members.items()))


def _nested(data: bytes) -> bytes:
    members = _members(data)
    members["meta.npy"] = _npy(np.array("[" * 200000 + "]" * 200000))
    return _zip(list(members.items()))


def _text(text):
    def apply(data: bytes) -> bytes:
        members = _members(data)
        members["meta.npy"] = _npy(np.array(text))
        return _zip(list(members.items()))
    return apply


NAN, INF = float("nan"), float("inf")
READ = "is not a readable revgraph checkpoint"
OTHER = "holds the state of another model or optimizer"

#: id: (damage to the snapshot's bytes, what the one-line refusal says)
DAMAGE = {
    # the archive
    "truncated half": (lambda d: d[:len(d) // 2], READ),
    "truncated to 40 bytes": (lambda d: d[:40], READ),
    "empty file": (lambda d: b"", READ),
    "not a zip": (lambda d: b"not a zip" * 100, READ),
    "bit flipped in a parameter": (_flip_in("a0.npy"), READ),
    "bit flipped in the metadata": (_flip_in("meta.npy"), READ),
    "member meta missing": (_raw_member(lambda ms: [m for m in ms if m[0] != "meta.npy"]), "member 'meta'"),
    "member a3 missing": (_raw_member(lambda ms: [m for m in ms if m[0] != "a3.npy"]), "member 'a3' is missing"),
    "last member missing": (_raw_member(lambda ms: [m for m in ms if m[0] != "a12.npy"]), OTHER),
    "unknown member": (_raw_member(lambda ms: [*ms, ("evil.npy", _npy(np.zeros(3)))]), "member 'evil'"),
    "extra array member": (_raw_member(lambda ms: [*ms, ("a13.npy", _npy(np.zeros(3)))]), OTHER),
    "member twice": (_raw_member(lambda ms: [*ms, ms[1]]), "appears twice"),
    "pickled member": (_raw_member(lambda ms: [(n, _npy(np.array([{"x": 1}], dtype=object)) if n == "a1.npy" else d)
                                               for n, d in ms]), "holds Python objects"),
    "member declares 64 MiB": (_bomb, "member 'a0' ('W1') declares"),
    "member header declares 4 TB": (_huge_shape, "'W1' has shape [1000000, 1000000]"),
    "npy version 3": (_npy_v3, "version (3, 0)"),
    "trailing data in a member": (_raw_member(lambda ms: [(n, d + b"\0" * 8 if n == "a2.npy" else d) for n, d in ms]),
                                  "member 'a2' has data after its array"),
    "metadata 3 M characters": (_long_meta, "declares 3145728 characters"),
    "metadata nested 200000 deep": (_nested, "nests too deeply"),
    "metadata not JSON": (_text("{'epoch': 1"), READ),
    "metadata nested 40 deep": (_set("epoch_means", json.loads("[" * 40 + "1" + "]" * 40)),
                                "the metadata nests deeper than 16 levels"),
    "a lora record nested 5000 deep": (_hp("revgraph.lora", "[" * 5000 + "]" * 5000),
                                       "was written with revgraph.lora '[[[["),
    "metadata a JSON list": (_text("[1, 2]"), "the metadata is a JSON list, not an object"),
    "metadata not a text": (_raw_member(lambda ms: [(n, _npy(np.zeros(3)) if n == "meta.npy" else d) for n, d in ms]),
                            "member 'meta' is float64 [3], not a text"),
    "unknown field": (_set("learning_rate", 0.1), "field 'learning_rate' is not a field"),
    # each field: its type, its range, this run
    "format number": (_set("format", 1), "field 'format' is 1"),
    "format other": (_set("format", "revgraph-checkpoint-9"), "field 'format'"),
    "format missing": (_drop("format"), "field 'format'"),
    "names not a list": (_set("names", "W1"), "field 'names' is 'W1', not a list"),
    "names of numbers": (_set("names", list(range(13))), "field 'names'"),
    "names missing": (_drop("names"), "field 'names' is None"),
    "names repeated": (_meta(lambda m: m["names"].__setitem__(1, "W1")), "field 'names' lists 13 names (12 distinct)"),
    "names permuted": (_meta(lambda m: m["names"].reverse()), OTHER),
    "names renamed": (_meta(lambda m: m["names"].__setitem__(0, "W9")), OTHER),
    "optimizer number": (_set("optimizer", 5), "field 'optimizer' is 5"),
    "optimizer other": (_set("optimizer", "sgd"), OTHER),
    "optimizer missing": (_drop("optimizer"), "field 'optimizer' is missing"),
    "batch_size text": (_set("batch_size", "8"), "field 'batch_size' is '8', not a positive integer"),
    "batch_size true": (_set("batch_size", True), "field 'batch_size' is True"),
    "batch_size 0": (_set("batch_size", 0), "field 'batch_size' is 0"),
    "batch_size and world_size negative": (_meta(lambda m: m.update(batch_size=-8, world_size=-1)),
                                           "field 'batch_size' is -8"),
    "batch_size other": (_set("batch_size", 16), "global batch 1 x 16 = 16 (now 1 x 8 = 8)"),
    "batch_size missing": (_drop("batch_size"), "field 'batch_size' is missing"),
    "world_size float": (_set("world_size", 1.0), "field 'world_size' is 1.0"),
    "world_size 0": (_set("world_size", 0), "field 'world_size' is 0"),
    "world_size other": (_set("world_size", 2), "global batch 2 x 8 = 16 (now 1 x 8 = 8)"),
    "world_size missing": (_drop("world_size"), "field 'world_size' is missing"),
    "seed text": (_set("seed", "0"), "field 'seed' is '0', not an integer"),
    "seed float": (_set("seed", 0.5), "field 'seed' is 0.5"),
    "seed other": (_set("seed", 7), "was written by a run with seed 7 (now 0)"),
    "seed missing": (_drop("seed"), "field 'seed' is missing"),
    "shuffle number": (_set("shuffle", 1), "field 'shuffle' is 1, not true or false"),
    "shuffle other": (_set("shuffle", False), "shuffle False (now True)"),
    "samples negative": (_set("samples", -24), "field 'samples' is -24"),
    "samples other": (_set("samples", 25), "samples 25 (now 24)"),
    "samples missing": (_drop("samples"), "field 'samples' is missing"),
    "accumulate_steps 0": (_set("accumulate_steps", 0), "field 'accumulate_steps' is 0"),
    "accumulate_steps text": (_set("accumulate_steps", "1"), "field 'accumulate_steps' is '1'"),
    "accumulate_steps other": (_set("accumulate_steps", 2), "global batch 1 x 8 x 2 = 16 (now 1 x 8 = 8)"),
    "epoch -3": (_set("epoch", -3), "field 'epoch' is -3, not an integer >= 0"),
    "epoch text": (_set("epoch", "1"), "field 'epoch' is '1'"),
    "epoch float": (_set("epoch", 1.0), "field 'epoch' is 1.0"),
    "epoch past the end": (_set("epoch", 5), "field 'epoch' is 5, past the end of this run (3 epochs)"),
    "epoch past the end, no means": (_meta(lambda m: m.update(epoch=4, batch=0, epoch_loss_sum=0.0, epoch_means=[])),
                                     "field 'epoch' is 4, past the end"),
    "epoch 10^9": (_set("epoch", 10**9), "field 'epoch' is 1000000000, past the end"),
    "epoch without its mean": (_set("epoch", 2), "field 'epoch_means' holds 1 numbers; the epoch (field 'epoch') is 2"),
    "epoch missing": (_drop("epoch"), "field 'epoch' is missing"),
    "batch 10^9": (_set("batch", 10**9), "field 'batch' is 1000000000, not a batch of this run's epochs (0 to 2"),
    "batch -2": (_set("batch", -2), "field 'batch' is -2, not an integer >= 0"),
    "batch 3 (an epoch has 3)": (_set("batch", 3), "field 'batch' is 3"),
    "batch float": (_set("batch", 1.5), "field 'batch' is 1.5"),
    "batch null": (_set("batch", None), "field 'batch' is None"),
    "batch past the steps taken": (_set("batch", 2), "field 'steps_taken' is 4, fewer than the 5 batches"),
    "steps_taken other": (_set("steps_taken", 5), "the step counter 'step' is 4 for 5 steps taken"),
    "steps_taken negative": (_set("steps_taken", -1), "field 'steps_taken' is -1, not an integer >= 0"),
    "steps_taken text": (_set("steps_taken", "4"), "field 'steps_taken' is '4'"),
    "steps_taken missing": (_drop("steps_taken"), "field 'steps_taken' is missing"),
    # a snapshot written before issue 38 (the per-step losses instead of steps_taken), damaged
    "older: batch past the losses": (_old(lambda m: m.update(batch=2)),
                                     "field 'losses' holds 4 losses, fewer than the 5 batches"),
    "batch at the end of the run": (_meta(lambda m: m.update(epoch=3, epoch_means=[1.0, 1.0, 1.0])),
                                    "field 'batch' is 1"),
    "batch missing": (_drop("batch"), "field 'batch' is missing"),
    "epoch_loss_sum text": (_set("epoch_loss_sum", "1.5"), "field 'epoch_loss_sum' is '1.5', not a number"),
    "epoch_loss_sum NaN": (_set("epoch_loss_sum", NAN), "field 'epoch_loss_sum' is not finite"),
    "epoch_loss_sum at batch 0": (_old(lambda m: m.update(batch=0, losses=m["losses"][:3])),
                                  "the losses of the epoch's first 0 batches (field 'losses') give 0.0"),
    "epoch_loss_sum other": (_old(lambda m: m.update(epoch_loss_sum=m["epoch_loss_sum"] * (1 + 1e-15))),
                             "the losses of the epoch's first 1 batches (field 'losses') give"),
    "epoch_means other": (_old(lambda m: m["epoch_means"].__setitem__(0, 1.0)),
                          "field 'epoch_means' gives epoch 1 the mean 1.0; its losses (field 'losses') give 1."),
    "a loss other": (_old(lambda m: m["losses"].__setitem__(0, 0.5)), "field 'epoch_means' gives epoch 1 the mean"),
    "position and means moved back an epoch": (
        _old(lambda m: m.update(epoch=0, epoch_means=[])), "the 0 of earlier fits (field 'earlier_losses') and the 1"),
    "earlier_losses other": (_old(lambda m: m.update(earlier_losses=1)),
                             "field 'losses' holds 4 losses; the 1 of earlier fits"),
    "earlier_losses negative": (_old(lambda m: m.update(earlier_losses=-1)), "field 'earlier_losses' is -1"),
    "earlier_losses text": (_old(lambda m: m.update(earlier_losses="0")), "field 'earlier_losses' is '0'"),
    "epoch_loss_sum missing": (_drop("epoch_loss_sum"), "field 'epoch_loss_sum' is missing"),
    "epoch_means a number": (_set("epoch_means", 5), "field 'epoch_means' is 5, not a list of numbers"),
    "epoch_means of text": (_set("epoch_means", ["1.0"]), "field 'epoch_means'"),
    "epoch_means too long": (_set("epoch_means", [1.0, 1.0]), "field 'epoch_means' holds 2 numbers"),
    "epoch_means infinite": (_set("epoch_means", [INF]), "field 'epoch_means' holds NaN or infinite"),
    "epoch_means missing": (_drop("epoch_means"), "field 'epoch_means' is missing"),
    "losses 5": (_old(lambda m: m.update(losses=5)), "field 'losses' is 5, not a list of numbers"),
    "losses of objects": (_old(lambda m: m.update(losses=[{"a": 1}] * 4)), "field 'losses'"),
    "losses NaN": (_old(lambda m: m["losses"].__setitem__(2, NAN)), "field 'losses' holds NaN or infinite"),
    "losses too few": (_old(lambda m: m["losses"].pop()), "field 'losses' holds 3 losses, fewer than the 4"),
    "losses too many": (_old(lambda m: m["losses"].insert(0, 1.0)), "field 'losses' holds 5 losses; the 0 of"),
    "losses of an earlier fit": (_old(lambda m: (m["losses"].insert(0, 1.0), m.pop("earlier_losses"))),
                                 "the step counter 'step' is 4 for 5 steps taken (field 'losses')"),
    "hyperparameters a list": (_set("hyperparameters", []), "field 'hyperparameters' is [], not an object"),
    "hyperparameters null": (_set("hyperparameters", None), "field 'hyperparameters' is None, not an object"),
    "hyperparameters unknown": (_hp("learning_rate", 0.1), "field 'hyperparameters.learning_rate' is not a recorded"),
    "hyperparameters lr text": (_hp("lr", "0.001"), "field 'hyperparameters.lr' is '0.001', not of its type"),
    "hyperparameters betas number": (_hp("betas", 0.9), "field 'hyperparameters.betas'"),
    "hyperparameters lr other": (_hp("lr", 0.5), "was written with lr 0.5 (now 0.001); resume with the same value"),
    # the arrays
    "parameter of another dtype": (_array("W1", lambda a: a.astype(np.float64)),
                                   ("cannot be resumed: 'W1' has shape [6, 8] and dtype float64; this training run "
                                    "needs shape [6, 8] and dtype float32")),
    "parameter of another shape": (_array("b2", lambda a: np.zeros(4, F32)), "'b2' has shape [4]"),
    "parameter NaN": (_array("W2", lambda a: _set_at(a, np.nan, (1, 1))), "parameter 'W2' holds NaN or infinite"),
    "optimizer state infinite": (_array("b1.m", lambda a: _set_at(a, np.inf)), "optimizer state 'b1.m' holds NaN"),
    "second moment negative": (_array("W1.v", lambda a: _set_at(a, -1.0, (0, 0))),
                               "optimizer state 'W1.v' (Adam's second moment) holds negative values"),
    "step counter int32": (_array("step", lambda a: a.astype(np.int32)), "'step' has shape [] and dtype int32"),
    "step counter a vector": (_array("step", lambda a: np.array([4])), "'step' has shape [1]"),
    "step counter -1": (_array("step", lambda a: np.array(-1)), "the step counter 'step' is -1 for 4 steps taken"),
    "step counter 10^12": (_array("step", lambda a: np.array(10**12)), "the step counter 'step' is 1000000000000"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_snapshot_is_refused_by_the_api(base, tmp_path, damage):
    ck = _copy(base, tmp_path)
    how, said = DAMAGE[damage]
    path = checkpoints.path_in(ck)
    path.write_bytes(how(base["bytes"]))
    before = path.read_bytes()
    tr = _trainer()
    with pytest.raises(rg.RevgraphError) as info:
        _fit(tr, ck)
    text = str(info.value)
    assert "\n" not in text and said in text and str(path) in text, text
    assert tr.steps == 0 and not tr.losses and tr.resumed is None
    assert sorted(os.listdir(ck)) == ["checkpoint.npz"] and path.read_bytes() == before


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_snapshot_is_refused_by_the_cli(base, tmp_path, capsys, damage):
    ck = _copy(base, tmp_path)
    how, said = DAMAGE[damage]
    path = checkpoints.path_in(ck)
    path.write_bytes(how(base["bytes"]))
    before = path.read_bytes()
    code = main(_cli_args(tmp_path))
    err = capsys.readouterr().err
    one_line_error(code, err, said, str(path))
    assert not (tmp_path / "t.onnx").exists() and sorted(os.listdir(ck)) == ["checkpoint.npz"]
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["ck", "d.npz", "m.onnx"]


@pytest.mark.parametrize("example, args", [
    ("truncated half", ()), ("metadata a JSON list", ()), ("losses 5", ()), ("epoch -3", ()),
    ("epoch past the end, no means", ()), ("batch 10^9", ()), ("batch -2", ())])
def test_the_issues_examples_exit_2_in_a_process_of_their_own(base, tmp_path, example, args):
    """Issue 28's reproductions as they were run: ``python -m revgraph train`` (exit 3 before, or an endless
    loop for batch 10^9, or exit 0 after 6 steps instead of 2 with a wrong mean for batch -2)."""
    ck = _copy(base, tmp_path)
    how, said = DAMAGE[example]
    checkpoints.path_in(ck).write_bytes(how(base["bytes"]))
    r = subprocess.run([sys.executable, "-m", "revgraph", *_cli_args(tmp_path, *args)], env=ENV, capture_output=True,
                       text=True, timeout=120)
    one_line_error(r.returncode, r.stderr, said)
    assert not (tmp_path / "t.onnx").exists()


# ------------------------------------------------------------------------------------------ what still resumes

def _resumes_exactly(base, tr, means):
    # (the per-step losses of the steps before the snapshot are not in it: the trainer has those it took)
    assert tr.resumed and tr.steps == 9 and means == base["means"] and tr.losses == base["losses"][4:]
    for name, value in base["ref"].items():
        np.testing.assert_array_equal({**tr.parameters, **tr.state}[name], value, err_msg=name)


ACCEPTED = {  # a change a snapshot may carry, and it still resumes to the uninterrupted run
    "as written": lambda d: d,
    "written by 2 processes x batch 4 (elastic)": _meta(lambda m: m.update(world_size=2, batch_size=4)),
    "without accumulate_steps (older)": _drop("accumulate_steps"),
    "older, with the per-step losses": _old(),
    "older, without earlier_losses": _old(lambda m: m.pop("earlier_losses")),
    "deflated members": lambda d: _zip(list(_members(d).items()), zipfile.ZIP_DEFLATED),
}


@pytest.mark.parametrize("change", ACCEPTED)
def test_a_valid_snapshot_resumes_to_the_uninterrupted_run(base, tmp_path, change):
    ck = _copy(base, tmp_path)
    checkpoints.path_in(ck).write_bytes(ACCEPTED[change](base["bytes"]))
    tr = _trainer()
    means = _fit(tr, ck)
    _resumes_exactly(base, tr, means)


def test_the_cli_resumes_the_snapshot_to_the_uninterrupted_run(base, tmp_path, capsys):
    _copy(base, tmp_path)
    assert main(_cli_args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "(epoch 2, step 4)" in out, out
    trained = rg.load(tmp_path / "t.onnx").initializers
    for name in ("W1", "b1", "W2", "b2"):
        np.testing.assert_array_equal(trained[name], base["ref"][name], err_msg=name)


def test_nonfinite_values_resume_with_allow_nonfinite(base, tmp_path, capsys):
    """NaN in a parameter and in the losses is what a run with ``nonfinite='continue'`` (--allow-nonfinite) may
    save: that run resumes it (and the one that stops at NaN refuses it, above)."""
    ck = _copy(base, tmp_path)
    damaged = _array("W2", lambda a: _set_at(a, np.nan, (1, 1)))(base["bytes"])
    checkpoints.path_in(ck).write_bytes(_old(lambda m: m.update(epoch_loss_sum=NAN) or m["losses"].__setitem__(
        3, NAN))(damaged))  # (the loss of epoch 2's first batch: the sum of that epoch so far is NaN too)
    tr = _trainer()
    means = _fit(tr, ck, nonfinite="continue")
    assert tr.resumed and tr.steps == 9 and np.isnan(tr.parameters["W2"]).any() and np.isnan(means[1])
    checkpoints.path_in(ck).write_bytes(damaged)
    assert main(_cli_args(tmp_path, "--allow-nonfinite")) == 0, capsys.readouterr().err


# ------------------------------------------------------------------------------------------ fp16 and schedules

def _fp16_trainer():
    import warnings

    from revgraph.train import adam
    from revgraph.train.precision import Precision
    from revgraph.train.schedules import Schedule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no product to run in float16)
        # a model with no product: fp16 is then loss scaling alone, which onnxruntime's CPU runs
        model = Graph([Node("Mul", ["x", "w"], ["logits"], name="mul")], [ValueInfo("x", F32, ("N", 6))],
                      [ValueInfo("logits", F32, ("N", 6))], {"w": np.linspace(0.5, 1.5, 6).astype(F32)})
        return rg.Trainer(model, "cross-entropy", adam(lr=0.01), threads=1,
                          precision=Precision("fp16", init_scale=2.0 ** 16, growth_interval=2),
                          schedule=Schedule("cosine", warmup_steps=2, min_lr=1e-3))


@pytest.fixture(scope="module")
def fp16_snapshot(tmp_path_factory):
    ck = tmp_path_factory.mktemp("fp16") / "ck"
    tr = _fp16_trainer()
    crash_after(tr, 4)
    with pytest.raises(KeyboardInterrupt):
        _fit(tr, ck)
    return checkpoints.path_in(ck).read_bytes(), tr.spec


@pytest.mark.parametrize("which, value, said", [
    ("scale", 0.0, "the fp16 loss scale"), ("scale", np.nan, "the fp16 loss scale"),
    ("scale", -2.0, "is -2.0, not a finite number > 0"), ("growth", -1, "the count of good steps"),
    ("total", -5, "the schedule's total steps"), ("scale", "int", "has shape [] and dtype int64")])
def test_fp16_scale_and_schedule_total_are_checked(fp16_snapshot, tmp_path, which, value, said):
    data, spec = fp16_snapshot
    name = {"scale": spec.scaling.scale, "growth": spec.scaling.growth, "total": spec.total}[which]
    ck = tmp_path / "ck"
    ck.mkdir()
    change = (lambda a: np.array(1, np.int64)) if value == "int" else (lambda a: np.array(value, a.dtype))
    checkpoints.path_in(ck).write_bytes(_array(name, change)(data))
    tr = _fp16_trainer()
    with pytest.raises(rg.RevgraphError, match="") as info:
        _fit(tr, ck)
    assert said in str(info.value) and name in str(info.value) and tr.steps == 0, str(info.value)


def test_fp16_snapshot_as_written_resumes(fp16_snapshot, tmp_path):
    data, _ = fp16_snapshot
    ck = tmp_path / "ck"
    ck.mkdir()
    checkpoints.path_in(ck).write_bytes(data)
    tr = _fp16_trainer()
    _fit(tr, ck)
    assert tr.resumed and len(tr.losses) == 5 and tr.steps_taken == 9  # (the losses of this trainer's steps)


def test_a_snapshot_read_to_look_at_it_is_checked_too(base, tmp_path):
    """``checkpoints.load`` without a run to compare with still refuses a damaged archive in one line."""
    ck = _copy(base, tmp_path)
    checkpoints.path_in(ck).write_bytes(DAMAGE["metadata a JSON list"][0](base["bytes"]))
    with pytest.raises(rg.RevgraphError, match="the metadata is a JSON list"):
        checkpoints.load(ck)
    checkpoints.path_in(ck).write_bytes(base["bytes"])
    arrays, meta = checkpoints.load(ck)
    assert (meta["epoch"], meta["batch"], int(arrays["step"])) == (1, 1, 4)


# ------------------------------------------------------------------------------------------ two processes

@pytest.mark.slow
def test_two_processes_check_the_snapshot_on_rank_0_and_refuse_together(base, tmp_path):
    """``train --nproc 2 --shard optimizer`` (ZeRO-1) resuming the one-process snapshot (global batch 1 x 8 =
    2 x 4: elastic). Snapshots hold whole arrays, gathered by rank 0 (no per-rank files): rank 0 reads and checks
    the file, and both ranks refuse together, so none waits for a broadcast that never comes: a damaged field,
    and a snapshot claiming another world size (2 x 8 = 16), end with exit 2 naming the file and the field,
    nothing written, the snapshot untouched. The snapshot as written resumes to the uninterrupted run's weights
    (to float rounding: the ranks' gradients are summed in another order)."""
    import torch.distributed.run  # noqa: F401  (in the test extra)
    ck = _copy(base, tmp_path)
    path = checkpoints.path_in(ck)
    args = [sys.executable, "-m", "revgraph", *_cli_args(tmp_path, "--nproc", "2", "--shard", "optimizer")]
    args[args.index("--batch-size") + 1] = str(BATCH // 2)
    for damage, said in [(DAMAGE["losses 5"][0], "field 'losses' is 5, not a list of numbers"),
                         (_set("world_size", 2), "global batch 2 x 8 = 16 (now 2 x 4 = 8)")]:
        path.write_bytes(damage(base["bytes"]))
        before = path.read_bytes()
        r = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=240)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        # (the refusal names the rank that read the file: rank 0 refuses, the others stop with it)
        assert (f"revgraph: error: rank 0 refused the checkpoint: {path}: {said}" in r.stderr
                or f"revgraph: error: rank 0 refused the checkpoint: {path} was written by a run with {said}"
                in r.stderr), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # (one line: no warning before it)
        assert path.read_bytes() == before and sorted(os.listdir(ck)) == ["checkpoint.npz"]
        assert sorted(os.listdir(tmp_path)) == ["ck", "d.npz", "m.onnx"]
    path.write_bytes(base["bytes"])
    r = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr
    trained = rg.load(tmp_path / "t.onnx").initializers
    for name in ("W1", "b1", "W2", "b2"):
        np.testing.assert_allclose(trained[name], base["ref"][name], rtol=2e-5, atol=2e-6, err_msg=name)
