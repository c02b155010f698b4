"""The one place where gradient contributions are added up: :class:`Accumulator` (DESIGN.md section 3).

Every contribution goes through it: the readers of a value version in the backward pass, the seeds of a loop
body's outputs (a body output that is both carried and scanned), the gradient of a loop-invariant value summed
over a backward loop's iterations, and the outputs of an ``If``'s branches.

**Sequences.** The cotangent of an ONNX sequence is a sequence of the same length whose element i is the
cotangent of element i (zeros for an element nothing depends on). It comes in two forms:

* dense: the name of a sequence value;
* :class:`SeqGrad`: the reads of ``SequenceAt`` nodes, ``(position, cotangent)`` pairs, plus an optional dense
  part. ``SequenceAt`` gives one read; the readers of one sequence concatenate their reads. Rules of the
  operators that made the sequence take reads at positions known when the graph is built without any sequence
  (``SplitToSequence`` -> ``SequenceAt(0)``, ``SequenceAt(1)`` is differentiated as ``Split``: one ``Concat`` of
  the cotangents with zeros for the unread pieces); anything else makes it dense (:func:`densify_sequence`):
  zeros of the sequence's structure, then each read added at its position, which may be a run-time value,
  with ``SequenceAt`` / ``SequenceInsert`` / ``SequenceErase`` (one update per distinct position: O(reads)
  nodes, never a node per element). Dense sequences add up elementwise in one loop over their elements whose
  body is a ``Sum`` (:func:`map_sequences`: ``SequenceMap`` written as its ``Loop``).

Everything emitted is standard ONNX (sequence operators and ``Loop``), so gradient graphs with sequences can be
differentiated again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import InternalError, RevgraphError
from ..ir import Graph, Node, ValueInfo, onnx_dtype
from ..onnx_io.value_types import keep_types, node_types, onnx_node_types
from . import sparse as sp
from .emitter import Emitter
from .sparse import SparseGrad

ACCUMULATE = ("sum", "running")
I64 = np.dtype(np.int64)


@dataclass(frozen=True)
class SeqGrad:
    """The cotangent of the sequence ``like`` given as ``reads``: ``(position, cotangent)`` pairs, an int32 or
    int64 scalar position (in ``[-n, n)``, as ``SequenceAt`` takes it) and the cotangent of the element read
    there (reads at one position add up), plus ``base``, a dense cotangent sequence (``None``: zeros).
    ``zeros(e)`` emits zeros of ``like``'s structure with ``e`` (``None``: a loop over ``like``,
    :func:`zeros_sequence`)."""

    like: str
    reads: tuple[tuple[str, str], ...]
    base: str | None = None
    zeros: Callable[[Emitter], str] | None = None


Grad = str | SparseGrad | SeqGrad


def is_sequence(types: dict[str, ValueInfo], name: str) -> bool:
    vi = types.get(name)
    return vi is not None and vi.kind == "sequence"


#: operators that make or read ONNX sequences
SEQUENCE_OPS = frozenset({"SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase", "SequenceAt",
                          "SequenceLength", "SplitToSequence", "ConcatFromSequence", "SequenceMap"})


def sequence_types(nodes: list[Node], types: dict[str, ValueInfo], values: dict[str, np.ndarray], opset: int) -> None:
    """Complete ``types`` with the values of ``nodes`` (in order) that have no type, in a graph with sequences:
    node by node inference keeps tensor results only (:func:`revgraph.onnx_io.value_types.onnx_node_types`), so a
    sequence, and everything computed from it, would stay untyped. ONNX's per-node inference for the nodes that make or
    read sequences, :func:`revgraph.onnx_io.value_types.node_types` for the others; a ``Loop``'s carried sequence
    outputs take the type of their initial values. Does nothing in a graph without sequences."""
    if not any(n.op_type in SEQUENCE_OPS for n in nodes) and not any(v.kind == "sequence" for v in types.values()):
        return
    for node in nodes:
        missing = [o for o in node.outputs if o and (types.get(o) is None or types[o].dtype is None)]
        if not missing or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Loop":
            for o, init in zip(node.outputs, node.inputs[2:], strict=False):
                vi = types.get(init)
                if o in missing and vi is not None and vi.kind == "sequence":
                    types[o] = ValueInfo(o, vi.dtype, vi.shape, "sequence")
            continue
        if node.subgraphs or any(i and i not in types for i in node.inputs):
            continue
        if node.op_type in SEQUENCE_OPS or any(is_sequence(types, i) for i in node.inputs if i):
            found = onnx_node_types(node, types, values, opset)  # ONNX's own: sequence types
        else:
            found = node_types(node, types, values, opset)
        for name, vi in found.items():
            if name in missing:
                types[name] = vi
    _forget_merged_dims(nodes, types)


def _forget_merged_dims(nodes: list[Node], types: dict[str, ValueInfo]) -> None:
    """Replace by ``None``, everywhere, the dimensions ONNX inference named ``unk__<k>`` in the type of a
    sequence's elements or of a ``SequenceAt`` result: the elements of one sequence may differ there
    (``SplitToSequence`` with sizes 2, 3, 4 gives ``('unk__0', 3)``), so each ``SequenceAt`` would get the same
    symbol, which tells onnxruntime that the tensors have equal shapes (it then shares their buffers and
    fails)."""
    merged = set()
    for node in nodes:
        names = node.outputs if node.op_type == "SequenceAt" else [*node.inputs, *node.outputs]
        for name in names:
            vi = types.get(name)
            if vi is not None and vi.shape is not None and (vi.kind == "sequence" or node.op_type == "SequenceAt"):
                merged.update(d for d in vi.shape if isinstance(d, str) and d.startswith("unk__"))
    if not merged:
        return
    for name, vi in list(types.items()):
        if vi.shape is not None and any(d in merged for d in vi.shape):
            types[name] = ValueInfo(name, vi.dtype, tuple(None if d in merged else d for d in vi.shape), vi.kind)


# ------------------------------------------------------------------------------------------ sequence helpers


def sequence_type(e: Emitter, name: str, like: str | ValueInfo | None) -> str:
    """Record ``name`` as a sequence with the element type of ``like`` (a value name or a type); return it."""
    vi = e.types.get(like) if isinstance(like, str) else like
    e.types[name] = ValueInfo(name, vi.dtype if vi else None, vi.shape if vi else None, "sequence")
    return name


def seq_op(e: Emitter, op_type: str, inputs: list[str], like: str | ValueInfo | None, **attrs) -> str:
    """Emit ``op_type`` whose output is a sequence with the element type of ``like``."""
    vi = e.types.get(like) if isinstance(like, str) else like
    if "dtype" in attrs:  # an ONNX attribute (SequenceEmpty's), which Emitter.op takes for the output's type
        name = e.fresh(f"{e.prefix}/{op_type}")
        e.nodes.append(Node(op_type, list(inputs), [name], attrs, name))
        return sequence_type(e, name, vi)
    dtype = vi.dtype if vi is not None and vi.dtype is not None else np.dtype(np.float32)
    return sequence_type(e, e.op(op_type, inputs, dtype=dtype, **attrs), vi)


def map_sequences(e: Emitter, seqs: list[str], build: Callable[[Emitter, list[str]], list[str]],
                  outs: list[ValueInfo], name: str, stack: bool = False) -> list[str]:
    """``SequenceMap`` written as the ``Loop`` it is defined by (ONNX "SequenceMap", its function body): a loop
    over the elements of the sequences ``seqs`` (all of one length), element i of each read with
    ``SequenceAt``, ``build(eb, elements)`` emitting the results of one iteration (of the element types
    ``outs``) with the body's emitter ``eb``; each result is appended to a carried sequence, or stacked as a
    scan output when ``stack`` (a tensor of shape ``[n, ...]``). Returns the sequences (or stacks).

    A ``Loop`` rather than a ``SequenceMap`` node: onnx's reference ``SequenceMap`` takes at most one
    additional sequence and fails inside a loop body, and the ``Loop`` VJP differentiates it again."""
    eb = e.child({}, f"{e.prefix}/{name}")
    i, cond = eb.fresh(f"{e.prefix}/{name}/i"), eb.fresh(f"{e.prefix}/{name}/cond")
    eb.types[i] = ValueInfo(i, I64, ())
    accs = [] if stack else [ValueInfo(eb.fresh(f"{e.prefix}/{name}/acc"), vi.dtype, vi.shape, "sequence")
                             for vi in outs]
    for a in accs:
        eb.types[a.name] = a
    xs = [eb.op("SequenceAt", [s, i], **_elem_type(e, s)) for s in seqs]
    results = build(eb, xs)
    body_outs = [ValueInfo(eb.op("Identity", [eb.const(np.array(True))]), np.dtype(bool), ())]
    for r, vi, a in zip(results, outs, accs or [None] * len(outs), strict=True):
        out = seq_op(eb, "SequenceInsert", [a.name, r], a) if a is not None else eb.op("Identity", [r])
        body_outs.append(ValueInfo(out, vi.dtype, vi.shape, "tensor" if stack else "sequence"))
    body = Graph(eb.nodes, [ValueInfo(i, I64, ()), ValueInfo(cond, np.dtype(bool), ()), *accs], body_outs,
                 name=name)
    keep_types(body, eb.types)
    n = e.op("SequenceLength", [seqs[0]], dtype=I64, shape=())
    initial = [seq_op(e, "SequenceEmpty", [], vi, dtype=onnx_dtype(vi.dtype or np.float32)) for vi in accs]
    loop = e.op("Loop", [n, "", *initial], n_out=len(outs), body=body)
    loop = [loop] if len(outs) == 1 else loop
    for r, vi in zip(loop, outs, strict=True):
        e.types[r] = ValueInfo(r, vi.dtype, None if vi.shape is None else (None, *vi.shape)) if stack else \
            ValueInfo(r, vi.dtype, vi.shape, "sequence")
    return loop


def _elem_type(e: Emitter, seq: str) -> dict:
    vi = e.types.get(seq)
    return {"dtype": vi.dtype if vi is not None and vi.dtype is not None else np.dtype(np.float32),
            "shape": vi.shape if vi is not None else None}


def _elem(e: Emitter, seq: str) -> ValueInfo:
    vi = e.types.get(seq)
    return ValueInfo("", vi.dtype if vi else None, vi.shape if vi else None)


def zeros_sequence(e: Emitter, like: str, fill: float = 0.0) -> str:
    """Zeros (or ``fill``) of the structure of the sequence ``like`` (its length, each element's shape): a loop
    over its elements (:func:`map_sequences`) whose body is ``ConstantOfShape(Shape(x))``."""
    el = _elem(e, like)
    dt = el.dtype if el.dtype is not None else np.dtype(np.float32)

    def build(eb: Emitter, xs: list[str]) -> list[str]:
        shape = eb.op("Shape", [xs[0]], dtype=I64, shape=(None if el.shape is None else len(el.shape),))
        return [eb.op("ConstantOfShape", [shape], value=np.full(1, fill, dt), dtype=dt, shape=el.shape)]

    return map_sequences(e, [like], build, [el], "zeros" if fill == 0 else "ones")[0]


def add_sequences(e: Emitter, parts: list[str]) -> str:
    """The elementwise sum of the sequences ``parts`` (same length and element shapes): one loop over their
    elements (:func:`map_sequences`) whose body is a ``Sum``."""
    if len(parts) == 1:
        return parts[0]
    el = _elem(e, parts[0])
    return map_sequences(e, parts, lambda eb, xs: [eb.op("Sum", xs, dtype=el.dtype, shape=el.shape)], [el], "sum")[0]


def static_position(e: Emitter, p: str) -> int | None:
    """The position ``p`` when it is known while the graph is built."""
    v = e.value(p)
    return None if v is None or np.asarray(v).size != 1 else int(np.asarray(v).reshape(-1)[0])


def group_reads(e: Emitter, reads: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """``reads`` with the cotangents of reads at the same position (the same value, or the same constant)
    summed: one ``(position, cotangent)`` per distinct position, in first-read order."""
    groups: dict[object, list[tuple[str, str]]] = {}
    for p, g in reads:
        k = static_position(e, p)
        groups.setdefault(("const", k) if k is not None else ("name", p), []).append((p, g))
    out = []
    for members in groups.values():
        gs = [g for _, g in members]
        out.append((members[0][0], gs[0] if len(gs) == 1 else e.op("Sum", gs, like=gs[0])))
    return out


def add_reads(e: Emitter, base: str, reads: tuple[tuple[str, str], ...]) -> str:
    """The sequence ``base`` with each read's cotangent added to the element at its position: for each
    distinct position p (normalised to ``[0, n)``), ``SequenceInsert(base, base[p] + g, p)`` then
    ``SequenceErase`` of the old element at p + 1. (Insert before erase: the position of the insert is then
    always below the length, which onnx's reference ``SequenceInsert`` needs: it takes a position equal to
    the length for 0.)"""
    seq = base
    for p, g in group_reads(e, reads):
        k = static_position(e, p)
        if k is not None and k >= 0:
            at, after = e.const(np.array(k, np.int64)), e.const(np.array(k + 1, np.int64))
        elif k is not None:  # negative: counted from the back, the old element is at k again after the insert
            at = after = e.const(np.array(k, np.int64))
        else:
            pos = p if e.dtype(p) == I64 else e.op("Cast", [p], to=onnx_dtype(I64), dtype=I64, shape=())
            n = e.op("SequenceLength", [seq], dtype=I64, shape=())
            at = e.op("Mod", [pos, n], dtype=I64, shape=())
            after = e.op("Add", [at, e.const(np.array(1, np.int64))], dtype=I64, shape=())
        old = e.op("SequenceAt", [seq, at], like=g)
        seq = seq_op(e, "SequenceInsert", [seq, e.op("Add", [old, g], like=g), at], base)
        seq = seq_op(e, "SequenceErase", [seq, after], base)
    return seq


def densify_sequence(e: Emitter, g: SeqGrad, zeros: Callable[[Emitter], str] | None = None) -> str:
    """The dense cotangent sequence of ``g``: its base (or zeros of the sequence's structure: ``zeros``, else
    ``g.zeros``, else :func:`zeros_sequence`) with the reads added (:func:`add_reads`)."""
    base = g.base
    if base is None:
        make = zeros or g.zeros
        base = make(e) if make is not None else zeros_sequence(e, g.like)
    return add_reads(e, base, g.reads) if g.reads else base


def densify(e: Emitter, g: Grad) -> str:
    """A dense cotangent: rows of a :class:`SparseGrad` scattered into zeros, a :class:`SeqGrad` made a sequence."""
    if isinstance(g, SparseGrad):
        return sp.densify(e, g)
    if isinstance(g, SeqGrad):
        return densify_sequence(e, g)
    return g


def zeros_like(e: Emitter, name: str) -> str:
    """Zeros like ``name``: a tensor's shape and dtype, or a sequence's structure (:func:`zeros_sequence`)."""
    return zeros_sequence(e, name) if is_sequence(e.types, name) else e.zeros_like(name)


# ------------------------------------------------------------------------------------------ the accumulator


class Accumulator:
    """Adds up the gradient contributions of each value version.

    ``mode="sum"``: contributions are kept until :meth:`total` is asked for the version (when its producer is
    reached in the reverse walk, or at the end for inputs), then added by one ``Sum`` node (Caffe2's
    ``GradientRegistry``). ``mode="running"``: each new dense contribution is added to the partial sum at once
    with ``Add``, so earlier terms can be freed sooner. Sparse contributions (:class:`SparseGrad`) concatenate;
    a mix of sparse and dense adds the rows into the dense sum with :func:`~revgraph.autodiff.sparse.add_rows`
    (``ScatterElements`` on flat views: onnxruntime's reducing ``ScatterND`` races on repeated indices when it
    runs on several threads). Sequence cotangents (module doc): dense ones add up elementwise in a loop,
    reads (:class:`SeqGrad`) concatenate, and the total of a sequence read by ``SequenceAt`` is a
    :class:`SeqGrad` (its dense contributions its base) until :meth:`dense_total`. Nodes are named
    ``accum/<value>``.

    Raises :class:`RevgraphError` for an unknown mode, :class:`InternalError` when a contribution arrives
    after the total was taken (a bug of the pass, exit 3).
    """

    def __init__(self, e: Emitter, mode: str = "sum"):
        if mode not in ACCUMULATE:
            raise RevgraphError(f"unknown accumulation {mode!r}; choose one of {', '.join(ACCUMULATE)}")
        self.e = e
        self.mode = mode
        self.dense: dict[str, list[str]] = defaultdict(list)
        self.sparse: dict[str, list[SparseGrad]] = defaultdict(list)
        self.reads: dict[str, list[SeqGrad]] = defaultdict(list)
        self.done: dict[str, Grad | None] = {}

    def add(self, value: str, grad: Grad) -> None:
        """One more contribution ``grad`` to the gradient of ``value``."""
        if value in self.done:
            raise InternalError(f"gradient of {value!r} used before all its contributions arrived")
        if isinstance(grad, SparseGrad):
            self.sparse[value].append(grad)
            return
        if isinstance(grad, SeqGrad):
            self.reads[value].append(grad)
            return
        parts = self.dense[value]
        if self.mode == "running" and parts:
            with self.e.scope(f"accum/{value}"):
                if is_sequence(self.e.types, parts[0]) or is_sequence(self.e.types, grad):
                    parts[:] = [add_sequences(self.e, [parts[0], grad])]
                else:
                    parts[:] = [self.e.op("Add", [parts[0], grad], like=parts[0])]
        else:
            parts.append(grad)

    def pending(self) -> list[str]:
        """The values with contributions whose total has not been taken, in the order they first arrived."""
        return [v for v in dict.fromkeys([*self.dense, *self.sparse, *self.reads]) if v not in self.done]

    def total(self, value: str) -> Grad | None:
        """The complete gradient of ``value`` (``None`` if nothing contributed); emits the accumulation once."""
        if value in self.done:
            return self.done[value]
        dense, rows, reads = self.dense.pop(value, []), self.sparse.pop(value, []), self.reads.pop(value, [])
        if len(dense) == 1 and not rows and not reads:  # one contribution (most values): nothing to emit
            self.done[value] = dense[0]
            return dense[0]
        result: Grad | None = None
        with self.e.scope(f"accum/{value}"):
            if len(dense) == 1:
                result = dense[0]
            elif dense and any(is_sequence(self.e.types, d) for d in dense):
                result = add_sequences(self.e, dense)
            elif dense:
                result = self.e.op("Sum", dense, like=dense[0])
            if rows:
                merged = sp.concat(self.e, rows)
                result = merged if result is None else sp.scatter_add(self.e, result, merged)
            if reads:
                bases = [b for b in [result, *(r.base for r in reads)] if b is not None]
                zeros = next((r.zeros for r in reads if r.zeros is not None), None)
                result = SeqGrad(value, tuple(x for r in reads for x in r.reads),
                                 add_sequences(self.e, bases) if bases else None, zeros)
        self.done[value] = result
        return result

    def rule_total(self, value: str) -> Grad | None:
        """:meth:`total` as VJP rules take it: a :class:`SparseGrad` densified, a :class:`SeqGrad` kept (the
        rules of operators that make sequences read it; the others never see one)."""
        g = self.total(value)
        if isinstance(g, SparseGrad):
            with self.e.scope(f"accum/{value}"):
                g = sp.densify(self.e, g)
            self.done[value] = g
        return g

    def dense_total(self, value: str) -> str | None:
        """:meth:`total`, densified (what loop bodies and graph outputs take)."""
        g = self.total(value)
        if isinstance(g, SparseGrad | SeqGrad):
            with self.e.scope(f"accum/{value}"):
                g = densify(self.e, g)
            self.done[value] = g
        return g
