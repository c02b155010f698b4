"""Batch normalization over the global batch in data-parallel training (``--sync-batchnorm``).

A training-mode ONNX ``BatchNormalization`` (``training_mode=1``, opset 14 and later; older models are
converted to it on load) normalizes with the statistics of the batch it sees. In data-parallel training each
rank sees only its share of the global batch, so without synchronization every rank normalizes over its own
``n_r`` samples, and training differs from one process on the same global batch
(:func:`warn_per_rank_statistics` says so). Its running statistics are then those of rank 0, as
``DistributedDataParallel``'s default ``broadcast_buffers=True`` makes them (:class:`RankZeroStatisticsEngine`).

How a one-process revgraph run treats a training-mode ``BatchNormalization``: its running mean and variance are
float initializers, so they are parameters (``rg.Trainer`` trains every float initializer by default) whose
gradient is zero (the loss does not read them). onnxruntime's kernel writes the updated running statistics
(``running = input * momentum + batch * (1 - momentum)``, the batch's population variance) into the buffers
of its inputs, which are the parameters' buffers, while the grad graph runs; the update graph then applies the
optimizer's zero-gradient step to them (no change, or AdamW's decoupled decay). Evaluation
(:func:`revgraph.train.eval_graph`) normalizes with the running statistics, as ``model.eval()`` does in
PyTorch (:func:`inference_batchnorms`): the same in one process and in many, whatever the evaluation batch.
"""

from __future__ import annotations

import warnings

from .devices import torch_from_ortvalue
from .distributed import DistributedEngine, collective
from .ir import Graph


def training_batchnorms(graph: Graph) -> list[str]:
    """The names (or, for unnamed nodes, the first output) of the ``BatchNormalization`` nodes of ``graph``
    and its subgraphs that run in training mode (a ``training_mode`` attribute of 1), in graph order."""
    found = []
    for _, node in graph.walk():
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") \
                and int(node.attrs.get("training_mode", 0)):
            found.append(node.name or node.outputs[0])
    return found


def inference_batchnorms(graph: Graph) -> list[str]:
    """Turn the top-level training-mode ``BatchNormalization`` nodes of ``graph`` whose running-statistics
    outputs nothing reads into inference mode (in place): they normalize with their ``input_mean`` and
    ``input_var`` and no longer write the running statistics (onnxruntime writes them into the input buffers,
    which would change the parameters while evaluating). Returns the names of the nodes changed."""
    read = {i for _, n in graph.walk() for i in n.inputs} | set(graph.output_names)
    changed = []
    for node in graph.nodes:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") \
                and int(node.attrs.get("training_mode", 0)) and not any(o in read for o in node.outputs[1:] if o):
            node.attrs = {k: v for k, v in node.attrs.items() if k != "training_mode"}
            node.outputs = node.outputs[:1]
            changed.append(node.name or node.outputs[0])
    return changed


def warn_per_rank_statistics(graph: Graph, world_size: int) -> None:
    """Warn (``UserWarning``) when ``graph`` has training-mode ``BatchNormalization`` nodes: in a world of
    ``world_size > 1`` ranks without ``sync_batchnorm`` each rank computes their statistics over its own share
    of the global batch. Call it on rank 0 only."""
    names = training_batchnorms(graph)
    if not names or world_size < 2:
        return
    shown = ", ".join(map(repr, names[:8])) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    warnings.warn(f"BatchNormalization {shown} normalize(s) in training mode: each of the {world_size} processes "
                  "computes the batch statistics and running statistics over its own share of the global batch, so "
                  "training differs from one process on the same global batch; pass --sync-batchnorm "
                  "(Trainer(..., sync_batchnorm=True)) for statistics over the global batch", stacklevel=3)


def running_statistics(graph: Graph, params) -> list[str]:
    """The running mean and variance inputs of ``graph``'s top-level training-mode ``BatchNormalization``
    nodes that are among ``params``, in graph order, each once."""
    names = set(training_batchnorms(graph))
    wanted = set(params)
    found: dict[str, None] = {}
    for node in graph.nodes:
        if node.op_type == "BatchNormalization" and (node.name or node.outputs[0]) in names:
            found.update((i, None) for i in node.inputs[3:5] if i in wanted)
    return list(found)


class RankZeroStatisticsEngine(DistributedEngine):
    """:class:`~revgraph.distributed.DistributedEngine` for a model with training-mode ``BatchNormalization``
    trained without ``sync_batchnorm``: each rank normalizes with its own batch statistics, and after the grad
    graph has written each rank's running statistics into its parameter buffers (module doc), rank 0's are
    broadcast to every rank before the update (``DistributedDataParallel(broadcast_buffers=True)`` broadcasts
    rank 0's buffers before each forward), so the ranks stay replicas.
    Raises :class:`RevgraphError` (one line) when the broadcast fails."""

    def __init__(self, spec, threads, device, comm, runtime=None, one_set: bool = True):
        super().__init__(spec, threads, device, comm, runtime, one_set)
        self.statistics = running_statistics(spec.model, spec.params)

    def _gradients(self, feeds, count, total):
        out = super()._gradients(feeds, count, total)
        torch = self.comm.torch
        views = [torch_from_ortvalue(torch, self.value(p)) for p in self.statistics]
        if views:
            flat = torch.cat([v.reshape(-1) for v in views])  # one broadcast for all of them (one dtype: float)
            with collective("the broadcast of rank 0's running statistics"):
                self.comm.dist.broadcast(flat, 0)
            at = 0
            for v in views:
                v.copy_(flat[at:at + v.numel()].view(v.shape))
                at += v.numel()
        return out


def engine_class(spec, default: type) -> type:
    """The data-parallel engine class for ``spec``: :class:`RankZeroStatisticsEngine` when the model has
    running statistics among the parameters, else ``default``."""
    return RankZeroStatisticsEngine if running_statistics(spec.model, spec.params) else default
