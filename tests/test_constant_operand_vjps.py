"""VJPs specialized for constant operands and static sizes (issue 42, item 4, "fewer nodes per step").

Each specialization is checked three ways: :func:`kit.harness.check_rule` (float64 central differences, PyTorch
autograd, a Hessian-vector product against differences of the gradient graph, forward mode), second order
against ``torch.func.hessian`` in float64 (forward over reverse and reverse over reverse), also at exact zeros
where the partial derivative is 0 or infinite (strong zeros, DESIGN section 5: a zero cotangent gives an exact 0
where the partial is inf, at every order), and by node count: the specialized backward has the nodes the
formula needs, counted by hand below, and fewer than the general rule's, which the same graph gets when the
operand is not a constant (a graph input fed the same value) or the size is not static.

The specializations: ``Pow`` by a constant ``k`` (``2 x``, ``0.5 / y``, ``k x^(k-1)``, the identity for 1; no
``Log``, no test of ``k``), ``Div`` by a finite nonzero constant (``g / b``, one node), ``ReduceMean`` over axes
of static size (``g / n``, no ``Size`` arithmetic), a ``Slice`` that takes an axis whole (``0:INT64_MAX:1``, as
exporters write ``x[:, ...]``: no VJP nodes), the last ``Pad`` of a ``Slice``'s VJP typed as the input (no
``Reshape`` after it), the broadcast of a same-rank operand undone by a ``ReduceSum`` with ``keepdims=1``
alone (no ``Reshape``), and a ``Reshape`` VJP with one symbolic dimension reshaping to a constant with -1 (no
``Shape`` of a forward value read at run time).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from kit import zeros
from kit.harness import check_rule
from torch.func import hessian

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.float64
INT64_MAX = int(np.iinfo(np.int64).max)
GUARDS = ("Equal", "Or", "Where", "IsInf", "IsNaN", "Not")


def _graph(nodes: list[tuple], inputs: dict, consts: dict | None = None, shapes: dict | None = None,
           loss: bool = False) -> Graph:
    """``nodes``: ``(op, inputs, output, attrs)``, the first named ``op``; ``inputs``: graph inputs (their
    declared shape from ``shapes``, e.g. a symbolic batch, else the array's); ``consts``: initializers. With
    ``loss``, the last node's output is summed into ``loss``."""
    built = [Node(op, list(ins), [out], dict(attrs), "op" if k == 0 else f"n{k}_{op}")
             for k, (op, ins, out, attrs) in enumerate(nodes)]
    out = nodes[-1][2]
    if loss:
        built.append(Node("ReduceSum", [out], ["loss"], {"keepdims": 0}, "sum"))
        out = "loss"
    shapes = shapes or {}
    g = Graph(built, [ValueInfo(k, F64, shapes.get(k, np.shape(v))) for k, v in inputs.items()], [ValueInfo(out)],
              {k: np.asarray(v) for k, v in (consts or {}).items()})
    g.opsets = {"": 21}
    return g


def _vjp_ops(gg: Graph) -> Counter:
    """The op types of the nodes the VJP of the node named ``op`` emitted (``grad/op/...``), constants left out."""
    return Counter(n.op_type for _, n in gg.walk() if n.name.startswith("grad/op/") and n.op_type != "Constant")


def _sum_u(g: Graph, shape: tuple) -> tuple[Graph, np.ndarray]:
    """``g`` with its output weighted by a random ``u`` (a constant) and summed into ``loss``: a cotangent with
    no zeros, so the strong-zero tests are the only thing that depends on the values."""
    u = np.random.default_rng(42).standard_normal(shape)
    g = g.copy()
    y = g.outputs[0].name
    g.initializers["u"] = u
    g.nodes += [Node("Mul", [y, "u"], ["yu"], {}, "weigh"), Node("ReduceSum", ["yu"], ["loss"], {"keepdims": 0}, "sum")]
    g.outputs = [ValueInfo("loss")]
    return g, u


def _assert_hessian(g: Graph, feeds: dict, fn, exact_zero: tuple = ()) -> None:
    """The Hessian of ``loss`` (``rg.hessian``, forward over reverse) and the Jacobian of its gradient (reverse
    over reverse) against ``torch.func.hessian(fn)`` in float64; at the flat indices ``exact_zero`` of the
    diagonal (a zero cotangent where the partial is inf: torch gives NaN there) exactly 0."""
    (x,) = feeds
    want = hessian(fn)(torch.tensor(feeds[x], dtype=torch.float64)).numpy()
    gg = rg.gradient(g, "loss", wrt=[x])
    ways = {"forward over reverse": zeros.run(rg.hessian(g, "loss", [x]), feeds)[f"{x}_hessian"],
            "reverse over reverse": zeros.run(rg.jacobian(gg, outputs=[f"{x}_grad"], inputs=[x], mode="reverse"),
                                              feeds)[f"{x}_grad_jacobian_{x}"]}
    keep = np.ones(want.shape, bool)
    for i in exact_zero:
        keep[i, :] = keep[:, i] = False
    for way, got in ways.items():
        np.testing.assert_allclose(got[keep], want[keep], rtol=1e-10, atol=1e-12, err_msg=way)
        for i in exact_zero:
            assert got[i, i] == 0.0 and np.all(got[i] == 0) and np.all(got[:, i] == 0), (way, got)


# ------------------------------------------------------------------------------------------ Pow


POW_AT = {2.0: [0.0, 1.5, -2.0], 3.0: [0.0, 1.5, -2.0], 0.5: [0.0, 1.5, 2.0], -1.0: [0.0, 1.5, -2.0],
          1.0: [0.0, 1.5, -2.0]}


@pytest.mark.parametrize("k", list(POW_AT))
def test_pow_by_a_constant_against_differences_and_torch(k):
    x = np.array([0.7, 1.5, 2.25]) if k in (0.5, -1.0) else np.array([-0.7, 1.5, 2.25])
    g = _graph([("Pow", ["x", "k"], "y", {})], {"x": x}, {"k": np.array(k)})
    check_rule(g, {"x": x}, lambda x: x ** k)


@pytest.mark.parametrize("k", list(POW_AT))
def test_pow_by_a_constant_at_zero_first_and_second_order(k):
    # x = 0 with a zero cotangent there: for 0.5 and -1 the partial is inf at 0, and the gradient and every
    # entry of the Hessian in that row must be an exact 0 (torch: NaN); for 2, 3, 1 torch is the reference
    x = np.array(POW_AT[k])
    w = np.array([0.0, 1.0, -2.0]) if k < 1 else np.array([1.0, 1.0, -2.0])
    g = _graph([("Pow", ["x", "k"], "y", {}), ("Mul", ["y", "w"], "yw", {})], {"x": x}, {"k": np.array(k), "w": w},
               loss=True)
    fn = lambda t: (t ** k * torch.tensor(w)).sum()
    got = zeros.grads(g, ["x"], {"x": x})["x"]
    tx = torch.tensor(x, requires_grad=True)
    (want,) = torch.autograd.grad(fn(tx), [tx])
    if k < 1:
        assert got[0] == 0.0
        np.testing.assert_allclose(got[1:], want.numpy()[1:], rtol=1e-12)
    else:
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=0)
    _assert_hessian(g, {"x": x}, fn, exact_zero=(0,) if k < 1 else ())


@pytest.mark.parametrize("k", [2.0, 3.0, 0.5, 1.0])
def test_pow_by_a_constant_has_fewer_nodes(k):
    x = np.array([0.7, 1.5, 2.25])
    const = _graph([("Pow", ["x", "k"], "y", {})], {"x": x}, {"k": np.array(k)}, loss=True)
    fed = _graph([("Pow", ["x", "k"], "y", {})], {"x": x, "k": np.array(k)}, loss=True)  # p a graph input
    special, general = (_vjp_ops(rg.gradient(h, "loss", wrt=["x"])) for h in (const, fed))
    arithmetic = Counter({op: n for op, n in special.items() if op not in GUARDS})
    # by hand: 2 x then g * it; 0.5 / y then g * it; x^2 * 3 then g * it; nothing for x^1
    want = {2.0: {"Mul": 2}, 3.0: {"Pow": 1, "Mul": 2}, 0.5: {"Div": 1, "Mul": 1}, 1.0: {}}[k]
    assert arithmetic == Counter(want), special
    assert "Log" not in special and sum(special.values()) < sum(general.values()), (special, general)


# ------------------------------------------------------------------------------------------ Div


def test_div_by_a_constant_is_one_node():
    x, b = np.array([[0.0, 1.5, -2.0], [3.0, -0.25, 1.0]]), np.array([2.0, -0.5, 4.0])
    const = _graph([("Div", ["x", "b"], "y", {})], {"x": x}, {"b": b})
    check_rule(const, {"x": x}, lambda x: x / torch.tensor(b))
    fed = _graph([("Div", ["x", "b"], "y", {})], {"x": x, "b": b})
    special = _vjp_ops(rg.gradient(_sum_u(const, x.shape)[0], "loss", wrt=["x"]))
    general = _vjp_ops(rg.gradient(_sum_u(fed, x.shape)[0], "loss", wrt=["x"]))
    assert special == Counter({"Div": 1}), special  # g / b; b broadcasts along x's rows, nothing to reduce
    assert general["Reciprocal"] == 1 and sum(general.values()) > 1, general


def test_div_by_a_constant_second_order_and_strong_zeros():
    # d/dx of w * x^2 / b at x = 0 and a zero weight: exact zeros, the Hessian 2 w / b against torch
    x, b, w = np.array([0.0, 1.5, -2.0]), np.array([2.0, -0.5, 4.0]), np.array([0.0, 1.0, 3.0])
    g = _graph([("Mul", ["x", "x"], "xx", {}), ("Div", ["xx", "b"], "y", {}), ("Mul", ["y", "w"], "yw", {})],
               {"x": x}, {"b": b, "w": w}, loss=True)
    g.nodes[0].name, g.nodes[1].name = "square", "op"
    fn = lambda t: (t * t / torch.tensor(b) * torch.tensor(w)).sum()
    np.testing.assert_allclose(zeros.grads(g, ["x"], {"x": x})["x"], 2 * x * w / b, rtol=1e-15)
    _assert_hessian(g, {"x": x}, fn)


# ------------------------------------------------------------------------------------------ ReduceMean


def test_reduce_mean_over_static_axes_with_a_symbolic_batch():
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    nodes = [("ReduceMean", ["x", "axes"], "y", {"keepdims": 1})]
    g = _graph(nodes, {"x": x}, {"axes": np.array([-1], np.int64)}, shapes={"x": ("B", 3, 4)})
    check_rule(g, {"x": x}, lambda x: x.mean(-1, keepdim=True))
    dynamic = _graph(nodes, {"x": x}, {"axes": np.array([-1], np.int64)}, shapes={"x": ("B", 3, "D")})
    special = _vjp_ops(rg.gradient(_sum_u(g, (2, 3, 1))[0], "loss", wrt=["x"]))
    general = _vjp_ops(rg.gradient(_sum_u(dynamic, (2, 3, 1))[0], "loss", wrt=["x"]))
    # g / 4 expanded by [1, 1, 4]: the batch and the 3 broadcast from g itself, no Shape(x) read at run time
    assert special == Counter({"Div": 1, "Expand": 1}), special
    assert general["Size"] >= 1 and sum(special.values()) < sum(general.values()), general


def test_rms_norm_chain_second_order_at_zero():
    # RMSNorm as exported (Pow 2, ReduceMean, Add eps, Sqrt, Reciprocal, Mul), a row of zeros included
    x = np.array([[0.0, 0.0, 0.0], [0.5, -1.0, 2.0]])
    nodes = [("Pow", ["x", "two"], "p", {}), ("ReduceMean", ["p", "axes"], "m", {"keepdims": 1}),
             ("Add", ["m", "eps"], "a", {}), ("Sqrt", ["a"], "s", {}), ("Reciprocal", ["s"], "r", {}),
             ("Mul", ["x", "r"], "n", {}), ("Mul", ["n", "w"], "y", {})]
    w = np.array([1.0, -2.0, 0.5])
    consts = {"two": np.array(2.0), "axes": np.array([-1], np.int64), "eps": np.array(1e-6), "w": w}
    fn = lambda t: (t / torch.sqrt((t ** 2).mean(-1, keepdim=True) + 1e-6) * torch.tensor(w)).sum()
    _assert_hessian(_graph(nodes, {"x": x}, consts, loss=True), {"x": x}, fn)  # a Hessian needs static shapes
    # with a symbolic batch: the Hessian-vector product against differences of the gradient graph
    check_rule(_graph(nodes, {"x": x}, consts, shapes={"x": ("B", 3)}), {"x": x},
               lambda x: x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * torch.tensor(w))


# ------------------------------------------------------------------------------------------ Slice, reduce_to


def test_a_slice_taking_an_axis_whole_has_no_vjp_nodes():
    x = np.random.default_rng(1).standard_normal((2, 4))
    ins = {"s": np.array([0], np.int64), "a": np.array([0], np.int64)}
    whole = _graph([("Slice", ["x", "s", "e", "a"], "y", {})], {"x": x}, {**ins, "e": np.array([INT64_MAX])},
                   shapes={"x": ("B", 4)})
    check_rule(whole, {"x": x}, lambda x: x[:])
    # one short of INT64_MAX: whole for every real length, but not provably so: the general rule
    almost = _graph([("Slice", ["x", "s", "e", "a"], "y", {})], {"x": x}, {**ins, "e": np.array([INT64_MAX - 1])},
                    shapes={"x": ("B", 4)})
    special = _vjp_ops(rg.gradient(_sum_u(whole, x.shape)[0], "loss", wrt=["x"]))
    general = _vjp_ops(rg.gradient(_sum_u(almost, x.shape)[0], "loss", wrt=["x"]))
    assert special == Counter() and general["Pad"] == 1, (special, general)


def test_a_half_slice_with_a_symbolic_batch_is_one_pad():
    x = np.random.default_rng(2).standard_normal((2, 3, 4))
    consts = {"s": np.array([2], np.int64), "e": np.array([INT64_MAX]), "a": np.array([-1], np.int64)}
    g = _graph([("Slice", ["x", "s", "e", "a"], "y", {})], {"x": x}, consts, shapes={"x": ("B", "T", 4)})
    check_rule(g, {"x": x}, lambda x: x[..., 2:])
    special = _vjp_ops(rg.gradient(_sum_u(g, (2, 3, 2))[0], "loss", wrt=["x"]))
    assert special == Counter({"Pad": 1}), special  # the cotangent padded with 2 zeros in front, typed as x


def test_a_same_rank_broadcast_is_undone_by_one_reduce_sum():
    # x * r with r [B, T, 1] (RMSNorm's x * rsqrt): r's cotangent is ReduceSum(g * x, -1, keepdims=1), no Reshape
    x, r = np.random.default_rng(3).standard_normal((2, 3, 4)), np.array([[[0.5], [2.0], [-1.0]]] * 2)
    g = _graph([("Mul", ["x", "r"], "y", {})], {"x": x, "r": r}, shapes={"x": ("B", 3, 4), "r": ("B", 3, 1)})
    check_rule(g, {"x": x, "r": r}, lambda x, r: x * r)
    special = _vjp_ops(rg.gradient(_sum_u(g, x.shape)[0], "loss", wrt=["r"]))
    arithmetic = Counter({op: n for op, n in special.items() if op not in GUARDS})  # x may be inf: a strong product
    assert arithmetic == Counter({"Mul": 1, "ReduceSum": 1}), special


def test_a_linear_layers_weight_gradient_is_a_gemm_and_a_transpose():
    # x @ Transpose(W) (PyTorch's linear as exported): dW = (x^T g)^T, the MatMul VJP's Gemm and the Transpose
    # VJP's Transpose; simplify does not fold them into Gemm(g, x) (g^T x): with the fold, onnxruntime's default
    # order raised the LLaMA step's peak by 13-28% (simplify's module doc)
    x, w = np.random.default_rng(4).standard_normal((2, 3, 4)), np.random.default_rng(5).standard_normal((5, 4))
    nodes = [("Transpose", ["W"], "Wt", {"perm": [1, 0]}), ("MatMul", ["x", "Wt"], "y", {})]
    g = _graph(nodes, {"x": x, "W": w}, shapes={"x": ("B", 3, 4)})
    check_rule(g, {"x": x, "W": w}, lambda x, W: x @ W.T)
    gg = rg.gradient(_sum_u(g, (2, 3, 5))[0], "loss", wrt=["x", "W"])
    assert _vjp_ops(gg) == Counter({"Transpose": 1}), _vjp_ops(gg)  # (the Gemm is the MatMul VJP's)


def test_where_with_a_constant_branch_builds_nothing_for_it():
    # Where(c, x, b) with b a constant: x's cotangent is the selection g * Cast(c) (exactly 0 where c is false)
    # and nothing is built for b; the same with b a graph input that needs no gradient
    x, c, b = np.array([[1.0, -2.0, 3.0]]), np.array([True, False, True]), np.array([0.0, 5.0, 1.0])
    g = _graph([("Where", ["c", "x", "b"], "y", {})], {"x": x}, {"c": c, "b": b})
    got = check_rule(g, {"x": x}, lambda x: torch.where(torch.tensor(c), x, torch.tensor(b)))
    assert np.all(got["x"][:, 1] == 0.0) and np.all(got["x"][:, [0, 2]] != 0.0)
    special = _vjp_ops(rg.gradient(_sum_u(g, x.shape)[0], "loss", wrt=["x"]))
    assert special == Counter({"Cast": 1, "Mul": 1}), special


def test_a_reshape_with_a_symbolic_batch_reads_no_shape():
    # the VJP of Reshape [B, 3, 4] -> [B, 12] is a Reshape back to [-1, 3, 4] (a constant: g has x's element
    # count, so -1 is B), where it read Shape(x) at run time; with two symbolic dimensions it still reads it
    x = np.random.default_rng(6).standard_normal((2, 3, 4))
    consts = {"s": np.array([0, 12], np.int64)}
    one = _graph([("Reshape", ["x", "s"], "y", {})], {"x": x}, consts, shapes={"x": ("B", 3, 4)})
    check_rule(one, {"x": x}, lambda x: x.reshape(-1, 12))
    two = _graph([("Reshape", ["x", "s"], "y", {})], {"x": x}, consts, shapes={"x": ("B", "T", 4)})
    special = _vjp_ops(rg.gradient(_sum_u(one, (2, 12))[0], "loss", wrt=["x"]))
    general = _vjp_ops(rg.gradient(_sum_u(two, (2, 12))[0], "loss", wrt=["x"]))
    assert special == Counter({"Reshape": 1}) and general == Counter({"Reshape": 1, "Shape": 1}), (special, general)
