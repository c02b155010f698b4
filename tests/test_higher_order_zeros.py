"""Strong zeros at every order (issue 39, DESIGN section 5): Hessians, HVPs and third derivatives at exact zeros.

The strong product ``Where(g == 0 or d == 0, 0, g * d)`` (autodiff/strong.py) is a primitive whose derivative is
the product rule; differentiated as a plain selection it dropped ``g * dd`` where ``d == 0`` (``H[0, 0] = 0`` for
``sum(sqrt(x*x + 1))`` at 0, where it is 1) and the whole second derivative where ``g == 0`` (at a minimum). Each
case below puts an exact zero where a rule reads a forward value through Sqrt, Log, Div, Pow, ReduceProd,
Reciprocal, a normalization, Softmax/LogSoftmax, Attention or CumProd: a zero factor of a product, a zero
cotangent (a stationary point, a zero weight), or both. References: ``torch.func.hessian`` in float64 on the same
function, and ``torch.func.jacfwd`` of it for third derivatives. Three ways to the second derivative are checked:
``rg.hessian`` (forward over reverse), ``rg.hvp`` along a random tangent, and ``rg.jacobian`` of ``rg.gradient``
in reverse mode (reverse over reverse, where the second pass differentiates the tagged ``Where`` itself).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kit import zeros
from torch.func import hessian, jacfwd

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.float64
T = lambda v: torch.tensor(v, dtype=torch.float64)


def _graph(nodes: list[tuple], inputs: dict[str, np.ndarray], consts: dict | None = None, opset: int = 21) -> Graph:
    """``nodes``: ``(op, inputs, output, attrs)``; the last writes ``loss``. Constants become initializers."""
    built = [Node(op, list(ins), [out], dict(attrs), f"n{k}_{op}") for k, (op, ins, out, attrs) in enumerate(nodes)]
    inits = {k: np.asarray(v, F64) if np.asarray(v).dtype.kind == "f" else np.asarray(v)
             for k, v in (consts or {}).items()}
    g = Graph(built, [ValueInfo(k, F64, v.shape) for k, v in inputs.items()], [ValueInfo("loss")], inits)
    g.opsets = {"": opset}
    return g


def _sum(v: str) -> tuple:
    return ("ReduceSum", [v], "loss", {"keepdims": 0})


def _standardize(x, axis: int, eps: float):
    # the normalizations written out: torch.func.hessian of F.layer_norm with a weight gives wrong mixed second
    # derivatives d2/(dweight dx) (torch 2.13: it drops the mean and variance terms), so the references are
    # compositions of elementwise operators and reductions, which PyTorch differentiates to any order
    m = x.mean(axis, keepdim=True)
    return (x - m) / torch.sqrt(((x - m) ** 2).mean(axis, keepdim=True) + eps)


def _prod(x):
    # the product along the first axis as a chain of multiplications: torch.prod's own backward special-cases
    # zeros and its third derivative at two zeros is wrong (torch 2.13: d3/dx0 dx2 dx1 of x0 x1 x2 at [0, 0, 3]
    # is 0, where it is 1, and not symmetric)
    out = x[0]
    for row in x[1:]:
        out = out * row
    return out


# name -> (nodes, inputs, constants, opset, torch function of the inputs in order)
CASES = {
    # the issue's two examples: a zero partial derivative (d == 0) behind Sqrt, and ReduceProd at a zero
    "sqrt_at_zero_partial": ([("Mul", ["x", "x"], "xx", {}), ("Add", ["xx", "one"], "u", {}), ("Sqrt", ["u"], "s", {}),
                              _sum("s")], {"x": [0.0, 1.0, 2.0]}, {"one": 1.0}, 21,
                             lambda x: torch.sqrt(x * x + 1).sum()),
    "reduce_prod_one_zero": ([("Mul", ["x", "x"], "xx", {}), ("ReduceProd", ["xx"], "loss", {"keepdims": 0})],
                             {"x": [0.0, 2.0, 3.0]}, {}, 21, lambda x: _prod(x * x)),
    "reduce_prod_two_zeros": ([("ReduceProd", ["x"], "loss", {"keepdims": 0})], {"x": [0.0, 0.0, 3.0]}, {}, 21,
                              lambda x: _prod(x)),
    # over axes 0 and 2 of [2, 2, 3], keepdims=0: group 0 holds three zeros, group 1 one
    "reduce_prod_axes_three_zeros": ([("ReduceProd", ["x", "axes"], "p", {"keepdims": 0}),
                                      ("Mul", ["p", "w"], "pw", {}), _sum("pw")],
                                     {"x": [[[0.0, 2.0, 0.5], [1.0, 3.0, 2.0]], [[0.0, 1.5, 1.0], [0.0, -1.0, 0.5]]]},
                                     {"axes": np.array([0, 2], np.int64), "w": [1.0, -2.0]}, 21,
                                     lambda x: (_prod(x.permute(1, 0, 2).reshape(2, 6).T) * T([1.0, -2.0])).sum()),
    # a zero cotangent: a stationary point (the gradient is 0 there, its derivative is not)
    "sqrt_at_a_minimum": ([("Sqrt", ["x"], "s", {}), ("Sub", ["s", "one"], "d", {}), ("Mul", ["d", "d"], "dd", {}),
                           _sum("dd")], {"x": [1.0, 4.0]}, {"one": 1.0}, 21,
                          lambda x: ((torch.sqrt(x) - 1) ** 2).sum()),
    "log_at_a_minimum": ([("Log", ["x"], "l", {}), ("Mul", ["l", "l"], "ll", {}), _sum("ll")],
                         {"x": [1.0, 2.0]}, {}, 21, lambda x: (torch.log(x) ** 2).sum()),
    "log_at_zero_partial": ([("Mul", ["x", "x"], "xx", {}), ("Add", ["xx", "one"], "u", {}), ("Log", ["u"], "l", {}),
                             _sum("l")], {"x": [0.0, 1.0]}, {"one": 1.0}, 21,
                            lambda x: torch.log(x * x + 1).sum()),
    "div_both": ([("Mul", ["x", "x"], "xx", {}), ("Mul", ["y", "y"], "yy", {}), ("Add", ["yy", "one"], "b", {}),
                  ("Div", ["xx", "b"], "q", {}), _sum("q")], {"x": [0.0, 1.0], "y": [0.0, 2.0]}, {"one": 1.0}, 21,
                 lambda x, y: (x * x / (y * y + 1)).sum()),
    "div_at_a_minimum": ([("Div", ["x", "y"], "q", {}), ("Sub", ["q", "one"], "d", {}), ("Mul", ["d", "d"], "dd", {}),
                          _sum("dd")], {"x": [2.0, 3.0], "y": [2.0, 3.0]}, {"one": 1.0}, 21,
                         lambda x, y: ((x / y - 1) ** 2).sum()),
    "pow_constant_exponent": ([("Mul", ["x", "x"], "xx", {}), ("Add", ["xx", "one"], "u", {}),
                               ("Pow", ["u", "p"], "w", {}), _sum("w")], {"x": [0.0, 1.0]},
                              {"one": 1.0, "p": 1.5}, 21, lambda x: ((x * x + 1) ** 1.5).sum()),
    "pow_cube_at_zero": ([("Pow", ["x", "p"], "w", {}), _sum("w")], {"x": [0.0, 1.0]}, {"p": 3.0}, 21,
                         lambda x: (x ** 3).sum()),
    "pow_variable_exponent": ([("Pow", ["x", "y"], "w", {}), _sum("w")], {"x": [1.0, 2.0], "y": [0.0, 1.0]}, {}, 21,
                              lambda x, y: (x ** y).sum()),
    "reciprocal_at_zero_partial": ([("Mul", ["x", "x"], "xx", {}), ("Add", ["xx", "one"], "u", {}),
                                    ("Reciprocal", ["u"], "r", {}), _sum("r")], {"x": [0.0, 1.0]}, {"one": 1.0}, 21,
                                   lambda x: (1 / (x * x + 1)).sum()),
    "reciprocal_at_a_minimum": ([("Reciprocal", ["x"], "r", {}), ("Sub", ["r", "one"], "d", {}),
                                 ("Mul", ["d", "d"], "dd", {}), _sum("dd")], {"x": [1.0, 2.0]}, {"one": 1.0}, 21,
                                lambda x: ((1 / x - 1) ** 2).sum()),
    "atanh_and_asin_at_zero": ([("Atanh", ["x"], "a", {}), ("Asin", ["x"], "b", {}), ("Mul", ["a", "b"], "ab", {}),
                                _sum("ab")], {"x": [0.0, 0.5]}, {}, 21,
                               lambda x: (torch.atanh(x) * torch.asin(x)).sum()),
    "reduce_l2_and_logsumexp": ([("Mul", ["x", "x"], "xx", {}), ("ReduceL2", ["x"], "n", {"keepdims": 0}),
                                 ("ReduceLogSumExp", ["xx"], "m", {"keepdims": 0}), ("Add", ["n", "m"], "loss", {})],
                                {"x": [0.0, 3.0, 4.0]}, {}, 21,
                                lambda x: torch.linalg.vector_norm(x) + torch.logsumexp(x * x, 0)),
    "cumprod": ([("CumProd", ["x", "axis"], "c", {}), _sum("c")], {"x": [0.0, 2.0, 3.0]},
                {"axis": np.array(0, np.int64)}, 26, lambda x: torch.cumprod(x, 0).sum()),
    "cumprod_exclusive_reverse": ([("CumProd", ["x", "axis"], "c", {"exclusive": 1, "reverse": 1}),
                                   ("Mul", ["c", "w"], "cw", {}), _sum("cw")], {"x": [2.0, 0.0, 3.0, 0.0]},
                                  {"axis": np.array(0, np.int64), "w": [1.0, 0.0, 2.0, -1.0]}, 26,
                                  lambda x: (torch.cat([torch.flip(torch.cumprod(torch.flip(x[1:], [0]), 0), [0]),
                                                        T([1.0])]) * T([1.0, 0.0, 2.0, -1.0])).sum()),
    # a zero weight: the output cotangent is 0 on some elements
    "softmax_zero_weights": ([("Softmax", ["x"], "p", {"axis": -1}), ("Mul", ["p", "w"], "pw", {}), _sum("pw")],
                             {"x": [[0.0, 0.0, 0.0], [1.0, 0.0, -1.0]]}, {"w": [1.0, 0.0, 0.0]}, 21,
                             lambda x: (torch.softmax(x, -1) * T([1.0, 0.0, 0.0])).sum()),
    "log_softmax_zero_weights": ([("LogSoftmax", ["x"], "p", {"axis": -1}), ("Mul", ["p", "w"], "pw", {}), _sum("pw")],
                                 {"x": [[0.0, 0.0, 0.0], [1.0, 0.0, -1.0]]}, {"w": [0.0, 2.0, 0.0]}, 21,
                                 lambda x: (torch.log_softmax(x, -1) * T([0.0, 2.0, 0.0])).sum()),
    "layer_norm": ([("LayerNormalization", ["x", "s", "b"], "y", {"axis": -1, "epsilon": 1e-5}),
                    ("Mul", ["y", "w"], "yw", {}), _sum("yw")],
                   {"x": [[0.0, 0.0, 1.0, -1.0], [0.5, 0.0, 0.0, 2.0]], "s": [1.0, 0.0, 2.0, 0.5]},
                   {"b": [0.0, 0.1, 0.0, 0.0], "w": [1.0, 0.0, -1.0, 0.5]}, 21,
                   lambda x, s: ((_standardize(x, -1, 1e-5) * s + T([0.0, 0.1, 0.0, 0.0]))
                                 * T([1.0, 0.0, -1.0, 0.5])).sum()),
    "instance_norm": ([("InstanceNormalization", ["x", "s", "b"], "y", {"epsilon": 1e-5}),
                       ("Mul", ["y", "w"], "yw", {}), _sum("yw")],
                      {"x": [[[0.0, 0.0, 1.0], [2.0, 0.0, -2.0]]]}, {"s": [1.0, 0.0], "b": [0.0, 0.0],
                                                                    "w": [[0.0, 1.0, 2.0]]}, 21,
                      lambda x: (_standardize(x, -1, 1e-5) * T([[1.0], [0.0]]) * T([[0.0, 1.0, 2.0]])).sum()),
    "group_norm": ([("GroupNormalization", ["x", "s", "b"], "y", {"num_groups": 2, "epsilon": 1e-5}),
                    ("Mul", ["y", "w"], "yw", {}), _sum("yw")],
                   {"x": [[[0.0, 1.0], [0.0, -1.0], [2.0, 0.0], [0.0, 0.0]]]},
                   {"s": [1.0, 0.0, 2.0, 0.5], "b": [0.0, 0.0, 0.1, 0.0], "w": [[1.0, 0.0]]}, 21,
                   lambda x: ((_standardize(x.reshape(1, 2, 4), -1, 1e-5).reshape(1, 4, 2)
                               * T([[1.0], [0.0], [2.0], [0.5]]) + T([[0.0], [0.0], [0.1], [0.0]]))
                              * T([[1.0, 0.0]])).sum()),
    "lp_norm": ([("LpNormalization", ["x"], "y", {"axis": -1, "p": 2}), ("Mul", ["y", "w"], "yw", {}), _sum("yw")],
                {"x": [[0.0, 3.0, 4.0], [1.0, 0.0, 0.0]]}, {"w": [1.0, 0.0, -1.0]}, 21,
                lambda x: (x / torch.sqrt((x * x).sum(-1, keepdim=True)) * T([1.0, 0.0, -1.0])).sum()),
    "rms_norm": ([("RMSNormalization", ["x", "s"], "y", {"axis": -1, "epsilon": 1e-6}), ("Mul", ["y", "w"], "yw", {}),
                  _sum("yw")], {"x": [[0.0, 0.0, 1.0], [0.0, 2.0, -1.0]], "s": [1.0, 0.0, 3.0]},
                 {"w": [0.0, 1.0, 1.0]}, 23,
                 lambda x, s: (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * s
                               * T([0.0, 1.0, 1.0])).sum()),
    "attention": ([("Attention", ["q", "k", "v"], "y", {}), ("Mul", ["y", "w"], "yw", {}), _sum("yw")],
                  {"q": np.zeros((1, 1, 2, 2)), "k": [[[[0.0, 1.0], [0.0, 0.0]]]], "v": [[[[1.0, 0.0], [0.0, 2.0]]]]},
                  {"w": [[[[1.0, 0.0], [0.0, -1.0]]]]}, 23,
                  lambda q, k, v: (torch.softmax(q @ k.transpose(-1, -2) / np.sqrt(2.0), -1) @ v
                                   * T([[[[1.0, 0.0], [0.0, -1.0]]]])).sum()),
}


def _case(name: str):
    nodes, inputs, consts, opset, fn = CASES[name]
    feeds = {k: np.asarray(v, F64) for k, v in inputs.items()}
    return _graph(nodes, feeds, consts, opset), feeds, fn


def _torch_hessian(fn, feeds: dict) -> dict[tuple[str, str], np.ndarray]:
    names = list(feeds)
    h = hessian(fn, argnums=tuple(range(len(names))))(*(T(v) for v in feeds.values()))
    return {(a, b): h[i][j].numpy() for i, a in enumerate(names) for j, b in enumerate(names)}


def _block(out: dict, a: str, b: str) -> np.ndarray:
    return out[f"{a}_hessian" if a == b else f"{a}_hessian_{b}"]


@pytest.mark.parametrize("name", list(CASES))
def test_hessian_at_exact_zeros(name):
    g, feeds, fn = _case(name)
    want = _torch_hessian(fn, feeds)
    assert all(np.all(np.isfinite(v)) for v in want.values())
    out = zeros.run(rg.hessian(g, "loss", list(feeds)), feeds)
    for (a, b), w in want.items():
        np.testing.assert_allclose(_block(out, a, b), w, rtol=1e-7, atol=1e-10, err_msg=f"d2/d{a}d{b}")


@pytest.mark.parametrize("name", list(CASES))
def test_reverse_over_reverse_at_exact_zeros(name):
    # the second backward pass differentiates the first one's tagged Where (not forward mode's transposition)
    g, feeds, fn = _case(name)
    want = _torch_hessian(fn, feeds)
    gg = rg.gradient(g, "loss", wrt=list(feeds))
    jac = rg.jacobian(gg, outputs=[f"{x}_grad" for x in feeds], inputs=list(feeds), mode="reverse")
    out = zeros.run(jac, feeds)
    for (a, b), w in want.items():
        np.testing.assert_allclose(out[f"{a}_grad_jacobian_{b}"], w, rtol=1e-7, atol=1e-10, err_msg=f"d2/d{a}d{b}")


@pytest.mark.parametrize("name", list(CASES))
def test_hvp_at_exact_zeros(name):
    g, feeds, fn = _case(name)
    want = _torch_hessian(fn, feeds)
    rng = np.random.default_rng(39)
    tangents = {x: rng.standard_normal(v.shape) for x, v in feeds.items()}
    out = zeros.run(rg.hvp(g, "loss", list(feeds)), {**feeds, **{f"{x}_tangent": t for x, t in tangents.items()}})
    for a in feeds:
        expected = sum(np.tensordot(want[a, b], tangents[b], axes=tangents[b].ndim) for b in feeds)
        np.testing.assert_allclose(out[f"{a}_hvp"], expected, rtol=1e-7, atol=1e-10, err_msg=a)


THIRD = ["sqrt_at_zero_partial", "reduce_prod_one_zero", "reduce_prod_two_zeros", "reduce_prod_axes_three_zeros",
         "log_at_a_minimum", "reciprocal_at_zero_partial", "cumprod", "softmax_zero_weights"]


@pytest.mark.parametrize("name", THIRD)
def test_third_derivatives_at_exact_zeros(name):
    # the Jacobian of the Hessian graph (it differentiates the forward-over-reverse graph, a Loop over the basis)
    g, feeds, fn = _case(name)
    (x,) = feeds
    want = jacfwd(hessian(fn))(T(feeds[x])).numpy()
    third = rg.jacobian(rg.hessian(g, "loss", [x]), outputs=[f"{x}_hessian"], inputs=[x], mode="reverse")
    out = zeros.run(third, feeds)
    np.testing.assert_allclose(out[f"{x}_hessian_jacobian_{x}"], want, rtol=1e-7, atol=1e-10)


def test_first_order_strong_zeros_still_hold_through_the_primitive():
    # 0 x inf stays 0 at first order and at second: sqrt(x) * c at x = 0 with c = 0 (the cotangent of sqrt is 0
    # where its partial derivative is inf), and the Hessian there is 0, not NaN
    g = _graph([("Sqrt", ["x"], "s", {}), ("Mul", ["s", "c"], "sc", {}), _sum("sc")], {"x": np.array([0.0, 4.0])},
               {"c": [0.0, 1.0]})
    feeds = {"x": np.array([0.0, 4.0])}
    assert zeros.run(rg.gradient(g, "loss", wrt=["x"]), feeds)["x_grad"].tolist() == [0.0, 0.25]
    h = zeros.run(rg.hessian(g, "loss", ["x"]), feeds)["x_hessian"]
    np.testing.assert_allclose(h, [[0.0, 0.0], [0.0, -1 / 32]], rtol=1e-12)


def test_a_users_where_stays_a_selection():
    # Where(p == 0, 0, p * log p), the entropy guard a user writes: untagged, so the unselected branch gets an
    # exact 0 at p = 0 (the primitive's derivative there would be -inf), and 1 + log p elsewhere
    g = _graph([("Equal", ["p", "zero"], "z", {}), ("Log", ["p"], "l", {}), ("Mul", ["p", "l"], "pl", {}),
                ("Where", ["z", "zero", "pl"], "h", {}), _sum("h")], {"p": np.array([0.0, 0.5])}, {"zero": 0.0})
    got = zeros.run(rg.gradient(g, "loss", wrt=["p"]), {"p": np.array([0.0, 0.5])})["p_grad"]
    np.testing.assert_allclose(got, [0.0, 1 + np.log(0.5)], rtol=1e-14)


def test_a_tagged_where_of_another_structure_stays_a_selection():
    # the tag alone does not make the primitive where the structure can be seen and differs: a condition that
    # is not a test of the product's factors against 0 (an optimizer's rewrite, or a name that happens to match)
    g = _graph([("Greater", ["x", "zero"], "c", {}), ("Mul", ["x", "x"], "xx", {}),
                ("Where", ["c", "zero", "xx"], "h", {}), _sum("h")], {"x": np.array([-1.0, 2.0])}, {"zero": 0.0})
    g.nodes[2].name = "grad/n/StrongZero"
    got = zeros.run(rg.gradient(g, "loss", wrt=["x"]), {"x": np.array([-1.0, 2.0])})["x_grad"]
    np.testing.assert_allclose(got, [-2.0, 0.0], rtol=1e-14)


def test_the_issues_examples_with_their_hand_derived_values():
    # issue 39 as filed: d2/dx2 sqrt(x^2 + 1) = (x^2 + 1)^(-3/2), so H = diag(1, 2^(-3/2), 5^(-3/2)) at [0, 1, 2]
    # (H[0, 0] was 0); prod(x^2) at [0, 2, 3]: H[0, 0] = 2 * 4 * 9 = 72 and every other entry carries a factor
    # x_0 = 0 (the whole matrix was 0). HVPs along ones, on both runtimes
    want = {"sqrt_at_zero_partial": np.diag([1.0, 2 ** -1.5, 5 ** -1.5]),
            "reduce_prod_one_zero": np.array([[72.0, 0, 0], [0, 0, 0], [0, 0, 0]])}
    for name, h in want.items():
        g, feeds, _ = _case(name)
        out = zeros.run(rg.hessian(g, "loss", ["x"]), feeds)
        np.testing.assert_allclose(out["x_hessian"], h, rtol=1e-12, atol=1e-12, err_msg=name)
        hv = zeros.run(rg.hvp(g, "loss", ["x"]), {**feeds, "x_tangent": np.ones(3)})
        np.testing.assert_allclose(hv["x_hvp"], h.sum(1), rtol=1e-12, atol=1e-12, err_msg=name)
