"""Output types of the onnxruntime contrib operators revgraph differentiates, which ONNX's shape inference does
not know (their schemas and inference functions live in onnxruntime, which exports the schemas to Python but
not the inference): without them every value after the first fused node of an optimized model would be
untyped, and the rules that need a rank (``MatMul``, a normalization) would refuse.

The formulas are onnxruntime's (``onnxruntime/core/graph/contrib_ops/bert_defs.cc``, ``contrib_defs.cc``,
``onnx_function_util``; version 1 of each operator): the fused activations and ``BiasAdd`` keep their first
input's type; the skip normalizations give ``output`` and ``input_skip_bias_sum`` the input's type and the
statistics ``mean`` and ``inv_std_var`` float32 of the input's shape with the last axis 1;
``SimplifiedLayerNormalization`` (written in the default domain, though ONNX does not define it) gives ``Y``
the scale's dtype and ``inv_std_var`` the ``stash_type`` dtype with the normalized axes 1; ``FusedMatMul``
follows ``FusedMatMulShapeInference`` (``transBatchA`` moves axis 0 of A to the row axis of the product);
``MatMulNBits`` gives A's shape with the last axis ``N``; ``RotaryEmbedding`` keeps its input's type;
``GroupQueryAttention``, ``MultiHeadAttention`` and ``Attention`` follow their documented shapes (the cache
lengths are run-time values); ``EmbedLayerNormalization`` gives ``[B, S, H]`` and the int32 ``mask_index [B]``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import Dim, Node, ValueInfo

MS = "com.microsoft"

#: ``stash_type`` (an ONNX TensorProto element type) to the dtype of the saved statistics
_STASH = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}


def _first(types: Mapping[str, ValueInfo], node: Node, i: int = 0) -> ValueInfo | None:
    name = node.inputs[i] if len(node.inputs) > i else ""
    return types.get(name) if name else None


def _same(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    x = _first(types, node)
    return {} if x is None else {node.outputs[0]: ValueInfo(node.outputs[0], x.dtype, x.shape)}


def _skip_norm(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    x = _first(types, node)
    if x is None:
        return {}
    kept = None if x.shape is None else (*tuple(x.shape)[:-1], 1)
    kinds = [(x.dtype, x.shape), (np.dtype(np.float32), kept), (np.dtype(np.float32), kept), (x.dtype, x.shape)]
    return {o: ValueInfo(o, dt, shape) for o, (dt, shape) in zip(node.outputs, kinds, strict=False) if o}


def _simplified_norm(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    x, scale = _first(types, node), _first(types, node, 1)
    if x is None:
        return {}
    found = {node.outputs[0]: ValueInfo(node.outputs[0], scale.dtype if scale else None, x.shape)}
    if len(node.outputs) > 1 and node.outputs[1]:
        shape = None
        if x.shape is not None:
            rank, axis = len(x.shape), int(node.attrs.get("axis", -1))
            axis = axis + rank if axis < 0 else axis
            shape = tuple(d if a < axis else 1 for a, d in enumerate(x.shape))
        dtype = _STASH.get(int(node.attrs.get("stash_type", 1)), np.dtype(np.float32))
        found[node.outputs[1]] = ValueInfo(node.outputs[1], dtype, shape)
    return found


def _broadcast(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Multidirectional broadcasting of two batch shapes; a dimension it cannot tell is ``None``."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    return tuple(x if y in (x, 1) else y if x == 1 else None for x, y in zip(a, b, strict=True))


def fused_matmul_perm(rank: int, trans: bool, trans_batch: bool) -> list[int] | None:
    """The permutation that turns a ``FusedMatMul`` operand of ``rank`` into the matrix (batch) it multiplies
    by ``numpy.matmul`` rules: ``transBatch`` moves axis 0 behind the batch axes (to the row axis), ``trans``
    swaps the last two; ``None`` when it is the identity (a vector is never transposed)."""
    if rank < 2 or not (trans or trans_batch):
        return None
    if trans_batch:
        perm = [*range(1, rank - 1), 0, rank - 1]
    else:
        perm = list(range(rank))
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


def _fused_matmul(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    a, b = _first(types, node), _first(types, node, 1)
    if a is None or b is None or a.shape is None or b.shape is None or not a.shape or not b.shape:
        return {}
    shapes = []
    for vi, t, tb in ((a, "transA", "transBatchA"), (b, "transB", "transBatchB")):
        perm = fused_matmul_perm(len(vi.shape), bool(node.attrs.get(t, 0)), bool(node.attrs.get(tb, 0)))
        shapes.append(tuple(vi.shape) if perm is None else tuple(vi.shape[p] for p in perm))
    sa, sb = shapes
    left = (1, *sa) if len(sa) == 1 else sa
    right = (*sb, 1) if len(sb) == 1 else sb
    shape = _broadcast(left[:-2], right[:-2])
    shape += (left[-2],) if len(sa) > 1 else ()
    shape += (right[-1],) if len(sb) > 1 else ()
    out = node.outputs[0]
    return {out: ValueInfo(out, a.dtype, shape)}


def _matmul_nbits(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    """``Y``: A's shape with the last axis ``N``, A's dtype."""
    a = _first(types, node)
    if a is None or "N" not in node.attrs:
        return {}
    shape = None if a.shape is None else (*tuple(a.shape)[:-1], int(node.attrs["N"]))
    return {node.outputs[0]: ValueInfo(node.outputs[0], a.dtype, shape)}


def _gqa(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    """``GroupQueryAttention``: ``output [B, S, Hq*D]``, ``present_key``/``present_value`` ``[B, Hkv, L, D]``
    (``L = max(past, total_sequence_length)``, unknown here), ``output_qk [B, Hq, S, L]``, query's dtype."""
    q = _first(types, node)
    if q is None:
        return {}
    hq, hkv = int(node.attrs.get("num_heads", 0)), int(node.attrs.get("kv_num_heads", 0))
    packed = len(node.inputs) < 2 or not node.inputs[1]
    b = s = d = hidden = None
    if q.shape is not None and len(q.shape) == 3:
        b, s, width = q.shape
        if isinstance(width, int) and hq and hkv:
            d = width // (hq + 2 * hkv) if packed else width // hq
            hidden = hq * d
    shapes = [(b, s, hidden), (b, hkv or None, None, d), (b, hkv or None, None, d), (b, hq or None, s, None)]
    return {o: ValueInfo(o, q.dtype, shape) for o, shape in zip(node.outputs, shapes, strict=False) if o}


def _mha(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    """``MultiHeadAttention``: ``output [B, S, Dv]`` (value's width, or ``N * H`` of a 4-D value), ``present_key``
    and ``present_value`` ``[B, N, T, H]``, ``qk [B, N, S, T]``; ``Attention``: ``output [B, S, Dv]`` (the last of
    ``qkv_hidden_sizes``, or a third of the weights' width), ``present [2, B, N, T, H]``; query's dtype."""
    q = _first(types, node)
    if q is None:
        return {}
    n = int(node.attrs.get("num_heads", 0)) or None
    b = s = None
    if q.shape is not None and len(q.shape) == 3:
        b, s = q.shape[:2]
    if node.op_type == "Attention":
        w = _first(types, node, 1)
        sizes = node.attrs.get("qkv_hidden_sizes")
        width = None
        if sizes:
            width = int(sizes[-1])
        elif w is not None and w.shape is not None and isinstance(w.shape[-1], int):
            width = w.shape[-1] // 3
        h = None if width is None or n is None else width // n
        shapes = [(b, s, width), (2, b, n, None, h)]
    else:
        v = _first(types, node, 2)
        dv = hk = hv = None
        if v is not None and v.shape is not None and n:
            dv = v.shape[-1] if len(v.shape) == 3 else (n * v.shape[-1] if isinstance(v.shape[-1], int) else None)
            hv = None if not isinstance(dv, int) else dv // n
        if q.shape is not None and len(q.shape) == 3 and isinstance(q.shape[-1], int) and n:
            hk = q.shape[-1] // n
        shapes = [(b, s, dv), (b, n, None, hk), (b, n, None, hv), (b, n, s, None)]
    return {o: ValueInfo(o, q.dtype, shape) for o, shape in zip(node.outputs, shapes, strict=False) if o}


def _embed_norm(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    """``EmbedLayerNormalization``: ``output`` and ``embedding_sum`` ``[B, S, H]`` of the word table's dtype,
    ``mask_index [B]`` int32."""
    ids, word = _first(types, node), _first(types, node, 2)
    if ids is None or word is None:
        return {}
    b, s = (None, None) if ids.shape is None or len(ids.shape) != 2 else ids.shape
    h = None if word.shape is None else word.shape[-1]
    kinds = [(word.dtype, (b, s, h)), (np.dtype(np.int32), (b,)), (word.dtype, (b, s, h))]
    return {o: ValueInfo(o, dt, shape) for o, (dt, shape) in zip(node.outputs, kinds, strict=False) if o}


def _ml_rows(node: Node, types: Mapping[str, ValueInfo]) -> tuple[ValueInfo | None, Dim | None]:
    x = _first(types, node)
    if x is None or x.shape is None or len(x.shape) not in (1, 2):
        return x, None
    return x, 1 if len(x.shape) == 1 else x.shape[0]


def _ml_linear(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    """ai.onnx.ml ``LinearClassifier``: ``label [N]`` (int64, or strings), ``scores [N, T]`` float32 (``T`` the
    intercepts' count; 2 for one target with two class labels); ``LinearRegressor``: ``[N, targets]`` float32
    (onnxruntime's linearclassifier.cc, linearregressor.cc; a 1-D input is one row)."""
    x, n = _ml_rows(node, types)
    if x is None:
        return {}
    if node.op_type == "LinearRegressor":
        targets = int(node.attrs.get("targets", 1))
        return {node.outputs[0]: ValueInfo(node.outputs[0], np.dtype(np.float32), (n, targets))}
    t = len(node.attrs.get("intercepts", []))
    strings = node.attrs.get("classlabels_strings")
    labels = len(strings if strings is not None and len(strings) else node.attrs.get("classlabels_ints", []))
    kinds = [(np.dtype(object) if strings is not None and len(strings) else np.dtype(np.int64), (n,)),
             (np.dtype(np.float32), (n, 2 if t == 1 and labels == 2 else t))]
    return {o: ValueInfo(o, dt, shape) for o, (dt, shape) in zip(node.outputs, kinds, strict=False) if o}


def _ml_normalizer(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    """ai.onnx.ml ``Normalizer``: the input's shape, float32 (normalizer.cc)."""
    x = _first(types, node)
    return {} if x is None else {node.outputs[0]: ValueInfo(node.outputs[0], np.dtype(np.float32), x.shape)}


_FORMULAS = {
    ("ai.onnx.ml", "LinearClassifier"): _ml_linear,
    ("ai.onnx.ml", "LinearRegressor"): _ml_linear,
    ("ai.onnx.ml", "Normalizer"): _ml_normalizer,
    (MS, "SkipLayerNormalization"): _skip_norm,
    (MS, "SkipSimplifiedLayerNormalization"): _skip_norm,
    ("", "SimplifiedLayerNormalization"): _simplified_norm,
    (MS, "Gelu"): _same,
    (MS, "BiasGelu"): _same,
    (MS, "FastGelu"): _same,
    (MS, "QuickGelu"): _same,
    (MS, "BiasAdd"): _same,
    (MS, "FusedMatMul"): _fused_matmul,
    (MS, "MatMulNBits"): _matmul_nbits,
    (MS, "RotaryEmbedding"): _same,
    (MS, "GroupQueryAttention"): _gqa,
    (MS, "MultiHeadAttention"): _mha,
    (MS, "Attention"): _mha,
    (MS, "EmbedLayerNormalization"): _embed_norm,
}


def infer(node: Node, types: Mapping[str, ValueInfo]) -> dict[str, ValueInfo]:
    """The output types of a contrib ``node`` of :data:`_FORMULAS` from its inputs' types (``{}`` for another
    operator, or when its first input's type is unknown; unknown dimensions stay ``None``)."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    formula = _FORMULAS.get((domain, node.op_type))
    if formula is None or not node.outputs:
        return {}
    return formula(node, types)
