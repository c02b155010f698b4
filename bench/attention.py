"""The Attention VJP against PyTorch's SDPA backward, CPU, one thread, float32.

revgraph: the gradient graph of one ONNX ``Attention`` node (opset 23, 4-D inputs), written with
``seed="input"`` (inputs Q, K, V and the output cotangent; outputs Y and the three gradients), run by
onnxruntime with its default optimizations. PyTorch: ``F.scaled_dot_product_attention`` (``enable_gqa``)
and ``torch.autograd.grad`` of Y with the same cotangent, eager. Both compute the forward and the backward.
The forward alone (onnxruntime's Attention kernel, SDPA under ``no_grad``) is timed too, to show which part
of the ratio is the forward kernel's.

Sizes: batch 4, 8 query heads, head size 64, sequence 128 and 512, MHA (8 key/value heads) and GQA (2),
causal and not. Each turn times one side for ``--seconds`` (mean of its runs); turns alternate between the
sides, and the table reports the median of ``--turns`` turns. Writes ``bench/results/attention.json`` and a
markdown table to stdout. Not part of the tests: ``python bench/attention.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "attention.json"


def _mean_time(run, seconds: float) -> float:
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or n < 2:
        run()
        n += 1
    return (time.perf_counter() - t0) / n


def _graph(b: int, hq: int, hkv: int, seq: int, d: int, causal: bool):
    import revgraph as rg
    from revgraph.ir import Graph, Node, ValueInfo

    f32 = np.dtype(np.float32)
    g = Graph([Node("Attention", ["q", "k", "v"], ["y"], {"is_causal": int(causal)}, "attn")],
              [ValueInfo("q", f32, (b, hq, seq, d)), ValueInfo("k", f32, (b, hkv, seq, d)),
               ValueInfo("v", f32, (b, hkv, seq, d))],
              [ValueInfo("y", f32, (b, hq, seq, d))], opsets={"": 23})
    return g, rg.gradient(g, loss="y", wrt=["q", "k", "v"], seed="input")


def _session(graph):
    import onnxruntime as ort

    import revgraph as rg

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    return ort.InferenceSession(rg.to_onnx(graph).SerializeToString(), opts, providers=["CPUExecutionProvider"])


def case(b: int, hq: int, hkv: int, seq: int, d: int, causal: bool, turns: int, seconds: float) -> dict:
    import torch

    F = torch.nn.functional
    fwd, vjp = _graph(b, hq, hkv, seq, d, causal)
    s_vjp, s_fwd = _session(vjp), _session(fwd)
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((b, hq, seq, d), dtype=np.float32),
             "k": rng.standard_normal((b, hkv, seq, d), dtype=np.float32),
             "v": rng.standard_normal((b, hkv, seq, d), dtype=np.float32),
             "y_grad": rng.standard_normal((b, hq, seq, d), dtype=np.float32)}
    names = [o.name for o in s_vjp.get_outputs()]
    q, k, v = (torch.from_numpy(feeds[n]).requires_grad_() for n in "qkv")
    dy = torch.from_numpy(feeds["y_grad"])

    def torch_vjp():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return y, *torch.autograd.grad(y, (q, k, v), dy)

    def torch_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    fwd_feeds = {n: feeds[n] for n in "qkv"}
    runners = {"revgraph": lambda: s_vjp.run(None, feeds), "torch": torch_vjp,
               "revgraph_forward": lambda: s_fwd.run(None, fwd_feeds), "torch_forward": torch_fwd}
    got = dict(zip(names, runners["revgraph"](), strict=True))
    want = dict(zip(["y", "q_grad", "k_grad", "v_grad"], (t.detach().numpy() for t in torch_vjp()), strict=True))
    err = {n: float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want}
    for run in runners.values():  # warm up
        run()
    times: dict[str, list[float]] = {n: [] for n in runners}
    for _ in range(turns):
        for name, run in runners.items():
            times[name].append(_mean_time(run, seconds))
    med = {n: float(np.median(t)) for n, t in times.items()}
    return {"batch": b, "q_heads": hq, "kv_heads": hkv, "seq": seq, "head_size": d, "causal": causal,
            "seconds": med, "turns": {n: [float(x) for x in t] for n, t in times.items()},
            "ratio": med["revgraph"] / med["torch"], "ratio_forward": med["revgraph_forward"] / med["torch_forward"],
            "max_rel_diff": err,
            "vjp_nodes": sorted({n.op_type for n in vjp.nodes})}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=7)
    p.add_argument("--seconds", type=float, default=0.4, help="time per turn and side")
    p.add_argument("--seq", type=int, nargs="*", default=[128, 512])
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    import onnxruntime as ort
    import torch

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    for seq in args.seq:
        for hkv in (8, 2):
            for causal in (False, True):
                rows.append(case(4, 8, hkv, seq, 64, causal, args.turns, args.seconds))
    out = {"what": "Attention VJP (forward + backward), revgraph on onnxruntime vs PyTorch SDPA eager; CPU, 1 thread, "
                   "float32; medians of alternating turns",
           "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                       "onnxruntime": ort.__version__, "torch": torch.__version__,
                       "load_average_before_after": [load_before[0], os.getloadavg()[0]]},
           "turns": args.turns, "seconds_per_turn": args.seconds, "cases": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print("| seq | heads q/kv | causal | revgraph fwd+bwd ms | torch fwd+bwd ms | ratio | fwd ratio | max rel diff |")
    print("|---:|---:|:---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["seconds"]
        print(f"| {r['seq']} | {r['q_heads']}/{r['kv_heads']} | {'yes' if r['causal'] else 'no'} | "
              f"{1e3 * s['revgraph']:.1f} | {1e3 * s['torch']:.1f} | {r['ratio']:.2f} | {r['ratio_forward']:.2f} | "
              f"{max(r['max_rel_diff'].values()):.1e} |")
    return out


if __name__ == "__main__":
    main()
