"""A training process under a memory limit, for tests/test_shard_parameters.py's "my model does not fit" test:
a deep MLP of ``--width`` x ``--layers`` square layers (default 2048 x 16: 67 M parameters, 256 MiB in float32)
trained with Adam, data-parallel with ``--shard`` when started by torchrun, alone otherwise.

The limit: the resident set may grow at most ``--limit-mib`` over its size once the libraries are imported and the
model is built (the model's weights, which every process holds as the user's graph, are the base; the limit is on
what training adds: the parameters the engine holds, the gradients, Adam's state, the sessions and activations),
from the Trainer's construction to the end of the last step (the trained model gathered afterwards for writing is
outside it; ``nonfinite="continue"``: no copy of the state kept for the last step's NaN check, as
``--allow-nonfinite``). A thread reads ``VmRSS`` every 2 ms and ends the process with exit 3 the moment it passes
the limit; after the last step the peak (``VmHWM``) is checked too, for a peak between two reads. Writes
``<out>/rank0.npz``: the parameters, Adam's state, the losses and the peak over the base."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

CLASSES = 10


def deep_mlp(width: int, layers: int) -> Graph:
    """``x [N, width] -> (Gemm, Relu) x layers -> Gemm -> 10 logits``, nn.Linear's uniform initialization."""
    rng = np.random.default_rng(0)
    inits, nodes, h = {}, [], "x"
    for i in range(layers + 1):
        out = CLASSES if i == layers else width
        bound = 1 / np.sqrt(width)
        inits[f"W{i}"] = rng.uniform(-bound, bound, (width, out)).astype(np.float32)
        inits[f"b{i}"] = rng.uniform(-bound, bound, out).astype(np.float32)
        nodes.append(Node("Gemm", [h, f"W{i}", f"b{i}"], [f"z{i}"], {}, f"layer{i}/gemm"))
        h = f"z{i}"
        if i < layers:
            nodes.append(Node("Relu", [h], [f"h{i}"], {}, f"layer{i}/relu"))
            h = f"h{i}"
    return Graph(nodes, [ValueInfo("x", np.float32, ("N", width))], [ValueInfo(h, np.float32, ("N", CLASSES))],
                 inits, name="deep_mlp")


def status(field: str) -> int:
    """``field`` of /proc/self/status in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def watch(base: int, limit: int) -> threading.Event:
    """End the process (exit 3) as soon as its resident set passes ``base + limit`` MiB, until the event returned
    is set."""
    done = threading.Event()

    def run():
        while not done.is_set():
            if status("VmRSS") - base > limit:
                print(f"over the memory limit: {status('VmRSS') - base} MiB > {limit} MiB", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.002)

    threading.Thread(target=run, daemon=True).start()
    return done


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shard", default="none")
    p.add_argument("--limit-mib", type=int, help="the most the resident set may grow over the base (none: no limit)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import onnxruntime  # noqa: F401  (the libraries are in the base)
    import torch  # noqa: F401

    distributed = "WORLD_SIZE" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = deep_mlp(a.width, a.layers)
    rng = np.random.default_rng(1)
    n = a.batch_size * a.steps
    data = {"x": rng.standard_normal((n, a.width)).astype(np.float32), "labels": rng.integers(0, CLASSES, n)}
    base = status("VmRSS")
    done = watch(base, a.limit_mib) if a.limit_mib else threading.Event()
    how = {"shard": a.shard, "bucket_mb": 4 * a.width * a.width / 2**20} if distributed else {}  # (a layer a unit)
    tr = rg.Trainer(g, "cross-entropy", "adam", threads=1, distributed=distributed, **how)
    peaks, step = [], tr._engine.step

    def stepped(*args, **kwargs) -> float:  # (on every rank, as the engine runs each step)
        loss = step(*args, **kwargs)
        if tr._engine.steps == a.steps:  # the last step is applied: the limit ends here
            peaks.append(status("VmHWM") - base)
            done.set()
        return loss

    tr._engine.step = stepped
    tr.fit(data, 1, a.batch_size // world, seed=3, progress=False, nonfinite="continue")
    peak = peaks[0]
    if a.limit_mib and peak > a.limit_mib:
        print(f"over the memory limit: peak {peak} MiB > {a.limit_mib} MiB", file=sys.stderr, flush=True)
        os._exit(3)
    params, state = tr.parameters, tr.state
    if tr.rank == 0:
        np.savez(os.path.join(a.out, "rank0.npz"), **params, **state, losses=np.array(tr.losses), peak=np.array(peak))
    print(f"peak {peak} MiB over the base", flush=True)
    if distributed:
        tr.comm.close()


if __name__ == "__main__":
    main()
