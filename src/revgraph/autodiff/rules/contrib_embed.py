"""VJP of onnxruntime's ``com.microsoft`` ``EmbedLayerNormalization``, BERT's embeddings fused by the transformer
optimizer (onnxruntime docs/ContribOperators.md; the CPU kernel ``contrib_ops/cpu/bert/embed_layer_norm.cc`` and
``embed_layer_norm_helper.cc``). The forward keeps the node, which onnxruntime runs; the VJP is standard ONNX
operators.

``EmbedLayerNormalization(input_ids, segment_ids?, word_embedding, position_embedding, segment_embedding?,
gamma, beta, mask?, position_ids?)``: ``s = word[input_ids] + position[p] + segment[segment_ids]`` with ``p =
position_ids`` (``[B, S]`` or ``[1, S]``) or the token's index ``t``; ``output = LayerNormalization(s) * gamma +
beta`` over the last axis with ``epsilon`` (default 1e-12). ``embedding_sum`` is ``s`` (the segment's row
included), ``mask_index`` the number of ones in each row of ``mask`` (zeros without one), an integer output.
Checked against onnxruntime 1.32 in tests/test_contrib_llm_ops.py.

The VJP of the normalization is the default-domain ``LayerNormalization`` rule's (rules/norm.py) on ``s`` (the
node's ``embedding_sum`` output when the model keeps it, else rebuilt from the tables), plus ``embedding_sum``'s
own cotangent; each table receives those rows at its indices as a sparse gradient (Gather's), repeated indices
accumulating; gamma and beta theirs.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ...ir import Node
from ...ir.contrib_types import MS
from ..algebra import Val, name_of
from ..context import Ctx
from ..registry import RULES, vjp
from ..sparse import SparseGrad
from ._common import dim, f32_attr, flat_indices, optional_input, padded


def _rebuilt_sum(ctx: Ctx, node: Node, positions: str) -> str:
    """``s`` in the backward graph from the tables (module doc)."""
    e = ctx.e
    ids, seg = node.inputs[0], optional_input(node, 1)
    word, pos, seg_table = node.inputs[2], node.inputs[3], optional_input(node, 4)
    s = e.op("Add", [e.op("Gather", [word, ids], axis=0), e.op("Gather", [pos, positions], axis=0)])
    if seg is not None and seg_table is not None:
        s = e.op("Add", [s, e.op("Gather", [seg_table, seg], axis=0)])
    return s


@vjp("EmbedLayerNormalization", domain=MS, bounded=True, finite=True, reads="all", mixing=True)
def embed_layer_normalization(ctx: Ctx, node: Node, cts: list) -> list:
    """``com.microsoft.EmbedLayerNormalization`` (module doc)."""
    e = ctx.e
    g_out, _, g_sum = padded(cts, 3)
    ids, seg = node.inputs[0], optional_input(node, 1)
    word, pos_table, seg_table = node.inputs[2], node.inputs[3], optional_input(node, 4)
    gamma, beta = node.inputs[5], node.inputs[6]
    pos_ids = optional_input(node, 8)
    kept = padded(node.outputs, 3)[2] or None

    @cache
    def positions() -> str:
        """The position of each token: ``position_ids`` (``[B, S]`` or ``[1, S]``), or ``[1, S]`` of ``t``."""
        if pos_ids is not None:
            return pos_ids
        r = e.op("Range", [e.const(np.int64(0)), dim(e, ids, 1), e.const(np.int64(1))])
        return e.op("Unsqueeze", [r, e.ints([0])])

    @cache
    def inner() -> list | None:
        if g_out is None:
            return None
        s = kept or _rebuilt_sum(ctx, node, positions())
        ln = Node("LayerNormalization", [s, gamma, beta], [node.outputs[0]],
                  {"axis": -1, "epsilon": f32_attr(node, "epsilon", 1e-12)}, name=node.name)
        return RULES["LayerNormalization"](ctx, ln, [g_out])

    @cache
    def ds() -> Val:
        parts = [] if inner() is None else [ctx.val(name_of(inner()[0]()))]
        if g_sum is not None:
            parts.append(ctx.val(g_sum))
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]

    def rows(indices: str, table: str) -> SparseGrad:
        """``ds``'s rows added to ``table`` at ``indices`` (``[B, S]``, or ``[1, S]``: the batch's rows summed)."""
        d = ds()
        d1 = e.dims(indices)
        if d1 is None or d1[0] != 1:
            values = d.reshape(e.op("Concat", [e.ints([-1]), e.op("Shape", [d.name], start=2)], axis=0))
        else:  # one row of positions for the whole batch
            values = d.sum([0], keepdims=0)
        return SparseGrad(flat_indices(e, indices, dim(e, table, 0)), values.name, table)

    def norm_grad(i: int):
        return None if inner() is None else inner()[i]()

    grads = [None, None, lambda: rows(ids, word), lambda: rows(positions(), pos_table),
             None if seg is None or seg_table is None else lambda: rows(seg, seg_table),
             lambda: norm_grad(1) if g_out is not None else e.zeros_like(gamma),
             lambda: norm_grad(2) if g_out is not None else e.zeros_like(beta),
             None, None]  # mask, position_ids: integers
    return grads[:len(node.inputs)]
