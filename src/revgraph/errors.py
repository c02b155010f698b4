"""Exceptions raised by revgraph.

Every error revgraph raises on bad input is a :class:`RevgraphError` whose message is one line that names
the node, op type and value concerned and says what to do. The command line prints that line and exits 2.
"""

from __future__ import annotations


class RevgraphError(Exception):
    """Base class: bad input to revgraph (a model, a name, a file). The message is a single line."""


class GraphError(RevgraphError):
    """A graph is malformed: a name read before any write, a wrong arity, a bad subgraph, a missing output."""


class UnsupportedModelError(RevgraphError):
    """A model uses something revgraph does not handle (a type, an operator domain, an opset)."""


class NonFiniteError(RevgraphError):
    """Training produced a loss or parameters that are NaN or infinite (the step is named; the trainer keeps the
    parameters from before it)."""


class InputError(RevgraphError):
    """Feeds given at run time do not fit the graph (missing, unknown, wrong dtype or shape)."""


class InternalError(Exception):
    """A bug of revgraph itself (a pass or a rule broke its contract): the command line exits 3. Not a
    :class:`RevgraphError`, as the input is not at fault."""
