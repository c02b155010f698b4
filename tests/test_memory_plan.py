"""The memory planner (issue 24, part 2; src/revgraph/autodiff/memory): which residuals a gradient graph keeps,
what it recomputes under ``memory=`` / ``--memory-budget``, and that no memory option changes a gradient.

Saved bytes are computed from the written graph (``saved_bytes``: the forward values its backward nodes read)
and asserted against counts made by hand in the comments; gradients against the default plan's (which the
rest of the suite holds to central differences and PyTorch), against torch.autograd for the model zoo.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from conftest import DATA_DIR
from kit.chains import tanh_chain
from kit.harness import double_backward
from kit.loops import body, loop, n

import revgraph as rg
from revgraph.autodiff.memory import (
    REMAT_PREFIX,
    Budget,
    as_budget,
    is_backward_node,
    parse_budget,
    residuals,
    saved_bytes,
)
from revgraph.cli import main
from revgraph.errors import RevgraphError
from revgraph.ir import Graph, Node, ValueInfo

F32 = np.float32
B, H = 4, 16
LAYER = B * H * 4  # bytes of one [4, 16] float32 activation


def _chain(layers: int, extra=None, batch: int | str = B) -> Graph:
    """``x -> (MatMul w_l -> Tanh) x layers -> ReduceSum`` on [batch, 16] (:func:`kit.chains.tanh_chain`)."""
    return tanh_chain(layers, H, batch, extra)


def _feeds(batch: int = B) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((batch, H)).astype(F32)}


def _grads(gg: Graph, feeds) -> dict[str, np.ndarray]:
    out = rg.Session(gg).run(feeds)
    return {k: v for k, v in out.items() if k.endswith("_grad")}


def _same(a: dict, b: dict, rtol=1e-6) -> None:
    assert a.keys() == b.keys() and a
    for k, v in a.items():
        np.testing.assert_allclose(v, b[k], rtol=rtol, atol=1e-7, err_msg=k)


def _remat(gg: Graph) -> list[Node]:
    return [node for node in gg.nodes if node.name.startswith(REMAT_PREFIX)]


# ------------------------------------------------------------------------------------------- the default plan


def test_default_plan_recomputes_a_reshape_instead_of_keeping_its_copy():
    # h = tanh(x w) [64, 64] float64 (32 KiB); r = reshape(h, [128, 32]); y = r v. The backward reads h (Tanh's
    # VJP) and r (v's gradient r^T g): 2 x 32 KiB. r is a free copy of h, which is kept anyway: the default plan
    # recomputes the Reshape in the backward and keeps h alone, 32 KiB.
    rng = np.random.default_rng(0)
    f64, n = np.float64, 64
    g = Graph([Node("MatMul", ["x", "w"], ["m"], name="mm"), Node("Tanh", ["m"], ["h"], name="act"),
               Node("Reshape", ["h", "shape"], ["r"], name="reshape"), Node("MatMul", ["r", "v"], ["y"], name="mm2"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, name="sum")],
              [ValueInfo("x", f64, (n, n))], [ValueInfo("loss", f64, ())],
              {"w": rng.standard_normal((n, n)) / 8, "v": rng.standard_normal((32, 8)),
               "shape": np.array([128, 32], np.int64)})
    gg = rg.gradient(g, wrt=["w", "v"])
    assert gg.memory_plan.saved_before == 2 * n * n * 8
    assert saved_bytes(gg) == gg.memory_plan.saved_after == n * n * 8
    assert residuals(gg) == ["h"]
    assert [node.op_type for node in _remat(gg)] == ["Reshape"]
    assert "reshape" in [node.name for node in gg.nodes]  # the forward copy stays for mm2: it is freed after it
    x = np.random.default_rng(1).standard_normal((n, n))
    torch_w, torch_v = (torch.tensor(g.initializers[k], requires_grad=True) for k in ("w", "v"))
    (torch.tanh(torch.tensor(x) @ torch_w).reshape(128, 32) @ torch_v).sum().backward()
    got = rg.Session(gg).run({"x": x})
    np.testing.assert_allclose(got["w_grad"], torch_w.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["v_grad"], torch_v.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_default_plan_leaves_copies_that_save_less_than_16_kib():
    # the same with h [4, 16] float32 (256 bytes): one more node to run is not worth 256 bytes
    rng = np.random.default_rng(0)
    g = Graph([Node("MatMul", ["x", "w"], ["m"], name="mm"), Node("Tanh", ["m"], ["h"], name="act"),
               Node("Reshape", ["h", "shape"], ["r"], name="reshape"), Node("MatMul", ["r", "v"], ["y"], name="mm2"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, name="sum")],
              [ValueInfo("x", F32, (B, H))], [ValueInfo("loss", F32, ())],
              {"w": rng.standard_normal((H, H)).astype(F32), "v": rng.standard_normal((8, 8)).astype(F32),
               "shape": np.array([8, 8], np.int64)})
    gg = rg.gradient(g, wrt=["w", "v"])
    assert saved_bytes(gg) == 2 * LAYER and not _remat(gg)
    assert saved_bytes(rg.gradient(g, wrt=["w", "v"], memory=1.0)) == 2 * LAYER  # 1.0 is the default plan
    assert saved_bytes(rg.gradient(g, wrt=["w", "v"], memory=0.99)) == LAYER  # any budget: every byte counts


def test_default_plan_changes_nothing_that_saves_no_bytes():
    # the chain keeps its 8 Tanh outputs (8 x 256 bytes) and has no free op to recompute
    gg = rg.gradient(_chain(8))
    assert saved_bytes(gg) == 8 * LAYER
    assert not _remat(gg)


# ------------------------------------------------------------------------------------------------ budgets


@pytest.mark.parametrize(("memory", "kept", "recomputed_matmuls"), [
    (1.0, 8, 0),  # the default plan
    (0.5, 4, 4),  # half: every dropped h_l is recomputed from a kept h_(l-1) (one MatMul and one Tanh each)
    (0.25, 2, 6),
    (0.0, 0, 8),  # nothing: the whole forward is recomputed from x
    (0, 0, 8),  # bytes
    (3 * LAYER, 3, 5),  # a byte budget of three activations
])
def test_budgets_on_a_chain_keep_what_was_counted(memory, kept, recomputed_matmuls):
    g = _chain(8)
    gg = rg.gradient(g, memory=memory)
    assert saved_bytes(gg) == gg.memory_plan.saved_after == kept * LAYER
    assert sum(node.op_type == "MatMul" for node in _remat(gg)) == recomputed_matmuls
    _same(_grads(gg, _feeds()), _grads(rg.gradient(g), _feeds()))


def test_recomputation_runs_after_the_forward_and_before_its_first_reader():
    gg = rg.gradient(_chain(8), memory=0.25)
    first_backward = min(k for k, node in enumerate(gg.nodes) if is_backward_node(node))
    for k, node in enumerate(gg.nodes):
        if node.name.startswith(REMAT_PREFIX):
            assert k > first_backward - 1
            readers = [j for j, other in enumerate(gg.nodes) if set(node.outputs) & set(other.inputs)]
            assert readers and min(readers) > k
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)


def test_random_draws_are_kept_never_recomputed():
    # h7 * noise with noise = RandomNormalLike(h7): Mul's VJP reads the noise (256 bytes), which must be the
    # same draw as the forward's: under memory=0 everything else is recomputed, the noise is kept
    def extra(x):
        return [Node("RandomNormalLike", [x], ["noise"], {"seed": 3.0}, name="noise"),
                Node("Mul", [x, "noise"], ["noisy"], name="mul"),
                Node("ReduceSum", ["noisy"], ["loss"], {"keepdims": 0}, name="sum")]

    gg = rg.gradient(_chain(2, extra), memory=0)
    assert residuals(gg) == ["noise"]
    assert saved_bytes(gg) == LAYER
    assert all(node.op_type != "RandomNormalLike" for node in _remat(gg))


def test_an_unreachable_budget_warns_with_the_smallest_figure():
    def extra(x):
        return [Node("RandomNormalLike", [x], ["noise"], {"seed": 3.0}, name="noise"),
                Node("Mul", [x, "noise"], ["noisy"], name="mul"),
                Node("ReduceSum", ["noisy"], ["loss"], {"keepdims": 0}, name="sum")]

    with pytest.warns(UserWarning, match=r"budget of 10 B cannot be met: recomputing everything recomputable "
                                         r"keeps 256 B of residuals"):
        gg = rg.gradient(_chain(2, extra), memory=10)
    assert saved_bytes(gg) == LAYER and not gg.memory_plan.met
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget of 0 asks for the fewest bytes: no warning
        rg.gradient(_chain(2, extra), memory=0)


def test_symbolic_dimensions_are_sized_by_the_budget():
    g = _chain(4, batch="N")
    # two activations at N = 8, and the shape of the last (int64[2]: ReduceSum's VJP expands to it)
    gg = rg.gradient(g, memory=Budget(bytes=2 * 8 * H * 4 + 16, dims={"N": 8}))
    assert gg.memory_plan.dims == {"N": 8}
    assert saved_bytes(gg, dims={"N": 8}) == 2 * 8 * H * 4 + 16
    _same(_grads(gg, _feeds(8)), _grads(rg.gradient(g), _feeds(8)))


# ------------------------------------------------------------------------------- gradients are unchanged


@pytest.mark.parametrize("name", ["light_squeezenet", "light_shufflenet"])
def test_light_models_keep_their_gradients_under_every_budget(name):
    g = rg.load(DATA_DIR / "light" / f"{name}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphs = {m: rg.gradient(g, lift_constants=True, seed="input", memory=m) for m in (None, 0.5, 0.0)}
    feeds = rg.runtime.random_inputs(graphs[None], seed=2)
    base = rg.Session(graphs[None]).run(feeds)
    for m in (0.5, 0.0):
        plan = graphs[m].memory_plan
        assert plan.met and (plan.saved_after <= plan.target or m == 0)
        assert saved_bytes(graphs[m]) == plan.saved_after < saved_bytes(graphs[None])
        got = rg.Session(graphs[m]).run(feeds)
        for k in base:
            np.testing.assert_allclose(got[k], base[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {m} {k}")


@pytest.mark.parametrize(("name", "exporter", "opset", "memory"), [("bert", "dynamo", 23, 0.0),
                                                                     ("llama", "dynamo", 23, 0.5)])
def test_exported_models_match_torch_autograd_under_a_budget(name, exporter, opset, memory):
    from kit import zoo
    assert zoo.compare(zoo.BY_NAME[name], exporter, opset, memory=memory)


def _loop_and_if_graph() -> tuple[Graph, dict[str, np.ndarray]]:
    """An RNN-like Loop (h = tanh(h w), 5 iterations), a Tanh layer after it, and an If on the sign of the sum
    choosing between two products; float64."""
    f64 = np.float64
    b = body([n("MatMul", ["h_in", "w"], ["hw"]), n("Tanh", ["hw"], ["h_out"])],
             carried=[("h_in", "h_out")], types={"h_in": (3, 4), "h_out": (3, 4)})
    then = Graph([Node("Mul", ["t", "t"], ["tt"], name="sq")], [], [ValueInfo("tt", f64, (3, 4))], name="then")
    other = Graph([Node("Mul", ["t", "v"], ["tv"], name="tv")], [], [ValueInfo("tv", f64, (3, 4))], name="else")
    nodes = [loop(b, "trip", ["h0"], ["hT"]), Node("MatMul", ["hT", "u"], ["a"], name="mm"),
             Node("Tanh", ["a"], ["t"], name="act"), Node("ReduceSum", ["t"], ["s"], {"keepdims": 0}, name="s"),
             Node("Greater", ["s", "zero"], ["c"], name="gt"),
             Node("If", ["c"], ["z"], {"then_branch": then, "else_branch": other}, name="if"),
             Node("ReduceSum", ["z"], ["loss"], {"keepdims": 0}, name="sum")]
    rng = np.random.default_rng(4)
    inits = {"trip": np.array(5, np.int64), "true": np.array(True), "zero": np.array(0.0),
             "w": rng.standard_normal((4, 4)) / 2, "u": rng.standard_normal((4, 4)) / 2,
             "v": rng.standard_normal((3, 4))}
    g = Graph(nodes, [ValueInfo("h0", f64, (3, 4))], [ValueInfo("loss", f64, ())], inits,
              value_info={"hT": ValueInfo("hT", f64, (3, 4))})
    return g, {"h0": rng.standard_normal((3, 4))}


@pytest.mark.parametrize("checkpoint", ["store", "sqrt"])
def test_loops_and_if_keep_their_gradients_and_their_policies(checkpoint):
    g, feeds = _loop_and_if_graph()
    wrt = ["h0", "w", "u", "v"]
    base = _grads(rg.gradient(g, wrt=wrt, checkpoint=checkpoint), feeds)
    for m in (0.5, 0):
        with warnings.catch_warnings():  # the loop's stacks cannot be recomputed: 0.5 is not reachable
            warnings.simplefilter("ignore")
            gg = rg.gradient(g, wrt=wrt, checkpoint=checkpoint, memory=m)
            again = rg.gradient(g, wrt=wrt, checkpoint=checkpoint, memory=m)
        assert all(node.op_type not in ("Loop", "If") for node in _remat(gg))  # loops and branches are kept
        _same(_grads(gg, feeds), base, rtol=1e-10)
        _same(_grads(gg, feeds), _grads(again, feeds), rtol=0)  # planning is deterministic


def test_a_recomputing_gradient_graph_can_be_differentiated_again():
    g = _chain(3)
    wrt = [f"w{k}" for k in range(3)]
    weights = {w: g.initializers[w] for w in wrt}
    v = {w: np.random.default_rng(5).standard_normal((H, H)).astype(F32) for w in wrt}
    hv = {}
    for m in (None, 0):
        gg = rg.gradient(g, wrt=wrt, memory=m)
        assert bool(_remat(gg)) == (m == 0)
        twice = double_backward(gg, wrt, weights)
        out = rg.Session(twice).run({**_feeds(), **{f"{w}_v": v[w] for w in wrt}})
        hv[m] = {k: out[k] for k in twice.output_names[-len(wrt):]}  # H v, reverse over reverse
    _same(hv[0], hv[None], rtol=1e-5)
    hvps = [rg.Session(rg.hvp(g, wrt=wrt, memory=m)).run({**_feeds(), **{f"{w}_tangent": v[w] for w in wrt}})
            for m in (0, None)]
    _same(*({k: val for k, val in h.items() if k.endswith("_hvp")} for h in hvps), rtol=1e-5)


# -------------------------------------------------------------------------------------- arguments and CLI


@pytest.mark.parametrize(("text", "want"), [("0.5", Budget(fraction=0.5)), ("0", Budget(bytes=0)),
                                            ("300MB", Budget(bytes=300_000_000)), ("2GiB", Budget(bytes=2**31)),
                                            ("1.0", Budget(fraction=1.0)), ("12345", Budget(bytes=12345))])
def test_budget_text(text, want):
    assert parse_budget(text) == want


@pytest.mark.parametrize(("value", "match"), [(-1, "negative"), (1.5, "from 0 to 1"), (True, "fraction"),
                                              (float("nan"), "from 0 to 1"), ("-0.5", "negative"),
                                              ("abc", "a fraction"), ("3XB", "unknown unit 'XB'"), ([0.5], "fraction")])
def test_bad_budgets_are_refused_in_one_line(value, match):
    with pytest.raises(RevgraphError, match=match) as info:
        as_budget(value)
    assert "\n" not in str(info.value)


def test_cli_reports_the_plan_and_refuses_bad_budgets(tmp_path, capsys):
    path, out = tmp_path / "chain.onnx", tmp_path / "chain.grad.onnx"
    rg.save(_chain(8), path)
    assert main(["grad", str(path), "-o", str(out), "--memory-budget", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "memory: residuals 2.0 KB without recomputation, 1.0 KB kept; 8 forward node(s) recomputed" in printed
    assert saved_bytes(rg.load(out)) == 4 * LAYER  # read back from the written file: the same count
    for bad in ("-1", "1.5", "3XB", "lots"):
        assert main(["grad", str(path), "-o", str(tmp_path / "bad.onnx"), "--memory-budget", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("revgraph: error:") and "\n" not in err
        assert not (tmp_path / "bad.onnx").exists()
    for cmd in ("hvp", "jacobian"):
        assert main([cmd, str(path), "-o", str(tmp_path / f"{cmd}.onnx"), "--memory-budget", "0"]) == 0
        assert main([cmd, str(path), "-o", str(tmp_path / f"{cmd}.onnx"), "--memory-budget", "x"]) == 2


def test_onnxruntime_keeps_the_recomputation_apart(tmp_path):
    # onnxruntime's common-subexpression elimination would merge each recomputed MatMul with its forward
    # original (12 of 16 left: the gradient right, the saving lost); rg.Session turns it off for such graphs
    import onnxruntime as ort

    from revgraph.runtime.options import disabled_optimizers

    gg = rg.gradient(_chain(4), memory=0)
    assert disabled_optimizers(gg) == ["CommonSubexpressionElimination"]
    assert disabled_optimizers(rg.gradient(_chain(4))) == []

    def products(model: onnx.ModelProto) -> int:
        return sum(node.op_type in ("MatMul", "FusedMatMul", "Gemm") for node in model.graph.node)

    assert products(rg.to_onnx(gg)) == 16  # 4 forward, 4 recomputed, 8 in the backward
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    rg.Session(gg, session_options=options)
    assert products(onnx.load(options.optimized_model_filepath)) == 16


def test_training_under_a_budget_follows_the_same_trajectory(tmp_path, capsys):
    from revgraph.train import adam

    rng = np.random.default_rng(3)
    g = _chain(4, batch="N", extra=lambda x: [Node("MatMul", [x, "head"], ["logits"], name="head")])
    g.outputs = [ValueInfo("logits", F32, ("N", 3))]
    g.initializers["head"] = rng.standard_normal((H, 3)).astype(F32)
    data = {"x": rng.standard_normal((64, H)).astype(F32), "labels": rng.integers(0, 3, 64)}
    losses = {}
    for m in (None, 0.5, 0):
        tr = rg.Trainer(g, "cross-entropy", adam(1e-2), memory=m)
        assert bool(_remat(tr.spec.graph)) == (m is not None)
        tr.fit(data, epochs=2, batch_size=16, console=None)
        losses[m] = np.array(tr.losses)
    np.testing.assert_allclose(losses[0.5], losses[None], rtol=1e-5)
    np.testing.assert_allclose(losses[0], losses[None], rtol=1e-5)
    path = tmp_path / "model.onnx"
    rg.save(g, path)
    np.savez(tmp_path / "data.npz", **data)
    args = ["train", str(path), "--data", str(tmp_path / "data.npz"), "--loss", "cross-entropy", "--epochs", "1",
            "--batch-size", "16", "-o", str(tmp_path / "trained.onnx")]
    assert main([*args, "--memory-budget", "2KB"]) == 0
    assert "at N=16" in capsys.readouterr().out  # a byte budget sizes the batch dimension with --batch-size
    assert main([*args, "--memory-budget", "-3"]) == 2
    assert "cannot be negative" in capsys.readouterr().err


@pytest.mark.parametrize(("ratio", "kept"), [(0.0, ["h"]), (0.3, ["h", "d", "drop/mask"])])
def test_dropout_is_recomputed_only_where_it_draws_nothing(ratio, kept):
    # d = Dropout(h, ratio, training_mode=True); y = d v. With ratio 0, d is h (a copy): the backward reads h
    # in its place, with no node at all, and keeps h alone (128 x 128 float32 = 64 KiB). With ratio 0.3 the mask
    # is a draw: d and the mask are kept as the forward made them (v's gradient reads d; d's cotangent the mask).
    rng = np.random.default_rng(0)
    n = 128
    g = Graph([Node("MatMul", ["x", "w"], ["m"], name="mm"), Node("Tanh", ["m"], ["h"], name="act"),
               Node("Dropout", ["h", "ratio", "training"], ["d"], name="drop"),
               Node("MatMul", ["d", "v"], ["y"], name="mm2"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, name="sum")],
              [ValueInfo("x", F32, (n, n))], [ValueInfo("loss", F32, ())],
              {"w": rng.standard_normal((n, n)).astype(F32), "v": rng.standard_normal((n, n)).astype(F32),
               "ratio": np.array(ratio, F32), "training": np.array(True)})
    gg = rg.gradient(g, wrt=["w", "v"])
    assert residuals(gg) == kept
    assert not _remat(gg)
    if ratio == 0:
        assert not any(is_backward_node(node) and "d" in node.inputs for node in gg.nodes)
        x = {"x": rng.standard_normal((n, n)).astype(F32)}
        _same(_grads(gg, x), _grads(rg.gradient(g, wrt=["w", "v"], memory=0), x), rtol=1e-5)


def test_default_plan_keeps_a_value_not_beside_its_elementwise_images():
    # SiLU as exported: s = Sigmoid(g), a = g * s, with g = x w [64, 128] float32 (32 KiB) and y = a v. The
    # backward reads a (v's gradient), g and s (the Mul's VJP) and s (Sigmoid's): 3 x 32 KiB. s and a are
    # elementwise images of g, which is kept anyway: the default plan recomputes them (two passes over 32 KiB)
    # and keeps g alone.
    rng = np.random.default_rng(0)
    b, h = 64, 128
    g = Graph([Node("MatMul", ["x", "w"], ["g"], name="mm"), Node("Sigmoid", ["g"], ["s"], name="sig"),
               Node("Mul", ["g", "s"], ["a"], name="silu"), Node("MatMul", ["a", "v"], ["y"], name="mm2"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, name="sum")],
              [ValueInfo("x", F32, (b, H))], [ValueInfo("loss", F32, ())],
              {"w": (rng.standard_normal((H, h)) / 4).astype(F32), "v": (rng.standard_normal((h, 4)) / 4).astype(F32)})
    gg = rg.gradient(g, wrt=["w", "v"])
    assert gg.memory_plan.saved_before == 3 * b * h * 4
    assert residuals(gg) == ["g"] and saved_bytes(gg) == b * h * 4
    assert sorted(node.op_type for node in _remat(gg)) == ["Mul", "Sigmoid"]
    x = np.random.default_rng(1).standard_normal((b, H)).astype(F32)
    tw, tv = (torch.tensor(g.initializers[k], dtype=torch.float64, requires_grad=True) for k in ("w", "v"))
    (torch.nn.functional.silu(torch.tensor(x, dtype=torch.float64) @ tw) @ tv).sum().backward()
    got = _grads(gg, {"x": x})
    np.testing.assert_allclose(got["w_grad"], tw.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["v_grad"], tv.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_a_vjp_that_reads_only_a_shape_does_not_keep_the_value():
    # loss = ReduceMean(Pow(x w, 2)) over a symbolic batch: ReduceMean's VJP needs only the shape of p = (x w)^2
    # (Shape(p), Size(p) and Size(loss) in the backward). They are moved into the forward, so p (N x 16 floats)
    # is not kept: the residuals are m = x w (Pow's VJP reads its input: 8 x 16 x 4 bytes at N = 8), the shape
    # (int64[2], 16 bytes) and the two sizes (int64, 8 bytes each).
    rng = np.random.default_rng(0)
    g = Graph([Node("MatMul", ["x", "w"], ["m"], name="mm"), Node("Pow", ["m", "two"], ["p"], name="pow"),
               Node("ReduceMean", ["p"], ["loss"], {"keepdims": 0}, name="mean")],
              [ValueInfo("x", F32, ("N", H))], [ValueInfo("loss", F32, ())],
              {"w": rng.standard_normal((H, H)).astype(F32), "two": np.array(2.0, F32)})
    gg = rg.gradient(g, wrt=["w"])
    shapes = [node for node in gg.nodes if node.name.startswith("hoist/")]
    assert sorted(node.op_type for node in shapes) == ["Shape", "Size", "Size"]
    assert "p" not in residuals(gg)
    assert saved_bytes(gg, dims={"N": 8}) == 8 * H * 4 + 16 + 2 * 8
    x = np.random.default_rng(1).standard_normal((8, H)).astype(F32)
    tw = torch.tensor(g.initializers["w"], dtype=torch.float64, requires_grad=True)
    ((torch.tensor(x, dtype=torch.float64) @ tw) ** 2).mean().backward()
    np.testing.assert_allclose(_grads(gg, {"x": x})["w_grad"], tw.grad.numpy(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ budgets compose


def _sines() -> Graph:
    # loss = sum(sin(sin(x))^2): memory=0 recomputes both Sin nodes in the backward (remat/Sin_0, remat/Sin_1)
    return Graph([Node("Sin", ["x"], ["s"], name="Sin_0"), Node("Sin", ["s"], ["t"], name="Sin_1"),
                  Node("Mul", ["t", "t"], ["tt"], name="sq"),
                  Node("ReduceSum", ["tt"], ["loss"], {"keepdims": 0}, "sum")],
                 [ValueInfo("x", np.float64, (3,))], [ValueInfo("loss")])


def _torch_hessian_of_sines(x: np.ndarray) -> np.ndarray:
    return torch.func.hessian(lambda t: (torch.sin(torch.sin(t)) ** 2).sum())(torch.tensor(x)).numpy()


def test_budgets_compose_across_differentiation_levels():
    # issue 39: the second level's recomputed nodes took the first level's names (two nodes remat/Sin_0), which
    # onnxruntime refuses; every node name is unique now and the Hessian is right at both budgets
    x = np.array([0.1, 0.5, 1.0])
    g1 = rg.gradient(_sines(), "loss", wrt=["x"], memory=0)
    assert any(n.name.startswith(REMAT_PREFIX) for n in g1.nodes)
    h = rg.jacobian(g1, outputs=["x_grad"], inputs=["x"], mode="reverse", memory=0)
    names = [n.name for _, n in h.walk()]
    assert len(names) == len(set(names))
    np.testing.assert_allclose(rg.Session(h).run({"x": x})["x_grad_jacobian_x"], _torch_hessian_of_sines(x),
                               rtol=1e-12, atol=1e-14)
    g1.outputs = [v for v in g1.outputs if v.name == "x_grad"]
    gg = rg.gradient(g1, "x_grad", wrt=["x"], memory=0)  # the gradient of sum(x_grad): the Hessian's row sums
    np.testing.assert_allclose(rg.Session(gg).run({"x": x})["x_grad_1"], _torch_hessian_of_sines(x).sum(0),
                               rtol=1e-12, atol=1e-14)


def test_budgets_compose_through_the_cli(tmp_path):
    # grad --memory-budget 0 twice, then run: the file onnxruntime refused
    x = np.array([0.1, 0.5, 1.0])
    rg.save(_sines(), tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", x=x)
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "a.onnx"), "--memory-budget", "0"]) == 0
    assert main(["grad", str(tmp_path / "a.onnx"), "--loss", "x_grad", "--wrt", "x", "-o", str(tmp_path / "b.onnx"),
                 "--memory-budget", "0"]) == 0
    assert main(["run", str(tmp_path / "b.onnx"), "--inputs", str(tmp_path / "x.npz"),
                 "-o", str(tmp_path / "out.npz")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["x_grad_1"], _torch_hessian_of_sines(x).sum(0),
                               rtol=1e-12, atol=1e-14)
