"""The report of bench/ddp.py: a plain-text table for the terminal (:func:`table`) and a Markdown section of
docs/benchmarks.md (:func:`render`), written between ``<!-- ddp:begin -->`` and ``<!-- ddp:end -->``
(:func:`write_section`: replaced in place, or appended at the end of the file). Throughputs are samples/s of
the global batch (medians over turns); a ratio revgraph / PyTorch above 1 means revgraph trains faster (the
inverse of the step-time ratios elsewhere in docs/benchmarks.md); scaling is the throughput of 2 processes
over that of 1 process (the plain single-process path), 2.0 being perfect on 2 cores.
"""

from __future__ import annotations

import re
from pathlib import Path

BEGIN, END = "<!-- ddp:begin -->", "<!-- ddp:end -->"
NAMES = {"mlp": "MLP", "rnn": "RNN (Loop)", "embed": "embedding (sparse)", "transformer": "Transformer",
         "wide": "wide MLP"}
PHASES = [("grad graph", "grad graph"), ("all-reduce (dense grads, loss)", "all-reduce"),
          ("all-gather (sparse counts)", "all-gather counts"), ("all-gather (sparse indices)", "all-gather indices"),
          ("all-gather (sparse rows)", "all-gather rows"),
          ("all-gather (sparse rows, packed)", "all-gather rows+indices"),
          ("update graph", "update graph")]


def _m(res: dict, model: str, fw: str, mode: str, n: int) -> float | None:
    return res["median"].get(f"{model}/{fw}/{mode}/{n}")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def _steps(res: dict, n: str) -> str:
    return ", ".join(str(s[n]) for s in res["steps"].values())


def _both(res: dict, model: str, mode: str, n: int) -> str:
    """The ratio of the medians, and in parentheses the median of the ratios of launches in the same turn."""
    r = _ratio(_m(res, model, "revgraph", mode, n), _m(res, model, "torch", mode, n))
    p = res.get("paired", {}).get(f"{model}/torch/{mode}/{n}")
    return f"{r} ({p:.2f}x)" if p and r != "–" else r


def _num(v: float | None) -> str:
    return f"{v:,.0f}" if v else "–"


def rows(res: dict) -> list[list[str]]:
    """One row per model: 1 process (revgraph, PyTorch, ratio), 2 processes (same), scaling of each."""
    out = []
    for m in res["models"]:
        r1, t1 = _m(res, m, "revgraph", "single", 1), _m(res, m, "torch", "single", 1)
        r2, t2 = _m(res, m, "revgraph", "ddp", 2), _m(res, m, "torch", "ddp", 2)
        out.append([NAMES.get(m, m), _num(r1), _num(t1), _both(res, m, "single", 1), _num(r2), _num(t2),
                    _both(res, m, "ddp", 2), _ratio(r2, r1), _ratio(t2, t1)])
    return out


HEAD = ["model", "revgraph 1 proc", "PyTorch 1 proc", "rg / PT", "revgraph 2 procs", "PyTorch DDP 2 procs",
        "rg / PT", "revgraph 2/1", "PyTorch 2/1"]


def table(res: dict) -> str:
    """The main table as aligned text (samples/s)."""
    body = [HEAD, *rows(res)]
    widths = [max(len(r[i]) for r in body) for i in range(len(HEAD))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in body]
    lines.insert(1, "-" * len(lines[0]))
    title = (f"samples/s, medians of {res['turns']} turn(s) (in parentheses: median of paired ratios), "
             f"batch {res['batch']} per process, 1 thread each")
    return "\n".join([title, *lines])


def _md(head: list[str], body: list[list[str]], left: int = 1) -> list[str]:
    align = [":---" if i < left else "---:" for i in range(len(head))]
    return ["| " + " | ".join(r) + " |" for r in [head, align, *body]]


def _spread(res: dict) -> str:
    worst = max(((max(v) / min(v), k) for k, v in res["samples"].items() if len(v) > 1), default=None)
    if worst is None:
        return ""
    every = sorted(max(v) / min(v) for v in res["samples"].values() if len(v) > 1)
    return (f"Between turns, the fastest and slowest launch of one configuration differ by a median factor of "
            f"{every[len(every) // 2]:.2f} and at most {worst[0]:.2f} (`{worst[1]}`); every launch is in the JSON.")


def _profile(res: dict) -> list[str]:
    prof = res.get("profile") or {}
    body, notes = [], []
    for m in res["models"]:
        p = (prof.get(f"{m}/revgraph/ddp/2") or {}).get("phases_ms_per_step")
        if not p:
            continue
        fused = (prof.get(f"{m}/revgraph/single/1") or {}).get("phases_ms_per_step", {})
        named = sum(p.get(k, 0.0) for k, _ in PHASES)
        comm = sum(v for k, v in p.items() if k.startswith(("all-reduce (", "all-gather (")))
        engine, whole = p.get("engine step", 0.0), p.get("Trainer.fit, the whole step", 0.0)
        body.append([NAMES.get(m, m), *[f"{p[k]:.3f}" if k in p else "–" for k, _ in PHASES],
                     f"{engine - named:.3f}", f"{whole - engine:.3f}", f"{whole:.3f}",
                     f"{p.get('all-reduce alone', 0):.3f}" + (f" / {p['all-gather alone']:.3f}"
                                                              if "all-gather alone" in p else ""),
                     f"{fused['step graph']:.3f}" if "step graph" in fused else "–"])
        if whole:
            notes.append(f"{NAMES.get(m, m)} {comm / whole:.0%}")
    if not body:
        return []
    head = ["model", *[h for _, h in PHASES], "rest of the engine step", "Trainer.fit around it", "whole step",
            "collectives alone", "fused step graph, 1 proc"]
    batch = res["batch"]
    return ["", "### Where a revgraph step goes at 2 processes", "",
            (f"One profiled launch per model (rank 0; ms per step, means over the "
            f"{_steps(res, '2')} timed steps of the models in order; batch {batch} per "
            "process). The engine's sessions and `torch.distributed` calls are wrapped with timers "
            "(bench/ddp_worker.py `--profile`): *grad graph* and *update graph* are onnxruntime's runs "
            "of the two halves of the split step graph (*grad graph* is empty when it runs in segments, one "
            "per bucket: the timeline section below times those); *all-reduce* "
            "is the gloo all-reduce of the gradient bucket(s) with the loss riding along, from its launch to the "
            "end of its wait, and *all-gather rows+indices* the one all-gather of every sparse table's indices "
            "and rows packed together (none for dense models; before issue 25 three: *counts*, *indices*, "
            "*rows*); *rest of the engine step* is the binding of inputs and outputs, the scaling of the "
            "gradients, the concatenation of gathered rows and the copies of the loss; *Trainer.fit around it* "
            "is the slicing of the batch and the loop. A collective's time includes the time this rank waits "
            "for the other to reach it. *Collectives alone* is the same all-reduce (and, for the embedding, the "
            "same all-gather of a batch's rows) run back to back after a barrier, so without waiting for the "
            "other rank's compute: the cost of gloo itself. The last column is the fused step graph of one "
            "process (`distributed=False`) at the same per-process batch."), "",
            *_md(head, body), "",
            ("Share of the whole step spent in collectives (launch to end of wait) at 2 processes: "
             + ", ".join(notes) + ".")]


def _ops(res: dict) -> list[str]:
    ops = res.get("ops") or {}
    body = [[NAMES.get(m, m), graph, ", ".join(f"{op} {share:.0%}" for op, share in top)]
            for m, graphs in ops.items() for graph, top in graphs.items()]
    if not body:
        return []
    return ["", ("Inside the two graphs at 2 processes: onnxruntime's profiler (one more launch per model, "
                 "`--ort-profile`; it slows every kernel, so only shares are shown) ranks the operator types by "
                 "their share of the graph's kernel time:"), "",
            *_md(["model", "graph", "operator types by share of kernel time"], body, left=3)]


def _notes(res: dict) -> list[str]:
    """What the numbers say: computed sentences, and how revgraph's exchange (at the measured commit) and
    DDP's differ in round trips."""
    def r(m, fw, mode, n):
        return _m(res, m, fw, mode, n)

    one = ", ".join(f"{NAMES.get(m, m)} {_ratio(r(m, 'revgraph', 'single', 1), r(m, 'torch', 'single', 1))}"
                    for m in res["models"])
    two = ", ".join(f"{NAMES.get(m, m)} {_ratio(r(m, 'revgraph', 'ddp', 2), r(m, 'revgraph', 'single', 1))} "
                    f"(PyTorch {_ratio(r(m, 'torch', 'ddp', 2), r(m, 'torch', 'single', 1))})" for m in res["models"])
    prof = res.get("profile") or {}
    alone = (prof.get("mlp/revgraph/ddp/2") or {}).get("phases_ms_per_step", {}).get("all-reduce alone")
    fused = (prof.get("mlp/revgraph/single/1") or {}).get("phases_ms_per_step", {}).get("step graph")
    cost = (f"about {alone / 2:.1f} ms (the MLP's two all-reduces alone, back to back: {alone:.2f} ms a step, "
            f"against {fused:.2f} ms for its whole fused step in one process)") if alone and fused else \
        "about a millisecond"
    scale = {m: (r(m, "revgraph", "ddp", 2) or 0) / (r(m, "revgraph", "single", 1) or 1) for m in res["models"]}
    best = NAMES.get(max(scale, key=scale.get), "")
    dense2 = r("embed", "torch-dense", "ddp", 2) or 0
    trail = (" Both sparse embeddings trail PyTorch's dense one (one all-reduce of 512 KiB) at 2 processes: here "
             "the number of round trips matters more than the bytes.") if dense2 > max(
        r("embed", "torch", "ddp", 2) or 0, r("embed", "revgraph", "ddp", 2) or 0) else ""
    return ["", "### Reading the numbers", "",
            f"- One process: revgraph's throughput over PyTorch's is {one}.",
            (f"- Two processes over one: {two}. On this machine a gloo round trip between the two processes "
            f"(TCP over loopback, threads woken on 2 shared, busy cores) costs {cost}, as much as a whole step "
            "of these small models or more, so the second process rarely pays for the exchange; of the three, "
            f"the {best} comes closest to scaling."),
            ("- Round trips per step. revgraph (since issue 25) all-reduces each gradient bucket once, the loss "
            "and every rank's count of sparse rows riding in the last bucket, and gathers the indices and rows "
            "of all sparse tables in one all-gather of one packed byte buffer: one round trip per bucket plus "
            "one for all sparse tables. DDP all-reduces each gradient bucket once and leaves the loss local; for "
            "a sparse gradient gloo's sparse all-reduce all-gathers metadata, indices and values in turn."
            f"{trail}"),
            ("- With several buckets revgraph runs the grad graph in segments and all-reduces each bucket while "
            "the next segment runs (the timeline section below); with a world of 1 the fused step graph would "
            "still beat the split one with its collectives (the table of the distributed paths in 1 process).")]


def render(res: dict, json_path: str) -> str:
    mach = res["machine"]
    start, end = ([round(x, 2) for x in res[k]] for k in ("load_start", "load_end"))
    load = f"{start} at the start, {end} at the end"
    lines = [BEGIN, "## Data-parallel training: throughput against PyTorch DDP", "",
             (f"Written by `{res['command']}` ({res['mode']} run) on {res['date']}, in {res['minutes']:.1f} "
              f"minutes. Raw numbers, every launch: `{json_path}`; `python bench/ddp.py --render {json_path}` "
              "rewrites this section from them (bench/run.py rewrites the rest of this file and keeps it)."), "",
             ("Training throughput in samples per second of the global batch, with Adam and cross-entropy, for "
             "revgraph (`rg.Trainer(..., threads=1)`; with 2 processes `distributed=True`: grad graph, gloo "
             "all-reduce, update graph) and the same model in PyTorch (same shapes and initial values, "
             "`torch.optim.Adam`, `torch.set_num_threads(1)`; with 2 processes `DistributedDataParallel` on "
             f"gloo). Every process has 1 thread and a batch of {res['batch']} samples, so a step of 2 processes "
             "trains on twice the samples. Each configuration is a launch of its own under torchrun "
             "(`python -m torch.distributed.run --standalone --nproc-per-node N bench/ddp_worker.py ...`); graph "
             f"build, sessions and {res['warmup']} warm-up steps are not timed, then a fixed number of steps is "
             f"({_steps(res, '1')} steps of the models in table order with 1 process, {_steps(res, '2')} with 2), "
             "from a barrier to a barrier. revgraph "
             "and PyTorch take turns (who goes first alternates); each number is the median over "
             f"{res['turns']} turns, each ratio the ratio of two medians."), "",
             "| | |", "| :--- | :--- |",
             f"| machine | {mach['cpu']}, {mach['cores']} cores, {mach['platform']} |",
             f"| load average (1, 5, 15 min) | {load} (shared machine: other processes ran during the run) |",
             f"| revgraph | {res['revgraph']}, Python {mach['python']}, onnxruntime {mach['onnxruntime']} |",
             f"| numpy | {mach['numpy']} |",
             f"| PyTorch | {mach['torch']} (eager, CPU, gloo) |", "",
             ("Models (bench/ddp_models.py): "
              + "; ".join(f"**{NAMES.get(m, m)}**: {d}" for m, d in res["models"].items())
              + ". The embedding's table is updated row by row in both: revgraph's lazy sparse Adam (its gradient "
             "is rows; 2 processes all-gather the rows, never densified) and PyTorch's "
             "`nn.Embedding(sparse=True)` with `SparseAdam` (the linear layer with `Adam`; DDP all-reduces sparse "
             "gradients through gloo)."), "",
             "### Throughput (samples/s)", "",
             ("*rg / PT*: revgraph's throughput over PyTorch's (above 1: revgraph is faster): the ratio of the "
              "medians, and in parentheses the median over turns of the ratio of the two launches of a turn, "
              "which ran back to back (less sensitive to the load drifting between turns). *2/1*: the "
              "throughput of 2 processes over that of 1 process (2.00x is perfect scaling on 2 cores)."), "",
             *_md(HEAD, rows(res))]
    extra = []
    for m in res["models"]:
        got = {f"{fw}/{mode}/{n}": _m(res, m, fw, mode, n) for fw in ("revgraph", "torch", "torch-dense")
               for mode, n in (("single", 1), ("ddp", 1), ("ddp", 2))}
        if got["revgraph/ddp/1"] or got["torch/ddp/1"]:
            extra.append([NAMES.get(m, m), _num(got["revgraph/single/1"]), _num(got["revgraph/ddp/1"]),
                          _ratio(got["revgraph/ddp/1"], got["revgraph/single/1"]), _num(got["torch/single/1"]),
                          _num(got["torch/ddp/1"]), _ratio(got["torch/ddp/1"], got["torch/single/1"])])
    if extra:
        lines += ["", ("The distributed paths in 1 process (a world of 1: the split step and its exchange code, "
                       "DDP's hooks and reducer), against the plain single-process paths above:"), "",
                  *_md(["model", "revgraph fused", "revgraph distributed", "ratio", "PyTorch plain", "PyTorch DDP",
                        "ratio"], extra)]
    dense = [(n, _m(res, "embed", "torch-dense", mode, n), _m(res, "embed", "torch", mode, n),
              _m(res, "embed", "revgraph", mode, n)) for mode, n in (("single", 1), ("ddp", 2))]
    if any(d for _, d, _, _ in dense):
        lines += ["", ("The embedding in PyTorch with dense gradients (`nn.Embedding(sparse=False)`, one `Adam`; "
                       "DDP all-reduces the whole 2048 x 64 gradient) against the sparse PyTorch model and revgraph:"),
                  "",
                  *_md(["processes", "PyTorch dense", "PyTorch sparse", "revgraph", "rg / PT dense"],
                       [[str(n), _num(d), _num(s), _num(r), _ratio(r, d)] for n, d, s, r in dense])]
    spread = _spread(res)
    if spread:
        lines += ["", spread]
    lines += _profile(res)
    lines += _ops(res)
    lines += _notes(res)
    lines += ["", (f"Regenerate: `python bench/ddp.py` (about {res['minutes']:.0f} minutes; `--quick`: 1 turn, fewer "
                   "steps, about 2 minutes, writes `bench/results/ddp-quick.json` and no doc); `--commit REV` "
                   "measures revgraph as committed."), END]
    return "\n".join(lines) + "\n"


def write_section(doc: Path, section: str, begin: str = BEGIN, end: str = END) -> None:
    """Put ``section`` between the markers ``begin`` and ``end`` of ``doc`` (replacing what was there), or at
    its end."""
    text = doc.read_text() if doc.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)
