"""VJP of ``If`` (ONNX operator spec "If"): an ``If`` on the same condition whose branches are the branches'
VJPs (DESIGN.md section 4).

All data enters a branch by capture, so the backward ``If`` returns one gradient per captured floating-point
value on a path from a wrt value (zeros from a branch that does not read it). Each backward branch recomputes
its forward branch first: the values a branch computed are not visible outside it, and only one branch ran.
"""

from __future__ import annotations

from ...ir import Graph, Node, ValueInfo
from ...ssa import captured_names
from ..registry import Emitter, vjp
from ..sparse import SparseGrad, densify
from .loop import body_types, is_float


@vjp("If")
def if_(e: Emitter, node: Node, out_grads: list) -> tuple[list, dict]:
    from ..backward import backward, keep_types

    branches = {k: node.attrs[k] for k in ("then_branch", "else_branch")}
    reads = {k: captured_names(b) for k, b in branches.items()}
    captured = [c for c in dict.fromkeys(reads["then_branch"] + reads["else_branch"])
                if c in e.reach and is_float(e.types.get(c))]
    if not captured:
        return [None], {}
    built = {}
    for key, branch in branches.items():
        fwd = branch.copy()
        types = body_types(fwd, e.types)
        eb = Emitter(types, e.used, e.opset)
        eb.options = e.options
        eb.prefix = f"grad/{node.name}/{key}"
        parts: dict[str, list[str]] = {}
        for out, g in zip(fwd.output_names, out_grads, strict=True):
            if g is not None and is_float(types.get(out)):
                parts.setdefault(out, []).append(g)
        ys = {y: ps[0] if len(ps) == 1 else eb.op("Sum", ps) for y, ps in parts.items()}
        wrt = [c for c in captured if c in reads[key]]
        _, gmap = backward(fwd, ys, wrt, types=types, emitter=eb)
        outs = []
        for c in captured:
            g = gmap.get(c)
            g = eb.zeros_like(c) if g is None else densify(eb, g) if isinstance(g, SparseGrad) else g
            vi = e.types.get(c)
            outs.append(ValueInfo(eb.op("Identity", [g]), vi.dtype if vi else None, vi.shape if vi else None))
        grad_branch = Graph([*fwd.nodes, *eb.nodes], [], outs, dict(fwd.initializers), name=f"grad_{node.name}_{key}")
        keep_types(grad_branch, types)
        built[key] = grad_branch
    results = e.op("If", [node.inputs[0]], n_out=len(captured), **built)
    results = [results] if len(captured) == 1 else results
    for name, c in zip(results, captured, strict=True):
        vi = e.types.get(c)
        if vi is not None:
            e.types[name] = ValueInfo(name, vi.dtype, vi.shape)
    return [None], dict(zip(captured, results, strict=True))
