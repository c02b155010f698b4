"""Gradients through ONNX sequences (issue 15, section 3): SequenceConstruct, SequenceAt, SequenceInsert,
SequenceErase, SplitToSequence, ConcatFromSequence (new_axis 0 and 1), SequenceEmpty and SequenceLength,
SequenceMap (as its Loop), sequences carried through Loop and returned by If. Each against PyTorch
(``torch.split`` / ``unbind`` / ``cat`` / ``stack`` / Python lists, autograd), float64 central differences, both
runtimes and second order (``harness.check_rule``); loops under the store and recompute policies."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from kit.harness import check_rule

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.float64
SEQUENCE_OPS = {"SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase", "SequenceAt",
                "SequenceLength", "SplitToSequence", "ConcatFromSequence", "SequenceMap"}


def i64(v):
    return np.array(v, np.int64)


def nd(op, ins, outs, name=None, **attrs):
    outs = outs if isinstance(outs, list) else [outs]
    return Node(op, ins, outs, attrs, name or f"{op}_{outs[0]}")


def graph(nodes, inputs, outputs, inits=None):
    """``inputs`` maps names to arrays (their dtype and shape are declared)."""
    return Graph(nodes, [ValueInfo(k, v.dtype, v.shape) for k, v in inputs.items()], [ValueInfo(o) for o in outputs],
                 inits or {})


def backward_ops(gg: Graph, g: Graph) -> list[str]:
    """Operator types of the nodes ``gradient`` added to ``g``, subgraphs included."""
    forward = {m.name for m in g.nodes}
    return [m.op_type for n in gg.nodes if n.name not in forward
            for m in [n, *(x for sub in n.subgraphs.values() for _, x in sub.walk())]]


RNG = np.random.default_rng(0)


# ---------------------------------------------------------------------------------------------- the minimal case


def test_minimal_case_split_to_sequence_reads_mul_reducesum():
    # Gemm -> SplitToSequence(split=3, axis=-1) -> SequenceAt(0), SequenceAt(1) -> Mul -> ReduceSum (issue 15)
    a, b = RNG.standard_normal((2, 4)), RNG.standard_normal((4, 9))
    g = graph([nd("Gemm", ["a", "b"], "h"), nd("SplitToSequence", ["h", "three"], "S", axis=-1),
               nd("SequenceAt", ["S", "zero"], "s0"), nd("SequenceAt", ["S", "one"], "s1"),
               nd("Mul", ["s0", "s1"], "m"), nd("ReduceSum", ["m"], "y", keepdims=0)],
              {"a": a, "b": b}, ["y"], {"three": i64(3), "zero": i64(0), "one": i64(1)})

    def torch_fn(a, b):
        q, k, _ = torch.split(a @ b, 3, dim=-1)
        return (q * k).sum()

    check_rule(g, {"a": a, "b": b}, torch_fn)
    # differentiated as Split: one Concat of the two cotangents and zeros for the unread piece, no sequence
    gg = rg.gradient(g, wrt=["a", "b"])
    ops = backward_ops(gg, g)
    assert not set(ops) & SEQUENCE_OPS, ops
    assert ops.count("Concat") == 1
    assert "Where" not in ops  # the pieces are products of a contraction: finite, plain Mul VJPs


# ---------------------------------------------------------------------------------------------- SplitToSequence


@pytest.mark.parametrize(("shape", "split", "axis", "keepdims", "reads"), [
    ((7, 3), 3, 0, 1, [0, -1, 0]),  # chunks 3, 3, 1 (the last one shorter); position 0 read twice
    ((2, 9), [2, 3, 4], 1, 1, [2, 1]),  # sizes; piece 0 unread
    ((2, 9), [2, 0, 7], -1, 1, [2, 0]),  # an empty piece
    ((3, 4), None, 1, 0, [3, -4, 1]),  # pieces of 1, squeezed (torch.unbind)
    ((3, 4), None, -2, 1, [1]),  # pieces of 1, kept
])
def test_split_to_sequence_reads_at_known_positions(shape, split, axis, keepdims, reads):
    x = RNG.standard_normal(shape)
    inits = {f"p{k}": i64(p) for k, p in enumerate(reads)}
    ins = ["x"] if split is None else ["x", "split"]
    if split is not None:
        inits["split"] = i64(split)
    nodes = [nd("SplitToSequence", ins, "S", axis=axis, keepdims=keepdims)]
    nodes += [nd("SequenceAt", ["S", f"p{k}"], f"r{k}") for k in range(len(reads))]
    nodes += [nd("Sin", [f"r{k}"], f"y{k}") for k in range(len(reads))]
    g = graph(nodes, {"x": x}, [f"y{k}" for k in range(len(reads))], inits)

    def torch_fn(x):
        parts = torch.unbind(x, axis) if split is None and not keepdims else \
            torch.split(x, 1 if split is None else split, dim=axis)
        return [torch.sin(parts[p]) for p in reads]

    check_rule(g, {"x": x}, torch_fn)
    sums = [nd("ReduceSum", [f"y{k}"], f"s{k}", keepdims=0) for k in range(len(reads))]
    loss = Graph([*nodes, *sums, nd("Sum", [f"s{k}" for k in range(len(reads))], "loss")], [ValueInfo("x", F64, shape)],
                 [ValueInfo("loss")], inits)
    gg = rg.gradient(loss, wrt=["x"])
    assert not set(backward_ops(gg, g)) & SEQUENCE_OPS  # positions and sizes known: no sequence


def test_split_to_sequence_reads_at_run_time_positions():
    # positions fed at run time (also equal to each other, and negative): the reads are added into a sequence of
    # zeros (SplitToSequence of zeros) at their positions, then concatenated
    x = RNG.standard_normal((9, 3))
    g = graph([nd("SplitToSequence", ["x", "split"], "S", axis=0), nd("SequenceAt", ["S", "p"], "s0"),
               nd("SequenceAt", ["S", "q"], "s1"), nd("SequenceAt", ["S", "last"], "s2"),
               nd("Tanh", ["s0"], "t0"), nd("Sin", ["s1"], "t1"), nd("ReduceSum", ["t0"], "y0", keepdims=0),
               nd("ReduceSum", ["t1"], "y1", keepdims=0), nd("ReduceSumSquare", ["s2"], "y2", keepdims=0),
               nd("Sum", ["y0", "y1", "y2"], "y")],
              {"x": x, "p": i64(0), "q": i64(0)}, ["y"], {"split": i64([2, 3, 4]), "last": i64(-1)})

    def torch_fn(x, p, q):
        s = torch.split(x, [2, 3, 4])
        return torch.tanh(s[int(p)]).sum() + torch.sin(s[int(q)]).sum() + (s[-1] ** 2).sum()

    for p, q in [(1, -2), (-3, 0), (2, -1)]:
        check_rule(g, {"x": x, "p": i64(p), "q": i64(q)}, torch_fn)


def test_split_to_sequence_of_an_empty_tensor():
    x = np.zeros((0, 6))
    g = graph([nd("SplitToSequence", ["x", "two"], "S", axis=1), nd("SequenceAt", ["S", "one"], "r"),
               nd("Exp", ["r"], "y")], {"x": x}, ["y"], {"two": i64(2), "one": i64(1)})
    grads = check_rule(g, {"x": x}, lambda x: torch.exp(torch.split(x, 2, dim=1)[1]), second_order=False)
    assert grads["x"].shape == (0, 6)


# ---------------------------------------------------------------------------------------------- ConcatFromSequence


@pytest.mark.parametrize("axis", [0, 1, -2])
def test_concat_from_sequence_of_different_sizes(axis):
    shapes = {0: [(2, 3), (4, 3), (1, 3)], 1: [(3, 2), (3, 4), (3, 1)], -2: [(2, 3), (4, 3), (1, 3)]}[axis]
    a, b, c = (RNG.standard_normal(s) for s in shapes)
    g = graph([nd("SequenceConstruct", ["a", "b", "c"], "S"), nd("ConcatFromSequence", ["S"], "y", axis=axis)],
              {"a": a, "b": b, "c": c}, ["y"])
    check_rule(g, {"a": a, "b": b, "c": c}, lambda a, b, c: torch.cat([a, b, c], axis))


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_concat_from_sequence_new_axis_stacks(axis):
    a, b, c = (RNG.standard_normal((2, 3)) for _ in range(3))
    g = graph([nd("SequenceConstruct", ["a", "b", "c"], "S"),
               nd("ConcatFromSequence", ["S"], "y", axis=axis, new_axis=1)], {"a": a, "b": b, "c": c}, ["y"])
    check_rule(g, {"a": a, "b": b, "c": c}, lambda a, b, c: torch.stack([a, b, c], axis))


def test_split_then_concat_with_a_read_as_well():
    # the sequence has a dense cotangent (from ConcatFromSequence) and reads (from SequenceAt): they add up
    x = RNG.standard_normal((6, 2))
    g = graph([nd("SplitToSequence", ["x", "two"], "S", axis=0), nd("ConcatFromSequence", ["S"], "c", axis=1),
               nd("SequenceAt", ["S", "one"], "r"), nd("Tanh", ["c"], "y1"), nd("Mul", ["r", "r"], "y2")],
              {"x": x}, ["y1", "y2"], {"two": i64(2), "one": i64(1)})

    def torch_fn(x):
        s = torch.split(x, 2)
        return torch.tanh(torch.cat(s, 1)), s[1] * s[1]

    check_rule(g, {"x": x}, torch_fn)


@pytest.mark.parametrize("accumulate", ["sum", "running"])
def test_two_dense_cotangents_of_one_sequence_add_up(accumulate):
    a, b = RNG.standard_normal((2, 3)), RNG.standard_normal((2, 3))
    g = graph([nd("SequenceConstruct", ["a", "b"], "S"), nd("ConcatFromSequence", ["S"], "c0", axis=0),
               nd("ConcatFromSequence", ["S"], "c1", axis=1, new_axis=1), nd("Sin", ["c0"], "s0"),
               nd("ReduceSum", ["s0"], "l0", keepdims=0), nd("ReduceSumSquare", ["c1"], "l1", keepdims=0),
               nd("Add", ["l0", "l1"], "loss")], {"a": a, "b": b}, ["loss"])
    g.outputs = [ValueInfo("loss", F64, ())]
    gg = rg.gradient(g, wrt=["a", "b"], accumulate=accumulate)
    out = rg.Session(gg).run({"a": a, "b": b})
    ref = rg.Session(gg, backend="reference").run({"a": a, "b": b})
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (a, b))
    loss = torch.sin(torch.cat([ta, tb], 0)).sum() + (torch.stack([ta, tb], 1) ** 2).sum()
    ga, gb = torch.autograd.grad(loss, [ta, tb])
    for got in (out, ref):
        np.testing.assert_allclose(got["a_grad"], ga.numpy(), rtol=1e-12)
        np.testing.assert_allclose(got["b_grad"], gb.numpy(), rtol=1e-12)


# ---------------------------------------------------------------------------------------------- construct, insert,
# erase


def test_sequence_construct_and_reads():
    a, b, c = (RNG.standard_normal((2, 2)) for _ in range(3))
    g = graph([nd("SequenceConstruct", ["a", "b", "c"], "S"), nd("SequenceAt", ["S", "m1"], "r0"),
               nd("SequenceAt", ["S", "zero"], "r1"), nd("SequenceAt", ["S", "two"], "r2"),
               nd("Mul", ["r0", "r1"], "y0"), nd("Exp", ["r2"], "y1")],
              {"a": a, "b": b, "c": c}, ["y0", "y1"], {"m1": i64(-1), "zero": i64(0), "two": i64(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no path from b
        grads = check_rule(g, {"a": a, "b": b, "c": c}, lambda a, b, c: (c * a, torch.exp(c)))
    np.testing.assert_array_equal(grads["b"], 0)  # never read


def test_insert_and_erase_at_known_positions_pass_reads_through():
    # [] -> [a] -> [a, b] -> [c, a, b] -> erase 1 -> [c, b]; reads at 0 and -1: c and b
    a, b, c = RNG.standard_normal((2, 3)), RNG.standard_normal((4, 3)), RNG.standard_normal((1, 3))
    g = graph([nd("SequenceEmpty", [], "E", dtype=onnx.TensorProto.DOUBLE), nd("SequenceInsert", ["E", "a"], "S1"),
               nd("SequenceInsert", ["S1", "b"], "S2"), nd("SequenceInsert", ["S2", "c", "zero"], "S3"),
               nd("SequenceErase", ["S3", "one"], "S4"), nd("SequenceAt", ["S4", "zero"], "r0"),
               nd("SequenceAt", ["S4", "m1"], "r1"), nd("Sin", ["r0"], "y0"), nd("Tanh", ["r1"], "y1")],
              {"a": a, "b": b, "c": c}, ["y0", "y1"], {"zero": i64(0), "one": i64(1), "m1": i64(-1)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no path from a
        grads = check_rule(g, {"a": a, "b": b, "c": c}, lambda a, b, c: (torch.sin(c), torch.tanh(b)))
    np.testing.assert_array_equal(grads["a"], 0)
    gg = rg.gradient(graph([*g.nodes, nd("ReduceSum", ["y1"], "loss", keepdims=0)], {"a": a, "b": b, "c": c},
                           ["loss"], g.initializers), wrt=["b"])
    assert not set(backward_ops(gg, g)) & SEQUENCE_OPS


@pytest.mark.parametrize(("p", "q"), [(1, -1), (-1, 0), (2, 2), (0, -3), (-3, -2), (3, 0)])
def test_insert_and_erase_at_run_time_positions(p, q):
    # a Python list's insert and del; q is read after the erase too
    a, b, c = RNG.standard_normal((2, 3)), RNG.standard_normal((4, 3)), RNG.standard_normal((1, 3))
    g = graph([nd("SequenceConstruct", ["a", "b", "c"], "S"), nd("SequenceInsert", ["S", "b", "p"], "S3"),
               nd("SequenceErase", ["S3", "q"], "S4"), nd("ConcatFromSequence", ["S4"], "y", axis=0),
               nd("SequenceAt", ["S4", "q"], "r"), nd("Sin", ["r"], "y2")],
              {"a": a, "b": b, "c": c, "p": i64(p), "q": i64(q)}, ["y", "y2"])

    def torch_fn(a, b, c, p, q):
        items = [a, b, c]
        items.insert(int(p) if p >= 0 else int(p) + 3, b)
        del items[int(q)]
        return torch.cat(items, 0), torch.sin(items[int(q)])

    feeds = {"a": a, "b": b, "c": c, "p": i64(p), "q": i64(q)}
    if p == 3:  # a position equal to the length: onnx 1.23's reference SequenceInsert inserts at the front there
        g.nodes += [nd("ReduceSum", ["y"], "l1", keepdims=0), nd("ReduceSum", ["y2"], "l2", keepdims=0),
                    nd("Add", ["l1", "l2"], "loss")]
        g.outputs = [ValueInfo("loss", F64, ())]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a is erased: no path
            out = rg.Session(rg.gradient(g, wrt=["a", "b", "c"])).run(feeds)
        t = {k: torch.tensor(v, requires_grad=k in "abc") for k, v in feeds.items()}
        y, y2 = torch_fn(**t)
        want = torch.autograd.grad(y.sum() + y2.sum(), [t[k] for k in "abc"], allow_unused=True)
        for k, w in zip("abc", want, strict=True):
            np.testing.assert_allclose(out[f"{k}_grad"], 0 if w is None else w.numpy(), rtol=1e-12, err_msg=k)
        return
    check_rule(g, feeds, torch_fn)


def test_erase_at_the_back_by_default():
    a, b = RNG.standard_normal((2, 3)), RNG.standard_normal((3, 3))
    g = graph([nd("SequenceConstruct", ["a", "b", "a"], "S"), nd("SequenceErase", ["S"], "S2"),
               nd("ConcatFromSequence", ["S2"], "y", axis=0)], {"a": a, "b": b}, ["y"])
    check_rule(g, {"a": a, "b": b}, lambda a, b: torch.cat([a, b], 0))


def test_integer_sequences_and_lengths_carry_no_gradient():
    x = RNG.standard_normal((4, 3))
    g = graph([nd("Cast", ["x"], "xi", to=onnx.TensorProto.INT64), nd("SplitToSequence", ["xi"], "S", axis=0),
               nd("SplitToSequence", ["x"], "T", axis=0), nd("SequenceLength", ["T"], "n"),
               nd("Cast", ["n"], "nf", to=onnx.TensorProto.DOUBLE), nd("ConcatFromSequence", ["S"], "ci", axis=0),
               nd("Cast", ["ci"], "cf", to=onnx.TensorProto.DOUBLE), nd("Mul", ["cf", "x"], "m"),
               nd("Mul", ["m", "nf"], "y")], {"x": x}, ["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cast to an integer
        check_rule(g, {"x": x}, lambda x: x.to(torch.int64).double() * x * 4.0)


def test_strong_zeros_through_a_sequence():
    # where(x > 0, sqrt(x), x) with both branches taken out of one sequence: at x = -1 the gradient is 1, not NaN
    x = np.array([-1.0, 4.0])
    g = graph([nd("Sqrt", ["x"], "r"), nd("SequenceConstruct", ["r", "x"], "S"), nd("SequenceAt", ["S", "zero"], "a"),
               nd("SequenceAt", ["S", "one"], "b"), nd("Greater", ["x", "fzero"], "pos"),
               nd("Where", ["pos", "a", "b"], "y")], {"x": x}, ["y"],
              {"zero": i64(0), "one": i64(1), "fzero": np.array(0.0)})
    g.outputs = [ValueInfo("y", F64, (2,))]
    g.nodes.append(nd("ReduceSum", ["y"], "loss", keepdims=0))
    g.outputs = [ValueInfo("loss", F64, ())]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sqrt(-1)
        out = rg.Session(rg.gradient(g, wrt=["x"])).run({"x": x})
    np.testing.assert_array_equal(out["x_grad"], [1.0, 0.25])


# ---------------------------------------------------------------------------------------------- loops and branches


def _carried_sequence_loop(read_previous: bool) -> Graph:
    """h <- tanh(h * w + x[t]) (or of the sequence's last element), appended to a carried sequence; after the loop
    the sequence is stacked and two of its elements read (a scripted PyTorch loop appending to a list)."""
    h_in = "prev" if read_previous else "h_in"
    nodes = [nd("Gather", ["x", "i"], "xt", axis=0), nd("Mul", [h_in, "w"], "hw"), nd("Add", ["hw", "xt"], "pre"),
             nd("Tanh", ["pre"], "h_out"), nd("SequenceInsert", ["s_in", "h_out"], "s_out"),
             nd("Identity", ["cond_in"], "cond_out")]
    if read_previous:
        nodes.insert(0, nd("SequenceAt", ["s_in", "m1"], "prev"))
    body = Graph(nodes, [ValueInfo("i", np.int64, ()), ValueInfo("cond_in", np.bool_, ()), ValueInfo("h_in", F64, (3,)),
                         ValueInfo("s_in", F64, None, "sequence")],
                 [ValueInfo("cond_out", np.bool_, ()), ValueInfo("h_out", F64, (3,)),
                  ValueInfo("s_out", F64, None, "sequence")], {"m1": i64(-1)})
    start = [nd("SequenceConstruct", ["h0"], "E")] if read_previous else [nd("SequenceEmpty", [], "E", dtype=11)]
    return Graph([*start, nd("Loop", ["M", "", "h0", "E"], ["hT", "S"], "loop", body=body),
                  nd("ConcatFromSequence", ["S"], "Y", axis=0, new_axis=1), nd("Mul", ["Y", "u"], "Yu"),
                  nd("ReduceSum", ["Yu"], "l1", keepdims=0), nd("SequenceAt", ["S", "one"], "s1"),
                  nd("SequenceAt", ["S", "mone"], "s2"), nd("Mul", ["s1", "s2"], "s11"),
                  nd("ReduceSum", ["s11"], "l2", keepdims=0), nd("Add", ["l1", "l2"], "loss")],
                 [ValueInfo("x", F64, (4, 3)), ValueInfo("w", F64, (3,)), ValueInfo("h0", F64, (3,)),
                  ValueInfo("u", F64, (5 if read_previous else 4, 3))],
                 [ValueInfo("loss", F64, ())], {"M": i64(4), "one": i64(1), "mone": i64(-1)})


def _unrolled(read_previous: bool):
    def fn(x, w, h0, u):
        h, items = h0, [h0] if read_previous else []
        for t in range(4):
            h = torch.tanh((items[-1] if read_previous else h) * w + x[t])
            items.append(h)
        return (torch.stack(items) * u).sum() + (items[1] * items[-1]).sum()

    return fn


@pytest.mark.parametrize("read_previous", [False, True], ids=["append", "read-last-then-append"])
@pytest.mark.parametrize("policy", ["store", "recompute"])
def test_loop_carried_sequence_against_the_unrolled_loop(policy, read_previous):
    g = _carried_sequence_loop(read_previous)
    wrt = ["x", "w", "h0"]
    feeds = {"x": RNG.standard_normal((4, 3)), "w": RNG.standard_normal(3), "h0": RNG.standard_normal(3),
             "u": RNG.standard_normal((5 if read_previous else 4, 3))}
    t = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
    first = torch.autograd.grad(_unrolled(read_previous)(**t), [t[k] for k in wrt], create_graph=True)
    gg = rg.gradient(g, wrt=wrt, checkpoint=policy)
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(gg, backend=backend).run(feeds)
        for k, want in zip(wrt, first, strict=True):
            np.testing.assert_allclose(out[f"{k}_grad"], want.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=k)

    # second order: the gradient of <grad, v>, differentiated through the backward loop's carried sequence
    vs = {f"{k}_v": RNG.standard_normal(feeds[k].shape) for k in wrt}
    hv = gg.copy()
    for k in wrt:
        hv.inputs.append(ValueInfo(f"{k}_v", F64, feeds[k].shape))
        hv.nodes += [nd("Mul", [f"{k}_grad", f"{k}_v"], f"{k}_gv"), nd("ReduceSum", [f"{k}_gv"], f"{k}_gs", keepdims=0)]
    hv.nodes.append(nd("Sum", [f"{k}_gs" for k in wrt], "hs"))
    hv.outputs = [ValueInfo("hs", F64, ())]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hg = rg.gradient(hv, loss="hs", wrt=wrt, checkpoint=policy)
    want = torch.autograd.grad(sum((d * torch.tensor(vs[f"{k}_v"])).sum() for k, d in zip(wrt, first, strict=True)),
                               [t[k] for k in wrt])
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(hg, backend=backend).run({**feeds, **vs})
        for name, w in zip(hg.output_names[-3:], want, strict=True):
            np.testing.assert_allclose(out[name], w.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_checkpoint_segments_fall_back_to_recompute_for_a_carried_sequence():
    # segments keep the carried values as stacked tensors, which a sequence cannot be: recompute, with a warning
    g = _carried_sequence_loop(False)
    with pytest.warns(UserWarning, match=r"carries a sequence, and checkpoint='sqrt'.*checkpoint='recompute'"):
        gg = rg.gradient(g, wrt=["x", "w"], checkpoint="sqrt")
    feeds = {"x": RNG.standard_normal((4, 3)), "w": RNG.standard_normal(3), "h0": RNG.standard_normal(3),
             "u": RNG.standard_normal((4, 3))}
    want = rg.Session(rg.gradient(g, wrt=["x", "w"])).run(feeds)
    got = rg.Session(gg).run(feeds)
    for k in ("x_grad", "w_grad"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12)


def test_carried_sequence_rebuilt_each_iteration_is_refused():
    # the new sequence does not come from the old one, which is only read: its cotangent would need its structure
    body = Graph([nd("SequenceAt", ["s_in", "zero"], "e"), nd("Mul", ["e", "w"], "h"),
                  nd("SequenceConstruct", ["h", "h"], "s_out"), nd("Identity", ["cond_in"], "cond_out")],
                 [ValueInfo("i", np.int64, ()), ValueInfo("cond_in", np.bool_, ()),
                  ValueInfo("s_in", F64, (3,), "sequence")],
                 [ValueInfo("cond_out", np.bool_, ()), ValueInfo("s_out", F64, (3,), "sequence")], {"zero": i64(0)})
    g = Graph([nd("SequenceConstruct", ["w"], "E"), nd("Loop", ["M", "", "E"], ["S"], "loop", body=body),
               nd("SequenceAt", ["S", "zero"], "r"), nd("ReduceSum", ["r"], "loss", keepdims=0)],
              [ValueInfo("w", F64, (3,))], [ValueInfo("loss", F64, ())], {"M": i64(3), "zero": i64(0)})
    with pytest.raises(rg.GraphError, match=r"loop-carried sequence 's_in' is not carried into 's_out'"):
        rg.gradient(g, wrt=["w"])


def _reads_everything_written(variant: str, initial: str) -> Graph:
    """tensorflow#13983's pattern: each iteration appends h to the carried sequence S, then reads all of S back,
    ``ConcatFromSequence`` (``variant="concat"``: h' = tanh(w * sum of S's elements)) or ``SequenceLength`` and
    ``SequenceAt`` over every position in an inner Loop (``"at"``: h' = tanh(w * sum of their squares)); S
    starts empty or as ``[w]`` (``initial``); 4 iterations, loss = sum(h)."""
    if variant == "concat":
        reads = [nd("ConcatFromSequence", ["s_out"], "all", axis=0, new_axis=1),
                 nd("ReduceSum", ["all", "ax0"], "tot", keepdims=0)]
    else:
        inner = Graph([nd("SequenceAt", ["s_out", "j"], "item"), nd("Mul", ["item", "item"], "sq"),
                       nd("Add", ["acc_in", "sq"], "acc_out"), nd("Identity", ["c_in"], "c_out")],
                      [ValueInfo("j", np.int64, ()), ValueInfo("c_in", np.bool_, ()), ValueInfo("acc_in", F64, (2,))],
                      [ValueInfo("c_out", np.bool_, ()), ValueInfo("acc_out", F64, (2,))])
        reads = [nd("SequenceLength", ["s_out"], "n"), nd("Loop", ["n", "", "zeros"], ["tot"], "inner", body=inner)]
    body = Graph([nd("SequenceInsert", ["s_in", "h_in"], "s_out"), *reads, nd("Mul", ["tot", "w"], "m"),
                  nd("Tanh", ["m"], "h_out"), nd("Identity", ["cond_in"], "cond_out")],
                 [ValueInfo("i", np.int64, ()), ValueInfo("cond_in", np.bool_, ()), ValueInfo("h_in", F64, (2,)),
                  ValueInfo("s_in", F64, (2,), "sequence")],
                 [ValueInfo("cond_out", np.bool_, ()), ValueInfo("h_out", F64, (2,)),
                  ValueInfo("s_out", F64, (2,), "sequence")])
    first = nd("SequenceEmpty", [], "s0", dtype=onnx.TensorProto.DOUBLE) if initial == "empty" else \
        nd("SequenceConstruct", ["w"], "s0")
    return graph([first, nd("Loop", ["T", "", "x", "s0"], ["hT", "sT"], "loop", body=body),
                  nd("ReduceSum", ["hT"], "loss", keepdims=0)],
                 {"x": np.zeros(2), "w": np.zeros(2)}, ["loss"],
                 {"T": i64(4), "ax0": i64([0]), "zeros": np.zeros(2)})


@pytest.mark.parametrize("policy", ["store", "recompute", "sqrt"])
@pytest.mark.parametrize("initial", ["empty", "construct"])
@pytest.mark.parametrize("variant", ["concat", "at"])
def test_a_body_reading_back_its_whole_carried_sequence(variant, initial, policy):
    # issue 39: reverse mode refused these (the backward body needs the sequence of every iteration); the
    # sequence is rebuilt from the stack of what was appended, and the gradients equal the unrolled loop's
    g = _reads_everything_written(variant, initial)
    x, w = np.array([0.3, -0.2]), np.array([0.5, 0.7])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sqrt: a loop carrying a sequence is differentiated with recompute
        gg = rg.gradient(g, "loss", wrt=["x", "w"], checkpoint=policy)
    got = rg.Session(gg).run({"x": x, "w": w})
    tx, tw = (torch.tensor(v, requires_grad=True) for v in (x, w))
    seq, h = ([] if initial == "empty" else [tw]), tx
    for _ in range(4):
        seq.append(h)
        h = torch.tanh(tw * (torch.stack(seq).sum(0) if variant == "concat" else sum(e * e for e in seq)))
    h.sum().backward()
    np.testing.assert_allclose(got["x_grad"], tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(got["w_grad"], tw.grad.numpy(), rtol=1e-12)
    if policy == "store":  # forward mode agrees (it carried (value, tangent) pairs already)
        t = {"x_tangent": np.array([1.0, -0.5]), "w_tangent": np.array([0.25, 2.0])}
        jv = rg.Session(rg.jvp(g, outputs=["loss"], inputs=["x", "w"])).run({"x": x, "w": w, **t})["loss_tangent"]
        np.testing.assert_allclose(jv, got["x_grad"] @ t["x_tangent"] + got["w_grad"] @ t["w_tangent"], rtol=1e-12)


def test_growing_elements_read_from_a_carried_sequence_are_refused():
    # each new element doubles the last one's length: a value read from the carried sequence has no fixed shape,
    # so neither it nor the sequence can be kept per iteration
    body = Graph([nd("SequenceAt", ["s_in", "m1"], "prev"), nd("Concat", ["prev", "prev"], "big", axis=0),
                  nd("Mul", ["big", "w"], "h"), nd("SequenceInsert", ["s_in", "h"], "s_out"),
                  nd("Identity", ["cond_in"], "cond_out")],
                 [ValueInfo("i", np.int64, ()), ValueInfo("cond_in", np.bool_, ()),
                  ValueInfo("s_in", F64, None, "sequence")],
                 [ValueInfo("cond_out", np.bool_, ()), ValueInfo("s_out", F64, None, "sequence")], {"m1": i64(-1)})
    g = Graph([nd("SequenceConstruct", ["w"], "E"), nd("Loop", ["M", "", "E"], ["S"], "loop", body=body),
               nd("SequenceAt", ["S", "m1"], "r"), nd("ReduceSum", ["r"], "loss", keepdims=0)],
              [ValueInfo("w", F64, (1,))], [ValueInfo("loss", F64, ())], {"M": i64(3), "m1": i64(-1)})
    with pytest.raises(rg.GraphError, match=r"needs the loop-carried sequence 's_in' of every iteration"):
        rg.gradient(g, wrt=["w"])


@pytest.mark.parametrize("policy", ["store", "recompute", "sqrt"])
def test_sequence_map_with_a_tensor_and_a_second_sequence(policy):
    # SequenceMap(S, w, S): r = tanh(e * w * e), r2 = sin(e); differentiated as its Loop
    x, w = RNG.standard_normal((4, 3)), RNG.standard_normal(3)
    body = Graph([nd("Mul", ["e", "ww"], "m"), nd("Mul", ["m", "e2"], "m2"), nd("Tanh", ["m2"], "r"),
                  nd("Sin", ["e"], "r2")],
                 [ValueInfo("e", F64, (1, 3)), ValueInfo("ww", F64, (3,)), ValueInfo("e2", F64, (1, 3))],
                 [ValueInfo("r", F64, (1, 3)), ValueInfo("r2", F64, (1, 3))])
    g = graph([nd("SplitToSequence", ["x"], "S", axis=0), nd("SequenceMap", ["S", "w", "S"], ["R", "R2"], body=body),
               nd("ConcatFromSequence", ["R"], "y", axis=0), nd("SequenceAt", ["R2", "two"], "y2")],
              {"x": x, "w": w}, ["y", "y2"], {"two": i64(2)})
    if policy == "store":
        check_rule(g, {"x": x, "w": w}, lambda x, w: (torch.tanh(x * w * x), torch.sin(x[2:3])))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sqrt: the loop carries sequences, differentiated with recompute
        gg = rg.gradient(graph([*g.nodes, nd("ReduceSum", ["y"], "l1", keepdims=0),
                                nd("ReduceSum", ["y2"], "l2", keepdims=0), nd("Add", ["l1", "l2"], "loss")],
                               {"x": x, "w": w}, ["loss"], g.initializers), wrt=["x", "w"], checkpoint=policy)
    tx, tw = (torch.tensor(v, requires_grad=True) for v in (x, w))
    want = torch.autograd.grad(torch.tanh(tx * tw * tx).sum() + torch.sin(tx[2]).sum(), [tx, tw])
    for backend in ("onnxruntime", "reference"):
        out = rg.Session(gg, backend=backend).run({"x": x, "w": w})
        np.testing.assert_allclose(out["x_grad"], want[0].numpy(), rtol=1e-10)
        np.testing.assert_allclose(out["w_grad"], want[1].numpy(), rtol=1e-10)


def test_if_returning_a_sequence():
    a, b = RNG.standard_normal((2, 3)), RNG.standard_normal((1, 3))
    then = Graph([nd("Mul", ["a", "a"], "aa"), nd("SequenceConstruct", ["aa", "b"], "t")], [],
                 [ValueInfo("t", F64, (None, 3), "sequence")], name="then")
    other = Graph([nd("Sin", ["b"], "sb"), nd("SequenceConstruct", ["sb", "a", "b"], "o")], [],
                  [ValueInfo("o", F64, (None, 3), "sequence")], name="else")
    for c in (True, False):
        g = graph([nd("If", ["c"], ["S"], "if", then_branch=then, else_branch=other),
                   nd("ConcatFromSequence", ["S"], "y", axis=0), nd("SequenceAt", ["S", "one"], "r"),
                   nd("Exp", ["r"], "y2")], {"a": a, "b": b}, ["y", "y2"], {"c": np.array(c), "one": i64(1)})

        def torch_fn(a, b, c=c):
            items = [a * a, b] if c else [torch.sin(b), a, b]
            return torch.cat(items, 0), torch.exp(items[1])

        check_rule(g, {"a": a, "b": b}, torch_fn)


# ---------------------------------------------------------------------------------------------- ONNX's node tests


def _onnx_sequence_cases() -> dict:
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node.collect_testcases()
    return {c.name: c for c in cases
            if c.name.startswith(("test_sequence_map", "test_split_to_sequence", "test_identity_sequence"))
            and "extract_shapes" not in c.name}  # that one's outputs are integers


ONNX_CASES = _onnx_sequence_cases()


def _wrapped(case) -> tuple[Graph, dict]:
    """The node test's model with each sequence input built by SequenceConstruct from float inputs (the test's
    elements), each sequence output read element by element, and the loss sum(sin(outputs))."""
    from onnx import numpy_helper

    from revgraph.onnx_io import graph_from_proto

    opset = max(case.model.opset_import[0].version, 21)
    core = graph_from_proto(case.model.graph, {"": opset})
    (inputs, outputs), nodes, ins, feeds, inits = case.data_sets[0], [], [], {}, {}
    for vi, data in zip(core.inputs, inputs, strict=True):
        arrays = [np.asarray(a) for a in data] if vi.kind == "sequence" else [np.asarray(
            numpy_helper.to_array(data) if isinstance(data, onnx.TensorProto) else data)]
        names = [f"{vi.name}_{k}" for k in range(len(arrays))] if vi.kind == "sequence" else [vi.name]
        for name, a in zip(names, arrays, strict=True):
            if a.dtype.kind == "f":
                ins.append(ValueInfo(name, a.dtype, a.shape))
                feeds[name] = a
            else:
                inits[name] = a
        if vi.kind == "sequence":
            nodes.append(nd("SequenceConstruct", names, vi.name))
    nodes += core.nodes
    parts = []
    for vi, data in zip(core.outputs, outputs, strict=True):
        reads = [vi.name]
        if vi.kind == "sequence":
            reads = [f"{vi.name}_at{k}" for k in range(len(data))]
            for k, r in enumerate(reads):
                inits[f"{r}_pos"] = i64(k)
                nodes.append(nd("SequenceAt", [vi.name, f"{r}_pos"], r))
        for r in reads:
            nodes += [nd("Sin", [r], f"{r}_sin"), nd("ReduceSum", [f"{r}_sin"], f"{r}_sum", keepdims=0)]
            parts.append(f"{r}_sum")
    nodes.append(nd("Sum", parts, "loss"))
    return Graph(nodes, ins, [ValueInfo("loss", ins[0].dtype, ())], inits, opsets={"": opset}), feeds


@pytest.mark.parametrize("name", list(ONNX_CASES))
def test_onnx_node_tests_of_sequence_operators(name):
    g, feeds = _wrapped(ONNX_CASES[name])
    onnx.checker.check_model(rg.to_onnx(rg.gradient(g, "loss")), full_check=True)
    report = rg.check_gradients(g, "loss", inputs=feeds)
    assert report.ok and all(row.status == "agree" for row in report.rows), report


# ---------------------------------------------------------------------------------------------- exported by PyTorch


@pytest.mark.slow
def test_torch_split_exported_by_dynamo_without_optimisation(tmp_path):
    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 9)

        def forward(self, x):
            q, k, v = self.lin(x).split(3, dim=-1)
            return ((q * k).sum(-1, keepdim=True) * v).sum()

    m, x = Heads().double(), torch.randn(2, 4, dtype=torch.float64)
    torch.onnx.export(m, (x,), dynamo=True, optimize=False, opset_version=21).save(tmp_path / "m.onnx")
    g = rg.load(str(tmp_path / "m.onnx"))
    assert "SplitToSequence" in [n.op_type for n in g.nodes]
    out = rg.Session(rg.gradient(g)).run({"x": x.numpy()})
    m(x).backward()
    np.testing.assert_allclose(out["lin.weight_grad"], m.lin.weight.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(out["lin.bias_grad"], m.lin.bias.grad.numpy(), rtol=1e-10)


@pytest.mark.slow
def test_scripted_loop_appending_to_a_list(tmp_path):
    class Cell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64) * 0.5)

        def forward(self, x):
            outs: list[torch.Tensor] = []
            h = x[0]
            for t in range(x.size(0)):
                h = torch.tanh(h @ self.w + x[t])
                outs.append(h)
            return torch.stack(outs).sum() + (outs[-1] * outs[0]).sum()

    m, x = torch.jit.script(Cell()), torch.randn(5, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (x,), str(tmp_path / "m.onnx"), dynamo=False, opset_version=17, input_names=["x"])
    g = rg.load(str(tmp_path / "m.onnx"))
    assert {"SequenceInsert", "Loop"} <= {n.op_type for _, n in g.walk()}
    xt = x.clone().requires_grad_()
    m(xt).backward()
    for policy in ("store", "recompute"):
        out = rg.Session(rg.gradient(g, checkpoint=policy)).run({"x": x.numpy()})
        np.testing.assert_allclose(out["w_grad"], m.w.grad.numpy(), rtol=1e-10)
        np.testing.assert_allclose(out["x_grad"], xt.grad.numpy(), rtol=1e-10)


# ------------------------------------------------------------------- ONNX's node tests as they are, by the CLI


def _raw_sequence_cases() -> dict:
    """Every ONNX backend node test of a sequence operator, its model as it is (sequence inputs and outputs)."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node.collect_testcases()
    return {c.name: c for c in cases if "sequence" in c.name and "reversesequence" not in c.name
            and "optional" not in c.name}


RAW_CASES = _raw_sequence_cases()


def _as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every float32 tensor and sequence element declared float64 (the node tests have no float
    constants), for central differences in float64."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    graphs = [m.graph]
    while graphs:  # the graph and its subgraphs (SequenceMap's body)
        gr = graphs.pop()
        graphs += [a.g for n in gr.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
        for vi in [*gr.input, *gr.output, *gr.value_info]:
            t = vi.type.sequence_type.elem_type if vi.type.HasField("sequence_type") else vi.type
            if t.tensor_type.elem_type == onnx.TensorProto.FLOAT:
                t.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    return m


def _loss(out) -> float:
    """The sum of every element of the output (a tensor or a sequence of tensors): what a seed of ones
    differentiates."""
    return float(sum(np.sum(a, dtype=np.float64) for a in out)) if isinstance(out, list) else float(np.sum(out))


def test_raw_sequence_node_tests_cover_the_sequence_operators():
    ops = {n.op_type for c in RAW_CASES.values() for n in c.model.graph.node}
    assert {"SplitToSequence", "SequenceInsert", "SequenceMap"} <= ops, ops


@pytest.mark.parametrize("name", sorted(RAW_CASES))
@pytest.mark.parametrize("command", ["grad", "jvp"])
def test_raw_sequence_node_tests_through_the_cli(name, command, tmp_path, capsys):
    """The issue-28 example (``grad`` of test_split_to_sequence_1, a sequence loss: exit 3) and its siblings: each
    sequence node test, as it is, is built (exit 0) or refused in one line (exit 2: no floating-point tensor to
    differentiate, several outputs), never exit 3; a built gradient agrees with float64 central differences of
    the sum of the loss's elements."""
    from revgraph.cli import main

    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(RAW_CASES[name].model, path)
    code = main([command, str(path), "-o", str(out)])
    err = capsys.readouterr().err
    if code != 0:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("revgraph: error:"), (code, err)
        assert not out.exists()
        return
    assert out.exists()
    if command != "grad":
        return
    g = rg.load(str(path))
    m64 = _as_float64(RAW_CASES[name].model)
    onnx.save(m64, tmp_path / "m64.onnx")
    g64 = rg.load(str(tmp_path / "m64.onnx"))
    gg = rg.gradient(g64)
    inputs = RAW_CASES[name].data_sets[0][0]
    feeds = {vi.name: ([np.asarray(a, F64) for a in v] if isinstance(v, list) else
                       np.asarray(v, F64) if np.asarray(v).dtype.kind == "f" else np.asarray(v))
             for vi, v in zip(g.inputs, inputs, strict=True)}
    grads = rg.Session(gg, backend="reference").run(feeds)
    fwd = rg.Session(g64, backend="reference")
    wanted = [o.name for o in gg.outputs if o.name.endswith("_grad")]
    assert wanted, gg.outputs
    for gname in wanted:
        x = gname[: -len("_grad")]
        base, numeric, h = feeds[x], np.zeros_like(feeds[x]), 1e-6
        for k in range(base.size):
            step = np.zeros(base.size)
            step[k] = h
            up = fwd.run({**feeds, x: base + step.reshape(base.shape)})
            down = fwd.run({**feeds, x: base - step.reshape(base.shape)})
            numeric.reshape(-1)[k] = (_loss(next(iter(up.values()))) - _loss(next(iter(down.values())))) / (2 * h)
        np.testing.assert_allclose(grads[gname], numeric, rtol=1e-6, atol=1e-8, err_msg=f"{name}: {gname}")
