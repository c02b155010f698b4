"""Fused linear cross-entropy: the output projection and the loss computed together, chunk by chunk of tokens.

A language model's loss reads logits ``[B, T, V]`` that a projection of the hidden states ``h [B, T, D]`` makes
(``MatMul(h, W)``, ``W [D, V]``, often a ``Transpose`` of the ``[V, D]`` lm_head weight; optionally ``+ bias``,
or a ``Gemm``; under mixed precision a ``Cast`` back to float32). At vocabulary 32000 those logits, their
log-softmax and their gradient are the largest tensors of a training step. With ``chunk_tokens=C``
(:func:`revgraph.train.losses.loss_graph`, ``loss_options={"chunk_tokens": C}``, ``revgraph train --loss-chunk C``)
the loss graph computes the cross-entropy as an ONNX ``Loop`` over chunks of ``C`` tokens (the idea of the
"fused linear cross-entropy" of Liger-Kernel, Hsu et al. 2024, and of Wijmans et al. 2024, "Cut your losses in
large-vocabulary language models"), so that the ``[B*T, V]`` logits never exist whole::

    h2 = Flatten(h) [N, D]   targets [N]   coefficients of each token's terms [N]   (N = B*T)
    sums = Loop over k < ceil(N / C):  logits_k = projection(h2[kC : kC + C])  [C, V]   (the last chunk shorter)
                                       sums[k] = sum(a_k * -log_softmax(logits_k)[target]) (+ smoothing term)
    loss = sum(sums) / den   (den: the counted targets' weights, [N]-sized work outside the loop)

The terms are those of :func:`revgraph.train.losses._cross_entropy` (``ignore_index``, ``label_smoothing``, class
weights, the divisor ``max(count, 1)``); only the order of the float sums differs (chunk by chunk), so the loss
and the gradients equal the unchunked ones to float32 rounding (tests/test_chunked_loss.py: 1e-6).

The backward must not keep the chunks' logits either: the loop's VJP under the ``store`` policy would stack each
iteration's ``[C, V]`` log-softmax, ``[N, V]`` in all. :func:`revgraph.training_graph` therefore differentiates
the chunk loops of :attr:`LossSpec.recompute <revgraph.train.losses.LossSpec>` with the ``recompute`` policy
(:class:`revgraph.autodiff.policies.PerLoop`; every other loop keeps ``checkpoint=``): the forward loop carries
nothing and keeps nothing but each chunk's sum, and each backward iteration recomputes its chunk's logits from
``h`` and ``W``: one more projection per step, the gradients of ``h`` and ``W`` summed over the chunks.

``chunk_tokens``: a whole number ``C >= 1`` (``C >= N``: one chunk), ``"off"``, or ``"auto"`` (the default):
chunked only under a memory budget (``Trainer(memory=)``, ``--memory-budget``, :func:`auto_chunk` has the rule).
A given ``C`` on logits that no recognizable projection makes (:func:`find_projection`) is refused in one line
naming the node; ``"auto"`` then computes the loss unchunked. Evaluation (:func:`revgraph.train.graphs.eval_graph`)
stays unchunked: it reads the whole logits for the accuracy anyway, batch by batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import RevgraphError
from ..ir import Graph, Node, ValueInfo
from ..ir.ssa import captured_names

I64 = np.int64

#: auto under a byte budget M: chunk when the [N, V] logits take more than this share of M ...
LOGITS_SHARE = 0.25
#: ... in chunks whose [C, V] logits take at most this share of M (a backward iteration holds about four
#: [C, V] tensors: the logits, log-softmax, its exponential and the cotangent)
CHUNK_SHARE = 1 / 16
#: auto under a fraction budget: chunks no smaller than this, so that each iteration's [C, D] x [D, V] product
#: outweighs the loop's overhead (bench/chunked_loss.py, V 32000, D 256, 2048 tokens: a step takes 1.2x the
#: unchunked one's time at C = 256, 1.6x at C = 64, for 468 and 400 MB against 926 MB)
MIN_AUTO_CHUNK = 256
#: the largest ``chunk_tokens`` accepted (a chunk's row count is an int64 in the graph; beyond this, one chunk)
MAX_CHUNK = 2**62


def check_chunk(value: object) -> int | str:
    """``chunk_tokens`` checked: a whole number from 1 to 2**62, ``"auto"`` or ``"off"`` (``None``: ``"auto"``;
    a digit string is the number, as the command line gives it). Raises :class:`RevgraphError` (one line)."""
    if value is None:
        return "auto"
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= int(value) <= MAX_CHUNK:
        raise RevgraphError(f"--loss-chunk (chunk_tokens=) must be a whole number of tokens from 1 to {MAX_CHUNK} "
                            f"(2**62), 'auto' or 'off', got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Projection:
    """The nodes that compute the logits from the hidden states: ``nodes[0]`` a ``MatMul`` or ``Gemm`` reading
    ``h`` as its first input, then ``Cast``/bias ``Add`` nodes, the last writing the logits. ``hidden``: ``D``."""

    h: str
    nodes: tuple[Node, ...]
    hidden: int | str | None
    rank: int  # of h and of the logits
    #: ``Slice`` nodes over token axes (never the class axis) between the projection and the logits, in the order
    #: they run: they commute with a row-wise projection, so the chunked loss applies them to ``h`` first
    #: (PyTorch's exporter writes ``logits[:, :-1]`` of a causal LM this way)
    slices: tuple[Node, ...] = ()


def find_projection(g: Graph, out: str, types: dict[str, ValueInfo]) -> tuple[Projection | None, str]:
    """The projection that computes the logits ``out`` of ``g`` row by row of ``h`` (module doc), or ``None`` and
    the reason, naming the node: a ``MatMul(h [..., D], W [D, V])`` or ``Gemm(h [N, D], W, bias)`` (``transA``
    0), possibly followed by ``Cast``, ``Add`` of a bias ``[V]``/``[1, V]`` and ``Slice`` nodes over token axes
    (constant axes, not the last), every value of the chain read by the next node only and the logits by nothing in
    the graph (else they would be computed whole anyway)."""
    producer = {o: n for n in g.nodes for o in n.outputs if o}
    readers: dict[str, int] = {}
    for n in g.nodes:
        for i in [*n.inputs, *(c for sub in n.subgraphs.values() for c in captured_names(sub))]:
            if i:
                readers[i] = readers.get(i, 0) + 1
    outputs = set(g.output_names) - {out}
    if readers.get(out) or out in outputs:
        who = next((n for n in g.nodes if out in n.inputs), None)
        return None, (f"the logits {out!r} are also read by {who.label() if who else 'a loop body or output'}, so "
                      "they are computed whole anyway")
    chain: list[Node] = []
    slices: list[Node] = []
    v = out
    while True:
        nd = producer.get(v)
        if nd is None:
            return None, f"the logits {out!r} come from no MatMul or Gemm (a graph input or initializer {v!r})"
        if nd.domain not in ("", "ai.onnx"):
            return None, f"the logits {out!r} come from {nd.label()}, not a MatMul or Gemm projection"
        if v != out and (readers.get(v, 0) != 1 or v in outputs):
            return None, f"{nd.label()}'s output {v!r} is read elsewhere too: the projection is not the loss's alone"
        if nd.op_type == "Slice":
            why = _token_slice(g, nd, types)
            if why:
                return None, f"the logits {out!r} come from {nd.label()}, {why}"
            slices.insert(0, nd)
            v = nd.inputs[0]
            continue
        chain.insert(0, nd)
        if nd.op_type in ("MatMul", "Gemm"):
            break
        if nd.op_type == "Cast" and onnx.helper.tensor_dtype_to_np_dtype(nd.attrs.get("to", 0) or 1).kind == "f":
            v = nd.inputs[0]
            continue
        if nd.op_type == "Add" and len(nd.inputs) == 2:
            k = next((k for k in (0, 1) if _is_bias(types.get(nd.inputs[1 - k]))), None)
            if k is not None and nd.inputs[k] in producer:
                v = nd.inputs[k]
                continue
        return None, (f"the logits {out!r} come from {nd.label()}, not a MatMul(h, W) or Gemm projection (with "
                      "Cast and a bias Add of shape [V])")
    mm = chain[0]
    h, w = mm.inputs[0], mm.inputs[1]
    hv, wv, ov = types.get(h), types.get(w), types.get(out)
    rank = None if ov is None or ov.shape is None else len(ov.shape)
    if wv is None or wv.shape is None or len(wv.shape) != 2 or hv is None or hv.shape is None or len(hv.shape) != rank:
        return None, f"{mm.label()} is not a product of hidden states [..., D] and a weight [D, V] of known shapes"
    if mm.op_type == "Gemm":
        if mm.attrs.get("transA", 0) or (len(mm.inputs) > 2 and mm.inputs[2] and not _is_bias(types.get(mm.inputs[2]))):
            return None, f"{mm.label()} has transA or a bias of more than one row: not chunked by rows"
        hidden = wv.shape[1 if mm.attrs.get("transB", 0) else 0]
    else:
        hidden = wv.shape[0]
    return Projection(h, tuple(chain), hidden, rank, tuple(slices)), ""


def _token_slice(g: Graph, node: Node, types: dict[str, ValueInfo]) -> str:
    """Why the ``Slice`` ``node`` on the way to the logits cannot be moved before the projection, or ``""`` when
    its axes are known (constants, or shape arithmetic over them: ``types`` are ``g``'s) and none is the class
    axis (the last)."""
    from ..onnx_io.value_types import constant_values

    data = types.get(node.inputs[0])
    rank = None if data is None or data.shape is None else len(data.shape)
    if rank is None:
        return "a Slice of logits of unknown rank"
    values = constant_values(g, types)
    if len(node.inputs) > 3 and node.inputs[3]:
        axes = values.get(node.inputs[3])
    else:  # no axes: the first len(starts) axes
        starts = values.get(node.inputs[1])
        axes = None if starts is None else np.arange(np.asarray(starts).size)
    if axes is None:
        return "a Slice whose axes are not constants"
    if any(int(a) % rank == rank - 1 for a in np.asarray(axes).reshape(-1)):
        return "a Slice of the class axis: the loss would not see every class"
    return ""


def _is_bias(vi: ValueInfo | None) -> bool:
    """A bias that broadcasts over the rows of ``[C, V]`` and keeps its rank 2: ``[V]``, ``[1, V]`` or a scalar."""
    return vi is not None and vi.shape is not None and len(vi.shape) <= 2 and all(d == 1 for d in vi.shape[:-1])


def auto_chunk(vi: ValueInfo, hidden: int | str | None, budget) -> int | None:
    """The chunk size ``"auto"`` chooses for logits of type ``vi`` (``[..., V]``) projected from ``hidden``
    features under ``budget`` (a :class:`revgraph.Budget`, or ``None``), or ``None`` (unchunked).

    ``N`` (the tokens) is the product of the logits' leading dimensions, a symbolic one sized by ``budget.dims``
    or else 64 (the memory planner's :data:`~revgraph.autodiff.memory.budget.DEFAULT_SYMBOLIC_DIM`), ``s`` the
    dtype's bytes. No budget, or the fraction 1: unchunked. A byte budget ``M``: chunked when the logits' ``N V s``
    bytes exceed ``M / 4`` (:data:`LOGITS_SHARE`), in chunks of the largest power of two ``C`` with ``C V s <=
    M / 16`` (:data:`CHUNK_SHARE`; at least 1). A fraction below 1: chunks whose logits are about the size of the
    hidden states ``[N, D]`` (Liger-Kernel's rule) but of at least 256 tokens (:data:`MIN_AUTO_CHUNK`): ``C`` the
    power of two at or above ``max(N D / V, 256)``, unchunked when that is ``N`` or more.
    """
    from ..autodiff.memory.budget import DEFAULT_SYMBOLIC_DIM

    if budget is None or budget.fraction == 1.0 or vi.shape is None or not isinstance(vi.shape[-1], int):
        return None
    classes, size = vi.shape[-1], np.dtype(vi.dtype).itemsize
    n = 1
    for d in vi.shape[:-1]:
        n *= d if isinstance(d, int) else budget.dims.get(d, DEFAULT_SYMBOLIC_DIM) if isinstance(d, str) else \
            DEFAULT_SYMBOLIC_DIM
    if budget.bytes is not None:
        if n * classes * size <= budget.bytes * LOGITS_SHARE:
            return None
        rows = max(1, int(budget.bytes * CHUNK_SHARE) // (classes * size))
        return 1 << (rows.bit_length() - 1)
    if not isinstance(hidden, int):
        return None
    c = 1 << max(0, math.ceil(math.log2(max(n * hidden / classes, MIN_AUTO_CHUNK))))
    return c if c < n else None


def chunked_cross_entropy(b, proj: Projection, targets: str, dt, opts: dict, chunk: int) -> tuple[str, str]:
    """The mean cross-entropy of the logits ``proj`` computes, at ``targets`` (int64, the logits' shape without
    the class axis), with the options of :func:`revgraph.train.losses._cross_entropy`, as a ``Loop`` over chunks of
    ``chunk`` tokens (module doc). ``b``: the loss's node builder. Returns ``(loss, name of the Loop node)``."""
    ii, smooth, w = opts["ignore_index"], opts["label_smoothing"], opts["class_weights"]
    to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    h = proj.h
    for s in proj.slices:  # token slices of the logits, taken of h instead (they commute with the projection)
        h = b.op("Slice", [h, *s.inputs[1:]])
    h2 = b.op("Flatten", [h], axis=proj.rank - 1)  # [N, D]
    t = b.op("Reshape", [targets, b.const([-1], I64)])
    counted = table = None
    weight = None  # each token's weight in both sums ([N]; None: every token weighs 1)
    if ii is not None:  # ignored targets pick class 0 (any valid index) and weigh 0
        mask = b.op("Not", [b.op("Equal", [t, b.const(ii, I64)])])
        t = b.op("Where", [mask, t, b.const(0, I64)])
        weight = counted = b.op("Cast", [mask], to=to)
    if w is not None:
        table = b.const(np.asarray(w), dt)
        wy = b.op("Gather", [table, t], axis=0)
        weight = wy if counted is None else b.op("Mul", [wy, counted])
    n = b.op("Size", [t])
    if weight is None:  # the mean over the N tokens
        den = b.op("Cast", [n], to=to)
    elif w is None:  # a count of targets: 0 or >= 1, so max(count, 1) (as losses.py, for the sign analysis)
        den = b.op("Max", [b.op("ReduceSum", [weight], keepdims=0), b.const(1.0, dt)])
    else:  # class weights may sum below 1
        den = b.op("ReduceSum", [weight], keepdims=0)
        den = b.op("Where", [b.op("Greater", [den, b.const(0.0, dt)]), den, b.const(1.0, dt)])
    # each token's terms: (1 - S) weight nll + S counted uniform (torch's smoothing term is not class-weighted
    # per target: it weighs every class by its own weight inside ``uniform``)
    a = weight if not smooth or weight is None else b.op("Mul", [weight, b.const(1.0 - smooth, dt)])
    u = None if not smooth or counted is None else b.op("Mul", [counted, b.const(smooth, dt)])
    size = b.const(chunk, I64)
    trips = b.op("Div", [b.op("Add", [n, b.const(chunk - 1, I64)]), size])
    body = _body(b, proj, h2, t, a, u, smooth, table, dt, size)
    num = b.fresh(f"{b.prefix}/chunks")
    name = b.fresh(f"{b.prefix}/chunked")
    b.nodes.append(Node("Loop", [trips, ""], [num], {"body": body}, name))
    return b.op("Div", [b.op("ReduceSum", [num], keepdims=0), den]), name


def _body(b, proj: Projection, h2: str, t: str, a: str | None, u: str | None, smooth: float, table, dt,
          size: str) -> Graph:
    """The chunk loop's body: ``(k, cond) -> (cond, the sum of chunk k's terms)``, a scan output. ``a`` / ``u``:
    each token's coefficient of its nll / uniform term ([N], captured), ``None`` for the constants ``1 - S`` /
    ``S``."""
    from .graphbuild import Builder

    e = Builder(b.used)
    e.prefix = f"{b.prefix}/chunk"
    k, cond = e.fresh("chunk_k"), e.fresh("chunk_cond")
    axes = e.const([0], I64)
    start = e.op("Unsqueeze", [e.op("Mul", [k, size]), axes])
    end = e.op("Add", [start, e.op("Unsqueeze", [size, axes])])

    def rows(v: str) -> str:  # rows kC .. kC + C of a [N, ...] value (the last chunk shorter: Slice clamps)
        return e.op("Slice", [v, start, end, axes])

    logits, prev = rows(h2), proj.h
    for nd in proj.nodes:  # the projection again, on the chunk's rows (MatMul/Gemm, then Cast / bias Add)
        logits, prev = e.op(nd.op_type, [logits if i == prev else i for i in nd.inputs], **nd.attrs), nd.outputs[0]
    logp = e.op("LogSoftmax", [logits], axis=1)
    last = e.const([1], I64)
    picked = e.op("Squeeze", [e.op("GatherElements", [logp, e.op("Unsqueeze", [rows(t), last])], axis=1), last])
    if a is not None:
        picked = e.op("Mul", [picked, rows(a)])
    terms = e.op("Neg", [e.op("ReduceSum", [picked], keepdims=0)])
    if smooth and a is None:
        terms = e.op("Mul", [terms, e.const(1.0 - smooth, dt)])
    if smooth:  # -sum_c w_c log p_c / C per counted token (w = 1 without class weights)
        lp = logp if table is None else e.op("Mul", [logp, table])
        uniform = e.op("Neg", [e.op("ReduceMean", [lp, last], keepdims=0)])
        uniform = e.op("Mul", [uniform, rows(u) if u is not None else e.const(smooth, dt)])
        terms = e.op("Add", [terms, e.op("ReduceSum", [uniform], keepdims=0)])
    cond_out = e.op("Identity", [cond])
    return Graph(e.nodes, [ValueInfo(k, np.dtype(I64), ()), ValueInfo(cond, np.dtype(bool), ()),
                           ],
                 [ValueInfo(cond_out, np.dtype(bool), ()), ValueInfo(terms, np.dtype(dt), ())],
                 name=f"{b.prefix}/chunk_body".replace("/", "_"))


def plan(g: Graph, out: str, vi: ValueInfo, chunk: int | str, memory) -> tuple[Projection, int] | None:
    """``(projection, C)`` when the loss on the logits ``out`` (type ``vi``) of ``g`` is computed in chunks of
    ``C`` tokens, else ``None``: ``chunk`` is :func:`check_chunk`'s value, ``memory`` the budget of ``"auto"``
    (:func:`auto_chunk`). Raises :class:`RevgraphError` (one line, naming the node) for a given ``C`` and logits
    that no projection makes (:func:`find_projection`); ``"auto"`` falls back to ``None`` then."""
    from ..autodiff.memory.budget import as_budget
    from ..onnx_io.value_types import infer_types

    budget = as_budget(memory)
    if chunk == "off" or (chunk == "auto" and (budget is None or budget.fraction == 1.0)):
        return None
    proj, why = find_projection(g, out, infer_types(g))
    if proj is None:
        if chunk == "auto":
            return None
        raise RevgraphError(f"--loss-chunk {chunk} (chunk_tokens=): {why}; give --loss-chunk off (or leave it "
                            "out) to compute the loss from the whole logits")
    size = auto_chunk(vi, proj.hidden, budget) if chunk == "auto" else chunk
    return None if size is None else (proj, size)
