"""Peak memory and time of a gradient build against the graph's size: what ``revgraph grad`` and ``check`` do.

    python bench/build_memory.py [--sizes 10000 100000 200000 1000000] [--limit-gib 8] [--check-sizes ...]
                                 [--profile N --profile-size 20000]

A chain of N nodes on a [2, 2] float32 tensor cycles MatMul(h, W), Add(h, b), Tanh(h), Mul(h, c) and ends in
``ReduceSum`` (the loss); the gradient is taken with respect to W, b and c. Each size runs in a fresh
subprocess under an address-space limit (``--limit-gib``, RLIMIT_AS), so that a size the machine cannot hold
fails there instead of swapping; the phases are those of ``revgraph grad m.onnx -o g.onnx``:

- ``load``: ``revgraph.load`` of the file (parse, opset check, SSA, shape inference) and ``check_valid``;
- ``gradient``: ``revgraph.gradient``;
- ``save``: ``write_graph`` (the model serialized in pieces into the atomic temporary file, the gradient
  graph's nodes released, ONNX's full check of the file).

Before each phase the process's peak resident size is reset (``/proc/self/clear_refs``, "5"), so a phase's
peak (``VmHWM``) includes what the earlier phases still hold; "per node" is that peak, less the interpreter's
resident size after imports, divided by N. ``check`` (``revgraph check m.onnx``: float64 central differences)
runs in its own subprocess: wall seconds, peak MiB and CPU seconds (all threads). ``--profile N`` prints cProfile's top
N functions by own time and tracemalloc's top N lines by size for one build at ``--profile-size`` nodes, instead of the
table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))  # this tree's revgraph, also for --profile in this process
PHASES = ("load", "gradient", "save")


def chain_proto(n: int):
    """The ``n``-node chain described above, as an ``onnx.ModelProto`` (opset 21)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    nodes, prev = [], "x"
    for i in range(n - 1):
        op, extra = (("MatMul", "W"), ("Add", "b"), ("Tanh", None), ("Mul", "c"))[i % 4]
        nodes.append(helper.make_node(op, [prev] + ([extra] if extra else []), [f"v{i}"], name=f"n{i}"))
        prev = f"v{i}"
    nodes.append(helper.make_node("ReduceSum", [prev], ["loss"], keepdims=0, name="loss"))
    inits = {"W": np.array([[0.6, -0.3], [0.2, 0.5]], np.float32), "b": np.array([0.1, -0.1], np.float32),
             "c": np.array(0.9, np.float32)}
    graph = helper.make_graph(nodes, f"chain{n}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(a, k) for k, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set size to the current one
        f.write("5")


def worker(model: str, out: str) -> dict:
    """The phases of ``revgraph grad`` on ``model`` in this process: seconds and peak KiB of each."""
    import revgraph as rg
    from revgraph.cli.write import write_graph
    from revgraph.ir import gc_paused
    from revgraph.onnx_io.part_check import check_valid

    _reset_hwm()
    result = {"base_kib": _hwm_kib()}

    def load():
        g = rg.load(model)
        check_valid(g)
        return g

    g = gg = None
    for phase in PHASES:
        _reset_hwm()
        t0 = time.perf_counter()
        with gc_paused():  # as the CLI runs
            if phase == "load":
                g = load()
            elif phase == "gradient":
                gg = rg.gradient(g, "loss", ["W", "b", "c"])
                result["nodes"] = len(gg.nodes)
            else:  # as `revgraph grad` writes: the gradient graph's nodes released before ONNX's check
                write_graph(gg, out, None, "gradient graph", g)
        result[phase] = {"s": time.perf_counter() - t0, "kib": _hwm_kib()}
    return result


def _limit(gib: float):
    def apply():
        size = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    return apply


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_build(model: str, out: str, gib: float, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", model, out], capture_output=True, text=True,
                          env=_env(), preexec_fn=_limit(gib), timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:120]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_check(model: str, gib: float, timeout: float) -> dict:
    """``revgraph check MODEL`` in a subprocess: wall seconds, CPU seconds (user + system, all its threads: less
    sensitive to other processes on a shared machine), peak resident KiB (``os.wait4``: the child's own, not the
    maximum over all children) and exit code."""
    t0 = time.perf_counter()
    with open(os.devnull, "wb") as null:
        # (preexec_fn: setrlimit in the child before exec; this process starts no threads)
        proc = subprocess.Popen([sys.executable, "-m", "revgraph", "check", model], stdout=null, stderr=null,
                                env=_env(), preexec_fn=_limit(gib))  # noqa: PLW1509
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                return {"error": f"over {timeout:.0f} s"}
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {"s": time.perf_counter() - t0, "cpu": usage.ru_utime + usage.ru_stime, "kib": usage.ru_maxrss,
            "rc": proc.returncode}


def profile(n: int, top: int) -> None:
    import cProfile
    import io
    import pstats
    import tracemalloc

    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "m.onnx")
        import onnx

        onnx.save(chain_proto(n), model)
        prof = cProfile.Profile()
        prof.enable()
        worker(model, os.path.join(tmp, "g.onnx"))
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        print(text.getvalue())
        import revgraph as rg

        tracemalloc.start()
        g = rg.load(model)
        gg = rg.gradient(g, "loss", ["W", "b", "c"])
        snap = tracemalloc.take_snapshot()
        print(f"tracemalloc: {tracemalloc.get_traced_memory()[1] / n:.0f} bytes per node at the peak; "
              f"{sum(s.size for s in snap.statistics('filename')) / n:.0f} held after gradient")
        for stat in snap.statistics("lineno")[:top]:
            print(f"{stat.size / n:8.1f} B/node {stat.count / n:6.2f} objs/node  {stat.traceback}")
        del g, gg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(argv[1], argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 200_000, 1_000_000])
    parser.add_argument("--check-sizes", type=int, nargs="*", default=None,
                        help="sizes to time `revgraph check` on (default: those of --sizes up to 200,000)")
    parser.add_argument("--limit-gib", type=float, default=8.0, help="address-space limit of each subprocess")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--profile-size", type=int, default=20_000)
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.profile_size, args.profile)
        return 0
    import onnx

    checks = args.check_sizes if args.check_sizes is not None else [n for n in args.sizes if n <= 200_000]
    print(f"address-space limit {args.limit_gib:g} GiB per subprocess; peaks are VmHWM per phase")
    print(f"{'nodes':>10} {'phase':>9} {'seconds':>9} {'peak MiB':>9} {'bytes/node':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted(set(args.sizes) | set(checks)):
            model, out = os.path.join(tmp, f"m{n}.onnx"), os.path.join(tmp, f"g{n}.onnx")
            onnx.save(chain_proto(n), model)
            if n in args.sizes:
                r = run_build(model, out, args.limit_gib, args.timeout)
                if "error" in r:
                    print(f"{n:>10,} {'build':>9} {r['error']}")
                else:
                    for phase in PHASES:
                        p = r[phase]
                        per = (p["kib"] - r["base_kib"]) * 1024 / n
                        print(f"{n:>10,} {phase:>9} {p['s']:9.2f} {p['kib'] / 1024:9.0f} {per:11.0f}")
            if n in checks:
                c = run_check(model, args.limit_gib, args.timeout)
                text = c.get("error") or (f"{c['s']:9.2f} {c['kib'] / 1024:9.0f} {'':>11} exit {c['rc']}, "
                                          f"{c['cpu']:.1f} CPU s")
                print(f"{n:>10,} {'check':>9} {text}")
            for p in (model, out):
                if os.path.exists(p):
                    os.remove(p)
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
