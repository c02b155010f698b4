"""``revgraph jvp``, ``hvp``, ``jacobian`` and ``hessian``: forward mode and the transforms built on it
(:mod:`revgraph.autodiff.forward`, :mod:`revgraph.autodiff.transforms`) as commands.

They follow ``revgraph grad`` (:mod:`revgraph.cli`): the model is loaded and checked, the output path is refused
before any work when it is one of the inputs, ``--opset`` is checked, the result passes ONNX's full check and
is written atomically, Python warnings become ``warning:`` lines, and the one-line summary lists the inputs and
outputs the command added (a name already taken in the model gets ``_1``, ``_2``..., so the printed names are
the ones to feed and read). Bad input exits 2 with one line, an internal error 3 (:func:`revgraph.cli.main`).
"""

from __future__ import annotations

import argparse

from ..autodiff.forward import jvp
from ..autodiff.policies import parse_policy
from ..autodiff.transforms import hessian, hvp, jacobian, jacobian_mode
from ..errors import RevgraphError
from ..ir import TARGET_OPSET, Graph
from ..onnx_io import load
from ..onnx_io.part_check import check_valid
from . import numeric as N
from .combinations import given
from .common import check_command_outputs, out
from .layout import add_renamed
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

_OPSET_HELP = f"write OUT.onnx at this opset (default: the model's, or {TARGET_OPSET} for an older model)"
_CHECKPOINT_HELP = ("residual policy of the loops of the gradient (as for grad): stack the residuals (store), "
                    "recompute the body (recompute), or keep checkpoints every K iterations or at perfect squares "
                    "(sqrt: O(sqrt(T)) memory)")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the four commands on ``revgraph``'s subparsers."""
    j = sub.add_parser("jvp", help="write the JVP graph (forward mode): inputs <x>_tangent, outputs <y>_tangent = J t")
    _common(j)
    _outputs_inputs(j, "values whose tangents to compute", "values that get a tangent input",
                    "; an intermediate value's tangent replaces the one its producer gives it")
    j.add_argument("--checkpoint", default="store", type=N.CHECKPOINT, metavar=POLICIES,
                   help="refused: forward mode stores no residuals (a loop's JVP carries the tangents forward with "
                   "the loop), so only the gradient inside hvp, hessian and reverse-mode jacobian uses it")
    _opset(j)

    _second_order(sub, "hvp", "write the Hessian-vector product graph: inputs <x>_tangent, outputs <x>_grad and "
                  "<x>_hvp (forward-over-reverse)")

    jac = sub.add_parser("jacobian", help="write the Jacobian graph: outputs <y>_jacobian_<x> of shape "
                         "y.shape + x.shape, computed by one Loop in the graph")
    _common(jac)
    _outputs_inputs(jac, "values to differentiate", "values to differentiate with respect to")
    jac.add_argument("--mode", choices=("auto", "forward", "reverse"), default="auto",
                     help="forward: one JVP per input element; reverse: one VJP per output element; auto "
                     "(default): forward when the inputs have no more elements than the outputs (static shapes), "
                     "else reverse")
    jac.add_argument("--checkpoint", default="store", type=N.CHECKPOINT, metavar=POLICIES,
                     help=_CHECKPOINT_HELP + "; used in reverse mode only (forward mode stores no residuals)")
    jac.add_argument("--memory-budget", type=N.MEMORY_BUDGET, metavar="F|BYTES",
                     help=MEMORY_HELP + "; reverse mode only")
    _opset(jac)

    _second_order(sub, "hessian", "write the Hessian graph: outputs <x>_hessian and cross blocks <xi>_hessian_<xj> "
                  "(forward-over-reverse)")


def _second_order(sub: argparse._SubParsersAction, name: str, help: str) -> None:
    """``hvp`` and ``hessian``: a loss, wrt values and the gradient's checkpoint policy."""
    p = sub.add_parser(name, help=help)
    _common(p)
    _loss_wrt(p)
    p.add_argument("--checkpoint", default="store", type=N.CHECKPOINT, metavar=POLICIES, help=_CHECKPOINT_HELP)
    p.add_argument("--memory-budget", type=N.MEMORY_BUDGET, metavar="F|BYTES",
                   help=MEMORY_HELP + " (of the gradient inside)")
    _opset(p)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("-o", "--output", metavar="OUT.onnx", required=True)


def _outputs_inputs(p: argparse.ArgumentParser, outputs: str, inputs: str, note: str = "") -> None:
    p.add_argument("--outputs", metavar="NAME", nargs="+", help=f"{outputs} (default: every floating-point output)")
    # "--inputs" is an .npz file of input arrays in run and check: the values differentiated against are
    # --wrt, as in grad, hvp and hessian (the old spelling stays accepted)
    add_renamed(p, "--wrt", "--inputs", dest="inputs", metavar="NAME", nargs="+",
                help=f"{inputs} (default: every floating-point input and initializer{note})")


def _loss_wrt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loss", metavar="NAME", help="the value to differentiate twice (default: the only output; "
                   "a non-scalar loss is summed)")
    p.add_argument("--wrt", metavar="NAME", nargs="+", help="values to differentiate with respect to "
                   "(default: every floating-point input and initializer)")


def _opset(p: argparse.ArgumentParser) -> None:
    p.add_argument("--opset", type=N.opset(), metavar="N", help=_OPSET_HELP)


# ------------------------------------------------------------------------------------------------ commands


def _prepare(args: argparse.Namespace) -> Graph:
    """The model, after the checks ``grad`` makes before any work (output path, validity, opset, policy)."""
    g = load(args.model)
    check_command_outputs(args, {"-o": args.output}, models=("-o",))
    check_valid(g)  # a model ONNX's checker refuses is bad input, not a failure of the derived graph's check
    check_opset(args.opset)
    parse_policy(args.checkpoint)  # a bad policy is refused even where no gradient reads it
    check_memory_budget(getattr(args, "memory_budget", None))
    return g


def _finish(args: argparse.Namespace, g: Graph, result: Graph, what: str, nodes: str, inputs: str,
            outputs: str, note: str = "") -> int:
    """Write ``result`` and print what ``grad`` prints: node counts and the names added (with their suffixes)."""
    written = write_graph(result, args.output, args.opset, what, g)
    forward, derived = count_nodes(written, g)
    new_inputs = [i for i in result.input_names if i not in g.input_names]
    new_outputs = [o for o in result.output_names if o not in g.output_names]
    parts = [f"wrote {args.output}: {forward} forward + {derived} {nodes} nodes{note}"]
    if new_inputs:
        parts.append(f"{len(new_inputs)} {inputs} input(s): {some(new_inputs)}")
    parts.append(f"{len(new_outputs)} {outputs} output(s): {some(new_outputs)}")
    out.print("; ".join(parts), soft_wrap=True, markup=False)
    report_memory(args, result)
    return 0


def cmd_jvp(args: argparse.Namespace) -> int:
    if given(args, "--checkpoint"):  # (issue 40: an option with no effect is refused)
        raise RevgraphError("--checkpoint has no effect on jvp: forward mode stores no residuals (the loop policy "
                            "applies to the gradient inside hvp, hessian and reverse-mode jacobian); leave it out")
    g = _prepare(args)
    result = with_warnings(jvp, g, args.outputs, args.inputs)  # forward mode has no checkpoint policy
    return _finish(args, g, result, "JVP graph", "tangent", "tangent", "tangent")


def cmd_hvp(args: argparse.Namespace) -> int:
    g = _prepare(args)
    result = with_warnings(hvp, g, args.loss, args.wrt, checkpoint=args.checkpoint, memory=args.memory_budget)
    return _finish(args, g, result, "Hessian-vector product graph", "derivative", "tangent", "gradient and HVP")


def cmd_jacobian(args: argparse.Namespace) -> int:
    g = _prepare(args)
    mode = args.mode
    if mode == "auto":  # decided here, by rg.jacobian's rule, so that the summary can say which mode it took
        mode = jacobian_mode(g, args.outputs, args.inputs)
    unused = [o for o in ("--checkpoint", "--memory-budget") if given(args, o)]
    if mode == "forward" and unused:  # (issue 40: an option with no effect is refused)
        chosen = " (chosen by --mode auto)" if args.mode == "auto" else ""
        raise RevgraphError(f"{unused[0]} has no effect in forward mode{chosen}, which builds no gradient: give "
                            f"--mode reverse, or leave {unused[0]} out")
    result = with_warnings(jacobian, g, args.outputs, args.inputs, mode=mode, checkpoint=args.checkpoint,
                           memory=args.memory_budget)
    note = f" ({mode} mode{', chosen by --mode auto' if args.mode == 'auto' else ''})"
    return _finish(args, g, result, "Jacobian graph", "derivative", "", "Jacobian", note)


def cmd_hessian(args: argparse.Namespace) -> int:
    g = _prepare(args)
    result = with_warnings(hessian, g, args.loss, args.wrt, checkpoint=args.checkpoint, memory=args.memory_budget)
    return _finish(args, g, result, "Hessian graph", "derivative", "", "gradient and Hessian")


COMMANDS = {"jvp": cmd_jvp, "hvp": cmd_hvp, "jacobian": cmd_jacobian, "hessian": cmd_hessian}
