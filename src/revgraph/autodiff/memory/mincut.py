"""Minimum s-t cuts of small integer flow networks, through scipy's maximum flow (Dinic's algorithm).

scipy (``scipy.sparse.csgraph.maximum_flow``, compiled) computes the flow; the source side of a minimum cut is
then what the source still reaches in the residual network (max-flow min-cut theorem, Ford and Fulkerson
1956). Capacities are int32 in scipy: callers scale their costs into ``[0, INF]``.
"""

from __future__ import annotations

import numpy as np

#: an "infinite" capacity: larger than any finite cut a caller builds (they keep their sums below 2**28)
INF = 2**30


class Network:
    """A flow network being built: vertices ``0..n-1`` (``0`` the source, ``1`` the sink), directed edges
    with integer capacities in ``[0, INF]``. Parallel edges add up."""

    SOURCE, SINK = 0, 1

    def __init__(self) -> None:
        self.n = 2
        self._tails: list[int] = []
        self._heads: list[int] = []
        self._caps: list[int] = []
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def vertex(self) -> int:
        """A new vertex."""
        self.n += 1
        return self.n - 1

    def edge(self, tail: int, head: int, capacity: int) -> int:
        """An edge ``tail -> head``; capacities are clipped into ``[0, INF]``. Returns its index (for
        :meth:`source_side`'s ``capacities``)."""
        self._tails.append(tail)
        self._heads.append(head)
        self._caps.append(min(INF, max(0, int(capacity))))
        return len(self._caps) - 1

    def source_side(self, capacities: dict[int, int] | None = None) -> np.ndarray:
        """A boolean mask of the vertices on the source side of a minimum cut; ``capacities`` replaces the
        capacities of some edges (by index) for this cut only."""
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import breadth_first_order, maximum_flow

        if self._arrays is None:
            self._arrays = (np.asarray(self._tails), np.asarray(self._heads))
        caps = np.asarray(self._caps, dtype=np.int64)
        if capacities:
            caps[list(capacities)] = np.clip(list(capacities.values()), 0, INF)
        tails, heads = self._arrays
        caps = csr_matrix((caps.astype(np.int32), (tails, heads)), shape=(self.n, self.n))
        caps.sum_duplicates()
        flow = maximum_flow(caps, self.SOURCE, self.SINK, method="dinic").flow
        residual = (caps - flow).tocsr()  # the flow is antisymmetric: reverse edges get what flows forward
        residual.data[residual.data < 0] = 0
        residual.eliminate_zeros()
        reached = breadth_first_order(residual, self.SOURCE, directed=True, return_predecessors=False)
        side = np.zeros(self.n, dtype=bool)
        side[reached] = True
        return side
