"""The shape of the code that DESIGN.md promises (issue 14): no import cycles, rules as pure functions of their
context, one accumulation helper, checkpoint policies as types, cotangents checked at the rule boundary."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import revgraph as rg
from revgraph.autodiff import registry
from revgraph.autodiff.policies import EveryK, Recompute, Segments, Squares, Store, parse_policy
from revgraph.errors import GraphError, InternalError
from revgraph.ir import Graph, Node, ValueInfo

SRC = Path(rg.__file__).resolve().parent
RULES_DIR = SRC / "autodiff" / "rules"
F64 = np.float64


def _imports(path: Path, module: str, is_pkg: bool, known: set[str], typing: bool = False) -> set[str]:
    """Modules of revgraph that ``path`` imports, at any depth (functions too); with ``typing``, those of its
    type-checking blocks too (an annotation that names a module is a tie between the two all the same)."""
    tree = ast.parse(path.read_text())
    typing_only = set() if typing else {
        id(n) for s in ast.walk(tree) if isinstance(s, ast.If) and getattr(s.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(s)}
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
    return {m for m in found if m in known and m != module}


def test_the_package_has_no_import_cycle():
    files = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    edges = {m: _imports(f, m, pkg, set(files), typing=True) for m, (f, pkg) in files.items()}
    # a cycle exists iff some module reaches itself (through type-checking imports too: issue 45 found two
    # circles that only annotations closed, autodiff.algebra <-> context and train.graphs <-> optimizers <-> ...)
    for start, first in edges.items():
        seen, todo = set(), list(first)
        while todo:
            m = todo.pop()
            assert m != start, f"import cycle through {start}"
            if m not in seen:
                seen.add(m)
                todo.extend(edges[m])


def _package_imports() -> dict[str, set[tuple[str, str]]]:
    """Imports between revgraph's layer packages: ``{package: {(module, imported module), ...}}``, where a
    package is the first name under ``revgraph`` (``ir``, ``onnx_io``, ``autodiff``, ``runtime``, ``train``, ``cli``,
    ``tools``, or a top-level module such as ``errors``)."""
    files = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    found: dict[str, set[tuple[str, str]]] = {}
    for m, (f, pkg) in files.items():
        for d in _imports(f, m, pkg, set(files)):
            found.setdefault(m.split(".")[1] if "." in m else "", set()).add((m, d))
    return found


#: what each layer may import besides itself: the foundation modules (errors, warn, limits, validate, text,
#: version) and the layers below it (DESIGN.md, "Layout")
FOUNDATION = {"errors", "warn", "limits", "validate", "text", "version"}
LAYERS_BELOW = {"ir": set(), "onnx_io": {"ir"}, "runtime": {"ir", "onnx_io"}}
NEVER = {"runtime": {"autodiff", "train", "cli", "tools"}, "autodiff": {"train", "cli", "tools"},
         "train": {"cli", "tools"}}


def test_the_foundation_imports_no_layer():
    """``validate`` and the other foundation modules (DESIGN.md, "Layout") import only one another, at any depth
    (an import inside a function too): the argument rules for the layers' types live in their layers
    (:mod:`revgraph.ir.arguments`, :mod:`revgraph.onnx_io.arguments`, ``autodiff.policies.POLICY``,
    ``autodiff.memory.budget.BUDGET``) and the registries validate names (optimizers, the TrainingGraph) are
    looked up in ``sys.modules``, not imported."""
    edges = _package_imports()
    bad = sorted((m, d) for name in FOUNDATION for m, d in edges.get(name, ()) if d.split(".")[1] not in FOUNDATION)
    assert not bad, f"a foundation module imports a layer: {bad}"


def test_the_layers_import_only_what_is_below_them():
    edges = _package_imports()
    for layer, below in LAYERS_BELOW.items():
        bad = sorted((m, d) for m, d in edges.get(layer, ()) if d.split(".")[1] not in {layer, *below, *FOUNDATION})
        assert not bad, f"{layer} imports above itself: {bad}"
    for layer, never in NEVER.items():
        bad = sorted((m, d) for m, d in edges.get(layer, ()) if d.split(".")[1] in never)
        assert not bad, f"{layer} imports {never}: {bad}"


def test_no_module_shadows_the_standard_library():
    import sys

    names = {f.stem for f in SRC.rglob("*.py")} | {d.name for d in SRC.rglob("*") if d.is_dir()}
    assert not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)


TESTS = Path(__file__).resolve().parent


def test_test_modules_share_helpers_only_through_kit():
    """No module of tests/ (test modules, tests/kit, the workers) imports from a test module: what several need is
    in tests/kit, by feature; and none imports a private (underscore) name of kit."""
    bad = []
    for path in sorted([*TESTS.glob("*.py"), *(TESTS / "kit").glob("*.py")]):
        where = path.relative_to(TESTS)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0].startswith("test_")]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                top = node.module.split(".")[0]
                if top.startswith("test_"):
                    bad.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
                elif top == "kit":
                    bad += [f"{where}: from {node.module} import {a.name}"
                            for a in node.names if a.name.startswith("_")]
    assert not bad, "\n".join(bad)


def test_rules_read_no_mutable_state_and_never_test_need():
    for f in RULES_DIR.glob("*.py"):
        text = f.read_text()
        assert "need[" not in text and "ctx.need" not in text, f"{f.name} tests which inputs need a gradient"
        for attr in ("prefix", "finite", "producers", "reach", "options", "graph", "need"):
            assert not re.search(rf"\be\.{attr}\b", text), f"{f.name} reads the emitter's {attr}"
    for op, rule in registry.RULES.items():
        params = list(inspect.signature(rule).parameters)
        assert params[:1] == ["ctx"], f"the rule of {op} takes {params}"


def test_one_accumulation_helper():
    # Sum nodes of gradient contributions are written by the Accumulator only
    for f in [*(SRC / "autodiff").glob("*.py"), *(SRC / "autodiff" / "loops").glob("*.py")]:
        if f.name != "accumulate.py":
            assert 'op("Sum"' not in f.read_text(), f"{f.name} adds gradient contributions itself"


def test_policies_are_parsed_once_into_types():
    assert parse_policy("store") == Store() and parse_policy("recompute") == Recompute()
    assert parse_policy("sqrt").boundary == Squares() and parse_policy("7").boundary == EveryK(7)
    assert parse_policy(3) == parse_policy("3") and parse_policy(Store()) == Store()
    for bad in ("sqr", 0, -2, True, 1.5, None):
        with pytest.raises(GraphError, match="unknown checkpoint policy"):
            parse_policy(bad)


def _counter_loop(T: int) -> tuple[Graph, dict]:
    """h_{t+1} = h_t * w + 1 for T iterations; loss = sum(h_T)."""
    body = Graph([Node("Mul", ["h", "w"], ["hw"], name="mul"), Node("Add", ["hw", "one"], ["h2"], name="add"),
                  Node("Identity", ["c"], ["c2"], name="cond")],
                 [ValueInfo("i", np.int64, ()), ValueInfo("c", np.bool_, ()), ValueInfo("h", F64, (3,))],
                 [ValueInfo("c2", np.bool_, ()), ValueInfo("h2", F64, (3,))], {"one": np.ones(3)}, name="body")
    g = Graph([Node("Loop", ["T", "", "h0"], ["hT"], {"body": body}, "loop"),
               Node("ReduceSum", ["hT"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("h0", F64, (3,)), ValueInfo("w", F64, (3,))], [ValueInfo("loss", F64, ())],
              {"T": np.array(T, np.int64)})
    return g, {"h0": np.array([0.5, -1.0, 2.0]), "w": np.array([0.9, 1.1, -0.7])}


class Thirds:
    """A segment layout written in a test, as a user would: three segments of ceil(T / 3) iterations."""

    def _length(self, b, trips):
        i64 = lambda v: b.const(np.array(v, np.int64))
        return b.op("Max", [b.op("Div", [b.op("Add", [trips, i64(2)]), i64(3)]), i64(1)])  # 1 for T = 0

    def start(self, b, s, trips):
        return b.op("Mul", [s, self._length(b, trips)], shape=(), dtype=np.dtype(np.int64))

    def count(self, b, trips):
        k = self._length(b, trips)
        return b.op("Div", [b.op("Add", [trips, b.op("Sub", [k, b.const(np.array(1, np.int64))])]), k])


@pytest.mark.parametrize("T", [0, 1, 5, 10])
def test_a_new_checkpoint_policy_needs_no_change_in_revgraph(T):
    g, feeds = _counter_loop(T)
    want = rg.Session(rg.gradient(g, wrt=["h0", "w"])).run(feeds)
    gg = rg.gradient(g, wrt=["h0", "w"], checkpoint=Segments(Thirds(), "thirds"))
    got = rg.Session(gg).run(feeds)
    # against the unrolled loop: h_T = w^T h0 + sum_{k<T} w^k
    w, h0 = feeds["w"], feeds["h0"]
    assert np.allclose(got["h0_grad"], w ** T) and np.allclose(want["h0_grad"], w ** T)
    dw = sum(k * w ** (k - 1) * h0 for k in [T]) + sum(k * w ** (k - 1) for k in range(1, T))
    assert np.allclose(got["w_grad"], dw) and np.allclose(want["w_grad"], dw)
    assert sum(n.op_type == "Loop" for n in gg.nodes) == 3  # forward, checkpoints, backward


def test_a_rule_returning_a_wrong_cotangent_is_named(monkeypatch):
    g = Graph([Node("Sin", ["x"], ["y"], name="sin"), Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float32, (2, 3))], [ValueInfo("loss", np.float32, ())])

    def wrong_dtype(ctx, node, cts):
        return [lambda: ctx.e.op("Cast", [cts[0]], to=11, shape=(2, 3), dtype=F64)]

    def wrong_rank(ctx, node, cts):
        return [lambda: ctx.e.op("ReduceSum", [cts[0]], keepdims=0, shape=(), dtype=np.dtype(np.float32))]

    def wrong_count(ctx, node, cts):
        return [cts[0], None]

    for rule, text in ((wrong_dtype, "cotangent of dtype float64"), (wrong_rank, "cotangent of rank 0")):
        monkeypatch.setitem(registry.RULES, "Sin", rule)
        with pytest.raises(GraphError, match=f"node 'sin' \\(Sin\\): the VJP of Sin gives input 'x' .* {text}"):
            rg.gradient(g)
    monkeypatch.setitem(registry.RULES, "Sin", wrong_count)
    with pytest.raises(InternalError, match="returned 2 cotangents for 1 inputs"):
        rg.gradient(g)


def test_lazy_cotangents_are_emitted_only_where_needed():
    # d/dw of x @ w must not build x's cotangent (w^T g) at all
    g = Graph([Node("MatMul", ["x", "w"], ["y"], name="mm"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float32, (2, 3)), ValueInfo("w", np.float32, (3, 4))],
              [ValueInfo("loss", np.float32, ())])
    nodes, grads = rg.backward(g, ["loss"], ["w"])
    assert set(grads) >= {"w", "y", "loss"} and "x" not in grads
    reads = {i for n in nodes for i in n.inputs}
    assert "x" in reads and "w" not in reads  # w's cotangent reads x; x's would read w
