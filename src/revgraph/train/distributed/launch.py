"""Starting, supervising and stopping data-parallel runs: what revgraph checks and does around ``torchrun``.

- :func:`run_torchrun` is ``revgraph train --nproc N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT ...]``:
  torchrun's own ``run()`` (its argument parser, elastic agent and c10d rendezvous) called in this process, after
  the checks torchrun does not make (a rendezvous port already taken, the loopback-hostname trap), and with its
  outcome turned into revgraph's exit codes. This process *is* the torchrun agent, so SIGINT, SIGTERM and SIGHUP
  reach torchrun's handlers, which stop the workers and wait for them before we exit.
- :func:`die_with_parent` makes a worker die with its agent (Linux ``prctl(PR_SET_PDEATHSIG)``): a killed
  torchrun leaves no worker training on and writing files.
- :func:`network_problem` is the loopback-hostname trap, checked in every worker before it joins the process
  group: gloo listens on the address this machine's name resolves to, and where that is 127.0.0.1 the other
  machines cannot connect (one node errors out, the other waits).
- :func:`record_failure` / :func:`recorded_failure`: torchrun's ``--max-restarts`` restarts the workers after
  any failure, also a deterministic one (bad data, a NaN loss, refused arguments). The failed attempt records its
  one-line message (in ``--checkpoint-dir`` by rank 0, and in the directory of the ``--nproc`` launcher by every
  rank); a restarted attempt of the same run finds it and stops at once with the same message.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from ...errors import RevgraphError

DEFAULT_TIMEOUT = 300.0  # seconds; gloo's own default is 30 minutes, NCCL's 10
FAILURE_FILE = "failure.json"
RUN_DIR_ENV = "REVGRAPH_RUN_DIR"  # set by run_torchrun for its workers: where they record a failure
AGENT_PID_ENV = "REVGRAPH_AGENT_PID"  # set by run_torchrun: the pid the workers' parent must have
PR_SET_PDEATHSIG = 1  # linux/prctl.h


# ---------------------------------------------------------------------------------------------- in a worker


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the torchrun agent) dies, and exit at once if it
    already has. A no-op elsewhere and outside torchrun (``TORCHELASTIC_RUN_ID`` unset). SIGKILL, not SIGTERM:
    a worker without its agent has nobody to report to, and must not go on to write the output."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    # the agent may have died between starting us and the prctl: then we were already re-parented
    expected = os.environ.get(AGENT_PID_ENV)
    if os.getppid() == 1 or (expected and os.getppid() != int(expected)):
        os._exit(1)


def _resolves(name: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return []


def _loopback(addresses: list[str]) -> bool:
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def interfaces() -> str:
    """This machine's network interfaces other than loopback, comma-separated (for messages)."""
    try:
        names = [n for _, n in socket.if_nameindex() if n != "lo"]
    except OSError:
        names = []
    return ", ".join(names) or "none found"


def trap_message(master: str) -> str:
    """The one line of the loopback-hostname trap (:func:`network_problem`)."""
    host = socket.gethostname()
    where = ", ".join(_resolves(host))
    return (f"this machine's name {host!r} resolves to {where}, a loopback address, so gloo would listen where the "
            f"other machines (rendezvous at {master}) cannot connect: set GLOO_SOCKET_IFNAME to the network interface "
            f"that reaches them on every machine (here: {interfaces()}; NCCL_SOCKET_IFNAME for --device cuda)")


def network_problem(backend: str) -> str | None:
    """The loopback-hostname trap, or ``None``: the processes span several machines (``WORLD_SIZE`` >
    ``LOCAL_WORLD_SIZE``) and meet at a non-loopback ``MASTER_ADDR``, gloo picks its address from this machine's
    name (``GLOO_SOCKET_IFNAME`` unset), and that name resolves only to loopback addresses. NCCL picks a
    non-loopback interface itself, so only gloo is checked."""
    world, local = int(os.environ.get("WORLD_SIZE", "1") or 1), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if backend != "gloo" or not local or world <= local or os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    master = os.environ.get("MASTER_ADDR", "")
    if not master or _loopback(_resolves(master)):  # every node on this machine (tests, 127.0.0.1): no trap
        return None
    return trap_message(master) if _loopback(_resolves(socket.gethostname())) else None


def _restart() -> tuple[str, int, int]:
    env = os.environ
    return (env.get("TORCHELASTIC_RUN_ID", ""), int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0))


def _failure_files(rank: int, checkpoint_dir) -> list[Path]:
    if os.environ.get(RUN_DIR_ENV):  # the --nproc launcher's: its workers share it (nothing left in the user's
        return [Path(os.environ[RUN_DIR_ENV]) / FAILURE_FILE]  # checkpoint directory beside a refused snapshot)
    if checkpoint_dir is not None and rank == 0:  # the checkpoint directory may exist on rank 0's machine only
        return [Path(checkpoint_dir) / FAILURE_FILE]
    return []


def record_failure(message: str, rank: int, checkpoint_dir=None) -> None:
    """Record a deterministic failure of this attempt (its one-line ``message``) where a restarted attempt of the
    same torchrun run will look (:func:`recorded_failure`). Only when torchrun may restart (``--max-restarts``)
    or the ``--nproc`` launcher asks for it; never raises (the failure being reported matters more)."""
    run_id, _, max_restarts = _restart()
    if not run_id or not (max_restarts or os.environ.get(RUN_DIR_ENV)):
        return
    for f in _failure_files(rank, checkpoint_dir):
        try:
            f.parent.mkdir(exist_ok=True)  # a checkpoint directory before its first checkpoint
            if not f.exists():  # the first failure is the one to repeat
                tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"run_id": run_id, "message": message}))
                os.replace(tmp, f)
        except OSError:
            pass


def recorded_failure(comm, checkpoint_dir=None) -> None:
    """Raise :class:`RevgraphError` with the message of the failure an earlier attempt of this torchrun run
    recorded (:func:`record_failure`), on every rank at once (one all-gather), when torchrun restarted us
    (``TORCHELASTIC_RESTART_COUNT`` > 0). On a fresh start rank 0 removes a record of an earlier run in
    ``checkpoint_dir``, so that it cannot stop a later restart of this one."""
    run_id, restart, _ = _restart()
    if not run_id:
        return
    found = None
    for f in _failure_files(comm.rank, checkpoint_dir):
        try:
            record = json.loads(f.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(record, dict):  # (a file of that name that is not ours: not a record)
            continue
        if restart and record.get("run_id") == run_id:
            found = found or str(record.get("message", "an earlier attempt of this run failed"))
        elif not restart and f.parent != Path(os.environ.get(RUN_DIR_ENV, "\0")):
            f.unlink(missing_ok=True)
    every = comm.gather_objects(found)
    message = next((m for m in every if m), None)
    if message:
        raise RevgraphError(message)


# ---------------------------------------------------------------------------------------------- the launcher


def _port_taken(host: str, port: int) -> bool:
    """True when ``host:port`` cannot be bound here because another socket holds it (torchrun's c10d backend
    would then silently connect to whatever listens there and wait)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            import errno

            return exc.errno == errno.EADDRINUSE
    return False


HANDED_OVER = "error.rank{rank}.txt"  # a worker's one-line error, for the launcher to print once


def launched_worker() -> bool:
    """Is this process a worker that ``revgraph train --nproc`` started (our launcher's run directory in the
    environment, the launcher its parent, a torchrun rank)? The launcher speaks for the run (one line)."""
    return bool(os.environ.get(RUN_DIR_ENV)) and os.environ.get("RANK") is not None and \
        os.environ.get(AGENT_PID_ENV) == str(os.getppid())


def hand_over(message: str) -> bool:
    """In a worker of ``revgraph train --nproc`` (our launcher's run directory in the environment, a torchrun
    rank): write this rank's one-line error for the launcher, which prints one line for the whole run, and return
    True (the caller then prints nothing: every rank printed the same refusal, between torchrun's own lines).
    False elsewhere, or when the file cannot be written (the caller prints the line itself)."""
    if not launched_worker():
        return False
    try:
        Path(os.environ[RUN_DIR_ENV], HANDED_OVER.format(rank=int(os.environ["RANK"]))).write_text(message,
                                                                                                   encoding="utf-8")
        return True
    except (OSError, ValueError):
        return False


def leave_worker(code: int) -> None:
    """End a worker that refused (exit ``code`` 2) at once, without the interpreter's finalization: after a peer
    timed out or stopped, gloo's threads are still joinable and their C++ destructors abort the process
    ("terminate called without an active exception", SIGABRT), which torchrun would report as a crash (exit
    code -6) instead of the refusal. A worker of ``--nproc`` (which handed its refusal over) or of raw torchrun
    (``TORCHELASTIC_RUN_ID`` and ``RANK`` set: its line is printed already). Anywhere else, or for another code,
    returns (the caller exits as usual)."""
    run_dir, rank = os.environ.get(RUN_DIR_ENV), os.environ.get("RANK")
    nproc = run_dir and rank is not None and os.environ.get(AGENT_PID_ENV) == str(os.getppid())
    torchrun = rank is not None and os.environ.get("TORCHELASTIC_RUN_ID") is not None
    if code != 2 or not (nproc or torchrun):
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _handed_over(run_dir: str) -> str | None:
    """The one line to print for a run whose workers refused. The first deterministic failure recorded
    (:func:`record_failure`) says what went wrong; a rank's line that ends with it says it better (``rank 0
    refused its data: ...``, as the other ranks word the refusing rank's message), and is preferred. Without a
    record (a peer that stopped, a timeout), the lowest rank's line."""
    try:
        recorded = str(json.loads(Path(run_dir, FAILURE_FILE).read_text())["message"])
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    lines = []
    for f in sorted(Path(run_dir).glob("error.rank*.txt"), key=lambda f: int(f.stem.removeprefix("error.rank"))):
        try:
            lines.append(f.read_text(encoding="utf-8").strip().splitlines()[0])
        except (OSError, ValueError, IndexError):
            continue
    if recorded is not None:
        return max((ln for ln in lines if ln.endswith(recorded)), key=len, default=recorded)
    return lines[0] if lines else None


class _quiet_torchrun:
    """torchrun's agent logs a W line ("Sending process ... closing signal SIGTERM") and an E line ("failed
    (exitcode: 2) local_rank: 1 ...") around a worker's refusal: its loggers (torch.distributed.*, which read the
    level from ``LOGLEVEL`` when they are made) are set to CRITICAL while it runs, unless the user set LOGLEVEL.
    What a failure means is said by revgraph's one line (:func:`run_torchrun`)."""

    def __enter__(self):
        import logging

        self.saved = None
        if "LOGLEVEL" in os.environ:  # the user asked for torchrun's logs
            return self
        os.environ["LOGLEVEL"] = "CRITICAL"  # (loggers made during the run; the workers set their own)
        loggers = [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict)
                   if n.startswith("torch.distributed")]
        self.saved = [(lg, lg.level) for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            os.environ.pop("LOGLEVEL", None)
            for lg, level in self.saved:
                lg.setLevel(level)


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise RevgraphError(f"--rdzv-endpoint must be HOST:PORT (the address of node 0 and a free port), got {text!r}")
    return host.strip("[]"), int(port)


def torchrun_arguments(args, rest: list[str]) -> list[str]:
    """torchrun's command line for ``revgraph train --nproc`` with ``rest`` (the train command without the launch
    options). One machine: ``--standalone`` (a c10d rendezvous on a free local port). Several: c10d rendezvous at
    ``--rdzv-endpoint``, hosted by ``--node-rank 0`` (``is_host``, which torchrun cannot infer where the
    endpoint's address is not what this machine's name resolves to), this node's ``--local-addr``. Raises
    :class:`RevgraphError` (one line) for inconsistent options, a taken port or the loopback trap."""
    nnodes = args.nnodes
    launch = [f"--nproc-per-node={args.nproc}", f"--max-restarts={args.max_restarts}"]
    if args.max_restarts < 0:
        raise RevgraphError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if nnodes == 1:
        if args.rdzv_endpoint or args.node_rank is not None:
            raise RevgraphError("--rdzv-endpoint and --node-rank are for several machines: add --nnodes M")
        return ["--standalone", *launch, "-m", "revgraph", "--", *rest]
    if nnodes < 1:
        raise RevgraphError(f"--nnodes must be at least 1, got {nnodes}")
    if args.rdzv_endpoint is None or args.node_rank is None:
        raise RevgraphError(f"--nnodes {nnodes} needs --node-rank R (0 on the machine of --rdzv-endpoint) and "
                            "--rdzv-endpoint HOST:PORT on every machine")
    if not 0 <= args.node_rank < nnodes:
        raise RevgraphError(f"--node-rank must be in [0, {nnodes}), got {args.node_rank}")
    host, port = _endpoint(args.rdzv_endpoint)
    is_host = args.node_rank == 0
    if is_host and _port_taken("" if not _resolves(host) else host, port):
        raise RevgraphError(f"port {port} of --rdzv-endpoint {args.rdzv_endpoint} is already taken on this machine "
                            "(another run or program listens there): choose another port")
    if args.device == "cpu" and not os.environ.get("GLOO_SOCKET_IFNAME") and not _loopback(_resolves(host)) \
            and _loopback(_resolves(socket.gethostname())):
        raise RevgraphError(trap_message(args.rdzv_endpoint))
    if not args.local_addr and _loopback(_resolves(socket.getfqdn())) and not _loopback(_resolves(host)):
        raise RevgraphError(f"this machine's name {socket.getfqdn()!r} resolves to a loopback address, which the other "
                            "machines cannot reach: give --local-addr with this machine's address on every machine")
    local = [f"--local-addr={args.local_addr}"] if args.local_addr else []
    # --timeout bounds the rendezvous too: the wait for the other nodes (join_timeout, torchrun's default 600 s) and
    # each store operation, the connection to node 0 included (read_timeout, 60 s, tried twice)
    wait = max(1, math.ceil(args.timeout))
    conf = f"is_host={int(is_host)},join_timeout={wait},read_timeout={max(1, math.ceil(args.timeout / 2))}"
    return [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}", f"--rdzv-conf={conf}", *local, *launch,
            "-m", "revgraph", "--", *rest]


def _first_failure(failures: dict) -> tuple:
    """The ``(rank, failure)`` that stopped the run: not one torchrun itself terminated (SIGTERM) after it, the
    earliest of the others (issue 40: the lowest rank was named, one torchrun had stopped with exit code -15)."""
    return min(failures.items(), key=lambda kv: (kv[1].exitcode == -signal.SIGTERM,
                                                 getattr(kv[1], "timestamp", 0), kv[0]))


def cpp_log_file(args) -> Path:
    """Where the launcher of ``revgraph train --nproc`` (``args``) puts torch's C++ log lines
    (:mod:`revgraph.train.distributed.cpp_log`): ``torch-cpp.node<R>.log`` in ``--snapshot-dir``, or beside
    ``-o`` without one."""
    where = args.checkpoint_dir if args.checkpoint_dir is not None else (Path(args.output).parent or ".")
    return Path(where, f"torch-cpp.node{args.node_rank or 0}.log")


def _with_log(message: str, cpp) -> str:
    """``message`` and where torch's C++ lines of the run went, when there were any (one line for a failed run)."""
    return message + (f" (torch's C++ log lines: {cpp.log_file})" if getattr(cpp, "lines", 0) else "")


def run_torchrun(argv: list[str], args=None) -> int:
    """Run torchrun (``torch.distributed.run``'s parser and ``run``) in this process with ``argv`` and return
    revgraph's exit code: 0 when every worker succeeded; 2 when a worker stopped with revgraph's one-line error
    (bad input, a NaN loss, refused arguments, a peer that stopped or timed out), which it printed, or the
    rendezvous failed (one line, :func:`revgraph.train.distributed.restarts.rendezvous_message`); 3 for an
    internal error; 128 + the signal's number when this process got SIGINT, SIGTERM or SIGHUP (torchrun then
    stopped the workers and waited for them); 1 when a worker crashed without a message (killed, say). With
    ``args`` (``revgraph train --nproc``'s options): one line per restart
    (:func:`revgraph.train.distributed.restarts.reporting`), and torch's C++ log lines in :func:`cpp_log_file`
    (one line says where, at the end)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .cpp_log import routed
    from .join import NODE_RANK_ENV
    from .restarts import lost_host_note, rendezvous_message, reporting

    parsed = parse_args(argv)
    node = 0 if args is None or args.node_rank is None else args.node_rank
    with tempfile.TemporaryDirectory(prefix="revgraph-run-") as run_dir:
        os.environ[RUN_DIR_ENV], os.environ[AGENT_PID_ENV] = run_dir, str(os.getpid())
        os.environ[NODE_RANK_ENV] = str(node)
        if parsed.log_dir is None:  # torchrun's logs (error files) go in this run's directory, removed with it:
            # by default the agent makes a torchelastic_* directory in TMPDIR per run and leaves it there
            parsed.log_dir = os.path.join(run_dir, "torchelastic")
        cpp = routed(cpp_log_file(args)) if args is not None else contextlib.nullcontext()
        try:
            with cpp, _quiet_torchrun(), reporting(run_dir, node, args and args.checkpoint_dir) as reached:
                try:
                    run(parsed)
                except (ChildFailedError, SignalException):
                    raise
                except Exception as exc:  # the rendezvous failed: one line when we can say why
                    said = args is not None and rendezvous_message(exc, args.rdzv_endpoint, node == 0, args.timeout,
                                                                   reached[0])
                    if said:
                        raise RevgraphError(said) from None
                    raise
            if getattr(cpp, "lines", 0):
                print(f"revgraph: torch's C++ log lines ({cpp.lines}) are in {cpp.log_file}", file=sys.stderr)
            return 0
        except ChildFailedError as exc:
            codes = {f.exitcode for f in exc.failures.values()}
            # (a failure this node recorded is its own, deterministic: not node 0's loss)
            lost = "" if Path(run_dir, FAILURE_FILE).exists() else lost_host_note(args and args.rdzv_endpoint, node)
            if 2 in codes or (3 not in codes and any(Path(run_dir).glob("error.rank*.txt"))):
                # the one line of the workers' refusal, printed once here (each worker handed it over); a rank that
                # handed its line over and then died in a native destructor still refused
                message = _handed_over(run_dir)
                if message:  # (one line, unwrapped, as the CLI prints its errors)
                    print(f"revgraph: error: {_with_log(message + lost, cpp)}", file=sys.stderr)
                return 2
            if 3 not in codes:  # a worker killed or crashed without a message: say which (torchrun's lines are off)
                rank, f = _first_failure(exc.failures)
                said = (f"worker {rank} of --nproc stopped with exit code {f.exitcode} and no message (killed, or "
                        "out of memory?)")
                print(f"revgraph: error: {_with_log(said + lost, cpp)}", file=sys.stderr)
            return 3 if 3 in codes else 1
        except RevgraphError as exc:
            raise RevgraphError(_with_log(str(exc), cpp)) from None
        except SignalException as exc:  # torchrun stopped the workers (they say nothing: launched_worker)
            if int(exc.sigval) == signal.SIGINT:
                print("revgraph: interrupted", file=sys.stderr)
            return 128 + int(exc.sigval)
        except Exception as exc:  # noqa: BLE001 - the rendezvous failed (a peer never came, the endpoint refused us)
            from ...runtime import _first_line

            raise RevgraphError(_with_log(f"torchrun failed: {type(exc).__name__}: {_first_line(exc)[:300]}",
                                          cpp)) from None
        finally:
            for k in (RUN_DIR_ENV, AGENT_PID_ENV, NODE_RANK_ENV):
                os.environ.pop(k, None)
