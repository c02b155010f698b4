"""Gradient-graph build time against graph size: the chains and fan-out graphs of bench/models.py.

    python bench/build_time.py [--sizes 1000 10000 100000] [--repeat 3] [--kinds chain fan] [--profile 25]

Times what section 1 of docs/benchmarks.md times, from the parsed ``onnx.ModelProto`` to the gradient
``ModelProto``: ``rg.load``, ``rg.gradient`` (with respect to ``w``; the loss is the model's ``ReduceSum``
output) and ``rg.to_onnx``, each in process CPU time (less sensitive to other processes than wall time), and
prints the medians per size and the time per forward node, which stays about constant when building is linear
in the size. ``--profile N`` prints the N functions with the most own time (cProfile) of one more build of each
graph.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import chain_model, fan_out_model

PHASES = ("load", "gradient", "to_onnx")


def build(proto) -> dict[str, float]:
    """One build of ``proto``'s gradient graph: CPU seconds of each phase, and the gradient graph's node count."""
    import revgraph as rg

    t0 = time.process_time()
    g = rg.load(proto)
    t1 = time.process_time()
    gg = rg.gradient(g, g.output_names[0], ["w"])
    t2 = time.process_time()
    model = rg.to_onnx(gg)
    t3 = time.process_time()
    return {"load": t1 - t0, "gradient": t2 - t1, "to_onnx": t3 - t2, "nodes": len(model.graph.node)}


def profile(proto, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    build(proto)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--repeat", type=int, default=3, help="builds per graph below 100k nodes (one at 100k)")
    parser.add_argument("--kinds", nargs="+", default=["chain", "fan"], choices=["chain", "fan"])
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the top N functions by own time")
    args = parser.parse_args(argv)
    console = Console()
    table = Table(title="revgraph build time (process CPU time, medians)", title_justify="left")
    for col in ("graph", "nodes", "ms", "load / gradient / to_onnx (ms)", "µs per node", "gradient graph nodes"):
        table.add_column(col, justify="left" if col == "graph" else "right")
    for kind in args.kinds:
        make = {"chain": chain_model, "fan": fan_out_model}[kind]
        for n in args.sizes:
            proto = make(n)
            runs = [build(copy.deepcopy(proto)) for _ in range(args.repeat if n < 100_000 else 1)]
            med = {k: statistics.median(r[k] for r in runs) for k in PHASES}
            total = statistics.median(sum(r[k] for k in PHASES) for r in runs)
            phases = " / ".join(f"{1e3 * med[k]:.1f}" for k in PHASES)
            table.add_row(kind, f"{n:,}", f"{1e3 * total:.1f}", phases, f"{1e6 * total / n:.0f}",
                          f"{runs[0]['nodes']:,}")
            if args.profile:
                console.print(f"[bold]{kind} {n:,}[/bold]\n" + profile(copy.deepcopy(proto), args.profile))
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
