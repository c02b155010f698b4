"""Mutation fuzzing of the training snapshots ``train --checkpoint-dir`` resumes from (used by tests/test_fuzz.py;
also runnable by hand; issue 28, part 1).

A real snapshot of ``train --checkpoint-dir ck`` (a run killed before its 5th step: epoch 1, batch 1) is mutated:
bytes flipped, cut, duplicated or inserted (tests/kit/fuzz.py's ``mutate_bytes``); 1-3 values of its JSON metadata
set to hostile values (an edge integer, NaN, a string, null, a list, an object, another field's value, a value
nudged), deleted, duplicated, or a field added; an array member given NaN, another dtype or shape, objects,
dropped or renamed. ``train`` resuming from each mutant, in a child forked from this process (revgraph loaded, no
onnxruntime threads) under a memory limit and a timeout, must exit 0 with the weights and last mean of the
uninterrupted run (other weights only after other finite values were put in an array: a valid snapshot of
them), or exit 2 with one error line, no output written and the snapshot untouched: never 3, a traceback or a
hang.

    python tests/kit/snapshot_fuzz.py --count 300 --seed 1 --save /tmp/snapshot-repro
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from revgraph.cli import main  # imported once here: each forked child starts with it loaded

if __package__ in (None, ""):  # run as a script (python tests/kit/snapshot_fuzz.py): kit's parent, tests/, on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kit.fuzz import MEMORY_LIMIT, TIMEOUT, command_line, forked, mutate_bytes

SNAPSHOT_TRAIN = ["train", "m.onnx", "--data", "d.npz", "--loss", "cross-entropy", "--epochs", "3", "--batch-size",
                  "8", "--threads", "1", "--checkpoint-every", "2", "--checkpoint-dir", "ck", "-o", "t.onnx"]


def _snapshot_files() -> dict[str, bytes]:
    """The model (x [N, 4] -> logits [N, 3]: MatMul, Add) and 24 samples of data, as files."""
    rng = np.random.default_rng(4)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                           helper.make_node("Add", ["h", "b"], ["logits"], name="add")], "snapshot",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
                          [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
                           numpy_helper.from_array(np.zeros(3, np.float32), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    f = io.BytesIO()
    np.savez(f, x=rng.standard_normal((24, 4)).astype(np.float32), y=rng.integers(0, 3, 24))
    return {"m.onnx": m.SerializeToString(), "d.npz": f.getvalue()}


def _forked(fn, timeout: float = TIMEOUT) -> str | None:
    """Run ``fn()`` in a forked child under the memory limit (:func:`kit.fuzz.forked`)."""
    return forked(fn, timeout, MEMORY_LIMIT)


def _quiet_main(argv: list[str], err_path: Path, out_path: Path):
    """``main(argv)`` with stderr and stdout to files; its exit code (or what it raised)."""
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for p in (err_path, out_path)]
    saved = os.dup(2), os.dup(1)
    os.dup2(fds[0], 2)
    os.dup2(fds[1], 1)
    try:
        rc = main(list(argv))
    except BaseException as exc:  # noqa: BLE001 - main must not raise
        rc = f"raised {type(exc).__name__}: {exc}"
    finally:
        sys.stderr.flush()
        sys.stdout.flush()
        os.dup2(saved[0], 2)
        os.dup2(saved[1], 1)
        for fd in fds:
            os.close(fd)
    return rc


def _mean_line(text: str) -> str:
    return next((ln for ln in text.splitlines() if "mean loss" in ln), "")


def snapshot_seed(root: Path) -> dict:
    """The seed of the snapshot mutants (made in forked children: the parent keeps no onnxruntime threads):
    ``{"files", "snapshot", "weights", "mean"}``: the model and data files, the snapshot's bytes, the
    uninterrupted run's trained weights (name -> array) and its line with the last epoch's mean loss."""
    files = _snapshot_files()
    for which in ("killed", "whole"):
        d = root / f"seed-{which}"
        d.mkdir()
        for name, content in files.items():
            (d / name).write_bytes(content)

    def make(which: str) -> None:
        from revgraph.train.engines import SplitEngine

        os.chdir(root / f"seed-{which}")
        if which == "killed":  # die before the 5th step, after the checkpoint of step 4 (the engine of --buffers one)
            real = SplitEngine.step

            def step(self, *args, **kwargs):
                if self.steps == 4:
                    raise KeyboardInterrupt
                return real(self, *args, **kwargs)

            SplitEngine.step = step
        rc = _quiet_main(SNAPSHOT_TRAIN, Path("err.txt"), Path("out.txt"))
        assert rc == (130 if which == "killed" else 0), (rc, Path("err.txt").read_text())

    for which in ("killed", "whole"):
        problem = _forked(lambda w=which: make(w), timeout=300)
        assert problem is None, f"making the seed snapshot ({which}): {problem}"
    whole = root / "seed-whole"
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(whole / "t.onnx")).graph.initializer}
    return {"files": files, "snapshot": (root / "seed-killed" / "ck" / "checkpoint.npz").read_bytes(),
            "weights": weights, "mean": _mean_line((whole / "out.txt").read_text())}


_OTHER_VALUES = "other finite values in"  # (a mutation after which exit 0 trains on from other values)
_HOSTILE = [0, 1, -1, 2, 3, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 10**12, 0.0, -0.0, 1.0, -1.0,
            float("nan"), float("inf"), -float("inf"), 1e38, 1e-45, "", "x", "NaN", "revgraph-checkpoint-1", "adam",
            "sgd", "step", "w", "a\nb", None,
            True, False, [], {}, [1.0], [0], {"a": 1}, "x" * 300]


def _paths(meta: dict) -> list[tuple[object, object]]:
    """``(container, key)`` of every value in ``meta``'s tree (iteratively)."""
    found, stack = [], [meta]
    while stack:
        c = stack.pop()
        for k in (range(len(c)) if isinstance(c, list) else list(c)):
            found.append((c, k))
            if isinstance(c[k], dict | list):
                stack.append(c[k])
    return found


def _mutate_json(meta: dict, rng: np.random.Generator) -> str:
    """Change one value of the metadata in place; return what was done."""
    paths = _paths(meta)
    c, k = paths[int(rng.integers(len(paths)))]
    where = repr(k)
    choice = int(rng.integers(6))
    v = c[k]
    if choice == 0:
        c.pop(k)
        return f"delete {where}"
    if choice == 1 and isinstance(c, list):
        c.insert(k, c[k])
        return f"duplicate {where}"
    if choice == 2 and isinstance(c, dict):
        c["unknown_" + str(int(rng.integers(100)))] = 1
        return "add a field"
    if choice == 3 and isinstance(v, int | float) and not isinstance(v, bool):  # a near-valid lie
        c[k] = v + int(rng.choice([-1, 1])) if isinstance(v, int) else v * (1 + float(rng.choice([-1e-12, 1e-9, 1])))
        return f"nudge {where}"
    if choice == 4:  # another field's value
        c2, k2 = paths[int(rng.integers(len(paths)))]
        c[k] = json.loads(json.dumps(c2[k2]))
        return f"set {where} to another field's value"
    c[k] = json.loads(json.dumps(_HOSTILE[int(rng.integers(len(_HOSTILE)))]))
    return f"set {where} to {str(c[k])[:20]}"


def _mutate_array(members: dict, names: list, rng: np.random.Generator) -> str:
    k = int(rng.integers(len(names)))
    member = f"a{k}.npy"
    a = np.load(io.BytesIO(members[member]))
    choice = int(rng.integers(7))
    if choice == 5:
        del members[member]
        return f"drop {member} ({names[k]})"
    if choice == 6:
        members[f"b{k}.npy"] = members.pop(member)
        return f"rename {member} ({names[k]})"
    if choice == 0 and a.size:
        a = a.copy()
        a.reshape(-1)[int(rng.integers(a.size))] = rng.choice([np.nan, np.inf, -1, 1e30, 0]) if a.dtype.kind == "f" \
            else rng.choice([-1, 2**40, 0])
        # a finite value in a parameter or a moment is a valid snapshot of other values (nothing can tell it
        # from the real one: the archive's CRC guards against damage, not edits): it trains on from there
        how = "a hostile element in" if a.dtype.kind != "f" or not np.isfinite(a).all() else _OTHER_VALUES
    elif choice == 1:
        a = a.astype(rng.choice([np.float64, np.float16, np.int32, np.int64, np.bool_]))
        how = "another dtype for"
    elif choice == 2:
        a = np.concatenate([a.reshape(-1), a.reshape(-1)[:1]]) if a.size else np.zeros(2)
        how = "another shape for"
    elif choice == 3:
        a = np.array([{"x": 1}], dtype=object)
        how = "objects in"
    else:
        a = np.asarray(a).reshape(-1)[:0]
        how = "an empty array for"
    f = io.BytesIO()
    np.save(f, a, allow_pickle=True)
    members[member] = f.getvalue()
    return f"{how} {member} ({names[k]})"


def mutate_snapshot(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """A mutant of the snapshot ``data``: 3 in 10 change bytes, 5 in 10 the metadata (1-3 values), 2 in 10 an
    array member."""
    r = rng.random()
    if r < 0.3:
        return mutate_bytes(data, rng)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    meta = json.loads(str(np.load(io.BytesIO(members["meta.npy"]))))
    if r < 0.8:
        done = "; ".join(_mutate_json(meta, rng) for _ in range(int(rng.integers(1, 4))))
        members["meta.npy"] = _npy_bytes(np.array(json.dumps(meta)))
    else:
        done = _mutate_array(members, meta["names"], rng)
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w") as z:
        for name, content in members.items():
            z.writestr(name, content)
    return f.getvalue(), done


def _npy_bytes(a) -> bytes:
    f = io.BytesIO()
    np.save(f, a)
    return f.getvalue()


def judge_snapshot(rc, err: str, out: str, workdir: Path, snapshot: bytes, seed: dict,
                    exact: bool = True) -> list[str]:
    """A resume passes with exit 0, the uninterrupted run's weights and mean (unless not ``exact``: a mutant with
    other finite values in an array), and nothing but ``t.onnx`` written beside the snapshot; or exit 2, one
    error line, nothing written and the snapshot as it was."""
    problems = []
    lines = err.splitlines()
    if "Traceback" in err:
        problems.append("traceback")
    left = sorted(os.listdir(workdir))
    in_ck = sorted(os.listdir(workdir / "ck")) if (workdir / "ck").is_dir() else []
    if rc == 0:
        if left != ["ck", "d.npz", "m.onnx", "t.onnx"] or in_ck != ["checkpoint.npz"]:
            problems.append(f"files left: {left}, ck: {in_ck}")
        else:
            got = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(workdir / "t.onnx")).graph.initializer}
            if not exact:  # (other values in an array: other weights, rightly)
                got = seed["weights"]
            if set(got) != set(seed["weights"]) or any(not np.array_equal(got[k], v, equal_nan=True)
                                                       for k, v in seed["weights"].items()):
                problems.append("exit 0 with weights other than the uninterrupted run's")
            if exact and _mean_line(out) != seed["mean"]:
                problems.append(f"exit 0 with another mean: {_mean_line(out)!r} (not {seed['mean']!r})")
    elif rc == 2:
        if not lines or not lines[-1].startswith("revgraph: error: ") or any(
                not ln.startswith(("note: ", "warning: ")) for ln in lines[:-1]):
            problems.append("a refusal that is not one error line")
        if left != ["ck", "d.npz", "m.onnx"] or in_ck != ["checkpoint.npz"]:
            problems.append(f"files left: {left}, ck: {in_ck}")
        elif (workdir / "ck" / "checkpoint.npz").read_bytes() != snapshot:
            problems.append("the snapshot was changed")
    else:
        problems.append(f"exit {rc}")
    return problems


def run_snapshot_mutant(snapshot: bytes, seed: dict, root: Path, exact: bool = True) -> dict:
    """Fork a child that resumes ``train`` from the snapshot ``snapshot`` in a new directory under ``root``;
    its findings (``{}`` when it passed)."""
    workdir = Path(tempfile.mkdtemp(dir=root))
    for name, content in seed["files"].items():
        (workdir / name).write_bytes(content)
    (workdir / "ck").mkdir()
    (workdir / "ck" / "checkpoint.npz").write_bytes(snapshot)
    result = workdir.parent / f"{workdir.name}.json"
    err_path, out_path = workdir.parent / f"{workdir.name}.err", workdir.parent / f"{workdir.name}.out"

    def child() -> None:
        os.chdir(workdir)
        rc = _quiet_main(SNAPSHOT_TRAIN, err_path, out_path)
        err, out = err_path.read_text(errors="replace"), out_path.read_text(errors="replace")
        problems = judge_snapshot(rc, err, out, workdir, snapshot, seed, exact)
        result.write_text(json.dumps({"train": {"rc": rc, "stderr": err[-2000:], "problems": problems}}
                                     if problems else {}))

    try:
        problem = _forked(child)
        findings = json.loads(result.read_text()) if problem is None and result.exists() else {
            "all": {"problems": [problem or "no result"]}}
    finally:
        for p in (result, err_path, out_path):
            p.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return findings


def fuzz_snapshots(count: int, seed: int, save: Path | None = None, start: int = 0) -> list[dict]:
    """Run ``count`` snapshot mutants (numbers ``start`` .. of the stream of ``seed``); return the failures, each
    mutant saved under ``save`` (with the model and data files) when given."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="revgraph-fuzz-snapshots-") as tmp:
        root = Path(tmp)
        base = snapshot_seed(root)
        failures = []
        for k in range(start + count):
            data, how = mutate_snapshot(base["snapshot"], rng)
            if k < start:
                continue
            findings = run_snapshot_mutant(data, base, root, exact=_OTHER_VALUES not in how)
            if findings:
                failure = {"mutant": k, "seed_model": "snapshot", "mutation": how, "findings": findings}
                if save is not None:
                    (save / f"snapshot-{seed}-{k}" / "ck").mkdir(parents=True, exist_ok=True)
                    for name, content in base["files"].items():
                        (save / f"snapshot-{seed}-{k}" / name).write_bytes(content)
                    (save / f"snapshot-{seed}-{k}" / "ck" / "checkpoint.npz").write_bytes(data)
                    failure["file"] = str(save / f"snapshot-{seed}-{k}" / "ck" / "checkpoint.npz")
                failures.append(failure)
    return failures


if __name__ == "__main__":
    command_line(fuzz_snapshots, __doc__)
