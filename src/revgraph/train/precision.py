"""Mixed precision training graphs: ``--precision fp32|bf16|fp16``, ``Trainer(precision=)``,
``training_graph(..., precision=)`` (PyTorch AMP: ``torch.autocast`` + ``torch.amp.GradScaler``).

**Autocast.** :func:`autocast` rewrites the forward model before it is differentiated: every matrix product
and convolution (:data:`LOW_PRECISION_OPS`, the ONNX forms of the ops on autocast's lower-precision list,
``AT_FORALL_LOWER_PRECISION_FP`` in ``aten/src/ATen/autocast_mode.h``: ``matmul``, ``linear``/``addmm``,
``conv*``, ``conv_transpose*``, ``einsum``, ``scaled_dot_product_attention``) reads its float32 inputs through
``Cast`` nodes to bfloat16 or float16 and its outputs are cast back to float32. The parameters stay float32
graph inputs and outputs (the *master weights*: the optimizer updates them in float32); the low-precision copy
of a weight is one ``Cast`` per step, shared by every product that reads it (autocast's cast cache). Every other
node keeps computing in float32: reductions, normalizations, softmax, ``exp``/``log``, the loss (autocast's
fp32 list) and also the elementwise ops between two products, which autocast would run in the dtype of their
input; they see the low-precision values (cast back exactly), so ``relu``, pooling and reshapes give the same
numbers either way. Because :func:`revgraph.gradient` differentiates through the casts (the cotangent of a
``Cast`` is cast back), the backward of a low-precision product runs in the low precision too, as autocast's.

Each low-precision node computes products only: a bias (``Gemm``'s ``C``, ``Conv``'s and ``ConvTranspose``'s
``B``) is added in float32 after the cast back (``Y = float(A @ B) + C``), and ``Gemm``'s ``alpha`` multiplies
there too. A kernel multiplies 16-bit values exactly in float32 and accumulates in float32 (cuBLAS, MLAS, the
reference evaluator), so the result is the product rounded once, whatever the backend; a bias added in the low
precision would be rounded twice by some (``onnx.reference``) and its gradient summed in the low precision.
(torch's CPU bfloat16 convolution backward is not correctly rounded: tests/test_precision.py.) A result cast back
and read by another low-precision node is read in the low precision directly (``Cast(Cast(y, fp32), bf16) = y``).

**Dynamic loss scaling** (``fp16`` only; float16's range ends at 65504 and its subnormals at 6e-8, so small
gradients underflow), inside the step graph as ``torch.amp.GradScaler``: the loss's cotangent is seeded with
the carried ``scale`` (init :attr:`Precision.init_scale` = 2^16), so the backward computes ``scale * dL/dp``;
the gradients are multiplied by ``1 / scale`` before the update (the schedule helper's clipping, part of the
update nodes, sees unscaled gradients); if any gradient holds an infinite or NaN value the step is skipped:
parameters, optimizer state *and the step counter* keep their values (``Where``), as ``GradScaler.step`` skips
``optimizer.step()`` and ``torch.optim.Adam`` does not count a skipped step in its bias corrections; the
scale is multiplied by ``backoff_factor`` (0.5) and the count of good steps reset. After ``growth_interval``
(2000) good steps in a row the scale grows by ``growth_factor`` (2) if that stays finite
(``_amp_update_scale_`` in ``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp``). The scale (float32) and
the good-step count (int64) are carried state like the step (:meth:`TrainingGraph.carried`), saved in
checkpoints. bfloat16 has float32's range: no loss scaling, as PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import InputError
from ..ir import Graph, Node, ValueInfo, is_float_dtype
from ..onnx_io.value_types import infer_types
from ..warn import warn
from .graphbuild import Builder

#: The precisions of a training step (the CLI's ``--precision`` choices read this).
PRECISIONS = ("fp32", "bf16", "fp16")

#: ONNX element type of each low precision.
LOW_TYPES = {"bf16": onnx.TensorProto.BFLOAT16, "fp16": onnx.TensorProto.FLOAT16}

#: The nodes that run in the low precision (autocast's lower-precision list in ONNX ops), and the position of
#: the bias each may have (added in float32 after the product: module doc), or ``None``.
LOW_PRECISION_OPS = {"MatMul": None, "Gemm": 2, "Conv": 2, "ConvTranspose": 2, "Einsum": None, "Attention": None}

_F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class Precision:
    """A training step's precision and, for ``"fp16"``, its dynamic loss scaling (module doc; the defaults
    are ``torch.amp.GradScaler``'s). Raises :class:`InputError` (one line) for an unknown kind or scaling
    values out of range (``init_scale`` finite and > 0, ``growth_factor`` > 1, ``backoff_factor`` in (0, 1),
    ``growth_interval`` >= 1)."""

    kind: str = "fp32"
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if self.kind not in PRECISIONS:
            raise InputError(f"unknown precision {self.kind!r} (--precision, precision=); choose one of "
                             f"{', '.join(PRECISIONS)}")
        checks = [(np.isfinite(self.init_scale) and self.init_scale > 0, "init-scale", self.init_scale,
                   "a positive number"),
                  (np.isfinite(self.growth_factor) and self.growth_factor > 1, "growth-factor", self.growth_factor,
                   "a number above 1"),
                  (0 < self.backoff_factor < 1, "backoff-factor", self.backoff_factor, "in (0, 1)"),
                  (int(self.growth_interval) == self.growth_interval and self.growth_interval >= 1,
                   "growth-interval", self.growth_interval, "a whole number >= 1")]
        for ok, name, value, need in checks:
            if not ok:
                raise InputError(f"--{name} {value:g} ({name.replace('-', '_')}=, the fp16 loss scaling) must be "
                                 f"{need}")

    @property
    def low(self) -> int | None:
        """The ONNX element type of the low precision (``None`` for fp32)."""
        return LOW_TYPES.get(self.kind)

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled dynamically (fp16)."""
        return self.kind == "fp16"


def make_precision(value: str | Precision | None) -> Precision:
    """``value`` as a :class:`Precision` (a name of :data:`PRECISIONS`, or ``None`` for fp32)."""
    if isinstance(value, Precision):
        return value
    return Precision("fp32" if value is None else value)


# ---------------------------------------------------------------------------------------------- autocast


def autocast(model: Graph, precision: Precision | str) -> tuple[Graph, int]:
    """A copy of ``model`` (SSA) whose :data:`LOW_PRECISION_OPS` nodes run in the low precision (module doc),
    and how many nodes were rewritten. Only float32 operands are cast (float64 products stay float64); nodes
    inside ``Loop``/``If``/``Scan`` bodies stay float32. ``fp32``: the model unchanged."""
    prec = make_precision(precision)
    if prec.low is None:
        return model, 0
    g = model.copy()
    types = infer_types(g)
    dtype = {k: np.asarray(a).dtype for k, a in g.initializers.items()}
    dtype.update((k, vi.dtype) for k, vi in types.items() if vi.dtype is not None)
    b = Builder(g.names_in_use())
    b.prefix = f"autocast/{prec.kind}"
    low: dict[str, str] = {}  # float32 value -> its low-precision copy (one Cast per value, or the original)
    rank = {k: len(vi.shape) for k, vi in types.items() if vi.shape is not None}
    rank.update((k, np.asarray(a).ndim) for k, a in g.initializers.items())
    count = 0
    for node in g.nodes:
        bias_at = LOW_PRECISION_OPS.get(node.op_type, -1) if node.domain in ("", "ai.onnx") else -1
        given = [i for i in node.inputs if i]  # float32 operands are cast; integer and bool ones (a mask) stay
        known = all(dtype.get(i) is not None for i in given)
        floats = [i for i in given if known and is_float_dtype(dtype[i])]
        if bias_at == -1 or node.subgraphs or not floats or any(dtype[i] != _F32 for i in floats):
            b.nodes.append(node)
            continue
        bias = node.inputs[bias_at] if bias_at is not None and len(node.inputs) > bias_at else ""
        if bias and node.op_type != "Gemm" and rank.get(node.inputs[1]) is None:
            bias = ""  # (a Conv bias is reshaped by the weight's rank; unknown: it stays in the node)
        count += 1
        inputs = list(node.inputs)
        if bias:
            inputs = inputs[:bias_at]
        for k, v in enumerate(inputs):
            if v and dtype[v] == _F32:
                if v not in low:
                    low[v] = b.op("Cast", [v], to=prec.low)
                inputs[k] = low[v]
        outputs = []
        for out in node.outputs:
            if not out or (types.get(out) and types[out].dtype not in (None, _F32)):
                outputs.append(out)
                continue
            lo = b.fresh(f"{out}.{prec.kind}")
            outputs.append(lo)
        attrs = dict(node.attrs)
        alpha = float(attrs.pop("alpha", 1.0)) if node.op_type == "Gemm" else 1.0  # (scaled in float32 too)
        if bias and node.op_type == "Gemm":
            attrs.pop("beta", None)
        b.nodes.append(Node(node.op_type, inputs, outputs, attrs, node.name, node.domain))
        for out, lo in zip(node.outputs, outputs, strict=True):
            if out == lo:
                continue
            if not ((bias or alpha != 1.0) and out == node.outputs[0]):
                b.nodes.append(Node("Cast", [lo], [out], {"to": onnx.TensorProto.FLOAT}, b.fresh(f"{b.prefix}/Cast")))
                low[out] = lo  # read again in the low precision: the exact value, no second Cast
                continue
            product = b.op("Cast", [lo], to=onnx.TensorProto.FLOAT)
            if alpha != 1.0:
                product = b.op("Mul", [product, b.const(alpha, np.float32)])
            if not bias:
                b.nodes.append(Node("Identity", [product], [out], name=b.fresh(f"{b.prefix}/Identity")))
                continue
            c = bias
            if node.op_type == "Gemm":
                beta = float(node.attrs.get("beta", 1.0))
                if beta != 1.0:
                    c = b.op("Mul", [c, b.const(beta, np.float32)])
            else:  # [M] against [N, M, spatial...]: unsqueeze the spatial axes
                c = b.op("Unsqueeze", [c, b.const(list(range(1, rank[node.inputs[1]] - 1)), np.int64)])
            b.nodes.append(Node("Add", [product, c], [out], name=b.fresh(f"{b.prefix}/Add")))
    g.nodes = b.nodes  # (a shared constant is emitted where it is first needed: before every reader)
    if not count:
        warn(f"precision {prec.kind}: the model has no float32 {', '.join(LOW_PRECISION_OPS)} node; "
             "the whole step runs in float32")
    return g, count


# ---------------------------------------------------------------------------------------------- loss scaling


@dataclass
class LossScale:
    """The names of the fp16 loss scaling in a training graph (module doc): inputs ``scale`` (float scalar)
    and ``growth`` (int64 scalar, good steps since the scale last changed), outputs ``new_scale`` and
    ``new_growth``; ``found`` the bool scalar that is true when a gradient was not finite (the step skipped)."""

    precision: Precision
    scale: str
    growth: str
    new_scale: str = ""
    new_growth: str = ""
    found: str = ""
    dtype: np.dtype = _F32

    def pairs(self) -> list[tuple[str, str]]:
        """The carried ``(input, output)`` pairs: the scale and the good-step count."""
        return [(self.scale, self.new_scale), (self.growth, self.new_growth)]

    def initial(self) -> dict[str, np.ndarray]:
        """Their first values: ``init_scale`` and 0."""
        return {self.scale: np.array(self.precision.init_scale, dtype=self.dtype),
                self.growth: np.array(0, dtype=np.int64)}


def seed_with_scale(gg: Graph, seed: str, keep_seed: bool, prec: Precision, loss_dtype) -> LossScale:
    """Make the loss cotangent of ``gg`` (the gradient graph, seeded by its input ``seed``) ``scale`` times
    the seed: the carried input ``scale`` replaces ``seed`` (``keep_seed``: ``seed * scale``, the seed stays an
    input). Returns the :class:`LossScale` names (its outputs are set by :func:`add_loss_scaling`)."""
    b = Builder(gg.names_in_use())
    scaling = LossScale(prec, b.fresh("loss_scale"), b.fresh("loss_scale.good_steps"), dtype=np.dtype(loss_dtype))
    at = next(k for k, v in enumerate(gg.inputs) if v.name == seed)
    gg.inputs.insert(at + 1, ValueInfo(scaling.scale, scaling.dtype, ()))
    if keep_seed:
        b.prefix = "loss_scale"
        value = b.op("Mul", [seed, scaling.scale])
        gg.nodes.insert(0, b.nodes[0])
    else:
        value = scaling.scale
        del gg.inputs[at]
    for _, n in gg.walk():
        if n.outputs[:1] != [value]:
            n.inputs = [value if i == seed else i for i in n.inputs]
    return scaling


# ---------------------------------------------------------------------------------------------- checks, CLI


def check_combination(prec: Precision, device_kind: str, graph: Graph) -> None:
    """Refuse (:class:`InputError`, one line) a step ``graph`` that computes in a low precision on the CPU:
    onnxruntime's CPU provider (x86-64, 1.32) has no bfloat16 kernel for ``MatMul``, ``Gemm`` or ``Conv`` (it
    refuses the graph), and none for float16 either: it runs those nodes in float32 and drops the ``Cast`` pairs
    around them, so the step would compute in float32 without float16's rounding or overflow, a silently
    different result. (A graph without a low-precision node, fp16 loss scaling alone, runs.) The graphs run on
    the CPU with ``onnx.reference`` (``revgraph.Session(graph, backend="reference")``)."""
    low = any(n.op_type == "Cast" and n.attrs.get("to") == prec.low for n in graph.nodes)
    if low and device_kind == "cpu":
        raise InputError(f"--precision {prec.kind} (precision={prec.kind!r}) needs --device cuda: onnxruntime's CPU "
                         f"provider has no {'bfloat16' if prec.kind == 'bf16' else 'float16'} MatMul, Gemm or Conv "
                         "kernel (training_graph(..., precision=) still writes the step graph)")
