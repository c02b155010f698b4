"""Losses of issue 26 (revgraph.train.losses): causal-lm, output:NAME, ignore_index, label smoothing and class weights,
each against torch.nn.functional.cross_entropy (value and gradients with respect to the logits and a parameter,
float64), float64 central differences of the written loss graph, and training trajectories of a tiny
transformer-like language model against the same model written in PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.lossdata_models import V, lm_data, tiny_lm
from kit.losses import own_loss_model, torch_lm

import revgraph as rg
from revgraph.errors import InputError, RevgraphError
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.runtime import Session
from revgraph.train import make_optimizer
from revgraph.train.losses import LOSSES, loss_graph

F64 = np.float64


def affine_logits(shape, dtype=F64) -> Graph:
    """``logits = z * scale + bias`` (``z`` a graph input of ``shape``, ``scale`` and ``bias`` parameters of the
    class axis): gradients with respect to the logits (through ``z``) and to parameters."""
    c = shape[-1]
    rng = np.random.default_rng(5)
    inits = {"scale": (1 + 0.3 * rng.standard_normal(c)).astype(dtype), "bias": rng.standard_normal(c).astype(dtype)}
    nodes = [Node("Mul", ["z", "scale"], ["zs"], {}, "mul"), Node("Add", ["zs", "bias"], ["logits"], {}, "add")]
    sym = ("N", *shape[1:-1], c)
    return Graph(nodes, [ValueInfo("z", dtype, sym)], [ValueInfo("logits", dtype, sym)], inits, name="affine")


def graph_loss(g, loss, feeds, **options):
    """The loss of ``loss_graph`` and its gradients with respect to ``z``, ``scale`` and ``bias`` (float64)."""
    lg, spec = loss_graph(g, loss, **options)
    gg = rg.gradient(lg, spec.loss, ["z", "scale", "bias"])
    names = [spec.loss, "z_grad", "scale_grad", "bias_grad"]
    feeds = {(spec.labels if k == "labels" else k): v for k, v in feeds.items()}
    out = Session(gg).run(feeds, names)
    return [out[n] for n in names], spec


def torch_loss(g, z, fn):
    """``fn(logits)`` with ``logits`` computed in torch from ``g``'s parameters, and the gradients of it."""
    zt = torch.tensor(z, requires_grad=True)
    s = torch.tensor(g.initializers["scale"], requires_grad=True)
    b = torch.tensor(g.initializers["bias"], requires_grad=True)
    value = fn(zt * s + b)
    value.backward()
    return [value.detach().numpy(), zt.grad.numpy(), s.grad.numpy(), b.grad.numpy()]


def close(ours, theirs, rtol=1e-10, atol=1e-12):
    for name, a, b in zip(["loss", "d logits", "d scale", "d bias"], ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)


OPTION_CASES = [{}, {"ignore_index": -100}, {"ignore_index": 2}, {"label_smoothing": 0.1},
                {"class_weights": [0.5, 2.0, 1.0, 0.25, 3.0]}, {"ignore_index": -100, "label_smoothing": 0.2},
                {"ignore_index": 1, "class_weights": [0.5, 2.0, 1.0, 0.25, 3.0], "label_smoothing": 0.3}]


@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: ",".join(o) or "plain")
def test_cross_entropy_options_against_torch(options):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((7, 5))
    y = rng.integers(0, 5, 7)
    ii = options.get("ignore_index")
    if ii is not None:  # padding rows: ignored targets
        y[[1, 4]] = ii
    g = affine_logits(z.shape)
    ours, spec = graph_loss(g, "cross-entropy", {"z": z, "labels": y}, **options)
    w = options.get("class_weights")
    theirs = torch_loss(g, z, lambda lg: F.cross_entropy(
        lg, torch.tensor(y), weight=None if w is None else torch.tensor(w, dtype=torch.float64),
        ignore_index=-100 if ii is None else ii, label_smoothing=options.get("label_smoothing", 0.0)))
    close(ours, theirs)
    assert spec.settings["kind"] == "cross-entropy" and spec.settings["output"] == "logits"
    assert spec.settings["class_weights"] == w and spec.settings.get("ignore_index") == ii


@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"class_weights": [1, 0.5, 2, 1.5]},
                                     {"ignore_index": 3, "label_smoothing": 0.25, "class_weights": [1, 0.5, 2, 1.5]}],
                         ids=lambda o: ",".join(o) or "default")
def test_causal_lm_against_torch_with_explicit_labels(options):
    """causal-lm with a labels array (Hugging Face: given unshifted, shifted inside) and -100 padding at the end
    of some rows: F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=...)."""
    rng = np.random.default_rng(1)
    b, t, v = 3, 6, 4
    z = rng.standard_normal((b, t, v))
    labels = rng.integers(0, v, (b, t))
    ii = options.get("ignore_index", -100)
    labels[0, 4:] = ii  # padding
    labels[2, 2:] = ii
    g = affine_logits(z.shape)
    ours, spec = graph_loss(g, "causal-lm", {"z": z, "labels": labels}, labels_from="labels", **options)
    assert spec.labels == "labels" and spec.settings["ignore_index"] == ii and spec.settings["labels_from"] == "labels"
    w = options.get("class_weights")
    theirs = torch_loss(g, z, lambda lg: F.cross_entropy(
        lg[:, :-1].reshape(-1, v), torch.tensor(labels[:, 1:]).reshape(-1),
        weight=None if w is None else torch.tensor(w, dtype=torch.float64), ignore_index=ii,
        label_smoothing=options.get("label_smoothing", 0.0)))
    close(ours, theirs)


def test_no_counted_target_gives_loss_zero_and_zero_gradient():
    """torch gives NaN for a batch of padding alone (0 / 0); revgraph documents loss 0 with zero gradients."""
    z = np.random.default_rng(2).standard_normal((2, 4, 3))
    labels = np.full((2, 4), -100)
    labels[:, 0] = 1  # the first position is never a target (shifted away)
    g = affine_logits(z.shape)
    torch_value = F.cross_entropy(torch.tensor(z[:, :-1]).reshape(-1, 3), torch.tensor(labels[:, 1:]).reshape(-1))
    assert torch.isnan(torch_value)
    for options in [{}, {"label_smoothing": 0.1}, {"class_weights": [1.0, 2.0, 3.0]}]:
        (loss, *grads), _ = graph_loss(g, "causal-lm", {"z": z, "labels": labels}, labels_from="labels", **options)
        assert loss == 0.0
        for gr in grads:
            np.testing.assert_array_equal(gr, np.zeros_like(gr))


def test_causal_lm_loss_graph_central_differences():
    """The gradient of the causal-lm loss (smoothing, weights, padding) against float64 central differences of
    the same graph, with respect to the logits' input and both parameters."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((2, 5, 4))
    labels = rng.integers(0, 4, (2, 5))
    labels[1, 3:] = -100
    lg, spec = loss_graph(affine_logits(z.shape), "causal-lm", labels_from="labels", label_smoothing=0.2,
                          class_weights=[1.0, 0.5, 2.0, 1.5])
    rep = rg.check_gradients(lg, spec.loss, ["z", "scale", "bias"], inputs={"z": z, "labels": labels}, rtol=1e-6,
                             atol=1e-9)
    assert rep.ok, rep


def test_causal_lm_never_copies_the_logits():
    """Issue 42: the causal-lm loss reads the [B, T, V] logits whole (the last position's target is the ignored
    index instead of a Slice of the logits, which onnxruntime copies), so neither the forward nor the backward
    holds a [B, T-1, V] slice or its Pad back; the loss and the gradient are torch's shifted loss's (whose last
    position gets exactly 0)."""
    rng = np.random.default_rng(5)
    z = rng.standard_normal((2, 5, 4))
    ids = rng.integers(0, 4, (2, 5))
    g = affine_logits(z.shape)
    lg, spec = loss_graph(g, "causal-lm", labels_from="labels")
    gg = rg.gradient(lg, spec.loss, ["z"])
    readers = {n.op_type for n in gg.nodes if "logits" in n.inputs}
    assert "Slice" not in readers and not any(n.op_type == "Pad" for n in gg.nodes), readers
    out = Session(gg).run({"z": z, "labels": ids})
    zt = torch.tensor(z, requires_grad=True)
    logits = zt * torch.tensor(g.initializers["scale"]) + torch.tensor(g.initializers["bias"])
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 4), torch.tensor(ids[:, 1:]).reshape(-1))
    ref.backward()
    np.testing.assert_allclose(out[spec.loss], float(ref), rtol=1e-12)
    np.testing.assert_allclose(out["z_grad"], zt.grad.numpy(), rtol=1e-10, atol=1e-14)
    assert (out["z_grad"][:, -1] == 0).all()


# ------------------------------------------------------------------------------------------ a tiny language model


def torch_sgd(g: Graph, batches, loss_fn, lr: float) -> dict:
    params = {k: torch.tensor(v, requires_grad=True) for k, v in g.initializers.items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr)
    for batch in batches:
        opt.zero_grad()
        loss_fn(params, *batch).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in params.items()}


def test_tiny_lm_causal_lm_training_equals_pytorch():
    """4 SGD steps of causal-lm on the input ids themselves (no labels array) equal torch.optim.SGD on
    F.cross_entropy(logits[:, :-1], ids[:, 1:])."""
    g = tiny_lm()
    ids, _ = lm_data()
    tr = rg.Trainer(g, "causal-lm", make_optimizer("sgd", lr=0.5), threads=1)
    assert tr.spec.labels is None and tr.spec.loss.targets == "input_ids"
    tr.fit({"input_ids": ids}, epochs=2, batch_size=4, shuffle=False, progress=False)

    def loss(p, i):
        return F.cross_entropy(torch_lm(p, i)[:, :-1].reshape(-1, V), i[:, 1:].reshape(-1))

    batches = [(torch.tensor(ids[j:j + 4]),) for j in (0, 4, 0, 4)]
    want = torch_sgd(g, batches, loss, 0.5)
    for k, v in tr.parameters.items():
        np.testing.assert_allclose(v, want[k], rtol=2e-5, atol=1e-6, err_msg=k)
    ev = tr.evaluate({"input_ids": ids})
    with torch.no_grad():
        p = {k: torch.tensor(v) for k, v in tr.parameters.items()}
        logits = torch_lm(p, torch.tensor(ids))
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, V), torch.tensor(ids[:, 1:]).reshape(-1))
        acc = (logits[:, :-1].argmax(-1) == torch.tensor(ids[:, 1:])).double().mean()
    np.testing.assert_allclose(ev["loss"], float(ref), rtol=1e-5)
    np.testing.assert_allclose(ev["accuracy"], float(acc))


def test_tiny_lm_padding_with_accumulation_is_the_mean_over_counted_tokens():
    """Padded labels (-100), label smoothing, batch 2 x 2 accumulated micro-batches: each step equals torch on
    the 4-sample batch (the micro-batches are weighted by their counted tokens, not by their samples, which
    differ here), and a batch of padding alone leaves SGD's parameters unchanged."""
    g = tiny_lm()
    ids, labels = lm_data()
    labels[0, 1:], labels[1, 1:] = -100, -100  # the first micro-batch counts nothing
    opts = {"labels_from": "labels", "label_smoothing": 0.1}
    tr = rg.Trainer(g, "causal-lm", make_optimizer("sgd", lr=0.5), threads=1, loss_options=opts)
    before = tr.parameters
    tr.step({"input_ids": ids[:2], "labels": labels[:2]})  # nothing counted: loss 0, zero gradient
    assert tr.losses == [0.0]
    for k, v in tr.parameters.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    tr.fit({"input_ids": ids, "labels": labels}, epochs=1, batch_size=2, shuffle=False, progress=False,
           accumulate_steps=2)

    def loss(p, i, y):
        return F.cross_entropy(torch_lm(p, i)[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), label_smoothing=0.1)

    batches = [(torch.tensor(ids[j:j + 4]), torch.tensor(labels[j:j + 4])) for j in (0, 4)]
    want = torch_sgd(g, batches, loss, 0.5)
    for k, v in tr.parameters.items():
        np.testing.assert_allclose(v, want[k], rtol=2e-5, atol=1e-6, err_msg=k)


# ------------------------------------------------------------------------------------------ output:NAME


def test_output_loss_trains_as_pytorch_without_labels():
    rng = np.random.default_rng(6)
    x, t = rng.standard_normal((12, 3)).astype(np.float32), rng.standard_normal(12).astype(np.float32)
    tr = rg.Trainer(own_loss_model(), "output:loss", make_optimizer("sgd", lr=0.1), threads=1)
    assert tr.spec.labels is None and tr.spec.loss.settings == {"kind": "output", "output": "loss"}
    assert "labels" not in {v.name for v in tr.spec.graph.inputs}
    tr.fit({"x": x, "t": t}, epochs=2, batch_size=5, shuffle=False, progress=False)
    w = torch.tensor(own_loss_model().initializers["w"], requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(2):
        for j in range(0, 12, 5):
            opt.zero_grad()
            (((torch.tensor(x[j:j + 5]) @ w).reshape(-1) - torch.tensor(t[j:j + 5])) ** 2).mean().backward()
            opt.step()
    np.testing.assert_allclose(tr.parameters["w"], w.detach().numpy(), rtol=2e-5, atol=1e-7)
    ev = tr.evaluate({"x": x, "t": t}, batch_size=5)  # the mean of the output, weighted by batch sizes
    with torch.no_grad():
        ref = (((torch.tensor(x) @ w).reshape(-1) - torch.tensor(t)) ** 2).mean()
    np.testing.assert_allclose(ev["loss"], float(ref), rtol=1e-5)
    assert ev["accuracy"] is None and ev["samples"] == 12


def test_loss_registry_and_bad_losses():
    assert list(LOSSES)[:5] == ["cross-entropy", "mse", "bce", "causal-lm", "output:NAME"]  # (tests add more)
    cases = [(own_loss_model(), "output:pred", {}, "needs a float scalar output; 'pred' is float32[N]"),
             (own_loss_model(), "output:nope", {}, "has no output 'nope'"),
             (own_loss_model(), "output:", {}, "needs the name"),
             (own_loss_model(), "output:NAME", {}, "no output 'NAME'"),
             (affine_logits((2, 3)), "hinge", {}, "unknown loss 'hinge'"),
             (affine_logits((2, 3)), "mse", {"label_smoothing": 0.1}, "--label-smoothing (label_smoothing=) does not"),
             (affine_logits((2, 3)), "cross-entropy", {"class_weights": [1.0, 2.0]}, "holds 2 weights; the logits"),
             (affine_logits((2, 3)), "cross-entropy", {"class_weights": [1.0, -2.0, 1.0]}, "non-negative"),
             (affine_logits((2, 3)), "cross-entropy", {"label_smoothing": 1.5}, "in [0, 1]"),
             (affine_logits((2, 3)), "causal-lm", {}, "causal-lm needs logits of shape [batch, positions"),
             (affine_logits((2, 4, 3)), "causal-lm", {}, "none named input_ids"),
             (tiny_lm(), "causal-lm", {"labels_from": "ids"}, "--labels-from 'ids': the model has no such input")]
    for g, loss, options, message in cases:
        with pytest.raises(RevgraphError) as info:
            loss_graph(g, loss, **options)
        assert message in str(info.value) and "\n" not in str(info.value), (loss, str(info.value))


def test_bad_targets_are_one_line_errors():
    tr = rg.Trainer(tiny_lm(), "causal-lm", "sgd", threads=1, loss_options={"labels_from": "labels"})
    ids, labels = lm_data(4)
    labels[1, 3] = V
    with pytest.raises(InputError,
                       match=r"target token id 11 in 'labels' is not a class index in \[0, 11\) or the ignore"):
        tr.arrays({"input_ids": ids, "labels": labels})
    with pytest.raises(InputError, match="lacks 'labels'"):
        tr.arrays({"input_ids": ids})
