"""VJP of ``Loop``: a loop that runs the iterations backwards (DESIGN.md section 4, MegEngine's ``LoopGrad``;
JAX's ``_transpose_scan_jaxpr`` is the same construction for ``scan``).

* The forward loop gets one more loop-carried value, an iteration counter (:func:`.reverse.count_trips`), so the
  backward loop knows the trip count T also when the condition stopped the forward loop early (T may be 0).
* Backward iteration k works on forward iteration t = T - 1 - k: it reads slice t of each scan output's
  cotangent and of each stacked residual, seeds the body's outputs, and runs the body's VJP (``ctx.backward``,
  the same backward pass on the body graph).
* Carried cotangents and loop-invariant accumulators are the backward loop's carried values
  (:mod:`.reverse`).

Residual policies (:mod:`..policies`): :class:`Store` stacks, as extra scan outputs of the forward loop, exactly
the body values that the body's VJP reads; :class:`Recompute` stacks only the loop-carried inputs and recomputes
the rest of the body inside the backward loop; :class:`Segments` checkpoints segments (:mod:`.checkpoint`).
What the forward loop must additionally produce comes back as a :class:`ForwardPatch`, which the backward pass
applies.
"""

from __future__ import annotations

import warnings

import numpy as np

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo
from ...ssa import captured_names
from ...types import keep_types
from ..accumulate import is_sequence
from ..context import Ctx, ForwardPatch, PatchedVJP
from ..emitter import Emitter
from ..policies import CheckpointPolicy, Recompute, Segments, Store
from ..registry import vjp
from .checkpoint import checkpointed_loop
from .reverse import I64, LoopParts, body_seeds, close_loop, count_trips, open_body, settle, take_apart


@vjp("Loop")
def loop(ctx: Ctx, node: Node, cts: list) -> PatchedVJP:
    """VJP of ONNX ``Loop`` (operator spec "Loop", opset 21): see the module doc."""
    policy = ctx.options.checkpoint
    if isinstance(policy, Segments) and _carries_sequences(ctx, node):
        warnings.warn(f"{node.label()} carries a sequence, and checkpoint={policy.name!r} keeps the loop-carried values "
                      "at segment starts as stacked tensors, which a sequence cannot be; this loop is differentiated "
                      "with checkpoint='recompute'", stacklevel=2)
        policy = Recompute()
    if isinstance(policy, Segments):
        return checkpointed_loop(ctx, node, cts, policy)
    p = take_apart(ctx, node)
    patch = ForwardPatch()
    trips = count_trips(ctx.e, p, patch)
    bb = open_body(ctx, p)
    eb = bb.e
    t = eb.op("Sub", [eb.op("Sub", [trips, eb.const(np.array(1, np.int64))]), bb.k.name], shape=(), dtype=I64)
    scan_cts = cts[p.n_carried :]
    seeds = body_seeds(eb, p, bb.cot, lambda s, name: None if scan_cts[s] is None else eb.op(
        "Gather", [scan_cts[s], t], axis=0, like=name))
    body_vjp = ctx.backward(p.body, seeds, p.wrt, types=p.types, options=ctx.options)
    carried, captured, settled = settle(p, bb, body_vjp.grads)
    vjp_nodes = [*body_vjp.nodes, *settled]

    residuals = [r for r in reads(vjp_nodes) if r in scope(p.body)]
    stacked, rerun = plan_residuals(p.body, residuals, policy, p.types)
    bound = {p.iter_in: t, p.cond_in: eb.const(np.array(True))}  # an iteration that ran had cond_in true
    for r in stacked:
        if r not in bound:
            stack_residual(ctx.e, eb, p, r, t, patch)
    wanted = set(residuals) | set(reads(rerun))
    eb.nodes += [Node("Identity", [v], [name], name=eb.fresh(f"grad/{node.name}/bind/{name}"))
                 for name, v in bound.items() if name in wanted]
    eb.nodes += [nd.copy() for nd in rerun]
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


def plan_residuals(body: Graph, needed: list[str], policy: CheckpointPolicy,
                   types: dict[str, ValueInfo] | None = None) -> tuple[list[str], list[Node]]:
    """Which body values the forward loop stacks, and which body nodes the backward loop recomputes, so that
    every value in ``needed`` is available in the backward body.

    :class:`Recompute` stacks only body inputs (the loop-carried values and the iteration number) and
    recomputes every other needed value. :class:`Store` stacks needed values, except values whose shape may
    change from one iteration to the next (scan outputs of inner loops, whose length is the inner trip count,
    and values with dimensions that shape inference could not name): those are recomputed from what can be
    stacked. Constants are always recomputed. A sequence is never stacked (a scan output is a tensor): it is
    recomputed, and a tensor read out of a sequence is stacked under both policies (when its shape is fixed),
    so that no sequence has to be kept per iteration. A loop-carried sequence that must be kept is a
    :class:`GraphError`."""
    types = types or {}
    store = isinstance(policy, Store)
    producer = {o: nd for nd in body.nodes for o in nd.outputs if o}
    inputs = set(body.input_names)
    stacked: dict[str, None] = {}
    rerun: set[int] = set()
    want, seen = list(needed), set()
    while want:
        v = want.pop()
        if v in seen or v in body.initializers:
            continue
        seen.add(v)
        nd = producer.get(v)
        vi = types.get(v)
        if nd is None:
            if v in inputs and vi is not None and vi.kind == "sequence":
                raise GraphError(
                    f"the backward pass of a loop body needs the loop-carried sequence {v!r} of every iteration, "
                    "and a sequence cannot be stacked per iteration; revgraph supports loop-carried sequences "
                    "whose elements are only appended, erased and read (the cotangent then needs no copy of them)"
                )
            if v in inputs:
                stacked.setdefault(v)
            continue  # captured from the enclosing graph: visible in the backward body as it is
        inner_scan = nd.op_type in ("Loop", "Scan") and nd.outputs.index(v) >= _n_state(nd)
        from_sequence = any(is_sequence(types, i) for i in nd.inputs if i)
        stackable = not inner_scan and nd.op_type != "Constant" and _fixed_shape(vi) and not is_sequence(types, v)
        if stackable and (store or from_sequence):
            stacked.setdefault(v)
            continue
        if id(nd) not in rerun:
            rerun.add(id(nd))
            want.extend(i for i in nd.inputs if i)
            want.extend(c for sub in nd.subgraphs.values() for c in captured_names(sub))
    return list(stacked), [nd for nd in body.nodes if id(nd) in rerun]


def _fixed_shape(vi: ValueInfo | None) -> bool:
    """Is the value's shape the same in every iteration? Static dimensions and symbols that name a graph
    input's dimension are; unknown dimensions (and the ``unk__`` symbols ONNX inference makes up) may not be."""
    if vi is None or vi.shape is None:
        return False
    return all(isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__")) for d in vi.shape)


def _n_state(node: Node) -> int:
    """The number of loop-carried (state) outputs of a ``Loop`` or ``Scan`` node."""
    if node.op_type == "Loop":
        return len(node.inputs) - 2
    return len(node.inputs) - int(node.attrs.get("num_scan_inputs", 0))


def stack_residual(e: Emitter, eb: Emitter, p: LoopParts, r: str, t: str, patch: ForwardPatch) -> None:
    """Make the forward loop stack body value ``r`` per iteration (one more scan output, through ``patch``),
    and read slice ``t`` of it back under the same name in the backward body ``eb``."""
    name = p.node.name
    vi = p.types.get(r) or ValueInfo(r)
    out, stack = eb.fresh(f"{name}/residual/{r}"), eb.fresh(f"{name}/stacked/{r}")
    patch.body.append(Node("Identity", [r], [out], name=out))
    patch.scan_outputs.append((ValueInfo(out, *vi.dtype_shape), stack))
    e.types[stack] = ValueInfo(stack, vi.dtype, None if vi.shape is None else (None, *vi.shape))
    eb.nodes.append(Node("Gather", [stack, t], [r], {"axis": 0}, eb.fresh(f"grad/{name}/residual/{r}")))
