"""The argparse ``type=`` of every numeric option of ``revgraph``: each value is range-checked at parse time, so
that ``--checkpoint 99999999999999999999`` or ``--lr nan`` is a one-line usage error (exit 2) naming the option,
never an ``OverflowError`` (exit 3) in an int64 array later or a run that trains on NaN.

A :class:`Number` parses the text as a whole number (``2.5`` and ``1e3`` are not whole numbers: say what you
mean) or as a finite float (``nan``, ``inf`` and ``1e400`` are refused), and checks its bounds
(:func:`revgraph.validate.number_problem`): integers always within int64, and within a stated maximum where a
larger value could only exhaust the machine (threads, processes). Options whose text is not only a number but
holds one (``--checkpoint K``, ``--memory-budget``, ``--device cuda:i``, ``--rdzv-endpoint HOST:PORT``) get a
:class:`Checked` type that runs the library's own parser. Every ``type=`` in the parsers is a :class:`Checked`
(tests/test_cli_numbers.py walks the parsers and fails on a bare ``type=int``).
"""

from __future__ import annotations

import argparse

from ..errors import RevgraphError
from ..validate import FLOAT32_MAX, INT64_MAX, describe, number_problem

#: Stated maxima: more would only exhaust the machine (onnxruntime threads per process; processes per machine).
MAX_THREADS = 4096
MAX_NPROC = 1024
MAX_NODES = 65536
#: --timeout: about 31 years; torch.distributed's timeout is a C++ duration that a larger value overflows.
MAX_TIMEOUT = 1e9
#: --bucket-mb: MiB whose byte count an int64 holds.
MAX_BUCKET_MB = float(2**43)


class Checked:
    """An argparse ``type=`` that checks its value; ``numeric``: the option's value is a number (the sweep test
    feeds it huge, negative, zero, non-finite and non-numeric values)."""

    numeric = False

    def __init__(self, parse, what: str) -> None:
        self._parse = parse
        self.what = what
        self.__name__ = what  # (argparse names the type in some messages)

    def __call__(self, text: str):
        try:
            return self._parse(text)
        except RevgraphError as exc:  # the library's own one-line reason
            raise argparse.ArgumentTypeError(str(exc)) from None

    def __repr__(self) -> str:
        return f"Checked({self.what})"


class Number(Checked):
    """A whole number (``integer``) or a finite float within bounds (:func:`revgraph.validate.number_problem`)."""

    numeric = True

    def __init__(self, integer: bool, low=None, high=None, *, low_open: bool = False, high_open: bool = False,
                 nonzero: bool = False) -> None:
        self.integer = integer
        self.bounds = {"low": low, "high": high, "low_open": low_open, "high_open": high_open, "nonzero": nonzero}
        super().__init__(self._number, describe(integer, **self.bounds))

    def problem(self, value) -> str | None:
        """What is wrong with ``value`` (a number) for this option (``None``: nothing)."""
        return number_problem(value, integer=self.integer, **self.bounds)

    def _number(self, text: str):
        value = _read(text, self.integer)
        problem = f"give {self.what}" if value is None else self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {problem}")
        return value


def _read(text: str, integer: bool):
    """``text`` as an int (digits only, a sign allowed) or a float; ``None`` when it is neither. An integer
    option given ``2.5`` or ``1e3`` gets the float, which :func:`number_problem` then calls not whole."""
    text = text.strip()
    if integer:
        try:
            return int(text, 10)
        except ValueError:
            pass
    try:
        value = float(text)
    except ValueError:
        return None
    return value


def whole(low: int | None = None, high: int | None = None) -> Number:
    """A whole number in ``[low, high]`` (int64's range where a bound is ``None``)."""
    return Number(True, low, high)


POSITIVE_INT = whole(1)
NON_NEGATIVE_INT = whole(0)
INT64 = whole()
SEED = whole(0, INT64_MAX)  # numpy's generators refuse negative seeds; the seed goes in int64 arrays
THREADS = whole(0, MAX_THREADS)
NPROC = whole(1, MAX_NPROC)
NNODES = whole(1, MAX_NODES)
NODE_RANK = whole(0, MAX_NODES - 1)
POSITIVE = Number(False, 0, None, low_open=True)
NON_NEGATIVE = Number(False, 0)
FRACTION_CLOSED = Number(False, 0, 1)  # [0, 1]: label smoothing
MOMENTUM = Number(False, 0, 1, high_open=True)  # [0, 1), as revgraph.train.Optimizer checks it
NONZERO = Number(False, nonzero=True)
TIMEOUT = Number(False, 0, MAX_TIMEOUT, low_open=True)
BUCKET_MB = Number(False, 0, MAX_BUCKET_MB, low_open=True)
LOSS_SCALE = Number(False, 0, FLOAT32_MAX, low_open=True)  # the fp16 loss scale is a float32 in the graph
GROWTH_FACTOR = Number(False, 1, FLOAT32_MAX, low_open=True)
BACKOFF_FACTOR = Number(False, 0, 1, low_open=True, high_open=True)


def opset() -> Number:
    """``--opset N``: from 7 to the newest opset the installed onnx knows."""
    import onnx

    return whole(7, onnx.defs.onnx_opset_version())


def _policy(text: str) -> str:
    from ..autodiff.policies import parse_policy

    parse_policy(text)
    return text


def _budget(text: str) -> str:
    from ..autodiff.memory import parse_budget

    parse_budget(text)
    return text


def _device(text: str) -> str:
    from ..runtime.devices import Device

    Device.parse(text)
    return text


def _endpoint(text: str) -> str:
    from ..train.distributed.launch import _endpoint as endpoint

    endpoint(text)
    return text


#: ``--checkpoint store|recompute|products|sqrt|K``: K a whole number from 1 to int64's largest.
CHECKPOINT = Checked(_policy, "checkpoint policy")
#: ``--memory-budget F|BYTES``: a fraction in [0, 1] or a byte count that an int64 holds.
MEMORY_BUDGET = Checked(_budget, "memory budget")
#: ``--device cpu|cuda[:i]``.
DEVICE = Checked(_device, "device")
#: ``--rdzv-endpoint HOST:PORT``: a port from 1 to 65535.
ENDPOINT = Checked(_endpoint, "endpoint")


def text_type(parse, what: str) -> Checked:
    """A :class:`Checked` for a non-numeric option (``--loss``): ``parse(text)`` returns the value or raises
    ``argparse.ArgumentTypeError`` / :class:`RevgraphError`."""
    return Checked(parse, what)
