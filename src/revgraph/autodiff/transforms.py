"""Transforms built on :func:`~.api.gradient` and :func:`~.forward.jvp`: Hessian-vector products, and full
Jacobians and Hessians computed in one run of one graph.

- :func:`hvp`: forward-over-reverse (Pearlmutter, "Fast exact multiplication by the Hessian", Neural
  Computation 6(1), 1994): the JVP of the gradient graph along ``v`` is ``H v``, at about the cost of two
  gradients and without forming ``H``.
- :func:`jacobian` and :func:`hessian`: one ``Loop`` runs over the basis vectors ``e_k`` inside the graph; the
  forward values are computed once, outside it, and each iteration runs only the tangent (or cotangent)
  part of the JVP (or VJP) graph for one basis vector, its result stacked as a scan output. Forward mode
  takes one iteration per input element, reverse mode one per output element, so ``mode="auto"`` takes
  forward mode when the inputs have no more elements than the outputs (JAX's ``jacfwd`` / ``jacrev``
  advice) and reverse mode otherwise; when only one side's size is known when the graph is built, the mode
  whose basis runs over that side.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np

from .. import validate as V
from ..errors import RevgraphError
from ..ir import Graph, Node, ValueInfo, onnx_dtype, require_graph
from ..ir.ssa import captured_names
from ..onnx_io.arguments import AS_GRAPH, ModelLike
from ..onnx_io.value_types import infer_types, keep_types
from .api import gradient
from .arguments import names_argument, resolve_loss, resolve_outputs, resolve_wrt, used_names
from .emitter import Emitter
from .forward import jvp
from .memory import as_budget
from .memory.budget import BUDGET
from .policies import POLICY, CheckpointPolicy, parse_policy
from .simplify import simplify


@V.arguments(graph=AS_GRAPH, loss=V.NAME, wrt=V.NAMES, checkpoint=POLICY, memory=BUDGET)
def hvp(graph: ModelLike, loss: str | None = None, wrt: Iterable[str] | str | None = None, *,
        checkpoint: str | int | CheckpointPolicy = "store", memory=None) -> Graph:
    """A graph computing ``graph``'s outputs, the gradients ``<x>_grad`` of ``loss`` and the Hessian-vector
    products ``<x>_hvp = sum_z d^2 loss / (dx dz) t_z`` for the tangents ``<z>_tangent`` (graph inputs of the
    shapes and dtypes of the ``wrt`` values).

    ``loss`` and ``wrt`` default as in :func:`~.api.gradient` (a non-scalar loss is summed); ``checkpoint`` is
    the residual policy of the gradient's loops (the JVP of a loop stores nothing); ``memory`` the gradient's
    residual budget (:func:`~.api.gradient`; forward mode keeps no residuals of its own). The math:
    forward-over-reverse, the JVP of the gradient graph (Pearlmutter 1994).

    Raises :class:`RevgraphError` (one line) for unknown or non-floating names and :class:`GraphError` for an
    operator without a VJP rule on the path (its gradient graph is differentiated too).
    """
    require_graph(graph, "hvp")
    grads, names = _gradient(graph, loss, wrt, checkpoint, memory)
    with warnings.catch_warnings():  # an unconnected wrt value was reported by the gradient; its HVP is 0 too
        warnings.filterwarnings("ignore", message="no path from the inputs")
        result = jvp(grads, outputs=[names[w] for w in names], inputs=list(names),
                     tangent_names={w: f"{w}_tangent" for w in names},
                     output_names={names[w]: f"{w}_hvp" for w in names})
    result.memory_plan = grads.memory_plan
    return result


def _gradient(graph: Graph, loss: str | None, wrt, checkpoint, memory=None) -> tuple[Graph, dict[str, str]]:
    """The gradient graph and the name of each wrt value's gradient output."""
    types = infer_types(graph)
    wrt_names = resolve_wrt(graph, None if wrt is None else names_argument(wrt, "wrt"), types)
    loss = resolve_loss(graph, loss)
    gg = gradient(graph, loss, wrt_names, checkpoint=checkpoint, memory=memory)
    return gg, dict(zip(wrt_names, gg.output_names[-len(wrt_names):], strict=True))


@V.arguments(graph=AS_GRAPH, outputs=V.NAMES, inputs=V.NAMES, mode=V.choice("auto", "forward", "reverse"),
             checkpoint=POLICY, memory=BUDGET)
def jacobian(graph: ModelLike, outputs: Iterable[str] | str | None = None, inputs: Iterable[str] | str | None = None, *,
             mode: str = "auto", checkpoint: str | int | CheckpointPolicy = "store", memory=None) -> Graph:
    """A graph computing ``graph``'s outputs and, for each output ``y`` and input ``x``, the Jacobian
    ``<y>_jacobian_<x>`` of shape ``y.shape + x.shape`` (``J[i..., j...] = dy[i...] / dx[j...]``, as
    ``torch.autograd.functional.jacobian`` lays it out), in ``y``'s dtype.

    ``outputs`` default to every floating-point graph output, ``inputs`` to every floating-point input and
    initializer. ``mode``: ``"forward"`` (one tangent pass per element of the inputs), ``"reverse"`` (one
    backward pass per element of the outputs) or ``"auto"`` (module doc). The passes run in one ``Loop``
    inside the graph, after the forward values. ``checkpoint``: the loops' residual policy in reverse mode;
    ``memory``: the residual budget of the reverse-mode gradient (:func:`~.api.gradient`).

    Raises :class:`RevgraphError` for unknown or non-floating names or an unknown mode, and
    :class:`GraphError` for an operator without a VJP rule on a path from ``inputs`` to ``outputs``.
    """
    require_graph(graph, "jacobian")
    if mode not in ("auto", "forward", "reverse"):
        raise RevgraphError(f"unknown mode {mode!r}; choose 'auto', 'forward' or 'reverse'")
    parse_policy(checkpoint)  # refused in forward mode too, where no gradient reads it
    as_budget(memory)  # (as is the budget)
    types = infer_types(graph)
    ys = resolve_outputs(graph, outputs, types)
    xs = resolve_wrt(graph, None if inputs is None else names_argument(inputs, "inputs"), types)
    if mode == "auto":
        mode = jacobian_mode(graph, ys, xs)
    names = {(y, x): f"{y}_jacobian_{x}" for y in ys for x in xs}
    if mode == "forward":
        return _forward_jacobian(graph, ys, xs, names)
    return _reverse_jacobian(graph, ys, xs, names, checkpoint, memory)


@V.arguments(graph=AS_GRAPH, loss=V.NAME, wrt=V.NAMES, checkpoint=POLICY, memory=BUDGET)
def hessian(graph: ModelLike, loss: str | None = None, wrt: Iterable[str] | str | None = None, *,
            checkpoint: str | int | CheckpointPolicy = "store", memory=None) -> Graph:
    """A graph computing ``graph``'s outputs and the Hessian of ``loss`` (summed if not scalar): for each pair
    of ``wrt`` values the block ``d^2 loss / (dx_i dx_j)`` of shape ``x_i.shape + x_j.shape``, named
    ``<x>_hessian`` for ``i == j`` and ``<x_i>_hessian_<x_j>`` otherwise (``torch.autograd.functional.hessian``'s
    layout). Forward-over-reverse: the forward-mode Jacobian of the gradient, one Hessian-vector product per
    element of the ``wrt`` values, in one ``Loop`` (module doc). ``checkpoint``: the gradient's loop policy.

    Raises :class:`RevgraphError` for unknown or non-floating names and :class:`GraphError` for an operator
    without a VJP rule on the path.
    """
    require_graph(graph, "hessian")
    grads, names = _gradient(graph, loss, wrt, checkpoint, memory)
    xs = list(names)
    blocks = {(names[a], b): (f"{a}_hessian" if a == b else f"{a}_hessian_{b}") for a in xs for b in xs}
    with warnings.catch_warnings():  # an unconnected wrt value was reported by the gradient
        warnings.filterwarnings("ignore", message="no path from the inputs")
        result = _forward_jacobian(grads, [names[a] for a in xs], xs, blocks)
    result.memory_plan = grads.memory_plan
    return result


def jacobian_mode(graph: Graph, outputs: Iterable[str] | str | None = None,
                  inputs: Iterable[str] | str | None = None) -> str:
    """The mode ``jacobian(..., mode="auto")`` takes: ``"forward"`` when the inputs have no more elements than
    the outputs (both static in the graph's declared or inferred types), ``"reverse"`` otherwise; when only one
    side's size is static, the mode whose basis runs over it (forward for static inputs). Raises
    :class:`RevgraphError` for unknown or non-floating names."""
    types = infer_types(graph)
    ys = resolve_outputs(graph, outputs, types)
    xs = resolve_wrt(graph, None if inputs is None else names_argument(inputs, "inputs"), types)
    nx, ny = (_numel(types, names) for names in (xs, ys))
    if nx is None or ny is None:  # the mode whose basis size is known (reverse when neither is: it names y)
        return "forward" if nx is not None else "reverse"
    return "forward" if nx <= ny else "reverse"


def _numel(types: dict[str, ValueInfo], names: list[str]) -> int | None:
    total = 0
    for n in names:
        vi = types.get(n)
        if vi is None or vi.shape is None or not all(isinstance(d, int) for d in vi.shape):
            return None
        total += int(np.prod(vi.shape, dtype=np.int64))
    return total


# ---------------------------------------------------------------------------------------------- the basis loop


def _forward_jacobian(graph: Graph, ys: list[str], xs: list[str], names: dict[tuple[str, str], str]) -> Graph:
    """Forward mode: the JVP graph's tangent part in a loop over the basis of the inputs, stacked
    ``[n_x, *y.shape]`` per input block, then laid out as ``[*y.shape, *x.shape]``."""
    jg = jvp(graph, outputs=ys, inputs=xs)
    seeds = jg.input_names[-len(xs):]
    types = infer_types(jg)
    stacked, offsets = _basis_loop(jg, seeds, jg.output_names[-len(ys):], types, xs,
                                   "a forward-mode basis runs over the inputs' elements; declare their shapes")
    e = Emitter(types, used_names(jg), jg.opset, prefix="jacobian")
    for (y, x), out in names.items():
        k = xs.index(x)
        block = _rows(e, stacked[ys.index(y)], offsets, k, len(xs))  # [n_x, *y]
        flat = e.op("Reshape", [block, e.ints([offsets[k + 1] - offsets[k], -1])])  # [n_x, n_y]
        t = e.op("Transpose", [flat], perm=[1, 0])
        shape = e.op("Concat", [e.op("Shape", [y]), e.ints(list(types[seeds[k]].shape))], axis=0)
        _output(e, jg, e.op("Reshape", [t, shape]), out, types.get(y))
    return _finish(jg, e)


def _reverse_jacobian(graph: Graph, ys: list[str], xs: list[str], names: dict[tuple[str, str], str],
                      checkpoint, memory=None) -> Graph:
    """Reverse mode: the VJP of ``sum_y <y, s_y>`` for seeds ``s_y`` in a loop over the basis of the outputs,
    stacked ``[n_y, *x.shape]`` per output block, then reshaped to ``[*y.shape, *x.shape]``."""
    g = graph.copy()
    types = infer_types(g)
    e = Emitter(types, used_names(g), g.opset, prefix="jacobian")
    seeds, parts = [], []
    for y in ys:
        vi = types.get(y) or ValueInfo(y)
        seeds.append(e.fresh(f"{y}_seed"))
        g.inputs.append(ValueInfo(seeds[-1], vi.dtype, vi.shape))
        parts.append(e.op("ReduceSum", [e.op("Mul", [y, seeds[-1]])], keepdims=0))
    total = parts[0]
    for part in parts[1:]:  # the objective, a forward value (gradient contributions are the Accumulator's)
        total = e.op("Add", [total, part])
    g.nodes += e.nodes
    keep = len(g.outputs)
    g.outputs.append(ValueInfo(total, (types.get(ys[0]) or ValueInfo(ys[0])).dtype, ()))
    gg = gradient(g, total, xs, checkpoint=checkpoint, memory=memory)
    gg.outputs = [*gg.outputs[:keep], *gg.outputs[keep + 1 :]]
    stacked, offsets = _basis_loop(gg, seeds, gg.output_names[-len(xs):], infer_types(gg), ys,
                                   "a reverse-mode basis runs over the outputs' elements; declare their shapes, "
                                   "or use mode='forward' (--mode forward) when the inputs' shapes are static")
    e = Emitter(infer_types(gg), used_names(gg), gg.opset, prefix="jacobian")
    for (y, x), out in names.items():
        block = _rows(e, stacked[xs.index(x)], offsets, ys.index(y), len(ys))  # [n_y, *x]
        shape = e.op("Concat", [e.op("Shape", [y]), e.op("Shape", [x])], axis=0)
        _output(e, gg, e.op("Reshape", [block, shape]), out, types.get(y))
    return _finish(gg, e)


def _basis_loop(g: Graph, seeds: list[str], results: list[str], types: dict[str, ValueInfo], of: list[str],
                advice: str) -> tuple[list[str], list[int]]:
    """Move the nodes of ``g`` that depend on the graph inputs ``seeds`` (static shapes) into a ``Loop`` over
    the basis of the concatenated seeds: iteration ``k`` feeds the ``k``-th unit vector, split and reshaped
    into the seeds, and stacks each of ``results`` (graph outputs, which stop being outputs). The seeds stop
    being graph inputs. Returns the stacked results ``[n, *result.shape]`` and the offsets of the seeds in the
    basis. A graph output computed in the loop (a forward value computed together with its tangent, as a
    loop's JVP does) is stacked too and read from the first iteration. ``of``: the value each seed stands for,
    named with ``advice`` in the :class:`RevgraphError` for a seed whose shape is not static."""
    seed_vis = [next(v for v in g.inputs if v.name == s) for s in seeds]
    offsets = [0]
    for vi, value in zip(seed_vis, of, strict=True):
        if vi.shape is None or not all(isinstance(d, int) for d in vi.shape):
            shape = "unknown" if vi.shape is None else list(vi.shape)
            raise RevgraphError(f"{value!r} has shape {shape}, not static: {advice}")
        offsets.append(offsets[-1] + int(np.prod(vi.shape, dtype=np.int64)))
    dependent, inner, outer = set(seeds), [], []
    for node in g.nodes:
        reads = [*node.inputs, *(c for sg in node.subgraphs.values() for c in captured_names(sg))]
        if any(i in dependent for i in reads if i):
            inner.append(node)
            dependent.update(o for o in node.outputs if o)
        else:
            outer.append(node)
    g.inputs = [v for v in g.inputs if v.name not in seeds]
    e = Emitter(types, used_names(g), g.opset, prefix="basis")  # the enclosing graph's nodes
    head, tail = e.child(types, "basis"), e.child(types, "basis")  # the body's, before and after the moved nodes
    k, cond = e.fresh("basis/k"), e.fresh("basis/cond")
    n = e.const(np.array(offsets[-1], np.int64))
    steps = head.op("Range", [head.const(np.array(0, np.int64)), n, head.const(np.array(1, np.int64))])
    onehot = head.op("Cast", [head.op("Equal", [steps, k])], to=onnx_dtype(seed_vis[0].dtype))
    sizes = [offsets[j + 1] - offsets[j] for j in range(len(seeds))]
    pieces = [onehot] if len(seeds) == 1 else head.op("Split", [onehot, head.ints(sizes)], n_out=len(seeds), axis=0)
    for vi, piece in zip(seed_vis, pieces, strict=True):
        head.nodes.append(Node("Reshape", [piece, head.ints(list(vi.shape))], [vi.name], name=e.fresh("basis/Reshape")))
    in_loop = [o for o in g.output_names if o in dependent and o not in results]
    body_outs = [ValueInfo(tail.op("Identity", [r]), *(types.get(r) or ValueInfo(r)).dtype_shape)
                 for r in [*results, *in_loop]]
    cond_out = ValueInfo(tail.op("Identity", [cond]), np.bool_, ())
    body = Graph([*head.nodes, *inner, *tail.nodes], [ValueInfo(k, np.int64, ()), ValueInfo(cond, np.bool_, ())],
                 [cond_out, *body_outs], name="basis")
    stacked = [e.fresh(f"{r}_stacked") for r in [*results, *in_loop]]
    e.nodes.append(Node("Loop", [n, ""], stacked, {"body": body}, e.fresh("basis/Loop")))
    for r, s in zip(in_loop, stacked[len(results):], strict=True):
        e.nodes.append(Node("Gather", [s, e.const(np.array(0, np.int64))], [r], {"axis": 0}, e.fresh("basis/Gather")))
    g.nodes = [*outer, *e.nodes]
    g.outputs = [o for o in g.outputs if o.name not in results]
    g.value_info = {}
    return stacked[: len(results)], offsets


def _rows(e: Emitter, stacked: str, offsets: list[int], k: int, blocks: int) -> str:
    """Rows ``offsets[k]:offsets[k+1]`` of ``stacked`` (all of it for one block)."""
    if blocks == 1:
        return stacked
    return e.op("Slice", [stacked, e.ints([offsets[k]]), e.ints([offsets[k + 1]]), e.ints([0])])


def _output(e: Emitter, g: Graph, value: str, name: str, like: ValueInfo | None) -> None:
    """Declare ``value`` as the graph output ``name`` (a fresh name)."""
    out = e.fresh(name)
    e.nodes.append(Node("Identity", [value], [out], name=e.fresh(f"jacobian/{name}")))
    g.outputs.append(ValueInfo(out, None if like is None else like.dtype))


def _finish(g: Graph, e: Emitter) -> Graph:
    """Append ``e``'s nodes, simplify, and declare the blocks' shapes (ONNX's checker wants a shape on every
    graph output)."""
    g.nodes += e.nodes
    simplify(g)
    types = infer_types(g)
    for k, o in enumerate(g.outputs):
        t = types.get(o.name)
        if o.shape is None and t is not None and t.shape is not None:
            g.outputs[k] = ValueInfo(o.name, o.dtype if o.dtype is not None else t.dtype, t.shape, o.kind)
    keep_types(g, types)
    return g
