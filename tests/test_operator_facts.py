"""Every operator's facts for autodiff/finite.py (bounded, finite, reads, ...) are stated at its registration
(issue 29): ``@vjp``/``@unary``/``not_differentiable`` keywords, :class:`registry.Facts`. A registration that
leaves a required fact out is found here, finite.py names no operator, and each fact changes the gradient graph
(dropping one is the bug class this fixes: HardSwish left out of two tables cost strong-zero ``Where`` nodes and
no test noticed)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import revgraph as rg
from revgraph.autodiff import finite, registry
from revgraph.ir import Graph, Node, ValueInfo

F32 = np.float32  # (onnxruntime has no float64 kernels of HardSwish, ThresholdedRelu, ...)


def _undeclared() -> dict[str, list[str]]:
    """Registered default-domain operators whose registration leaves out a required fact, with the keywords."""
    ops = set(registry.RULES) | set(registry.NOT_DIFFERENTIABLE)
    return {op: registry.FACTS[op].undeclared() if op in registry.FACTS else list(registry.REQUIRED)
            for op in sorted(ops) if op not in registry.FACTS or registry.FACTS[op].undeclared()}


def test_every_registered_operator_states_its_facts():
    assert _undeclared() == {}
    # and no facts are kept for an operator that has neither a rule nor a not_differentiable declaration
    assert set(registry.FACTS) <= set(registry.RULES) | set(registry.NOT_DIFFERENTIABLE)


def test_a_registration_without_facts_is_found(monkeypatch):
    monkeypatch.setattr(registry, "RULES", dict(registry.RULES))
    monkeypatch.setattr(registry, "FACTS", dict(registry.FACTS))
    monkeypatch.setattr(registry, "NOT_DIFFERENTIABLE", dict(registry.NOT_DIFFERENTIABLE))

    @registry.vjp("Silent")
    def silent(ctx, node, cts):
        return [cts[0]]

    @registry.unary("HalfSaid", bounded=True, finite=True)
    def half_said(ctx, node, x, y, g):
        return g

    registry.not_differentiable("an integer result", "Quiet")
    registry.not_differentiable("an integer result", "Stated", bounded=False, finite=True)
    assert _undeclared() == {"HalfSaid": ["reads"], "Quiet": ["bounded", "finite"], "Silent": ["bounded", "finite"]}
    # what finite.py makes of a fact left out: the answer that claims nothing
    node = Node("Silent", ["a"], ["b"], name="s")
    assert not finite._facts(node).bounded and not finite._facts(node).finite
    assert registry.FACTS["HalfSaid"].reads_of(Node("HalfSaid", ["a"], ["b"], name="h"), 0) == ["a", "b"]


def test_unknown_and_conflicting_facts_are_refused():
    with pytest.raises(TypeError, match="unknown operator facts"):
        registry.vjp("Typo", bounded=True, finite=True, reads=(), bouned=True)
    with pytest.raises(ValueError, match="reads or product"):
        registry.Facts(bounded=True, finite=True, reads=(), product=True)
    with pytest.raises(ValueError, match="tuple of input positions"):
        registry.Facts(bounded=True, finite=True, reads="none")


def test_what_each_kind_of_reads_reads():
    mul, drop, gemm = (Node("Mul", ["a", "b"], ["y"], name="m"), Node("Dropout", ["x", "r", "t"], ["y", "m"], name="d"),
                       Node("Gemm", ["a", "b", "c"], ["y"], name="g"))
    facts = registry.FACTS
    assert [facts["Mul"].reads_of(mul, i) for i in (0, 1)] == [["b"], ["a"]]
    assert [facts["Gemm"].reads_of(gemm, i) for i in (0, 1, 2)] == [["b"], ["a"], []]  # the bias reads nothing
    assert facts["Dropout"].reads_of(drop, 0) == ["r"]  # the scale 1 / (1 - ratio)
    assert facts["Relu"].reads_of(Node("Relu", ["x"], ["y"], name="r"), 0) == []
    assert facts["Tanh"].reads_of(Node("Tanh", ["x"], ["y"], name="t"), 0) == ["x", "y"]


def test_other_domains_and_unregistered_operators_claim_nothing():
    assert finite._facts(Node("Relu", ["x"], ["y"], domain="com.example", name="r")) is registry.UNKNOWN
    assert finite._facts(Node("NoSuchOp", ["x"], ["y"], name="n")) is registry.UNKNOWN
    assert registry.UNKNOWN.bounded is False and registry.UNKNOWN.finite is False


def test_finite_py_names_no_operator():
    # its tables are derived from the registrations: no string in its code (docstrings aside) is an op type
    tree = ast.parse(Path(finite.__file__).read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    ops = set(registry.RULES) | set(registry.NOT_DIFFERENTIABLE) | set(registry.LOWERED)
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs} & ops
    assert named == set()


# ------------------------------------------------------------------------------------ each fact counts


def _relu_then(op: str) -> tuple[Graph, list[str]]:
    """``sum(op(relu(x)))`` with ``x`` a graph input (so it may be inf or NaN): the ReLU's VJP multiplies by a
    cast mask only where ``op``'s VJP is bounded and reads no value that may be non-finite."""
    return Graph([Node("Relu", ["x"], ["r"], name="relu"), Node(op, ["r"], ["y"], name="op"),
                  Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")],
                 [ValueInfo("x", F32, (4,))], [ValueInfo("loss")]), ["x"]


def _after_a_contraction(op: str) -> tuple[Graph, list[str]]:
    """``sum(tanh(relu(op(x W))))``: past the MatMul, ``x``'s inf or NaN is not followed; ``op``'s output is
    finite only where ``op`` is registered ``finite``, else the Tanh VJP reads a value that may be NaN and the
    ReLU keeps its ``Where`` (and the Tanh product its zero test)."""
    return Graph([Node("MatMul", ["x", "W"], ["h"], name="mm"), Node(op, ["h"], ["s"], name="op"),
                  Node("Relu", ["s"], ["r"], name="relu"), Node("Tanh", ["r"], ["t"], name="tanh"),
                  Node("ReduceSum", ["t"], ["loss"], {"keepdims": 0}, "sum")],
                 [ValueInfo("x", F32, (2, 3)), ValueInfo("W", F32, (3, 4))], [ValueInfo("loss")]), ["x", "W"]


def _wheres_and_grads(g: Graph, wrt: list[str]) -> tuple[int, dict[str, np.ndarray]]:
    gg = rg.gradient(g, wrt=wrt)
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.uniform(-4, 4, v.shape).astype(F32) for v in g.inputs}
    return sum(n.op_type == "Where" for _, n in gg.walk()), rg.Session(gg).run(feeds)


@pytest.mark.parametrize(("dropped", "build", "registered", "without"), [
    ({"reads": "all"}, _relu_then, 2, 3),       # HardSwish's own VJP has two (its pieces); the ReLU's is the third
    ({"bounded": False}, _relu_then, 2, 3),
    ({"finite": False}, _after_a_contraction, 2, 4),
])
def test_dropping_a_fact_of_hard_swish_adds_where_nodes(monkeypatch, dropped, build, registered, without):
    g, wrt = build("HardSwish")
    n_with, grads = _wheres_and_grads(g, wrt)
    monkeypatch.setitem(registry.FACTS, "HardSwish", dataclasses.replace(registry.FACTS["HardSwish"], **dropped))
    n_without, grads_without = _wheres_and_grads(g, wrt)
    assert (n_with, n_without) == (registered, without)
    for k in grads:  # the fact changes how the gradient is computed, not its value
        np.testing.assert_array_equal(grads[k], grads_without[k])


#: one-input elementwise rules (``@unary``) registered bounded with ``reads=()``
READS_NOTHING = sorted(op for op in registry.ops_with(bounded=True, reads=()) if op in registry.RULES
                       and hasattr(registry.RULES[op], "__wrapped__")
                       and registry.RULES[op].__module__.endswith(("rules.elementwise", "rules.activations")))


@pytest.mark.parametrize("op", READS_NOTHING)
def test_a_selection_before_a_rule_that_reads_nothing_multiplies_by_its_mask(op):
    # the ReLU before it costs no Where: its cotangent is finite although x may be inf or NaN
    g, wrt = _relu_then(op)
    alone = Graph(g.nodes[1:], [ValueInfo("r", F32, (4,))], g.outputs)
    assert _wheres_and_grads(g, wrt)[0] == _wheres_and_grads(alone, ["r"])[0]
    assert "HardSwish" in READS_NOTHING and "Relu" in READS_NOTHING
