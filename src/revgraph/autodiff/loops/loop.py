"""VJP of ``Loop``: a loop that runs the iterations backwards (DESIGN.md section 4, MegEngine's ``LoopGrad``;
JAX's ``_transpose_scan_jaxpr`` is the same construction for ``scan``).

* The forward loop gets one more loop-carried value, an iteration counter (:func:`.reverse.count_trips`), so the
  backward loop knows the trip count T also when the condition stopped the forward loop early (T may be 0).
* Backward iteration k works on forward iteration t = T - 1 - k: it reads slice t of each scan output's
  cotangent and of each stacked residual, seeds the body's outputs, and runs the body's VJP (``ctx.backward``,
  the same backward pass on the body graph).
* Carried cotangents and loop-invariant accumulators are the backward loop's carried values
  (:mod:`.reverse`).

Residual policies (:mod:`..policies`) say per body node whether its outputs are saved (``policy.saves(node)``,
asked by :mod:`.residuals`): :class:`Store` stacks, as extra scan outputs of the forward loop, the body values
that the body's VJP reads, each distinct value once (a carried value's input is the previous iteration's
output, a row of an outer input is read again, the user's own scan outputs are reused); :class:`Recompute`
stacks only the loop-carried inputs and recomputes the rest of the body inside the backward loop;
:class:`SaveProducts` stacks the products' outputs and recomputes the rest; :class:`Segments` checkpoints
segments (:mod:`.checkpoint`). What the forward loop must additionally
produce comes back as a :class:`ForwardPatch`, which the backward pass applies.
"""

from __future__ import annotations

import numpy as np

from ...ir import Graph, Node, ValueInfo
from ...ir.ssa import captured_names
from ...onnx_io.value_types import keep_types
from ...warn import warn
from ..context import Ctx, ForwardPatch, PatchedVJP
from ..policies import Recompute, Segments, loop_policy
from ..registry import vjp
from .checkpoint import checkpointed_loop
from .residuals import declare_outputs, emit_plan, plan_residuals, static_trips
from .reverse import I64, body_seeds, close_loop, count_trips, open_body, settle, take_apart


@vjp("Loop", bounded=False, finite=False)
def loop(ctx: Ctx, node: Node, cts: list) -> PatchedVJP:
    """VJP of ONNX ``Loop`` (operator spec "Loop", opset 21): see the module doc."""
    policy = loop_policy(ctx.options.checkpoint, node)  # (PerLoop: a chunked loss's loop recomputes)
    if isinstance(policy, Segments) and _carries_sequences(ctx, node):
        warn(f"{node.label()} carries a sequence, and checkpoint={policy.name!r} keeps the loop-carried values "
             "at segment starts as stacked tensors, which a sequence cannot be; this loop is differentiated "
             "with checkpoint='recompute'")
        policy = Recompute()
    if isinstance(policy, Segments):
        return checkpointed_loop(ctx, node, cts, policy)
    p = take_apart(ctx, node)
    declare_outputs(ctx.e, p)
    patch = ForwardPatch()
    trips = count_trips(ctx.e, p, patch)
    bb = open_body(ctx, p)
    eb = bb.e
    t = eb.op("Sub", [eb.op("Sub", [trips, eb.const(np.array(1, np.int64))]), bb.k.name], shape=(), dtype=I64)
    scan_cts = cts[p.n_carried :]
    seeds = body_seeds(eb, p, bb.cot, lambda s, name: None if scan_cts[s] is None else eb.op(
        "Gather", [scan_cts[s], t], axis=0, like=name), ctx.options.accumulate)
    body_vjp = ctx.backward(p.body, seeds, p.wrt, types=p.types, options=ctx.options, singular=ctx.singular)
    carried, captured, settled = settle(p, bb, body_vjp.grads)
    vjp_nodes = [*body_vjp.nodes, *settled]

    residuals = [r for r in reads(vjp_nodes) if r in scope(p.body)]
    plan = plan_residuals(p, residuals, policy, ctx.e.types)
    bound = {p.iter_in: t, p.cond_in: eb.const(np.array(True))}  # an iteration that ran had cond_in true
    wanted = set(residuals) | set(reads(plan.rerun))
    eb.nodes += [Node("Identity", [v], [name], name=eb.fresh(f"grad/{node.name}/bind/{name}"))
                 for name, v in bound.items() if name in wanted]
    emit_plan(ctx.e, eb, p, plan, t, trips, patch, static_trips(ctx.e, p))
    eb.nodes += vjp_nodes
    keep_types(p.body, p.types)
    return close_loop(ctx, p, bb, trips, cts, carried, captured, patch)


def _carries_sequences(ctx: Ctx, node: Node) -> bool:
    body: Graph = node.attrs["body"]
    return any(v.kind == "sequence" for v in body.inputs[2:]) or any(
        (ctx.e.types.get(i) or ValueInfo(i)).kind == "sequence" for i in node.inputs[2:] if i)


def scope(body: Graph) -> set[str]:
    """The names a body defines: its inputs and its nodes' outputs."""
    return set(body.input_names) | {o for n in body.nodes for o in n.outputs if o}


def reads(nodes: list[Node]) -> list[str]:
    """Names the nodes read (subgraph captures included) that they do not write themselves."""
    written = {o for n in nodes for o in n.outputs if o}
    seen: dict[str, None] = {}
    for n in nodes:
        for name in [*n.inputs, *(c for sub in n.subgraphs.values() for c in captured_names(sub))]:
            if name and name not in written:
                seen.setdefault(name)
    return list(seen)
