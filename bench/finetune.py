"""Fine-tuning a causal LM with revgraph against PyTorch + PEFT (issue 38): the LLaMA of bench/finetune_worker.py
(4 layers, hidden 256, grouped-query attention, vocabulary 8000), full fine-tune and LoRA, at 1 and 2 threads.

    python bench/finetune.py [--quick] [--steps 100] [--threads 1 2] [--modes full lora] [--json FILE] [--write-docs]
    python bench/finetune.py --render bench/results/finetune.json --write-docs   # the docs section from saved numbers

For every (mode, threads) pair two fresh processes run the same fine-tune (bench/finetune_worker.py: same initial
weights and adapters, same batches in the same order, AdamW with a cosine schedule, warm-up and clipping), one
revgraph (``rg.Trainer.fit``), one PyTorch (+ PEFT for LoRA). They are started one after the other (which side
starts first alternates from pair to pair) and the second starts only when the first has finished its first step,
so each one's **time to the first step** (from the moment the orchestrator starts the process: interpreter,
imports, model files read, training graph or module built, one step) is measured with the other idle. Then they
take **turns**: a block of ``--block`` steps of one, then a block of the other (the side that goes first in a round
alternates), until both have run ``--steps`` steps. Reported per pair:

* **loss**: the largest ``|loss_rg - loss_torch|`` over the steps (the same batch at every step), and the losses
  at the first and last step;
* **step time**: the median seconds per step over the steps after the first ``--warmup`` (each step timed inside
  its process, from the end of the previous step; with the process's CPU seconds over those wall seconds, which
  says how many cores each side had), and the ratio revgraph / PyTorch as the median over the rounds
  of the ratio of the two sides' median steps in that round (a load that drifts between rounds cancels);
* **peak memory**: VmHWM of each process at the end (its peak resident set over its whole life, imports
  included), and that peak less VmRSS after the imports (what the model and its training added);

and, once, the peak memory (``ru_maxrss`` of the finished child, from ``os.wait4``) of ``revgraph train`` on the
same ONNX file and tokens: without evaluation, with ``--eval-data tokens.npz`` (evaluation batch = training
batch), and with ``--eval-batch-size 512`` (what every run cost before issue 38: the whole training set evaluated
at batch 512).

Every revgraph process runs a copy of src/revgraph made when the run starts: the committed one (``git archive
HEAD``; ``--working-tree``: the files as they are), since the working tree is shared and edited meanwhile. Results
go to ``--json`` (default bench/results/finetune.json, finetune-quick.json with ``--quick``); ``--write-docs`` puts
the section into docs/benchmarks.md between ``<!-- finetune:begin -->`` and ``<!-- finetune:end -->``
(bench/finetune_report.py). ``--quick``: 12 steps, blocks of 3, 2 threads, LoRA and full, no CLI runs (a check
that it all runs, about 2 minutes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import finetune_report
from finetune_worker import BATCH, LLAMA, LR, SEQ, WARMUP
from workers import Log

WORKER = HERE / "finetune_worker.py"
log = Log()


class Side:
    """One fine-tuning process of bench/finetune_worker.py and its protocol (that module's doc)."""

    def __init__(self, side: str, mode: str, threads: int, args, env: dict, logs: Path):
        self.side = side
        self.stderr = open(logs / f"{mode}-t{threads}-{side}.log", "w")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, str(WORKER), "run", side, mode, "--cache", str(args.cache), "--threads", str(threads),
               "--steps", str(args.steps), "--block", str(args.block)]
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env, cwd=str(ROOT))
        self.timeout = args.timeout

    def read(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"the {self.side} worker stopped or timed out (exit {self.proc.wait()}); see "
                               f"{self.stderr.name}")
        return json.loads(line)

    def go(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()


def run_pair(mode: str, threads: int, first: str, args, env: dict, logs: Path) -> dict:
    """The two sides of one (mode, threads) pair, started in turn and then timed in turns (module doc)."""
    order = [first, "torch" if first == "rg" else "rg"]
    sides, out = {}, {}
    load_start = loadavg()
    try:
        for s in order:  # the second starts when the first has finished its first step (and waits for a go)
            sides[s] = Side(s, mode, threads, args, env, logs)
            msg = sides[s].read()
            marks = msg["marks"]
            out[s] = {"started_first": s == first, "to_first_step_s": marks["first_step"] - sides[s].started,
                      "phases_s": {"interpreter": marks["main"] - sides[s].started,
                                   "import": marks["imported"] - marks["main"],
                                   "build": marks["built"] - marks["imported"],
                                   "first step": marks["first_step"] - marks["built"]},
                      "import_rss_mb": marks["import_rss_mb"], "built_rss_mb": marks["built_rss_mb"],
                      "build_peak_mb": marks["build_peak_mb"], "first_step_peak_mb": msg["peak_mb"],
                      "losses": [msg["loss"]], "times": [msg["step_s"]], "cpu": [None], "rounds": []}
            log(f"{mode}, {threads} thread(s), {s}: first step {out[s]['to_first_step_s']:.1f} s after start, "
                f"loss {msg['loss']:.5f}")
        done = 1
        turn = 0
        while done < args.steps:
            for s in (order if turn % 2 == 0 else order[::-1]):
                msg = sides[s].go()
                out[s]["losses"] += msg["losses"]
                out[s]["times"] += msg["times"]
                out[s]["cpu"] += msg["cpu"]
                out[s]["rounds"].append(msg["times"])
            done = len(out[order[0]]["losses"])
            turn += 1
            log(f"  step {done}: loss rg {out['rg']['losses'][-1]:.5f}, torch {out['torch']['losses'][-1]:.5f}; "
                f"last block ms/step rg {1e3 * statistics.median(out['rg']['rounds'][-1]):.0f}, "
                f"torch {1e3 * statistics.median(out['torch']['rounds'][-1]):.0f}")
        for s in order:
            msg = sides[s].read()
            assert msg["event"] == "done", msg
            out[s].update(peak_mb=msg["peak_mb"], end_rss_mb=msg["rss_mb"])
            sides[s].proc.wait(timeout=60)
    finally:
        for side in sides.values():
            side.close()
    return {"mode": mode, "threads": threads, "first": first, "load_start": load_start, "load_end": loadavg(),
            **out, **summarize(out, args.warmup, args.block)}


def summarize(out: dict, warmup: int, block: int) -> dict:
    """Loss agreement, step times and ratios, memory ratios of one pair (module doc)."""
    rg, pt = out["rg"], out["torch"]
    diffs = [abs(a - b) for a, b in zip(rg["losses"], pt["losses"], strict=True)]
    # rounds with a warm-up step left out (step 1 is no round's: round i has steps 2 + i * block ...)
    skip = max(0, (warmup - 1 + block - 1) // block)
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(rg["rounds"], pt["rounds"], strict=True)]
    kept = ratios[skip:] or ratios
    return {"max_abs_loss_diff": max(diffs), "max_abs_loss_diff_step": diffs.index(max(diffs)) + 1,
            "step_ms": {s: 1e3 * statistics.median(out[s]["times"][1 + skip * block:] or out[s]["times"])
                        for s in ("rg", "torch")},
            "step_ratio": statistics.median(kept),
            # CPU seconds over wall seconds of those steps: 1 thread should read 1.0, 2 threads up to 2.0
            "cpu_per_wall": {s: sum(out[s]["cpu"][1 + skip * block:]) / sum(out[s]["times"][1 + skip * block:])
                             for s in ("rg", "torch")}, "round_ratios": ratios, "rounds_used": len(kept),
            "peak_ratio": rg["peak_mb"] / pt["peak_mb"],
            "peak_over_import_ratio": (rg["peak_mb"] - rg["import_rss_mb"]) / (pt["peak_mb"] - pt["import_rss_mb"]),
            "to_first_step_ratio": rg["to_first_step_s"] / pt["to_first_step_s"]}


def cli_memory(args, env: dict, logs: Path) -> list[dict]:
    """Peak memory of ``revgraph train`` in fresh processes: no evaluation, --eval-data at the training batch,
    and at batch 512 (module doc)."""
    cache = args.cache
    base = [sys.executable, "-m", "revgraph", "train", str(cache / "llama.onnx"), "--data", str(cache / "tokens.npz"),
            "--loss", "causal-lm", "--optimizer", "adamw", "--lr", str(LR["full"]), "--lr-schedule", "cosine",
            "--warmup-steps", str(WARMUP), "--clip-grad-norm", "1.0", "--batch-size", str(BATCH),
            "--max-steps", str(args.cli_steps), "--no-shuffle", "--threads", str(max(args.threads))]
    variants = [("no evaluation", []),
                (f"--eval-data tokens.npz (evaluation batch {BATCH})", ["--eval-data", str(cache / "tokens.npz")]),
                ("--eval-data tokens.npz --eval-batch-size 512 (the old default's evaluation)",
                 ["--eval-data", str(cache / "tokens.npz"), "--eval-batch-size", "512"])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (label, extra) in enumerate(variants):
            cmd = [*base, *extra, "-o", os.path.join(tmp, f"out{k}.onnx")]
            with open(logs / f"cli-{k}.log", "w") as f:
                t0 = time.perf_counter()
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp)
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"revgraph train ({label}) exited {proc.returncode}; see {logs / f'cli-{k}.log'}")
            rows.append({"label": label, "args": extra, "peak_mb": usage.ru_maxrss / 1024, "wall_s": wall})
            log(f"revgraph train, {label}: peak {usage.ru_maxrss / 1024:,.0f} MB, {wall:.1f} s")
    return rows


def snapshot(logs: Path, env: dict, working_tree: bool) -> dict:
    """Put a copy of src/revgraph first on the workers' path, so that the whole run measures one revgraph while
    the shared working tree is edited: the committed one (``git archive HEAD``), or the working tree's files."""
    dst = logs / "src"
    if working_tree:
        shutil.copytree(ROOT / "src" / "revgraph", dst / "revgraph", ignore=shutil.ignore_patterns("__pycache__"))
    else:
        dst.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "HEAD", "src/revgraph"], capture_output=True, check=True,
                                 cwd=ROOT).stdout
        subprocess.run(["tar", "-x", "--strip-components=1", "-C", str(dst)], input=archive, check=True)
    env["PYTHONPATH"] = str(dst) + os.pathsep + os.environ.get("PYTHONPATH", "")
    diff = subprocess.run(["git", "diff", "HEAD", "--stat", "--", "src"], capture_output=True, text=True, check=False,
                          cwd=ROOT).stdout.strip()
    return {"snapshot": str(dst), "working_tree": working_tree,
            "src_diff": (diff.splitlines()[-1] if diff else None) if working_tree else None}


def wait_quiet(limit: float, most_s: float) -> list[float]:
    """Wait (a minute at a time, at most ``most_s`` seconds) until the 1-minute load average is under ``limit``."""
    t0 = time.time()
    while loadavg()[0] >= limit and time.time() - t0 < most_s:
        log(f"load average {loadavg()}: waiting for a quieter moment")
        time.sleep(60)
    return loadavg()


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def versions() -> dict:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in ("numpy", "onnx", "onnxruntime", "torch", "transformers", "peft"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 steps, blocks of 3, 2 threads, no CLI runs")
    parser.add_argument("--steps", type=int, help="steps per run (default 100; --quick 12)")
    parser.add_argument("--block", type=int, help="steps per turn (default 5; --quick 3)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the step times (default 10)")
    parser.add_argument("--threads", type=int, nargs="+", help="thread counts (default 1 2; --quick 2)")
    parser.add_argument("--modes", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    parser.add_argument("--cli-steps", type=int, default=20, help="steps of each revgraph train run (default 20)")
    parser.add_argument("--no-cli", dest="cli", action="store_false", help="skip the revgraph train memory runs")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "revgraph-bench-finetune",
                        help="where the model files are written once and the logs go")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one block (default 600)")
    parser.add_argument("--wait-load", type=float, default=0.0,
                        help="before measuring, wait (up to 15 min) until the 1-minute load average is under this")
    parser.add_argument("--working-tree", action="store_true",
                        help="measure src/revgraph as it is in the working tree (default: as committed, HEAD)")
    parser.add_argument("--json", help="results file (default bench/results/finetune[-quick].json)")
    parser.add_argument("--write-docs", action="store_true", help="write the section into docs/benchmarks.md")
    parser.add_argument("--render", metavar="JSON", help="only render the docs section from saved results")
    parser.add_argument("--notes", metavar="MD", help="observations on these numbers (Markdown), stored in the JSON "
                                                      "and rendered as the section's last part")
    args = parser.parse_args(argv)
    doc = ROOT / "docs" / "benchmarks.md"
    if args.render:
        res = json.loads(Path(args.render).read_text())
        if args.notes:  # kept with the numbers they describe
            res["notes"] = Path(args.notes).read_text()
            Path(args.render).write_text(json.dumps(res, indent=1) + "\n")
        text = finetune_report.render(res, os.path.relpath(Path(args.render).resolve(), ROOT))
        finetune_report.write_section(doc, text) if args.write_docs else print(text)
        return 0
    args.steps = args.steps or (12 if args.quick else 100)
    args.block = args.block or (3 if args.quick else 5)
    args.threads = args.threads or ([2] if args.quick else [1, 2])
    args.cli = args.cli and not args.quick
    if args.quick:
        args.warmup = min(args.warmup, 3)
    json_path = Path(args.json or HERE / "results" / f"finetune{'-quick' if args.quick else ''}.json")
    started = dt.datetime.now()
    logs = args.cache / "logs" / started.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONWARNINGS": "ignore"}
    source = snapshot(logs, env, args.working_tree)
    prep = subprocess.run([sys.executable, str(WORKER), "prepare", "--cache", str(args.cache)], env=env, check=False,
                          capture_output=True, text=True, cwd=str(ROOT))
    if prep.returncode != 0:
        sys.stderr.write(prep.stderr[-3000:])
        return 1
    model = json.loads(prep.stdout)
    log(f"model files in {args.cache}: {model}")
    load_before = loadavg()
    if args.wait_load:
        wait_quiet(args.wait_load, 900)
    from run import machine_info

    res = {"started": started.isoformat(timespec="seconds"), "command": " ".join(["python", "bench/finetune.py",
                                                                                  *(argv or sys.argv[1:])]),
           "machine": machine_info(), "versions": versions(), "source": source, "model": model,
           "config": {"llama": LLAMA, "seq": SEQ, "batch": BATCH, "lr": LR, "warmup_steps": WARMUP,
                      "steps": args.steps, "block": args.block, "warmup": args.warmup},
           "load_before_wait": load_before, "load_start": loadavg(), "pairs": []}
    k = 0
    for threads in args.threads:
        for mode in args.modes:
            thread_env = {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                          "OPENBLAS_NUM_THREADS": str(threads)}
            res["pairs"].append(run_pair(mode, threads, "rg" if k % 2 == 0 else "torch", args, thread_env, logs))
            p = res["pairs"][-1]
            log(f"{mode}, {threads} thread(s): max |dloss| {p['max_abs_loss_diff']:.2e}, step ratio "
                f"{p['step_ratio']:.2f}, peak ratio {p['peak_ratio']:.2f}, first step ratio "
                f"{p['to_first_step_ratio']:.2f}")
            k += 1
    if args.cli:
        res["cli"] = {"threads": max(args.threads), "steps": args.cli_steps, "runs": cli_memory(args, env, logs)}
    res["load_end"] = loadavg()
    if args.notes:
        res["notes"] = Path(args.notes).read_text()
    res["minutes"] = round((dt.datetime.now() - started).total_seconds() / 60, 1)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(res, indent=1) + "\n")
    log(f"results in {json_path}")
    if args.write_docs:
        finetune_report.write_section(doc, finetune_report.render(res, os.path.relpath(json_path.resolve(), ROOT)))
        log(f"section written to {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
