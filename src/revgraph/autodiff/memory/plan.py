"""The memory planner: which forward values the backward keeps and which it recomputes (rematerialization).

A gradient graph computes the forward values, then the backward nodes, which read some forward values (the
residuals, :mod:`.residuals`). Each residual can be **kept** (alive from its producer to its last backward
reader: bytes) or **recomputed** inside the backward graph from values that are kept (FLOPs). The planner
chooses, over the whole top-level graph, the cheapest mix:

- It is a minimum s-t cut, as torch.compile's min-cut partitioner (``torch/_functorch/partitioners.py``,
  after Checkmate: Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization",
  MLSys 2020). Every forward value ``v`` is split into ``v_in -> v_out`` with capacity ``bytes(v)`` (cutting it =
  keeping ``v``); a recomputable node ``n`` has edges ``u_out -> n`` from its inputs and ``n -> v_in`` to its
  outputs (infinite), and ``source -> n`` with capacity ``lambda * flops(n)`` (cut when ``n`` is on the sink side:
  recomputed); residuals have ``v_out -> sink`` (infinite); values a node that cannot be recomputed writes hang
  from the source. A minimum cut then minimises ``kept bytes + lambda * recomputed FLOPs`` exactly, for the
  recomputation being ordinary forward nodes run in the backward (the sink side: every recomputed node's
  inputs are kept or recomputed themselves).
- ``lambda`` (bytes per FLOP) is the Lagrange multiplier of the budget: ``lambda = inf`` is the default plan,
  which recomputes only the free operators (no FLOPs: reshapes, transposes, casts, ... :data:`.cost.FREE`) and
  cheap elementwise images of kept values (costed at half their bytes: a value is never kept beside its
  elementwise image when one suffices); ``lambda = 0`` keeps the fewest bytes possible. Under a budget,
  ``lambda`` is bisected (on a log scale) to the largest value whose plan keeps at most the budget: kept bytes fall
  monotonically with ``lambda`` (parametric min-cut), so the plan found minimises recomputation among the Lagrangian
  plans that meet it. The plans that meet it are then ranked by their step's predicted peak (:func:`_search`,
  :mod:`.lifetime`): keeping fewer bytes can hold more at once when recomputed chains live long.
- A tie-breaking cost of one thousandth of a node's output bytes makes a recomputation that saves nothing
  lose to keeping the value; in the default plan a recomputation must save at least 16 KiB (each is one more
  node to run), so the default plan changes nothing that saves no real memory.

Before the cut, backward ``Shape``/``Size`` nodes of forward values move into the forward (``hoist/...``): a
VJP that needs a value's shape keeps a few int64s, not the value. Random operators (their draws and masks),
loops and branches (their own checkpoint policies decide inside
them), sequences and nodes of unknown size are never recomputed; values a backward subgraph captures are kept.
The recomputed nodes are copies of the forward nodes named ``remat/<node>`` that write ``<value>__remat``
values, placed just before the first backward node that reads them (so they live only from there to their
last backward reader); forward nodes whose outputs nothing reads any more are removed.

Runtimes that merge common subexpressions would merge a recomputation back into its forward node (the
gradient stays right, the saving is lost): revgraph's onnxruntime sessions turn off
:data:`~revgraph.runtime.options.ORT_DISABLED_OPTIMIZERS` for graphs with ``remat/`` nodes
(:func:`revgraph.runtime.options.disabled_optimizers`); other runtimes' users should do the same.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ... import validate as V
from ...ir import REMAT_PREFIX, Graph, Node, ValueInfo, fresh_name
from ...ir.ssa import captured_names
from ...onnx_io.arguments import AS_GRAPH, ModelLike
from ...runtime.options import ORT_DISABLED_OPTIMIZERS
from ...warn import warn
from .budget import DEFAULT_SYMBOLIC_DIM, OPTIONAL_BUDGET, Budget
from .cost import ALIASING, cheap, flops, is_identity, recomputable
from .lifetime import lifetimes
from .mincut import INF, Network
from .residuals import is_backward_node, value_bytes

__all__ = ["ORT_DISABLED_OPTIMIZERS", "REMAT_PREFIX", "MemoryPlan", "plan_memory"]
_SCALE = 2**22  # finite cut costs are scaled to about this many units (scipy's capacities are int32)
_NEVER = 2**26  # more than any finite cut: "do not recompute" for lambda = inf
_TIE = 1e-3  # tie-breaking cost of a recomputation, per byte it writes
_KEEP = frozenset({"Shape", "Size", "Constant"})  # outputs a few bytes: kept, never recomputed (Shape reads a value)
HOIST_PREFIX = "hoist/"  # backward Shape/Size nodes moved into the forward (_hoist_shapes)
_MIN_SAVING = 16384  # bytes a free recomputation must save in the default plan (per-node cost of running it)
_CHEAP = 0.5  # in the default plan, recomputing a cheap or copying node costs this share of its output bytes
_SKEW = 0.05  # FLOPs of the last forward node count this much more than the first's (see _Cuts)
_PEAK_GAIN = 0.05  # under a budget, a plan recomputing more than the least must lower the predicted peak this much


@dataclass
class MemoryPlan:
    """What :func:`plan_memory` chose for a gradient graph.

    ``saved_before``: residual bytes without recomputation; ``saved_default``: those of the default plan (free
    operators recomputed); ``saved_after``: those of the chosen plan; ``recomputed_flops``: the FLOPs its
    recomputation adds to a step; ``recomputed``: the recomputed forward nodes' names; ``target``: the budget
    in bytes (``None`` for the default plan); ``met``: whether the plan keeps at most the target; ``unknown``:
    residuals of unknown size (kept, counted as 0 bytes). Sizes use ``dims`` for symbolic dimensions.
    ``peak_default`` and ``peak_after``: under a budget, the peak of the bytes alive at once that
    :func:`.lifetime.lifetimes` predicts for the default plan and the chosen one (``None`` without a budget)."""

    saved_before: int = 0
    saved_default: int = 0
    saved_after: int = 0
    recomputed_flops: int = 0
    recomputed: list[str] = field(default_factory=list)
    target: int | None = None
    met: bool = True
    unknown: list[str] = field(default_factory=list)
    dims: dict[str, int] = field(default_factory=dict)
    peak_default: int | None = None
    peak_after: int | None = None

    def summary(self) -> str:
        """One line: saved bytes before and after, the recomputation added."""
        text = (f"residuals {human_bytes(self.saved_before)} without recomputation, {human_bytes(self.saved_after)} "
                f"kept; {len(self.recomputed)} forward node(s) recomputed ({human_flops(self.recomputed_flops)})")
        if self.target is not None:
            text += f"; budget {human_bytes(self.target)}" + ("" if self.met else " (not reachable)")
        if self.peak_after is not None and self.peak_default is not None:
            text += (f"; predicted peak of the step's tensors {human_bytes(self.peak_after)} "
                     f"(default plan {human_bytes(self.peak_default)})")
        if self.dims:
            text += " at " + ", ".join(f"{k}={v}" for k, v in sorted(self.dims.items()))
        return text


def human_bytes(n: int) -> str:
    """``512 B``, ``12.3 KB``, ``45.67 MB``, ``1.23 GB`` (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{1 if unit == 'KB' else 2}f} {unit}"
    return f"{n} B"


def human_flops(n: int) -> str:
    """``0 FLOP``, ``512 FLOP``, ``12.3 KFLOP``, ``4.31 GFLOP`` (powers of 1000)."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.{1 if unit == 'KFLOP' else 2}f} {unit}"
    return f"{n} FLOP"


class _Problem:
    """The forward part of a gradient graph as the planner sees it: residuals, sizes, costs."""

    def __init__(self, graph: Graph, dims: Mapping[str, int]):
        self.graph, self.dims = graph, dims
        # (a view, not a copy of value_info: the planner's own maps are a long build's peak)
        self.types: Mapping[str, ValueInfo] = collections.ChainMap(
            {vi.name: vi for vi in [*graph.inputs, *graph.outputs]}, graph.value_info,
            {k: ValueInfo(k, a.dtype, a.shape) for k, a in graph.initializers.items()})
        self.outputs = set(graph.output_names)
        self.producer: dict[str, int] = {}
        self.forward: list[int] = []
        self.backward: list[int] = []
        residual: set[str] = set()
        self.pinned: set[str] = set()
        for k, node in enumerate(graph.nodes):
            if is_backward_node(node):
                self.backward.append(k)
                residual.update(i for i in node.inputs if i in self.producer)  # (producers come first)
                for sub in node.subgraphs.values():
                    self.pinned.update(captured_names(sub))
            else:
                self.forward.append(k)
                for o in node.outputs:
                    if o:
                        self.producer.setdefault(o, k)
        self.residuals = sorted((r for r in residual | self.pinned if r in self.producer), key=self.producer.get)
        self.pinned &= set(self.residuals)
        self._bytes: dict[str, int | None] = {}
        self._flops: dict[int, int | None] = {}
        self._cheap: dict[int, bool] = {}

    @functools.cached_property
    def peak_dims(self) -> dict[str, int]:
        """Symbolic dimensions for the predicted peak: those of the graph's inputs (the budget's sizes, else the
        default), not those shape inference left unnamed inside (``unk__3``): sized 64 each, a value with several
        of them would outweigh the whole step (such values count as unknown, 0 bytes)."""
        names = {d for vi in self.graph.inputs for d in (vi.shape or ()) if isinstance(d, str)}
        return {d: self.dims.get(d) for d in names | set(dict.keys(self.dims))}

    @functools.cached_property
    def position(self) -> dict[int, float]:
        """Where each forward node stands in the forward pass, from 0 to 1 (only the min-cut needs it)."""
        return {k: j / max(1, len(self.forward)) for j, k in enumerate(self.forward)}

    def constant(self, v: str):
        """The value of ``v`` when it is an initializer or a ``Constant`` node's output, else ``None``."""
        if v in self.graph.initializers:
            return self.graph.initializers[v]
        k = self.producer.get(v)
        node = self.graph.nodes[k] if k is not None else None
        if node is not None and node.op_type == "Constant" and isinstance(node.attrs.get("value"), np.ndarray):
            return node.attrs["value"]
        return None

    def bytes(self, v: str) -> int | None:
        if v not in self._bytes:
            self._bytes[v] = value_bytes(self.types.get(v), self.dims)
        return self._bytes[v]

    def flops(self, k: int) -> int | None:
        if k not in self._flops:
            node = self.graph.nodes[k]
            ok = (recomputable(node, self.constant) and node.op_type not in _KEEP
                  and all(self.bytes(o) is not None for o in node.outputs if o))
            self._flops[k] = flops(node, self.types, self.dims) if ok else None
        return self._flops[k]

    def is_cheap(self, k: int) -> bool:
        """Is forward node ``k`` elementwise and no larger than its output (:func:`.cost.cheap`)?"""
        if k not in self._cheap:
            self._cheap[k] = cheap(self.graph.nodes[k], self.types, self.dims)
        return self._cheap[k]

    def kept_bytes(self, recomputed: set[int]) -> int:
        """The residual bytes of the graph with ``recomputed`` rewritten (what :func:`.residuals.saved_bytes` will
        find): the residuals no recomputed node writes, and the forward values the recomputed nodes read. (Not
        the values the cut crosses: a graph output's edge costs nothing, so a minimum cut may cross one that
        nothing reads, issue 42.)"""
        written = {o for k in recomputed for o in self.graph.nodes[k].outputs if o}
        kept = {r for r in self.residuals if r not in written}
        for k in recomputed:
            kept.update(i for i in self.graph.nodes[k].inputs if i in self.producer and i not in written)
        return sum(self.bytes(v) or 0 for v in kept)

    def candidates(self, free_only: bool) -> list[int]:
        """The recomputable forward nodes some residual depends on through recomputable nodes only (with
        ``free_only``, the default plan's: free and cheap elementwise nodes)."""
        seen: set[int] = set()
        stack = [self.producer[r] for r in self.residuals if r not in self.pinned]
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            if free_only and sum(self.bytes(o) or 0 for o in self.graph.nodes[k].outputs if o) < _MIN_SAVING:
                continue  # keeping its outputs is cheaper than the least a recomputation costs there: exact
            f = self.flops(k)
            if f is None or (free_only and f > 0 and not self.is_cheap(k)):
                continue
            seen.add(k)
            stack.extend(self.producer[i] for i in self.graph.nodes[k].inputs if i in self.producer)
        return sorted(seen)


class _Cuts:
    """The flow network over the candidate ``nodes`` (module doc), built once; :meth:`solve` cuts it for one
    multiplier. ``default``: the default plan's costs (free and cheap nodes only, :data:`_MIN_SAVING`)."""

    def __init__(self, p: _Problem, nodes: list[int], unit: float, default: bool):
        self.p, self.nodes, self.unit, self.default = p, nodes, unit, default
        net = self.net = Network()
        vin: dict[str, int] = {}
        vout: dict[str, int] = {}
        nid = {k: net.vertex() for k in nodes}

        def out_vertex(v: str) -> int:
            if v not in vout:
                vout[v] = net.vertex()
                cap = 0 if v in p.outputs else math.ceil((p.bytes(v) or 0) / unit)
                k = p.producer[v]
                if k in nid:
                    vin[v] = net.vertex()
                    net.edge(nid[k], vin[v], INF)
                    net.edge(vin[v], vout[v], cap)
                else:  # written by a node that stays in the forward: kept if needed
                    net.edge(Network.SOURCE, vout[v], cap)
            return vout[v]

        self.recompute_edges: list[int] = []  # the source -> node edge of each candidate, in ``nodes`` order
        self.ties: list[int] = []
        self.flops: list[float] = []
        for k in nodes:
            node = p.graph.nodes[k]
            f = p.flops(k)
            out_bytes = sum(p.bytes(o) or 0 for o in node.outputs if o)
            tie = max(1, math.ceil(_TIE * out_bytes / unit))
            if default:  # a recomputation is one more node to run: worth it for a real saving
                tie = max(tie, math.ceil(_MIN_SAVING / unit))
                if (f and p.is_cheap(k)) or (f == 0 and node.op_type not in ALIASING and not is_identity(node)):
                    # one pass over its output (elementwise, or a copy): worth it where it saves twice that
                    f, tie = 0, tie + math.ceil(_CHEAP * out_bytes / unit)
            self.ties.append(tie)
            self.flops.append(f * (1 + _SKEW * p.position[k]))  # later nodes a little dearer: ties flip one by one
            self.recompute_edges.append(net.edge(Network.SOURCE, nid[k], tie))
            for i in node.inputs:
                if i in p.producer:
                    net.edge(out_vertex(i), nid[k], INF)
            for o in node.outputs:
                if o:
                    out_vertex(o)
        for r in p.residuals:
            net.edge(out_vertex(r), Network.SINK, INF)
            if r in p.pinned and r in vin:
                net.edge(Network.SOURCE, vin[r], INF)
        self.nid = nid

    def solve(self, lam: float | None) -> tuple[set[int], int, int]:
        """The minimum cut for ``lam`` (``None``: infinity, only FLOP-free recomputation): the recomputed nodes,
        the residual bytes kept and the FLOPs recomputed."""
        costs = [tie if f == 0 else (_NEVER if lam is None else min(_NEVER, tie + math.ceil(lam * f / self.unit)))
                 for tie, f in zip(self.ties, self.flops, strict=True)]
        side = self.net.source_side(dict(zip(self.recompute_edges, costs, strict=True)))
        p = self.p
        recomputed = {k for k in self.nodes if not side[self.nid[k]]}
        return recomputed, p.kept_bytes(recomputed), sum(p.flops(k) or 0 for k in recomputed)


@V.arguments(graph=AS_GRAPH, budget=OPTIONAL_BUDGET)
def plan_memory(graph: ModelLike, budget: Budget | None = None) -> MemoryPlan:
    """Choose the residuals of the gradient graph ``graph`` (top level; written by :func:`revgraph.gradient`)
    under ``budget`` and rewrite ``graph`` in place with the recomputation (see the module doc). ``None`` is the
    default plan: only free operators (views, copies) and cheap elementwise images of kept values are
    recomputed, where that keeps fewer bytes than the recomputation moves (twice for copies and elementwise
    nodes, 16 KiB at least). A fraction budget is of that plan's bytes. A budget that cannot be
    met warns (``UserWarning``) with the smallest achievable figure and applies that plan. Returns the
    :class:`MemoryPlan`. Values with symbolic dimensions are sized with ``budget.dims`` (others: 64)."""
    dims = dict(budget.dims) if budget is not None else {}
    _hoist_shapes(graph)
    sizing = _Dims(dims)
    p = _Problem(graph, sizing)
    sizes = [p.bytes(r) for r in p.residuals]
    plan = MemoryPlan(saved_before=sum(s or 0 for s in sizes), dims=sizing.used,
                      unknown=[r for r, s in zip(p.residuals, sizes, strict=True) if s is None])
    free = p.candidates(free_only=True)
    chosen, kept, cost = (_Cuts(p, free, _unit(p, free, plan), True).solve(None) if free
                          else (set(), plan.saved_before, 0))
    plan.saved_default = kept
    if budget is not None and not (budget.fraction is not None and budget.fraction >= 1):
        target = round(budget.fraction * kept) if budget.fraction is not None else budget.bytes
        plan.target = target
        if kept > target:
            chosen, kept, cost = _search(p, target, plan, (chosen, kept, cost))
            plan.met = kept <= target or target == 0
            if not plan.met and target > 0:  # (a budget of 0 asks for the least memory: no warning)
                warn(f"the memory budget of {human_bytes(target)} cannot be met: recomputing everything "
                     f"recomputable keeps {human_bytes(kept)} of residuals; the graph keeps that")
    plan.saved_after, plan.recomputed_flops = kept, cost
    plan.recomputed = [graph.nodes[k].name or graph.nodes[k].op_type for k in sorted(chosen)]
    if chosen:
        _rewrite(graph, p, sorted(chosen))
    return plan


def _unit(p: _Problem, nodes: list[int], plan: MemoryPlan) -> float:
    """Bytes per capacity unit: every finite cut of the network over ``nodes`` fits in about :data:`_SCALE`."""
    total = sum(p.bytes(o) or 0 for k in nodes for o in p.graph.nodes[k].outputs if o)
    return max(1.0, (total + plan.saved_before) / _SCALE)


Choice = tuple[set[int], int, int]  # (recomputed forward nodes, residual bytes kept, FLOPs recomputed)


def _search(p: _Problem, target: int, plan: MemoryPlan, default: Choice) -> Choice:
    """The plan under a budget of ``target`` bytes. Candidates: the plans of the multipliers bisected on a log
    scale (the largest one that keeps at most ``target`` bytes is the plan with the least recomputation that
    fits), four per decade, and ``lambda = 0`` (the fewest bytes). Of those that fit, the one whose step has the
    lowest predicted peak (:func:`.lifetime.lifetimes` of the rewritten graph in its own order): a low multiplier
    recomputes long chains whose values then live from the start of the backward to their own layer's, so
    keeping fewer bytes can raise the peak. A plan recomputing more than the least-recomputation plan must lower
    the predicted peak by :data:`_PEAK_GAIN`. A budget of 0 (``memory=0``) asks for the least memory: every
    candidate competes, the default plan's included (the fewest bytes among equal peaks), so the result is never
    predicted above the default's peak. A budget below the fewest bytes any plan keeps gets the fewest-bytes
    plans (the caller warns)."""
    nodes = p.candidates(free_only=False)
    cuts = _Cuts(p, nodes, _unit(p, nodes, plan), False)
    fewest = cuts.solve(0.0)
    trials = [fewest, *(cuts.solve(10.0 ** (e / 4)) for e in range(-48, 25))]  # four per decade
    lo, hi = -12.0, 6.0  # log10 of lambda, bytes per FLOP: 1e-12 recomputes anything, 1e6 nothing with FLOPs
    least = fewest  # the fitting plan of the largest multiplier: the least recomputation
    for _ in range(40 if fewest[1] <= target else 0):  # (fine enough to separate the skewed ties)
        mid = (lo + hi) / 2
        trial = cuts.solve(10.0**mid)
        trials.append(trial)
        lo, hi, least = (mid, hi, trial) if trial[1] <= target else (lo, mid, least)
    if target == 0:
        fits = {frozenset(t[0]): t for t in [*trials, default]}
    else:
        bar = max(target, fewest[1])
        fits = {frozenset(t[0]): t for t in trials if t[1] <= bar}
    peaks = {key: _predicted_peak(p, set(key)) for key in fits}
    plan.peak_default = _predicted_peak(p, default[0])
    best = min(fits, key=lambda key: (peaks[key], fits[key][1], fits[key][2]))
    if target > 0 and frozenset(least[0]) in fits and peaks[best] > (1 - _PEAK_GAIN) * peaks[frozenset(least[0])]:
        best = frozenset(least[0])
    plan.peak_after = peaks[best]
    return fits[best]


def _predicted_peak(p: _Problem, chosen: set[int]) -> int:
    """The peak of the bytes alive at once (:func:`.lifetime.lifetimes`) in ``p``'s graph with ``chosen``
    recomputed (rewritten on a copy; ``p.graph`` is not changed)."""
    graph = p.graph.copy()
    if chosen:
        _rewrite(graph, p, sorted(chosen))
    return lifetimes(graph, p.peak_dims).peak


class _Dims(dict):
    """Symbolic dimension sizes: the budget's, else :data:`DEFAULT_SYMBOLIC_DIM`; remembers which it used."""

    def __init__(self, given: Mapping[str, int]):
        super().__init__(given)
        self.used: dict[str, int] = {}

    def get(self, key, default=None):
        value = super().get(key, DEFAULT_SYMBOLIC_DIM)
        self.used[key] = value
        return value


def _hoist_shapes(graph: Graph) -> None:
    """Move each backward ``Shape``/``Size`` of a forward value to just after that value's producer, renamed
    ``hoist/...``: a VJP that needs only a value's shape (ReduceMean's, Reshape's, Slice's, when a dimension is
    symbolic), or the accumulation of sparse rows into a table of that shape, would otherwise keep the whole
    value alive until the backward, for a few int64s."""
    producer: dict[str, int] = {}
    moved: dict[int, list[Node]] = {}
    gone: set[int] = set()
    for k, node in enumerate(graph.nodes):
        if not is_backward_node(node):
            producer.update((o, k) for o in node.outputs if o)
        elif (node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx") and node.inputs
              and node.inputs[0] in producer and not node.name.startswith(REMAT_PREFIX)):
            node.name = HOIST_PREFIX + node.name.split("/", 1)[1]  # (grad/, accum/ or seed/ ...)
            moved.setdefault(producer[node.inputs[0]], []).append(node)
            gone.add(k)
            _type_shape_node(graph, node)
    if moved:
        out: list[Node] = []
        for k, node in enumerate(graph.nodes):
            if k not in gone:
                out.append(node)
                out.extend(moved.get(k, ()))
        graph.nodes = out


def _type_shape_node(graph: Graph, node: Node) -> None:
    """Declare the output of a hoisted ``Shape`` (int64 ``[rank]``, or its ``start:end`` slice) or ``Size``
    (int64 scalar) where it is undeclared and the input's rank is known, so that it is sized as a residual."""
    out = node.outputs[0] if node.outputs else ""
    vi = graph.type_of(node.inputs[0])
    if not out or out in graph.value_info:
        return
    if node.op_type == "Size":
        graph.value_info[out] = ValueInfo(out, np.int64, ())
    elif vi is not None and vi.shape is not None:
        r = len(vi.shape)
        start, end = node.attrs.get("start", 0), node.attrs.get("end", r)
        n = len(range(r)[slice(start, end)])
        graph.value_info[out] = ValueInfo(out, np.int64, (n,))


def _rewrite(graph: Graph, p: _Problem, chosen: list[int]) -> None:
    """Insert copies of the ``chosen`` forward nodes before their first backward reader; rename the reads."""
    used = graph.names_in_use()
    rename: dict[str, str] = {}
    copies: dict[int, Node] = {}
    for k in chosen:  # forward order: a copy's recomputed inputs are renamed already
        node = graph.nodes[k]
        if is_identity(node):  # (Identity, Dropout that draws nothing): read its input, recomputed or kept
            rename[node.outputs[0]] = rename.get(node.inputs[0], node.inputs[0])
            continue
        new = node.copy()
        new.name = fresh_name(f"{REMAT_PREFIX}{node.name or node.op_type}", used)
        new.inputs = [rename.get(i, i) for i in node.inputs]
        for j, o in enumerate(node.outputs):
            if o:
                rename[o] = new.outputs[j] = fresh_name(f"{o}__remat", used)
                vi = p.types.get(o)
                if vi is not None:
                    graph.value_info[rename[o]] = ValueInfo(rename[o], vi.dtype, vi.shape, vi.kind)
        copies[k] = new
    first: dict[str, int] = {}
    for pos, k in enumerate(p.backward):
        node = graph.nodes[k]
        if not rename.keys().isdisjoint(node.inputs):
            node.inputs = [rename.get(i, i) for i in node.inputs]
            for i in node.inputs:
                first.setdefault(i, pos)
    at: dict[int, int] = {}
    remat = {o for new in copies.values() for o in new.outputs if o}
    for k in reversed(list(copies)):  # a copy runs before its first reader, backward node or copy
        new = copies[k]
        at[k] = min((first[o] for o in new.outputs if o in first), default=len(p.backward))
        for i in new.inputs:
            if i in remat:
                first[i] = min(first.get(i, at[k]), at[k])
    slots: dict[int, list[Node]] = {}
    for k, copy in copies.items():
        slots.setdefault(at[k], []).append(copy)
    out = [graph.nodes[k] for k in p.forward]
    for pos, k in enumerate(p.backward):
        out.extend(slots.get(pos, ()))
        out.append(graph.nodes[k])
    out.extend(slots.get(len(p.backward), ()))
    graph.nodes = _drop_dead_forward(graph, out)


def _drop_dead_forward(graph: Graph, nodes: list[Node]) -> list[Node]:
    """``nodes`` without the forward nodes none of whose outputs anything reads any more (their readers were
    backward nodes that now read a recomputation); random nodes stay (removing one changes later draws)."""
    read = set(graph.output_names)
    keep = [True] * len(nodes)
    for idx in range(len(nodes) - 1, -1, -1):
        node = nodes[idx]
        if (not is_backward_node(node) and read.isdisjoint(o for o in node.outputs if o) and not node.subgraphs
                and recomputable(node)):
            keep[idx] = False
            continue
        read.update(i for i in node.inputs if i)
        for sub in node.subgraphs.values():
            read.update(captured_names(sub))
    return [n for n, k in zip(nodes, keep, strict=True) if k]
