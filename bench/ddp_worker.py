"""One configuration of bench/ddp.py, run in every process of a torchrun launch:

    python -m torch.distributed.run --standalone --nproc-per-node N bench/ddp_worker.py \\
        --framework revgraph|torch --model mlp|rnn|embed --mode single|ddp --batch B --warmup W --steps S --out F

``single`` (only with N = 1): the one-process path, revgraph's ``Trainer(threads=1)`` (the fused step graph)
or the plain PyTorch module. ``ddp``: revgraph's ``Trainer(threads=1, distributed=True)`` (grad graph, gloo
all-reduce, update graph) or ``DistributedDataParallel`` on gloo. Every process uses 1 thread
(``torch.set_num_threads(1)``; onnxruntime ``intra_op_num_threads=1``) and ``B`` samples a step; a step's
global batch is ``B * N`` samples, dealt as ``Trainer.fit`` deals them (rank ``r`` takes every ``N``-th
sample of the global batch from ``r``).

The data (``--data``, an .npz that bench/ddp.py writes once for all processes) is cut to 50 global batches.
The model, its sessions and ``W`` warm-up steps run first; then (after a barrier) ``S`` steps are timed on
rank 0 until a barrier after the last: revgraph with ``Trainer.fit`` (``S / 50`` epochs, shuffled, no
progress bar; each call ends with its replica check), PyTorch with the equivalent loop (the same epoch order,
slice the batch, forward, cross-entropy, backward, optimizer step, ``loss.item()``). Rank 0 writes
``{"samples_per_s", "seconds", "steps", "samples", ...}`` to ``--out`` as JSON. ``--profile`` (revgraph) also
times the phases of each step (the sessions' runs, the collectives, the rest) by wrapping the engine's
sessions and ``torch.distributed``; ``--ort-profile`` runs onnxruntime's profiler on the step graphs and
reports each graph's operator types by share of kernel time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_models

EPOCH = 50  # global batches in the timed data set, which is visited steps / EPOCH times


class Clock:
    """Seconds spent in named phases, summed."""

    def __init__(self):
        self.s = defaultdict(float)

    def wrap(self, what: str, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[what] += time.perf_counter() - t
        return timed


class _Proxy:
    """``obj`` with some methods replaced (an onnxruntime session or ``torch.distributed``)."""

    def __init__(self, obj, **methods):
        self._obj = obj
        self.__dict__.update(methods)

    def __getattr__(self, name):
        return getattr(self._obj, name)


def _profile(trainer, clock: Clock) -> None:
    """Wrap ``trainer``'s engine so that ``clock`` sums the time of each phase of a step."""
    eng = trainer._engine
    eng.step = clock.wrap("engine step", eng.step)
    if hasattr(eng, "_sess"):  # the fused engine: one session
        eng._sess = _Proxy(eng._sess, run_with_iobinding=clock.wrap("step graph", eng._sess.run_with_iobinding))
        return
    if getattr(eng, "_grad", None) is not None:  # (cut into segments: those are timed by --timeline)
        eng._grad = _Proxy(eng._grad, run_with_iobinding=clock.wrap("grad graph", eng._grad.run_with_iobinding))
    eng._update = _Proxy(eng._update, run_with_iobinding=clock.wrap("update graph", eng._update.run_with_iobinding))
    if not hasattr(eng, "comm"):  # one process with one buffer set (the split step, no collective)
        return
    dist = eng.comm.dist

    def all_reduce(*a, **k):
        work = clock.wrap("all-reduce (dense grads, loss)", dist.all_reduce)(*a, **k)
        if work is None:
            return None
        return _Proxy(work, wait=clock.wrap("all-reduce (dense grads, loss)", work.wait))

    def all_gather(out, t, *a, **k):  # _exchange_rows: every table's indices and rows packed in one byte buffer
        if t.numel() == 32:  # Collective.check_replicas (a SHA-256), once at the end of fit: not a step's
            return dist.all_gather(out, t, *a, **k)
        return clock.wrap("all-gather (sparse rows, packed)", dist.all_gather)(out, t, *a, **k)

    eng.comm.dist = _Proxy(dist, all_reduce=all_reduce, all_gather=all_gather)


def _collectives_alone(trainer, args, reps: int = 200) -> dict:
    """ms per step of the step's collectives alone, back to back after a barrier (no graph runs between them,
    so no rank waits for another's compute): the all-reduce of every bucket and of the loss, and the all-gather
    of the sparse rows of a batch (``B * 16`` rows per table, as the embedding model's batch gathers)."""
    eng = trainer._engine
    torch, dist = eng.comm.torch, eng.comm.dist._obj
    eng.comm.dist = dist
    loss = torch.zeros(1, dtype=torch.float64)
    out = {}
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        for work in [*(dist.all_reduce(b.flat, async_op=True) for b in eng.buckets),
                     dist.all_reduce(loss, async_op=True)]:
            work.wait()
    out["all-reduce alone"] = 1e3 * (time.perf_counter() - t) / reps
    if eng._sparse:  # the packed all-gather of B * 16 rows per table (and their indices)
        from revgraph.train.distributed.exchange import packed_size

        k = args.batch * ddp_models.TOKENS
        size = packed_size([k] * len(eng._empty_rows),
                           [e.element_size() * int(np.prod(e.shape[1:])) for e in eng._empty_rows])
        buf = torch.zeros(size, dtype=torch.uint8)
        every = [torch.empty_like(buf) for _ in range(eng.comm.world_size)]
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            dist.all_gather(every, buf)
        out["all-gather alone"] = 1e3 * (time.perf_counter() - t) / reps
    return out


def _pool(args, world: int) -> tuple[dict, int, int]:
    """The timed data (``EPOCH`` global batches, visited ``steps / EPOCH`` times), the global batch and the
    number of epochs."""
    group = args.batch * world
    with np.load(args.data) as f:
        pool = {k: f[k][:EPOCH * group] for k in f.files}
    if args.steps % EPOCH or args.warmup > EPOCH or len(pool["labels"]) < EPOCH * group:
        raise SystemExit(f"--steps must be a multiple of {EPOCH}, --warmup at most {EPOCH}, and --data hold "
                         f"{EPOCH * group} samples")
    return pool, group, args.steps // EPOCH


def _ort_profiling() -> None:
    """Make the onnxruntime sessions created from now on record onnxruntime's profile (every run)."""
    import onnxruntime as ort

    class Profiled(ort.SessionOptions):
        def __init__(self):
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = os.path.join(tempfile.gettempdir(), f"rg-ddp-ort-{os.getpid()}")

    ort.SessionOptions = Profiled


def _ort_ops(trainer, top: int = 6) -> dict:
    """For each step session of ``trainer``: its ``top`` operator types by share of the kernel time."""
    eng, out = trainer._engine, {}
    sessions = {"fused step graph": eng._sess} if hasattr(eng, "_sess") else {"grad graph": eng._grad,
                                                                             "update graph": eng._update}
    for what, sess in sessions.items():
        path = sess.end_profiling()
        events = json.loads(Path(path).read_text())
        Path(path).unlink()
        per_op = defaultdict(float)
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                per_op[e["args"]["op_name"]] += e["dur"]
        total = sum(per_op.values()) or 1.0
        out[what] = [[op, us / total] for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]]
    Path(eng._eval.end_profiling()).unlink(missing_ok=True)  # the evaluation session's (empty) profile
    return out


def run_revgraph(args, rank: int, world: int) -> tuple[float, dict]:
    import revgraph as rg

    if args.ort_profile:
        _ort_profiling()
    trainer = rg.Trainer(ddp_models.rg_graph(args.model), "cross-entropy", "adam", threads=1,
                         distributed=args.mode == "ddp", bucket_mb=args.bucket_mb, reduce_dtype=args.reduce_dtype,
                         overlap={"on": True, "off": False, "auto": "auto"}[args.overlap],
                         profile="timeline" if args.timeline else args.shard_profile,
                         **({"shard": args.shard} if args.shard != "none" else {}))
    assert trainer.world_size == world
    pool, group, epochs = _pool(args, world)
    trainer.fit({k: a[:args.warmup * group] for k, a in pool.items()}, batch_size=args.batch, progress=False)
    clock = Clock()
    if args.profile:
        _profile(trainer, clock)
    barrier = trainer.comm.barrier if trainer.comm else (lambda: None)
    barrier()
    t0 = time.perf_counter()
    trainer.fit(pool, epochs=epochs, batch_size=args.batch, progress=False)
    barrier()
    seconds = time.perf_counter() - t0
    assert trainer.steps == args.warmup + args.steps
    phases = {k: v / args.steps for k, v in clock.s.items()}
    phases["Trainer.fit, the whole step"] = seconds / args.steps
    if args.profile and trainer.comm:
        phases.update({k: v / 1e3 for k, v in _collectives_alone(trainer, args).items()})
    if args.shard_profile:  # the engine's own phase timers (revgraph.train.steptimes), medians over the timed steps
        phases.update({f"median {k}": v for k, v in trainer.times.medians(skip=args.warmup).items()})
        rows = trainer.times.steps[args.warmup:]  # and the means, which throughput follows (a slow step counts)
        phases.update({f"mean {k}": sum(r[k] for r in rows) / len(rows) for k in rows[0]})
    if args.ort_profile:
        phases = {"ops": _ort_ops(trainer)}
    if args.timeline:
        phases = {"timeline": {**timeline_summary(trainer, args.warmup), **_cut_cost(trainer, pool, args)}}
    if trainer.comm:
        trainer.comm.close()
    return seconds, phases if args.profile or args.ort_profile or args.timeline or args.shard_profile else {}


def run_paired(args, rank: int, world: int) -> dict:
    """``--rounds R``: one revgraph Trainer per mode of ``--shard`` (a comma list) in this one launch, sharing the
    process group, each warmed up; then ``R`` rounds in which each trains ``--steps`` steps in turn (the order
    reversed every round), timed from a barrier to a barrier. The ratio of two modes within a round is not moved by
    what differs between launches (which cores the processes got, the machine's load that minute)."""
    import revgraph as rg

    modes = args.shard.split(",")
    trainers = {m: rg.Trainer(ddp_models.rg_graph(args.model), "cross-entropy", "adam", threads=1, distributed=True,
                              bucket_mb=args.bucket_mb, **({"shard": m} if m != "none" else {})) for m in modes}
    pool, group, epochs = _pool(args, world)
    for tr in trainers.values():
        tr.fit({k: a[:args.warmup * group] for k, a in pool.items()}, batch_size=args.batch, progress=False)
    barrier = trainers[modes[0]].comm.barrier
    rounds = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            barrier()
            t0 = time.perf_counter()
            trainers[m].fit(pool, epochs=epochs, batch_size=args.batch, progress=False)
            barrier()
            rounds[m].append(time.perf_counter() - t0)
    return rounds


def _hidden(events: list[dict]) -> tuple[float, float]:
    """``(all-reduce seconds, of which hidden)``: the union of the buckets' all-reduce intervals, and its part
    before the backward pass ended (the end of the last segment), when compute ran alongside."""
    spans = sorted((e["start"], e["end"]) for e in events if e["kind"] == "all-reduce" and e["end"] is not None)
    compute_end = max((e["end"] for e in events if e["kind"] == "segment"), default=0.0)
    total = hidden = 0.0
    cur = None
    for a, b in [*spans, (float("inf"), float("inf"))]:
        if cur and a <= cur[1]:
            cur = (cur[0], max(cur[1], b))
            continue
        if cur:
            total += cur[1] - cur[0]
            hidden += max(0.0, min(cur[1], compute_end) - cur[0])
        cur = (a, b)
    return total, hidden


def _cut_cost(trainer, pool: dict, args, reps: int = 30) -> dict:
    """The cost of running the grad graph in segments rather than uncut, with no collective: medians (ms) of
    ``reps`` alternating runs of each on one batch (every rank does the same, at the same time)."""
    import statistics

    eng = trainer._engine
    if getattr(eng, "segments", None) is None:
        return {}
    feeds = trainer._feeds(trainer.arrays({k: a[:args.batch] for k, a in pool.items()}), slice(None))
    whole = eng.session(eng.grad_graph, "gradient graph (uncut, timed)")
    params = {p: eng.value(p) for p in eng.spec.params}

    def uncut():
        b = whole.io_binding()
        for n, a in feeds.items():
            b.bind_cpu_input(n, a)
        for p, v in params.items():
            b.bind_ortvalue_input(p, v)
        for o in eng.grad_graph.output_names:
            b.bind_output(o)
        whole.run_with_iobinding(b)

    def cut():
        eng.segments.run(params, feeds, {}, lambda *a: None)

    def forward():  # the loss graph alone: the forward part of the grad graph's first segment
        eng.evaluate(feeds)

    times = {"uncut": [], "cut": [], "forward": []}
    for _ in range(reps):
        for name, fn in (("uncut", uncut), ("cut", cut), ("forward", forward)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {"grad_uncut_ms": 1e3 * statistics.median(times["uncut"]),
            "grad_cut_ms": 1e3 * statistics.median(times["cut"]),
            "forward_ms": 1e3 * statistics.median(times["forward"])}


def timeline_summary(trainer, warmup: int) -> dict:
    """What bench/ddp.py --profile reports from rank 0's timeline: per-phase medians, per-segment compute and
    per-bucket all-reduce medians (ms), the buckets' bytes, the median all-reduce time and its hidden part, and
    the timeline of the step whose time is the median (seconds from its start)."""
    import statistics

    times, eng = trainer.times, trainer._engine
    steps = list(zip(times.steps[warmup:], times.timelines[warmup:], strict=True))
    med = lambda xs: 1e3 * statistics.median(xs) if xs else None
    names = sorted({(e["kind"], e["name"]) for _, tl in steps for e in tl})
    per = {f"{k}: {n}": med([e["end"] - e["start"] for _, tl in steps for e in tl
                             if (e["kind"], e["name"]) == (k, n) and e["end"] is not None]) for k, n in names}
    hid = [_hidden(tl) for _, tl in steps]
    totals = [sum(ph.values()) for ph, _ in steps]
    mid = sorted(range(len(steps)), key=lambda i: totals[i])[len(steps) // 2] if steps else None
    buckets = [int(b.grads.numel() * b.grads.element_size()) for b in getattr(eng, "buckets", [])]
    return {"phases_ms": {k: 1e3 * v for k, v in times.medians(warmup).items()}, "events_ms": per,
            "bucket_bytes": buckets, "segments": len(eng.segments.segments) if getattr(eng, "segments", None) else 1,
            "ready": [s.buckets for s in eng.segments.segments] if getattr(eng, "segments", None) else None,
            "allreduce_ms": med([h[0] for h in hid]), "hidden_ms": med([h[1] for h in hid]),
            "median_step": steps[mid][1] if steps else []}


def run_torch(args, rank: int, world: int) -> tuple[float, dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model, opts = ddp_models.torch_model(args.model, args.torch_embed)
    if args.mode == "ddp":
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    pool, group, epochs = _pool(args, world)
    key = "tokens" if args.model == "embed" else "x"

    def epoch(d: dict, seed: int) -> None:  # as Trainer.fit visits an epoch
        x, y = torch.from_numpy(d[key]), torch.from_numpy(d["labels"])
        order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
        for start in range(0, len(y), group):
            rows = order[start:start + group][rank::world]
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[rows]), y[rows])
            loss.backward()
            for o in opts:
                o.step()
            loss.item()

    epoch({k: a[:args.warmup * group] for k, a in pool.items()}, 0)
    barrier = dist.barrier if args.mode == "ddp" else (lambda: None)
    barrier()
    t0 = time.perf_counter()
    for e in range(epochs):
        epoch(pool, e)
    barrier()
    seconds = time.perf_counter() - t0
    return seconds, {}  # the process group is left to os._exit (main): tearing DDP down can deadlock on exit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("revgraph", "torch"), required=True)
    parser.add_argument("--model", choices=ddp_models.MODELS, required=True)
    parser.add_argument("--mode", choices=("single", "ddp"), required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--torch-embed", choices=("sparse", "dense"), default="sparse")
    parser.add_argument("--profile", action="store_true", help="time the phases of each step (revgraph)")
    parser.add_argument("--ort-profile", action="store_true", help="onnxruntime's profile of the step graphs: "
                        "the operator types' shares of kernel time (revgraph)")
    parser.add_argument("--timeline", action="store_true", help="(revgraph) record each step's segments and "
                        "all-reduces (Trainer(profile='timeline')) and report them")
    parser.add_argument("--bucket-mb", type=float, default=None, help="(revgraph) Trainer(bucket_mb=), default its "
                        "default (25, and for --shard gradients no more than keeps the unsharded gradient memory)")
    parser.add_argument("--shard", default="none", help="(revgraph, --mode ddp) Trainer(shard=): none, optimizer "
                        "or gradients; with --rounds a comma list of them")
    parser.add_argument("--rounds", type=int, default=0, help="(revgraph, --mode ddp) every mode of --shard in this "
                        "one launch, in R alternating rounds of --steps steps (run_paired); answers seconds per round")
    parser.add_argument("--shard-profile", action="store_true", help="(revgraph) Trainer(profile=True): the "
                        "phases' medians (forward+backward, exchange, update) in the answer's phase_medians_ms")
    parser.add_argument("--overlap", choices=("on", "off", "auto"), default="auto",
                        help="(revgraph) Trainer(overlap=): on, off, or auto (the default: off on the CPU)")
    parser.add_argument("--reduce-dtype", default="fp32", help="(revgraph) Trainer(reduce_dtype=)")
    parser.add_argument("--data", required=True, help="an .npz of ddp_models.data (at least 50 global batches)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.mode == "single" and world != 1:
        parser.error("--mode single runs in one process")
    if args.rounds:
        rounds = run_paired(args, rank, world)
        if rank == 0:
            Path(args.out).write_text(json.dumps({"rounds": rounds, "steps": args.steps, "world": world}))
        sys.stdout.flush()
        os._exit(0)  # (as below)
    run = run_revgraph if args.framework == "revgraph" else run_torch
    seconds, phases = run(args, rank, world)
    if rank == 0:
        samples = args.steps * args.batch * world
        Path(args.out).write_text(json.dumps({
            "samples_per_s": samples / seconds, "seconds": seconds, "steps": args.steps, "samples": samples,
            "world": world, "ops": phases.pop("ops", None), "timeline": phases.pop("timeline", None),
            "phases_ms_per_step": {k: 1e3 * v for k, v in phases.items()}}))
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit now: in torch 2.13 the destructor of a DistributedDataParallel's Reducer can deadlock at interpreter
    # exit (ProcessGroupGloo joins a thread that waits for the GIL), and nothing is left to clean up.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
