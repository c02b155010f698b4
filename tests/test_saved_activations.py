"""Rules read outputs where the derivative is a function of the output (issue 24, part 1; DESIGN.md section 3,
"Rules"): the residuals a gradient graph keeps, counted by hand, and the gradients of the rules that read ``y``
instead of ``x`` against float64 central differences and torch.autograd (``harness.check_rule``: also second
order and forward mode) at ordinary points, and against the documented conventions at the special points (0,
-0, subnormals, +-inf, NaN, the kinks; zero cotangents; infinite cotangents on the unselected side).

The counts: every graph below is ``x [2, 3] -> MatMul(w1 [3, 4]) -> m -> Add(b1) -> h [2, 4] -> act -> r [2, 4]
-> MatMul(w2 [4, 5]) -> o -> ReduceSum -> loss`` in float32 with static shapes, so a [2, 4] activation is 32
bytes. ``x`` is a graph input and the weights are initializers: never residuals. The second MatMul's weight
gradient ``r^T do`` reads ``r``; Add's and ReduceSum's VJPs read no value (static shapes); the first MatMul's
weight gradient reads ``x``. So the residuals are ``r`` plus whatever ``act``'s VJP reads: nothing more for a
rule that reads its output, ``h`` for one that reads its input.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit.harness import check_rule, one_node_graph

import revgraph as rg
from revgraph.autodiff.memory import residuals, saved_bytes
from revgraph.ir import Graph, Node, ValueInfo

F = torch.nn.functional
F32 = np.float32
ACT = 2 * 4 * 4  # bytes of one [2, 4] float32 activation
WRT = ["w1", "b1", "w2"]
SELU_ALPHA, SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875  # ONNX defaults (float32)


def _layer(op: str, attrs: dict | None = None, inits: dict | None = None, extra_inputs=(), n_out: int = 1) -> Graph:
    """The graph of the module doc with ``act = op(h, *extra_inputs)`` (``inits`` holds the extra inputs)."""
    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((3, 4)).astype(F32), "b1": np.zeros(4, F32),
              "w2": rng.standard_normal((4, 5)).astype(F32), **(inits or {})}
    outs = ["r", *[f"r_extra{i}" for i in range(1, n_out)]]
    nodes = [Node("MatMul", ["x", "w1"], ["m"], name="mm1"), Node("Add", ["m", "b1"], ["h"], name="bias"),
             Node(op, ["h", *extra_inputs], outs, dict(attrs or {}), name="act"),
             Node("MatMul", ["r", "w2"], ["o"], name="mm2"),
             Node("ReduceSum", ["o"], ["loss"], {"keepdims": 0}, name="sum")]
    return Graph(nodes, [ValueInfo("x", F32, (2, 3))], [ValueInfo("loss", F32, ())], params)


# ---------------------------------------------------------------------------------------------- saved bytes

# (op, attributes, residuals besides r). Output-based: the rule's VJP reads only r, which the next MatMul keeps
# anyway, so the total is one activation (32 bytes) where reading h cost two (64).
OUTPUT_BASED = [
    ("Relu", {}),                                            # g * (r > 0)
    ("LeakyRelu", {"alpha": 0.1}),                           # Where(r > 0, g, alpha g)
    ("LeakyRelu", {"alpha": 0.0}),                           # alpha 0: r = 0 * h = -0 for h < 0, not > 0
    ("ThresholdedRelu", {"alpha": 0.5}),                     # g * (r > alpha)
    ("HardSigmoid", {"alpha": 0.25, "beta": 0.5}),           # alpha g * (0 < r < 1)
    ("Elu", {"alpha": 1.0}),                                 # Where(r > 0, 1, r + alpha)
    ("Selu", {}),                                            # Where(r > 0, gamma, r + gamma alpha)
    ("Celu", {"alpha": 1.5}),                                # Where(r > 0, 1, r / alpha + 1)
    # already output-based before issue 24 (kept here so that none goes back to reading h)
    ("Sigmoid", {}), ("Tanh", {}), ("Exp", {}), ("Sqrt", {}), ("Reciprocal", {}), ("Softmax", {}),
    ("LogSoftmax", {}), ("Tan", {}),
]
# Input-based: the derivative is no exact function of the output (Gelu, Softplus: 1 - exp(-r) cancels), or an
# attribute makes r's sign differ from h's (a negative slope, Selu's gamma < 1 rounding a subnormal gamma h to
# 0): the rule reads h, so both are kept.
INPUT_BASED = [
    ("Gelu", {}), ("Softplus", {}), ("Softsign", {}), ("Mish", {}), ("HardSwish", {}), ("Shrink", {}),
    ("LeakyRelu", {"alpha": -0.5}), ("Elu", {"alpha": -0.5}), ("ThresholdedRelu", {"alpha": -0.5}),
    ("Selu", {"gamma": 0.5}), ("Selu", {"alpha": -1.0}),
]


@pytest.mark.parametrize("op,attrs", OUTPUT_BASED, ids=[f"{o}{a}" for o, a in OUTPUT_BASED])
def test_rules_that_read_their_output_keep_one_activation(op, attrs):
    gg = rg.gradient(_layer(op, attrs), "loss", WRT)
    assert "r" in _reads_of(gg, "act") and "h" not in _reads_of(gg, "act")
    assert residuals(gg) == ["r"]
    assert saved_bytes(gg) == ACT  # r only: 2 x 4 float32


def _reads_of(gg: Graph, node_name: str) -> set[str]:
    """The values the backward nodes of the forward node ``node_name`` read."""
    return {i for n in gg.nodes if n.name.startswith(f"grad/{node_name}/") for i in n.inputs if i}


@pytest.mark.parametrize("op,attrs", INPUT_BASED, ids=[f"{o}{a}" for o, a in INPUT_BASED])
def test_rules_that_read_their_input_keep_both(op, attrs):
    gg = rg.gradient(_layer(op, attrs), "loss", WRT)
    assert "h" in _reads_of(gg, "act")
    # h and r, 32 bytes each (r could only go if the memory plan recomputed it from h: still 32 bytes a residual)
    assert "h" in residuals(gg) and set(residuals(gg)) <= {"h", "r"}
    assert saved_bytes(gg) == ACT * len(residuals(gg))


def test_mlp_keeps_the_relu_outputs_not_their_inputs():
    # x [2, 3] -> MatMul(w1) -> h1 [2, 4] -> Relu -> r1 -> MatMul(w2) -> h2 [2, 6] -> Relu -> r2 -> MatMul(w3) ->
    # o [2, 5] -> ReduceSum. The weight gradients read x (an input), r1 (w2's) and r2 (w3's); the Relu VJPs read
    # r1 and r2 too. Before issue 24 they read h1 and h2: 32 + 48 more bytes.
    rng = np.random.default_rng(0)
    inits = {"w1": rng.standard_normal((3, 4)).astype(F32), "w2": rng.standard_normal((4, 6)).astype(F32),
             "w3": rng.standard_normal((6, 5)).astype(F32)}
    nodes = [Node("MatMul", ["x", "w1"], ["h1"], name="mm1"), Node("Relu", ["h1"], ["r1"], name="relu1"),
             Node("MatMul", ["r1", "w2"], ["h2"], name="mm2"), Node("Relu", ["h2"], ["r2"], name="relu2"),
             Node("MatMul", ["r2", "w3"], ["o"], name="mm3"), Node("ReduceSum", ["o"], ["loss"], {"keepdims": 0})]
    g = Graph(nodes, [ValueInfo("x", F32, (2, 3))], [ValueInfo("loss", F32, ())], inits)
    gg = rg.gradient(g, "loss", ["w1", "w2", "w3"])
    assert residuals(gg) == ["r1", "r2"]
    assert saved_bytes(gg) == 2 * 4 * 4 + 2 * 6 * 4  # r1 [2, 4] + r2 [2, 6], float32
    # the gradients are those of PyTorch
    x = rng.standard_normal((2, 3)).astype(F32)
    out = rg.Session(gg).run({"x": x})
    t = {k: torch.tensor(v, requires_grad=True) for k, v in inits.items()}
    (torch.relu(torch.relu(torch.tensor(x) @ t["w1"]) @ t["w2"]) @ t["w3"]).sum().backward()
    for k in inits:
        np.testing.assert_allclose(out[f"{k}_grad"], t[k].grad.numpy(), rtol=1e-5, atol=1e-6)


def test_training_dropout_keeps_its_mask():
    # Dropout(h, ratio 0.5, training): dh = do * mask / (1 - ratio). The rule reads the mask output it asks the
    # forward node to write (bool, 1 byte an element: 8 bytes), not h; r is kept for w2's gradient (32).
    extra = {"ratio": np.array(0.5, F32), "training": np.array(True)}
    gg = rg.gradient(_layer("Dropout", {"seed": 0}, extra, ("ratio", "training")), "loss", WRT)
    assert residuals(gg) == ["r", "act/mask"]
    assert saved_bytes(gg) == ACT + 2 * 4


@pytest.mark.parametrize("op", ["LayerNormalization", "BatchNormalization"])
def test_normalizations_keep_their_input_and_no_statistics(op):
    # LayerNormalization(h, scale, bias) over the last axis; BatchNormalization in training mode over the batch
    # ([N, C] = [2, 4]). Their VJPs read h (and the scale, an initializer) and recompute mean and inverse
    # standard deviation from it in the backward pass: no statistic is kept, and no copy of h (h is what
    # PyTorch's native_layer_norm / batch_norm save too, with the statistics beside it). r is kept for w2's
    # gradient: 32 + 32 bytes.
    vec = {"s": np.full(4, 1.5, F32), "bb": np.full(4, 0.25, F32)}
    if op == "LayerNormalization":
        g = _layer(op, {"axis": -1}, vec, ("s", "bb"))
    else:
        stats = {"mean": np.zeros(4, F32), "var": np.ones(4, F32)}
        g = _layer(op, {"training_mode": 1}, {**vec, **stats}, ("s", "bb", "mean", "var"), n_out=3)
    gg = rg.gradient(g, "loss", [*WRT, "s", "bb"])
    assert "h" in _reads_of(gg, "act") and "r" not in _reads_of(gg, "act")
    assert "h" in residuals(gg) and set(residuals(gg)) <= {"h", "r"}  # (r: unless the plan recomputes it)
    assert saved_bytes(gg) == ACT * len(residuals(gg))


# ---------------------------------------------------------------------------------------------- gradients


def _away(x: np.ndarray, kinks, margin: float = 1e-3) -> np.ndarray:
    """``x`` with points closer than ``margin`` to a kink moved off it (central differences would straddle it)."""
    for k in kinks:
        x = np.where(np.abs(x - k) < margin, k + 10 * margin, x)
    return x


def _f32(v: float) -> float:
    return float(np.float32(v))


# op, attributes, torch function, kinks; both branches of every attribute condition in the rules
CASES = [
    ("Relu", {}, torch.relu, [0.0]),
    ("LeakyRelu", {"alpha": 0.25}, lambda x: F.leaky_relu(x, 0.25), [0.0]),
    ("LeakyRelu", {"alpha": -0.5}, lambda x: F.leaky_relu(x, -0.5), [0.0]),
    ("Elu", {"alpha": 0.75}, lambda x: F.elu(x, 0.75), [0.0]),
    ("Elu", {"alpha": -0.5}, lambda x: torch.where(x > 0, x, -0.5 * torch.expm1(x)), [0.0]),
    ("Selu", {}, lambda x: SELU_GAMMA * F.elu(x, SELU_ALPHA), [0.0]),
    ("Selu", {"alpha": 1.5, "gamma": 0.5}, lambda x: 0.5 * F.elu(x, 1.5), [0.0]),
    ("Selu", {"alpha": -1.0, "gamma": 2.0}, lambda x: 2.0 * torch.where(x > 0, x, -torch.expm1(x)), [0.0]),
    ("ThresholdedRelu", {"alpha": 0.5}, lambda x: F.threshold(x, 0.5, 0.0), [0.5]),
    ("ThresholdedRelu", {"alpha": -0.5}, lambda x: F.threshold(x, -0.5, 0.0), [-0.5]),
    ("HardSigmoid", {"alpha": 0.25, "beta": 0.5}, lambda x: torch.clamp(0.25 * x + 0.5, 0, 1), [-2.0, 2.0]),
    ("HardSigmoid", {"alpha": -0.5, "beta": 0.25}, lambda x: torch.clamp(-0.5 * x + 0.25, 0, 1), [-1.5, 0.5]),
    ("Sigmoid", {}, torch.sigmoid, []),
    ("Tanh", {}, torch.tanh, []),
    ("Exp", {}, torch.exp, []),
]


@pytest.mark.parametrize("op,attrs,fn,kinks", CASES, ids=[f"{c[0]}{c[1]}" for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradients_at_ordinary_points(op, attrs, fn, kinks, seed):
    # float64: central differences of the ONNX forward (the reference evaluator where onnxruntime has no float64
    # kernel), torch.autograd, the Hessian-vector product and forward mode (check_rule)
    x = _away(np.random.default_rng(seed).standard_normal((3, 4)) * 3, kinks)
    check_rule(one_node_graph(op, {"x": x}, attrs), {"x": x}, fn)


@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.0])
def test_celu_gradients_against_torch(alpha):
    # ONNX defines Celu for float32 only: PyTorch's float64 gradient of the same float32 points
    x = _away(np.random.default_rng(3).standard_normal((3, 4)).astype(F32) * 3, [0.0]).astype(F32)
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    F.celu(tx, alpha).sum().backward()
    for backend in ("onnxruntime", "reference"):
        got = _grad(one_node_graph("Celu", {"x": x}, {"alpha": alpha}), {"x": x}, backend)
        np.testing.assert_allclose(got, tx.grad.numpy(), rtol=2e-6, atol=1e-7, err_msg=backend)


def _grad(g: Graph, feeds: dict, backend: str, loss: str = "y0") -> np.ndarray:
    """The gradient of ``sum(loss)`` with respect to ``x``."""
    gg = rg.gradient(g, loss=loss, wrt=["x"])
    with np.errstate(all="ignore"):
        return rg.Session(gg, backend=backend).run(feeds)["x_grad"]


# 0, -0, the smallest subnormals, tiny and huge values of both signs, +-inf and NaN (float32)
SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 3.0,
                    -3.0, 50.0, -50.0, 1e30, -1e30, np.inf, -np.inf, np.nan], F32)


def _expected(op: str, attrs: dict, x: np.ndarray) -> np.ndarray:
    """The derivative as a function of the input, in float64 (the formulas the rules wrote before reading y)."""
    x = x.astype(np.float64)
    with np.errstate(all="ignore"):
        if op == "Relu":
            return (x > 0).astype(np.float64)
        if op == "LeakyRelu":
            return np.where(x > 0, 1.0, _f32(attrs["alpha"]))
        if op == "Elu":
            return np.where(x > 0, 1.0, _f32(attrs["alpha"]) * np.exp(x))
        if op == "Selu":
            a, gm = _f32(attrs.get("alpha", SELU_ALPHA)), _f32(attrs.get("gamma", SELU_GAMMA))
            return np.where(x > 0, gm, gm * a * np.exp(x))
        if op == "Celu":
            a = _f32(attrs["alpha"])
            return np.where(x > 0, 1.0, np.exp(x / a))
        if op == "ThresholdedRelu":
            return (x > _f32(attrs["alpha"])).astype(np.float64)
        if op == "HardSigmoid":
            t = x * _f32(attrs["alpha"]) + _f32(attrs["beta"])
            return np.where((t > 0) & (t < 1), _f32(attrs["alpha"]), 0.0)
    raise AssertionError(op)


SPECIAL_CASES = [
    ("Relu", {}), ("LeakyRelu", {"alpha": 0.01}), ("LeakyRelu", {"alpha": 0.0}), ("Elu", {"alpha": 1.0}),
    ("Elu", {"alpha": 0.5}), ("Selu", {}), ("Celu", {"alpha": 1.0}), ("Celu", {"alpha": 2.0}),
    ("ThresholdedRelu", {"alpha": 1.0}), ("ThresholdedRelu", {"alpha": 0.0}),
    ("HardSigmoid", {"alpha": 0.25, "beta": 0.5}),
]
MASKS = ("Relu", "ThresholdedRelu", "HardSigmoid")  # selections: exact 0 or g


@pytest.mark.parametrize("op,attrs", SPECIAL_CASES, ids=[f"{o}{a}" for o, a in SPECIAL_CASES])
@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_gradients_at_special_points(op, attrs, backend):
    # seed ones: the gradient is the derivative itself, which must be the input-based formula's everywhere,
    # also at 0 (the 0 subgradient; the left piece for LeakyRelu, Elu, Selu), at subnormals (alpha h rounds to
    # -0), at +-inf (Elu's y + alpha = 0 exactly at -inf) and at NaN (no mask is true; NaN where the slope is)
    got = _grad(one_node_graph(op, {"x": SPECIAL}, attrs), {"x": SPECIAL}, backend)
    want = _expected(op, attrs, SPECIAL)
    if op in MASKS or op == "LeakyRelu":
        np.testing.assert_array_equal(got, want.astype(F32))
    else:  # y + alpha rounds where alpha exp(x) is computed directly
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and torch.autograd's at every non-NaN point where its convention is the same (HardSigmoid: torch's
    # clamp passes the gradient at the bounds; PyTorch's masks pass a NaN's gradient)
    if op == "HardSigmoid":
        return
    finite = ~np.isnan(SPECIAL)
    tx = torch.tensor(SPECIAL[finite].astype(np.float64), requires_grad=True)
    fns = {"Relu": torch.relu, "LeakyRelu": lambda t: F.leaky_relu(t, _f32(attrs.get("alpha", 0.01))),
           "Elu": lambda t: F.elu(t, _f32(attrs.get("alpha", 1.0))),
           "Selu": lambda t: _f32(SELU_GAMMA) * F.elu(t, _f32(SELU_ALPHA)),
           "Celu": lambda t: F.celu(t, _f32(attrs.get("alpha", 1.0))),
           "ThresholdedRelu": lambda t: F.threshold(t, _f32(attrs.get("alpha", 1.0)), 0.0)}
    fns[op](tx).sum().backward()
    np.testing.assert_allclose(got[finite], tx.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_hard_sigmoid_matches_torch_hardsigmoid():
    # ONNX HardSwish's constants (alpha = 1/6 in float32, beta = 1/2) are PyTorch's hardsigmoid, whose backward
    # takes the 0 subgradient at both kinks (-3 < x < 3), as revgraph does
    x = np.array([-4.0, -3.0, -2.9, -1.0, 0.0, 1.0, 2.9, 3.0, 4.0, np.inf, -np.inf], F32)
    tx = torch.tensor(x, requires_grad=True)
    F.hardsigmoid(tx).sum().backward()
    for backend in ("onnxruntime", "reference"):
        got = _grad(one_node_graph("HardSigmoid", {"x": x}, {"alpha": 1 / 6, "beta": 0.5}), {"x": x}, backend)
        np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-6, err_msg=backend)


def _times_w(op: str, attrs: dict, x: np.ndarray, w: np.ndarray) -> tuple[Graph, dict]:
    """``loss = sum(op(x) * w)``: ``w`` is the cotangent of ``op(x)``."""
    nodes = [Node(op, ["x"], ["y"], dict(attrs), name="act"), Node("Mul", ["y", "w"], ["yw"], name="mul"),
             Node("ReduceSum", ["yw"], ["loss"], {"keepdims": 0}, name="sum")]
    g = Graph(nodes, [ValueInfo("x", F32, x.shape), ValueInfo("w", F32, w.shape)], [ValueInfo("loss", F32, ())])
    return g, {"x": x, "w": w}


@pytest.mark.parametrize("op,attrs", [("Elu", {"alpha": 1.0}), ("Selu", {}), ("Celu", {"alpha": 1.0})])
@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_zero_cotangent_gives_zero_at_nan_and_inf(op, attrs, backend):
    # strong zeros: where the cotangent is 0 the contribution is 0, also where the slope read from y is NaN
    x = np.array([np.nan, np.inf, -np.inf, -1.0, 1.0, np.nan], F32)
    w = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 2.0], F32)
    got = _grad(*_times_w(op, attrs, x, w), backend, loss="loss")
    np.testing.assert_array_equal(got[:5], 0.0)
    assert np.isnan(got[5])


@pytest.mark.parametrize("op,attrs,x", [("Relu", {}, [-1.0, 0.0, -0.0, 2.0]),
                                        ("ThresholdedRelu", {"alpha": 0.5}, [0.25, 0.5, 0.0, 2.0]),
                                        ("HardSigmoid", {"alpha": 0.25, "beta": 0.5}, [-3.0, 2.0, -2.0, 1.0])])
@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_selection_sends_zero_for_an_infinite_cotangent_where_unselected(op, attrs, x, backend):
    # a mask read from y selects as the one read from x did: an inf or NaN cotangent on the unselected side
    # gives an exact 0 (DESIGN section 5, selection VJPs)
    x = np.array(x, F32)
    w = np.array([np.inf, np.nan, -np.inf, 1.0], F32)
    got = _grad(*_times_w(op, attrs, x, w), backend, loss="loss")
    slope = 0.25 if op == "HardSigmoid" else 1.0
    np.testing.assert_array_equal(got, np.array([0.0, 0.0, 0.0, slope], F32))


def test_in_place_relu_reads_its_output_version():
    # Relu(h) -> h (an in-place write, as Caffe2 nets do): the VJP reads the new version h__v1, the old one is
    # not kept (MatMul(w2) reads h__v1 too)
    rng = np.random.default_rng(0)
    inits = {"w1": rng.standard_normal((3, 4)).astype(F32), "w2": rng.standard_normal((4, 5)).astype(F32)}
    nodes = [Node("MatMul", ["x", "w1"], ["h"], name="mm1"), Node("Relu", ["h"], ["h"], name="relu"),
             Node("MatMul", ["h", "w2"], ["o"], name="mm2"), Node("ReduceSum", ["o"], ["loss"], {"keepdims": 0})]
    g = Graph(nodes, [ValueInfo("x", F32, (2, 3))], [ValueInfo("loss", F32, ())], inits)
    gg = rg.gradient(g, "loss", ["w1", "w2"])
    assert len(residuals(gg)) == 1 and saved_bytes(gg) == ACT
    x = rng.standard_normal((2, 3)).astype(F32)
    out = rg.Session(gg).run({"x": x})
    t = {k: torch.tensor(v, requires_grad=True) for k, v in inits.items()}
    (torch.relu(torch.tensor(x) @ t["w1"]) @ t["w2"]).sum().backward()
    for k in inits:
        np.testing.assert_allclose(out[f"{k}_grad"], t[k].grad.numpy(), rtol=1e-5, atol=1e-6)
