"""Memory settings that never change a result (issue 24, parts 3 and 4): onnxruntime's arena, memory pattern and
execution order (``rg.RuntimeOptions``) on Session, Trainer and the CLI; one buffer set for parameters and
optimizer state (the update graph writing over its inputs where revgraph.ir.inplace finds it safe) against two."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from kit.harness import one_line_error
from kit.training import OPTIMIZERS, embedding_model, mlp

import revgraph as rg
from revgraph import train as T
from revgraph.cli import main
from revgraph.errors import InternalError, RevgraphError
from revgraph.ir import Node
from revgraph.ir.inplace import inplace_pairs
from revgraph.runtime.options import TRAINING_DEFAULT, RuntimeOptions
from revgraph.tools import demo
from revgraph.train import update_nodes
from revgraph.train.engines import FusedEngine, SplitEngine

F32 = np.float32


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps at 80 columns when not on a terminal



def _mlp_batches(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(0, 1, (16, 6)).astype(F32), rng.integers(0, 3, 16)) for _ in range(n)]


def _embedding_batches(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 8, (6, 5)), rng.integers(0, 3, 6)) for _ in range(n)]


def _rnn_batches(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.random((8, 5, 4)).astype(F32), rng.integers(0, 3, 8)) for _ in range(n)]


MODELS = {
    "mlp": (lambda: mlp(np.random.default_rng(3)), _mlp_batches),
    "embedding": (lambda: embedding_model(np.random.default_rng(2)), _embedding_batches),
    "rnn": (lambda: demo.rnn_model(hidden=6, rows=5, width=4, classes=3, seed=1), _rnn_batches),
}


def _train(model: str, optimizer, steps: int = 6, **kwargs) -> tuple[rg.Trainer, list[float], dict]:
    build, batches = MODELS[model]
    tr = rg.Trainer(build(), "cross-entropy", optimizer, **kwargs)
    data = batches()
    losses = [tr.step(data[k % len(data)]) for k in range(steps)]
    return tr, losses, {**tr.parameters, **tr.state}


# ------------------------------------------------------------------------------------------ RuntimeOptions


@pytest.mark.parametrize("kwargs,fragment", [
    ({"arena": "off"}, "RuntimeOptions arena must be True, False or None"),
    ({"memory_pattern": 1}, "RuntimeOptions memory_pattern must be True, False or None"),
    ({"execution_order": "fast"}, "execution_order must be one of default, priority_based, memory_efficient"),
    ({"execution_order": 0}, "execution_order must be one of"),
])
def test_bad_runtime_options_are_one_line(kwargs, fragment):
    with pytest.raises(RevgraphError, match=fragment) as info:
        RuntimeOptions(**kwargs)
    assert "\n" not in str(info.value)


def test_runtime_options_fill_session_options():
    opts = RuntimeOptions(arena=False, memory_pattern=False, execution_order="priority_based").apply()
    assert (opts.enable_cpu_mem_arena, opts.enable_mem_pattern) == (False, False)
    assert opts.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    base = ort.SessionOptions()
    RuntimeOptions(arena=False).apply(base)  # the fields left None keep the given options' values
    assert (base.enable_cpu_mem_arena, base.enable_mem_pattern, base.execution_order) == (
        False, True, ort.ExecutionOrder.DEFAULT)
    assert RuntimeOptions(arena=True).over(TRAINING_DEFAULT) == RuntimeOptions(
        arena=True, memory_pattern=False, execution_order="priority_based", graph_optimization="none",
        memory_reuse=False, arena_extend="same_as_requested")
    assert RuntimeOptions(memory_reuse=False).apply().enable_mem_reuse is False
    # the shared arena: the sessions that ask for it allocate from the process's environment allocator
    assert RuntimeOptions(arena_extend="same_as_requested").apply().get_session_config_entry(
        "session.use_env_allocators") == "1"
    assert RuntimeOptions(arena=False, arena_extend="same_as_requested").apply().get_session_config_entry(
        "session.use_env_allocators") == "0"  # (no arena asked for: none shared either)
    assert RuntimeOptions(arena_extend="next_power_of_two").apply().get_session_config_entry(
        "session.use_env_allocators") == "0"
    with pytest.raises(RevgraphError, match="arena_extend must be one of next_power_of_two, same_as_requested"):
        RuntimeOptions(arena_extend="double")
    assert ort.SessionOptions().enable_mem_reuse is True  # (onnxruntime's default, which rg.Session keeps)
    with pytest.raises(RevgraphError, match="RuntimeOptions memory_reuse must be True, False or None"):
        RuntimeOptions(memory_reuse="off")
    opts = RuntimeOptions(graph_optimization="extended").apply()
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    with pytest.raises(RevgraphError, match="graph_optimization must be one of none, basic, extended, all"):
        RuntimeOptions(graph_optimization="max")
    assert rg.RuntimeOptions is RuntimeOptions


def test_session_runtime_and_session_options():
    g = demo.mlp_model(hidden=8)
    x = np.random.default_rng(0).normal(0, 1, (4, 8, 8)).astype(F32)
    ref = rg.Session(g).run({"x": x})["logits"]
    for arena, pattern, order in itertools.product((True, False), (True, False), ("default", "priority_based")):
        out = rg.Session(g, runtime=RuntimeOptions(arena, pattern, order)).run({"x": x})["logits"]
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)
    base = ort.SessionOptions()
    base.enable_mem_pattern = True
    base.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = rg.Session(g, runtime=RuntimeOptions(memory_pattern=False), session_options=base)
    np.testing.assert_allclose(s.run({"x": x})["logits"], ref, rtol=1e-6, atol=1e-7)
    assert base.enable_mem_pattern is True  # the user's options are left as they were
    for extend in ("same_as_requested", "next_power_of_two"):  # the shared arena: same results, options unset after
        s = rg.Session(g, runtime=RuntimeOptions(memory_reuse=False, arena_extend=extend), session_options=base)
        np.testing.assert_allclose(s.run({"x": x})["logits"], ref, rtol=1e-6, atol=1e-7)
        assert base.enable_mem_reuse is True and base.get_session_config_entry("session.use_env_allocators") == "0"


@pytest.mark.parametrize("kwargs,fragment", [
    ({"session_options": 3}, "session_options must be an onnxruntime.SessionOptions, got int"),
    ({"runtime": "off"}, "runtime must be a revgraph.RuntimeOptions or None, got str"),
    ({"runtime": RuntimeOptions(execution_order="memory_efficient")},
     "onnxruntime refuses execution_order 'memory_efficient': this onnxruntime is not a training build"),
    ({"runtime": RuntimeOptions(arena=False), "backend": "reference"}, "the reference backend takes none"),
])
def test_session_bad_runtime_arguments(kwargs, fragment):
    if "memory_efficient" in fragment and _has_memory_efficient_order():
        pytest.skip("this onnxruntime is a training build")
    with pytest.raises(RevgraphError, match=fragment) as info:
        rg.Session(demo.mlp_model(hidden=8), **kwargs)
    assert "\n" not in str(info.value)


def _has_memory_efficient_order() -> bool:
    opts = RuntimeOptions(execution_order="memory_efficient").apply()
    opts.log_severity_level = 4
    try:
        ort.InferenceSession(rg.to_onnx(demo.mlp_model(hidden=2)).SerializeToString(), opts,
                             providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any refusal means: not supported
        return False
    return True


def test_trainer_runtime_defaults_and_overrides():
    g = mlp(np.random.default_rng(0))
    assert rg.Trainer(g, "cross-entropy", "sgd").runtime == TRAINING_DEFAULT == RuntimeOptions(
        True, False, "priority_based", "none", False, "same_as_requested")
    tr = rg.Trainer(g, "cross-entropy", "sgd", runtime=RuntimeOptions(arena=True, execution_order="default"))
    assert tr.runtime == RuntimeOptions(True, False, "default", "none", False, "same_as_requested")
    assert not tr._engine.options.enable_mem_reuse
    assert tr._engine.options.get_session_config_entry("session.use_env_allocators") == "1"
    assert tr._engine.options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert tr._engine.options.enable_cpu_mem_arena and not tr._engine.options.enable_mem_pattern
    with pytest.raises(RevgraphError, match="buffers must be one of one, two, got 'three'"):
        rg.Trainer(g, "cross-entropy", "sgd", buffers="three")
    with pytest.raises(RevgraphError, match=r"runtime must be a revgraph\.RuntimeOptions"):
        rg.Trainer(g, "cross-entropy", "sgd", runtime={"arena": False})


# ------------------------------------------------------------------------------------------ trajectories


@pytest.mark.parametrize("model", MODELS)
def test_trajectories_equal_under_every_runtime_setting_and_buffer_layout(model):
    """Adam on a dense MLP, a gathered table (sparse rows, ScatterND) and a Loop RNN: every arena x memory
    pattern x execution order x buffer layout gives the losses and parameters of onnxruntime's defaults with
    two buffer sets to float rounding; one and two sets give them bitwise (the same nodes on the same values)."""
    opt = OPTIMIZERS["adam"]
    ref_tr, ref_losses, ref = _train(model, opt, runtime=RuntimeOptions(True, True, "default"), buffers="two")
    assert isinstance(ref_tr._engine, FusedEngine)
    for arena, pattern, order in itertools.product((True, False), (True, False), ("default", "priority_based")):
        runtime = RuntimeOptions(arena, pattern, order)
        runs = {b: _train(model, opt, runtime=runtime, buffers=b) for b in ("one", "two")}
        for buffers, (_, losses, values) in runs.items():
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, err_msg=f"{runtime} {buffers}")
            for k, v in ref.items():
                np.testing.assert_allclose(values[k], v, rtol=1e-5, atol=1e-7, err_msg=f"{k} {runtime} {buffers}")
        (_, l1, one), (_, l2, two) = runs["one"], runs["two"]
        assert l1 == l2
        for k, v in two.items():
            np.testing.assert_array_equal(one[k], v, err_msg=f"{k} {runtime}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_one_set_equals_two_sets_bitwise_for_every_optimizer(name, monkeypatch):
    """SGD with momentum, Adam and AdamW, with small tensors updated as one group (Concat, Split) and without."""
    for limit in (0, T.GROUP_ELEMENTS):
        monkeypatch.setattr(update_nodes, "GROUP_ELEMENTS", limit)
        for model in ("mlp", "embedding"):
            (_, l1, one), (_, l2, two) = (_train(model, OPTIMIZERS[name], buffers=b) for b in ("one", "two"))
            assert l1 == l2
            for k, v in two.items():
                np.testing.assert_array_equal(one[k], v, err_msg=f"{k} {model} {limit}")


# ------------------------------------------------------------------------------------------ alias safety


def _update_graph(model="mlp", optimizer="adam"):
    spec = T.training_graph(MODELS[model][0](), "cross-entropy", OPTIMIZERS[optimizer])
    return spec, T.split_step(spec)[1]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", MODELS)
def test_real_update_graphs_overwrite_every_tensor(model, optimizer):
    """Parameters and state may all be overwritten in place; only Adam's step is read twice (the bias
    correction and step + 1, in no fixed order) and keeps two buffers."""
    spec, update = _update_graph(model, optimizer)
    unsafe = inplace_pairs(update, spec.carried())
    assert set(unsafe) == ({"step"} if optimizer != "sgd" else set()), unsafe
    if unsafe:
        assert "optim/bias_correction" in unsafe["step"] and "may run after" in unsafe["step"]


def test_unsafe_update_graphs_are_refused():
    spec, update = _update_graph()
    pairs = spec.carried()
    p, new = "W1", spec.new_params["W1"]
    assert "W1" not in inplace_pairs(update, pairs)

    late = update.copy()  # a reader of the old value that need not run before the writer
    late.nodes.append(Node("ReduceSum", [p], ["late"], {"keepdims": 0}, "late_reader"))
    assert "node 'late_reader' (ReduceSum) reads 'W1' and may run after" in inplace_pairs(late, pairs)["W1"]

    view = update.copy()  # the same through views onnxruntime may alias (Reshape, then Flatten), read before
    k = next(i for i, n in enumerate(view.nodes) if new in n.outputs)  # the writer and after the writer
    w = view.nodes[k]
    view.nodes[k:k] = [Node("Constant", [], ["shape"], {"value": np.array([-1], np.int64)}, "shape"),
                       Node("Constant", [], ["zero"], {"value": np.array(0, F32)}, "zero"),
                       Node("Reshape", [p, "shape"], ["flat"], name="view"),
                       Node("Flatten", ["flat"], ["flat2"], name="view2"),
                       Node("ReduceSum", ["flat2"], ["s"], {"keepdims": 0}, "early_view_reader"),
                       Node("Mul", ["s", "zero"], ["s0"], name="times_zero"),
                       Node("Add", [w.inputs[1], "s0"], ["step2"], name="plus_zero")]
    w.inputs[1] = "step2"
    assert "W1" not in inplace_pairs(view, pairs)  # every reader of the views runs before the writer
    view.nodes.append(Node("ReduceMax", ["flat2"], ["late"], {"keepdims": 0}, "late_view_reader"))
    assert "node 'late_view_reader' (ReduceMax) reads 'flat2'" in inplace_pairs(view, pairs)["W1"]

    writer = update.copy()  # a writer that is not elementwise over the old value
    k = next(i for i, n in enumerate(writer.nodes) if new in n.outputs)
    old = writer.nodes[k]
    writer.nodes[k] = Node("MatMul", [p, "eye"], [new], name="matmul_writer")
    writer.nodes[k:k] = [Node("EyeLike", [old.inputs[1]], ["eye"], name="eye")]  # the old writer's ancestors stay
    reason = inplace_pairs(writer, pairs)["W1"]
    assert "matmul_writer" in reason and "while it writes" in reason
    assert old.op_type == "Sub" and "W1" not in inplace_pairs(update, pairs)

    sub = update.copy()  # a writer that reads the old value through a view
    k = next(i for i, n in enumerate(sub.nodes) if new in n.outputs)
    sub.nodes[k].inputs = ["W1_view" if i == p else i for i in sub.nodes[k].inputs]
    sub.nodes[k:k] = [Node("Identity", [p], ["W1_view"], name="view")]
    assert "reads 'W1_view' while it writes" in inplace_pairs(sub, pairs)["W1"]

    loop = update.copy()  # a subgraph reading the old value from outside, not before the writer
    body = rg.Graph([Node("Identity", [p], ["seen"], name="inner")], [], [rg.ValueInfo("seen", F32, None)])
    loop.nodes.append(Node("If", ["cond"], ["late"], {"then_branch": body, "else_branch": body}, "late_if"))
    assert "late_if" in inplace_pairs(loop, pairs)["W1"]


def test_a_graph_refused_in_place_trains_with_two_buffers(monkeypatch):
    """Where the check refuses a pair, the engine keeps two buffers for it, and training is unchanged."""
    from revgraph.train import engines as steps

    monkeypatch.setattr(steps, "inplace_pairs", lambda graph, pairs: {i: "refused" for i, _ in pairs})
    tr, losses, values = _train("mlp", "adam", buffers="one")
    assert isinstance(tr._engine, SplitEngine) and not tr._engine.shared
    monkeypatch.undo()
    _, ref_losses, ref = _train("mlp", "adam", buffers="two")
    assert losses == ref_losses
    for k, v in ref.items():
        np.testing.assert_array_equal(values[k], v)


# ------------------------------------------------------------------------------------------ one set held


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_one_set_holds_one_set_and_onnxruntime_writes_into_it(model):
    """The one-set engine keeps one buffer per parameter and state tensor (two for the int64 step only) plus
    the gradients; the two-set engine two per name. After a step the update's bound outputs are the input
    buffers themselves (same data pointers), and they hold the new values."""
    one, _, _ = _train(model, "adam", steps=1, buffers="one")
    two, _, _ = _train(model, "adam", steps=1, buffers="two")
    e1, e2 = one._engine, two._engine
    state = sum(np.asarray(v).nbytes for v in one.spec.initial_state().values())
    assert e2.held() == {"state": 2 * state, "gradients": 0}
    dense = sum(one.spec.initial[p].nbytes for p in one.spec.params if p not in one.spec.sparse)
    assert e1.held() == {"state": state + 8, "gradients": dense}  # the step's second buffer: 8 bytes
    buffers = {id(v) for s in e1._sets for v in s.values()}
    assert len(buffers) == len(e1.names) + 1
    before = {n: np.array(e1.value(n).numpy()) for n in e1.names}
    pointers = {n: e1.value(n).data_ptr() for n in e1.shared}
    _, batches = MODELS[model]
    one.step(batches()[1])
    binding = e1._update_bindings[1 - e1._current]  # the binding that ran
    outputs = dict(zip([o for _, o in one.spec.carried()], binding.get_outputs(), strict=True))
    for i, o in one.spec.carried():
        if i in e1.shared:
            assert outputs[o].data_ptr() == pointers[i] == e1.value(i).data_ptr(), i
    changed = [n for n in e1.shared if not np.array_equal(e1.value(n).numpy(), before[n])]
    assert set(changed) >= set(one.spec.params) - set(one.spec.sparse)


# ------------------------------------------------------------------------------------------ undo


@pytest.mark.parametrize("buffers", ["one", "two"])
def test_undo_after_a_step_that_kept_its_values(buffers):
    tr, _, _ = _train("embedding", "adam", steps=3, buffers=buffers)
    before = {**tr.parameters, **tr.state}
    e = tr._engine
    feeds = tr._feeds(tr.arrays(_embedding_batches()[0]), slice(None))
    e.step(feeds, 6, 6, keep_previous=True)
    assert tr.steps == 4 and not np.array_equal(tr.parameters["E"], before["E"])
    e.undo()
    assert tr.steps == 3
    for k, v in {**tr.parameters, **tr.state}.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    e.step(feeds, 6, 6)  # training goes on from the restored values
    assert tr.steps == 4


def test_undo_of_an_in_place_step_is_an_internal_error_and_release_frees_the_kept_set():
    tr, _, _ = _train("mlp", "adam", steps=1, buffers="one")
    e = tr._engine
    assert not e.can_undo
    with pytest.raises(InternalError, match="overwrote its buffers in place"):
        e.undo()
    held = e.held()["state"]
    feeds = tr._feeds(tr.arrays(_mlp_batches()[0]), slice(None))
    e.step(feeds, 16, 16, keep_previous=True)
    assert e.can_undo and e.held()["state"] > held
    e.release()
    assert not e.can_undo and e.held()["state"] == held


def test_a_non_finite_loss_is_not_applied():
    for buffers in ("one", "two"):
        tr, _, _ = _train("mlp", "sgd", steps=2, buffers=buffers)
        before = tr.parameters
        x, y = _mlp_batches()[0]
        x[0, 0] = np.nan
        feeds = tr._feeds(tr.arrays((x, y)), slice(None))
        loss = tr._engine.step(feeds, 16, 16, accept=lambda v: bool(np.isfinite(v)))
        assert np.isnan(loss) and tr.steps == 2
        for k, v in tr.parameters.items():
            np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("buffers", ["one", "two"])
def test_fit_stops_at_a_nan_loss_and_at_an_overflowing_last_update(buffers):
    train, _ = demo.digits()
    data = {"x": train["x"][:64].copy(), "labels": train["labels"][:64].copy()}
    data["x"][40] = np.nan
    tr = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", "sgd", buffers=buffers)
    with pytest.raises(rg.RevgraphError, match=r"the loss is nan at step 3 \(epoch 1, batch 3\)"):
        tr.fit(data, 2, 16, shuffle=False, progress=False)
    assert tr.steps == 2
    tr = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", rg.train.sgd(lr=1e38), buffers=buffers)
    before, held = tr.parameters, tr._engine.held()
    big = {"x": train["x"][:16] * 1e6, "labels": train["labels"][:16]}
    with pytest.raises(rg.RevgraphError, match=r"became NaN or infinite at step 1"):
        tr.fit(big, 1, 16, shuffle=False, progress=False)
    assert tr.steps == 0 and tr._engine.held() == held
    for k, v in tr.parameters.items():
        np.testing.assert_array_equal(v, before[k])
    tr = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", "adam", buffers=buffers)
    held = tr._engine.held()
    tr.fit({"x": train["x"][:32], "labels": train["labels"][:32]}, 1, 16, progress=False)
    assert tr.steps == 2 and tr._engine.held() == held  # the kept values are released after fit


# ------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    rg.save(mlp(rng), tmp_path / "model.onnx")
    np.savez(tmp_path / "data.npz", x=rng.normal(0, 1, (32, 6)).astype(F32), labels=rng.integers(0, 3, 32))
    return tmp_path


def _train_args(tmp, *extra):
    return ["train", str(tmp / "model.onnx"), "--data", str(tmp / "data.npz"), "--loss", "cross-entropy",
            "--epochs", "2", "--batch-size", "16", "-o", str(tmp / "trained.onnx"), *extra]


def test_cli_runtime_flags_train_the_same_weights(files, capsys):
    weights = []
    for k, extra in enumerate([[], ["--arena", "on", "--memory-pattern", "on", "--execution-order", "priority_based"],
                               ["--arena", "off", "--memory-pattern", "off", "--buffers", "two"],
                               ["--execution-order", "default", "--buffers", "one"],
                               ["--execution-order", "default", "--graph-optimization", "all"]]):
        args = _train_args(files, *extra)
        args[-1 - len(extra)] = str(files / f"trained{k}.onnx")
        assert main(args) == 0, capsys.readouterr().err
        weights.append(rg.load(files / f"trained{k}.onnx").initializers)
    for w in weights[1:]:
        for name, value in weights[0].items():
            np.testing.assert_allclose(w[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    assert main(["run", str(files / "trained0.onnx"), "--arena", "off", "--memory-pattern", "off",
                 "--execution-order", "priority_based"]) == 0


@pytest.mark.parametrize("extra,fragment", [
    (["--arena", "maybe"], "argument --arena: invalid choice: 'maybe'"),
    (["--memory-pattern", "yes"], "argument --memory-pattern: invalid choice: 'yes'"),
    (["--execution-order", "fast"], "argument --execution-order: invalid choice: 'fast'"),
    (["--graph-optimization", "max"], "argument --graph-optimization: invalid choice: 'max'"),
    (["--buffers", "three"], "argument --buffers: invalid choice: 'three'"),
])
def test_cli_bad_runtime_flags_exit_2_with_one_line(files, capsys, extra, fragment):
    one_line_error(main(_train_args(files, *extra)), capsys.readouterr().err, fragment)
    if extra[0] != "--buffers":
        one_line_error(main(["run", str(files / "model.onnx"), *extra]), capsys.readouterr().err, fragment)


def test_cli_runtime_flags_that_onnxruntime_or_the_backend_refuses(files, capsys):
    one_line_error(main(["run", str(files / "model.onnx"), "--arena", "off", "--backend", "reference"]),
                   capsys.readouterr().err, "the reference backend takes none")
    if not _has_memory_efficient_order():
        one_line_error(main(_train_args(files, "--execution-order", "memory_efficient")), capsys.readouterr().err,
                       "execution_order 'memory_efficient': this onnxruntime is not a training build")
