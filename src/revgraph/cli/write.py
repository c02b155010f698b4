"""What the commands that write a derived graph share (``grad`` in :mod:`revgraph.cli`; ``jvp``, ``hvp``,
``jacobian`` and ``hessian`` in :mod:`revgraph.cli.forward`): the ``--checkpoint`` names, ``--opset`` checks,
warnings as lines, the checked atomic write and the summary's counts."""

from __future__ import annotations

import contextlib
import functools

from ..autodiff.lift import drop_unused_initializers
from ..autodiff.policies import NAMED as _NAMED_POLICIES
from ..errors import RevgraphError
from ..ir import Graph, ValueInfo
from ..onnx_io import converter_error, save, to_onnx
from ..onnx_io.atomic import atomic_path, output_target
from ..onnx_io.external_data import too_large
from .common import err

POLICIES = "|".join([*_NAMED_POLICIES, "K"])  # the --checkpoint names (autodiff/policies.py)

MEMORY_HELP = ("budget for the residuals (forward values the backward reads): a fraction of what the default keeps "
               "(0.5), a byte count (300000000) or a size with a unit (300MB, 2GiB); 0 keeps only what cannot be "
               "recomputed. Forward nodes are recomputed in the backward at the least FLOPs (a minimum cut). "
               "Default: recompute only free shape ops (reshapes, transposes, casts)")


def report_memory(args, graph: Graph) -> None:
    """With ``--memory-budget``, print what the planner chose (saved MB before and after, recomputed FLOPs)."""
    plan = getattr(graph, "memory_plan", None)
    if getattr(args, "memory_budget", None) is not None and plan is not None:
        from .common import out

        out.print(f"memory: {plan.summary()}", soft_wrap=True, markup=False)


def check_memory_budget(text: str | None) -> None:
    """``--memory-budget``: refused (one line, exit 2) before any work when it is not a budget."""
    if text is not None:
        from ..autodiff.memory import parse_budget

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


def write_graph(gg: Graph, path: str, opset: int | None, what: str, forward: Graph | None = None) -> list[str]:
    """Write ``gg`` to ``path`` atomically, at ``opset`` (default: its own), after ONNX's full check; returns
    the names of the written top-level nodes (for :func:`count_nodes`). Initializers no node reads are dropped
    (onnxruntime warns about each). ``forward``: the model ``gg`` was derived from, whose nodes a failure of the
    check is attributed to (:func:`refuse_inconsistent_model`: exit 2 naming the model's node; a failure in
    revgraph's own nodes is re-raised).

    At the graph's own opset the model is serialized in pieces straight into the temporary file
    (:mod:`revgraph.onnx_io.stream`) and checked piece by piece on the way (:mod:`revgraph.onnx_io.part_check`): neither
    the whole ``ModelProto`` of a long gradient graph (about 1.3 KB per node) nor ONNX's C++ copy of it (about
    4 KB per forward node) ever exists. A conversion to another opset, a graph output without a dtype and a
    model over protobuf's 2 GiB (its large tensors go to external data) take the whole model
    (:func:`_write_model`)."""
    drop_unused_initializers(gg)  # onnxruntime would warn about each one when it loads the graph
    attributed = functools.partial(_attributed, gg=gg, what=what, forward=forward)
    if opset is None or opset == gg.opset:
        from ..onnx_io.part_check import PartCheck
        from ..onnx_io.stream import pieces, prepared

        ready = prepared(gg)
        if ready is not None:
            with attributed():
                checker = PartCheck(ready)
            names, parts = [n.name for n in ready.nodes], pieces(ready, check=checker)
            del ready  # (the finished pieces generator drops the last reference to a rewritten copy)
            try:
                with attributed():
                    _write_pieces(parts, path, checker.finish)
                return names
            except _TooLarge:
                pass
    return _write_model(gg, path, opset, what, attributed)


class _TooLarge(Exception):
    """The pieces passed protobuf's 2 GiB: the model is written with external data instead."""


def _write_pieces(parts, path: str, check=None) -> None:
    """Write the serialized pieces ``parts`` to ``path`` through a temporary file that replaces ``path`` once
    all are written and ``check`` (if any: given the file's path, or the bytes for a FIFO or device, which are
    written directly) passes. Raises :class:`_TooLarge` (nothing written) when the pieces pass protobuf's
    limit."""
    from ..onnx_io.external_data import PROTOBUF_LIMIT

    if output_target(path).kind in ("fifo", "device"):  # nothing to check once it is seen: checked from bytes
        data = b"".join(parts)
        if len(data) > PROTOBUF_LIMIT:
            raise _TooLarge
        if check is not None:
            check(data)
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
        if check is not None:
            check(tmp)


def _write_model(gg: Graph, path: str, opset: int | None, what: str, attributed) -> list[str]:
    """:func:`write_graph` through the whole ``ModelProto`` (converted to ``opset``, written with external data
    when over 2 GiB)."""
    import onnx

    from ..onnx_io.runtime_ops import parked, runtime_defaults

    model = to_onnx(gg)
    if opset is not None and opset != gg.opset:
        try:
            model = onnx.version_converter.convert_version(model, opset)
        except Exception as exc:  # noqa: BLE001 - the converter's many failures, one line
            raise RevgraphError(f"cannot write the {what} at opset {opset}: {converter_error(exc)}") from None
    names = [n.name for n in model.graph.node]
    if too_large(model):  # onnx's checker takes a model over 2 GiB only as a file
        save(model, path)
        return names
    # Given the serialized bytes, onnx 1.23's check copies the parsed model before its strict shape inference;
    # given a file, it infers in place: so the file is checked before it replaces OUT (half the memory).
    data = model.SerializeToString()
    if runtime_defaults(model):  # onnxruntime's default-domain operators: the checker sees them parked, so the
        # model is checked in memory before it is written as it is (runtime_ops.parked)
        with attributed(), parked(model):
            onnx.checker.check_model(model, full_check=True)
        del model
        _write_pieces([data], path)
        return names
    del model
    with attributed():
        _write_pieces([data], path, functools.partial(onnx.checker.check_model, full_check=True))
    return names


@contextlib.contextmanager
def _attributed(gg: Graph, what: str, forward: Graph | None = None):
    """Around ONNX's full check of the written graph ``gg``: a failure caused by one of the model's own nodes is
    bad input (:func:`refuse_inconsistent_model`), others re-raised."""
    import onnx

    try:
        yield
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        refuse_inconsistent_model(exc, gg, what, forward)
        raise


#: Name prefixes of the nodes revgraph adds (backward, tangents, hoisted and recomputed values, adapters).
_OURS = ("grad/", "accum/", "seed/", "remat/", "hoist/", "jvp/", "hvp/", "lora/")


def refuse_inconsistent_model(exc: Exception, gg: Graph, what: str, forward: Graph | None = None) -> None:
    """Raise :class:`RevgraphError` (exit 2) when ONNX's check of the written graph ``gg`` failed because of a
    node of the model (``forward``, the graph as loaded; ``None``: the nodes of ``gg`` revgraph did not add):
    ONNX's message names the nodes from the outermost (a ``Loop`` or ``If`` holding the failing node) to the
    one it failed at. That innermost node is the model's own, at any depth (its declared types disagree with
    what it computes, which ONNX's check of the model alone can miss: a loop's carried shapes, which revgraph
    completes from the body's declarations, reach the nodes after the loop); or revgraph made it from a node of
    the model (``grad/<node>/...``) whose declared output types disagree with what ONNX infers from its
    declared inputs. Otherwise nothing is raised: a failure in revgraph's own nodes with consistent inputs is a
    bug, left to the caller (exit 3)."""
    import re

    pattern = r"\(op_type:([^,]+), node name: ([^)]*)\)"
    # one line per error, each naming its nodes from the outermost to the one it failed at
    failures = []
    for line in str(exc).strip().splitlines():
        named = re.findall(pattern, line)
        if named:
            what_failed = re.sub(r"^(\[\w+\] )+(Inference error\(s\): )?", "", re.split(pattern, line)[-1].lstrip(": "))
            failures.append((*named[-1], what_failed[:300]))
    if not failures:
        return
    source = forward if forward is not None else gg
    nodes = {n.name: n for _, n in source.walk() if n.name and not n.name.startswith(_OURS)}
    for op, name, detail in failures:
        if name in nodes:
            raise RevgraphError(f"the {what} cannot be written: the model's declared types disagree with what its "
                                f"node {name!r} ({op}) computes ({detail}); correct the model's output and value_info "
                                "types") from None
    op, name, detail = failures[0]
    origin = _origin(name, nodes)
    why = None if origin is None else _inconsistent(nodes[origin], source)
    if why is not None:
        raise RevgraphError(f"the {what} cannot be written: node {origin!r} ({nodes[origin].op_type}) of the model "
                            f"{why}; ONNX's check fails at {name!r} ({op}), which revgraph built from it ({detail}): "
                            "correct the model's output and value_info types") from None


def _origin(name: str, nodes: dict) -> str | None:
    """The model's node that revgraph's node ``name`` was built from: ``grad/<node name>/...`` (the longest
    such name, since names may hold slashes), or ``None``."""
    rest = name.split("/", 1)[1] if "/" in name else ""
    found = [n for n in nodes if rest == n or rest.startswith(n + "/")]
    return max(found, key=len) if found else None


def _inconsistent(node, graph: Graph) -> str | None:
    """What is wrong with ``node`` of ``graph`` (any depth) given the types the model declares: ONNX's inference
    of the node from its inputs' declared types fails, or gives an output a rank or a static dimension other
    than the declared one; ``None`` when it agrees or nothing can be told (an input without a declared type, a
    node with subgraphs, which per-node inference does not see into)."""
    import onnx
    from onnx import helper, numpy_helper

    from ..ir.schema import get_schema
    from ..onnx_io import attr_to_proto, value_info_from_proto, value_info_to_proto

    if node.subgraphs:
        return None
    declared, values = {}, {}
    for g in [graph, *(sub for _, n in graph.walk() for sub in n.subgraphs.values())]:
        declared.update((v.name, v) for v in [*g.value_info.values(), *g.inputs, *g.outputs]
                        if v.dtype is not None and v.kind == "tensor")
        for k, a in g.initializers.items():
            declared[k] = ValueInfo(k, a.dtype, a.shape)
            values[k] = a
    schema = get_schema(node.op_type, node.domain, {"": graph.opset})
    if schema is None or any(i and i not in declared for i in node.inputs):
        return None
    proto = helper.make_node(node.op_type, node.inputs, node.outputs)
    proto.attribute.extend(attr_to_proto(node, k, v, {"": graph.opset}) for k, v in node.attrs.items())
    in_types = {i: value_info_to_proto(declared[i]).type for i in node.inputs if i}
    data = {i: numpy_helper.from_array(values[i], i) for i in node.inputs if i in values and values[i].size <= 64}
    try:
        inferred = onnx.shape_inference.infer_node_outputs(schema, proto, in_types, data)
    except Exception as exc:  # noqa: BLE001 - onnx's inference fails in many ways: its first line says how
        return f"does not fit its inputs' declared types ({str(exc).strip().splitlines()[0][:200]})"
    for out, tp in inferred.items():
        want = declared.get(out)
        try:
            got = value_info_from_proto(helper.make_value_info(out, tp))
        except Exception:  # noqa: BLE001, S112 - a type revgraph does not model is no evidence either way
            continue
        if want is None or want.shape is None or got.shape is None:
            continue
        if len(want.shape) != len(got.shape) or any(isinstance(a, int) and isinstance(b, int) and a != b
                                                    for a, b in zip(want.shape, got.shape, strict=False)):
            return f"declares its output {out!r} as {want.describe()} but computes {got.describe()} from its inputs"
    return None


def count_nodes(written: list[str], forward: Graph) -> tuple[int, int]:
    """Of the ``written`` top-level nodes (names, from :func:`write_graph`), those that ``forward`` had (by name:
    revgraph names every node on load, and the backward pass gives its nodes fresh names), and the others: the backward
    pass, and the forward nodes it rewrote (a ``Scan`` or ``LSTM`` becomes a ``Loop``). Forward nodes no output depends
    on are not written, so neither count is ever negative."""
    names = {n.name for n in forward.nodes}
    kept = sum(1 for n in written if n in names)
    return kept, len(written) - kept


def some(names: list[str], most: int = 6) -> str:
    """The first few names, and how many more there are (all of them with ``--verbose``)."""
    from .common import verbose

    most = len(names) if verbose() else most
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")
