"""The emitter's Python shape formulas (revgraph/ir/fastshape.py) against ONNX's own per-node shape inference:
on hand-picked edge cases, on random slices, and on every node emitted while differentiating real models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import revgraph as rg
from revgraph.autodiff.emitter import Emitter
from revgraph.autodiff.lift import lift_constants
from revgraph.ir import Node, ValueInfo, fastshape
from revgraph.onnx_io.value_types import onnx_node_types

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def _emitter(inputs: dict[str, tuple], consts: dict[str, np.ndarray]) -> Emitter:
    types = {k: ValueInfo(k, np.dtype(np.float32), s) for k, s in inputs.items()}
    types.update({k: ValueInfo(k, v.dtype, v.shape) for k, v in consts.items()})
    e = Emitter(types, set(), 21)
    e.values.update(consts)
    return e


def _agree(op, inputs: dict[str, tuple], attrs=None, consts=None, cond=None):
    consts = {k: np.asarray(v, dtype=np.int64) for k, v in (consts or {}).items()}
    e = _emitter(inputs, consts)
    if cond is not None:
        e.types["c"] = ValueInfo("c", np.dtype(bool), cond)
    names = (["c"] if cond is not None else []) + list(inputs) + list(consts)
    node = Node(op, names, ["y"], attrs or {}, "n")
    fast = fastshape.infer(node, e.types, e.values)
    ref = onnx_node_types(node, e.types, e.values, 21).get("y")
    assert fast is not None, f"{op} {inputs} {attrs} {consts}: no fast answer"
    assert ref is not None and ref.shape is not None
    assert (fast.dtype, fast.shape) == (ref.dtype, tuple(ref.shape)), f"{op} {inputs} {attrs} {consts}"


CASES = [
    ("Add", {"a": (2, 1, 4), "b": (3, 1)}, {}, {}),
    ("Transpose", {"x": (2, 3, 4)}, {"perm": [2, 0, 1]}, {}),
    ("Transpose", {"x": (2, 3, 4)}, {}, {}),
    ("Reshape", {"x": (2, 3, 4)}, {}, {"s": [0, -1]}),
    ("Reshape", {"x": (2, 3, 4)}, {}, {"s": [-1, 2, 2]}),
    ("Unsqueeze", {"x": (2, 3)}, {}, {"a": [0, -1]}),
    ("Unsqueeze", {"x": (2, 3)}, {}, {"a": [3, 1]}),
    ("Squeeze", {"x": (1, 3, 1)}, {}, {"a": [-1]}),
    ("Squeeze", {"x": (1, 3, 1)}, {}, {}),
    ("Slice", {"x": (10, 6)}, {}, {"b": [1, -4], "e": [9, 100], "ax": [0, 1], "st": [3, 1]}),
    ("Slice", {"x": (10, 6)}, {}, {"b": [-1], "e": [-(2**63)], "ax": [-2], "st": [-2]}),
    ("Concat", {"a": (2, 3), "b": (2, 5)}, {"axis": -1}, {}),
    ("MatMul", {"a": (5, 1, 2, 3), "b": (4, 3, 6)}, {}, {}),
    ("Gemm", {"a": (3, 2), "b": (4, 3)}, {"transA": 1, "transB": 1}, {}),
    ("ReduceSum", {"x": (2, 3, 4)}, {"keepdims": 0}, {"a": [-1, 0]}),
    ("ReduceMean", {"x": (2, 3, 4)}, {}, {"a": [1]}),
    ("ReduceSum", {"x": (2, 3, 4)}, {"keepdims": 0}, {}),
    ("ReduceMax", {"x": (2, 3, 4)}, {"noop_with_empty_axes": 1}, {}),
]


@pytest.mark.parametrize("op, inputs, attrs, consts", CASES, ids=[c[0] for c in CASES])
def test_formula_agrees_with_onnx(op, inputs, attrs, consts):
    _agree(op, inputs, attrs, consts)


def test_where_broadcasts_its_condition_too():
    _agree("Where", {"a": (4,), "b": (1,)}, cond=(3, 4))


def test_unknown_or_symbolic_shapes_are_left_to_onnx():
    e = _emitter({"x": (2, "N")}, {"a": np.array([0], np.int64)})
    assert fastshape.infer(Node("Unsqueeze", ["x", "a"], ["y"], {}, "n"), e.types, e.values) is None
    e.types["s"] = ValueInfo("s", np.dtype(np.int64), (2,))  # a shape computed at run time
    assert fastshape.infer(Node("Reshape", ["x", "s"], ["y"], {}, "n"), e.types, e.values) is None


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 9), b=st.integers(-12, 12), e=st.integers(-12, 12), step=st.sampled_from([-3, -2, -1, 1, 2, 3]))
def test_random_slices_agree_with_onnx(n, b, e, step):
    _agree("Slice", {"x": (n, 2)}, {}, {"b": [b], "e": [e], "ax": [0], "st": [step]})


@pytest.mark.parametrize("model", ["resnet50", "inception_v2"])
def test_every_emitted_node_agrees_with_onnx(model, monkeypatch):
    checked = []
    original = Emitter._infer

    def both(self, node):
        original(self, node)
        if any(i and i not in self.types for i in node.inputs):
            return
        fast = fastshape.infer(node, self.types, self.values)
        if fast is not None:
            ref = onnx_node_types(node, self.types, self.values, self.opset).get(node.outputs[0])
            if ref is not None and ref.shape is not None:
                assert (fast.dtype, fast.shape) == (ref.dtype, tuple(ref.shape)), node.label()
                checked.append(node.op_type)

    monkeypatch.setattr(Emitter, "_infer", both)
    g, lifted = lift_constants(rg.load(LIGHT / f"light_{model}.onnx"))
    rg.gradient(g, g.output_names[0], wrt=lifted[:40])
    assert len(checked) > 100 and {"Reshape", "Transpose", "MatMul"} & set(checked)


def test_an_empty_squeeze_axes_tensor_is_left_to_onnx():
    # onnx's inference keeps every axis, onnxruntime squeezes all size-1 axes: no fast answer either way
    e = _emitter({"x": (1, 3, 1)}, {"a": np.zeros(0, np.int64)})
    assert fastshape.infer(Node("Squeeze", ["x", "a"], ["y"], {}, "n"), e.types, e.values) is None


RANK_CASES = [
    ("ReduceMean", (2, 1, 4), [2], {}),
    ("ReduceSum", (2, 3, 4), [0, -1], {"keepdims": 0}),
    ("ReduceProd", (2, 3, 4), [], {"keepdims": 0, "noop_with_empty_axes": 1}),
    ("ArgMax", (2, 3, 4), None, {"axis": 1, "keepdims": 0}),
    ("Unsqueeze", (2, 3), [0, 3], {}),
    ("Squeeze", (2, 1, 3, 1), [1, -1], {}),
    ("CenterCropPad", (2, 7, 4), [3, 6], {"axes": [1, 2]}),
]


@pytest.mark.parametrize("op, xs, axes, attrs", RANK_CASES, ids=[c[0] for c in RANK_CASES])
def test_rank_types_agree_with_onnx_where_it_knows(op, xs, axes, attrs):
    """Where the axes are constants ONNX's inference knows the output shape: the ranks revgraph gives for computed
    axes (``rank_types``, only the axes' length known) have the same rank and no other known dimension."""
    inputs = ["x"] if axes is None else ["x", "a"]
    node = Node(op, inputs, ["y"], attrs, "n")
    types = {"x": ValueInfo("x", np.dtype(np.float32), xs)}
    values = {}
    if axes is not None:
        types["a"] = ValueInfo("a", np.dtype(np.int64), (len(axes),))
        values["a"] = np.array(axes, np.int64)
    ref = onnx_node_types(node, types, values, 21)["y"]
    fast = fastshape.rank_types(node, types)["y"]
    assert len(fast.shape) == len(ref.shape) and fast.dtype == ref.dtype
    assert all(d is None or d == r for d, r in zip(fast.shape, ref.shape, strict=True)), (fast.shape, ref.shape)
