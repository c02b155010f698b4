"""The models of bench/ddp.py, for revgraph (a :class:`revgraph.Graph`) and for PyTorch (an
``nn.Module`` with the same parameter shapes and the same initial values, copied from the graph), and their
data. Every model reads a batch and writes logits for 10 classes; the loss is cross-entropy.

- ``mlp``: the demo MLP, ``revgraph.tools.demo.mlp_model(64)``: ``relu(flatten(x) W1 + b1) W2 + b2`` on the digits
  (8x8 images), 64-64-10.
- ``rnn``: the demo recurrent classifier, ``revgraph.tools.demo.rnn_model(128)`` (the hidden size the demo trains
  with): an ONNX ``Loop`` over the 8 rows of an image, ``h <- tanh(x_t W + h U + b)``, then ``h V + c``. In
  PyTorch the same recurrence as a Python loop over the 8 rows (``nn.RNN`` has two biases, so a different
  parameter set).
- ``embed``: a bag of tokens: a table ``E`` of 2048 x 64 read through ``Gather`` (so revgraph updates it row by
  row, lazily, as ``torch.optim.SparseAdam`` does), the mean over the 16 tokens of a sample, then
  ``pooled W + b``. Data: random token ids (uniform over the vocabulary), label = first token mod 10. In
  PyTorch ``nn.Embedding(sparse=True)`` updated by ``SparseAdam`` and the linear layer by ``Adam``
  (``torch_embed="dense"``: ``nn.Embedding`` with dense gradients and one ``Adam`` over everything).
- ``transformer``: ``nn.TransformerEncoder`` of 2 layers of width 64 (4 heads, feed-forward 256, no dropout,
  batch first) over 16 positions of random vectors, mean over positions, a linear layer; label = the argmax of
  the first vector's first 10 entries. revgraph trains the module's ``torch.onnx.export`` (same initial values).
- ``wide``: an MLP 64-1024-1024-10 on the digits (4.3 MB of parameters: two buckets, the first capped at 1 MiB
  as DDP caps it), exported from ``nn.Sequential`` likewise.
"""

from __future__ import annotations

import numpy as np

MODELS = ("mlp", "rnn", "embed", "transformer", "wide")
MLP_HIDDEN, RNN_HIDDEN, WIDE_HIDDEN = 64, 128, 1024
SEQ, WIDTH, HEADS, LAYERS = 16, 64, 4, 2  # the Transformer encoder
VOCAB, DIM, TOKENS, CLASSES = 2048, 64, 16, 10
DIGITS_TRAIN = 1437  # training images of revgraph.tools.demo.digits()


def describe(name: str) -> str:
    return {"mlp": f"MLP 64-{MLP_HIDDEN}-10 (digits)",
            "rnn": f"RNN, ONNX Loop over 8 rows, hidden {RNN_HIDDEN} (digits)",
            "embed": f"embedding {VOCAB}x{DIM}, {TOKENS} tokens, mean, linear (sparse rows)",
            "transformer": f"Transformer encoder, {LAYERS} layers of width {WIDTH}, {HEADS} heads, feed-forward "
                           f"{4 * WIDTH}, {SEQ} positions, mean, linear (random vectors)",
            "wide": f"wide MLP 64-{WIDE_HIDDEN}-{WIDE_HIDDEN}-10 (digits)"}[name]


def rg_graph(name: str):
    """The model as a revgraph :class:`Graph` (initial values are its initializers)."""
    from revgraph.tools import demo

    if name == "mlp":
        return demo.mlp_model(MLP_HIDDEN)
    if name == "rnn":
        return demo.rnn_model(RNN_HIDDEN)
    if name in ("transformer", "wide"):  # exported from the PyTorch module (same initial values)
        return _exported(name)
    from revgraph.ir import Graph, Node, ValueInfo

    rng = np.random.default_rng(0)
    k = 1 / np.sqrt(DIM)
    inits = {"E": rng.standard_normal((VOCAB, DIM)).astype(np.float32),  # nn.Embedding's N(0, 1)
             "W": rng.uniform(-k, k, (DIM, CLASSES)).astype(np.float32),
             "b": rng.uniform(-k, k, (CLASSES,)).astype(np.float32),
             "axes": np.array([1], np.int64)}
    nodes = [Node("Gather", ["E", "tokens"], ["emb"], {"axis": 0}, "embed/gather"),
             Node("ReduceMean", ["emb", "axes"], ["pooled"], {"keepdims": 0}, "embed/mean"),
             Node("MatMul", ["pooled", "W"], ["mm"], {}, "head/matmul"),
             Node("Add", ["mm", "b"], ["logits"], {}, "head/bias")]
    return Graph(nodes, [ValueInfo("tokens", np.int64, ("N", TOKENS))],
                 [ValueInfo("logits", np.float32, ("N", CLASSES))], inits, name="bag_of_tokens")


def data(name: str, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` training samples ``{input: array, "labels": int64}`` (digits drawn with replacement from the
    demo's training split, or random tokens), the same in every process."""
    rng = np.random.default_rng(seed)
    if name == "transformer":
        x = rng.standard_normal((n, SEQ, WIDTH)).astype(np.float32)
        return {"x": x, "labels": (x[:, 0, :CLASSES].argmax(1)).astype(np.int64)}
    if name == "embed":
        tokens = rng.integers(0, VOCAB, (n, TOKENS), dtype=np.int64)
        return {"tokens": tokens, "labels": tokens[:, 0] % CLASSES}
    from revgraph.tools.demo import digits

    train, _ = digits(0)
    rows = rng.integers(0, len(train["labels"]), n)
    return {"x": np.ascontiguousarray(train["x"][rows]), "labels": train["labels"][rows]}


def _torch_module(name: str):
    """The Transformer encoder or the wide MLP in PyTorch, initialised from ``torch.manual_seed(0)``."""
    import warnings

    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "wide":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, WIDE_HIDDEN), nn.ReLU(), nn.Linear(WIDE_HIDDEN, WIDE_HIDDEN),
                             nn.ReLU(), nn.Linear(WIDE_HIDDEN, CLASSES))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.fc = nn.Linear(WIDTH, CLASSES)

        def forward(self, x):
            return self.fc(self.encoder(x).mean(1))

    return Transformer()


def _exported(name: str):
    """The PyTorch module exported to ONNX (``torch.onnx.export``, TorchScript exporter, training mode, batch
    dimension symbolic) and loaded as a revgraph Graph."""
    import io
    import warnings

    import torch

    import revgraph as rg

    module = _torch_module(name)
    module.train()
    x = torch.zeros((2, SEQ, WIDTH) if name == "transformer" else (2, 8, 8))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buf, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}})
    return rg.load(buf.getvalue())


def torch_model(name: str, torch_embed: str = "sparse"):
    """``(module, optimizers)``: the model in PyTorch with the graph's initial values, and its Adam
    optimizer(s) with PyTorch's defaults (lr 1e-3), as revgraph's ``"adam"``."""
    import torch
    from torch import nn

    if name in ("transformer", "wide"):
        module = _torch_module(name)
        return module, [torch.optim.Adam(module.parameters())]

    g = rg_graph(name)
    p = {k: nn.Parameter(torch.from_numpy(np.array(v))) for k, v in g.initializers.items() if v.dtype.kind == "f"}

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.W1, self.b1, self.W2, self.b2 = p["W1"], p["b1"], p["W2"], p["b2"]

        def forward(self, x):
            h = torch.relu(torch.addmm(self.b1, x.flatten(1), self.W1))
            return torch.addmm(self.b2, h, self.W2)

    class RNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.W, self.U, self.b, self.V, self.c = p["W"], p["U"], p["b"], p["V"], p["c"]

        def forward(self, x):
            h = x.new_zeros(x.shape[0], self.U.shape[0])
            for t in range(x.shape[1]):
                h = torch.tanh(torch.addmm(self.b, x[:, t], self.W) + h @ self.U)
            return torch.addmm(self.c, h, self.V)

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.E = nn.Embedding(VOCAB, DIM, sparse=torch_embed == "sparse", _weight=p["E"].data)
            self.W, self.b = p["W"], p["b"]

        def forward(self, tokens):
            return torch.addmm(self.b, self.E(tokens).mean(1), self.W)

    module = {"mlp": MLP, "rnn": RNN, "embed": Embed}[name]()
    if name == "embed" and torch_embed == "sparse":
        return module, [torch.optim.SparseAdam([module.E.weight]), torch.optim.Adam([module.W, module.b])]
    return module, [torch.optim.Adam(module.parameters())]
