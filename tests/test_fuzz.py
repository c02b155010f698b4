"""Mutation fuzzing of ``info``, ``grad``, ``run`` and ``check`` (issue 12, section 2; tests/kit/fuzz.py), and of
the training snapshots ``train --checkpoint-dir`` resumes from (issue 28, part 1).

Every mutant of the seed models (several operators, a Loop, an If, initializers, external data) must give exit
0 or 2 (``check`` also 1), no traceback, one ``revgraph: error:`` line on a refusal, and no file left behind.
CI runs a fixed sample; ``-m slow`` runs a few thousand more. Failures are saved as reproducers (the mutant
file and its findings) under ``$REVGRAPH_FUZZ_SAVE`` when set, else in pytest's temporary directory.
Every mutant of a real snapshot must resume with exit 0 to the uninterrupted run's weights, or exit 2 with one
error line, nothing written and the snapshot untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent / "kit" / "fuzz.py"
SNAPSHOT_KIT = KIT.parent / "snapshot_fuzz.py"
CI_SAMPLE = 150
SLOW_COUNT = 3000
SNAPSHOT_SAMPLE = 60  # (about 0.25 s a mutant)
SNAPSHOT_SLOW = 1500


def _fuzz(tmp_path: Path, count: int, seed: int, start: int = 0, kit: Path = KIT) -> list[dict]:
    """Run the fuzzer in its own process (it forks a child per mutant from a process with no onnxruntime
    threads); return its failures."""
    save = Path(os.environ.get("REVGRAPH_FUZZ_SAVE", tmp_path / "repro"))
    report = tmp_path / "failures.json"
    proc = subprocess.run([sys.executable, str(kit), "--count", str(count), "--seed", str(seed), "--start", str(start),
                           "--save", str(save), "--json", str(report)], capture_output=True, text=True, timeout=3600)
    assert proc.returncode in (0, 1) and report.exists(), proc.stderr[-3000:]
    return json.loads(report.read_text())


def _summary(failures: list[dict]) -> str:
    lines = []
    for f in failures[:15]:
        for cmd, found in f["findings"].items():
            last = (found.get("stderr") or "").strip().splitlines()[-1:] or [""]
            lines.append(f"mutant {f['mutant']} of {f['seed_model']} ({f['mutation']}), {cmd}: "
                         f"{', '.join(found['problems'])}: {last[0][:200]} [{f.get('file')}]")
    return "\n".join(lines) + (f"\n... {len(failures)} failing mutants in all" if len(failures) > 15 else "")


def test_fuzz_sample(tmp_path):
    failures = _fuzz(tmp_path, CI_SAMPLE, seed=12)
    assert not failures, _summary(failures)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzz_many(tmp_path, seed):
    failures = _fuzz(tmp_path, SLOW_COUNT // 3, seed=seed)
    assert not failures, _summary(failures)


def test_fuzz_snapshots_sample(tmp_path):
    failures = _fuzz(tmp_path, SNAPSHOT_SAMPLE, 28, kit=SNAPSHOT_KIT)
    assert not failures, _summary(failures)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzz_snapshots_many(tmp_path, seed):
    failures = _fuzz(tmp_path, SNAPSHOT_SLOW // 3, seed, kit=SNAPSHOT_KIT)
    assert not failures, _summary(failures)


def test_the_snapshot_judge_catches_what_it_should(tmp_path):
    """The verdicts on hand-made resumes: exit 3, two error lines, other weights, a changed snapshot."""
    import numpy as np
    from kit.snapshot_fuzz import judge_snapshot

    (tmp_path / "ck").mkdir()
    for f in ("m.onnx", "d.npz"):
        (tmp_path / f).write_bytes(b"")
    (tmp_path / "ck" / "checkpoint.npz").write_bytes(b"snap")
    seed = {"weights": {"w": np.ones(2, np.float32)}, "mean": "mean loss 1"}
    assert judge_snapshot(2, "revgraph: error: bad\n", "", tmp_path, b"snap", seed) == []
    assert judge_snapshot(3, "revgraph: internal error: KeyError\n", "", tmp_path, b"snap", seed) == ["exit 3"]
    assert judge_snapshot(2, "revgraph: error: a\nrevgraph: error: b\n", "", tmp_path, b"snap", seed) != []
    assert judge_snapshot(2, "revgraph: error: bad\n", "", tmp_path, b"other", seed) == ["the snapshot was changed"]
    (tmp_path / "ck" / "failure.json").write_bytes(b"{}")
    assert judge_snapshot(2, "revgraph: error: bad\n", "", tmp_path, b"snap", seed) != []
    (tmp_path / "ck" / "failure.json").unlink()
    import onnx
    from onnx import helper, numpy_helper

    g = helper.make_graph([], "g", [], [], initializer=[numpy_helper.from_array(np.zeros(2, np.float32), "w")])
    onnx.save(helper.make_model(g), str(tmp_path / "t.onnx"))
    assert judge_snapshot(0, "", "mean loss 1\n", tmp_path, b"snap", seed) == [
        "exit 0 with weights other than the uninterrupted run's"]
    assert judge_snapshot(0, "", "mean loss 1\n", tmp_path, b"snap", seed, exact=False) == []


def test_the_judge_catches_what_it_should(tmp_path):
    """The fuzzer's verdicts on hand-made outcomes: a crash, a second error line, a file left behind."""
    from kit.fuzz import judge

    assert judge("grad", 0, "warning: no path\n", ["g.onnx"]) == []
    assert judge("info", 2, "note: x\nrevgraph: error: bad\n", []) == []
    assert judge("check", 1, "", []) == []
    assert judge("grad", 3, "revgraph: internal error: KeyError\n", []) == ["exit 3"]
    assert judge("run", 2, "revgraph: error: a\nrevgraph: error: b\n", []) != []
    assert judge("run", 2, "Traceback (most recent call last):\nrevgraph: error: b\n", []) != []
    assert judge("grad", 2, "revgraph: error: bad\n", [".g.onnx.abc.tmp"]) != []
    assert judge("run", 0, "", ["out.npz", "stray"]) != []
