"""The largest batch under a memory limit (issue 42, item 3): revgraph default, ``memory=0.5`` and ``memory=0``
against PyTorch eager and PyTorch with ``torch.utils.checkpoint`` per decoder layer, on the AdamW step of issue 42's
LLaMA (bench/llama42.py: hidden 256, 4 layers, 4 heads, 2 key/value heads, vocabulary 8000, 128 tokens a sequence).

    python bench/max_batch.py [--limit-gib 2] [--limit-kind as|rss] [--configs rg rg-0.5 rg-0 pt pt-ckpt]
                              [--start 16] [--resolution 4] [--steps 2] [--json FILE]
    python bench/max_batch.py --render bench/results/max_batch.json   # the table of saved results

A *probe* (configuration, batch) is a fresh process (``python bench/max_batch.py --probe CONFIG BATCH``) on one
thread that imports its framework and runs a toy step (bench/memory_worker.py's, so one-time initialisation is
not charged), then sets its address-space limit, ``RLIMIT_AS`` = its address space now (VmSize) + ``--limit-gib``,
and builds the step (revgraph: the training graph and its onnxruntime session; PyTorch: the module, the weights,
AdamW) and runs ``--steps`` steps at that batch. It passes when the steps finish with finite losses; an
allocation that fails (``MemoryError``, onnxruntime's or PyTorch's allocator errors, an abort) fails it. So each
side gets the same address space beyond its imported framework (PyTorch and transformers reserve ~920 MB of
address space at import, revgraph ~230 MB: an absolute limit would charge that to PyTorch).

The search per configuration: the batch doubles from ``--start`` until a probe fails (or passes ``--max-batch``),
then bisects between the largest pass and the smallest failure until they are ``--resolution`` apart. Passing
probes also report their peak resident set (VmHWM) and peak address space (VmPeak) over the imported base: the
address space can run ahead of what is resident (onnxruntime's arena and glibc reserve more than they touch).
``--limit-kind rss`` limits that peak resident set instead: a probe passes when its steps finish and VmHWM less
VmRSS after the import stays under ``--limit-gib`` (with a backstop RLIMIT_AS of three times the limit; a thread
stops the probe as soon as the peak passes the limit).

Every probe runs a copy of src/revgraph made when the run starts (the working tree is shared). Results: ``--json``
(default bench/results/max_batch.json); the table and the goals of issue 42 (revgraph default >= PyTorch eager,
revgraph ``memory=0.5`` >= PyTorch checkpointed) are printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import llama42
from memory_common import peak_mb, rss_mb, status_kb
from workers import Log

LABELS = {"rg": "revgraph default", "rg-0.5": "revgraph memory=0.5", "rg-0": "revgraph memory=0",
          "pt": "PyTorch eager", "pt-ckpt": "PyTorch, checkpoint per layer"}
GOALS = (("rg", "pt"), ("rg-0.5", "pt-ckpt"))
KINDS = {"rss": "peak resident set: VmHWM - VmRSS after the import <= the limit",
         "as": "address space: RLIMIT_AS = VmSize after the import + the limit"}
log = Log()


def probe(config: str, batch: int, limit_gib: float, steps: int, cache: str, kind: str = "as") -> dict:
    """The probe of the module doc, in this process; returns what it measured (``ok`` False with the error).
    ``kind``: ``"as"`` (the address-space limit) or ``"rss"`` (the peak resident set, with a backstop
    address-space limit of 3x ``limit_gib`` so that a large batch cannot take the shared machine's memory)."""
    llama42.framework_import(config)
    base_vm, base_rss = status_kb("VmSize") / 1024, rss_mb()
    limit = int((base_vm + limit_gib * 1024 * (3 if kind == "rss" else 1)) * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    import revgraph

    out = {"config": config, "batch": batch, "base_vm_mb": base_vm, "base_rss_mb": base_rss,
           "revgraph": os.path.dirname(revgraph.__file__)}
    if kind == "rss":
        _watch(out, limit_gib * 1024)
    try:
        info = json.loads((Path(cache) / "llama42.json").read_text())
        task = llama42.Step(config, batch, 1, info)
        out["losses"] = [task.step() for _ in range(steps)]
    except BaseException as exc:  # noqa: BLE001 - any failure under the limit fails the probe
        lines = str(exc).strip().splitlines()
        return {**out, "ok": False, "error": f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]}
    out["peak_rss_mb"] = peak_mb() - base_rss
    out["peak_vm_mb"] = status_kb("VmPeak") / 1024 - base_vm
    out["ok"] = all(math.isfinite(x) for x in out["losses"])
    if kind == "rss" and out["peak_rss_mb"] > limit_gib * 1024:
        out.update(ok=False, error=f"peak RSS +{out['peak_rss_mb']:.0f} MB over the limit")
    return out


def _watch(out: dict, limit_mb: float) -> None:
    """Under a resident-set limit, end the probe as soon as its peak passes the limit (a thread polling VmHWM
    every 0.1 s): a batch over the limit need not finish its steps (``memory=0`` runs minutes at large batches)."""
    import threading

    def poll():
        while True:
            over = peak_mb() - out["base_rss_mb"]
            if over > limit_mb:
                print(json.dumps({**out, "ok": False, "error": f"peak RSS +{over:.0f} MB over the limit (stopped)"}),
                      flush=True)
                os._exit(0)
            time.sleep(0.1)

    threading.Thread(target=poll, daemon=True).start()


class Search:
    """Runs probes in fresh processes (a copy of src/revgraph first on their path) and searches the batch."""

    def __init__(self, args):
        self.args = args
        self.logs = Path(args.cache) / "logs" / dt.datetime.now().strftime("max-batch-%Y%m%d-%H%M%S")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **llama42.thread_env(1)}
        self.source, self.kind = {"snapshot": None}, "as"
        if args.snapshot:
            import shutil

            dst = self.logs / "src"
            shutil.copytree(ROOT / "src" / "revgraph", dst / "revgraph", ignore=shutil.ignore_patterns("__pycache__"))
            self.env["PYTHONPATH"] = str(dst) + os.pathsep + os.environ.get("PYTHONPATH", "")
            self.source = {"snapshot": str(dst), "commit": _git("rev-parse", "--short", "HEAD"),
                           "src_diff_lines": _git("diff", "HEAD", "--", "src").count("\n")}

    def run_probe(self, config: str, batch: int) -> dict:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", config, str(batch), "--limit-gib",
               str(self.args.limit_gib), "--limit-kind", self.kind, "--steps", str(self.args.steps),
               "--cache", str(self.args.cache)]
        t0 = time.perf_counter()
        with open(self.logs / f"{self.kind}-{config}-b{batch}.log", "w") as err:
            try:
                p = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=err, text=True, env=self.env,
                                   timeout=self.args.timeout, cwd=str(ROOT))
                lines = p.stdout.strip().splitlines()
                r = json.loads(lines[-1]) if lines and p.returncode == 0 else {
                    "ok": False, "error": f"exit code {p.returncode} (see {err.name})"}
            except subprocess.TimeoutExpired:
                r = {"ok": False, "error": f"timed out after {self.args.timeout:.0f} s", "timeout": True}
        r.update(config=config, batch=batch, seconds=time.perf_counter() - t0)
        how = (f"ok, peak RSS +{r['peak_rss_mb']:.0f} MB, address space +{r['peak_vm_mb']:.0f} MB" if r["ok"]
               else f"fails: {r['error']}")
        log(f"  {self.kind}: {config} batch {batch}: {how} ({r['seconds']:.0f} s)")
        return r

    def largest(self, config: str) -> dict:
        """Doubling from ``--start``, then bisection (module doc)."""
        a, probes = self.args, []
        passed, failed, b = 0, None, a.start
        while failed is None and b <= a.max_batch:
            probes.append(self.run_probe(config, b))
            if probes[-1]["ok"]:
                passed, b = b, b * 2
            else:
                failed = b
        while failed is not None and failed - passed > a.resolution:
            mid = (passed + failed) // 2
            probes.append(self.run_probe(config, mid))
            passed, failed = (mid, failed) if probes[-1]["ok"] else (passed, mid)
        best = next((p for p in probes if p["ok"] and p["batch"] == passed), None)
        return {"largest": passed, "smallest_failing": failed, "probes": probes,
                "peak_rss_mb": best and best["peak_rss_mb"], "peak_vm_mb": best and best["peak_vm_mb"],
                "failure": next((p["error"] for p in probes if p["batch"] == failed), None)}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=False, capture_output=True, text=True, cwd=ROOT).stdout.strip()


def table(res: dict) -> str:
    """The Markdown tables of a run (one per kind of limit) and the goals' verdicts."""
    lines = []
    head = ("| configuration | largest batch | first failing batch | peak RSS at the largest (MB over import) | "
            "peak address space (MB over import) | probes | seconds |")
    for run in res["kinds"].values():
        lines += [f"Limit on the {run['limit']} ({res['limit_gib']} GiB):", "", head, "| :--- |" + " ---: |" * 6]
        for c, r in run["results"].items():
            stopped = " (search stopped)" if r.get("stopped") else ""
            lines.append(f"| {LABELS[c]} | {r['largest'] or 'none'}{stopped} | {r['smallest_failing'] or '> max'} | "
                         f"{_mb(r['peak_rss_mb'])} | {_mb(r['peak_vm_mb'])} | {len(r['probes'])} | "
                         f"{sum(p['seconds'] for p in r['probes']):.0f} |")
        lines.append("")
        for (a, b), ok in zip(GOALS, run["goals"].values(), strict=True):
            if ok is not None:
                lines.append(f"- {LABELS[a]} >= {LABELS[b]}: {run['results'][a]['largest']} vs "
                             f"{run['results'][b]['largest']}: {'met' if ok else 'NOT met'}")
        lines.append("")
    return "\n".join(lines).rstrip()


def _mb(x) -> str:
    return "" if x is None else f"{x:,.0f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--limit-gib", type=float, default=2.0, help="address space a probe may add to its "
                        "imported framework's (GiB)")
    parser.add_argument("--limit-kind", nargs="+", choices=("rss", "as"), default=["rss", "as"],
                        help="rss: the probe's peak resident set (VmHWM) over its import must stay under the limit; "
                        "as: RLIMIT_AS (an allocation over it fails); one search per kind (default: both)")
    parser.add_argument("--configs", nargs="+", choices=list(LABELS), default=list(LABELS))
    parser.add_argument("--start", type=int, default=16, help="the first batch tried")
    parser.add_argument("--max-batch", type=int, default=1024, help="stop doubling above this batch")
    parser.add_argument("--resolution", type=int, default=4, help="bisect until the largest pass and the smallest "
                        "failure are this close")
    parser.add_argument("--steps", type=int, default=2, help="training steps a probe runs")
    llama42.common_options(parser, "max_batch.json", timeout=600.0)
    parser.add_argument("--probe", nargs=2, metavar=("CONFIG", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("start", "max_batch", "resolution", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} takes a positive integer, not {getattr(args, name)}")
    if args.limit_gib <= 0:
        parser.error(f"--limit-gib takes a positive number of GiB, not {args.limit_gib}")
    if args.render:
        print(table(json.loads(Path(args.render).read_text())))
        return 0
    if args.probe:
        config, batch = args.probe
        print(json.dumps(probe(config, int(batch), args.limit_gib, args.steps, args.cache, args.limit_kind[0])),
              flush=True)
        return 0
    from run import loadavg, machine_info

    t0 = time.perf_counter()
    search = Search(args)
    prep = subprocess.run([sys.executable, "-c", f"import llama42; llama42.prepare({str(args.cache)!r})"],
                          cwd=str(HERE), env=search.env, capture_output=True, text=True, check=False)
    if prep.returncode:
        sys.exit(f"max_batch: could not write the model files into {args.cache}: {prep.stderr.strip()[-300:]}")
    res = {"command": "python bench/max_batch.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "started": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
           "load_start": loadavg(), "limit_gib": args.limit_gib, "steps": args.steps, "threads": 1,
           "model": {**llama42.LLAMA, "seq": llama42.SEQ}, "source": search.source, "kinds": {}}
    for kind in args.limit_kind:
        search.kind, found, t1 = kind, {}, time.perf_counter()
        for config in args.configs:
            log(f"{LABELS[config]} under {args.limit_gib} GiB ({kind})")
            found[config] = search.largest(config)
        res["kinds"][kind] = {"limit": KINDS[kind], "results": found, "seconds": time.perf_counter() - t1,
                              "goals": {f"{a} >= {b}": (found[a]["largest"] >= found[b]["largest"]
                                                        if a in found and b in found else None) for a, b in GOALS}}
    res["load_end"], res["seconds"] = loadavg(), time.perf_counter() - t0
    llama42.save_results(res, args.json, args.cache, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
