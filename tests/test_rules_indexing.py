"""VJP rules of the indexing operators (Gather, GatherElements, GatherND, ScatterND, ScatterElements, OneHot,
TopK, Compress, ReverseSequence, TensorScatter), checked three ways by the harness (central differences,
PyTorch autograd, second order), plus the sparse gradients of gathered tables through ``revgraph.gradient``.

Where the rule's backward graph depends on the differentiated input (the tests that square the op's output),
the second-order check differentiates the emitted scatters and gathers themselves.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.harness import check_rule, one_node_graph
from kit.rules import squared, with_repeat, wrap

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

SETTINGS = settings(max_examples=8, deadline=None)
seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------- Gather


@SETTINGS
@given(seed=seeds, rank=st.integers(1, 3), idx_rank=st.integers(0, 2), data=st.data())
def test_gather(seed, rank, idx_rank, data):
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 4, rank))
    axis = data.draw(st.none() | st.integers(-rank, rank - 1), label="axis")
    ax = (axis or 0) % rank
    n = shape[ax]
    idx = np.asarray(rng.integers(-n, n, size=tuple(rng.integers(1, 4, idx_rank))))
    idx = with_repeat(idx.reshape(-1), n).reshape(idx.shape)
    idx = idx.astype(data.draw(st.sampled_from([np.int64, np.int32]), label="index dtype"))
    x = rng.standard_normal(shape)
    g = one_node_graph("Gather", {"x": x, "i": idx}, {} if axis is None else {"axis": axis})
    take = (slice(None),) * ax + (torch.tensor(idx.astype(np.int64)),)
    check_rule(squared(g), {"x": x}, lambda x: x[take] ** 2, seed=seed)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_scalar_index(axis):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4))
    g = one_node_graph("Gather", {"x": x, "i": np.array(-2, dtype=np.int64)}, {"axis": axis})
    take = (slice(None),) * (axis % 2) + (-2,)
    check_rule(g, {"x": x}, lambda x: x[take])


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_unknown_shapes_and_runtime_indices(axis):
    """Symbolic dimensions and indices fed at run time: the rule normalises and reshapes with Shape ops."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 2))
    n = x.shape[axis]
    idx = with_repeat(rng.integers(-n, n, size=6), n).reshape(2, 3)
    idx = idx.astype(np.int32 if axis else np.int64)
    g = one_node_graph("Gather", {"x": x, "i": idx}, {"axis": axis}, float_inputs=["x", "i"])
    g.inputs = [ValueInfo("x", x.dtype, ("a", "b", "c")), ValueInfo("i", idx.dtype, ("p", "q"))]
    take = (slice(None),) * axis

    def fn(x, i):
        return x[(*take, i.long())] ** 2

    check_rule(squared(g), {"x": x, "i": idx}, fn, wrt=["x"])


# ---------------------------------------------------------------------------------------------- GatherElements


@SETTINGS
@given(seed=seeds, rank=st.integers(1, 3), data=st.data())
def test_gather_elements(seed, rank, data):
    """Non-negative axes only: the reference evaluator's GatherElements mishandles negative ones."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 4, rank))
    axis = data.draw(st.none() | st.integers(0, rank - 1), label="axis")
    ax = (axis or 0) % rank
    n = shape[ax]
    # the reference evaluator's GatherElements wants the data's sizes outside the axis
    ishape = list(shape)
    ishape[ax] = int(rng.integers(2, 5))  # more reads than rows along the axis: repeats
    idx = with_repeat(np.moveaxis(rng.integers(-n, n, size=ishape), ax, 0), n)
    idx = np.ascontiguousarray(np.moveaxis(idx, 0, ax))
    x = rng.standard_normal(shape)
    g = one_node_graph("GatherElements", {"x": x, "i": idx}, {} if axis is None else {"axis": axis})
    pos = torch.tensor(wrap(idx, n))
    check_rule(squared(g), {"x": x}, lambda x: torch.gather(x, ax, pos) ** 2, seed=seed)


# ---------------------------------------------------------------------------------------------- GatherND


def nd_index(idx: np.ndarray, batch: tuple[int, ...]) -> tuple:
    """The numpy/torch advanced index equivalent to GatherND's ``indices`` with ``len(batch)`` batch dims."""
    lead = idx.shape[:-1]
    grids = []
    for j, size in enumerate(batch):
        shape = [1] * len(lead)
        shape[j] = size
        grids.append(np.broadcast_to(np.arange(size).reshape(shape), lead))
    return tuple(torch.tensor(np.ascontiguousarray(a)) for a in [*grids, *np.moveaxis(idx, -1, 0)])


@SETTINGS
@given(seed=seeds, b=st.integers(0, 2), m=st.integers(1, 2), rest=st.integers(0, 1), extra=st.integers(0, 1))
def test_gather_nd(seed, b, m, rest, extra):
    rng = np.random.default_rng(seed)
    batch = tuple(int(d) for d in rng.integers(1, 3, b))
    inner = tuple(int(d) for d in rng.integers(1, 4, m))
    shape = batch + inner + tuple(int(d) for d in rng.integers(1, 3, rest))
    lead = batch + tuple(int(d) for d in rng.integers(2, 4, extra)) + (int(rng.integers(2, 4)),)
    idx = np.stack([rng.integers(-d, d, size=lead) for d in inner], axis=-1)
    idx = np.moveaxis(with_repeat(np.moveaxis(idx, b, 0), np.array(inner)), 0, b)
    x = rng.standard_normal(shape)
    g = one_node_graph("GatherND", {"x": x, "i": np.ascontiguousarray(idx)}, {"batch_dims": b} if b else {})
    where = nd_index(idx, batch)
    check_rule(squared(g), {"x": x}, lambda x: x[where] ** 2, seed=seed)


def test_gather_nd_unknown_shapes():
    """batch_dims with shapes known only at run time: batch positions from Range, depth from Shape."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 2))
    idx = np.stack([rng.integers(-3, 3, size=(2, 5)), rng.integers(-4, 4, size=(2, 5))], axis=-1)
    idx[:, -1] = idx[:, 0] - np.array([3, 4]) * (idx[:, 0] >= 0)
    g = one_node_graph("GatherND", {"x": x, "i": idx}, {"batch_dims": 1}, float_inputs=["x", "i"])
    g.inputs = [ValueInfo("x", x.dtype, ("a", "b", "c", "d")), ValueInfo("i", idx.dtype, ("p", "q", "r"))]
    where = nd_index(idx, (2,))

    def fn(x, i):
        return x[where] ** 2

    check_rule(squared(g), {"x": x, "i": idx}, fn, wrt=["x"])


# ---------------------------------------------------------------------------------------------- scatters


def unique_rows(rng, dims: tuple[int, ...], count: int) -> np.ndarray:
    """``count`` distinct index tuples into ``dims`` (shape [count, len(dims)]), some written negatively."""
    flat = rng.choice(int(np.prod(dims)), size=count, replace=False)
    rows = np.stack(np.unravel_index(flat, dims), axis=-1)
    return np.where(rng.random(rows.shape) < 0.5, rows - np.array(dims), rows)


@SETTINGS
@given(seed=seeds, rank=st.integers(1, 3), m=st.integers(1, 3), reduction=st.sampled_from([None, "none", "add"]))
def test_scatter_nd(seed, rank, m, reduction):
    rng = np.random.default_rng(seed)
    m = min(m, rank)
    shape = tuple(int(d) for d in rng.integers(1, 4, rank))
    dims = shape[:m]
    if reduction == "add":
        count = int(rng.integers(2, 6))
        rows = with_repeat(np.stack([rng.integers(-d, d, size=count) for d in dims], axis=-1), np.array(dims))
    else:
        count = int(rng.integers(1, np.prod(dims) + 1))
        rows = unique_rows(rng, dims, count)
    lead = (count,) if rng.random() < 0.5 or count % 2 else (2, count // 2)
    idx = rows.reshape(*lead, m)
    x = rng.standard_normal(shape)
    u = rng.standard_normal(lead + shape[m:])
    g = one_node_graph("ScatterND", {"x": x, "i": idx, "u": u}, {} if reduction is None else {"reduction": reduction})
    where = tuple(torch.tensor(a) for a in np.moveaxis(wrap(idx, np.array(dims)), -1, 0))

    def fn(x, u):
        return x.index_put(where, u, accumulate=reduction == "add") ** 2

    check_rule(squared(g), {"x": x, "u": u}, fn, seed=seed)


@SETTINGS
@given(seed=seeds, rank=st.integers(1, 3), reduction=st.sampled_from([None, "none", "add"]), cut=st.booleans(),
       data=st.data())
def test_scatter_elements(seed, rank, reduction, cut, data):
    """``cut``: indices smaller than the data outside the axis (the updates' gradient reads a Slice of the
    cotangent first)."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 4, rank))
    axis = data.draw(st.none() | st.integers(-rank, rank - 1), label="axis")
    ax = (axis or 0) % rank
    n = shape[ax]
    ishape = [int(rng.integers(1, d + 1)) if cut else d for d in shape]
    if reduction == "add":
        ishape[ax] = int(rng.integers(2, 5))
        idx = np.moveaxis(with_repeat(np.moveaxis(rng.integers(-n, n, size=ishape), ax, 0), n), 0, ax)
    else:  # distinct positions along the axis: a random permutation per line, cut to the index shape
        perm = np.argsort(rng.random([*ishape[:ax], n, *ishape[ax + 1:]]), axis=ax)
        idx = np.take(perm, range(int(rng.integers(1, n + 1))), axis=ax)
        idx = np.where(rng.random(idx.shape) < 0.5, idx - n, idx)
    idx = np.ascontiguousarray(idx)
    x = rng.standard_normal(shape)
    u = rng.standard_normal(idx.shape)
    attrs = {} if axis is None else {"axis": axis}
    if reduction is not None:
        attrs["reduction"] = reduction
    g = one_node_graph("ScatterElements", {"x": x, "i": idx, "u": u}, attrs)
    pos = torch.tensor(wrap(idx, n))

    def fn(x, u):
        return torch.scatter_add(x, ax, pos, u) if reduction == "add" else torch.scatter(x, ax, pos, u)

    check_rule(squared(g), {"x": x, "u": u}, lambda x, u: fn(x, u) ** 2, seed=seed)


def test_scatter_nd_mul_data():
    rng = np.random.default_rng(4)
    x, u = rng.standard_normal((4, 3)), rng.standard_normal((3, 3))
    idx = np.array([[1], [-3], [3]])  # rows 1 and -3 are the same row: two factors there
    g = one_node_graph("ScatterND", {"x": x, "i": idx, "u": u}, {"reduction": "mul"}, float_inputs=["x"])
    factor = np.ones_like(x)
    np.multiply.at(factor, wrap(idx[:, 0], 4), u)
    check_rule(g, {"x": x}, lambda x: x * torch.tensor(factor))


def test_scatter_elements_mul_data():
    rng = np.random.default_rng(5)
    x, u = rng.standard_normal((3, 4)), rng.standard_normal((3, 3))
    idx = np.array([[0, -4, 2], [3, 3, 1], [1, 2, -1]])
    g = one_node_graph("ScatterElements", {"x": x, "i": idx, "u": u}, {"axis": 1, "reduction": "mul"},
                       float_inputs=["x"])
    pos, ut = torch.tensor(wrap(idx, 4)), torch.tensor(u)
    check_rule(g, {"x": x}, lambda x: torch.scatter_reduce(x, 1, pos, ut, reduce="prod"),
               torch_jvp_by_vjp="torch.func.jvp of scatter_reduce(reduce='prod') returns zeros (torch 2.13)")


# Reductions mul, max and min, with respect to the data and the updates: tests/test_rules_range_scatter_dropout.py.


# ---------------------------------------------------------------------------------------------- OneHot, TopK


@SETTINGS
@given(seed=seeds, rank=st.integers(1, 2), depth=st.integers(1, 4), data=st.data())
def test_one_hot(seed, rank, depth, data):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.none() | st.integers(-rank - 1, rank), label="axis")
    # indices one beyond either end give all-off rows
    idx = np.asarray(rng.integers(-depth - 1, depth + 1, size=tuple(rng.integers(1, 4, rank))))
    idx = idx.astype(data.draw(st.sampled_from([np.int64, np.int32, np.float32]), label="index dtype"))
    # OneHot wants indices of rank >= 1; a depth of shape [1] trips the reference evaluator, so scalar depth
    dep = np.array(depth, dtype=data.draw(st.sampled_from([np.int64, np.float32]), label="depth dtype"))
    v = rng.standard_normal(2)
    g = one_node_graph("OneHot", {"i": idx, "d": dep, "v": v}, {} if axis is None else {"axis": axis},
                       float_inputs=["v"])
    k = wrap(idx.astype(np.int64), depth)
    hot = (k[..., None] == np.arange(depth)) & ((k >= 0) & (k < depth))[..., None]
    hot = torch.tensor(np.moveaxis(hot, -1, (-1 if axis is None else axis) % (rank + 1)).astype(np.float64))
    check_rule(g, {"v": v}, lambda v: v[0] * (1 - hot) + v[1] * hot, seed=seed)


@SETTINGS
@given(seed=seeds, rank=st.integers(1, 3), largest=st.sampled_from([None, 0, 1]), data=st.data())
def test_top_k(seed, rank, largest, data):
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 5, rank))
    axis = data.draw(st.none() | st.integers(-rank, rank - 1), label="axis")
    ax = (-1 if axis is None else axis) % rank
    k = int(rng.integers(1, shape[ax] + 1))
    x = rng.standard_normal(shape)
    attrs = {} if axis is None else {"axis": axis}
    if largest is not None:
        attrs["largest"] = largest
    g = one_node_graph("TopK", {"x": x, "k": np.array([k], dtype=np.int64)}, attrs, n_out=2)
    big = largest is None or bool(largest)
    check_rule(squared(g), {"x": x}, lambda x: torch.topk(x, k, dim=ax, largest=big)[0] ** 2, seed=seed)


def test_top_k_indices_output_only_is_not_differentiable():
    x = np.random.default_rng(6).standard_normal((3, 4))
    g = one_node_graph("TopK", {"x": x, "k": np.array([2], dtype=np.int64)}, {}, n_out=2)
    g.nodes.append(Node("Cast", ["y1"], ["f"], {"to": 11}, name="cast"))
    g.nodes.append(Node("ReduceSum", ["f"], ["loss"], {"keepdims": 0}, name="sum"))
    g.outputs = [ValueInfo("loss")]
    with pytest.warns(UserWarning, match="no path"):
        gg = rg.gradient(g, loss="loss", wrt=["x"])
    np.testing.assert_array_equal(rg.Session(gg).run({"x": x})["x_grad"], np.zeros_like(x))


# ---------------------------------------------------------------------------------------------- sparse tables


def table_graph(second: str) -> tuple[Graph, dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """``loss = sum(u1 * t[i1]) + sum(u2 * second(t))`` where ``second`` is a Gather with 2-D indices or a Mul."""
    rng = np.random.default_rng(7)
    t = rng.standard_normal((5, 3))
    i1 = np.array([0, 3, -1, 3, -2])  # 3 twice, and -1 / -2 alias 4 / 3
    i2 = np.array([[1, 4], [-5, 0]])
    feeds = {"t": t, "i1": i1, "u1": rng.standard_normal((5, 3))}  # i1 fed at run time, i2 a constant
    nodes = [Node("Gather", ["t", "i1"], ["y1"], name="gather1")]
    if second == "Gather":
        nodes.append(Node("Gather", ["t", "i2"], ["y2"], name="gather2"))
        feeds["u2"] = rng.standard_normal((2, 2, 3))
    else:
        nodes.append(Node("Mul", ["t", "w"], ["y2"], name="mul"))
        feeds["w"] = rng.standard_normal((5, 3))
        feeds["u2"] = rng.standard_normal((5, 3))
    nodes += [
        Node("Mul", ["y1", "u1"], ["p1"], name="p1"),
        Node("Mul", ["y2", "u2"], ["p2"], name="p2"),
        Node("ReduceSum", ["p1"], ["s1"], {"keepdims": 0}, name="s1"),
        Node("ReduceSum", ["p2"], ["s2"], {"keepdims": 0}, name="s2"),
        Node("Add", ["s1", "s2"], ["loss"], name="loss"),
    ]
    g = Graph(nodes=nodes, inputs=[ValueInfo(k, v.dtype, v.shape) for k, v in feeds.items()],
              outputs=[ValueInfo("loss")], initializers={"i2": i2})
    return g, feeds, i1, i2


def test_two_gathers_give_sparse_rows():
    g, feeds, i1, i2 = table_graph("Gather")
    expected = np.zeros_like(feeds["t"])  # d loss / d t, by hand
    np.add.at(expected, wrap(i1, 5), feeds["u1"])
    np.add.at(expected, wrap(i2, 5), feeds["u2"])

    sparse = rg.gradient(g, loss="loss", wrt=["t"], sparse=True)
    onnx.checker.check_model(rg.to_onnx(sparse), full_check=True)
    names = sparse.output_names
    assert "t_grad_indices" in names and "t_grad_values" in names and "t_grad" not in names
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(sparse, backend=backend).run(feeds)
        rows, values = out["t_grad_indices"], out["t_grad_values"]
        assert rows.dtype == np.int64 and rows.shape == (i1.size + i2.size,)
        assert values.shape == (rows.size, 3)
        assert rows.min() >= 0 and rows.max() < 5
        dense = np.zeros_like(feeds["t"])
        np.add.at(dense, rows, values)
        np.testing.assert_allclose(dense, expected, rtol=1e-12, atol=1e-12)

    plain = rg.gradient(g, loss="loss", wrt=["t"], sparse=False)
    assert "t_grad" in plain.output_names
    np.testing.assert_allclose(rg.Session(plain).run(feeds)["t_grad"], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("accumulate", ["sum", "running"])
def test_gather_and_dense_reader_add_up(accumulate):
    """A table read by Gather and by Mul: the rows are scattered (added) into the dense gradient."""
    g, feeds, i1, _ = table_graph("Mul")
    expected = feeds["w"] * feeds["u2"]
    np.add.at(expected, wrap(i1, 5), feeds["u1"])
    gg = rg.gradient(g, loss="loss", wrt=["t"], sparse=True, accumulate=accumulate)
    assert "t_grad" in gg.output_names and "t_grad_indices" not in gg.output_names
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(rg.Session(gg, backend=backend).run(feeds)["t_grad"], expected, rtol=1e-12)


def test_gather_and_dense_reader_three_way():
    rng = np.random.default_rng(8)
    t, w = rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    i = np.array([2, -2, 0, 1, 1])
    g = Graph(
        nodes=[Node("Gather", ["t", "i"], ["y0"], name="gather"), Node("Mul", ["t", "w"], ["m"], name="mul"),
               Node("Mul", ["y0", "y0"], ["y1"], name="square"), Node("Mul", ["m", "t"], ["y2"], name="mul2")],
        inputs=[ValueInfo("t", t.dtype, t.shape), ValueInfo("w", w.dtype, w.shape)],
        outputs=[ValueInfo("y1"), ValueInfo("y2")],
        initializers={"i": i},
    )
    it = torch.tensor(i)
    check_rule(g, {"t": t, "w": w}, lambda t, w: (t[it] ** 2, t * w * t))


# ---------------------------------------------------------------------------------------------- Compress


@pytest.mark.parametrize("axis, cond", [
    (None, [True, False, True, True, False, False, True]),  # flattened, shorter than the 12 elements
    (0, [False, True, True]),
    (1, [True, False, False, True]),
    (-1, [False, True]),                                  # shorter than the axis: the rest is dropped
    (1, [False, False, False, False]),                    # nothing kept: an empty output, zero gradient
])
def test_compress(axis, cond):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 4))
    cond = np.array(cond)
    g = one_node_graph("Compress", {"x": x, "c": cond}, {} if axis is None else {"axis": axis})
    kept = torch.tensor(np.flatnonzero(cond))

    def fn(x, **_):
        return x.reshape(-1)[kept] if axis is None else x.index_select(axis % 2, kept)

    grads = check_rule(squared(g), {"x": x}, lambda x, **_: fn(x) ** 2)
    if not cond.any():
        np.testing.assert_array_equal(grads["x"], np.zeros_like(x))


@pytest.mark.parametrize("axis", [None, 0, 2])
def test_compress_condition_at_run_time(axis):
    """A condition fed at run time (NonZero in the backward graph) and a symbolic leading dimension."""
    rng = np.random.default_rng(12)
    x, cond = rng.standard_normal((4, 2, 3)), np.array([True, False, True])
    attrs = {} if axis is None else {"axis": axis}
    g = Graph([Node("Compress", ["x", "c"], ["y0"], attrs, "op")],
              [ValueInfo("x", x.dtype, ("N", 2, 3)), ValueInfo("c", np.dtype(bool), (3,))], [ValueInfo("y0")])
    kept = torch.tensor(np.flatnonzero(cond))
    fn = (lambda x, c: x.reshape(-1)[kept]) if axis is None else (lambda x, c: x.index_select(axis, kept))
    check_rule(g, {"x": x, "c": cond}, fn, wrt=["x"])


def test_compress_axis0_gives_sparse_rows():
    """Along axis 0 Compress is a Gather of rows: with ``sparse=True`` the gradient is its rows."""
    rng = np.random.default_rng(13)
    x, u = rng.standard_normal((5, 2)), rng.standard_normal((2, 2))
    g = Graph([Node("Compress", ["x", "c"], ["y"], {"axis": 0}, "op"), Node("Mul", ["y", "u"], ["p"], name="mul"),
               Node("ReduceSum", ["p"], ["loss"], {"keepdims": 0}, name="sum")],
              [ValueInfo("x", x.dtype, x.shape), ValueInfo("u", u.dtype, u.shape)], [ValueInfo("loss")],
              {"c": np.array([False, True, False, False, True])})
    out = rg.Session(rg.gradient(g, loss="loss", wrt=["x"], sparse=True)).run({"x": x, "u": u})
    np.testing.assert_array_equal(out["x_grad_indices"], [1, 4])
    np.testing.assert_array_equal(out["x_grad_values"], u)


# ---------------------------------------------------------------------------------------------- ReverseSequence


def reversed_index(shape: tuple, lens: np.ndarray, time_axis: int, batch_axis: int) -> torch.Tensor:
    """Indices along ``time_axis`` that ReverseSequence reads: the first ``lens[b]`` reversed, the rest kept."""
    idx = np.moveaxis(np.indices(shape)[time_axis], (batch_axis, time_axis), (0, 1)).copy()
    for b, n in enumerate(lens):
        idx[b, :n] = idx[b, :n][::-1]
    return torch.tensor(np.moveaxis(idx, (0, 1), (batch_axis, time_axis)).copy())


@pytest.mark.parametrize("time_axis, batch_axis, shape, lens", [
    (0, 1, (5, 3, 2), [5, 1, 3]),
    (1, 0, (3, 4), [2, 4, 1]),
    (0, 1, (4, 2, 3, 2), [4, 4]),
])
def test_reverse_sequence(time_axis, batch_axis, shape, lens):
    rng = np.random.default_rng(14)
    x, lens = rng.standard_normal(shape), np.array(lens, dtype=np.int64)
    g = one_node_graph("ReverseSequence", {"x": x, "lens": lens}, {"time_axis": time_axis, "batch_axis": batch_axis})
    idx = reversed_index(shape, lens, time_axis, batch_axis)
    check_rule(squared(g), {"x": x}, lambda x, **_: torch.gather(x, time_axis, idx) ** 2)


# ---------------------------------------------------------------------------------------------- TensorScatter


def torch_tensor_scatter(writes: np.ndarray | None, n_upd: int, axis: int, circular: bool):
    """TensorScatter as ``torch.scatter`` along ``axis`` at ``write_indices[b] + s`` (mod the cache length)."""
    def fn(p, u, **_):
        ax = axis % p.dim()
        w = np.zeros(p.shape[0], dtype=np.int64) if writes is None else writes
        slots = w[:, None] + np.arange(n_upd)[None]
        slots = slots % p.shape[ax] if circular else slots
        shape = [p.shape[0]] + [1] * (p.dim() - 1)
        shape[ax] = n_upd
        lined = slots.reshape([p.shape[0]] + [1] * (ax - 1) + [n_upd] + [1] * (p.dim() - ax - 1))
        return p.scatter(ax, torch.tensor(np.broadcast_to(lined, u.shape).copy()), u)
    return fn


def tensor_scatter_graph(past, upd, writes, attrs, dims=None) -> Graph:
    ins = {"p": past, "u": upd, **({"w": writes} if writes is not None else {})}
    g = one_node_graph("TensorScatter", ins, attrs)
    g.opsets = {"": 24}  # TensorScatter is new in opset 24
    if dims is not None:
        g.inputs = [ValueInfo(v.name, v.dtype, d) for v, d in zip(g.inputs, dims, strict=True)]
    return g


@pytest.mark.parametrize("mode, axis, writes", [
    ("linear", None, None),                   # prefill: slots 0 .. L-1, axis -2 by default
    ("linear", None, [0, 3]),
    ("linear", 1, [2, 0]),
    ("circular", None, [4, 6]),               # wraps around (6 + 2 > 5, 4 + 1 = 5) and past the length
    ("circular", 3, [1, 3]),
    ("circular", 1, None),
])
def test_tensor_scatter(mode, axis, writes):
    rng = np.random.default_rng(15)
    shape = [2, 3, 5, 4]
    ax = -2 if axis is None else axis
    ushape = list(shape)
    ushape[ax] = 2
    past, upd = rng.standard_normal(shape), rng.standard_normal(ushape)
    if mode == "linear" and writes is not None:
        writes = [min(w, shape[ax] - 2) for w in writes]
    writes = None if writes is None else np.array(writes, dtype=np.int64)
    attrs = {"mode": mode, **({} if axis is None else {"axis": axis})}
    g = tensor_scatter_graph(past, upd, writes, attrs)
    fn = torch_tensor_scatter(writes, 2, ax, mode == "circular")
    check_rule(squared(g), {"p": past, "u": upd}, lambda p, u: fn(p, u) ** 2)


def test_tensor_scatter_full_length_and_run_time_indices():
    """An update as long as the cache (every slot written: the cache gets zeros), write indices fed at run
    time, and symbolic batch and cache lengths (Shape-based ramps)."""
    rng = np.random.default_rng(16)
    past, upd = rng.standard_normal((2, 3, 2)), rng.standard_normal((2, 3, 2))
    writes = np.array([1, 2], dtype=np.int64)
    g = tensor_scatter_graph(past, upd, None, {"mode": "circular", "axis": 1})
    g.nodes[0].inputs.append("w")
    g.inputs = [ValueInfo("p", past.dtype, ("B", "M", 2)), ValueInfo("u", upd.dtype, ("B", "S", 2)),
                ValueInfo("w", np.dtype(np.int64), ("B",))]
    fn = torch_tensor_scatter(writes, 3, 1, True)
    grads = check_rule(g, {"p": past, "u": upd, "w": writes}, lambda p, u, w: fn(p, u), wrt=["p", "u"])
    np.testing.assert_array_equal(grads["p"], np.zeros_like(past))


def test_tensor_scatter_prefill_symbolic_lengths():
    """No write indices and symbolic cache and update lengths: the slots 0 .. S-1 from Shape-based ramps."""
    rng = np.random.default_rng(17)
    past, upd = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 2, 3))
    g = tensor_scatter_graph(past, upd, None, {"axis": 1}, dims=[("B", "M", 3), ("B", "S", 3)])
    fn = torch_tensor_scatter(None, 2, 1, False)
    check_rule(squared(g), {"p": past, "u": upd}, lambda p, u: fn(p, u) ** 2)


def test_tensor_scatter_strong_zeros():
    """The written slots of the cache get an exact 0 even where their cotangent is infinite: ``sum(1 /
    present)`` with zeros written has an infinite cotangent there, and the cache's other slots get -1."""
    past, upd = np.ones((1, 4, 2)), np.zeros((1, 2, 2))
    g = tensor_scatter_graph(past, upd, np.array([1], dtype=np.int64), {"axis": 1})
    g.nodes += [Node("Reciprocal", ["y0"], ["r"], name="recip"), Node("ReduceSum", ["r"], ["loss"], {"keepdims": 0},
                                                                       name="sum")]
    g.outputs = [ValueInfo("loss")]
    with np.errstate(divide="ignore"):
        out = rg.Session(rg.gradient(g, loss="loss", wrt=["p", "u"])).run({"p": past, "u": upd})
    expected = -np.ones_like(past)
    expected[:, 1:3] = 0.0
    np.testing.assert_array_equal(out["p_grad"], expected)
    assert np.isneginf(out["u_grad"]).all()


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize(("order", "scatters"), [((0, 1, 2), 0), ((2, 0, 1), 0), ((0, -1, 1), 0), ((1, 0), 0),
                                                 ((0, 2), 1), ((1, 1, 2), 1), ((1, 2), 1)])
def test_rows_split_by_constant_gathers(order, scatters, static):
    """q, k, v split from one packed tensor by Gather at constant indices (exported attention): when the
    indices name rows 0 .. K-1 once each, the table's gradient is the rows in index order followed by zeros
    for the other rows, with no scatter; a gap or a repeated row keeps the scatter. The table's shape static or
    not (exported attention computes it at run time). Against PyTorch autograd, both runtimes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 4))
    nodes = [Node("Constant", [], [f"i{k}"], {"value": np.array(i, np.int64)}, f"c{k}") for k, i in enumerate(order)]
    nodes += [Node("Gather", ["x", f"i{k}"], [f"r{k}"], {"axis": 0}, f"gather{k}") for k in range(len(order))]
    nodes += [Node("Sin", [f"r{k}"], [f"s{k}"], name=f"sin{k}") for k in range(len(order))]
    nodes += [Node("Mul", [f"s{k}", f"r{k}"], [f"m{k}"], name=f"mul{k}") for k in range(len(order))]
    nodes += [Node("Sum", [f"m{k}" for k in range(len(order))], ["total"], name="sum"),
              Node("ReduceSum", ["total"], ["loss"], {"keepdims": 0}, "loss")]
    g = Graph(nodes, [ValueInfo("x", np.float64, (3, 2, 4) if static else ("n", 2, None))],
              [ValueInfo("loss", np.float64, ())])
    gg = rg.gradient(g, loss="loss", wrt=["x"])
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    if not static and min(order) < 0:
        scatters = 1  # a negative index names a row only once the row count is known: at run time
    assert sum(n.op_type.startswith("Scatter") for n in gg.nodes) == scatters
    xt = torch.tensor(x, requires_grad=True)
    rows = [xt[i] for i in order]
    torch.stack([torch.sin(r) * r for r in rows]).sum().backward()
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(rg.Session(gg, backend=backend).run({"x": x})["x_grad"], xt.grad.numpy(),
                                   rtol=1e-12, atol=1e-12)
