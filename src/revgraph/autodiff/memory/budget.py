"""Memory budgets for the residuals of a backward pass: a fraction of the default's, a byte count, or zero.

``rg.gradient(..., memory=...)``, ``rg.Trainer(..., memory=...)`` and ``--memory-budget`` take a budget for
the bytes of the residuals (the forward values the backward reads, :mod:`.residuals`):

- a ``float`` in ``[0, 1]``: that fraction of what the default plan keeps (``1.0`` is the default plan,
  ``0.5`` half of it);
- an ``int`` ``>= 0``: a byte count (``0``: keep only what cannot be recomputed);
- a :class:`Budget`, which also gives the sizes of symbolic dimensions (a byte budget must know the batch).

On the command line a number with a decimal point or an exponent is a fraction, an integer is bytes, and a unit
(``KB``, ``MB``, ``GB``, ``KiB``, ``MiB``, ``GiB``, ``B``) makes it bytes: ``0.5``, ``0``, ``300MB``, ``2GiB``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ... import validate as V
from ...errors import RevgraphError

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

#: The size a symbolic dimension is taken to have when a fraction budget is planned and ``dims`` does not
#: give it: sizes only matter relative to each other then, and a batch or sequence dimension scales every
#: activation alike.
DEFAULT_SYMBOLIC_DIM = 64
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Budget:
    """A memory budget for the residuals of a backward pass.

    Exactly one of ``fraction`` (in ``[0, 1]``, of the bytes the default plan keeps) and ``bytes`` (``>= 0``) is
    set. ``dims`` maps symbolic dimension names to sizes (``{"batch": 64}``), used to size values; a byte budget
    over values with symbolic dimensions needs them. Raises :class:`RevgraphError` (one line) otherwise.
    """

    fraction: float | None = None
    bytes: int | None = None
    dims: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise RevgraphError("a Budget takes exactly one of fraction= (0 to 1) and bytes= (>= 0)")
        if self.fraction is not None:
            object.__setattr__(self, "fraction", _fraction(self.fraction))
        if self.bytes is not None and (isinstance(self.bytes, bool) or not isinstance(self.bytes, int)
                                       or not 0 <= self.bytes <= _INT64_MAX):
            raise RevgraphError(f"a byte budget must be an int from 0 to {_INT64_MAX} (int64), got {self.bytes!r}")
        dims = dict(self.dims or {})
        for k, v in dims.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _INT64_MAX:
                raise RevgraphError(f"dims maps symbolic dimension names to sizes >= 1, got {k!r}: {v!r}")
        object.__setattr__(self, "dims", dims)

    def describe(self) -> str:
        """``0.5 of the default`` or ``300.0 MB``, for messages."""
        return f"{self.fraction:g} of the default" if self.fraction is not None else f"{self.bytes / 1e6:.1f} MB"


def _fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RevgraphError(f"a memory fraction must be a number from 0 to 1, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or v > 1:
        raise RevgraphError(f"a memory fraction must be from 0 to 1 (of what the default keeps), got {value!r}; "
                            "for a byte count give an int or a unit (300MB, 2GiB)")
    return v


def as_budget(memory: object) -> Budget | None:
    """The :class:`Budget` a ``memory=`` argument means: ``None`` (the default plan), a float fraction, an int
    byte count, a :class:`Budget`, or text as the command line takes it (:func:`parse_budget`). Raises
    :class:`RevgraphError` (one line) for anything else, a negative number, or a fraction above 1."""
    if memory is None or isinstance(memory, Budget):
        return memory
    if isinstance(memory, str):
        return parse_budget(memory)
    if isinstance(memory, bool):
        raise RevgraphError(f"memory must be a fraction (float), a byte count (int) or a revgraph.Budget, "
                            f"got {memory!r}")
    if isinstance(memory, int):
        if memory < 0:
            raise RevgraphError(f"a memory budget cannot be negative, got {memory}")
        return Budget(bytes=memory)
    if isinstance(memory, float):
        return Budget(fraction=memory)
    raise RevgraphError(f"memory must be a fraction (float), a byte count (int) or a revgraph.Budget, "
                        f"got {type(memory).__name__}")


_TEXT = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_budget(text: str) -> Budget:
    """Parse ``--memory-budget``: ``0.5`` (a fraction), ``0``, ``300000000`` (bytes), ``300MB``, ``2GiB``.
    Raises :class:`RevgraphError` (one line) for a negative number, text that is not a number, a fraction
    above 1 or a unit revgraph does not know."""
    m = _TEXT.match(text) if isinstance(text, str) else None
    if m is None:
        raise RevgraphError(f"a memory budget is a fraction from 0 to 1 (0.5), a byte count (300000000) or a size "
                            f"with a unit (300MB, 2GiB), got {text!r}")
    number, unit = m.groups()
    if number.startswith("-") and float(number) != 0:
        raise RevgraphError(f"a memory budget cannot be negative, got {text!r}")
    number = number.lstrip("+-")
    if unit:
        scale = _UNITS.get(unit.lower())
        if scale is None:
            raise RevgraphError(f"unknown unit {unit!r} in the memory budget {text!r}; use one of "
                                "B, KB, MB, GB, KiB, MiB, GiB")
        size = float(number) * scale
        if not math.isfinite(size) or size > _INT64_MAX:  # (1e400GB was an OverflowError, exit 3)
            raise RevgraphError(f"the memory budget {text!r} is more bytes than an int64 holds")
        return Budget(bytes=int(size))
    if re.fullmatch(r"[0-9]+", number):
        return Budget(bytes=int(number))
    return Budget(fraction=_fraction(float(number)))


# ------------------------------------------------------------------ argument rules (revgraph.validate.arguments)


def budget_argument(name: str, value: object) -> Budget | None:
    """The rule of a ``memory=`` argument: :func:`as_budget` (``None``, a fraction, a byte count, a size text or
    a :class:`Budget`)."""
    return as_budget(value)


def optional_budget_argument(name: str, value: object) -> Budget | None:
    """The rule of a ``budget=`` argument: ``None`` or a :class:`Budget`."""
    return None if value is None else V.instance(name, value, Budget, "a revgraph.Budget or None")


BUDGET = budget_argument
OPTIONAL_BUDGET = optional_budget_argument
