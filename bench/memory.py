"""Memory of one training step: revgraph (defaults, memory budgets, onnxruntime settings) against PyTorch eager,
PyTorch with activation checkpointing, JAX and JAX with ``jax.checkpoint`` (issue 24, part 5).

    python bench/memory.py [--quick] [--models llama transformer cnn rnn] [--configs rg pt jax ...] [--turns N]
                           [--largest-batch] [--json FILE] [--write-docs]
    python bench/memory.py --largest-batch --from bench/results/memory.json   # only the largest batches, later
    python bench/memory.py --render bench/results/memory.json --write-docs    # the docs section from saved numbers

Rows: the LLaMA of transformers' ``LlamaConfig`` (memory_common.LLAMA) at 8 x 128 and 64 x 128 tokens, the bench
Transformer and CNN at batch 64 (Adam steps), the bench RNN Loop at T = 1000, batch 64 (forward plus backward).
Columns: the configurations of :data:`CONFIGS`. Every cell is a fresh worker process (bench/workers.py), which
imports one framework, builds the step, warms it up and measures one step (memory_worker's doc: *over setup*,
*total*); then the cells of a row take turns timing their steps (``--turns``, each turn about ``--turn-seconds``
of steps per cell, the starting cell rotating), and the step time is the median over the turns. The first-step
losses of a row must agree (same weights, same batch): a check of every framework's model against the others.

Every cell runs a copy of src/revgraph made when the run starts (``--no-snapshot``: the working tree), so that
edits made meanwhile (the tree is shared) do not split a run between two versions.

``--largest-batch``: the largest LLaMA batch whose step stays under ``--limit-gib`` (8) GiB of *total* memory,
per configuration: a line through the two LLaMA rows' totals predicts it, rounded down to a multiple of 8, and a
fresh process at that batch confirms it. A run over the limit is followed by one at the batch the line through
the larger row and that run predicts (rounded down to a multiple of 8, and at least 8 below), at most 3 runs:
stepping down by 8 alone does not get under the limit when the line through the small batches is off by more than
a few steps' worth (about 135 MB per 8 sequences).

Results go to ``--json`` (default bench/results/memory.json, bench/results/memory-quick.json with --quick);
``--write-docs`` puts the section "Memory" into docs/benchmarks.md between ``<!-- memory:begin -->`` and
``<!-- memory:end -->`` (bench/report.py, which writes the rest of that file, keeps marked sections).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from memory_worker import THREAD_ENV
from workers import Log, Worker, WorkerError

#: Configuration key -> label, in table order.
CONFIGS = {
    "rg": "revgraph default",
    "rg-1.0": "revgraph memory=1.0",
    "rg-0.5": "revgraph memory=0.5",
    "rg-0": "revgraph memory=0",
    "rg-ort": "revgraph, onnxruntime defaults (arena on, pattern on)",
    "rg-lean": "revgraph, arena off, pattern off",
    "pt": "PyTorch eager",
    "pt-ckpt": "PyTorch, checkpoint per block",
    "jax": "JAX jit",
    "jax-ckpt": "JAX jit, jax.checkpoint per block",
}
SHORT = {"rg": "rg default", "rg-1.0": "rg 1.0", "rg-0.5": "rg 0.5", "rg-0": "rg 0", "rg-ort": "rg ORT defaults",
         "rg-lean": "rg arena/pattern off", "pt": "PyTorch", "pt-ckpt": "PyTorch ckpt", "jax": "JAX",
         "jax-ckpt": "JAX ckpt"}
MODELS = ("llama", "transformer", "cnn", "rnn")
BASE = "pt"  # ratios are against PyTorch eager


def rows_for(quick: bool, models) -> list[dict]:
    """The rows: ``id``, ``model``, ``batch``, ``steps`` (the RNN's T), ``step`` (``adam`` or ``grad``)."""
    small, large, b, T = (2, 8, 8, 100) if quick else (8, 64, 64, 1000)
    rows = [
        {"model": "llama", "batch": small, "step": "adam"},
        {"model": "llama", "batch": large, "step": "adam"},
        {"model": "transformer", "batch": b, "step": "adam"},
        {"model": "cnn", "batch": b, "step": "adam"},
        {"model": "rnn", "batch": b, "steps": T, "step": "grad"},
    ]
    for r in rows:
        r["id"] = f"{r['model']}-b{r['batch']}" + (f"-T{r['steps']}" if "steps" in r else "")
    return [r for r in rows if r["model"] in models]


def row_label(r: dict) -> str:
    if r["model"] == "llama":
        return f"LLaMA, {r['batch']} x 128 tokens"
    if r["model"] == "rnn":
        return f"bench RNN Loop, T = {r['steps']:,} ({r['batch']})"
    return f"bench {r['model'].capitalize() if r['model'] != 'cnn' else 'CNN'} ({r['batch']})"


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


log = Log()


# -------------------------------------------------------------------------------------------------- running


class Bench:
    def __init__(self, args):
        self.args = args
        self.cache = Path(args.cache)
        self.logs = self.cache / "logs" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.files: dict = {}
        self.env = {**THREAD_ENV, **dict(kv.split("=", 1) for kv in args.worker_env or [])}
        self.source = self.snapshot() if args.snapshot else {"snapshot": None}

    def reuse(self, source: dict) -> None:
        """Run the revgraph snapshot of an earlier run (``source``) if it is still in the cache."""
        path = (source or {}).get("snapshot") or ""
        path = path.replace("<cache>", str(self.cache))
        if os.path.isdir(os.path.join(path, "revgraph")):
            self.env["PYTHONPATH"] = path + os.pathsep + os.environ.get("PYTHONPATH", "")
            self.source = {**source, "reused": True}

    def snapshot(self) -> dict:
        """Copy src/revgraph as it is now and put the copy first on the workers' path: every cell of the run
        measures the same revgraph, whatever is edited in the working tree meanwhile."""
        import hashlib
        import shutil
        import subprocess

        dst = self.logs / "src"
        shutil.copytree(ROOT / "src" / "revgraph", dst / "revgraph", ignore=shutil.ignore_patterns("__pycache__"))
        self.env["PYTHONPATH"] = str(dst) + os.pathsep + os.environ.get("PYTHONPATH", "")
        diff = subprocess.run(["git", "diff", "HEAD", "--", "src"], capture_output=True, cwd=ROOT).stdout
        return {"snapshot": str(dst), "src_diff_sha1": hashlib.sha1(diff).hexdigest()[:12] if diff else None,
                "src_diff_lines": diff.count(b"\n")}

    def worker(self, name: str) -> Worker:
        return Worker(name, sys.executable, self.logs, env=self.env)

    def prepare(self, rows: list[dict]) -> dict:
        with self.worker("prepare") as w:
            t0 = time.perf_counter()
            self.files = w.call("memory_worker:prepare", spec={"rows": rows, "cache": str(self.cache)})
            log(f"model files ready in {time.perf_counter() - t0:.1f} s ({self.cache})")
            return w.call("memory_worker:versions")

    def spec(self, row: dict, config: str, batch: int | None = None, saved: bool = True) -> dict:
        return {"model": row["model"], "batch": batch or row["batch"], "step": row["step"], "config": config,
                "files": self.files[row["id"]], "saved": saved}

    def measure(self, name: str, spec: dict) -> tuple[dict, Worker | None]:
        """One cell in a fresh worker: the measurement, and the worker (still running) when it succeeded."""
        w = self.worker(name)
        t0 = time.perf_counter()
        try:
            r = w.call("memory_worker:measure", timeout=self.args.timeout, spec=spec)
        except WorkerError as exc:
            w.close()
            log(f"  {name}: error: {exc.error}")
            return {"status": "error", "why": exc.error, "traceback": exc.traceback[-2000:]}, None
        r["cell_seconds"] = time.perf_counter() - t0
        if r["status"] != "ok":
            w.close()
            log(f"  {name}: n/a ({r.get('why')})")
            return r, None
        log(f"  {name}: over setup {r['over_setup']:.0f} MB, total {r['total']:.0f} MB, saved "
            f"{_mb(r.get('saved_bytes'))} MB, loss {r['loss']:.6f} ({r['cell_seconds']:.0f} s)")
        return r, w

    def time_group(self, live: list[tuple[str, Worker]], cells: dict) -> None:
        """Turns of timed steps over the live workers (the starting one rotates), then close them."""
        times: dict[str, list[float]] = {c: [] for c, _ in live}
        cpu: dict[str, list[dict]] = {c: [] for c, _ in live}
        for turn in range(self.args.turns):
            order = live[turn % len(live):] + live[:turn % len(live)] if live else []
            for config, w in order:
                try:
                    t = w.call("memory_worker:time_steps", timeout=self.args.timeout, seconds=self.args.turn_seconds)
                except WorkerError as exc:
                    cells[config]["time_error"] = exc.error
                    continue
                times[config].append(t["mean"])
                cpu[config].append(t)
        for config, w in live:
            w.close()
            if times[config]:
                cells[config]["step_ms"] = 1e3 * statistics.median(times[config])
                cells[config]["step_ms_turns"] = [1e3 * t for t in times[config]]
                for key, name in (("cpu", "cpu_per_wall"), ("sys", "sys_per_wall"), ("page_faults", "page_faults")):
                    cells[config][name] = statistics.median(t[key] for t in cpu[config])

    def row(self, row: dict, configs: list[str]) -> dict:
        log(f"{row['id']}: {row_label(row)}")
        cells: dict = {}
        live: list[tuple[str, Worker]] = []
        groups = []
        for config in configs:
            cells[config], w = self.measure(f"{row['id']}-{config}", self.spec(row, config))
            if w is not None:
                live.append((config, w))
            if live and mem_available_gib() < self.args.reserve_gib:  # time what is alive now, free its memory
                groups.append([c for c, _ in live])
                self.time_group(live, cells)
                live = []
        if live:
            groups.append([c for c, _ in live])
            self.time_group(live, cells)
        out = {**row, "label": row_label(row), "cells": cells, "timing_groups": groups}
        for key in ("loss", "loss_after"):  # before the first update, and after it (a check of the gradients)
            losses = {c: r[key] for c, r in cells.items() if r.get("status") == "ok" and r.get(key) is not None}
            if not losses:
                continue
            ref = losses.get(BASE, next(iter(losses.values())))
            dev = {c: abs(v - ref) / max(abs(ref), 1e-12) for c, v in losses.items()}
            out[f"{key}_check"] = {"reference": ref, "max_relative_deviation": max(dev.values()),
                                   "worst": max(dev, key=dev.get)}
            if max(dev.values()) > 1e-4:
                log(f"  WARNING: {key} disagrees between the configurations: {losses}")
        return out

    def largest(self, rows: list[dict], configs: list[str], limit_gib: float, tries: int = 3,
                previous: dict | None = None) -> dict:
        """The largest LLaMA batch under ``limit_gib`` of total memory per configuration (module doc): at most
        ``tries`` runs per configuration, continuing from the runs of ``previous`` (an earlier search's entries)."""
        llama = sorted((r for r in rows if r["model"] == "llama"), key=lambda r: r["batch"])
        if len(llama) < 2:
            return {"error": "needs the two LLaMA rows"}
        lo, hi = llama[0], llama[-1]
        limit = limit_gib * 1024
        t0 = time.perf_counter()
        out = {"limit_gib": limit_gib, "from": [lo["batch"], hi["batch"]], "configs": {}}
        for config in configs:
            a, b = lo["cells"].get(config, {}), hi["cells"].get(config, {})
            if a.get("status") != "ok" or b.get("status") != "ok":
                out["configs"][config] = {"status": "n/a"}
                continue
            slope = (b["total"] - a["total"]) / (hi["batch"] - lo["batch"])
            intercept = a["total"] - slope * lo["batch"]
            predicted = (limit - intercept) / slope if slope > 0 else float("inf")
            entry = {"status": "ok", "mb_per_sample": slope, "intercept_mb": intercept, "predicted": predicted,
                     "tries": list(((previous or {}).get(config) or {}).get("tries", []))}
            for _ in range(tries):
                batch = _next_batch(entry["tries"], (lo["batch"], a["total"]), (hi["batch"], b["total"]), limit)
                if batch is None:
                    break
                need = min(intercept + slope * batch, 1.5 * limit) / 1024 + 1  # a run far over stops at the limit
                for _ in range(12):  # memory of the last worker, or of other processes, may take a while to go
                    if mem_available_gib() >= need:
                        break
                    time.sleep(10)
                if mem_available_gib() < need:
                    entry["skipped"] = f"only {mem_available_gib():.1f} GiB available, {need:.1f} needed"
                    log(f"  largest {config}: skipped ({entry['skipped']})")
                    break
                r, w = self.measure(f"largest-{config}-b{batch}", self.spec(hi, config, batch=batch, saved=False))
                if w is not None:
                    w.close()
                entry["tries"].append({"batch": batch, **{k: r.get(k) for k in (
                    "status", "why", "total", "over_setup", "step_seconds", "cell_seconds")}})
            fits = [t["batch"] for t in entry["tries"] if t.get("status") == "ok" and t["total"] <= limit]
            if fits:
                entry["batch"] = max(fits)
            over = [t["batch"] for t in entry["tries"] if not (t.get("status") == "ok" and t["total"] <= limit)]
            if over and (not fits or min(over) > max(fits)):
                entry["over"] = min(over)  # the smallest batch seen over the limit (or failing)
            out["configs"][config] = entry
        out["seconds"] = time.perf_counter() - t0
        return out


def _next_batch(tries: list[dict], small: tuple, large: tuple, limit: float) -> int | None:
    """The next batch to run in the search for the largest batch under ``limit`` MB, or ``None`` when the answer
    is known to 8 sequences. Between the largest batch that fitted and the smallest that did not (or was refused),
    a secant step: the line through the two measured points nearest the limit on either side (the two rows when
    there is nothing else), rounded down to a multiple of 8 and kept strictly inside the bracket."""
    ok = sorted((t["batch"], t["total"]) for t in tries if t.get("status") == "ok")
    fit = [p for p in ok if p[1] <= limit]
    over = [p for p in ok if p[1] > limit] + [(t["batch"], None) for t in tries if t.get("status") != "ok"]
    lo = max(fit) if fit else None
    hi = min(over) if over else None
    if lo and hi and hi[0] - lo[0] <= 8:
        return None
    if lo and hi and hi[1] is not None:
        p, q = lo, hi
    elif lo:
        p, q = (large if large[0] < lo[0] else small), lo
    elif hi and hi[1] is not None:
        p, q = large, hi
    else:
        p, q = small, large
    slope = (q[1] - p[1]) / (q[0] - p[0]) if q[0] != p[0] else 0
    guess = q[0] + (limit - q[1]) / slope if slope > 0 else (lo[0] + 8 if lo else 8)
    batch = int(guess // 8 * 8)
    if hi:
        batch = min(batch, hi[0] - 8)
    if lo:
        batch = max(batch, lo[0] + 8)
    if batch < 8 or (hi and batch >= hi[0]) or any(t["batch"] == batch for t in tries):
        return None
    return batch


def largest_only(args) -> dict:
    """``--largest-batch --from JSON``: the largest-batch search on the LLaMA rows of saved results (with the
    revgraph snapshot of that run when it is still in the cache), written back into them. With ``--configs``, only
    those configurations are searched (on from their earlier runs) and the others' results are kept."""
    res = json.loads(Path(args.from_json).read_text())
    bench = Bench(args)
    bench.reuse(res.get("source"))
    rows = [r for r in res["rows"] if r["model"] == "llama"]
    bench.prepare([{k: r[k] for k in ("id", "model", "batch", "step")} for r in rows])
    configs = [c for c in res["configs"] if not args.configs or c in args.configs]
    log(f"largest LLaMA batch under {args.limit_gib} GiB, from {args.from_json}")
    old = res.get("largest") or {}
    previous = old.get("configs", {}) if old.get("limit_gib") == args.limit_gib else {}
    new = bench.largest(rows, configs, args.limit_gib, args.largest_tries, previous)
    runs = old.get("runs", [{k: old[k] for k in ("command", "started", "seconds") if k in old}] if old else [])
    new["runs"] = [*runs, {"command": "python bench/memory.py " + " ".join(sys.argv[1:]), "seconds": new["seconds"],
                           "started": dt.datetime.now().isoformat(timespec="seconds"), "configs": configs}]
    new["configs"] = {**previous, **new["configs"]}
    new["seconds"] = sum(r.get("seconds", 0) for r in new["runs"])
    new["source"] = bench.source
    res["largest"] = new
    return res


def run(args) -> dict:
    models = args.models or list(MODELS)
    configs = args.configs or list(CONFIGS)
    rows = rows_for(args.quick, models)
    started = dt.datetime.now()
    t0 = time.perf_counter()
    bench = Bench(args)
    from run import loadavg, machine_info

    res = {"command": "python bench/memory.py " + " ".join(sys.argv[1:]), "mode": "quick" if args.quick else "full",
           "started": started.isoformat(timespec="seconds"), "machine": machine_info(), "load_start": loadavg(),
           "turns": args.turns, "turn_seconds": args.turn_seconds, "configs": {c: CONFIGS[c] for c in configs},
           "threads": THREAD_ENV, "worker_env": args.worker_env or []}
    res["versions"] = bench.prepare(rows)
    res["source"] = bench.source
    res["rows"] = [bench.row(r, configs) for r in rows]
    if args.largest_batch:
        log(f"largest LLaMA batch under {args.limit_gib} GiB")
        res["largest"] = bench.largest(res["rows"], configs, args.limit_gib, args.largest_tries)
    res["load_end"] = loadavg()
    res["seconds"] = time.perf_counter() - t0
    return res


# -------------------------------------------------------------------------------------------------- report


def _mb(b) -> str:
    return "–" if b is None else f"{b / 2**20:,.0f}" if b >= 10 * 2**20 else f"{b / 2**20:.1f}"


def _num(x, digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _cell(r: dict | None, fmt) -> str:
    if not r:
        return "–"
    if r.get("status") == "n/a":
        return "n/a"
    if r.get("status") != "ok":
        return "error"
    return fmt(r)


def _ratio(r: dict, base: dict | None, key) -> str:
    """``key(r) / key(base)``; "–" when either is missing or the base is under 1 MB (noise: memory figures are in
    MB, a step under a millisecond is not measured here)."""
    if not base or base.get("status") != "ok" or r.get("status") != "ok":
        return "–"
    a, b = key(r), key(base)
    return f"{max(a, 0) / b:.2f}" if a is not None and b is not None and b >= 1 else "–"


def _time_ratio(r: dict, base: dict | None) -> float | None:
    """Step time of ``r`` over ``base``: the median over the turns of the ratio within each turn (the two ran in
    the same turn, so a load that drifts between turns cancels), or the ratio of the medians."""
    if not base or not r.get("step_ms") or not base.get("step_ms"):
        return None
    a, b = r.get("step_ms_turns") or [], base.get("step_ms_turns") or []
    if a and len(a) == len(b):
        return statistics.median(x / y for x, y in zip(a, b, strict=True))
    return r["step_ms"] / base["step_ms"]


def render(res: dict, json_path: str = "bench/results/memory.json") -> str:
    from report_format import table

    configs = list(res["configs"])
    rows = res["rows"]
    m, v = res["machine"], res["versions"]
    head = ["model (batch)", "step", *(SHORT[c] for c in configs)]
    step = {"adam": "Adam step", "grad": "forward + backward"}

    def matrix(fmt):
        return table(head, [[r["label"], step[r["step"]], *(_cell(r["cells"].get(c), fmt) for c in configs)]
                            for r in rows], "ll" + "r" * len(configs))

    def versus(r):
        base = r["cells"].get(BASE)

        def one(x):
            t = _time_ratio(x, base)
            return " / ".join([*(_ratio(x, base, k) for k in (
                lambda x: x["over_setup"], lambda x: x["total"],
                lambda x: x["saved_bytes"] / 2**20 if x.get("saved_bytes") is not None else None)),
                f"{t:.2f}" if t else "–"])

        return [one(r["cells"][c]) if r["cells"].get(c, {}).get("status") == "ok" else _cell(r["cells"].get(c), str)
                for c in configs]

    checks = [f"{r['label']}: {r['loss_check']['max_relative_deviation']:.0e} and "
              f"{r.get('loss_after_check', {}).get('max_relative_deviation', float('nan')):.0e}"
              for r in rows if "loss_check" in r]
    lines = [
        "<!-- memory:begin -->",
        "## Memory",
        "",
        (f"Written by `{res['command']}` ({res['mode']} run) on {res['started'][:10]}, in {res['seconds'] / 60:.1f} "
         f"minutes. Raw numbers: `{json_path}`; `python bench/memory.py --render {json_path} --write-docs` rewrites "
         "this section from them (bench/run.py rewrites the rest of this file and keeps it)."),
        "",
        table(["", ""], [
            ["machine", f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}"],
            ["load average (1, 5, 15 min)", (f"{res['load_start']} at the start, {res.get('load_end')} at the end "
             "(shared machine: other processes ran during the run)")],
            ["revgraph", f"commit {m['commit']}" + (
                f" with local changes under src/ (diff {res.get('source', {}).get('src_diff_sha1')}, "
                f"{res.get('source', {}).get('src_diff_lines')} lines: other work in progress in the shared tree)"
                if m.get("src_modified") else "")
             + (", copied when the run started (every cell runs the copy)" if res.get("source", {}).get("snapshot")
                else "") + f"; onnxruntime {v.get('onnxruntime')}, onnx {v.get('onnx')}, numpy {v.get('numpy')}, "
             f"Python {v.get('python')}"],
            ["PyTorch", f"{v.get('torch')}, transformers {v.get('transformers')}"],
            ["JAX", f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, optax {v.get('optax')}"],
        ], "ll"),
        "",
        ("**How it is measured.** Each cell is a fresh process running one framework with one intra-op thread "
         "(onnxruntime `threads=1`; `torch.set_num_threads(1)` and `set_num_interop_threads(1)`; XLA "
         "`--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`; `OMP_NUM_THREADS`, "
         "`MKL_NUM_THREADS`, `OPENBLAS_NUM_THREADS` = 1). It imports the framework (revgraph with onnx and "
         "onnxruntime; torch, plus transformers' LLaMA for the LLaMA; jax and optax), then `gc.collect()` and reads "
         "VmRSS: the **baseline**. It builds the model and its step (revgraph: the exported ONNX file read, the "
         "training graph built, the onnxruntime session made; PyTorch: the module built and the weights loaded, "
         "`torch.optim.Adam`; JAX: the weights on the device, `jit` of the whole step with the parameters and Adam "
         "state donated), runs one warm-up step (JAX compiles, onnxruntime plans, PyTorch's Adam creates its state), "
         "`gc.collect()`, resets the peak (5 into `/proc/self/clear_refs`), reads VmRSS (*before*), runs one step "
         "and reads VmHWM. **Over setup** = VmHWM − *before*: what the step itself adds. **Total** = the highest "
         "VmHWM of the process's life (setup, warm-up and step) − the baseline: everything the model and its "
         "training cost the process on top of the imported framework (parameters, optimizer state, graphs, "
         "sessions, compiled code, arenas and caches, the step). The imports themselves are not in it (RSS of "
         "the imported framework: revgraph "
         f"{_import_mb(rows, 'rg')}, PyTorch {_import_mb(rows, 'pt')}, JAX {_import_mb(rows, 'jax')} MB). "
         "MB = 2^20 bytes."),
        "",
        ("**Saved** is the bytes of the activations the backward pass keeps from the forward pass, the parameters "
         "and the batch left out: revgraph's `revgraph.autodiff.memory.saved_bytes` of the step graph (the forward "
         "values its backward nodes read, sized from the graph's types); PyTorch's tensors packed by "
         "`torch.autograd.graph.saved_tensors_hooks` during one more step, counted once per storage "
         "(`untyped_storage().data_ptr()`, the whole storage's bytes: a saved view keeps its storage), leaving "
         "out the parameters' and the batch's storages; under checkpointing, autograd packs nothing inside a block "
         "and the block's tensor arguments (what the checkpoint keeps) are counted by the wrapper that calls "
         "`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; JAX's "
         "`jax._src.ad_checkpoint.saved_residuals` of the loss (residuals of the jaxpr, before XLA fuses or "
         "schedules anything; arguments left out)."),
        "",
        f"**Step** time: every cell of a row stays alive after its measurement and the cells take {res['turns']} "
        f"turns of about {res['turn_seconds']} s of steps each (the first cell of a turn rotates); the median over "
        "the turns. **Checkpoint per block**: each LLaMA decoder layer (transformers' own hook with "
        "`torch.utils.checkpoint.checkpoint(use_reentrant=False)`), each Transformer encoder layer, each CNN "
        "residual block, and for the RNN each segment of 25 steps (the divisor of T nearest sqrt(T); a "
        "checkpoint per step would keep as much); JAX the same blocks under `jax.checkpoint` (the RNN a scan of "
        "checkpointed scans). Losses: cross-entropy (the LLaMA's over its 127 shifted positions: the exported "
        "module returns `logits[:, :-1]` and the labels are `input_ids[:, 1:]`). The first-step losses of each "
        "row agree across all cells, before the first update and after it (largest relative deviation from PyTorch "
        "eager's: " + "; ".join(checks) + ").",
        "",
        ("The LLaMA: `transformers.LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=256, "
         "intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, "
         "max_position_embeddings=128))` (688 = 256 x 11008 / 4096, transformers' default ratio; SDPA attention), "
         "exported once with `torch.onnx.export(dynamo=True, optimize=False, opset_version=23)` and a symbolic "
         "batch; JAX runs the same function written in `jax.numpy` on the same weights. The bench Transformer, "
         "CNN and RNN are bench/models.py's."),
        "",
        *_goals(res),
        "### Peak memory of a step (MB): over setup / total",
        "",
        matrix(lambda r: f"{max(r['over_setup'], 0):,.0f} / {r['total']:,.0f}"),
        "",
        "### Saved activations (MB)",
        "",
        ("JAX's cells add, in parentheses, the temporary buffer XLA's buffer assignment gives the compiled step "
         "(`compiled.memory_analysis().temp_size_in_bytes`: every intermediate of the step, the residuals among "
         "them)."),
        "",
        matrix(lambda r: _mb(r.get("saved_bytes")) + (f" ({_mb(r['xla_temp_bytes'])})" if "xla_temp_bytes" in r
                                                       else "")),
        "",
        "### Step time (ms, median of the turns)",
        "",
        matrix(lambda r: _num(r.get("step_ms"), 1 if (r.get("step_ms") or 0) < 100 else 0)),
        "",
        "### Against PyTorch eager: over setup / total / saved / step time",
        "",
        ("Each figure of the configuration over PyTorch eager's on the same row (below 1: less than PyTorch); the "
         "time ratio is the median over the turns of the ratio within a turn (a load that drifts between turns "
         "cancels). Ratios of figures under 1 MB are left out."),
        "",
        table(head, [[r["label"], step[r["step"]], *versus(r)] for r in rows], "ll" + "r" * len(configs)),
        "",
        "### Where the total goes (MB): built / first step / kept",
        "",
        ("*Built*: resident after building the model and its step, before any step (parameters, graphs, sessions, "
         "traced functions), over the baseline. *First step*: the peak of the warm-up step over the built model "
         "(includes JAX's compilation and onnxruntime's first run). *Kept*: resident after the warm-up step, over the "
         "baseline (optimizer state, arenas, compiled code, memory the allocator keeps): *over setup* starts from "
         "there, so an allocator that keeps the first step's memory shows a small *over setup* and a large *kept*."),
        "",
        matrix(lambda r: f"{r['built'] - r['import']:,.0f} / {r['first_step']:,.0f} / "
                         f"{r['setup_rss'] - r['import']:,.0f}"
               if "built" in r else "–"),
    ]
    na = sorted({f"{SHORT[c]}: {r['cells'][c].get('why')}" for r in rows for c in configs
                 if r["cells"].get(c, {}).get("status") == "n/a"})
    errors = sorted({f"{SHORT[c]} on {r['label']}: {r['cells'][c].get('why')}" for r in rows for c in configs
                     if r["cells"].get(c, {}).get("status") == "error"})
    if na:
        lines += ["", "n/a: " + "; ".join(na) + "."]
    if errors:
        lines += ["", "Errors: " + "; ".join(errors) + "."]
    if res.get("largest"):
        lines += ["", *_largest_section(res["largest"], configs)]
    if res.get("notes"):
        lines += ["", "### Observations", "", res["notes"].strip()]
    lines.append("<!-- memory:end -->")
    return "\n".join(lines) + "\n"


def _goals(res: dict) -> list[str]:
    """The measured goals of issue 24 (each row's figure against its target)."""
    from report_format import table

    out = []

    def ok(r, c):
        return r["cells"].get(c, {}).get("status") == "ok"

    for r in res["rows"]:
        if not (ok(r, "rg") and ok(r, BASE)):
            continue
        rg, pt = r["cells"]["rg"], r["cells"][BASE]
        for what, key in (("over setup", "over_setup"), ("total", "total")):
            if pt[key] < 1:  # under 1 MB: no ratio
                out.append([f"defaults: {what} <= 1.0x PyTorch eager", r["label"],
                            f"{max(rg[key], 0):.0f} vs {pt[key]:.0f} MB", _met(rg[key] <= 1)])
                continue
            x = max(rg[key], 0) / pt[key]
            out.append([f"defaults: {what} <= 1.0x PyTorch eager", r["label"], f"{x:.2f}x", _met(x <= 1.0)])
        if rg.get("saved_bytes") and pt.get("saved_bytes"):
            x = rg["saved_bytes"] / pt["saved_bytes"]
            out.append(["defaults: saved <= PyTorch's", r["label"], f"{x:.3f}x" if abs(x - 1) < 0.01 else f"{x:.2f}x",
                        _met(x <= 1.0)])
        half = r["cells"].get("rg-0.5", {})
        if half.get("status") == "ok" and half.get("saved_bytes") is not None and rg.get("saved_bytes"):
            s = half["saved_bytes"] / rg["saved_bytes"]
            t = _time_ratio(half, rg)
            out.append(["memory=0.5: saved <= 0.5x the default's at <= 1.25x its time", r["label"],
                        f"{s:.2f}x, time {t:.2f}x" if t else f"{s:.2f}x", _met(s <= 0.5 and (t or 0) <= 1.25)])
        else:
            out.append(["memory=0.5: saved <= 0.5x the default's at <= 1.25x its time", r["label"], "n/a", "–"])
    lg = (res.get("largest") or {}).get("configs", {})
    half, pt = lg.get("rg-0.5", {}).get("batch"), lg.get(BASE, {}).get("batch")
    if lg:
        out.append([(f"memory=0.5: largest LLaMA batch under {res['largest']['limit_gib']:g} GiB >= 2x PyTorch "
                     "eager's"), "LLaMA",
                    f"{half} vs {pt}" if half and pt else "n/a", _met(half >= 2 * pt) if half and pt else "–"])
    if not out:
        return []
    return ["### Goals of issue 24", "", table(["goal", "row", "now", "met?"], out, "llrl"), "",
            ("*Over setup* starts after the warm-up step: an allocator that keeps the first step's memory "
             "(onnxruntime's arena, on in revgraph's training default; glibc's heap) has little left to add in the "
             "measured step, so *total* is the figure to compare across frameworks (the last table shows what each "
             "keeps)."), ""]


def _met(b: bool) -> str:
    return "yes" if b else "**no**"


def _import_mb(rows, prefix) -> str:
    vals = [r["cells"][c]["import"] for r in rows for c in r["cells"]
            if c.split("-")[0] == prefix and r["cells"][c].get("import") is not None]
    return f"{min(vals):.0f}-{max(vals):.0f}" if vals else "–"


def _largest_section(lg: dict, configs: list[str]) -> list[str]:
    from report_format import table

    if "error" in lg:
        return [f"Largest batch: {lg['error']}."]
    rows = []
    for c in configs:
        e = lg["configs"].get(c, {})
        if e.get("status") != "ok":
            rows.append([CONFIGS[c], "n/a", "", "", "", ""])
            continue
        tries = ", ".join(f"{t['batch']}: {_num(t.get('total'))}" if t.get("status") == "ok" else
                          f"{t['batch']}: {t.get('status')}" for t in e["tries"]) or e.get("skipped", "–")
        rows.append([CONFIGS[c], f"{e['mb_per_sample']:.1f}", f"{e['predicted']:.0f}",
                     f"**{e['batch']}**" if e.get("batch") else "–", str(e.get("over", "–")), tries])
    runs = lg.get("runs") or ([{"command": lg["command"]}] if lg.get("command") else [])
    how = "; ".join(f"`{r['command']}`" for r in runs if r.get("command"))
    same = " with the same revgraph as its rows" if lg.get("source", {}).get("reused") else ""
    fr = lg.get("from_run")
    if fr:
        same += (f"). **This search ran on the LLaMA rows of another full run** (`{fr['json']}`, revgraph commit "
                 f"{fr['commit']}, {fr['started'][:10]}), whose line it starts from; that run's totals: " + "; ".join(
                     f"{k.split('-b')[-1]} sequences: revgraph default {fr['rows'][k].get('rg') or 0:,.0f}, PyTorch "
                     f"{fr['rows'][k].get('pt') or 0:,.0f} MB" for k in fr["rows"]) +
                 " (the tables above come from the run of this section")
    return [f"### Largest LLaMA batch under {lg['limit_gib']:g} GiB", "",
            (f"The line through the {lg['from'][0]} and {lg['from'][1]} rows' totals predicts the batch whose total "
             f"reaches {lg['limit_gib']:g} GiB = {lg['limit_gib'] * 1024:,.0f} MB; a fresh process runs its multiple "
             "of 8 below, and then, between the largest batch that fitted and the smallest that did not, the batch "
             "a secant through the nearest runs on either side predicts (a multiple of 8). *Largest* is the largest "
             "batch that ran under the limit, *over* the smallest that ran over it (the answer lies between; no "
             "bound: not found within the runs). Total memory is not linear in the batch at this range (onnxruntime's "
             "arena grows by chunks, allocators keep freed memory), so the prediction from small batches can be off "
             f"by hundreds of MB. The search took {lg['seconds'] / 60:.1f} minutes ({how}{same})."), "",
            table(["configuration", "MB per sequence (b8-b64 line)", "predicted", "largest", "over",
                   "runs (batch: total MB)"], rows, "lrrrrl")]


def write_docs(section: str, doc: Path = ROOT / "docs" / "benchmarks.md") -> None:
    import re

    text = doc.read_text() if doc.exists() else ""
    pattern = re.compile(r"<!-- memory:begin -->.*?<!-- memory:end -->\n?", re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)


def console_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    configs = list(res["configs"])
    t = Table(title="over setup / total MB, saved MB, step ms", title_justify="left")
    t.add_column("row")
    for c in configs:
        t.add_column(SHORT[c], justify="right")
    for r in res["rows"]:
        t.add_row(r["label"], *(_cell(r["cells"].get(c), lambda x: (
            f"{x['over_setup']:.0f} / {x['total']:.0f}\n{_mb(x.get('saved_bytes'))}\n{_num(x.get('step_ms'), 1)}"))
            for c in configs))
    Console().print(t)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true", help="small batches (LLaMA 2 and 8, bench models 8, RNN "
                        "T = 100), 1 turn: a few minutes")
    parser.add_argument("--models", nargs="+", choices=MODELS)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS))
    parser.add_argument("--turns", type=int)
    parser.add_argument("--turn-seconds", type=float)
    parser.add_argument("--largest-batch", action="store_true")
    parser.add_argument("--limit-gib", type=float, default=8.0)
    parser.add_argument("--largest-tries", type=int, default=3, help="runs per configuration in the search")
    parser.add_argument("--from", dest="from_json", metavar="JSON",
                        help="with --largest-batch: measure only the largest batches, from the LLaMA rows of saved "
                             "results (written back into them, or into --json)")
    parser.add_argument("--json")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--render", metavar="JSON", help="no measurement: render saved results")
    parser.add_argument("--largest-from", metavar="JSON", help="with --render: take the largest-batch search from "
                        "another run's results (stored, and labelled in the section)")
    parser.add_argument("--notes", metavar="MD", help="observations on these numbers (Markdown): stored in the JSON "
                        "and rendered at the end of the section")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "revgraph-bench-memory"),
                        help="model files and worker logs")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker call")
    parser.add_argument("--reserve-gib", type=float, default=4.0,
                        help="time the live cells of a row early when less memory than this is available")
    parser.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                        help="run the working tree's src/revgraph in each cell instead of a copy made at the start")
    parser.add_argument("--worker-env", nargs="+", metavar="KEY=VALUE",
                        help="more environment for the cells (e.g. MALLOC_MMAP_THRESHOLD_=131072)")
    args = parser.parse_args(argv)
    if args.turns is None:
        args.turns = 1 if args.quick else 5
    if args.turn_seconds is None:
        args.turn_seconds = 0.3 if args.quick else 1.0
    if args.render:
        res = json.loads(Path(args.render).read_text())
        json_path = args.render
    else:
        res = largest_only(args) if args.from_json else run(args)
        json_path = args.json or args.from_json or str(
            HERE / "results" / ("memory-quick.json" if args.quick else "memory.json"))
        from report_format import portable

        res = portable(res, {str(ROOT): "<repo>", str(Path(args.cache)): "<cache>", tempfile.gettempdir(): "<tmp>"})
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
        log(f"wrote {json_path}")
    if args.largest_from:  # the largest-batch search of another run (labelled as such in the section)
        other = json.loads(Path(args.largest_from).read_text())
        res["largest"] = {**other["largest"], "from_run": {
            "json": os.path.relpath(Path(args.largest_from).resolve(), ROOT), "commit": other["machine"]["commit"],
            "started": other["started"], "rows": {r["id"]: {c: x.get("total") for c, x in r["cells"].items()}
                                                  for r in other["rows"] if r["model"] == "llama"}}}
    if args.notes:  # observations written for these numbers, kept with them in the JSON
        res["notes"] = Path(args.notes).read_text()
    if args.notes or args.largest_from:
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
    console_table(res)
    if args.write_docs:
        rel = os.path.relpath(Path(json_path).resolve(), ROOT)
        write_docs(render(res, rel))
        log("wrote the Memory section of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
