"""``torch.compile`` as an anchor (issue 42, item 5): the AdamW step of issue 42's LLaMA (bench/llama42.py) in
revgraph, PyTorch eager, PyTorch ``torch.compile`` (inductor, CPU) and JAX ``jit``, at batches 1, 8 and 32 of 128
tokens, with 1 and 2 threads.

    python bench/compile_anchor.py [--batches 1 8 32] [--threads 1 2] [--configs rg pt pt-compile jax]
                                   [--turns 5] [--turn-seconds 1.0] [--json FILE]
    python bench/compile_anchor.py --render bench/results/compile_anchor.json   # the table of saved results

Every (threads, batch) cell starts one fresh worker process per configuration (bench/workers.py), which imports
its framework, builds the step and runs two steps: the first is timed apart (for ``pt-compile`` it is inductor's
compilation of the forward and backward, with an empty inductor cache; for ``jax`` XLA's), reported as *first step*, and
*compile* = first step less the median step. Then the cell's workers take turns (``--turns``, each about
``--turn-seconds`` of steps per worker, the starting worker rotating, bench/memory.py's ``Bench.time_group``), so the
configurations are timed in the same minutes; a step time is the median over the turns of the turn's mean step, and a
ratio is the median over the turns of the two configurations' ratio in that turn. The first-step losses of a cell must
agree (same weights, same batch).

Every worker runs a copy of src/revgraph made when the run starts (the tree is shared and edited meanwhile).
Results: ``--json`` (default bench/results/compile_anchor.json); the Markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import llama42
from memory import Bench
from workers import Log, WorkerError

LABELS = {"rg": "revgraph", "pt": "PyTorch eager", "pt-compile": "torch.compile (inductor)", "jax": "JAX jit",
          "rg-0.5": "revgraph memory=0.5", "rg-0": "revgraph memory=0", "pt-ckpt": "PyTorch checkpointed"}
log = Log()


class AnchorBench(Bench):
    """bench/memory.py's runner (source snapshot, workers, turns) with bench/llama42.py's cells."""

    def measure(self, name: str, spec: dict):
        w = self.worker(name)
        t0 = time.perf_counter()
        try:
            r = w.call("llama42:build", timeout=self.args.timeout, **spec)
        except WorkerError as exc:
            w.close()
            log(f"  {name}: error: {exc.error}")
            return {"status": "error", "why": exc.error, "traceback": exc.traceback[-2000:]}, None
        r["cell_seconds"], r["status"] = time.perf_counter() - t0, "ok"
        log(f"  {name}: first step {r['first_step_s']:.2f} s, second {r['second_step_s']:.3f} s, "
            f"loss {r['loss']:.6f} ({r['cell_seconds']:.0f} s)")
        return r, w

    def cell(self, threads: int, batch: int, configs: list[str]) -> dict:
        self.env.update(llama42.thread_env(threads))
        # a fresh inductor cache per cell: the first step is a cold compilation, as on a user's first run
        self.env["TORCHINDUCTOR_CACHE_DIR"] = str(self.logs / f"inductor-t{threads}-b{batch}")
        log(f"threads {threads}, batch {batch}")
        cells, live = {}, []
        for config in configs:
            spec = {"config": config, "batch": batch, "threads": threads, "cache": str(self.cache)}
            cells[config], w = self.measure(f"t{threads}-b{batch}-{config}", spec)
            if w is not None:
                live.append((config, w))
        self.time_group(live, cells)
        for r in cells.values():
            if "step_ms" in r:
                r["compile_s"] = r["first_step_s"] - r["step_ms"] / 1e3
        losses = [r["loss"] for r in cells.values() if "loss" in r]
        spread = (max(losses) - min(losses)) / abs(min(losses)) if losses else None
        if spread is not None and spread > 1e-4:
            log(f"  WARNING: first-step losses disagree: { {c: r.get('loss') for c, r in cells.items()} }")
        return {"threads": threads, "batch": batch, "cells": cells, "loss_spread": spread}


def ratio(row: dict, a: str, b: str) -> float | None:
    """``a``'s step time over ``b``'s: the median over the turns of the ratio of their means in that turn (a load
    that drifts from turn to turn cancels), or the ratio of the medians when a turn is missing."""
    x, y = row["cells"].get(a, {}), row["cells"].get(b, {})
    tx, ty = x.get("step_ms_turns") or [], y.get("step_ms_turns") or []
    if tx and len(tx) == len(ty):
        return statistics.median(p / q for p, q in zip(tx, ty, strict=True))
    return x["step_ms"] / y["step_ms"] if x.get("step_ms") and y.get("step_ms") else None


def table(res: dict) -> str:
    """The Markdown table of a run: step medians, ratios, compile seconds, CPU per wall."""
    configs = list(res["configs"])
    head = ["threads", "batch", *(f"{LABELS[c]} ms" for c in configs)]
    pairs = [(a, b) for a, b in (("rg", "pt"), ("rg", "pt-compile"), ("rg", "jax"), ("pt-compile", "pt"))
             if a in configs and b in configs]
    head += [f"{LABELS[a].split()[0]} / {LABELS[b]}" for a, b in pairs]
    head += [f"{LABELS[c]} compile s" for c in ("pt-compile", "jax") if c in configs]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for row in res["rows"]:
        cells = row["cells"]
        vals = [str(row["threads"]), str(row["batch"])]
        vals += [f"{cells[c]['step_ms']:.1f}" if "step_ms" in cells.get(c, {}) else "error" for c in configs]
        vals += [f"{r:.2f}x" if (r := ratio(row, a, b)) else "" for a, b in pairs]
        vals += [f"{cells[c]['compile_s']:.1f}" if "compile_s" in cells.get(c, {}) else ""
                 for c in ("pt-compile", "jax") if c in configs]
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--configs", nargs="+", choices=llama42.CONFIGS, default=["rg", "pt", "pt-compile", "jax"])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--turn-seconds", type=float, default=1.0)
    llama42.common_options(parser, "compile_anchor.json", timeout=900.0)
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or min(args.threads) < 1 or args.turns < 1:
        parser.error("--batches, --threads and --turns take positive integers")
    if args.render:
        print(table(json.loads(Path(args.render).read_text())))
        return 0
    args.worker_env, args.reserve_gib = None, 0.0
    from run import loadavg, machine_info

    t0 = time.perf_counter()
    bench = AnchorBench(args)
    with bench.worker("prepare") as w:
        info = w.call("llama42:prepare", cache=str(args.cache))
    res = {"command": "python bench/compile_anchor.py " + " ".join(sys.argv[1 if argv is None else 0:]),
           "started": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
           "load_start": loadavg(), "turns": args.turns, "turn_seconds": args.turn_seconds,
           "configs": {c: LABELS[c] for c in args.configs}, "model": {**llama42.LLAMA, "seq": llama42.SEQ,
                                                                    "parameters": info["parameters"]},
           "source": bench.source}
    res["rows"] = [bench.cell(t, b, args.configs) for t in args.threads for b in args.batches]
    res["load_end"], res["seconds"] = loadavg(), time.perf_counter() - t0
    llama42.save_results(res, args.json, args.cache, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
