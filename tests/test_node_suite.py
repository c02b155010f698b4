"""The ONNX backend node tests as gradient checks.

The onnx wheel ships the generators of its backend node tests (``onnx.backend.test.case.node``: each
``export*`` function builds a one-node model and its inputs through ``expect``; ``collect_testcases`` runs them
all). For every test whose graph is one node of an operator revgraph differentiates (a VJP rule in
``revgraph.autodiff.registry.RULES``, or a rewrite into a Loop, ``LOWERED``) with a floating-point input and a
floating-point output, :func:`revgraph.check_gradients` compares the gradient of each float output with float64
central differences, with respect to every float input, at the test's own inputs.

* Inputs that set the output's shape (ONNX shape inference knows the output shape only once the input's value
  is known: ``Resize`` scales, ``OneHot`` depth, axes, pads, ...) become initializers, as exported models hold
  them; the others stay graph inputs.
* Inputs that sit exactly on a kink or a jump of the function (``Relu`` at 0, tied ``Max`` inputs, a
  bound of ``Clip``, a float index at an integer), on a point where the output's shape jumps, or next to a
  singularity (``Acosh`` at 1, ``Pow`` of 0 by a negative exponent) cannot be checked by differences: the check
  says so (:data:`revgraph.check.NOT_CHECKED`, or "not finite"), and the test moves them by ~1e-3 (relative)
  and checks there, with a :class:`NudgedWarning` naming them.
* Each test runs at its own opset when that is 21 or newer (revgraph keeps a model's opset, up to the newest the
  installed onnx knows); an older one is converted up to 21 by ``onnx.version_converter``, as :func:`revgraph.load`
  does.
* Skipped, with the reason: NaN or infinite data; a dtype onnxruntime's Python API cannot feed (float8, int4,
  float4, int2, ...); an opset newer than onnxruntime runs; an old model that ``onnx.version_converter`` cannot
  convert up to opset 21, or whose declared inputs the conversion changes so that the test's data no longer fits
  (Scan-8's batch axis).
* A real gradient bug, or a gradient revgraph refuses, is an ``xfail(strict=True)`` naming it
  (:data:`KNOWN_BUGS`), so that its fix shows.

A deterministic sample (:data:`SAMPLED`, a tenth: ~85 tests) runs with the suite; ``pytest -m slow
tests/test_node_suite.py`` runs them all (~950).
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

import revgraph as rg
from revgraph.autodiff.registry import LOWERED, RULES
from revgraph.check import NOT_CHECKED, is_float_dtype
from revgraph.errors import UnsupportedModelError
from revgraph.ir import TARGET_OPSET
from revgraph.runtime import onnxruntime_newest_opset

SAMPLE_MODULUS = 10
_FLOAT = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
#: floating-point types onnxruntime's Python API cannot feed or return (numpy has no such dtype)
_UNFEEDABLE = {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2,
               TensorProto.FLOAT8E5M2FNUZ, TensorProto.UINT4, TensorProto.INT4, TensorProto.FLOAT4E2M1,
               *(getattr(TensorProto, n) for n in ("FLOAT8E8M0", "UINT2", "INT2") if hasattr(TensorProto, n))}

#: node tests whose gradient revgraph refuses to build or gets wrong: name -> what is missing or wrong.
#: The section 2 bugs of issue 13 that this suite also finds (Clip with min > max, Dropout's ratio, ScatterND
#: and ScatterElements with reduction mul/max/min) are fixed by their own changes, not marked here.
KNOWN_BUGS = {
    "test_convtranspose_output_shape": "ConvTranspose with an output_shape larger than the convolution produces "
                                       "(negative padding): revgraph refuses its VJP",
}

#: node tests whose data sit where the function has no derivative, which central differences cannot see (they
#: report a mismatch, not a non-finite value): the inputs are moved off the singularity first, as for kinks
SINGULAR = {
    "test_l2normalization_axis_0": "x holds a zero vector along axis 0, where x / ||x|| jumps (revgraph's "
                                   "gradient there is 0 by convention, docs/op_coverage.md)",
}
#: node tests whose gradient the float64 check cannot run, with why
UNCHECKABLE = {
    "test_mvn": "MeanVarianceNormalization in float64: onnxruntime has a float32 kernel only, and the reference "
                "evaluator's function body adds a float32 epsilon to a float64 value (tests/test_rules_norm.py "
                "checks the rule on the gradient graph alone)",
}

#: integer inputs that a rule reads when the gradient graph is built (docs/op_coverage.md says so): op type ->
#: input positions. A node test feeds them at run time; exporters write them as constants, and so does the suite.
BUILD_TIME_INPUTS = {"CumProd": (1,), "DFT": (2,), "STFT": (1, 3)}


class NudgedWarning(UserWarning):
    """A node test's inputs sat on a kink or jump of the function and were moved before checking."""


def _graph_ops(graph: onnx.GraphProto) -> list[str]:
    return [n.op_type for n in graph.node]


def _elem(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


def _selected(case) -> bool:
    graph = case.model.graph
    ops = _graph_ops(graph)
    return (len(ops) == 1 and (ops[0] in RULES or ops[0] in LOWERED)
            and any(_elem(v) in _FLOAT for v in graph.input)
            and any(_elem(v) in _FLOAT | _UNFEEDABLE for v in graph.output))


def _collect() -> list:
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):  # the generators overflow casts on purpose
        warnings.simplefilter("ignore")
        cases = node.collect_testcases()
    return sorted((c for c in cases if _selected(c)), key=lambda c: c.name)


def _array(value) -> np.ndarray:
    return numpy_helper.to_array(value) if isinstance(value, TensorProto) else np.asarray(value)


def _feedable(case) -> bool:
    """No dtype onnxruntime cannot feed and no NaN data: the test will not be skipped for those."""
    graph = case.model.graph
    arrays = [_array(a) for a in case.data_sets[0][0]]
    return (all(_elem(v) not in _UNFEEDABLE for v in [*graph.input, *graph.output])
            and all(not is_float_dtype(a.dtype) or np.all(np.isfinite(a.astype(np.float64))) for a in arrays))


CASES = {c.name: c for c in _collect()}
NAMES = list(CASES)
#: the feedable tests whose name hashes to 0 modulo SAMPLE_MODULUS: about 85, spread over the operators, and the
#: same tests whatever rules are added (each test's membership depends on its name only)
SAMPLED = [n for n in NAMES if zlib.crc32(n.encode()) % SAMPLE_MODULUS == 0 and _feedable(CASES[n])]


# ---------------------------------------------------------------------------------------------- preparing


@dataclass
class Prepared:
    graph: rg.Graph
    feeds: dict[str, np.ndarray]
    losses: list[str]
    wrt: list[str]


def _sets_shape(model: onnx.ModelProto, name: str, value: np.ndarray) -> bool:
    """Whether ONNX's shape inference knows every output's shape only once input ``name`` is a constant (the
    declared output shapes, which ``expect`` takes from the expected outputs, are left out)."""
    def known(m: onnx.ModelProto) -> bool:
        m = _as_initializer(m, None, None)
        for o in m.graph.output:
            o.type.tensor_type.ClearField("shape")
        try:
            out = onnx.shape_inference.infer_shapes(m, strict_mode=False).graph.output
        except Exception:
            return False
        tensors = [o.type.tensor_type for o in out if o.type.HasField("tensor_type")]
        return all(t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim) for t in tensors)

    return not known(model) and known(_as_initializer(model, name, value))


def _as_initializer(model: onnx.ModelProto, name: str | None, value: np.ndarray | None) -> onnx.ModelProto:
    """A copy of ``model`` with input ``name`` (if any) turned into an initializer holding ``value``."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    if name is not None:
        keep = [vi for vi in m.graph.input if vi.name != name]
        del m.graph.input[:]
        m.graph.input.extend(keep)
        m.graph.initializer.append(numpy_helper.from_array(value, name))
    return m


def prepare(case) -> Prepared:
    """The graph, feeds, losses and wrt values of a node test; ``pytest.skip`` with the reason when it cannot
    be checked (module doc)."""
    model, graph = case.model, case.model.graph
    for vi in [*graph.input, *graph.output]:
        if _elem(vi) in _UNFEEDABLE:
            dtype = TensorProto.DataType.Name(_elem(vi)).lower()
            pytest.skip(f"dtype {dtype} ({vi.name!r}): onnxruntime's Python API cannot feed it")
    feeds = {vi.name: _array(a) for vi, a in zip(graph.input, case.data_sets[0][0], strict=True)}
    for k, a in feeds.items():
        if is_float_dtype(a.dtype) and not np.all(np.isfinite(a.astype(np.float64))):
            pytest.skip(f"NaN or infinite data in {k!r}: central differences need finite inputs")
    node = graph.node[0]
    fixed = {node.input[i] for i in BUILD_TIME_INPUTS.get(node.op_type, ()) if i < len(node.input) and node.input[i]}
    for k in list(feeds):
        if k in fixed or _sets_shape(model, k, feeds[k]):
            model = _as_initializer(model, k, feeds.pop(k))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), TARGET_OPSET)
    newest = onnxruntime_newest_opset()
    if newest is not None and opset > newest:
        pytest.skip(f"opset {opset}: the installed onnxruntime runs opsets up to {newest}")
    try:
        g = rg.load(model)
    except UnsupportedModelError as exc:
        if opset < TARGET_OPSET and "cannot convert the model from opset" in str(exc):
            pytest.skip(f"opset {opset}: onnx.version_converter cannot convert this model up to opset {TARGET_OPSET}, "
                        f"the oldest revgraph works at ({str(exc)[:160]})")
        raise
    assert g.opset == max(opset, TARGET_OPSET)
    changed = [f"{v.name} {v.describe()}" for v in g.inputs if not _fits(v, feeds[v.name])]
    if changed and opset < TARGET_OPSET:
        pytest.skip(f"opset {opset}: converted up to opset {TARGET_OPSET} by onnx.version_converter, the model "
                    f"declares {', '.join(changed)}, which the test's inputs do not fit (Scan-8's batch axis is gone)")
    wrt = [v.name for v in g.inputs if is_float_dtype(v.dtype)]
    losses = [v.name for v in g.outputs if is_float_dtype(v.dtype)]
    if not wrt:
        pytest.skip("every floating-point input sets the output's shape (made an initializer): nothing to check")
    return Prepared(g, feeds, losses, wrt)


def _fits(vi: rg.ValueInfo, value: np.ndarray) -> bool:
    """Whether ``value`` has the rank and the static dimensions that ``vi`` declares."""
    if vi.shape is None:
        return True
    return len(vi.shape) == value.ndim and all(not isinstance(d, int) or d == n for d, n in zip(vi.shape, value.shape))


def nudged(feeds: dict[str, np.ndarray], names: list[str], attempt: int) -> dict[str, np.ndarray]:
    """``feeds`` with inputs ``names`` moved up by 1e-3 to 2e-3 of max(1, |x|) per element (distinct amounts,
    so ties break; upwards, so a ratio at 0 stays inside its domain)."""
    rng = np.random.default_rng(100 + attempt)
    out = dict(feeds)
    for k in names:
        x = feeds[k].astype(np.float64)
        out[k] = x + 1e-3 * (1 + rng.random(x.shape)) * np.maximum(1.0, np.abs(x))
    return out


def check_case(name: str) -> None:
    """Check every float output's gradient of node test ``name`` (module doc)."""
    if name in UNCHECKABLE:
        pytest.skip(UNCHECKABLE[name])
    prep = prepare(CASES[name])
    for loss in prep.losses:
        feeds, moved = prep.feeds, []
        if name in SINGULAR:
            feeds, moved = nudged(prep.feeds, prep.wrt, 3), list(prep.wrt)
        for attempt in range(4):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no path" for inputs a rule does not differentiate
                rep = rg.check_gradients(prep.graph, loss, prep.wrt, inputs=feeds)
            unchecked = [r.name for r in rep.rows if r.status in (*NOT_CHECKED, "not finite")]
            if not unchecked or attempt == 3:
                break
            moved = sorted(set(moved) | set(unchecked))
            feeds = nudged(prep.feeds, moved, attempt)
        if rep.rows and all(r.status == "not finite" for r in rep.rows):
            continue  # an output holding -inf (masked attention scores) everywhere nearby: no loss to differentiate
        if moved and name not in SINGULAR:
            warnings.warn(f"{name}: {', '.join(moved)} sat on a kink, a jump or a singularity of {loss!r}; checked "
                          "at inputs moved by ~1e-3", NudgedWarning, stacklevel=2)
        bad = [f"{r.name}: {r.status} (abs {r.max_abs:.3g}, rel {r.max_rel:.3g}) {r.note}" for r in rep.rows
               if r.status != "agree"]
        assert not bad, f"{name}, loss {loss!r} ({rep.backend}; {'; '.join(rep.notes)}): " + "; ".join(bad)


def _params(names: list[str], *marks) -> list:
    return [pytest.param(n, id=n, marks=[*marks, *([pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[n])]
                                                   if n in KNOWN_BUGS else [])]) for n in names]


@pytest.mark.parametrize("name", _params(SAMPLED))
def test_node_gradient_sample(name):
    check_case(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(NAMES))
def test_node_gradient(name):
    check_case(name)
