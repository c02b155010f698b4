"""Checkpoint policies answer ``saves(node)`` (issue 29): the residual planner asks the policy per body node,
so a selective policy is one class. ``products`` (:class:`SaveProducts`, JAX's ``dots_saveable``) keeps only
the products' outputs and recomputes the elementwise rest: the gradient of the unrolled loop, with fewer stacks
than ``store``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from kit.loops import assert_close, body, grads, graph, loop, n, torch_grads

import revgraph as rg
from revgraph.autodiff.policies import NAMED, PRODUCTS, Recompute, SaveProducts, Store, parse_policy

TRIPS = 4
RNG = np.random.default_rng(29)
FEEDS = {"h0": RNG.standard_normal((2, 3)) * 0.5, "W": RNG.standard_normal((3, 3)) * 0.5}


def _graph():
    """``z = h @ W; h' = tanh(z) * sin(z) * exp(-z^2)``: one product and elementwise work whose VJP reads z,
    tanh(z), sin(z) and the Gaussian factor."""
    b = body([n("MatMul", ["h_in", "W"], "z", "product"), n("Tanh", ["z"], "a"), n("Sin", ["z"], "s"),
              n("Mul", ["a", "s"], "c"), n("Mul", ["z", "z"], "z2"), n("Neg", ["z2"], "nz2"), n("Exp", ["nz2"], "e"),
              n("Mul", ["c", "e"], "h_out")], [("h_in", "h_out")], types={"h_in": (2, 3), "h_out": (2, 3)})
    return graph([loop(b, "M", ["h0"], ["h"]), n("ReduceSum", ["h"], "loss", keepdims=0)],
                 {"h0": (2, 3), "W": (3, 3)}, ["loss"], {"M": np.array(TRIPS, np.int64)})


def _unrolled(h0, W):
    h = h0
    for _ in range(TRIPS):
        z = h @ W
        h = torch.tanh(z) * torch.sin(z) * torch.exp(-z * z)
    return h.sum()


def _stacked(policy) -> list[str]:
    gg = rg.gradient(_graph(), wrt=["h0", "W"], checkpoint=policy)
    fwd = next(node for node in gg.nodes if node.name == "loop")
    return [o for o in fwd.outputs if "stacked" in o]


def test_products_is_a_named_policy_answering_per_node():
    assert parse_policy("products") == SaveProducts() == NAMED["products"]
    assert {"MatMul", "Gemm", "Conv"} <= PRODUCTS
    mm, tanh = rg.ir.Node("MatMul", ["a", "b"], ["c"]), rg.ir.Node("Tanh", ["c"], ["d"])
    assert SaveProducts().saves(mm) and not SaveProducts().saves(tanh)
    assert Store().saves(tanh) and not Recompute().saves(mm)


def test_products_keeps_only_the_product_and_matches_the_unrolled_loop():
    expected = torch_grads(_unrolled, FEEDS, ["h0", "W"])
    results = {p: grads(_graph(), FEEDS, ["h0", "W"], policy=p) for p in ("store", "recompute", "products")}
    for ours in results.values():
        assert_close(ours, expected)
        assert_close(ours, results["store"], rtol=1e-12, atol=1e-14)
    store, products, recompute = _stacked("store"), _stacked("products"), _stacked("recompute")
    assert sorted(products) == ["loop/stacked/h_in", "loop/stacked/z"]  # the product, and the carried input
    assert len(recompute) < len(products) < len(store), (recompute, products, store)


@dataclass(frozen=True)
class SaveExp:
    """A user's selective policy: keep the outputs of Exp nodes only (anything with ``saves`` and ``name``)."""

    name = "exp"

    def saves(self, node) -> bool:
        return node.op_type == "Exp"


@pytest.mark.parametrize("policy", [SaveExp(), SaveProducts()])
def test_a_policy_object_is_taken_as_it_is(policy):
    assert parse_policy(policy) is policy
    ours = grads(_graph(), FEEDS, ["h0", "W"], policy=policy)
    assert_close(ours, torch_grads(_unrolled, FEEDS, ["h0", "W"]))
    if isinstance(policy, SaveExp):
        assert sorted(_stacked(policy)) == ["loop/stacked/e", "loop/stacked/h_in"]
