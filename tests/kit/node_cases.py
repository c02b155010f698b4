"""The ONNX backend node tests as gradient-check cases: the one-node models of ``onnx.backend.test.case.node``
that revgraph differentiates, and their preparation (which inputs become initializers, which cases cannot be
checked and why). Used by the node-test suite (tests/test_node_suite.py, whose module doc says what is checked)
and by the node-count guard (:mod:`kit.node_counts`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

import revgraph as rg
from revgraph.autodiff.registry import LOWERED, RULES
from revgraph.errors import UnsupportedModelError
from revgraph.ir import TARGET_OPSET
from revgraph.runtime import onnxruntime_newest_opset
from revgraph.tools.check import is_float_dtype

#: what :func:`prepare` raises for a case that cannot be checked (pytest's skip, with the reason)
Skip = pytest.skip.Exception

_FLOAT = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
#: floating-point types onnxruntime's Python API cannot feed or return (numpy has no such dtype)
_UNFEEDABLE = {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2,
               TensorProto.FLOAT8E5M2FNUZ, TensorProto.UINT4, TensorProto.INT4, TensorProto.FLOAT4E2M1,
               *(getattr(TensorProto, n) for n in ("FLOAT8E8M0", "UINT2", "INT2") if hasattr(TensorProto, n))}

#: integer inputs that a rule reads when the gradient graph is built (docs/op_coverage.md says so): op type ->
#: input positions. A node test feeds them at run time; exporters write them as constants, and so does the suite.
BUILD_TIME_INPUTS = {"CumProd": (1,), "DFT": (2,), "STFT": (1, 3)}


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


def feedable(case) -> bool:
    """No dtype onnxruntime cannot feed and no NaN data: the test will not be skipped for those."""
    graph = case.model.graph
    arrays = [_array(a) for a in case.data_sets[0][0]]
    return (all(_elem(v) not in _UNFEEDABLE for v in [*graph.input, *graph.output])
            and all(not is_float_dtype(a.dtype) or np.all(np.isfinite(a.astype(np.float64))) for a in arrays))


CASES = {c.name: c for c in _collect()}
NAMES = list(CASES)
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
        except Exception:  # noqa: BLE001  (any failure of inference: the shape is not known)
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
    return len(vi.shape) == value.ndim and all(not isinstance(d, int) or d == n
                                               for d, n in zip(vi.shape, value.shape, strict=True))
