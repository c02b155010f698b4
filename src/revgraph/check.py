"""Numeric gradient checking: the backward pass against float64 central differences along random directions.

For a loss L (a graph output) the check projects L on a random cotangent u, f(w) = sum(u * L(w)), and for
each wrt value w and random direction v compares the VJP ``<grad_w f, v>`` with the central difference
``(f(w + h v) - f(w - h v)) / 2h``. Everything runs in float64 (the graph's float tensors, constants and
casts are promoted), so the comparison measures the rules, not float32 rounding.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .autodiff.backward import gradient, resolve_loss, resolve_wrt
from .autodiff.loops.lower import lower_to_loops
from .errors import InputError, RevgraphError
from .ir import Graph, Node, ValueInfo
from .onnx_io import infer_types
from .runtime import Session, expand_domains, random_inputs
from .ssa import is_ssa, to_ssa

_FLOAT_TYPES = {1, 10, 11, 16}  # onnx FLOAT, FLOAT16, DOUBLE, BFLOAT16


@dataclass
class CheckRow:
    """One wrt value: the largest absolute and relative error over the directions tried."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclass
class GradientReport:
    """The result of :func:`check_gradients`: one :class:`CheckRow` per wrt value; ``ok`` if all agree."""

    loss: str
    rows: list[CheckRow] = field(default_factory=list)
    backend: str = "onnxruntime"

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)


def to_float64(graph: Graph) -> Graph:
    """A copy of ``graph`` computing in float64: float inputs, outputs, initializers, ``Constant`` and
    ``ConstantOfShape`` values, and ``Cast`` targets become float64 (subgraphs too)."""
    g = graph.copy()
    stack = [g]
    while stack:
        sub = stack.pop()
        sub.inputs = [_promote_vi(v) for v in sub.inputs]
        sub.outputs = [_promote_vi(v) for v in sub.outputs]
        sub.value_info = {}
        sub.initializers = {k: _promote(a) for k, a in sub.initializers.items()}
        for node in sub.nodes:
            for key, val in list(node.attrs.items()):
                if isinstance(val, np.ndarray):
                    node.attrs[key] = _promote(val)
            if node.op_type in ("Cast", "EyeLike", "RandomNormal", "RandomUniform") and node.attrs.get("to", node.attrs.get("dtype")) in _FLOAT_TYPES:
                node.attrs["to" if node.op_type == "Cast" else "dtype"] = 11
            stack.extend(node.subgraphs.values())
    return g


def _promote(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def _promote_vi(v: ValueInfo) -> ValueInfo:
    dtype = np.float64 if v.dtype is not None and v.dtype.kind == "f" else v.dtype
    return ValueInfo(v.name, dtype, v.shape, v.kind)


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
    g.outputs = [ValueInfo(v.name, v.dtype, v.shape, v.kind) for v in g.outputs]
    return g


def _session(graph: Graph, backend: str) -> Session:
    try:
        return Session(graph, backend=backend)
    except Exception as exc:  # onnxruntime lacks float64 kernels for a few ops: the reference evaluator has them
        if backend == "onnxruntime" and "NOT_IMPLEMENTED" in str(exc):
            return Session(graph, backend="reference")
        raise


def check_gradients(
    graph: Graph,
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
    seeds the inputs, the cotangent and the directions. A wrt value passes when every direction's error is
    within ``atol + rtol * |central difference|``. Raises :class:`InputError` for non-finite inputs, and what
    :func:`revgraph.gradient` raises for bad names.
    """
    if not (rtol >= 0 and atol >= 0 and step > 0 and directions > 0):
        raise RevgraphError(f"tolerances must be >= 0 and step and directions > 0 (rtol {rtol}, atol {atol}, "
                            f"step {step}, directions {directions})")
    g = expand_domains(graph if is_ssa(graph) else to_ssa(graph)).copy()
    # onnxruntime has no float64 LSTM/GRU/RNN kernels: check them in their (equivalent) Loop form
    lower_to_loops(g, None, g.all_names() | {n.name for _, n in g.walk()})
    g = to_float64(g)
    types = infer_types(g)
    loss = resolve_loss(g, loss)
    wrt_names = resolve_wrt(g, wrt, types)
    rng = np.random.default_rng(seed)
    feeds = dict(random_inputs(g, seed) if inputs is None else inputs)
    for k, v in list(feeds.items()):
        v = np.asarray(v)
        if v.dtype.kind == "f":
            if not np.all(np.isfinite(v)):
                raise InputError(f"input {k!r} holds NaN or infinite values; the numeric check needs finite inputs")
            v = v.astype(np.float64)
        feeds[k] = v

    gg = gradient(g, loss, wrt_names, seed="input", unconnected="zero")
    seed_name = gg.inputs[-1].name
    grad_names = gg.output_names[len(g.outputs):]
    sess = _session(gg, backend)
    # the gradient graph may run where the forward graph cannot: the clean-up pass drops dead forward nodes
    probe = _session(g, sess.backend).run(feeds, [loss])[loss]
    u = rng.standard_normal(probe.shape)
    result = sess.run({**feeds, seed_name: u})
    grads = dict(zip(wrt_names, (result[n] for n in grad_names), strict=True))

    pg = _perturbed(g, wrt_names)
    psess = _session(pg, sess.backend)
    report = GradientReport(loss, backend=sess.backend)
    zero = {f"{w}__delta": np.zeros_like(grads[w]) for w in wrt_names}
    for w in wrt_names:
        max_abs = max_rel = 0.0
        ok = True
        for _ in range(directions):
            v = rng.standard_normal(grads[w].shape)
            plus = psess.run({**feeds, **zero, f"{w}__delta": step * v}, [loss])[loss]
            minus = psess.run({**feeds, **zero, f"{w}__delta": -step * v}, [loss])[loss]
            numeric = float(np.sum(u * (plus - minus))) / (2 * step)
            analytic = float(np.sum(grads[w] * v))
            if not (np.isfinite(analytic) and np.isfinite(numeric)):  # e.g. Sqrt of a negative input
                max_abs = max_rel = float("nan")
                ok = False
                continue
            err = abs(analytic - numeric)
            max_abs = max(max_abs, err)
            max_rel = max(max_rel, err / max(abs(numeric), 1e-300))
            ok &= bool(err <= atol + rtol * abs(numeric))
        report.rows.append(CheckRow(w, max_abs, max_rel, ok))
    return report
