"""Which initializers train: names or glob patterns to train (``params=``, ``--train``) and to freeze
(``freeze=``, ``--freeze``), as onnxruntime-training's ``requires_grad`` / ``frozen_params`` lists and PyTorch's
``requires_grad_(False)`` choose them, and the count of trainable and frozen parameters.

Patterns are ``fnmatch`` globs over initializer names, matched case-sensitively; a string that is an initializer's
exact name means that initializer even when it holds glob characters (``onnx::MatMul_12``, ``w[0]``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping

import numpy as np

from ..errors import RevgraphError
from ..ir import Graph
from ..onnx_io.torch_names import torch_names


def _floats(a) -> bool:
    """Initializers that train: numpy kind ``"f"`` (float16/32/64), as :func:`revgraph.train.trainable` always had."""
    return np.asarray(a).dtype.kind == "f"


def _by_default(a) -> bool:
    """Whether a float initializer trains when nothing is named and the file has no record of the module's
    parameters: not a 0-d or one-element one. Exporters keep the constants of a model's formulas as such
    initializers (RMSNorm's exponent ``2.0``, an ``eps``, a scale): training them changes the model's math (issue
    38: the exponent's gradient ``x^p ln x`` is NaN for negative ``x``, and the loss was NaN at step 2). Name one
    with ``params=`` / ``--train`` to train it (a PReLU slope)."""
    return _floats(a) and np.asarray(a).size > 1


#: The names PyTorch and Keras give the buffers models keep beside their parameters: rotary frequencies and their
#: cached tables, normalization running statistics, position index tables. Without an exporter's record (the
#: TorchScript exporter, tf2onnx write none) these float tensors of many elements look like weights, and training
#: them changes the model's fixed math (issue 38: LLaMA's rotary ``inv_freq`` trained by default).
BUFFER_NAMES = frozenset({
    "inv_freq", "original_inv_freq", "cos_cached", "sin_cached", "freqs_cis",
    "running_mean", "running_var", "num_batches_tracked", "moving_mean", "moving_variance",
    "position_ids", "token_type_ids", "relative_position_index",
    "cos_cache", "sin_cache",  # onnxruntime-genai's model builder: the rotary tables GroupQueryAttention reads
})


def buffer_name(name: str) -> bool:
    """Whether an initializer's name is a buffer's (:data:`BUFFER_NAMES`): one of its ``.``/``/``/``:``-separated
    parts is (``model.rotary_emb.inv_freq``, ``bn1.running_mean``, ``bn/moving_mean:0``)."""
    return any(part in BUFFER_NAMES for part in re.split(r"[./:]", name))


#: Why :func:`left_out` leaves out a ``MatMulNBits``'s scales and zero points.
FROZEN_BASE = "scales and zero points of MatMulNBits (a frozen int4 base)"


def frozen_base(model: Graph) -> set[str]:
    """The initializers ``com.microsoft.MatMulNBits`` nodes read as their scales and zero points (inputs 2 and 3),
    by structure, not by name: the packed weight they dequantize cannot train (it is integers), and a scale or
    zero point trained alone would move a whole block of it; onnxruntime's rule gives them no gradient (a frozen
    base: LoRA adapters train beside it, :mod:`.lora_nbits`)."""
    return {i for _, n in model.walk() if (n.domain, n.op_type) == ("com.microsoft", "MatMulNBits")
            for i in n.inputs[2:4] if i}


def _defaults(model: Graph) -> tuple[list[str], dict[str, str]]:
    """The default trainable set (declaration order) and ``{left out: why}``, over the float initializers, by the
    best record the model has: revgraph's ``revgraph.torch_parameters`` (:func:`revgraph.export_torch`), else the
    dynamo exporter's per-initializer kinds (:mod:`revgraph.onnx_io.torch_names`), else the names and sizes. A
    record that names none of the model's initializers (a stale one) is passed over."""
    base = frozen_base(model)
    floats = [k for k, a in model.initializers.items() if _floats(a) and k not in base]
    frozen = {k: FROZEN_BASE for k in model.initializers if k in base and _floats(model.initializers[k])}
    record = torch_names(model.metadata)
    if record is not None and record.parameters & set(floats):
        def why(k: str) -> str:
            if k in record.buffers:
                return "buffers"
            if k in record.frozen:
                return "parameters with requires_grad=False"
            return "constants" if np.asarray(model.initializers[k]).size > 1 else "one-element constants"

        return ([k for k in floats if k in record.parameters],
                {**{k: why(k) for k in floats if k not in record.parameters}, **frozen})
    trained, out = [], dict(frozen)
    for k in floats:
        if not _by_default(model.initializers[k]):
            out[k] = "one-element constants"
        elif buffer_name(k):
            out[k] = "buffers (by name)"
        else:
            trained.append(k)
    return trained, out


def left_out(model: Graph) -> dict[str, str]:
    """The float initializers the default trainable set leaves out, in declaration order, each with why: a plural
    kind for messages to group them by (``"buffers"``, ``"buffers (by name)"``, ``"one-element constants"``,
    ``"constants"``, ``"parameters with requires_grad=False"``, :data:`FROZEN_BASE`); see :func:`select`."""
    return _defaults(model)[1]


def _matches(model: Graph, pattern: object, option: str) -> list[str]:
    """The initializers ``pattern`` names (its exact name, else its glob matches, in declaration order)."""
    if not isinstance(pattern, str) or not pattern:
        raise RevgraphError(f"{option} {pattern!r} is not a name or glob pattern of an initializer")
    if pattern in model.initializers:
        return [pattern]
    found = [k for k in model.initializers if fnmatch.fnmatchcase(k, pattern)]
    if not found:
        raise RevgraphError(f"{option} pattern {pattern!r} matches no initializer of the model; `revgraph info` "
                            "lists them (patterns are fnmatch globs over initializer names)")
    return found


def _patterns(value: Iterable[str] | str | None, option: str) -> list | None:
    if value is None or isinstance(value, str):
        return None if value is None else [value]
    # bytes would iterate as ints and a mapping as its keys ({"W1": False} would freeze W1): refuse both
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
        raise RevgraphError(f"{option} must be a name or glob pattern or a list of them, got {type(value).__name__}")
    return list(value)


def _constant_weights(model: Graph) -> str:
    """The hint of a model with nothing to train whose weights are floating-point ``Constant`` nodes (paddle2onnx
    writes its weights so), naming :func:`revgraph.autodiff.lift.lift_constants`; empty for another model."""
    from ..autodiff.lift import lift_constants

    lifted = lift_constants(model)[1]
    if not lifted:
        return ""
    return (f"; its weights are Constant nodes ({', '.join(map(repr, lifted[:4]))}{', ...' if len(lifted) > 4 else ''})"
            ": make them initializers with revgraph.autodiff.lift.lift_constants (revgraph train --lift-constants)")


def select(model: Graph, params: Iterable[str] | str | None = None, freeze: Iterable[str] | str | None = None,
           ) -> list[str]:
    """The initializers to train, in declaration order.

    ``params``: names or glob patterns (module doc) of the initializers to train; ``None``: the LoRA adapters of
    a model that has them (:func:`revgraph.train.lora.adapter_names`), else the module's parameters: the initializers
    of ``revgraph.torch_parameters`` in a file :func:`revgraph.export_torch` wrote, else those the dynamo
    exporter's record marks ``PARAMETER``, else every floating-point initializer with more than one element whose
    name is not a buffer's (:func:`buffer_name`; a 0-d or one-element one is a constant of the model's formulas),
    in every case without the scales and zero points of ``MatMulNBits`` nodes (:func:`frozen_base`).
    :func:`left_out` lists what the default leaves out, and why. Integer initializers a glob matches are left out (they
    cannot train). ``freeze``: names or globs removed from that set. Raises :class:`RevgraphError` (one line) for a
    pattern that matches no initializer (naming it and the option), an integer initializer named exactly, a glob that
    matches only integer ones, and a selection that leaves nothing to train (naming
    :func:`revgraph.autodiff.lift.lift_constants` where the weights are ``Constant`` nodes).
    """
    from .lora import adapter_names

    params, freeze = _patterns(params, "params (--train)"), _patterns(freeze, "freeze (--freeze)")
    if params is None:
        names = adapter_names(model) or _defaults(model)[0]
        if not names:
            skipped = list(left_out(model))
            raise RevgraphError("the model has no floating-point initializers to train" + (
                f" but ones left out by default ({', '.join(map(repr, skipped[:4]))}), which train only when "
                "named: params= (--train)" if skipped else _constant_weights(model)))
    else:
        if not params:
            raise RevgraphError("params (--train) is empty: give names or glob patterns of initializers, or None "
                                "(leave it out) to train every float one")
        chosen: dict[str, None] = {}
        for p in params:
            found = _matches(model, p, "params (--train)")
            floats = [k for k in found if _floats(model.initializers[k])]
            if not floats:
                k = found[0]
                raise RevgraphError(f"parameter {k!r} is {np.asarray(model.initializers[k]).dtype}; only floats train"
                                    + (f" (pattern {p!r} matches no float initializer)" if k != p else ""))
            chosen.update(dict.fromkeys(floats))
        order = {k: i for i, k in enumerate(model.initializers)}
        names = sorted(chosen, key=order.__getitem__)
    for f in freeze or []:
        frozen = set(_matches(model, f, "freeze (--freeze)"))
        names = [k for k in names if k not in frozen]
    if not names:
        raise RevgraphError("params and freeze (--train, --freeze) leave no initializer to train")
    return names


def parameters(model: Graph) -> list[str]:
    """What counts as a parameter: the float initializers and the integer weights of ``DequantizeLinear`` and
    ``MatMulNBits`` nodes (a quantized base), not the integer shapes, axes and indices a graph holds as initializers."""
    quantized = {n.inputs[0] for _, n in model.walk() if n.op_type == "DequantizeLinear" and n.inputs}
    packed = set(_packed(model))
    return [k for k, a in model.initializers.items()
            if _floats(a) or (k in quantized and np.asarray(a).ndim >= 2) or k in packed]


def _packed(model: Graph) -> dict[str, int]:
    """The packed weights of ``MatMulNBits`` nodes (input 1) and the elements each holds, ``K * N`` (its bytes
    hold 8 / bits of them)."""
    return {n.inputs[1]: int(n.attrs.get("K", 0)) * int(n.attrs.get("N", 0)) for _, n in model.walk()
            if (n.domain, n.op_type) == ("com.microsoft", "MatMulNBits") and len(n.inputs) > 1
            and n.inputs[1] in model.initializers}


def count_line(model: Graph, trained: Iterable[str]) -> str:
    """One line: the trainable and frozen parameters (:func:`parameters`) in tensors and elements, e.g.
    ``parameters: 2,048 trainable in 4 tensors (1.96%), 102,400 frozen in 8 tensors``."""
    trained = list(trained)
    mine = set(trained)
    frozen = [k for k in parameters(model) if k not in mine]
    t = sum(int(np.asarray(model.initializers[k]).size) for k in trained)
    packed = _packed(model)
    f = sum(packed.get(k) or int(np.asarray(model.initializers[k]).size) for k in frozen)
    share = f" ({100 * t / (t + f):.3g}%)" if t + f else ""
    return (f"parameters: {t:,} trainable in {len(trained)} tensor{'s' * (len(trained) != 1)}{share}, "
            f"{f:,} frozen in {len(frozen)} tensor{'s' * (len(frozen) != 1)}")
