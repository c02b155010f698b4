"""Memory and time of an Adam training step per onnxruntime memory setting and buffer layout (issue 24, parts 3-4).

For the step benchmark's models at batch 64 (bench/models.py: MLP, CNN, Transformer, RNN Loop with T = 100), a
wider MLP (784-2048-2048-10, 5.8 M parameters) and bench/memory.py's LLaMA (transformers' ``LlamaConfig``, 4
layers, hidden 256, vocabulary 2048) at 8 x 128 tokens,
``rg.Trainer(..., "cross-entropy", "adam")`` runs with every combination of

- onnxruntime's CPU arena on/off and memory pattern on/off (``rg.RuntimeOptions(arena=, memory_pattern=)``),
- two buffer sets (the fused step graph, parameters and state swapped between two sets) or one
  (``buffers="one"``: the step split into a grad graph and an update graph that writes over its inputs).

Each configuration is a fresh process (bench/_worker.py). It measures, from /proc/self/status:

- **held**: resident memory after building the trainer minus before (parameters, state, gradients, sessions);
- **setup HWM**: VmHWM after setup (the process's peak so far: imports, the build, the sessions);
- **step peak**: VmHWM over the first three steps (reset to the resident size through /proc/self/clear_refs,
  "5", just before them) minus the resident size after setup: what a step needs beyond setup (the memory
  pattern is planned on the first run and used from the second);
- **kept**: resident memory after those steps minus after setup (what the arena keeps between steps);

then every configuration of a model runs its step in turns (the order rotates each turn) and the step time is
the median over turns of each turn's mean. Raw numbers go to ``bench/results/runtime_settings.json``, the table
between ``<!-- runtime:begin -->`` and ``<!-- runtime:end -->`` in docs/benchmarks.md.

    python bench/runtime_settings.py [--models mlp cnn transformer rnn] [--turns 7] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import itertools

from memory_common import reset_peak, status_kb

BEGIN, END = "<!-- runtime:begin -->", "<!-- runtime:end -->"
NAMES = {"mlp": "MLP", "cnn": "CNN", "transformer": "Transformer", "rnn": "RNN (Loop, T=100)",
         "mlp-wide": "MLP 784-2048-2048-10", "llama": "LLaMA 8 x 128 tokens"}
WIDE = (784, 2048, 2048, 10)
#: (arena, memory pattern, buffers), onnxruntime's defaults and the old engine first
CONFIGS = [(a, m, b) for b in ("two", "one") for a in (True, False) for m in (True, False)]
#: the training default (rg.Trainer, revgraph train), compared with onnxruntime's defaults in the summary
DEFAULT_KEY = "True|False|one"
_CELL: dict = {}


# ------------------------------------------------------------------------------------ worker side (one cell)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; that RSS in kB."""
    return round(reset_peak() * 1024)


def prepare(info: dict, arena: bool, memory_pattern: bool, buffers: str, threads: int) -> dict:
    """Build the trainer of one configuration in this (fresh) process and measure its memory (module doc)."""
    import numpy as np
    from models import load_npz

    import revgraph as rg

    if "llama_batch" in info:  # bench/memory.py's LLaMA: token ids and next-token labels
        from memory_common import llama_batch

        data = llama_batch(info["llama_batch"])
        data = {"x": data["input_ids"], "labels": data["labels"]}
    else:
        _, data = load_npz(info["npz"])
    rss0 = status_kb("VmRSS")
    t0 = time.perf_counter()
    tr = rg.Trainer(info["path"], "cross-entropy", "adam", params=info["params"], threads=threads, buffers=buffers,
                    runtime=rg.RuntimeOptions(arena=arena, memory_pattern=memory_pattern))
    build = time.perf_counter() - t0
    rss1, hwm1 = status_kb("VmRSS"), status_kb("VmHWM")
    feeds = {tr.spec.inputs[0]: np.ascontiguousarray(data["x"]), tr.spec.labels: data["labels"]}
    n = len(data["labels"])
    base = _reset_peak()
    losses = [tr._engine.step(feeds, n, n) for _ in range(3)]
    peak = status_kb("VmHWM")
    rss2 = status_kb("VmRSS")
    t0 = time.perf_counter()
    tr._engine.step(feeds, n, n)
    first = time.perf_counter() - t0
    _CELL.update(trainer=tr, run=lambda: tr._engine.step(feeds, n, n))
    held = tr._engine.held()
    digest = parameters_digest()  # after 4 steps in every configuration
    return {"held_mb": (rss1 - rss0) / 1024, "setup_hwm_mb": hwm1 / 1024, "step_peak_mb": (peak - base) / 1024,
            "kept_mb": (rss2 - rss1) / 1024, "build_s": build, "first_step_s": first, "losses": losses,
            "engine_state_mb": held["state"] / 2**20, "engine_gradients_mb": held["gradients"] / 2**20,
            "shared": len(tr._engine.shared), "carried": len(tr._engine.names), "digest": digest}


def timed(steps: int) -> list[float]:
    """Mean wall and CPU seconds per step over ``steps`` steps of the prepared trainer."""
    run = _CELL["run"]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        run()
    return [(time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps]


def parameters_digest() -> str:
    """SHA-256 of the trainer's parameters and state (every configuration must train to the same bits)."""
    import hashlib

    import numpy as np

    tr = _CELL["trainer"]
    h = hashlib.sha256()
    values = tr._engine.read(tr._engine.names)
    for k in sorted(values):
        h.update(np.ascontiguousarray(values[k]).tobytes())
    return h.hexdigest()[:16]


def write_wide_mlp(batch: int, out_dir: str) -> dict:
    """A wider MLP (:data:`WIDE`, ReLU; 5.8 M parameters) written by revgraph, where parameters and optimizer
    state are a visible share of the step's memory: ``{"path", "npz", "params"}`` as bench/models.py gives."""
    import numpy as np

    import revgraph as rg
    from revgraph.ir import Graph, Node, ValueInfo

    rng = np.random.default_rng(0)
    inits, nodes, h = {}, [], "x"
    for k, (a, b) in enumerate(itertools.pairwise(WIDE)):
        inits[f"W{k}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        inits[f"b{k}"] = np.zeros(b, np.float32)
        nodes += [Node("MatMul", [h, f"W{k}"], [f"m{k}"], name=f"mm{k}"),
                  Node("Add", [f"m{k}", f"b{k}"], [f"z{k}"], name=f"add{k}")]
        h = f"z{k}"
        if k < len(WIDE) - 2:
            nodes.append(Node("Relu", [h], [f"h{k}"], name=f"relu{k}"))
            h = f"h{k}"
    nodes[-1].outputs = ["logits"]
    g = Graph(nodes, [ValueInfo("x", np.float32, (batch, WIDE[0]))],
              [ValueInfo("logits", np.float32, (batch, WIDE[-1]))], inits, name="mlp_wide")
    path = Path(out_dir) / f"mlp-wide_b{batch}.onnx"
    rg.save(g, path)
    npz = path.with_suffix(".npz")
    np.savez(npz, x=rng.standard_normal((batch, WIDE[0])).astype(np.float32),
             labels=rng.integers(0, WIDE[-1], batch).astype(np.int64))
    return {"path": str(path), "npz": str(npz), "params": list(inits)}


# ------------------------------------------------------------------------------------------- orchestrator


def _label(cfg) -> str:
    a, m, b = cfg
    return f"arena {'on' if a else 'off'}, pattern {'on' if m else 'off'}, {b} set{'s' if b == 'two' else ''}"


def _parse_config(text: str) -> tuple:
    a, m, b = text.split("-")
    return a == "on", m == "on", b


def measure_model(name: str, info: dict, turns: int, seconds: float, threads: int, log_dir: Path, log,
                  configs=CONFIGS) -> dict:
    from workers import Worker

    workers, cells = {}, {}
    try:
        for cfg in configs:
            w = Worker(f"{name}-{'-'.join(map(str, cfg))}", sys.executable, log_dir)
            workers[cfg] = w
            cells[cfg] = w.call("runtime_settings:prepare", info=info, arena=cfg[0], memory_pattern=cfg[1],
                                buffers=cfg[2], threads=threads)
            log(f"  {name} {_label(cfg)}: held {cells[cfg]['held_mb']:.1f} MB, step peak "
                f"{cells[cfg]['step_peak_mb']:.1f} MB")
        times = {cfg: [] for cfg in configs}
        for t in range(turns):
            order = configs[t % len(configs):] + configs[:t % len(configs)]
            for cfg in order:
                steps = max(3, int(seconds / max(cells[cfg]["first_step_s"], 1e-5)))
                times[cfg].append(workers[cfg].call("runtime_settings:timed", steps=steps))
    finally:
        for w in workers.values():
            w.close()
    for cfg in configs:
        cells[cfg]["step_ms"] = 1e3 * statistics.median(t[0] for t in times[cfg])
        cells[cfg]["cpu_ms"] = 1e3 * statistics.median(t[1] for t in times[cfg])
        cells[cfg]["turns_ms"] = [[1e3 * x for x in t] for t in times[cfg]]
    return {"|".join(map(str, cfg)): cells[cfg] for cfg in configs}


def _name(model: str) -> str:
    if model.startswith("llama-b"):
        return f"LLaMA {model[7:]} x 128 tokens"
    return NAMES.get(model, model)


def _command(res: dict) -> str:
    shown, skip = [], False
    for a in res["argv"]:  # where the numbers were written is not part of the command that measures them
        if skip or a in ("-o", "--output", "--json"):
            skip = not skip
            continue
        shown.append(a)
    return " ".join(["python bench/runtime_settings.py", *shown])


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _findings(models: dict) -> list[str]:
    """The paragraph that reads the table: each effect as the range of its ratio over the models measured."""
    def ratios(num, den, field):
        out = {}
        for model, cells in models.items():
            a, b = cells.get(num), cells.get(den)
            if a and b:
                out[model] = field(a) / field(b)
        return out

    def span(r: dict) -> str:
        if not r:
            return "n/a"
        lo, hi = min(r.values()), max(r.values())
        return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}x to {hi:.2f}x"

    peak = lambda c: c["step_peak_mb"]
    total = lambda c: c["held_mb"] + c["step_peak_mb"]
    cpu = lambda c: c["cpu_ms"]
    held = {m: c["True|False|two"]["held_mb"] - c["True|False|one"]["held_mb"] for m, c in models.items()
            if "True|False|two" in c and "True|False|one" in c}
    return [
        "What the numbers say (ratios over the models above, each a range from the smallest to the largest):", "",
        ("- **Memory pattern off** (arena on, one set): step peak "
         f"{span(ratios('True|False|one', 'True|True|one', peak))} of the pattern's, CPU time "
         f"{span(ratios('True|False|one', 'True|True|one', cpu))}. The pattern allocates every intermediate of a run "
         "in one block planned from the previous run, so the peak holds them all at once."),
        (f"- **Arena off** (pattern off, one set): step peak {span(ratios('False|False|one', 'True|False|one', peak))} "
         f"of the arena's, CPU time {span(ratios('False|False|one', 'True|False|one', cpu))}: each step's tensors are "
         "allocated and freed through the C allocator (fresh pages to fault in and zero each step), and glibc keeps "
         "freed memory too, so the arena's reuse costs no more memory. Between steps the arena keeps what it grew; "
         "without it part of the peak returns to the system (*kept*)."),
        f"- **One buffer set** (arena on, pattern off): held + step peak "
        f"{span(ratios('True|False|one', 'True|False|two', total))} of two sets'; held after setup "
        + ", ".join(f"{_name(m)} {max(d, 0.0):.1f} MB" for m, d in held.items())
        + f" less; CPU time {span(ratios('True|False|one', 'True|False|two', cpu))}. Adam holds parameters, "
        "moments and gradients (4P) where two sets held 6P; the split step's update reads the gradients from "
        "buffers and allocates its temporaries anew, where the fused graph reuses the buffers of gradients it no "
        "longer needs, so its step peak can be higher (up to about twice the largest parameter: the wide MLP); "
        "held plus peak is never higher.",
        ("- **Training default** (`rg.Trainer`, `revgraph train`): memory pattern off, arena on, one buffer set. "
         "`rg.Session` keeps onnxruntime's defaults (measured here for training steps only)."), ""]


def render(results: list[dict]) -> str:
    """The docs/benchmarks.md section from one or more runs (``results``, each the JSON of a run)."""
    models = {m: c for res in results for m, c in res["models"].items()}
    runs = [f"`{_command(res)}` on {res['date']} (commit {res['commit']}, onnxruntime {res['onnxruntime']}, "
            f"{res['threads']} thread{'s' if res['threads'] != 1 else ''}, {res['turns']} turns, "
            f"{', '.join(_name(m) for m in res['models'])}; load average {res['load_start']} at the start, "
            f"{res['load_end']} at the end; raw numbers "
            f"`bench/results/{res.get('json_name', 'runtime_settings.json')}`)"
            for res in results]
    lines = [BEGIN, "## Runtime memory settings and buffer sets", "",
             "Written by " + "; and ".join(runs) + ", on a shared machine (other processes ran: wall times move "
             "with the load, CPU times less).", "",
             ("An Adam step of `rg.Trainer` per onnxruntime setting (`rg.RuntimeOptions(arena=, memory_pattern=)`) "
              "and buffer layout (`buffers=\"two\"`: the fused step graph, parameters and state swapped between two "
              "sets; `\"one\"`: the step split into grad and update graphs, the update writing over its inputs), at "
              "batch 64 but for the LLaMA. Each configuration is a fresh process. *held*: resident memory after "
              "building the trainer minus before; *setup HWM*: the process's VmHWM after setup; *step peak*: VmHWM "
              "over the first three steps minus the resident size after setup; *kept*: resident memory after those "
              "steps minus after setup; *step ms*, *CPU ms*: medians over turns (configurations alternate) of each "
              "turn's mean wall and process CPU time per step; *CPU vs default*: against onnxruntime's defaults with "
              "two sets (the engine before issue 24). *same bits*: the parameters and state after 4 steps are "
              "bitwise those of the first configuration of the model."), "",
             ("| model | arena | memory pattern | buffers | held MB | setup HWM MB | step peak MB | held + peak MB | "
              "kept MB | step ms | CPU ms | CPU vs default | same bits |"),
             "| :--- | :---: | :---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    on = {"True": "on", "False": "off"}
    for model, cells in models.items():
        ref = cells.get("|".join(map(str, CONFIGS[0])))
        first = next(iter(cells.values()))
        for key, c in cells.items():
            a, m, b = key.split("|")
            versus = f"{c['cpu_ms'] / ref['cpu_ms']:.2f}x" if ref else "n/a"
            lines.append(f"| {_name(model)} | {on[a]} | {on[m]} | {b} | {c['held_mb']:.1f} | "
                         f"{c['setup_hwm_mb']:.0f} | {c['step_peak_mb']:.1f} | {c['held_mb'] + c['step_peak_mb']:.1f} "
                         f"| {c['kept_mb']:.1f} | {c['step_ms']:.2f} | {c['cpu_ms']:.2f} | {versus} | "
                         f"{'yes' if c['digest'] == first['digest'] else 'no'} |")
    a, m, b = DEFAULT_KEY.split("|")
    lines += ["", (f"Per model, onnxruntime's defaults with two sets against the training default (arena {on[a]}, "
              f"memory pattern {on[m]}, {b} set):"), "",
              ("| model | default: held + step peak MB | training default: held + step peak MB | ratio | "
               "CPU time ratio | wall time ratio |"),
              "| :--- | ---: | ---: | ---: | ---: | ---: |"]
    for model, cells in models.items():
        ref, new = cells.get("True|True|two"), cells.get(DEFAULT_KEY)
        if ref is None or new is None:
            continue
        x, y = ref["held_mb"] + ref["step_peak_mb"], new["held_mb"] + new["step_peak_mb"]
        lines.append(f"| {_name(model)} | {x:.1f} | {y:.1f} | {y / x:.2f}x | "
                     f"{new['cpu_ms'] / ref['cpu_ms']:.2f}x | {new['step_ms'] / ref['step_ms']:.2f}x |")
    lines += ["", *_findings(models), END]
    return "\n".join(lines) + "\n"


def write_section(doc: Path, section: str) -> None:
    """Put ``section`` between the markers of ``doc`` (replacing what was there), or at its end."""
    text = doc.read_text() if doc.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(NAMES), choices=list(NAMES),
                        help="(default: all; mlp-wide is a 5.8 M-parameter MLP where the buffer sets show)")
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.4, help="time per configuration per turn (default 0.4)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="3 turns of 0.15 s (a smoke run)")
    parser.add_argument("--configs", nargs="+", metavar="ARENA-PATTERN-BUFFERS",
                        help="a subset of the configurations, e.g. on-off-one off-off-one (default: all 8)")
    parser.add_argument("--llama-batch", type=int, default=8, help="sequences of 128 tokens of the LLaMA (default 8)")
    parser.add_argument("--json", default=str(HERE / "results" / "runtime_settings.json"))
    parser.add_argument("-o", "--output", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--render", metavar="JSON", nargs="+",
                        help="only rewrite the section from saved numbers (one or more runs, in table order)")
    args = parser.parse_args(argv)
    if args.render:
        runs = []
        for path in args.render:
            res = json.loads(Path(path).read_text())
            res["json_name"] = Path(path).name
            runs.append(res)
        write_section(Path(args.output), render(runs))
        return 0
    if args.quick:
        args.turns, args.seconds = 3, 0.15
    import onnxruntime
    from models import write_step_model

    configs = [_parse_config(c) for c in args.configs] if args.configs else CONFIGS

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    res = {"date": dt.date.today().isoformat(), "commit": commit, "onnxruntime": onnxruntime.__version__,
           "threads": args.threads, "turns": args.turns, "load_start": [round(x, 2) for x in os.getloadavg()],
           "argv": [f"<path>/{Path(a).name}" if os.path.isabs(a) else a
                    for a in (argv if argv is not None else sys.argv[1:])],
           "models": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        (work / "logs").mkdir()
        for name in args.models:
            if name == "llama":  # the LLaMA of bench/memory.py (transformers' LlamaConfig), at batch 8
                from memory_torch import export_llama

                files = export_llama(str(work))
                info = {"path": files["onnx"], "params": files["params"], "llama_batch": args.llama_batch}
            elif name == "mlp-wide":
                info = write_wide_mlp(64, str(work))
            else:
                info = write_step_model(name, 64, str(work))
            log(f"{name}: {len(configs)} configurations")
            key = f"llama-b{args.llama_batch}" if name == "llama" and args.llama_batch != 8 else name
            res["models"][key] = measure_model(name, info, args.turns, args.seconds, args.threads, work / "logs", log,
                                               configs)
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["seconds"] = time.perf_counter() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    res["json_name"] = Path(args.json).name
    write_section(Path(args.output), render([res]))
    log(f"wrote {args.output} and {args.json} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
