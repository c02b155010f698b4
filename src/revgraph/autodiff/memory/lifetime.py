"""Lifetimes: when each value of a graph is born and dies as the graph runs, and the peak of the bytes alive.

The planner's cut (:mod:`.plan`) counts the bytes a plan keeps from the forward; what a step costs in memory is
the most bytes alive at once, which also depends on **how long** each value lives: a value is born when its
producer runs and dies after its last reader (a graph output lives to the end). :func:`lifetimes` walks the
nodes in the order given (a gradient graph's own order: forward, then the backward as emitted, each
recomputation just before its first reader) as onnxruntime's sequential allocation planner does
(``onnxruntime/core/framework/allocation_planner.cc``):

- a tensor is freed after its last reader;
- the outputs of :data:`~.cost.ALIASING` operators (``Reshape``, ``Squeeze``, ``Unsqueeze``, ``Flatten``,
  ``Identity``) share their input's buffer;
- with ``reuse=True`` (onnxruntime's ``enable_mem_reuse``, on by default in a plain session), a new tensor takes
  the buffer of the most recently freed tensor of the same element size and shape (the same numbers, the same
  symbolic names: ``FindReusableTensor``/``SameSize``), which then stays allocated from its first tensor's birth
  to its last one's death, through the gap between them; graph outputs take no buffer. ``rg.Trainer`` turns that
  reuse off (:data:`revgraph.runtime.options.TRAINING_DEFAULT`), and ``reuse=False``, the default here, models it:
  each tensor has its own buffer from its birth to its death.

Not modelled: in-place kernels (an output written into a dying input: the model errs high by that output),
kernels' scratch space, what a subgraph allocates inside (the chunked loss's loop: about four ``[C, V]``
tensors), onnxruntime's arena (its free blocks, off in the checks below). The order is the graph's:
``rg.Trainer`` runs its steps so (``execution_order="priority_based"`` with no graph optimizations,
:data:`revgraph.runtime.options.TRAINING_DEFAULT`; ``simplify`` writes no ``CastLike``, which onnxruntime would
inline as new nodes and run last); onnxruntime's default order, a depth-first walk back from the outputs, is
another. Graph inputs and initializers (the batch, the parameters, the
optimizer state) are alive for the whole run and are counted apart (``resident``). Sizes come from the declared
types (:func:`.residuals.value_bytes`, symbolic dimensions from ``dims``); a value of unknown size counts 0 and is
listed in ``unknown``.

The planner (:mod:`.plan`) ranks the plans a budget allows by this peak. Checked against onnxruntime
(tests/test_lifetimes.py, a fresh process, the arena off, glibc's mmap threshold fixed so that freed tensors
leave the resident set): an MLP's gradient graph and a LLaMA's ``rg.Trainer`` step, by default and under
``memory=0.5``, within 15% (1-3% on the LLaMA).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ...ir import Graph, Node
from .cost import ALIASING
from .residuals import reads, value_bytes


@dataclass
class Lifetimes:
    """What :func:`lifetimes` found. ``peak``: the most bytes of intermediate values alive at once (bytes);
    ``at``: the index (in the order walked) of the node where it is reached; ``resident``: the bytes of graph
    inputs and initializers; ``alive``: the values alive at the peak, largest first (name -> bytes);
    ``unknown``: values of unknown size (counted as 0)."""

    peak: int = 0
    at: int = -1
    resident: int = 0
    alive: dict[str, int] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """``peak + resident``: the bytes of tensors alive at the peak, inputs and parameters included."""
        return self.peak + self.resident


def lifetimes(graph: Graph, dims: Mapping[str, int] | None = None,
              nodes: Sequence[Node] | None = None, reuse: bool = False) -> Lifetimes:
    """The peak of the bytes alive while ``graph``'s top-level ``nodes`` (default: ``graph.nodes``, in their
    order) run (module doc). ``dims``: sizes of symbolic dimensions (name -> int); a value with a symbolic
    dimension not in ``dims`` counts as unknown; ``reuse``: onnxruntime's planned buffer reuse on (a plain
    session's default) or off (``rg.Trainer``'s). Returns :class:`Lifetimes`. Pure: ``graph`` is not changed."""
    nodes = graph.nodes if nodes is None else nodes
    dims = {} if dims is None else dims
    resident_names = {vi.name for vi in graph.inputs} | set(graph.initializers)
    out = Lifetimes()
    for name in resident_names:
        size = value_bytes(graph.type_of(name), dims)
        out.resident += size or 0
    root: dict[str, str] = {}  # value -> the value whose buffer it shares (itself when it owns one)
    birth: dict[str, int] = {}
    death: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for name in reads(node):
            r = root.get(name)
            if r is not None:
                death[r] = k
        aliasing = node.op_type in ALIASING and node.domain in ("", "ai.onnx") and node.inputs
        source = None
        if aliasing:
            source = node.inputs[0] if node.inputs[0] in resident_names else root.get(node.inputs[0])
        for o in node.outputs:
            if not o or o in root:
                continue
            if source is not None:
                root[o] = source
            else:
                root[o] = o
                birth[o] = death[o] = k
    end = len(nodes)
    for name in graph.output_names:
        if name in root:
            death[root[name]] = end
    sizes: dict[str, int] = {}
    keys: dict[str, tuple] = {}
    for name in birth:
        vi = graph.type_of(name)
        size = value_bytes(vi, dims)
        if size is None:
            out.unknown.append(name)
        sizes[name] = size or 0
        keys[name] = _shape_key(vi, name)
    outputs = {root[n] for n in graph.output_names if n in root}
    # value -> the first value of the buffer it is planned into
    buffer = _reuse(birth, death, keys, outputs) if reuse else {n: n for n in birth}
    span: dict[str, list[int]] = {}
    for name, b in buffer.items():
        lo_hi = span.setdefault(b, [birth[name], death[name]])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], birth[name]), max(lo_hi[1], death[name])
    born: dict[int, list[str]] = {}
    dead: dict[int, list[str]] = {}
    for b, (lo, hi) in span.items():
        born.setdefault(lo, []).append(b)
        dead.setdefault(hi, []).append(b)
    live = 0
    for k in range(end + 1):
        live += sum(sizes[n] for n in born.get(k, ()))
        if live > out.peak:
            out.peak, out.at = live, k
        live -= sum(sizes[n] for n in dead.get(k, ()))
    if out.at >= 0:
        alive = [n for n in birth if birth[n] <= out.at <= death[n] and sizes[n]]
        out.alive = dict(sorted(((n, sizes[n]) for n in alive), key=lambda t: -t[1]))
    return out


def _shape_key(vi, name: str) -> tuple:
    """What onnxruntime's planner compares to reuse a buffer (``SameSize``: element size, rank, each dimension
    equal as a number or as the same symbolic name); a value of unknown type matches nothing."""
    if vi is None or vi.dtype is None or vi.shape is None or vi.kind != "tensor":
        return ("unique", name)
    return (np.dtype(vi.dtype).itemsize, tuple(vi.shape))


def _reuse(birth: dict[str, int], death: dict[str, int], keys: dict[str, tuple], outputs: set[str]) -> dict[str, str]:
    """onnxruntime's sequential planner's buffer reuse (``FindReusableTensor``): walking the values in the
    order they are born, a value takes the buffer of the most recently freed value of the same shape key, if
    any; a freed buffer is free from the step after its value's last reader. Graph outputs neither give nor
    take a buffer. Returns value -> the value that first owned its buffer."""
    owner: dict[str, str] = {}
    free: dict[tuple, list[str]] = {}  # shape key -> the freed values of that key, the most recent last
    pending: list[tuple[int, str]] = []  # (last reader, value): a heap of the buffers in use
    for name in sorted(birth, key=birth.__getitem__):
        k = birth[name]
        while pending and pending[0][0] < k:
            _, b = heapq.heappop(pending)
            free.setdefault(keys[b], []).append(b)
        stack = free.get(keys[name]) if name not in outputs else None
        if stack:
            owner[name] = owner[stack.pop()]
        else:
            owner[name] = name
        if name not in outputs:
            heapq.heappush(pending, (death[name], name))
    return owner
