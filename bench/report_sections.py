"""Sections 1 to 4 of docs/benchmarks.md: the gradient-graph build time (synthetic graphs with their growth
exponents, the models, and where onnxruntime-training fails), the training-step time (one table per thread count,
and the whole Adam step), the peak memory of the backward pass (loop residual policies, gradient accumulation), and
the size of the gradient graphs each tool builds.
"""

from __future__ import annotations

from report_format import MODEL_NAMES, _r, contended, ms, ratio, s, table, top_ops


def build_section(res: dict) -> str:
    b = res.get("build")
    if not b:
        return ""
    out = ["## 1. Gradient-graph build time", "",
           ("From a parsed `onnx.ModelProto` to the gradient `ModelProto` in memory. revgraph: `rg.load` (opset "
            "conversion, SSA, shape inference), the loss (`revgraph.train.loss_graph`'s cross-entropy for the "
            "classifiers; the model's scalar output otherwise), parameters as graph inputs, `rg.gradient`, "
            "`rg.to_onnx`. onnxruntime-training: what `generate_artifacts` does in memory (`TrainingBlock` with its "
            "`CrossEntropyLoss` or `PassThrough` loss block: onnx checker and shape inference, ORT's pre-training "
            "graph optimisations, the C++ `GradientGraphBuilder`, gradient-accumulation nodes, the eval model); "
            "files are not written in either timing. Both differentiate with respect to the same parameters."), ""]
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
                ("A chain `loss = ReduceSum(f_n(...f_1(x * w)))` of alternating `Sin`/`Tanh`, and a fan-out where "
                 "`h = x * w` feeds (n - 1) / 2 consumers `h * s_i` (distinct constants, so that no "
                 "common-subexpression elimination merges them) whose results a chain of `Add` nodes sums; gradient "
                 "with respect to `w` (whose gradient is the accumulation of all the consumers' contributions)."), "",
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
                note = (f"on the adapted model ({c.get('adaptation')}); revgraph on the original: "
                        f"{s(c.get('revgraph_original_s'))}")
            elif c.get("ort_error"):
                note = f"onnxruntime-training fails: {c['ort_error_explained']}"
            if c.get("ort_timeout"):
                note = f"onnxruntime-training did not finish within {c['ort_timeout_s']:.0f} s"
            rows.append([c["name"], f"{c['nodes']:,}", c["params_count"], s(c["revgraph_s"]),
                         f"{s(ph['load'])} / {s(ph['gradient'])} / {s(ph['to_onnx'])}", s(c["ort_s"]),
                         ratio(c["ratio"]), s(c.get("generate_artifacts_s")), note])
        out += ["### Models", "",
                ("ResNet-50 and DenseNet-121 are the onnx wheel's `light_*.onnx` with "
                 "`revgraph.autodiff.lift.lift_constants` (weights as initializers) and `loss = ReduceSum(output)`; "
                 "the PyTorch models are those of the step benchmark at batch 64 (`bench/models.py`). "
                 "*generate_artifacts* is the documented call itself (files, checkpoint, AdamW optimizer model), "
                 "once."), "",
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
                line += (f" It builds after an adaptation of the model: {c['adaptation']}; the comparison above "
                         "uses the adapted model for both tools.")
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
           ("Forward, cross-entropy loss and the gradients of every parameter, on the same parameters and batch in "
            "each framework (a check compares the loss and the sum of squared gradients with revgraph's). "
            "revgraph: the gradient graph of `loss_graph` + `rg.gradient` (parameters as inputs) run by "
            "onnxruntime through an IO binding (inputs bound once, outputs allocated by onnxruntime per step, "
            "`intra_op_num_threads` = threads, default graph optimisations). PyTorch: eager, `zero_grad(set_to_none="
            "True)`, `F.cross_entropy(model(x), y).backward()`, `torch.set_num_threads(threads)`. JAX: "
            "`jax.jit(jax.value_and_grad(loss))` and `block_until_ready`, XLA's CPU thread pool set to the same "
            "thread count. Models (`bench/models.py`): MLP 784-512-512-10; ResNet-style CNN on 3x32x32 (stem and "
            "3 residual blocks with batch norm, 16/32/64 channels); Transformer encoder (2 layers, width 128, 4 "
            "heads, sequence 32); RNN `tanh(h W + x_t U + b)`, hidden 128, T = 100, as an ONNX `Loop` (PyTorch: a "
            "Python loop; JAX: `lax.scan`). Batch sizes are static in each exported model."), ""]
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
            out += [("*Contention*: a framework ran slower with more threads than with one, because other processes "
                     "held a core while it ran (*load* is the 1-minute load average after the entry; above the "
                     "number of cores, processes wait for a core). PyTorch's OpenMP pool (libgomp, spinning "
                     "barriers) degrades most: one descheduled thread stalls every parallel region. Read these rows "
                     "as a measure of robustness to a shared machine, not of speed; the 1-thread table is the "
                     "comparison of kernels and overheads."), ""]
    if st.get("adam"):
        rows = []
        for e in st["adam"]:
            m = e["ms"]
            g = e.get("grad_ms", {})
            rows.append([MODEL_NAMES[e["model"]], e["batch"], e["threads"], ms(m.get("revgraph")),
                         ms(m.get("pytorch")), ratio(_r(m.get("revgraph"), m.get("pytorch"))),
                         ms(g.get("revgraph")), ms(g.get("pytorch"))])
        out += ["### Whole Adam step", "",
                ("`rg.Trainer` (the training-step graph of `revgraph.train.training_graph`: forward, loss, backward "
                 "and Adam in one graph, parameters and state kept in onnxruntime buffers swapped by two IO "
                 "bindings) against PyTorch eager with `torch.optim.Adam`."), "",
                table(["model", "batch", "threads", "revgraph ms", "PyTorch ms", "revgraph / PyTorch",
                       "revgraph fwd+bwd ms", "PyTorch fwd+bwd ms"], rows), "",
                ("The last two columns are the forward-and-backward steps of section 2 timed again in the same turns "
                 "as the Adam steps, so that the difference is the cost of the update."), ""]
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
                ("bench/loop_memory.py's RNN body (hidden 256, batch 8, input 32; gradients of W, U, b, h0) for "
                 "each residual policy of `rg.gradient(..., checkpoint=...)`, each in a fresh process with "
                 "onnxruntime's arena off: the peak resident size during the first forward-plus-backward run minus "
                 "the size just before it, and the median time of 3 further runs."), "",
                table(["T", *[f"`{p}`" if not p.isdigit() else f"K = {p}" for p in policies]], rows), ""]
    acc = mem.get("accumulation")
    if acc:
        rows = [[f"`{r['accumulate']}`", f"`{r['order']}`", f"{r['peak_mb']:.1f}", s(r["time_s"]), r["nodes"]]
                for r in acc]
        out += ["### Accumulation: one value read by 64 consumers", "",
                ("`h = tanh(x W)` (64 x 4096 floats, 1 MiB) read by 64 consumers `c_i = h * w_i` (the `w_i` are graph "
                 "inputs, so onnxruntime cannot fold the backward pass into constants), loss `sum_i ReduceSum(c_i)`; "
                 "gradients of W and every w_i. `accumulate=\"sum\"` adds the 64 contributions to dL/dh with one "
                 "`Sum` (all 64 alive at once); `\"running\"` adds each as it arrives. Each in a fresh process, "
                 "arena off, under onnxruntime's two execution orders (`SessionOptions.execution_order`); medians "
                 "over the runs."), "",
                table(["accumulate", "execution order", "peak MB", "fwd+bwd time", "nodes"], rows, "llrrr"), ""]
        by = {(r["accumulate"], r["order"]): r for r in acc}
        d_sum, d_run = by.get(("sum", "DEFAULT")), by.get(("running", "DEFAULT"))
        p_sum, p_run = by.get(("sum", "PRIORITY_BASED")), by.get(("running", "PRIORITY_BASED"))
        if d_sum and d_run and p_sum and p_run and d_run["peak_mb"] > 0.5 * d_sum["peak_mb"] \
                and p_run["peak_mb"] < 0.5 * p_sum["peak_mb"]:
            out += [(f"Under onnxruntime's default execution order, `running` peaks at {d_run['peak_mb']:.1f} MB "
                     f"against {d_sum['peak_mb']:.1f} MB for `sum`: onnxruntime does not run the nodes in the order "
                     "revgraph wrote them, but computes every contribution (each is ready as soon as the forward pass "
                     "is done) before the additions, so all 64 are alive at once either way. With "
                     f"`execution_order = PRIORITY_BASED` it follows the written order and `running` peaks at "
                     f"{p_run['peak_mb']:.1f} MB against {p_sum['peak_mb']:.1f} MB for `sum`. `rg.Session` and "
                     "`rg.Trainer` use the default order, so `--accumulate running` saves memory only in a runtime "
                     "that keeps the node order."), ""]
        elif d_sum and d_run:
            out += [(f"`running` peaks at {d_run['peak_mb']:.1f} MB against {d_sum['peak_mb']:.1f} MB for `sum` under "
                     "the default execution order."), ""]
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
           ("Nodes (loop bodies included), initializers and graph inputs of the graph each tool builds in section 1 "
            "(forward, loss and backward; onnxruntime-training's training model also holds one "
            "`InPlaceAccumulatorV2` per parameter, for gradient accumulation, and uses its fused contrib operators "
            "such as `ConvGrad`, `ReluGrad`, `BatchNormalizationGrad`, `SoftmaxCrossEntropyLossGrad`; revgraph "
            "writes default-domain ONNX only). Both take the parameters as graph inputs."), "",
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
