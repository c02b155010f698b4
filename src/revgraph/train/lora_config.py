"""The LoRA configuration (``metadata["revgraph.lora"]``, :mod:`.lora`) checked field by field, as untrusted input
(issue 40): a model file or an adapter file may carry a hand-edited, truncated or hostile one, and every field
revgraph reads from it is checked here before use, with the discipline of the snapshot checks
(:mod:`.snapshot_checks`): one line naming the field and what is wrong, never a ``KeyError`` inside a merge, and
never a base weight trained as if it were an adapter.

:func:`check_structure` checks what a configuration alone can say (types, ranges, names distinct);
:func:`check_against` and :func:`check_sites` what it says about a model: every weight, ``A`` and ``B`` it names is
an initializer of the model, each adapter a floating-point ``[in, rank]`` / ``[rank, out]`` array; each site a
``MatMul``/``Gemm``/``MatMulNBits`` reading its weight as recorded, and its added nodes exactly those computing the
update from ``A`` and ``B`` (so no other node reads them).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import RevgraphError
from ..ir import Graph, is_float_dtype

FORMAT = 1
_ADAPTER_KEYS = {"weight": str, "A": str, "B": str, "in": int, "out": int, "quantized": bool, "transposed": bool,
                 "sites": list}
_SITE_KEYS = {"node": str, "output": str, "base": str, "added": list}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_structure(found: object, fail: Callable[[str], RevgraphError]) -> dict:
    """``found`` when it is a configuration of this format (module doc), field by field; raises ``fail(what is
    wrong)`` otherwise (the caller names the file and says what to do)."""
    if not isinstance(found, dict):
        raise fail(f"it is a JSON {type(found).__name__}, not an object")
    if not _is_int(found.get("format")) or found.get("format") != FORMAT:
        raise fail(f"its format is {found.get('format')!r}, not {FORMAT}")
    rank, alpha, scaling = found.get("rank"), found.get("alpha"), found.get("scaling")
    if not _is_int(rank) or rank < 1:
        raise fail(f"its rank {rank!r} is not an integer >= 1")
    if not _is_number(alpha) or alpha == 0:
        raise fail(f"its alpha {alpha!r} is not a finite non-zero number")
    if not _is_number(scaling) or not math.isclose(scaling, alpha / rank, rel_tol=1e-9):
        raise fail(f"its scaling {scaling!r} is not alpha / rank = {alpha / rank!r}")
    seed = found.get("seed", 0)
    if not _is_int(seed) or seed < 0:
        raise fail(f"its seed {seed!r} is not an integer >= 0")
    targets = found.get("targets")
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise fail("its targets are neither null nor a list of strings")
    adapters = found.get("adapters")
    if not isinstance(adapters, list) or not adapters:
        raise fail("it lists no adapters")
    names: dict[str, str] = {}
    for k, a in enumerate(adapters):
        _check_adapter_fields(k, a, fail)
        for key in ("weight", "A", "B"):
            other = names.setdefault(a[key], f"the {key} of adapter {k}")
            if other != f"the {key} of adapter {k}":
                raise fail(f"adapter {k} names {a[key]!r} as its {key}, which is also {other}")
    return found


def _check_adapter_fields(k: int, a: object, fail: Callable[[str], RevgraphError]) -> None:
    if not isinstance(a, dict):
        raise fail(f"adapter {k} is not an object")
    for key, kind in _ADAPTER_KEYS.items():
        v = a.get(key)
        ok = _is_int(v) and v >= 1 if kind is int else isinstance(v, kind) and (kind is not str or v)
        if not ok:
            raise fail(f"adapter {k}'s {key!r} is {v!r}, not {_describe(kind)}")
    for j, s in enumerate(a["sites"]):
        if not isinstance(s, dict) or not all(isinstance(s.get(key), kind) for key, kind in _SITE_KEYS.items()) \
                or not all(isinstance(n, str) for n in s["added"]):
            raise fail(f"site {j} of adapter {k} is not an object of node, output, base and added node names")


def _describe(kind: type) -> str:
    return {str: "a non-empty string", int: "an integer >= 1", bool: "true or false", list: "a list"}[kind]


def check_against(graph: Graph, found: dict, fail: Callable[[str], RevgraphError]) -> None:
    """Check that the weights and adapters the configuration ``found`` (checked by :func:`check_structure`)
    names are initializers of ``graph`` of the recorded shapes; raises ``fail(what is wrong)``. Its sites and
    the nodes reading the adapters are :func:`check_sites`'."""
    inits = graph.initializers
    rank = found["rank"]
    for k, a in enumerate(found["adapters"]):
        if a["weight"] not in inits:
            raise fail(f"adapter {k}'s weight {a['weight']!r} is not an initializer of the model")
        for key, shape in (("A", (a["in"], rank)), ("B", (rank, a["out"]))):
            value = inits.get(a[key])
            if value is None:
                raise fail(f"adapter {k}'s {key} {a[key]!r} is not an initializer of the model")
            arr = np.asarray(value)
            if not is_float_dtype(arr.dtype) or arr.shape != shape:
                raise fail(f"adapter {k}'s {key} {a[key]!r} is {arr.dtype} {list(arr.shape)}, not a floating-point "
                           f"{list(shape)} array (in, out and rank as recorded)")


def check_sites(graph: Graph, found: dict, sites: dict, fail: Callable[[str], RevgraphError]) -> None:
    """Each recorded site is a ``MatMul``/``Gemm`` of ``graph`` that reads the adapter's weight as recorded (in
    and out, quantized, transposed) and writes the recorded base value, and its added nodes are those computing
    the update: what :func:`.lora.merge_adapters` relies on. ``sites``: the model's LoRA sites by node name."""
    for k, a in enumerate(found["adapters"]):
        if not a["sites"]:
            raise fail(f"adapter {k} lists no sites")
        for j, rec in enumerate(a["sites"]):
            s = sites.get(rec["node"])
            if s is None or s.weight != a["weight"] or s.node.outputs[0] != rec["base"]:
                raise fail(f"adapter {k}'s site {rec['node']!r} is not a MatMul/Gemm/MatMulNBits of the model "
                           f"that reads weight {a['weight']!r} and writes {rec['base']!r}")
            # (a square weight may be read in both orientations: the record holds the first site's)
            if (s.dims, s.quantized) != ((a["in"], a["out"]), a["quantized"]) or (j == 0 and
                    s.transposed != a["transposed"]):
                raise fail(f"adapter {k}'s site {rec['node']!r} reads weight {a['weight']!r} as {s.dims}, "
                           f"quantized {s.quantized}, transposed {s.transposed}; the record says otherwise")
        # the added nodes are exactly those computing from A, B and the bases up to the outputs (what a merge
        # removes), and they write the recorded outputs (what it renames the bases back to)
        reach = {a["A"], a["B"], *(rec["base"] for rec in a["sites"])}
        outputs = {rec["output"] for rec in a["sites"]}
        closure, written = set(), set()
        for n in graph.nodes:
            if not reach.isdisjoint(n.inputs):
                closure.add(n.name)
                written.update(o for o in n.outputs if o in outputs)
                reach.update(o for o in n.outputs if o and o not in outputs)
        added = {n for rec in a["sites"] for n in rec["added"]}
        constants = {n.name for n in graph.nodes if n.name in added and not n.inputs}  # (the scaling)
        if closure != added - constants or written != outputs:
            raise fail(f"adapter {k}'s sites do not record the nodes that compute its update and the values they "
                       "write")
