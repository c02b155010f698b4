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

from dataclasses import dataclass

import numpy as np

from ...errors import RevgraphError
from ...ir import Graph, Node, ValueInfo, fresh_name
from ...onnx_io.value_types import infer_types
from ...warn import warn
from .graph_collectives import all_reduce_node


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
    warn(f"BatchNormalization {shown} normalize(s) in training mode: each of the {world_size} processes "
         "computes the batch statistics and running statistics over its own share of the global batch, so "
         "training differs from one process on the same global batch; pass --sync-batchnorm "
         "(Trainer(..., sync_batchnorm=True)) for statistics over the global batch")


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


# ---------------------------------------------------------------------------------------------- the rewrite


@dataclass
class SyncedBatchNorm:
    """What :func:`rewrite` made of one ``BatchNormalization`` node: its ``name`` and ``channels``; ``sums``,
    the output of the placeholder summing ``[sum d, sum d^2, n]`` (``2 channels + 1`` values, ``d = x -
    shift``) over the ranks; ``shift``, the graph input holding the shift (the running mean's current value,
    fed by the engine); its running-statistics inputs ``running_mean`` and ``running_var``, and ``momentum``
    (a float32 value)."""

    name: str
    channels: int
    sums: str
    shift: str
    running_mean: str
    running_var: str
    momentum: float


def rewrite(graph: Graph) -> tuple[Graph, list[SyncedBatchNorm]]:
    """A copy of ``graph`` with each top-level training-mode ``BatchNormalization`` written as explicit ops
    around an ``AllReduceSum`` placeholder (:mod:`revgraph.train.distributed.graph_collectives`): the statistics over
    the global batch, as ``torch.nn.SyncBatchNorm`` computes them. With ``c`` channels (axis 1), ``axes`` every other
    axis and ``k`` a per-channel shift (a new graph input, ``[c]``; the engine feeds the running mean, the same on
    every rank, so that ``sum d^2`` does not lose the variance to cancellation: the shifted-data algorithm), on
    each rank ``d = x - k`` and ``t = sum_ranks [sum_axes d, sum_axes d^2, n]`` (``n`` the elements per channel,
    a float); ``m = t[:c] / n'``, ``mean = k + m``, ``v = max(t[c:2c] / n' - m^2, 0)`` (``n' = t[2c]``; the
    population variance, as the ONNX operator defines it), ``Y = (d - m) scale (v + epsilon)^(-1/2) + B``. The
    shift is an input, not the running-mean parameter itself, so that no gradient reaches the running mean (in
    exact arithmetic none would; in floats rounding would, and Adam would turn it into steps). The running
    statistics are not written by the graph (the engine writes them from ``t``:
    :class:`revgraph.train.distributed.sync_batchnorm_engine.SyncBatchNormEngine`), so the graph must not read them. The
    placeholder's VJP all-reduces the cotangents of the sums (SyncBatchNorm's backward: ``sum dY`` and ``sum dY
    xh`` over the global batch). One all-reduce forward and one backward per node. Returns the graph and what
    each node became.

    Raises :class:`RevgraphError` for a training-mode ``BatchNormalization`` in a subgraph, one whose running
    statistics outputs are read, or one whose input rank, channel count (the scale's length) or dtype
    (float32, float64) is not known.
    """
    nested = [n for g, n in graph.walk() if g is not graph and n.op_type == "BatchNormalization"
              and int(n.attrs.get("training_mode", 0))]
    if nested:
        raise RevgraphError(f"BatchNormalization {nested[0].name!r} runs in training mode inside a subgraph (Loop, "
                            "If, Scan); --sync-batchnorm synchronizes top-level ones only: train without it")
    g = graph.copy()
    types = infer_types(g)
    read = {i for _, n in g.walk() for i in n.inputs} | set(g.output_names)
    used = g.names_in_use()
    out_nodes: list[Node] = []
    synced = []
    for node in g.nodes:
        if not (node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
                and int(node.attrs.get("training_mode", 0))):
            out_nodes.append(node)
            continue
        name = node.name or node.outputs[0]
        if any(o in read for o in node.outputs[1:] if o):
            raise RevgraphError(f"the graph reads the running statistics BatchNormalization {name!r} writes; "
                                "--sync-batchnorm cannot synchronize it")
        x, scale, bias, mean_in, var_in = node.inputs[:5]
        vi, sv = types.get(x), types.get(scale)
        if vi is None or vi.shape is None or vi.dtype not in (np.float32, np.float64) or sv is None \
                or sv.shape is None or len(sv.shape) != 1 or not isinstance(sv.shape[0], int):
            raise RevgraphError(f"BatchNormalization {name!r}: --sync-batchnorm needs a float32 or float64 input of "
                                f"known rank and a scale of static length (got {vi.describe() if vi else 'unknown'})")
        c = sv.shape[0]
        shift = fresh_name(f"{name}/sync/shift", used)
        g.inputs.append(ValueInfo(shift, vi.dtype, (c,)))
        nodes, sums = _synced(node, name, x, scale, bias, shift, len(vi.shape), c, vi.dtype, used)
        out_nodes += nodes
        g.value_info[sums] = ValueInfo(sums, vi.dtype, (2 * c + 1,))
        synced.append(SyncedBatchNorm(name, c, sums, shift, mean_in, var_in,
                                      float(np.float32(node.attrs.get("momentum", 0.9)))))
    g.nodes = out_nodes
    return g, synced


def _synced(node: Node, name: str, x: str, scale: str, bias: str, shift: str, rank: int, c: int, dt: np.dtype,
            used: set[str]) -> tuple[list[Node], str]:
    """The nodes of one synchronized batch normalization (:func:`rewrite`), writing ``node.outputs[0]``, and
    the name of the all-reduced sums."""
    nodes: list[Node] = []

    def op(op_type: str, inputs: list[str], **attrs) -> str:
        out = fresh_name(f"{name}/sync/{op_type}", used)
        nodes.append(Node(op_type, inputs, [out], attrs, out))
        return out

    def const(value, dtype) -> str:
        return op("Constant", [], value=np.asarray(value, dtype=dtype))

    def part(start: int, stop: int) -> str:
        return op("Slice", [sums, const([start], np.int64), const([stop], np.int64)])

    axes = const([0, *range(2, rank)], np.int64)
    channel = const([1, c, *[1] * (rank - 2)], np.int64)  # a [C] vector broadcast along axis 1
    d = op("Sub", [x, op("Reshape", [op("CastLike", [shift, x]), channel])])
    # the elements per channel on this rank (0 on a rank without samples), as a float [1]
    n = op("Cast", [op("Div", [op("Size", [x]), const(c, np.int64)])], to=1 if dt == np.float32 else 11)
    t = op("Concat", [op("ReduceSum", [d, axes], keepdims=0), op("ReduceSum", [op("Mul", [d, d]), axes], keepdims=0),
                      op("Reshape", [n, const([1], np.int64)])], axis=0)
    sums = fresh_name(f"{name}/sync/sums", used)
    nodes.append(all_reduce_node(t, sums, fresh_name(f"{name}/sync/AllReduceSum", used), 2 * c + 1, batchnorm=name))
    total = part(2 * c, 2 * c + 1)
    m = op("Div", [part(0, c), total])
    var = op("Max", [op("Sub", [op("Div", [part(c, 2 * c), total]), op("Mul", [m, m])]), const(0.0, dt)])
    eps = const(float(np.float32(node.attrs.get("epsilon", 1e-5))), dt)
    inv = op("Reciprocal", [op("Sqrt", [op("Add", [var, eps])])])
    k = op("Reshape", [op("Mul", [inv, op("CastLike", [scale, x])]), channel])  # (scale and B may be of another dtype)
    xc = op("Sub", [d, op("Reshape", [m, channel])])
    y = op("Add", [op("Mul", [xc, k]), op("Reshape", [op("CastLike", [bias, x]), channel])])
    nodes.append(Node("Identity", [y], [node.outputs[0]], {}, fresh_name(f"{name}/sync/output", used)))
    return nodes, sums


def synchronized(model) -> tuple[Graph, Graph, list[SyncedBatchNorm]]:
    """``(the model, the model rewritten by :func:`rewrite`, what each BatchNormalization became)`` for a
    :class:`~revgraph.ir.Graph`, ``onnx.ModelProto`` or path (loaded and put in SSA form first); the model
    itself twice and ``[]`` when it has no training-mode ``BatchNormalization``."""
    from ...ir.ssa import is_ssa, to_ssa
    from ...onnx_io import load

    g = model if isinstance(model, Graph) else load(model)
    g = g if is_ssa(g) else to_ssa(g)
    if not training_batchnorms(g):
        return g, g, []
    rewritten, synced = rewrite(g)
    return g, rewritten, synced
