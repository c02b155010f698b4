"""VJP rules of MatMul, Gemm, Einsum and Det, checked three ways by tests/kit/harness.py (central differences,
PyTorch autograd, second order); Det also at singular matrices."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from kit.harness import check_rule, one_node_graph, with_loss

import revgraph as rg
from revgraph.errors import GraphError
from revgraph.ir import Node, ValueInfo

FAST = settings(max_examples=8, deadline=None)


def floats(feeds: dict) -> dict:
    return {k: v for k, v in feeds.items() if v.dtype.kind == "f"}


def symbolic(g, names):
    """``g`` with the named inputs' dimensions unknown (symbols), so rules take their Shape-based paths."""
    g.inputs = [
        ValueInfo(v.name, v.dtype, tuple(f"{v.name}{i}" for i in range(len(v.shape)))) if v.name in names else v
        for v in g.inputs
    ]
    return g


# ------------------------------------------------------------------------------------------ MatMul


@st.composite
def matmul_case(draw):
    batch = draw(mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3))
    n, k, m = (draw(st.integers(1, 4)) for _ in range(3))
    a_vec, b_vec = draw(st.booleans()), draw(st.booleans())
    sa = (k,) if a_vec else (*batch.input_shapes[0], n, k)
    sb = (k,) if b_vec else (*batch.input_shapes[1], k, m)
    return sa, sb, draw(st.integers(0, 2**31 - 1))


@FAST
@given(matmul_case())
def test_matmul_broadcast_and_vectors(case):
    sa, sb, seed = case
    rng = np.random.default_rng(seed)
    feeds = {"a": rng.standard_normal(sa), "b": rng.standard_normal(sb)}
    check_rule(one_node_graph("MatMul", feeds), feeds, lambda a, b: torch.matmul(a, b), seed=seed)


@pytest.mark.parametrize("sa, sb", [((4,), (4,)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)), ((3, 1, 2, 4), (5, 4, 2))])
def test_matmul_vector_operands(sa, sb):
    rng = np.random.default_rng(1)
    feeds = {"a": rng.standard_normal(sa), "b": rng.standard_normal(sb)}
    check_rule(one_node_graph("MatMul", feeds), feeds, lambda a, b: torch.matmul(a, b))


def test_matmul_one_operand_wanted():
    rng = np.random.default_rng(2)
    feeds = {"a": rng.standard_normal((2, 3, 4)), "b": rng.standard_normal((4, 5))}
    grads = check_rule(one_node_graph("MatMul", feeds), feeds, lambda a, b: torch.matmul(a, b), wrt=["b"])
    assert set(grads) == {"b"}


@pytest.mark.parametrize("sa", [(2, 3, 4), (2, 1, 3, 4)])
def test_matmul_weight_gradient_is_one_gemm_over_the_batch(sa):
    # A batch of activations times a matrix: dB is A flattened to [-1, k], transposed, times dY flattened.
    rng = np.random.default_rng(5)
    feeds = {"a": rng.standard_normal(sa), "b": rng.standard_normal((4, 5))}
    g = one_node_graph("MatMul", feeds)
    check_rule(g, feeds, lambda a, b: torch.matmul(a, b))
    ops = [n.op_type for n in rg.gradient(g, wrt=["b"]).nodes]
    assert "Gemm" in ops and "ReduceSum" not in ops


def test_matmul_unknown_dimensions():
    rng = np.random.default_rng(3)
    feeds = {"a": rng.standard_normal((2, 1, 3, 4)), "b": rng.standard_normal((5, 4, 2))}
    g = symbolic(one_node_graph("MatMul", feeds), ["a", "b"])
    check_rule(g, feeds, lambda a, b: torch.matmul(a, b))


def test_matmul_unknown_rank_is_an_error():
    g = one_node_graph("MatMul", {"a": np.zeros((2, 3)), "b": np.zeros((3, 2))})
    g.inputs = [ValueInfo(v.name, v.dtype, None) for v in g.inputs]
    lg, _ = with_loss(g, {"y0": np.zeros((2, 2))})
    with pytest.raises(GraphError, match="rank"):
        rg.gradient(lg, loss="loss", wrt=["a"])


# ------------------------------------------------------------------------------------------ Gemm


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (), (5,), (1, 5), (3, 1), (3, 5)])
def test_gemm(trans_a, trans_b, c_shape):
    rng = np.random.default_rng(trans_a * 7 + trans_b * 3 + len(c_shape or "xy"))
    m, k, n = 3, 4, 5
    alpha, beta = 0.75, -1.25  # exact in float32, the type of ONNX float attributes
    feeds = {
        "a": rng.standard_normal((k, m) if trans_a else (m, k)),
        "b": rng.standard_normal((n, k) if trans_b else (k, n)),
    }
    if c_shape is not None:
        feeds["c"] = rng.standard_normal(c_shape)

    def ref(a, b, c=None):
        y = alpha * (a.T if trans_a else a) @ (b.T if trans_b else b)
        return y if c is None else y + beta * c

    attrs = {"alpha": alpha, "beta": beta, "transA": trans_a, "transB": trans_b}
    check_rule(one_node_graph("Gemm", feeds, attrs), feeds, ref)


def test_gemm_default_attributes():
    rng = np.random.default_rng(5)
    feeds = {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal((3, 4)), "c": rng.standard_normal((4,))}
    check_rule(one_node_graph("Gemm", feeds), feeds, lambda a, b, c: a @ b + c)


def test_gemm_missing_c_input_name():
    rng = np.random.default_rng(6)
    feeds = {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal((3, 4))}
    g = one_node_graph("Gemm", feeds, {"alpha": 2.0})
    g.nodes[0].inputs.append("")
    check_rule(g, feeds, lambda a, b: 2.0 * a @ b)


# ------------------------------------------------------------------------------------------ Einsum

EQUATIONS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),  # matmul
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),  # batched
    ("i,j->ij", [(3,), (4,)]),  # outer product
    ("i,i->", [(4,), (4,)]),  # dot
    ("ij,ij->ij", [(3, 4), (3, 4)]),  # elementwise
    ("ij->ji", [(3, 4)]),  # transpose
    ("ij->i", [(3, 4)]),  # summed out
    ("ij->", [(3, 4)]),  # everything summed
    ("ijk->ki", [(2, 3, 4)]),
    ("ii->i", [(3, 3)]),  # diagonal
    ("ii->", [(4, 4)]),  # trace
    ("iii->i", [(3, 3, 3)]),
    ("iij,kj->ik", [(3, 3, 2), (4, 2)]),  # diagonal and contraction
    ("bii,bj->bij", [(2, 3, 3), (2, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output
    ("ba,ca", [(3, 4), (2, 4)]),  # implicit output, letters reordered
    ("ij , jk -> ki", [(3, 4), (4, 2)]),  # spaces
    ("ijk,ikl,j->il", [(2, 3, 4), (2, 4, 5), (3,)]),  # three operands
    ("aB,Bc->ca", [(2, 3), (3, 4)]),  # upper case
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 5, 4, 2)]),  # broadcast batch
    ("...ij,jk->...ik", [(2, 3, 3, 4), (4, 5)]),  # ellipsis in one operand only
    ("i...j,j->i...", [(2, 3, 4), (4,)]),  # ellipsis in the middle
    ("i...,i...->...", [(3, 2, 1), (3, 1, 4)]),  # trailing ellipsis, broadcast
    ("...ii->...i", [(2, 3, 3)]),  # batched diagonal
    ("...ii", [(2, 3, 3)]),  # batched trace, implicit
    ("...,...->...", [(2, 3), (1, 3)]),  # only an ellipsis
    ("ij,j->", [(3, 4), (4,)]),
]


def _torch_einsum(equation):
    def fn(**ops):
        return torch.einsum(equation.replace(" ", ""), *ops.values())

    return fn


@pytest.mark.parametrize("equation, shapes", EQUATIONS, ids=[eq for eq, _ in EQUATIONS])
def test_einsum(equation, shapes):
    rng = np.random.default_rng(len(equation))
    feeds = {name: rng.standard_normal(s) for name, s in zip("abc", shapes, strict=False)}
    g = one_node_graph("Einsum", feeds, {"equation": equation})
    check_rule(g, feeds, _torch_einsum(equation))


@pytest.mark.parametrize("equation, shapes", [
    ("ii->i", [(3, 3)]), ("ij->i", [(3, 4)]), ("iij,kj->ik", [(3, 3, 2), (4, 2)]),
    ("...ij,...jk->...ik", [(2, 3, 3, 4), (2, 3, 4, 2)]), ("i...j,j->i...", [(2, 3, 4), (4,)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 5, 4, 2)]),
])
def test_einsum_unknown_dimensions(equation, shapes):
    rng = np.random.default_rng(11)
    feeds = {name: rng.standard_normal(s) for name, s in zip("abc", shapes, strict=False)}
    g = symbolic(one_node_graph("Einsum", feeds, {"equation": equation}), list(feeds))
    # ONNX shape inference gives a broadcast ellipsis the first operand's symbolic dimensions (here
    # (a0, a1) for what is really (2, 5)); the gradient graph's own Einsum outputs then get wrong types
    # when the second-order pass re-infers them, so only first order is checked with symbolic broadcasting.
    broadcast = any(a != b for a, b in zip(*(s[:-2] for s in shapes), strict=False)) if len(shapes) == 2 else False
    check_rule(g, feeds, _torch_einsum(equation), second_order=not broadcast)


def test_einsum_same_value_twice():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 4))
    g = one_node_graph("Einsum", {"x": x}, {"equation": "ij,ij->i"})
    g.nodes[0].inputs = ["x", "x"]
    check_rule(g, {"x": x}, lambda x: torch.einsum("ij,ij->i", x, x))


@pytest.mark.parametrize("equation", ["...ij,...jk->...ik", "i...j,j->i...", "ii->", "bii,bj->bij"])
def test_einsum_gradient_graph_is_valid_onnx(equation):
    shapes = dict(EQUATIONS)[equation]
    feeds = {name: np.ones(s) for name, s in zip("abc", shapes, strict=False)}
    g = one_node_graph("Einsum", feeds, {"equation": equation})
    fwd_shape = np.einsum(equation, *feeds.values()).shape
    lg, _ = with_loss(g, {"y0": np.zeros(fwd_shape)})
    onnx.checker.check_model(rg.to_onnx(rg.gradient(lg, loss="loss")), full_check=True)


@st.composite
def einsum_batch_case(draw):
    shapes = draw(mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3))
    rank = max(len(s) for s in shapes.input_shapes)
    pad = [(1,) * (rank - len(s)) + tuple(s) for s in shapes.input_shapes]  # ONNX wants equal ellipsis ranks
    n, k, m = (draw(st.integers(1, 3)) for _ in range(3))
    return (*pad[0], n, k), (*pad[1], m, k), draw(st.integers(0, 2**31 - 1))


@FAST
@given(einsum_batch_case())
def test_einsum_broadcast_batch(case):
    sa, sb, seed = case
    rng = np.random.default_rng(seed)
    feeds = {"a": rng.standard_normal(sa), "b": rng.standard_normal(sb)}
    eq = "...ij,...kj->...ki"
    check_rule(one_node_graph("Einsum", feeds, {"equation": eq}), feeds, _torch_einsum(eq), seed=seed)


@pytest.mark.parametrize("op, feeds, attrs", [
    ("MatMul", {"a": np.ones(4), "b": np.ones((2, 4, 3))}, {}),
    ("MatMul", {"a": np.ones((2, 1, 3, 4)), "b": np.ones(4)}, {}),
    ("Gemm", {"a": np.ones((4, 3)), "b": np.ones((5, 4)), "c": np.ones(5)}, {"transA": 1, "transB": 1, "beta": 0.5}),
], ids=["matmul-vector-left", "matmul-vector-right", "gemm"])
def test_product_gradient_graphs_are_valid_onnx(op, feeds, attrs):
    """First- and second-order gradient graphs pass the full ONNX checker."""
    g = one_node_graph(op, feeds, attrs)
    lg, _ = with_loss(g, rg.Session(g).run(feeds))
    gg = rg.gradient(lg, loss="loss")
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    h = gg.copy()
    for k in feeds:
        h.nodes.append(Node("ReduceSumSquare", [f"{k}_grad"], [f"{k}_s"], {"keepdims": 0}, name=f"s/{k}"))
    h.nodes.append(Node("Sum", [f"{k}_s" for k in feeds], ["s"], name="s"))
    h.outputs = [ValueInfo("s")]
    wrt = [k for k in feeds if k != "c"]  # Gemm is linear in C: no second-order path from it
    onnx.checker.check_model(rg.to_onnx(rg.gradient(h, loss="s", wrt=wrt)), full_check=True)


# ------------------------------------------------------------------------------------------ Det
# onnxruntime has no float64 Det kernel: the harness runs float64 graphs that contain one with the reference
# evaluator (forward and gradient graphs); float32 is run by onnxruntime below.


def _cofactor_grad(x: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``u * cofactor(x)`` by brute force (numpy determinants of the minors), for any x, singular or not."""
    n = x.shape[-1]
    c = np.empty_like(x)
    for i in range(n):
        for j in range(n):
            minor = np.delete(np.delete(x, i, axis=-2), j, axis=-1)
            c[..., i, j] = (-1) ** (i + j) * (np.linalg.det(minor) if n > 1 else 1.0)
    return np.asarray(u)[..., None, None] * c


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (2, 3, 3), (2, 1, 4, 4)])
def test_det(shape):
    x = np.random.default_rng(len(shape) + shape[-1]).standard_normal(shape)
    check_rule(one_node_graph("Det", {"x": x}), {"x": x}, lambda x: torch.linalg.det(x))


@pytest.mark.parametrize("rank", [2, 1, 0])
def test_det_singular_matrices(rank):
    # det is a polynomial: central differences and second order hold at singular matrices too. The cofactors
    # are the gradient there (rank n - 1: a rank-one adjugate; below: 0), where det(X) X^-T is undefined.
    rng = np.random.default_rng(rank)
    x = np.stack([rng.standard_normal((3, rank)) @ rng.standard_normal((rank, 3)) for _ in range(2)])
    assert np.allclose(np.linalg.det(x), 0.0)
    grads = check_rule(one_node_graph("Det", {"x": x}), {"x": x}, lambda x: torch.linalg.det(x), rtol=1e-6, atol=1e-9)
    u = np.random.default_rng(0).standard_normal(2)  # the harness's first draw: the cotangent of y0
    np.testing.assert_allclose(grads["x"], _cofactor_grad(x, u), rtol=1e-9, atol=1e-12)
    if rank < 2:
        np.testing.assert_allclose(grads["x"], 0.0, atol=1e-12)
    else:
        assert np.abs(grads["x"]).max() > 1e-3


def test_det_exactly_singular_with_zeros():
    x = np.array([[[1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [0.0, 0.0, 0.0]],
                  [[0.0, 0.0, 0.0], [0.0, 3.0, 1.0], [0.0, 1.0, 5.0]]])
    lg, _ = with_loss(one_node_graph("Det", {"x": x}), {"y0": np.zeros(2)})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    u = np.array([1.5, -2.0])
    got = rg.Session(gg, backend="reference").run({"x": x, "y0_u": u})["x_grad"]
    # rank 1: no nonzero minor of order 2; rank 2: the one nonzero minor, det [[3, 1], [1, 5]]
    expected = np.zeros_like(x)
    expected[1, 0, 0] = -2.0 * 14.0
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(got, _cofactor_grad(x, u), rtol=1e-14, atol=1e-14)
    assert np.isfinite(got).all()


def test_det_float32_onnxruntime():
    rng = np.random.default_rng(3)
    x, u = rng.standard_normal((4, 3, 3)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    lg, _ = with_loss(one_node_graph("Det", {"x": x}), {"y0": u})
    got = rg.Session(rg.gradient(lg, loss="loss", wrt=["x"])).run({"x": x, "y0_u": u})["x_grad"]
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    (torch.linalg.det(tx) * torch.tensor(u, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_det_unknown_size():
    x = np.random.default_rng(4).standard_normal((2, 3, 3))
    g = symbolic(one_node_graph("Det", {"x": x}), ["x"])
    check_rule(g, {"x": x}, lambda x: torch.linalg.det(x))
    lg, _ = with_loss(g, {"y0": np.zeros(2)})
    assert any(n.op_type == "Range" for n in rg.gradient(lg, loss="loss", wrt=["x"]).nodes)


def test_det_empty_matrices_and_bad_shapes():
    x = np.zeros((2, 0, 0))
    lg, _ = with_loss(one_node_graph("Det", {"x": x}), {"y0": np.ones(2)})
    got = rg.Session(rg.gradient(lg, loss="loss", wrt=["x"]), backend="reference").run({"x": x, "y0_u": np.ones(2)})
    assert got["x_grad"].shape == (2, 0, 0)
    g = one_node_graph("Det", {"x": np.zeros((2, 3))})
    g.inputs = [ValueInfo("x", np.float64, (2, 3))]
    with pytest.raises(GraphError, match="square"):
        rg.gradient(g, loss="y0", wrt=["x"])


def test_det_gradient_graphs_are_valid_onnx():
    x = np.random.default_rng(5).standard_normal((2, 3, 3)).astype(np.float32)
    lg, _ = with_loss(one_node_graph("Det", {"x": x}), {"y0": np.zeros(2, np.float32)})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    h = gg.copy()
    h.nodes.append(Node("ReduceSumSquare", ["x_grad"], ["s"], {"keepdims": 0}, name="s"))
    h.outputs = [ValueInfo("s")]
    onnx.checker.check_model(rg.to_onnx(rg.gradient(h, loss="s", wrt=["x"])), full_check=True)
