"""Devices for tests: the marks of GPU-only tests (what is missing here), tolerances of GPU against CPU runs, and
training on the command line with ``--device``."""

from __future__ import annotations

try:  # before onnxruntime: a CUDA torch loads the CUDA and cuDNN libraries that onnxruntime-gpu needs
    import torch
except ImportError:
    torch = None

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.tools import demo

F32 = np.float32
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def embedding_model(seed: int = 0) -> Graph:
    """ids int64 ``[N, 4]`` -> rows of ``E`` [20, 8] (``Gather``: a sparse gradient) -> mean -> 3 classes."""
    rng = np.random.default_rng(seed)
    inits = {"E": rng.standard_normal((20, 8)).astype(F32), "W": (rng.standard_normal((8, 3)) / 3).astype(F32),
             "b": np.zeros(3, F32), "axis1": np.array([1], np.int64)}
    nodes = [Node("Gather", ["E", "x"], ["emb"], {"axis": 0}, "embed"),
             Node("ReduceMean", ["emb", "axis1"], ["pooled"], {"keepdims": 0}, "pool"),
             Node("Gemm", ["pooled", "W", "b"], ["logits"], {}, "head")]
    return Graph(nodes, [ValueInfo("x", np.int64, ("N", 4))], [ValueInfo("logits", F32, ("N", 3))], inits,
                 name="embedding")


def model_and_data(name: str, samples: int = 97) -> tuple[Graph, dict[str, np.ndarray]]:
    """The demo MLP on digits, or :func:`embedding_model` on random ids (repeated rows), with ``samples`` samples."""
    if name == "embedding":
        rng = np.random.default_rng(1)
        return embedding_model(), {"x": rng.integers(0, 10, (samples, 4)).astype(np.int64),
                                   "labels": rng.integers(0, 3, samples)}
    train, _ = demo.digits()
    return demo.mlp_model(hidden=32), {"x": train["x"][:samples], "labels": train["labels"][:samples]}


def cuda_missing() -> str | None:
    """Why onnxruntime cannot run on a GPU here, or None when it can (a session on cuda:0 is tried)."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (it has "
                f"{', '.join(ort.get_available_providers())}): needs onnxruntime-gpu (revgraph[cuda]) and a GPU")
    try:
        rg.Session(demo.mlp_model(hidden=4), device="cuda")
    except rg.RevgraphError as exc:
        return f"onnxruntime-gpu is installed but cannot run on cuda:0: {exc}"
    return None


def torch_cuda_missing(gpus: int) -> str | None:
    """Why torch cannot hold buffers on ``gpus`` GPUs here (NCCL wants one GPU per process), or None."""
    if torch is None:
        return "needs torch (revgraph[distributed]): training on the device shares buffers with torch"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU (a CPU build of torch, or no GPU)"
    if torch.cuda.device_count() < gpus:
        return f"needs {gpus} GPUs, one per NCCL process; torch sees {torch.cuda.device_count()}"
    return None


CUDA_MISSING = cuda_missing()


def on_gpu(torch_gpus: int = 0) -> list:
    """The marks of a GPU-only test: ``cuda``, and a skip saying what is missing unless onnxruntime runs on a
    GPU here (and, with ``torch_gpus``, a CUDA torch sees that many GPUs)."""
    reason = CUDA_MISSING or (torch_cuda_missing(torch_gpus) if torch_gpus else None)
    return [pytest.mark.cuda, pytest.mark.skipif(reason is not None, reason=reason or "")]


def gpu_test(fn=None, *, torch_gpus: int = 0):
    """Decorator applying :func:`on_gpu`'s marks."""
    def apply(f):
        for mark in reversed(on_gpu(torch_gpus)):
            f = mark(f)
        return f
    return apply(fn) if fn is not None else apply


def tolerance(optimizer: str) -> dict:
    """``assert_allclose``'s tolerances of a GPU run's weights against the CPU's, trained with ``optimizer``."""
    # GPU reductions add in another order than the CPU's; Adam divides by sqrt(v) and so magnifies tiny
    # gradient differences more than SGD does.
    return {"rtol": 1e-4, "atol": 1e-6} if optimizer == "sgd" else {"rtol": 1e-3, "atol": 2e-5}


def train_cli(tmp: Path, name: str, out: str, *extra: str) -> dict[str, np.ndarray]:
    """``revgraph train`` (2 epochs, ``extra`` options) of :func:`model_and_data`'s ``name`` in ``tmp``: the weights."""
    g, data = model_and_data(name)
    rg.save(g, tmp / f"{name}.onnx")
    np.savez(tmp / f"{name}.npz", **data)
    cmd = [sys.executable, "-m", "revgraph", "train", str(tmp / f"{name}.onnx"), "--data", str(tmp / f"{name}.npz"),
           "--loss", "cross-entropy", "--epochs", "2", "--seed", "3", "-o", str(tmp / out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return rg.load(tmp / out).initializers
