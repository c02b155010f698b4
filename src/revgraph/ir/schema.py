"""Operator schemas from ``onnx.defs``: does a node's signature fit its operator at the graph's opset?"""

from __future__ import annotations

from functools import cache
from typing import Any, Protocol

import onnx

from ..errors import GraphError


class Node(Protocol):
    """What the checks read of a :class:`revgraph.ir.Node` (declared here: the IR imports this module, and this
    module importing the IR back would be a circle)."""

    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    subgraphs: Any

    def label(self) -> str: ...


def get_schema(op_type: str, domain: str, opsets: dict[str, int]) -> onnx.defs.OpSchema | None:
    """The schema of ``domain::op_type`` at the version ``opsets`` imports, or ``None`` if unknown."""
    version = opsets.get(domain, opsets.get("ai.onnx") if domain == "" else None)
    if version is None:
        return None
    try:
        return onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        return None


#: The operator domains ONNX itself defines (``onnx.defs``): an operator of another domain (``com.microsoft``,
#: a custom one) is checked against onnxruntime's schemas where it knows the operator, else not at all.
ONNX_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"})


@cache
def _runtime_schemas() -> dict[tuple[str, str], list]:
    """onnxruntime's operator schemas (its contrib operators: ``com.microsoft``, and those it adds to the
    default domain, such as ``SimplifiedLayerNormalization``) by ``(domain, op_type)``, oldest first; empty
    when the installed onnxruntime does not export them. Imported here, lazily: only a model with an operator
    that ONNX does not define pays for it."""
    try:
        from onnxruntime.capi import _pybind_state

        found = _pybind_state.get_all_operator_schema()
    except (ImportError, AttributeError, RuntimeError):  # (an onnxruntime build without the schema export)
        return {}
    table: dict[tuple[str, str], list] = {}
    for s in found:
        table.setdefault((s.domain or "", s.name), []).append(s)
    for versions in table.values():
        versions.sort(key=lambda s: s.since_version)
    return table


def runtime_schema(op_type: str, domain: str, opsets: dict[str, int]):
    """onnxruntime's schema of ``domain::op_type`` at the version ``opsets`` imports (its newest one no newer
    than that), or ``None`` if onnxruntime does not define it there."""
    version = opsets.get(domain, opsets.get("ai.onnx") if domain == "" else None)
    older = [s for s in _runtime_schemas().get((domain, op_type), []) if version is None or s.since_version <= version]
    return older[-1] if older else None


def check_node_signature(node: Node, opsets: dict[str, int], where: str = "graph") -> None:
    """Raise :class:`GraphError` if ``node``'s operator is unknown or its arity does not fit its schema.

    An operator of a domain that ONNX does not define (``com.microsoft``'s contrib operators, a custom domain:
    valid ONNX, which revgraph loads and refuses only where it must differentiate one, issue 41) is checked
    against onnxruntime's schema where onnxruntime defines it, else only for its domain being imported; so is
    an operator that onnxruntime adds to the default domain (``SimplifiedLayerNormalization``). Also checks the
    input and output counts of ``Loop``, ``Scan`` and ``If`` subgraphs against the node (ONNX operator spec:
    ``Loop`` body has 2+N inputs and 1+N+K outputs for N loop-carried values and K scan outputs; ``Scan`` body
    has N+M inputs and N+K outputs; ``If`` branches have no inputs and as many outputs as the node).
    """
    domain = node.domain or ""
    schema = get_schema(node.op_type, domain, opsets)
    if schema is None:
        if domain not in opsets:
            raise GraphError(
                f"{node.label()} in {where} uses operator domain {domain!r}, which the model does not import"
            )
        schema = runtime_schema(node.op_type, domain, opsets)
        if schema is None and domain not in ONNX_DOMAINS:
            return  # a custom operator: its signature is its own
    if schema is None:
        raise GraphError(
            f"{node.label()} in {where}: unknown operator {node.op_type!r} in domain {domain or 'ai.onnx'!r} "
            f"at opset {opsets[domain]}; revgraph handles the standard ONNX operators only"
        )
    n_in, n_out = len(node.inputs), len(node.outputs)
    if not schema.min_input <= n_in <= schema.max_input:
        raise GraphError(
            f"{node.label()} in {where} has {n_in} inputs; {node.op_type} takes "
            f"{_range(schema.min_input, schema.max_input)}"
        )
    if not schema.min_output <= n_out <= schema.max_output:
        raise GraphError(
            f"{node.label()} in {where} has {n_out} outputs; {node.op_type} gives "
            f"{_range(schema.min_output, schema.max_output)}"
        )
    _check_subgraphs(node, where)


def _range(lo: int, hi: int) -> str:
    if lo == hi:
        return str(lo)
    if hi >= 2**31 - 1:
        return f"at least {lo}"
    return f"{lo} to {hi}"


def _check_subgraphs(node: Node, where: str) -> None:
    if node.domain not in ("", "ai.onnx"):
        return
    subs = node.subgraphs
    n_in, n_out = len(node.inputs), len(node.outputs)
    if node.op_type == "Loop":
        body = _need(node, subs, "body", where)
        if len(body.inputs) != n_in:
            raise GraphError(
                f"body of {node.label()} in {where} has {len(body.inputs)} inputs; it needs {n_in} "
                f"(iteration number, condition and {n_in - 2} loop-carried values)"
            )
        if len(body.outputs) != n_out + 1 or n_out < n_in - 2:
            raise GraphError(
                f"body of {node.label()} in {where} has {len(body.outputs)} outputs; it needs "
                f"{n_out + 1} (condition, {n_in - 2} loop-carried values, {n_out - (n_in - 2)} scan outputs)"
            )
    elif node.op_type == "Scan":
        body = _need(node, subs, "body", where)
        if len(body.inputs) != n_in or len(body.outputs) != n_out:
            raise GraphError(
                f"body of {node.label()} in {where} has {len(body.inputs)} inputs and {len(body.outputs)} "
                f"outputs; it needs {n_in} and {n_out}, as the Scan node has"
            )
    elif node.op_type == "If":
        for attr in ("then_branch", "else_branch"):
            branch = _need(node, subs, attr, where)
            if branch.inputs or len(branch.outputs) != n_out:
                raise GraphError(
                    f"{attr} of {node.label()} in {where} has {len(branch.inputs)} inputs and "
                    f"{len(branch.outputs)} outputs; it needs 0 and {n_out}"
                )


def _need(node: Node, subs: dict, attr: str, where: str):
    if attr not in subs:
        raise GraphError(f"{node.label()} in {where} has no {attr!r} subgraph attribute")
    return subs[attr]
