"""docs/benchmarks.md from the results of bench/run.py (``render``), or from a saved JSON file:

    python bench/report.py bench/results/full.json -o docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STEP_GOAL = 1.0   # revgraph step time / PyTorch eager step time, batch 64, MLP, CNN, Transformer
BUILD_GOAL = 2.0  # revgraph build time / onnxruntime-training build time
MODEL_NAMES = {"mlp": "MLP", "cnn": "CNN", "transformer": "Transformer", "rnn": "RNN (Loop, T=100)"}


def s(x) -> str:
    if x is None:
        return "–"
    if x >= 100:
        return f"{x:,.0f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{1e3 * x:.1f} ms" if x >= 0.01 else f"{1e3 * x:.2f} ms"
    return f"{1e6 * x:.0f} µs"


def ms(x) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}x"


def table(header: list[str], rows: list[list], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def top_ops(ops: dict, k: int = 6) -> str:
    return ", ".join(f"{o} {n}" for o, n in list(ops.items())[:k])


# ------------------------------------------------------------------------------------------------ sections


def header(res: dict, json_path) -> str:
    m = res["machine"]
    v = res.get("versions", {})
    rgv = v.get("revgraph worker", {})
    ortv = v.get("onnxruntime-training worker", {})
    jv = v.get("jax worker", {})
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{res['command']}` ({res['mode']} run) on {res['started'][:10]}, in "
        f"{res.get('seconds', 0) / 60:.1f} minutes. Raw numbers: `{_rel(json_path)}`. Every comparison below was "
        "measured in the same run, on the same machine, with the frameworks taking turns (round-robin between "
        "worker processes); times are medians over the rounds, ratios are ratios of those medians.",
        "",
        table(["", ""], [
            ["machine", f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}"],
            ["load average (1, 5, 15 min)", f"{res.get('load_start')} at the start, {res.get('load_end')} at the end "
             "(the machine is shared: other processes ran during the benchmark)"],
            ["revgraph", f"commit {m['commit']}" + (" with local changes under src/" if m.get("src_modified") else "")
             + f", Python {m['python']}"],
            ["revgraph's runtime", f"onnxruntime {rgv.get('onnxruntime')}, onnx {rgv.get('onnx')}, "
             f"numpy {rgv.get('numpy')}"],
            ["PyTorch", f"{v.get('pytorch worker', {}).get('torch')} (eager, CPU)"],
            ["JAX", f"jax {jv.get('jax')}, jaxlib {jv.get('jaxlib')}, numpy {jv.get('numpy')} (own venv)" if jv
             else "not available"],
            ["onnxruntime-training", f"{ortv.get('onnxruntime-training')} with onnx {ortv.get('onnx')}, numpy "
             f"{ortv.get('numpy')}, torch {ortv.get('torch')} (own venv)" if ortv else "not available"],
        ], "ll"),
    ]
    if res.get("errors"):
        lines += ["", "Errors during the run: " + "; ".join(res["errors"])]
    return "\n".join(lines)


def _rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return str(p)


def goals(res: dict) -> str:
    rows = []
    for e in res.get("steps", {}).get("grad", []):
        if e["batch"] == 64 and e["model"] in ("mlp", "cnn", "transformer"):
            r = _r(e["ms"].get("revgraph"), e["ms"].get("pytorch"))
            v = _verdict(r, STEP_GOAL)
            if contended(res, e):
                v += " (unreliable: " + contended(res, e) + ")"
            rows.append([f"training step ≤ PyTorch eager: {MODEL_NAMES[e['model']]}, batch 64, {e['threads']} "
                         f"thread{'s' if e['threads'] > 1 else ''}", ratio(r), v])
    for c in res.get("build", {}).get("cases", []):
        if c.get("ratio") is not None and c["group"] != "synthetic":
            rows.append([f"build within 2x of onnxruntime-training: {c['name']}"
                         + (" (adapted model)" if c.get("compared_on") == "adapted" else ""),
                         ratio(c["ratio"]), _verdict(c["ratio"], BUILD_GOAL)])
    for c in res.get("build", {}).get("cases", []):
        if c.get("ratio") is not None and c["group"] == "synthetic":
            rows.append([f"build within 2x of onnxruntime-training: {c['name']}", ratio(c["ratio"]),
                         _verdict(c["ratio"], BUILD_GOAL)])
    if not rows:
        return ""
    return "\n".join(["## Goals", "", "Ratio = revgraph's time / the other's time (below 1: revgraph is faster).",
                      "", table(["goal", "ratio", "met?"], rows, "lrl")])


def contended(res: dict, e: dict) -> str:
    """Why a multi-threaded step entry is unreliable, or "": a framework that runs slower with more threads than
    with one on the same model and batch was competing for the cores with other processes (the machine is
    shared; OpenMP's and onnxruntime's spinning thread pools degrade badly when a core is taken)."""
    if e["threads"] == 1:
        return ""
    one = next((x for x in res["steps"]["grad"] if x["threads"] == 1 and x["model"] == e["model"]
                and x["batch"] == e["batch"]), None)
    if one is None:
        return ""
    slow = [fw for fw, t in e["ms"].items() if one["ms"].get(fw) and t > 1.1 * one["ms"][fw]]
    return (", ".join(slow) + f" slower with {e['threads']} threads than with 1") if slow else ""


def _r(a, b):
    return a / b if a and b else None


def _verdict(r, goal):
    if r is None:
        return "–"
    return "yes" if r <= goal else f"no: {r / goal:.2f}x over the goal"


def build_section(res: dict) -> str:
    b = res.get("build")
    if not b:
        return ""
    out = ["## 1. Gradient-graph build time", "",
           "From a parsed `onnx.ModelProto` to the gradient `ModelProto` in memory. revgraph: `rg.load` (opset "
           "conversion, SSA, shape inference), the loss (`revgraph.train.loss_graph`'s cross-entropy for the "
           "classifiers; the model's scalar output otherwise), parameters as graph inputs, `rg.gradient`, "
           "`rg.to_onnx`. onnxruntime-training: what `generate_artifacts` does in memory (`TrainingBlock` with its "
           "`CrossEntropyLoss` or `PassThrough` loss block: onnx checker and shape inference, ORT's pre-training "
           "graph optimisations, the C++ `GradientGraphBuilder`, gradient-accumulation nodes, the eval model); "
           "files are not written in either timing. Both differentiate with respect to the same parameters.", ""]
    syn = [c for c in b["cases"] if c["group"] == "synthetic"]
    if syn:
        rows = []
        for c in syn:
            ph = c["revgraph_phases_s"]
            ort_cell = s(c["ort_s"]) if not c.get("ort_timeout") else f"> {c['ort_timeout_s']:.0f} s (stopped)"
            rows.append([c["name"], f"{c['n']:,}", s(c["revgraph_s"]),
                         f"{s(ph['load'])} / {s(ph['gradient'])} / {s(ph['to_onnx'])}",
                         f"{1e6 * c['revgraph_s'] / c['n']:.0f}", ort_cell,
                         f"{1e6 * c['ort_s'] / c['n']:.0f}" if c["ort_s"] else "–", ratio(c["ratio"])])
        out += ["### Synthetic graphs", "",
                "A chain `loss = ReduceSum(f_n(...f_1(x * w)))` of alternating `Sin`/`Tanh`, and a fan-out where "
                "`h = x * w` feeds (n - 1) / 2 consumers `h * s_i` (distinct constants, so that no "
                "common-subexpression elimination merges them) whose results a chain of `Add` nodes sums; gradient "
                "with respect to `w` (whose gradient is the accumulation of all the consumers' contributions).", "",
                table(["graph", "nodes", "revgraph", "load / gradient / to_onnx", "µs per node", "onnxruntime-training",
                       "µs per node", "revgraph / ORT"], rows), ""]
        grow = []
        for kind, pts in b.get("growth", {}).items():
            for p in pts:
                grow.append([kind, f"{p['from']:,} → {p['to']:,}", f"{p['revgraph_exponent']:.2f}",
                             f"{p['ort_exponent']:.2f}" if p["ort_exponent"] is not None else "–"])
        if grow:
            out += ["How the time grows: the exponent k in time ∝ nodes^k between two sizes (1 is linear).", "",
                    table(["graph", "sizes", "revgraph k", "onnxruntime-training k"], grow), ""]
    real = [c for c in b["cases"] if c["group"] != "synthetic"]
    if real:
        rows = []
        for c in real:
            ph = c["revgraph_phases_s"]
            note = ""
            if c.get("compared_on") == "adapted":
                note = f"on the adapted model ({c.get('adaptation')}); revgraph on the original: " \
                       f"{s(c.get('revgraph_original_s'))}"
            elif c.get("ort_error"):
                note = f"onnxruntime-training fails: {c['ort_error_explained']}"
            if c.get("ort_timeout"):
                note = f"onnxruntime-training did not finish within {c['ort_timeout_s']:.0f} s"
            rows.append([c["name"], f"{c['nodes']:,}", c["params_count"], s(c["revgraph_s"]),
                         f"{s(ph['load'])} / {s(ph['gradient'])} / {s(ph['to_onnx'])}", s(c["ort_s"]),
                         ratio(c["ratio"]), s(c.get("generate_artifacts_s")), note])
        out += ["### Models", "",
                "ResNet-50 and DenseNet-121 are the onnx wheel's `light_*.onnx` with `revgraph.lift.lift_constants` "
                "(weights as initializers) and `loss = ReduceSum(output)`; the PyTorch models are those of the step "
                "benchmark at batch 64 (`bench/models.py`). *generate_artifacts* is the documented call itself "
                "(files, checkpoint, AdamW optimizer model), once.", "",
                table(["model", "forward nodes", "params", "revgraph", "load / gradient / to_onnx",
                       "onnxruntime-training", "revgraph / ORT", "generate_artifacts", "notes"], rows,
                      "lrrrrrrrl"), ""]
    fails = [c for c in b["cases"] if c.get("ort_error") or c.get("ort_timeout")]
    if fails:
        out += ["### Where onnxruntime-training fails", ""]
        for c in fails:
            if c.get("ort_timeout"):
                k = next((p["ort_exponent"] for p in b.get("growth", {}).get(c.get("kind"), [])
                          if p["ort_exponent"] is not None), None)
                out.append(f"- **{c['name']}**: its build did not finish within {c['ort_timeout_s']:.0f} s and was "
                           "stopped" + (f" (between the smaller sizes its time grew as nodes^{k:.2f})" if k else "")
                           + f"; revgraph built the same graph in {s(c['revgraph_s'])}.")
                continue
            line = f"- **{c['name']}**: {c['ort_error_explained']}."
            if c.get("compared_on") == "adapted":
                line += f" It builds after an adaptation of the model: {c['adaptation']}; the comparison above " \
                        "uses the adapted model for both tools."
            elif c.get("ort_adapted_error"):
                line += f" The adapted model fails too: {c['ort_adapted_error_explained']}."
            line += f" Its message: `{_short(c['ort_error'])}`"
            out.append(line)
        out.append("")
    return "\n".join(out)


def _short(msg: str, n: int = 220) -> str:
    msg = " ".join(msg.split()).replace("`", "'")
    return msg if len(msg) <= n else "…" + msg[-n:]


def steps_section(res: dict) -> str:
    st = res.get("steps")
    if not st:
        return ""
    out = ["## 2. Training-step time", "",
           "Forward, cross-entropy loss and the gradients of every parameter, on the same parameters and batch in "
           "each framework (a check compares the loss and the sum of squared gradients with revgraph's). "
           "revgraph: the gradient graph of `loss_graph` + `rg.gradient` (parameters as inputs) run by "
           "onnxruntime through an IO binding (inputs bound once, outputs allocated by onnxruntime per step, "
           "`intra_op_num_threads` = threads, default graph optimisations). PyTorch: eager, `zero_grad(set_to_none="
           "True)`, `F.cross_entropy(model(x), y).backward()`, `torch.set_num_threads(threads)`. JAX: "
           "`jax.jit(jax.value_and_grad(loss))` and `block_until_ready`, XLA's CPU thread pool set to the same "
           "thread count. Models (`bench/models.py`): MLP 784-512-512-10; ResNet-style CNN on 3x32x32 (stem and "
           "3 residual blocks with batch norm, 16/32/64 channels); Transformer encoder (2 layers, width 128, 4 "
           "heads, sequence 32); RNN `tanh(h W + x_t U + b)`, hidden 128, T = 100, as an ONNX `Loop` (PyTorch: a "
           "Python loop; JAX: `lax.scan`). Batch sizes are static in each exported model.", ""]
    for threads in sorted({e["threads"] for e in st["grad"]}):
        rows = []
        for e in [x for x in st["grad"] if x["threads"] == threads]:
            m = e["ms"]
            chk = e.get("check", {})
            agree = all(v.get("agree") for v in chk.values()) if chk else None
            errs = "; ".join(f"{k}: {_short(v, 80)}" for k, v in e.get("errors", {}).items())
            flag = contended(res, e)
            rows.append([MODEL_NAMES[e["model"]], e["batch"], ms(m.get("revgraph")), ms(m.get("pytorch")),
                         ms(m.get("jax")), ratio(_r(m.get("revgraph"), m.get("pytorch"))),
                         ratio(_r(m.get("revgraph"), m.get("jax"))),
                         ("yes" if agree else "NO" if agree is not None else "–") + (f" ({errs})" if errs else ""),
                         e.get("load", [None])[0], flag or ""])
        out += [f"### {threads} thread{'s' if threads > 1 else ''}", "",
                table(["model", "batch", "revgraph ms", "PyTorch ms", "JAX ms", "revgraph / PyTorch",
                       "revgraph / JAX", "same loss and gradients", "load", "contention"], rows, "lrrrrrrlrl"), ""]
        if threads > 1 and any(contended(res, e) for e in st["grad"] if e["threads"] == threads):
            out += ["*Contention*: a framework ran slower with more threads than with one, because other processes "
                    "held a core while it ran (*load* is the 1-minute load average after the entry; above the "
                    "number of cores, processes wait for a core). PyTorch's OpenMP pool (libgomp, spinning "
                    "barriers) degrades most: one descheduled thread stalls every parallel region. Read these rows "
                    "as a measure of robustness to a shared machine, not of speed; the 1-thread table is the "
                    "comparison of kernels and overheads.", ""]
    if st.get("adam"):
        rows = []
        for e in st["adam"]:
            m = e["ms"]
            g = e.get("grad_ms", {})
            rows.append([MODEL_NAMES[e["model"]], e["batch"], e["threads"], ms(m.get("revgraph")),
                         ms(m.get("pytorch")), ratio(_r(m.get("revgraph"), m.get("pytorch"))),
                         ms(g.get("revgraph")), ms(g.get("pytorch"))])
        out += ["### Whole Adam step", "",
                "`rg.Trainer` (the training-step graph of `revgraph.train.training_graph`: forward, loss, backward "
                "and Adam in one graph, parameters and state kept in onnxruntime buffers swapped by two IO "
                "bindings) against PyTorch eager with `torch.optim.Adam`.", "",
                table(["model", "batch", "threads", "revgraph ms", "PyTorch ms", "revgraph / PyTorch",
                       "revgraph fwd+bwd ms", "PyTorch fwd+bwd ms"], rows), "",
                "The last two columns are the forward-and-backward steps of section 2 timed again in the same turns "
                "as the Adam steps, so that the difference is the cost of the update.", ""]
    return "\n".join(out)


def memory_section(res: dict) -> str:
    mem = res.get("memory")
    if not mem:
        return ""
    out = ["## 3. Peak memory of the backward pass", ""]
    if mem.get("loops"):
        steps = sorted({r["steps"] for r in mem["loops"]})
        policies = list(dict.fromkeys(r["policy"] for r in mem["loops"]))
        by = {(r["steps"], r["policy"]): r for r in mem["loops"]}
        rows = []
        for t in steps:
            row = [f"{t:,}"]
            for p in policies:
                r = by.get((t, p))
                row.append(f"{r['peak_mb']:.1f} MB, {s(r['time_s'])}" if r else "–")
            rows.append(row)
        out += ["### Loops", "",
                "bench/loop_memory.py's RNN body (hidden 256, batch 8, input 32; gradients of W, U, b, h0) for "
                "each residual policy of `rg.gradient(..., checkpoint=...)`, each in a fresh process with "
                "onnxruntime's arena off: the peak resident size during the first forward-plus-backward run minus "
                "the size just before it, and the median time of 3 further runs.", "",
                table(["T", *[f"`{p}`" if not p.isdigit() else f"K = {p}" for p in policies]], rows), ""]
    acc = mem.get("accumulation")
    if acc:
        rows = [[f"`{r['accumulate']}`", f"`{r['order']}`", f"{r['peak_mb']:.1f}", s(r["time_s"]), r["nodes"]]
                for r in acc]
        out += ["### Accumulation: one value read by 64 consumers", "",
                "`h = tanh(x W)` (64 x 4096 floats, 1 MiB) read by 64 consumers `c_i = h * w_i` (the `w_i` are graph "
                "inputs, so onnxruntime cannot fold the backward pass into constants), loss `sum_i ReduceSum(c_i)`; "
                "gradients of W and every w_i. `accumulate=\"sum\"` adds the 64 contributions to dL/dh with one "
                "`Sum` (all 64 alive at once); `\"running\"` adds each as it arrives. Each in a fresh process, "
                "arena off, under onnxruntime's two execution orders (`SessionOptions.execution_order`); medians "
                "over the runs.", "",
                table(["accumulate", "execution order", "peak MB", "fwd+bwd time", "nodes"], rows, "llrrr"), ""]
        by = {(r["accumulate"], r["order"]): r for r in acc}
        d_sum, d_run = by.get(("sum", "DEFAULT")), by.get(("running", "DEFAULT"))
        p_sum, p_run = by.get(("sum", "PRIORITY_BASED")), by.get(("running", "PRIORITY_BASED"))
        if d_sum and d_run and p_sum and p_run and d_run["peak_mb"] > 0.5 * d_sum["peak_mb"] \
                and p_run["peak_mb"] < 0.5 * p_sum["peak_mb"]:
            out += [f"Under onnxruntime's default execution order, `running` peaks at {d_run['peak_mb']:.1f} MB "
                    f"against {d_sum['peak_mb']:.1f} MB for `sum`: onnxruntime does not run the nodes in the order "
                    "revgraph wrote them, but computes every contribution (each is ready as soon as the forward pass "
                    "is done) before the additions, so all 64 are alive at once either way. With "
                    f"`execution_order = PRIORITY_BASED` it follows the written order and `running` peaks at "
                    f"{p_run['peak_mb']:.1f} MB against {p_sum['peak_mb']:.1f} MB for `sum`. `rg.Session` and "
                    "`rg.Trainer` use the default order, so `--accumulate running` saves memory only in a runtime "
                    "that keeps the node order.", ""]
        elif d_sum and d_run:
            out += [f"`running` peaks at {d_run['peak_mb']:.1f} MB against {d_sum['peak_mb']:.1f} MB for `sum` under "
                    "the default execution order.", ""]
    return "\n".join(out)


def size_section(res: dict) -> str:
    b = res.get("build")
    if not b:
        return ""
    rows = []
    for c in b["cases"]:
        if c["group"] == "synthetic" and c["n"] > 10000:
            continue
        r = c["revgraph_stats"] if c.get("compared_on") != "adapted" else c.get("revgraph_adapted_stats")
        o = c.get("ort_stats")
        rows.append([c["name"] + (" (adapted)" if c.get("compared_on") == "adapted" else ""), f"{r['nodes']:,}",
                     r["initializers"], r["inputs"], f"{o['nodes']:,}" if o else "–", o["initializers"] if o else "–",
                     o["inputs"] if o else "–", ratio(r["nodes"] / o["nodes"]) if o else "–"])
    out = ["## 4. Size of the gradient graphs", "",
           "Nodes (loop bodies included), initializers and graph inputs of the graph each tool builds in section 1 "
           "(forward, loss and backward; onnxruntime-training's training model also holds one "
           "`InPlaceAccumulatorV2` per parameter, for gradient accumulation, and uses its fused contrib operators "
           "such as `ConvGrad`, `ReluGrad`, `BatchNormalizationGrad`, `SoftmaxCrossEntropyLossGrad`; revgraph "
           "writes default-domain ONNX only). Both take the parameters as graph inputs.", "",
           table(["model", "revgraph nodes", "initializers", "inputs", "ORT nodes", "initializers", "inputs",
                  "nodes revgraph / ORT"], rows), ""]
    rows = []
    for c in b["cases"]:
        if c["group"] == "synthetic":
            continue
        r = c["revgraph_stats"] if c.get("compared_on") != "adapted" else c.get("revgraph_adapted_stats")
        o = c.get("ort_stats")
        rows.append([c["name"], top_ops(r["ops"], 8), top_ops(o["ops"], 8) if o else "–"])
    out += ["Most frequent operators:", "", table(["model", "revgraph", "onnxruntime-training"], rows, "lll"), ""]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------- hotspots


def _share(part, whole):
    return f"{100 * part / whole:.0f}%" if whole else "–"


def hotspots_section(res: dict) -> str:
    prof = res.get("profile", {})
    out = ["## 5. Where revgraph misses the goals, and why", ""]
    missed_step = []
    for e in res.get("steps", {}).get("grad", []):
        if e["batch"] == 64 and e["model"] in ("mlp", "cnn", "transformer"):
            r = _r(e["ms"].get("revgraph"), e["ms"].get("pytorch"))
            if r is not None and r > STEP_GOAL:
                missed_step.append(f"{MODEL_NAMES[e['model']]} ({e['threads']} thread{'s' if e['threads'] > 1 else ''}"
                                   f"): {r:.2f}x PyTorch's time, {100 * (r - 1):.0f}% slower")
    missed_build = [f"{c['name']}: {c['ratio']:.2f}x onnxruntime-training's time ({c['ratio'] / BUILD_GOAL:.2f}x the "
                    "allowed 2x)" for c in res.get("build", {}).get("cases", [])
                    if c.get("ratio") is not None and c["ratio"] > BUILD_GOAL]
    out += ["Missed step-time goals: " + ("; ".join(missed_step) if missed_step else "none") + ".", "",
            "Missed build-time goals: " + ("; ".join(missed_build) if missed_build else "none") + ".", ""]
    # comparison with JAX too (what a graph compiler reaches on the same machine)
    jx = []
    for e in res.get("steps", {}).get("grad", []):
        r = _r(e["ms"].get("revgraph"), e["ms"].get("jax"))
        if r is not None and e["threads"] == 1:
            jx.append(f"{MODEL_NAMES[e['model']]} b{e['batch']} {r:.2f}x")
    if jx:
        out += ["For reference, revgraph / JAX `jit` (1 thread): " + ", ".join(jx) + ".", ""]
    ort = prof.get("ort", {})
    if ort:
        out += ["### Step time: onnxruntime's profiler (batch 64)", "",
                "Kernel time per step by operator type and by kind of node (the names revgraph gives: forward "
                "nodes, `grad/` VJP nodes, `accum/` accumulation), after onnxruntime's own graph optimisations "
                "(which fuse and rename some nodes). *Outside kernels* is the step's wall time minus the kernel "
                "time (onnxruntime's per-node overhead, allocation, the Python call).", ""]
        rows = []
        for model, p in ort.items():
            cats = ", ".join(f"{k} {ms(v)}" for k, v in p["by_category"].items())
            rows.append([MODEL_NAMES[model], ms(1e3 * p["wall"]), ms(1e3 * p["kernel"]),
                         ms(max(0.0, 1e3 * (p["wall"] - p["kernel"]))) if model != "rnn" else "(loop: nested)",
                         cats, f"{p['nodes_before']} → {p['nodes_after']}"])
        out += [table(["model", "step ms", "kernels ms", "outside kernels ms", "kernel ms by kind", "nodes before → "
                       "after ORT's optimiser"], rows, "lrrrll"), ""]
        for model, p in ort.items():
            kern = 1e3 * p["kernel"]
            ops = ", ".join(f"{r['op']} {ms(r['ms'])} ({_share(r['ms'], kern)}, {r['calls']} nodes)"
                            for r in p["by_op"][:8])
            nodes = ", ".join(f"`{r['node']}` {ms(r['ms'])}" for r in p["slowest_nodes"][:6])
            out += [f"- **{MODEL_NAMES[model]}**: by operator: {ops}. Slowest nodes: {nodes}."]
        out.append("")
    audit = prof.get("audit", {})
    if audit:
        findings = ["dead nodes", "repeated subexpressions", "Shape nodes", "Shape nodes over static shapes",
                    "nodes with only constant inputs (foldable at build time)", "arithmetic on known zeros",
                    "zero tensors materialised (ConstantOfShape of 0)", "Transpose -> Transpose pairs",
                    "Reshape -> Reshape pairs", "Identity nodes"]
        rows = []
        for name, a in audit.items():
            ra = a["revgraph"]["counts"]
            oa = a.get("ort", {}).get("counts") if a.get("ort") else None
            row = [name, a["revgraph"]["nodes"]]
            for f in findings:
                c = ra.get(f, {})
                tot, bwd = sum(c.values()), c.get("backward", 0)
                cell = f"{tot} ({bwd})" if tot else "0"
                if oa is not None:
                    cell += f" / {sum(oa.get(f, {}).values())}"
                row.append(cell)
            rows.append(row)
        out += ["### Redundant nodes in the gradient graphs", "",
                "A static audit of each gradient graph (bench/rg_tasks.py `audit`). Cells: revgraph's count (of "
                "which in nodes the backward pass emitted) / onnxruntime-training's count where it builds the "
                "model. *Dead*: no path to an output. *Repeated*: same operator, attributes and inputs as an "
                "earlier node (after merging earlier repeats). *Foldable*: every input is a constant, so the value "
                "could be computed when the graph is built. *Arithmetic on zeros*: an operand is a known all-zero "
                "tensor.", "",
                table(["graph", "nodes", "dead", "repeated", "Shape", "Shape of static", "foldable",
                       "arith. on zeros", "ConstantOfShape 0", "Transpose→Transpose", "Reshape→Reshape",
                       "Identity"], rows), ""]
        ex = []
        for name, a in audit.items():
            e = a["revgraph"]["examples"]
            for f in ("dead nodes", "repeated subexpressions", "Transpose -> Transpose pairs", "Reshape -> Reshape pairs",
                      "arithmetic on known zeros"):
                if e.get(f) and name in ("Transpose", "CNN", "DenseNet-121", "RNN (Loop, T=100)", "MLP"):
                    ex.append(f"- {name}, {f}: " + ", ".join(f"`{x}`" for x in e[f][:3]))
        if ex:
            out += ["Examples:", "", *ex, ""]
    var = prof.get("session_variants", {})
    if var:
        names = list(next(iter(var.values())).keys())
        rows = [[MODEL_NAMES[m], *[ms(1e3 * v[n]) for n in names]] for m, v in var.items()]
        out += ["### Session options (batch 64, ms per step, medians of turns)", "",
                table(["model", *names], rows), ""]
    micro = prof.get("micro_relu")
    if micro:
        keys = [k for k in micro[0] if k != "shape"]
        rows = [["x".join(map(str, r["shape"])), *[ms(1e3 * r[k]) for k in keys],
                 ratio(r[keys[0]] / r[keys[1]])] for r in micro]
        out += ["### Micro-benchmark: the ReLU VJP", "",
                "The same values for finite cotangents; ms per run on onnxruntime.", "",
                table(["shape", *keys, "Where / Mul"], rows), ""]
    conv = prof.get("micro_conv")
    if conv:
        rows = [[k, ms(1e3 * v)] for k, v in conv["seconds"].items()]
        out += ["### Micro-benchmark: the weight gradient of a 3x3 convolution", "",
                f"x {conv['shape']['x']}, w {conv['shape']['w']} (the CNN's first residual block), padding 1; "
                f"revgraph's nodes: {', '.join(conv['nodes']['revgraph'])}.", "",
                table(["implementation", "ms"], rows), ""]
    cp = prof.get("cprofile", {})
    if cp:
        out += ["### Build time: cProfile", ""]
        for name, p in cp.items():
            tot = ", ".join(f"`{r['function']}` {r['tottime']:.3f} s ({r['calls']:,} calls)" for r in p["by_tottime"][:8])
            cum = ", ".join(f"`{r['function']}` {r['cumtime']:.3f} s" for r in p["revgraph_by_cumtime"][:8])
            out += [f"- **{name}** ({p['wall']:.2f} s under the profiler). Own time: {tot}.", "",
                    f"  revgraph functions by cumulative time: {cum}.", ""]
    notes = hotspot_notes(res)
    if notes:
        out += ["### Hotspots to optimise next", "", *notes, ""]
    return "\n".join(out)


def hotspot_notes(res: dict) -> list[str]:
    """The concrete findings, each backed by a number measured in this run."""
    prof = res.get("profile", {})
    ort = prof.get("ort", {})
    notes = []

    def op_ms(p, op):
        return sum(r["ms"] for r in p["by_op"] if r["op"] == op)

    where = [(m, op_ms(p, "Where"), 1e3 * p["kernel"]) for m, p in ort.items() if op_ms(p, "Where")]
    origins = {name: a["revgraph"].get("where_origins", {}) for name, a in prof.get("audit", {}).items()
               if name in ("MLP", "CNN", "Transformer", "RNN (Loop, T=100)")}
    micro = prof.get("micro_relu") or []
    if where:
        spd = ", ".join(f"{r[list(r)[1]] / r[list(r)[2]]:.1f}x" for r in micro)
        notes.append("1. **`Where` in VJPs.** " + ", ".join(f"{MODEL_NAMES[m]}: {ms(w)} ms of {ms(k)} ms kernel "
                     f"time ({_share(w, k)})" for m, w, k in where) + ". " + (("The backward `Where` nodes, by the forward operator whose VJP wrote them: " + "; ".join(
                         f"{n}: " + ", ".join(f"{op} {c}" for op, c in o.items()) for n, o in origins.items() if o)
                     + ". ") if any(origins.values()) else "") + "revgraph writes the ReLU VJP as `Where(Greater(x, 0), g, 0)` (rules/elementwise.py `relu`) "
                     "and the Dropout VJP as a `Where` on the mask as well. onnxruntime's `Where` with a broadcast "
                     "scalar runs far slower than a multiply" + (f" ({spd} slower than `Mul(g, Cast(x > 0))` in the "
                     "micro-benchmark above, same values for finite cotangents)" if spd else "") + ": a mask "
                     "multiply removes most of this time. (The strong-zero products of `strong`, "
                     "`Where(Equal(g, 0), 0, g * d)` in the Div, Pow, Sqrt, Reciprocal and Log VJPs, have the same "
                     "form; they do not occur on these models' hot paths.)")
    cnn = ort.get("cnn")
    if cnn:
        convs = [r for r in cnn["slowest_nodes"] if r["op"] == "Conv"]
        conv_total = op_ms(cnn, "Conv")
        ct = op_ms(cnn, "ConvTranspose")
        micro_c = prof.get("micro_conv", {}).get("seconds", {})
        line = (f"2. **Convolution backward.** CNN: `Conv` {ms(conv_total)} ms (forward convolutions and the weight "
                f"gradients) and `ConvTranspose` (input gradients) {ms(ct)} ms of {ms(1e3 * cnn['kernel'])} ms. The "
                "weight gradient is written as a `Conv` of the transposed input with the transposed output gradient "
                "as its kernel (rules/conv.py `weight_grad`): a convolution whose kernel is the whole H x W output "
                "gradient over N input channels, a shape onnxruntime's CPU Conv is not built for (it is tuned for "
                "small kernels), while PyTorch calls oneDNN's dedicated weight-gradient kernel")
        if convs:
            line += f"; the slowest node is `{convs[0]['node']}` at {ms(convs[0]['ms'])} ms"
        if micro_c:
            k = list(micro_c)
            line += (f". Micro-benchmark on the largest layer: {k[0]} {ms(1e3 * micro_c[k[0]])} ms, {k[1]} "
                     f"{ms(1e3 * micro_c[k[1]])} ms, {k[2]} {ms(1e3 * micro_c[k[2]])} ms")
        notes.append(line + ".")
    tr = ort.get("transformer")
    audit = prof.get("audit", {})
    a_tr = audit.get("Transformer", {}).get("revgraph", {}).get("counts", {})
    if tr or a_tr:
        parts = []
        if tr:
            kb, ka = tr.get("nodes_by_kind_before", {}), tr.get("nodes_by_kind_after", {})
            parts.append(f"onnxruntime's optimiser removes {tr['nodes_before'] - tr['nodes_after']} of its "
                         f"{tr['nodes_before']} nodes before running it (by the names that survive: forward "
                         f"{kb.get('forward', 0)} → {ka.get('forward', 0)}, `grad/` {kb.get('grad', 0)} → "
                         f"{ka.get('grad', 0)}, `accum/` {kb.get('accum', 0)} → {ka.get('accum', 0)}; fused nodes "
                         "take the name of one of their parts)")
        for f, label in (("dead nodes", "dead nodes"), ("repeated subexpressions", "repeated subexpressions"),
                         ("Shape nodes", "Shape nodes"), ("Transpose -> Transpose pairs", "Transpose→Transpose pairs"),
                         ("Reshape -> Reshape pairs", "Reshape→Reshape pairs"),
                         ("nodes with only constant inputs (foldable at build time)", "foldable nodes")):
            c = a_tr.get(f, {})
            if c.get("backward"):
                parts.append(f"{c['backward']} {label} in the backward part")
        if tr:
            ts = op_ms(tr, "Transpose")
            rs = op_ms(tr, "ReduceSum")
            parts.append(f"`Transpose` costs {ms(ts)} ms and `ReduceSum` {ms(rs)} ms of {ms(1e3 * tr['kernel'])} ms")
        fwd_fold = a_tr.get("nodes with only constant inputs (foldable at build time)", {}).get("forward", 0)
        notes.append("3. **Shape bookkeeping and batched weight gradients in the Transformer's backward graph.** "
                     + "; ".join(parts) + ". The exported attention block computes its reshape targets at run time "
                     f"(`Shape`, `Gather`, `Unsqueeze`, `Concat`: {fwd_fold} forward nodes whose inputs are all "
                     "constant), so ONNX shape inference loses the static shapes after those reshapes and the VJPs "
                     "fall back to `Shape`-based code: the `Gather` VJP of each of q, k and v (`grad/.../self_attn/"
                     "Gather*`) emits `Shape` of the same tensor again (repeated subexpressions) and a "
                     "`Shape`/`Squeeze` pair it never uses (the dead nodes). The Transpose pairs are the MatMul VJP "
                     "transposing a forward `Transpose` output (two permutations that compose into one). The MatMul "
                     "VJP of a batched activation times a 2-D weight computes the weight gradient as a batched "
                     "MatMul followed by `ReduceSum` over the batch (an intermediate of batch x weight size) instead "
                     "of one GEMM over the flattened batch (the `grad/.../linear*/MatMul/MatMul_1` FusedMatMul nodes among "
                     "the slowest above are these batched weight gradients, each followed by a `ReduceSum` over a "
                     "64 x 128 x 512 intermediate). Folding the "
                     "constant shape arithmetic before differentiating, a CSE and dead-node pass after `backward`, "
                     "and a flattened GEMM for weight gradients would remove these.")
    b1 = [e for e in res.get("steps", {}).get("grad", []) if e["batch"] == 1 and e["threads"] == 1]
    if b1:
        worst = max(b1, key=lambda e: _r(e["ms"].get("revgraph"), e["ms"].get("jax")) or 0)
        r = _r(worst["ms"].get("revgraph"), worst["ms"].get("jax"))
        if r:
            nodes = worst["prepare"].get("revgraph", {}).get("nodes")
            notes.append(f"4. **Per-node overhead at batch 1.** {MODEL_NAMES[worst['model']]} at batch 1 (1 thread): "
                         f"{ms(worst['ms']['revgraph'])} ms for a {nodes}-node graph, {r:.1f}x JAX's fused "
                         "executable: at small sizes the step time is the number of nodes times onnxruntime's "
                         "per-node cost, so every node removed above (and fewer shape-only nodes) counts.")
    rnn1 = next((e for e in res.get("steps", {}).get("grad", []) if e["model"] == "rnn" and e["batch"] == 1
                 and e["threads"] == 1), None)
    p_rnn = ort.get("rnn")
    if rnn1 and rnn1["ms"].get("revgraph") and rnn1["ms"].get("jax"):
        line = (f"5. **Loop overhead.** The RNN at batch 1 (1 thread) takes {ms(rnn1['ms']['revgraph'])} ms, "
                f"{1e3 * rnn1['ms']['revgraph'] / 200:.0f} µs per iteration of the forward and backward loops "
                f"together (T = 100 each), against {ms(rnn1['ms']['jax'])} ms for JAX's `lax.scan`")
        if p_rnn:
            calls = {r["op"]: r["calls"] for r in p_rnn["by_op"]}
            body = ", ".join(f"{op} {n // 100}" for op, n in calls.items() if op != "Loop" and n >= 100)
            line += (f"; per iteration the two loop bodies run about {body} nodes (onnxruntime's profile at batch "
                     "64), among them the `Identity` nodes that stack residuals and the `Gather` of each time step")
        notes.append(line + ". onnxruntime executes a Loop body as a subgraph with per-iteration setup, so nodes "
                     "removed from loop bodies (Identity residuals, recomputed shapes) count T times.")
    upd = []
    for a in res.get("steps", {}).get("adam", []):
        g = a.get("grad_ms", {})
        if a["threads"] == 1 and all(x.get(fw) for x in (a["ms"], g) for fw in ("revgraph", "pytorch")):
            upd.append(f"{MODEL_NAMES[a['model']]} batch {a['batch']}: revgraph {ms(a['ms']['revgraph'] - g['revgraph'])}"
                       f" ms, PyTorch {ms(a['ms']['pytorch'] - g['pytorch'])} ms")
    if upd:
        notes.append("6. **The optimizer update.** Whole Adam step minus forward-and-backward step, both timed in the "
                     "same turns (1 thread): " + "; ".join(upd) + ". revgraph's Adam "
                     "is 13 elementwise nodes per parameter tensor plus 3 output `Identity` nodes (train.py "
                     "`_update`, `_output`), each a separate pass over the parameter's memory with its own output "
                     "buffer; PyTorch's CPU Adam (single-tensor path here) updates `exp_avg`, `exp_avg_sq` and the "
                     "parameter in place. Writing the new state into the old buffers (in-place update through the IO "
                     "binding) and fewer, fused passes would close the gap.")
    var = prof.get("session_variants", {})
    if var:
        best = []
        for m, v in var.items():
            base = v[next(iter(v))]
            k, t = min(v.items(), key=lambda kv: kv[1])
            if t < 0.95 * base:
                best.append(f"{MODEL_NAMES[m]}: {k} {ms(1e3 * t)} ms against {ms(1e3 * base)} ms")
        caveat = ""
        if any("thread" in b or "spinning" in b for b in best):
            caveat = (" (one thread or no spinning winning is a sign that another process held a core: with the "
                      "cores free, two spinning threads are the faster setting)")
        notes.append("7. **Session options.** " + ("; ".join(best) + caveat if best else
                     "no variant measured here beats the defaults (all optimisations, IO binding) by more than 5%")
                     + ".")
    cp = prof.get("cprofile", {})
    if cp:
        parts = []
        for name, p in cp.items():
            top = [r for r in p["by_tottime"] if r["tottime"] > 0.05 * p["wall"]][:3] or p["by_tottime"][:1]
            parts.append(f"{name}: " + ", ".join(f"`{r['function']}` {100 * r['tottime'] / p['wall']:.0f}% "
                                                   f"({r['calls']:,} calls)" for r in top))
        line = ("8. **Build time.** The functions with the most own time, as a share of the profiled build: "
                + "; ".join(parts) + ".")
        fan = prof.get("concat_fan_in")
        fresh = [p for p in cp.values() if any("fresh_name" in r["function"] and r["tottime"] > 0.3 * p["wall"]
                                               for r in p["by_tottime"])]
        if fresh:
            line += (" `ir.fresh_name` probes `base`, `base_1`, `base_2`, ... until a name is free, so a VJP that "
                     "emits many nodes under one prefix (the Concat VJP emits one Slice and two constants per "
                     "input) costs quadratic time")
            if fan:
                line += (f": a {fan['n']:,}-node fan-in into one Concat builds in {s(fan['revgraph_s'])}"
                         + (f" (onnxruntime-training {s(fan['ort_s'])})" if fan.get("ort_s") else ""))
            line += "; a counter per base name makes it linear."
        else:
            line += (" revgraph's time is spread over the Python-level graph walk: `rg.load` (onnx's version "
                     "converter and shape inference), the emitter's per-node ONNX shape inference "
                     "(`Emitter._infer`) and `to_onnx`.")
        notes.append(line)
    return notes


def reproduce(res: dict) -> str:
    return "\n".join([
        "## Reproduce", "",
        "```bash",
        "python bench/run.py            # everything above (full run), writes docs/benchmarks.md and "
        "bench/results/full.json",
        "python bench/run.py --quick    # the same at smaller sizes and fewer rounds, under 10 minutes",
        "python bench/run.py --sections build,memory     # a subset (build, step, memory, profile)",
        "python bench/envs.py           # create the onnxruntime-training and JAX environments only",
        "python bench/loop_memory.py    # the loop-memory table alone",
        "python bench/build_time.py     # revgraph's build time alone",
        "python bench/report.py bench/results/full.json -o docs/benchmarks.md   # re-render from saved numbers",
        "```", "",
        "The first run creates `venv-ort-training` (numpy<2, torch==2.13.0, onnxruntime-training==1.19.2, "
        "onnx==1.17.0) and `venv-jax` (jax==0.10.2) next to the project directory (`--venv-dir` elsewhere). "
        "On a shared machine the absolute times move with the load; the ratios, measured in alternation, move "
        "less.", ""])


def render(res: dict, json_path=None) -> str:
    parts = [header(res, json_path or ""), goals(res), build_section(res), steps_section(res), memory_section(res),
             size_section(res), hotspots_section(res), reproduce(res)]
    return "\n\n".join(p.strip() for p in parts if p) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="render docs/benchmarks.md from bench/run.py's JSON")
    parser.add_argument("json")
    parser.add_argument("-o", "--output", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"))
    args = parser.parse_args(argv)
    res = json.loads(Path(args.json).read_text())
    Path(args.output).write_text(render(res, json_path=args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
