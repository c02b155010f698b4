"""LoRA adapters in Hugging Face PEFT's format: :func:`save_peft` (``revgraph lora extract --format peft``) and
:func:`apply_peft` (``revgraph lora apply BASE.onnx DIR``), so that ``peft.PeftModel.from_pretrained(base, DIR)``
loads what revgraph trained, and revgraph applies what PEFT trained.

The format (PEFT's ``save_pretrained``): a directory holding ``adapter_config.json`` (``peft_type "LORA"``, ``r``,
``lora_alpha``, ``target_modules``, ...) and ``adapter_model.safetensors`` with, per adapted module,
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``base_model.model.<module>.lora_B.weight``
``[out, r]``. PEFT computes ``y = base(x) + (lora_alpha / r) lora_B(lora_A(x))`` (Hu et al. 2021;
``alpha / sqrt(r)`` with ``use_rslora``); revgraph's ``A`` ``[in, r]`` and ``B`` ``[r, out]`` (:mod:`.lora`) apply
the same map in ONNX's ``x W`` orientation, so PEFT's tensors are their transposes, whatever orientation the
weight is stored in (``nn.Linear``'s ``[out, in]``, exported as ``MatMul(x, Transpose(W))``, or ``[in, out]``).

Module names. ``<module>`` is the torch module whose ``weight`` the adapted initializer is: from the record of
``rg.export_torch`` (:func:`.hf_io.torch_names`) where the model has one, else the initializer's own name less
``.weight`` (``torch.onnx.export(dynamo=True, optimize=False)`` names initializers after the parameters).

Reading is of untrusted input: the configuration is bounded (:data:`MAX_CONFIG_BYTES`) and checked field by field
(what revgraph cannot compute, DoRA, per-module ranks, trained biases, is refused), the weights file is bounded by
the size adapters of that rank can have on the base model before it is read, every tensor name must be a
``lora_A``/``lora_B`` weight of a module the configuration targets and whose weight the base model has, of a
floating-point dtype and the shape ``[r, in]`` / ``[out, r]`` of that weight: one line each, naming the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from .. import validate as V
from ..errors import RevgraphError
from ..ir import Graph, is_float_dtype
from ..ir.arguments import GRAPH
from . import hf_io, lora

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
#: PEFT's prefix of the tensor names (``PeftModel.base_model.model``)
PREFIX = "base_model.model."
#: PEFT's ``TaskType`` values (``task_type`` of the configuration)
TASK_TYPES = ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")
#: The largest ``adapter_config.json`` read (PEFT writes about 1.5 KB).
MAX_CONFIG_BYTES = 1 << 20
#: Fields of PEFT's ``LoraConfig`` that change what the adapters compute (its LoRA variants among them), with
#: the values that leave plain LoRA (absent or ``None`` too): anything else is refused rather than applied wrongly.
_UNSUPPORTED = {"use_dora": (False,), "rank_pattern": ({},), "alpha_pattern": ({},), "bias": ("none",),
                "lora_bias": (False,), "modules_to_save": ([],), "layer_replication": ([],),
                "trainable_token_indices": ([], {}), "target_parameters": ([],), "use_qalora": (False,),
                "alora_invocation_tokens": ([],), "use_bdlora": (False,), "arrow_config": (), "kasa_config": (),
                "velora_config": (), "monteclora_config": ()}


def module_paths(graph: Graph) -> dict[str, str]:
    """``{adapted weight initializer: torch module path}`` of the adapters of ``graph`` (module doc). Raises
    :class:`RevgraphError` for a weight no torch parameter ``<module>.weight`` names, or one the torch module ties
    to several (PEFT adapts each module on its own)."""
    found = lora.config(graph)
    if found is None:
        raise RevgraphError("the model has no LoRA adapters (no metadata 'revgraph.lora'): train it with --lora "
                            "(lora.add_adapters) first")
    names = hf_io.torch_names(graph)
    owners: dict[str, list[str]] = {}
    for name, init in (names or {}).items():
        owners.setdefault(init, []).append(name)
    paths = {}
    for a in found["adapters"]:
        w = a["weight"]
        params = [p for p in owners.get(w, []) if p.endswith(".weight")] if names is not None else [w]
        if len(params) > 1:
            raise RevgraphError(f"weight {w!r} is the tied parameters {', '.join(map(repr, params))} of the torch "
                                "module: PEFT adapts one module at a time; leave it out of --lora-targets")
        if not params or not params[0].endswith(".weight") or params[0] == ".weight":
            raise RevgraphError(f"the adapted weight {w!r} is named after no torch parameter <module>.weight; export "
                                "the model with rg.export_torch or torch.onnx.export(dynamo=True, optimize=False)")
        paths[w] = params[0][: -len(".weight")]
    return paths


def _target_modules(paths: list[str], candidates: set[str]) -> list[str]:
    """PEFT's ``target_modules``: the modules' last names (``["q_proj", "v_proj"]``, as a PEFT user writes them)
    when they pick exactly the adapted ``paths`` among the model's modules ``candidates``, else the full paths."""
    short = sorted({p.rsplit(".", 1)[-1] for p in paths})
    picked = {c for c in candidates if c.rsplit(".", 1)[-1] in short}
    return short if picked == set(paths) else sorted(paths)


@V.arguments(directory=V.PATH, graph=GRAPH)
def save_peft(directory: str | os.PathLike, graph: Graph, task_type: str | None = None) -> tuple[int, int]:
    """Write the adapters of ``graph`` to ``directory`` (made if needed, under an existing parent) in PEFT's
    format (module doc): ``adapter_model.safetensors`` then ``adapter_config.json``, each atomically. ``task_type``:
    PEFT's ``task_type`` (:data:`TASK_TYPES`, e.g. ``"CAUSAL_LM"``; ``None``: ``PeftModel.from_pretrained`` makes
    a plain ``PeftModel``). Returns ``(tensors, elements)``. Raises :class:`RevgraphError` for a model without
    adapters, weights not named after torch modules (:func:`module_paths`), and a ``Gemm`` site whose ``alpha``
    also scales the update (PEFT's layer does not)."""
    from ..onnx_io.atomic import atomic_path

    if task_type is not None and task_type not in TASK_TYPES:
        raise RevgraphError(f"task_type {task_type!r} is not one of PEFT's: {', '.join(TASK_TYPES)}")
    arrays, found = lora.extract(graph)
    paths = module_paths(graph)
    nodes = {n.name: n for n in graph.nodes}
    tensors = {}
    for a in found["adapters"]:
        for site in a["sites"]:
            node = nodes[site["node"]]
            if node.op_type == "Gemm" and float(node.attrs.get("alpha", 1.0)) != 1.0:
                raise RevgraphError(f"the adapted {node.label()} scales its product by alpha="
                                    f"{node.attrs['alpha']:g}, which PEFT's LoRA layer does not apply to the update; "
                                    "keep revgraph's adapter format (.npz or .onnx)")
        module = PREFIX + paths[a["weight"]]
        tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(arrays[a["A"]].T)  # [in, r] -> PEFT's [r, in]
        tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(arrays[a["B"]].T)  # [r, out] -> PEFT's [out, r]
    names = hf_io.torch_names(graph)
    weights = names if names is not None else {k: k for k in graph.initializers}
    candidates = {k[: -len(".weight")] for k in weights if k.endswith(".weight")}
    alpha = found["alpha"]
    # weights stored [in, out] (transformers' Conv1D, GPT-2) are what PEFT's fan_in_fan_out means; it only
    # changes how PEFT merges, and PEFT corrects it per layer with a warning: True where every weight is so
    fan_in_fan_out = not any(a["transposed"] for a in found["adapters"])
    config = {"peft_type": "LORA", "task_type": task_type, "r": found["rank"],
              "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
              "target_modules": _target_modules(list(paths.values()), candidates), "bias": "none",
              "lora_dropout": 0.0, "fan_in_fan_out": fan_in_fan_out, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None, "rank_pattern": {},
              "alpha_pattern": {}, "base_model_name_or_path": None, "revision": None}
    directory = Path(directory)
    try:
        directory.mkdir(exist_ok=True)
    except OSError as exc:
        raise RevgraphError(f"cannot make the directory {str(directory)!r} ({exc.strerror})") from None
    hf_io.write_safetensors(directory / WEIGHTS, tensors)
    with atomic_path(directory / CONFIG) as tmp, open(tmp, "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    return len(tensors), sum(t.size for t in tensors.values())


# ------------------------------------------------------------------------------------------------ reading


@V.arguments(base=GRAPH, directory=V.PATH, merge=V.FLAG)
def apply_peft(base: Graph, directory: str | os.PathLike, merge: bool = False) -> Graph:
    """``base`` with the LoRA adapters of the PEFT directory ``directory`` (written by PEFT's
    ``save_pretrained`` or :func:`save_peft`) as revgraph adapters (:mod:`.lora`: trained further, extracted,
    merged), merged into the weights with ``merge``; ``base`` is not changed. The directory is untrusted input
    (module doc): raises :class:`RevgraphError` (one line naming the file and what is wrong) for a configuration
    revgraph cannot compute or that does not fit ``base``, and for a weights file that is truncated, too large,
    or holds a tensor that is not the ``lora_A``/``lora_B`` weight of a targeted module of ``base`` of the
    configuration's rank."""
    directory = Path(directory)
    if not directory.is_dir():
        raise RevgraphError(f"{str(directory)!r} is not a directory; PEFT adapters are a directory holding {CONFIG} "
                            f"and {WEIGHTS} (save_pretrained)")
    rank, alpha, targets = _read_config(directory / CONFIG)
    weights_file = directory / WEIGHTS
    label = repr(str(weights_file))
    if not weights_file.exists() and (directory / "adapter_model.bin").exists():
        raise RevgraphError(f"{str(directory)!r} holds adapter_model.bin (a pickle), which revgraph does not read: "
                            "save the adapters with save_pretrained(safe_serialization=True)")
    names = hf_io.torch_names(base)
    dims = {k: np.asarray(v).shape for k, v in base.initializers.items() if np.ndim(v) == 2}
    if not any(rank <= min(s) for s in dims.values()):
        raise RevgraphError(f"{str(directory / CONFIG)!r}: r {rank} exceeds min(in, out) of every 2-D weight of the "
                            "base model; apply the adapters to the model they were trained on")
    # the most bytes adapters of this rank can take on this base (float64), plus PEFT's JSON header
    limit = 8 * rank * sum(sum(s) for s in dims.values()) + (1 << 20)
    arrays = hf_io.read_safetensors(weights_file, "the adapter weights", limit)
    pairs = _pairs(arrays, label, rank, targets)
    weight_of: dict[str, str] = {}
    for path in pairs:
        w = names.get(f"{path}.weight") if names is not None else f"{path}.weight"
        if w is None or w not in base.initializers:
            raise RevgraphError(f"{label}: module {path!r} has no weight in the base model (no initializer "
                                f"{w or path + '.weight'!r}); apply the adapters to the model they were trained on")
        if w in weight_of.values():
            raise RevgraphError(f"{label}: modules {path!r} and {next(p for p, v in weight_of.items() if v == w)!r} "
                                f"both adapt weight {w!r}; revgraph gives a weight one adapter")
        weight_of[path] = w
    escaped = ["".join(f"[{c}]" if c in "*?[" else c for c in w) for w in weight_of.values()]
    try:
        g = lora.add_adapters(base, rank, alpha, escaped)
    except RevgraphError as exc:
        raise RevgraphError(f"{label}: {exc}") from None
    adapters = {a["weight"]: a for a in lora.config(g)["adapters"]}
    for path, (a_peft, b_peft) in pairs.items():
        a = adapters[weight_of[path]]
        for key, value, want in (("lora_A", a_peft, (rank, a["in"])), ("lora_B", b_peft, (a["out"], rank))):
            if value.shape != want:
                raise RevgraphError(f"{label}: {PREFIX}{path}.{key}.weight has shape {list(value.shape)}; weight "
                                    f"{a['weight']!r} of the base model needs {list(want)}: apply the adapters "
                                    "to the model they were trained on")
            if not np.isfinite(value.astype(np.float32)).all():
                raise RevgraphError(f"{label}: {PREFIX}{path}.{key}.weight holds NaN or infinite values")
        for name, value in ((a["A"], a_peft.T), (a["B"], b_peft.T)):
            g.initializers[name] = np.ascontiguousarray(value.astype(g.initializers[name].dtype))
    return lora.merge_adapters(g) if merge else g


def _read_config(path: Path) -> tuple[int, float, list[str] | str | None]:
    """``(r, alpha, target_modules)`` of PEFT's ``adapter_config.json`` at ``path``, revgraph's ``alpha`` being
    ``scaling * r`` (so ``use_rslora``'s ``lora_alpha / sqrt(r)`` is kept); raises :class:`RevgraphError` for a
    file that is not such a configuration or asks for what revgraph does not compute (:data:`_UNSUPPORTED`)."""
    from ..limits import open_regular_file

    label = repr(str(path))
    if not path.exists():
        raise RevgraphError(f"{label}: no such file; PEFT adapters are a directory holding {CONFIG} and {WEIGHTS}")
    with os.fdopen(open_regular_file(path, "PEFT configuration"), "rb") as f:
        text = f.read(MAX_CONFIG_BYTES + 1)
    if len(text) > MAX_CONFIG_BYTES:
        raise RevgraphError(f"{label} has more than {MAX_CONFIG_BYTES:,} bytes; a PEFT configuration has a few "
                            "thousand")
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        raise RevgraphError(f"{label} is not JSON; give the adapter_config.json PEFT wrote") from None

    def fail(what: str) -> RevgraphError:
        return RevgraphError(f"{label}: {what}")

    if not isinstance(found, dict):
        raise fail(f"it is a JSON {type(found).__name__}, not PEFT's configuration object")
    if found.get("peft_type") != "LORA":
        raise fail(f"peft_type is {found.get('peft_type')!r}; revgraph reads LoRA adapters (peft_type \"LORA\")")
    r, lora_alpha = found.get("r"), found.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise fail(f"r is {r!r}, not an integer >= 1")
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not math.isfinite(lora_alpha) \
            or lora_alpha == 0:
        raise fail(f"lora_alpha is {lora_alpha!r}, not a finite non-zero number")
    for key, fine in _UNSUPPORTED.items():
        if found.get(key) is not None and found[key] not in fine:
            plain = " or ".join(["absent", "null", *(json.dumps(v) for v in fine)])
            raise fail(f"{key} is {found[key]!r}; revgraph applies plain LoRA adapters ({key} {plain})")
    rslora = found.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise fail(f"use_rslora is {rslora!r}, not true or false")
    targets = found.get("target_modules")
    if not (targets is None or isinstance(targets, str) or
            (isinstance(targets, list) and all(isinstance(t, str) and t for t in targets))):
        raise fail("target_modules is neither a list of module names nor a regular expression")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except (re.error, RecursionError):
            raise fail(f"target_modules {targets!r} is not a regular expression") from None
    scaling = lora_alpha / math.sqrt(r) if rslora else lora_alpha / r
    return r, scaling * r, targets


def _pairs(arrays: dict[str, np.ndarray], label: str, rank: int,
           targets: list[str] | str | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{module path: (lora_A [r, in], lora_B [out, r])}`` of the tensors of a PEFT weights file (``label``),
    each name checked (PEFT's form, a module ``targets`` selects as PEFT does: a name or a suffix ``.name`` of
    the list, or a full match of the regular expression), each tensor a 2-D floating-point array of rank
    ``rank``, each module with both."""
    form = f"{PREFIX}<module>.lora_A.weight / .lora_B.weight"
    found: dict[str, dict[str, np.ndarray]] = {}
    for name, value in arrays.items():
        m = re.fullmatch(re.escape(PREFIX) + r"(.+)\.(lora_A|lora_B)\.weight", name)
        if m is None:
            raise RevgraphError(f"{label}: tensor {name!r} is not a LoRA weight of PEFT's form ({form}); revgraph "
                                "applies plain LoRA adapters")
        path, key = m.groups()
        if targets is not None and not (re.fullmatch(targets, path) if isinstance(targets, str) else
                                        any(path == t or path.endswith("." + t) for t in targets)):
            raise RevgraphError(f"{label}: tensor {name!r} adapts module {path!r}, which target_modules "
                                f"{targets!r} of {CONFIG} does not select")
        if not is_float_dtype(value.dtype) or value.ndim != 2:
            raise RevgraphError(f"{label}: tensor {name!r} is {value.dtype} {list(value.shape)}, not a 2-D "
                                "floating-point array")
        r = value.shape[0] if key == "lora_A" else value.shape[1]
        if r != rank:
            raise RevgraphError(f"{label}: tensor {name!r} has shape {list(value.shape)}, of rank {r}; {CONFIG} "
                                f"says r = {rank}")
        found.setdefault(path, {})[key] = value
    if not found:
        raise RevgraphError(f"{label} holds no tensors; give the adapter_model.safetensors PEFT wrote")
    for path, pair in found.items():
        if len(pair) != 2:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise RevgraphError(f"{label}: {PREFIX}{path}.{missing}.weight is missing (module {path!r} has only "
                                f"its {next(iter(pair))})")
    return {path: (pair["lora_A"], pair["lora_B"]) for path, pair in found.items()}
