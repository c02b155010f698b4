"""The ``revgraph`` command (argparse). Bad input exits 2 with one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import limits
from ..autodiff.accumulate import ACCUMULATE
from ..autodiff.api import gradient
from ..autodiff.lift import lift_constants
from ..autodiff.registry import without_rules
from ..errors import InputError, RevgraphError
from ..ir import TARGET_OPSET, ValueInfo, is_float_dtype
from ..onnx_io import load
from ..onnx_io.atomic import write_error
from ..onnx_io.part_check import check_valid
from ..runtime import BACKENDS, Session, random_inputs
from ..text import cell
from ..tools.check import NOT_CHECKED, check_gradients
from ..validate import fits_in_memory
from ..version import __version__
from . import numeric as N
from .common import (
    check_command_outputs,
    err,
    note,
    out,
    quiet,
    read_feeds,
    set_verbosity,
    silence_stdout,
    stdout,
    verbose,
    write_npz,
)
from .forward import COMMANDS as FORWARD_COMMANDS
from .forward import add_parsers as add_forward_parsers
from .layout import add_renamed, finish, required_unless_renamed, settings, spelling_problem
from .lora import add_lora_parser, cmd_lora
from .train import add_runtime_arguments, add_train_parser, cmd_train, runtime_from_args
from .write import (
    MEMORY_HELP,
    POLICIES,
    check_memory_budget,
    check_opset,
    count_nodes,
    report_memory,
    some,
    with_warnings,
    write_graph,
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2), as every revgraph error is, and without abbreviated
    options: ``--npro 2`` is an unknown option, not ``--nproc 2`` (an abbreviation accepted today would change
    meaning when a longer option with the same start is added, and torchrun would see it spelled out)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        with required_unless_renamed(self, args):  # (renamed options: cli/layout.add_renamed)
            namespace, rest = super().parse_known_args(args, namespace)
        problem = spelling_problem(self, args)
        if problem:
            self.error(problem)
        return namespace, rest


class _UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="revgraph", description="Automatic differentiation of ONNX graphs, as ONNX graphs: gradients "
                "(reverse mode), JVPs (forward mode), Hessian-vector products, Jacobians and Hessians; training.")
    p.add_argument("--version", action="version", version=f"revgraph {__version__}")
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks of internal errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    info = sub.add_parser("info", help="inputs, outputs, initializers, operators and opset of a model")
    info.add_argument("model", metavar="MODEL.onnx")

    run = sub.add_parser("run", help="run a model on inputs from an .npz file (random inputs without one)")
    run.add_argument("model", metavar="MODEL.onnx")
    run.add_argument("--inputs", metavar="FILE.npz", help="input arrays by input name (default: random)")
    run.add_argument("-o", "--output", metavar="OUT.npz",
                     help="write the outputs here (default: print a summary); each output is stored under its name "
                     "when that is a plain file name, else as output_<k>; the member revgraph_names maps members to "
                     "names: z = np.load(OUT); {name: z[m] for m, name in z['revgraph_names']}")
    run.add_argument("--backend", choices=BACKENDS, default="onnxruntime")
    run.add_argument("--seed", type=N.SEED, default=0, help="seed of the random inputs (default 0)")
    run.add_argument("--device", default="cpu", type=N.DEVICE, metavar="cpu|cuda[:i]",
                     help="where onnxruntime runs the model (cuda needs onnxruntime-gpu; default cpu)")
    add_runtime_arguments(run, "onnxruntime's, on")

    grad = sub.add_parser("grad", help="write the gradient graph: forward outputs plus <name>_grad outputs")
    grad.add_argument("model", metavar="MODEL.onnx")
    grad.add_argument("-o", "--output", metavar="OUT.onnx", required=True)
    grad.add_argument("--loss", metavar="NAME", help="the value to differentiate (default: the only output)")
    grad.add_argument("--wrt", metavar="NAME", nargs="+", help="values to differentiate with respect to "
                      "(default: every floating-point input and initializer)")
    # "--seed" is a random seed everywhere else (run, check, train, demo): the output cotangent is --cotangent
    add_renamed(grad, "--cotangent", "--seed", choices=("ones", "input"), default="ones",
                help="the cotangent of the loss: ones differentiates the sum of its elements; input adds a graph "
                "input <loss>_grad that holds it (a VJP)")
    grad.add_argument("--unconnected", choices=("zero", "error"), default="zero",
                      help="a wrt value with no path to the loss: zero gradient and a warning, or an error")
    grad.add_argument("--sparse", action="store_true",
                      help="tables read only through Gather get <name>_grad_indices and <name>_grad_values")
    grad.add_argument("--accumulate", choices=ACCUMULATE, default="sum",
                      help="sum: one Sum per value read several times; running: pairwise Add as gradients arrive")
    grad.add_argument("--checkpoint", default="store", type=N.CHECKPOINT, metavar=POLICIES,
                      help="loop residuals: stack them (store), recompute the body (recompute), stack only the "
                      "products' outputs and recompute the rest (products), or keep checkpoints "
                      "every K iterations or at perfect squares (sqrt: O(sqrt(T)) memory)")
    grad.add_argument("--memory-budget", type=N.MEMORY_BUDGET, metavar="F|BYTES", help=MEMORY_HELP)
    grad.add_argument("--lift-constants", action="store_true",
                      help="make floating Constant/ConstantOfShape values with more than one element trainable "
                      "initializers, and the coefficients of ai.onnx.ml LinearClassifier/LinearRegressor nodes")
    grad.add_argument("--straight-through", action="store_true",
                      help="differentiate QuantizeLinear -> DequantizeLinear pairs with the straight-through estimator "
                      "(quantization-aware training)")
    grad.add_argument("--opset", type=N.opset(), metavar="N",
                      help=f"write OUT.onnx at this opset (default: the model's, or {TARGET_OPSET} for an older model)")

    check = sub.add_parser("check", help="compare the gradients with float64 central differences")
    check.add_argument("model", metavar="MODEL.onnx")
    check.add_argument("--loss", metavar="NAME")
    check.add_argument("--wrt", metavar="NAME", nargs="+")
    check.add_argument("--inputs", metavar="FILE.npz", help="input arrays by input name (default: random)")
    check.add_argument("--seed", type=N.SEED, default=0, help="seed of the inputs, cotangent and directions")
    check.add_argument("--lift-constants", action="store_true", help="as for grad")
    check.add_argument("--rtol", type=N.NON_NEGATIVE, default=1e-4, metavar="R",
                       help="relative tolerance (default 1e-4)")
    check.add_argument("--atol", type=N.NON_NEGATIVE, default=1e-6, metavar="A",
                       help="absolute tolerance (default 1e-6)")


    add_forward_parsers(sub)

    show = sub.add_parser("show", help="draw the graph (with --grad: forward and backward) as SVG, PNG or DOT")
    show.add_argument("model", metavar="MODEL.onnx")
    show.add_argument("-o", "--output", metavar="FILE.svg|FILE.png|FILE.dot", required=True,
                      help="the picture; SVG and PNG need Graphviz's dot program, DOT text needs nothing")
    show.add_argument("--grad", action="store_true", help="draw the gradient graph that 'revgraph grad' writes")
    show.add_argument("--loss", metavar="NAME",
                      help="with --grad: the value to differentiate (default: the only output)")
    show.add_argument("--wrt", metavar="NAME", nargs="+", help="with --grad: values to differentiate with respect to")
    show.add_argument("--checkpoint", type=N.CHECKPOINT, metavar=POLICIES, help="with --grad: loop residual policy")

    add_train_parser(sub, N.SEED, MEMORY_HELP)
    add_lora_parser(sub)

    demo = sub.add_parser("demo", help="train a recurrent classifier (ONNX Loop) and an MLP on scikit-learn's digits")
    demo.add_argument("-o", "--output", metavar="DIR", default="revgraph-demo",
                      help="where to write the graphs and the loss curves (default ./revgraph-demo; made if "
                      "missing; a file there of a name the demo writes that the demo did not write is not replaced "
                      "without --force)")
    demo.add_argument("--quick", action="store_true", help="a short run (a smoke test; lower accuracy)")
    demo.add_argument("--epochs", type=N.POSITIVE_INT, metavar="N",
                      help="epochs of the recurrent classifier (default 30)")
    demo.add_argument("--hidden", type=N.POSITIVE_INT, metavar="H",
                      help="hidden size of the recurrent classifier (default 128)")
    demo.add_argument("--seed", type=N.SEED, default=0, help="seed of the split, the weights and the shuffling")
    demo.add_argument("--force", action="store_true", help="overwrite files in DIR that the demo did not write "
                      "(by default the demo refuses to replace them: it writes rnn.onnx, rnn.train.onnx, mlp.onnx, "
                      "mlp.train.onnx, loss.svg and .revgraph-demo.json)")
    finish(p)  # argument groups, examples, --quiet/--verbose, --print-completion (cli/layout.py)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``revgraph`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    for stream in (sys.stdout, sys.stderr):  # a name the terminal's encoding cannot show is escaped, not fatal
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        code = _main(argv)
        if sys.stdout is not None:
            sys.stdout.flush()  # (here, where a closed pipe is caught, not at the interpreter's exit)
        return code
    except BrokenPipeError:  # the reader went away (`revgraph info m.onnx | head -1`): stop quietly, as Unix
        # tools do (128 + SIGPIPE); stdout goes to /dev/null so that the interpreter's last flush cannot fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13
    except OSError as exc:  # standard output on a full disk (> /dev/full): one line, as for any output file
        silence_stdout()
        with contextlib.suppress(OSError):  # (stderr on a full disk too: the exit code is all that can be said)
            err.print(f"revgraph: error: {write_error(exc, 'standard output')}", soft_wrap=True, markup=False)
        return 2


def _main(argv: list[str]) -> int:
    stdout.to_stderr = False  # (set by check_command_outputs when -o is standard output)
    try:
        args = _parser().parse_args(argv)
        args.argv = list(argv)
        set_verbosity(getattr(args, "verbosity", 0))
    except _UsageError as exc:
        err.print(f"revgraph: error: {exc}", soft_wrap=True, markup=False)  # argv is echoed: no markup
        return 2
    try:
        commands = {"info": cmd_info, "run": cmd_run, "grad": cmd_grad, "check": cmd_check, "train": cmd_train,
                    "demo": cmd_demo, "show": cmd_show, "lora": cmd_lora, **FORWARD_COMMANDS}
        return _dispatch(commands[args.command], args)
    except RevgraphError as exc:
        from ..train.distributed.launch import hand_over

        if not hand_over(str(exc)):  # (a --nproc worker: its launcher prints the run's one line)
            err.print(f"revgraph: error: {exc}", soft_wrap=True, markup=False)
        return 2
    except KeyboardInterrupt:
        from ..train.distributed.launch import launched_worker

        if not launched_worker():  # (a --nproc worker: its launcher says it once for the run)
            err.print("revgraph: interrupted")
        return 130
    except BrokenPipeError:  # (not a bug: main stops quietly)
        raise
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


def _dispatch(command, args: argparse.Namespace) -> int:
    """Run ``command``; a Python warning that a library raises on the way (onnx warns about odd external
    data keys, say) is printed as one ``warning:`` line, shown literally, before the result or error line,
    instead of as Python's two-line source excerpt."""
    import time
    import warnings

    start = time.perf_counter()
    talk = verbose() and os.environ.get("RANK", "0") == "0"  # (--verbose: once for a data-parallel run)
    if talk:
        err.print(f"revgraph {args.command}: {settings(args)}", soft_wrap=True, markup=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            return command(args)
        finally:
            for w in caught:
                err.print(f"warning: {w.message}", soft_wrap=True)
            if talk:
                err.print(f"revgraph {args.command}: {time.perf_counter() - start:.2f} s", markup=False)


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
    header = Text.assemble(cell(args.model, "bold"),
                           cell(f": opset {g.opset}{converted}" + (f"; also {others}" if others else "")))
    out.print(header, soft_wrap=True)
    out.print(_values_table("Inputs", g.inputs))
    out.print(_values_table("Outputs", g.outputs))
    nbytes = sum(np.asarray(a).nbytes for a in g.initializers.values())
    out.print(f"Initializers: {len(g.initializers)} ({_human_bytes(nbytes)})")
    ops = Counter(n.op_type if not n.domain else f"{n.domain}:{n.op_type}" for _, n in g.walk())
    nested = sum(1 for _ in g.walk()) - len(g.nodes)
    # Not the table's title: a title wraps at the width of the (narrow) table.
    nested_text = f", {nested} of them in subgraphs" if nested else ""
    out.print(f"Operators: {sum(ops.values())} nodes{nested_text}", soft_wrap=True)
    table = Table(show_edge=False)
    table.add_column("op")
    table.add_column("count", justify="right")
    for op, count in ops.most_common():
        table.add_row(op, str(count))
    out.print(table)
    # what grad and train would refuse where a path to the loss passes it (issue 41: info itself refuses
    # no readable file, contrib operators included)
    missing = without_rules(n for _, n in g.walk())
    if missing:
        listed = ", ".join(f"{op} ({k} node{'s' if k > 1 else ''})" for op, k in sorted(missing.items()))
        out.print(f"Operators revgraph cannot differentiate: {listed}", soft_wrap=True, markup=False)
    return 0


# -------------------------------------------------------------------------------------------------- run


def _summary(arrays: dict[str, np.ndarray]) -> Table:
    table = Table(show_edge=False)
    for col in ("output", "dtype", "shape", "min", "max", "mean"):
        table.add_column(col, justify="right" if col in ("min", "max", "mean") else "left")
    for name, a in _flatten_sequences(arrays).items():
        numeric = (a.dtype.kind in "iub" or is_float_dtype(a.dtype)) and a.size
        stats = ([f"{float(s):.6g}" for s in (a.min(), a.max(), a.astype(np.float64).mean())] if numeric
                 else ["", "", ""])
        table.add_row(name, str(a.dtype), str(list(a.shape)), *stats)
    return table


def _flatten_sequences(arrays: dict) -> dict[str, np.ndarray]:
    """Sequence outputs (lists of arrays) as one entry per element, named ``<name>[i]``."""
    flat: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        if isinstance(value, list):
            flat.update({f"{name}[{i}]": np.asarray(v) for i, v in enumerate(value)})
        else:
            flat[name] = np.asarray(value)
    return flat


def cmd_run(args: argparse.Namespace) -> int:
    from .combinations import given

    if args.inputs is not None and given(args, "--seed"):  # (issue 40: an option with no effect is refused)
        raise RevgraphError("--seed seeds the random inputs: it has no effect with --inputs; leave one out")
    g = load(args.model)
    check_command_outputs(args, {"-o": args.output}, {"--inputs": args.inputs})
    session = Session(g, backend=args.backend, device=args.device,  # a bad device fails before the note below
                      runtime=runtime_from_args(args))
    if args.inputs is not None:  # "" is a path too, and not "no --inputs"
        results = session.run(read_feeds(args.inputs, g))
    else:
        feeds = random_inputs(g, args.seed)
        try:
            results = session.run(feeds)
        except RevgraphError as exc:  # one line: the refusal says the inputs were made up
            raise InputError(f"{exc} (on random inputs, seed {args.seed}: give --inputs FILE.npz)") from None
        described = ", ".join(f"{k} {a.dtype}{list(a.shape)}" for k, a in feeds.items()) or "none needed"
        note(err, f"note: no --inputs given; used random inputs (seed {args.seed}): {described}")
    if args.output:
        write_npz(args.output, _flatten_sequences(results))
        out.print(f"wrote {len(results)} output(s) to {args.output}", markup=False)
    else:
        out.print(_summary(results))
    return 0


# ------------------------------------------------------------------------------------------------- grad


def cmd_grad(args: argparse.Namespace) -> int:
    check_memory_budget(args.memory_budget)
    g = load(args.model)
    check_command_outputs(args, {"-o": args.output}, models=("-o",))
    check_valid(g)  # a model ONNX's checker refuses is bad input, not a failure of the gradient graph's check
    check_opset(args.opset)
    gg = with_warnings(gradient, g, args.loss, args.wrt, seed=args.cotangent, unconnected=args.unconnected,
                       sparse=args.sparse, accumulate=args.accumulate, checkpoint=args.checkpoint,
                       lift_constants=args.lift_constants, straight_through=args.straight_through,
                       memory=args.memory_budget)
    written = write_graph(gg, args.output, args.opset, "gradient graph", g)
    added = [o for o in gg.output_names if o not in g.output_names]
    forward, backward = count_nodes(written, g)
    out.print(
        f"wrote {args.output}: {forward} forward + {backward} backward nodes; "
        f"{len(added)} gradient output(s): {some(added)}",
        soft_wrap=True,
        markup=False,
    )
    report_memory(args, gg)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    g = load(args.model)
    nodes = sum(1 for _ in g.walk())
    if nodes > limits.MAX_CHECK_NODES:
        raise RevgraphError(f"{args.model!r} has {nodes:,} nodes; check takes at most {limits.MAX_CHECK_NODES:,} "
                            "(about 80 CPU seconds at that size: onnxruntime's float64 sessions grow faster than the "
                            "graph); check a part of the model, or call revgraph.check_gradients, which has no bound")
    if args.lift_constants:
        g = lift_constants(g)[0]
    feeds = read_feeds(args.inputs, g) if args.inputs is not None else None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check_gradients(g, args.loss, args.wrt, inputs=feeds, seed=args.seed, rtol=args.rtol, atol=args.atol)
    for w in caught:
        err.print(f"warning: {w.message}", soft_wrap=True, markup=False)
    table = Table(title=f"gradient of {report.loss!r} against float64 central differences", title_justify="left",
                  show_edge=False)
    for col in ("value", "max abs error", "max rel error", "ok"):
        table.add_column(col, justify="left" if col == "value" else "right")
    unchecked = [r for r in report.rows if r.status in NOT_CHECKED]
    for row in report.rows:
        verdict = "yes" if row.ok else Text("NO", style="red")
        if row in unchecked:
            table.add_row(row.name, "-", "-", "not checked")
        else:
            table.add_row(row.name, f"{row.max_abs:.3g}", f"{row.max_rel:.3g}", verdict)
    out.print(table)
    for row in report.rows:
        if row.note and row.status != "agree":
            out.print(f"{row.name}: {row.note}", markup=False, soft_wrap=True)
    for text in report.notes:
        out.print(f"note: {text}", markup=False, soft_wrap=True)
    bad = [r.name for r in report.rows if not r.ok]
    if any(r.status == "not finite" for r in report.rows):
        out.print("NaN or infinite values: the forward pass is not finite at these inputs (an input outside an "
                  "operator's domain?); pass --inputs FILE.npz with inputs inside it", markup=False)
    tolerances = f"rtol {args.rtol}, atol {args.atol}"
    if bad:
        out.print(f"{len(bad)} of {len(report.rows)} values disagree ({tolerances})", markup=False)
        return 1
    if unchecked:
        checked = len(report.rows) - len(unchecked)
        if not checked:  # nothing verified is no success: exit 2, as for inputs outside the model's domain
            raise InputError(f"none of the {len(report.rows)} values could be checked numerically (see above); "
                             "pass --inputs FILE.npz with inputs where the loss is finite and changes under a step")
        out.print(f"{checked} of {len(report.rows)} values checked: all agree ({tolerances}); {len(unchecked)} not "
                  "checked numerically (see above)", markup=False)
        return 0
    out.print(f"all {len(report.rows)} gradients agree ({tolerances})", markup=False)
    return 0


# ------------------------------------------------------------------------------------------ train, demo


def cmd_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from ..tools import demo

    settings = demo.QUICK if args.quick else demo.Settings()
    changes = {k: v for k, v in (("epochs", args.epochs), ("hidden", args.hidden)) if v is not None}
    settings = dataclasses.replace(settings, seed=args.seed, **changes)  # (positive: cli_numbers)
    fits_in_memory(demo.memory_needed(settings), f"demo --hidden {settings.hidden}")
    # The demo builds its own models (no untrusted names) and styles its table with markup.
    results = demo.run(args.output, settings, force=args.force, console=Console(file=stdout, highlight=False,
                       width=out.width if sys.stdout.isatty() else 200), progress=not quiet())
    return 0 if all(results[k]["check_ok"] for k in ("rnn", "mlp")) else 1


# ------------------------------------------------------------------------------------------------- show


def cmd_show(args: argparse.Namespace) -> int:
    import warnings

    from ..tools import viz

    if not args.grad:
        given = [f for f, v in (("--loss", args.loss), ("--wrt", args.wrt), ("--checkpoint", args.checkpoint)) if v]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise RevgraphError(f"{', '.join(given)} {verb} only with --grad; add --grad to draw the backward graph")
    fmt = viz.check_output(args.output)  # before any work: a bad name or a missing dot is reported at once
    g = load(args.model)
    check_command_outputs(args, {"-o": args.output})
    path = Path(args.model)
    title = f"{path.parent.name}/{path.name}" if path.stem == "model" and path.parent.name else path.name
    if args.grad:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            g = gradient(g, args.loss, args.wrt, checkpoint=args.checkpoint or "store")
        for w in caught:
            err.print(f"warning: {w.message}", soft_wrap=True, markup=False)
        title += ": forward and backward"
    viz.write(viz.to_dot(g, title=title), args.output, fmt)
    c = viz.summary(g)
    n_back = c["backward"] + c["seed"] + c["accum"]
    nodes = f"{c['forward']} forward and {n_back} backward nodes ({c['accum']} accumulation)" if n_back else \
        f"{c['forward']} nodes"
    out.print(f"wrote {args.output}: {nodes}, {c['clusters']} subgraph cluster{'s' if c['clusters'] != 1 else ''}",
              soft_wrap=True, markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
