"""gloo's collectives at the sizes of ZeRO-2's units: all-reduce, reduce-scatter (into another tensor and in place),
all-gather, the float64 tail, and the pairwise forms ZeRO-1/2 use on the CPU (revgraph.train.distributed.swap: with
one peer one ``all_to_all_single`` swapping a chunk each way; with more, ``isend``/``irecv`` per peer), medians (ms)
and means of 50 calls after a barrier each, in 2 processes of one thread.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 bench/gloo_collectives.py

Why ``--shard optimizer|gradients`` exchange pairwise on the CPU: gloo's reduce-scatter takes as long as its
all-reduce of the whole tensor, and a swap of half the tensor each way (what a reduce-scatter or an all-gather moves
at 2 processes) takes about half of that (docs/benchmarks.md).
"""

import os
import statistics
import time

import torch
import torch.distributed as dist


def one_size(n: int, r: int, w: int) -> dict[str, float]:
    """Median ms of each collective on ``n`` float32 elements (padded to a multiple of ``w``)."""
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (torch 2.13's names)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    n = -(-n // w) * w
    x, s, tail = torch.ones(n), torch.zeros(n // w), torch.zeros(1, dtype=torch.float64)
    k, peer = n // w, (r + 1) % w
    sizes = [k if j == peer else 0 for j in range(w)]
    into = torch.zeros(k)

    def isend_irecv():
        for work in (dist.isend(x[peer * k:(peer + 1) * k], peer), dist.irecv(into, (r - 1) % w)):
            work.wait()

    calls = {"all-reduce": lambda: dist.all_reduce(x), "reduce-scatter": lambda: rs(s, x),
             "reduce-scatter in place": lambda: rs(x[r * (n // w):(r + 1) * (n // w)], x),
             "all-gather": lambda: ag(x, s), "all-reduce of the float64 tail": lambda: dist.all_reduce(tail),
             "swap (isend/irecv)": isend_irecv}
    if w == 2:  # (one peer: the exchange revgraph.train.distributed.swap makes)
        calls["swap (all_to_all_single)"] = lambda: dist.all_to_all_single(into, x[peer * k:(peer + 1) * k], sizes,
                                                                            sizes)
    res = {}
    for name, f in calls.items():
        ts = []
        for _ in range(60):
            dist.barrier()
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        res[name] = f"{1e3 * statistics.median(ts[10:]):.3f} (mean {1e3 * statistics.mean(ts[10:]):.3f})"
    return res


def main() -> None:
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    for n in (4810, 100_000, 1_126_922):  # the bench MLP's, a middle size, the wide MLP's parameters
        res = one_size(n, r, w)
        if r == 0:
            print(f"{4 * n} bytes: {res} (load {os.getloadavg()[0]:.1f})", flush=True)
    os._exit(0)  # (tearing the group down can hang at exit in torch 2.13, as bench/ddp_worker.py notes)


if __name__ == "__main__":
    main()
