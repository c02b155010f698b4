"""The fused linear cross-entropy (issue 42, item 1: revgraph.train.chunked_loss, ``chunk_tokens``,
``--loss-chunk``): the output projection and the loss computed together, chunk by chunk of tokens.

Against the unchunked loss graph (loss and every parameter's gradient, float32, 1e-6), against PyTorch
(``F.cross_entropy`` with ignore_index, label_smoothing and weight, float64) and against float64 central
differences; on a Gather + MatMul (+ bias) language model, a Gemm head and a tiny transformers LLaMA exported by
``rg.export_torch``; chunk sizes that divide the tokens, that do not (a short last chunk) and that hold them all.
The backward keeps nothing vocabulary-sized (``saved_bytes``), training steps equal the unchunked ones, "auto"
chooses under a memory budget, and bad values are one-line refusals (exit 2 on the command line)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.harness import one_line_error

import revgraph as rg
from revgraph.autodiff.memory import Budget, residual_sizes
from revgraph.autodiff.policies import PerLoop, Recompute
from revgraph.cli import main
from revgraph.errors import RevgraphError
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.runtime import Session
from revgraph.train import run_record
from revgraph.train.graphs import params_as_inputs, split_step, training_graph
from revgraph.train.losses import loss_graph

V, D, B, T = 13, 6, 3, 7
N = B * T  # the tokens: 21
WEIGHTS = np.linspace(0.25, 2.0, V)
OPTIONS = {"plain": {}, "ignore": {"ignore_index": -100}, "smooth": {"label_smoothing": 0.15},
           "weights": {"class_weights": WEIGHTS},
           "all": {"ignore_index": -100, "label_smoothing": 0.2, "class_weights": WEIGHTS}}
CHUNKS = [3, 4, N, 64]  # divides 21, leaves a chunk of 1, exactly one chunk, more than the tokens


def lm(dtype=np.float32, bias: bool = True, transposed: bool = True, vocab: int = V) -> Graph:
    """ids int64 [B, T] -> Gather(emb) -> Tanh -> MatMul(h, Transpose(w [V, D])) (+ b) -> logits [B, T, V]."""
    rng = np.random.default_rng(0)
    inits = {"emb": rng.standard_normal((vocab, D)), "w": rng.standard_normal((vocab, D) if transposed else (D, vocab))}
    nodes = [Node("Gather", ["emb", "ids"], ["h0"], {"axis": 0}, "embed"), Node("Tanh", ["h0"], ["h"], {}, "tanh")]
    w = "w"
    if transposed:
        nodes.append(Node("Transpose", ["w"], ["wt"], {"perm": [1, 0]}, "transpose"))
        w = "wt"
    nodes.append(Node("MatMul", ["h", w], ["logits"], {}, "head"))
    if bias:
        inits["b"] = rng.standard_normal(vocab)
        nodes[-1].outputs = ["mm"]
        nodes.append(Node("Add", ["mm", "b"], ["logits"], {}, "bias"))
    inits = {k: v.astype(dtype) for k, v in inits.items()}
    return Graph(nodes, [ValueInfo("ids", np.int64, ("B", "T"))], [ValueInfo("logits", dtype, ("B", "T", vocab))],
                 inits, name="lm")


def gemm_lm(dtype=np.float32) -> Graph:
    """ids int64 [N] -> Gather(emb) -> Gemm(h, w [V, D], b, transB=1, alpha=0.7) -> logits [N, V]."""
    rng = np.random.default_rng(1)
    inits = {k: v.astype(dtype) for k, v in {"emb": rng.standard_normal((V, D)), "w": rng.standard_normal((V, D)),
                                             "b": rng.standard_normal(V)}.items()}
    nodes = [Node("Gather", ["emb", "ids"], ["h"], {"axis": 0}, "embed"),
             Node("Gemm", ["h", "w", "b"], ["logits"], {"transB": 1, "alpha": 0.7}, "head")]
    return Graph(nodes, [ValueInfo("ids", np.int64, ("N",))], [ValueInfo("logits", dtype, ("N", V))], inits, name="g")


def data(shape=(B, T)) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels (a fifth of the labels the ignored index -100)."""
    rng = np.random.default_rng(2)
    ids = rng.integers(0, V, shape).astype(np.int64)
    labels = np.where(rng.random(shape) < 0.2, -100, rng.integers(0, V, shape)).astype(np.int64)
    return ids, labels


def grads(g: Graph, loss: str, labels: np.ndarray | None, ids: np.ndarray, **options) -> tuple[dict, object]:
    """The loss and every parameter's gradient (``loss_graph`` + ``rg.gradient``, a chunk loop recomputed as
    ``training_graph`` does); ``(values by name, spec)``."""
    lg, spec = loss_graph(g, loss, **options)
    params = list(g.initializers)
    params_as_inputs(lg, params)
    lg.outputs = lg.outputs[:1]
    policy = PerLoop(Recompute(), dict.fromkeys(spec.recompute, Recompute())) if spec.recompute else "store"
    gg = rg.gradient(lg, spec.loss, params, checkpoint=policy)
    feeds = {"ids": ids, **g.initializers}
    if spec.labels:
        feeds[spec.labels] = labels
    out = Session(gg).run(feeds)
    return {"loss": out[spec.loss], **{p: out[f"{p}_grad"] for p in params}}, spec


def torch_reference(g: Graph, loss: str, ids, labels, options: dict) -> dict:
    """The same loss and gradients in PyTorch (float64): ``F.cross_entropy`` of the logits."""
    p = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in g.initializers.items()}
    h = torch.tanh(p["emb"][torch.as_tensor(ids)])
    logits = h @ p["w"].T + p["b"]
    kw = {"ignore_index": options.get("ignore_index", -100), "label_smoothing": options.get("label_smoothing", 0.0),
          "weight": None if options.get("class_weights") is None else torch.tensor(options["class_weights"])}
    if loss == "causal-lm":
        out = F.cross_entropy(logits[:, :-1].reshape(-1, V), torch.as_tensor(ids)[:, 1:].reshape(-1), **kw)
    else:
        out = F.cross_entropy(logits.reshape(-1, V), torch.as_tensor(labels).reshape(-1), **kw)
    out.backward()
    return {"loss": out.detach().numpy(), **{k: v.grad.numpy() for k, v in p.items()}}


def close(got: dict, want: dict, rtol: float, atol: float, what: str) -> None:
    for k, value in want.items():
        np.testing.assert_allclose(got[k], value, rtol=rtol, atol=atol, err_msg=f"{what}: {k}")


@pytest.mark.parametrize("loss", ["cross-entropy", "causal-lm"])
@pytest.mark.parametrize("opts", list(OPTIONS))
def test_chunked_equals_unchunked_and_pytorch(loss, opts):
    """float32: every chunk size's loss and gradients equal the unchunked graph's to 1e-6; float64: PyTorch's."""
    options = OPTIONS[opts]
    ids, labels = data()
    if "ignore_index" not in options:  # (cross-entropy counts every label then: no -100 among them)
        labels = np.where(labels < 0, 0, labels)
    whole, spec = grads(lm(), loss, labels, ids, **options)
    assert not spec.recompute and "chunk_tokens" not in spec.settings
    for c in CHUNKS:
        got, spec = grads(lm(), loss, labels, ids, chunk_tokens=c, **options)
        assert spec.settings["chunk_tokens"] == c and len(spec.recompute) == 1
        close(got, whole, 1e-6, 1e-6, f"chunk {c}")
    want = torch_reference(lm(np.float64), loss, ids, labels, options)
    got, _ = grads(lm(np.float64), loss, labels, ids, chunk_tokens=4, **options)
    close(got, want, 1e-10, 1e-12, "float64 against PyTorch")


def test_gemm_head_and_untransposed_matmul():
    """A Gemm head (transB, alpha, bias) on [N, V] logits and a MatMul of an untransposed [D, V] weight without
    bias: chunked equal to unchunked (float32), and the Gemm's float64 loss equal to PyTorch's."""
    ids, labels = data((N,))
    labels = np.where(labels < 0, 0, labels)
    whole, _ = grads(gemm_lm(), "cross-entropy", labels, ids, label_smoothing=0.1)
    for c in (5, N, 100):
        got, spec = grads(gemm_lm(), "cross-entropy", labels, ids, label_smoothing=0.1, chunk_tokens=c)
        assert spec.recompute
        close(got, whole, 1e-6, 1e-6, f"Gemm, chunk {c}")
    g64 = gemm_lm(np.float64)
    got, _ = grads(g64, "cross-entropy", labels, ids, label_smoothing=0.1, chunk_tokens=5)
    p = {k: torch.tensor(v, requires_grad=True) for k, v in g64.initializers.items()}
    alpha = float(np.float32(0.7))  # (an ONNX float attribute is a float32)
    out = F.cross_entropy(alpha * p["emb"][torch.as_tensor(ids)] @ p["w"].T + p["b"], torch.as_tensor(labels),
                          label_smoothing=0.1)
    out.backward()
    close(got, {"loss": out.detach().numpy(), **{k: v.grad.numpy() for k, v in p.items()}}, 1e-10, 1e-12, "Gemm")
    ids2, _ = data()
    plain = lm(bias=False, transposed=False)
    whole, _ = grads(plain, "causal-lm", None, ids2)
    got, _ = grads(plain, "causal-lm", None, ids2, chunk_tokens=8)
    close(got, whole, 1e-6, 1e-6, "MatMul without bias")


def sliced_lm(axes: list[int] | None, starts=(0,), ends=(-1,), dtype=np.float32) -> Graph:
    """:func:`lm` whose logits are a ``Slice`` of the projection's (``logits[:, :-1]`` as PyTorch's exporter
    writes a causal LM's shifted logits), over ``axes`` (``None``: the input left out); a second Slice of the
    whole batch (axis 0) before it."""
    g = lm(dtype)
    g.nodes[-1].outputs = ["full"]
    ints = {"s": starts, "e": ends, "z": [0], "big": [2**62], "a0": [0], **({} if axes is None else {"ax": axes})}
    g.nodes += [Node("Constant", [], [k], {"value": np.array(v, np.int64)}, k)
                for k, v in ints.items()]  # (constants, not initializers: those are the parameters here)
    g.nodes.append(Node("Slice", ["full", "z", "big", "a0"], ["whole"], {}, "batch_slice"))
    g.nodes.append(Node("Slice", ["whole", "s", "e", *([] if axes is None else ["ax"])], ["logits"], {}, "shift"))
    g.outputs = [ValueInfo("logits", dtype, ("B", None, V))]
    return g


@pytest.mark.parametrize("axes", [[1], [-2]])
def test_sliced_logits_are_chunked(axes):
    """Logits sliced over token axes after the projection (axis 1 or -2, after a whole-batch Slice over axis 0):
    the Slices move before the projection, and the chunked loss and gradients equal the unchunked ones (float32,
    1e-6) and PyTorch's ``F.cross_entropy(logits[:, :-1])`` (float64); "auto" chunks them under a budget."""
    ids, labels = data()
    labels = labels[:, :-1]
    opts = {"ignore_index": -100, "label_smoothing": 0.1}
    whole, _ = grads(sliced_lm(axes), "cross-entropy", labels, ids, **opts)
    for c in (4, 7, 64):
        got, spec = grads(sliced_lm(axes), "cross-entropy", labels, ids, chunk_tokens=c, **opts)
        assert spec.settings["chunk_tokens"] == c
        close(got, whole, 1e-6, 1e-6, f"sliced {axes}, chunk {c}")
    g64 = sliced_lm(axes, dtype=np.float64)
    got, _ = grads(g64, "cross-entropy", labels, ids, chunk_tokens=4, **opts)
    p = {k: torch.tensor(v, requires_grad=True) for k, v in g64.initializers.items() if k in ("emb", "w", "b")}
    logits = torch.tanh(p["emb"][torch.as_tensor(ids)]) @ p["w"].T + p["b"]
    out = F.cross_entropy(logits[:, :-1].reshape(-1, V), torch.as_tensor(labels).reshape(-1), **opts)
    out.backward()
    close(got, {"loss": out.detach().numpy(), **{k: v.grad.numpy() for k, v in p.items()}}, 1e-10, 1e-12, "torch")
    _, spec = loss_graph(sliced_lm(axes), "cross-entropy", memory=Budget(fraction=0.5, dims={"B": 64, "T": 64}))
    # Liger's rule: N D / V = 64 * 64 * 6 / 13 = 1890 tokens, the power of two above: 2048 (< N = 4096)
    assert spec.settings["chunk_tokens"] == 2048 and spec.recompute


def test_slice_without_axes_takes_the_leading_axes():
    """A Slice with no axes input slices its first len(starts) axes (here the batch, logits[:-1]): a token axis,
    so chunked, equal to the unchunked loss and gradients (float32, 1e-6)."""
    ids, labels = data()
    labels = labels[:-1]
    whole, _ = grads(sliced_lm(None), "cross-entropy", labels, ids, ignore_index=-100)
    got, spec = grads(sliced_lm(None), "cross-entropy", labels, ids, ignore_index=-100, chunk_tokens=4)
    assert spec.settings["chunk_tokens"] == 4 and whole["loss"].shape == ()
    close(got, whole, 1e-6, 1e-6, "Slice without axes")


def test_slice_of_the_class_axis_is_not_chunked():
    """A Slice of the class axis (given as -1 or 2), or whose axes are no constant, is not a token slice: a given
    chunk size is refused in one line naming the Slice node, "auto" computes the whole logits."""
    for axes in ([2], [-1], [1, 2]):
        g = sliced_lm(axes, starts=[0] * len(axes), ends=[-1] * len(axes))
        with pytest.raises(RevgraphError, match=r"node 'shift' \(Slice\), a Slice of the class axis") as e:
            loss_graph(g, "cross-entropy", chunk_tokens=4)
        assert "\n" not in str(e.value)
        _, spec = loss_graph(g, "cross-entropy", memory=0.5)
        assert not spec.recompute
    g = sliced_lm([1])
    g.nodes.insert(0, Node("Shape", ["ids"], ["dyn"], {"start": 1, "end": 2}, "dyn_axes"))
    g.nodes[-1].inputs[3] = "dyn"
    with pytest.raises(RevgraphError, match=r"node 'shift' \(Slice\), a Slice whose axes are not constants"):
        loss_graph(g, "cross-entropy", chunk_tokens=4)


def test_central_differences_float64():
    """The chunked loss's gradient (every option at once, a short last chunk) against float64 central
    differences of the same graph's loss along random directions of every parameter."""
    g = lm(np.float64)
    ids, labels = data()
    options = {"ignore_index": -100, "label_smoothing": 0.2, "class_weights": WEIGHTS, "chunk_tokens": 4}
    got, spec = grads(g, "cross-entropy", labels, ids, **options)
    lg, _ = loss_graph(g, "cross-entropy", **options)
    params_as_inputs(lg, list(g.initializers))
    sess = Session(lg)

    def loss_at(params):
        return float(sess.run({"ids": ids, spec.labels: labels, **params}, [spec.loss])[spec.loss])
    rng = np.random.default_rng(3)
    for _ in range(3):
        d = {k: rng.standard_normal(v.shape) for k, v in g.initializers.items()}
        eps = 1e-6
        up = loss_at({k: v + eps * d[k] for k, v in g.initializers.items()})
        down = loss_at({k: v - eps * d[k] for k, v in g.initializers.items()})
        directional = sum(float(np.sum(got[k] * d[k])) for k in d)
        assert abs((up - down) / (2 * eps) - directional) <= 1e-7 * max(1.0, abs(directional))


def kept_bytes(tg, ids: np.ndarray) -> int:
    """The bytes of the training step's residuals (``residual_sizes``: the forward values its backward reads),
    measured: the step run with them as outputs; less a [D, V] one (the transposed head weight, which the chunk
    loop reads: weight-sized, whatever the tokens)."""
    g = tg.graph.copy()
    names = list(residual_sizes(g))
    g.outputs = [*g.outputs, *(ValueInfo(n) for n in names if n not in g.output_names)]
    values = Session(g).run({"ids": ids, **tg.initial_state()}, names)
    return sum(np.asarray(values[n]).nbytes for n in names if np.shape(values[n]) != (D, tg.initial["w"].shape[0]))


def test_backward_keeps_nothing_vocabulary_sized():
    """The training step's residuals at vocabulary 4000: the unchunked step keeps at least the [N, V]
    log-softmax; the chunked one, under the Trainer's default ``store`` and under ``sqrt``, keeps less than a
    tenth of one [N, V] tensor in all (besides the transposed weight), and its graph computes no whole logits (the
    head's MatMul and bias are gone, the chunk loop stacks nothing)."""
    vocab = 4000
    g = lm(vocab=vocab)
    ids = np.random.default_rng(6).integers(0, vocab, (B, T)).astype(np.int64)
    logits_bytes = N * vocab * 4
    assert kept_bytes(training_graph(g, "causal-lm", "adam"), ids) >= logits_bytes
    for checkpoint in ("store", "sqrt"):
        tg = training_graph(g, "causal-lm", "adam", checkpoint=checkpoint, loss_options={"chunk_tokens": 5})
        assert kept_bytes(tg, ids) < logits_bytes / 10, checkpoint
        assert not [n for n in tg.graph.nodes if n.name in ("head", "bias")]
        loop = next(n for n in tg.graph.nodes if n.name == tg.loss.recompute[0])
        assert len(loop.outputs) <= 2  # the chunks' sums (and the trip count the backward loop reads)


def test_trainer_steps_auto_and_evaluation():
    """Three Adam steps with chunk_tokens equal the unchunked ones; evaluation is unchunked and equal; "auto"
    chunks under a fraction budget (C = the power of two >= max(N D / V, 256) for N = 64 x 64 symbolic tokens)
    and a byte budget (C = the largest power of two with C V 4 <= M / 16), not without one; the setting is in the
    run record."""
    ids, _ = data()
    batches = [data()[0][:, ::-1].copy(), ids, (ids + 1) % V]
    trained = {}
    for name, kw in {"off": {}, "chunked": {"loss_options": {"chunk_tokens": 4}},
                     "auto": {"memory": Budget(bytes=4000, dims={"B": B, "T": T})}}.items():
        tr = rg.Trainer(lm(), "causal-lm", "adam", threads=1, **kw)
        losses = [tr.step({"ids": x}) for x in batches]
        trained[name] = (tr, losses, dict(tr.parameters))
    assert "chunk_tokens" not in trained["off"][0].spec.loss.settings
    assert run_record.record(trained["chunked"][0].spec)["loss"]["chunk_tokens"] == 4
    # 21 x 13 x 4 > 4000 / 4; 4000 / 16 / (13 x 4) = 4.8 -> 4
    assert trained["auto"][0].spec.loss.settings["chunk_tokens"] == 4
    for name in ("chunked", "auto"):
        np.testing.assert_allclose(trained[name][1], trained["off"][1], rtol=1e-6)
        close(trained[name][2], trained["off"][2], 1e-5, 1e-6, name)
    ev = [trained[k][0].evaluate({"ids": ids}, batch_size=2)["loss"] for k in ("off", "chunked")]
    assert ev[0] == pytest.approx(ev[1], rel=1e-6)
    fraction = rg.Trainer(lm(), "causal-lm", "adam", memory=0.5)
    n_est = 64 * 64
    want = 1 << int(np.ceil(np.log2(max(n_est * D / V, 256))))
    assert fraction.spec.loss.settings["chunk_tokens"] == want
    assert "chunk_tokens" not in rg.Trainer(lm(), "causal-lm", "adam", memory=1.0).spec.loss.settings


def affine() -> Graph:
    """logits = z * s + b: no projection to chunk."""
    nodes = [Node("Mul", ["z", "s"], ["zs"], {}, "scale"), Node("Add", ["zs", "b"], ["logits"], {}, "shift")]
    return Graph(nodes, [ValueInfo("z", np.float32, ("N", V))], [ValueInfo("logits", np.float32, ("N", V))],
                 {"s": np.ones(V, np.float32), "b": np.zeros(V, np.float32)}, name="affine")


def test_refusals_and_fallback():
    """Bad values and a chunk_tokens on logits no projection makes are one-line errors naming the value or the
    node; "auto" under a budget falls back to the whole logits silently; mse takes no chunk_tokens."""
    for bad in (0, -3, 1.5, "x", True, 2**63, [4]):
        with pytest.raises(RevgraphError, match="chunk_tokens") as e:
            loss_graph(lm(), "causal-lm", chunk_tokens=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(RevgraphError, match="node 'scale' \\(Mul\\)"):
        loss_graph(affine(), "cross-entropy", chunk_tokens=4)
    with pytest.raises(RevgraphError, match=r"--loss-chunk .* does not apply to --loss mse"):
        loss_graph(lm(), "mse", chunk_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = rg.Trainer(affine(), "cross-entropy", "adam", memory=0.5)
    assert not tr.spec.loss.recompute and "chunk_tokens" not in tr.spec.loss.settings
    two = lm()  # the logits read by another node too: computed whole anyway
    two.nodes.append(Node("Exp", ["logits"], ["p"], {}, "probs"))
    two.outputs.append(ValueInfo("p", np.float32, ("B", "T", V)))
    with pytest.raises(RevgraphError, match="also read by node 'probs'"):
        loss_graph(two, "causal-lm", output="logits", chunk_tokens=4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny transformers LLaMA (vocabulary 64, hidden 32, one layer) exported by rg.export_torch, and the
    module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class LogitsOnly(LlamaForCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    torch.manual_seed(0)
    m = LogitsOnly(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                               tie_word_embeddings=False, attn_implementation="eager")).eval()
    path = tmp_path_factory.mktemp("llama") / "llama.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rg.export_torch(m, (torch.randint(0, 64, (2, 8)),), path, input_names=["input_ids"], output_names=["logits"],
                        dynamic_shapes=({0: torch.export.Dim("B"), 1: torch.export.Dim("T", max=32)},))
    return rg.load(path), m


def dense(tg, p: str, out: dict) -> np.ndarray:
    """Parameter ``p``'s gradient, its rows added into a dense array where it is sparse (an embedding table)."""
    if len(tg.grads[p]) == 1:
        return out[tg.grads[p][0]]
    full = np.zeros_like(tg.initial[p])
    np.add.at(full, out[tg.grads[p][0]], out[tg.grads[p][1]])
    return full


def test_llama_exported_from_transformers(llama):
    """The exported LLaMA's lm_head (MatMul of a Transpose of the [V, D] weight) is chunked: the training graph's
    loss and every gradient equal the unchunked ones (1e-6) and PyTorch's (float32, 1e-5), for chunks of 5 and
    16 of the 2 x 9 tokens, with ignored positions and label smoothing."""
    g, m = llama
    ids = np.random.default_rng(4).integers(0, 64, (2, 9)).astype(np.int64)
    labels = ids.copy()
    labels[0, :3] = -100
    options = {"labels_from": "labels", "label_smoothing": 0.1}

    def run(**extra):
        tg = training_graph(g, "causal-lm", "adam", freeze=["*inv_freq"], loss_options={**options, **extra})
        gg, _ = split_step(tg)
        out = Session(gg).run({"input_ids": ids, tg.labels: labels, **{p: tg.initial[p] for p in tg.params}})
        return {"loss": out[gg.outputs[0].name], **{p: dense(tg, p, out) for p in tg.params}}, tg
    whole, _ = run()
    for c in (5, 16):
        got, tg = run(chunk_tokens=c)
        assert tg.loss.settings["chunk_tokens"] == c
        close(got, whole, 1e-6, 1e-6, f"LLaMA, chunk {c}")
    m.zero_grad()
    x = torch.as_tensor(ids)
    out = F.cross_entropy(m(x)[:, :-1].reshape(-1, 64), torch.as_tensor(labels)[:, 1:].reshape(-1),
                          label_smoothing=0.1)
    out.backward()
    names = dict(m.named_parameters())
    want = {"loss": out.detach().numpy(), **{p: names[p].grad.numpy() for p in tg.params if p in names}}
    close(got, want, 1e-5, 1e-5, "LLaMA against PyTorch")


def test_cli_loss_chunk(tmp_path, capsys, monkeypatch):
    """``revgraph train --loss-chunk C`` trains the weights of the unchunked run (1e-5); bad values, a loss
    without classes and logits no projection makes exit 2 with one line, naming the option or the node."""
    monkeypatch.setenv("COLUMNS", "250")
    rg.save(lm(), tmp_path / "lm.onnx")
    ids = np.random.default_rng(5).integers(0, V, (12, T)).astype(np.int64)
    np.savez(tmp_path / "d.npz", ids=ids)
    base = ["train", str(tmp_path / "lm.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "causal-lm",
            "--optimizer", "adam", "--lr", "0.01", "--epochs", "2", "--batch-size", "4", "--no-shuffle"]
    assert main([*base, "-o", str(tmp_path / "a.onnx")]) == 0
    assert main([*base, "--loss-chunk", "5", "-o", str(tmp_path / "b.onnx")]) == 0
    capsys.readouterr()
    a, b = rg.load(tmp_path / "a.onnx").initializers, rg.load(tmp_path / "b.onnx").initializers
    close(b, a, 1e-5, 1e-6, "--loss-chunk 5")
    for value, words in (("0", "from 1 to"), ("abc", "'auto' or 'off'"), ("-4", "from 1 to")):
        code = main([*base, "--loss-chunk", value, "-o", str(tmp_path / "c.onnx")])
        one_line_error(code, capsys.readouterr().err, "--loss-chunk", words)
    rg.save(affine(), tmp_path / "affine.onnx")
    np.savez(tmp_path / "z.npz", z=np.zeros((4, V), np.float32), labels=np.zeros(4, np.int64))
    code = main(["train", str(tmp_path / "affine.onnx"), "--data", str(tmp_path / "z.npz"), "--loss", "cross-entropy",
                 "--epochs", "1", "--loss-chunk", "2", "-o", str(tmp_path / "c.onnx")])
    one_line_error(code, capsys.readouterr().err, "--loss-chunk 2", "node 'scale'")
    np.savez(tmp_path / "y.npz", z=np.zeros((4, V), np.float32), labels=np.zeros((4, V), np.float32))
    code = main(["train", str(tmp_path / "affine.onnx"), "--data", str(tmp_path / "y.npz"), "--loss", "mse",
                 "--epochs", "1", "--loss-chunk", "2", "-o", str(tmp_path / "c.onnx")])
    one_line_error(code, capsys.readouterr().err, "--loss-chunk", "does not apply to --loss mse")
    assert not (tmp_path / "c.onnx").exists()
