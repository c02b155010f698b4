"""onnxruntime-training's graph builder, timed (runs in its own virtual environment: see envs.py).

:func:`build` times what ``onnxruntime.training.artifacts.generate_artifacts`` does in memory: the
``TrainingBlock`` with the loss block and ``requires_grad`` parameters (onnx checker and shape inference,
ORT's pre-training graph optimisations, its C++ ``GradientGraphBuilder``, the gradient-accumulation nodes
and the eval model), from a parsed ``onnx.ModelProto`` to the training ``ModelProto``; saving is not timed.
:func:`generate` runs ``generate_artifacts`` itself, with files and the AdamW optimizer model, once.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import time
from collections import Counter

import onnx

_MODELS: dict[str, onnx.ModelProto] = {}


def _quiet() -> None:
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    logging.getLogger().setLevel(logging.WARNING)


def versions() -> dict:
    import numpy
    import onnxruntime
    import torch

    return {"onnxruntime-training": onnxruntime.__version__, "onnx": onnx.__version__, "numpy": numpy.__version__,
            "torch": torch.__version__}


def _model(path: str) -> onnx.ModelProto:
    if path not in _MODELS:
        _MODELS[path] = onnx.load(path)
    return _MODELS[path]


def graph_stats(model: onnx.ModelProto) -> dict:
    """Nodes (subgraphs included), initializers, inputs and a histogram of operators."""
    ops: Counter = Counter()
    stack, total = list(model.graph.node), 0
    while stack:
        node = stack.pop()
        total += 1
        ops[node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"] += 1
        for a in node.attribute:
            stack.extend(n for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs) for n in g.node)
    return {"nodes": total, "initializers": len(model.graph.initializer), "inputs": len(model.graph.input),
            "outputs": len(model.graph.output), "ops": dict(ops.most_common())}


def _loss_block(loss_kind: str):
    from onnxruntime.training import onnxblock

    return onnxblock.loss.CrossEntropyLoss() if loss_kind == "cross-entropy" else onnxblock.blocks.PassThrough()


def build(path: str, params: list[str], loss_kind: str, save_to: str | None = None, stats: bool = False) -> dict:
    """One in-memory build; seconds, and the graph's size when ``stats``. ``save_to`` keeps the training model."""
    _quiet()
    from onnxruntime.training import onnxblock

    base = copy.deepcopy(_model(path))
    loss = _loss_block(loss_kind)

    class Block(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.loss = loss

        def build(self, *outputs):
            return self.loss(*outputs)

    t0 = time.perf_counter()
    block = Block()
    for p in params:
        block.requires_grad(p)
    with onnxblock.base(base):
        block(*[o.name for o in base.graph.output])
        training, _eval = block.to_model_proto()
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds}
    if stats:
        out.update(graph_stats(training))
    if save_to:
        onnx.save(training, save_to)
    return out


def generate(path: str, params: list[str], loss_kind: str) -> dict:
    """``generate_artifacts`` as documented (files, checkpoint, AdamW optimizer model), timed once."""
    _quiet()
    from onnxruntime.training import artifacts

    loss = artifacts.LossType.CrossEntropyLoss if loss_kind == "cross-entropy" else None
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        artifacts.generate_artifacts(copy.deepcopy(_model(path)), requires_grad=params, loss=loss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=d)
        seconds = time.perf_counter() - t0
        files = {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)}
    return {"seconds": seconds, "files": files}


def forget(path: str) -> bool:
    _MODELS.pop(path, None)
    return True
