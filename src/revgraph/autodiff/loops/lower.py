"""Rewrite operators that are differentiated through their ``Loop`` form (``Scan``, ``LSTM``, ``GRU``,
``RNN``) before the backward pass."""

from __future__ import annotations

from ...ir import Graph, ValueInfo
from ...types import infer_types
from .recurrent import RECURRENT_OPS, lower_recurrent
from .scan import lower_scans


def lower_to_loops(graph: Graph, types: dict[str, ValueInfo] | None, used: set[str]) -> bool:
    """Rewrite, in place and in every subgraph, each ``Scan``/``LSTM``/``GRU``/``RNN`` node into the
    equivalent ``Loop``; fresh names avoid ``used``; ``types`` (inferred here when ``None``) gains the types of
    the new values (rules need static ranks). Returns True if the graph changed."""
    ops = {n.op_type for _, n in graph.walk() if n.domain in ("", "ai.onnx")}
    if "Scan" not in ops and not ops & set(RECURRENT_OPS):
        return False
    types = infer_types(graph) if types is None else types
    changed = False
    if "Scan" in ops:
        changed |= bool(lower_scans(graph, types, used))
    if ops & set(RECURRENT_OPS):
        lower_recurrent(graph, types, used)
        changed = True
    if changed:
        for name, vi in infer_types(graph).items():
            types.setdefault(name, vi)
    return changed
