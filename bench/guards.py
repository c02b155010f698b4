"""The cost of the strong-zero guards (issue 27): guard nodes in the gradient graphs of the bench models, and
the gradient graphs' step time on onnxruntime, for the revgraph on ``PYTHONPATH`` (run it once per tree to
compare two trees).

``python bench/guards.py count OUT.json``: for each model (the step models of ``bench/models.py`` at batch 1
and 64, the lifted light ResNet-50 and DenseNet-121, the synthetic Sin/Tanh chain and fan-out) the number of
``Where``, ``Equal`` and ``Or`` nodes the backward pass emitted (names ``grad/...``) and of all nodes.
``python bench/guards.py time OUT.json --other OTHER_SRC``: step times (median of alternating turns) of the
gradient graphs built by this tree and by the revgraph source at ``OTHER_SRC`` (built in a subprocess with
that ``PYTHONPATH``), run on onnxruntime with 1 thread, the two in alternating order turn by turn; never
asserted by a test (noise: time a model whose graph did not change beside, as a control).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
CACHE = Path(os.environ.get("REVGRAPH_BENCH_CACHE", Path(tempfile.gettempdir()) / "revgraph-bench-models"))
GUARDS = ("Where", "Equal", "Or")


def _models() -> dict[str, dict]:
    import models

    CACHE.mkdir(parents=True, exist_ok=True)
    out = {f"{m}_b{b}": models.write_step_model(m, b, str(CACHE)) for m in models.STEP_MODELS for b in (1, 64)}
    for name in ("resnet50", "densenet121"):
        out[f"light_{name}"] = models.write_light(name, str(CACHE))
    out["chain201"] = models.write_synthetic("chain", 201, str(CACHE))
    out["fan201"] = models.write_synthetic("fan", 201, str(CACHE))
    return out


def _gradient(info: dict) -> onnx.ModelProto:
    import rg_tasks

    import revgraph as rg

    kind = info.get("loss_kind", "output")
    return rg.to_onnx(rg_tasks.gradient_graph(onnx.load(info["path"]), info["params"], kind))


def _count(model: onnx.ModelProto) -> dict:
    ops: Counter = Counter()
    stack, total = list(model.graph.node), 0
    while stack:
        node = stack.pop()
        total += 1
        if node.name.startswith("grad/") and node.op_type in GUARDS:
            ops[node.op_type] += 1
        for a in node.attribute:
            stack.extend(n for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs) for n in g.node)
    return {"nodes": total, **{op: ops[op] for op in GUARDS}}


def count(out: str) -> None:
    """Write ``{model: {"nodes", "Where", "Equal", "Or"}}`` for every model to ``out``."""
    result = {key: _count(_gradient(info)) for key, info in _models().items()}
    Path(out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def _save(keys: list[str], folder: str) -> None:
    infos = _models()
    for key in keys:
        onnx.save(_gradient(infos[key]), str(Path(folder) / f"{key}.onnx"))


def _feeds(info: dict, sess) -> dict[str, np.ndarray]:
    import models

    state, data = models.load_npz(info["npz"])
    feeds = {}
    for v in sess.get_inputs():
        feeds[v.name] = data["labels"] if v.name.startswith("labels") else data.get(v.name, state.get(v.name))
    return feeds


def timing(out: str, other: str, keys: list[str], turns: int, iters: int) -> None:
    """Median step times of this tree's and ``other``'s gradient graphs of ``keys``, alternating turns."""
    import onnxruntime as ort

    infos = _models()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"after": Path(tmp) / "after", "before": Path(tmp) / "before"}
        for d in dirs.values():
            d.mkdir()
        _save(keys, str(dirs["after"]))
        env = dict(os.environ, PYTHONPATH=f"{other}{os.pathsep}{HERE}")
        subprocess.run([sys.executable, __file__, "save", str(dirs["before"]), *keys], env=env, check=True)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = 1, 1, 3
        result = {}
        for key in keys:
            sess = {k: ort.InferenceSession(str(d / f"{key}.onnx"), opts, providers=["CPUExecutionProvider"])
                    for k, d in dirs.items()}
            feeds = {k: _feeds(infos[key], s) for k, s in sess.items()}
            times: dict[str, list[float]] = {k: [] for k in sess}
            for turn in range(turns):
                order = list(sess.items()) if turn % 2 else list(sess.items())[::-1]
                for k, s in order:  # alternating, in both orders: both see the same machine load
                    s.run(None, feeds[k])
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        s.run(None, feeds[k])
                    times[k].append((time.perf_counter() - t0) / iters)
            med = {k: float(np.median(v)) for k, v in times.items()}
            result[key] = {"before_ms": 1e3 * med["before"], "after_ms": 1e3 * med["after"],
                           "ratio": med["after"] / med["before"]}
            print(key, result[key], flush=True)
    Path(out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["count", "time", "save"])
    ap.add_argument("out")
    ap.add_argument("keys", nargs="*")
    ap.add_argument("--other", help="the other revgraph source folder (for time)")
    ap.add_argument("--turns", type=int, default=11)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    if a.what == "count":
        count(a.out)
    elif a.what == "save":
        _save(a.keys, a.out)
    else:
        timing(a.out, a.other, a.keys or ["rnn_b64", "transformer_b64", "cnn_b64"], a.turns, a.iters)


if __name__ == "__main__":
    main()
