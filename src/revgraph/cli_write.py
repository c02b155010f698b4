"""What the commands that write a derived graph share (``grad`` in :mod:`revgraph.cli`; ``jvp``, ``hvp``,
``jacobian`` and ``hessian`` in :mod:`revgraph.cli_forward`): the ``--checkpoint`` names, ``--opset`` checks,
warnings as lines, the checked atomic write and the summary's counts."""

from __future__ import annotations


from .autodiff.policies import NAMED as _NAMED_POLICIES
from .atomic import atomic_path, output_target
from .cli_io import err
from .errors import RevgraphError
from .external_data import too_large
from .ir import Graph
from .lift import drop_unused_initializers
from .onnx_io import converter_error, save, to_onnx

POLICIES = "|".join([*_NAMED_POLICIES, "K"])  # the --checkpoint names (autodiff/policies.py)

MEMORY_HELP = ("budget for the residuals (forward values the backward reads): a fraction of what the default keeps "
               "(0.5), a byte count (300000000) or a size with a unit (300MB, 2GiB); 0 keeps only what cannot be "
               "recomputed. Forward nodes are recomputed in the backward at the least FLOPs (a minimum cut). "
               "Default: recompute only free shape ops (reshapes, transposes, casts)")


def report_memory(args, graph: Graph) -> None:
    """With ``--memory-budget``, print what the planner chose (saved MB before and after, recomputed FLOPs)."""
    plan = getattr(graph, "memory_plan", None)
    if getattr(args, "memory_budget", None) is not None and plan is not None:
        from .cli_io import out

        out.print(f"memory: {plan.summary()}", soft_wrap=True, markup=False)


def check_memory_budget(text: str | None) -> None:
    """``--memory-budget``: refused (one line, exit 2) before any work when it is not a budget."""
    if text is not None:
        from .autodiff.memory import parse_budget

        parse_budget(text)


def check_opset(opset: int | None) -> None:
    """``--opset N``: from 7 to the newest opset the installed onnx knows (checked before any work)."""
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if opset is not None and not 7 <= opset <= newest:
        raise RevgraphError(f"--opset {opset}: give an opset from 7 to {newest} (the newest this onnx knows)")


def with_warnings(build, *args, **kwargs):
    """``build(*args, **kwargs)``, each Python warning it raises printed as one literal ``warning:`` line."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = build(*args, **kwargs)
    for w in caught:
        err.print(f"warning: {w.message}", soft_wrap=True, markup=False)
    return result


def write_graph(gg: Graph, path: str, opset: int | None, what: str):
    """Write ``gg`` to ``path`` atomically, at ``opset`` (default: its own), after ONNX's full check; returns
    the written ``ModelProto``. Initializers no node reads are dropped (onnxruntime warns about each)."""
    import onnx

    drop_unused_initializers(gg)  # onnxruntime would warn about each one when it loads the graph
    model = to_onnx(gg)
    if opset is not None and opset != gg.opset:
        try:
            model = onnx.version_converter.convert_version(model, opset)
        except Exception as exc:
            raise RevgraphError(f"cannot write the {what} at opset {opset}: {converter_error(exc)}") from None
    if too_large(model):  # onnx's checker takes a model over 2 GiB only as a file
        save(model, path)
        return model
    # ONNX's check with strict shape inference parses its own C++ copy of the model and infers every value's
    # type. Given the serialized bytes, onnx 1.23 infers on a second copy (``check_model(bytes)`` copies the
    # parsed model before ``InferShapes``); given a file, it infers in place: half the check's memory, about
    # 4 KB per forward node of a long chain (docs/benchmarks.md, "Build memory"). So the bytes are written to
    # the temporary file first and the file is checked before it replaces OUT: the same full check, and a
    # model that fails it is never written. Only the serialized bytes stay alive meanwhile (the protobuf
    # objects are ten times their size), parsed back afterwards.
    data = model.SerializeToString()
    del model
    direct = output_target(path).kind in ("fifo", "device")
    if direct:  # written directly, nothing to check before it is seen: checked from the bytes first
        _full_check(data, gg, what)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        if not direct:
            f.flush()
            _full_check(tmp, gg, what)
    model = onnx.ModelProto.FromString(data)
    del data
    return model


def _full_check(model, gg: Graph, what: str) -> None:
    """``onnx.checker.check_model(model, full_check=True)`` of the written graph (bytes or a file's path); a
    failure at one of the model's own nodes is bad input (:func:`_refuse_inconsistent_model`), others re-raised."""
    import onnx

    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        _refuse_inconsistent_model(exc, gg, what)
        raise


def _refuse_inconsistent_model(exc: Exception, gg: Graph, what: str) -> None:
    """Raise :class:`RevgraphError` (exit 2) when ONNX's check of the written graph fails at one of the model's
    own nodes: its declared types disagree with what its nodes compute, which ONNX's check of the model alone
    can miss (a loop's carried shapes, which revgraph completes from the body's declarations, reach the nodes
    after the loop). A failure at a node revgraph wrote is left to the caller (a bug: exit 3)."""
    import re

    text = str(exc)
    m = re.search(r"node name: ([^)]*)\)", text)
    node = m.group(1) if m else None
    if node is None:
        return
    from .autodiff.memory import is_backward_node

    ours = [n for n in gg.nodes if n.name == node]
    if ours and not any(is_backward_node(n) or n.name.startswith("hoist/") for n in ours):
        detail = text.strip().splitlines()[0][:300]
        raise RevgraphError(f"the {what} cannot be written: the model's declared types disagree with what its node "
                            f"{node!r} computes ({detail}); correct the model's output and value_info types") from None



def count_nodes(model, forward: Graph) -> tuple[int, int]:
    """The nodes of the written top-level graph that ``forward`` had (by name: revgraph names every node on
    load, and the backward pass gives its nodes fresh names), and the others: the backward pass, and the forward
    nodes it rewrote (a ``Scan`` or ``LSTM`` becomes a ``Loop``). Forward nodes no output depends on are not
    written, so neither count is ever negative."""
    names = {n.name for n in forward.nodes}
    kept = sum(1 for n in model.graph.node if n.name in names)
    return kept, len(model.graph.node) - kept


def some(names: list[str], most: int = 6) -> str:
    """The first few names, and how many more there are."""
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")
