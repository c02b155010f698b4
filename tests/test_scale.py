"""Deep and wide graphs: a 100,000-node chain and a value with 10,000 consumers get their gradients without
recursion errors (the walks are iterative). Build time is measured in bench/build_time.py, not asserted here."""

from __future__ import annotations

import numpy as np

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo


def chain(n: int) -> Graph:
    nodes, prev = [], "x"
    for i in range(n):
        nodes.append(Node("Sin" if i % 2 else "Tanh", [prev], [f"v{i}"], name=f"n{i}"))
        prev = f"v{i}"
    return Graph(nodes, [ValueInfo("x", np.float64, (3,))], [ValueInfo(prev, np.float64, (3,))])


def test_chain_of_100k_nodes_differentiates():
    gg = rg.gradient(chain(100_000))
    assert gg.output_names[-1] == "x_grad"
    proto = rg.to_onnx(gg)
    assert len(proto.graph.node) == len(gg.nodes) > 300_000


def test_long_chain_gradient_is_right():
    x = np.array([0.3, -0.2, 0.9])
    out = rg.Session(rg.gradient(chain(2_000))).run({"x": x})
    value, grad = x.copy(), np.ones(3)
    for i in range(2_000):
        if i % 2:
            grad, value = grad * np.cos(value), np.sin(value)
        else:
            value = np.tanh(value)
            grad = grad * (1 - value**2)
    np.testing.assert_allclose(out["x_grad"], grad, rtol=1e-10)


def test_value_with_10k_consumers():
    n = 10_000
    nodes = [Node("Mul", ["x", f"c{i}"], [f"v{i}"], name=f"n{i}") for i in range(n)]
    nodes.append(Node("Sum", [f"v{i}" for i in range(n)], ["y"], name="sum"))
    inits = {f"c{i}": np.array(float(i % 7), np.float64) for i in range(n)}
    g = Graph(nodes, [ValueInfo("x", np.float64, (2,))], [ValueInfo("y", np.float64, (2,))], inits)
    gg = rg.gradient(g, wrt=["x"])
    sums = [nd for nd in gg.nodes if nd.op_type == "Sum" and nd.name.startswith("accum/x")]
    assert len(sums) == 1 and len(sums[0].inputs) == n
    out = rg.Session(gg).run({"x": np.array([1.0, 2.0])})
    np.testing.assert_allclose(out["x_grad"], np.full(2, sum(i % 7 for i in range(n))))
