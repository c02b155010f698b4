"""The node-count guard: the gradient graphs of the bench's step models and of every ONNX node test revgraph
checks are no larger than when ``tests/data/gradient_node_counts.json`` was written (:mod:`kit.node_counts`
says when to write it again). Rewriting rules (their algebra, where their facts live) must not cost nodes: a
strong-zero ``Where`` lost from a table shows here as a larger count."""

from __future__ import annotations

import json

from kit.node_counts import COUNTS, bench_counts, case_counts

RECORDED: dict[str, int] = json.loads(COUNTS.read_text())


def _compare(now: dict[str, int], prefix: str) -> None:
    recorded = {k: v for k, v in RECORDED.items() if k.startswith(prefix)}
    grown = {k: (recorded[k], v) for k, v in now.items() if k in recorded and v > recorded[k]}
    assert not grown, "gradient graphs grew (recorded -> now): " + ", ".join(
        f"{k} {a} -> {b}" for k, (a, b) in sorted(grown.items()))
    lost = sorted(set(recorded) - set(now))
    assert not lost, f"no longer differentiated: {lost}"


def test_node_tests_gradient_graphs_do_not_grow():
    now = case_counts()
    _compare(now, "node/")
    _compare(now, "guards/node")  # their guard nodes together (issue 39)


def test_bench_models_gradient_graphs_do_not_grow(tmp_path):
    import torch  # noqa: F401  (in the test extra)
    now = bench_counts(str(tmp_path))
    _compare(now, "bench/")
    _compare(now, "guards/bench/")
