"""VJPs of the ONNX sequence operators (ONNX operator spec, "SequenceConstruct" ... "ConcatFromSequence", opset
11 and later; "SequenceMap", opset 17, is differentiated as its ``Loop`` form, :mod:`..loops.lower`).

The cotangent of a sequence is a sequence of the same length: element i is the cotangent of element i
(zeros where nothing depends on the element). Every operator here moves tensors in or out of sequences without
changing them, so each VJP is the adjoint data movement, the list transposes of JAX's pytrees and of
PyTorch's ``split_backward`` / ``cat`` / ``stack`` / ``unbind`` entries in ``derivatives.yaml``:

* ``SequenceAt(S, p)``: ``S`` gets the read ``(p, g)`` (:class:`~..accumulate.SeqGrad`); the reads of all the
  readers of ``S`` add up, at run-time positions too (:mod:`..accumulate`).
* ``SplitToSequence(x)``: ``x`` gets the element cotangents concatenated along ``axis`` (``Concat`` of the
  reads and zeros when the positions and piece sizes are known while the graph is built: no sequence;
  ``ConcatFromSequence`` of the dense cotangent otherwise).
* ``ConcatFromSequence(S)``: ``S`` gets the cotangent split back into its elements (``SplitToSequence``,
  ``keepdims=0`` for ``new_axis=1``).
* ``SequenceConstruct(x_1, ..., x_n)``: ``x_i`` gets element i.
* ``SequenceInsert(S, t, p)``: ``t`` gets element p of the cotangent, ``S`` the cotangent without it
  (``SequenceErase``).
* ``SequenceErase(S, p)``: ``S`` gets the cotangent with zeros of the erased element's shape inserted at p.
* ``SequenceLength`` (an integer) and ``SequenceEmpty`` (no inputs) carry no gradient.

Positions are scalars in ``[-n, n)`` (``[-n, n]`` for ``SequenceInsert``); a negative one counts from the back.
Reads at positions known while the graph is built pass through ``SequenceConstruct``, ``SequenceInsert`` and
``SequenceErase`` as reads, so a sequence that is built and read only at constant positions costs no
sequence in the backward graph.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...ir import Node, ValueInfo, onnx_dtype
from ..accumulate import I64, SeqGrad, densify_sequence, map_sequences, seq_op, static_position
from ..algebra import Val, where
from ..context import Ctx
from ..emitter import Emitter
from ..registry import not_differentiable, vjp
from ._common import optional_input


def _i64(e: Emitter, value: int) -> str:
    return e.const(np.array(value, np.int64))


def _from_back(ctx: Ctx, p64: str, n: str | Val) -> str:
    """The int64 scalar position ``p64`` with a negative one counted from the back of a length ``n``:
    ``p + n`` where ``p < 0``."""
    p = ctx.val(p64)
    return where(p.lt(0), p + n, p).name


def _sum(e: Emitter, gs: list[str]) -> str | None:
    if not gs:
        return None
    return gs[0] if len(gs) == 1 else e.op("Sum", gs, like=gs[0])


# ------------------------------------------------------------------------------------------ static structure


def static_length(ctx: Ctx, seq: str) -> int | None:
    """The length of the sequence ``seq`` when it is known while the graph is built (from its producers:
    ``SequenceConstruct``, ``SequenceEmpty``, ``SplitToSequence`` with known sizes, and ``SequenceInsert`` /
    ``SequenceErase`` chains over them), else ``None``."""
    delta = 0
    while True:
        node = ctx.producers.get(seq)
        if node is None or node.domain:
            return None
        if node.op_type == "SequenceInsert":
            delta, seq = delta + 1, node.inputs[0]
        elif node.op_type == "SequenceErase":
            delta, seq = delta - 1, node.inputs[0]
        elif node.op_type == "SequenceConstruct":
            return delta + len(node.inputs)
        elif node.op_type == "SequenceEmpty":
            return delta
        elif node.op_type == "SplitToSequence":
            sizes = _split_sizes(ctx.e, node)
            return None if sizes is None else delta + len(sizes)
        else:
            return None


def _split_sizes(e: Emitter, node: Node) -> list[int] | None:
    """The sizes of ``SplitToSequence``'s pieces along its axis, when known while the graph is built."""
    x, split = node.inputs[0], optional_input(node, 1)
    dims = e.dims(x)
    axis = int(node.attrs.get("axis", 0))
    dim = dims[axis] if dims is not None and -len(dims) <= axis < len(dims) else None
    if split is not None:
        v = e.value(split)
        if v is None:
            return None
        v = np.asarray(v)
        if v.ndim == 1:
            return [int(a) for a in v]
        if not isinstance(dim, int) or int(v) <= 0:
            return None
        n, rest = divmod(dim, int(v))
        return [int(v)] * n + ([rest] if rest else [])
    return [1] * dim if isinstance(dim, int) else None


def _static_reads(e: Emitter, g: SeqGrad, n: int | None) -> dict[int, list[str]] | None:
    """The reads of ``g`` by normalised position (in ``[0, n)``) when every position is known while the graph
    is built (negative ones need the length ``n``); ``None`` otherwise."""
    out: dict[int, list[str]] = {}
    for p, gr in g.reads:
        k = static_position(e, p)
        if k is None or (k < 0 and n is None):
            return None
        out.setdefault(k + n if k < 0 else k, []).append(gr)
    return out


def structural_zeros(ctx: Ctx, seq: str) -> Callable[[Emitter], str] | None:
    """A function emitting zeros of the structure of ``seq`` from its producer's tensor inputs, without
    reading ``seq`` (so that a loop body need not keep the sequence): ``SplitToSequence`` of zeros,
    ``SequenceConstruct`` of zeros, ``SequenceEmpty``. ``None`` for other producers (then zeros come from
    a loop over ``seq``, :func:`~..accumulate.zeros_sequence`)."""
    node = ctx.producers.get(seq)
    if node is None or node.domain:
        return None
    like = ctx.e.types.get(seq)
    if node.op_type == "SplitToSequence":
        return lambda e: seq_op(e, "SplitToSequence", [e.zeros_like(node.inputs[0]), *node.inputs[1:]], like,
                                **node.attrs)
    if node.op_type == "SequenceConstruct":
        return lambda e: seq_op(e, "SequenceConstruct", [e.zeros_like(x) for x in node.inputs], like)
    if node.op_type == "SequenceEmpty":
        return lambda e: seq_op(e, "SequenceEmpty", [], like, **node.attrs)
    return None


def _dense(ctx: Ctx, g: str | SeqGrad, zeros: Callable[[Emitter], str] | None = None) -> str:
    return densify_sequence(ctx.e, g, zeros) if isinstance(g, SeqGrad) else g


# ------------------------------------------------------------------------------------------ reads


@vjp("SequenceAt", bounded=True, finite=True, reads=(), moves=True)
def sequence_at(ctx: Ctx, node: Node, cts: list) -> list:
    """``S`` gets the read ``(position, g)``: its cotangent is ``g`` at the position and zeros elsewhere, added
    to the other readers' (PyTorch's ``unbind`` / ``select`` backward, one element at a time)."""
    seq, pos = node.inputs
    return [lambda: SeqGrad(seq, ((pos, cts[0]),), zeros=structural_zeros(ctx, seq)), None]


@vjp("SplitToSequence", bounded=True, finite=True, reads=(), moves=True)
def split_to_sequence(ctx: Ctx, node: Node, cts: list) -> list:
    """``x`` gets the element cotangents concatenated along ``axis`` (PyTorch's ``split_backward``): a
    ``Concat`` of the reads (summed per position, unsqueezed for ``keepdims=0``) and zeros for the unread
    pieces when every read position and piece size is known while the graph is built, else
    ``ConcatFromSequence`` of the dense cotangent (zeros: ``SplitToSequence`` of zeros)."""
    e, x, split = ctx.e, node.inputs[0], optional_input(node, 1)
    squeeze = split is None and int(node.attrs.get("keepdims", 1)) == 0
    rank = e.rank(x)
    axis = int(node.attrs.get("axis", 0))
    axis = axis + rank if axis < 0 and rank is not None else axis

    def piece_zeros(size: int) -> str:
        dims, dt = e.dims(x), e.dtype(x)
        if dt is not None and dims is not None and all(isinstance(d, int) for i, d in enumerate(dims) if i != axis):
            shape = [size if i == axis else d for i, d in enumerate(dims)]
            return e.op("ConstantOfShape", [e.ints(shape)], value=np.zeros(1, dt), dtype=dt, shape=tuple(shape))
        shape = e.op("ScatterElements", [e.shape_of(x), e.ints([axis]), e.ints([size])], axis=0, dtype=I64,
                     shape=(rank,))
        if dt is None:
            return e.op("CastLike", [e.op("ConstantOfShape", [shape], value=np.zeros(1, np.float32)), x])
        return e.op("ConstantOfShape", [shape], value=np.zeros(1, dt), dtype=dt, shape=(None,) * rank)

    def dx() -> str | None:
        g = cts[0]
        sizes = _split_sizes(e, node)
        reads = _static_reads(e, g, None if sizes is None else len(sizes)) if isinstance(g, SeqGrad) else None
        if reads is not None and g.base is None and sizes is not None and rank is not None:
            if not reads:
                return None
            pieces = []
            for i, size in enumerate(sizes):
                total = _sum(e, reads.get(i, []))
                if total is not None and squeeze:
                    total = e.op("Unsqueeze", [total, e.ints([axis])])
                pieces.append(total if total is not None else piece_zeros(size))
            return pieces[0] if len(pieces) == 1 else e.op("Concat", pieces, axis=axis, like=x)
        dense = _dense(ctx, g, lambda eb: seq_op(eb, "SplitToSequence", [eb.zeros_like(x), *node.inputs[1:]],
                                                 node.outputs[0], **node.attrs))
        return e.op("ConcatFromSequence", [dense], axis=axis, new_axis=1 if squeeze else 0, like=x)

    return [dx, *[None] * (len(node.inputs) - 1)]


@vjp("ConcatFromSequence", bounded=True, finite=True, reads=(), moves=True)
def concat_from_sequence(ctx: Ctx, node: Node, cts: list) -> list:
    """``S`` gets the cotangent split back into its elements along ``axis`` (PyTorch's ``cat`` and ``stack``
    backward): ``SplitToSequence(g, keepdims=0)`` for ``new_axis=1``; for ``new_axis=0`` chunks of the
    elements' common size along ``axis`` when the sequence's type says it, else the sizes read from the
    elements (a loop over their shapes)."""
    e, seq, g = ctx.e, node.inputs[0], cts[0]
    axis = int(node.attrs["axis"])
    stack = int(node.attrs.get("new_axis", 0)) == 1

    def dseq() -> str:
        if stack:
            return seq_op(e, "SplitToSequence", [g], seq, axis=axis, keepdims=0)
        el = e.types.get(seq)
        dims = el.shape if el is not None else None
        size = dims[axis] if dims is not None and -len(dims) <= axis < len(dims) else None
        if isinstance(size, int) and size > 0:
            return seq_op(e, "SplitToSequence", [g, _i64(e, size)], seq, axis=axis)
        return seq_op(e, "SplitToSequence", [g, _sizes(e, seq, axis)], seq, axis=axis)

    return [dseq]


def _sizes(e: Emitter, seq: str, axis: int) -> str:
    """The 1-D int64 sizes of the elements of ``seq`` along ``axis``: ``Shape`` of each element, stacked by a
    loop over them (:func:`~..accumulate.map_sequences`)."""
    attrs = {"start": axis} if axis == -1 else {"start": axis, "end": axis + 1}
    sizes = map_sequences(e, [seq], lambda eb, xs: [eb.op("Shape", xs, dtype=I64, shape=(1,), **attrs)],
                          [ValueInfo("", I64, (1,))], "sizes", stack=True)[0]
    return e.op("Reshape", [sizes, e.ints([-1])], dtype=I64, shape=(None,))


# ------------------------------------------------------------------------------------------ construction


@vjp("SequenceConstruct", bounded=True, finite=True, reads=(), moves=True)
def sequence_construct(ctx: Ctx, node: Node, cts: list) -> list:
    """``x_i`` gets element i of the cotangent: the reads at i (summed) when their positions are known while
    the graph is built, else ``SequenceAt(dense cotangent, i)``."""
    e, g, n = ctx.e, cts[0], len(node.inputs)

    def static() -> dict[int, list[str]] | None:
        return _static_reads(e, g, n) if isinstance(g, SeqGrad) and g.base is None else None

    reads = static()
    dense = None

    def dx(i: int, x: str) -> str | None:
        nonlocal dense
        if reads is not None:
            return _sum(e, reads.get(i, []))
        if dense is None:
            dense = _dense(ctx, g, lambda eb: seq_op(eb, "SequenceConstruct", [eb.zeros_like(v) for v in node.inputs],
                                                     node.outputs[0]))
        return e.op("SequenceAt", [dense, _i64(e, i)], like=x)

    return [lambda i=i, x=x: dx(i, x) for i, x in enumerate(node.inputs)]


@vjp("SequenceInsert", bounded=True, finite=True, reads=(), moves=True)
def sequence_insert(ctx: Ctx, node: Node, cts: list) -> list:
    """``t`` gets element p of the cotangent and ``S`` the cotangent without it (``SequenceErase``); p is the
    insert position (the back when omitted; a negative p counts from the back of ``S``, so it is element
    ``p + len(S)`` of the result). Reads at known positions pass through as reads (module doc)."""
    e, g = ctx.e, cts[0]
    seq, t, pos = node.inputs[0], node.inputs[1], optional_input(node, 2)

    def plan() -> tuple | None:
        """(cotangent of t, reads of S) when the reads' and the insert's positions are known."""
        if not isinstance(g, SeqGrad) or g.base is not None:
            return None
        n_out = static_length(ctx, node.outputs[0])
        p = None if pos is None else static_position(e, pos)
        if pos is not None and p is None:
            return None
        if p is None or p < 0:
            if n_out is None:
                return None
            where = n_out - 1 if p is None else p + n_out - 1
        else:
            where = p
        reads = _static_reads(e, g, n_out)
        if reads is None:
            return None
        rest = tuple((_i64(e, q if q < where else q - 1), gr) for q, grs in sorted(reads.items()) if q != where
                     for gr in grs)
        return _sum(e, reads.get(where, [])), rest

    static = plan()

    def index(dense: str) -> str:
        if pos is None:
            return _i64(e, -1)
        p = static_position(e, pos)
        if p is not None and p >= 0:
            return _i64(e, p)
        p64 = pos if e.dtype(pos) == I64 else e.op("Cast", [pos], to=onnx_dtype(I64), dtype=I64, shape=())
        return _from_back(ctx, p64, ctx.val(e.op("SequenceLength", [dense], dtype=I64, shape=())) - 1)

    dense_cache: list[tuple[str, str]] = []

    def dense_and_index() -> tuple[str, str]:
        if not dense_cache:
            dense = _dense(ctx, g)
            dense_cache.append((dense, index(dense)))
        return dense_cache[0]

    def dseq() -> SeqGrad | str | None:
        if static is not None:
            return SeqGrad(seq, static[1], zeros=structural_zeros(ctx, seq)) if static[1] else None
        dense, at = dense_and_index()
        return seq_op(e, "SequenceErase", [dense, at], seq)

    def dt() -> str | None:
        if static is not None:
            return static[0]
        dense, at = dense_and_index()
        return e.op("SequenceAt", [dense, at], like=t)

    return [dseq, dt, *[None] * (len(node.inputs) - 2)]


@vjp("SequenceErase", bounded=True, finite=True, reads=(), moves=True)
def sequence_erase(ctx: Ctx, node: Node, cts: list) -> list:
    """``S`` gets the cotangent with zeros of the erased element's shape inserted where it was (the back when
    the position is omitted). Reads at known positions pass through as reads, shifted past the erased one."""
    e, g = ctx.e, cts[0]
    seq, pos = node.inputs[0], optional_input(node, 1)

    def dseq() -> SeqGrad | str | None:
        n_in = static_length(ctx, seq)
        p = -1 if pos is None else static_position(e, pos)
        if isinstance(g, SeqGrad) and g.base is None and p is not None and (p >= 0 or n_in is not None):
            erased = p + n_in if p < 0 else p
            reads = _static_reads(e, g, None if n_in is None else n_in - 1)
            if reads is not None:
                moved = tuple((_i64(e, q if q < erased else q + 1), gr) for q, grs in reads.items() for gr in grs)
                return SeqGrad(seq, moved, zeros=structural_zeros(ctx, seq)) if moved else None
        dense = _dense(ctx, g)
        zero = _erased_zeros(ctx, seq, pos)
        if p == -1:  # the back: append
            return seq_op(e, "SequenceInsert", [dense, zero], seq)
        if p is not None and p >= 0 and n_in is not None and p < n_in - 1:
            return seq_op(e, "SequenceInsert", [dense, zero, _i64(e, p)], seq)
        # p + len when negative, through an appended placeholder so that the insert position stays below the
        # length (onnx's reference SequenceInsert takes a position equal to the length for 0)
        p64 = _i64(e, p) if p is not None else (pos if e.dtype(pos) == I64 else
                                                 e.op("Cast", [pos], to=onnx_dtype(I64), dtype=I64, shape=()))
        padded = seq_op(e, "SequenceInsert", [dense, zero], seq)
        if p is None or p < 0:
            p64 = _from_back(ctx, p64, e.op("SequenceLength", [padded], dtype=I64, shape=()))
        return seq_op(e, "SequenceErase", [seq_op(e, "SequenceInsert", [padded, zero, p64], seq)], seq)

    return [dseq, *[None] * (len(node.inputs) - 1)]


def _erased_zeros(ctx: Ctx, seq: str, pos: str | None) -> str:
    """Zeros of the shape of the element ``SequenceErase`` removes: static when the sequence's type gives every
    element one shape; else ``ConstantOfShape(Shape(.))`` of a ``SequenceAt`` of the sequence at the same
    position, one the graph has (the VJP of ``SequenceInsert`` writes both) or a new one."""
    e = ctx.e
    el = e.types.get(seq)
    dt = el.dtype if el is not None and el.dtype is not None else np.dtype(np.float32)
    if el is not None and el.shape is not None and all(isinstance(d, int) for d in el.shape):
        return e.op("ConstantOfShape", [e.ints(el.shape)], value=np.zeros(1, dt), dtype=dt, shape=el.shape)
    item = _same_read(ctx, seq, pos)
    if item is None:
        item = e.op("SequenceAt", [seq, pos if pos is not None else _i64(e, -1)], dtype=dt,
                    shape=None if el is None else el.shape)
    return e.zeros_like(item)


def _same_read(ctx: Ctx, seq: str, pos: str | None) -> str | None:
    """The output of a ``SequenceAt(seq, p)`` of the graph with p the position ``pos`` (the last element when
    ``None``): the same element, a tensor, which a loop can keep where it cannot keep the sequence."""
    e = ctx.e
    want = -1 if pos is None else static_position(e, pos)
    for out, node in ctx.producers.items():
        if node.op_type == "SequenceAt" and not node.domain and node.inputs[0] == seq:
            p = node.inputs[1]
            if p == pos or (want is not None and static_position(e, p) == want):
                return out
    return None


not_differentiable("integer result", "SequenceLength", bounded=False, finite=True)
not_differentiable("no inputs: a constant (the empty sequence)", "SequenceEmpty", bounded=False, finite=True)
