"""``nn.Embedding(padding_idx=i)``: PyTorch never gives row i a gradient; ``rg.export_torch`` records the row
(``revgraph.torch_padding_rows``) and the training graph masks it, so a full fine-tune equals PyTorch's with the
padding row in the batches: AdamW with weight decay and clipping, SGD with momentum, both buffer layouts, and
the record of a transformers BERT (whose word embeddings pad at ``pad_token_id``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.training import assert_params_close

import revgraph as rg
from revgraph import train as T
from revgraph.onnx_io.torch_names import PADDING_ROWS


class Pooled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8, padding_idx=1)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)).mean(1))


def _data():
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 12, (24, 5))
    ids[:, -1] = 1  # every sequence ends with the padding id (rows 12..19 are never read)
    return ids, rng.integers(0, 3, 24)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    module = Pooled()
    with torch.no_grad():  # (nn.Embedding zeroes the padding row; a pretrained table's need not be zero)
        module.emb.weight[1] = torch.linspace(-1, 1, 8)
    path = tmp_path_factory.mktemp("pad") / "m.onnx"
    rg.export_torch(module, (torch.zeros(2, 5, dtype=torch.int64),), path,
                    dynamic_shapes={"ids": {0: torch.export.Dim("batch")}})
    return module, path


def _torch_run(module, make_opt, clip, steps, batch=8):
    ids, labels = _data()
    m = Pooled()
    m.load_state_dict(module.state_dict())
    opt = make_opt(list(m.parameters()))
    losses = []
    for k in range(steps):
        s = (k * batch) % len(ids)
        opt.zero_grad()
        loss = F.cross_entropy(m(torch.tensor(ids[s:s + batch])), torch.tensor(labels[s:s + batch]))
        loss.backward()
        assert float(m.emb.weight.grad[1].abs().max()) == 0  # (torch's padding row: no gradient)
        if clip:
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), clip)
        opt.step()
        losses.append(float(loss))
    return {k: v.detach().numpy() for k, v in m.state_dict().items()}, losses


@pytest.mark.parametrize(("kind", "buffers", "clip"), [("adamw", "one", 0.5), ("adamw", "two", None),
                                                       ("sgd", "one", None)])
def test_the_padding_row_trains_as_in_pytorch(exported, kind, buffers, clip):
    module, path = exported
    assert json.loads(rg.load(path).metadata[PADDING_ROWS]) == {"emb.weight": [1]}
    if kind == "adamw":
        opt, make = T.adamw(lr=0.05, weight_decay=0.1, no_decay="none"), \
            lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1)
    else:
        opt, make = T.sgd(lr=0.2, momentum=0.9, weight_decay=0.01, no_decay="none"), \
            lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, weight_decay=0.01)
    trainer = rg.Trainer(path, "cross-entropy", opt, clip_grad_norm=clip, buffers=buffers)
    ids, labels = _data()
    trainer.fit({"ids": ids, "labels": labels}, batch_size=8, shuffle=False, max_steps=9, progress=False)
    ref, losses = _torch_run(module, make, clip, 9)
    np.testing.assert_allclose(trainer.losses, losses, rtol=1e-5)
    assert_params_close({k: trainer.parameters[k] for k in ref}, ref, rtol=1e-5)
    if kind == "adamw":  # the padding row moved by the decoupled weight decay only: (1 - lr wd)^9
        before = module.emb.weight.detach().numpy()[1]
        np.testing.assert_allclose(trainer.parameters["emb.weight"][1], before * (1 - 0.05 * 0.1) ** 9, rtol=1e-6)


def test_without_the_record_the_padding_row_trains(exported, tmp_path):
    """The same file without revgraph.torch_padding_rows (a plain exporter's): row 1 gets its Gather gradient,
    so the run is not PyTorch's (the record is what makes it so)."""
    module, path = exported
    g = rg.load(path)
    del g.metadata[PADDING_ROWS]
    trainer = rg.Trainer(g, "cross-entropy", T.sgd(lr=0.2))
    ids, labels = _data()
    trainer.fit({"ids": ids, "labels": labels}, batch_size=8, shuffle=False, max_steps=3, progress=False)
    ref, _ = _torch_run(module, lambda p: torch.optim.SGD(p, lr=0.2), None, 3)
    assert np.abs(trainer.parameters["emb.weight"][1] - ref["emb.weight"][1]).max() > 1e-4
    np.testing.assert_array_equal(ref["emb.weight"][1], module.emb.weight.detach().numpy()[1])


@pytest.mark.parametrize("value", ['{"emb.weight": [20]}', '{"emb.weight": []}', '[1]', '{"emb.weight": [-1]}'])
def test_a_bad_record_is_one_line(exported, value):
    _, path = exported
    g = rg.load(path)
    g.metadata[PADDING_ROWS] = value
    with pytest.raises(rg.RevgraphError, match="torch_padding_rows") as info:
        rg.Trainer(g, "cross-entropy", "sgd")
    assert "\n" not in str(info.value)


def test_bert_records_its_word_embeddings_padding_row(tmp_path):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, pad_token_id=3)
    module = BertModel(config).eval()
    rg.export_torch(module, (torch.ones(2, 6, dtype=torch.int64),), tmp_path / "bert.onnx")
    rows = json.loads(rg.load(tmp_path / "bert.onnx").metadata[PADDING_ROWS])
    assert rows == {"embeddings.word_embeddings.weight": [3]}
