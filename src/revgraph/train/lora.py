"""LoRA adapters on any ONNX model: :func:`add_adapters`, :func:`merge_adapters`, :func:`extract`, :func:`apply`.

Low-rank adaptation (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; Hugging Face PEFT's
``LoraLayer``): a frozen weight ``W`` of a linear map ``y = x W`` gets a trainable low-rank update,
``y = x W + (alpha / r) (x A) B`` with ``A`` ``[in, r]`` and ``B`` ``[r, out]``. ``A`` starts Kaiming-uniform
(PEFT's ``nn.init.kaiming_uniform_(lora_A.weight, a=sqrt(5))``: uniform in ``+-1/sqrt(in)``), ``B`` at zero, so
the adapted model computes what the base model computes until ``B`` trains. PEFT stores ``lora_A.weight``
``[r, in]`` and ``lora_B.weight`` ``[out, r]``; ours are their transposes, the orientation of ONNX's ``MatMul``.

Targets. A ``MatMul`` whose second input, or a ``Gemm`` whose ``B`` input, is a *weight*:

- a 2-D floating-point initializer, also through a ``Transpose`` node (PyTorch's exporter writes ``nn.Linear``
  as ``MatMul(x, Transpose(weight))`` when it does not fold the transpose); ``Gemm``'s ``transB`` is honoured,
- the output of a ``DequantizeLinear`` of a 2-D int8/uint8/int4/uint4 initializer: a quantized frozen base
  (QLoRA, Dettmers et al. 2023); the adapters take the dtype of the dequantized weight (the scale's).

And every ``com.microsoft.MatMulNBits`` whose packed weight is an initializer (onnxruntime's 4-bit quantizer,
onnxruntime-genai's model builder): the packed weight is the frozen base, ``in``/``out`` its ``K``/``N``
(:mod:`.lora_nbits`, which also says how such an adapter merges: into a float weight).

One adapter per weight: every node reading the same weight (tied or shared weights) adds the same update, as one
PEFT-wrapped ``nn.Linear`` called twice does. ``Gemm(X, W, C, alpha=g, beta=c, transA=t)`` becomes
``Gemm(Gemm(X, A, transA=t), B, Gemm(X, W, C), alpha=g * alpha / r, beta=1)``: the update is scaled by ``g`` as
the weight is, so merging ``W + (alpha / r) A B`` gives the same outputs. Nodes inside ``Loop``/``Scan``/``If``
bodies are not adapted.

Configuration. :func:`add_adapters` records what it did as JSON under ``graph.metadata["revgraph.lora"]`` (ONNX
``metadata_props``, written by :func:`revgraph.save`): rank, alpha, scaling, seed, the patterns, and per adapter
the base weight, the adapter names and the rewritten nodes. :func:`merge_adapters`, :func:`extract` and
:func:`apply` read it; :func:`revgraph.train.trainable` trains only the adapters of a graph that has one.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .. import validate as V
from ..errors import RevgraphError
from ..ir import Graph, NameSet, Node, ValueInfo, fresh_name, is_float_dtype
from ..onnx_io.arguments import AS_GRAPH, ModelLike
from . import lora_nbits
from .lora_config import FORMAT as _FORMAT
from .lora_config import check_against, check_sites, check_structure

#: The ``Graph.metadata`` key of the LoRA configuration (JSON).
KEY = "revgraph.lora"
#: The integer element types of a quantized base weight (``DequantizeLinear``'s input).
QUANTIZED = ("int8", "uint8", "int4", "uint4")
#: The file formats of :func:`save_adapters` / :func:`load_adapters`, by suffix.
ADAPTER_FORMATS = (".npz", ".onnx")


@dataclass
class _Site:
    """A ``MatMul``/``Gemm`` node and its weight: ``weight`` the initializer (float, or the quantized integers),
    ``transposed`` when it is stored ``[out, in]``, ``stored_shape`` its shape as stored, ``dtype`` the float
    dtype the node reads it in (the dequantized one for integers)."""

    node: Node
    weight: str
    quantized: bool
    transposed: bool
    stored_shape: tuple
    dtype: np.dtype | None
    kn: tuple[int, int] | None = None  # a MatMulNBits' (K, N): its packed weight is 3-D (.lora_nbits)

    @property
    def dims(self) -> tuple[int, int] | None:
        """``(in, out)`` as the node applies the weight, ``None`` when it is not 2-D."""
        if self.kn is not None:
            return self.kn
        if len(self.stored_shape) != 2:
            return None
        rows, cols = self.stored_shape
        return (cols, rows) if self.transposed else (rows, cols)


@V.arguments(graph=AS_GRAPH)
def config(graph: ModelLike) -> dict | None:
    """The LoRA configuration of ``graph`` (module doc), or ``None`` when it has no adapters. Raises
    :class:`RevgraphError` (one line) for one that is not what revgraph writes or does not fit ``graph``
    (:mod:`.lora_config`: every field, every name it gives)."""
    text = graph.metadata.get(KEY)
    if text is None:
        return None
    where, fix = f"the model's metadata {KEY!r}", "remove it from the model's metadata_props"
    found = _parse_config(text, where, fix)
    check_against(graph, found, _failure(where, fix))
    check_sites(graph, found, {s.node.name: s for s in _sites(graph)}, _failure(where, fix))
    return found


def _failure(where: str, fix: str):
    def fail(what: str) -> RevgraphError:
        return RevgraphError(f"{where} is not a LoRA configuration revgraph wrote (format {_FORMAT}): {what}; {fix}")

    return fail


def _parse_config(text: str, where: str, fix: str) -> dict:
    """The configuration JSON ``text`` read from ``where`` (named in the error with what to do, ``fix``), checked
    field by field (:func:`.lora_config.check_structure`)."""
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        raise _failure(where, fix)("it is not JSON") from None
    return check_structure(found, _failure(where, fix))


def adapter_names(graph: Graph) -> list[str]:
    """The adapter initializers of ``graph`` (``A`` then ``B`` per adapter; ``[]`` without adapters)."""
    found = config(graph)
    return [] if found is None else [n for a in found["adapters"] for n in (a["A"], a["B"])]


def _sites(graph: Graph) -> list[_Site]:
    """Every ``MatMul``/``Gemm`` of the top-level graph whose weight input is an initializer, the transpose of one,
    or the ``DequantizeLinear`` of an integer one, and every ``MatMulNBits`` of an initializer (module doc),
    whatever its rank."""
    producer = {o: n for n in graph.nodes for o in n.outputs if o}
    sites = []
    for node in graph.nodes:
        if lora_nbits.is_nbits(node):
            found = lora_nbits.site(graph, node)
            if found is not None:
                weight, shape, kn, dtype = found
                sites.append(_Site(node, weight, True, True, shape, dtype, kn))
            continue
        if node.domain or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        transposed = node.op_type == "Gemm" and bool(node.attrs.get("transB", 0))
        name = node.inputs[1]
        source = producer.get(name)
        if source is not None and source.op_type == "Transpose" and not source.domain and \
                source.inputs[0] in graph.initializers:
            arr = np.asarray(graph.initializers[source.inputs[0]])
            if source.attrs.get("perm", [1, 0]) not in ([1, 0], (1, 0)) or arr.ndim != 2:
                continue
            name, transposed = source.inputs[0], not transposed
        if name in graph.initializers:
            arr = np.asarray(graph.initializers[name])
            if is_float_dtype(arr.dtype):
                sites.append(_Site(node, name, False, transposed, arr.shape, arr.dtype))
        elif source is not None and source.op_type == "DequantizeLinear" and not source.domain and \
                source.inputs[0] in graph.initializers:
            arr = np.asarray(graph.initializers[source.inputs[0]])
            if arr.dtype.name in QUANTIZED:
                scale = graph.type_of(source.inputs[1]) if len(source.inputs) > 1 else None
                dtype = np.dtype(source.attrs["output_dtype"]) if source.attrs.get("output_dtype") else \
                    (scale.dtype if scale is not None else None)
                sites.append(_Site(node, source.inputs[0], True, transposed, arr.shape, dtype))
    return sites


def _select(graph: Graph, sites: list[_Site], targets: Iterable[str] | None) -> list[_Site]:
    """The sites whose weight or node name matches a pattern of ``targets`` (all 2-D ones for ``None``); raises
    :class:`RevgraphError` naming a pattern that matches none, or a matched weight that is not 2-D."""
    if targets is None:
        chosen = [s for s in sites if s.dims is not None]
        if not chosen:
            raise RevgraphError("the model has no MatMul or Gemm whose weight is a 2-D float initializer (or a "
                                "DequantizeLinear of an int8/int4 one) and no com.microsoft.MatMulNBits: nothing "
                                "to put LoRA adapters on")
        return chosen
    patterns = [targets] if isinstance(targets, str) else list(targets)
    if not patterns:
        raise RevgraphError("targets is empty: give glob patterns over weight or node names, or None for every "
                            "eligible weight")
    chosen: dict[int, _Site] = {}
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise RevgraphError(f"LoRA target {pattern!r} is not a pattern: give glob patterns (strings) over "
                                "weight or node names")
        hits = [s for s in sites if pattern in (s.weight, s.node.name)
                or fnmatch.fnmatchcase(s.weight, pattern) or fnmatch.fnmatchcase(s.node.name, pattern)]
        if not hits:
            others = [k for k in graph.initializers if fnmatch.fnmatchcase(k, pattern) or k == pattern]
            what = (f"matches initializer(s) {', '.join(map(repr, others[:3]))}, none of them the weight of a "
                    "MatMul or Gemm or MatMulNBits" if others else "matches no initializer and no MatMul/Gemm/"
                    "MatMulNBits node")
            raise RevgraphError(f"LoRA target pattern {pattern!r} {what}; LoRA adapts MatMul/Gemm weights "
                                "(2-D float initializers or DequantizeLinear of int8/int4 ones) and MatMulNBits")
        flat = next((s for s in hits if s.dims is None), None)
        if flat is not None:
            raise RevgraphError(f"LoRA target {flat.weight!r} (matched by {pattern!r}, read by {flat.node.label()}) "
                                f"has shape {list(flat.stored_shape)}; LoRA adapts 2-D weights only: narrow the "
                                "pattern")
        chosen.update((id(s.node), s) for s in hits)
    return [s for s in sites if id(s.node) in chosen]


def check_rank(rank: object, alpha: object) -> tuple[int, float]:
    """``rank`` (an int >= 1) and ``alpha`` (a finite number; ``None``: the rank, a scaling of 1), checked;
    raises :class:`RevgraphError` naming the bad one."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank <= 0:
        raise RevgraphError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if alpha is None:
        alpha = float(rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)) or \
            not math.isfinite(float(alpha)) or float(alpha) == 0:
        raise RevgraphError(f"LoRA alpha must be a finite non-zero number, got {alpha!r}")
    return int(rank), float(alpha)


@V.arguments(graph=AS_GRAPH, targets=V.OPTIONAL_NAMES, seed=V.SEED)  # (rank, alpha: check_rank)
def add_adapters(graph: ModelLike, rank: int, alpha: float | None = None, targets: Iterable[str] | str | None = None,
                 seed: int = 0) -> Graph:
    """``graph`` with LoRA adapters on the weights of its ``MatMul``/``Gemm`` nodes (module doc); ``graph`` is
    not changed (its initializer arrays are shared).

    ``rank`` is ``r``; ``alpha`` the numerator of the scaling ``alpha / r`` (default ``None``: ``alpha = r``, a
    scaling of 1; PEFT's own default is ``lora_alpha=8``, the same at its default ``r=8``). ``targets``: glob
    patterns (``fnmatch``, case-sensitive) over weight initializer names or node names, e.g.
    ``["*q_proj*", "*v_proj*"]``; ``None`` adapts every eligible weight. ``seed`` seeds ``A``
    (``numpy.random.default_rng``, one generator over the adapters in node order). Each adapter adds the
    initializers ``<weight>.lora_A`` ``[in, r]`` and ``<weight>.lora_B`` ``[r, out]`` (zeros) of the weight's
    float dtype and writes the configuration to ``metadata["revgraph.lora"]``.

    Raises :class:`RevgraphError` (one line) for a rank that is not an int >= 1 or exceeds ``min(in, out)`` of a
    target, a non-finite or zero alpha, a pattern matching no weight or node (naming it), a target whose weight
    is not 2-D, weights shared by nodes that read them in different orientations, and a graph that already has
    adapters (merge them first).
    """
    from ..ir import require_graph

    require_graph(graph, "lora.add_adapters")
    rank, alpha = check_rank(rank, alpha)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise RevgraphError(f"seed must be an integer >= 0, got {seed!r}")
    if config(graph) is not None:
        raise RevgraphError("the model already has LoRA adapters (metadata 'revgraph.lora'): train them as they are, "
                            "or merge them into the weights first (revgraph lora apply --merge, lora.merge_adapters)")
    g = graph.copy()
    sites = _sites(g)
    chosen = _select(g, sites, targets)
    weights = {s.weight for s in chosen}  # one adapter per weight: every MatMul/Gemm reading it gets it
    chosen = [s for s in sites if s.weight in weights]
    by_weight: dict[str, list[_Site]] = {}
    for s in chosen:
        by_weight.setdefault(s.weight, []).append(s)
    for weight, group in by_weight.items():
        if len({s.dims for s in group}) > 1:
            raise RevgraphError(f"weight {weight!r} is read as {group[0].dims} by {group[0].node.label()} and as "
                                f"{group[1].dims} by {group[1].node.label()}; LoRA gives a weight one adapter: "
                                "narrow the targets to one of them")
        n_in, n_out = group[0].dims
        if rank > min(n_in, n_out):
            raise RevgraphError(f"LoRA rank {rank} exceeds min(in, out) = {min(n_in, n_out)} of weight {weight!r} "
                                f"({n_in} x {n_out}); choose a rank <= {min(n_in, n_out)} or narrow the targets")
        if group[0].dtype is None or not is_float_dtype(group[0].dtype):
            raise RevgraphError(f"the dequantized type of weight {weight!r} is unknown ({group[0].node.label()}); "
                                "declare the DequantizeLinear scale's type")
    used = NameSet(g.names_in_use())
    rng = np.random.default_rng(seed)
    scaling = alpha / rank
    adapters = []
    inserted: dict[int, list[Node]] = {}
    for weight, group in by_weight.items():
        n_in, n_out = group[0].dims
        dtype = np.dtype(group[0].dtype)
        a_name, b_name = fresh_name(f"{weight}.lora_A", used), fresh_name(f"{weight}.lora_B", used)
        bound = 1.0 / math.sqrt(n_in)  # kaiming_uniform_(a=sqrt(5)) on PEFT's [r, in] lora_A: fan_in = in
        g.initializers[a_name] = rng.uniform(-bound, bound, (rank, n_in)).T.astype(dtype)
        g.initializers[b_name] = np.zeros((rank, n_out), dtype)
        sites = []
        for s in group:
            nodes = _rewrite(s, a_name, b_name, scaling, dtype, used)
            inserted[id(s.node)] = nodes
            sites.append({"node": s.node.name, "output": nodes[-1].outputs[0], "base": s.node.outputs[0],
                          "added": [n.name for n in nodes]})
        adapters.append({"weight": weight, "A": a_name, "B": b_name, "in": n_in, "out": n_out,
                         "quantized": group[0].quantized, "transposed": group[0].transposed, "sites": sites})
    nodes = []
    for node in g.nodes:  # each site's nodes right after it (the graph stays in topological order)
        nodes.append(node)
        nodes.extend(inserted.get(id(node), []))
    g.nodes = nodes
    g.metadata[KEY] = json.dumps({"format": _FORMAT, "rank": rank, "alpha": alpha, "scaling": scaling, "seed": seed,
                                  "targets": None if targets is None else
                                  ([targets] if isinstance(targets, str) else list(targets)),
                                  "adapters": adapters})
    return g


def _rewrite(s: _Site, a: str, b: str, scaling: float, dtype: np.dtype, used: set[str]) -> list[Node]:
    """The nodes adding ``scaling (x A) B`` to the output of ``s.node``, which now writes ``<output>.base``; the
    last one writes the node's old output name."""
    node = s.node
    out = node.outputs[0]
    base = fresh_name(f"{out}.base", used)
    node.outputs[0] = base
    prefix = f"lora/{s.weight}/{node.name}"

    def name(what: str) -> str:
        return fresh_name(f"{prefix}/{what}", used)

    if node.op_type == "Gemm":
        xa = name("xA")
        first = Node("Gemm", [node.inputs[0], a], [xa], {"transA": int(node.attrs.get("transA", 0))}, xa)
        scale = float(node.attrs.get("alpha", 1.0)) * scaling  # the update scaled as Gemm scales the weight
        last = Node("Gemm", [xa, b, base], [out], {"alpha": scale, "beta": 1.0}, name("add"))
        return [first, last]
    xa, xab, const, delta = name("xA"), name("xAB"), name("scaling"), name("delta")
    return [Node("MatMul", [node.inputs[0], a], [xa], {}, xa),
            Node("MatMul", [xa, b], [xab], {}, xab),
            Node("Constant", [], [const], {"value": np.array(scaling, dtype)}, const),
            Node("Mul", [xab, const], [delta], {}, delta),
            Node("Add", [base, delta], [out], {}, name("add"))]


@V.arguments(graph=AS_GRAPH)
def merge_adapters(graph: ModelLike) -> Graph:
    """``graph`` with its adapters folded into the weights: ``W + (alpha / r) A B`` (in ``W``'s stored
    orientation), the adapter nodes, initializers and configuration removed; ``graph`` is not changed. A weight
    that other nodes read too (a ``Gather`` of a tied embedding) keeps its value for them: the adapted nodes
    read a merged copy ``<weight>.merged`` ``[in, out]`` instead.

    A quantized base (``DequantizeLinear`` of integers) cannot take the sum in its integers without rounding it
    away, so its adapted nodes read a new float initializer ``<weight>.merged`` ``[in, out]`` = the dequantized
    weight (computed by onnxruntime's own ``DequantizeLinear``) plus the update; the integer weight stays for the
    nodes that still read it (dropped when no node does). The same copy is made for a weight the adapted nodes
    read in both orientations (directly and through a ``Transpose``). An adapted ``com.microsoft.MatMulNBits``
    becomes a ``MatMul`` of a float ``<weight>.merged`` ``[K, N]`` (:mod:`.lora_nbits`: packed 4-bit blocks cannot
    take the update), so the merged model is a float one where it was adapted. Raises :class:`RevgraphError` for a graph
    without adapters."""
    found = config(graph)
    if found is None:
        raise RevgraphError("the model has no LoRA adapters (no metadata 'revgraph.lora') to merge")
    g = graph.copy()
    scaling = float(found["scaling"])
    used = NameSet(g.names_in_use())
    for adapter in found["adapters"]:
        a, b = (np.asarray(g.initializers[adapter[k]]) for k in ("A", "B"))
        delta = (scaling * (a.astype(np.float64) @ b.astype(np.float64)))
        added = {n for site in adapter["sites"] for n in site["added"]}
        rename = {site["base"]: site["output"] for site in adapter["sites"]}
        g.nodes = [n for n in g.nodes if n.name not in added]
        sites = []
        for n in g.nodes:
            if n.outputs and n.outputs[0] in rename:
                n.outputs[0] = rename[n.outputs[0]]
                sites.append(n)
        weight = adapter["weight"]
        if any(lora_nbits.is_nbits(n) for n in sites):  # packed int4 cannot hold the sum: a float weight instead
            lora_nbits.merge(g, sites, weight, delta, used)
            del g.initializers[adapter["A"]], g.initializers[adapter["B"]]
            continue
        producer = {o: n for n in g.nodes for o in n.outputs if o}
        # each site's orientation: is the weight stored [out, in] for it (Gemm's transB, a Transpose before it)?
        flipped = {}
        for n in sites:
            via = producer.get(n.inputs[1])
            flipped[id(n)] = bool(n.op_type == "Gemm" and n.attrs.get("transB", 0)) != bool(
                via is not None and via.op_type == "Transpose")
        if adapter["quantized"]:
            w = _dequantize(g, sites[0].inputs[1])
        else:
            w = np.asarray(g.initializers[weight])
        if not adapter["quantized"] and len(set(flipped.values())) == 1 and not _other_readers(g, weight, sites):
            g.initializers[weight] = (w + (delta.T if adapter["transposed"] else delta)).astype(w.dtype)
        else:  # integers, other readers (a tied embedding) or both orientations: the sites read merged copies
            copies: dict[bool, str] = {}
            for n in sites:
                t = flipped[id(n)]
                if t not in copies:
                    copies[t] = fresh_name(f"{weight}.merged", used)
                    g.initializers[copies[t]] = ((w.T if t else w) + delta).astype(w.dtype)  # [in, out]
                n.inputs[1] = copies[t]  # read as [in, out], past any Transpose
                if n.op_type == "Gemm":
                    n.attrs["transB"] = 0
        del g.initializers[adapter["A"]], g.initializers[adapter["B"]]
    _drop_dead_weight_nodes(g)
    del g.metadata[KEY]
    return g


def _other_readers(g: Graph, weight: str, sites: list[Node]) -> bool:
    """Does anything but ``sites`` (directly, or through a ``Transpose`` only they read) read ``weight``?"""
    mine = {id(n) for n in sites}
    via = {n.inputs[1] for n in sites}
    for _, n in g.walk():
        if id(n) in mine:
            continue
        if weight in n.inputs and not (n.op_type == "Transpose" and n.outputs[0] in via):
            return True
        if via & set(n.inputs) - {weight}:
            return True
    return weight in g.output_names or bool(via & set(g.output_names))


def _dequantize(g: Graph, value: str) -> np.ndarray:
    """The value of ``value``, the output of a ``DequantizeLinear`` of initializers, as onnxruntime computes it."""
    from ..runtime import Session

    node = next(n for n in g.nodes if value in n.outputs)
    inputs = [i for i in node.inputs if i]
    missing = [i for i in inputs if i not in g.initializers]
    if missing:
        raise RevgraphError(f"cannot merge into the quantized weight of {node.label()}: its input {missing[0]!r} is "
                            "not an initializer; keep the adapters separate")
    small = Graph(nodes=[node.copy()], outputs=[ValueInfo(value, None, None)],
                  initializers={i: g.initializers[i] for i in inputs}, opsets=dict(g.opsets))
    return np.asarray(Session(small).run({}, [value])[value])


def _drop_dead_weight_nodes(g: Graph) -> None:
    """Remove the ``DequantizeLinear`` and ``Transpose`` nodes whose output nothing reads any more (the merged
    sites read a copy instead), then the initializers nothing reads."""
    read = {i for _, n in g.walk() for i in n.inputs} | set(g.output_names)
    g.nodes = [n for n in g.nodes if not (n.op_type in ("DequantizeLinear", "Transpose") and n.outputs[0] not in read)]
    read = {i for _, n in g.walk() for i in n.inputs} | set(g.output_names)
    for k in [k for k in g.initializers if k not in read]:
        del g.initializers[k]


# ------------------------------------------------------------------------------------------ extract and apply


@V.arguments(graph=AS_GRAPH)
def extract(graph: ModelLike) -> tuple[dict[str, np.ndarray], dict]:
    """The adapters of ``graph`` alone: ``({adapter name: array}, configuration)``. Raises
    :class:`RevgraphError` for a graph without adapters."""
    found = config(graph)
    if found is None:
        raise RevgraphError("the model has no LoRA adapters (no metadata 'revgraph.lora'): train it with --lora "
                            "(lora.add_adapters) first")
    missing = [(a, k) for a in found["adapters"] for k in ("A", "B") if a[k] not in graph.initializers]
    if missing:
        a, k = missing[0]
        raise RevgraphError(f"the model has no initializer {a[k]!r}, the {k} adapter of weight {a['weight']!r} "
                            f"that its metadata {KEY!r} names; export the trained model again (Trainer.export)")
    return {n: np.asarray(graph.initializers[n]) for n in adapter_names(graph)}, found


@V.arguments(base=AS_GRAPH, merge=V.FLAG, source=V.OPTIONAL_PATH)  # (arrays, configuration: checked below, named)
def apply(base: ModelLike, arrays: dict[str, np.ndarray], configuration: dict, merge: bool = False, *,
          source: str | os.PathLike | None = None) -> Graph:
    """``base`` with the adapters ``arrays`` of ``configuration`` (what :func:`extract` returns) on the same
    weights, merged into them with ``merge``. ``source``: the file the adapters came from (what
    :func:`load_adapters` read), named in the errors. Raises :class:`RevgraphError` (one line) when ``base``
    lacks a weight the adapters were trained on, or an adapter is missing, is not a finite floating-point
    array, or has a shape that does not fit its weight."""
    check_structure(configuration, _failure("lora.apply: the configuration",
                                            "pass what lora.extract or lora.load_adapters returns"))
    if not isinstance(arrays, Mapping):
        raise RevgraphError("lora.apply: the adapters must be a mapping of arrays by name, "
                            f"got {type(arrays).__name__}")
    weights = [a["weight"] for a in configuration["adapters"]]
    sites = {s.weight for s in _sites(base)}
    missing = [w for w in weights if w not in sites]
    if missing:
        raise RevgraphError(f"the base model has no MatMul/Gemm weight {missing[0]!r}, which the adapters were "
                            "trained on: apply them to the model they were trained from")
    g = _add_exact(base, configuration, weights)
    new = {a["weight"]: a for a in config(g)["adapters"]}
    kind = "initializer" if str(source).lower().endswith(".onnx") else "member"
    for a in configuration["adapters"]:
        for key in ("A", "B"):
            adapter = (f"adapter {a[key]!r}" if source is None else f"{os.fspath(source)!r}: {kind} {a[key]!r}") + \
                f" (the {key} adapter of weight {a['weight']!r})"
            if a[key] not in arrays:
                held = ", ".join(map(repr, arrays)) or "none"
                raise RevgraphError(f"{adapter} is missing; the adapters hold {held}: "
                                    "write them with revgraph lora extract (lora.save_adapters)")
            value, name = _check_adapter(arrays[a[key]], adapter), new[a["weight"]][key]
            want = g.initializers[name]
            if value.shape != want.shape:
                raise RevgraphError(f"{adapter} has shape {list(value.shape)}; weight {a['weight']!r} of the base "
                                    f"model needs {list(want.shape)}: apply it to the model it was trained from")
            g.initializers[name] = value.astype(want.dtype)
    return merge_adapters(g) if merge else g


def _check_adapter(value: object, adapter: str) -> np.ndarray:
    """``value`` as an array when it is a finite 2-D floating-point array (what an adapter is); raises
    :class:`RevgraphError` naming ``adapter`` and what is wrong (not an array, its dtype, rank, non-finite)."""
    if not isinstance(value, np.ndarray):
        raise RevgraphError(f"{adapter} is a {type(value).__name__}, not an array; an adapter is a 2-D "
                            "floating-point array")
    if not is_float_dtype(value.dtype):
        raise RevgraphError(f"{adapter} has dtype {value.dtype}; an adapter is a 2-D floating-point array (float32, "
                            "float16, bfloat16 or float64)")
    if value.ndim != 2:
        raise RevgraphError(f"{adapter} has shape {list(value.shape)}; an adapter is a 2-D array ([in, rank] for A, "
                            "[rank, out] for B)")
    if not np.isfinite(value.astype(np.float32) if value.dtype.itemsize < 4 else value).all():
        raise RevgraphError(f"{adapter} holds NaN or infinite values; an adapter holds finite numbers")
    return value


def _add_exact(base: Graph, configuration: dict, weights: list[str]) -> Graph:
    """:func:`add_adapters` on exactly the weights ``weights`` (no glob: names may hold ``[`` or ``*``)."""
    rank, alpha = check_rank(configuration.get("rank"), configuration.get("alpha"))
    escaped = ["".join(f"[{c}]" if c in "*?[" else c for c in w) for w in weights]
    return add_adapters(base, rank, alpha, escaped, configuration.get("seed", 0))


@V.arguments(path=V.PATH, graph=AS_GRAPH)
def save_adapters(path: str | os.PathLike, graph: ModelLike) -> tuple[int, int]:
    """Write the adapters of ``graph`` and their configuration to ``path`` atomically: ``.npz`` (the arrays by
    name, the configuration as the string member ``revgraph.lora``; :mod:`revgraph.onnx_io.npz`) or ``.onnx`` (a model
    without nodes whose outputs are the adapter initializers, the configuration in its metadata). Returns
    ``(tensors, elements)``."""
    from ..onnx_io import save
    from ..onnx_io.npz import write_outputs

    arrays, found = extract(graph)
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix not in ADAPTER_FORMATS:
        raise RevgraphError(f"cannot write adapters to {str(path)!r}: give a file name ending in "
                            f"{' or '.join(ADAPTER_FORMATS)}")
    if suffix == ".npz":
        write_outputs(path, {**arrays, KEY: np.array(json.dumps(found))})
    else:
        small = Graph(outputs=[ValueInfo(k, a.dtype, a.shape) for k, a in arrays.items()], initializers=arrays,
                      name="lora_adapters", opsets=dict(graph.opsets), metadata={KEY: json.dumps(found)})
        save(small, path)
    return len(arrays), sum(a.size for a in arrays.values())


@V.arguments(path=V.PATH)
def load_adapters(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """The adapters and configuration that :func:`save_adapters` wrote to ``path`` (``.npz`` or ``.onnx``), or
    what :func:`extract` gives for a whole adapted model (``.onnx``). Raises :class:`RevgraphError` for a file
    that holds no LoRA configuration."""
    from ..onnx_io import load
    from ..onnx_io.archive import read_archive
    from ..onnx_io.npz import NAMES

    suffix = os.path.splitext(str(path))[1].lower()
    if suffix == ".onnx":
        model = load(path)
        label = repr(os.fspath(path))
        if model.nodes:  # a whole adapted model: its configuration is checked against it
            try:
                arrays, found = extract(model)
            except RevgraphError as exc:  # named by the file it read
                raise RevgraphError(f"{label}: {exc}") from None
        else:  # what save_adapters writes: the adapters alone, as initializers
            text = model.metadata.get(KEY)
            if text is None:
                raise RevgraphError(f"{label}: the model holds no LoRA configuration (metadata {KEY!r}); write the "
                                    "file with revgraph lora extract")
            found = _parse_config(text, f"{label}: metadata {KEY!r}", "write the file with revgraph lora extract")
            arrays = {n: np.asarray(a) for n, a in model.initializers.items()}
        for a in found["adapters"]:
            for key in ("A", "B"):
                name = f"{label}: initializer {a[key]!r} (the {key} adapter of weight {a['weight']!r})"
                if a[key] not in arrays:
                    raise RevgraphError(f"{name} is missing; write the file with revgraph lora extract")
                _check_adapter(arrays[a[key]], name)
        return arrays, found
    if suffix != ".npz":
        raise RevgraphError(f"cannot read adapters from {str(path)!r}: give an .npz or .onnx file written by "
                            "revgraph lora extract")
    # every member is read (all are adapters), each bounded before it is decompressed (revgraph.onnx_io.archive)
    label = repr(os.fspath(path))
    fix = "write the file with revgraph lora extract"
    z = read_archive(path, what=".npz file of adapters")
    table = z.get(NAMES)
    if table is None:
        names = {k: k for k in z}
    elif table.dtype.kind != "U" or table.ndim != 2 or table.shape[1:] != (2,):
        raise RevgraphError(f"{label}: member {NAMES!r} is a {table.dtype} array of shape {list(table.shape)}, not the "
                            f"table of (member, name) strings revgraph writes; {fix}")
    else:
        names = {str(n): str(m) for m, n in table}
    lost = [(n, m) for n, m in names.items() if m not in z]
    if lost:
        raise RevgraphError(f"{label}: member {lost[0][1]!r} is missing (member {NAMES!r} lists it, for "
                            f"{lost[0][0]!r}); {fix}")
    arrays = {n: z[m] for n, m in names.items()}
    if KEY not in arrays:
        raise RevgraphError(f"{label}: the file holds no LoRA configuration (member {KEY!r}); {fix}")
    text = arrays.pop(KEY)
    if text.dtype.kind != "U" or text.ndim != 0:
        raise RevgraphError(f"{label}: member {KEY!r} is a {text.dtype} array of shape {list(text.shape)}, "
                            f"not the JSON text of a LoRA configuration; {fix}")
    found = _parse_config(str(text), f"{label}: member {KEY!r}", fix)
    for a in found["adapters"]:  # what apply checks too, named here by member
        for key in ("A", "B"):
            member = f"{label}: member {names.get(a[key], a[key])!r} (the {key} adapter of weight {a['weight']!r})"
            if a[key] not in arrays:
                raise RevgraphError(f"{member} is missing; {fix}")
            _check_adapter(arrays[a[key]], member)
    return arrays, found
