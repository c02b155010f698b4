"""Embedding tables (a parameter read only through Gather, whose gradient revgraph builds as rows) against
PyTorch: by default (``embedding_update="dense"``) the update is torch.optim.SGD/Adam/AdamW's on the dense
gradient, also for the rows a batch misses (their moments decay, weight decay shrinks them); ``"lazy"`` is
torch.optim.SparseAdam's row update. 20 steps of Gather + MatMul on batches that miss rows, every engine."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from kit.training import assert_params_close
from onnx import TensorProto, helper, numpy_helper

import revgraph as rg
from revgraph import train as T
from revgraph.errors import RevgraphError
from revgraph.ir.inplace import inplace_pairs
from revgraph.train.graphs import split_step

F32 = np.float32
V, D, C, B, STEPS = 20, 4, 3, 6, 20
TOL = 1e-5

CASES = {  # the optimizer, and PyTorch's dense twin
    "adam": ({"name": "adam", "lr": 0.05}, lambda P: torch.optim.Adam(P, lr=0.05)),
    "adamw decay": ({"name": "adamw", "lr": 0.05, "weight_decay": 0.1},
                    lambda P: torch.optim.AdamW(P, lr=0.05, weight_decay=0.1)),
    "adam L2": ({"name": "adam", "lr": 0.05, "weight_decay": 0.05},
                lambda P: torch.optim.Adam(P, lr=0.05, weight_decay=0.05)),
    "sgd momentum decay": ({"name": "sgd", "lr": 0.3, "momentum": 0.9, "weight_decay": 0.05},
                           lambda P: torch.optim.SGD(P, lr=0.3, momentum=0.9, weight_decay=0.05)),
    "sgd decay": ({"name": "sgd", "lr": 0.3, "weight_decay": 0.05},
                  lambda P: torch.optim.SGD(P, lr=0.3, weight_decay=0.05)),
    "sgd momentum": ({"name": "sgd", "lr": 0.3, "momentum": 0.9}, lambda P: torch.optim.SGD(P, lr=0.3, momentum=0.9)),
}


def gather_matmul(seed: int = 0) -> onnx.ModelProto:
    """ids int64 [N] -> Gather(E [V, D]) -> MatMul(W [D, C]) -> logits [N, C], built with onnx.helper."""
    rng = np.random.default_rng(seed)
    E, W = rng.normal(0, 1, (V, D)).astype(F32), rng.normal(0, 0.5, (D, C)).astype(F32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["emb"], axis=0),
         helper.make_node("MatMul", ["emb", "W"], ["logits"])],
        "gather_matmul", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", C])],
        [numpy_helper.from_array(E, "E"), numpy_helper.from_array(W, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def batches(seed: int = 1, n: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches of B ids from rows 0..11 only (rows 12..19 never read), each with repeats and missing most rows;
    a row read at one step is missed at later ones (its moments decay there under the dense update)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, 12, B)
        ids[1] = ids[0]  # a repeated row: its gradient rows add
        out.append((ids.astype(np.int64), rng.integers(0, C, B)))
    return out


def initial(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def torch_reference(model, make_opt, data, *, clip=None, sparse=False):
    """PyTorch's training of :func:`gather_matmul` over ``data``: ``make_opt(params)`` over both parameters
    (dense embedding gradient), or with ``sparse`` SparseAdam over E (sparse gradient) and ``make_opt`` over W.
    ``clip``: clip_grad_norm_ before each step. Returns the parameters and the losses."""
    P = {k: torch.tensor(v, requires_grad=True) for k, v in initial(model).items()}
    opts = [make_opt([P["W"]]), torch.optim.SparseAdam([P["E"]], lr=0.05)] if sparse else [make_opt(list(P.values()))]
    losses = []
    for ids, y in data:
        for o in opts:
            o.zero_grad()
        loss = F.cross_entropy(F.embedding(torch.tensor(ids), P["E"], sparse=sparse) @ P["W"], torch.tensor(y))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(P.values()), clip)
        for o in opts:
            o.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().numpy() for k, v in P.items()}, losses


def ours(model, hp, data, **how):
    trainer = rg.Trainer(model, "cross-entropy", T.make_optimizer(**hp), threads=1, **how)
    losses = [trainer.step(b) for b in data]
    assert trainer.spec.sparse == ["E"]  # the table's gradient is rows: the sparse update is what is tested
    return trainer, losses


def check(trainer, losses, theirs, torch_losses):
    np.testing.assert_allclose(losses, torch_losses, rtol=TOL, atol=TOL)
    assert_params_close(trainer.parameters, theirs, rtol=TOL)


@pytest.mark.parametrize("case", CASES)
def test_dense_update_equals_torch_dense_optimizers(case):
    model, data = gather_matmul(), batches()
    hp, make_opt = CASES[case]
    trainer, losses = ours(model, {**hp, "no_decay": "none"}, data)
    theirs, torch_losses = torch_reference(model, make_opt, data)
    check(trainer, losses, theirs, torch_losses)
    E0 = initial(model)["E"]
    missed = np.setdiff1d(np.arange(12), data[-1][0])  # read before, missed by the last batch
    assert not np.allclose(theirs["E"][missed], E0[missed], atol=1e-3)  # rows the batch missed did move
    if hp.get("weight_decay"):  # never read: only weight decay moved them, as in torch
        assert not np.allclose(theirs["E"][12:], E0[12:], atol=1e-4)
    lazy, _ = ours(model, {**hp, "no_decay": "none", "embedding_update": "lazy"}, data)
    assert not np.allclose(lazy.parameters["E"], theirs["E"], atol=1e-3)  # the comparison tells the two apart


def test_lazy_adam_equals_sparse_adam():
    """``embedding_update="lazy"``: torch.optim.SparseAdam's update of E (W dense Adam): rows outside the batch,
    and their moments, stay as they were."""
    model, data = gather_matmul(), batches()
    trainer, losses = ours(model, {"name": "adam", "lr": 0.05, "embedding_update": "lazy"}, data)
    theirs, torch_losses = torch_reference(model, lambda P: torch.optim.Adam(P, lr=0.05), data, sparse=True)
    check(trainer, losses, theirs, torch_losses)
    np.testing.assert_array_equal(trainer.parameters["E"][12:], initial(model)["E"][12:])
    assert not trainer.state["E.m"][12:].any() and not trainer.state["E.v"][12:].any()


@pytest.mark.parametrize("case", ["adamw decay", "sgd momentum decay"])
def test_dense_update_with_clipping_equals_torch(case):
    """Clipping by the global norm coalesces the rows first (the norm of torch's dense gradient); the dense
    update reads those coalesced, scaled rows."""
    model, data = gather_matmul(), batches()
    hp, make_opt = CASES[case]
    trainer, losses = ours(model, {**hp, "no_decay": "none", "clip_grad_norm": 0.5}, data)
    theirs, torch_losses = torch_reference(model, make_opt, data, clip=0.5)
    check(trainer, losses, theirs, torch_losses)
    unclipped, _ = torch_reference(model, make_opt, data)
    assert not np.allclose(unclipped["E"], theirs["E"], atol=1e-3)  # the clipping changed the run


@pytest.mark.parametrize("case", ["adam L2", "adamw decay"])
def test_two_buffer_sets_equal_torch(case):
    """buffers="two": the fused step graph writing the other buffer set."""
    model, data = gather_matmul(), batches()
    hp, make_opt = CASES[case]
    trainer, losses = ours(model, {**hp, "no_decay": "none"}, data, buffers="two")
    check(trainer, losses, *torch_reference(model, make_opt, data))


@pytest.mark.parametrize("mode", ["dense", "lazy"])
def test_one_buffer_set_overwrites_the_table_and_its_state(mode):
    """The update writes the new table and moments into the buffers of the old ones (revgraph.ir.inplace): every
    reader of E, E.m, E.v is an ancestor of the ScatterND writing the new value."""
    tg = T.training_graph(gather_matmul(), "cross-entropy", T.adam(lr=0.05, weight_decay=0.1, embedding_update=mode))
    unsafe = inplace_pairs(split_step(tg)[1], tg.carried())
    assert not {"E", *tg.state["E"]} & set(unsafe), unsafe


def test_accumulated_micro_batches_equal_torch():
    """fit(accumulate_steps=2): two micro-batches of 6, their gradient rows summed, then one dense update: torch's
    step on the batch of 12."""
    model, data = gather_matmul(), batches(n=2 * 10)
    ids, y = np.concatenate([d[0] for d in data]), np.concatenate([d[1] for d in data])
    hp, make_opt = CASES["adamw decay"]
    trainer = rg.Trainer(model, "cross-entropy", T.make_optimizer(**hp, no_decay="none"), threads=1)
    trainer.fit({"ids": ids, "labels": y}, 1, B, shuffle=False, progress=False, accumulate_steps=2)
    assert trainer.steps == 10
    pairs = [(ids[k:k + 2 * B], y[k:k + 2 * B]) for k in range(0, len(ids), 2 * B)]
    check(trainer, trainer.losses, *torch_reference(model, make_opt, pairs))


def test_bad_embedding_update_is_refused_naming_the_option():
    with pytest.raises(RevgraphError, match=r"--embedding-update.*dense or lazy, got 'sparse'"):
        T.adam(embedding_update="sparse")
    with pytest.raises(RevgraphError, match="--embedding-update"):
        T.Optimizer("sgd", 0.1, embedding_update=None)
    assert T.make_optimizer("adam").embedding_update == "dense"


def test_cli_embedding_update_reaches_the_optimizer(tmp_path, capsys):
    """``revgraph train --embedding-update lazy|dense``: AdamW with weight decay on full batches of rows 0..11;
    rows 12..19 are never read, so lazy leaves them as they were and dense decays them by (1 - lr wd) a step
    (torch.optim.AdamW: their gradient and moments are zero). A bad value exits 2 with one line."""
    from revgraph.cli import main

    model = gather_matmul()
    onnx.save(model, tmp_path / "m.onnx")
    ids, y = np.concatenate([d[0] for d in batches(n=2)]), np.concatenate([d[1] for d in batches(n=2)])
    np.savez(tmp_path / "d.npz", ids=ids, labels=y)
    E0 = initial(model)["E"]
    for mode in ("lazy", "dense"):
        argv = ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "cross-entropy",
                "--epochs", "3", "--batch-size", str(len(ids)), "--optimizer", "adamw", "--lr", "0.01",
                "--weight-decay", "0.5", "--embedding-update", mode, "-o", str(tmp_path / f"{mode}.onnx")]
        assert main(argv) == 0
        E = initial(onnx.load(tmp_path / f"{mode}.onnx"))["E"]
        want = E0[12:] if mode == "lazy" else E0[12:] * np.float32(1 - 0.01 * 0.5) ** 3
        np.testing.assert_allclose(E[12:], want, rtol=1e-6)
    capsys.readouterr()
    argv[argv.index("dense")] = "sparse"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--embedding-update" in err[0] and "'sparse'" in err[0], err


def test_a_method_that_is_not_elementwise_gets_the_dense_gradient():
    """A registered optimizer whose update is not declared elementwise (its formula may read the whole tensor):
    the rows are scattered into a dense gradient, then its ordinary update: torch's numbers all the same."""
    from revgraph.train import optimizers

    class WholeTensorSGD(optimizers.SGD):
        name, elementwise = "whole-sgd", False

    optimizers.register(WholeTensorSGD)
    try:
        model, data = gather_matmul(), batches()
        hp, make_opt = CASES["sgd momentum decay"]
        trainer, losses = ours(model, {**hp, "name": "whole-sgd", "no_decay": "none"}, data)
        check(trainer, losses, *torch_reference(model, make_opt, data))
        spec = trainer.spec
        update = spec.graph.nodes[len(spec.graph.nodes) - spec.n_update_nodes:]
        assert not any(n.op_type == "Gather" and n.inputs[0] == "E" for n in update)  # no row update: dense
    finally:
        del optimizers.OPTIMIZERS["whole-sgd"]


def test_resuming_with_another_embedding_update_is_refused(tmp_path):
    """The snapshot records embedding_update (Optimizer.settings): resuming with the other one is refused,
    naming it, since the two train differently."""
    data = batches(n=4)
    arrays = {"ids": np.concatenate([d[0] for d in data]), "labels": np.concatenate([d[1] for d in data])}
    first = rg.Trainer(gather_matmul(), "cross-entropy", T.adam(lr=0.05), threads=1)
    first.fit(arrays, 1, B, progress=False, snapshot_dir=tmp_path)
    again = rg.Trainer(gather_matmul(), "cross-entropy", T.adam(lr=0.05, embedding_update="lazy"), threads=1)
    with pytest.raises(RevgraphError, match="embedding_update 'dense' \\(now 'lazy'\\)"):
        again.fit(arrays, 2, B, progress=False, snapshot_dir=tmp_path)
