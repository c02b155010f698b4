"""The parts every ``Loop`` VJP shares: a loop taken apart into named slots, the forward patch that counts its
trips, and the backward loop (its body's inputs, and the loop node that runs it) (DESIGN.md section 4).

The backward loop runs ``count`` iterations. Its body's inputs are the backward iteration number ``k``, a
condition, one cotangent per floating-point loop-carried value (starting from the cotangent of the loop's final
output) and one accumulator per captured, loop-invariant value on a path from a wrt value (starting at zero).
Its outputs are the carried cotangents for the previous iteration and the accumulators plus this iteration's
contribution. So the initial value of a carried value gets what the last backward iteration produces, and a
loop-invariant value the sum over all iterations (MegEngine's ``LoopGrad``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo
from ...ir.ssa import captured_names
from ...onnx_io.value_types import differentiable, infer_types, keep_types
from ..accumulate import (
    Accumulator,
    Grad,
    SeqGrad,
    add_sequences,
    densify,
    sequence_types,
    zeros_like,
)
from ..context import Ctx, ForwardPatch, PatchedVJP
from ..emitter import Emitter
from ..sparse import SparseGrad
from .output_types import inferred_outputs, settle_carried

I64, BOOL = np.dtype(np.int64), np.dtype(bool)


@dataclass(frozen=True)
class LoopParts:
    """A ``Loop`` node taken apart: body names by role, body types, and which values need cotangents."""

    node: Node
    body: Graph
    n_carried: int
    iter_in: str  # the body's iteration number
    cond_in: str  # the body's condition input
    v_in: list[str]  # body inputs of the loop-carried values
    v_out: list[str]  # body outputs of the loop-carried values
    scan_out: list[str]  # body outputs stacked as scan outputs
    types: dict[str, ValueInfo]  # types of the body's values (shared with the backward body)
    carried: list[int]  # positions of floating-point carried values
    captured: list[str]  # floating-point captured values on a path from a wrt value

    @property
    def wrt(self) -> list[str]:
        """The body values whose cotangents the backward body computes."""
        return [self.v_in[j] for j in self.carried] + self.captured


def body_types(body: Graph, outer: dict[str, ValueInfo], hints: dict[str, ValueInfo] | None = None
               ) -> dict[str, ValueInfo]:
    """Types of a subgraph's values, inferred with its captured values declared from ``outer`` and its inputs
    as ``hints`` says where it has one."""
    captured = [outer.get(c) or ValueInfo(c) for c in captured_names(body)]
    inputs = [(hints or {}).get(v.name, v) for v in body.inputs]
    outputs, declared = body.outputs, body.value_info
    if hints:  # sequences declared without an element shape: inferred from the hints instead
        outputs = [ValueInfo(v.name) if v.kind == "sequence" and v.shape is None else v for v in outputs]
        declared = {k: v for k, v in declared.items() if v.kind != "sequence" or v.shape is not None}
    probe = Graph(body.nodes, [*inputs, *captured], outputs, body.initializers, declared)
    types = infer_types(probe)
    for c in captured:
        types.setdefault(c.name, c)
    sequence_types(body.nodes, types, {}, body.opset)
    completed = complete_loop_types(body.nodes, types)
    if completed:  # inferred again from them, so that the values computed from an inner loop's results have shapes
        probe.value_info = {**probe.value_info, **completed}
        refine(types, infer_types(probe))
    return types


def refine(types: dict[str, ValueInfo], better: dict[str, ValueInfo]) -> None:
    """Take from ``better`` the types ``types`` lacks or knows without a shape."""
    for name, vi in better.items():
        old = types.get(name)
        if old is None or (old.shape is None and vi.shape is not None and old.kind == vi.kind):
            types[name] = vi


def complete_loop_types(nodes: list[Node], types: dict[str, ValueInfo],
                        values: Mapping[str, np.ndarray] | None = None) -> dict[str, ValueInfo]:
    """Give the final value of each carried tensor of each ``Loop`` in ``nodes`` (not in their bodies) the shape
    its body declares, where ``types`` has none: ONNX's inference leaves a loop's carried outputs unshaped (a
    carried value may change shape in general), so rules reading them later would need ``Shape`` nodes or refuse
    (an unknown rank) and their residuals would have no size. Where the body declares its input and output
    with one fixed shape and the initial value's known shape agrees, that shape; otherwise, and for scan outputs,
    the type inferred from the body (:func:`.output_types.inferred_outputs`; ``values``: the enclosing graph's
    constants, for the trip count). Returns the types it set."""
    completed: dict[str, ValueInfo] = {}
    for node in nodes:
        if node.op_type != "Loop" or "body" not in node.attrs:
            continue
        if all(not o or (types.get(o) is not None and types[o].shape is not None) for o in node.outputs):
            continue
        _declared_carried(node, types, completed)
        if any(o and (types.get(o) is None or types[o].shape is None) for o in node.outputs):
            for out, vi in inferred_outputs(node, types, body_types, values).items():
                if types.get(out) is None or types[out].shape is None:
                    types[out] = completed[out] = vi
    return completed


def _declared_carried(node: Node, types: dict[str, ValueInfo], completed: dict[str, ValueInfo]) -> None:
    """The carried outputs of ``node`` whose body declares one fixed shape for them (:func:`complete_loop_types`)."""
    body: Graph = node.attrs["body"]
    n = len(node.inputs) - 2
    for j, out in enumerate(node.outputs[:n]):
        known = types.get(out)
        if not out or j + 2 >= len(body.inputs) or j + 1 >= len(body.outputs) or (
                known is not None and known.shape is not None):
            continue
        a, b, init = body.inputs[2 + j], body.outputs[1 + j], types.get(node.inputs[2 + j])
        fixed = a.shape is not None and all(isinstance(d, int) for d in a.shape)
        if not (fixed and a.kind == b.kind == "tensor" and a.shape == b.shape and a.dtype is not None
                and b.dtype in (None, a.dtype)):
            continue
        if init is not None and init.shape is not None and init.shape != a.shape:
            continue
        types[out] = completed[out] = ValueInfo(out, a.dtype, a.shape)


def take_apart(ctx: Ctx, node: Node) -> LoopParts:
    """``node``'s slots; :class:`GraphError` for a carried value whose shape changes between iterations."""
    outer = ctx.e.types
    body: Graph = node.attrs["body"]
    n = len(node.inputs) - 2
    v_in = body.input_names[2:]
    types = _carried_sequence_types(body, outer, node) or loop_body_types(body, outer, node)
    for j, name in enumerate(v_in):  # carried inputs take the types of the initial values when undeclared
        if types.get(name) is None or types[name].dtype is None:
            src = outer.get(node.inputs[2 + j])
            if src is not None:
                types[name] = ValueInfo(name, src.dtype, src.shape, src.kind)
    sequence_types(body.nodes, types, {}, body.opset)
    for a, b in zip(v_in, body.output_names[1 : 1 + n], strict=True):
        sa, sb = (types.get(x).shape if types.get(x) else None for x in (a, b))
        if _changes_shape(sa, sb):
            raise GraphError(
                f"{node.label()}: loop-carried value {a!r} enters an iteration with shape {list(sa)} and leaves it as "
                f"{b!r} with shape {list(sb)}; revgraph differentiates loops whose carried values keep their shape"
            )
    carried = [j for j in range(n) if differentiable(outer.get(node.inputs[2 + j]) or types.get(v_in[j]))]
    captured = [c for c in captured_names(body) if c in ctx.reach and differentiable(outer.get(c))]
    return LoopParts(node, body, n, body.input_names[0], body.input_names[1], v_in, body.output_names[1 : 1 + n],
                     body.output_names[1 + n :], types, carried, captured)


def loop_body_types(body: Graph, outer: dict[str, ValueInfo], node: Node) -> dict[str, ValueInfo]:
    """The body's types; where a carried tensor's body input declares no shape (tf2onnx's ``tf.while_loop``),
    with the carried inputs typed as they hold through every iteration (:func:`.output_types.settle_carried`)."""
    if all(v.shape is not None or v.kind != "tensor" for v in body.inputs[2:]):
        return body_types(body, outer)
    settled = settle_carried(node, outer, body_types)
    return settled[1] if settled is not None else body_types(body, outer)


def _carried_sequence_types(body: Graph, outer: dict[str, ValueInfo], node: Node) -> dict[str, ValueInfo] | None:
    """The body's types with each carried sequence whose body input declares no element shape taking its initial
    value's (a scripted loop appending to a list declares none), when the body keeps that element shape (the
    sequence it outputs has it too); ``None`` when no carried sequence gets one. Without it, a tensor read out of
    the carried sequence has no fixed shape and could not be kept per iteration."""
    n = len(node.inputs) - 2
    hints = {}
    for v, init in zip(body.inputs[2:], node.inputs[2:], strict=True):
        src = outer.get(init)
        if v.kind == "sequence" and v.shape is None and src is not None and src.kind == "sequence" and src.shape:
            hints[v.name] = ValueInfo(v.name, v.dtype if v.dtype is not None else src.dtype, src.shape, "sequence")
    if not hints:
        return None
    types = body_types(body, outer, hints)
    for v, out in zip(body.inputs[2:], body.output_names[1 : 1 + n], strict=True):
        found = types.get(out)
        if v.name in hints and (found is None or found.shape != hints[v.name].shape):
            return None
        if v.name in hints:
            types[v.name] = hints[v.name]
    return types


def _changes_shape(before: tuple | None, after: tuple | None) -> bool:
    """True when two declared shapes certainly differ (rank, or a static dimension)."""
    if before is None or after is None:
        return False
    if len(before) != len(after):
        return True
    return any(isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(before, after, strict=True))


def count_trips(e: Emitter, p: LoopParts, patch: ForwardPatch) -> str:
    """Add to ``patch`` a loop-carried iteration counter for the forward loop, so that the trip count T is known
    also when the condition stopped the loop early (T may be 0); return the trip count's name."""
    name = p.node.name
    zero, one = e.fresh(f"{name}/count_init"), e.fresh(f"{name}/one")
    count_in, count_out = e.fresh(f"{name}/count_in"), e.fresh(f"{name}/count_out")
    trips = e.fresh(f"{name}/trip_count")
    patch.before.append(Node("Constant", [], [zero], {"value": np.array(0, np.int64)}, zero))
    patch.body += [Node("Constant", [], [one], {"value": np.array(1, np.int64)}, one),
                   Node("Add", [p.iter_in, one], [count_out], name=count_out)]
    patch.carried.append((zero, ValueInfo(count_in, I64, ()), ValueInfo(count_out, I64, ()), trips))
    e.types[trips] = ValueInfo(trips, I64, ())
    e.types[zero] = ValueInfo(zero, I64, ())
    return trips


@dataclass(frozen=True)
class BackwardBody:
    """The body of a backward loop while it is built: its emitter ``e`` and its input slots."""

    e: Emitter
    k: ValueInfo  # the backward iteration number
    cond: ValueInfo
    cot: dict[int, ValueInfo]  # carried position -> the cotangent of the carried value after the iteration
    acc: dict[str, ValueInfo]  # captured value -> its gradient summed over the later iterations


def open_body(ctx: Ctx, p: LoopParts) -> BackwardBody:
    """A new backward-loop body for ``p``, with its inputs declared."""
    base = f"grad/{p.node.name}"
    eb = ctx.e.child(p.types, f"{base}/body")  # shared types: what the body's rules record are residual types

    def slot(name: str, vi: ValueInfo | None) -> ValueInfo:
        info = ValueInfo(eb.fresh(name), *(vi or ValueInfo("")).dtype_shape, (vi or ValueInfo("")).kind)
        eb.types[info.name] = info
        return info

    return BackwardBody(eb, slot(f"{base}/k", ValueInfo("", I64, ())), slot(f"{base}/cond", ValueInfo("", BOOL, ())),
                        {j: slot(f"{base}/cot_{p.v_in[j]}", p.types.get(p.v_in[j])) for j in p.carried},
                        {c: slot(f"{base}/acc_{c}", ctx.e.types.get(c)) for c in p.captured})


def body_seeds(eb: Emitter, p: LoopParts, cot: dict[int, ValueInfo], scan_seed: Callable[[int, str], str | None],
               mode: str = "sum") -> dict[str, str]:
    """The cotangent seeds of the body outputs: the carried cotangents, and ``scan_seed(s, name)`` for scan
    output s; a body output listed twice gets the sum of its seeds (through the :class:`Accumulator`, adding
    up as ``mode``, the options' ``accumulate``)."""
    acc = Accumulator(eb, mode)
    for j in p.carried:
        acc.add(p.v_out[j], cot[j].name)
    for s, name in enumerate(p.scan_out):
        if differentiable(p.types.get(name)):
            seed = scan_seed(s, name)
            if seed is not None:
                acc.add(name, seed)
    return {y: acc.dense_total(y) for y in acc.pending()}


def settle(p: LoopParts, bb: BackwardBody, grads: dict[str, Grad]) -> tuple[dict, dict, list[Node]]:
    """The body VJP's cotangents made dense where they are sequence reads (:class:`SeqGrad`) or rows, before the
    residuals are planned (the positions read and the shapes of zeros are body values): the carried cotangents,
    and each captured value's new
    accumulator (its accumulator slot with the reads added). Returns ``(carried, captured, nodes)``: the
    carried cotangents by position, the captured contributions (a name in ``bb.acc`` terms already summed
    for a :class:`SeqGrad`; see :func:`close_loop`), and the nodes emitted."""
    ed = bb.e.child(p.types, f"grad/{p.node.name}/body")
    ed.learn_constants(p.body)
    carried: dict[int, Grad | None] = {}
    for j in p.carried:
        g = grads.get(p.v_in[j])
        if isinstance(g, SeqGrad) and g.base is None:
            refuse_unknown_structure(p, j)
        carried[j] = densify(ed, g) if isinstance(g, SeqGrad | SparseGrad) else g  # zeros of a table: planned too
    captured: dict[str, Grad | None] = {}
    for c in p.captured:
        g = grads.get(c)
        if isinstance(g, SeqGrad):  # the slot with the reads added: the whole new accumulator
            base = bb.acc[c].name if g.base is None else add_sequences(ed, [bb.acc[c].name, g.base])
            g = Total(densify(ed, SeqGrad(g.like, g.reads, base)))
        captured[c] = g
    return carried, captured, ed.nodes


class Total(str):
    """A captured value's complete new accumulator (:func:`settle`), which :func:`close_loop` does not add to
    the accumulator slot again."""


def close_loop(ctx: Ctx, p: LoopParts, bb: BackwardBody, count: str, cts: list, carried: dict[int, Grad | None],
               captured: dict[str, Grad | None], patch: ForwardPatch) -> PatchedVJP:
    """Finish the body ``bb`` (its outputs: the carried cotangents ``carried`` of this iteration, and each
    accumulator plus this iteration's ``captured`` contribution, or the new accumulator itself for a
    :class:`Total`), emit the backward ``Loop`` of ``count`` iterations, and return the node's VJP. A carried
    sequence's cotangent is a carried sequence."""
    e, eb, node = ctx.e, bb.e, p.node
    outs = [ValueInfo(eb.op("Identity", [eb.const(np.array(True))]), BOOL, ())]
    for j in p.carried:
        g = carried.get(j)
        if g is None or (isinstance(g, SeqGrad) and g.base is None):
            refuse_unknown_structure(p, j)
        g = eb.zeros_like(p.v_in[j]) if g is None else densify(eb, g)
        outs.append(ValueInfo(eb.op("Identity", [g]), *_type(p.types, p.v_in[j])))
    rows = {c: g for c in p.captured if (g := _fixed_rows(eb, captured.get(c))) is not None}
    summed = [c for c in p.captured if c not in rows]
    acc = Accumulator(eb, ctx.options.accumulate)
    for c in summed:
        if not isinstance(captured.get(c), Total):
            acc.add(c, bb.acc[c].name)
        if captured.get(c) is not None:
            acc.add(c, str(captured[c]) if isinstance(captured[c], Total) else captured[c])
        outs.append(ValueInfo(eb.op("Identity", [acc.dense_total(c)]), *_type(e.types, c)))
    for g in rows.values():  # scan outputs: each iteration's rows, stacked
        outs += [ValueInfo(eb.op("Identity", [g.indices]), I64, eb.shape(g.indices)),
                 ValueInfo(eb.op("Identity", [g.values]), eb.dtype(g.values), eb.shape(g.values))]
    inputs = [bb.k, bb.cond, *bb.cot.values(), *(bb.acc[c] for c in summed)]
    bwd_body = Graph(eb.nodes, inputs, outs, name=f"grad_{node.name}_body")
    keep_types(bwd_body, eb.types)

    initial = [densify(e, cts[j]) if cts[j] is not None else zeros_like(e, node.outputs[j]) for j in p.carried]
    initial += [zeros_like(e, c) for c in summed]
    n_out = len(initial) + 2 * len(rows)
    results = e.op("Loop", [count, e.const(np.array(True)), *initial], n_out=n_out, body=bwd_body)
    results = [results] if n_out == 1 else results
    for name, src in zip(results, [node.inputs[2 + j] for j in p.carried] + summed, strict=False):
        e.types[name] = ValueInfo(name, *_type(e.types, src))
    in_grads: list = [None] * len(node.inputs)
    for j, name in zip(p.carried, results, strict=False):
        in_grads[2 + j] = name
    grads: dict[str, Grad] = dict(zip(summed, results[len(p.carried):len(initial)], strict=True))
    stacked = results[len(initial):]
    for k, (c, g) in enumerate(rows.items()):
        rest = list(eb.shape(g.values)[1:])
        indices = e.op("Reshape", [stacked[2 * k], e.ints([-1])], dtype=I64, shape=(None,))
        values = e.op("Reshape", [stacked[2 * k + 1], e.ints([-1, *rest])], dtype=eb.dtype(g.values),
                      shape=(None, *rest))
        grads[c] = SparseGrad(indices, values, c)
    return PatchedVJP(in_grads, {c: grads[c] for c in p.captured}, patch)


def _fixed_rows(eb: Emitter, g: Grad | None) -> SparseGrad | None:
    """``g`` when it is rows of a table (a ``Gather`` in the body) whose count and shape are the same in every
    iteration (static in ``eb``'s types): the backward loop then stacks them as scan outputs, and the loop's
    gradient of the table is all the rows, sparse (the accumulator adds them once, or keeps them sparse).
    Adding each iteration's rows into a dense accumulator carried by the loop would copy the whole table every
    iteration (onnxruntime does not update loop-carried values in place): O(T^2) for a [T, ...] table read
    one row per iteration, as a recurrence reads its input sequence."""
    if not isinstance(g, SparseGrad):
        return None
    shapes = [eb.shape(g.indices), eb.shape(g.values)]
    if any(s is None or not all(isinstance(d, int) for d in s) for s in shapes) or len(shapes[0]) != 1:
        return None
    return g


def refuse_unknown_structure(p: LoopParts, j: int) -> None:
    """:class:`GraphError` for a carried sequence whose cotangent at an iteration's start would need the sequence
    itself (its length and element shapes), which the backward loop does not have: its new value does not
    come from the old one by ``SequenceInsert`` / ``SequenceErase`` / ``Identity`` (tensors have their shape)."""
    if p.types.get(p.v_in[j]) is None or p.types[p.v_in[j]].kind != "sequence":
        return
    raise GraphError(
        f"{p.node.label()}: the loop-carried sequence {p.v_in[j]!r} is not carried into {p.v_out[j]!r} by "
        "SequenceInsert, SequenceErase or Identity, so the cotangent of its value at the start of an iteration "
        "would need the sequence itself, which revgraph keeps only as tensors; build the new sequence from the "
        "old one, or carry its elements as a tensor"
    )


def _type(types: dict[str, ValueInfo], name: str) -> tuple:
    """``(dtype, shape, kind)`` of ``name``, to declare a value of the same type."""
    vi = types.get(name) or ValueInfo(name)
    return vi.dtype, vi.shape, vi.kind
