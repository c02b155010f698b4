"""Padding rows of embedding tables: the rows PyTorch's gradient leaves at zero, masked the same way here.

``nn.Embedding(padding_idx=i)`` (and ``nn.EmbeddingBag``) gives row ``i`` a zero gradient whatever the
cotangent (``torch/nn/functional.py``: "the entries at padding_idx do not contribute to the gradient"); an ONNX
``Gather`` has no such notion, so an exported table's padding row would train. :func:`revgraph.export_torch`
records the rows (``revgraph.torch_padding_rows``, :mod:`revgraph.onnx_io.torch_names`), and the training graph
replaces their gradient by exact zeros (``Where``, not a product: a NaN cotangent stays out too) before clipping
and the update, as in PyTorch: the padding row gets no gradient step and does not count in the clipping norm,
while weight decay and the decay of its moments apply as ``torch.optim`` applies them to a zero gradient.
"""

from __future__ import annotations

import numpy as np

from ..errors import RevgraphError
from ..ir import ValueInfo
from .graphbuild import Builder


def mask_padding_rows(b: Builder, tg, rows: dict[str, list[int]]) -> dict[str, str]:
    """Append to ``b`` the nodes giving each trained table of ``rows`` (``{initializer: [row, ...]}``) its gradient
    with those rows zero, and point ``tg.grads`` at them: a sparse table's ``rows`` (``[K, ...]``) where its
    indices (int64 ``[K]``) name a padding row, a dense gradient's padding rows. Returns ``{old gradient name:
    masked name}``. Raises :class:`RevgraphError` (one line) for a row outside its table."""
    renamed: dict[str, str] = {}
    for p, padding in rows.items():
        if p not in tg.grads:  # (a frozen table: no gradient to mask)
            continue
        table = tg.initial[p]
        bad = [r for r in padding if not 0 <= r < table.shape[0]]
        if table.ndim == 0 or bad:
            raise RevgraphError(f"padding row {bad[0] if bad else padding[0]} of {p!r} (the model's "
                                f"revgraph.torch_padding_rows) is not a row of its table of shape {list(table.shape)}")
        b.prefix = f"train/padding/{p}"
        zero = b.const(0, table.dtype)
        if p in tg.sparse:
            idx, values = tg.grads[p]
            hits = [b.op("Equal", [idx, b.const(r, np.int64)]) for r in padding]
            hit = hits[0] if len(hits) == 1 else _any(b, hits)
            at = b.op("Unsqueeze", [hit, b.const(list(range(1, table.ndim)), np.int64)]) if table.ndim > 1 else hit
            renamed[values] = b.op("Where", [at, zero, values])
            tg.grads[p] = [idx, renamed[values]]
        else:
            (g,) = tg.grads[p]
            mask = np.zeros((table.shape[0],) + (1,) * (table.ndim - 1), bool)
            mask[padding] = True
            renamed[g] = b.op("Where", [b.const(mask, bool), zero, g])
            tg.grads[p] = [renamed[g]]
    return renamed


def _any(b: Builder, tests: list[str]) -> str:
    out = tests[0]
    for t in tests[1:]:
        out = b.op("Or", [out, t])
    return out


def renamed_types(types: list[ValueInfo], renamed: dict[str, str]) -> list[ValueInfo]:
    """The gradients' declared types with the masked names of :func:`mask_padding_rows`."""
    return [ValueInfo(renamed[v.name], v.dtype, v.shape) if v.name in renamed else v for v in types]
