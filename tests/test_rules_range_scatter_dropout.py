"""Gradients at the edges of three ops: ``Range`` in ``start`` and ``delta``; ``ScatterND`` and
``ScatterElements`` with ``reduction`` mul, max and min; the ``ratio`` input of ``Dropout`` in training mode
(issue 13, section 2).

Each example of the issue is a test with its hand-derived value. The sweeps check every reduction of both
scatters, with repeated indices, against float64 central differences, PyTorch's ``scatter_reduce`` (whose
``prod`` backward handles zeros and whose ``amax``/``amin`` backward splits ties equally, as revgraph does)
and second order; at ties and zeros, where central differences do not apply, against a brute-force numpy
reference written from the definitions (and PyTorch).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.harness import check_rule, one_node_graph, with_loss
from kit.rules import squared, with_repeat, wrap

import revgraph as rg
from revgraph.autodiff import group_products
from revgraph.ir import Graph, Node, ValueInfo

SETTINGS = settings(max_examples=5, deadline=None)
seeds = st.integers(0, 2**31 - 1)
TORCH_REDUCE = {"mul": "prod", "max": "amax", "min": "amin"}


# ---------------------------------------------------------------------------------------------- Range


def range_graph(dtype=np.float64, weights=None, constants: dict | None = None) -> Graph:
    """``loss = sum(Range(a, l, d) * c)``; ``constants`` makes some of a, l, d initializers."""
    constants = constants or {}
    nodes = [Node("Range", ["a", "l", "d"], ["y"], name="range"), Node("Mul", ["y", "c"], ["z"], name="weigh"),
             Node("ReduceSum", ["z"], ["loss"], {"keepdims": 0}, name="sum")]
    inputs = [ValueInfo(n, dtype, ()) for n in "ald" if n not in constants]
    init = {"c": np.asarray(weights, dtype), **{k: np.asarray(v, dtype) for k, v in constants.items()}}
    return Graph(nodes, inputs, [ValueInfo("loss", dtype, ())], init)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_range_hand_derived(dtype, backend):
    """start 0.3, limit 5.1, delta 0.7: n = ceil(4.8 / 0.7) = 7; weights c = 1..7, so d start = sum(c) = 28,
    d delta = sum(i * c_i) = sum(i (i + 1), i < 7) = 91 + 21 = 112; the limit only sets n: 0 and a warning."""
    g = range_graph(dtype, np.arange(1, 8))
    with pytest.warns(UserWarning, match="no path from 'l'"):
        gg = rg.gradient(g, "loss", ["a", "l", "d"])
    out = rg.Session(gg, backend=backend).run({"a": dtype(0.3), "l": dtype(5.1), "d": dtype(0.7)})
    assert out["a_grad"].dtype == dtype and out["a_grad"].shape == ()
    np.testing.assert_array_equal([out["a_grad"], out["l_grad"], out["d_grad"]], [28.0, 0.0, 112.0])


@pytest.mark.parametrize("start,limit,delta", [(0.3, 5.1, 0.7), (2.5, -1.2, -0.45), (-1.1, 0.35, 0.2), (1.0, 1.3, 2.0)])
def test_range_against_differences_and_torch(start, limit, delta):
    """Run-time start/limit/delta (the length is known only at run time: the ramp is a Range itself); fractions
    away from integers, so that small steps keep the length."""
    n = int(np.ceil((limit - start) / delta))
    g = one_node_graph("Range", {"a": np.array(start), "l": np.array(limit), "d": np.array(delta)})
    ramp = torch.arange(n, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the limit: no path
        grads = check_rule(g, {"a": np.array(start), "l": np.array(limit), "d": np.array(delta)},
                           lambda a, l, d: a + ramp * d + 0 * l)
    assert grads["l"] == 0.0


def test_range_static_length_and_second_order():
    """Constant limit and delta with a run-time start: the length is static (the ramp is a constant); the
    gradient is linear in the cotangent, so a squared output checks second order."""
    g = one_node_graph("Range", {"a": np.array(-0.25), "l": np.array(3.0), "d": np.array(0.5)}, float_inputs=["a"])
    g.initializers = {"l": np.array(3.0), "d": np.array(0.5)}
    ramp = torch.arange(7, dtype=torch.float64)
    check_rule(squared(g), {"a": np.array(-0.25)}, lambda a: (a + ramp * 0.5) ** 2)


@pytest.mark.parametrize("n", [5, 3000])
def test_range_constant_bounds(n):
    """Start, limit and delta all initializers (their gradients still wanted): weights of ones give d start = n,
    d delta = n (n - 1) / 2."""
    g = range_graph(np.float64, np.ones(n), constants={"a": 0.0, "l": n - 0.5, "d": 1.0})
    gg = rg.gradient(g, "loss", ["a", "d"])
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(gg, backend=backend).run({})
        assert out["a_grad"] == n and out["d_grad"] == n * (n - 1) / 2


def test_range_empty_gives_zero():
    g = range_graph(np.float64, np.zeros(0))
    with pytest.warns(UserWarning, match="no path"):
        gg = rg.gradient(g, "loss", ["a", "l", "d"])
    out = rg.Session(gg).run({"a": np.array(3.0), "l": np.array(1.0), "d": np.array(0.5)})
    assert out["a_grad"] == 0.0 and out["d_grad"] == 0.0


def test_range_integer_is_not_differentiated():
    g = Graph([Node("Range", ["a", "l", "d"], ["r"], name="range"), Node("Cast", ["r"], ["f"], {"to": 11}, name="cast"),
               Node("Mul", ["f", "w"], ["z"], name="mul"),
               Node("ReduceSum", ["z"], ["loss"], {"keepdims": 0}, name="sum")],
              [ValueInfo("w", np.float64, (4,))], [ValueInfo("loss", np.float64, ())],
              {"a": np.array(0, np.int64), "l": np.array(4, np.int64), "d": np.array(1, np.int64)})
    out = rg.Session(rg.gradient(g, "loss", ["w"])).run({"w": np.ones(4)})
    np.testing.assert_array_equal(out["w_grad"], [0, 1, 2, 3])


# ---------------------------------------------------------------------------------------------- scatters


def scatter_loss(op: str, data: np.ndarray, idx: np.ndarray, upd: np.ndarray, reduction: str, coef: np.ndarray,
                 axis: int | None = None, runtime_indices: bool = False) -> Graph:
    """``loss = sum(op(x, i, u, reduction) * c)``: the data gradient's cotangent is ``c``."""
    attrs = {"reduction": reduction, **({} if axis is None else {"axis": axis})}
    inputs = [ValueInfo("x", data.dtype, data.shape), ValueInfo("u", upd.dtype, upd.shape)]
    init = {"c": coef}
    if runtime_indices:
        inputs.append(ValueInfo("i", idx.dtype, idx.shape))
    else:
        init["i"] = idx
    return Graph([Node(op, ["x", "i", "u"], ["s"], attrs, "scatter"), Node("Mul", ["s", "c"], ["y"], name="weigh"),
                  Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, name="sum")],
                 inputs, [ValueInfo("loss", data.dtype, ())], init)


def scatter_grads(g: Graph, feeds: dict, backend: str = "onnxruntime") -> tuple[np.ndarray, np.ndarray]:
    gg = rg.gradient(g, "loss", ["x", "u"])
    out = rg.Session(gg, backend=backend).run(feeds)
    return out["x_grad"], out["u_grad"]


D5 = np.array([10.0, 20, 30, 40, 50])
C5 = np.arange(1.0, 6)  # y = s * [1..5], loss = sum(y): the cotangent of s is [1..5]
#: the issue's example and hand-derived ties and zeros: (reduction, 1-D indices, updates, data grad, updates grad)
HAND = [
    # mul: position 1 gets 20 * -1 * -2 = 40; dx = c * (-1)(-2); du_k = c_1 * 20 * (the other update)
    ("mul", [1, 1], [-1.0, -2.0], [1, 4, 3, 4, 5], [-80, -40]),
    # mul with zeros: position 0 holds updates 0 and 3 (one zero), position 2 holds 0, 2, 0 (two zeros):
    # du = 1 * 10 * 3 = 30 for the single zero, 0 for the others; dx = c * 0 at both
    ("mul", [0, 0, 2, 2, 2], [0.0, 3, 0, 2, 0], [0, 2, 0, 4, 5], [30, 0, 0, 0, 0]),
    # mul, a single zero among three: position 2 holds 0, 2, 5: du = 3 * 30 * (2 * 5) = 900 for the zero
    ("mul", [2, 2, 2], [0.0, 2, 5], [1, 2, 0, 4, 5], [900, 0, 0]),
    # max: position 1 ties data 20 with two updates 20 (2/3 each); 3: update 45 wins (4); 0: two updates 15
    # tie above data 10 (1/2 each); 2: data 30 ties one update 30 (3/2 each)
    ("max", [1, 1, 3, 0, 0, 2], [20.0, 20, 45, 15, 15, 30], [0, 2 / 3, 1.5, 0, 5], [2 / 3, 2 / 3, 4, 0.5, 0.5, 1.5]),
    # min: position 1 as above; 3: update 35 below 40 (4); 0: update 5 below data 10 and update 15 (1); 2: tie
    ("min", [1, 1, 3, 0, 0, 2], [20.0, 20, 35, 15, 5, 30], [0, 2 / 3, 1.5, 0, 5], [2 / 3, 2 / 3, 4, 0, 1, 1.5]),
    # max: two equal updates above the data at position 4 share; a lower update gets nothing
    ("max", [4, 4, 4], [60.0, 60, 55], [1, 2, 3, 4, 0], [2.5, 2.5, 0]),
]


@pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", range(len(HAND)))
def test_scatter_reduction_hand_derived(op, backend, dtype, case):
    reduction, idx, upd, dx, du = HAND[case]
    idx, upd = np.array(idx, np.int64), np.array(upd, dtype)
    g = scatter_loss(op, D5.astype(dtype), idx[:, None] if op == "ScatterND" else idx, upd, reduction, C5.astype(dtype))
    gx, gu = scatter_grads(g, {"x": D5.astype(dtype), "u": upd}, backend)
    assert gx.dtype == gu.dtype == dtype
    tol = 1e-15 if dtype == np.float64 else 1e-7
    np.testing.assert_allclose(gx, dx, rtol=tol, atol=0)
    np.testing.assert_allclose(gu, du, rtol=tol, atol=0)


@pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
def test_scatter_mul_large_constant_indices_sort_at_run_time(op, monkeypatch):
    """Constant indices beyond group_products.FOLD_LIMIT are sorted by the graph (TopK), not when it is built."""
    monkeypatch.setattr(group_products, "FOLD_LIMIT", 1)
    for reduction, idx, upd, dx, du in [h for h in HAND if h[0] == "mul"]:
        idx = np.array(idx, np.int64)
        g = scatter_loss(op, D5, idx[:, None] if op == "ScatterND" else idx, np.array(upd), reduction, C5)
        assert any(n.op_type == "TopK" for n in rg.gradient(g, "loss", ["u"]).nodes)
        gx, gu = scatter_grads(g, {"x": D5, "u": np.array(upd)})
        np.testing.assert_allclose(gx, dx, rtol=1e-15, atol=0)
        np.testing.assert_allclose(gu, du, rtol=1e-15, atol=0)


@pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
@pytest.mark.parametrize("reduction", ["mul", "max", "min"])
def test_scatter_reduction_no_updates(op, reduction):
    """No update at all: the output is the data, whose gradient is the cotangent."""
    idx = np.zeros((0, 1) if op == "ScatterND" else (0,), np.int64)
    g = scatter_loss(op, D5, idx, np.zeros(0), reduction, C5)
    for backend in ("onnxruntime", "reference"):
        gx, gu = scatter_grads(g, {"x": D5, "u": np.zeros(0)}, backend)
        np.testing.assert_array_equal(gx, C5)
        assert gu.shape == (0,)


@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_scatter_elements_axis1_hand_derived(backend):
    """Along axis 1 of a [2, 5] table with negative indices. Row 0 is the max example above with cotangent
    [1..5] (the reduction is max). Row 1, cotangent [6..10]: position 4 (also written -1) ties the data 5 with
    updates 5 and 5 (10/3 each), the update 1 there loses; position 0 (also -5) keeps the data 1 above the
    updates 0 (6 to the data)."""
    data = np.array([[10.0, 20, 30, 40, 50], [1, 2, 3, 4, 5]])
    idx = np.array([[1, 1, 3, 0, 0, 2], [4, -1, 4, 0, -5, 0]])
    upd = np.array([[20.0, 20, 45, 15, 15, 30], [5, 5, 1, 0, 0, 0]])
    coef = np.arange(1.0, 11).reshape(2, 5)
    g = scatter_loss("ScatterElements", data, idx, upd, "max", coef, axis=1)
    gx, gu = scatter_grads(g, {"x": data, "u": upd}, backend)
    np.testing.assert_allclose(gx, [[0, 2 / 3, 1.5, 0, 5], [6, 7, 8, 9, 10 / 3]], rtol=1e-15)
    np.testing.assert_allclose(gu, [[2 / 3, 2 / 3, 4, 0.5, 0.5, 1.5], [10 / 3, 10 / 3, 0, 0, 0, 0]], rtol=1e-15)


@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_scatter_nd_rows_mul_hand_derived(backend):
    """ScatterND of rows into a [3, 2] table: rows 2 and -1 are one row, written twice; row 0 once.
    s[2] = x[2] * u0 * u2, s[0] = x[0] * u1; with cotangent c: dx[2] = c[2] u0 u2, du0 = c[2] x[2] u2."""
    data = np.array([[1.0, 2], [3, 4], [5, 6]])
    idx = np.array([[2], [0], [-1]])
    upd = np.array([[2.0, 0], [3, 4], [5, 7]])
    coef = np.array([[1.0, 2], [3, 4], [5, 6]])
    g = scatter_loss("ScatterND", data, idx, upd, "mul", coef)
    gx, gu = scatter_grads(g, {"x": data, "u": upd}, backend)
    np.testing.assert_allclose(gx, [[1 * 3, 2 * 4], [3, 4], [5 * 2 * 5, 6 * 0 * 7]], rtol=1e-15)
    np.testing.assert_allclose(gu, [[5 * 5 * 5, 6 * 6 * 7], [1 * 1, 2 * 2], [5 * 5 * 2, 6 * 6 * 0]], rtol=1e-15)


# ---------------------------------------------------------------------------------------------- brute force


def flat_positions(op: str, shape: tuple, idx: np.ndarray, upd_shape: tuple, axis: int = 0) -> np.ndarray:
    """The flat data position each update element is written to (updates-shaped), from the ONNX definitions."""
    if op == "ScatterND":
        m = idx.shape[-1]
        tup = wrap(idx, np.array(shape[:m]))
        rows = np.ravel_multi_index(tuple(np.moveaxis(tup, -1, 0)), shape[:m])
        width = int(np.prod(shape[m:], dtype=np.int64))
        return (rows.reshape(-1, 1) * width + np.arange(width)).reshape(upd_shape)
    coords = list(np.indices(idx.shape))
    coords[axis] = wrap(idx, shape[axis])
    return np.ravel_multi_index(tuple(coords), shape)


def brute_force(reduction: str, data: np.ndarray, pos: np.ndarray, upd: np.ndarray, c: np.ndarray):
    """(data grad, updates grad) of ``sum(c * scatter(data, updates))`` from the definitions: every update
    at its flat position; mul by the products of the others, max/min by equal shares among the attaining."""
    x, u, p, cf = data.reshape(-1), upd.reshape(-1), pos.reshape(-1), c.reshape(-1)
    dx, du = np.zeros_like(x), np.zeros_like(u)
    for q in range(x.size):
        ks = np.flatnonzero(p == q)
        if reduction == "mul":
            dx[q] = cf[q] * np.prod(u[ks])
            for k in ks:
                du[k] = cf[q] * x[q] * np.prod(u[[j for j in ks if j != k]])
            continue
        best = (max if reduction == "max" else min)([x[q], *u[ks]])
        winners = [x[q] == best, *(u[ks] == best)]
        share = cf[q] / sum(winners)
        dx[q] = share if winners[0] else 0.0
        for k, w in zip(ks, winners[1:], strict=True):
            du[k] = share if w else 0.0
    return dx.reshape(data.shape), du.reshape(upd.shape)


def random_scatter(rng, op: str, small_ints: bool):
    """A random scatter with repeated indices: (data, indices, updates, attrs, axis); small integers (ties,
    zeros) or normal values."""
    rank = int(rng.integers(1, 4))
    shape = tuple(int(d) for d in rng.integers(1, 4, rank))
    draw = (lambda s: rng.integers(-2, 3, s).astype(np.float64)) if small_ints else rng.standard_normal
    if op == "ScatterND":
        m = int(rng.integers(1, rank + 1))
        dims = np.array(shape[:m])
        count = int(rng.integers(2, 7))
        idx = with_repeat(np.stack([rng.integers(-d, d, count) for d in dims], axis=-1), dims)
        lead = (count,) if count % 2 else (2, count // 2)
        idx = idx.reshape(*lead, m)
        return draw(shape), idx, draw(lead + shape[m:]), {}, 0
    axis = int(rng.integers(-rank, rank))
    ax = axis % rank
    ishape = [int(rng.integers(1, d + 1)) for d in shape]  # may be smaller than the data outside the axis
    ishape[ax] = int(rng.integers(2, 6))
    n = shape[ax]
    idx = np.ascontiguousarray(np.moveaxis(with_repeat(np.moveaxis(rng.integers(-n, n, ishape), ax, 0), n), 0, ax))
    return draw(shape), idx, draw(idx.shape), {"axis": axis}, ax


#: why forward mode is checked against PyTorch's double backward for reduction="mul" (harness check 4)
PROD_JVP = "torch.func.jvp of scatter_reduce(reduce='prod') returns zeros (torch 2.13); its double backward is right"


def torch_scatter(op: str, reduction: str, idx: np.ndarray, shape: tuple, ax: int):
    """The scatter as PyTorch's ``scatter_reduce(include_self=True)`` (ScatterND on the [rows, S] view)."""
    if op == "ScatterElements":
        pos = torch.tensor(wrap(idx, shape[ax]))
        return lambda x, u: torch.scatter_reduce(x, ax, pos, u, TORCH_REDUCE[reduction])
    m = idx.shape[-1]
    rows = np.ravel_multi_index(tuple(np.moveaxis(wrap(idx, np.array(shape[:m])), -1, 0)), shape[:m]).reshape(-1)
    width = int(np.prod(shape[m:], dtype=np.int64))
    pos = torch.tensor(np.repeat(rows[:, None], width, axis=1))

    def fn(x, u):
        flat = torch.scatter_reduce(x.reshape(-1, width), 0, pos, u.reshape(-1, width), TORCH_REDUCE[reduction])
        return flat.reshape(shape)

    return fn


def smooth_case(op: str, reduction: str, seed: int) -> None:
    """Random shapes, axes and repeated (and negative) indices, normal values: central differences, PyTorch,
    second order (the output squared, so that the gradient depends on the inputs)."""
    rng = np.random.default_rng(seed)
    data, idx, upd, attrs, ax = random_scatter(rng, op, small_ints=False)
    g = one_node_graph(op, {"x": data, "i": idx, "u": upd}, {"reduction": reduction, **attrs})
    fn = torch_scatter(op, reduction, idx, data.shape, ax)
    check_rule(squared(g), {"x": data, "u": upd}, lambda x, u: fn(x, u) ** 2, seed=seed,
               torch_jvp_by_vjp=PROD_JVP if reduction == "mul" else None)


def tie_case(op: str, reduction: str, runtime_indices: bool, seed: int) -> None:
    """Values in {-2..2}: ties and zeros everywhere; against the brute-force definition and PyTorch, with
    constant indices (the sort and its masks fold into constants) and indices fed at run time (TopK)."""
    rng = np.random.default_rng(seed)
    data, idx, upd, attrs, ax = random_scatter(rng, op, small_ints=True)
    coef = rng.standard_normal(data.shape)
    g = scatter_loss(op, data, idx, upd, reduction, coef, attrs.get("axis"), runtime_indices)
    feeds = {"x": data, "u": upd, **({"i": idx} if runtime_indices else {})}
    gx, gu = scatter_grads(g, feeds)
    pos = flat_positions(op, data.shape, idx, upd.shape, ax)
    ex, eu = brute_force(reduction, data, pos, upd, coef)
    np.testing.assert_allclose(gx, ex, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(gu, eu, rtol=1e-13, atol=1e-13)
    tx, tu = torch.tensor(data, requires_grad=True), torch.tensor(upd, requires_grad=True)
    (torch_scatter(op, reduction, idx, data.shape, ax)(tx, tu) * torch.tensor(coef)).sum().backward()
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(gu, tu.grad.numpy(), rtol=1e-13, atol=1e-13)


OPS = pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
REDUCTIONS = pytest.mark.parametrize("reduction", ["mul", "max", "min"])
RUNTIME = pytest.mark.parametrize("runtime_indices", [False, True])


@OPS
@REDUCTIONS
@SETTINGS
@given(seed=seeds)
def test_scatter_reduction_sweep(op, reduction, seed):
    smooth_case(op, reduction, seed)


@OPS
@REDUCTIONS
@RUNTIME
@settings(max_examples=6, deadline=None)
@given(seed=seeds)
def test_scatter_reduction_ties_and_zeros(op, reduction, runtime_indices, seed):
    tie_case(op, reduction, runtime_indices, seed)


@pytest.mark.slow
@OPS
@REDUCTIONS
@settings(max_examples=60, deadline=None)
@given(seed=seeds)
def test_scatter_reduction_sweep_long(op, reduction, seed):
    smooth_case(op, reduction, seed)


@pytest.mark.slow
@OPS
@REDUCTIONS
@RUNTIME
@settings(max_examples=100, deadline=None)
@given(seed=seeds)
def test_scatter_reduction_ties_and_zeros_long(op, reduction, runtime_indices, seed):
    tie_case(op, reduction, runtime_indices, seed)


@pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
def test_scatter_mul_many_repeats_second_order(op):
    """One position written 9 times and others 2-3 times (four doubling steps): central differences, PyTorch
    and second order of the updates' gradient, whose scans are differentiated again."""
    rng = np.random.default_rng(12)
    data = rng.uniform(0.5, 1.5, (4, 3))
    if op == "ScatterND":
        idx = np.array([1] * 9 + [0, 0, -2, 3, 2, -1])[:, None]
        upd, ax, attrs = rng.uniform(0.5, 1.5, (15, 3)), 0, {}
    else:
        idx = np.array([[1, 1, 1, -3, 1, 1, 1, 1, 1, 0, 2], [0, 0, 3, -1, 2, 2, 2, 1, 1, 1, 1]]).T.copy()
        idx = np.concatenate([idx, idx[:, :1]], axis=1)
        upd, ax, attrs = rng.uniform(0.5, 1.5, idx.shape), 0, {"axis": 0}
    g = one_node_graph(op, {"x": data, "i": idx, "u": upd}, {"reduction": "mul", **attrs})
    fn = torch_scatter(op, "mul", idx, data.shape, ax)
    check_rule(squared(g), {"x": data, "u": upd}, lambda x, u: fn(x, u) ** 2, torch_jvp_by_vjp=PROD_JVP)


def test_scatter_symbolic_shapes():
    """Data with symbolic dimensions and indices fed at run time: the keys, the flat positions of the per-line
    sort and ScatterND's row numbers come from Shape ops; the number of updates along the axis is static."""
    rng = np.random.default_rng(13)
    data, upd = rng.standard_normal((3, 4)), rng.standard_normal((5, 2))
    idx = np.array([[0, 2], [-3, 1], [2, 2], [0, -1], [1, 1]])
    cases = [("ScatterElements", idx, upd, {"axis": 0}),
             ("ScatterND", np.array([[[0, 3]], [[-3, 3]], [[2, 1]]]), rng.standard_normal((3, 1)), {}),
             ("ScatterND", np.array([[0], [-3], [2], [2]]), rng.standard_normal((4, 4)), {})]  # rows: [R, S] view
    for op, i, u, attrs in cases:
        for reduction in ("mul", "max"):
            g = one_node_graph(op, {"x": data, "i": i, "u": u}, {"reduction": reduction, **attrs},
                               float_inputs=["x", "i", "u"])
            if op == "ScatterElements":  # the count along the axis static, the other dimension symbolic
                g.inputs = [ValueInfo("x", data.dtype, ("a", "b")), ValueInfo("i", i.dtype, (i.shape[0], "q")),
                            ValueInfo("u", u.dtype, (u.shape[0], "q"))]
            else:  # ScatterND: the index tuples static, the rows' width symbolic
                g.inputs = [ValueInfo("x", data.dtype, ("a", "b")), ValueInfo("i", i.dtype, i.shape),
                            ValueInfo("u", u.dtype, (*u.shape[:-1], "b") if i.shape[-1] == 1 else u.shape)]
            fn = torch_scatter(op, reduction, i, data.shape, 0)
            check_rule(squared(g), {"x": data, "i": i, "u": u}, lambda x, u, i, fn=fn: fn(x, u) ** 2, wrt=["x", "u"],
                       torch_jvp_by_vjp=PROD_JVP if reduction == "mul" else None)


@pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
def test_scatter_mul_updates_need_static_count(op):
    """The scans' length is fixed when the graph is built: a run-time number of updates is refused in one
    line naming the node (the data gradient and max/min need no such thing)."""
    x, u = np.ones((3, 2)), np.ones((2, 2))
    i = np.array([[1], [1]]) if op == "ScatterND" else np.array([[1, 0], [1, 2]])
    g = scatter_loss(op, x, i, u, "mul", np.ones((3, 2)), runtime_indices=True)
    g.inputs = [ValueInfo("x", x.dtype, x.shape), ValueInfo("u", u.dtype, ("k", 2)),
                ValueInfo("i", i.dtype, ("k", i.shape[1]))]
    with pytest.raises(rg.GraphError, match=rf"node 'scatter' \({op}\).*reduction='mul'.*'i'") as info:
        rg.gradient(g, "loss", ["u"])
    assert "\n" not in str(info.value)
    for reduction, wrt in [("mul", "x"), ("max", "u"), ("min", "x")]:
        g.nodes[0].attrs["reduction"] = reduction
        rg.gradient(g, "loss", [wrt])


# ---------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
@pytest.mark.parametrize("reduction", ["mul", "max", "min"])
def test_scatter_reduction_gradients_are_race_free(op, reduction):
    """No reducing ScatterND is emitted, and the gradients agree with the brute-force reference at 1, 2, 4
    and 8 onnxruntime threads (64 positions, 2048 updates: ~32 per position), with run-time indices."""
    rng = np.random.default_rng(14)
    rows, width, k = 64, 4, 512
    data = rng.integers(-2, 3, (rows, width)).astype(np.float64)
    if op == "ScatterND":
        idx = rng.integers(0, rows, k)[:, None]
        upd = rng.integers(-2, 3, (k, width)).astype(np.float64)
    else:
        idx = rng.integers(0, rows, (k, width))
        upd = rng.integers(-2, 3, (k, width)).astype(np.float64)
    if reduction == "mul":  # products of ~32 factors of -2..2 would overflow nothing, but keep them exact
        upd = np.where(rng.random(upd.shape) < 0.8, np.sign(upd) + (upd == 0), upd)
    coef = rng.standard_normal(data.shape)
    g = scatter_loss(op, data, idx, upd, reduction, coef, 0 if op == "ScatterElements" else None, True)
    gg = rg.gradient(g, "loss", ["x", "u"])
    for _, node in gg.walk():
        if node.name != "scatter":  # the forward's own
            assert node.op_type != "ScatterND" or node.attrs.get("reduction", "none") == "none", node.name
    ex, eu = brute_force(reduction, data, flat_positions(op, data.shape, idx, upd.shape, 0), upd, coef)
    model = rg.to_onnx(gg).SerializeToString()
    for threads in (1, 2, 4, 8):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        for _ in range(3):
            gx, gu = sess.run(["x_grad", "u_grad"], {"x": data, "u": upd, "i": idx})
            np.testing.assert_allclose(gx, ex, rtol=1e-12, atol=1e-12, err_msg=f"{threads} threads")
            np.testing.assert_allclose(gu, eu, rtol=1e-12, atol=1e-12, err_msg=f"{threads} threads")


# ---------------------------------------------------------------------------------------------- Dropout ratio


def dropout_graph(shape: tuple, ratio_dtype=np.float64, training=True, seed: int = 3) -> Graph:
    """``loss = sum(Dropout(x, r, training) * c)`` with a seeded mask and the mask as an output."""
    init = {} if isinstance(training, str) else {"t": np.array(training)}
    inputs = [ValueInfo("x", np.float64, shape), ValueInfo("r", ratio_dtype, ())]
    if isinstance(training, str):
        inputs.append(ValueInfo("t", np.bool_, ()))
    return Graph([Node("Dropout", ["x", "r", "t"], ["y0"], {"seed": seed}, "drop")], inputs, [ValueInfo("y0")], init)


def _grad_with_mask(g: Graph, feeds: dict, backend: str) -> tuple[dict, np.ndarray, Graph]:
    lg, _ = with_loss(g, {"y0": feeds["x"]})
    gg = rg.gradient(lg, "loss", ["x", "r"])
    mask = next(n for n in gg.nodes if n.op_type == "Dropout").outputs[1]
    gg.outputs.append(ValueInfo(mask, np.bool_, feeds["x"].shape))
    out = rg.Session(gg, backend=backend).run(feeds)
    return out, out[mask], lg


@pytest.mark.parametrize("ratio_dtype", [np.float64, np.float32])
def test_dropout_ratio_gradient(ratio_dtype):
    """y = x * mask / (1 - r) with the mask fixed: d r = sum(c * x * mask) / (1 - r)^2 = sum(c * y) / (1 - r).
    The reference evaluator draws the same mask for the same seed every run, so central differences in r apply
    (the mask moves only where r crosses a draw); PyTorch on the same mask agrees."""
    rng = np.random.default_rng(20)
    x, c = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    r = ratio_dtype(0.3)
    g = dropout_graph(x.shape, ratio_dtype)
    out, mask, lg = _grad_with_mask(g, {"x": x, "r": r, "y0_u": c}, "reference")
    assert 0 < mask.sum() < mask.size
    rr = float(r)
    hand = np.sum(c * x * mask) / (1 - rr) ** 2
    assert out["r_grad"].dtype == ratio_dtype and out["r_grad"].shape == ()
    np.testing.assert_allclose(out["r_grad"], hand, rtol=1e-12 if ratio_dtype == np.float64 else 1e-6)
    fwd = rg.Session(lg, backend="reference")
    h = 1e-6 if ratio_dtype == np.float64 else 1e-3
    numeric = (fwd.run({"x": x, "r": ratio_dtype(rr + h), "y0_u": c})["loss"]
               - fwd.run({"x": x, "r": ratio_dtype(rr - h), "y0_u": c})["loss"]) / (2 * h)
    np.testing.assert_allclose(out["r_grad"], numeric, rtol=1e-6 if ratio_dtype == np.float64 else 1e-3)
    tr = torch.tensor(rr, dtype=torch.float64, requires_grad=True)
    (torch.tensor(x) * torch.tensor(mask) / (1 - tr) * torch.tensor(c)).sum().backward()
    np.testing.assert_allclose(out["r_grad"], tr.grad.numpy(), rtol=1e-12 if ratio_dtype == np.float64 else 1e-6)


def test_dropout_ratio_gradient_onnxruntime():
    """onnxruntime draws a fixed sequence of masks per session for a seed, so fresh sessions give the same
    mask; its scale 1 / (1 - r) is computed in float32, so its differences in r agree to ~1e-4 only."""
    rng = np.random.default_rng(21)
    x, c = rng.standard_normal((5, 5)), rng.standard_normal((5, 5))
    g = dropout_graph(x.shape)
    out, mask, lg = _grad_with_mask(g, {"x": x, "r": np.array(0.4), "y0_u": c}, "onnxruntime")
    np.testing.assert_allclose(out["r_grad"], np.sum(c * x * mask) / 0.6 ** 2, rtol=1e-6)
    h = 1e-4
    loss = [rg.Session(lg).run({"x": x, "r": np.array(0.4 + s * h), "y0_u": c})["loss"] for s in (1, -1)]
    np.testing.assert_allclose(out["r_grad"], (loss[0] - loss[1]) / (2 * h), rtol=1e-3)


@pytest.mark.parametrize("training", [True, False])
def test_dropout_ratio_runtime_training_mode(training):
    """training_mode fed at run time: in inference mode the output is x whatever the ratio (gradient 0)."""
    rng = np.random.default_rng(22)
    x, c = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    g = dropout_graph(x.shape, training="t")
    out, mask, _ = _grad_with_mask(g, {"x": x, "r": np.array(0.75), "t": np.array(training), "y0_u": c}, "reference")
    expected = np.sum(c * x * mask) / 0.25 ** 2 if training else 0.0
    np.testing.assert_allclose(out["r_grad"], expected, rtol=1e-12)


def test_dropout_ratio_inference_mode_has_no_path():
    x = np.ones((2, 2))
    lg, _ = with_loss(dropout_graph(x.shape, training=False), {"y0": x})
    with pytest.warns(UserWarning, match="no path from 'r'"):
        gg = rg.gradient(lg, "loss", ["x", "r"])
    assert rg.Session(gg).run({"x": x, "r": np.array(0.5), "y0_u": x})["r_grad"] == 0.0


def test_dropout_ratio_second_order():
    """d2 loss / dr2 = 2 sum(c * y) / (1 - r)^2 for the fixed mask, and d2 loss / dr dx = c * mask / (1 - r)^2:
    the gradient of r_grad, against the hand formula and central differences of r_grad (reference backend)."""
    rng = np.random.default_rng(23)
    x, c = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    g = dropout_graph(x.shape)
    lg, _ = with_loss(g, {"y0": x})
    gg = rg.gradient(lg, "loss", ["x", "r"])
    gg.outputs = [o for o in gg.outputs if o.name == "r_grad"]
    g2 = rg.gradient(gg, "r_grad", ["x", "r"])
    assert sum(n.op_type == "Dropout" for n in g2.nodes) == 1
    feeds = {"x": x, "r": np.array(0.2), "y0_u": c}
    out = rg.Session(g2, backend="reference").run(feeds)
    assert g2.output_names == ["r_grad", "x_grad_1", "r_grad_1"]  # the names are taken: suffixed
    out = {"x_grad": out["x_grad_1"], "r_grad": out["r_grad_1"]}
    mask = out["x_grad"] != 0
    np.testing.assert_allclose(out["r_grad"], 2 * np.sum(c * x * mask) / 0.8 ** 3, rtol=1e-12)
    np.testing.assert_allclose(out["x_grad"], c * mask / 0.8 ** 2, rtol=1e-12)
    first = rg.Session(gg, backend="reference")
    h = 1e-6
    at = [first.run({**feeds, "r": np.array(0.2 + s * h)})["r_grad"] for s in (1, -1)]
    numeric = (at[0] - at[1]) / (2 * h)
    np.testing.assert_allclose(out["r_grad"], numeric, rtol=1e-6)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max"])
def test_broadcast_undone_when_both_dimensions_are_unknown(op):
    # declared (None, None) on both sides, fed (2, 3) and (2, 1): an unknown dimension is not another unknown one,
    # so b's gradient is summed over the broadcast axis (it used to keep (2, 3): a silently wrong gradient)
    a = np.array([[0.5, 1.5, 2.0], [1.0, -0.5, 3.0]])
    b = np.array([[0.7], [1.3]])
    g = Graph([Node(op, ["a", "b"], ["y"], name="op")],
              [ValueInfo("a", np.float64, (None, None)), ValueInfo("b", np.float64, (None, None))], [ValueInfo("y")])
    fns = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Max": torch.maximum}
    check_rule(g, {"a": a, "b": b}, lambda a, b: fns[op](a, b))
