"""The models of bench/run.py, as ONNX files that every framework reads.

- Synthetic graphs for build time: a **chain** ``loss = sum(f_n(...f_2(f_1(x * w))))`` of alternating ``Sin``
  and ``Tanh``, and a **fan-out** where one value ``h = x * w`` feeds ``(n - 1) / 2`` consumers ``h * s_i``
  whose results are added up by a chain of ``Add`` nodes (each consumer has its own scalar ``s_i`` so that no
  common-subexpression elimination can merge them). The gradient is taken with respect to ``w``; ``n`` counts
  every node.
- The onnx wheel's ``light_resnet50.onnx`` and ``light_densenet121.onnx`` with their ``ConstantOfShape``
  weights lifted to initializers (:func:`revgraph.autodiff.lift.lift_constants`) and ``loss = ReduceSum(output)``.
- PyTorch models exported with ``torch.onnx.export(dynamo=False, training=TrainingMode.TRAINING)``:
  an MLP (784-512-512-10, ReLU), a ResNet-style CNN (3x32x32 input, a 3x3 stem and three residual blocks of
  16, 32 and 64 channels with batch norm, global average pooling, a linear layer) and a Transformer encoder
  (2 ``TransformerEncoderLayer`` of width 128, 4 heads, feed-forward 512, no dropout, sequences of 32 vectors,
  mean pooling, a linear layer). Each outputs logits for 10 classes; the loss is cross-entropy, added by each
  framework in its own way (revgraph's ``loss_graph``, onnxruntime-training's ``CrossEntropyLoss`` block,
  ``F.cross_entropy``, and its formula in JAX).
- An RNN ``h_t = tanh(h_{t-1} W + x_t U + b)`` over T = 100 steps (hidden 128, input 32) written as an ONNX
  ``Loop``, then a linear layer to 10 classes on ``h_T``: the same cross-entropy.

The batch size is fixed in each exported file (one file per batch size), so that every framework sees the
same static shapes. Parameters and inputs are written to an ``.npz`` next to the model (parameters under
their initializer names, which are PyTorch's ``state_dict`` names), for JAX and for checks.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np

CLASSES = 10
SEQ, WIDTH = 32, 128
RNN_T, RNN_HIDDEN, RNN_INPUT = 100, 128, 32
TORCH_MODELS = ("mlp", "cnn", "transformer")
STEP_MODELS = ("mlp", "cnn", "transformer", "rnn")


# ------------------------------------------------------------------------------------ synthetic ONNX graphs


def _onnx_model(nodes, inits, name):
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(a, k) for k, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def chain_model(n: int):
    """``n`` nodes: Mul, n - 2 alternating Sin/Tanh, ReduceSum."""
    from onnx import helper

    nodes, prev = [helper.make_node("Mul", ["x", "w"], ["v0"], name="mul")], "v0"
    for i in range(1, n - 1):
        nodes.append(helper.make_node("Sin" if i % 2 else "Tanh", [prev], [f"v{i}"], name=f"n{i}"))
        prev = f"v{i}"
    nodes.append(helper.make_node("ReduceSum", [prev], ["loss"], keepdims=0, name="loss"))
    return _onnx_model(nodes, {"w": np.linspace(0.5, 1.5, 16, dtype=np.float32)}, f"chain{n}")


def fan_out_model(n: int):
    """``n`` nodes: h = Mul(x, w) read by (n - 1) / 2 consumers ``v_i = h * s_i``, joined by a chain of Adds,
    then ReduceSum. (Joining them with one Concat of thousands of inputs instead makes both builders
    superlinear in the Concat's VJP; :func:`concat_model` keeps that case for the profile.)"""
    from onnx import helper

    k = (n - 1) // 2
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"], name="mul")]
    nodes += [helper.make_node("Mul", ["h", f"s{i}"], [f"v{i}"], name=f"n{i}") for i in range(k)]
    prev = "v0"
    for i in range(1, k):
        nodes.append(helper.make_node("Add", [prev, f"v{i}"], [f"a{i}"], name=f"add{i}"))
        prev = f"a{i}"
    nodes.append(helper.make_node("ReduceSum", [prev], ["loss"], keepdims=0, name="loss"))
    inits = {"w": np.linspace(0.5, 1.5, 16, dtype=np.float32)}
    inits.update({f"s{i}": np.array(1.0 + i / k, np.float32) for i in range(k)})
    return _onnx_model(nodes, inits, f"fan{n}")


def concat_model(n: int):
    """``n`` nodes: h = Mul(x, w) read by n - 3 consumers ``h * s_i``, one Concat of them all, ReduceSum."""
    from onnx import helper

    k = n - 3
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"], name="mul")]
    nodes += [helper.make_node("Mul", ["h", f"s{i}"], [f"v{i}"], name=f"n{i}") for i in range(k)]
    nodes.append(helper.make_node("Concat", [f"v{i}" for i in range(k)], ["c"], axis=0, name="concat"))
    nodes.append(helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0, name="loss"))
    inits = {"w": np.linspace(0.5, 1.5, 16, dtype=np.float32)}
    inits.update({f"s{i}": np.array(1.0 + i / k, np.float32) for i in range(k)})
    return _onnx_model(nodes, inits, f"concat{n}")


def write_synthetic(kind: str, n: int, out_dir: str) -> dict:
    import onnx

    path = Path(out_dir) / f"{kind}{n}.onnx"
    if not path.exists():
        make = {"chain": chain_model, "fan": fan_out_model, "concat": concat_model}[kind]
        onnx.save(make(n), str(path))
    return {"path": str(path), "params": ["w"], "loss": "loss", "loss_kind": "output", "nodes": n}


def write_light(name: str, out_dir: str, adapted: bool = False) -> dict:
    """The onnx wheel's light model ``name`` (``resnet50``, ``densenet121``) with lifted weights and a
    ReduceSum loss. ``adapted=True`` is the variant onnxruntime-training can build: two-input ``Sum`` written as
    ``Add`` (it has no gradient for ``Sum``) and the batch-norm running statistics left out of the parameters
    (it has no gradient for them)."""
    import onnx

    import revgraph as rg
    from revgraph.autodiff.lift import lift_constants
    from revgraph.ir import Node, ValueInfo

    tag = "adapted" if adapted else "lifted"
    path = Path(out_dir) / f"{tag}_{name}.onnx"
    meta = path.with_suffix(".json")
    if not (path.exists() and meta.exists()):
        src = Path(onnx.__file__).parent / "backend/test/data/light" / f"light_{name}.onnx"
        g, params = lift_constants(rg.load(src))
        if adapted:
            stats = {n.inputs[i] for n in g.nodes if n.op_type == "BatchNormalization" for i in (3, 4)}
            params = [p for p in params if p not in stats]
            for n in g.nodes:
                if n.op_type == "Sum" and len(n.inputs) == 2:
                    n.op_type = "Add"
        out = g.output_names[0]
        g.nodes.append(Node("ReduceSum", [out], ["loss"], {"keepdims": 0}, "loss"))
        g.outputs = [ValueInfo("loss", np.float32, ())]
        rg.save(g, path)
        meta.write_text(json.dumps({"params": params, "forward_nodes": len(g.nodes)}))
    info = json.loads(meta.read_text())
    return {"path": str(path), "params": info["params"], "loss": "loss", "loss_kind": "output",
            "nodes": info["forward_nodes"]}


def layer_norm_outputs(src: str, dst: str) -> str:
    """``src`` with every ``LayerNormalization`` given its optional ``Mean`` and ``InvStdDev`` outputs (what
    onnxruntime-training's gradient builder needs; ``torch.onnx.export`` writes only the first output)."""
    import onnx

    model = onnx.load(src)
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            while len(node.output) < 3:
                node.output.append(f"{node.name}/extra_output_{len(node.output)}")
    onnx.save(model, dst)
    return dst


# ------------------------------------------------------------------------------------------ PyTorch models


def torch_module(name: str):
    import torch
    from torch import nn

    F = nn.functional

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.l3 = nn.Linear(784, 512), nn.Linear(512, 512), nn.Linear(512, CLASSES)

        def forward(self, x):
            return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)

        def forward(self, x):
            h = F.relu(self.bn1(self.conv1(x)))
            h = self.bn2(self.conv2(h))
            return F.relu(h + (self.down(x) if self.down is not None else x))

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
            self.bn = nn.BatchNorm2d(16)
            self.blocks = nn.ModuleList([Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2)])
            self.fc = nn.Linear(64, CLASSES)

        def forward(self, x):
            h = F.relu(self.bn(self.conv(x)))
            for b in self.blocks:
                h = b(h)
            return self.fc(h.mean((2, 3)))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.fc = nn.Linear(WIDTH, CLASSES)

        def forward(self, x):
            return self.fc(self.encoder(x).mean(1))

    class RNN(nn.Module):
        """The Loop RNN of :func:`rnn_graph`, in eager PyTorch (a Python loop over time)."""

        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.empty(RNN_HIDDEN, RNN_HIDDEN))
            self.U = nn.Parameter(torch.empty(RNN_INPUT, RNN_HIDDEN))
            self.b = nn.Parameter(torch.empty(RNN_HIDDEN))
            self.fc = nn.Linear(RNN_HIDDEN, CLASSES)

        def forward(self, xs):  # xs: [T, B, I]
            h = torch.zeros(xs.shape[1], RNN_HIDDEN)
            for t in range(xs.shape[0]):
                h = torch.tanh(h @ self.W + xs[t] @ self.U + self.b)
            return self.fc(h)

    return {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "rnn": RNN}[name]()


def input_shape(name: str, batch: int) -> tuple[int, ...]:
    return {"mlp": (batch, 784), "cnn": (batch, 3, 32, 32), "transformer": (batch, SEQ, WIDTH),
            "rnn": (RNN_T, batch, RNN_INPUT)}[name]


def batch_data(name: str, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(input_shape(name, batch)).astype(np.float32)
    return {"x": x, "labels": rng.integers(0, CLASSES, batch).astype(np.int64)}


def rnn_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "W": (rng.standard_normal((RNN_HIDDEN, RNN_HIDDEN)) / np.sqrt(RNN_HIDDEN)).astype(np.float32),
        "U": (rng.standard_normal((RNN_INPUT, RNN_HIDDEN)) / np.sqrt(RNN_INPUT)).astype(np.float32),
        "b": np.zeros(RNN_HIDDEN, np.float32),
        "fc.weight": (rng.standard_normal((CLASSES, RNN_HIDDEN)) / np.sqrt(RNN_HIDDEN)).astype(np.float32),
        "fc.bias": np.zeros(CLASSES, np.float32),
    }


def rnn_graph(batch: int, params: dict[str, np.ndarray]):
    """The RNN as a revgraph IR graph: a Loop over the T rows of ``x`` ([T, B, I]), then ``Gemm`` to logits."""
    from revgraph.ir import Graph, Node, ValueInfo

    f32 = np.dtype(np.float32)
    body = Graph(
        [
            Node("Gather", ["x", "i"], ["x_t"], {"axis": 0}, "x_t"),
            Node("MatMul", ["h_in", "W"], ["hw"], name="hw"),
            Node("MatMul", ["x_t", "U"], ["xu"], name="xu"),
            Node("Add", ["hw", "xu"], ["pre0"], name="pre0"),
            Node("Add", ["pre0", "b"], ["pre"], name="pre"),
            Node("Tanh", ["pre"], ["h_out"], name="tanh"),
            Node("Identity", ["cond_in"], ["cond_out"], name="cond"),
        ],
        [ValueInfo("i", np.int64, ()), ValueInfo("cond_in", np.bool_, ()), ValueInfo("h_in", f32, (batch, RNN_HIDDEN))],
        [ValueInfo("cond_out", np.bool_, ()), ValueInfo("h_out", f32, (batch, RNN_HIDDEN))],
        name="rnn_body",
    )
    inits = {**params, "T": np.array(RNN_T, np.int64), "true": np.array(True),
             "h0": np.zeros((batch, RNN_HIDDEN), np.float32)}
    return Graph(
        [Node("Loop", ["T", "true", "h0"], ["h"], {"body": body}, "rnn"),
         Node("Gemm", ["h", "fc.weight", "fc.bias"], ["logits"], {"transB": 1}, "fc")],
        [ValueInfo("x", f32, input_shape("rnn", batch))],
        [ValueInfo("logits", f32, (batch, CLASSES))],
        inits,
    )


def write_step_model(name: str, batch: int, out_dir: str) -> dict:
    """The ONNX file, parameters and one batch of model ``name`` at ``batch``: ``{"path", "npz", "params"}``.

    PyTorch models are exported in training mode with ``do_constant_folding=False`` (as the tests do); the
    RNN is written by revgraph. The npz holds every initializer (PyTorch's ``state_dict``: parameters and
    batch-norm buffers) and the batch (``x``, ``labels``)."""
    path = Path(out_dir) / f"{name}_b{batch}.onnx"
    npz = path.with_suffix(".npz")
    meta = path.with_suffix(".json")
    if path.exists() and npz.exists() and meta.exists():
        return json.loads(meta.read_text())
    data = batch_data(name, batch)
    if name == "rnn":
        import revgraph as rg

        params = rnn_params()
        rg.save(rnn_graph(batch, params), path)
        state, names = params, list(params)
    else:
        import torch

        torch.manual_seed(0)
        module = torch_module(name)
        module.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (torch.from_numpy(data["x"]),), str(path), dynamo=False,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                              input_names=["x"], output_names=["logits"])
        state = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
        names = [k for k, _ in module.named_parameters()]
    np.savez(npz, **{f"param:{k}": v for k, v in state.items()}, **data)
    info = {"path": str(path), "npz": str(npz), "params": names, "model": name, "batch": batch,
            "loss_kind": "cross-entropy"}
    meta.write_text(json.dumps(info))
    return info


def load_npz(npz: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(state, batch)`` from a file of :func:`write_step_model`."""
    with np.load(npz) as f:
        state = {k[6:]: f[k] for k in f.files if k.startswith("param:")}
        data = {k: f[k] for k in f.files if not k.startswith("param:")}
    return state, data


def write_models(out_dir: str, batches=(1, 64)) -> dict:
    """Every step model at every batch size (call in a process with torch)."""
    os.makedirs(out_dir, exist_ok=True)
    return {f"{m}_b{b}": write_step_model(m, b, out_dir) for m in STEP_MODELS for b in batches}
