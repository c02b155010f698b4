"""Static checks of a forward node's constant inputs and attributes against its inputs' ranks and shapes, run
before a node is differentiated (issue 28, part 3). ONNX's own inference of a model lets some inconsistent
nodes through (a ``Pad`` whose ``pads`` has the wrong length when the output shape is not declared, a
``ScatterND`` whose ``updates`` do not fit its ``indices``); a rule then builds from them a graph that is huge
(80000 pads: minutes) or that ONNX refuses. Each check knows its operator's spec (ONNX operator docs) and
raises a one-line :class:`~revgraph.errors.GraphError` (exit 2) naming the node, the input and the value.
Only what is known while the graph is built is checked (static ranks and dimensions, constant inputs), in the
top-level graph and in every Loop/Scan/If body (walked iteratively, with the types inferred for each body)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..errors import GraphError
from ..ir import Graph, Node, ValueInfo


def _rank(types: Mapping[str, ValueInfo], name: str) -> int | None:
    vi = types.get(name) if name else None
    return None if vi is None or vi.shape is None or vi.kind != "tensor" else len(vi.shape)


def _dims(types: Mapping[str, ValueInfo], name: str) -> tuple | None:
    vi = types.get(name) if name else None
    return None if vi is None or vi.shape is None or vi.kind != "tensor" else tuple(vi.shape)


def _ints(values: Mapping, node: Node, i: int, attr: str | None = None) -> list[int] | None:
    """Input ``i`` of ``node`` when constant (or, from older opsets, the attribute ``attr``), as ints."""
    if len(node.inputs) > i and node.inputs[i]:
        v = values.get(node.inputs[i])
        return None if v is None else [int(x) for x in np.asarray(v).reshape(-1)]
    if attr is not None and node.attrs.get(attr) is not None:
        return [int(x) for x in node.attrs[attr]]
    return None


def _fail(node: Node, what: str) -> None:
    raise GraphError(f"{node.label()}: {what}; correct the model")


def _axes(node: Node, axes: list[int] | None, rank: int | None, what: str = "axes") -> None:
    if axes is None or rank is None:
        return
    bad = [a for a in axes if not -rank <= a < rank]
    if bad:
        _fail(node, f"{what} {axes} has {bad[0]} out of range for rank {rank} (give values in [{-rank}, {rank}))")
    norm = [a % rank for a in axes]
    if len(set(norm)) != len(norm):
        _fail(node, f"{what} {axes} names an axis more than once")


def _pad(node, types, values):
    rank, pads = _rank(types, node.inputs[0]), _ints(values, node, 1, "pads")
    axes = _ints(values, node, 3)
    _axes(node, axes, rank)
    n = len(axes) if axes is not None else rank
    if pads is not None and n is not None and len(pads) != 2 * n:
        _fail(node, f"pads has {len(pads)} values; the input of rank {rank} takes 2 x {n} = {2 * n}")


def _slice(node, types, values):
    rank = _rank(types, node.inputs[0])
    parts = {k: _ints(values, node, i, k if i < 3 else None)
             for i, k in ((1, "starts"), (2, "ends"), (3, "axes"), (4, "steps"))}
    lengths = {k: len(v) for k, v in parts.items() if v is not None}
    if len(set(lengths.values())) > 1:
        said = ", ".join(f"{k} {n}" for k, n in lengths.items())
        _fail(node, f"starts, ends, axes and steps have different lengths ({said})")
    _axes(node, parts["axes"], rank)
    if parts["axes"] is None and rank is not None and lengths and max(lengths.values()) > rank:
        _fail(node, f"starts and ends have {max(lengths.values())} values for an input of rank {rank}")
    if parts["steps"] is not None and 0 in parts["steps"]:
        _fail(node, f"steps {parts['steps']} has a 0")


def _resize(node, types, values):
    rank = _rank(types, node.inputs[0])
    axes = [int(a) for a in node.attrs["axes"]] if node.attrs.get("axes") is not None else None
    _axes(node, axes, rank)
    n = len(axes) if axes is not None else rank
    first = 1 if node.op_type == "Upsample" else 2
    for i, what in ((first, "scales"), (first + 1, "sizes")):
        v = values.get(node.inputs[i]) if len(node.inputs) > i and node.inputs[i] else None
        if v is not None and np.asarray(v).size and n is not None and np.asarray(v).size != n:
            _fail(node, f"{what} has {np.asarray(v).size} values; the input of rank {rank} takes {n}")


def _tile(node, types, values):
    rank, reps = _rank(types, node.inputs[0]), _ints(values, node, 1)
    if reps is not None and rank is not None and len(reps) != rank:
        _fail(node, f"repeats has {len(reps)} values; the input has rank {rank}")
    if reps is not None and any(r < 0 for r in reps):
        _fail(node, f"repeats {reps} has a negative value")


def _expand(node, types, values):
    dims, shape = _dims(types, node.inputs[0]), _ints(values, node, 1)
    if dims is None or shape is None:
        return
    for a, b in zip(reversed(dims), reversed(shape), strict=False):
        if isinstance(a, int) and a != 1 and b not in (1, a):
            _fail(node, f"shape {shape} does not broadcast with the input's {list(dims)}")


def _reshape(node, types, values):
    shape = _ints(values, node, 1)
    if shape is not None and shape.count(-1) > 1:
        _fail(node, f"shape {shape} has more than one -1")
    if shape is not None and any(s < -1 for s in shape):
        _fail(node, f"shape {shape} has a value below -1")


def _transpose(node, types, values):
    rank, perm = _rank(types, node.inputs[0]), node.attrs.get("perm")
    if perm is not None and rank is not None and sorted(int(p) % rank if -rank <= int(p) < rank else -1
                                                         for p in perm) != list(range(rank)):
        _fail(node, f"perm {list(perm)} is not a permutation of the input's {rank} axes")


def _squeeze(node, types, values):
    _axes(node, _ints(values, node, 1, "axes"), _rank(types, node.inputs[0]))


def _unsqueeze(node, types, values):
    rank, axes = _rank(types, node.inputs[0]), _ints(values, node, 1, "axes")
    _axes(node, axes, None if rank is None or axes is None else rank + len(axes))


def _reduce(node, types, values):
    _axes(node, _ints(values, node, 1, "axes"), _rank(types, node.inputs[0]))


def _scatter_nd(node, types, values):
    data, idx, upd = (_dims(types, n) for n in node.inputs[:3])
    if data is None or idx is None or upd is None or not idx or not isinstance(idx[-1], int):
        return
    k = idx[-1]
    if k > len(data):
        _fail(node, f"indices' last dimension {k} exceeds the data's rank {len(data)}")
    want = (*idx[:-1], *data[k:])
    if len(upd) != len(want) or any(isinstance(a, int) and isinstance(b, int) and a != b
                                    for a, b in zip(upd, want, strict=True)):
        _fail(node, f"updates have shape {list(upd)}; data {list(data)} and indices {list(idx)} take {list(want)} "
                    "(indices.shape[:-1] + data.shape[indices.shape[-1]:])")


def _scatter_elements(node, types, values):
    data, idx, upd = (_dims(types, n) for n in node.inputs[:3])
    if idx is not None and upd is not None and (len(idx) != len(upd) or any(
            isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(idx, upd, strict=True))):
        _fail(node, f"indices {list(idx)} and updates {list(upd)} differ in shape")
    if data is not None and idx is not None and len(data) != len(idx):
        _fail(node, f"indices of rank {len(idx)} for data of rank {len(data)}")


def _affine_grid(node, types, values):
    theta, size = _dims(types, node.inputs[0]), _ints(values, node, 1)
    n_size = _dims(types, node.inputs[1])
    if theta is not None and size is None and n_size is not None and len(n_size) == 1 and n_size[0] in (4, 5):
        want = (2, 3) if n_size[0] == 4 else (3, 4)  # size a run-time input of known length: theta [N, *want]
        if len(theta) != 3 or any(isinstance(a, int) and a != b for a, b in zip(theta[1:], want, strict=True)):
            _fail(node, f"theta has shape {list(theta)}; a size of {n_size[0]} values takes [N, {want[0]}, {want[1]}]")
    if theta is None or size is None:
        return
    want = {4: [size[0], 2, 3], 5: [size[0], 3, 4]}.get(len(size))
    if want is None:
        _fail(node, f"size {size} has {len(size)} values; give 4 (N, C, H, W) or 5 (N, C, D, H, W)")
    if len(theta) != 3 or any(isinstance(a, int) and a != b for a, b in zip(theta, want, strict=True)):
        _fail(node, f"theta has shape {list(theta)}; size {size} takes {want}")


def _softmax_ce(node, types, values):
    scores, labels = _dims(types, node.inputs[0]), _dims(types, node.inputs[1])
    if scores is None or labels is None:
        return
    want = (scores[0], *scores[2:]) if len(scores) >= 2 else None
    if want is None or len(labels) != len(want) or any(
            isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(labels, want, strict=True)):
        _fail(node, f"labels have shape {list(labels)}; scores {list(scores)} take {list(want or ())} (N, d1, ...)")
    w = _dims(types, node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if w is not None and (len(w) != 1 or (isinstance(w[0], int) and isinstance(scores[1], int) and w[0] != scores[1])):
        _fail(node, f"weights have shape {list(w)}; scores {list(scores)} take [{scores[1]}]")


def _attention(node, types, values):
    q, k, v = (_dims(types, n) for n in node.inputs[:3])
    if q is None or k is None or v is None or not (len(q) == len(k) == len(v)):
        return
    same = lambda a, b: not (isinstance(a, int) and isinstance(b, int) and a != b)
    if len(q) == 4:  # (batch, heads, sequence, head size)
        if not (same(q[0], k[0]) and same(k[0], v[0]) and same(q[3], k[3]) and same(k[2], v[2]) and same(k[1], v[1])):
            _fail(node, f"Q {list(q)}, K {list(k)} and V {list(v)} do not fit (batch, heads, sequence, head size): "
                        "Q and K share the head size, K and V the sequence")
        if isinstance(q[1], int) and isinstance(k[1], int) and q[1] % k[1]:
            _fail(node, f"Q has {q[1]} heads, not a multiple of K's {k[1]}")
        mask = _dims(types, node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
        # The mask broadcasts to (q sequence, kv sequence), past keys aside; a mask shorter than the keys is padded
        # with -inf (False) on the right, as the spec's reference does, so only a longer one cannot fit.
        known = lambda *d: all(isinstance(x, int) for x in d)
        if mask is not None and len(mask) >= 2 and len(node.inputs) <= 4 and (
                (known(mask[-2], q[2]) and mask[-2] not in (1, q[2])) or (known(mask[-1], k[2]) and mask[-1] > k[2])):
            _fail(node, f"attn_mask has shape {list(mask)}; it takes (q sequence, at most kv sequence) = "
                        f"{[q[2], k[2]]}")
    elif len(q) == 3 and not (same(q[0], k[0]) and same(k[0], v[0]) and same(k[1], v[1])):
        _fail(node, f"Q {list(q)}, K {list(k)} and V {list(v)} do not fit (batch, sequence, hidden)")


CHECKS: dict[str, Callable] = {
    "Pad": _pad, "Slice": _slice, "Resize": _resize, "Upsample": _resize, "Tile": _tile, "Expand": _expand,
    "Reshape": _reshape, "Transpose": _transpose, "Squeeze": _squeeze, "Unsqueeze": _unsqueeze,
    "ScatterND": _scatter_nd, "ScatterElements": _scatter_elements, "AffineGrid": _affine_grid,
    "SoftmaxCrossEntropyLoss": _softmax_ce, "Attention": _attention,
    **dict.fromkeys(("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                     "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"), _reduce),
}


def check_nodes(graph: Graph, types: Mapping[str, ValueInfo], values: Mapping) -> None:
    """Check every node of ``graph`` of an operator in :data:`CHECKS` (default domain) against the static types
    ``types`` and the constant values ``values``, the nodes of its ``Loop``/``Scan``/``If`` bodies too (walked
    iteratively, each body with the types inferred for it from its declarations and the enclosing graph's types
    of what it captures, and the constants it captures); raises :class:`GraphError` (one line naming the node)
    at the first inconsistent one; a node in a body is named with the bodies that hold it ("node 'n1' (Pad) in
    'body' of node 'loop' (Loop)")."""
    stack: list[tuple[Graph, Mapping[str, ValueInfo], Mapping, str]] = [(graph, types, values, "")]
    while stack:
        g, t, v, where = stack.pop()
        for node in g.nodes:
            check = CHECKS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            if check is not None and node.inputs and node.inputs[0]:
                try:
                    check(node, t, v)
                except GraphError as exc:
                    if not where:
                        raise
                    raise GraphError(str(exc).replace(node.label(), node.label() + where, 1)) from None
            for attr, body in node.subgraphs.items():
                if any(n.op_type in CHECKS for _, n in body.walk()):  # (inferring a body's types costs)
                    stack.append((*_body_scope(body, t, v, graph.opsets), f" in {attr!r} of {node.label()}{where}"))


def _body_scope(body: Graph, types: Mapping[str, ValueInfo], values: Mapping, opsets: Mapping[str, int]
                ) -> tuple[Graph, dict, dict]:
    """``(body, its types, its constant values)`` (``opsets``: the model's): the body's own inferred from its
    declarations, and the types and constants of the enclosing graph's values it captures (a captured initializer is a
    constant in the body too)."""
    from ..ir.ssa import captured_names
    from ..onnx_io.value_types import constant_values, infer_types

    captured = captured_names(body)
    outer = [types.get(c) or ValueInfo(c) for c in captured]
    probe = Graph(body.nodes, [*body.inputs, *outer], body.outputs, body.initializers, body.value_info,
                  opsets=dict(opsets))  # (a body's own opsets are the model's)
    try:
        inner = infer_types(probe)
    except Exception:  # noqa: BLE001 - inference is a help here; the node checks use what is known
        inner = {}
    for vi in [*outer, *body.inputs]:
        inner.setdefault(vi.name, vi)
    known = {c: values[c] for c in captured if c in values}
    return body, inner, {**known, **constant_values(body, inner)}
