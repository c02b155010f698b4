"""Training graphs and rg.Trainer against PyTorch: the same model from the same initial weights on the same
batches has the same parameters after 20 steps (SGD with momentum, Adam, AdamW; every loss; a recurrent
model whose recurrence is an ONNX Loop; a gathered embedding table's lazy row update)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from kit.registry_checks import check_float64_to_rounding, check_trains_like_torch, check_update_nodes, make_batches
from kit.training import F32, OPTIMIZERS, assert_params_close, embedding_model, mlp, torch_mlp, torch_train

import revgraph as rg
from revgraph import train as T
from revgraph.errors import InputError, RevgraphError
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.tools.demo import rnn_model
from revgraph.train import graphbuild, update_nodes

STEPS = 20


# ------------------------------------------------------------------------------------------------ models


def torch_rnn(P, x):
    h = torch.zeros(x.shape[0], P["U"].shape[0])
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t, :] @ P["W"] + h @ P["U"] + P["b"])
    return h @ P["V"] + P["c"]


def torch_embedding(P, ids):
    return F.embedding(ids, P["E"], sparse=True).mean(1) @ P["Wo"] + P["bo"]


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("loss", [k for k, v in T.LOSSES.items() if v.labels == "required"])  # (one-output losses)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_trainer_matches_pytorch(name, loss):
    check_trains_like_torch(OPTIMIZERS[name], loss)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float64_model_matches_pytorch_to_rounding(name):
    check_float64_to_rounding(OPTIMIZERS[name])


MORE_OPTIMIZERS = {
    "sgd-plain": T.sgd(lr=0.1),
    "sgd-decay-no-momentum": T.sgd(lr=0.1, weight_decay=0.05, no_decay="none"),
    "sgd-momentum": T.sgd(lr=0.05, momentum=0.5),
    "adam-no-decay-small-beta1": T.adam(lr=0.02, betas=(0.3, 0.99), eps=1e-6),  # lerp with weight > 0.5
    "adamw-no-decay": T.adamw(lr=0.02, weight_decay=0.0),
    "adamw-decay-eps": T.adamw(lr=0.02, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.2, no_decay="none"),
}


@pytest.mark.parametrize("name", MORE_OPTIMIZERS)
def test_more_hyperparameters_match_pytorch_over_many_steps(name):
    """The update's rearranged formulas (few passes, bias corrections folded into two scalars) equal
    torch.optim's to rounding over 20 steps: float64 (tight) and float32."""
    for dtype, rtol in ((np.float64, 1e-10), (F32, 1e-4)):
        rng = np.random.default_rng(15)
        g = mlp(rng, dtype=dtype)
        schedule = [(rng.normal(0, 1, (16, 6)).astype(dtype), rng.integers(0, 3, 16)) for _ in range(STEPS)]
        trainer = rg.Trainer(g, "cross-entropy", MORE_OPTIMIZERS[name])
        for b in schedule:
            trainer.step(b)
        theirs, _ = torch_train(g.initializers, torch_mlp, "cross-entropy", MORE_OPTIMIZERS[name], schedule)
        assert_params_close(trainer.parameters, theirs, rtol=rtol)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_update_writes_its_outputs_without_copies(name):
    """The outputs are named by the nodes that compute them (no Identity copies), with the names of old, and
    Adam is 12 elementwise passes per tensor (plus 2 for L2 weight decay, 1 for AdamW's decay)."""
    check_update_nodes(OPTIMIZERS[name])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_grouped_small_tensors_update_as_separate_ones(name, monkeypatch):
    """Small tensors of one dtype and trailing shape are updated as one concatenation, split back: the same
    elementwise arithmetic, so the same values as one update per tensor; names and outputs unchanged."""
    rng = np.random.default_rng(4)
    g = mlp(rng, din=5, hidden=5, out=5)  # W1, W2 [5, 5] and b1, b2 [5]: two groups
    batches = make_batches(rng, "cross-entropy", n_batches=3, din=5, out=5)
    runs = {}
    for limit in (0, T.GROUP_ELEMENTS):
        monkeypatch.setattr(update_nodes, "GROUP_ELEMENTS", limit)
        trainer = rg.Trainer(g, "cross-entropy", OPTIMIZERS[name])
        losses = [trainer.step(b) for b in batches * 3]
        runs[limit] = trainer, losses
    (alone, l0), (grouped, l1) = runs.values()
    tg = grouped.spec
    assert len([n for n in tg.graph.nodes if n.op_type == "Split"]) == 2 * (1 + len(tg.optimizer.slots))
    assert (tg.new_params, tg.new_state, tg.graph.output_names) == (alone.spec.new_params, alone.spec.new_state,
                                                                    alone.spec.graph.output_names)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    state0, state1 = (t._engine.read(t._engine.names) for t in (alone, grouped))
    for k, v in state0.items():
        np.testing.assert_allclose(state1[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_outputs_keep_identity_only_where_needed():
    """A value no update node computes (an input) or one already named gets an Identity; others are renamed."""
    b = graphbuild.Builder({"p", "g"})
    b.prefix = "optim/p"
    s = b.op("Add", ["p", "g"])
    t = b.op("Mul", [s, s])
    names = graphbuild.name_outputs(b, 0, [(s, "p.new"), ("p", "q.new"), (s, "r.new")])
    assert names == ["p.new", "q.new", "r.new"]
    add, mul, keep, dup = b.nodes
    assert add.outputs == ["p.new"] and mul.inputs == ["p.new", "p.new"] and mul.outputs == [t]
    assert (keep.op_type, keep.inputs, keep.outputs) == ("Identity", ["p"], ["q.new"])
    assert (dup.op_type, dup.inputs, dup.outputs) == ("Identity", ["p.new"], ["r.new"])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_recurrent_loop_model_matches_pytorch(name):
    rng = np.random.default_rng(1)
    g = rnn_model(hidden=6, rows=5, width=4, classes=3, seed=1)
    opt = OPTIMIZERS[name]
    batches = [(rng.random((8, 5, 4)).astype(F32), rng.integers(0, 3, 8)) for _ in range(3)]
    schedule = [batches[k % 3] for k in range(STEPS)]
    trainer = rg.Trainer(g, "cross-entropy", opt)
    for b in schedule:
        trainer.step(b)
    params = {k: v for k, v in g.initializers.items() if v.dtype == F32}
    theirs, _ = torch_train(params, torch_rnn, "cross-entropy", opt, schedule)
    assert_params_close(trainer.parameters, theirs)


def test_sparse_table_plain_sgd_is_exact():
    """Rows of a table read only through Gather are updated with ScatterND; for SGD that is the dense step."""
    rng = np.random.default_rng(2)
    g = embedding_model(rng)
    opt = T.sgd(lr=0.5)
    batches = [(rng.integers(0, 8, (6, 5)), rng.integers(0, 3, 6)) for _ in range(4)]  # rows 8..11 never read
    schedule = [batches[k % 4] for k in range(STEPS)]
    trainer = rg.Trainer(g, "cross-entropy", opt)
    assert trainer.spec.sparse == ["E"]
    for b in schedule:
        trainer.step(b)
    params = {k: v for k, v in g.initializers.items() if v.dtype == F32}
    theirs, _ = torch_train(params, torch_embedding, "cross-entropy", opt, schedule, sparse=("E",))
    assert_params_close(trainer.parameters, theirs)
    np.testing.assert_array_equal(trainer.parameters["E"][8:], g.initializers["E"][8:])


def test_sparse_table_lazy_adam_is_sparse_adam():
    """embedding_update="lazy": torch.optim.SparseAdam's row update (the default, torch's dense update, is in
    tests/test_embedding_update.py)."""
    rng = np.random.default_rng(3)
    g = embedding_model(rng)
    opt = T.adam(lr=0.05, embedding_update="lazy")
    batches = [(rng.integers(0, 10, (6, 5)), rng.integers(0, 3, 6)) for _ in range(4)]
    schedule = [batches[k % 4] for k in range(STEPS)]
    trainer = rg.Trainer(g, "cross-entropy", opt)
    for b in schedule:
        trainer.step(b)
    params = {k: v for k, v in g.initializers.items() if v.dtype == F32}
    theirs, _ = torch_train(params, torch_embedding, "cross-entropy", opt, schedule, sparse=("E",))
    assert_params_close(trainer.parameters, theirs)
    state = trainer.state
    assert not state["E.m"][10:].any() and not state["E.v"][10:].any()  # untouched rows: no state either


def test_sparse_table_lazy_momentum():
    """SGD with momentum on a gathered table, embedding_update="lazy": only the rows of the batch decay and move
    (numpy reference, with the gradient rows from revgraph.gradient checked against PyTorch's sparse gradient)."""
    rng = np.random.default_rng(4)
    g = embedding_model(rng)
    opt = T.sgd(lr=0.2, momentum=0.9, weight_decay=0.01, no_decay="none", embedding_update="lazy")
    batches = [(rng.integers(0, 12, (3, 5)), rng.integers(0, 3, 3)) for _ in range(5)]
    trainer = rg.Trainer(g, "cross-entropy", opt, params=["E"])
    P = {k: torch.tensor(v, requires_grad=k == "E") for k, v in g.initializers.items() if v.dtype == F32}
    E, buf = g.initializers["E"].copy(), np.zeros_like(g.initializers["E"])
    for k in range(STEPS):
        ids, y = batches[k % 5]
        trainer.step((ids, y))
        P["E"] = torch.tensor(E, requires_grad=True)
        F.cross_entropy(torch_embedding(P, torch.tensor(ids)), torch.tensor(y)).backward()
        grad = P["E"].grad.coalesce()
        rows, values = grad.indices()[0].numpy(), grad.values().numpy()
        values = values + opt.weight_decay * E[rows]
        buf[rows] = opt.momentum * buf[rows] + values
        E[rows] -= opt.lr * buf[rows]
    assert_params_close(trainer.parameters, {"E": E})
    assert_params_close(trainer.state, {"E.momentum": buf})


def test_bce_gradient_is_exact_at_zero_logits():
    """softplus is written so that its derivative is sigmoid(z) also at z = 0 (no tie convention of Max)."""
    g = Graph([Node("Identity", ["z"], ["out"], name="id")], [ValueInfo("z", F32, (4,))], [ValueInfo("out", F32, (4,))])
    lg, spec = T.loss_graph(g, "bce")
    gg = rg.gradient(lg, spec.loss, ["z"])
    y = np.array([0, 1, 0.25, 1], F32)
    z = np.array([0, 0, 30, -30], F32)
    out = rg.Session(gg).run({"z": z, spec.labels: y})
    zt = torch.tensor(z, requires_grad=True)
    F.binary_cross_entropy_with_logits(zt, torch.tensor(y)).backward()
    np.testing.assert_allclose(out[gg.output_names[-1]], zt.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(out[spec.loss], F.binary_cross_entropy_with_logits(torch.tensor(z), torch.tensor(y)),
                               rtol=1e-6)


# ------------------------------------------------------------------------------------------------ graphs


def _rnn_case():
    rng = np.random.default_rng(5)
    return rnn_model(hidden=5, rows=3, width=4, classes=3, seed=5), {"x": rng.random((4, 3, 4)).astype(F32)}, 3


def _mlp_case():
    rng = np.random.default_rng(6)
    return mlp(rng), {"x": rng.normal(0, 1, (5, 6)).astype(F32)}, 3


def _embedding_case():
    rng = np.random.default_rng(7)
    return embedding_model(rng), {"ids": rng.integers(0, 12, (5, 5))}, 3


@pytest.mark.parametrize("case", [_mlp_case, _rnn_case, _embedding_case], ids=["mlp", "rnn-loop", "sparse-table"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_training_graph_is_standard_onnx_and_runtimes_agree(case, name):
    g, feeds, classes = case()
    tg = T.training_graph(g, "cross-entropy", OPTIMIZERS[name])
    model = rg.to_onnx(tg.graph)
    onnx.checker.check_model(model, full_check=True)
    nodes, stack = [], list(model.graph.node)
    while stack:  # every node, loop bodies included
        node = stack.pop()
        nodes.append(node)
        stack.extend(n for a in node.attribute if a.type == onnx.AttributeProto.GRAPH for n in a.g.node)
    assert {n.domain for n in nodes} | {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
    assert (case is _rnn_case) == any(n.op_type == "Loop" for n in nodes)
    assert [v.name for v in model.graph.input] == [*tg.inputs, tg.labels, *tg.params,
                                                    *[s for p in tg.params for s in tg.state[p]], tg.step]
    assert [v.name for v in model.graph.output] == [tg.loss.loss, *tg.new_params.values(),
                                                     *[s for p in tg.params for s in tg.new_state[p]], tg.new_step]
    n = len(next(iter(feeds.values())))
    labels = np.random.default_rng(0).integers(0, classes, n)
    runs = {}
    for backend in ("onnxruntime", "reference"):
        sess = rg.Session(tg.graph, backend=backend)
        state = {**tg.initial_state(), **feeds, tg.labels: labels}
        for _ in range(3):  # three steps, each fed the previous step's outputs
            out = sess.run(state)
            state.update({i: out[o] for i, o in tg.carried()})
        runs[backend] = (out, state)
    (ort_out, ort_state), (ref_out, ref_state) = runs["onnxruntime"], runs["reference"]
    np.testing.assert_allclose(ort_out[tg.loss.loss], ref_out[tg.loss.loss], rtol=1e-5)
    for name_ in [*tg.params, *[s for p in tg.params for s in tg.state[p]]]:
        scale = float(np.abs(ref_state[name_]).max()) or 1.0
        np.testing.assert_allclose(ort_state[name_], ref_state[name_], rtol=1e-5, atol=1e-5 * scale, err_msg=name_)
    assert int(ort_state[tg.step]) == 3
    assert any(not np.array_equal(ort_state[p], tg.initial[p]) for p in tg.params)


def test_trainer_bindings_match_plain_session_runs():
    """The IO-binding loop (two swapped OrtValue sets) gives what feeding outputs back through numpy gives."""
    rng = np.random.default_rng(8)
    g = mlp(rng)
    batches = make_batches(rng, "cross-entropy", n_batches=5)
    trainer = rg.Trainer(g, "cross-entropy", "adam")
    tg = trainer.spec
    sess = rg.Session(tg.graph)
    state = tg.initial_state()
    for x, y in batches:
        loss = trainer.step({"x": x, "labels": y})
        out = sess.run({**state, "x": x, tg.labels: y})
        state.update({i: out[o] for i, o in tg.carried()})
        assert loss == pytest.approx(float(out[tg.loss.loss]), rel=1e-6)
    for p in tg.params:
        np.testing.assert_allclose(trainer.parameters[p], state[p], rtol=1e-6, atol=1e-7)


def test_fit_evaluate_export(tmp_path):
    rng = np.random.default_rng(9)
    g = mlp(rng)
    x = rng.normal(0, 1, (200, 6)).astype(F32)
    y = np.argmax(x[:, :3] + 0.1 * x[:, 3:], axis=1)  # a learnable rule
    trainer = rg.Trainer(g, "cross-entropy", T.adam(lr=0.05))
    before = trainer.evaluate({"x": x, "labels": y})
    means = trainer.fit({"x": x, "labels": y}, epochs=15, batch_size=32, progress=False)
    after = trainer.evaluate((x, y))
    assert len(means) == 15 and len(trainer.losses) == 15 * 7
    assert means[-1] < means[0] and after["loss"] < before["loss"]
    assert after["accuracy"] > 0.9 and after["samples"] == 200
    logits = trainer.predict(x)
    assert after["accuracy"] == pytest.approx(float(np.mean(np.argmax(logits, 1) == y)))
    ref = F.cross_entropy(torch.tensor(logits), torch.tensor(y))
    assert after["loss"] == pytest.approx(float(ref), rel=1e-5)
    path = tmp_path / "trained.onnx"
    exported = trainer.export(path)
    back = rg.load(path)
    for p in ("W1", "b1", "W2", "b2"):
        np.testing.assert_array_equal(back.initializers[p], trainer.parameters[p])
    np.testing.assert_allclose(rg.Session(back).run({"x": x})["y"], logits, rtol=1e-6, atol=1e-6)
    assert exported.input_names == ["x"]


def test_fit_shows_progress_with_loss_and_throughput():
    from rich.console import Console

    rng = np.random.default_rng(10)
    console = Console(record=True, width=120, force_terminal=False)
    trainer = rg.Trainer(mlp(rng), "mse", "sgd")
    x, y = make_batches(rng, "mse", n_batches=1, size=40)[0]
    trainer.fit((x, y), epochs=2, batch_size=16, console=console, description="mlp")
    text = console.export_text()
    assert "mlp epoch 2/2" in text and "6/6" in text
    assert "samples/s" in text and f"loss {trainer.losses[-1]:.4f}" in text


def test_bce_accuracy_and_mse_has_none():
    rng = np.random.default_rng(11)
    g = mlp(rng, out=1)
    x = rng.normal(0, 1, (50, 6)).astype(F32)
    y = (x[:, :1] > 0).astype(F32)
    trainer = rg.Trainer(g, "bce", T.adam(lr=0.05))
    trainer.fit((x, y), epochs=20, batch_size=10, progress=False)
    ev = trainer.evaluate((x, y))
    assert ev["accuracy"] == pytest.approx(float(np.mean((trainer.predict(x) > 0) == (y > 0.5))))
    assert ev["accuracy"] > 0.9
    assert rg.Trainer(g, "mse", "sgd").evaluate((x, y))["accuracy"] is None


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": -1.0}, "learning rate must be positive"),
    ({"momentum": 1.0}, "momentum must be in [0, 1)"),
    ({"weight_decay": -0.1}, "weight decay must be >= 0"),
])
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(RevgraphError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        T.sgd(**kwargs)


def test_bad_data_is_one_line():
    rng = np.random.default_rng(12)
    trainer = rg.Trainer(mlp(rng), "cross-entropy", "sgd")
    x = rng.normal(0, 1, (4, 6)).astype(F32)
    cases = [
        ({"x": x}, "lacks 'labels'"),
        ({"x": x, "labels": np.array([0, 1, 2])}, "differ in length"),
        ({"x": x, "labels": np.array([0, 1, 2, 3])}, "not a class index in [0, 3)"),
        ({"x": x, "labels": np.array([0.5, 1, 2, 0])}, "integer class indices"),
        ({"x": x[:, :5], "labels": np.zeros(4, int)}, "must be float32[N,6]"),
    ]
    for data, message in cases:
        with pytest.raises(InputError) as info:
            trainer.arrays(data)
        assert message in str(info.value) and "\n" not in str(info.value)


def test_model_with_two_outputs_needs_a_choice():
    rng = np.random.default_rng(13)
    g = mlp(rng)
    g.outputs.append(ValueInfo("h", F32, ("N", 8)))
    with pytest.raises(RevgraphError, match="has 2 outputs"):
        T.training_graph(g, "cross-entropy", "sgd")
    tg = T.training_graph(g, "cross-entropy", "sgd", output="y")
    assert tg.loss.output == "y"
