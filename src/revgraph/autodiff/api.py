"""The public entry point :func:`gradient`: a graph computing a model's outputs and the gradients of its loss.

It checks its arguments once (names, seeds, the checkpoint policy), lowers ``Scan`` and recurrent operators
into loops, runs the backward pass (:mod:`.backward`), declares the ``<name>_grad`` outputs and cleans the
result up (:mod:`.simplify`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .. import validate as V
from ..errors import RevgraphError
from ..ir import Graph, Node, ValueInfo, fresh_name, gc_paused, require_graph
from ..ir.ssa import is_ssa, to_ssa
from ..onnx_io.arguments import AS_GRAPH, ModelLike
from ..onnx_io.value_types import infer_types, keep_types
from ..warn import warn
from . import sparse as sp
from .arguments import names_argument, refuse_integer_loss, resolve_loss, resolve_wrt, suggest, used_names
from .backward import backward
from .context import Grad, Options
from .emitter import Emitter
from .lift import lift_constants as lift
from .loops.lower import lower_to_loops
from .memory import Budget, as_budget, plan_memory
from .memory.budget import BUDGET
from .policies import POLICY, CheckpointPolicy, parse_policy
from .simplify import simplify
from .sparse import SparseGrad


@V.arguments(graph=AS_GRAPH, loss=V.NAME, wrt=V.NAMES, seed=V.choice("ones", "input"),
             unconnected=V.choice("zero", "error"), sparse=V.FLAG, accumulate=V.choice("sum", "running"),
             checkpoint=POLICY, lift_constants=V.FLAG, straight_through=V.FLAG, memory=BUDGET,
             finite_inputs=V.NAMES)
def gradient(
    graph: ModelLike,
    loss: str | None = None,
    wrt: Iterable[str] | str | None = None,
    *,
    seed: str = "ones",
    unconnected: str = "zero",
    sparse: bool = False,
    accumulate: str = "sum",
    checkpoint: str | int | CheckpointPolicy = "store",
    lift_constants: bool = False,
    straight_through: bool = False,
    memory: float | int | Budget | str | None = None,  # noqa: PYI041 (an int is a byte count, a float a fraction)
    finite_inputs: Iterable[str] | str = (),
) -> Graph:
    """A graph computing ``graph``'s outputs and the gradient of ``loss`` with respect to each ``wrt`` value.

    ``graph`` is a :class:`Graph`, an ``onnx.ModelProto`` or the path of an ``.onnx`` file (read with
    :func:`revgraph.load`; so for :func:`jvp`, :func:`hvp`, :func:`jacobian`, :func:`hessian`,
    :func:`check_gradients`, :func:`saved_bytes` and :func:`plan_memory`: ``revgraph.onnx_io.arguments.AS_GRAPH``).

    ``loss`` defaults to the only graph output; a non-scalar loss is differentiated as the sum of its
    elements (``seed="ones"``), or ``seed="input"`` adds a graph input ``<loss>_grad`` holding the output
    cotangent (a VJP). ``wrt`` defaults to every floating-point input and initializer; a name may also be an
    intermediate value (of a name written twice, its first version). The result has one more output per wrt
    name, ``<name>_grad``, of the value's shape and dtype; with ``sparse=True`` a table read only through
    ``Gather`` gets ``<name>_grad_indices`` (int64 [K]) and ``<name>_grad_values`` ([K, ...]) instead.
    A wrt value with no path to the loss gets zeros and a ``UserWarning`` (``unconnected="zero"``) or raises
    (``unconnected="error"``). ``accumulate`` is ``"sum"`` or ``"running"`` (see :class:`Accumulator`).
    ``checkpoint`` is the residual policy of loops: ``"store"``, ``"recompute"``, ``"products"``, ``"sqrt"`` or a
    segment length K, or a :data:`~.policies.CheckpointPolicy` (see :mod:`.policies`). ``lift_constants=True`` first
    turns floating-point ``Constant`` and ``ConstantOfShape`` values with more than one element into initializers
    (:func:`revgraph.autodiff.lift.lift_constants`), so that they are differentiated by default.
    ``straight_through=True`` differentiates each ``QuantizeLinear -> DequantizeLinear`` pair with the straight-through
    estimator (quantization-aware training,
    :mod:`.rules.quant`); without it a path through such a pair raises :class:`GraphError`.
    ``memory`` is the budget of the residuals (the forward values the backward reads), planned by
    :func:`~.memory.plan_memory`: ``None`` (default) recomputes only free operators (reshapes, transposes, ...)
    where that keeps fewer bytes; a float in [0, 1] keeps at most that fraction of the default's bytes, an int
    at most that many bytes, or a :class:`~.memory.Budget` (which may size symbolic dimensions), recomputing
    forward nodes inside the backward graph; of the plans that fit, the one with the lowest predicted peak
    (``0``: the least memory, never predicted above the default). The plan is ``result.memory_plan``.
    ``finite_inputs``: graph inputs the caller guarantees finite (no inf or NaN element), so that the
    strong-zero analysis (DESIGN section 5) need not follow them: a :class:`revgraph.Trainer`'s parameters,
    which it never steps with once one is non-finite. Other inputs may hold inf or NaN (masks, padding).

    Raises :class:`RevgraphError` (one line) for an unknown, ambiguous or non-floating name, and
    :class:`GraphError` for operators without a VJP rule on the path.
    """
    require_graph(graph, "gradient")
    budget = as_budget(memory)
    if loss is not None and not isinstance(loss, str):
        raise RevgraphError(f"loss must be a value name (a str) or None, got {type(loss).__name__}")
    wrt = None if wrt is None else names_argument(wrt, "wrt")
    if not isinstance(seed, str) or seed not in ("ones", "input"):
        raise RevgraphError(f"unknown seed {seed!r}; choose 'ones' or 'input'")
    if not isinstance(unconnected, str) or unconnected not in ("zero", "error"):
        raise RevgraphError(f"unknown unconnected policy {unconnected!r}; choose 'zero' or 'error'")
    with gc_paused():  # (see gc_paused: a third of a long chain's build)
        g = graph if is_ssa(graph) else to_ssa(graph)
        g = lift(g)[0] if lift_constants else g.copy()
        used = used_names(g)
        if lower_to_loops(g, None, used):
            used = used_names(g)  # the names of the nodes the rewrite replaced are free again
        types = infer_types(g)
        loss = resolve_loss(g, loss)
        refuse_integer_loss(loss, types)
        wrt_names = resolve_wrt(g, wrt, types)
        ys: dict[str, str | None] = {loss: None}
        if seed == "input":
            seed_name = fresh_name(f"{loss}_grad", used)
            vi = types.get(loss) or ValueInfo(loss)
            # a sequence loss takes a sequence of cotangents (one per element), not a tensor
            g.inputs.append(ValueInfo(seed_name, vi.dtype, vi.shape, vi.kind))
            types[seed_name] = ValueInfo(seed_name, vi.dtype, vi.shape, vi.kind)
            ys[loss] = seed_name
        e = Emitter(types, used, g.opset)
        finite = names_argument(finite_inputs, "finite_inputs")
        unknown = [n for n in finite if n not in g.input_names]
        if unknown:
            raise RevgraphError(f"finite_inputs names {', '.join(map(repr, unknown))}, not an input of the graph"
                                f"{suggest(unknown[0], set(g.input_names))}")
        options = Options(checkpoint=parse_policy(checkpoint), straight_through=bool(straight_through),
                          accumulate=accumulate, finite_inputs=frozenset(finite))
        _, grad_map = backward(g, ys, wrt_names, types=types, emitter=e, options=options)

        missing = [w for w in wrt_names if w not in grad_map]
        if missing and unconnected == "error":
            raise RevgraphError(
                f"no path from {', '.join(map(repr, missing))} to the loss {loss!r} (use unconnected='zero' for zero "
                "gradients)"
            )
        if missing:
            warn(f"no path from {', '.join(map(repr, missing))} to the loss {loss!r}; their gradients are zero")
        tail: list[Node] = []
        for w in wrt_names:
            with e.scope(f"grad/{w}"):
                tail += _grad_output(e, g, w, grad_map.get(w), types.get(w) or ValueInfo(w), sparse)
        g.nodes.extend(e.nodes)
        g.nodes.extend(tail)
        simplify(g, e.types)
        keep_types(g, e.types)
        g.memory_plan = plan_memory(g, budget)
        return g


def _grad_output(e: Emitter, g: Graph, w: str, grad: Grad | None, vi: ValueInfo, sparse: bool) -> list[Node]:
    """Declare the gradient outputs of ``w`` on ``g``; return the nodes that write them."""
    used = e.used
    if isinstance(grad, SparseGrad) and sparse:
        nodes = []
        for part, src, dtype, shape in (
            ("indices", grad.indices, np.dtype(np.int64), ("K",)),
            ("values", grad.values, vi.dtype, None if vi.shape is None else ("K", *vi.shape[1:])),
        ):
            out = fresh_name(f"{w}_grad_{part}", used)
            nodes.append(Node("Identity", [src], [out], name=fresh_name(f"grad/{w}/{part}", used)))
            g.outputs.append(ValueInfo(out, dtype, shape))
        return nodes
    if grad is None:
        grad = e.zeros_like(w)
    elif isinstance(grad, SparseGrad):
        grad = sp.densify(e, grad)
    out = fresh_name(f"{w}_grad", used)
    g.outputs.append(ValueInfo(out, vi.dtype, vi.shape))
    return [Node("Identity", [grad], [out], name=fresh_name(f"grad/{w}/output", used))]
