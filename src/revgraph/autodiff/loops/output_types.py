"""The types of a ``Loop``'s outputs from its body, where the model declares none (issue 41: a ``tf.while_loop``
exported by tf2onnx declares the loop's outputs, and its body's, without a shape, so the rank of a carried output
was unknown and the rule reading it refused; declaring the type by hand made it work).

ONNX's shape inference leaves a loop's carried outputs without a shape (a carried value may change shape
between iterations in general) and needs the body's types declared to type the scan outputs. Here the body is
typed with its carried inputs taking their initial values' types (the iteration number an int64 scalar, the
condition a bool), and inferred again with each carried input widened to what its body output has in common
with it (a dimension that changes between iterations becomes unknown), until nothing changes:

- a carried output has the type its carried value keeps through every iteration (the fixpoint);
- a scan output has its body output's type with one more leading dimension, the number of iterations (a number
  where the trip count is a constant and no condition input can stop the loop early, else unknown).

The ``Scan`` operator is rewritten into its ``Loop`` form before the backward pass (:mod:`.scan`), which this
then types the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ...ir import Graph, Node, ValueInfo

#: at most this many inferences of one body: each round makes at least one dimension unknown or stops
MAX_ROUNDS = 4

BodyTypes = Callable[[Graph, dict[str, ValueInfo], dict[str, ValueInfo]], dict[str, ValueInfo]]


def _common(a: ValueInfo, b: ValueInfo | None) -> ValueInfo:
    """The type ``a`` and ``b`` share: the same rank with the dimensions they agree on (others unknown), or no
    shape when the ranks differ or one is unknown."""
    dtype = a.dtype if a.dtype is not None else b.dtype if b is not None else None
    if b is None or b.kind != a.kind or a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return ValueInfo(a.name, dtype, None, a.kind)
    return ValueInfo(a.name, dtype, tuple(x if x == y else None for x, y in zip(a.shape, b.shape, strict=True)),
                     a.kind)


def settle_carried(node: Node, types: dict[str, ValueInfo], body_types: BodyTypes
           ) -> tuple[dict[str, ValueInfo], dict[str, ValueInfo]] | None:
    """The types of ``node``'s (a ``Loop``) body inputs that hold through every iteration (module doc), and the
    body's types inferred with them; ``None`` where a carried value's rank does not settle. ``types``: the
    enclosing graph's (initial values, captured values); ``body_types(body, outer, hints)``: the body's types
    with its inputs as ``hints`` says (:func:`.reverse.body_types`)."""
    body: Graph = node.attrs["body"]
    n = len(node.inputs) - 2
    if len(body.inputs) != n + 2 or len(body.outputs) < n + 1:
        return None
    it, cond = body.inputs[0].name, body.inputs[1].name
    hints = {it: ValueInfo(it, np.dtype(np.int64), ()), cond: ValueInfo(cond, np.dtype(bool), ())}
    for j in range(n):
        a, init = body.inputs[2 + j], types.get(node.inputs[2 + j])
        start = init if init is not None and init.dtype is not None and init.shape is not None else a
        hints[a.name] = ValueInfo(a.name, start.dtype if start.dtype is not None else a.dtype, start.shape, start.kind)
    for _ in range(MAX_ROUNDS):
        inner = body_types(body, types, dict(hints))
        changed = False
        for j in range(n):
            a = hints[body.inputs[2 + j].name]
            common = _common(a, inner.get(body.outputs[1 + j].name))
            if common.shape != a.shape or common.dtype != a.dtype:
                hints[a.name], changed = common, True
        if not changed:
            return hints, inner
    return None


def inferred_outputs(node: Node, types: dict[str, ValueInfo], body_types: BodyTypes,
                     values: Mapping[str, np.ndarray] | None = None) -> dict[str, ValueInfo]:
    """The types of ``node``'s (a ``Loop``) tensor outputs that its body gives (module doc, :func:`settle_carried`), by
    output name; ``values``: constants of the enclosing graph (the trip count). Outputs whose type the body does
    not settle are left out."""
    settled = settle_carried(node, types, body_types)
    if settled is None:
        return {}
    hints, inner = settled
    body: Graph = node.attrs["body"]
    n = len(node.inputs) - 2
    found: dict[str, ValueInfo] = {}
    for j, out in enumerate(node.outputs[:n]):
        vi = hints[body.inputs[2 + j].name]
        if out and vi.kind == "tensor" and vi.dtype is not None and vi.shape is not None:
            found[out] = ValueInfo(out, vi.dtype, vi.shape)
    trips = _trip_count(node, values or {})
    for k, out in enumerate(node.outputs[n:]):
        b = inner.get(body.outputs[1 + n + k].name) if 1 + n + k < len(body.outputs) else None
        if out and b is not None and b.kind == "tensor" and b.dtype is not None and b.shape is not None:
            found[out] = ValueInfo(out, b.dtype, (trips, *b.shape))
    return found


def _trip_count(node: Node, values: Mapping[str, np.ndarray]) -> int | None:
    """The number of iterations when the graph is built: a constant trip count with no condition input (ONNX
    "Loop": the body's condition output is then ignored), else ``None``."""
    m = node.inputs[0] if node.inputs else ""
    if not m or (len(node.inputs) > 1 and node.inputs[1]) or m not in values:
        return None
    count = np.asarray(values[m])
    if count.size != 1 or count.dtype.kind not in "iu" or not 0 <= int(count.reshape(())) < 2**31:
        return None  # (tf2onnx writes INT64_MAX with a condition; a size so large is no shape)
    return int(count.reshape(()))
