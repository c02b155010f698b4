"""Gradient-graph build time against graph size: chains and fan-out graphs of 1k, 10k and 100k nodes.

    python bench/build_time.py [--sizes 1000 10000 100000] [--repeat 3]

Prints the median build time (revgraph.gradient) per size and the time per node, which stays about
constant when building is linear in the size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def chain(n: int):
    from revgraph.ir import Graph, Node, ValueInfo

    nodes, prev = [], "x"
    for i in range(n):
        nodes.append(Node("Sin" if i % 2 else "Tanh", [prev], [f"v{i}"], name=f"n{i}"))
        prev = f"v{i}"
    return Graph(nodes, [ValueInfo("x", np.float32, (16,))], [ValueInfo(prev, np.float32, (16,))])


def fan_out(n: int):
    from revgraph.ir import Graph, Node, ValueInfo

    nodes = [Node("Sin" if i % 2 else "Tanh", ["x"], [f"v{i}"], name=f"n{i}") for i in range(n - 1)]
    nodes.append(Node("Sum", [f"v{i}" for i in range(n - 1)], ["y"], name="sum"))
    return Graph(nodes, [ValueInfo("x", np.float32, (16,))], [ValueInfo("y", np.float32, (16,))])


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    import revgraph as rg

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    table = Table(title="revgraph.gradient build time (median)", title_justify="left")
    for col in ("graph", "nodes", "seconds", "µs per node", "backward nodes"):
        table.add_column(col, justify="left" if col == "graph" else "right")
    for make in (chain, fan_out):
        for n in args.sizes:
            g = make(n)
            times, size = [], 0
            for _ in range(args.repeat if n < 100_000 else 1):
                t0 = time.perf_counter()
                gg = rg.gradient(g)
                times.append(time.perf_counter() - t0)
                size = len(gg.nodes) - len(g.nodes)
            med = statistics.median(times)
            table.add_row(make.__name__, f"{n:,}", f"{med:.2f}", f"{1e6 * med / n:.0f}", f"{size:,}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
