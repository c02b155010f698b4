"""revgraph's benchmarks, side by side with onnxruntime-training, PyTorch eager and JAX, in one run.

    python bench/run.py [--quick] [-o docs/benchmarks.md] [--json FILE] [--sections build,step,memory,profile]

Measures, on this machine, in one run:

1. gradient-graph build time: synthetic chains and fan-outs of 1k, 10k and 100k nodes (``--quick``: 1k and
   10k), the onnx wheel's ResNet-50 and DenseNet-121, and PyTorch-exported MLP, ResNet-style CNN, Transformer
   encoder and a Loop RNN, against onnxruntime-training's builder (``generate_artifacts``) where it works;
2. training-step time (forward plus backward, batch 1 and 64) of revgraph's gradient graphs on onnxruntime,
   against PyTorch eager with the same number of threads and JAX's ``jit(value_and_grad)``; and a whole
   Adam step against PyTorch's;
3. peak memory of the backward pass of loops (bench/loop_memory.py) and of the two accumulation strategies;
4. the size of the gradient graphs against onnxruntime-training's;

then profiles where revgraph misses its goals (cProfile of the builder, onnxruntime's profiler on the step
graphs, an audit of redundant nodes, session options, two micro-benchmarks) and writes everything to a
Markdown file (``docs/benchmarks.md``) and the raw numbers to JSON (``bench/results/<mode>.json``).

Every framework runs in a worker process of its own (onnxruntime-training and JAX in virtual environments
that bench/envs.py creates on first use) and the orchestrator hands them work in turns, so that each
comparison is measured in the same minutes: a reported time is the median over rounds, and a ratio is the
ratio of the two medians measured in alternation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import itertools

import envs
from report_format import portable
from workers import Log, Worker, WorkerError, WorkerTimeout


class Config:
    def __init__(self, quick: bool):
        self.quick = quick
        self.sizes = [1000, 10000] if quick else [1000, 10000, 100000]
        self.build_rounds = 3 if quick else 5
        self.threads = [1, 2]
        self.step_rounds = 3 if quick else 5
        self.step_seconds = 0.2 if quick else 0.5
        self.batches = [1, 64]
        self.adam_batches = [64] if quick else [1, 64]
        self.loop_steps = [100, 1000] if quick else [100, 1000, 10000]
        self.loop_policies = ["store", "recompute", "sqrt", "100"]
        self.accum_rounds = 2 if quick else 3
        self.profile_steps = 5 if quick else 20
        self.variant_models = ["mlp", "transformer"] if quick else ["mlp", "cnn", "transformer", "rnn"]
        self.variant_rounds = 2 if quick else 3
        self.variant_seconds = 0.2 if quick else 0.4
        self.micro_rounds = 2 if quick else 3
        self.concat_n = 2000 if quick else 3000
        self.ort_timeout = 600.0  # seconds for one onnxruntime-training build of a 100k-node graph


log = Log()


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], capture_output=True, text=True, cwd=ROOT)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "os": platform.platform(),
            "python": platform.python_version(), "commit": commit.stdout.strip(),
            "src_modified": bool(dirty.stdout.strip())}


def failure(exc: BaseException) -> str:
    return exc.error if isinstance(exc, WorkerError) else f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------------- 1. build


#: What onnxruntime-training's failure messages mean, and the model change that makes it build.
ORT_ADAPTATIONS = {
    "resnet50": "two-input `Sum` (the residual additions) written as `Add`, and the batch-norm running mean and "
                "variance left out of the parameters",
    "densenet121": "the batch-norm running mean and variance left out of the parameters",
    "transformer": "`LayerNormalization` given its optional `Mean` and `InvStdDev` outputs",
}


def explain_ort_error(message: str) -> str:
    import re

    m = re.search(r"gradient builder has not been registered: (\w+) for node (\S+)", message)
    if m:
        return f"no gradient builder for `{m.group(1)}` (node `{m.group(2)}`)"
    m = re.search(r"failed to find NodeArg by name: (\S+)_grad", message)
    if m:
        return (f"no gradient produced for parameter `{m.group(1)}` (a batch-norm running statistic: ORT "
                "rewrites inference-mode BatchNormalization into its training kernel, whose gradient has no "
                "entry for the mean and variance inputs)")
    if "OutputDefs().size()" in message:
        return ("its `LayerNormalization` gradient reads the forward node's optional outputs `Mean` and "
                "`InvStdDev`, which `torch.onnx.export` does not write")
    m = re.search(r"name which does not exist:\s*(\S+)\s*for node: (\S+)", message)
    if m:
        return (f"the `Loop` node `{m.group(2)}` reads `{m.group(1)}` from the enclosing graph (a captured "
                "parameter), which its gradient builder cannot resolve")
    return message.split("\n", maxsplit=1)[0][-300:]


def build_cases(rg: Worker, cfg: Config, work: Path, infos: dict) -> list[dict]:
    cases = []
    for kind in ("chain", "fan-out"):
        for n in cfg.sizes:
            info = rg.call("models:write_synthetic", kind="chain" if kind == "chain" else "fan", n=n,
                           out_dir=str(work))
            cases.append({"name": f"{kind} {n // 1000}k", "group": "synthetic", "kind": kind, "n": n, **info,
                          "big": n >= 100000})
    for name in ("resnet50", "densenet121"):
        info = rg.call("models:write_light", name=name, out_dir=str(work))
        adapted = rg.call("models:write_light", name=name, out_dir=str(work), adapted=True)
        cases.append({"name": {"resnet50": "ResNet-50", "densenet121": "DenseNet-121"}[name], "group": "light",
                      "key": name, **info, "adapted": adapted})
    for name in ("mlp", "cnn", "transformer", "rnn"):
        info = infos[f"{name}_b64"]
        case = {"name": {"mlp": "MLP", "cnn": "CNN", "transformer": "Transformer", "rnn": "RNN (Loop, T=100)"}[name],
                "group": "pytorch" if name != "rnn" else "loop", "key": name, **info,
                "nodes": rg.call("rg_tasks:graph_stats_file", path=info["path"])["nodes"]}
        if name == "transformer":
            dst = str(work / "transformer_b64_ln3.onnx")
            rg.call("models:layer_norm_outputs", src=info["path"], dst=dst)
            case["adapted"] = {**info, "path": dst}
        cases.append(case)
    return cases


def run_build(rg: Worker, W: dict, cfg: Config, work: Path, cases: list[dict], res: dict) -> None:
    """``W["ort"]`` is the onnxruntime-training worker (replaced by a fresh one after a timeout)."""
    out = res.setdefault("build", {"cases": []})
    for case in cases:
        ort = W.get("ort")
        log(f"build: {case['name']}")
        entry = {k: case.get(k) for k in ("name", "group", "kind", "n", "nodes", "params_count")}
        entry["params_count"] = len(case["params"])
        args = {"params": case["params"], "loss_kind": case["loss_kind"]}
        rg_graph = work / f"grad_rg_{case['name'].replace(' ', '_')}.onnx"
        first = rg.call("rg_tasks:build", path=case["path"], stats=True, save_to=str(rg_graph), **args)
        entry["revgraph_stats"] = {k: first[k] for k in ("nodes", "initializers", "inputs", "outputs", "ops")}
        entry["revgraph_graph"] = str(rg_graph)
        # onnxruntime-training on the model as it is, then on the adapted model if that fails
        compare = None
        if ort is not None:
            try:
                o = ort.call("ort_training_tasks:build", path=case["path"], stats=True,
                             save_to=str(rg_graph).replace("grad_rg_", "grad_ort_"),
                             timeout=cfg.ort_timeout if case.get("big") else None, **args)
                entry["ort_stats"] = {k: o[k] for k in ("nodes", "initializers", "inputs", "outputs", "ops")}
                entry["ort_graph"] = str(rg_graph).replace("grad_rg_", "grad_ort_")
                compare = case
            except WorkerTimeout as exc:
                entry["ort_timeout"] = exc.error
                entry["ort_timeout_s"] = cfg.ort_timeout
                log(f"  onnxruntime-training: {exc.error}")
                W["ort"] = ort = ort.restart()
            except WorkerError as exc:
                entry["ort_error"] = exc.error
                entry["ort_error_explained"] = explain_ort_error(exc.error)
                adapted = case.get("adapted")
                if adapted:
                    entry["adaptation"] = ORT_ADAPTATIONS.get(case.get("key", ""), "")
                    aargs = {"params": adapted["params"], "loss_kind": adapted["loss_kind"]}
                    try:
                        path_ort = str(rg_graph).replace("grad_rg_", "grad_ort_adapted_")
                        o = ort.call("ort_training_tasks:build", path=adapted["path"], stats=True,
                                     save_to=path_ort, **aargs)
                        entry["ort_stats"] = {k: o[k] for k in ("nodes", "initializers", "inputs", "outputs", "ops")}
                        entry["ort_graph"] = path_ort
                        a = rg.call("rg_tasks:build", path=adapted["path"], stats=True, **aargs)
                        entry["revgraph_adapted_stats"] = {k: a[k] for k in ("nodes", "initializers", "inputs",
                                                                              "outputs", "ops")}
                        compare = adapted
                    except WorkerError as exc2:
                        entry["ort_adapted_error"] = exc2.error
                        entry["ort_adapted_error_explained"] = explain_ort_error(exc2.error)
        entry["compared_on"] = None if compare is None else ("adapted" if compare is not case else "original")
        # graphs of 100k nodes: one build of each tool (the builds above, whose timings exclude the statistics
        # and the saving); smaller graphs: the builds above were warm-ups, then rounds in alternation
        rounds = 0 if case.get("big") else cfg.build_rounds
        times = {"revgraph": [], "revgraph_phases": [], "ort": [], "revgraph_original": []}
        if case.get("big"):
            times["revgraph"].append(first["seconds"])
            times["revgraph_phases"].append({k: first[k] for k in ("load", "gradient", "to_onnx")})
            if compare is case:
                times["ort"].append(o["seconds"])
        for r in range(rounds):
            order = ["rg", "ort"] if r % 2 == 0 else ["ort", "rg"]
            for who in order:
                if who == "rg":
                    target = compare or case
                    t = rg.call("rg_tasks:build", path=target["path"], params=target["params"],
                                loss_kind=target["loss_kind"])
                    times["revgraph"].append(t["seconds"])
                    times["revgraph_phases"].append({k: t[k] for k in ("load", "gradient", "to_onnx")})
                    if compare is not None and compare is not case:
                        t2 = rg.call("rg_tasks:build", path=case["path"], **args)
                        times["revgraph_original"].append(t2["seconds"])
                elif compare is not None:
                    t = ort.call("ort_training_tasks:build", path=compare["path"], params=compare["params"],
                                 loss_kind=compare["loss_kind"])
                    times["ort"].append(t["seconds"])
        entry["times"] = times
        entry["revgraph_s"] = median(times["revgraph"])
        entry["revgraph_phases_s"] = {k: median([p[k] for p in times["revgraph_phases"]])
                                      for k in ("load", "gradient", "to_onnx")}
        entry["ort_s"] = median(times["ort"])
        entry["revgraph_original_s"] = median(times["revgraph_original"])
        entry["ratio"] = entry["revgraph_s"] / entry["ort_s"] if entry["ort_s"] else None
        if compare is not None and case["group"] != "synthetic":
            try:
                g = ort.call("ort_training_tasks:generate", path=compare["path"], params=compare["params"],
                             loss_kind=compare["loss_kind"])
                entry["generate_artifacts_s"] = g["seconds"]
            except WorkerError as exc:
                entry["generate_artifacts_error"] = exc.error
        for w in (rg, ort):
            if w is not None:
                w.call(f"{'rg_tasks' if w is rg else 'ort_training_tasks'}:forget", path=case["path"])
        out["cases"].append(entry)
        log(f"  revgraph {entry['revgraph_s']:.3f}s" + (f", onnxruntime-training {entry['ort_s']:.3f}s "
            f"(ratio {entry['ratio']:.2f})" if entry["ort_s"] else f", onnxruntime-training: "
            f"{entry.get('ort_error_explained', 'not run')}"))
    # growth of the synthetic builds
    growth = {}
    for kind in ("chain", "fan-out"):
        pts = [(c["n"], c["revgraph_s"], c["ort_s"]) for c in out["cases"] if c.get("kind") == kind]
        rows = []
        for (n1, a1, o1), (n2, a2, o2) in itertools.pairwise(pts):
            rows.append({"from": n1, "to": n2, "revgraph_exponent": math.log(a2 / a1) / math.log(n2 / n1),
                         "ort_exponent": math.log(o2 / o1) / math.log(n2 / n1) if o1 and o2 else None})
        growth[kind] = rows
    out["growth"] = growth


# -------------------------------------------------------------------------------------------- 2. steps


STEP_WORKERS = {"revgraph": "rg_tasks", "pytorch": "torch_tasks", "jax": "jax_tasks"}


def jax_env(threads: int) -> dict:
    multi = "true" if threads > 1 else "false"
    return {"XLA_FLAGS": f"--xla_cpu_multi_thread_eigen={multi} intra_op_parallelism_threads={threads}",
            "JAX_PLATFORMS": "cpu"}


def run_steps(rg: Worker, th: Worker, jax_python, cfg: Config, work: Path, infos: dict, res: dict,
              profile_hook=None) -> None:
    out = res.setdefault("steps", {"grad": [], "adam": []})
    for threads in cfg.threads:
        jx = None
        if jax_python is not None:
            jx = Worker(f"jax-{threads}t", jax_python, work / "logs", env=jax_env(threads))
        workers = {"revgraph": rg, "pytorch": th, "jax": jx}
        for model in ("mlp", "cnn", "transformer", "rnn"):
            for batch in cfg.batches:
                key = f"{model}_b{batch}"
                info = infos[key]
                log(f"step: {key}, {threads} thread(s)")
                entry = {"model": model, "batch": batch, "threads": threads, "prepare": {}, "errors": {}}
                live = {}
                for fw, w in workers.items():
                    if w is None:
                        entry["errors"][fw] = "no JAX environment"
                        continue
                    try:
                        entry["prepare"][fw] = w.call(f"{STEP_WORKERS[fw]}:prepare_step", key=key, info=info,
                                                      threads=threads)
                        entry["prepare"][fw].pop("ops", None)
                        live[fw] = w
                    except WorkerError as exc:
                        entry["errors"][fw] = exc.error
                entry["check"] = check_agreement(entry["prepare"])
                times = {fw: [] for fw in live}
                for r in range(cfg.step_rounds):
                    names = list(live)
                    names = names[r % len(names):] + names[: r % len(names)]
                    for fw in names:
                        try:
                            t = live[fw].call(f"{STEP_WORKERS[fw]}:step_time", key=key, seconds=cfg.step_seconds)
                            times[fw].append(t["mean"])
                        except WorkerError as exc:
                            entry["errors"][fw] = exc.error
                entry["times"] = times
                entry["ms"] = {fw: 1e3 * median(v) for fw, v in times.items() if v}
                entry["load"] = loadavg()
                if profile_hook is not None and threads == max(cfg.threads) and batch == 64:
                    profile_hook(model, key, info)
                for fw, w in live.items():
                    w.call(f"{STEP_WORKERS[fw]}:drop_step", key=key)
                out["grad"].append(entry)
                log("  " + ", ".join(f"{fw} {ms:.2f} ms" for fw, ms in entry["ms"].items()))
        # whole Adam steps: revgraph's Trainer against torch.optim.Adam, with the forward-and-backward steps and
        # the update alone (on fixed gradients) of both timed in the same turns
        for model in ("mlp", "cnn", "transformer", "rnn"):
            for batch in cfg.adam_batches:
                info = infos[f"{model}_b{batch}"]
                log(f"adam step: {model} batch {batch}, {threads} thread(s)")
                entry = {"model": model, "batch": batch, "threads": threads, "errors": {}}
                live = {}
                for fw in ("revgraph", "pytorch"):
                    for mode in ("adam", "grad", "update"):
                        key = f"{mode}_{model}_b{batch}"
                        try:
                            workers[fw].call(f"{STEP_WORKERS[fw]}:prepare_step", key=key, info=info,
                                             threads=threads, mode=mode)
                            live[(fw, mode)] = (workers[fw], key)
                        except WorkerError as exc:
                            entry["errors"][f"{fw} {mode}"] = exc.error
                times = {k: [] for k in live}
                for r in range(cfg.step_rounds):
                    names = list(live)
                    names = names[r % len(names):] + names[: r % len(names)]
                    for k in names:
                        w, key = live[k]
                        times[k].append(w.call(f"{STEP_WORKERS[k[0]]}:step_time", key=key,
                                               seconds=cfg.step_seconds)["mean"])
                for (fw, _mode), (w, key) in live.items():
                    w.call(f"{STEP_WORKERS[fw]}:drop_step", key=key)
                entry["times"] = {f"{fw} {mode}": v for (fw, mode), v in times.items()}
                entry["ms"] = {fw: 1e3 * median(v) for (fw, mode), v in times.items() if v and mode == "adam"}
                entry["grad_ms"] = {fw: 1e3 * median(v) for (fw, mode), v in times.items() if v and mode == "grad"}
                entry["update_ms"] = {fw: 1e3 * median(v) for (fw, mode), v in times.items() if v and mode == "update"}
                out["adam"].append(entry)
                log("  " + ", ".join(f"{fw} {ms:.2f} ms (fwd+bwd {entry['grad_ms'].get(fw, 0):.2f} ms)"
                                     for fw, ms in entry["ms"].items()))
        if jx is not None:
            jx.close()


def check_agreement(prepared: dict) -> dict:
    """Loss and sum of squared gradients of each framework against revgraph's (relative differences)."""
    base = prepared.get("revgraph")
    if not base:
        return {}
    out = {}
    g0 = sum(base.get("grad_sq", {}).values())
    for fw, p in prepared.items():
        if fw == "revgraph":
            continue
        g = sum(p.get("grad_sq", {}).values())
        out[fw] = {"loss_rel": abs(p["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12),
                   "grad_rel": abs(g - g0) / max(abs(g0), 1e-12)}
        out[fw]["agree"] = out[fw]["loss_rel"] < 1e-4 and out[fw]["grad_rel"] < 1e-3
    return out


# ------------------------------------------------------------------------------------------- 3. memory


def run_memory(rg: Worker, cfg: Config, res: dict) -> None:
    out = res.setdefault("memory", {"loops": [], "accumulation": {}})
    for steps in cfg.loop_steps:
        for policy in cfg.loop_policies:
            log(f"memory: loop T={steps} {policy}")
            r = rg.call("rg_tasks:loop_memory", steps=steps, policy=policy)
            out["loops"].append({"steps": steps, "policy": policy, **r})
    configs = [(s, o) for o in ("DEFAULT", "PRIORITY_BASED") for s in ("sum", "running")]
    acc = {c: [] for c in configs}
    for r in range(cfg.accum_rounds):
        for strategy, order in (configs if r % 2 == 0 else configs[::-1]):
            log(f"memory: accumulation {strategy}, execution order {order}, round {r + 1}")
            acc[(strategy, order)].append(rg.call("rg_tasks:accumulation_memory", strategy=strategy, order=order))
    out["accumulation"] = [{"accumulate": s, "order": o, "peak_mb": median([x["peak_mb"] for x in v]),
                            "time_s": median([x["time_s"] for x in v]), "nodes": v[0]["nodes"],
                            "checksum": v[0]["checksum"], "runs": v} for (s, o), v in acc.items()]


# ------------------------------------------------------------------------------------------ 4. profile


def run_profiles(rg: Worker, W: dict, cfg: Config, work: Path, res: dict) -> None:
    out = res.setdefault("profile", {})
    ort = W.get("ort")
    builds = {c["name"]: c for c in res.get("build", {}).get("cases", [])}
    # audits of the gradient graphs saved by the build section
    audits = {}
    for name, c in builds.items():
        if c.get("group") == "synthetic" and c.get("n", 0) > 10000:
            continue
        log(f"audit: {name}")
        a = {"revgraph": rg.call("rg_tasks:audit", path=c["revgraph_graph"])}
        if c.get("ort_graph"):
            a["ort"] = rg.call("rg_tasks:audit", path=c["ort_graph"])
        audits[name] = a
    out["audit"] = audits
    # cProfile of the builder
    prof = {}
    targets = [c for c in builds.values() if c["name"] in ("chain 10k", "fan-out 10k", "ResNet-50", "Transformer")]
    cases = {c["name"]: c for c in res["_cases"]}
    for c in targets:
        log(f"cProfile: {c['name']}")
        case = cases[c["name"]]
        prof[c["name"]] = rg.call("rg_tasks:profile_build", path=case["path"], params=case["params"],
                                  loss_kind=case["loss_kind"])
    # one VJP emitting thousands of nodes: the Concat of a fan-in (profile only, and one build of each tool)
    info = rg.call("models:write_synthetic", kind="concat", n=cfg.concat_n, out_dir=str(work))
    log(f"cProfile: concat fan-in {cfg.concat_n // 1000}k")
    name = f"concat fan-in {cfg.concat_n // 1000}k"
    prof[name] = rg.call("rg_tasks:profile_build", path=info["path"], params=info["params"],
                         loss_kind=info["loss_kind"])
    fan_in = {"n": cfg.concat_n, "revgraph_s": rg.call("rg_tasks:build", path=info["path"], params=info["params"],
                                                      loss_kind=info["loss_kind"])["seconds"]}
    if ort is not None:
        try:
            fan_in["ort_s"] = ort.call("ort_training_tasks:build", path=info["path"], params=info["params"],
                                       loss_kind=info["loss_kind"])["seconds"]
        except WorkerError as exc:
            fan_in["ort_error"] = exc.error
    out["concat_fan_in"] = fan_in
    out["cprofile"] = prof
    log("micro-benchmarks")
    try:
        out["micro_relu"] = rg.call("micro:relu_vjp", threads=max(cfg.threads), rounds=cfg.micro_rounds)
        out["micro_conv"] = rg.call("micro:conv_weight_grad", threads=max(cfg.threads), rounds=cfg.micro_rounds)
        out["micro_conv_forward"] = rg.call("micro:conv_forward_layout", threads=1, rounds=cfg.micro_rounds)
    except WorkerError as exc:
        out["micro_error"] = exc.error


def step_profile_hook(rg: Worker, cfg: Config, res: dict):
    out = res.setdefault("profile", {})

    def hook(model, key, info):
        log(f"  onnxruntime profile of {key}")
        try:
            out.setdefault("ort", {})[model] = rg.call("rg_tasks:ort_profile", key=key, steps=cfg.profile_steps,
                                                        threads=max(cfg.threads))
            if model in cfg.variant_models:
                log(f"  session options, {key}")
                out.setdefault("session_variants", {})[model] = rg.call(
                    "rg_tasks:session_variants", key=key, seconds=cfg.variant_seconds, rounds=cfg.variant_rounds,
                    threads=max(cfg.threads))
        except WorkerError as exc:
            out.setdefault("errors", []).append(f"{key}: {exc.error}")

    return hook


# --------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (under 10 minutes)")
    parser.add_argument("-o", "--output", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--json", default=None, help="raw results (default bench/results/<quick|full>.json)")
    parser.add_argument("--sections", default="build,step,memory,profile")
    parser.add_argument("--work-dir", default=None, help="models and gradient graphs (default: a temporary dir)")
    parser.add_argument("--venv-dir", default=None, help="where the comparison virtual environments live")
    parser.add_argument("--baseline", default=None, help="results of an earlier full run to compare the goals "
                        "with (default for a full run: bench/results/before-round2.json; '' for none)")
    args = parser.parse_args(argv)
    if args.venv_dir:
        os.environ["RG_BENCH_VENV_DIR"] = args.venv_dir
    cfg = Config(args.quick)
    mode = "quick" if args.quick else "full"
    sections = set(args.sections.split(","))
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="revgraph-bench-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else HERE / "results" / f"{mode}.json"
    command = "python bench/run.py" + (" --quick" if args.quick else "")
    res: dict = {"mode": mode, "command": command, "argv": sys.argv[1:], "started": dt.datetime.now().isoformat(
        timespec="seconds"), "machine": machine_info(), "load_start": loadavg(), "errors": [], "work_dir": str(work)}
    log(f"revgraph benchmarks ({mode}); work dir {work}; load average {res['load_start']}")

    pythons = {}
    for kind in ("ort-training", "jax"):
        try:
            pythons[kind] = envs.ensure(kind, log=log)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on without that framework
            res["errors"].append(f"environment {kind}: {failure(exc)}")
            log(f"environment {kind} unavailable: {failure(exc)}")
    rg = Worker("revgraph", sys.executable, work / "logs")
    th = Worker("pytorch", sys.executable, work / "logs")
    ort = Worker("ort-training", pythons["ort-training"], work / "logs") if "ort-training" in pythons else None
    res["versions"] = {"revgraph worker": rg.call("rg_tasks:versions"),
                       "pytorch worker": th.call("torch_tasks:versions")}
    if ort is not None:
        res["versions"]["onnxruntime-training worker"] = ort.call("ort_training_tasks:versions")
    if "jax" in pythons:
        with Worker("jax-versions", pythons["jax"], work / "logs", env=jax_env(2)) as jx:
            res["versions"]["jax worker"] = jx.call("jax_tasks:versions")
    W = {"ort": ort}
    t_start = time.perf_counter()
    try:
        log("writing models")
        infos = th.call("models:write_models", out_dir=str(work / "models"))
        res["_cases"] = build_cases(rg, cfg, work, infos)
        for name, fn in (
            ("build", lambda: run_build(rg, W, cfg, work, res["_cases"], res)),
            ("step", lambda: run_steps(rg, th, pythons.get("jax"), cfg, work, infos, res,
                                       step_profile_hook(rg, cfg, res) if "profile" in sections else None)),
            ("memory", lambda: run_memory(rg, cfg, res)),
            ("profile", lambda: run_profiles(rg, W, cfg, work, res)),
        ):
            if name not in sections:
                continue
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a failed section is reported, the others still run
                res["errors"].append(f"section {name}: {failure(exc)}")
                res.setdefault("tracebacks", []).append(traceback.format_exc())
                log(f"section {name} failed: {failure(exc)}")
            res.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
    finally:
        for w in (rg, th, W["ort"]):
            if w is not None:
                w.close()
    res["seconds"] = time.perf_counter() - t_start
    res["load_end"] = loadavg()
    res["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    res["argv"] = [f"<path>/{Path(a).name}" if os.path.isabs(a) and not a.startswith(str(ROOT)) else a
                   for a in res.get("argv", [])]  # (the machine's own directories are not saved)
    res = portable(json.loads(json.dumps(res, default=str)), {res["work_dir"]: "<work_dir>", str(ROOT): "<repo>"})
    json_path.write_text(json.dumps(res, indent=1))
    import report

    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    baseline = args.baseline if args.baseline is not None else ("" if args.quick else report.BASELINE)
    report.write(args.output, report.render(res, json_path=json_path, baseline=report.load_baseline(baseline)))
    log(f"wrote {args.output} and {json_path} in {res['seconds']:.0f}s")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
