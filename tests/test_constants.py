"""Constants, folded shape arithmetic and ranks that exporters need (issue 15, section 5): every form of the
``Constant`` operator, shape arithmetic over static shapes folded into values the rules read (the Resize sizes
of PyTorch's legacy exporter), ranks kept through operators whose output rank does not depend on values, and
what an unknown rank's message advises."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

import revgraph as rg
from revgraph.autodiff.emitter import Emitter
from revgraph.autodiff.lift import lift_constants
from revgraph.errors import GraphError
from revgraph.ir import Graph, Node, ValueInfo, fastshape
from revgraph.onnx_io.value_types import constant_value, constant_values, infer_types
from revgraph.tools.check import to_float64

F32 = np.float32
I64 = np.int64


def _sparse(values, indices, dims) -> onnx.AttributeProto:
    sp = helper.make_sparse_tensor(numpy_helper.from_array(np.asarray(values)),
                                   numpy_helper.from_array(np.asarray(indices, I64)), dims)
    return helper.make_attribute("sparse_value", sp)


# ------------------------------------------------------------------------------------------ Constant forms

FORMS = [
    ({"value": np.array([[1, 2]], F32)}, np.array([[1, 2]], F32)),
    ({"value_float": 2.5}, np.array(2.5, F32)),
    ({"value_floats": [1.0, 1.0, 2.0, 2.0]}, np.array([1, 1, 2, 2], F32)),
    ({"value_int": -3}, np.array(-3, I64)),
    ({"value_ints": [0, -1]}, np.array([0, -1], I64)),
    ({"value_string": "a"}, np.array("a", object)),
    ({"value_strings": ["a", "bc"]}, np.array(["a", "bc"], object)),
    ({"sparse_value": _sparse(np.array([5.0, 7.0], F32), [1, 4], [2, 3])}, np.array([[0, 5, 0], [0, 7, 0]], F32)),
    ({"sparse_value": _sparse([5, 7], [[0, 1], [1, 2]], [2, 3])}, np.array([[0, 5, 0], [0, 0, 7]], I64)),
]


@pytest.mark.parametrize("attrs, expected", FORMS, ids=[next(iter(f[0])) + str(i) for i, f in enumerate(FORMS)])
def test_every_constant_form_is_read(attrs, expected):
    value = constant_value(Node("Constant", [], ["c"], attrs, "c"))
    assert value.dtype == expected.dtype and value.shape == expected.shape
    assert (value == expected).all()
    g = Graph([Node("Constant", [], ["c"], attrs, "c")], [], [ValueInfo("c", expected.dtype if expected.dtype != object
                                                                       else np.dtype(str), expected.shape)])
    assert "c" in constant_values(g)


def test_forms_read_from_a_file_agree_with_onnxruntime(tmp_path):
    """The forms as a file holds them (onnx.helper's attributes, loaded by revgraph.load) against what
    onnxruntime computes for each Constant."""
    nodes, outs = [], []
    for i, (attrs, expected) in enumerate(FORMS):
        if expected.dtype == object:
            continue
        key, v = next(iter(attrs.items()))
        v = numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v
        nodes.append(helper.make_node("Constant", [], [f"c{i}"], **({key: v} if key != "sparse_value" else {})))
        if key == "sparse_value":  # onnxruntime returns a sparse graph output as a SparseTensor: read it dense
            nodes[-1].attribute.append(v)
            nodes[-1].output[0] = f"s{i}"
            nodes.append(helper.make_node("Max", [f"s{i}"], [f"c{i}"]))
        outs.append(helper.make_tensor_value_info(f"c{i}", helper.np_dtype_to_tensor_dtype(expected.dtype), None))
    model = helper.make_model(helper.make_graph(nodes, "g", [], outs), opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, tmp_path / "c.onnx")
    g = rg.load(tmp_path / "c.onnx")
    values = constant_values(g)
    ran = rg.Session(g).run({})
    for name, arr in ran.items():
        name = name.replace("c", "s") if f"{name.replace('c', 's')}" in values else name
        np.testing.assert_array_equal(values[name], arr)
        assert values[name].dtype == arr.dtype


def test_a_large_sparse_constant_is_not_made_dense_for_the_rules():
    node = Node("Constant", [], ["c"], {"sparse_value": _sparse([1.0], [0], [10**9, 10**3])}, "c")
    assert constant_value(node) is None


def test_lift_and_the_float64_check_read_every_form():
    g = Graph([Node("Constant", [], ["w"], {"value_floats": [1.0, 2.0, 3.0]}, "w"),
               Node("Constant", [], ["v"], {"sparse_value": _sparse(np.array([2.0], F32), [1], [3])}, "v"),
               Node("Constant", [], ["k"], {"value_float": 0.5}, "k"),
               Node("Mul", ["x", "w"], ["a"], name="m1"), Node("Mul", ["a", "v"], ["b"], name="m2"),
               Node("Mul", ["b", "k"], ["y"], name="m3")],
              [ValueInfo("x", F32, (3,))], [ValueInfo("y", F32, (3,))])
    lifted, names = lift_constants(g)
    assert names == ["w", "v"] and lifted.initializers["v"].tolist() == [0, 2, 0]
    promoted = to_float64(g)
    assert all(np.asarray(n.attrs["value"]).dtype == np.float64 for n in promoted.nodes if n.op_type == "Constant")
    rep = rg.check_gradients(g, "y", ["x"], inputs={"x": np.array([1, 2, 3], F32)})
    assert rep.ok, rep


# ------------------------------------------------------------------------------------------ folding

X_SHAPE = (2, 3, 4, 5)
FOLD_CASES = [
    ("Shape", {}, {}),
    ("Shape", {}, {"start": 1}),
    ("Shape", {}, {"start": -2, "end": -1}),
    ("Shape", {}, {"start": 3, "end": 1}),
    ("Shape", {}, {"end": 10}),
    ("Size", {}, {}),
    ("Gather", {"d": np.array([2, 3, 4]), "i": np.array([-1, 0])}, {}),
    ("Gather", {"d": np.arange(6).reshape(2, 3), "i": np.array(2)}, {"axis": 1}),
    ("Slice", {"d": np.arange(10), "b": np.array([-2]), "e": np.array([-100]), "a": np.array([0]),
               "s": np.array([-3])}, {}),
    ("Slice", {"d": np.arange(12).reshape(3, 4), "b": np.array([1, 0]), "e": np.array([100, -1])}, {}),
    ("Concat", {"a": np.array([1, 2]), "b": np.array([3])}, {"axis": 0}),
    ("Cast", {"a": np.array([2.7, -2.7, 3.0], F32)}, {"to": 7}),
    ("Cast", {"a": np.array([2, -3])}, {"to": 1}),
    ("Unsqueeze", {"a": np.array([2, 3]), "x": np.array([0, -1])}, {}),
    ("Squeeze", {"a": np.array([[2], [3]]), "x": np.array([1])}, {}),
    ("Reshape", {"a": np.array(-1), "s": np.array([1])}, {}),
    ("Reshape", {"a": np.arange(6).reshape(2, 3), "s": np.array([0, -1])}, {}),
    ("Flatten", {"a": np.arange(24).reshape(2, 3, 4)}, {"axis": -1}),
    ("Add", {"a": np.array([2, 3]), "b": np.array([1])}, {}),
    ("Sub", {"a": np.array([2, 3]), "b": np.array([5, 1])}, {}),
    ("Mul", {"a": np.array([2.0, 3.0], F32), "b": np.array([1.5], F32)}, {}),
    ("Div", {"a": np.array([-7, 7, -8]), "b": np.array([2, -2, 3])}, {}),
    ("Div", {"a": np.array([7.0], F32), "b": np.array([2.0], F32)}, {}),
    ("Neg", {"a": np.array([1, -2])}, {}),
    ("Abs", {"a": np.array([1, -2])}, {}),
    ("Floor", {"a": np.array([1.5, -1.5], F32)}, {}),
    ("Ceil", {"a": np.array([1.5, -1.5], F32)}, {}),
    ("Max", {"a": np.array([1, 5]), "b": np.array([3]), "c": np.array([2, 2])}, {}),
    ("Min", {"a": np.array([1, 5]), "b": np.array([3])}, {}),
    ("Equal", {"a": np.array([1, 5]), "b": np.array([5])}, {}),
    ("Less", {"a": np.array([1, 5]), "b": np.array([3])}, {}),
    ("Greater", {"a": np.array([1, 5]), "b": np.array([3])}, {}),
    ("Not", {"a": np.array([True, False])}, {}),
    ("Where", {"c": np.array([True, False]), "a": np.array([1, 2]), "b": np.array([3, 4])}, {}),
    ("ConstantOfShape", {"s": np.array([2, 3])}, {"value": np.array([7], I64)}),
    ("ConstantOfShape", {"s": np.array([2])}, {}),
    ("Range", {"a": np.array(1), "b": np.array(10), "c": np.array(3)}, {}),
    ("Range", {"a": np.array(1.0, F32), "b": np.array(0.0, F32), "c": np.array(-0.25, F32)}, {}),
    ("ReduceProd", {"a": np.array([[2, 3], [4, 5]]), "x": np.array([1])}, {"keepdims": 0}),
    ("ReduceSum", {"a": np.array([[2, 3], [4, 5]])}, {}),
    ("Expand", {"a": np.array([[1], [2]]), "s": np.array([2, 3])}, {}),
    ("Identity", {"a": np.array([1, 2])}, {}),
]


@pytest.mark.parametrize("op, consts, attrs", FOLD_CASES, ids=[f"{c[0]}{i}" for i, c in enumerate(FOLD_CASES)])
def test_folded_values_agree_with_onnxruntime(op, consts, attrs):
    inputs = ["x"] if op in ("Shape", "Size") else list(consts)
    node = Node(op, inputs, ["y"], attrs, "op")
    consts = {k: np.asarray(v) for k, v in consts.items()}
    types = {"x": ValueInfo("x", F32, X_SHAPE)}
    folded = fastshape.fold(node, consts, types)
    assert folded is not None
    g = Graph([node], [ValueInfo("x", F32, X_SHAPE)] if op in ("Shape", "Size") else [],
              [ValueInfo("y", folded.dtype, None)], consts)
    ran = rg.Session(g).run({"x": np.zeros(X_SHAPE, F32)} if op in ("Shape", "Size") else {})["y"]
    assert folded.dtype == ran.dtype and folded.shape == ran.shape, (folded, ran)
    np.testing.assert_array_equal(folded, ran)


def test_nothing_is_folded_from_a_shape_known_only_at_run_time():
    types = {"x": ValueInfo("x", F32, (2, "N")), "y": ValueInfo("y", F32, (2, None))}
    for name in ("x", "y"):
        assert fastshape.fold(Node("Shape", [name], ["s"], {}, "s"), {}, types) is None
    assert fastshape.fold(Node("Div", ["a", "b"], ["q"], {}, "d"), {"a": np.array([1]), "b": np.array([0])}, {}) is None
    big = {"s": np.array([10**6])}
    assert fastshape.fold(Node("ConstantOfShape", ["s"], ["c"], {}, "c"), big, {}) is None


def legacy_resize_sizes(mode: str = "nearest") -> Graph:
    """``Resize(x, sizes=Concat(Slice(Shape(x), 0, 2), Cast(Constant([6., 8.]))))``: PyTorch's legacy exporter's
    sizes for ``F.interpolate(x, size=...)``."""
    return Graph([Node("Shape", ["x"], ["sh"], name="shape"),
                  Node("Constant", [], ["z"], {"value_ints": [0]}, name="c0"),
                  Node("Constant", [], ["two"], {"value": np.array([2])}, name="c2"),
                  Node("Slice", ["sh", "z", "two"], ["nc"], name="slice"),
                  Node("Constant", [], ["hw"], {"value_floats": [6.0, 8.0]}, name="chw"),
                  Node("Cast", ["hw"], ["hwi"], {"to": 7}, name="cast"),
                  Node("Concat", ["nc", "hwi"], ["sizes"], {"axis": 0}, name="concat"),
                  Node("Resize", ["x", "", "", "sizes"], ["y"], {"mode": mode}, name="resize")],
                 [ValueInfo("x", F32, (1, 2, 3, 4))], [ValueInfo("y", F32, None)])


def test_shape_arithmetic_is_folded_for_the_rules():
    g = legacy_resize_sizes()
    values = constant_values(g, infer_types(g))
    assert values["sizes"].tolist() == [1, 2, 6, 8] and values["sizes"].dtype == I64
    assert "sizes" not in constant_values(g)  # without types: no static shape to fold from


@pytest.mark.parametrize("which", ["value_floats-scales", "legacy-sizes"])
def test_resize_with_exported_scales_or_sizes(which):
    """The dynamo exporter writes Resize scales as ``Constant(value_floats=...)``, the legacy exporter computes
    sizes from ``Shape(x)``: both were refused ("the Resize VJP needs constant scales or sizes")."""
    rng = np.random.default_rng(0)
    x, u = rng.standard_normal((1, 2, 3, 4)).astype(F32), rng.standard_normal((1, 2, 6, 8)).astype(F32)
    if which == "legacy-sizes":
        g, mode = legacy_resize_sizes("nearest"), "nearest"
    else:
        mode = "linear"
        g = Graph([Node("Constant", [], ["sc"], {"value_floats": [1.0, 1.0, 2.0, 2.0]}, name="c"),
                   Node("Resize", ["x", "", "sc"], ["y"], {"mode": mode}, name="resize")],
                  [ValueInfo("x", F32, x.shape)], [ValueInfo("y", F32, None)], opsets={"": 23})
    gg = rg.gradient(g, "y", seed="input")
    got = rg.Session(gg).run({"x": x, "y_grad": u})["x_grad"]
    t = torch.tensor(x, requires_grad=True)
    y = torch.nn.functional.interpolate(t, size=(6, 8), mode="bilinear" if mode == "linear" else "nearest")
    (y * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-5, atol=1e-6)


class Interpolating(torch.nn.Module):
    """A convolution, ``F.interpolate`` and ``mean(-1, keepdim=True)`` (``ReduceMean`` over computed axes in
    the legacy exporter's output)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        h = torch.nn.functional.interpolate(self.conv(x), scale_factor=2, mode="bilinear", align_corners=False)
        return (h.mean(-1, keepdim=True) * h).sum()


@pytest.mark.parametrize("exporter, opset", [("dynamo", 23), ("legacy", 17)])
def test_interpolate_exported_by_pytorch(exporter, opset):
    torch.manual_seed(0)
    m, x = Interpolating(), torch.randn(1, 2, 5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            model = torch.onnx.export(m, (x,), dynamo=True, opset_version=opset, optimize=False).model_proto
        else:
            f = io.BytesIO()
            torch.onnx.export(m, (x,), f, dynamo=False, opset_version=opset, input_names=["x"])
            model = onnx.load_from_string(f.getvalue())
    g = rg.load(model)
    assert g.opset == max(opset, 21)
    gg = rg.gradient(g)
    got = rg.Session(gg).run({g.inputs[0].name: x.numpy()})
    m.zero_grad()
    m(x).backward()
    for name, p in m.named_parameters():
        np.testing.assert_allclose(got[f"{name}_grad"], p.grad.numpy(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ ranks


def test_reduce_mean_keepdims_over_computed_axes_keeps_its_rank():
    """``x.mean(-1, keepdim=True)`` as the legacy exporter writes it: axes ``Reshape(Constant(-1), [1])``."""
    g = Graph([Node("Constant", [], ["m1"], {"value": np.array(-1)}, name="c"),
               Node("Constant", [], ["one"], {"value_ints": [1]}, name="c1"),
               Node("Reshape", ["m1", "one"], ["axes"], name="reshape"),
               Node("ReduceMean", ["x", "axes"], ["m"], name="mean"),
               Node("Sub", ["x", "m"], ["d"], name="sub"),
               Node("Mul", ["d", "d"], ["y"], name="sq")],
              [ValueInfo("x", F32, ("B", 5))], [ValueInfo("y", F32, None)])
    types = infer_types(g)
    assert types["m"].shape is not None and len(types["m"].shape) == 2
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(F32)
    assert rg.check_gradients(g, "y", ["x"], inputs={"x": x}).ok


RANK_CASES = [
    ("ReduceSum", {"x": (2, 3, 4)}, {"a": (2,)}, {"keepdims": 0}, {"a": np.array([0, -1])}),
    ("ReduceMax", {"x": (2, 3, 4)}, {"a": (1,)}, {}, {"a": np.array([1])}),
    ("ReduceL2", {"x": (2, 1, 4)}, {"a": (1,)}, {"keepdims": 1}, {"a": np.array([2])}),
    ("ReduceSum", {"x": (2, 3, 4)}, {"a": (0,)}, {"keepdims": 0, "noop_with_empty_axes": 1}, {"a": np.zeros(0, I64)}),
    ("Unsqueeze", {"x": (2, 3)}, {"a": (2,)}, {}, {"a": np.array([0, 3])}),
    ("Squeeze", {"x": (2, 1, 3, 1)}, {"a": (2,)}, {}, {"a": np.array([1, -1])}),
    ("Split", {"x": (2, 7)}, {"a": (2,)}, {"axis": 1}, {"a": np.array([3, 4])}),
    ("CenterCropPad", {"x": (2, 7, 4)}, {"a": (2,)}, {"axes": [1, 2]}, {"a": np.array([3, 6])}),
    ("MaxUnpool", {"x": (1, 2, 2, 2), "i": (1, 2, 2, 2)}, {"a": (4,)}, {"kernel_shape": [2, 2], "strides": [2, 2]},
     {"a": np.array([1, 2, 5, 5]), "i": np.array([0, 3, 10, 15, 1, 6, 20, 24]).reshape(1, 2, 2, 2)}),
]


@pytest.mark.parametrize("op, xs, computed, attrs, feeds", RANK_CASES,
                         ids=[f"{c[0]}{i}" for i, c in enumerate(RANK_CASES)])
def test_ranks_that_do_not_depend_on_values_are_kept(op, xs, computed, attrs, feeds):
    """Operators whose output rank does not depend on the values of the inputs that set dimensions (axes, split
    sizes, a target shape), here graph inputs known only at run time: ONNX's inference gives no shape, revgraph
    gives the rank (and the dimensions it can tell), checked against onnxruntime's outputs."""
    n_out = 2 if op == "Split" else 1
    names = list(xs) + list(computed)
    outs = [f"y{k}" for k in range(n_out)]
    inputs = [ValueInfo(k, I64 if k == "i" else F32, s) for k, s in xs.items()]
    inputs += [ValueInfo(k, I64, s) for k, s in computed.items()]
    g = Graph([Node(op, names, outs, attrs, "op")], inputs, [ValueInfo(o) for o in outs])
    types = infer_types(g)
    rng = np.random.default_rng(2)
    run = {k: rng.standard_normal(s).astype(F32) for k, s in xs.items() if k != "i"}
    run.update(feeds)
    got = rg.Session(g).run(run)
    for o in outs:
        vi = types.get(o)
        assert vi is not None and vi.shape is not None, (o, vi)
        assert len(vi.shape) == got[o].ndim
        assert all(d is None or isinstance(d, str) or d == n for d, n in zip(vi.shape, got[o].shape, strict=True))


# ------------------------------------------------------------------------------------------ messages


def _unknown_rank_graph(declared: bool) -> Graph:
    """``Slice(Reshape(x, s), ...)`` with the target shape ``s`` and every Slice parameter graph inputs: the
    Slice VJP needs the rank of the reshaped value, which no shape inference can tell."""
    return Graph([Node("Reshape", ["x", "s"], ["r"], name="reshape"),
                  Node("Slice", ["r", "b", "e", "a"], ["y"], name="slice")],
                 [ValueInfo("x", F32, (2, 3) if declared else None), ValueInfo("s", I64, (None,)),
                  *(ValueInfo(k, I64, (1,)) for k in "bea")], [ValueInfo("y", F32, None)])


def test_an_unknown_rank_advises_declaring_the_inputs_only_when_they_are_not():
    with pytest.raises(GraphError, match=r"rank of 'r' is unknown.*declare the shapes of the graph inputs "
                                         r"\(not declared: 'x'\)"):
        rg.gradient(_unknown_rank_graph(False), "y", wrt=["x"])
    with pytest.raises(GraphError) as info:
        rg.gradient(_unknown_rank_graph(True), "y", wrt=["x"])
    message = str(info.value)
    assert "declare the shapes of the graph inputs" not in message
    assert "shapes are declared" in message and "declare its type in the model's value_info" in message


def test_the_emitter_message_names_who_needs_the_rank():
    e = Emitter({}, set(), 21)
    e.undeclared = []
    text = e.unknown_rank("v", Node("Tile", ["v", "r"], ["t"], {}, "tile"), "the VJP of Tile")
    assert text.startswith("node 'tile' (Tile): the rank of 'v' is unknown, and the VJP of Tile needs it; ")


def test_pad_amounts_reordered_by_the_legacy_exporter_give_static_shapes():
    # torch's TorchScript exporter writes F.pad's amounts as Concat -> Reshape(-1, 2) -> Slice(reversed) ->
    # Transpose -> Reshape(-1) -> Cast: folded over constants, the Pad's output (and the SAME-padded Conv after it,
    # whose VJP needs the spatial sizes) gets its static shape; the gradient matches PyTorch
    i64 = lambda *v: np.array(v, np.int64)
    nodes = [Node("Concat", ["p", "z"], ["c"], {"axis": 0}, "cat"), Node("Reshape", ["c", "r2"], ["r"], name="rs"),
             Node("Slice", ["r", "s0", "s1", "ax", "st"], ["sl"], name="sl"),
             Node("Transpose", ["sl"], ["tr"], {"perm": [1, 0]}, "tr"),
             Node("Reshape", ["tr", "m1"], ["flat"], name="r1"),
             Node("Cast", ["flat"], ["pads"], {"to": onnx.TensorProto.INT64}, "cast"),
             Node("Pad", ["x", "pads"], ["xp"], {"mode": "constant"}, "pad"),
             Node("Conv", ["xp", "w"], ["y"], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, "conv"),
             Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")]
    inits = {"p": i64(0, 1, 0, 1), "z": i64(0, 0, 0, 0), "r2": i64(-1, 2), "s0": i64(-1), "s1": i64(-9999),
             "ax": i64(0), "st": i64(-1), "m1": i64(-1), "w": np.random.default_rng(0).standard_normal((2, 3, 3, 3))}
    g = Graph(nodes, [ValueInfo("x", np.float64, (1, 3, 7, 7))], [ValueInfo("loss", np.float64, ())], inits)
    types = infer_types(g)
    assert types["xp"].shape == (1, 3, 8, 8) and types["y"].shape == (1, 2, 4, 4)
    x = np.random.default_rng(1).standard_normal((1, 3, 7, 7))
    got = rg.Session(rg.gradient(g, wrt=["x", "w"]), backend="reference").run({"x": x})
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(inits["w"], requires_grad=True)
    xp = torch.nn.functional.pad(xt, (0, 1, 0, 1))  # pads [0,1,0,1] in (W, H) order after the reordering
    # SAME_UPPER on 8 x 8, kernel 3, stride 2: 4 outputs, one padded row and column at the end
    torch.nn.functional.conv2d(torch.nn.functional.pad(xp, (0, 1, 0, 1)), wt, stride=2).sum().backward()
    np.testing.assert_allclose(got["x_grad"], xt.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(got["w_grad"], wt.grad.numpy(), rtol=1e-10)
