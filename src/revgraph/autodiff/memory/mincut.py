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

    def vertex(self) -> int:
        """A new vertex."""
        self.n += 1
        return self.n - 1

    def edge(self, tail: int, head: int, capacity: int) -> None:
        """An edge ``tail -> head``; capacities are clipped into ``[0, INF]``."""
        if tail != head:
            self._tails.append(tail)
            self._heads.append(head)
            self._caps.append(min(INF, max(0, int(capacity))))

    def source_side(self) -> np.ndarray:
        """A boolean mask of the vertices on the source side of a minimum cut."""
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import breadth_first_order, maximum_flow

        caps = csr_matrix((np.asarray(self._caps, dtype=np.int32), (self._tails, self._heads)), shape=(self.n, self.n))
        caps.sum_duplicates()
        flow = maximum_flow(caps, self.SOURCE, self.SINK, method="dinic").flow
        residual = (caps - flow).tocsr()  # the flow is antisymmetric: reverse edges get what flows forward
        residual.data[residual.data < 0] = 0
        residual.eliminate_zeros()
        reached = breadth_first_order(residual, self.SOURCE, directed=True, return_predecessors=False)
        side = np.zeros(self.n, dtype=bool)
        side[reached] = True
        return side
