"""``Scan`` is differentiated as the ``Loop`` it is equivalent to (ONNX operator spec "Scan", opset 21).

:func:`lower_scans` rewrites each ``Scan`` node into a ``Loop`` whose body slices scan input m at
iteration i with ``Gather`` along ``scan_input_axes[m]`` (at T-1-i for a reverse direction) and whose scan
outputs are stacked on axis 0, then reversed (``Slice`` with step -1) and moved to ``scan_output_axes[k]``
(``Transpose``). The ``Loop`` VJP (:mod:`.loop`) then applies, with every residual policy.
"""

from __future__ import annotations

import numpy as np

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo, fresh_name
from ..registry import LOWERED
from .rewrite import replace_nodes

LOWERED["Scan"] = "rewritten into the equivalent Loop (every direction and axis), then the Loop VJP"

INT64_MIN = np.iinfo(np.int64).min


def lower_scans(graph: Graph, types: dict[str, ValueInfo], used: set[str]) -> bool:
    """Replace every ``Scan`` node of ``graph`` and of its subgraphs by its ``Loop`` form, in place.

    ``types`` gives the ranks of scan outputs (needed to move a stacked axis); raises :class:`GraphError`
    when a non-zero ``scan_output_axes`` meets an unknown rank. Returns True if anything changed."""
    return replace_nodes(graph, ("Scan",), lambda node, g: _lower(node, types, used))


def _lower(node: Node, types: dict[str, ValueInfo], used: set[str]) -> list[Node]:
    body: Graph = node.attrs["body"].copy()
    m = int(node.attrs["num_scan_inputs"])
    n_state = len(node.inputs) - m
    n_scan_out = len(node.outputs) - n_state
    in_dirs = list(node.attrs.get("scan_input_directions", [0] * m))
    out_dirs = list(node.attrs.get("scan_output_directions", [0] * n_scan_out))
    in_axes = list(node.attrs.get("scan_input_axes", [0] * m))
    out_axes = list(node.attrs.get("scan_output_axes", [0] * n_scan_out))
    base = node.name or "Scan"

    def nd(op, ins, n_out=1, **attrs):
        outs = [fresh_name(f"{base}/{op}", used) for _ in range(n_out)]
        pre.append(Node(op, ins, outs, attrs, outs[0]))
        return outs[0] if n_out == 1 else outs

    pre: list[Node] = []
    first = node.inputs[n_state]
    trips = nd("Gather", [nd("Shape", [first]), nd("Constant", [], value=np.array(in_axes[0], np.int64))], axis=0)

    i, cond = fresh_name(f"{base}/i", used), fresh_name(f"{base}/cond", used)
    slices: list[Node] = []
    for k in range(m):
        index = i
        if in_dirs[k]:
            one = fresh_name(f"{base}/one", used)
            last, index = fresh_name(f"{base}/last", used), fresh_name(f"{base}/reverse_index", used)
            slices += [Node("Constant", [], [one], {"value": np.array(1, np.int64)}, one),
                       Node("Sub", [trips, one], [last], name=last),
                       Node("Sub", [last, i], [index], name=index)]
        target = body.inputs[n_state + k].name
        slices.append(Node("Gather", [node.inputs[n_state + k], index], [target], {"axis": in_axes[k]},
                           fresh_name(f"{base}/slice", used)))
    cond_out = fresh_name(f"{base}/cond_out", used)
    slices.append(Node("Identity", [cond], [cond_out], name=cond_out))
    loop_body = Graph(
        [*slices, *body.nodes],
        [ValueInfo(i, np.int64, ()), ValueInfo(cond, np.bool_, ()), *body.inputs[:n_state]],
        [ValueInfo(cond_out, np.bool_, ()), *body.outputs],
        dict(body.initializers),
        dict(body.value_info),
        name=f"{body.name}_as_loop",
    )
    stacked = [fresh_name(f"{base}/stacked", used) for _ in range(n_scan_out)]
    true = nd("Constant", [], value=np.array(True))
    pre.append(Node("Loop", [trips, true, *node.inputs[:n_state]], [*node.outputs[:n_state], *stacked],
                    {"body": loop_body}, fresh_name(f"{base}/as_loop", used)))
    for k, (src, dst) in enumerate(zip(stacked, node.outputs[n_state:], strict=True)):
        cur = src
        if out_dirs[k]:
            cur = nd("Slice", [cur, *(nd("Constant", [], value=np.array([v], np.int64))
                                      for v in (-1, INT64_MIN, 0, -1))])
        axis = out_axes[k]
        if axis != 0:
            vi = types.get(body.outputs[n_state + k].name) or body.value_info.get(body.outputs[n_state + k].name)
            vi = vi if vi is not None and vi.shape is not None else body.outputs[n_state + k]
            if vi.shape is None:
                raise GraphError(f"{node.label()}: scan_output_axes needs the rank of scan output {dst!r}; "
                                 "declare its shape")
            rank = len(vi.shape) + 1
            axis = axis % rank
            perm = [*range(1, axis + 1), 0, *range(axis + 1, rank)]
            cur = nd("Transpose", [cur], perm=perm)
        pre.append(Node("Identity", [cur], [dst], name=fresh_name(f"{base}/output", used)))
    return pre
