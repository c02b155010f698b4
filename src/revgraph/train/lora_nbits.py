"""LoRA on ``com.microsoft.MatMulNBits``, the 2/4/8-bit block-quantized linear layer of onnxruntime's quantizer and
onnxruntime-genai's model builder (``/model/layers.0/attn/qkv_proj/MatMul_Q4``): the sites :mod:`.lora` adapts
beside ``MatMul``/``Gemm``, and the merge of their adapters.

``MatMulNBits(x, B, scales, zero_points, g_idx, bias)`` computes ``y = x W^T (+ bias)`` with ``W`` ``[N, K]``
dequantized block by block from the packed integers ``B`` ``[N, blocks, blob]`` (onnxruntime's
docs/ContribOperators.md). The packed weight is a frozen base (QLoRA, Dettmers et al. 2023): the adapters add
``scaling (x A) B`` with ``A`` ``[K, r]`` and ``B`` ``[r, N]`` in the activation's dtype (the scales' dtype, which
the operator requires to equal the activation's), written by the same ``MatMul``/``Mul``/``Add`` nodes as a
``MatMul`` site's. The adapter's ``weight`` is the packed initializer ``B``; ``in``/``out`` are the attributes
``K``/``N``; ``transposed`` is true (``W`` is stored ``[N, K]``).

Merging. ``W + scaling A^T B^T`` cannot be written back into 4-bit blocks without rounding the update away (the
step of a block is its scale, and an update is much smaller), so a merge writes a float weight: each adapted
``MatMulNBits`` becomes ``MatMul(x, <weight>.merged)`` (then ``Add`` of its bias, if it has one) with
``<weight>.merged`` ``[K, N]`` the dequantized weight, computed by onnxruntime's own kernel, plus the update. The
merged model is a float model of the same outputs (to float32 rounding), 8 (int4) times the size of the packed
weights it replaces; keep the adapters separate (no ``--merge-adapters``) to keep the int4 file.
"""

from __future__ import annotations

import numpy as np

from ..errors import RevgraphError
from ..ir import Graph, Node, ValueInfo, fresh_name

#: The operator, as ``(domain, op_type)``.
OP = ("com.microsoft", "MatMulNBits")


def is_nbits(node: Node) -> bool:
    """Whether ``node`` is a ``com.microsoft.MatMulNBits``."""
    return (node.domain, node.op_type) == OP


def site(graph: Graph, node: Node) -> tuple[str, tuple, tuple[int, int], np.dtype | None] | None:
    """``(weight, stored shape, (K, N), float dtype)`` of the ``MatMulNBits`` ``node`` when its packed weight (input
    1) is an initializer and ``K``/``N`` are given, else ``None`` (a weight computed at run time is not adapted).
    The float dtype is the scales' (input 2), which the operator requires to be the activation's."""
    if len(node.inputs) < 3 or node.inputs[1] not in graph.initializers:
        return None
    k, n = node.attrs.get("K"), node.attrs.get("N")
    if not isinstance(k, (int, np.integer)) or not isinstance(n, (int, np.integer)) or k < 1 or n < 1:
        return None
    scales = graph.type_of(node.inputs[2])
    dtype = scales.dtype if scales is not None and scales.dtype is not None else None
    return node.inputs[1], tuple(np.asarray(graph.initializers[node.inputs[1]]).shape), (int(k), int(n)), dtype


def dequantized(graph: Graph, node: Node) -> np.ndarray:
    """The weight ``W^T`` ``[K, N]`` of the ``MatMulNBits`` ``node`` as onnxruntime computes it: the node (without
    its bias, at ``accuracy_level`` 0, which multiplies in float) applied to the identity ``[K, K]``. Raises
    :class:`RevgraphError` (one line naming the node) when its scales or zero points are not initializers."""
    from ..runtime import Session

    inputs = [i for i in node.inputs[1:5] if i]
    missing = [i for i in inputs if i not in graph.initializers]
    if missing:
        raise RevgraphError(f"cannot merge LoRA adapters into {node.label()}: its input {missing[0]!r} is not an "
                            "initializer; keep the adapters separate (no --merge-adapters / --merge)")
    k = int(node.attrs["K"])
    dtype = np.asarray(graph.initializers[node.inputs[2]]).dtype
    copy = node.copy()
    copy.inputs = ["eye", *node.inputs[1:5]]
    copy.attrs = {**copy.attrs, "accuracy_level": 0}
    copy.outputs = ["w"]
    small = Graph(nodes=[copy], inputs=[ValueInfo("eye", dtype, (k, k))],
                  outputs=[ValueInfo("w", dtype, (k, int(node.attrs["N"])))],
                  initializers={i: graph.initializers[i] for i in inputs}, opsets=dict(graph.opsets))
    return np.asarray(Session(small).run({"eye": np.eye(k, dtype=dtype)}, ["w"])["w"])


def merge(g: Graph, sites: list[Node], weight: str, delta: np.ndarray, used) -> None:
    """Replace the ``MatMulNBits`` ``sites`` of ``weight`` in ``g`` (in place) by ``MatMul`` of a float
    ``<weight>.merged`` ``[K, N]`` = dequantized weight + ``delta`` (module doc), keeping each node's output
    name; a bias (input 5) is added by an ``Add`` after it."""
    merged = fresh_name(f"{weight}.merged", used)
    w = dequantized(g, sites[0])
    g.initializers[merged] = (w.astype(np.float64) + delta).astype(w.dtype)
    nodes = []
    for n in g.nodes:
        if not any(n is s for s in sites):
            nodes.append(n)
            continue
        bias = n.inputs[5] if len(n.inputs) > 5 and n.inputs[5] else None
        out = n.outputs[0]
        mid = fresh_name(f"{out}.nobias", used) if bias else out
        nodes.append(Node("MatMul", [n.inputs[0], merged], [mid], {}, n.name))
        if bias:
            nodes.append(Node("Add", [mid, bias], [out], {}, fresh_name(f"{n.name}/bias", used)))
    g.nodes = nodes
