"""Guard nodes as a share of the backward (issue 39, "fewer guards"), for the revgraph on ``PYTHONPATH``: run it
once per tree to compare two trees.

    python bench/guard_share.py OUT.json [--no-node-tests]
    python bench/guard_share.py --time [--batch 8] [--steps 10]


Rows: the four step models of ``bench/models.py`` (batch 2, differentiated with respect to their parameters as
``tests/kit/node_counts.py`` builds them), the LLaMA of ``bench/memory_common.py`` as ``rg.Trainer`` builds its
AdamW step (parameters as graph inputs, the graph issue 39 measured), and the ONNX node tests that
``tests/kit/node_cases.py`` checks (summed). For each: the backward's nodes (named ``grad/``, ``accum/`` or
``seed/``, subgraphs included) and among the ``grad/`` ones the guard nodes ``Equal``, ``Or``, ``Where``, ``IsInf``
and ``IsNaN``, whatever emitted them (strong zeros, selections, fully masked rows), and the tagged strong
products (``.../StrongZero``, which trees before issue 39 do not tag: 0 there).

``--time`` prints the median CPU time of the LLaMA's AdamW step (onnxruntime, 1 thread, ``--steps`` steps after
two of warm-up) at ``--batch`` sequences of 128 tokens: run it in alternating turns with two trees on
``PYTHONPATH`` (docs/benchmarks.md, "Strong zeros, round four").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
GUARDS = ("Equal", "Or", "Where", "IsInf", "IsNaN")


def count(graph) -> dict:
    """``{"backward", "guards", "strong", <op>...}`` of a gradient or training graph (module doc)."""
    ops: Counter = Counter()
    backward = strong = 0
    for _, node in graph.walk():
        if not node.name.startswith(("grad/", "accum/", "seed/")):
            continue
        backward += 1
        if node.name.startswith("grad/") and node.op_type in GUARDS:
            ops[node.op_type] += 1
            strong += node.op_type == "Where" and node.name.rsplit("/", 1)[-1].startswith("StrongZero")
    guards = sum(ops.values())
    return {"backward": backward, "guards": guards, "share": round(guards / max(backward, 1), 4),
            "strong": strong, **{op: ops[op] for op in GUARDS}}


def _bench_models(folder: str) -> dict[str, dict]:
    import revgraph as rg

    sys.path.insert(0, str(HERE))
    import models

    out = {}
    for name in ("mlp", "cnn", "transformer", "rnn"):
        info = models.write_step_model(name, 2, folder)
        g = rg.load(info["path"])
        gg = rg.gradient(g, g.outputs[0].name, [p for p in info["params"] if p in g.initializers])
        out[f"bench/{name}"] = count(gg)
    return out


def _llama(cache: str) -> dict[str, dict]:
    import revgraph as rg

    sys.path.insert(0, str(HERE))
    import memory_torch

    info = memory_torch.export_llama(cache)
    tr = rg.Trainer(info["onnx"], "cross-entropy", "adamw", params=info["params"], threads=1)
    return {"llama/step": count(tr.spec.graph)}


def _node_tests() -> dict[str, dict]:
    import revgraph as rg

    sys.path.insert(0, str(HERE.parent / "tests"))
    from kit.node_cases import CASES, Skip, prepare

    total: Counter = Counter()
    for name in CASES:
        try:
            prep = prepare(CASES[name])
            gg = rg.gradient(prep.graph, prep.losses[0], prep.wrt)
        except (Skip, rg.RevgraphError):
            continue
        total.update({k: v for k, v in count(gg).items() if k != "share"})
        total["cases"] += 1
    total["share"] = round(total["guards"] / max(total["backward"], 1), 4)
    return {"node tests": dict(total)}


def step_time(cache: str, batch: int, steps: int) -> float:
    """The median process CPU seconds of one LLaMA AdamW step (module doc)."""
    import time

    import revgraph as rg

    sys.path.insert(0, str(HERE))
    import memory_torch
    from memory_common import llama_batch

    info = memory_torch.export_llama(cache)
    tr = rg.Trainer(info["onnx"], "cross-entropy", "adamw", params=info["params"], threads=1)
    data = llama_batch(batch)
    times = []
    for k in range(steps + 2):
        t0 = time.process_time()
        tr.step(data)
        if k >= 2:
            times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--no-node-tests", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "revgraph-bench-models"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.time:
        print(f"{1000 * step_time(args.cache, args.batch, args.steps):.1f} ms per step")
        return
    if not args.out:
        ap.error("give OUT.json, or --time")
    with tempfile.TemporaryDirectory() as d:
        rows = {**_bench_models(d), **_llama(args.cache), **({} if args.no_node_tests else _node_tests())}
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    for k, r in rows.items():
        print(f"{k:16} backward {r['backward']:7,} guards {r['guards']:6,} ({100 * r['share']:.1f}%), "
              f"tagged strong products {r['strong']}")


if __name__ == "__main__":
    main()
