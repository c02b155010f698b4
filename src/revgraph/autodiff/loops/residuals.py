"""What a forward ``Loop`` keeps for its backward loop, and how the backward body reads it back (DESIGN.md
section 4, "Residuals").

The body's VJP reads some body values (the residuals). :func:`plan_residuals` decides, for each, how the
backward iteration for forward iteration t gets it, keeping every distinct value at most once:

* **recomputed** in the backward body from values it has anyway (:attr:`Plan.rerun`): values that depend only
  on the iteration number and loop-invariant values (a row of an outer input read by ``Gather(xs, i)``, possibly
  through ``Squeeze``/``Unsqueeze``/``Cast`` and index arithmetic; the ``Gather`` a lowered ``Scan`` reads its
  scan inputs with), copies (``Identity``, ``Reshape``, ``Squeeze``, ``Unsqueeze``, ``Flatten``) of a value that
  is kept instead, and cheap functions (copies and elementwise arithmetic) of values kept anyway. Under
  ``recompute`` everything but the body inputs is recomputed, as before;
* **read from a stack** at row t (:attr:`Plan.read`): a new scan output of the forward loop
  (:attr:`Plan.stacked`), or a scan output the user's body already has (:attr:`Plan.reused`: a body that
  carries h and scans it out keeps nothing more);
* **shifted** (:attr:`Plan.shifted`): a loop-carried value's per-iteration input is the previous iteration's
  output. When the VJP reads both ``h_in`` and ``h_out`` (or reads ``h_in`` and the body scans ``h_out`` out),
  only ``h_out`` is stacked and ``h_in`` at iteration t is row t - 1 of that stack, or the initial value at
  t = 0; when the body scans ``h_in`` out, ``h_out`` at t is row t + 1 of it, or the loop's final value at
  t = T - 1. The trip count T is the forward loop's (early exit included), so this holds however the loop
  stopped; a loop of zero iterations runs no backward iteration;
* **rebuilt** (:attr:`Plan.rebuilt`): a loop-carried sequence that the body only appends to
  (``S_out = SequenceInsert(S_in, x)``, no position) is at iteration t its initial value followed by ``x`` of
  iterations 0 .. t - 1. A sequence cannot be stacked, but ``x`` can: the backward body rebuilds ``S_in`` from
  the rows ``0 .. t - 1`` of ``x``'s stack with an inner ``Loop`` of ``SequenceInsert`` (tensorflow#13983's
  pattern: a body that reads back everything it wrote, ``ConcatFromSequence`` or ``SequenceAt`` over every
  position; O(t) inserts per backward iteration, as the forward's own reads are O(t)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo
from ...ir.ssa import captured_names
from ..accumulate import is_sequence
from ..context import ForwardPatch
from ..emitter import Emitter
from ..policies import CheckpointPolicy
from .reverse import BOOL, I64, LoopParts

#: copies of their first input: keeping the input instead keeps the same bytes
VIEWS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
#: operators that move or select data without arithmetic (recomputing one is a memory pass, as stacking is)
MOVES = VIEWS | {"Cast", "CastLike", "Gather", "GatherElements", "GatherND", "Slice", "Transpose", "Expand",
                 "Concat", "Tile", "Shape", "Size", "ConstantOfShape", "Range", "Split"}
#: elementwise arithmetic, as cheap to recompute as a copy (index arithmetic, masks, scalings)
ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Mod", "Min", "Max", "Sign", "Floor", "Ceil",
                        "Round", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or",
                        "Xor", "Where", "Relu", "Clip"})
CHEAP = MOVES | ARITHMETIC


@dataclass(frozen=True)
class Shift:
    """``value`` at backward iteration t is row ``t + step`` of the stack of ``source``, or ``boundary`` (an
    enclosing value: the initial value for ``step = -1``, the final value for ``step = +1``) where that row is
    outside the loop."""

    value: str
    source: str
    boundary: str
    step: int


@dataclass
class Plan:
    """How the backward body gets each residual (see the module doc)."""

    stacked: list[str] = field(default_factory=list)  # body values the forward loop stacks as new scan outputs
    reused: dict[str, str] = field(default_factory=dict)  # body value -> the loop output that stacks it already
    read: list[str] = field(default_factory=list)  # body values read back at row t of their stack
    shifted: list[Shift] = field(default_factory=list)
    rerun: list[Node] = field(default_factory=list)  # body nodes recomputed, in body order
    #: carried sequence -> (the appended body value, stacked; the sequence's initial value, an enclosing one)
    rebuilt: dict[str, tuple[str, str]] = field(default_factory=dict)


def plan_residuals(p: LoopParts, needed: list[str], policy: CheckpointPolicy,
                   outer: dict[str, ValueInfo] | None = None) -> Plan:
    """The :class:`Plan` that makes every body value in ``needed`` available in the backward body of ``p``.

    A needed value is kept (each distinct value once, see the module doc) when ``policy.saves`` its producer
    (:class:`~..policies.Store`: every node), else recomputed from what is kept and the body inputs
    (:class:`~..policies.Recompute`: no node, only body inputs kept). Either way values whose shape may change from one
    iteration to the next (scan outputs of inner loops, whose length is the inner trip count, and values with dimensions
    that shape inference could not name) are recomputed from what can be stacked, constants are recomputed,
    and a sequence is never stacked (a scan output is a tensor): it is recomputed, and a tensor read out of a
    sequence is stacked under both policies (when its shape is fixed), so that no sequence has to be kept per
    iteration. A loop-carried sequence that must be kept is a :class:`GraphError`. ``outer``: the types of
    the enclosing graph's values (a carried value is shifted only when its initial value has its type)."""
    return _Planner(p, policy, outer or {}).plan(needed)


class _Planner:
    def __init__(self, p: LoopParts, policy: CheckpointPolicy, outer: dict[str, ValueInfo]):
        self.p, self.policy, self.body, self.types, self.outer = p, policy, p.body, p.types, outer
        self.producer = {o: nd for nd in self.body.nodes for o in nd.outputs if o}
        self.inputs = set(self.body.input_names)
        self.scope = self.inputs | set(self.producer)
        self.free = self._free_values()
        self.kept: dict[str, None] = {}  # values read from a stack (before the carried values are shifted)
        self.carried_in: dict[str, None] = {}  # body inputs needed (loop-carried values)
        self.rerun: set[int] = set()
        self.seen: set[str] = set()
        self.rebuilt: dict[str, tuple[str, str]] = {}

    def _free_values(self) -> set[str]:
        """Body values that depend only on the iteration number, the condition (true in every iteration that
        ran) and loop-invariant values, through cheap operators: recomputed, never stacked."""
        b = self.body
        free = {b.input_names[0], b.input_names[1], *b.initializers}
        for nd in b.nodes:
            if nd.subgraphs or (nd.op_type not in CHEAP and nd.op_type != "Constant"):
                continue
            if all(i in free or i not in self.scope for i in nd.inputs if i):
                free.update(o for o in nd.outputs if o and not is_sequence(self.types, o))
        return free

    def plan(self, needed: list[str]) -> Plan:
        self._resolve(list(needed))
        if any(self.policy.saves(nd) for nd in self.body.nodes):  # (none saved: nothing cheap to drop)
            self._drop_cheap()
        plan = Plan()
        self._shift_carried(plan)
        user = self._user_stacks()
        for v in [*self.carried_in, *self.kept]:
            if v in user:
                plan.reused[v] = user[v]
            elif v not in plan.stacked:
                plan.stacked.append(v)
            plan.read.append(v)
        for s in plan.shifted:  # the stack a shifted value is read from, when nothing else reads it
            if s.source not in plan.reused and s.source not in plan.stacked:
                if s.source in user:
                    plan.reused[s.source] = user[s.source]
                else:
                    plan.stacked.append(s.source)
        for x, _ in self.rebuilt.values():  # the appended values' whole stacks (rows 0 .. t - 1)
            if x not in user and x not in plan.stacked:
                plan.stacked.append(x)
            elif x in user:
                plan.reused[x] = user[x]
        plan.rebuilt = dict(self.rebuilt)
        plan.rerun = [nd for nd in self.body.nodes if id(nd) in self.rerun]
        return plan

    # ------------------------------------------------------------------------------------ what is needed

    def _resolve(self, want: list[str]) -> None:
        """Walk from the needed values up the body: each one is kept, recomputed (then its inputs are needed),
        or a body input."""
        p, types = self.p, self.types
        while want:
            v = want.pop()
            if v in self.seen or v in self.body.initializers:
                continue
            self.seen.add(v)
            nd = self.producer.get(v)
            vi = types.get(v)
            if nd is None:
                if v in self.inputs and vi is not None and vi.kind == "sequence" and self._rebuild(v):
                    continue
                if v in self.inputs and vi is not None and vi.kind == "sequence":
                    raise GraphError(
                        f"the backward pass of a loop body needs the loop-carried sequence {v!r} of every iteration, "
                        "and a sequence cannot be stacked per iteration; revgraph rebuilds a carried sequence that "
                        "the body only appends to (SequenceInsert without a position) from its appended tensors, "
                        "and needs no copy of one whose elements are only appended, erased and read"
                    )
                if v in self.inputs and v not in (p.iter_in, p.cond_in):  # those two are bound in the backward body
                    self.carried_in.setdefault(v)
                continue  # captured from the enclosing graph: visible in the backward body as it is
            from_sequence = any(is_sequence(types, i) for i in nd.inputs if i)
            saves = self.policy.saves(nd)
            if saves and v in self.free:
                self._recompute(nd, want)
            elif saves and self._is_view_of_kept(nd):
                self._recompute(nd, want)  # keep the copied value instead: the same bytes, and maybe shared
            elif self._stackable(v) and (saves or from_sequence):
                self.kept.setdefault(v)
            else:
                self._recompute(nd, want)

    def _rebuild(self, v: str) -> bool:
        """Plan carried sequence ``v`` as rebuilt (module doc) when the body only appends a stackable tensor to it
        and its initial value is an enclosing value the backward body can read."""
        p = self.p
        j = p.v_in.index(v) if v in p.v_in else -1
        if j < 0:
            return False
        nd = self.producer.get(self._canonical(p.v_out[j]))
        init = p.node.inputs[2 + j] if 2 + j < len(p.node.inputs) else ""
        if (nd is None or nd.op_type != "SequenceInsert" or nd.domain or nd.inputs[0] != v
                or (len(nd.inputs) > 2 and nd.inputs[2]) or not self._outer(init) or not self._stackable(nd.inputs[1])):
            return False
        self.rebuilt[v] = (nd.inputs[1], init)
        return True

    def _recompute(self, nd: Node, want: list[str]) -> None:
        if id(nd) not in self.rerun:
            self.rerun.add(id(nd))
            want.extend(i for i in nd.inputs if i)
            want.extend(c for sub in nd.subgraphs.values() for c in captured_names(sub))

    def _stackable(self, v: str) -> bool:
        """Can body value ``v`` be stacked per iteration (a tensor of the same shape in every iteration)?"""
        nd = self.producer.get(v)
        if nd is None:
            return v in self.inputs
        inner_scan = nd.op_type in ("Loop", "Scan") and nd.outputs.index(v) >= _n_state(nd)
        return not inner_scan and nd.op_type != "Constant" and fixed_shape(self.types.get(v)) and not is_sequence(
            self.types, v)

    def _is_view_of_kept(self, nd: Node) -> bool:
        """Is ``nd`` a copy (:data:`VIEWS`) of a body value that can be kept in its place, its other inputs free?"""
        if nd.op_type not in VIEWS or nd.subgraphs or not nd.inputs or not nd.inputs[0]:
            return False
        data, rest = nd.inputs[0], [i for i in nd.inputs[1:] if i]
        return (data in self.scope and data not in self.free and self._stackable(data)
                and all(i in self.free or i not in self.scope for i in rest))

    def _drop_cheap(self) -> None:
        """Recompute, rather than stack, each kept value that a cheap operator (:data:`CHEAP`) computes from
        values the backward body has anyway (kept, body inputs needed, free, recomputed)."""
        have = set(self.kept) | set(self.carried_in)
        for nd in self.body.nodes:
            outs = [o for o in nd.outputs if o]
            if id(nd) in self.rerun:
                have.update(outs)
                continue
            if nd.subgraphs or nd.op_type not in CHEAP or not any(o in self.kept for o in outs):
                continue
            if all(i in have or i in self.free or i not in self.scope for i in nd.inputs if i):
                for o in outs:
                    self.kept.pop(o, None)
                have.update(outs)
                want: list[str] = []
                self._recompute(nd, want)
                self._resolve(want)  # free inputs: their own recomputation

    # ------------------------------------------------------------------------------------ carried values

    def _shift_carried(self, plan: Plan) -> None:
        """Read one of each carried value's input and output from the other's stack (see the module doc)."""
        p = self.p
        user = self._user_stacks()
        for j in range(p.n_carried):
            v_in, out = p.v_in[j], self._canonical(p.v_out[j])
            init, final = p.node.inputs[2 + j], p.node.outputs[j] if j < len(p.node.outputs) else ""
            in_needed, out_needed = v_in in self.carried_in, out in self.kept
            if not (in_needed or out_needed) or not self._shiftable(v_in, out):
                continue
            shift_in = in_needed and self._outer(init) and self._fits(init, v_in)
            if shift_in and out in user:  # h_in from the user's stack of h_out: nothing stacked
                plan.shifted.append(Shift(v_in, out, init, -1))
                del self.carried_in[v_in]
            elif out_needed and v_in in user and self._outer(final):  # h_out from the user's stack of h_in
                plan.shifted.append(Shift(out, v_in, final, +1))
                del self.kept[out]
            elif shift_in and out_needed:  # one stack, of h_out
                plan.shifted.append(Shift(v_in, out, init, -1))
                del self.carried_in[v_in]

    def _shiftable(self, v_in: str, out: str) -> bool:
        """Are carried input ``v_in`` and output ``out`` one tensor value per iteration, of one fixed type?"""
        a, b = self.types.get(v_in), self.types.get(out)
        return (out in self.producer and self._stackable(out) and a is not None and b is not None
                and a.kind == b.kind == "tensor" and a.dtype is not None and a.dtype == b.dtype
                and fixed_shape(a) and a.shape == b.shape)

    def _fits(self, init: str, v_in: str) -> bool:
        """Does the initial value ``init`` have the carried value's type, where the enclosing graph knows it (a
        mismatch would broadcast where the shifted value is selected)?"""
        vi, want = self.outer.get(init), self.types[v_in].shape
        if vi is None or vi.shape is None:
            return True
        return len(vi.shape) == len(want) and all(d is None or d == w for d, w in zip(vi.shape, want, strict=True))

    def _outer(self, name: str) -> bool:
        """Is ``name`` an enclosing value the backward body can read (not shadowed by a body name)?"""
        return bool(name) and name not in self.scope

    def _canonical(self, v: str) -> str:
        """``v`` with ``Identity`` copies inside the body looked through."""
        while (nd := self.producer.get(v)) is not None and nd.op_type == "Identity" and nd.inputs[0] in self.scope:
            v = nd.inputs[0]
        return v

    def _user_stacks(self) -> dict[str, str]:
        """Body value -> the loop output stacking it: the user's own scan outputs (``Identity`` looked through)."""
        p, stacks = self.p, {}
        for s, name in enumerate(p.scan_out):
            pos = p.n_carried + s
            out = p.node.outputs[pos] if pos < len(p.node.outputs) else ""
            if out and not is_sequence(self.types, name):
                stacks.setdefault(self._canonical(name), out)
        return stacks


def _n_state(node: Node) -> int:
    """The number of loop-carried (state) outputs of a ``Loop`` or ``Scan`` node."""
    if node.op_type == "Loop":
        return len(node.inputs) - 2
    return len(node.inputs) - int(node.attrs.get("num_scan_inputs", 0))


def fixed_shape(vi: ValueInfo | None) -> bool:
    """Is the value's shape the same in every iteration? Static dimensions and symbols that name a graph
    input's dimension are; unknown dimensions (and the ``unk__`` symbols ONNX inference makes up) may not be."""
    if vi is None or vi.shape is None:
        return False
    return all(isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__")) for d in vi.shape)


# ---------------------------------------------------------------------------------------- emitting the plan

def static_trips(e: Emitter, p: LoopParts) -> int | None:
    """The number of iterations of ``p``'s loop when the graph says it before running: a constant trip count
    and a condition that cannot stop the loop (absent or constant true outside, passed on unchanged or constant
    true inside). ``None`` otherwise."""
    node, body = p.node, p.body
    m = e.value(node.inputs[0]) if node.inputs and node.inputs[0] else None
    cond = node.inputs[1] if len(node.inputs) > 1 else ""
    if m is None or m.size != 1 or (cond and not _is_true(e.value(cond))):
        return None
    producer = {o: nd for nd in body.nodes for o in nd.outputs if o}
    c = body.output_names[0]
    while c != p.cond_in:
        nd = producer.get(c)
        if nd is not None and nd.op_type == "Identity":
            c = nd.inputs[0]
        elif ((nd is not None and nd.op_type == "Constant" and _is_true(nd.attrs.get("value")))
              or (c in body.initializers and _is_true(body.initializers[c]))):
            break
        else:
            return None
    return max(int(np.asarray(m).reshape(-1)[0]), 0)


def declare_outputs(e: Emitter, p: LoopParts) -> None:
    """Complete the types of ``p``'s loop outputs where ``e`` lacks what the body says (ONNX's inference leaves a
    ``Loop``'s carried outputs unshaped and its scan outputs of unknown length): each final value of a carried
    tensor whose body input and output agree on a fixed shape gets it, and each scan output its length when
    :func:`static_trips` knows it, so that the residuals a backward graph keeps have sizes
    (:func:`..memory.saved_bytes`)."""
    types = e.types
    for j, out in enumerate(p.node.outputs[: p.n_carried]):
        known, a, b = types.get(out), p.types.get(p.v_in[j]), p.types.get(p.v_out[j])
        if not out or (known is not None and known.shape is not None) or a is None or b is None:
            continue
        if a.kind == b.kind == "tensor" and a.dtype is not None and a.dtype == b.dtype and fixed_shape(a) \
                and a.shape == b.shape:
            types[out] = ValueInfo(out, a.dtype, a.shape)
    rows = static_trips(e, p)
    if rows == 0:  # (left unknown: onnxruntime's inference then merges a [0] stack with the [1] it infers for
        return     # the reductions of it, and refuses the graph; a loop that never runs keeps nothing anyway)
    for out, row in zip(p.node.outputs[p.n_carried :], p.scan_out, strict=False):
        known, vi = types.get(out), p.types.get(row)
        if not out or rows is None or vi is None or vi.kind != "tensor" or not fixed_shape(vi):
            continue
        if known is None or known.shape is None or not isinstance(known.shape[0], int):
            types[out] = ValueInfo(out, vi.dtype, (rows, *vi.shape))


def _is_true(value) -> bool:
    return value is not None and np.asarray(value).size == 1 and bool(np.asarray(value).reshape(-1)[0])


def emit_plan(e: Emitter, eb: Emitter, p: LoopParts, plan: Plan, t: str, trips: str, patch: ForwardPatch,
              rows: int | None) -> None:
    """Emit ``plan``: the forward loop stacks :attr:`Plan.stacked` (``patch``; stacks typed ``[rows, ...]``,
    ``rows`` None when T is not known before running), and the backward body ``eb`` reads row ``t`` of each
    stack and the shifted values, then recomputes :attr:`Plan.rerun`."""
    stacks = dict(plan.reused)
    for r in plan.stacked:
        stacks[r] = stack_residual(e, p, r, patch, rows)
    name = p.node.name
    for r in plan.read:
        eb.nodes.append(Node("Gather", [stacks[r], t], [r], {"axis": 0}, eb.fresh(f"grad/{name}/residual/{r}")))
    one = eb.const(np.array(1, np.int64))
    for s in plan.shifted:
        with eb.scope(f"grad/{name}/shift/{s.value}"):
            if s.step < 0:  # row t - 1 (row 0 when t = 0, then not selected)
                edge = eb.op("Equal", [t, eb.const(np.array(0, np.int64))], shape=(), dtype=BOOL)
                row = eb.op("Max", [eb.op("Sub", [t, one], shape=(), dtype=I64), eb.const(np.array(0, np.int64))],
                            shape=(), dtype=I64)
            else:  # row t + 1 (row T - 1 when t = T - 1, then not selected)
                last = eb.op("Sub", [trips, one], shape=(), dtype=I64)
                edge = eb.op("Equal", [t, last], shape=(), dtype=BOOL)
                row = eb.op("Min", [eb.op("Add", [t, one], shape=(), dtype=I64), last], shape=(), dtype=I64)
            vi = p.types[s.value]
            neighbour = eb.op("Gather", [stacks[s.source], row], axis=0, dtype=vi.dtype, shape=vi.shape)
            eb.nodes.append(Node("Where", [edge, s.boundary, neighbour], [s.value], name=eb.fresh(
                f"grad/{name}/shift/{s.value}")))
    for seq, (x, init) in plan.rebuilt.items():
        _rebuild_sequence(eb, p, seq, stacks[x], init, t)
    eb.nodes += [nd.copy() for nd in plan.rerun]


def _rebuild_sequence(eb: Emitter, p: LoopParts, seq: str, stack: str, init: str, t: str) -> None:
    """Emit, in the backward body ``eb``, the carried sequence ``seq`` at forward iteration ``t``: ``init``
    with rows ``0 .. t - 1`` of ``stack`` appended, by a ``Loop`` of ``t`` iterations (module doc, "rebuilt")."""
    name = p.node.name
    with eb.scope(f"grad/{name}/rebuild/{seq}"):
        inner = eb.child(eb.types, f"grad/{name}/rebuild/{seq}")
        k, cond = inner.fresh(f"{inner.prefix}/k"), inner.fresh(f"{inner.prefix}/cond")
        s_in = inner.fresh(f"{inner.prefix}/in")
        vi = p.types[seq]
        inner.types[s_in] = ValueInfo(s_in, vi.dtype, vi.shape, "sequence")
        row = inner.op("Gather", [stack, k], axis=0)
        s_out = inner.op("SequenceInsert", [s_in, row])
        inner.types[s_out] = ValueInfo(s_out, vi.dtype, vi.shape, "sequence")
        keep = inner.op("Identity", [cond], shape=(), dtype=BOOL)
        body = Graph(inner.nodes, [ValueInfo(k, I64, ()), ValueInfo(cond, BOOL, ()), ValueInfo(s_in, vi.dtype,
                                                                                               vi.shape, "sequence")],
                     [ValueInfo(keep, BOOL, ()), ValueInfo(s_out, vi.dtype, vi.shape, "sequence")],
                     name=inner.fresh(f"{inner.prefix}/body").replace("/", "_"))
    eb.nodes.append(Node("Loop", [t, "", init], [seq], {"body": body}, eb.fresh(f"grad/{name}/rebuild/{seq}")))
    eb.types[seq] = ValueInfo(seq, vi.dtype, vi.shape, "sequence")


def stack_residual(e: Emitter, p: LoopParts, r: str, patch: ForwardPatch, rows: int | None) -> str:
    """Make the forward loop stack body value ``r`` per iteration (one more scan output, through ``patch``);
    return the stack's name (typed ``[rows, ...]``)."""
    name = p.node.name
    vi = p.types.get(r) or ValueInfo(r)
    out, stack = e.fresh(f"{name}/residual/{r}"), e.fresh(f"{name}/stacked/{r}")
    patch.body.append(Node("Identity", [r], [out], name=out))
    patch.scan_outputs.append((ValueInfo(out, *vi.dtype_shape), stack))
    e.types[stack] = ValueInfo(stack, vi.dtype, None if vi.shape is None else (rows, *vi.shape))
    return stack

