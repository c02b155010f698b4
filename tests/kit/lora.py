"""LoRA for tests: a model with every kind of LoRA target, PEFT's LoRA ``Linear`` in PyTorch, running a model on
onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import revgraph as rg

F32 = np.float32
RANK, ALPHA = 4, 8.0


def mixed_model(seed: int = 0) -> rg.Graph:
    """x [N, 8] through every kind of LoRA target: MatMul of a weight, Gemm(transB=1, alpha, beta) with a bias,
    MatMul of a DequantizeLinear int8 base, Gemm(transA=1) and MatMul of a Transpose'd weight: y [N, 6]."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(0, 0.5, s).astype(F32)
    inits = {"W1": f(8, 16), "W2": f(12, 16), "b2": f(12), "q3": rng.integers(-100, 100, (12, 6)).astype(np.int8),
             "s3": np.array(0.01, F32), "z3": np.array(3, np.int8), "W4": f(12, 6), "W5": f(6, 12)}
    nodes = [h.make_node("MatMul", ["x", "W1"], ["h1"], name="mm1"), h.make_node("Relu", ["h1"], ["r1"], name="relu"),
             h.make_node("Gemm", ["r1", "W2", "b2"], ["h2"], transB=1, alpha=0.7, beta=0.5, name="gemm2"),
             h.make_node("Tanh", ["h2"], ["r2"], name="tanh"),
             h.make_node("DequantizeLinear", ["q3", "s3", "z3"], ["w3"], name="dq3"),
             h.make_node("MatMul", ["r2", "w3"], ["h3"], name="mm3"),
             h.make_node("Transpose", ["r2"], ["t"], perm=[1, 0], name="tr"),
             h.make_node("Gemm", ["t", "W4"], ["h4"], transA=1, name="gemm4"),
             h.make_node("Transpose", ["W5"], ["w5t"], perm=[1, 0], name="tr5"),
             h.make_node("MatMul", ["r2", "w5t"], ["h5"], name="mm5"), h.make_node("Sum", ["h3", "h4", "h5"], ["y"])]
    g = h.make_graph(nodes, "mixed", [h.make_tensor_value_info("x", T.FLOAT, ["N", 8])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 6])],
                     [nh.from_array(v, k) for k, v in inits.items()])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    return rg.load(model)


class LoraLinear(torch.nn.Module):
    """PEFT's LoRA ``Linear`` (peft.tuners.lora.layer.Linear.forward): a frozen ``base`` ``nn.Linear`` plus
    ``scaling * lora_B(lora_A(dropout(x)))`` with ``lora_A = nn.Linear(in, r)``, ``lora_B = nn.Linear(r, out)``
    (no bias, dropout 0). ``weight`` is ``[out, in]`` as PyTorch stores it; ``A`` ``[in, r]``, ``B`` ``[r, out]``
    are revgraph's adapters (the transposes of ``lora_A.weight``, ``lora_B.weight``)."""

    def __init__(self, weight, bias, A, B, scaling):
        super().__init__()
        out_f, in_f = weight.shape
        self.base = torch.nn.Linear(in_f, out_f, bias=bias is not None, dtype=torch.float64)
        self.base.weight = torch.nn.Parameter(torch.as_tensor(np.asarray(weight, np.float64)), requires_grad=False)
        if bias is not None:
            self.base.bias = torch.nn.Parameter(torch.as_tensor(np.asarray(bias, np.float64)), requires_grad=False)
        self.lora_A = torch.nn.Linear(in_f, A.shape[1], bias=False, dtype=torch.float64)
        self.lora_B = torch.nn.Linear(A.shape[1], out_f, bias=False, dtype=torch.float64)
        self.lora_A.weight = torch.nn.Parameter(torch.as_tensor(np.asarray(A, np.float64).T.copy()))
        self.lora_B.weight = torch.nn.Parameter(torch.as_tensor(np.asarray(B, np.float64).T.copy()))
        self.scaling = scaling

    def forward(self, x):
        return self.base(x) + self.scaling * self.lora_B(self.lora_A(x))


def run(g: rg.Graph, x: np.ndarray, optimized: bool = True) -> np.ndarray:
    """``y`` by onnxruntime; ``optimized=False`` turns its graph optimizations off (its CPU fusion of
    DequantizeLinear + MatMul quantizes the activations: 6e-3 off on the base mixed model)."""
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return rg.Session(g, session_options=options).run({"x": x})["y"]
