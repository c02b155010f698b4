"""Helpers every rule family shares, in one spelling: attributes as the runtimes read them and optional inputs.
(The algebra rules write their formulas in is :mod:`revgraph.autodiff.algebra`; constant tables are in
:mod:`.tables`.) No rule family imports another family's private names (tests/test_architecture.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...ir import Node

if TYPE_CHECKING:
    from ..algebra import Val
    from ..emitter import Emitter


def f32_attr(node: Node, name: str, default: float) -> float:
    """A float attribute as the runtimes see it: ONNX float attributes are 32-bit, so the derivative must use the
    rounded value the forward used."""
    return float(np.float32(node.attrs.get(name, default)))


def optional_input(node: Node, i: int) -> str | None:
    """The name of ``node``'s input ``i``, or ``None`` when it is absent or empty (an omitted optional input)."""
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i] else None


# ---- geometry and grids (portB)


def product(factors: Sequence[Val]) -> Val:
    """The product of ``factors`` (at least one), left to right: one ``Mul`` per factor after the first, as
    multilinear interpolation weights multiply their per-axis weights (GridSample, DeformConv)."""
    out = factors[0]
    for f in factors[1:]:
        out = out * f
    return out


def zeros_of_shape(e: Emitter, shape: str, like: str) -> str:
    """Zeros of the shape held by the int64 value ``shape``, in ``like``'s dtype (``CastLike`` when that dtype is
    unknown: a float32 zero would mistype a float64 gradient); the tables scatters add into."""
    dt = e.dtype(like)
    if dt is not None:
        return e.op("ConstantOfShape", [shape], value=np.zeros(1, dtype=dt))
    return e.op("CastLike", [e.op("ConstantOfShape", [shape], value=np.zeros(1, dtype=np.float32)), like])
