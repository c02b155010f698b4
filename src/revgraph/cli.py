"""The ``revgraph`` command (argparse). Bad input exits 2 with one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from . import __version__
from .errors import InputError, RevgraphError
from .ir import Graph, ValueInfo
from .onnx_io import load
from .runtime import BACKENDS, Session

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2), as every revgraph error is."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


class _UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="revgraph", description="Reverse-mode automatic differentiation of ONNX graphs, as ONNX graphs.")
    p.add_argument("--version", action="version", version=f"revgraph {__version__}")
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks of internal errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    info = sub.add_parser("info", help="inputs, outputs, initializers, operators and opset of a model")
    info.add_argument("model", metavar="MODEL.onnx")

    run = sub.add_parser("run", help="run a model on inputs from an .npz file (random inputs without one)")
    run.add_argument("model", metavar="MODEL.onnx")
    run.add_argument("--inputs", metavar="FILE.npz", help="input arrays by input name (default: random)")
    run.add_argument("-o", "--output", metavar="OUT.npz", help="write the outputs here (default: print a summary)")
    run.add_argument("--backend", choices=BACKENDS, default="onnxruntime")
    run.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``revgraph`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        err.print(f"revgraph: error: {exc}", soft_wrap=True)
        return 2
    try:
        return {"info": cmd_info, "run": cmd_run}[args.command](args)
    except RevgraphError as exc:
        err.print(f"revgraph: error: {exc}", soft_wrap=True, markup=False)
        return 2
    except KeyboardInterrupt:
        err.print("revgraph: interrupted")
        return 130
    except Exception as exc:  # a bug of ours: say so in one line unless asked for the traceback
        if args.traceback:
            raise
        err.print(
            f"revgraph: internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
            "(rerun with --traceback and report it)",
            soft_wrap=True,
            markup=False,
        )
        return 3


# ------------------------------------------------------------------------------------------------- info


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _values_table(title: str, values: list[ValueInfo]) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column("name")
    table.add_column("dtype")
    table.add_column("shape")
    for v in values:
        shape = "?" if v.shape is None else "[" + ", ".join("?" if d is None else str(d) for d in v.shape) + "]"
        dtype = str(v.dtype) if v.dtype is not None else "?"
        table.add_row(v.name, f"seq({dtype})" if v.kind == "sequence" else dtype, shape)
    return table


def cmd_info(args: argparse.Namespace) -> int:
    g = load(args.model)
    converted = f" (converted from {g.source_opset})" if g.source_opset not in (None, g.opset) else ""
    others = ", ".join(f"{d} {v}" for d, v in sorted(g.opsets.items()) if d)
    out.print(f"[bold]{args.model}[/bold]: opset {g.opset}{converted}" + (f"; also {others}" if others else ""))
    out.print(_values_table("Inputs", g.inputs))
    out.print(_values_table("Outputs", g.outputs))
    nbytes = sum(np.asarray(a).nbytes for a in g.initializers.values())
    out.print(f"Initializers: {len(g.initializers)} ({_human_bytes(nbytes)})")
    ops = Counter(n.op_type if not n.domain else f"{n.domain}:{n.op_type}" for _, n in g.walk())
    nested = sum(1 for _ in g.walk()) - len(g.nodes)
    table = Table(
        title=f"Operators: {sum(ops.values())} nodes" + (f", {nested} of them in subgraphs" if nested else ""),
        title_justify="left",
        show_edge=False,
    )
    table.add_column("op")
    table.add_column("count", justify="right")
    for op, count in ops.most_common():
        table.add_row(op, str(count))
    out.print(table)
    return 0


# -------------------------------------------------------------------------------------------------- run


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random arrays for every graph input: floats from N(0, 1), integers in [0, 2), booleans; symbolic or
    unknown dimensions are 1. Raises :class:`InputError` for inputs that cannot be made up (strings,
    sequences, unknown dtype or rank)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        if v.kind != "tensor" or v.dtype is None or v.shape is None or v.dtype.kind not in "fiub":
            raise InputError(f"cannot make up a random value for input {v.name!r} ({v.describe()}); pass --inputs FILE.npz")
        shape = tuple(d if isinstance(d, int) else 1 for d in v.shape)
        if v.dtype.kind == "f":
            feeds[v.name] = rng.standard_normal(shape).astype(v.dtype)
        elif v.dtype.kind == "b":
            feeds[v.name] = rng.random(shape) < 0.5
        else:
            feeds[v.name] = rng.integers(0, 2, shape).astype(v.dtype)
    return feeds


def read_npz(path: str) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by key; :class:`InputError` if it is missing or not an npz file."""
    if not os.path.exists(path):
        raise InputError(f"{path!r}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not hasattr(data, "files"):
                raise InputError(f"{path!r} holds one array; pass an .npz file that maps input names to arrays")
            return {k: data[k] for k in data.files}
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path!r} is not a readable .npz file ({type(exc).__name__})") from None


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` as .npz, atomically."""
    target = Path(path)
    if not target.parent.is_dir():
        raise RevgraphError(f"cannot write {path!r}: directory {str(target.parent)!r} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".npz", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _summary(arrays: dict[str, np.ndarray]) -> Table:
    table = Table(show_edge=False)
    for col in ("output", "dtype", "shape", "min", "max", "mean"):
        table.add_column(col, justify="right" if col in ("min", "max", "mean") else "left")
    for name, a in arrays.items():
        numeric = a.dtype.kind in "fiub" and a.size
        stats = [f"{float(s):.6g}" for s in (a.min(), a.max(), a.astype(np.float64).mean())] if numeric else ["", "", ""]
        table.add_row(name, str(a.dtype), str(list(a.shape)), *stats)
    return table


def cmd_run(args: argparse.Namespace) -> int:
    g = load(args.model)
    if args.inputs:
        feeds = read_npz(args.inputs)
    else:
        feeds = random_inputs(g, args.seed)
        described = ", ".join(f"{k} {a.dtype}{list(a.shape)}" for k, a in feeds.items()) or "none needed"
        err.print(f"note: no --inputs given; using random inputs (seed {args.seed}): {described}", soft_wrap=True, markup=False)
    results = Session(g, backend=args.backend).run(feeds)
    if args.output:
        write_npz(args.output, results)
        out.print(f"wrote {len(results)} output(s) to {args.output}", markup=False)
    else:
        out.print(_summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
