"""No silent cuts (issue 41, item 4): every operator revgraph declares not differentiable
(``registry.NOT_DIFFERENTIABLE``) whose schema lets a floating-point output depend on a floating-point input is
checked with float64 central differences at the ONNX backend node tests' own inputs (and cases of ours where
onnx has none): the output's derivative must be 0 there (piecewise constant, or independent of the values).
``DynamicQuantizeLinear`` was on that list and its scale is not: its VJP is checked against the same
differences, and its rounded outputs are treated as QuantizeLinear's (refused, or the straight-through
estimator). A float-to-float ``BitCast`` is refused."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh
from onnx.reference import ReferenceEvaluator

import revgraph as rg
from revgraph.autodiff.registry import NOT_DIFFERENTIABLE, RULES

_FLOAT_TYPES = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}
_FLOAT_ELEMS = {TP.FLOAT, TP.DOUBLE, TP.FLOAT16, TP.BFLOAT16}


def _types(schema: onnx.defs.OpSchema, params) -> set[str]:
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return set().union(*(constraints.get(p.type_str, {p.type_str}) for p in params)) if params else set()


def _float_in_float_out(op: str) -> bool:
    schema = onnx.defs.get_schema(op)
    return bool(_types(schema, schema.inputs) & _FLOAT_TYPES) and bool(_types(schema, schema.outputs) & _FLOAT_TYPES)


#: the declared-non-differentiable operators whose float output may read a float input (from their schemas)
CANDIDATES = sorted(op for op in NOT_DIFFERENTIABLE if _float_in_float_out(op))


def _node_cases() -> dict[str, list]:
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = node.collect_testcases()
    found: dict[str, list] = {}
    for c in cases:
        ops = [n.op_type for n in c.model.graph.node]
        if len(ops) == 1 and c.data_sets:
            inputs = [nh.to_array(t) if isinstance(t, onnx.TensorProto) else t for t in c.data_sets[0][0]]
            found.setdefault(ops[0], []).append((c.name, c.model, inputs))
    return found


def _one_node(op: str, x: np.ndarray, **attrs) -> onnx.ModelProto:
    g = h.make_graph([h.make_node(op, ["x"], ["y"], **attrs)], "g", [h.make_tensor_value_info("x", TP.DOUBLE, None)],
                     [h.make_tensor_value_info("y", TP.DOUBLE, None)])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 22)])


def _our_cases() -> dict[str, list]:
    """Operators with no float-input node test in onnx: a seeded draw reads x's shape and dtype only."""
    x = np.linspace(-1.0, 2.0, 12).reshape(3, 4)
    return {"RandomNormalLike": [("ours_random_normal_like", _one_node("RandomNormalLike", x, seed=3.0), [x])],
            "RandomUniformLike": [("ours_random_uniform_like", _one_node("RandomUniformLike", x, seed=3.0), [x])],
            "EyeLike": [("ours_eyelike_float", _one_node("EyeLike", x, k=1), [x])]}


def _seeded(model: onnx.ModelProto) -> onnx.ModelProto:
    """A random operator with a fixed seed, so that differences see the values' effect, not a new draw."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for n in model.graph.node:
        if n.op_type in ("Bernoulli", "RandomNormalLike", "RandomUniformLike") and not any(
                a.name == "seed" for a in n.attribute):
            n.attribute.append(h.make_attribute("seed", 7.0))
    return model


def _float64(model: onnx.ModelProto, inputs: list) -> tuple[ReferenceEvaluator, dict, list[str]]:
    """The model under onnx's reference evaluator, its float inputs in float64 (the evaluator computes in the
    dtype it is fed), and the names of those inputs."""
    names = [i.name for i in model.graph.input]
    feeds, floats = {}, []
    for vi, value in zip(model.graph.input, inputs, strict=True):
        value = np.asarray(value)
        if vi.type.tensor_type.elem_type in _FLOAT_ELEMS:
            value = value.astype(np.float64)
            floats.append(vi.name)
        feeds[vi.name] = value
    assert set(feeds) == set(names)
    return ReferenceEvaluator(model), feeds, floats


def _directional(ref: ReferenceEvaluator, feeds: dict, name: str, rng) -> list[tuple[str, np.ndarray]]:
    """Central differences (float64) of every float output along each unit direction of input ``name`` (four
    random directions for a large input), at a point moved off kinks and ties by a random 1e-3 (relative).
    The step, 1e-5 of the input's scale, shows a dependence also where an evaluator computes in float32."""
    x = feeds[name] * (1 + rng.uniform(1e-3, 2e-3, feeds[name].shape)) + rng.uniform(1e-4, 2e-4, feeds[name].shape)
    eps = 1e-5 * max(1.0, float(np.abs(x).max(initial=0)))
    directions = (np.eye(x.size).reshape(x.size, *x.shape) if x.size <= 64
                  else rng.standard_normal((4, *x.shape)))
    outs = [o.name for o in ref.proto_.graph.output]
    found = []
    for d in directions:
        plus = ref.run(None, {**feeds, name: x + eps * d})
        minus = ref.run(None, {**feeds, name: x - eps * d})
        found += [(o, (np.asarray(p, np.float64) - np.asarray(m, np.float64)) / (2 * eps))
                  for o, p, m in zip(outs, plus, minus, strict=True) if np.asarray(p).dtype.kind == "f"]
    return found


def test_the_candidates_are_the_ones_expected():
    # the schema test finds the operators this audit is about; DynamicQuantizeLinear left the list (it has a VJP)
    assert "DynamicQuantizeLinear" not in NOT_DIFFERENTIABLE and "DynamicQuantizeLinear" in RULES
    assert "BitCast" not in NOT_DIFFERENTIABLE and "BitCast" in RULES
    assert {"Floor", "Ceil", "Round", "Sign", "Hardmax", "EyeLike", "Bernoulli", "MelWeightMatrix",
            "RandomNormalLike", "RandomUniformLike"} <= set(CANDIDATES)


@pytest.mark.parametrize("op", CANDIDATES)
def test_declared_non_differentiable_outputs_do_not_vary_with_float_inputs(op):
    cases = _node_cases().get(op, []) + _our_cases().get(op, [])
    rng = np.random.default_rng(41)
    checked = 0
    for name, model, inputs in cases:
        ref, feeds, floats = _float64(_seeded(model), inputs)
        for x in floats:
            for out, diff in _directional(ref, feeds, x, rng):
                # a silent cut of a float output that varies with x would show here (issue 41:
                # DynamicQuantizeLinear's scale, [0, 1.16, -1.16, 0] by differences, revgraph [0, 0, 0, 0])
                assert np.all(diff == 0), f"{name}: {op}'s output {out!r} varies with {x!r} ({diff.ravel()[:4]})"
                checked += 1
    assert checked, f"no case reads a float input of {op} into a float output: add one to _our_cases"


def test_the_audit_sees_dynamic_quantize_linears_scale():
    # the control: the same differences on the operator that was declared and should not have been
    rng = np.random.default_rng(41)
    for name, model, inputs in _node_cases()["DynamicQuantizeLinear"]:
        ref, feeds, _ = _float64(model, inputs)
        found = _directional(ref, feeds, "x", rng)
        assert {out for out, _ in found} == {"y_scale"} and any(np.any(diff != 0) for _, diff in found), name


# ------------------------------------------------------------------------------------------ DynamicQuantizeLinear


def _dql_reference(x: np.ndarray) -> tuple[np.ndarray, float, float]:
    """ONNX "DynamicQuantizeLinear" in float64 (the spec's formulas)."""
    lo, hi = min(0.0, float(x.min())), max(0.0, float(x.max()))
    s = (hi - lo) / 255
    zp = float(np.clip(np.round(-lo / s), 0, 255))
    return np.clip(np.round(x / s) + zp, 0, 255), s, zp


@pytest.mark.parametrize("case", ["test_dynamicquantizelinear", "test_dynamicquantizelinear_max_adjusted",
                                  "test_dynamicquantizelinear_min_adjusted"])
def test_dynamic_quantize_linear_scale_gradient_is_the_central_difference(case):
    _, model, (x,) = next(c for c in _node_cases()["DynamicQuantizeLinear"] if c[0] == case)
    g = rg.load(model)
    x = x.astype(np.float32)
    eps = 1e-6
    expected = np.array([(_dql_reference(x + eps * e)[1] - _dql_reference(x - eps * e)[1]) / (2 * eps)
                         for e in np.eye(x.size).reshape(x.size, *x.shape)]).reshape(x.shape)
    assert np.abs(expected).sum() > 0
    grad = rg.Session(rg.gradient(g, "y_scale", wrt=["x"])).run({"x": x})["x_grad"]
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-9)
    # forward mode: J t along a direction
    t = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    jt = rg.Session(rg.jvp(g, outputs=["y_scale"], inputs=["x"])).run({"x": x, "x_tangent": t})["y_scale_tangent"]
    np.testing.assert_allclose(jt, (expected * t).sum(), rtol=1e-5, atol=1e-9)


def _dql_model(tail: str) -> onnx.ModelProto:
    """x[4] -> DynamicQuantizeLinear -> loss = sum(w * dequantized): by hand from the integers (``integer``: what
    quantize_dynamic's MatMulInteger + Cast + Mul does) or with DequantizeLinear (``pair``)."""
    nodes = [h.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "zp"], name="dql")]
    if tail == "integer":
        nodes += [h.make_node("Cast", ["y"], ["yf"], to=TP.FLOAT), h.make_node("Cast", ["zp"], ["zf"], to=TP.FLOAT),
                  h.make_node("Sub", ["yf", "zf"], ["c"]), h.make_node("Mul", ["c", "s"], ["d"])]
    else:
        nodes += [h.make_node("DequantizeLinear", ["y", "s", "zp"], ["d"], name="dq")]
    nodes += [h.make_node("Mul", ["d", "w"], ["e"]), h.make_node("ReduceSum", ["e"], ["loss"], keepdims=0)]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, [4])],
                     [h.make_tensor_value_info("loss", TP.FLOAT, [])], [nh.from_array(W, "w")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 21)])


W = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
X = np.array([0.3, 0.9, -0.6, 0.2], np.float32)


def test_dynamic_quantize_linear_scale_path_of_a_quantize_dynamic_product():
    def loss(x):
        y, s, zp = _dql_reference(x)
        return float(((y - zp) * s * W).sum())

    x64, eps = X.astype(np.float64), 1e-7
    expected = np.array([(loss(x64 + eps * e) - loss(x64 - eps * e)) / (2 * eps) for e in np.eye(4)])
    assert expected[0] == 0 and expected[3] == 0 and expected[1] > 0 > expected[2]  # the max's and the min's
    # by hand: s = (0.9 - (-0.6)) / 255, the integers q = round(x / s) = [51, 153, -102, 34] are constant, so
    # loss = s * sum(q w) = s * 187 and d loss / dx = 187 ds/dx: +1/255 at the max (x1), -1/255 at the min (x2)
    np.testing.assert_allclose(expected, np.array([0.0, 187.0, -187.0, 0.0]) / 255, rtol=1e-6, atol=1e-9)
    g = rg.load(_dql_model("integer"))
    for straight_through in (False, True):  # the integers carry no gradient either way (their derivative is 0)
        grad = rg.Session(rg.gradient(g, "loss", wrt=["x"], straight_through=straight_through)).run({"x": X})
        np.testing.assert_allclose(grad["x_grad"], expected, rtol=1e-5)


def test_dynamic_quantize_linear_into_dequantize_linear_is_a_quantizer_pair():
    g = rg.load(_dql_model("pair"))
    with pytest.raises(rg.GraphError, match=r"'dql' \(DynamicQuantizeLinear\) -> DequantizeLinear.*straight_through"):
        rg.gradient(g, "loss", wrt=["x"])
    grad = rg.Session(rg.gradient(g, "loss", wrt=["x"], straight_through=True)).run({"x": X})["x_grad"]

    def fake_quant(x):  # PyTorch: the rounding passes the gradient, the zero point is an integer (detached)
        lo, hi = torch.clamp(x.min(), max=0), torch.clamp(x.max(), min=0)
        s = (hi - lo) / 255
        zp = torch.clamp(torch.round(-lo / s), 0, 255).detach()
        v = x / s
        y = torch.clamp(v + (torch.round(v) - v).detach() + zp, 0, 255)
        return ((y - zp) * s * torch.tensor(W, dtype=torch.float64)).sum()

    tx = torch.tensor(X.astype(np.float64), requires_grad=True)
    fake_quant(tx).backward()
    np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-5)


def test_a_float_to_float_bitcast_on_the_path_is_refused():
    g = h.make_graph([h.make_node("BitCast", ["x"], ["b"], to=TP.BFLOAT16, name="bc"),
                      h.make_node("Cast", ["b"], ["f"], to=TP.FLOAT), h.make_node("ReduceSum", ["f"], ["loss"])],
                     "g", [h.make_tensor_value_info("x", TP.FLOAT16, [3])],
                     [h.make_tensor_value_info("loss", TP.FLOAT, [1])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 26)])
    with pytest.raises(rg.GraphError, match=r"'bc' \(BitCast\).*no differentiable function"):
        rg.gradient(rg.load(model), "loss", wrt=["x"])
