"""Empty tensors (a dimension of size 0) through the VJPs: the gradient graphs run and give PyTorch's gradients.

A ``Reshape`` to a shape holding 0 copies the input's dimension unless ``allowzero=1``; the emitter writes
``allowzero=1`` when it reshapes to a real shape (``Emitter.shape_of``, ``dims_const``), so that an empty dimension
stays empty (Gather with empty indices failed at a Reshape before)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.float64


def _grads(nodes, inputs: dict[str, np.ndarray], inits=None, wrt=None) -> dict[str, np.ndarray]:
    """``loss = sum(u * y)`` of the last node's output ``y``, by revgraph on both backends (checked equal)."""
    g = Graph([*nodes, Node("Mul", ["y", "u"], ["yu"], name="mul"),
               Node("ReduceSum", ["yu"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo(k, v.dtype, v.shape) for k, v in inputs.items()] + [ValueInfo("u", F64, None)],
              [ValueInfo("loss", F64, ())], dict(inits or {}))
    y = rg.Session(Graph(nodes, g.inputs[:-1], [ValueInfo("y")], dict(inits or {}))).run(inputs)["y"]
    u = np.random.default_rng(0).standard_normal(y.shape)
    gg = rg.gradient(g, wrt=wrt or list(inputs))
    out = {}
    for backend in ("onnxruntime", "reference"):
        got = rg.Session(gg, backend=backend).run({**inputs, "u": u})
        for k in wrt or inputs:
            if k in out:
                np.testing.assert_allclose(got[f"{k}_grad"], out[k], rtol=1e-12)
            out[k] = got[f"{k}_grad"]
    out["_u"] = u
    return out


def _torch(fn, inputs: dict[str, np.ndarray], u: np.ndarray) -> dict[str, np.ndarray]:
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in inputs.items()}
    (fn(**ts) * torch.tensor(u)).sum().backward()
    return {k: t.grad.numpy() if t.grad is not None else np.zeros(v.shape)
            for (k, t), v in zip(ts.items(), inputs.values(), strict=True)}


@pytest.mark.parametrize("idx_shape", [(0,), (1, 0), (2, 0, 3), (0, 2)])
def test_gather_with_empty_indices(idx_shape):
    x = np.random.default_rng(1).standard_normal((4, 3))
    idx = np.zeros(idx_shape, np.int64)
    got = _grads([Node("Gather", ["x", "i"], ["y"], {"axis": 0}, "gather")], {"x": x}, {"i": idx})
    assert np.array_equal(got["x"], np.zeros((4, 3)))


@pytest.mark.parametrize(("op", "attrs", "shape", "extra", "fn"), [
    ("Reshape", {"allowzero": 1}, (2, 0, 3), {"s": np.array([0, 6], np.int64)}, lambda x: x.reshape(0, 6)),
    ("Flatten", {"axis": 1}, (2, 0, 3), {}, lambda x: x.reshape(2, 0)),
    ("Transpose", {"perm": [2, 0, 1]}, (2, 0, 3), {}, lambda x: x.permute(2, 0, 1)),
    ("Unsqueeze", {}, (0, 3), {"a": np.array([0], np.int64)}, lambda x: x.unsqueeze(0)),
    ("ReduceSum", {"keepdims": 1}, (0, 3), {"a": np.array([0], np.int64)}, lambda x: x.sum(0, keepdim=True)),
    ("Softmax", {"axis": -1}, (0, 4), {}, lambda x: torch.softmax(x, -1)),
    ("Tanh", {}, (3, 0), {}, torch.tanh),
])
def test_one_input_rules_on_empty_tensors(op, attrs, shape, extra, fn):
    x = np.zeros(shape)
    node = Node(op, ["x", *extra], ["y"], attrs, "op")
    got = _grads([node], {"x": x}, extra)
    want = _torch(lambda x: fn(x), {"x": x}, got["_u"])
    assert got["x"].shape == shape and np.array_equal(got["x"], want["x"])


def test_matmul_and_concat_with_an_empty_dimension():
    rng = np.random.default_rng(2)
    a, b, c = rng.standard_normal((3, 0)), rng.standard_normal((0, 4)), rng.standard_normal((0, 4))
    nodes = [Node("MatMul", ["a", "b"], ["m"], name="mm"), Node("Concat", ["c", "m"], ["y"], {"axis": 0}, "cat")]
    got = _grads(nodes, {"a": a, "b": b, "c": c})
    want = _torch(lambda a, b, c: torch.cat([c, a @ b], 0), {"a": a, "b": b, "c": c}, got["_u"])
    for k in "abc":
        assert got[k].shape == want[k].shape and np.array_equal(got[k], want[k])
