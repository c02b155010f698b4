"""The modelled scaling of data-parallel training to 8 and 64 GPUs (bench/ddp.py ``--profile``; issue 25): the
step time of a 100M-parameter fp32 model with and without overlapping the gradient exchange with the backward
pass, from a stated network model and the per-bucket backward compute measured by the bench.

The model (every input is in :data:`INPUTS` and printed with the results):

- **The model**: ``P`` = 100M fp32 parameters (400 MB of gradients), forward ``F`` = 50 ms and backward ``B`` =
  100 ms on one GPU (the issue's 100 ms backward; the forward at half of it, the usual 1:2 ratio of their
  FLOPs); the update is left out (it is the same on 1 and on W GPUs).
- **Buckets** as DDP and revgraph pack them: reverse parameter order, the first of 1 MiB, then 25 MiB each.
- **When a bucket is ready**: bucket ``j`` is ready when the backward has produced its gradients, at ``F + B *
  c_j``, ``c_j`` the share of the backward's compute done by then. ``uniform``: the compute is proportional to
  the bytes of parameters (dense layers: 2 FLOPs per parameter and sample, each way). ``measured``: the shape of
  the measured curve, the share of compute done by each segment of revgraph's grad graph against the share of
  bytes of the buckets it completed (bench/ddp.py runs the Transformer with small buckets for it), with the first
  segment's forward part taken out (the loss graph's time measured alone; without it ``F / (F + B)`` of the
  segments' time).
- **Network**: ring all-reduce of ``n`` bytes among ``W`` GPUs takes ``2 (W - 1) / W * n / BW + 2 (W - 1) *
  alpha`` (``2 (W - 1)`` steps of a reduce-scatter and an all-gather around the ring, each paying the latency
  ``alpha``), ``BW`` = 100 Gbit/s per GPU, ``alpha`` = 10 us; one collective at a time (NCCL runs a process
  group's collectives in order on one stream).
- **Without overlap** (revgraph before issue 25): every bucket is all-reduced after the backward: step =
  ``F + B + sum_j T(b_j)``. **With overlap** (DDP; revgraph with ``--overlap on``): bucket ``j`` starts at
  ``max(ready_j, end_{j-1})``: step = ``max(F + B, end_last)``. revgraph's segments cost ``k`` times the uncut
  grad graph, forward and backward (the cost of cutting: lost fusions and one session run per segment), ``k``
  measured by the bench on the CPU (the Transformer's segments against its uncut grad graph, no collectives);
  the last column of the table only.
- **Scaling efficiency** = the one-GPU step time over the W-GPU step time (throughput per GPU, relative). DDP
  corresponds to the overlapped columns without cutting cost (it overlaps inside autograd's one backward).
- **ZeRO-3** (``--shard parameters``, FSDP; issue 43, :func:`zero3_step_ms`): the units are the buckets in forward
  order; each is all-gathered before the forward computes it and again before the backward does (but the last,
  whose backward follows its forward at once), and its gradient reduce-scattered after its backward: per step 2
  all-gathers of about P and 1 reduce-scatter of G, each ``(W - 1) / W * n / BW + (W - 1) * alpha`` (half a ring
  all-reduce), against DDP's one all-reduce of G. The schedule of revgraph's param_schedule: the gather of the
  next unit is issued when a unit starts computing (prefetch one ahead: two gather buffers), a reduce-scatter
  when its unit's backward ends, all on one stream in the order issued; a unit computes once its gather is done
  and the previous unit's compute has ended; compute is uniform in bytes. The step ends with the last
  reduce-scatter.
"""

from __future__ import annotations

import itertools

INPUTS = {"params": 100e6, "bytes_per_param": 4, "forward_ms": 50.0, "backward_ms": 100.0,
          "first_bucket_bytes": 2**20, "bucket_bytes": 25 * 2**20, "bandwidth_gbit": 100.0, "alpha_us": 10.0,
          "worlds": [8, 64]}


def buckets(total: float, first: float, cap: float) -> list[float]:
    out, left = [], total
    while left > 0:
        b = min(left, first if not out else cap)
        out.append(b)
        left -= b
    return out


def allreduce_ms(nbytes: float, world: int, inputs: dict) -> float:
    bw = inputs["bandwidth_gbit"] * 1e9 / 8  # bytes per second
    return 1e3 * (2 * (world - 1) / world * nbytes / bw) + 2 * (world - 1) * inputs["alpha_us"] / 1e3


def compute_curve(measured: dict | None) -> list[tuple[float, float]] | None:
    """``[(share of bytes, share of backward compute)]`` from a bench timeline (``bucket_bytes`` and
    ``events_ms`` of ``segment: segment k`` with the buckets each completed), or ``None``."""
    if not measured or measured.get("segments", 1) < 2:
        return None
    seg = [measured["events_ms"].get(f"segment: segment {k}") for k in range(measured["segments"])]
    ready = measured.get("ready")  # the buckets each segment completed
    if any(s is None for s in seg) or not ready:
        return None
    total_bytes = sum(measured["bucket_bytes"])
    grad_ms = sum(seg)
    # the forward inside the first segment: measured alone (the loss graph), else the model's 1:2 ratio
    fwd = measured.get("forward_ms") or grad_ms * INPUTS["forward_ms"] / (INPUTS["forward_ms"] + INPUTS["backward_ms"])
    back = [max(seg[0] - fwd, 0.0), *seg[1:]]
    done_b = done_c = 0.0
    curve = [(0.0, 0.0)]
    for k, js in enumerate(ready):
        done_c += back[k]
        done_b += sum(measured["bucket_bytes"][j] for j in js)
        curve.append((done_b / total_bytes, done_c / max(sum(back), 1e-12)))
    return curve


def _interp(curve: list[tuple[float, float]], x: float) -> float:
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-12)
    return curve[-1][1]


def step_ms(world: int, overlap: bool, inputs: dict, curve=None, cost: float = 1.0) -> float:
    total = inputs["params"] * inputs["bytes_per_param"]
    sizes = buckets(total, inputs["first_bucket_bytes"], inputs["bucket_bytes"])
    k = cost if overlap else 1.0  # the segments' cost applies to the whole grad graph, forward included
    F, B = inputs["forward_ms"] * k, inputs["backward_ms"] * k
    if not overlap:
        return F + B + sum(allreduce_ms(b, world, inputs) for b in sizes)
    end, done = 0.0, 0.0
    for b in sizes:
        done += b
        share = _interp(curve, done / total) if curve else done / total
        end = max(F + B * share, end) + allreduce_ms(b, world, inputs)
    return max(F + B, end)


def zero3_step_ms(world: int, inputs: dict) -> float:
    """The modelled ZeRO-3 step (module doc): the forward's all-gathers prefetched one unit ahead, the backward's
    all-gathers and reduce-scatters on the same stream, the compute uniform in bytes."""
    total = inputs["params"] * inputs["bytes_per_param"]
    units = buckets(total, inputs["first_bucket_bytes"], inputs["bucket_bytes"])[::-1]  # (forward order)
    half = lambda n: allreduce_ms(n, world, inputs) / 2  # an all-gather or a reduce-scatter
    order = [("forward", j) for j in range(len(units))] + [("backward", j) for j in reversed(range(len(units)))]
    net = compute = 0.0  # when the stream and the compute are next free
    ready = {}  # (pass, unit) -> when its gather ends
    gathered = lambda k: k == 0 or order[k] != ("backward", len(units) - 1)  # (the last: kept)

    def gather(k: int, at: float) -> None:
        nonlocal net
        if k < len(order) and gathered(k):
            net = max(net, at) + half(units[order[k][1]])
            ready[k] = net

    gather(0, 0.0)
    for k, (phase, j) in enumerate(order):
        start = max(compute, ready.get(k, 0.0))
        gather(k + 1, start)  # the next unit's, while this one computes
        ms = inputs["forward_ms" if phase == "forward" else "backward_ms"] * units[j] / total
        compute = start + ms
        if phase == "backward":
            net = max(net, compute) + half(units[j])  # its reduce-scatter
    return max(compute, net)


def model(measured: dict | None = None, cost: float | None = None, inputs: dict | None = None) -> dict:
    """The modelled step times (ms) and scaling efficiencies at each world size: without overlap; with overlap
    and the uniform curve; with the ``measured`` curve (a bench timeline); and with the measured curve and
    revgraph's measured cost ``cost`` of cutting the grad graph (the segments over the uncut graph)."""
    inputs = {**INPUTS, **(inputs or {})}
    curve = compute_curve(measured)
    one = inputs["forward_ms"] + inputs["backward_ms"]
    sizes = buckets(inputs["params"] * inputs["bytes_per_param"], inputs["first_bucket_bytes"], inputs["bucket_bytes"])
    out = {"inputs": inputs, "buckets": len(sizes), "one_gpu_ms": one, "cost": cost, "curve": curve, "rows": []}
    for w in inputs["worlds"]:
        row = {"world": w, "no_overlap_ms": step_ms(w, False, inputs), "overlap_uniform_ms": step_ms(w, True, inputs)}
        if curve:
            row["overlap_measured_ms"] = step_ms(w, True, inputs, curve)
            if cost:
                row["overlap_measured_cost_ms"] = step_ms(w, True, inputs, curve, cost)
        row["zero3_ms"] = zero3_step_ms(w, inputs)
        if cost:  # revgraph's segments (ZeRO-3 always runs cut) at the measured cost of cutting
            row["zero3_cost_ms"] = zero3_step_ms(w, {**inputs, "forward_ms": inputs["forward_ms"] * cost,
                                                     "backward_ms": inputs["backward_ms"] * cost})
        for k in [k for k in row if k.endswith("_ms")]:
            row[k[:-3] + "_eff"] = one / row[k]
        out["rows"].append(row)
    return out


COLUMNS = [("no_overlap", "no overlap"), ("overlap_uniform", "overlap, uniform curve"),
           ("overlap_measured", "overlap, measured curve"),
           ("overlap_measured_cost", "overlap, measured curve and cutting cost")]


def render(res: dict) -> list[str]:
    """Markdown lines: the inputs, then a table of step times and efficiencies."""
    i = res["inputs"]
    cols = [(k, h) for k, h in COLUMNS if all(f"{k}_ms" in r for r in res["rows"])]
    cost = f"{res['cost']:.2f}x" if res.get("cost") else "not measured"
    lines = [(f"Model (bench/ddp_scaling.py): {i['params'] / 1e6:.0f}M fp32 parameters, forward {i['forward_ms']:g} "
              f"ms, backward {i['backward_ms']:g} ms on one GPU; {res['buckets']} buckets (first "
              f"{i['first_bucket_bytes'] / 2**20:g} MiB, then {i['bucket_bytes'] / 2**20:g} MiB); ring all-reduce "
              f"2(W-1)/W x bytes / {i['bandwidth_gbit']:g} Gbit/s + 2(W-1) x {i['alpha_us']:g} us, one collective at a "
              f"time. revgraph's cost of cutting the grad graph into segments, measured on this CPU (the Transformer "
              f"with 0.05 MiB buckets, its segments against its uncut grad graph): {cost}; it multiplies the whole "
              "forward+backward in the last column (pessimistic for a GPU, where a segment boundary costs a kernel "
              "launch and a session run, not a share of the compute). Step times in ms, efficiency = one GPU's step / "
              "W GPUs' step."),
             "", "| GPUs | " + " | ".join(f"{h} | efficiency" for _, h in cols) + " |",
             "|---:|" + "---:|---:|" * len(cols)]
    for r in res["rows"]:
        cells = [str(r["world"])] + [x for k, _ in cols for x in (f"{r[k + '_ms']:.1f}", f"{r[k + '_eff']:.0%}")]
        lines.append("| " + " | ".join(cells) + " |")
    if all("zero3_ms" in r for r in res["rows"]):
        lines += ["", ("ZeRO-3 (`--shard parameters`, as FSDP; issue 43) on the same model and network: 2 "
                       "all-gathers of the parameters and 1 reduce-scatter of the gradients per step, unit by "
                       "unit (the buckets), the next unit's gather issued as a unit starts computing, the "
                       "reduce-scatters after each unit's backward, one collective at a time, uniform compute, no "
                       "cutting cost (module doc): "
                       + "; ".join(f"{r['world']} GPUs {r['zero3_ms']:.1f} ms, efficiency {r['zero3_eff']:.0%} "
                                   f"(DDP overlapped: {r['overlap_uniform_eff']:.0%})" for r in res["rows"]) + "."
                       + ("" if not res.get("cost") else " With revgraph's measured cutting cost "
                          f"({res['cost']:.2f}x the forward and backward): " + "; ".join(
                              f"{r['world']} GPUs {r['zero3_cost_eff']:.0%}" for r in res["rows"]) + "."))]
    if res["curve"]:
        pts = ", ".join(f"({x:.2f}, {y:.2f})" for x, y in res["curve"])
        lines += ["", f"Measured curve (share of gradient bytes ready, share of backward compute done): {pts}."]
    return lines


if __name__ == "__main__":
    import json

    print(json.dumps(model(), indent=1))
