"""Memory and step time of a LoRA fine-tune whose frozen weights dominate: revgraph (as committed at REV, side by
side) against PyTorch with the same adapters, each in a fresh process, alternating turns.

    python bench/frozen_memory.py [--turns N] [--width D] [--layers L] [--batch B] [--steps S] [--commit REV]
                                  [--shard gradients|parameters] [--json FILE]

The model: ``L`` frozen ``D x D`` float32 weights (``MatMul`` then ``Relu``, 16 MiB each at ``D = 2048``) and a
``D x 10`` head, every frozen weight with a rank-8 LoRA adapter (:func:`revgraph.train.lora.add_adapters`); the
loss cross-entropy, AdamW on the adapters, batch ``B``, one thread. The weights exist as numpy arrays before anything
is measured (the user's model, loaded). *revgraph constants*: ``RuntimeOptions(frozen_weights="constants")`` (each
session's own constants, as before frozen weights were shared). Per process: *built*, the resident set added by
making the trainer (``rg.Trainer``; PyTorch: the modules over the same arrays, ``torch.from_numpy``, and the
optimizer); *peak*, the high-water mark of the resident set over ``S`` steps of training less the resident set
before the trainer (``/proc/self/status`` VmHWM after ``/proc/self/clear_refs``); *ms/step*, the median of the
steps after the first.
``--shard``: revgraph at 2 processes under torchrun (``B`` samples a step in all), ZeRO-2 or ZeRO-3 with 1 MiB
units, rank 0's numbers (torch's import not counted). PyTorch's LoRA is the formula of PEFT's ``LoraLayer`` (``x W +
(x A^T) B^T * alpha / r``, B zero at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) / 1024 for line in f if line.startswith(key)), 0.0)


def _weights(d: int, layers: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32) for _ in range(layers)]
    return ws, (rng.standard_normal((d, 10)) * 0.01).astype(np.float32), rng


def _revgraph(ws, head, rng, args) -> tuple[object, object]:
    import numpy as np

    import revgraph as rg
    from revgraph.ir import Graph, Node, ValueInfo
    from revgraph.train.lora import add_adapters

    nodes, inits, x = [], {}, "x"
    for i, w in enumerate(ws):
        inits[f"W{i}"] = w
        nodes += [Node("MatMul", [x, f"W{i}"], [f"h{i}"], name=f"mm{i}"), Node("Relu", [f"h{i}"], [f"a{i}"],
                                                                                name=f"relu{i}")]
        x = f"a{i}"
    inits["Wo"] = head
    nodes.append(Node("MatMul", [x, "Wo"], ["logits"], name="head"))
    d = args.width
    g = Graph(nodes, [ValueInfo("x", np.float32, ["N", d])], [ValueInfo("logits", np.float32, ["N", 10])], inits)
    g = add_adapters(g, 8, targets=[f"W{i}" for i in range(len(ws))])
    how = {"runtime": rg.RuntimeOptions(frozen_weights=args.frozen)} if args.frozen else {}  # (REV may predate it)
    if args.shard:
        how.update(distributed=True, shard=args.shard, bucket_mb=1.0)
    tr = rg.Trainer(g, "cross-entropy", "adamw", threads=1, **how)
    data = {"x": rng.standard_normal((args.batch, d)).astype(np.float32),
            "labels": rng.integers(0, 10, args.batch).astype(np.int64)}
    return tr, lambda: tr.fit(data, 1, args.batch, progress=False, shuffle=False)


def _torch(ws, head, rng, args) -> tuple[object, object]:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    frozen = [torch.from_numpy(w) for w in ws] + [torch.from_numpy(head)]
    adapters = [(torch.nn.Parameter(torch.randn(8, args.width) * 0.01), torch.nn.Parameter(torch.zeros(args.width, 8)))
                for _ in ws]
    opt = torch.optim.AdamW([p for ab in adapters for p in ab], lr=1e-3)
    x = torch.from_numpy(rng.standard_normal((args.batch, args.width)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, args.batch).astype(np.int64))

    def step():
        h = x
        for w, (a, b) in zip(frozen, adapters, strict=False):  # (frozen[-1]: the head)
            h = torch.relu(h @ w + (h @ a.T) @ b.T)  # (alpha = r: scaling 1)
        loss = torch.nn.functional.cross_entropy(h @ frozen[-1], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return opt, step


def worker(args) -> dict:
    ws, head, rng = _weights(args.width, args.layers)
    if args.framework == "torch" or args.shard:  # (the imports are not what is measured)
        import torch.distributed  # noqa: F401
    else:
        import onnxruntime  # noqa: F401

        import revgraph  # noqa: F401
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (the high-water mark restarts from the resident set now)
    base = _status("VmRSS")
    made, step = (_torch if args.framework == "torch" else _revgraph)(ws, head, rng, args)
    built = _status("VmRSS") - base
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if args.shard:
        made.comm.close()  # (made: the Trainer; PyTorch's side returns its optimizer)
    return {"built_mb": built, "peak_mb": _status("VmHWM") - base, "ms_per_step": 1e3 * statistics.median(times[1:]),
            "frozen_mb": sum(w.nbytes for w in ws) / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--commit", help="also revgraph as committed at REV, in the same turns")
    parser.add_argument("--shard", choices=("gradients", "parameters"), help="revgraph data-parallel at 2 processes "
                        "with Trainer(shard=...) and 1 MiB units (rank 0's numbers; no PyTorch row)")
    parser.add_argument("--json")
    parser.add_argument("--framework", help=argparse.SUPPRESS)  # (a worker process: revgraph or torch)
    parser.add_argument("--frozen", help=argparse.SUPPRESS)  # (a revgraph worker: RuntimeOptions(frozen_weights=))
    args = parser.parse_args()
    if args.framework:
        answer = worker(args)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(answer))
        return 0
    import ddp

    tmp = Path(tempfile.mkdtemp())
    here = ddp.revgraph_source(None, tmp)[0]
    configs = {"revgraph": ("revgraph", here), "revgraph constants": ("revgraph", here), "torch": ("torch", None)}
    launch = [sys.executable]
    if args.shard:
        del configs["torch"]
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if args.commit:
        configs[f"revgraph@{args.commit}"] = ("revgraph", ddp.revgraph_source(args.commit, tmp)[0])
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for turn in range(args.turns):
        for label in (list(configs) if turn % 2 == 0 else list(configs)[::-1]):
            fw, env = configs[label]
            sizes = ("width", "layers", "batch", "steps", "shard")
            given = [f"--{k}={getattr(args, k)}" for k in sizes if getattr(args, k)]
            cmd = [*launch, __file__, "--framework", fw, *given]
            if label == "revgraph constants":
                cmd.append("--frozen=constants")
            out = subprocess.run(cmd, env=env or base, capture_output=True, text=True, check=True).stdout
            runs[label].append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
            r = runs[label][-1]
            print(f"turn {turn + 1} {label:24s} built {r['built_mb']:7.1f} MB  peak {r['peak_mb']:7.1f} MB  "
                  f"{r['ms_per_step']:7.2f} ms/step", flush=True)
    frozen = runs["revgraph"][0]["frozen_mb"]
    print(f"frozen weights: {frozen:.1f} MiB; medians over {args.turns} turns:")
    for label, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("built_mb", "peak_mb", "ms_per_step")}
        print(f"{label:24s} built {med['built_mb']:7.1f} MB  peak {med['peak_mb']:7.1f} MB  "
              f"{med['ms_per_step']:7.2f} ms/step")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "machine": ddp.machine()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
