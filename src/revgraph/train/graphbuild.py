"""The small node builder of the training graphs (losses, optimizers, the step): fresh names under a prefix,
shared constants, and graph outputs named without extra copies.

:class:`Builder` speaks the protocol shared with the autodiff :class:`revgraph.autodiff.emitter.Emitter`
(``op(op_type, inputs, **attrs)``, ``const(value, dtype)``, ``scope(prefix)``), so the row helpers of
:mod:`revgraph.autodiff.sparse` write with either.
"""

from __future__ import annotations

import numpy as np

from ..autodiff.emitter import Emitter
from ..ir import Node, fresh_name


class Builder:
    """Appends nodes with fresh names under a prefix; shares identical constants."""

    def __init__(self, used: set[str]):
        self.used = used
        self.nodes: list[Node] = []
        self.prefix = "train"
        self._consts: dict[tuple, str] = {}

    def fresh(self, base: str) -> str:
        """A value or node name not used anywhere yet, starting with ``base``."""
        return fresh_name(base, self.used)

    scope = Emitter.scope  # ``with b.scope(prefix):`` names what is emitted inside ``<prefix>/<OpType>``

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        """Append one default-domain node ``op_type(inputs)`` with ``attrs``; returns its (fresh) output name."""
        out = self.fresh(f"{self.prefix}/{op_type}")
        self.nodes.append(Node(op_type, inputs, [out], attrs, out))
        return out

    def const(self, value, dtype) -> str:
        """The name of a ``Constant`` holding ``value`` as ``dtype``; equal constants are emitted once."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh("train/const")
            self.nodes.append(Node("Constant", [], [name], {"value": arr}, name))
            self._consts[key] = name
        return self._consts[key]


def name_outputs(b: Builder, start: int, values: list[tuple[str, str]]) -> list[str]:
    """Name each ``(value, base)`` a graph output called ``base`` (made fresh); returns the names.

    The node among ``b.nodes[start:]`` that computes the value writes the output name itself, and the nodes
    after it read that name: an ``Identity`` would be one more copy of the tensor each step. An ``Identity`` is
    kept only where it is needed: for a value no such node computes (a graph input or a value computed before
    ``start``) and for a value already named as another output (two outputs of one value).
    """
    nodes = b.nodes[start:]
    producer = {o: n for n in nodes for o in n.outputs if o}
    renamed: dict[str, str] = {}
    names = []
    for value, base in values:
        name = b.fresh(base)
        node = producer.get(value)
        if node is None or value in renamed:
            b.nodes.append(Node("Identity", [renamed.get(value, value)], [name], name=b.fresh(f"{b.prefix}/output")))
        else:
            node.outputs = [name if o == value else o for o in node.outputs]
            renamed[value] = name
        names.append(name)
    if renamed:
        for n in nodes:
            n.inputs = [renamed.get(i, i) for i in n.inputs]
    return names
