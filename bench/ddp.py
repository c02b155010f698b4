"""Data-parallel training throughput: revgraph on torch.distributed against PyTorch DDP, side by side.

    python bench/ddp.py [--quick] [--turns N] [--batch B] [--commit REV] [--doc docs/benchmarks.md] [--json FILE]
    python bench/ddp.py --render bench/results/ddp.json     # rewrite the doc section from saved numbers
    python bench/ddp.py --profile ...                       # also timelines, hidden exchange, modelled scaling
    python bench/ddp.py --render-overlap bench/results/ddp-timeline.json   # rewrite that section
    python bench/ddp.py --memory [--quick]                   # memory per rank, sharded (bench/ddp_memory.py)

What is measured: training throughput, in samples per second of the global batch, of five models
(bench/ddp_models.py: the demo MLP and the demo recurrent classifier with an ONNX ``Loop`` on the digits, an
embedding table of 2048 x 64 updated by sparse rows on random tokens, a 2-layer Transformer encoder and a wide
MLP 64-1024-1024-10), trained with Adam and cross-entropy:

- revgraph, 1 process: ``rg.Trainer(model, "cross-entropy", "adam", threads=1)`` (the fused step graph);
- revgraph, 2 processes: the same with ``distributed=True`` (grad graph, gloo all-reduce of the gradients
  and all-gather of the sparse rows, update graph);
- PyTorch, 1 process: the same model in torch (same shapes, same initial values, ``torch.optim.Adam``; for the
  embedding ``nn.Embedding(sparse=True)`` with ``SparseAdam``), ``torch.set_num_threads(1)``;
- PyTorch, 2 processes: the same wrapped in ``DistributedDataParallel`` on gloo.

Each process uses one thread and the same per-process batch (``--batch``, default 64), so a step of 2
processes trains on twice the samples. The machine has 2 cores: 2 processes x 1 thread use both. Every
configuration is its own ``python -m torch.distributed.run --standalone --nproc-per-node N
bench/ddp_worker.py ...`` launch; graph build, session creation and 20 warm-up steps are not timed; a fixed
number of steps is (bench/ddp_worker.py). The launches take turns: within a turn, for each model and each
process count, revgraph and PyTorch run one after the other (who goes first alternates between turns). A
reported throughput is the median over turns; a ratio is the ratio of two medians. The full run adds
revgraph's and PyTorch's distributed paths in 1 process (the cost of the split step and of DDP) and the
embedding with dense gradients in PyTorch (``nn.Embedding`` + ``Adam``). Finally one profiled revgraph launch
per model and process count times the phases of a step (bench/ddp_worker.py ``--profile``), and (full run)
one more at 2 processes runs onnxruntime's profiler on the grad and update graphs (``--ort-profile``).
``--profile`` adds timeline launches at 2 processes (bench/ddp_worker.py ``--timeline``: every model, the
Transformer with 0.05 MiB buckets with and without overlap, the wide MLP without overlap and in bf16): rank 0's
timeline of segment runs and bucket all-reduces, how much all-reduce time the backward pass hid, and the modelled
scaling of a 100M-parameter model to 8 and 64 GPUs (bench/ddp_scaling.py) into
``bench/results/ddp-timeline[-quick].json`` and the ``<!-- ddp-overlap:begin -->`` section of docs/benchmarks.md.

Writes the numbers to ``bench/results/ddp.json`` (``--quick``: ``ddp-quick.json``) and, for a full run, a
section of docs/benchmarks.md between ``<!-- ddp:begin -->`` and ``<!-- ddp:end -->`` (bench/ddp_report.py).
``--commit REV`` measures revgraph as committed at REV (its ``src/`` extracted with ``git archive`` into a
temporary folder that every process imports), not the working tree that others may be editing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import ddp_models
import ddp_report

# Timed steps per model with 1 and with 2 processes: a timed window of about 1-3 s in each configuration.
FULL_STEPS = {"mlp": {1: 5000, 2: 1000}, "rnn": {1: 1000, 2: 500}, "embed": {1: 2000, 2: 300},
              "transformer": {1: 200, 2: 100}, "wide": {1: 200, 2: 100}}
QUICK_STEPS = {"mlp": {1: 1000, 2: 200}, "rnn": {1: 200, 2: 100}, "embed": {1: 400, 2: 100},
               "transformer": {1: 50, 2: 50}, "wide": {1: 50, 2: 50}}
#: --profile: the timeline launches (2 processes, revgraph): (label, model, extra worker arguments). The
#: Transformer with 0.05 MiB buckets (about 9 buckets) gives the measured compute curve of the scaling model
#: and, against the same run without overlap, the cost of cutting the grad graph into segments.
TIMELINES = [(m, m, ["--overlap", "on"]) for m in ddp_models.MODELS] + [
    ("transformer, 0.05 MiB buckets", "transformer", ["--bucket-mb", "0.05", "--overlap", "on"]),
    ("transformer, 0.05 MiB buckets, no overlap", "transformer", ["--bucket-mb", "0.05", "--overlap", "off"]),
    ("wide, no overlap", "wide", ["--overlap", "off"]),
    ("wide, bf16 reduce", "wide", ["--reduce-dtype", "bf16", "--overlap", "on"])]
CURVE, CURVE_OFF = "transformer, 0.05 MiB buckets", "transformer, 0.05 MiB buckets, no overlap"
OVERLAP_BEGIN, OVERLAP_END = "<!-- ddp-overlap:begin -->", "<!-- ddp-overlap:end -->"
WARMUP = 20


def configs(quick: bool) -> list[tuple[str, str, int, list[tuple[str, dict]]]]:
    """``(model, mode, processes, [(framework, extra worker args)...])`` in the order of a turn."""
    out = []
    for m in ddp_models.MODELS:
        pairs = [("single", 1), ("ddp", 2)] if quick else [("single", 1), ("ddp", 1), ("ddp", 2)]
        for mode, n in pairs:
            runs = [("revgraph", {}), ("torch", {})]
            if m == "embed" and not quick:
                runs.append(("torch-dense", {"--torch-embed": "dense"}))
            out.append((m, mode, n, runs))
    return out


def key(model: str, framework: str, mode: str, n: int) -> str:
    return f"{model}/{framework}/{mode}/{n}"


def launch(worker_args: list[str], n: int, env: dict, timeout: float, log) -> dict | None:
    """One torchrun launch of bench/ddp_worker.py in ``n`` processes; its JSON answer, or None (logged)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    out.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           str(HERE / "ddp_worker.py"), *worker_args, "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launch we started, and its workers
        text, _ = proc.communicate()
        text += f"\n(stopped after {timeout:.0f} s)"
    if proc.returncode == 0 and out.exists():
        answer = json.loads(out.read_text())
        out.unlink()
        return answer
    log.write(f"$ {' '.join(cmd)}\n{text[-4000:]}\n")
    log.flush()
    print(f"    FAILED (exit {proc.returncode}); its output goes to bench/results/ddp*.log", flush=True)
    return None


def paired(samples: dict[str, list[float]]) -> dict[str, float]:
    """For each PyTorch configuration, the median over turns of revgraph's throughput over PyTorch's in the same
    turn (the two launches ran back to back): less sensitive to the machine's load drifting between turns."""
    out = {}
    for k, theirs in samples.items():
        model, fw, rest = k.split("/", 2)
        ours = samples.get(f"{model}/revgraph/{rest}")
        if fw != "revgraph" and ours and len(ours) == len(theirs):
            out[k] = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
    return out


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    import numpy
    import onnxruntime
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__}


def revgraph_source(commit: str | None, tmp: Path) -> tuple[dict, str]:
    """The environment of the workers (PYTHONPATH to revgraph at ``commit``) and a description of the code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    git = ["git", "-C", str(ROOT)]
    if commit is None:
        import revgraph

        rev = subprocess.run([*git, "describe", "--always", "--dirty"], check=False, capture_output=True,
                             text=True).stdout.strip()
        where = Path(revgraph.__file__).resolve().parent  # said relative to the checkout: no machine's paths
        place = where.relative_to(ROOT) if where.is_relative_to(ROOT) else "an installed revgraph outside the checkout"
        return env, f"working tree {rev or '?'} ({place})"
    sha = subprocess.run([*git, "rev-parse", commit], capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run([*git, "archive", sha, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(tmp / "src"))
    return env, f"commit {sha[:7]}"


def main() -> int:
    if "--memory" in sys.argv[1:]:  # memory per rank, sharded or not, against DDP + ZeroRedundancyOptimizer
        import ddp_memory

        return ddp_memory.main([a for a in sys.argv[1:] if a != "--memory"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="measure memory per rank instead (bench/ddp_memory.py: "
                        "revgraph unsharded / --shard optimizer / --shard gradients against DDP + "
                        "ZeroRedundancyOptimizer; its options follow)")
    parser.add_argument("--quick", action="store_true", help="1 turn, fewer steps, no extra rows (1-2 minutes)")
    parser.add_argument("--turns", type=int, help="rounds of launches (default 5; --quick: 1)")
    parser.add_argument("--batch", type=int, default=64, help="samples per process and step (default 64)")
    parser.add_argument("--commit", help="measure revgraph as committed at this revision (default: as installed)")
    parser.add_argument("--json", help="where to write the numbers (default bench/results/ddp[-quick].json)")
    parser.add_argument("--doc", help="the Markdown file whose section to write (default: docs/benchmarks.md for "
                        "a full run, none for --quick)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled revgraph launches")
    parser.add_argument("--profile", action="store_true", help="also record rank 0's timeline of segments and "
                        "all-reduces (2 processes, every model, and the Transformer with small buckets), how much "
                        "all-reduce time the backward hid, and the modelled scaling to 8 and 64 GPUs "
                        "(bench/ddp_scaling.py); writes bench/results/ddp-timeline[-quick].json and, unless --quick "
                        "(or with --doc), the ddp-overlap section of docs/benchmarks.md")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a launch is stopped")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the doc section from saved numbers")
    parser.add_argument("--render-overlap", metavar="JSON", help="only rewrite the ddp-overlap section of the doc "
                        "from a saved timeline file (bench/results/ddp-timeline*.json), the modelled scaling "
                        "computed again")
    args = parser.parse_args()
    if args.render_overlap:
        tl = json.loads(Path(args.render_overlap).read_text())
        tl["scaling"] = scaling(tl["timelines"])
        doc = Path(args.doc or ROOT / "docs" / "benchmarks.md")
        ddp_report.write_section(doc, overlap_section(tl, args.render_overlap), OVERLAP_BEGIN, OVERLAP_END)
        print(overlap_text(tl, args.render_overlap))
        print(f"wrote the ddp-overlap section of {doc}")
        return 0
    if args.render:
        res = json.loads(Path(args.render).read_text())
        doc = Path(args.doc or ROOT / "docs" / "benchmarks.md")
        ddp_report.write_section(doc, ddp_report.render(res, args.render))
        print(ddp_report.table(res))
        print(f"wrote {doc}")
        return 0
    turns = args.turns or (1 if args.quick else 5)
    steps = QUICK_STEPS if args.quick else FULL_STEPS
    mode_name = "quick" if args.quick else "full"
    json_path = Path(args.json or HERE / "results" / f"ddp{'-quick' if args.quick else ''}.json")
    doc = Path(args.doc) if args.doc else (None if args.quick else ROOT / "docs" / "benchmarks.md")
    started, load_start = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rg-ddp-") as tmp_name:
        tmp = Path(tmp_name)
        env, source = revgraph_source(args.commit, tmp)
        data = {}
        for m in ddp_models.MODELS:  # one data set per model, the same for every launch and process
            import numpy as np

            data[m] = tmp / f"{m}.npz"
            np.savez(data[m], **ddp_models.data(m, 50 * args.batch * 2, seed=1))
        samples: dict[str, list[float]] = {}
        log = open(tmp / "failures.log", "w")  # noqa: SIM115 - kept open for the run
        keep_log = json_path.with_suffix(".log")
        plan = configs(args.quick)
        for turn in range(turns):
            print(f"turn {turn + 1}/{turns}", flush=True)
            for m, mode, n, runs in plan:
                order = runs if turn % 2 == 0 else [runs[1], runs[0], *runs[2:]]
                for fw, extra in order:
                    base = "torch" if fw.startswith("torch") else "revgraph"
                    wargs = ["--framework", base, "--model", m, "--mode", mode, "--batch", str(args.batch),
                             "--warmup", str(WARMUP), "--steps", str(steps[m][n]), "--data", str(data[m]),
                             *[s for kv in extra.items() for s in kv]]
                    r = launch(wargs, n, env, args.timeout, log)
                    k = key(m, fw, mode, n)
                    if r:
                        samples.setdefault(k, []).append(r["samples_per_s"])
                        print(f"  {k:32s} {r['samples_per_s']:>12,.0f} samples/s", flush=True)
        profile, ops = {}, {}
        if not args.no_profile:
            print("profile (revgraph, phases of a step)", flush=True)
            for m in ddp_models.MODELS:
                for mode, n in ([("ddp", 2)] if args.quick else [("single", 1), ("ddp", 2)]):
                    wargs = ["--framework", "revgraph", "--model", m, "--mode", mode, "--batch", str(args.batch),
                             "--warmup", str(WARMUP), "--steps", str(steps[m][n]), "--data", str(data[m]), "--profile"]
                    r = launch(wargs, n, env, args.timeout, log)
                    if r:
                        profile[key(m, "revgraph", mode, n)] = r
                        print(f"  {key(m, 'revgraph', mode, n):32s} " + ", ".join(
                            f"{p} {v:.3f}" for p, v in r["phases_ms_per_step"].items()) + " ms/step", flush=True)
                if not args.quick:  # onnxruntime's profiler on the two step graphs at 2 processes
                    wargs[wargs.index("--steps") + 1] = str(steps[m][2])
                    wargs[wargs.index("--mode") + 1] = "ddp"
                    r = launch([*wargs[:-1], "--ort-profile"], 2, env, args.timeout, log)
                    if r:
                        ops[m] = r["ops"]
                        print(f"  {m}: " + "; ".join(f"{g}: " + ", ".join(f"{o} {s:.0%}" for o, s in top[:3])
                                                     for g, top in r["ops"].items()), flush=True)
        timelines = run_timelines(args, steps, data, env, log) if args.profile else None
        log.close()
        failed = (tmp / "failures.log").stat().st_size > 0
        if failed:
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            keep_log.write_text((tmp / "failures.log").read_text())
    res = {
        "mode": mode_name, "date": dt.date.today().isoformat(), "minutes": (time.perf_counter() - started) / 60,
        "command": "python bench/ddp.py" + (" --quick" if args.quick else "") + (
            f" --commit {args.commit}" if args.commit else ""),
        "revgraph": source, "machine": machine(), "load_start": load_start, "load_end": os.getloadavg(),
        "turns": turns, "batch": args.batch, "warmup": WARMUP,
        "steps": {m: {str(n): v for n, v in d.items()} for m, d in steps.items()},
        "models": {m: ddp_models.describe(m) for m in ddp_models.MODELS},
        "samples": samples, "median": {k: statistics.median(v) for k, v in samples.items()}, "profile": profile,
        "ops": ops, "paired": paired(samples),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(res, indent=1))
    res = json.loads(json_path.read_text())  # the report reads what the JSON holds
    print(ddp_report.table(res))
    print(f"wrote {json_path}" + (f" (failed launches: {keep_log})" if failed else ""))
    if doc is not None:
        ddp_report.write_section(doc, ddp_report.render(res, str(json_path.relative_to(ROOT))
                                                        if json_path.is_relative_to(ROOT) else str(json_path)))
        print(f"wrote the section of {doc}")
    if timelines is not None:
        tl_path = json_path.with_name(json_path.stem.replace("ddp", "ddp-timeline", 1) + ".json")
        tl = {"command": res["command"] + " --profile", "mode": mode_name, "date": res["date"], "revgraph": source,
              "machine": res["machine"], "load": [res["load_start"], os.getloadavg()], "batch": args.batch,
              "timelines": timelines, "scaling": scaling(timelines)}
        tl_path.write_text(json.dumps(tl, indent=1))
        print(overlap_text(tl, str(tl_path)))
        print(f"wrote {tl_path}")
        if doc is not None:
            ddp_report.write_section(doc, overlap_section(tl, str(tl_path.relative_to(ROOT)) if
                                                          tl_path.is_relative_to(ROOT) else str(tl_path)),
                                     OVERLAP_BEGIN, OVERLAP_END)
            print(f"wrote the ddp-overlap section of {doc}")
    return 0


def run_timelines(args, steps: dict, data: dict, env: dict, log) -> dict:
    """The --profile launches (:data:`TIMELINES`): rank 0's timeline summary of each (bench/ddp_worker.py
    ``--timeline``), by label."""
    out = {}
    print("timelines (revgraph, 2 processes)", flush=True)
    for label, m, extra in TIMELINES:
        wargs = ["--framework", "revgraph", "--model", m, "--mode", "ddp", "--batch", str(args.batch), "--warmup",
                 str(WARMUP), "--steps", str(steps[m][2]), "--data", str(data[m]), "--timeline", *extra]
        r = launch(wargs, 2, env, args.timeout, log)
        if r:
            out[label] = {**r["timeline"], "samples_per_s": r["samples_per_s"]}
            t = r["timeline"]
            print(f"  {label:44s} step {t['phases_ms']['step']:.2f} ms, {t['segments']} segments, all-reduce "
                  f"{t['allreduce_ms'] or 0:.2f} ms of which hidden {t['hidden_ms'] or 0:.2f} ms", flush=True)
    return out


def scaling(timelines: dict) -> dict:
    """The modelled scaling (bench/ddp_scaling.py) from the Transformer's measured curve and cutting cost."""
    import ddp_scaling

    on = timelines.get(CURVE)
    cost = on["grad_cut_ms"] / on["grad_uncut_ms"] if on and on.get("grad_uncut_ms") else None
    return ddp_scaling.model(on, cost)


def _load(tl: dict) -> str:
    if not tl.get("load"):
        return "not recorded"
    start, end = (round(x[0], 1) for x in tl["load"])
    return f"{start} at the start, {end} at the end of the run (1-minute averages, {tl['machine']['cores']} cores)"


def _pairs(timelines: dict) -> str:
    """The step times of the runs measured with and without overlap, as a sentence."""
    out = []
    for on, off in [("wide", "wide, no overlap"), (CURVE, CURVE_OFF)]:
        a, b = timelines.get(on), timelines.get(off)
        if a and b:
            a, b = a["phases_ms"]["step"], b["phases_ms"]["step"]
            out.append(f"{on}: {a:.1f} ms a step overlapped against {b:.1f} ms not ({a / b:.2f}x)")
    return "; ".join(out) or "no run was measured both with and without overlap"


def overlap_text(tl: dict, path: str) -> str:
    return "\n".join(overlap_section(tl, path).splitlines()[1:-1])


def overlap_section(tl: dict, path: str) -> str:
    """The ddp-overlap section of docs/benchmarks.md: the measured timelines and the modelled scaling."""
    import ddp_scaling

    rows = []
    for label, t in tl["timelines"].items():
        ph = t["phases_ms"]
        hidden = f"{t['hidden_ms']:.2f} of {t['allreduce_ms']:.2f} ms" if t.get("allreduce_ms") else "–"
        cut = f"{t['grad_cut_ms']:.2f} / {t['grad_uncut_ms']:.2f}" if t.get("grad_uncut_ms") else "–"
        rows.append(f"| {label} | {len(t['bucket_bytes'])} | {t['segments']} | {cut} | {ph['forward+backward']:.2f} | "
                    f"{ph['exchange']:.2f} | {ph['update']:.2f} | {ph['step']:.2f} | {hidden} | "
                    f"{t['samples_per_s']:,.0f} |")
    sc = tl["scaling"]
    at64 = next((r for r in sc["rows"] if r["world"] == 64), {})
    goal = ", ".join(f"{h} {at64[k + '_eff']:.0%}" for k, h in ddp_scaling.COLUMNS if k + "_eff" in at64)
    lines = [OVERLAP_BEGIN, ("## Data-parallel training: overlap of the gradient exchange, timelines and modelled "
             "scaling"), "",
             (f"Written by `{tl['command']}` ({tl['mode']} run) on {tl['date']} ({tl['revgraph']}); every timeline: "
              f"`{path}` (per step: each segment's run and each bucket's all-reduce from its start to its "
              "completion, seconds from the step's start, for the step of median time). revgraph, 2 gloo "
              f"processes of 1 thread, batch {tl['batch']} per process, Adam; medians over the timed steps (ms); "
              f"load average {_load(tl)}. "
              "*Hidden*: the part of the union of the all-reduce intervals before the backward pass ended."), "",
             ("| run | buckets | segments | grad graph cut / uncut, alone | forward+backward | exchange (waited) | "
              "update | step | all-reduce hidden | samples/s |"), "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             *rows, "",
             ("*Grad graph cut / uncut, alone*: the segments run one after another against the uncut grad graph "
              "as one session, on one batch with no collective (medians of 30 alternating runs on each rank): "
              "the cost of cutting, i.e. onnxruntime's optimisations lost at the boundaries and one session run "
              "per segment. It is the scaling model's cost factor."), "",
             ("On this machine (2 cores, loopback TCP) a gloo round trip costs about as much as a whole step of the "
              "small models, and the all-reduce's gloo thread sums and copies on the same core as the next "
              f"segment: {_pairs(tl['timelines'])}. The hidden all-reduce time is paid back by the cutting cost "
              "and the shared cores: overlap gains nothing on this CPU (slower under load, measured 1.4-1.65x in "
              "earlier runs of a busy machine), so `--overlap auto` (the default) overlaps only on CUDA, where NCCL "
              "moves the bytes beside the compute; the modelled scaling below is the number for the goal."), "",
             *ddp_scaling.render(sc), "",
             (f"Goal (issue 25): >= 90% scaling efficiency at 64 GPUs with overlap; modelled at 64 GPUs: {goal}. "
              "The inputs are in bench/ddp_scaling.py (INPUTS), the model in its docstring."), OVERLAP_END]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
