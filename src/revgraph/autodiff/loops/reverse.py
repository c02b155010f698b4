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

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo
from ...ssa import captured_names
from ...types import differentiable, infer_types, keep_types
from ..accumulate import Accumulator
from ..context import Ctx, ForwardPatch, Grad, PatchedVJP
from ..emitter import Emitter
from ..sparse import SparseGrad, densify

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


def body_types(body: Graph, outer: dict[str, ValueInfo]) -> dict[str, ValueInfo]:
    """Types of a subgraph's values, inferred with its captured values declared from ``outer``."""
    captured = [outer.get(c) or ValueInfo(c) for c in captured_names(body)]
    probe = Graph(body.nodes, [*body.inputs, *captured], body.outputs, body.initializers, body.value_info)
    types = infer_types(probe)
    for c in captured:
        types.setdefault(c.name, c)
    return types


def take_apart(ctx: Ctx, node: Node) -> LoopParts:
    """``node``'s slots; :class:`GraphError` for a carried value whose shape changes between iterations."""
    outer = ctx.e.types
    body: Graph = node.attrs["body"]
    n = len(node.inputs) - 2
    types = body_types(body, outer)
    v_in = body.input_names[2:]
    for j, name in enumerate(v_in):  # carried inputs take the types of the initial values when undeclared
        if types.get(name) is None or types[name].dtype is None:
            src = outer.get(node.inputs[2 + j])
            if src is not None:
                types[name] = ValueInfo(name, src.dtype, src.shape)
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
    count_in, count_out, trips = e.fresh(f"{name}/count_in"), e.fresh(f"{name}/count_out"), e.fresh(f"{name}/trip_count")
    patch.before.append(Node("Constant", [], [zero], {"value": np.array(0, np.int64)}, zero))
    patch.body += [Node("Constant", [], [one], {"value": np.array(1, np.int64)}, one),
                   Node("Add", [p.iter_in, one], [count_out], name=count_out)]
    patch.carried.append((zero, ValueInfo(count_in, I64, ()), ValueInfo(count_out, I64, ()), trips))
    e.types[trips] = ValueInfo(trips, I64, ())
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
        info = ValueInfo(eb.fresh(name), *(vi or ValueInfo("")).dtype_shape)
        eb.types[info.name] = info
        return info

    return BackwardBody(eb, slot(f"{base}/k", ValueInfo("", I64, ())), slot(f"{base}/cond", ValueInfo("", BOOL, ())),
                        {j: slot(f"{base}/cot_{p.v_in[j]}", p.types.get(p.v_in[j])) for j in p.carried},
                        {c: slot(f"{base}/acc_{c}", ctx.e.types.get(c)) for c in p.captured})


def body_seeds(eb: Emitter, p: LoopParts, cot: dict[int, ValueInfo], scan_seed: Callable[[int, str], str | None]
               ) -> dict[str, str]:
    """The cotangent seeds of the body outputs: the carried cotangents, and ``scan_seed(s, name)`` for scan
    output s; a body output listed twice gets the sum of its seeds (through the :class:`Accumulator`)."""
    acc = Accumulator(eb)
    for j in p.carried:
        acc.add(p.v_out[j], cot[j].name)
    for s, name in enumerate(p.scan_out):
        if differentiable(p.types.get(name)):
            seed = scan_seed(s, name)
            if seed is not None:
                acc.add(name, seed)
    return {y: acc.dense_total(y) for y in acc.pending()}


def close_loop(ctx: Ctx, p: LoopParts, bb: BackwardBody, count: str, cts: list, carried: dict[int, Grad | None],
               captured: dict[str, Grad | None], patch: ForwardPatch) -> PatchedVJP:
    """Finish the body ``bb`` (its outputs: the carried cotangents ``carried`` of this iteration, and each
    accumulator plus this iteration's ``captured`` contribution), emit the backward ``Loop`` of ``count``
    iterations, and return the node's VJP."""
    e, eb, node = ctx.e, bb.e, p.node
    outs = [ValueInfo(eb.op("Identity", [eb.const(np.array(True))]), BOOL, ())]
    for j in p.carried:
        g = carried.get(j)
        g = eb.zeros_like(p.v_in[j]) if g is None else densify(eb, g) if isinstance(g, SparseGrad) else g
        outs.append(ValueInfo(eb.op("Identity", [g]), *_dtype_shape(p.types, p.v_in[j])))
    acc = Accumulator(eb)
    for c in p.captured:
        acc.add(c, bb.acc[c].name)
        if captured.get(c) is not None:
            acc.add(c, captured[c])
        outs.append(ValueInfo(eb.op("Identity", [acc.dense_total(c)]), *_dtype_shape(e.types, c)))
    inputs = [bb.k, bb.cond, *bb.cot.values(), *bb.acc.values()]
    bwd_body = Graph(eb.nodes, inputs, outs, name=f"grad_{node.name}_body")
    keep_types(bwd_body, eb.types)

    initial = [cts[j] if cts[j] is not None else e.zeros_like(node.outputs[j]) for j in p.carried]
    initial += [e.zeros_like(c) for c in p.captured]
    n_out = len(initial)
    results = e.op("Loop", [count, e.const(np.array(True)), *initial], n_out=n_out, body=bwd_body)
    results = [results] if n_out == 1 else results
    for name, src in zip(results, [node.inputs[2 + j] for j in p.carried] + p.captured, strict=True):
        e.types[name] = ValueInfo(name, *_dtype_shape(e.types, src))
    in_grads: list = [None] * len(node.inputs)
    for j, name in zip(p.carried, results, strict=False):
        in_grads[2 + j] = name
    return PatchedVJP(in_grads, dict(zip(p.captured, results[len(p.carried):], strict=True)), patch)


def _dtype_shape(types: dict[str, ValueInfo], name: str) -> tuple:
    return (types.get(name) or ValueInfo(name)).dtype_shape
