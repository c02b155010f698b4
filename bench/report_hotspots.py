"""Section 5 of docs/benchmarks.md: which step-time and build-time goals revgraph misses and why, from the profile
section of the results: onnxruntime's per-operator profile, the static audit of redundant nodes in the gradient
graphs, the session-option variants, the ReLU-VJP and convolution micro-benchmarks, cProfile of the build, and the
numbered hotspot notes, each backed by a number measured in the same run.
"""

from __future__ import annotations

from collections import Counter

import report_goals
from report_format import MODEL_NAMES, _r, ms, ratio, s, table


def _share(part, whole):
    return f"{100 * part / whole:.0f}%" if whole else "–"


def hotspots_section(res: dict) -> str:
    prof = res.get("profile", {})
    out = ["## 5. Where revgraph misses the goals, and why", ""]
    missed = [g for g in report_goals.goals(res) if g.met is False]
    out += ["Goals missed in this run: " + ("; ".join(f"{g.name}: {g.show()} (limit {g.show(g.limit)})" for g in missed)
                                            if missed else "none") + ".", ""]
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
                ("Kernel time per step by operator type and by kind of node (the names revgraph gives: forward "
                 "nodes, `grad/` VJP nodes, `accum/` accumulation), after onnxruntime's own graph optimisations "
                 "(which fuse and rename some nodes). *Outside kernels* is the step's wall time minus the kernel "
                 "time (onnxruntime's per-node overhead, allocation, the Python call)."), ""]
        rows = []
        for model, p in ort.items():
            cats = ", ".join(f"{k} {ms(v)}" for k, v in p["by_category"].items())
            rows.append([MODEL_NAMES[model], ms(1e3 * p["wall"]), ms(1e3 * p["kernel"]),
                         ms(max(0.0, 1e3 * (p["wall"] - p["kernel"]))) if model != "rnn" else "(loop: nested)",
                         cats, f"{p['nodes_before']} → {p['nodes_after']}"])
        out += [table(["model", "step ms", "kernels ms", "outside kernels ms", "kernel ms by kind", ("nodes before → "
                       "after ORT's optimiser")], rows, "lrrrll"), ""]
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
                ("A static audit of each gradient graph (bench/rg_tasks.py `audit`). Cells: revgraph's count (of "
                 "which in nodes the backward pass emitted) / onnxruntime-training's count where it builds the "
                 "model. *Dead*: no path to an output. *Repeated*: same operator, attributes and inputs as an "
                 "earlier node (after merging earlier repeats). *Foldable*: every input is a constant, so the value "
                 "could be computed when the graph is built. *Arithmetic on zeros*: an operand is a known all-zero "
                 "tensor."), "",
                table(["graph", "nodes", "dead", "repeated", "Shape", "Shape of static", "foldable",
                       "arith. on zeros", "ConstantOfShape 0", "Transpose→Transpose", "Reshape→Reshape",
                       "Identity"], rows), ""]
        ex = []
        for name, a in audit.items():
            e = a["revgraph"]["examples"]
            for f in ("dead nodes", "repeated subexpressions", "Transpose -> Transpose pairs",
                      "Reshape -> Reshape pairs", "arithmetic on known zeros"):
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
                "revgraph's nodes: " + ", ".join(f"{op} {n}" for op, n in Counter(conv["nodes"]["revgraph"]).items())
                + ".", "",
                table(["implementation", "ms"], rows), ""]
    fwd = prof.get("micro_conv_forward")
    if fwd:
        rows = [[k, ms(1e3 * v)] for k, v in fwd["seconds"].items()]
        out += ["### Micro-benchmark: a forward convolution, constant or variable weight", "",
                f"x {fwd['shape']['x']}, w {fwd['shape']['w']}, padding 1, 1 thread.", "",
                table(["implementation", "ms"], rows), ""]
    cp = prof.get("cprofile", {})
    if cp:
        out += ["### Build time: cProfile", ""]
        for name, p in cp.items():
            tot = ", ".join(f"`{r['function']}` {r['tottime']:.3f} s ({r['calls']:,} calls)"
                            for r in p["by_tottime"][:8])
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
    spd = ", ".join(f"{r[list(r)[1]] / r[list(r)[2]]:.1f}x" for r in micro)
    fix = ("Selection VJPs (ReLU, Dropout, Clip, Where) are written `g * Cast(mask)` wherever "
           "`autodiff/finite.py` proves the cotangent finite (every VJP between it and the seed has a bounded "
           "derivative), and `Where(mask, g, 0)` only where an inf or NaN cotangent could reach them, so strong "
           "zeros still hold (DESIGN section 5)" + (f"; `Where` is {spd} slower than the multiply in the "
           "micro-benchmark above" if spd else ""))
    if where:
        notes.append("1. **`Where` in VJPs.** " + ", ".join(f"{MODEL_NAMES[m]}: {ms(w)} ms of {ms(k)} ms kernel "
                     f"time ({_share(w, k)})" for m, w, k in where) + ". " + (("The backward `Where` nodes, by the "
                     "forward operator whose VJP wrote them: " + "; ".join(
                         f"{n}: " + ", ".join(f"{op} {c}" for op, c in o.items()) for n, o in origins.items() if o)
                     + ". ") if any(origins.values()) else "") + fix + ".")
    elif ort:
        notes.append("1. **`Where` in VJPs (done).** No `Where` runs in these models' training steps any more (the "
                     "baseline spent 9%, 13% and 24% of the MLP's, CNN's and Transformer's kernel time in it). "
                     + fix + ".")
    cnn = ort.get("cnn")
    if cnn:
        convs = [r for r in cnn["slowest_nodes"] if r["op"] == "Conv"]
        conv_total = op_ms(cnn, "Conv")
        ct = op_ms(cnn, "ConvTranspose")
        micro_c = prof.get("micro_conv", {}).get("seconds", {})
        line = (f"2. **Convolution backward.** CNN: `Conv` {ms(conv_total)} ms (the forward convolutions), "
                f"`ConvTranspose` (input gradients) {ms(ct)} ms, and for the weight gradients `FusedMatMul` "
                f"{ms(op_ms(cnn, 'FusedMatMul'))} ms and the `Slice` copies of the kernel taps "
                f"{ms(op_ms(cnn, 'Slice'))} ms, of {ms(1e3 * cnn['kernel'])} ms. The weight gradient of an "
                "ungrouped convolution is one batched `MatMul` per kernel tap over a strided slice of the padded "
                "input (rules/conv.py `weight_grad_taps`), no longer a `Conv` whose kernel is the whole output "
                "gradient (which onnxruntime's im2col Conv runs as a GEMM only 9 columns wide). What is left is "
                "kernel quality: PyTorch runs oneDNN's convolution and weight-gradient kernels, while the "
                "convolutions of a training graph run on onnxruntime's generic Conv (the weights are graph "
                "inputs, so its NCHWc layout transformer, which needs constant weights, does not apply)")
        fwd = prof.get("micro_conv_forward", {}).get("seconds", {})
        if len(fwd) == 3:
            a, b, c = fwd.values()
            line += (f"; the micro-benchmark above: the same forward convolution takes {ms(1e3 * a)} ms with a "
                     f"constant weight, {ms(1e3 * b)} ms with the weight as an input, {ms(1e3 * c)} ms in PyTorch")
        if convs:
            line += f"; the slowest convolution is `{convs[0]['node']}` at {ms(convs[0]['ms'])} ms"
        if micro_c:
            line += ". Micro-benchmark on the largest layer: " + ", ".join(
                f"{k} {ms(1e3 * v)} ms" for k, v in micro_c.items())
        notes.append(line + ". Done in round 2: the batch-norm VJP in training mode runs on onnxruntime's fused "
                     "batch-norm kernels (a training-mode `BatchNormalization` gives the normalised input and the "
                     "batch variance, an inference-mode one applies the final affine map: 7 passes over the "
                     "activation instead of 14; 0.89x the CNN's step). Measured and not kept, because none "
                     "changed the whole step by more than the noise (0.97x to 1.04x; bench/micro.py holds each "
                     "as a micro-benchmark): the weight gradient as one 2-D GEMM per tap over the batch and "
                     "pixels, as contiguous wide-row taps, or after an unfold by a one-hot grouped `Conv`; the "
                     "input gradient as a `Conv` of the flipped, channel-transposed weight instead of "
                     "`ConvTranspose` (onnxruntime's `Conv` with a computed weight takes the same generic path); "
                     "taps cut without the padded copy. In the profile of the best micro form its extra "
                     "`Transpose` copies cost what its GEMMs saved: the step is bound by memory traffic, and "
                     "closing the gap to oneDNN needs kernels standard ONNX does not reach (a fused "
                     "convolution weight gradient).")
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
        notes.append("3. **The Transformer's gradient graph.** " + "; ".join(parts) + ". "
                     "Done in round 2: a Dropout whose ratio is a constant 0 passes its cotangent through (its "
                     "VJP was a Mul by 1, a Cast of the mask and a Mul, 3 nodes per Dropout, and onnxruntime now "
                     "drops the forward Dropouts too); the float32 LayerNormalization VJP gets the normalised input "
                     "and the inverse standard deviation from one `LayerNormalization` node instead of five "
                     "passes; and the gradient of the packed q/k/v tensor, split by `Gather` at constant indices "
                     "0, 1, 2, is the three row blocks in order instead of a `ScatterElements` into zeros "
                     "(autodiff/sparse.py `densify`). Measured by hand-editing the step graph, folding the "
                     f"exported attention's constant shape arithmetic ({fwd_fold} forward nodes whose inputs are "
                     "all constant) before differentiating changes the batch-64 step by less than the noise "
                     "(0.98x): onnxruntime folds those `Shape` chains itself when it creates the session.")
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
        notes.append(line + ". A Loop iteration itself is cheap in onnxruntime (about 0.3 µs per iteration for an "
                     "empty body, 1 thread), and so is each small GEMM (about 1 µs for [1, 128] x [128, 128], "
                     "weight an input or a constant alike); what adds up is onnxruntime's fixed cost per node, "
                     "about 0.3-0.4 µs, times the ~37 nodes the two bodies run per iteration, where XLA compiles "
                     "the scan's body into a few fused kernels. Removing the `Identity` body outputs and hoisting "
                     "loop-invariant nodes out of the backward body, tried by hand on this graph, saved 1.5%: "
                     "the remaining gap is the per-node execution model, not redundant nodes.")
    upd = []
    for a in res.get("steps", {}).get("adam", []):
        rg, pt = report_goals.update_ms(a, "revgraph"), report_goals.update_ms(a, "pytorch")
        if a["threads"] == 1 and rg is not None and pt is not None:
            upd.append(f"{MODEL_NAMES[a['model']]} batch {a['batch']}: revgraph {ms(rg)} ms, PyTorch {ms(pt)} ms")
    if upd:
        notes.append("6. **The optimizer update.** The update alone (revgraph: the update half of the step graph, "
                     "`revgraph.train.split_step`, through IO bindings; PyTorch: `optimizer.step()`; the same "
                     "fixed gradients; 1 thread): " + "; ".join(upd) + ". Done in round 2: Adam is 12 elementwise "
                     "nodes per tensor instead of 13 plus 3 output `Identity` copies (the node computing each new "
                     "value writes the graph output; the bias corrections fold into two scalars computed once), "
                     "and dense tensors of at most 4096 elements with the same trailing shape are updated as one "
                     "group (`Concat`, one update, `Split`): the Transformer's update went from 438 to 151 nodes "
                     "and its update graph alone from 0.77 to 0.62 ms. Parameters and state already lived in two "
                     "buffer sets swapped by IO bindings, so no buffer is allocated per step. What is left shows "
                     "on the MLP, whose 670k parameters are in two large matrices: there the update is a "
                     "matter of passes over memory, 12 with binary ONNX operators against PyTorch's about 7 (its "
                     "`lerp_`, `addcmul_` and `addcdiv_` fuse two operations each and write in place); standard ONNX "
                     "has no fused optimizer operator onnxruntime runs (`ai.onnx.preview.training.Adam` is not "
                     "implemented by its CPU provider).")
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
            line += (" Done in round 2: the garbage collector is paused while a graph is loaded, differentiated "
                     "and written (it rescanned the growing heap and found nothing to free: 30% of a 10k chain's "
                     "build), protobuf messages are filled in place instead of built by `onnx.helper` and copied, "
                     "each distinct type is read once, opset 20 models go to 21 by renumbering (every adapter of "
                     "that step but GroupNormalization's is a no-op; the converter cost 4-8 ms even for the MLP), "
                     "Flatten/Pad/Cast have Python shape formulas, data-propagating shape inference runs only "
                     "when there is integer data to propagate, and the graph walks of the clean-up pass, the "
                     "pruning and the SSA check do less per node; the output graphs are byte for byte the same.")
        chains = [c for c in res.get("build", {}).get("cases", []) if c.get("kind") == "chain" and c.get("ort_s")]
        if chains:
            line += (" The chains have no weights and no opset conversion, and their elementwise nodes had a "
                     "Python typing path before, so those changes do not reach them: per forward node revgraph spends "
                     + ", ".join(f"{1e6 * c['revgraph_s'] / c['n']:.0f} µs ({c['name']})" for c in chains)
                     + " in Python (a VJP rule and 4.5 emitted nodes with their names and types: the chain's input "
                     "may hold inf, so each product of a cotangent and a factor that may be infinite is guarded "
                     "for strong zeros, `Mul`, `Equal`, `Where`; the clean-up pass; `to_onnx`), "
                     "onnxruntime-training " + ", ".join(
                         f"{1e6 * c['ort_s'] / c['n']:.0f} µs" for c in chains) + " in C++ for 2.5 nodes. The cost "
                     "left is spread thinly (no function above 7% of the build): Python's fixed cost per emitted "
                     "node, about 2-3 µs to create it with its name and type, 2 µs in the clean-up pass and 2 µs "
                     "to write it out. Reaching 40 µs per node needs fewer nodes per VJP or one pass that cleans "
                     "up and types at once, not more micro-optimisation. The CNN's build also carries the per-tap "
                     "weight gradients (about 40 more nodes per 3x3 convolution), which trade build time and "
                     "graph size for step time; the Transformer's, two rounds of ONNX shape inference on its "
                     "322 exported nodes (load, then the loss appended).")
        notes.append(line)
    dense = ("Gemm", "MatMul", "FusedMatMul", "Conv", "ConvTranspose")
    shares = [f"{MODEL_NAMES[m]} {_share(sum(op_ms(p, op) for op in dense), 1e3 * p['kernel'])}"
              for m, p in ort.items() if m != "rnn" and p.get("kernel")]
    if shares:
        notes.append("10. **Dense kernels.** Share of the batch-64 step's kernel time in matrix products and "
                     "convolutions (`Gemm`, `MatMul`, `FusedMatMul`, `Conv`, `ConvTranspose`; profile above): "
                     + ", ".join(shares) + ". Where that share is large the step is as fast as onnxruntime's "
                     "MLAS kernels against XLA's and oneDNN's: the MLP's step is eight GEMMs of about 200 MFLOP "
                     "together, which XLA runs faster than MLAS here (and both faster than PyTorch eager); the RNN's "
                     "per-iteration products are GEMMs of 64 rows, as in JAX's `lax.scan`. No graph form changes the "
                     "arithmetic left there; the forms that do change what surrounds it are in items 2, 3 and 6.")
    loops = {(r["steps"], r["policy"]): r for r in res.get("memory", {}).get("loops", [])}
    if (10000, "store") in loops and (10000, "sqrt") in loops:
        st, sq = loops[(10000, "store")], loops[(10000, "sqrt")]
        notes.append(f"9. **Checkpointed loops.** At T = 10,000 `sqrt` takes {s(sq['time_s'])} and {sq['peak_mb']:.1f} "
                     f"MB against `store`'s {s(st['time_s'])} and {st['peak_mb']:.1f} MB "
                     f"({sq['time_s'] / st['time_s']:.2f}x the time). Done in round 2: for a loop without scan outputs "
                     "the forward `Loop` keeps the checkpoints itself (it becomes a loop over segments, each run as an "
                     "inner loop, stacking the carried values at segment starts), where before a second loop "
                     "recomputed the forward pass once T was known to take them: one forward pass fewer, the same "
                     "memory (loops/checkpoint.py `_checkpointing_forward`). The cost left is the one forward pass "
                     "that recomputes each segment in the backward loop, with its residuals stacked as `store` "
                     "would.")
    return notes
