"""``revgraph.export_torch``: a PyTorch module to an ONNX file that revgraph trains as PyTorch would, with the
record of which initializers are the module's parameters and which its buffers (:mod:`.torch_names`)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .. import validate as V
from ..errors import RevgraphError
from .torch_names import BUFFERS, PADDING_ROWS, PARAMETERS, STATE_DICT

#: the dynamo exporter's name, on each initializer, of the exported program's placeholder it came from
_PLACEHOLDER = "pkg.torch.onnx.original_node_name"
#: export_torch's own choices, which an ``export_options`` entry may not change
_FIXED = ("f", "dynamo", "optimize")


def _torch_module(name: str, value: Any) -> Any:
    """A ``torch.nn.Module`` (PyTorch imported here: it is what export_torch needs)."""
    try:
        import torch
    except ImportError:
        raise RevgraphError("export_torch needs PyTorch (pip install torch)") from None
    if not isinstance(value, torch.nn.Module):
        raise RevgraphError(f"{name}= must be a torch.nn.Module, got {type(value).__name__}")
    return value


@V.arguments(module=_torch_module, path=V.PATH, kwargs=V.OPTIONAL_MAPPING, input_names=V.NAMES,
             output_names=V.NAMES, opset_version=V.POSITIVE_INT)  # (args, dynamic_shapes: torch.export's)
def export_torch(module: Any, args: Any, path: str | os.PathLike, *, kwargs: dict | None = None,
                 dynamic_shapes: Any = None, input_names: list[str] | None = None,
                 output_names: list[str] | None = None, opset_version: int = 23,
                 **export_options: Any) -> dict[str, dict[str, str]]:
    """Export ``module`` (a ``torch.nn.Module``) called on ``args`` (a tensor or a tuple of them; ``kwargs``:
    keyword inputs) to the ONNX file ``path``, as revgraph's README recommends: ``torch.onnx.export(...,
    dynamo=True, optimize=False, opset_version=23)``. Unoptimized, the initializers are the parameters
    themselves under their PyTorch names (``optimize=True`` folds BatchNorm into convolutions and pre-transposes
    linear weights: the gradients would be for other tensors); at opset 23 ``scaled_dot_product_attention`` is
    ONNX ``Attention``. ``dynamic_shapes``, ``input_names``, ``output_names``, ``opset_version`` and any other
    ``export_options`` (``external_data``, ``report``, ``fallback``, ...) go to ``torch.onnx.export``; ``verbose``
    defaults to ``False``.

    The file's ``metadata_props`` record which initializers are the module's tensors, each a JSON object
    ``{PyTorch name: ONNX initializer name}``:

    * ``revgraph.torch_parameters``: every name of ``module.named_parameters(remove_duplicate=False)`` whose
      parameter has ``requires_grad`` (a tied weight under each of its names, mapped to its one initializer).
      :func:`revgraph.Trainer` trains exactly these by default (:func:`revgraph.train.selection.select`).
    * ``revgraph.torch_buffers``: every name of ``module.named_buffers(remove_duplicate=False)``, persistent or
      not (a rotary ``inv_freq``, BatchNorm's ``running_mean``); they do not train by default.
    * ``revgraph.torch_state_dict``: every key of ``module.state_dict()``: the parameters (frozen ones too) and
      the persistent buffers (a buffer is persistent iff its name is here).

    A tensor the graph does not read has no initializer (the exporter drops it) and is absent from the three.
    The mapping comes from the exported program's graph signature (which placeholder is which parameter or
    buffer) and each initializer's placeholder name, else from an initializer named as the tensor.

    The module is not changed: its ``train()``/``eval()`` modes and ``requires_grad`` flags are as the caller
    left them (export in ``eval()`` for a graph without Dropout and with BatchNorm's running statistics).
    Returns ``{"parameters": ..., "buffers": ..., "state_dict": ...}``, the three objects written. Raises
    :class:`RevgraphError` (one line) when PyTorch is not installed, ``module`` is not an ``nn.Module``,
    ``path`` is not a path or names another format, ``kwargs`` is not a mapping, the names are not strings
    (``.safetensors``, ``.pt``: :func:`revgraph.save`), an ``export_options`` entry sets ``f``, ``dynamo`` or
    ``optimize``, and when the export fails (naming the exporter's own first line of the error); the file is written
    atomically, nothing is left on failure.
    """
    import torch

    from . import refuse_other_format, save

    refuse_other_format(path)
    fixed = [k for k in _FIXED if k in export_options]
    if fixed:
        raise RevgraphError(f"export_torch sets {fixed[0]}= itself (it writes path with dynamo=True, optimize=False); "
                            f"leave {fixed[0]}= out")
    if isinstance(args, torch.Tensor):
        args = (args,)
    input_names, output_names = V.names("input_names", input_names), V.names("output_names", output_names)
    export_options.setdefault("verbose", False)
    modes = [(m, m.training) for m in module.modules()]
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        program = torch.onnx.export(module, args, kwargs=kwargs, dynamo=True, optimize=False,
                                    opset_version=opset_version, dynamic_shapes=dynamic_shapes,
                                    input_names=input_names, output_names=output_names, **export_options)
        proto = program.model_proto
    except Exception as exc:  # torch.export's and the translation's errors are of many types
        raise RevgraphError(f"torch.onnx.export(dynamo=True) of {type(module).__name__} failed: "
                            f"{_first_line(exc)}") from exc
    finally:
        for m, training in modes:  # as the caller left them (assigned, not .train(): that recurses)
            m.training = training
        for p, flag in flags:
            p.requires_grad_(flag)
    record = _record(torch, module, program, proto)
    kept = [p for p in proto.metadata_props if p.key not in (PARAMETERS, BUFFERS, STATE_DICT, PADDING_ROWS)]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for key, names in zip((PARAMETERS, BUFFERS, STATE_DICT), record.values(), strict=True):
        proto.metadata_props.add(key=key, value=json.dumps(names))
    padding = _padding_rows(torch, module, record["state_dict"])
    if padding:
        proto.metadata_props.add(key=PADDING_ROWS, value=json.dumps(padding))
    save(proto, path)
    return record


def _first_line(exc: BaseException) -> str:
    """The innermost cause's type and first line (the exporter wraps torch.export's error in a long report)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line[:300]}" if line else type(exc).__name__


def _record(torch, module, program, proto) -> dict[str, dict[str, str]]:
    """``{"parameters", "buffers", "state_dict"}``, each ``{PyTorch name: initializer name}`` (export_torch's
    doc). Tensors are matched by identity, so that every alias of a tied weight gets its one initializer."""
    inits = {t.name for t in proto.graph.initializer}
    placeholder = {p.value: v.name for v in [*proto.graph.initializer, *proto.graph.value_info, *proto.graph.input]
                   for p in v.metadata_props if p.key == _PLACEHOLDER and v.name in inits}
    tensors = {**dict(module.named_parameters(remove_duplicate=False)),
               **dict(module.named_buffers(remove_duplicate=False))}
    found: dict[int, str] = {}  # id(tensor) -> initializer
    program_ = getattr(program, "exported_program", None)  # None where export fell back to TorchScript
    for spec in program_.graph_signature.input_specs if program_ is not None else ():
        target, arg = getattr(spec, "target", None), getattr(getattr(spec, "arg", None), "name", None)
        init = placeholder.get(arg) or (target if target in inits else None)
        if target in tensors and init is not None:
            found.setdefault(id(tensors[target]), init)
    for name, t in tensors.items():  # else the initializer named as the tensor (the exporters' usual name)
        if name in inits:
            found.setdefault(id(t), name)
    return {
        "parameters": {n: found[id(p)] for n, p in module.named_parameters(remove_duplicate=False)
                       if p.requires_grad and id(p) in found},
        "buffers": {n: found[id(b)] for n, b in module.named_buffers(remove_duplicate=False) if id(b) in found},
        "state_dict": {k: found[id(v)] for k, v in module.state_dict(keep_vars=True).items()
                       if isinstance(v, torch.Tensor) and id(v) in found},
    }


def _padding_rows(torch, module, state_dict: dict[str, str]) -> dict[str, list[int]]:
    """``{initializer: [row]}`` of the embedding tables with a ``padding_idx`` (torch normalizes a negative
    one to its row), found through the module's state-dict names: the rows PyTorch's gradient leaves at zero."""
    rows: dict[str, list[int]] = {}
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    for name, m in module.named_modules(remove_duplicate=False):
        init = state_dict.get(f"{name}.weight" if name else "weight")
        if isinstance(m, kinds) and m.padding_idx is not None and init is not None:
            rows.setdefault(init, [])
            if int(m.padding_idx) not in rows[init]:
                rows[init].append(int(m.padding_idx))
    return rows
