"""Peak memory and time of forward plus backward through an ONNX Loop, per residual policy, side by side.

An RNN-like body, h_t = tanh(h_{t-1} W + x_t U + b) with hidden size 256 (batch 8, input size 32), runs
T = 100, 1,000 and 10,000 steps; the loss is sum(h_T). For each checkpoint policy revgraph builds the
gradient graph (gradients for W, U, b and h0) and onnxruntime runs it, each configuration in a fresh process
with onnxruntime's memory arena off; the peak resident set size during the first run, minus the resident size
just before it (Linux's VmHWM, reset through /proc/self/clear_refs), measures what forward and backward hold. Times are
medians of 3 runs after one warm-up run.

Two more modes run next to the policies: ``jvp``, revgraph's forward-mode graph ``rg.jvp(g, "loss", [W, U, b,
h0])`` (the loss and its tangent along random tangents of the same four values; a Loop that carries the tangent
of ``h`` next to ``h`` and stores no residuals), and ``forward``, the model alone: the JVP's peak should stay
near the forward's at every T while ``store``'s grows with T. ``jvp+xs`` (not run by default) also gives the
input sequence ``xs`` a tangent.

    python bench/loop_memory.py [--steps 100 1000 10000] [--policies store recompute sqrt 100 jvp forward]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

import numpy as np

HIDDEN, BATCH, INPUT = 256, 8, 32
#: Modes measured next to the checkpoint policies: the forward graph alone and forward-mode JVP graphs.
FORWARD_MODES = ("forward", "jvp", "jvp+xs")


def rnn_graph(steps: int):
    from revgraph.ir import Graph, Node, ValueInfo

    f32 = np.dtype(np.float32)
    body = Graph(
        [
            Node("Gather", ["xs", "i"], ["x_t"], {"axis": 0}, "x_t"),
            Node("MatMul", ["h_in", "W"], ["hw"], name="hw"),
            Node("MatMul", ["x_t", "U"], ["xu"], name="xu"),
            Node("Add", ["hw", "xu"], ["pre0"], name="pre0"),
            Node("Add", ["pre0", "b"], ["pre"], name="pre"),
            Node("Tanh", ["pre"], ["h_out"], name="tanh"),
            Node("Identity", ["cond_in"], ["cond_out"], name="cond"),
        ],
        [ValueInfo("i", np.int64, ()), ValueInfo("cond_in", np.bool_, ()), ValueInfo("h_in", f32, (BATCH, HIDDEN))],
        [ValueInfo("cond_out", np.bool_, ()), ValueInfo("h_out", f32, (BATCH, HIDDEN))],
        name="rnn_body",
    )
    rng = np.random.default_rng(0)
    inits = {
        "W": (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32),
        "U": (rng.standard_normal((INPUT, HIDDEN)) / np.sqrt(INPUT)).astype(np.float32),
        "b": np.zeros(HIDDEN, np.float32),
        "M": np.array(steps, np.int64),
        "true": np.array(True),
    }
    return Graph(
        [Node("Loop", ["M", "true", "h0"], ["h"], {"body": body}, "rnn"),
         Node("ReduceSum", ["h"], ["loss"], {"keepdims": 0}, "loss")],
        [ValueInfo("xs", f32, (steps, BATCH, INPUT)), ValueInfo("h0", f32, (BATCH, HIDDEN))],
        [ValueInfo("loss", f32, ())],
        inits,
    )


def _measure(steps: int, policy: str, queue) -> None:
    import onnxruntime as ort

    import revgraph as rg

    t0 = time.perf_counter()
    tangents = []
    if policy in FORWARD_MODES:  # the forward graph alone, or its JVP
        tangents = {"forward": [], "jvp": ["W", "U", "b", "h0"], "jvp+xs": ["W", "U", "b", "h0", "xs"]}[policy]
        gg = rg.jvp(rnn_graph(steps), "loss", tangents) if tangents else rnn_graph(steps)
    else:
        gg = rg.gradient(rnn_graph(steps), wrt=["W", "U", "b", "h0"], checkpoint=policy)
    build = time.perf_counter() - t0
    opts = ort.SessionOptions()
    opts.enable_cpu_mem_arena = False
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    sess = ort.InferenceSession(rg.to_onnx(gg).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {"xs": rng.standard_normal((steps, BATCH, INPUT)).astype(np.float32),
             "h0": rng.standard_normal((BATCH, HIDDEN)).astype(np.float32) * 0.1}
    types = {i.name: i for i in gg.inputs}
    for name in tangents:
        shape = types[f"{name}_tangent"].shape
        feeds[f"{name}_tangent"] = rng.standard_normal(shape).astype(np.float32)
    before = _reset_peak_rss()
    sess.run(None, feeds)
    peak = _peak_rss()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    checksum = float(sum(np.abs(o).sum() for o in out[1:]))
    queue.put({"peak_mb": (peak - before) / 1024, "time_s": statistics.median(times), "build_s": build,
               "checksum": checksum})


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS and return that RSS in kB (Linux; elsewhere
    fall back to getrusage's lifetime maximum, which can hide a run's peak behind an earlier one)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmRSS")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_rss() -> int:
    try:
        return _status("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure(steps: int, policy: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(steps, policy, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--policies", nargs="+", default=["store", "recompute", "sqrt", "100", "jvp", "forward"],
                        help="checkpoint policies of the gradient graph (store, recompute, sqrt, a segment "
                             "length), and the modes forward, jvp and jvp+xs (module doc)")
    args = parser.parse_args(argv)
    console = Console()
    table = Table(title=f"Loop VJP, RNN body (hidden {HIDDEN}, batch {BATCH}), onnxruntime {_ort_version()}, "
                        f"{os.cpu_count()} cores", title_justify="left")
    base_name = args.policies[0]
    for col in ("T", "policy", "peak MB", "fwd+bwd s (median)", f"vs {base_name}: memory", f"vs {base_name}: time"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for steps in args.steps:
        results = {policy: measure(steps, policy) for policy in args.policies}
        base = results[args.policies[0]]
        sums = [r["checksum"] for p, r in results.items() if p not in FORWARD_MODES]
        if sums and max(sums) - min(sums) > 1e-3 * max(abs(x) for x in sums):
            console.print(f"[red]policies disagree at T={steps}: {sums}[/red]")
        for policy, r in results.items():
            table.add_row(f"{steps:,}", policy, f"{r['peak_mb']:.1f}", f"{r['time_s']:.3f}",
                          f"{r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f}x", f"{r['time_s'] / base['time_s']:.2f}x")
        table.add_section()
    console.print(table)
    if any(p in FORWARD_MODES for p in args.policies):
        console.print("forward: the model alone; jvp: forward plus tangent (rg.jvp of the loss along tangents of W, U, "
                      "b, h0; jvp+xs: and xs), no backward pass; the time column is then forward (plus tangent).")
    return 0


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    sys.exit(main())
