"""Joining the process group with a side channel for refusals: a rank that stops before the group exists (its data
file truncated, its model unreadable) tells the others through the rendezvous store instead of leaving them to
wait ``--timeout`` for it.

torchrun gives every worker the address of a TCP store (``MASTER_ADDR``, ``MASTER_PORT``): hosted by rank 0 (as
``init_process_group``'s ``env://`` does) or by the agent (``TORCHELASTIC_USE_AGENT_STORE``). :func:`join_store`
connects to it as ``env://`` would, but without waiting for every worker inside the store's constructor, and
then waits in a loop of short polls until every rank has checked in (key ``joined/<rank>``) or one has written
its refusal (key ``refused``); ``init_process_group`` then runs on that store. :func:`announce_refusal` is the
other side: the refusing rank connects (rank 0 hosts), writes its one-line message and leaves. Keys live under
``revgraph/join/``, not under torchrun's restart count: that count is each node's own (a node restarted because
another one failed does not count it), so ranks of one attempt may hold different counts. Each attempt of
``revgraph train --nproc`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) has a new store; with the agent's shared
store an attempt sees the last one's keys: its refusal again (as :func:`revgraph.train.distributed.launch.
recorded_failure` would repeat it), or a full count (the check-in then waits for nothing; the join itself is
``init_process_group``'s).

A host (rank 0, when it hosts the store) that saw or wrote a refusal stays until every other rank is marked
``told/<rank>`` or ``--timeout`` passed: leaving earlier would take the store, and the message, with it. A rank
marks itself when it reads the refusal; a refusing rank marks itself and the other ranks of its node, which its
torchrun agent stops as soon as it exits (they may never read it).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

from ...errors import InputError, RevgraphError


class CollectiveError(RevgraphError):
    """A collective failed: another rank died, stopped (``--timeout``) or cannot be reached. Unlike other
    :class:`RevgraphError` failures it is not deterministic, so it is not recorded against torchrun's restarts
    (:func:`revgraph.train.distributed.launch.record_failure`). Defined here, where joining fails first;
    :mod:`.data_parallel` re-exports it."""

NODE_RANK_ENV = "REVGRAPH_NODE_RANK"  # set by the --nproc launcher: this machine's --node-rank, for messages
POLL = 0.05  # seconds between two looks at the store while joining


def _prefix() -> str:
    return "revgraph/join/"


def _hosts_store(rank: int) -> bool:
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


def where_rank(rank: int) -> str:
    """``"rank r (node n, host h)"``: this process's rank, node (``--node-rank`` under ``revgraph train --nproc``,
    torchrun's ``GROUP_RANK`` otherwise) and machine, for messages about it."""
    node = os.environ.get(NODE_RANK_ENV) or os.environ.get("GROUP_RANK")
    return f"rank {rank}" + (f" (node {node}, host {socket.gethostname()})" if node else "")


def _store(rank: int, world: int, timeout: float):
    """The TCP store at ``MASTER_ADDR:MASTER_PORT`` (hosted here on rank 0 unless the agent hosts it), connected
    within ``timeout`` seconds. Raises what ``TCPStore`` raises (the caller words it)."""
    from torch.distributed import TCPStore

    host = _hosts_store(rank)
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=host,
                    timeout=timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=host)


def _tell(store, ranks) -> None:
    for r in ranks:
        store.set(f"{_prefix()}told/{r}", "1")


def _node_ranks(rank: int) -> range:
    """The global ranks of this node's workers: torchrun numbers them contiguously, ``LOCAL_RANK`` from 0."""
    first = rank - int(os.environ.get("LOCAL_RANK", "0") or 0)
    return range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def _told(store, rank: int, world: int, timeout: float) -> None:
    """On the store's host: wait (at most ``timeout`` s) until every other rank was told of the refusal."""
    deadline = time.monotonic() + timeout
    keys = [f"{_prefix()}told/{r}" for r in range(world) if r != rank]
    while keys and not store.check(keys) and time.monotonic() < deadline:
        time.sleep(POLL)


def _missing(store, world: int) -> list[int]:
    return [r for r in range(world) if not store.check([f"{_prefix()}joined/{r}"])]


def join_store(rank: int, world: int, timeout: float):
    """Connect to torchrun's store and wait until all ``world`` ranks checked in; return the store, for
    ``init_process_group(store=...)``. Raises :class:`InputError` ``"<rank r (node n, host h)> refused before
    joining: <its message>"`` as soon as a rank announced a refusal (:func:`announce_refusal`), and
    :class:`CollectiveError` naming the ranks that did not check in
    within ``timeout`` seconds (``--timeout``) or when the store cannot be reached."""
    from ...runtime import _first_line

    deadline = time.monotonic() + timeout
    try:
        store = _store(rank, world, timeout)
        store.set(f"{_prefix()}joined/{rank}", "1")
        store.add(_prefix() + "count", 1)
        while True:
            if store.check([_prefix() + "refused"]):
                message = store.get(_prefix() + "refused").decode("utf-8", "replace")
                _tell(store, [rank])
                if _hosts_store(rank):
                    _told(store, rank, world, max(1.0, deadline - time.monotonic()))
                raise InputError(message)
            if int(store.add(_prefix() + "count", 0)) >= world:
                return store
            if time.monotonic() > deadline:
                missing = ", ".join(map(str, _missing(store, world)))
                raise CollectiveError(f"rank(s) {missing} did not join the process group within {timeout:g} s "
                                      "(--timeout): they stopped before joining or cannot be reached")
            time.sleep(POLL)
    except RevgraphError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.distributed's errors, one line
        raise CollectiveError(f"cannot join the process group within {timeout:g} s (--timeout): "
                              f"{_first_line(exc)[:300]}") from None


def announce_refusal(message: str, timeout: float) -> None:
    """Under torchrun, in a rank that refuses before the process group exists (no ``init_process_group`` yet):
    write ``"<rank r (node n, host h)> refused before joining: <message>"`` where the other ranks look while they
    join (:func:`join_store`), so that they stop at once naming it. Rank 0 hosts the store and stays until the
    others read it (at most ``timeout`` s). Never raises: the refusal itself is what matters."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ or "RANK" not in os.environ:
        return
    try:
        import torch.distributed as dist

        if dist.is_initialized():  # the group exists: the ranks refuse together through it
            return
        rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
        if world < 2:
            return
        store = _store(rank, world, timeout)
        line = f"{where_rank(rank)} refused before joining: {message}"
        store.compare_set(_prefix() + "refused", "", line)  # (the first refusal stays)
        _tell(store, _node_ranks(rank))  # (this node's others are stopped by its agent when this rank exits)
        if _hosts_store(rank):
            _told(store, rank, world, timeout)
    except Exception:  # noqa: BLE001, S110 - a store that cannot be reached: the others time out as before
        pass
