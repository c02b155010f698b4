"""Opsets 21 to the newest the installed onnx knows, natively (issue 15, section 1): a model at opset 21 or newer
keeps its opset on load and its gradient graph is written at it; older models are converted up to 21;
``load(opset=N)`` and ``revgraph grad --opset N`` choose another; a model newer than onnx knows is refused at
load, and one newer than onnxruntime runs only by :class:`revgraph.Session` on onnxruntime. Also the gradient
graphs' ``Pad`` nodes (never an ``axes`` input: onnxruntime's transpose optimizer mishandles it) at every
onnxruntime optimisation level, and the node counts ``revgraph grad`` prints."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import revgraph as rg
from revgraph import runtime
from revgraph.autodiff.emitter import Emitter
from revgraph.cli import main
from revgraph.errors import UnsupportedModelError
from revgraph.ir import NEWEST_OPSET, TARGET_OPSET, Graph, Node, ValueInfo

F32 = np.float32
W = np.random.default_rng(0).standard_normal((4, 6)).astype(F32)
INITS = {"w": W, "s": np.array([2, 2, 3], np.int64), "p": np.array([0, 1, 0, 0, 0, 2], np.int64),
         "b": np.array([1], np.int64), "e": np.array([3], np.int64), "a": np.array([1], np.int64)}


def small_model(opset: int) -> onnx.ModelProto:
    """``tanh(Slice(Pad(Transpose(Reshape(x @ w)))))``: operators with new versions in opsets 23 to 25 (Reshape,
    Transpose, Pad) and older ones, at ``opset``."""
    g = Graph([Node("MatMul", ["x", "w"], ["h"], name="mm"),
               Node("Reshape", ["h", "s"], ["r"], name="reshape"),
               Node("Transpose", ["r"], ["t"], {"perm": [0, 2, 1]}, name="transpose"),
               Node("Pad", ["t", "p"], ["pd"], name="pad"),
               Node("Slice", ["pd", "b", "e", "a"], ["sl"], name="slice"),
               Node("Tanh", ["sl"], ["y"], name="tanh")],
              [ValueInfo("x", F32, (2, 4))], [ValueInfo("y", F32, None)], dict(INITS), opsets={"": opset})
    return rg.to_onnx(g)


def torch_grads(x: np.ndarray) -> dict[str, np.ndarray]:
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(W, requires_grad=True)
    t = (tx @ tw).reshape(2, 2, 3).permute(0, 2, 1)
    t = torch.nn.functional.pad(t, (0, 0, 1, 2))[:, 1:3]
    torch.tanh(t).sum().backward()
    return {"x": tx.grad.numpy(), "w": tw.grad.numpy()}


def opset_of(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


@pytest.mark.parametrize("opset", [21, 22, 23, 24, 25, 26])
def test_a_model_keeps_its_opset_and_so_does_its_gradient_graph(opset):
    g = rg.load(small_model(opset))
    assert (g.opset, g.source_opset) == (opset, opset)
    gg = rg.gradient(g, "y")
    assert gg.opset == opset
    model = rg.to_onnx(gg)
    assert opset_of(model) == opset
    onnx.checker.check_model(model, full_check=True)  # every node fits its schema at the graph's opset
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(F32)
    got = rg.Session(gg).run({"x": x})
    for k, ref in torch_grads(x).items():
        np.testing.assert_allclose(got[f"{k}_grad"], ref, rtol=1e-5, atol=1e-6)


def test_an_older_model_is_converted_up_to_21():
    g = rg.load(small_model(17))
    assert (g.opset, g.source_opset) == (TARGET_OPSET, 17)
    assert rg.gradient(g, "y").opset == TARGET_OPSET


def test_an_opset_20_model_is_renumbered_as_the_converter_would_convert_it():
    """From 20 to 21 revgraph renumbers the opset itself (every adapter of that step but GroupNormalization's
    only renumbers): the nodes are those onnx.version_converter writes, and the gradient matches PyTorch."""
    model = small_model(20)
    g = rg.load(model)
    assert (g.opset, g.source_opset) == (TARGET_OPSET, 20)
    converted = onnx.version_converter.convert_version(model, TARGET_OPSET)
    assert [(n.op_type, list(n.input), list(n.output)) for n in converted.graph.node] == \
        [(n.op_type, n.inputs, n.outputs) for n in g.nodes]
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(F32)
    got = rg.Session(rg.gradient(g, "y")).run({"x": x})
    for k, ref in torch_grads(x).items():
        np.testing.assert_allclose(got[f"{k}_grad"], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("op", "converted"), [("Tanh", 0), ("GroupNormalization", 1)])
def test_only_an_opset_20_model_with_a_rewriting_adapter_goes_through_the_converter(op, converted, monkeypatch):
    """GroupNormalization's 20 -> 21 adapter may rewrite the node (per-group scale and bias become per-channel):
    a model holding one is given to onnx.version_converter; any other opset-20 model is renumbered."""
    calls = []
    real = onnx.version_converter.convert_version
    monkeypatch.setattr(onnx.version_converter, "convert_version", lambda m, v: calls.append(v) or real(m, v))
    ones = np.ones(4, F32)
    node = (Node("GroupNormalization", ["x", "s", "b"], ["y"], {"num_groups": 4, "epsilon": 1e-5}, "gn")
            if op == "GroupNormalization" else Node("Tanh", ["x"], ["y"], name="tanh"))
    g = Graph([node], [ValueInfo("x", F32, (2, 4, 3))], [ValueInfo("y", F32, (2, 4, 3))],
              {"s": ones, "b": ones} if op == "GroupNormalization" else {}, opsets={"": 20})
    assert rg.load(rg.to_onnx(g)).opset == TARGET_OPSET
    assert len(calls) == converted


@pytest.mark.parametrize("opset", [18, 20])
@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_group_normalization_before_21_keeps_its_per_group_scale_and_bias(opset, backend):
    """GroupNormalization 18 scales and shifts per group, 21 per channel, and onnx 1.23's converter leaves the
    node as it is (onnxruntime then refuses it): revgraph repeats each group's scale and bias over its
    channels in the graph, so the per-group parameters keep their shape. Forward and gradients (x, scale,
    bias) against PyTorch's group_norm with the repeated parameters."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 3))
    scale, bias = rng.standard_normal(2), rng.standard_normal(2)
    g = Graph([Node("GroupNormalization", ["x", "scale", "bias"], ["y"], {"num_groups": 2, "epsilon": 1e-5}, "gn"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float64, (2, 4, 3))], [ValueInfo("loss", np.float64, ())],
              {"scale": scale, "bias": bias}, opsets={"": opset})
    loaded = rg.load(rg.to_onnx(g))
    assert loaded.opset == TARGET_OPSET and loaded.initializers["scale"].shape == (2,)
    gg = rg.gradient(loaded, "loss", wrt=["x", "scale", "bias"])
    got = rg.Session(gg, backend=backend).run({"x": x})
    t = {k: torch.tensor(v, requires_grad=True) for k, v in {"x": x, "scale": scale, "bias": bias}.items()}
    y = torch.nn.functional.group_norm(t["x"], 2, t["scale"].repeat_interleave(2), t["bias"].repeat_interleave(2),
                                       eps=float(np.float32(1e-5)))
    y.sum().backward()
    # (GroupNormalization's statistics are float32 by default, stash_type 1, also for a float64 input)
    np.testing.assert_allclose(got["loss"], y.sum().item(), rtol=1e-6, atol=1e-6)
    for k, v in t.items():
        np.testing.assert_allclose(got[f"{k}_grad"], v.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("opset", [21, 22, 24, NEWEST_OPSET])
def test_load_converts_to_the_opset_asked_for(opset):
    g = rg.load(small_model(23), opset=opset)
    assert (g.opset, g.source_opset) == (opset, 23)


@pytest.mark.parametrize("opset", [20, 7, NEWEST_OPSET + 1, "23", True])
def test_load_refuses_an_opset_below_21_or_unknown_to_onnx(opset):
    with pytest.raises(rg.RevgraphError, match=f"opset=.*: give None .* from {TARGET_OPSET} to {NEWEST_OPSET}"):
        rg.load(small_model(23), opset=opset)


def test_a_model_newer_than_onnx_knows_is_refused_at_load():
    model = small_model(23)
    model.opset_import[0].version = NEWEST_OPSET + 1
    with pytest.raises(UnsupportedModelError, match=rf"opset {NEWEST_OPSET + 1}; the installed onnx .* up to "
                                                    rf"{NEWEST_OPSET}"):
        rg.load(model)


def test_onnxruntime_runs_the_opsets_onnx_knows():
    """onnxruntime 1.32's operator schemas go up to opset 28, what onnx 1.23 knows (its kernels too: Range-27,
    Celu-28); so Session refuses nothing that load accepts with these versions."""
    newest = runtime.onnxruntime_newest_opset()
    assert newest is not None and newest >= 26
    if ort.__version__.startswith("1.32"):
        assert newest == 28


def test_session_refuses_an_opset_newer_than_onnxruntime_runs(monkeypatch):
    """Loading and differentiating never ask onnxruntime; running on it does, and the reference backend runs the
    graph all the same."""
    g = rg.load(small_model(23))
    gg = rg.gradient(g, "y")
    monkeypatch.setattr(runtime, "onnxruntime_newest_opset", lambda: 22)
    with pytest.raises(UnsupportedModelError, match=r"opset 23; onnxruntime .* runs opsets up to 22: run it with "
                                                    "the reference backend"):
        rg.Session(gg)
    x = np.ones((2, 4), F32)
    got = rg.Session(gg, backend="reference").run({"x": x})
    np.testing.assert_allclose(got["w_grad"], torch_grads(x)["w"], rtol=1e-5, atol=1e-6)


def test_the_emitter_types_nodes_at_the_graph_opset():
    """Swish exists from opset 24: at 24 the emitter knows its output type, at 21 there is no such operator."""
    for opset, known in ((24, True), (21, False)):
        e = Emitter({"x": ValueInfo("x", F32, (2, 3))}, set(), opset)
        y = e.op("Swish", ["x"])
        assert (y in e.types) is known
        if known:
            assert e.types[y].shape == (2, 3)


# ------------------------------------------------------------------------------------------ the command line


def test_info_shows_the_opset_and_the_original(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    for opset, expected in ((23, r"opset 23(?! \(converted)"), (17, r"opset 21 \(converted from 17\)")):
        onnx.save(small_model(opset), tmp_path / f"m{opset}.onnx")
        assert main(["info", str(tmp_path / f"m{opset}.onnx")]) == 0
        assert re.search(expected, capsys.readouterr().out)


def test_grad_writes_at_the_models_opset_unless_asked(tmp_path, capsys):
    onnx.save(small_model(23), tmp_path / "m.onnx")
    for args, opset in (([], 23), (["--opset", "21"], 21), (["--opset", "24"], 24)):
        out = tmp_path / f"g{opset}.onnx"
        assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(out), *args]) == 0
        written = onnx.load(str(out))
        assert opset_of(written) == opset
        x = np.random.default_rng(2).standard_normal((2, 4)).astype(F32)
        got = rg.Session(str(out)).run({"x": x})
        np.testing.assert_allclose(got["w_grad"], torch_grads(x)["w"], rtol=1e-5, atol=1e-6)
    capsys.readouterr()


def test_grad_counts_the_nodes_it_wrote(tmp_path, capsys):
    """A forward node that no output depends on is not written (it made the count "8 forward + -1 backward"):
    the counts are of the written graph's nodes, forward (by name) and the rest."""
    g = Graph([Node("Sin", ["x"], ["dead1"], name="dead1"), Node("Cos", ["dead1"], ["dead2"], name="dead2"),
               Node("Exp", ["x"], ["e"], name="exp"), Node("ReduceSum", ["e"], ["y"], {"keepdims": 0}, name="sum")],
              [ValueInfo("x", F32, (3,))], [ValueInfo("y", F32, ())])
    rg.save(g, tmp_path / "m.onnx")
    assert main(["grad", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "g.onnx")]) == 0
    match = re.search(r"(\d+) forward \+ (\d+) backward nodes", capsys.readouterr().out)
    written = onnx.load(str(tmp_path / "g.onnx")).graph.node
    forward, backward = int(match[1]), int(match[2])
    assert forward == sum(n.name in ("exp", "sum") for n in written) == 2
    assert forward + backward == len(written) and backward > 0


# ------------------------------------------------------------------------------------------ Pad without axes


def _levels():
    L = ort.GraphOptimizationLevel
    return [L.ORT_DISABLE_ALL, L.ORT_ENABLE_BASIC, L.ORT_ENABLE_EXTENDED, L.ORT_ENABLE_ALL]


def _run_at(model: onnx.ModelProto, feeds: dict, level) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def _pads(graph: Graph) -> list[Node]:
    return [n for _, n in graph.walk() if n.op_type == "Pad"]


@pytest.mark.parametrize("case", ["slice", "strided-slice", "pad-axes", "pad-axes-reflect", "dynamic-pads"])
def test_gradient_pads_have_no_axes_and_run_at_every_optimisation_level(case):
    """GPT-NeoX's gradient graph failed at ORT_ENABLE_BASIC and above ("Gather ... idx=3 must be within the
    inclusive range [-2,1]"): onnxruntime's transpose optimizer moves a Transpose through a Pad with an ``axes``
    input and gets the axes wrong. The Slice and Pad VJPs (and every Pad the emitter writes) pad over all axes."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 5)).astype(F32)
    inputs = [ValueInfo("x", F32, x.shape)]
    feeds = {"x": x}
    # the model's own Pad with axes reads x directly: after a Transpose, the forward graph alone would fail
    nodes = [] if case.startswith(("pad", "dynamic")) else [Node("Transpose", ["x"], ["t"], {"perm": [0, 2, 3, 1]},
                                                                  name="tr")]
    inits: dict[str, np.ndarray] = {}
    if case in ("slice", "strided-slice"):
        step = 2 if case == "strided-slice" else 1
        inits = {"b": np.array([1]), "e": np.array([3]), "a": np.array([3]), "st": np.array([step])}
        nodes.append(Node("Slice", ["t", "b", "e", "a", "st"], ["m"], name="op"))
    elif case == "dynamic-pads":
        inputs.append(ValueInfo("p", np.int64, (2,)))
        feeds["p"] = np.array([1, 2], np.int64)
        inits = {"a": np.array([-1])}
        nodes.append(Node("Pad", ["x", "p", "", "a"], ["m"], {"mode": "edge"}, name="op"))
    else:
        inits = {"p": np.array([1, 2]), "a": np.array([-1])}
        mode = "reflect" if case.endswith("reflect") else "constant"
        nodes.append(Node("Pad", ["x", "p", "", "a"], ["m"], {"mode": mode}, name="op"))
    perm = [0, 3, 1, 2] if nodes[0].op_type == "Transpose" else [0, 2, 3, 1]
    nodes += [Node("Transpose", ["m"], ["o"], {"perm": perm}, name="back"),
              Node("Sin", ["o"], ["y"], name="sin")]
    g = Graph(nodes, inputs, [ValueInfo("y", F32, None)], {k: v.astype(np.int64) for k, v in inits.items()})
    gg = rg.gradient(g, "y", wrt=["x"])
    added = _pads(gg)[1:] if case.startswith(("pad", "dynamic")) else _pads(gg)  # the forward Pad is the model's
    assert all(len(n.inputs) <= 3 for n in added), [n.inputs for n in added]
    assert added or case == "pad-axes"  # the constant-mode Pad's VJP is a Slice
    model = rg.to_onnx(gg)
    results = [_run_at(model, feeds, level)["x_grad"] for level in _levels()]
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=1e-6, atol=1e-6)
    # and the values are right
    tx = torch.tensor(x, requires_grad=True)
    if case.startswith("slice") or case == "strided-slice":
        t = tx.permute(0, 2, 3, 1)
        m = (t[..., 1:3] if case == "slice" else t[..., 1:3:2]).permute(0, 3, 1, 2)
    else:
        mode = {"pad-axes": "constant", "pad-axes-reflect": "reflect", "dynamic-pads": "replicate"}[case]
        m = torch.nn.functional.pad(tx, (1, 2, 0, 0), mode=mode).permute(0, 2, 3, 1)
    torch.sin(m).sum().backward()
    np.testing.assert_allclose(results[0], tx.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("known", ["rank", "nothing"])
@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_the_emitter_writes_every_pad_over_all_axes(known, mode):
    """A rule's ``Pad`` with ``axes`` becomes full pads: constants when the rank, axes and pads are known, the pads
    scattered into zeros in the graph otherwise. Compared with ``np.pad``."""
    x = np.arange(24, dtype=F32).reshape(2, 3, 4)
    types = {"x": ValueInfo("x", F32, x.shape if known == "rank" else None), "p": ValueInfo("p", np.int64, (4,))}
    e = Emitter(types, {"x", "p"}, 21)
    axes = e.ints([-1, 0])
    y = e.op("Pad", ["x", "p", "", axes], mode=mode)
    pad = next(n for n in e.nodes if n.op_type == "Pad")
    assert len(pad.inputs) == 2
    g = Graph(e.nodes, [ValueInfo("x", F32, None), ValueInfo("p", np.int64, (4,))], [ValueInfo(y, F32, None)])
    pads = np.array([1, 0, 2, 1], np.int64)  # axis -1: 1 before, 2 after; axis 0: 0 before, 1 after
    for backend in ("onnxruntime", "reference"):
        got = rg.Session(g, backend=backend).run({"x": x, "p": pads})[y]
        np.testing.assert_array_equal(got, np.pad(x, [(0, 1), (0, 0), (1, 2)], mode=mode))
