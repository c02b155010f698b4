"""VJP of ``If`` (ONNX operator spec "If"): an ``If`` on the same condition whose branches are the branches'
VJPs (DESIGN.md section 4).

All data enters a branch by capture, so the backward ``If`` returns one gradient per captured floating-point
value on a path from a wrt value (zeros from a branch that does not read it). Each backward branch recomputes
its forward branch first: the values a branch computed are not visible outside it, and only one branch ran.
"""

from __future__ import annotations

from ...ir import Graph, Node, ValueInfo
from ...ir.ssa import captured_names
from ...onnx_io.value_types import differentiable, keep_types
from ..accumulate import Accumulator, densify, zeros_like
from ..context import Ctx, PatchedVJP
from ..registry import vjp
from .reverse import body_types


@vjp("If", bounded=False, finite=False)
def if_(ctx: Ctx, node: Node, cts: list) -> PatchedVJP:
    """VJP of ONNX ``If``: see the module doc."""
    e = ctx.e
    branches = {k: node.attrs[k] for k in ("then_branch", "else_branch")}
    captured = [c for c in dict.fromkeys(c for b in branches.values() for c in captured_names(b))
                if c in ctx.reach and differentiable(e.types.get(c))]
    if not captured:
        return PatchedVJP([None], {})
    cts = [None if g is None else densify(e, g) for g in cts]  # a sequence's reads: the branches take names
    built = {key: _branch_vjp(ctx, node, key, branch, captured, cts) for key, branch in branches.items()}
    results = e.op("If", [node.inputs[0]], n_out=len(captured), **built)
    results = [results] if len(captured) == 1 else results
    for name, c in zip(results, captured, strict=True):
        vi = e.types.get(c)
        if vi is not None:
            e.types[name] = ValueInfo(name, vi.dtype, vi.shape, vi.kind)
    return PatchedVJP([None], dict(zip(captured, results, strict=True)))


def _branch_vjp(ctx: Ctx, node: Node, key: str, branch: Graph, captured: list[str], cts: list) -> Graph:
    """The backward branch of ``branch``: the forward branch recomputed, then its VJP; one output per captured
    value (zeros for a value this branch does not read)."""
    fwd = branch.copy()
    types = body_types(fwd, ctx.e.types)
    eb = ctx.e.child(types, f"grad/{node.name}/{key}")
    seeds = Accumulator(eb, ctx.options.accumulate)  # a value the branch outputs twice gets the sum of both cotangents
    for out, g in zip(fwd.output_names, cts, strict=True):
        if g is not None and differentiable(types.get(out)):
            seeds.add(out, g)
    reads = set(captured_names(fwd))
    body_vjp = ctx.backward(fwd, {y: seeds.dense_total(y) for y in seeds.pending()},
                            [c for c in captured if c in reads], types=types, options=ctx.options,
                            singular=ctx.singular)
    eb.nodes += body_vjp.nodes
    outs = []
    for c in captured:
        g = body_vjp.grads.get(c)
        g = zeros_like(eb, c) if g is None else densify(eb, g)
        vi = ctx.e.types.get(c) or ValueInfo(c)
        outs.append(ValueInfo(eb.op("Identity", [g]), vi.dtype, vi.shape, vi.kind))
    grad_branch = Graph([*fwd.nodes, *eb.nodes], [], outs, dict(fwd.initializers), name=f"grad_{node.name}_{key}")
    keep_types(grad_branch, types)
    return grad_branch
