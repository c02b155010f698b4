"""Memory and CPU time of an Adam training step in onnxruntime's order and in revgraph's (issue 42, item 2).

``rg.Trainer(..., "cross-entropy", "adam", threads=1)`` on the step benchmark's models at batch 64
(bench/models.py: MLP, CNN, Transformer; the RNN is time-major, which Trainer.step does not take) and bench/memory.py's
LLaMA (transformers' ``LlamaConfig``: 4 layers, hidden 256, vocabulary 2048) at ``--llama-batch`` x 128 tokens, with
four runtime settings that differ in the order the nodes run and in how onnxruntime places tensors:

- **onnxruntime**: ``execution_order="default"`` (a depth-first walk back from the outputs), every graph
  optimization (``"all"``), onnxruntime's planned buffer reuse (``memory_reuse=True``) and an arena per session
  that grows by doubling chunks (``arena_extend="next_power_of_two"``): the training default before issue 42;
- **revgraph, reuse on**: revgraph's order (``"priority_based"`` with no graph optimizations: the nodes run in the
  order revgraph wrote them, the order ``memory/lifetime.py`` models) with the planned reuse, a freed buffer held
  for the next tensor of its shape, and the sessions' own arenas (the training default of commit 58c0e57);
- **revgraph, reuse off**: the same with the planned reuse off (the arena hands freed blocks to what comes next);
- **revgraph**: :data:`revgraph.runtime.options.TRAINING_DEFAULT`, reuse off and one arena for the process that
  grows by what is requested (``arena_extend="same_as_requested"``).

Each measurement is a fresh process (``python bench/runtime_order.py --cell MODEL CONFIG ...``): the step peak is
VmHWM over three steps (reset through /proc/self/clear_refs just before them) minus the resident size after setup;
the CPU time per step (``time.process_time``, one onnxruntime thread) is the median of ``--steps`` steps after
those three. The configurations alternate for ``--turns`` turns (the first rotating); the table gives each
configuration's median over turns and ``predicted``, the peak :func:`revgraph.autodiff.memory.lifetime.lifetimes`
gives the step graph in its own order (with or without the planned reuse). ``--memory F`` gives every
configuration ``rg.Trainer(memory=F)``.

    python bench/runtime_order.py [--models mlp cnn transformer rnn llama] [--turns 3] [--llama-batch 64] [--memory F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CONFIGS = {"onnxruntime": {"execution_order": "default", "graph_optimization": "all", "memory_reuse": True,
                           "arena_extend": "next_power_of_two"},
           "revgraph, reuse on": {"memory_reuse": True, "arena_extend": "next_power_of_two"},
           "revgraph, reuse off": {"arena_extend": "next_power_of_two"}, "revgraph": {}}


def cell(info: dict, config: str, steps: int, memory: float | None = None) -> dict:
    """One configuration's step peak (MB over setup), CPU ms per step and predicted peak (MB)."""
    import warnings

    import numpy as np
    from memory_common import peak_mb, reset_peak

    import revgraph as rg
    from revgraph.autodiff.memory.lifetime import lifetimes

    if "llama_batch" in info:
        from memory_common import llama_batch

        data = llama_batch(info["llama_batch"])
        data = {"x": data["input_ids"], "labels": data["labels"]}
    else:
        from models import load_npz

        _, data = load_npz(info["npz"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = rg.Trainer(info["path"], "cross-entropy", "adam", params=info["params"], threads=1,
                        runtime=rg.RuntimeOptions(**CONFIGS[config]), **({} if memory is None else {"memory": memory}))
    batch = {tr.spec.inputs[0]: np.ascontiguousarray(data["x"]), "labels": data["labels"]}
    n = len(data["labels"])
    base = reset_peak()
    losses = [float(tr.step(batch)) for _ in range(3)]
    peak = peak_mb() - base
    cpu = []
    for _ in range(steps):
        t0 = time.process_time()
        tr.step(batch)
        cpu.append(1000 * (time.process_time() - t0))
    dims = {d: n for vi in tr.spec.graph.inputs for d in (vi.shape or ()) if isinstance(d, str)}
    reuse = CONFIGS[config].get("memory_reuse", False)
    predicted = lifetimes(tr.spec.graph, dims, reuse=reuse).peak / 2**20
    return {"peak_mb": peak, "cpu_ms": statistics.median(cpu), "predicted_mb": predicted, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer", "llama"])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--llama-batch", type=int, default=64)
    parser.add_argument("--json", default=str(HERE / "results" / "runtime_order.json"))
    parser.add_argument("--memory", type=float, help="rg.Trainer's memory= budget (default: none)")
    parser.add_argument("--cell", nargs=3, metavar=("INFO_JSON", "CONFIG", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell:
        print(json.dumps(cell(json.loads(args.cell[0]), args.cell[1], int(args.cell[2]), args.memory)))
        return 0
    from models import write_step_model

    results: dict = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            if name == "llama":
                from memory_torch import export_llama

                files = export_llama(work)
                info = {"path": files["onnx"], "params": files["params"], "llama_batch": args.llama_batch}
            else:
                info = write_step_model(name, 64, work)
            runs: dict = {c: [] for c in CONFIGS}
            names = list(CONFIGS)
            for turn in range(args.turns):
                for config in names[turn % len(names):] + names[:turn % len(names)]:
                    budget = [] if args.memory is None else ["--memory", str(args.memory)]
                    out = subprocess.run([sys.executable, __file__, "--cell", json.dumps(info), config,
                                          str(args.steps), *budget], capture_output=True, text=True, check=True)
                    runs[config].append(json.loads(out.stdout.strip().splitlines()[-1]))
            results[name] = {c: {k: statistics.median(r[k] for r in rs) for k in ("peak_mb", "cpu_ms", "predicted_mb")}
                             | {"losses": rs[0]["losses"], "cpu_ms_turns": [round(r["cpu_ms"], 1) for r in rs]}
                             for c, rs in runs.items()}
            r = results[name]
            print(f"{name}: " + "; ".join(f"{c}: peak {r[c]['peak_mb']:.0f} MB (predicted {r[c]['predicted_mb']:.0f}), "
                                          f"CPU {r[c]['cpu_ms']:.1f} ms" for c in names), flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
