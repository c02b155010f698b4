"""Products of the *other* members of groups of equal keys, without division: the updates' gradient of a
``mul`` scatter (``rules/indexing.py``).

``out[k] = prod(vals[j] for j != k with keys[j] == keys[k])`` along one axis. Dividing the group's product by
``vals[k]`` (PyTorch's ``scatter_reduce`` backward for ``prod``) is wrong at zeros and needs a special case
for a single zero; instead the values are sorted by key along the axis (``TopK`` with ``largest=0``, which
the ONNX spec makes stable, or ``numpy.argsort`` when the keys are constants), so that each group is a
contiguous run, and two segmented scans (Hillis and Steele's doubling, "Data parallel algorithms", CACM
1986) give the product of the run before and after each element: step ``d`` multiplies each element by the
one ``d`` places earlier (later) when both have the same key, so after steps ``d = 1, 2, 4, ...`` below the
longest run ``L`` each element holds the product of its run up to (from) itself. The exclusive products are
those of the neighbours, and their product is the answer. ``ceil(log2 L)`` steps (``L`` from constant keys,
else the axis length), each differentiable, so the result can be differentiated again: ``Gather`` of whole
rows through 1-D index vectors when every line shares the keys (ScatterND's rows), ``Slice``, ``Where``,
``Pad`` and ``Mul`` per element otherwise (ScatterElements). The number of steps is fixed when the graph is
built, so the axis must have a static length. Cost, measured on 2M float32 updates (8192 x 256, ~128 per
position, onnxruntime on 2 busy cores): ~0.1-0.2 s for ScatterND's rows, ~0.6 s for ScatterElements with
constant indices and ~1.5 s with run-time indices (the per-line ``TopK`` is most of it); max/min ~0.05-0.15 s.
"""

from __future__ import annotations

import numpy as np

from .emitter import Emitter

#: keys of at most this many elements are sorted when the graph is built (the order, its inverse and the
#: scans' masks become constants); larger ones at run time, so the graph file does not grow by ~10x their size
FOLD_LIMIT = 1 << 16


def others_product(e: Emitter, vals: str, keys: str, axis: int, n: int) -> str:
    """``out`` of ``vals``' shape and dtype: for each element, the product of the elements of its line along
    ``axis`` (``axis >= 0``; ``n = vals.shape[axis]``, static) that have the same key, itself excluded (1 for
    an element alone in its group). ``keys`` (integers, of known rank) has ``vals``' shape, or size 1 in every
    dimension but ``axis`` (one key per position along the axis, shared by all lines: ScatterND's rows).
    Exact at zeros (no division); float rounding only."""
    if n <= 1:
        return e.ones_like(vals)
    if _shared(e, keys, axis):
        return _shared_product(e, vals, keys, axis, n)
    rank = e.rank(keys)
    kv = _folded(e, keys)
    if kv is not None:  # constant keys: the order, its inverse and the masks are constants too
        order = np.argsort(kv, axis=axis, kind="stable")
        inverse = e.const(np.argsort(order, axis=axis, kind="stable"))
        ks = np.take_along_axis(kv, order, axis=axis)
        steps = _longest_run(ks, axis)
        if steps == 1:  # no position written twice
            return e.ones_like(vals)
        order = e.const(order)
    else:
        ks, order = e.op("TopK", [keys, e.ints([n])], n_out=2, axis=axis, largest=0, sorted=1)
        inverse = _inverse(e, order, axis, n, rank)
        steps = n
    same = {d: _same(e, ks, d, n, axis) for d in sorted({1, *_doublings(steps)})}
    sorted_vals = _take_lines(e, vals, order, axis, rank)
    before, after = sorted_vals, sorted_vals
    for d in _doublings(steps):  # inclusive segmented products, from the start and from the end of each run
        before = e.op("Mul", [before, _shifted(e, before, same[d], d, n, axis, later=False)], like=vals)
        after = e.op("Mul", [after, _shifted(e, after, same[d], d, n, axis, later=True)], like=vals)
    others = e.op("Mul", [_shifted(e, before, same[1], 1, n, axis, later=False),
                          _shifted(e, after, same[1], 1, n, axis, later=True)], like=vals)
    return _take_lines(e, others, inverse, axis, rank)


def _shared_product(e: Emitter, vals: str, keys: str, axis: int, n: int) -> str:
    """:func:`others_product` with one key per position along ``axis`` (ScatterND's rows of S elements). The
    sorted values get a row of ones appended (position ``n``), and a scan step multiplies by a ``Gather`` of
    the rows ``d`` places away, or of the ones row where that row is in another run: 1-D index vectors select,
    not a ``Where`` over the values (which costs ~7x a ``Mul`` in onnxruntime, more when it broadcasts). The
    last gathers read the neighbours straight in the original order (index vectors composed with the inverse
    of the sort)."""
    kv = _folded(e, keys)
    if kv is not None:
        flat = kv.reshape(-1)
        order = np.argsort(flat, kind="stable")
        ks = flat[order]
        steps = _longest_run(ks, 0)
        if steps == 1:
            return e.ones_like(vals)
        inverse = np.argsort(order, kind="stable")
        sources = {d: (e.const(_source(ks, d, later=False)), e.const(_source(ks, d, later=True)))
                   for d in _doublings(steps)}
        final = [e.const(_source(ks, 1, later=later)[inverse]) for later in (False, True)]
        order = e.const(order)
    else:
        flat = e.op("Reshape", [keys, e.ints([-1])], shape=(n,), dtype=e.dtype(keys))
        ks, order = e.op("TopK", [flat, e.ints([n])], n_out=2, axis=0, largest=0, sorted=1)
        inverse = _inverse(e, order, 0, n, 1)
        sources = {d: (_source_op(e, ks, d, n, later=False), _source_op(e, ks, d, n, later=True))
                   for d in sorted({1, *_doublings(n)})}
        final = [e.op("Gather", [sources[1][later], inverse], axis=0) for later in (0, 1)]
    one = e.scalar(1.0, vals)
    padded = e.op("Pad", [e.op("Gather", [vals, order], axis=axis), e.ints([0, 1]), one, e.ints([axis])],
                  mode="constant")
    before, after = padded, padded
    for d in _doublings(steps if kv is not None else n):
        before = e.op("Mul", [before, e.op("Gather", [before, sources[d][0]], axis=axis)])
        after = e.op("Mul", [after, e.op("Gather", [after, sources[d][1]], axis=axis)])
    return e.op("Mul", [e.op("Gather", [before, final[0]], axis=axis), e.op("Gather", [after, final[1]], axis=axis)],
                like=vals)


def _source(ks: np.ndarray, d: int, *, later: bool) -> np.ndarray:
    """int64 [n + 1] for sorted keys ``ks`` [n]: position ``t`` reads ``t - d`` (``later``: ``t + d``) when that
    is in ``t``'s run, else ``n`` (the ones row); ``n`` reads ``n``."""
    n = ks.size
    t = np.arange(n + 1, dtype=np.int64)
    ok = np.zeros(n + 1, dtype=bool)
    if later:
        ok[:n - d] = ks[d:] == ks[:n - d]
        return np.where(ok, t + d, n)
    ok[d:n] = ks[d:] == ks[:n - d]
    return np.where(ok, t - d, n)


def _source_op(e: Emitter, ks: str, d: int, n: int, *, later: bool) -> str:
    """:func:`_source` for sorted keys known at run time (1-D integer ops only)."""
    t = np.arange(n + 1, dtype=np.int64)
    if d >= n:
        return e.const(np.full(n + 1, n, dtype=np.int64))
    same = e.op("Equal", [_cut(e, ks, d, n, 0), _cut(e, ks, 0, n - d, 0)])
    head, tail = (0, d + 1) if later else (d, 1)
    parts = [e.const(np.zeros(head, dtype=bool))] if head else []
    parts += [same, e.const(np.zeros(tail, dtype=bool))]
    ok = e.op("Concat", parts, axis=0)
    return e.op("Where", [ok, e.const(t + d if later else t - d), e.const(np.int64(n))])


def _folded(e: Emitter, keys: str) -> np.ndarray | None:
    """The constant value of ``keys`` when it is small enough to sort now (:data:`FOLD_LIMIT`), else ``None``."""
    kv = e.value(keys)
    return kv if kv is not None and kv.size <= FOLD_LIMIT else None


def _inverse(e: Emitter, order: str, axis: int, n: int, rank: int) -> str:
    """The inverse of the permutations ``order`` (int64, one per line along ``axis``): ``inverse[.., order[..,
    t, ..], ..] = t``, a ``ScatterElements`` without reduction at distinct positions (a second ``TopK`` would
    sort again, ~2x the time of the whole scan at 2M elements)."""
    ramp = e.const(np.arange(n, dtype=np.int64).reshape([n if i == axis else 1 for i in range(rank)]))
    if rank > 1:
        ramp = e.op("Expand", [ramp, e.op("Shape", [order])])
    return e.op("ScatterElements", [e.op("ConstantOfShape", [e.op("Shape", [order])], value=np.zeros(1, np.int64)),
                                    order, ramp], axis=axis)


def _doublings(longest: int) -> list[int]:
    """The shifts ``1, 2, 4, ...`` below ``longest``: after them a scan covers runs of ``longest`` elements."""
    out, d = [], 1
    while d < longest:
        out.append(d)
        d *= 2
    return out


def _longest_run(sorted_keys: np.ndarray, axis: int) -> int:
    """The largest number of equal keys in one line of ``sorted_keys`` (sorted along ``axis``)."""
    lines = np.moveaxis(sorted_keys, axis, -1).reshape(-1, sorted_keys.shape[axis])
    best = 1
    for line in lines:
        starts = np.flatnonzero(np.r_[True, line[1:] != line[:-1], True])
        best = max(best, int(np.diff(starts).max()))
    return best


def _shared(e: Emitter, keys: str, axis: int) -> bool:
    dims = e.dims(keys)
    return dims is not None and all(d == 1 for i, d in enumerate(dims) if i != axis)


def _cut(e: Emitter, x: str, start: int, end: int, axis: int) -> str:
    """``x`` sliced to ``[start, end)`` along ``axis``."""
    return e.op("Slice", [x, e.ints([start]), e.ints([end]), e.ints([axis])])


def _same(e: Emitter, ks, d: int, n: int, axis: int) -> str:
    """bool, length ``n - d`` along ``axis``: do sorted keys ``t`` and ``t + d`` agree (one run)?"""
    if isinstance(ks, np.ndarray):
        head = np.take(ks, range(d, n), axis=axis)
        return e.const(head == np.take(ks, range(n - d), axis=axis))
    return e.op("Equal", [_cut(e, ks, d, n, axis), _cut(e, ks, 0, n - d, axis)])


def _shifted(e: Emitter, x: str, same: str, d: int, n: int, axis: int, *, later: bool) -> str:
    """Each element's neighbour ``d`` places earlier (``later``: later) along ``axis`` where both are in one
    run, else 1."""
    part = _cut(e, x, d, n, axis) if later else _cut(e, x, 0, n - d, axis)
    one = e.scalar(1.0, x)
    kept = e.op("Where", [same, part, one])
    pads = [0, d] if later else [d, 0]
    return e.op("Pad", [kept, e.ints(pads), one, e.ints([axis])], mode="constant", like=x)


def _take_lines(e: Emitter, x: str, order: str, axis: int, rank: int) -> str:
    """``x`` reordered line by line along ``axis``: ``out[.., t, ..] = x[.., order[.., t, ..], ..]``, as a
    ``Gather`` from the flat ``x`` at ``line start + order * stride`` (``GatherElements`` would do, but the
    reference evaluator's takes at most 64 entries along the axis)."""
    pos = _flat_positions(e, order, axis, rank)
    flat_x = e.op("Reshape", [x, e.ints([-1])])
    return e.op("Gather", [flat_x, pos], axis=0, like=x)


def _flat_positions(e: Emitter, order: str, axis: int, rank: int) -> str:
    """int64 of ``order``'s shape: the flat (row-major) position of element ``order[.., t, ..]`` of its line
    along ``axis``, that is the element's own flat position with its coordinate along ``axis`` replaced."""
    shape, ov = e.shape(order), e.value(order)
    if shape is not None:
        stride = int(np.prod(shape[axis + 1:], dtype=np.int64))
        start = np.take(np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape), [0], axis=axis)
        if ov is not None:
            return e.const(start + ov.astype(np.int64) * stride)
        return e.op("Add", [e.const(start), e.op("Mul", [order, e.const(np.int64(stride))])])
    size = e.op("Size", [order])
    grid = e.op("Reshape", [e.op("Range", [e.const(np.int64(0)), size, e.const(np.int64(1))]), e.op("Shape", [order])])
    start = _cut(e, grid, 0, 1, axis)
    if axis == rank - 1:
        return e.op("Add", [start, order])
    stride = e.op("ReduceProd", [e.op("Shape", [order], start=axis + 1)], keepdims=0)
    return e.op("Add", [start, e.op("Mul", [order, stride])])

