"""Residual policies of loop VJPs (``checkpoint=``): what the forward ``Loop`` keeps for its backward loop.

A policy answers one question per node of a loop body, :meth:`Policy.saves`: does the forward loop keep (stack)
this node's outputs for the backward loop, or does the backward loop recompute them? The residual planner
(loops/residuals.py) asks it for each body node whose output the body's VJP needs, and recomputes what is not
saved from what is (body inputs, the loop-carried values, are always available: stacked if needed).

* :class:`Store` saves every node: it stacks, per iteration, exactly the body values the body's VJP reads
  (fastest, O(T) memory).
* :class:`Recompute` saves none: it stacks only the loop-carried values and recomputes the rest of the body
  backwards.
* :class:`SaveProducts` (``products``) saves the outputs of products (``MatMul``, ``Gemm``, ``Conv``, ...:
  :data:`PRODUCTS`), the FLOP-heavy nodes, and recomputes everything else, elementwise activations included
  (JAX's ``checkpoint_policies.dots_saveable``). A selective policy is one class with a :meth:`saves`.
* :class:`Segments` keeps the loop-carried values at segment starts only (checkpoints) and recomputes one segment
  at a time (Griewank and Walther, "Algorithm 799: revolve"; Chen et al. 2016, "Training deep nets with
  sublinear memory cost"); inside a segment it is :class:`Store`. Where segments start is its
  :class:`Boundary`: every K iterations (:class:`EveryK`), or at the perfect squares (:class:`Squares`, the
  ``sqrt`` policy: about sqrt(T) checkpoints and segments of at most about 2 sqrt(T) iterations).

A policy is parsed once, at the API boundary (:func:`parse_policy`), from the names users write: ``store``,
``recompute``, ``products``, ``sqrt`` or a positive integer K; an object with ``saves`` and ``name`` is a
policy as it is (``checkpoint=MyPolicy()``). Adding a policy is adding a class here and its name to
:data:`NAMED` (a new segment layout is a :class:`Boundary`: two functions written as graph nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx

from ..errors import GraphError
from ..ir import Node

I64 = np.dtype(np.int64)


class Builder(Protocol):  # the autodiff Emitter
    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **kw): ...
    def const(self, value, dtype=None) -> str: ...


class Boundary(Protocol):
    """Where the segments of a checkpointed loop start, as graph nodes (int64 scalars).

    A boundary whose class sets ``online = True`` computes ``start`` without reading ``trips`` (it is passed
    ``""``): the forward loop can then keep the checkpoints itself as it runs, instead of a second forward
    loop recomputing them once T is known (loops/checkpoint.py)."""

    def start(self, b: Builder, s: str, trips: str) -> str:
        """The first iteration of segment ``s`` of a loop of ``trips`` iterations (0 for s = 0, increasing)."""

    def count(self, b: Builder, trips: str) -> str:
        """The number of segments of a loop of ``trips`` iterations: how many starts are below it."""


@dataclass(frozen=True)
class EveryK:
    """Segments of ``k`` iterations (the last one shorter)."""

    k: int
    online = True

    def __post_init__(self) -> None:  # (built directly too: Segments(EveryK(k)))
        if isinstance(self.k, bool) or not isinstance(self.k, int | np.integer) or not 0 < self.k <= 2**62:
            raise GraphError(f"EveryK(k={self.k!r}): give a whole number from 1 to {2**62} (2**62)")

    def start(self, b: Builder, s: str, trips: str) -> str:
        return b.op("Mul", [s, b.const(np.array(self.k, np.int64))], shape=(), dtype=I64)

    def count(self, b: Builder, trips: str) -> str:  # ceil(T / k)
        k, k1 = b.const(np.array(self.k, np.int64)), b.const(np.array(self.k - 1, np.int64))
        return b.op("Div", [b.op("Add", [trips, k1]), k], shape=(), dtype=I64)


@dataclass(frozen=True)
class Squares:
    """Segments starting at the perfect squares 0, 1, 4, 9, ...: lengths 1, 3, 5, ..."""

    online = True

    def start(self, b: Builder, s: str, trips: str) -> str:
        return b.op("Mul", [s, s], shape=(), dtype=I64)

    def count(self, b: Builder, trips: str) -> str:  # ceil(sqrt(T)), in float64: exact for any int64 trip count
        real = b.op("Sqrt", [b.op("Cast", [trips], to=onnx.TensorProto.DOUBLE)])
        return b.op("Cast", [b.op("Ceil", [real])], to=onnx.TensorProto.INT64, shape=(), dtype=I64)


class Policy(Protocol):
    """A residual policy: ``name`` (how messages name it) and :meth:`saves`."""

    name: str

    def saves(self, node: Node) -> bool:
        """Does the forward loop keep (stack per iteration) the outputs of body node ``node`` that the backward
        loop reads, rather than the backward loop recomputing them? (Values that cannot be stacked, of a shape
        that changes between iterations or sequences, are recomputed whatever the answer.)"""


@dataclass(frozen=True)
class Store:
    """Stack the residuals the body's VJP reads: every node saved."""

    name = "store"

    def saves(self, node: Node) -> bool:
        return True


@dataclass(frozen=True)
class Recompute:
    """Stack the loop-carried values only; recompute the body in the backward loop: no node saved."""

    name = "recompute"

    def saves(self, node: Node) -> bool:
        return False


#: the products :class:`SaveProducts` saves: contractions and convolutions, whose FLOPs grow faster than their
#: outputs' bytes (recomputing one costs far more than the copy of stacking it)
PRODUCTS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger", "QLinearMatMul",
                      "QLinearConv", "ConvInteger"})


@dataclass(frozen=True)
class SaveProducts:
    """Save the outputs of products (:data:`PRODUCTS`) and recompute the rest of the body from them and the
    loop-carried values (JAX's ``checkpoint_policies.dots_saveable``): the backward loop repeats only cheap
    elementwise work, and the forward loop stacks fewer residuals than :class:`Store`."""

    name = "products"

    def saves(self, node: Node) -> bool:
        return node.op_type in PRODUCTS and node.domain in ("", "ai.onnx")


@dataclass(frozen=True)
class Segments:
    """Checkpoints at segment starts (``boundary``); each segment is recomputed and differentiated with
    :class:`Store` by the backward loop, so only one segment's residuals exist at a time."""

    boundary: Boundary
    name: str = "segments"

    def saves(self, node: Node) -> bool:  # inside a segment (the backward loop differentiates it with Store)
        return True


@dataclass(frozen=True)
class PerLoop:
    """``default`` for every loop but those whose node name is a key of ``loops``, which get the policy it maps
    them to (:func:`loop_policy`). :func:`revgraph.training_graph` gives a chunked loss's loop
    (:mod:`revgraph.train.chunked_loss`) :class:`Recompute` this way, whatever ``checkpoint=`` says."""

    default: object
    loops: dict

    @property
    def name(self) -> str:
        return self.default.name

    def saves(self, node: Node) -> bool:
        return self.default.saves(node)

    def for_loop(self, node: Node) -> object:
        return self.loops.get(node.name) or loop_policy(self.default, node)


def loop_policy(policy: object, node: Node) -> object:
    """The policy of the loop ``node``: ``policy.for_loop(node)`` for a policy that chooses per loop
    (:class:`PerLoop`), else ``policy``."""
    choose = getattr(policy, "for_loop", None)
    return choose(node) if callable(choose) else policy


CheckpointPolicy = Store | Recompute | SaveProducts | Segments | PerLoop | Policy

#: The longest segment of a K policy (``parse_policy``: T + K must fit in int64).
MAX_SEGMENT = 2**62

#: The policies users name, by name (a positive integer K means ``Segments(EveryK(K))``).
NAMED: dict[str, CheckpointPolicy] = {
    "store": Store(),
    "recompute": Recompute(),
    "products": SaveProducts(),
    "sqrt": Segments(Squares(), "sqrt"),
}


def parse_policy(policy: object) -> CheckpointPolicy:
    """The policy ``policy`` names: a :data:`CheckpointPolicy` as it is (any object with a callable ``saves``
    and a ``name``: :class:`Policy`), a name of :data:`NAMED`, or a positive segment length K (an int or a
    digit string). Raises :class:`GraphError` (one line) otherwise."""
    if callable(getattr(policy, "saves", None)) and isinstance(getattr(policy, "name", None), str):
        return policy
    if isinstance(policy, str) and policy.isascii() and policy.isdigit():
        policy = int(policy)
    # K goes in int64 constants of the backward loop (10**20 was an OverflowError there, exit 3), and the
    # segment count ceil(T / K) = (T + K - 1) / K must not wrap around: K <= 2**62 keeps T + K in int64 for
    # any trip count up to 2**62 (K = 2**63 - 1 wrapped, and the gradient came out wrong without an error)
    if isinstance(policy, int) and not isinstance(policy, bool) and 0 < policy <= MAX_SEGMENT:
        return Segments(EveryK(policy), str(policy))
    if isinstance(policy, str) and policy in NAMED:
        return NAMED[policy]
    raise GraphError(f"unknown checkpoint policy '{policy}'; choose {', '.join(NAMED)} or a whole number K "
                     f"from 1 to {MAX_SEGMENT} (2**62)")


def policy_argument(name: str, value: object) -> CheckpointPolicy:
    """The rule of :func:`revgraph.validate.arguments` for a ``checkpoint=`` argument: :func:`parse_policy`
    (here, not in validate, which imports no layer)."""
    return parse_policy(value)


POLICY = policy_argument
