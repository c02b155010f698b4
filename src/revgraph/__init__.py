"""revgraph: the backward pass of a static dataflow graph, as another graph.

Reverse-mode automatic differentiation done ahead of time on ONNX models and on graphs built with
revgraph's IR. See DESIGN.md for the contract and the architecture.
"""

from .autodiff import SparseGrad, backward, gradient, hessian, hvp, jacobian, jvp
from .autodiff.memory import Budget, MemoryPlan, plan_memory, saved_bytes
from .errors import GraphError, InputError, RevgraphError, UnsupportedModelError
from .ir import TARGET_OPSET, Graph, Node, ValueInfo
from .ir.ssa import analyze as analyze_ssa
from .ir.ssa import is_ssa, to_ssa
from .onnx_io import load, save, to_onnx
from .runtime import Session
from .runtime.options import RuntimeOptions
from .tools.check import GradientReport, check_gradients
from .train import lora  # (rg.lora.add_adapters, merge_adapters, extract, apply)
from .train.trainer import Trainer  # (rg.Trainer: training with the graphs of revgraph.train)
from .version import __version__ as __version__

__all__ = [
    "TARGET_OPSET",
    "Budget",
    "GradientReport",
    "Graph",
    "GraphError",
    "InputError",
    "MemoryPlan",
    "Node",
    "RevgraphError",
    "RuntimeOptions",
    "Session",
    "SparseGrad",
    "Trainer",
    "UnsupportedModelError",
    "ValueInfo",
    "analyze_ssa",
    "backward",
    "check_gradients",
    "export_torch",
    "gradient",
    "hessian",
    "hvp",
    "is_ssa",
    "jacobian",
    "jvp",
    "load",
    "lora",
    "plan_memory",
    "save",
    "saved_bytes",
    "to_onnx",
    "to_ssa",
]


def __getattr__(name: str):
    """``revgraph.export_torch``, imported when asked for (it imports PyTorch when called)."""
    if name == "export_torch":
        from .onnx_io.torch_export import export_torch

        return export_torch
    raise AttributeError(f"module 'revgraph' has no attribute {name!r}")
