"""What the ``--nproc`` launcher says about restarts and the rendezvous: one line per event on its stderr.

- :func:`reporting` wraps torchrun's elastic agent (``LocalElasticAgent``, which ``torch.distributed.run`` makes
  in this process) so that every restart prints one line: the rank, the node, the exit code or signal, the
  worker's own one-line error if it handed one over, ``restart k of K``, and the snapshot step the workers resume
  from. torchrun restarts in two cases (``SimpleElasticAgent._invoke_run``): a local worker failed (counted
  against ``--max-restarts``), or another node left or rejoined the rendezvous (not counted).
- :func:`rendezvous_message` turns the rendezvous's exceptions (nothing at the endpoint, a node that never came,
  the host that went away) into one line saying what happened and what to do.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path


def _how(exitcode: int) -> str:
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-exitcode).name}"
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def snapshot_step(directory, machines: int = 1) -> str:
    """Where restarted workers resume: ``"resuming from the snapshot of step s (epoch e) in PATH"``, read from the
    snapshot's metadata only (not its arrays); ``"no --snapshot-dir: starting again from step 0"`` without a
    directory, and a plain statement when this machine has no readable snapshot there (rank 0 writes it, on node
    0's disk; ``machines``: how many take part)."""
    from ..snapshot_checks import read, steps_taken
    from ..snapshots import path_in

    if directory is None:
        return "no --snapshot-dir: training starts again from step 0"
    target = path_in(directory)
    if not target.exists():
        if machines > 1:
            return f"no snapshot in {directory} on this machine: the workers resume from rank 0's, if any, or step 0"
        return f"no snapshot in {directory} yet: training starts again from step 0"

    class Seen(Exception):  # stops the read once the metadata is known (the arrays may be large)
        pass

    def stop(meta):
        raise Seen(meta)

    try:
        read(target, check=stop)
    except Seen as seen:
        meta = seen.args[0]
        with contextlib.suppress(KeyError, TypeError):
            return f"resuming from the snapshot of step {steps_taken(meta)} (epoch {meta['epoch'] + 1}) in {target}"
    except Exception:  # noqa: BLE001, S110 - a damaged snapshot: the workers say why when they read it
        pass
    return f"the workers resume from {target} (its metadata cannot be read here)"


def _handed(run_dir: str, rank: int) -> str | None:
    """The one line worker ``rank`` handed over (:func:`revgraph.train.distributed.launch.hand_over`), removed so
    that it does not speak for a later attempt."""
    f = Path(run_dir, f"error.rank{rank}.txt")
    try:
        text = f.read_text(encoding="utf-8").strip().splitlines()[0]
    except (OSError, ValueError, IndexError):
        return None
    f.unlink(missing_ok=True)
    return text


def restart_lines(failures: dict, node, done: int, most: int, run_dir: str, snapshot_dir,
                  machines: int = 1) -> list[str]:
    """The lines of one restart: one per failed worker in ``failures`` (torchrun's ``RunResult.failures``, global
    rank -> ``ProcessFailure``: rank, node, exit code or signal, its handed-over message), or one for a restart
    that another node caused (no failure here); ``done`` of ``most`` restarts counted so far."""
    resume = snapshot_step(snapshot_dir, machines)
    said = {rank: _handed(run_dir, rank) for rank in failures}
    failures = sorted(failures.items(), key=lambda kv: (getattr(kv[1], "timestamp", 0), kv[0]))
    # no event of its own: a worker torchrun stopped (SIGTERM) after another failed, and one that stopped with its
    # line (exit 2) beside one that was killed or crashed (its collective failed because of that one)
    failures = ([kv for kv in failures if kv[1].exitcode not in (2, -signal.SIGTERM)]
                or [kv for kv in failures if kv[1].exitcode != -signal.SIGTERM] or failures[:1])
    if not failures:
        return [(f"revgraph: restarting the workers of node {node} (not counted against --max-restarts, {done} of "
                 f"{most} used): another node left or rejoined the rendezvous, after a failure there; {resume}")]
    return [f"revgraph: rank {rank} on node {node} {_how(f.exitcode)}" + (f" ({said[rank]})" if said[rank] else "")
            + f"; restart {done} of {most}, {resume}" for rank, f in failures]


@contextlib.contextmanager
def reporting(run_dir: str, node, snapshot_dir=None):
    """While torchrun runs in this process: its ``LocalElasticAgent`` is a subclass that prints
    :func:`restart_lines` to stderr before each restart. ``node``: this machine's ``--node-rank``. Yields a list
    whose one item tells whether workers ever ran (so the rendezvous was reached once)."""
    import torch.distributed.launcher.api as launcher_api

    reached = [False]
    base = launcher_api.LocalElasticAgent

    class Reporting(base):
        _last = None

        def _monitor_workers(self, worker_group):
            reached[0] = True  # (workers run: this node met the others at the rendezvous)
            self._last = super()._monitor_workers(worker_group)
            return self._last

        def _restart_workers(self, worker_group):
            from torch.distributed.elastic.agent.server.api import WorkerState

            spec = worker_group.spec
            failed = self._last is not None and self._last.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            done = spec.max_restarts - self._remaining_restarts
            lines = restart_lines(self._last.failures if failed else {}, node, done, spec.max_restarts, run_dir,
                                  snapshot_dir, worker_group.group_world_size or 1)
            for line in lines:
                print(line, file=sys.stderr, flush=True)
            super()._restart_workers(worker_group)

    launcher_api.LocalElasticAgent = Reporting
    try:
        yield reached
    finally:
        launcher_api.LocalElasticAgent = base


def rendezvous_message(exc: BaseException, endpoint: str | None, is_host: bool, timeout: float,
                       reached: bool) -> str | None:
    """One line for a failed c10d rendezvous (``exc``, raised by torchrun's ``run``), or ``None`` when ``exc`` is
    not one. ``endpoint``: ``--rdzv-endpoint`` (``None`` on one machine); ``is_host``: this is node 0, which hosts
    torchrun's store; ``reached``: this node met the others there before (workers ran)."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    if endpoint is None:
        return None
    restart = ("restart the command on every machine with the same --rdzv-id (with --snapshot-dir the run resumes "
               "from its last snapshot)")
    if isinstance(exc, RendezvousConnectionError):
        if is_host:
            return f"torchrun's rendezvous store at {endpoint} failed on this machine (node 0, its host); {restart}"
        if not reached:
            return (f"nothing answers at --rdzv-endpoint {endpoint} within --timeout {timeout:g} s: node 0 "
                    "(--node-rank 0) hosts torchrun's rendezvous there; start the command there too, or check the "
                    "address, the port and the network between the machines")
        return (f"lost the rendezvous at {endpoint}: node 0 (--node-rank 0) holds it (torchrun's c10d store lives "
                f"there) and stopped or cannot be reached within --timeout {timeout:g} s; {restart}, node 0 first, "
                "or use an external store (torchrun --rdzv-backend etcd-v2) to survive losing node 0")
    if isinstance(exc, RendezvousTimeoutError):
        return (f"the other machines did not join the rendezvous at {endpoint} within --timeout {timeout:g} s: start "
                f"the command on every machine (--nnodes), with the same --rdzv-id and --rdzv-endpoint; after a "
                f"failed run, {restart}")
    if isinstance(exc, RendezvousClosedError):
        return (f"the rendezvous at {endpoint} was closed: another node's run ended (see its messages); {restart}, "
                "with a new --rdzv-id if the old run's store is still up")
    return None


def lost_host_note(endpoint: str | None, node) -> str:
    """On a node other than node 0 whose workers failed: ``"; node 0 ... is gone: ..."`` when nothing answers at
    ``endpoint`` (``--rdzv-endpoint``) any more, so that the user learns that the rendezvous went with node 0 and
    how to start again; ``""`` otherwise (node 0 itself, one machine, the store still up)."""
    import socket

    if endpoint is None or not node:
        return ""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        return ""
    except (OSError, ValueError):
        return ("; node 0 (--node-rank 0), which holds the rendezvous (torchrun's c10d store), is gone too: restart "
                "the command on every machine with the same --rdzv-id, or use an external store")
