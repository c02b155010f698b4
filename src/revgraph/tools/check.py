"""Numeric gradient checking: the backward pass against float64 central differences along random directions.

For a loss L (a graph output) the check projects L on a random cotangent u, f(w) = sum(u * L(w)), and for
each wrt value w and random direction v compares the VJP ``<grad_w f, v>`` with the central difference
``(f(w + h v) - f(w - h v)) / 2h``. Everything runs in float64 (the graph's float tensors, constants, casts
and statistics are promoted, :func:`to_float64`), so the comparison measures the rules, not float32 rounding;
where onnxruntime has no float64 kernel, or one that computes in float32, the graphs run on the reference
evaluator (whose float64 kernels :mod:`revgraph.runtime.reference_ops` makes exact), and the report says so.

Randomness is fixed: the masks of ``Dropout`` nodes and the outputs of random operators (top-level graph) are
taken from the run that computes the gradient and replayed in the runs that take the differences, with the
ONNX spec's formula ``x * mask / (1 - ratio)``, so both sides see the same function.

Steps follow each value's scale: element ``i`` of a wrt value ``x`` moves by ``h * max(1, |x_i|) * v_i``
(``h`` the relative step, 1e-6), so a weight of 1e12 moves by about 1e6 instead of by less than its float64
resolution (1e-4 there), and a value of 1e-8 still moves by 1e-6.

A value is *not checked* (its row says why, and it does not fail the check) when moving it changes the shape
of the loss (``OneHot`` depth, ``Range`` limit), when the loss is not differentiable at the inputs along a
direction tried (a kink or a jump: the one-sided differences disagree at two step sizes, e.g. ``Relu`` at 0,
tied ``Max`` inputs), where every convention for the gradient is as good as another, when the loss or the
value itself is not finite there (NaN or inf: no difference to take), and when the difference left is within
float64's rounding of the loss (a loss of 1e24 whose change under the step is below its resolution).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .. import validate as V
from ..autodiff.api import gradient
from ..autodiff.arguments import resolve_loss, resolve_wrt
from ..autodiff.loops.lower import lower_to_loops
from ..errors import InputError, RevgraphError
from ..ir import Graph, Node, ValueInfo, fresh_name, is_float_dtype, require_graph
from ..ir.ssa import is_ssa, to_ssa
from ..onnx_io.arguments import AS_GRAPH, ModelLike
from ..onnx_io.value_types import constant_value, infer_types
from ..runtime import Session, expand_domains, random_inputs

_FLOAT_TYPES = {1, 10, 11, 16}  # onnx FLOAT, FLOAT16, DOUBLE, BFLOAT16 (float8 casts quantize: left alone)
#: attributes that name an output dtype, and the operators whose default for it is FLOAT
_DTYPE_ATTRS = ("to", "dtype", "output_datatype", "softmax_precision", "stash_type")
_FLOAT_BY_DEFAULT = {"RandomNormal": "dtype", "RandomUniform": "dtype", "SequenceEmpty": "dtype",
                     "HannWindow": "output_datatype", "HammingWindow": "output_datatype",
                     "BlackmanWindow": "output_datatype", "MelWeightMatrix": "output_datatype"}
#: operators whose float64 onnxruntime kernels compute in float32 (onnxruntime 1.32: relative errors ~1e-7
#: against the exact values, which the reference evaluator gives); central differences with a step of 1e-6
#: through them would measure float32 rounding, so graphs holding them run on the reference evaluator
_ORT_FLOAT32_PRECISE = ("Shrink",)
#: operators that draw random values at every run (Dropout's mask is handled separately)
_RANDOM_OPS = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial")
#: row statuses that do not fail the check: the value could not be checked numerically
NOT_CHECKED = ("shape", "kink", "not finite", "resolution")
#: rounding of a computed loss, in units of float64's epsilon times the magnitude of what is summed: a
#: disagreement below it is float64's, not the gradient's
_ROUNDING = 32 * np.finfo(np.float64).eps


@dataclass
class CheckRow:
    """One wrt value: the largest absolute and relative error over the directions tried (the relative error of a
    direction: ``|analytic - numeric| / max(|analytic|, |numeric|, atol)``).

    ``status`` is ``"agree"``, ``"mismatch"``, ``"not finite"`` (NaN or inf in the loss at or next to the
    inputs, or in the value itself: not checked), ``"gradient not finite"`` (NaN or inf in the gradient only),
    ``"shape"`` (moving the value changes the loss's shape), ``"kink"`` (the loss is not differentiable at
    the inputs along a direction tried) or ``"resolution"`` (the disagreement is within float64's rounding of
    the loss); ``note`` says why a value was not checked. ``ok`` is False only for a mismatch or a gradient that
    is not finite where the loss is.
    """

    name: str
    max_abs: float
    max_rel: float
    ok: bool
    status: str = "agree"
    note: str = ""


@dataclass
class GradientReport:
    """The result of :func:`check_gradients`: one :class:`CheckRow` per wrt value; ``ok`` if none fails.
    ``notes`` says how the check ran where it departs from the plain method (backend, replayed masks)."""

    loss: str
    rows: list[CheckRow] = field(default_factory=list)
    backend: str = "onnxruntime"
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)


# ---------------------------------------------------------------------------------------------- float64


def to_float64(graph: Graph) -> Graph:
    """A copy of ``graph`` computing in float64, subgraphs included: float inputs, outputs, declared types
    (``value_info``, kept so that ranks ONNX cannot infer survive), initializers, ``Constant`` and
    ``ConstantOfShape`` values, and the dtype attributes of ``Cast``, ``EyeLike``, the random operators and
    the window functions become float64; ``GroupNormalization`` computes its statistics in float64
    (``stash_type``; ``LayerNormalization``'s stays, :func:`_stash_kept`); unused ``Mean``/``InvStdDev`` outputs of
    ``LayerNormalization`` are dropped (their schema type is float32 or bfloat16 only). Float8 casts are left alone:
    they quantize."""
    g = graph.copy()
    used = _used_names(g)
    stack = [g]
    while stack:
        sub = stack.pop()
        sub.inputs = [_promote_vi(v) for v in sub.inputs]
        sub.outputs = [_promote_vi(v) for v in sub.outputs]
        sub.value_info = {k: _promote_vi(v) for k, v in sub.value_info.items()}
        sub.initializers = {k: _promote(a) for k, a in sub.initializers.items()}
        for node in sub.nodes:
            _promote_node(node, g.opset, used)
            stack.extend(node.subgraphs.values())
    return g


def _used_names(g: Graph) -> set[str]:
    """Names some node reads or some graph (or subgraph) outputs."""
    used = set(g.output_names)
    for sub, node in g.walk():
        used.update(node.inputs)
        used.update(sub.output_names)
        for body in node.subgraphs.values():
            used.update(body.output_names)
    return used


def _promote_node(node: Node, opset: int, used: set[str]) -> None:
    for key, val in list(node.attrs.items()):
        if isinstance(val, np.ndarray):
            node.attrs[key] = _promote(val)
        elif key in _DTYPE_ATTRS and isinstance(val, int) and val in _FLOAT_TYPES and not _stash_kept(node, key):
            node.attrs[key] = 11
    if node.domain:
        return
    if node.op_type in _FLOAT_BY_DEFAULT and _FLOAT_BY_DEFAULT[node.op_type] not in node.attrs:
        node.attrs[_FLOAT_BY_DEFAULT[node.op_type]] = 11
    elif node.op_type == "Constant" and ("value_float" in node.attrs or "value_floats" in node.attrs):
        value = node.attrs.pop("value_float", None)
        value = node.attrs.pop("value_floats", value)
        node.attrs["value"] = np.asarray(value, dtype=np.float64)
    elif node.op_type == "Constant" and "sparse_value" in node.attrs:
        dense = constant_value(node, dense_limit=1 << 24)  # a float sparse constant: dense float64
        if dense is not None and is_float_dtype(dense.dtype):
            node.attrs = {"value": dense.astype(np.float64)}
    elif node.op_type == "ConstantOfShape" and "value" not in node.attrs:
        node.attrs["value"] = np.zeros(1, np.float64)  # the default is a float32 zero
    elif node.op_type == "GroupNormalization" and opset >= 21:
        node.attrs["stash_type"] = 11
    elif node.op_type == "LayerNormalization":
        outs = [o if i == 0 or o in used else "" for i, o in enumerate(node.outputs)]
        while len(outs) > 1 and not outs[-1]:
            outs.pop()
        node.outputs = outs


def _stash_kept(node: Node, key: str) -> bool:
    """``LayerNormalization``'s ``stash_type`` stays (the dynamo exporter spells out 1): it is the statistics'
    precision, at least the data's; onnxruntime and onnx's reference compute float64 data's statistics in
    float64 with 1 (1e-16 from numpy on 1e4-sized rows), and the reference refuses 11 (issue 27)."""
    return key == "stash_type" and node.op_type == "LayerNormalization" and not node.domain


def _promote(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float64) if is_float_dtype(a.dtype) else a


def _promote_vi(v: ValueInfo) -> ValueInfo:
    dtype = np.float64 if is_float_dtype(v.dtype) else v.dtype
    return ValueInfo(v.name, dtype, v.shape, v.kind)


# ---------------------------------------------------------------------------------------------- randomness


def _record_randomness(g: Graph, types: Mapping[str, ValueInfo]) -> list[str]:
    """Make the random values of ``g``'s top-level graph its outputs (in place): every ``Dropout``'s mask
    (added to the node when it has none) and the outputs of random operators. Returns their names."""
    used = g.names_in_use()
    recorded = []
    for node in g.nodes:
        if node.domain:
            continue
        if node.op_type == "Dropout":
            if len(node.outputs) < 2 or not node.outputs[1]:
                node.outputs[1:] = [fresh_name(f"{node.outputs[0]}__check_mask", used)]
            x = types.get(node.inputs[0])
            g.outputs.append(ValueInfo(node.outputs[1], np.dtype(bool), x.shape if x else None))
            recorded.append(node.outputs[1])
        elif node.op_type in _RANDOM_OPS:
            g.outputs.append(types.get(node.outputs[0]) or ValueInfo(node.outputs[0]))
            recorded.append(node.outputs[0])
    return recorded


def _replay_randomness(g: Graph, values: Mapping[str, np.ndarray]) -> Graph:
    """A copy of ``g`` whose recorded random values (:func:`_record_randomness`) are inputs ``<name>__fixed``:
    random operators become ``Identity`` of them, and each ``Dropout`` the ONNX spec's formula (Dropout-13:
    ``x * mask / (1 - ratio)`` in training mode, ``x`` otherwise) on its fixed mask."""
    g = g.copy()
    used = g.names_in_use()
    fed = {name: f"{name}__fixed" for name in values}
    g.inputs += [ValueInfo(fed[k], v.dtype, v.shape) for k, v in values.items()]
    nodes: list[Node] = []
    for node in g.nodes:
        if node.op_type == "Dropout" and not node.domain and node.outputs[1] in fed:
            nodes += _dropout_formula(node, fed[node.outputs[1]], used)
        elif node.op_type in _RANDOM_OPS and not node.domain and node.outputs[0] in fed:
            nodes.append(Node("Identity", [fed[node.outputs[0]]], [node.outputs[0]], name=f"check/replay/{node.name}"))
        else:
            nodes.append(node)
    g.nodes = nodes
    return g


def _dropout_formula(node: Node, mask: str, used: set[str]) -> list[Node]:
    x, y, mask_out = node.inputs[0], node.outputs[0], node.outputs[1]
    ratio = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1] else None
    training = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    prefix = f"check/replay/{node.name or 'Dropout'}"
    if training is None:  # inference mode: the identity, and an all-true mask
        return [Node("Identity", [x], [y], name=f"{prefix}/y"),
                Node("Identity", [mask], [mask_out], name=f"{prefix}/mask")]

    def new(op: str, inputs: list[str], **attrs) -> str:
        out = fresh_name(f"{prefix}/{op}", used)
        nodes.append(Node(op, inputs, [out], attrs, out))
        return out

    nodes: list[Node] = []
    one = new("CastLike", [new("Constant", [], value=np.asarray(1.0)), x])
    r = new("CastLike", [ratio, x]) if ratio else new("CastLike", [new("Constant", [], value=np.asarray(0.5)), x])
    scale = new("Div", [one, new("Sub", [one, r])])
    kept = new("Mul", [new("Mul", [x, new("CastLike", [mask, x])]), scale])
    nodes.append(Node("Where", [training, kept, x], [y], name=f"{prefix}/y"))
    nodes.append(Node("Identity", [mask], [mask_out], name=f"{prefix}/mask"))
    return nodes


# ---------------------------------------------------------------------------------------------- sessions


def _perturbed(graph: Graph, wrt: list[str]) -> Graph:
    """``graph`` with inputs ``<w>__delta`` added to every wrt value before anything reads it."""
    g = graph.copy()
    producers = {o: i for i, n in enumerate(g.nodes) for o in n.outputs if o}
    renamed = {w: f"{w}__perturbed" for w in wrt}
    for w in wrt:
        vi = next((v for v in g.inputs if v.name == w), None) or g.type_of(w)
        g.inputs.append(ValueInfo(f"{w}__delta", vi.dtype if vi else None, vi.shape if vi else None))
    for _, node in g.walk():
        node.inputs = [renamed.get(i, i) for i in node.inputs]
    for w in sorted(wrt, key=lambda n: producers.get(n, -1), reverse=True):
        pos = producers.get(w, -1) + 1
        g.nodes.insert(pos, Node("Add", [w, f"{w}__delta"], [renamed[w]], name=f"check/perturb/{w}"))
    # an output that is a wrt value itself (a graph whose output is its input, no node between) is the moved
    # value: left as it is, it would not move, and every difference would be 0
    g.outputs = [ValueInfo(renamed.get(v.name, v.name), v.dtype, v.shape, v.kind) for v in g.outputs]
    return g


def _session(graph: Graph, backend: str, notes: list[str]) -> Session:
    """A session on ``backend``, or on the reference evaluator where onnxruntime cannot run the float64 graph
    exactly (no float64 kernel, a float-only schema, a float64 kernel computing in float32); ``notes`` gets
    the reason."""
    if backend == "onnxruntime":
        imprecise = sorted({n.op_type for _, n in graph.walk() if n.op_type in _ORT_FLOAT32_PRECISE and not n.domain})
        if imprecise:
            _note(notes, f"ran on the reference evaluator: onnxruntime's float64 {', '.join(imprecise)} computes "
                         "in float32")
            return Session(graph, backend="reference")
    try:
        return Session(graph, backend=backend, session_options=_check_options() if backend == "onnxruntime" else None)
    except RevgraphError as exc:
        text = str(exc)
        if backend != "onnxruntime" or not ("NOT_IMPLEMENTED" in text or ("Type Error" in text and "double" in text)):
            raise
    op = re.search(r"implementation for (\w+)\(", text) or re.search(r"operator \((\w+)\)", text)
    node = re.search(r"of node \(([^)]*)\)", text)
    ops = {n.name: n.op_type for _, n in graph.walk()}
    op = op.group(1) if op else ops.get(node.group(1)) if node else None
    what = f"a float64 {op}" if op else "the float64 graph"
    _note(notes, f"ran on the reference evaluator: onnxruntime does not run {what}")
    return Session(graph, backend="reference")


def _check_options():
    """Session options of the check's onnxruntime sessions: no graph optimisations (``ORT_DISABLE_ALL``) and no
    memory pattern (below). The
    check compares the rules' arithmetic with finite differences in float64; optimisations would only fold
    constants and fuse float32 patterns, and their passes grew faster than the graph: a 20,000-node chain's
    session took 10 s at the default level and 4 s at the basic one, and a 200,000-node chain's did not finish
    in 40 minutes at the basic level, while without them the sessions' time is linear in the graph
    (docs/benchmarks.md, "Build memory")."""
    import onnxruntime as ort

    from ..runtime.options import session_options

    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # onnxruntime's memory pattern (planned after the first run) made each run of a long graph superlinear:
    # 6.2 s instead of 0.31 s per run of a 20,000-node chain's gradient graph, 20 times the work of 5,000 nodes
    options.enable_mem_pattern = False
    return options


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


# ---------------------------------------------------------------------------------------------- the check


@V.arguments(graph=AS_GRAPH, loss=V.NAME, wrt=V.NAMES, inputs=V.OPTIONAL_MAPPING, seed=V.SEED, rtol=V.NON_NEGATIVE,
             atol=V.NON_NEGATIVE, directions=V.POSITIVE_INT, step=V.POSITIVE,
             backend=V.choice("onnxruntime", "reference"))
def check_gradients(
    graph: ModelLike,
    loss: str | None = None,
    wrt: Iterable[str] | str | None = None,
    *,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    directions: int = 3,
    step: float = 1e-6,
    backend: str = "onnxruntime",
) -> GradientReport:
    """Compare revgraph's gradients of ``loss`` with float64 central differences (see the module doc).

    ``inputs`` gives the graph inputs (random ones, as ``revgraph run`` makes them, when absent); ``seed``
    seeds the inputs, the cotangent and the directions; ``step`` is relative: element ``x_i`` moves by
    ``step * max(1, |x_i|)`` along each direction. A wrt value passes when every direction's error is
    within ``atol + rtol * |central difference|``; values that cannot be checked get a row saying why
    (:class:`CheckRow`). A sequence loss is checked as its elements flattened and concatenated (one cotangent
    per element, fed to the VJP as a sequence). Raises :class:`InputError` for non-finite inputs, and what
    :func:`revgraph.gradient` raises for bad names.
    """
    require_graph(graph, "check_gradients")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise RevgraphError(f"seed must be an int >= 0, got {seed!r}")
    if inputs is not None and not isinstance(inputs, Mapping):
        raise InputError(f"inputs must map input names to arrays (a dict), got {type(inputs).__name__}")
    if not (rtol >= 0 and atol >= 0 and step > 0 and directions > 0):
        raise RevgraphError(f"tolerances must be >= 0 and step and directions > 0 (rtol {rtol}, atol {atol}, "
                            f"step {step}, directions {directions})")
    g = expand_domains(graph if is_ssa(graph) else to_ssa(graph)).copy()
    # onnxruntime has no float64 LSTM/GRU/RNN kernels: check them in their (equivalent) Loop form
    lower_to_loops(g, None, g.names_in_use())
    # onnxruntime's ai.onnx.ml kernels compute in float32 only: check them in their standard-operator form
    ml = any(n.domain == "ai.onnx.ml" for n in g.nodes)
    if ml:
        from ..autodiff.lift_ml import lower_ml_operators

        g = lower_ml_operators(g)
    g = to_float64(g)
    types = infer_types(g)
    loss = resolve_loss(g, loss)
    wrt_names = resolve_wrt(g, wrt, types)
    rng = np.random.default_rng(seed)
    feeds = _float64_feeds(random_inputs(g, seed) if inputs is None else inputs)
    random_values = _record_randomness(g, types)

    gg = gradient(g, loss, wrt_names, seed="input", unconnected="zero")
    seed_name, seed_dtype = gg.inputs[-1].name, gg.inputs[-1].dtype or np.dtype(np.float64)
    grad_names = gg.output_names[len(g.outputs):]
    notes: list[str] = []
    if ml:
        _note(notes, "ai.onnx.ml operators checked in their standard-operator form (revgraph.autodiff.lift_ml)")
    sess = _session(gg, backend, notes)
    # the gradient graph may run where the forward graph cannot: the clean-up pass drops dead forward nodes
    probe = _session(g, sess.backend, notes).run(feeds, [loss])[loss]
    # the cotangent in the seed's declared dtype (float32 for LayerNormalization's statistics), the same values
    # on both sides
    # a sequence loss (SequenceConstruct, SplitToSequence) is checked as the concatenation of its elements: one
    # cotangent per element, fed to the gradient graph as a sequence
    shapes = [np.shape(a) for a in probe] if isinstance(probe, list) else None
    u = rng.standard_normal(_flat(probe).shape).astype(seed_dtype).astype(np.float64)
    cotangent = u.astype(seed_dtype) if shapes is None else _split(u.astype(seed_dtype), shapes)
    result = sess.run({**feeds, seed_name: cotangent})
    grads = dict(zip(wrt_names, (result[n] for n in grad_names), strict=True))
    fixed = {name: result[name] for name in random_values}
    if fixed:
        _note(notes, "random values (Dropout masks, random operators) are those of the gradient's run, replayed")

    pg = _perturbed(_replay_randomness(g, fixed), wrt_names)
    moved_loss = f"{loss}__perturbed" if loss in wrt_names else loss  # (the loss is a wrt value: _perturbed)
    # the values of the wrt names that are neither fed nor initializers (computed ones) come from the base run
    known = {**g.initializers, **feeds}
    computed = [w for w in wrt_names if w not in known]
    pg.outputs += [ValueInfo(w) for w in computed if w not in pg.output_names]
    psess = _session(pg, sess.backend, notes)
    base_feeds = {**feeds, **{f"{k}__fixed": v for k, v in fixed.items()},
                  **{f"{w}__delta": np.zeros_like(grads[w]) for w in wrt_names}}
    first = psess.run(base_feeds, [moved_loss, *computed])
    base = _flat(first[moved_loss])
    values = {w: np.asarray(known[w] if w in known else first[w]) for w in wrt_names}
    report = GradientReport(loss, backend=sess.backend, notes=notes)
    for w in wrt_names:
        def loss_at(delta: np.ndarray, w: str = w) -> np.ndarray:
            return _flat(psess.run({**base_feeds, f"{w}__delta": delta}, [moved_loss])[moved_loss])

        report.rows.append(_compare(w, grads[w], loss_at, u, base, rng, directions, step, rtol, atol, values[w]))
    return report


def _flat(value: np.ndarray | list[np.ndarray]) -> np.ndarray:
    """A loss value as one array: a tensor as it is, a sequence as its elements flattened and concatenated."""
    if not isinstance(value, list):
        return np.asarray(value)
    return np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in value]) if value else np.zeros(0)


def _split(flat: np.ndarray, shapes: list[tuple]) -> list[np.ndarray]:
    """The sequence of arrays of ``shapes`` whose concatenation is ``flat`` (the inverse of :func:`_flat`)."""
    ends = np.cumsum([math.prod(sh) for sh in shapes])[:-1] if shapes else []
    return [part.reshape(sh) for part, sh in zip(np.split(flat, ends), shapes, strict=True)]


def _float64_feeds(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in feeds.items():
        v = np.asarray(v)
        if is_float_dtype(v.dtype):
            v = v.astype(np.float64)
            if not np.all(np.isfinite(v)):
                raise InputError(f"input {k!r} holds NaN or infinite values; the numeric check needs finite inputs")
        out[k] = v
    return out


def _compare(w: str, grad: np.ndarray, loss_at: Callable[[np.ndarray], np.ndarray], u: np.ndarray,
             base: np.ndarray, rng: np.random.Generator, directions: int, step: float, rtol: float,
             atol: float, value: np.ndarray | None = None) -> CheckRow:
    """The row of wrt value ``w`` (its values ``value``, which set each element's step: module doc):
    ``loss_at(delta)`` is the loss with ``w`` moved by ``delta``."""
    max_abs = max_rel = 0.0
    mismatch = unresolved = False
    if grad.size == 0:  # nothing to move, nothing to compare (the loss may even be -inf: max of an empty set)
        return CheckRow(w, 0.0, 0.0, True, "agree", "empty")
    if value is not None and value.dtype.kind in "fc" and not np.all(np.isfinite(value)):
        return CheckRow(w, float("nan"), float("nan"), True, "not finite",
                        "not checked: the value holds NaN or infinite entries, which no finite step moves")
    # per element: step * max(1, |x|), so that the step is above x's float64 resolution however large x is
    scale = (np.maximum(1.0, np.abs(value.astype(np.float64))) if value is not None and value.shape == grad.shape
             and value.dtype.kind in "fc" else np.ones(grad.shape))
    for _ in range(directions):
        v = rng.standard_normal(grad.shape) * scale
        plus, minus = loss_at(step * v), loss_at(-step * v)
        if plus.shape != base.shape or minus.shape != base.shape:
            moved = plus.shape if plus.shape != base.shape else minus.shape
            return CheckRow(w, float("nan"), float("nan"), True, "shape",
                            f"not checked: moving it by {step:g} changes the loss's shape from {list(base.shape)} "
                            f"to {list(moved)} (it sets a shape)")
        numeric = float(np.sum(u * (plus - minus))) / (2 * step)
        analytic = float(np.sum(grad * v))
        if not np.isfinite(numeric):  # e.g. Sqrt of a negative input, Log at 0
            return CheckRow(w, float("nan"), float("nan"), True, "not finite",
                            "not checked: the loss is not finite at or next to these inputs (outside an operator's "
                            "domain?)")
        if not np.isfinite(analytic):
            return CheckRow(w, float("nan"), float("nan"), False, "gradient not finite",
                            "the gradient is not finite, though the loss is finite around these inputs")
        err = abs(analytic - numeric)
        max_abs = max(max_abs, err)
        # relative to the larger of the two, and never to less than atol: a gradient that is 0 (a bias no path
        # moves) against a difference of 1e-22 is no relative error of 1e+278
        max_rel = max(max_rel, err / max(abs(numeric), abs(analytic), atol, 1e-300))
        if err > atol + rtol * abs(numeric):
            # what float64 rounding of the two losses (and of the VJP's sum) can explain: no verdict below it
            noise = (_ROUNDING * (float(np.sum(np.abs(u * plus))) + float(np.sum(np.abs(u * minus)))) / (2 * step)
                     + _ROUNDING * float(np.sum(np.abs(grad * v))))
            if err <= noise:
                unresolved = True  # another direction may still show a real disagreement
                continue
            if _on_kink(loss_at, u, base, v, step, (plus, minus), rtol, atol):
                return CheckRow(w, max_abs, max_rel, True, "kink",
                                "not checked: the loss is not differentiable here (its one-sided differences "
                                "disagree at two step sizes: a kink or a jump); move the input")
            mismatch = True
    if unresolved and not mismatch:
        return CheckRow(w, max_abs, max_rel, True, "resolution",
                        f"not checked: the loss's change under the step ({step:g} of each element's magnitude) is "
                        "within float64's rounding of the loss")
    return CheckRow(w, max_abs, max_rel, not mismatch, "mismatch" if mismatch else "agree")


def _on_kink(loss_at, u, base, v, step, first, rtol, atol) -> bool:
    """Whether the loss has a kink or a jump at the inputs along ``v``: its forward and backward differences
    disagree beyond the tolerance, and do not approach each other when the step shrinks 16-fold (for a
    smooth loss their gap is ``step * v'Hv`` and shrinks with the step)."""
    f0 = float(np.sum(u * base))

    def gap(plus: np.ndarray, minus: np.ndarray, h: float) -> tuple[float, float]:
        if plus.shape != base.shape or minus.shape != base.shape:
            return float("inf"), 0.0
        fwd, bwd = (float(np.sum(u * plus)) - f0) / h, (f0 - float(np.sum(u * minus))) / h
        return abs(fwd - bwd), max(abs(fwd), abs(bwd))

    wide, scale = gap(*first, step)
    if not wide > atol + rtol * scale:
        return False
    h = step / 16
    narrow, _ = gap(loss_at(h * v), loss_at(-h * v), h)
    return narrow > 0.5 * wide
