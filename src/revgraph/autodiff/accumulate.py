"""The one place where gradient contributions are added up: :class:`Accumulator` (DESIGN.md section 3).

Every contribution goes through it: the readers of a value version in the backward pass, the seeds of a loop
body's outputs (a body output that is both carried and scanned), the gradient of a loop-invariant value summed
over a backward loop's iterations, and the outputs of an ``If``'s branches.
"""

from __future__ import annotations

from collections import defaultdict

from ..errors import InternalError, RevgraphError
from . import sparse as sp
from .emitter import Emitter
from .sparse import SparseGrad

ACCUMULATE = ("sum", "running")
Grad = str | SparseGrad


class Accumulator:
    """Adds up the gradient contributions of each value version.

    ``mode="sum"``: contributions are kept until :meth:`total` is asked for the version (when its producer is
    reached in the reverse walk, or at the end for inputs), then added by one ``Sum`` node (Caffe2's
    ``GradientRegistry``). ``mode="running"``: each new dense contribution is added to the partial sum at once
    with ``Add``, so earlier terms can be freed sooner. Sparse contributions (:class:`SparseGrad`) concatenate;
    a mix of sparse and dense adds the rows into the dense sum with :func:`~revgraph.autodiff.sparse.add_rows`
    (``ScatterElements`` on flat views: onnxruntime's reducing ``ScatterND`` races on repeated indices when it
    runs on several threads). Nodes are named ``accum/<value>``.

    Raises :class:`RevgraphError` for an unknown mode, :class:`InternalError` when a contribution arrives
    after the total was taken (a bug of the pass, exit 3).
    """

    def __init__(self, e: Emitter, mode: str = "sum"):
        if mode not in ACCUMULATE:
            raise RevgraphError(f"unknown accumulation {mode!r}; choose one of {', '.join(ACCUMULATE)}")
        self.e = e
        self.mode = mode
        self.dense: dict[str, list[str]] = defaultdict(list)
        self.sparse: dict[str, list[SparseGrad]] = defaultdict(list)
        self.done: dict[str, Grad | None] = {}

    def add(self, value: str, grad: Grad) -> None:
        """One more contribution ``grad`` to the gradient of ``value``."""
        if value in self.done:
            raise InternalError(f"gradient of {value!r} used before all its contributions arrived")
        if isinstance(grad, SparseGrad):
            self.sparse[value].append(grad)
            return
        parts = self.dense[value]
        if self.mode == "running" and parts:
            with self.e.scope(f"accum/{value}"):
                parts[:] = [self.e.op("Add", [parts[0], grad], like=parts[0])]
        else:
            parts.append(grad)

    def pending(self) -> list[str]:
        """The values with contributions whose total has not been taken, in the order they first arrived."""
        return [v for v in dict.fromkeys([*self.dense, *self.sparse]) if v not in self.done]

    def total(self, value: str) -> Grad | None:
        """The complete gradient of ``value`` (``None`` if nothing contributed); emits the accumulation once."""
        if value in self.done:
            return self.done[value]
        dense, rows = self.dense.pop(value, []), self.sparse.pop(value, [])
        result: Grad | None = None
        with self.e.scope(f"accum/{value}"):
            if len(dense) == 1:
                result = dense[0]
            elif dense:
                result = self.e.op("Sum", dense, like=dense[0])
            if rows:
                merged = sp.concat(self.e, rows)
                result = merged if result is None else sp.scatter_add(self.e, result, merged)
        self.done[value] = result
        return result

    def dense_total(self, value: str) -> str | None:
        """:meth:`total`, densified (what rules, loop bodies and graph outputs take)."""
        g = self.total(value)
        if isinstance(g, SparseGrad):
            with self.e.scope(f"accum/{value}"):
                g = sp.densify(self.e, g)
            self.done[value] = g
        return g
