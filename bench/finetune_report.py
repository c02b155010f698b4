"""The section "Fine-tuning a causal LM, against PyTorch + PEFT" of docs/benchmarks.md from bench/finetune.py's
results (:func:`render`), written between ``<!-- finetune:begin -->`` and ``<!-- finetune:end -->``
(:func:`write_section`; bench/report.py, which rewrites the rest of that file, keeps marked sections)."""

from __future__ import annotations

import statistics
from pathlib import Path

from ddp_report import write_section as _write_section

BEGIN, END = "<!-- finetune:begin -->", "<!-- finetune:end -->"
#: issue 38's goals: the loss within LOSS_GOAL of PyTorch's at every step, step time and peak memory ratios
LOSS_GOAL, TIME_GOAL, MEMORY_GOAL = 1e-4, 0.9, 0.8
MODES = {"full": "full fine-tune", "lora": "LoRA r=8, alpha 16"}


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _label(p: dict) -> str:
    return f"{MODES[p['mode']]}, {p['threads']} thread{'s' if p['threads'] > 1 else ''}"


def goals(res: dict) -> list[str]:
    steps = res["config"]["steps"]
    lines = ["| goal | run | now | met? |", "| :--- | :--- | ---: | :--- |"]
    for p in res["pairs"]:
        lines.append(f"| loss within {LOSS_GOAL:g} of PyTorch's at each of {steps} steps | {_label(p)} | "
                     f"{p['max_abs_loss_diff']:.1e} | {_met(p['max_abs_loss_diff'] <= LOSS_GOAL)} |")
    for p in res["pairs"]:
        lines.append(f"| step time <= {TIME_GOAL}x PyTorch eager | {_label(p)} | {p['step_ratio']:.2f}x | "
                     f"{_met(p['step_ratio'] <= TIME_GOAL)} |")
    for p in res["pairs"]:
        lines.append(f"| peak memory <= {MEMORY_GOAL}x PyTorch's (process peak; over the imports) | {_label(p)} | "
                     f"{p['peak_ratio']:.2f}x; {p['peak_over_import_ratio']:.2f}x | "
                     f"{_met(p['peak_ratio'] <= MEMORY_GOAL)}; {_met(p['peak_over_import_ratio'] <= MEMORY_GOAL)} |")
    return lines


def _spread(p: dict) -> str:
    """The quartiles of the rounds' time ratios (the median is the reported ratio): how steady the turns were."""
    kept = p["round_ratios"][-p["rounds_used"]:]
    if len(kept) < 4:
        return ""
    q1, _, q3 = statistics.quantiles(kept, n=4)
    return f" ({q1:.2f}-{q3:.2f})"


def results(res: dict) -> list[str]:
    lines = [("| run | max \\|loss diff\\| (step) | loss, step 1 -> last (rg / PyTorch) | ms per step rg / PyTorch | "
             "time ratio (quartiles) | CPU / wall rg / PyTorch | peak MB rg / PyTorch | peak ratio | over imports MB "
             "rg / PyTorch | to first step s rg / PyTorch |"),
             "| :--- | ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in res["pairs"]:
        rg, pt = p["rg"], p["torch"]
        lines.append(
            f"| {_label(p)} | {p['max_abs_loss_diff']:.1e} ({p['max_abs_loss_diff_step']}) | "
            f"{rg['losses'][0]:.4f} -> {rg['losses'][-1]:.4f} / {pt['losses'][0]:.4f} -> {pt['losses'][-1]:.4f} | "
            f"{_n(p['step_ms']['rg'])} / {_n(p['step_ms']['torch'])} | {p['step_ratio']:.2f}{_spread(p)} | "
            f"{p['cpu_per_wall']['rg']:.2f} / {p['cpu_per_wall']['torch']:.2f} | "
            f"{_n(rg['peak_mb'])} / {_n(pt['peak_mb'])} | {p['peak_ratio']:.2f} | "
            f"{_n(rg['peak_mb'] - rg['import_rss_mb'])} / {_n(pt['peak_mb'] - pt['import_rss_mb'])} | "
            f"{rg['to_first_step_s']:.1f} / {pt['to_first_step_s']:.1f} |")
    return lines


def first_steps(res: dict) -> list[str]:
    phases = ("interpreter", "import", "build", "first step")
    lines = ["| run | side | started | " + " | ".join(phases) + " | total | RSS after imports MB |",
             "| :--- | :--- | :--- | " + " | ".join("---:" for _ in phases) + " | ---: | ---: |"]
    for p in res["pairs"]:
        for s, name in (("rg", "revgraph"), ("torch", "PyTorch")):
            d = p[s]
            lines.append(f"| {_label(p)} | {name} | {'first' if d['started_first'] else 'second'} | "
                         + " | ".join(f"{d['phases_s'][k]:.2f}" for k in phases)
                         + f" | {d['to_first_step_s']:.2f} | {_n(d['import_rss_mb'])} |")
    return lines


def memory(res: dict) -> list[str]:
    lines = ["| run | side | after imports | built | peak of build | peak at first step | peak | resident at the end |",
             "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in res["pairs"]:
        for s, name in (("rg", "revgraph"), ("torch", "PyTorch")):
            d = p[s]
            cells = [d["import_rss_mb"], d["built_rss_mb"], d["build_peak_mb"], d["first_step_peak_mb"], d["peak_mb"],
                     d["end_rss_mb"]]
            lines.append(f"| {_label(p)} | {name} | " + " | ".join(_n(x) for x in cells) + " |")
    return lines


def cli_table(res: dict) -> list[str]:
    cli = res.get("cli")
    if not cli:
        return []
    c = res["config"]
    lines = ["", "### `revgraph train`: peak memory with and without evaluation", "",
             (f"`revgraph train llama.onnx --data tokens.npz --loss-fn causal-lm --optimizer adamw "
             f"--lr {c['lr']['full']:g} --lr-schedule cosine --warmup-steps {c['warmup_steps']} --clip-grad-norm 1.0 "
             f"--batch-size {c['batch']} --max-steps {cli['steps']} --no-shuffle --threads {cli['threads']} "
             "-o out.onnx` plus the options of each row, each in a fresh process; the peak is the finished child's "
             "`ru_maxrss` (`os.wait4`), its whole life's peak resident set. `tokens.npz` holds the "
             f"{c['steps'] * c['batch']} training sequences of {c['seq']} tokens; evaluation runs once, at the end. "
             "Before issue 38 every run evaluated the whole training set at batch 512, before and after training "
             "(the last row: the same evaluation, once)."), "",
             "| run | peak MB | x no evaluation | wall s |", "| :--- | ---: | ---: | ---: |"]
    base = cli["runs"][0]["peak_mb"]
    for r in cli["runs"]:
        lines.append(f"| {r['label']} | {_n(r['peak_mb'])} | {r['peak_mb'] / base:.2f} | {r['wall_s']:.1f} |")
    return lines


def _source(res: dict) -> str:
    src, commit = res.get("source") or {}, res["machine"]["commit"]
    if not src.get("working_tree"):
        return f"commit {commit} as committed (`git archive HEAD`, taken when the run started)"
    changed = f", with uncommitted changes ({src['src_diff']})" if src.get("src_diff") else ""
    return f"the working tree of commit {commit}{changed}, copied when the run started"


def render(res: dict, json_path: str) -> str:
    m, v, c, model = res["machine"], res["versions"], res["config"], res["model"]
    loads = [p["load_start"][0] for p in res["pairs"]] + [p["load_end"][0] for p in res["pairs"]]
    llama = c["llama"]
    lines = [
        BEGIN, "## Fine-tuning a causal LM, against PyTorch + PEFT", "",
        (f"Written by `{res['command']}` on {res['started'][:10]}, in {res['minutes']} minutes. Raw numbers: "
        f"`{json_path}`; `python bench/finetune.py --render {json_path} --write-docs` rewrites this section from "
        "them."), "",
        "|  |  |", "| :--- | :--- |",
        f"| machine | {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']} |",
        (f"| load average (1 min) | {res['load_start'][0]} at the start, {min(loads)} to {max(loads)} during the "
        f"pairs, {res['load_end'][0]} at the end (a shared machine: other engineers' processes ran on the same "
        "2 cores) |"),
        (f"| revgraph | {_source(res)}; onnxruntime {v['onnxruntime']}, onnx {v['onnx']}, numpy {v['numpy']}, "
        f"Python {v['python']} |"),
        f"| PyTorch | {v['torch']}, transformers {v['transformers']}, peft {v['peft']} |", "",
        (f"**The model**: `transformers.LlamaForCausalLM(LlamaConfig(vocab_size={llama['vocab_size']}, hidden_size="
        f"{llama['hidden_size']}, intermediate_size={llama['intermediate_size']}, num_hidden_layers="
        f"{llama['num_hidden_layers']}, num_attention_heads={llama['num_attention_heads']}, num_key_value_heads="
        f"{llama['num_key_value_heads']}, tie_word_embeddings=False))` with seeded random weights "
        f"({model['parameters']:,} parameters, {model['attention']} attention), saved with `save_pretrained` for "
        f"PyTorch and exported with `rg.export_torch` (opset 23, {model['onnx_mb']} MB, {model['export_s']} s) for "
        f"revgraph. **Data**: {c['steps'] * c['batch']} sequences of {c['seq']} tokens, each counting up from a "
        "random start by a random stride of 1 to 3 (seeded), in order, batch "
        f"{c['batch']}. **Training**: AdamW (lr {c['lr']['full']:g}, LoRA {c['lr']['lora']:g}, weight decay 0.01, "
        "none on 1-D parameters), cosine "
        f"schedule with {c['warmup_steps']} warm-up steps over {c['steps']} steps, gradient clipping at norm 1.0; "
        "revgraph `rg.Trainer(path, \"causal-lm\", rg.train.adamw(...), clip_grad_norm=1.0, threads=N).fit(data, "
        "batch_size=8, shuffle=False, max_steps=...)`, PyTorch `torch.optim.AdamW` with the same two parameter "
        "groups, `get_cosine_schedule_with_warmup`, `LlamaForCausalLM(input_ids=x, labels=x).loss.backward()`, "
        "`clip_grad_norm_`. **LoRA**: rank 8, alpha 16 on q/k/v/o/gate/up/down of every layer "
        f"({model['lora_parameters']:,} trained parameters): revgraph `lora.add_adapters(graph, 8, alpha=16, "
        "targets=[\"*q_proj*\", ...])`, PyTorch `PeftModel.from_pretrained(model, dir, is_trainable=True)` of "
        "revgraph's initial adapters written in PEFT's format (`peft_io.save_peft`), so both start from the same "
        "A (B = 0); `lora_dropout` 0."), "",
        (f"**How it is measured** (bench/finetune.py's doc): per run, a revgraph process and a PyTorch process, "
        "started one after the other (the side started first alternates between runs; the second starts when the "
        "first has finished its first step and waits). *To first step*: from the orchestrator's start of the "
        "process to the end of its first step (interpreter, imports, files read, graph or module built, one step). "
        f"Then they take turns of {c['block']} steps each until both have run {c['steps']} steps; *ms per step* is "
        f"the median over the steps after the warm-up (the rounds that hold any of the first {c['warmup']} steps are "
        "left out), each timed in its process "
        "(the fit loop's own steps, from the end of one step to the end of the next), and the *time ratio* the "
        "median over those rounds of revgraph's median step over PyTorch's in the same round; *CPU / wall*: the "
        "process's CPU seconds (all its threads) over the wall seconds of those steps (1.0 at one thread; at two "
        "threads, how much of two cores the side got and used, spinning included). *Peak*: VmHWM of "
        f"each process at the end (its whole life: imports, build, {c['steps']} steps); *over imports*: that peak less "
        "VmRSS after the imports. Threads: onnxruntime `threads=N`; `torch.set_num_threads(N)`; "
        "`OMP_NUM_THREADS`, `MKL_NUM_THREADS`, `OPENBLAS_NUM_THREADS` = N for both. MB = 2^20 bytes."), "",
        "### Goals of issue 38", "", *goals(res), "",
        "### Results", "", *results(res), "",
        "### Time to the first step (s)", "",
        ("*interpreter*: process start to the worker's `main` (Python and the standard library); *import*: revgraph "
        "(onnx, onnxruntime) or torch, transformers (and peft); *build*: revgraph `rg.load` (and `add_adapters`), "
        "`rg.Trainer` (training graph, onnxruntime session); PyTorch `from_pretrained` (and PEFT), the optimizer "
        "and schedule; *first step*: the first call of the step (onnxruntime plans and allocates; PyTorch's Adam "
        "creates its state)."), "",
        *first_steps(res), "",
        "### Where the memory goes (MB)", "",
        ("Resident set (VmRSS) and its peak so far (VmHWM) of each process: after the imports; after the build "
        "(*built*, and the peak so far); at the end of the first step; at the end of the run (*peak*: the process's "
        "highest; *resident*: what it holds then)."), "",
        *memory(res), *cli_table(res)]
    if res.get("notes"):
        lines += ["", "### Observations", "", res["notes"].strip()]
    lines += [END]
    return "\n".join(lines) + "\n"


def write_section(doc: Path, section: str) -> None:
    """Put ``section`` between the markers of ``doc``, or at its end."""
    _write_section(doc, section, BEGIN, END)
