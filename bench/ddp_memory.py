"""Memory per rank of sharded data-parallel training: revgraph unsharded / --shard optimizer (ZeRO-1) /
--shard gradients (ZeRO-2) against PyTorch DDP + Adam and DDP + ZeroRedundancyOptimizer(Adam), on one model.

    python bench/ddp.py --memory [--quick]                     # (bench/ddp.py hands over to this module)
    python bench/ddp_memory.py [--quick] [--width 2048 --layers 6 --bucket-mb 25] [--json FILE]

The model: a deep MLP, ``x [N, width] -> (Gemm, Relu) x layers -> Gemm -> 10 classes`` (``layers`` square
``width x width`` weights: 4.2 M parameters for width 1024 and 4 layers; the full run 25.2 M), trained with Adam
and cross-entropy on random data, batch ``--batch`` per process, in 2 processes on gloo with one thread each.
Every configuration is a fresh ``torchrun --nproc-per-node 2`` launch (this file as the worker); each rank
reads its /proc/self/status: ``VmRSS`` after importing torch, onnxruntime and revgraph (the base: the
libraries), ``VmRSS`` once the model, optimizer and sessions are built and ``VmHWM`` (peak) after ``--steps``
training steps and after gathering the trained model to rank 0 to write it (revgraph's ``fit`` does; FSDP2:
``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) (the table: the largest over the ranks, less the
base), every launch with
``MALLOC_MMAP_THRESHOLD_=131072`` (large temporaries go back to the system when freed, instead of growing glibc's
heap: see ``main``). What differs between the configurations is the training state: revgraph's engine also
reports the bytes of its own buffers (``engine.held()``: parameters, optimizer state, gradients), which the
table sets beside the arithmetic (P parameters of 4 bytes: unsharded Adam holds 3P of state and P of
gradients; ZeRO-1 P + 2P/W and P (reduce-scattered in place); ZeRO-2 P + 2P/W and P/W + one bucket). The DDP
bucket size and revgraph's largest gradient unit are both ``--bucket-mb`` (DDP's default 25; a layer larger than
a bucket is a unit of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = [("revgraph", "none"), ("revgraph", "optimizer"), ("revgraph", "gradients"), ("revgraph", "parameters"),
           ("torch", "ddp"), ("torch", "zero"), ("torch", "fsdp2")]
LABELS = {("revgraph", "none"): "revgraph, unsharded", ("revgraph", "optimizer"): "revgraph --shard optimizer",
          ("revgraph", "gradients"): "revgraph --shard gradients", ("torch", "ddp"): "PyTorch DDP + Adam",
          ("revgraph", "parameters"): "revgraph --shard parameters",
          ("torch", "zero"): "PyTorch DDP + ZeroRedundancyOptimizer(Adam)",
          ("torch", "fsdp2"): "PyTorch FSDP2 (fully_shard per layer) + Adam"}
CLASSES = 10


def weights(width: int, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``W{i}``, ``b{i}`` (``torch.nn.Linear``'s uniform +-1/sqrt(fan in)) of the deep MLP, float32."""
    rng = np.random.default_rng(seed)
    out, k = {}, 1 / np.sqrt(width)
    for i in range(layers + 1):
        cols = CLASSES if i == layers else width
        out[f"W{i}"] = rng.uniform(-k, k, (width, cols)).astype(np.float32)
        out[f"b{i}"] = rng.uniform(-k, k, (cols,)).astype(np.float32)
    return out


def rg_graph(width: int, layers: int):
    from revgraph.ir import Graph, Node, ValueInfo

    nodes, h = [], "x"
    for i in range(layers + 1):
        nodes.append(Node("Gemm", [h, f"W{i}", f"b{i}"], [f"z{i}"], {}, f"layer{i}/gemm"))
        h = f"z{i}"
        if i < layers:
            nodes.append(Node("Relu", [h], [f"h{i}"], {}, f"layer{i}/relu"))
            h = f"h{i}"
    nodes.append(Node("Identity", [h], ["logits"], {}, "out"))
    return Graph(nodes, [ValueInfo("x", np.float32, ("N", width))], [ValueInfo("logits", np.float32, ("N", CLASSES))],
                 weights(width, layers), name="deep_mlp")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args) -> None:
    """One rank of one configuration (under torchrun): build, train ``--steps`` steps, report memory."""
    import onnxruntime  # noqa: F401  (the libraries are in the base)
    import torch
    import torch.distributed as dist

    import revgraph as rg

    torch.set_num_threads(1)
    base = _status("VmRSS")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rng = np.random.default_rng(1)
    n = args.batch * world * args.steps
    x = rng.standard_normal((n, args.width)).astype(np.float32)
    y = rng.integers(0, CLASSES, n).astype(np.int64)
    held, gathered = None, None
    if args.framework == "revgraph":
        tr = rg.Trainer(rg_graph(args.width, args.layers), "cross-entropy", "adam", threads=1, distributed=True,
                        **trainer_options(args))
        built = _status("VmRSS")
        step, stepped = tr._engine.step, []

        def timed_step(*a, **k):  # the peak while training, before fit gathers the trained model to return it
            loss = step(*a, **k)
            stepped.append(_status("VmHWM"))
            return loss

        tr._engine.step = timed_step
        start = time.perf_counter()
        # (nonfinite="continue": no copy of the state kept for the last step's NaN check, as the PyTorch loops keep
        # none)
        tr.fit({"x": x, "labels": y}, 1, args.batch, progress=False, nonfinite="continue")
        seconds = time.perf_counter() - start
        train_peak = max(stepped)
        held = tr._engine.held()
        units = getattr(tr._engine, "units", [])
        held["largest_unit"] = 4 * max((u.length for u in units), default=0)
        if "optimizer" not in held:  # the unsharded engine counts state (parameters, Adam's m and v, step) at once
            held["optimizer"] = held["state"] - sum(a.nbytes for a in tr.spec.initial.values()) - 16
        dist_ = dist
    else:
        from torch import nn
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dist.init_process_group("gloo")
        dist_ = dist
        w = weights(args.width, args.layers)
        layers = []
        for i in range(args.layers + 1):
            lin = nn.Linear(args.width, CLASSES if i == args.layers else args.width)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w[f"W{i}"].T))
                lin.bias.copy_(torch.from_numpy(w[f"b{i}"]))
            layers += [lin, nn.ReLU()] if i < args.layers else [lin]
        if args.shard == "fsdp2":  # each Linear its own FSDP unit (as revgraph's units of --bucket-mb), then the root
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            model = nn.Sequential(*layers)
            for layer in layers:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=args.bucket_mb)
        opt = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam) if args.shard == "zero"
               else torch.optim.Adam(model.parameters()))
        built = _status("VmRSS")
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        group = args.batch * world
        start = time.perf_counter()
        for s in range(args.steps):
            rows = slice(s * group + rank, (s + 1) * group, world)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xt[rows]), yt[rows]).backward()
            opt.step()
        seconds = time.perf_counter() - start
        train_peak = _status("VmHWM")
        if args.shard == "fsdp2":  # the trained model gathered to rank 0 for writing it, as revgraph's fit does
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            gathered = sum(t.numel() * t.element_size() for t in full.values())  # (rank 0's; the others: 0)
    mine = {"rank": rank, "base": base, "built": built, "peak": _status("VmHWM"), "train_peak": train_peak,
            "held": held, "gathered": gathered, "ms_per_sample": 1e3 * seconds / (args.steps * args.batch * world)}
    every = [None] * world
    dist_.all_gather_object(every, mine)
    if rank == 0:
        Path(args.out).write_text(json.dumps(every))
    sys.stdout.flush()
    os._exit(0)  # (DDP's Reducer can deadlock at interpreter exit on gloo: bench/ddp_worker.py)


def launch(fw: str, shard: str, args, env: dict) -> list | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    out.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(Path(__file__)),
           "--worker", "--framework", fw, "--shard", shard, "--width", str(args.width), "--layers", str(args.layers),
           "--batch", str(args.batch), "--steps", str(args.steps), "--bucket-mb", str(args.bucket_mb),
           "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
    if proc.returncode == 0 and out.exists():
        res = json.loads(out.read_text())
        out.unlink()
        return res
    print(f"    FAILED (exit {proc.returncode}):\n{text[-3000:]}", flush=True)
    return None


def trainer_options(args) -> dict:
    """revgraph's side of ``--bucket-mb`` and ``--shard``: ``rg.Trainer``'s ``bucket_mb`` (DDP gets the same as
    ``bucket_cap_mb``; issue 43: the bench once set a module attribute that no longer existed, so revgraph ran at
    25 MiB where DDP ran at 4)."""
    return {"bucket_mb": args.bucket_mb, "shard": args.shard}


def expected(params: int, world: int, bucket: int, shard: str) -> dict[str, float]:
    """The arithmetic of revgraph's held bytes (module doc; padding and the step left out)."""
    p = 4 * params
    opt = 2 * p / (world if shard != "none" else 1)
    grads = {"none": p, "optimizer": p, "gradients": p / world + bucket, "parameters": p / world + bucket}[shard]
    return {"optimizer": opt, "gradients": grads}


def table(res: dict) -> str:
    mb = lambda b: f"{b / 2**20:8.1f}"
    lines = [(f"deep MLP width {res['width']} x {res['layers']} layers: {res['params'] / 1e6:.2f} M parameters "
              f"({4 * res['params'] / 2**20:.1f} MiB fp32), batch {res['batch']} per process, 2 processes, "
              f"{res['steps']} Adam steps, buckets {res['bucket_mb']} MiB"),
             (f"{'configuration':<46} {'peak-base':>9} {'train':>9} {'built-base':>10} {'optimizer':>9} "
              f"{'(arith.)':>9} {'gradients':>9} {'(arith.)':>9} {'in step':>9} {'ms/sample':>9}   "
              "MiB per rank (max over ranks)")]
    for fw, shard in CONFIGS:
        ranks = res["runs"].get(f"{fw}/{shard}")
        if not ranks:
            lines.append(f"{LABELS[(fw, shard)]:<46} failed")
            continue
        peak = max(r["peak"] - r["base"] for r in ranks)
        train = max(r.get("train_peak", r["peak"]) - r["base"] for r in ranks)
        built = max(r["built"] - r["base"] for r in ranks)
        held = ranks[0]["held"]
        if held:
            want = expected(res["params"], 2, held["largest_unit"], shard)
            extra = (f"{mb(held['optimizer'])}  {mb(want['optimizer'])}  {mb(held['gradients'])}  "
                     f"{mb(want['gradients'])}  {mb(held.get('gradients_peak', held['gradients']))}")
        else:
            extra = f"{'':>9} {'':>9} {'':>9} {'':>9} {'':>9}"
        ms = max(r.get("ms_per_sample", float("nan")) for r in ranks)  # (the first step's build included for revgraph)
        lines.append(f"{LABELS[(fw, shard)]:<46} {mb(peak)} {mb(train)} {mb(built):>10} {extra} {ms:9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="width 1024, 4 layers, buckets 4 MiB, 5 steps")
    p.add_argument("--width", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--bucket-mb", type=float)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="where to write the numbers (default bench/results/ddp-memory[-quick].json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--shard", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = (1024, 4, 4.0, 5) if args.quick else (2048, 6, 25.0, 20)
    for name, value in zip(("width", "layers", "bucket_mb", "steps"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.worker:
        worker(args)
        return 0
    # A fixed mmap threshold: glibc otherwise raises it after each large free, so the temporaries of gloo's
    # reduce-scatter and all-gather (freed every step) end up in a heap that never shrinks, and VmHWM grows for
    # several steps with memory nobody holds (measured: +200 MiB over 10 steps at 14 M parameters). The same
    # setting for every configuration, PyTorch's too.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    params = args.layers * (args.width * args.width + args.width) + args.width * CLASSES + CLASSES
    res = {"date": time.strftime("%Y-%m-%d"), "width": args.width, "layers": args.layers, "params": params,
           "batch": args.batch, "steps": args.steps, "bucket_mb": args.bucket_mb,
           "runs": {}, "command": "python bench/ddp_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    for fw, shard in CONFIGS:
        print(f"  {LABELS[(fw, shard)]} ...", flush=True)
        r = launch(fw, shard, args, env)
        if r:
            res["runs"][f"{fw}/{shard}"] = r
    path = Path(args.json or HERE / "results" / f"ddp-memory{'-quick' if args.quick else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
