"""The revgraph IR: :class:`Graph`, :class:`Node` and :class:`ValueInfo`.

A graph is an ordered list of nodes over named values, as in the ONNX IR (onnx/docs/IR.md, "Graphs"), with
one difference: a name may be written more than once (in-place writes, as in nets converted from Caffe2).
:mod:`revgraph.ir.ssa` resolves such names into versions. Bodies of ``Loop``, ``Scan`` and ``If`` are
``Graph`` objects stored as node attributes; a body may read names of the enclosing graphs (captured,
loop-invariant values).

Graph walks here are iterative over nodes, so a chain of 100,000 nodes is fine; only the nesting of
subgraphs (a handful of levels in practice) is followed by recursion.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import onnx

from ..errors import GraphError, RevgraphError

#: The oldest default-domain opset revgraph works at. A model at an older opset is converted up to it on load
#: (``onnx.version_converter``); a model at this opset or a newer one keeps its own, and its gradient graph is
#: written at that opset too. Graphs built without ``opsets`` use it. Opset 21 has ``ScatterND`` with
#: ``reduction`` (since 16; "max"/"min" since 18), reductions with an ``axes`` input (18), ``Gelu`` (20) and
#: ``GroupNormalization`` (21), the forms the VJP rules emit; it runs in onnxruntime >= 1.17 and in
#: ``onnx.reference``, and is one above the opset that ``torch.onnx.export`` writes by default (20).
TARGET_OPSET = 21

#: The newest default-domain opset the installed onnx knows (its operator schemas and shape inference): the
#: newest a model may be at. Whether a runtime runs it is the runtime's question (:class:`revgraph.Session`).
NEWEST_OPSET = onnx.defs.onnx_opset_version()

Dim = int | str | None

#: The name prefix of forward nodes that the memory planner recomputes inside the backward graph
#: (``revgraph.autodiff.memory.plan``); runtimes that merge common subexpressions must leave them apart.
REMAT_PREFIX = "remat/"

#: Floating-point types numpy sees as kind "V" (ml_dtypes' bfloat16): floating point all the same.
_VOID_FLOATS = frozenset({"bfloat16"})


def is_float_dtype(dtype: np.dtype | None) -> bool:
    """True for a floating-point dtype, the values that carry gradients: numpy's kind ``"f"`` (float16,
    float32, float64) and ONNX's bfloat16, which numpy (through ml_dtypes) calls kind ``"V"``. The float8
    and float4 types are left out: ONNX's arithmetic operators do not take them."""
    if dtype is None:
        return False
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name in _VOID_FLOATS


def require_graph(graph: object, function: str) -> None:
    """Refuse (:class:`~revgraph.errors.RevgraphError`, one line) anything but a :class:`Graph` where the
    public function ``function`` needs one (a path or an ``onnx.ModelProto`` goes through ``revgraph.load``)."""
    if not isinstance(graph, Graph):
        raise RevgraphError(f"{function} takes a revgraph.Graph, got {type(graph).__name__}; turn a model file or "
                            "an onnx.ModelProto into one with revgraph.load")


#: The shapes :class:`ValueInfo` shares (interned, up to :data:`_MAX_SHAPES` distinct ones).
_SHAPES: dict[tuple, tuple] = {}
_MAX_SHAPES = 1 << 16


@dataclass(slots=True)  # (no per-instance __dict__: a graph holds a type per value, millions in a long chain)
class ValueInfo:
    """The declared type of a value.

    ``dtype`` is a numpy dtype (``None`` when unknown); ``shape`` is a tuple whose entries are ``int``
    (static), ``str`` (a symbolic dimension) or ``None`` (unknown), or ``None`` when the rank is unknown.
    ``kind`` is ``"tensor"`` or ``"sequence"`` (an ONNX sequence of tensors of ``dtype`` and ``shape``).
    """

    name: str
    dtype: np.dtype | None = None
    shape: tuple[Dim, ...] | None = None
    kind: str = "tensor"

    def __post_init__(self) -> None:
        if self.dtype is not None:
            self.dtype = np.dtype(self.dtype)
        if self.shape is not None:
            shape = tuple(self.shape)
            # one tuple per distinct shape: a long graph repeats a few shapes millions of times
            self.shape = _SHAPES.setdefault(shape, shape) if len(_SHAPES) < _MAX_SHAPES else shape

    @property
    def is_float(self) -> bool:
        """True for a floating-point tensor (the values that can carry gradients)."""
        return self.kind == "tensor" and is_float_dtype(self.dtype)

    @property
    def dtype_shape(self) -> tuple:
        """``(dtype, shape)``, to declare another value of the same type: ``ValueInfo(name, *vi.dtype_shape)``."""
        return self.dtype, self.shape

    def describe(self) -> str:
        """``float32[1,3,'N']``-style text for messages and tables."""
        dt = str(self.dtype) if self.dtype is not None else "?"
        shape = "[?]" if self.shape is None else "[" + ",".join("?" if d is None else str(d) for d in self.shape) + "]"
        text = dt + shape
        return f"seq({text})" if self.kind == "sequence" else text


@dataclass(eq=False, slots=True)  # (no per-instance __dict__: 120 bytes of every node of a gradient graph)
class Node:
    """One operator application.

    ``inputs`` and ``outputs`` are value names; ``""`` marks an omitted optional input or output, as in
    ONNX. ``attrs`` maps attribute names to Python values: ``int``, ``float``, ``str``, ``np.ndarray``
    (a tensor), :class:`Graph` (a subgraph), lists of these, or an ``onnx.AttributeProto`` kept as is for
    the rare kinds revgraph does not interpret (type protos, sparse tensors).
    """

    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""

    def __post_init__(self) -> None:
        self.inputs = list(self.inputs)
        self.outputs = list(self.outputs)

    @property
    def subgraphs(self) -> dict[str, Graph]:
        """Subgraph attributes (``body``, ``then_branch``, ``else_branch``, ...) by attribute name."""
        if not self.attrs:  # most nodes: every graph walk asks every node, so skip building the dict
            return {}
        return {k: v for k, v in self.attrs.items() if isinstance(v, Graph)}

    def copy(self) -> Node:
        """A copy whose subgraphs are copied too (so passes that extend a loop body never share it)."""
        return _copy_node(self)

    def label(self) -> str:
        """How messages refer to the node: ``node 'conv1' (Conv)``."""
        return f"node {self.name!r} ({self.op_type})" if self.name else f"unnamed {self.op_type} node"


@dataclass(eq=False)
class Graph:
    """A dataflow graph: inputs, outputs, initializers (numpy arrays by name) and an ordered node list.

    ``value_info`` holds known types of intermediate values (filled by ONNX shape inference on load).
    ``opsets`` maps operator domains to versions; it is meaningful on the top-level graph.
    """

    nodes: list[Node] = field(default_factory=list)
    inputs: list[ValueInfo] = field(default_factory=list)
    outputs: list[ValueInfo] = field(default_factory=list)
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    value_info: dict[str, ValueInfo] = field(default_factory=dict)
    name: str = "graph"
    opsets: dict[str, int] = field(default_factory=lambda: {"": TARGET_OPSET})
    doc_string: str = ""
    #: The default-domain opset of the file this graph was loaded from, before any conversion (``None`` if built).
    source_opset: int | None = None
    #: What the memory planner chose for this gradient graph (``revgraph.autodiff.memory.MemoryPlan``: saved
    #: bytes before and after, recomputed FLOPs), set by ``revgraph.gradient``; not kept by :meth:`copy`.
    memory_plan: Any = field(default=None, compare=False, repr=False)
    #: Key-value text of the model (ONNX ``ModelProto.metadata_props``), kept by :meth:`copy` and round-tripped by
    #: :func:`revgraph.load` / :func:`revgraph.save`; revgraph's own keys start with ``"revgraph."`` (the LoRA
    #: configuration: ``"revgraph.lora"``, :mod:`revgraph.train.lora`). Meaningful on the top-level graph.
    metadata: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        """One short line: ``Graph('torch_jit', opset 21, 654 nodes, 3 inputs, 1 output, 52 initializers)`` (the
        counts are of the top-level graph; the field-by-field form, arrays and all, is :meth:`describe`)."""
        def count(n: int, what: str) -> str:
            return f"{n} {what}{'' if n == 1 else 's'}"

        return (f"Graph({self.name!r}, opset {self.opset}, {count(len(self.nodes), 'node')}, "
                f"{count(len(self.inputs), 'input')}, {count(len(self.outputs), 'output')}, "
                f"{count(len(self.initializers), 'initializer')})")

    def describe(self) -> str:
        """The long form: every field as the dataclass writes it (nodes, types, initializer arrays; a
        ResNet-50's is about 170,000 characters), where ``repr`` is one line."""
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"{type(self).__name__}({shown})"

    @property
    def opset(self) -> int:
        """The default-domain opset version."""
        return self.opsets.get("", TARGET_OPSET)

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.outputs]

    def type_of(self, name: str) -> ValueInfo | None:
        """The declared type of ``name`` (an input, output, initializer or inferred value), if known."""
        for vi in itertools.chain(self.inputs, self.outputs):
            if vi.name == name:
                return vi
        if name in self.initializers:
            arr = self.initializers[name]
            return ValueInfo(name, arr.dtype, arr.shape)
        return self.value_info.get(name)

    def walk(self) -> Iterator[tuple[Graph, Node]]:
        """Every node of this graph and of all its subgraphs, as ``(owning graph, node)`` pairs."""
        stack: list[Graph] = [self]
        while stack:
            g = stack.pop()
            for node in g.nodes:
                yield g, node
                stack.extend(node.subgraphs.values())

    def all_names(self) -> set[str]:
        """Every value name used anywhere, subgraphs included (to make fresh names that cannot clash)."""
        names: set[str] = set()
        stack: list[Graph] = [self]
        while stack:
            g = stack.pop()
            names.update(g.input_names, g.output_names, g.initializers, g.value_info)
            for node in g.nodes:
                names.update(node.inputs)
                names.update(node.outputs)
                stack.extend(node.subgraphs.values())
        names.discard("")
        return names

    def names_in_use(self) -> set[str]:
        """Every value name and every node name used anywhere, subgraphs included: what a pass that adds nodes
        gives :func:`fresh_name`, so that neither a value nor a node it adds clashes with one already there (a
        gradient graph differentiated again holds the first level's ``remat/...`` nodes; onnxruntime refuses two
        nodes of one name)."""
        return self.all_names() | {n.name for _, n in self.walk() if n.name}

    def check(self) -> None:
        """Check that the graph is well formed; raise :class:`GraphError` naming the first problem.

        Checked: every name is written (as an input, initializer, node output, or in an enclosing graph)
        before it is read; every node's operator exists and its input and output counts fit the operator
        schema of ``self.opsets`` (``onnx.defs``); subgraph input and output counts fit their operator
        (``Loop``, ``Scan``, ``If`` sections of the ONNX operator spec); every graph output is produced.
        """
        from .schema import check_node_signature  # local: schema imports ir for Graph

        stack: list[tuple[Graph, frozenset[str], str]] = [(self, frozenset(), "graph")]
        fits: set[tuple] = set()  # (op_type, domain, inputs, outputs) of nodes without subgraphs that fit
        while stack:
            g, outer, where = stack.pop()
            defined = set(outer)
            defined.update(g.input_names)
            defined.update(g.initializers)
            for pos, node in enumerate(g.nodes):
                signature = (node.op_type, node.domain, len(node.inputs), len(node.outputs))
                if signature not in fits:  # (a schema lookup per node was a fifth of a load)
                    check_node_signature(node, self.opsets, where)
                    if not node.subgraphs:
                        fits.add(signature)
                for name in node.inputs:
                    if name and name not in defined:
                        later = next((n for n in g.nodes[pos:] if name in n.outputs), None)
                        if later is not None:
                            raise GraphError(
                                f"{node.label()} in {where} reads {name!r}, which {later.label()} writes only later: "
                                "the graph has a cycle or its nodes are not in topological order"
                            )
                        raise GraphError(
                            f"{node.label()} in {where} reads {name!r} before anything writes it; "
                            "add it as a graph input or initializer, or move its producer earlier"
                        )
                for attr, sub in node.subgraphs.items():
                    stack.append((sub, frozenset(defined), f"{attr} of {node.label()}"))
                defined.update(o for o in node.outputs if o)
            for out in g.output_names:
                if out not in defined:
                    raise GraphError(
                        f"output {out!r} of {where} is never produced; "
                        "remove it from the outputs or add the node that computes it"
                    )

    def copy(self) -> Graph:
        """A deep copy of the structure; initializer arrays are shared, not copied."""
        return _copy_graph(self)


def _copy_attr(v: Any) -> Any:
    if isinstance(v, Graph):
        return _copy_graph(v)
    if isinstance(v, list):
        return [_copy_attr(x) for x in v]
    return v


def _copy_node(n: Node) -> Node:  # (Node copies the input and output lists)
    return Node(n.op_type, n.inputs, n.outputs, {k: _copy_attr(v) for k, v in n.attrs.items()}, n.name, n.domain)


def _copy_graph(g: Graph) -> Graph:
    nodes = [_copy_node(n) for n in g.nodes]
    return Graph(
        nodes=nodes,
        inputs=[ValueInfo(v.name, v.dtype, v.shape, v.kind) for v in g.inputs],
        outputs=[ValueInfo(v.name, v.dtype, v.shape, v.kind) for v in g.outputs],
        initializers=dict(g.initializers),
        value_info=dict(g.value_info),
        name=g.name,
        opsets=dict(g.opsets),
        doc_string=g.doc_string,
        source_opset=g.source_opset,
        metadata=dict(g.metadata),
    )


class NameSet(set):
    """A set of used names that remembers, per base, the next suffix to try, so that :func:`fresh_name` stays
    O(1) when many names share one base (a rule emitting hundreds of nodes under one prefix)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.next_suffix: dict[str, int] = {}


def fresh_name(base: str, used: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first that is not in ``used`` (which then holds it)."""
    k = used.next_suffix.get(base, 0) if isinstance(used, NameSet) else 0
    name = base if k == 0 else f"{base}_{k}"
    while name in used:
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    if isinstance(used, NameSet):
        used.next_suffix[base] = k + 1
    return name


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause CPython's cyclic garbage collector for the ``with`` block (a graph build), then restore it.

    Building a gradient graph allocates hundreds of thousands of small objects that all stay alive (nodes,
    their name lists, types, protobuf messages), so the collector's generational thresholds trigger it again
    and again over a growing heap in which it finds nothing to free: a third of a 10,000-node chain's build
    time. The objects of a build form no reference cycles that need the collector (reference counting frees
    them); whatever garbage cycles arise are collected as usual once the collector runs again."""
    if not gc.isenabled():  # nested, or paused by the caller: leave it to them
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def onnx_dtype(dtype: np.dtype) -> int:
    """The ``onnx.TensorProto`` data type of a numpy dtype."""
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
