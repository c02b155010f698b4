"""Node counts of gradient graphs: the guard that a change to the rules (their algebra, their facts) does not
make the backward graphs of the bench models and of every operator's node tests larger.

``python -m kit.node_counts`` (from ``tests/``) writes ``tests/data/gradient_node_counts.json`` from the rules
as they are; :mod:`test_gradient_node_counts` compares each count against it (equal or smaller passes). Write
the file again only when a change makes a graph smaller on purpose, or adds an operator, and say so in the
commit. Besides the node counts (``bench/<model>``, ``node/<test>``) it holds the guard nodes (``Equal``,
``Or``, ``Where``, ``IsInf``, ``IsNaN`` the backward pass emitted, issue 39) of each bench model
(``guards/bench/<model>``) and of all node tests together (``guards/node``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import revgraph as rg

COUNTS = Path(__file__).resolve().parent.parent / "data" / "gradient_node_counts.json"
#: the bench's step models (bench/models.py) at a small batch, differentiated with respect to their parameters
BENCH_MODELS = ("mlp", "cnn", "transformer", "rnn")


GUARDS = ("Equal", "Or", "Where", "IsInf", "IsNaN")


def guard_count(graph: rg.Graph) -> int:
    """The guard nodes among ``graph``'s backward nodes (named ``grad/...``), subgraphs included."""
    return sum(1 for _, n in graph.walk() if n.op_type in GUARDS and n.name.startswith("grad/"))


def node_count(graph: rg.Graph) -> int:
    """Every node of ``graph`` and of its subgraphs (Loop bodies, If branches), walked iteratively."""
    total, stack = 0, [graph]
    while stack:
        g = stack.pop()
        total += len(g.nodes)
        for n in g.nodes:
            stack.extend(n.subgraphs.values())
    return total


def bench_counts(out_dir: str) -> dict[str, int]:
    """The gradient graph's node count of each bench step model (``bench/models.py``, batch 2)."""
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "bench"))
    try:
        import models  # bench/models.py
    finally:
        sys.path.remove(str(root / "bench"))
    counts = {}
    for name in BENCH_MODELS:
        info = models.write_step_model(name, 2, out_dir)
        g = rg.load(info["path"])
        out = g.outputs[0].name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gg = rg.gradient(g, out, [p for p in info["params"] if p in g.initializers])
        counts[f"bench/{name}"] = node_count(gg)
        counts[f"guards/bench/{name}"] = guard_count(gg)
    return counts


def case_counts() -> dict[str, int]:
    """The gradient graph's node count of each ONNX node test that the node-test suite checks (its graph,
    losses and wrt values as :func:`kit.node_cases.prepare` makes them; cases it skips are left out)."""
    from kit.node_cases import CASES, Skip, prepare

    counts = {"guards/node": 0}
    for name in CASES:
        try:
            prep = prepare(CASES[name])
        except Skip:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                gg = rg.gradient(prep.graph, prep.losses[0], prep.wrt)
            except rg.RevgraphError:
                continue
        counts[f"node/{name}"] = node_count(gg)
        counts["guards/node"] += guard_count(gg)
    return counts


def all_counts() -> dict[str, int]:
    with tempfile.TemporaryDirectory() as d:
        return {**bench_counts(d), **case_counts()}


if __name__ == "__main__":
    COUNTS.parent.mkdir(exist_ok=True)
    COUNTS.write_text(json.dumps(all_counts(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {COUNTS}")
