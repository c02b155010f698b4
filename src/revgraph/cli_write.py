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


def write_graph(gg: Graph, path: str, opset: int | None, what: str) -> list[str]:
    """Write ``gg`` to ``path`` atomically, at ``opset`` (default: its own), after ONNX's full check; returns
    the names of the written top-level nodes (for :func:`count_nodes`). Initializers no node reads are dropped
    (onnxruntime warns about each).

    At the graph's own opset the model is serialized in pieces straight into the temporary file
    (:mod:`revgraph.onnx_stream`): the whole ``ModelProto`` of a long gradient graph (about 1.3 KB per node)
    never exists. A conversion to another opset, a graph output without a dtype and a model over protobuf's
    2 GiB (its large tensors go to external data) take the whole model (:func:`_write_model`)."""
    drop_unused_initializers(gg)  # onnxruntime would warn about each one when it loads the graph
    if opset is None or opset == gg.opset:
        from .onnx_stream import pieces, prepared

        ready = prepared(gg)
        if ready is not None:
            try:
                _write_pieces(pieces(ready), path, gg, what)
                return [n.name for n in ready.nodes]
            except _TooLarge:
                pass
    return _write_model(gg, path, opset, what)


class _TooLarge(Exception):
    """The pieces passed protobuf's 2 GiB: the model is written with external data instead."""


def _write_pieces(parts, path: str, gg: Graph, what: str) -> None:
    """Write the serialized pieces ``parts`` to ``path`` through a temporary file checked by ONNX's full check
    before it replaces ``path``; a FIFO or device, written directly, gets bytes checked first. Raises
    :class:`_TooLarge` (nothing written) when the pieces pass protobuf's limit."""
    from .external_data import PROTOBUF_LIMIT

    if output_target(path).kind in ("fifo", "device"):  # nothing to check once it is seen: checked from bytes
        data = b"".join(parts)
        if len(data) > PROTOBUF_LIMIT:
            raise _TooLarge
        _full_check(data, gg, what)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
        return
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        size = 0
        for part in parts:
            size += len(part)
            if size > PROTOBUF_LIMIT:
                raise _TooLarge  # (atomic_path removes the temporary file)
            f.write(part)
        f.flush()
        _full_check(tmp, gg, what)


def _write_model(gg: Graph, path: str, opset: int | None, what: str) -> list[str]:
    """:func:`write_graph` through the whole ``ModelProto`` (converted to ``opset``, written with external data
    when over 2 GiB)."""
    import onnx

    model = to_onnx(gg)
    if opset is not None and opset != gg.opset:
        try:
            model = onnx.version_converter.convert_version(model, opset)
        except Exception as exc:
            raise RevgraphError(f"cannot write the {what} at opset {opset}: {converter_error(exc)}") from None
    names = [n.name for n in model.graph.node]
    if too_large(model):  # onnx's checker takes a model over 2 GiB only as a file
        save(model, path)
        return names
    # ONNX's check with strict shape inference parses its own C++ copy of the model and infers every value's
    # type. Given the serialized bytes, onnx 1.23 infers on a second copy (``check_model(bytes)`` copies the
    # parsed model before ``InferShapes``); given a file, it infers in place: half the check's memory, about
    # 4 KB per forward node of a long chain (docs/benchmarks.md, "Build memory"). So the bytes are written to
    # the temporary file first and the file is checked before it replaces OUT: the same full check, and a
    # model that fails it is never written.
    data = model.SerializeToString()
    del model
    _write_pieces([data], path, gg, what)
    return names


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



def count_nodes(written: list[str], forward: Graph) -> tuple[int, int]:
    """Of the ``written`` top-level nodes (names, from :func:`write_graph`), those that ``forward`` had (by name:
    revgraph names every node on load, and the backward pass gives its nodes fresh names), and the others: the backward pass, and the forward
    nodes it rewrote (a ``Scan`` or ``LSTM`` becomes a ``Loop``). Forward nodes no output depends on are not
    written, so neither count is ever negative."""
    names = {n.name for n in forward.nodes}
    kept = sum(1 for n in written if n in names)
    return kept, len(written) - kept


def some(names: list[str], most: int = 6) -> str:
    """The first few names, and how many more there are."""
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")
