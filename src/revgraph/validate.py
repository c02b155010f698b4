"""Arguments of the public API, checked where they enter: each check raises :class:`RevgraphError` with one line
naming the argument, the value given and what to give instead, so that a wrong type or an out-of-range number
is refused at the call instead of surfacing later as numpy's ``TypeError``, an ``OverflowError`` in an int64
array, an endless loop or a silently wrong result.

The same bounds serve the command line (:mod:`revgraph.cli.numeric` turns :func:`number_problem` into
argparse's refusals). Integers are bounded by what an int64 holds (:data:`INT64_MAX`): counts, seeds and sizes
end up in int64 arrays and ONNX attributes. ``bool`` is refused where a number is meant (``True`` is an ``int``
to Python, and ``batch_size=True`` is a mistake, not a batch of one).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable

import numpy as np

from .errors import RevgraphError

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
#: float32's largest finite value: a loss scale or factor above it is infinite in a float32 graph.
FLOAT32_MAX = 3.4028234663852886e38


def _show(name: str, value) -> str:
    """``batch_size=2.5`` (an argument) or ``--epochs 2.5`` (an option)."""
    return f"{name} {value!r}" if name.startswith("-") else f"{name}={value!r}"


def is_number(value) -> bool:
    """A real number (numpy's too), not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def number_problem(value, *, integer: bool, low=None, high=None, low_open: bool = False, high_open: bool = False,
                   nonzero: bool = False) -> str | None:
    """What is wrong with ``value`` as a number of this kind (``None``: nothing): not a number (or a ``bool``),
    not whole where ``integer``, not finite, or outside ``[low, high]`` (an end excluded with ``low_open`` /
    ``high_open``; ``None``: unbounded, but integers always within int64), or zero with ``nonzero``."""
    if not is_number(value):
        return f"give {describe(integer, low, high, low_open, high_open, nonzero)}"
    if integer and not isinstance(value, numbers.Integral):
        return f"not a whole number; give {describe(integer, low, high, low_open, high_open, nonzero)}"
    if not integer and not math.isfinite(value):
        return f"not finite; give {describe(integer, low, high, low_open, high_open, nonzero)}"
    if integer:
        low = INT64_MIN if low is None else low
        high = INT64_MAX if high is None else high
    out = (low is not None and (value < low or (low_open and value == low))) or \
        (high is not None and (value > high or (high_open and value == high))) or (nonzero and value == 0)
    return f"give {describe(integer, low, high, low_open, high_open, nonzero)}" if out else None


def describe(integer: bool, low=None, high=None, low_open: bool = False, high_open: bool = False,
             nonzero: bool = False) -> str:
    """``"a whole number from 1 to 9223372036854775807"``, ``"a finite number > 0"``, ``"a number in [0, 1)"``."""
    kind = "a whole number" if integer else "a finite number"
    if integer:
        low = INT64_MIN if low is None else low
        high = INT64_MAX if high is None else high
    if nonzero and low is None and high is None:
        return f"{kind} other than 0"
    if low is not None and high is not None:
        if integer:
            return f"{kind} from {low + low_open:d} to {high - high_open:d}"
        return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {high:g}"
    return kind


def number(name: str, value, *, integer: bool, **bounds):
    """``value`` (a Python ``int`` or ``float``) when :func:`number_problem` finds nothing; else
    :class:`RevgraphError` naming ``name``."""
    problem = number_problem(value, integer=integer, **bounds)
    if problem:
        raise RevgraphError(f"{_show(name, value)}: {problem}")
    return int(value) if integer else float(value)


def positive_int(name: str, value) -> int:
    """A whole number from 1 to :data:`INT64_MAX` (a numpy integer too), as ``int``."""
    return number(name, value, integer=True, low=1)


def non_negative_int(name: str, value) -> int:
    """A whole number from 0 to :data:`INT64_MAX`, as ``int``."""
    return number(name, value, integer=True, low=0)


def finite_float(name: str, value, **bounds) -> float:
    """A finite real number (an ``int`` too) within ``bounds`` (:func:`number_problem`), as ``float``."""
    return number(name, value, integer=False, **bounds)


def optional(check, name: str, value, **bounds):
    """``None`` as it is, else ``check(name, value, **bounds)``."""
    return None if value is None else check(name, value, **bounds)


def flag(name: str, value) -> bool:
    """``True`` or ``False`` (numpy's ``bool_`` too); ``1`` or ``"yes"`` is refused."""
    if value is True or value is False or isinstance(value, np.bool_):
        return bool(value)
    raise RevgraphError(f"{_show(name, value)}: give True or False")


def one_of(name: str, value, choices: Iterable):
    """``value`` when it is one of ``choices`` (compared by type and value: ``1`` is not ``True``)."""
    choices = tuple(choices)
    if not any(type(value) is type(c) and value == c for c in choices):
        raise RevgraphError(f"{_show(name, value)}: choose one of {', '.join(repr(c) for c in choices)}")
    return value


def text(name: str, value, *, empty: bool = False) -> str:
    """A ``str`` (not empty unless ``empty``) without a NUL character (no file, node or value can be named so)."""
    if not isinstance(value, str):
        raise RevgraphError(f"{_show(name, value)}: give a string")
    if not value and not empty:
        raise RevgraphError(f"{_show(name, '')}: give a non-empty string")
    if "\x00" in value:
        raise RevgraphError(f"{_show(name, value)}: a name cannot hold a NUL character")
    return value


def names(name: str, value, *, empty: bool = False) -> list[str] | None:
    """``None`` (the default set), one name, or an iterable of names (a ``str`` is one name, not its letters);
    an empty list is refused unless ``empty``: it asks for nothing, and was a silent no-op or a crash."""
    if value is None:
        return None
    if isinstance(value, str):
        return [text(name, value)]
    if isinstance(value, bytes | dict) or not isinstance(value, Iterable):
        raise RevgraphError(f"{name} must be a value name or a list of names, got {type(value).__name__}")
    items = list(value)
    if not items and not empty:
        raise RevgraphError(f"{_show(name, [])}: give at least one name, or leave {name} out for the default")
    for item in items:
        if not isinstance(item, str):
            raise RevgraphError(f"{name} holds {item!r} ({type(item).__name__}); value names are str")
        text(name, item)
    return items


def path(name: str, value) -> str | os.PathLike:
    """A file path: a ``str`` or ``os.PathLike`` (bytes too), not empty, without a NUL (the operating system
    cannot open such a name, and Python says so with a ``ValueError``)."""
    if not isinstance(value, str | bytes | os.PathLike):
        raise RevgraphError(f"{_show(name, value)}: give a file path (a str or pathlib.Path)")
    raw = os.fspath(value)
    if not isinstance(raw, str | bytes):
        raise RevgraphError(f"{_show(name, value)}: give a file path (a str or pathlib.Path)")
    if len(raw) == 0:
        raise RevgraphError(f"{_show(name, '')}: give a non-empty file path")
    if (b"\x00" if isinstance(raw, bytes) else "\x00") in raw:
        raise RevgraphError(f"{_show(name, value)}: a file path cannot hold a NUL character")
    return value


def instance(name: str, value, kinds: type | tuple[type, ...], what: str):
    """``value`` when it is an instance of ``kinds``; else one line saying ``what`` to give."""
    if not isinstance(value, kinds):
        raise RevgraphError(f"{_show(name, value)} ({type(value).__name__}): give {what}")
    return value


def _loaded(module: str, name: str) -> tuple[type, ...]:
    """The class ``module.name`` when that module is loaded, else no class: a value of a class whose module was
    never imported cannot be an instance of it. (validate is imported by the modules whose classes it checks;
    importing them back would make an import cycle.)"""
    import sys

    found = getattr(sys.modules.get(module), name, None)
    return (found,) if isinstance(found, type) else ()


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (``None`` where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: float) -> str:
    """``"74.5 GiB"``."""
    return f"{n / 2**30:.1f} GiB"


def fits_in_memory(needed: int, what: str) -> None:
    """Refuse (one line, with both figures) a size that needs more bytes than the machine's physical memory:
    it would end in a ``MemoryError`` or the kernel's OOM killer after minutes of swapping."""
    have = physical_memory()
    if have is not None and needed > have:
        raise RevgraphError(f"{what} needs {gib(needed)}, this machine has {gib(have)}: give a smaller size")


# ------------------------------------------------------------------------------------- entry points


class ArgumentError(RevgraphError, TypeError, ValueError):
    """A public function's argument has the wrong type or value. A :class:`RevgraphError` (one line naming the
    function and the argument), and a ``TypeError`` / ``ValueError`` too, for code that caught Python's own."""


def arguments(**rules):
    """Decorate a public function so that each argument named in ``rules`` is checked by its rule
    (``rule(name, value)`` raising :class:`RevgraphError`) before the function runs; the refusal is prefixed with
    the function's name and raised as :class:`ArgumentError`. Arguments that do not bind (an unknown keyword, a
    missing one) are refused the same way. The rules are kept as ``__revgraph_rules__`` (tests/test_api_arguments.py
    checks that every parameter of every public function is covered)."""
    import functools

    def wrap(fn):
        sig, where = _signature(fn, rules), _where(fn)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise ArgumentError(f"{where}: {exc}") from None
            if _apply(rules, where, bound.arguments):
                return fn(*bound.args, **bound.kwargs)
            return fn(*args, **kwargs)

        checked.__revgraph_rules__ = dict(rules)
        return checked

    return wrap


def checked_inside(**rules):
    """:func:`arguments` without the wrapper, for a function on the path of every training batch
    (:meth:`revgraph.Trainer.fit`: one call frame fewer between the caller and the session,
    tests/test_train_frames.py): the rules are kept as ``__revgraph_rules__`` and the function itself calls
    :func:`check` with its ``locals()`` first thing. Converting rules are refused (the function holds its values
    already). An unknown keyword is Python's own ``TypeError`` (an :class:`ArgumentError` is one too)."""

    def mark(fn):
        _signature(fn, rules)
        if any(getattr(rule, "converts", False) for rule in rules.values()):
            raise TypeError(f"{fn.__qualname__}: a converting rule needs validate.arguments' wrapper")
        fn.__revgraph_rules__ = dict(rules)
        return fn

    return mark


def check(fn, values: dict) -> None:
    """Check the arguments of ``fn`` (marked with :func:`checked_inside`) in ``values`` (its ``locals()`` at its
    start) by its rules. Raises :class:`ArgumentError` (one line naming the function and the argument)."""
    _apply(fn.__revgraph_rules__, _where(fn), dict(values))


def _signature(fn, rules: dict):
    import inspect

    sig = inspect.signature(fn)
    unknown = set(rules) - set(sig.parameters)
    if unknown:  # a rule for a parameter that is gone would silently check nothing
        raise TypeError(f"rules for unknown parameters of {fn.__qualname__}: {sorted(unknown)}")
    return sig


def _where(fn) -> str:
    return fn.__qualname__.removesuffix(".__init__")


def _apply(rules: dict, where: str, values: dict) -> bool:
    """Check each of ``values`` that ``rules`` names; a converting rule's new value replaces it in ``values``.
    Returns whether one did."""
    converted = False
    for name, rule in rules.items():
        if name in values:
            try:
                if getattr(rule, "with_where", False):
                    value = rule(name, values[name], where)
                else:
                    value = rule(name, values[name])
            except WholeRefusal as exc:
                raise ArgumentError(str(exc)) from None
            except RevgraphError as exc:
                raise ArgumentError(f"{where}: {exc}") from None
            if getattr(rule, "converts", False) and value is not values[name]:
                values[name] = value  # (AS_GRAPH: the model loaded from a path or ModelProto)
                converted = True
    return converted


def rule(check, **bounds):
    """A rule of :func:`arguments` from a check taking ``(name, value, **bounds)``."""
    return lambda name, value: check(name, value, **bounds)


def nullable(check, **bounds):
    """A rule that lets ``None`` through (the argument's default) and checks anything else."""
    return lambda name, value: None if value is None else check(name, value, **bounds)


def choice(*choices):
    """A rule: one of ``choices``."""
    return lambda name, value: one_of(name, value, choices)


class WholeRefusal(RevgraphError):
    """A rule's message that names the function itself (:func:`arguments` does not prefix it again); rules with
    ``rule.with_where = True`` are given the function's name as a third argument."""


def is_torch_module(value) -> bool:
    """An ``torch.nn.Module`` (looked up without importing torch: it is loaded already where one exists)."""
    import sys

    nn = getattr(sys.modules.get("torch"), "nn", None)
    return nn is not None and isinstance(value, nn.Module)


def mapping(name: str, value):
    """A ``dict``-like mapping (``Mapping``)."""
    from collections.abc import Mapping

    return instance(name, value, Mapping, "a dict")


def optimizer(name: str, value):
    """An optimizer name (``"adam"``) or a :class:`revgraph.train.Optimizer`."""
    import sys

    # the registry's names (read, not imported: revgraph.train.optimizers imports this module)
    names = getattr(sys.modules.get("revgraph.train.optimizers"), "OPTIMIZERS", ("sgd", "adam", "adamw"))
    kinds = (str, *_loaded("revgraph.train.optimizers", "Optimizer"))
    return instance(name, value, kinds, f"an optimizer name ({', '.join(map(repr, names))}) or a "
                    "revgraph.train.Optimizer (revgraph.train.make_optimizer builds one)")


def _name(name: str, value):
    if value is not None and not isinstance(value, str):
        raise RevgraphError(f"{name} must be a value name (a str) or None, got {type(value).__name__}")
    return None if value is None else text(name, value)


NAME = _name  # an optional value name (loss=, output=)
NAMES = names  # None, a name or a non-empty list of names
FLAG = flag
def _seed(name: str, value):
    if number_problem(value, integer=True, low=0):  # numpy refuses negative seeds; seeds go in int64 arrays
        raise RevgraphError(f"{name} must be an int >= 0 that fits in int64, got {value!r}")
    return int(value)


SEED = _seed
POSITIVE_INT = rule(positive_int)
NON_NEGATIVE_INT = rule(non_negative_int)
NON_NEGATIVE = rule(finite_float, low=0)
POSITIVE = rule(finite_float, low=0, low_open=True)
PATH = path
MAPPING = mapping
OPTIMIZER = optimizer
TEXT = text
OPTIONAL_NAMES = rule(names, empty=True)  # (freeze=, override=: may be empty)
OPTIONAL_PATH = nullable(path)
OPTIONAL_MAPPING = nullable(mapping)
OPTIONAL_POSITIVE = nullable(finite_float, low=0, low_open=True)
OPTIONAL_NON_NEGATIVE = nullable(finite_float, low=0)
OPTIONAL_NONZERO = nullable(finite_float, nonzero=True)
MAX_THREADS = 4096  # (as --threads: more would only exhaust the machine)
def _threads(name: str, value):
    if number_problem(value, integer=True, low=0, high=MAX_THREADS):
        raise RevgraphError(f"{name} must be a whole number from 0 (onnxruntime's default) to {MAX_THREADS}, got "
                            f"{value!r}")
    return int(value)


THREADS = _threads


def _loadable(name: str, value):
    """What :func:`revgraph.load` reads: a path, an ``onnx.ModelProto`` or the serialized bytes."""
    import onnx

    if isinstance(value, onnx.ModelProto | bytes | bytearray | memoryview):
        return value
    if isinstance(value, str | os.PathLike):
        return path(name, value)
    raise RevgraphError(f"cannot load a model from {type(value).__name__} ({name}=): give the path of an .onnx "
                        "file, an onnx.ModelProto or its serialized bytes")


LOADABLE = _loadable


def _training_graph(name: str, value):
    kinds = _loaded("revgraph.train", "TrainingGraph")
    return instance(name, value, kinds, "a revgraph.train.TrainingGraph (revgraph.train.training_graph "
                    "builds one)")


TRAINING_GRAPH = _training_graph


def _betas(name: str, value):
    if not (isinstance(value, tuple | list) and len(value) == 2 and all(is_number(b) for b in value)):
        raise RevgraphError(f"{_show(name, value)}: give two numbers in [0, 1), e.g. (0.9, 0.999)")
    return value


def _feeds(name: str, value):
    """A dict of arrays by input name, or one array (a model with one input)."""
    from collections.abc import Mapping

    return instance(name, value, Mapping | np.ndarray | list | tuple, "a dict of arrays by input name, or an array")


BETAS = _betas


def _static(name: str, value):
    """``static=``: ``None`` or a dict of arrays by input name (as revgraph.train.data words it)."""
    from collections.abc import Mapping

    if value is not None and not isinstance(value, Mapping):
        raise WholeRefusal(f"static= must be a mapping of arrays by input name, got {type(value).__name__}")
    return value


STATIC = _static
FEEDS = _feeds
