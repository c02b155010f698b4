"""VJP rules of the shape operators (Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Expand, Concat, Split,
Tile, Slice, Pad) checked three ways by the harness: central differences, PyTorch autograd and second order.

Every op here is linear, so a one-node graph has a zero Hessian and its second-order check would never touch
the nodes the rule emits. The tests therefore square the op's outputs: the cotangent reaching the rule then
depends on the input, and the second-order check differentiates the rule's backward nodes themselves.
"Dynamic" variants hide the static shapes (and feed starts/ends/pads/repeats as graph inputs), so that the
rules take their Shape-based paths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from kit.harness import check_rule, double_backward, one_node_graph, ort_runner, with_loss

import revgraph as rg
from revgraph.errors import GraphError
from revgraph.ir import Graph, Node, ValueInfo

SETTINGS = settings(max_examples=8, deadline=None)
seeds = st.integers(0, 2**31 - 1)
I64 = np.iinfo(np.int64)


def squared(g: Graph) -> Graph:
    """``g`` with every output ``y`` replaced by ``y * y`` (outputs named ``<y>_sq``)."""
    g = g.copy()
    for y in g.output_names:
        g.nodes.append(Node("Mul", [y, y], [f"{y}_sq"], name=f"square/{y}"))
    g.outputs = [ValueInfo(f"{y}_sq") for y in g.output_names]
    return g


def hide_shapes(g: Graph, names, rank: bool = True) -> Graph:
    """Declare the inputs ``names`` with symbolic dimensions (or no rank at all when ``rank`` is False)."""
    g = g.copy()
    for i, vi in enumerate(g.inputs):
        if vi.name in names:
            shape = tuple(f"{vi.name}_{k}" for k in range(len(vi.shape))) if rank else None
            g.inputs[i] = ValueInfo(vi.name, vi.dtype, shape)
    return g


def op_graph(op, inputs, attrs=None, n_out=1, graph_inputs=(), hidden=(), rank=True, slots=None):
    """A one-node graph of ``op``, outputs squared; ``graph_inputs`` makes integer arrays graph inputs too.
    ``slots`` names the node's inputs in order, with "" for an omitted optional input (default: ``inputs``)."""
    floats = [k for k, v in inputs.items() if v.dtype.kind == "f" or k in graph_inputs]
    g = one_node_graph(op, inputs, attrs, n_out=n_out, float_inputs=floats)
    if slots is not None:
        g.nodes[0].inputs = list(slots)
    return squared(hide_shapes(g, hidden, rank) if hidden else g)


def feeds_of(inputs, graph_inputs=()):
    return {k: v for k, v in inputs.items() if v.dtype.kind == "f" or k in graph_inputs}


def sq(t):
    return t * t


# ---------------------------------------------------------------------------------------------- reshapes


def onnx_reshape_target(shape, target, allowzero):
    """The output shape of ONNX Reshape (operator spec: 0 copies the input dim unless allowzero, -1 infers)."""
    out = [shape[i] if (t == 0 and not allowzero) else t for i, t in enumerate(target)]
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1]))
        out[out.index(-1)] = int(np.prod(shape)) // known
    return out


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(1, 4), min_size=1, max_size=4), kind=st.integers(0, 3),
       allowzero=st.sampled_from([0, 1]), dynamic=st.booleans())
def test_reshape(seed, dims, kind, allowzero, dynamic):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(dims)
    if kind == 0:
        target = [-1]
    elif kind == 1:
        target = list(rng.permutation(dims))
        target[int(rng.integers(len(target)))] = -1
    elif kind == 2 and len(dims) >= 2:
        target, allowzero = [0, -1], 0  # 0 copies the first dimension
    else:
        target = [int(np.prod(dims[:1])), int(np.prod(dims[1:]))]
    shape = np.array(target, np.int64)
    out = onnx_reshape_target(dims, target, allowzero)
    g = op_graph("Reshape", {"x": x, "shape": shape}, {"allowzero": allowzero}, hidden=("x",) if dynamic else ())
    check_rule(g, {"x": x}, lambda x: sq(x.reshape(out)))


def test_reshape_allowzero_empty():
    """With allowzero=1 a 0 in the shape is a real zero dimension; the gradient is an empty array of x's shape."""
    x = np.zeros((2, 0, 3))
    g = op_graph("Reshape", {"x": x, "shape": np.array([3, 0, 2], np.int64)}, {"allowzero": 1})
    grads = check_rule(g, {"x": x}, lambda x: sq(x.reshape(3, 0, 2)))
    assert grads["x"].shape == (2, 0, 3)


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_flatten(seed, dims, data):
    rng = np.random.default_rng(seed)
    r = len(dims)
    axis = data.draw(st.none() | st.integers(-r, r), label="axis")
    a = 1 if axis is None else axis % r if axis < 0 else axis
    rows = int(np.prod(dims[:a]))
    x = rng.standard_normal(dims)
    attrs = {} if axis is None else {"axis": axis}
    check_rule(op_graph("Flatten", {"x": x}, attrs), {"x": x}, lambda x: sq(x.reshape(rows, -1)))


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(1, 3), min_size=1, max_size=4), data=st.data())
def test_squeeze(seed, dims, data):
    rng = np.random.default_rng(seed)
    r = len(dims)
    ones = [i for i, d in enumerate(dims) if d == 1]
    # an empty axes list is left out: onnxruntime then squeezes every unit axis, the spec is silent
    some = st.lists(st.sampled_from(ones), unique=True, min_size=1) if ones else st.none()
    chosen = data.draw(st.none() | some, label="axes")
    x = rng.standard_normal(dims)
    inputs = {"x": x}
    if chosen is None:
        out = [d for d in dims if d != 1]
    else:
        out = [d for i, d in enumerate(dims) if i not in chosen]
        inputs["axes"] = np.array([a - r if rng.random() < 0.5 else a for a in chosen], np.int64)
    check_rule(op_graph("Squeeze", inputs, hidden=("x",) if seed % 2 else ()), {"x": x}, lambda x: sq(x.reshape(out)))


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(1, 3), min_size=0, max_size=3), m=st.integers(1, 2))
def test_unsqueeze(seed, dims, m):
    rng = np.random.default_rng(seed)
    r = len(dims) + m
    axes = sorted(int(a) for a in rng.choice(r, m, replace=False))
    out = list(dims)
    for a in axes:
        out.insert(a, 1)
    x = np.asarray(rng.standard_normal(dims))
    given_axes = np.array([a - r if rng.random() < 0.5 else a for a in rng.permutation(axes)], np.int64)
    g = op_graph("Unsqueeze", {"x": x, "axes": given_axes}, hidden=("x",) if seed % 2 else ())
    check_rule(g, {"x": x}, lambda x: sq(x.reshape(out)))


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(1, 4), min_size=1, max_size=4), default=st.booleans())
def test_transpose(seed, dims, default):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(dims)
    perm = list(range(len(dims)))[::-1] if default else [int(p) for p in rng.permutation(len(dims))]
    attrs = {} if default else {"perm": perm}
    check_rule(op_graph("Transpose", {"x": x}, attrs), {"x": x}, lambda x: sq(x.permute(*perm)))


@SETTINGS
@given(seed=seeds, shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, max_side=3),
       dynamic=st.booleans())
def test_expand(seed, shapes, dynamic):
    """Expand broadcasts both ways: a 1 in the shape input keeps x's dim, a 1 in x takes the shape's."""
    rng = np.random.default_rng(seed)
    xs, target = shapes.input_shapes
    x = np.asarray(rng.standard_normal(xs))
    g = op_graph("Expand", {"x": x, "shape": np.array(target, np.int64)}, hidden=("x",) if dynamic else ())
    check_rule(g, {"x": x}, lambda x: sq(torch.broadcast_to(x, shapes.result_shape)))


# ---------------------------------------------------------------------------------------------- concat / split


@SETTINGS
@given(seed=seeds, rank=st.integers(1, 3), n=st.integers(1, 3), data=st.data(), dynamic=st.booleans())
def test_concat(seed, rank, n, data, dynamic):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-rank, rank - 1), label="axis")
    base = [int(d) for d in rng.integers(1, 4, rank)]
    inputs = {}
    for i in range(n):
        shape = list(base)
        shape[axis] = int(rng.integers(0, 4))  # empty pieces too
        inputs[f"x{i}"] = rng.standard_normal(shape)
    g = op_graph("Concat", inputs, {"axis": axis}, hidden=tuple(inputs) if dynamic else ())
    check_rule(g, dict(inputs), lambda **t: sq(torch.cat([t[f"x{i}"] for i in range(n)], dim=axis)))


@SETTINGS
@given(seed=seeds, rank=st.integers(1, 3), n=st.integers(1, 3), data=st.data())
def test_split(seed, rank, n, data):
    """Both forms (num_outputs, split input); pieces left out of the loss get no cotangent (zeros)."""
    rng = np.random.default_rng(seed)
    axis = data.draw(st.none() | st.integers(-rank, rank - 1), label="axis")
    ax = axis or 0
    dims = [int(d) for d in rng.integers(1, 4, rank)]
    inputs, attrs = {}, {} if axis is None else {"axis": axis}
    if data.draw(st.booleans(), label="num_outputs"):
        dims[ax] = int(rng.integers(n, 3 * n + 1))
        chunk = -(-dims[ax] // n)
        sizes = [min(chunk, dims[ax] - k * chunk) for k in range(n)]
        if sizes[-1] <= 0:  # not a valid num_outputs split: use even pieces
            dims[ax], sizes = chunk * n, [chunk] * n
        attrs["num_outputs"] = n
    else:
        sizes = [int(s) for s in rng.integers(0, 3, n)]
        dims[ax] = sum(sizes)
        inputs["split"] = np.array(sizes, np.int64)
    x = rng.standard_normal(dims)
    g = op_graph("Split", {"x": x, **inputs}, attrs, n_out=n)
    used = sorted(int(k) for k in rng.choice(n, int(rng.integers(1, n + 1)), replace=False))

    def torch_fn(x):
        pieces = torch.split(x, sizes, dim=ax)
        return [sq(pieces[k]) for k in used]

    check_rule(g, {"x": x}, torch_fn, outputs=[f"y{k}_sq" for k in used])


# ---------------------------------------------------------------------------------------------- tile


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(1, 3), min_size=1, max_size=3), dynamic=st.booleans())
def test_tile(seed, dims, dynamic):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(dims)
    reps = rng.integers(1, 4, len(dims)).astype(np.int64)
    extra = ("repeats",) if dynamic else ()
    g = op_graph("Tile", {"x": x, "repeats": reps}, graph_inputs=extra, hidden=("x",) if dynamic else ())
    feeds = feeds_of({"x": x, "repeats": reps}, extra)
    check_rule(g, feeds, lambda x, **_: sq(x.repeat(*[int(r) for r in reps])))


def test_tile_zero_repeat():
    x = np.random.default_rng(0).standard_normal((2, 3))
    g = op_graph("Tile", {"x": x, "repeats": np.array([0, 2], np.int64)})
    grads = check_rule(g, {"x": x}, lambda x: sq(x.repeat(0, 2)))
    np.testing.assert_array_equal(grads["x"], 0.0)


def test_tile_unknown_rank_is_a_one_line_error():
    x = np.ones((2, 3))
    g = one_node_graph("Tile", {"x": x, "repeats": np.array([1, 2], np.int64)}, float_inputs=["x", "repeats"])
    g.inputs = [ValueInfo("x", np.float64, None), ValueInfo("repeats", np.int64, None)]
    with pytest.raises(GraphError) as info:
        rg.gradient(g, loss="y0", wrt=["x"])
    assert "node 'op' (Tile)" in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- slice


def onnx_slice_indices(dim, start, end, step):
    """Slice-13 along one axis, written from the operator spec (independent of the rule's own helper)."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    lo, hi = (0, dim) if step > 0 else (0, dim - 1)
    start = min(max(start, lo), hi)
    end = min(max(end, 0 if step > 0 else -1), dim if step > 0 else dim - 1)
    return list(range(start, end, step))


def torch_slice(x, dims, axes, starts, ends, steps):
    for a, s, e, t in zip(axes, starts, ends, steps, strict=True):
        a = a % len(dims)
        x = x.index_select(a, torch.tensor(onnx_slice_indices(dims[a], s, e, t), dtype=torch.long))
    return x


def bound(rng, d):
    """A start or end: in range, out of range either way, or the INT64 sentinels."""
    choice = rng.integers(6)
    if choice == 0:
        return int(I64.max)
    if choice == 1:
        return int(I64.min)
    return int(rng.integers(-2 * d - 2, 2 * d + 3))


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       variant=st.sampled_from(["static", "dynamic", "dynamic_axes", "int32"]))
def test_slice(seed, dims, variant):
    """Random starts/ends (negative, clamped, INT64 sentinels), steps of either sign, axes in any order and
    sign; the parameters constant, fed at run time with hidden shapes, or with the axes fed at run time."""
    rng = np.random.default_rng(seed)
    r = len(dims)
    k = int(rng.integers(1, r + 1))
    axes = [int(a) - r if rng.random() < 0.4 else int(a) for a in rng.choice(r, k, replace=False)]
    steps = [int(rng.choice([-3, -2, -1, 1, 2, 3])) for _ in axes]
    starts = [bound(rng, dims[a]) for a in axes]
    ends = [bound(rng, dims[a]) for a in axes]
    # Where the runtimes depart from the operator spec, keep away: onnx.reference slices like numpy, which
    # empties a negative-step slice starting before -dim where the spec clamps the start to 0
    # (test_slice_negative_step_start_before_begin covers that case), and onnxruntime reads an end of
    # INT64_MAX with a negative step as "to the beginning" where the spec clamps it to dim - 1.
    starts = [s if t > 0 or s >= -dims[a] else -dims[a] for s, t, a in zip(starts, steps, axes, strict=True)]
    ends = [e if t > 0 or e != I64.max else dims[a] for e, t, a in zip(ends, steps, axes, strict=True)]
    for i, a in enumerate(axes):  # mostly non-empty selections (an empty one makes the whole gradient 0)
        if not onnx_slice_indices(dims[a], starts[i], ends[i], steps[i]) and rng.random() < 0.8:
            starts[i], ends[i] = (0, dims[a]) if steps[i] > 0 else (-1, -dims[a] - 1)
    x = rng.standard_normal(dims)
    itype = np.int32 if variant == "int32" else np.int64
    if itype == np.int32:
        starts = [int(np.clip(v, -(2**31), 2**31 - 1)) for v in starts]
        ends = [int(np.clip(v, -(2**31), 2**31 - 1)) for v in ends]
    inputs = {"x": x, "starts": np.array(starts, itype), "ends": np.array(ends, itype)}
    omit_axes = axes == list(range(k)) and rng.random() < 0.5
    if not omit_axes:
        inputs["axes"] = np.array(axes, itype)
    if any(s != 1 for s in steps) or rng.random() < 0.5:
        inputs["steps"] = np.array(steps, itype)
    extra = {"static": (), "int32": (), "dynamic": ("starts", "ends"), "dynamic_axes": ("axes",)}[variant]
    extra = tuple(n for n in extra if n in inputs)
    hidden = ("x",) if variant == "dynamic" else ()
    slots = ["x", "starts", "ends", "axes" if "axes" in inputs else "", "steps" if "steps" in inputs else ""]
    g = op_graph("Slice", inputs, graph_inputs=extra, hidden=hidden, slots=slots)
    check_rule(g, feeds_of(inputs, extra), lambda x, **_: sq(torch_slice(x, dims, axes, starts, ends, steps)))


def test_slice_dynamic_steps_unknown_dims():
    """Steps fed at run time (so the interleaving stride and the reversal are graph values)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 5))
    inputs = {"x": x, "starts": np.array([-1, 0], np.int64), "ends": np.array([-100, 100], np.int64),
              "axes": np.array([0, -1], np.int64), "steps": np.array([-2, 3], np.int64)}
    g = op_graph("Slice", inputs, graph_inputs=("steps",), hidden=("x",))
    check_rule(g, feeds_of(inputs, ("steps",)),
               lambda x, **_: sq(torch_slice(x, (7, 5), [0, -1], [-1, 0], [-100, 100], [-2, 3])))


@pytest.mark.parametrize("start", [-7, int(I64.min)])
def test_slice_negative_step_start_before_begin(start):
    """Operator spec: with a negative step, a start before -dim clamps to 0 (so x[0] is selected); numpy and
    onnx.reference empty the slice instead, so this runs under onnxruntime only."""
    x = np.random.default_rng(2).standard_normal((3, 4))
    inputs = {"x": x, "starts": np.array([start, -1], np.int64), "ends": np.array([int(I64.min), -9], np.int64),
              "axes": np.array([0, 1], np.int64), "steps": np.array([-1, -2], np.int64)}
    ort_only_check(op_graph("Slice", inputs), {"x": x}, lambda x: sq(x[:1].flip(0)[:, [3, 1]]), ["x"])


def test_slice_empty_selection_gives_zeros():
    x = np.random.default_rng(1).standard_normal((4, 3))
    inputs = {"x": x, "starts": np.array([3], np.int64), "ends": np.array([1], np.int64)}
    g = one_node_graph("Slice", inputs)
    grads = check_rule(g, {"x": x}, lambda x: x[3:1])
    np.testing.assert_array_equal(grads["x"], 0.0)


def test_slice_dynamic_axes_unknown_rank_is_a_one_line_error():
    x = np.ones((2, 3))
    inputs = {"x": x, "starts": np.array([0], np.int64), "ends": np.array([1], np.int64), "axes": np.array([1])}
    g = one_node_graph("Slice", inputs, float_inputs=["x", "axes"])
    g.inputs[0] = ValueInfo("x", np.float64, None)
    with pytest.raises(GraphError) as info:
        rg.gradient(g, loss="y0", wrt=["x"])
    assert "node 'op' (Slice)" in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- pad


def torch_pad(x, dims, pads, axes, mode, cv=None):
    """ONNX Pad written with PyTorch ops: negative pads crop first, then the mode pads the cropped row (what
    onnxruntime does; the harness checks the forward values against it). Non-constant modes gather the
    ``np.pad`` index map of each axis; constant mode is ``F.pad`` of ``x - cv`` plus ``cv``."""
    k = len(axes)
    axes = [a % len(dims) for a in axes]
    if mode == "constant":
        width = [0] * (2 * len(dims))
        for a, b, e in zip(axes, pads[:k], pads[k:], strict=True):
            width[2 * (len(dims) - 1 - a)], width[2 * (len(dims) - 1 - a) + 1] = b, e
        if cv is None:
            return F.pad(x, width)
        return F.pad(x - cv, width) + cv
    for a, b, e in zip(axes, pads[:k], pads[k:], strict=True):
        cut_b, cut_a = max(-b, 0), max(-e, 0)
        src = np.pad(np.arange(dims[a] - cut_b - cut_a), (max(b, 0), max(e, 0)), mode=mode) + cut_b
        x = x.index_select(a, torch.tensor(src, dtype=torch.long))
    return x


def pad_case(rng, dims, mode, negative=False, use_axes=None):
    """Pads for ``dims``: reflect at most dim-1 (onnxruntime's limit), edge and wrap beyond the dim too."""
    r = len(dims)
    use_axes = bool(rng.integers(2)) if use_axes is None else use_axes
    axes = list(range(r))
    if use_axes:
        chosen = rng.choice(r, int(rng.integers(1, r + 1)), replace=False)
        axes = [int(a) - r if rng.random() < 0.5 else int(a) for a in chosen]
    limit = {"reflect": lambda d: d - 1, "edge": lambda d: d + 2, "wrap": lambda d: 2 * d + 1,
             "constant": lambda d: 3}[mode]
    before = [int(rng.integers(0, limit(dims[a]) + 1)) for a in axes]
    after = [int(rng.integers(0, limit(dims[a]) + 1)) for a in axes]
    if negative:
        for i, a in enumerate(axes):
            if dims[a] > 2 and rng.random() < 0.7:
                if rng.random() < 0.5:
                    before[i] = -int(rng.integers(1, dims[a] - 1))
                else:
                    after[i] = -int(rng.integers(1, dims[a] - 1))
        if mode == "reflect":  # onnxruntime checks reflect pads against the cropped size
            for i, a in enumerate(axes):
                n = dims[a] - max(-before[i], 0) - max(-after[i], 0)
                before[i], after[i] = min(before[i], n - 1), min(after[i], n - 1)
    return (axes if use_axes else None), before + after


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       variant=st.sampled_from(["static", "no_value", "dynamic_pads", "hidden"]))
def test_pad_constant(seed, dims, variant):
    """Constant mode: the gradient of x is the cotangent without the border; constant_value gets the sum of
    the cotangent over the border."""
    rng = np.random.default_rng(seed)
    axes, pads = pad_case(rng, dims, "constant")
    x = rng.standard_normal(dims)
    inputs = {"x": x, "pads": np.array(pads, np.int64)}
    if variant != "no_value":
        inputs["value"] = np.array(rng.standard_normal())
    if axes is not None:
        inputs["axes"] = np.array(axes, np.int64)
    extra = ("pads",) if variant == "dynamic_pads" else ()
    hidden = ("x",) if variant == "hidden" else ()
    cv_given = "value" in inputs
    slots = ["x", "pads", "value" if cv_given else "", *(["axes"] if axes is not None else [])]
    g = op_graph("Pad", inputs, graph_inputs=extra, hidden=hidden, slots=slots)
    check_rule(g, feeds_of(inputs, extra),
               lambda x, value=None, **_: sq(torch_pad(x, dims, pads, axes or list(range(len(dims))), "constant",
                                                      value if cv_given else None)))


@SETTINGS
@given(seed=seeds, dims=st.lists(st.integers(2, 4), min_size=1, max_size=3),
       mode=st.sampled_from(["reflect", "edge", "wrap"]), dynamic=st.booleans())
def test_pad_modes(seed, dims, mode, dynamic):
    """Reflect/edge/wrap: every x element gets the sum of the cotangents of its copies. Static sizes use
    slices and pads; ``dynamic`` (pads fed at run time) scatters through a padded index grid."""
    rng = np.random.default_rng(seed)
    axes, pads = pad_case(rng, dims, mode)
    x = rng.standard_normal(dims)
    inputs = {"x": x, "pads": np.array(pads, np.int64)}
    if axes is not None:
        inputs["axes"] = np.array(axes, np.int64)
    extra = ("pads",) if dynamic else ()
    slots = ["x", "pads", *(["", "axes"] if axes is not None else [])]
    g = op_graph("Pad", inputs, {"mode": mode}, graph_inputs=extra, slots=slots)
    check_rule(g, feeds_of(inputs, extra),
               lambda x, **_: sq(torch_pad(x, dims, pads, axes or list(range(len(dims))), mode)))


def test_pad_modes_hidden_shape():
    """Constant pads but unknown dims: the scatter path."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4))
    inputs = {"x": x, "pads": np.array([2, 1, 0, 3], np.int64)}
    g = op_graph("Pad", inputs, {"mode": "reflect"}, hidden=("x",))
    check_rule(g, {"x": x}, lambda x: sq(torch_pad(x, (3, 4), [2, 1, 0, 3], [0, 1], "reflect")))


def ort_only_check(g: Graph, feeds: dict, torch_fn, wrt: list[str], seed: int = 0) -> None:
    """The harness checks, for graphs that onnx.reference cannot run (negative pads: np.pad rejects them):
    onnxruntime only, against PyTorch first and second derivatives and central differences."""
    rng = np.random.default_rng(seed)
    fwd = ort_runner(g)(feeds)
    lg, outputs = with_loss(g, fwd)
    us = {f"{y}_u": rng.standard_normal(fwd[y].shape) for y in outputs}
    tin = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
    tout = torch_fn(**tin)
    np.testing.assert_allclose(tout.detach().numpy(), fwd[outputs[0]], rtol=1e-12, atol=1e-12)
    total = (tout * torch.tensor(us[f"{outputs[0]}_u"])).sum()
    tgrads = torch.autograd.grad(total, [tin[w] for w in wrt], create_graph=True)

    gg = rg.gradient(lg, loss="loss", wrt=wrt)
    got = ort_runner(gg)({**feeds, **us})
    for w, t in zip(wrt, tgrads, strict=True):
        np.testing.assert_allclose(got[f"{w}_grad"], t.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=w)
    v = {w: rng.standard_normal(feeds[w].shape) for w in wrt}
    h = 1e-6
    run_loss = ort_runner(lg)
    plus = run_loss({**feeds, **us, **{w: feeds[w] + h * v[w] for w in wrt}})["loss"]
    minus = run_loss({**feeds, **us, **{w: feeds[w] - h * v[w] for w in wrt}})["loss"]
    analytic = sum(float(np.sum(got[f"{w}_grad"] * v[w])) for w in wrt)
    np.testing.assert_allclose(analytic, (plus - minus) / (2 * h), rtol=1e-6, atol=1e-8)

    hvp = double_backward(gg, wrt, feeds)
    second = ort_runner(hvp)({**feeds, **us, **{f"{w}_v": v[w] for w in wrt}})
    s = sum((t * torch.tensor(v[w])).sum() for w, t in zip(wrt, tgrads, strict=True))
    expected = torch.autograd.grad(s, [tin[w] for w in wrt], allow_unused=True)
    for w, t in zip(wrt, expected, strict=True):
        want = np.zeros_like(feeds[w]) if t is None else t.numpy()
        np.testing.assert_allclose(second[hvp.output_names[-len(wrt) + wrt.index(w)]], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pad_negative(mode, seed):
    """Negative pads crop x: the cropped elements get zero gradient, in every mode."""
    rng = np.random.default_rng(seed)
    dims = [int(d) for d in rng.integers(3, 6, 2)]
    axes, pads = pad_case(rng, dims, mode, negative=True, use_axes=seed == 2)
    if all(p >= 0 for p in pads):
        pads[0] = -1
    x = rng.standard_normal(dims)
    inputs = {"x": x, "pads": np.array(pads, np.int64)}
    if mode == "constant":
        inputs["value"] = np.array(0.5)
    if axes is not None:
        inputs["axes"] = np.array(axes, np.int64)
    slots = ["x", "pads", "value" if mode == "constant" else "", *(["axes"] if axes is not None else [])]
    g = op_graph("Pad", inputs, {"mode": mode}, slots=slots)
    wrt = ["x", "value"] if mode == "constant" else ["x"]
    ort_only_check(g, feeds_of(inputs), lambda x, value=None: sq(
        torch_pad(x, dims, pads, axes or [0, 1], mode, value)), wrt)


def test_pad_default_mode_and_scalar_value_grad():
    """No mode attribute means constant; constant_value's gradient is the border sum (here with u = 1)."""
    x = np.arange(6.0).reshape(2, 3)
    g = one_node_graph("Pad", {"x": x, "pads": np.array([1, 0, 0, 2], np.int64), "value": np.array(2.0)})
    lg = g.copy()
    lg.nodes.append(Node("ReduceSum", ["y0"], ["loss"], {"keepdims": 0}, name="sum"))
    lg.outputs = [ValueInfo("loss")]
    gg = rg.gradient(lg, loss="loss", wrt=["x", "value"])
    out = rg.Session(gg).run({"x": x, "value": np.array(2.0)})
    np.testing.assert_array_equal(out["x_grad"], np.ones((2, 3)))
    assert out["value_grad"].shape == () and float(out["value_grad"]) == 3 * 5 - 6


# ---------------------------------------------------------------------------------------------- not differentiable


def test_shape_producers_cut_the_path():
    """Shape, Size, ConstantOfShape, Range, NonZero, EyeLike and Constant carry no gradient: the gradient of
    x * EyeLike(x) + ConstantOfShape(Shape(x)) * Size(x) + Range-based values flows only through x itself."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 3))
    nodes = [
        Node("EyeLike", ["x"], ["eye"], name="eye"),
        Node("Mul", ["x", "eye"], ["diag"], name="diag"),
        Node("Shape", ["x"], ["shp"], name="shape"),
        Node("ConstantOfShape", ["shp"], ["ones"], {"value": np.ones(1, np.float64)}, name="cos"),
        Node("Size", ["x"], ["n"], name="size"),
        Node("Cast", ["n"], ["nf"], {"to": 11}, name="cast"),
        Node("Mul", ["ones", "nf"], ["c"], name="scale"),
        Node("NonZero", ["x"], ["nz"], name="nonzero"),
        Node("Constant", [], ["k"], {"value": np.array(2.0)}, name="const"),
        Node("Range", ["x0", "k", "one"], ["rng"], name="range"),
        Node("ReduceSum", ["rng"], ["rs"], {"keepdims": 0}, name="rsum"),
        Node("Add", ["diag", "c"], ["t"], name="add"),
        Node("Mul", ["t", "rs"], ["t1"], name="mul"),
        Node("Cast", ["nz"], ["nzf"], {"to": 11}, name="cast_nz"),
        Node("ReduceMax", ["nzf"], ["top"], {"keepdims": 0}, name="top"),
        Node("Mul", ["t1", "top"], ["y0"], name="mul_top"),
    ]
    g = Graph(nodes=nodes, inputs=[ValueInfo("x", np.float64, (3, 3))], outputs=[ValueInfo("y0")],
              initializers={"x0": np.array(0.0), "one": np.array(1.0)})
    # y = (x * I + ones * 9) * sum(Range(0, 2, 1)) * max(NonZero(x)) = (x * I + 9) * 1 * 2 (no zero in x)
    check_rule(squared(g), {"x": x}, lambda x: sq((x * torch.eye(3, dtype=torch.float64) + 9.0) * 2.0),
               wrt=["x"])


def test_static_backward_stays_in_shape_family():
    """With known sizes, the backward of a strided, reversed Slice and of a reflect Pad is built from slices,
    pads and sums only (no scatter), so its own gradient needs no indexing rule."""
    x = np.random.default_rng(4).standard_normal((6, 5))
    allowed = {"Constant", "Slice", "Pad", "Unsqueeze", "Reshape", "ReduceSum", "Sum"}
    graphs = [
        one_node_graph("Slice", {"x": x, "starts": np.array([5, 0]), "ends": np.array([int(I64.min), 5]),
                                 "axes": np.array([0, 1]), "steps": np.array([-2, 3])}),
        one_node_graph("Pad", {"x": x, "pads": np.array([3, 1, 2, 4])}, {"mode": "reflect"}),
    ]
    for g in graphs:
        gg = rg.gradient(g, loss="y0", wrt=["x"])
        used = {n.op_type for n in gg.nodes if n.name.startswith("grad/op/")}
        assert used and used <= allowed, used


@pytest.mark.parametrize(("upper", "k", "shape"), [(1, 0, (4, 5)), (0, 0, (3, 4)), (1, 2, (2, 3, 4)),
                                                   (0, -1, (2, 5, 3)), (1, None, (3, 3)), (0, 7, (3, 4))])
def test_trilu(upper, k, shape):
    x = np.random.default_rng(3).standard_normal(shape)
    inputs = {"x": x} if k is None else {"x": x, "k": np.array(k, np.int64)}
    g = op_graph("Trilu", inputs, {"upper": upper})
    fn = torch.triu if upper else torch.tril
    check_rule(g, {"x": x}, lambda x: sq(fn(x, 0 if k is None else k)), wrt=["x"])


def test_trilu_keeps_strong_zeros_for_infinite_cotangents():
    # loss = sum(1 / Trilu(x)) with a zero kept on the diagonal: the cotangent is -inf there, the discarded
    # triangle gets exact zeros (not 0 * inf)
    g = Graph([Node("Trilu", ["x"], ["t"], {"upper": 1}, "tri"), Node("Add", ["t", "one"], ["s"], name="add"),
               Node("Reciprocal", ["s"], ["r"], name="rec"),
               Node("ReduceSum", ["r"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float64, (3, 3))], [ValueInfo("loss", np.float64, ())], {"one": np.ones((3, 3))})
    x = np.array([[-1.0, 2.0, 3.0], [4.0, 0.5, 6.0], [7.0, 8.0, 9.0]])
    got = rg.Session(rg.gradient(g)).run({"x": x})["x_grad"]
    xt = torch.tensor(x, requires_grad=True)
    (1 / (torch.triu(xt) + 1)).sum().backward()
    assert got[0, 0] == -np.inf and np.array_equal(np.tril(got, -1), np.zeros((3, 3)))
    np.testing.assert_array_equal(got, xt.grad.numpy())
