"""Residual policies of loop VJPs (``checkpoint=``): what the forward ``Loop`` keeps for its backward loop.

* :class:`Store` stacks, per iteration, exactly the body values the body's VJP reads (fastest, O(T) memory).
* :class:`Recompute` stacks only the loop-carried values and recomputes the rest of the body backwards.
* :class:`Segments` keeps the loop-carried values at segment starts only (checkpoints) and recomputes one segment
  at a time (Griewank and Walther, "Algorithm 799: revolve"; Chen et al. 2016, "Training deep nets with
  sublinear memory cost"). Where segments start is its :class:`Boundary`: every K iterations
  (:class:`EveryK`), or at the perfect squares (:class:`Squares`, the ``sqrt`` policy: about sqrt(T)
  checkpoints and segments of at most about 2 sqrt(T) iterations).

A policy is parsed once, at the API boundary (:func:`parse_policy`), from the names users write: ``store``,
``recompute``, ``sqrt`` or a positive integer K. Adding a policy is adding a class here and its name to
:data:`NAMED` (a new segment layout is a :class:`Boundary`: two functions written as graph nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx

from ..errors import GraphError

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


@dataclass(frozen=True)
class Store:
    """Stack the residuals the body's VJP reads."""

    name = "store"


@dataclass(frozen=True)
class Recompute:
    """Stack the loop-carried values only; recompute the body in the backward loop."""

    name = "recompute"


@dataclass(frozen=True)
class Segments:
    """Checkpoints at segment starts (``boundary``); each segment is recomputed and differentiated with
    :class:`Store` by the backward loop, so only one segment's residuals exist at a time."""

    boundary: Boundary
    name: str = "segments"


CheckpointPolicy = Store | Recompute | Segments

#: The longest segment of a K policy (``parse_policy``: T + K must fit in int64).
MAX_SEGMENT = 2**62

#: The policies users name, by name (a positive integer K means ``Segments(EveryK(K))``).
NAMED: dict[str, CheckpointPolicy] = {
    "store": Store(),
    "recompute": Recompute(),
    "sqrt": Segments(Squares(), "sqrt"),
}


def parse_policy(policy: object) -> CheckpointPolicy:
    """The policy ``policy`` names: a :data:`CheckpointPolicy` as it is, a name of :data:`NAMED`, or a positive
    segment length K (an int or a digit string). Raises :class:`GraphError` (one line) otherwise."""
    if isinstance(policy, (Store, Recompute, Segments)):
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
