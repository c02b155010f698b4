"""Models and data for the loss and data-layout tests of issue 26 (tests/test_data.py, tests/test_lossdata_cli.py,
tests/distributed_worker.py): an MLP with static inputs (a mixing matrix without a sample axis, a scalar gain), a
full-graph GNN (node features, edge_index [2, E] and labels all static), and a tiny causal language model."""

from __future__ import annotations

import numpy as np

from revgraph.ir import Graph, Node, ValueInfo

F32 = np.float32


def static_model() -> Graph:
    """x float32 [N, 4] (per sample), adj float32 [4, 4] and gain float32 [] (static) -> logits [N, 3] =
    ((x @ adj) @ W) * gain."""
    rng = np.random.default_rng(11)
    inits = {"W": (rng.standard_normal((4, 3)) / 2).astype(F32), "b": np.zeros(3, F32)}
    nodes = [Node("MatMul", ["x", "adj"], ["xa"], {}, "mix"), Node("MatMul", ["xa", "W"], ["h"], {}, "lin"),
             Node("Add", ["h", "b"], ["hb"], {}, "bias"), Node("Mul", ["hb", "gain"], ["logits"], {}, "gain")]
    return Graph(nodes, [ValueInfo("x", F32, ("N", 4)), ValueInfo("adj", F32, (4, 4)), ValueInfo("gain", F32, ())],
                 [ValueInfo("logits", F32, ("N", 3))], inits, name="static_inputs")


def static_data(n: int = 97) -> tuple[dict, dict]:
    """``(per-sample data, static arrays)`` of :func:`static_model`."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((n, 4)).astype(F32)
    data = {"x": x, "labels": (x.sum(1) > 0).astype(np.int64) + (x[:, 0] > 1)}
    return data, {"adj": (np.eye(4) + 0.1 * rng.standard_normal((4, 4))).astype(F32), "gain": np.array(1.5, F32)}


NODES, FEATURES, HIDDEN, CLASSES = 7, 3, 5, 2


def gnn_model() -> Graph:
    """A one-layer message-passing GNN trained full-graph: x [nodes, 3], edge_index int64 [2, E] -> h = x @ W1,
    each node's h plus the sum of its in-neighbours' (ScatterND add) -> logits [nodes, 2] = ... @ W2."""
    rng = np.random.default_rng(13)
    inits = {"W1": (rng.standard_normal((FEATURES, HIDDEN)) / 2).astype(F32),
             "W2": (rng.standard_normal((HIDDEN, CLASSES)) / 2).astype(F32)}
    nodes = [Node("Constant", [], ["zero"], {"value": np.array(0, np.int64)}, "zero"),
             Node("Constant", [], ["one"], {"value": np.array(1, np.int64)}, "one"),
             Node("Constant", [], ["last"], {"value": np.array([1], np.int64)}, "last"),
             Node("MatMul", ["x", "W1"], ["h"], {}, "lin1"),
             Node("Gather", ["edge_index", "zero"], ["src"], {"axis": 0}, "src"),
             Node("Gather", ["edge_index", "one"], ["dst"], {"axis": 0}, "dst"),
             Node("Gather", ["h", "src"], ["msg"], {"axis": 0}, "messages"),
             Node("Shape", ["h"], ["hshape"], {}, "shape"),
             Node("ConstantOfShape", ["hshape"], ["empty"], {"value": np.zeros(1, F32)}, "zeros"),
             Node("Unsqueeze", ["dst", "last"], ["dst2"], {}, "dst2"),
             Node("ScatterND", ["empty", "dst2", "msg"], ["agg"], {"reduction": "add"}, "aggregate"),
             Node("Add", ["agg", "h"], ["hh"], {}, "self"), Node("Relu", ["hh"], ["r"], {}, "relu"),
             Node("MatMul", ["r", "W2"], ["logits"], {}, "lin2")]
    return Graph(nodes, [ValueInfo("x", F32, ("nodes", FEATURES)), ValueInfo("edge_index", np.int64, (2, "E"))],
                 [ValueInfo("logits", F32, ("nodes", CLASSES))], inits, name="gnn")


def gnn_data() -> dict:
    """The whole graph: ``x``, ``edge_index`` and ``labels`` (every one static)."""
    rng = np.random.default_rng(14)
    edges = np.array([[0, 1, 2, 3, 4, 5, 6, 0, 2], [1, 2, 3, 4, 5, 6, 0, 3, 5]], np.int64)
    return {"x": rng.standard_normal((NODES, FEATURES)).astype(F32), "edge_index": edges,
            "labels": rng.integers(0, CLASSES, NODES)}


V, T, D = 11, 6, 8


def tiny_lm(dtype=F32, seed: int = 0) -> Graph:
    """ids int64 [B, 6] -> embedding [11, 8] -> one causal self-attention head with a residual -> logits
    [B, 6, 11] (the mask and the scale are Constant nodes, so only the five matrices train)."""
    rng = np.random.default_rng(seed)
    inits = {"E": rng.standard_normal((V, D)), "Wq": rng.standard_normal((D, D)) / np.sqrt(D),
             "Wk": rng.standard_normal((D, D)) / np.sqrt(D), "Wv": rng.standard_normal((D, D)) / np.sqrt(D),
             "Wo": rng.standard_normal((D, V)) / np.sqrt(D)}
    inits = {k: v.astype(dtype) for k, v in inits.items()}
    mask = np.triu(np.full((T, T), -1e9), 1).astype(dtype)
    nodes = [Node("Constant", [], ["mask"], {"value": mask}, "mask"),
             Node("Constant", [], ["c"], {"value": np.array(1 / np.sqrt(D), dtype)}, "c"),
             Node("Gather", ["E", "input_ids"], ["h"], {"axis": 0}, "embed"),
             Node("MatMul", ["h", "Wq"], ["q"], {}, "q"), Node("MatMul", ["h", "Wk"], ["k"], {}, "k"),
             Node("MatMul", ["h", "Wv"], ["v"], {}, "v"),
             Node("Transpose", ["k"], ["kt"], {"perm": [0, 2, 1]}, "kt"),
             Node("MatMul", ["q", "kt"], ["s"], {}, "s"), Node("Mul", ["s", "c"], ["s2"], {}, "scale"),
             Node("Add", ["s2", "mask"], ["s3"], {}, "causal"), Node("Softmax", ["s3"], ["a"], {"axis": -1}, "softmax"),
             Node("MatMul", ["a", "v"], ["o"], {}, "attend"), Node("Add", ["o", "h"], ["r"], {}, "residual"),
             Node("MatMul", ["r", "Wo"], ["logits"], {}, "head")]
    return Graph(nodes, [ValueInfo("input_ids", np.int64, ("B", T))], [ValueInfo("logits", dtype, ("B", T, V))],
                 inits, name="tiny_lm")


def lm_data(n: int = 8, seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, labels)`` int64 [n, 6]: the labels are the ids with right padding masked as -100."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (n, T))
    labels = ids.copy()
    for i, m in enumerate(rng.integers(2, T + 1, n)):
        labels[i, m:] = -100
    return ids, labels
