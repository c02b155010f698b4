"""Models exported from PyTorch with torch.onnx.export in training mode: the gradient of the exported loss with
respect to every parameter agrees with torch.autograd on the same inputs (float32, rtol 1e-4)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch

import revgraph as rg

F = torch.nn.functional


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.l2(torch.relu(self.l1(x))), y)


class SmallResNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.c2, self.b2 = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4)
        self.c3 = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(h + self.b2(self.c2(h)))
        h = F.max_pool2d(torch.relu(self.c3(h)), 2)
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1)), y)


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x, mask, y):
        return F.cross_entropy(self.fc(self.enc(x, src_key_padding_mask=mask).mean(1)), y)


class Recurrent(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn, self.fc = getattr(torch.nn, kind)(5, 6, batch_first=True), torch.nn.Linear(6, 3)

    def forward(self, x, y):
        out, _ = self.rnn(x)
        return F.cross_entropy(self.fc(out[:, -1]), y)


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag, self.fc = torch.nn.EmbeddingBag(10, 4, mode="mean"), torch.nn.Linear(4, 3)

    def forward(self, idx, offsets, y):
        return F.cross_entropy(self.fc(self.bag(idx, offsets)), y)


def _cases():
    g = torch.Generator().manual_seed(0)
    y = torch.tensor([0, 2, 1])
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    return {
        "mlp": (MLP, (torch.randn(3, 4, generator=g), y)),
        "resnet_bn": (SmallResNet, (torch.randn(3, 3, 8, 8, generator=g), y)),
        "transformer_masked": (Encoder, (torch.randn(3, 5, 8, generator=g), mask, y)),
        "lstm": (lambda: Recurrent("LSTM"), (torch.randn(3, 4, 5, generator=g), y)),
        "gru": (lambda: Recurrent("GRU"), (torch.randn(3, 4, 5, generator=g), y)),
        "embedding_bag": (Bag, (torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 5]), y)),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_exported_model_gradients_match_torch(name, tmp_path):
    make, args = _cases()[name]
    torch.manual_seed(1)
    model = make()
    path = tmp_path / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    params = dict(model.named_parameters())
    loss = model(*args)
    expected = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))

    g = rg.load(path)
    missing = [p for p in params if p not in g.initializers]
    assert not missing, f"parameters not exported under their names: {missing}"
    gg = rg.gradient(g, loss=g.output_names[0], wrt=list(params))
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    feeds = {vi.name: a.numpy() for vi, a in zip(g.inputs, args, strict=True)}
    out = rg.Session(gg).run(feeds)
    np.testing.assert_allclose(out[g.output_names[0]], loss.detach().numpy(), rtol=1e-5)
    grads = dict(zip(params, gg.output_names[len(g.outputs):], strict=True))
    for p, t in expected.items():
        np.testing.assert_allclose(out[grads[p]], t.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"{name}: {p}")
