"""VJP of onnxruntime's ``com.microsoft`` ``MatMulNBits``, a matrix product with a block-quantized weight: a
frozen base (onnxruntime docs/ContribOperators.md; ``onnxruntime/core/graph/contrib_ops/contrib_defs.cc``; the
CPU kernel ``contrib_ops/cpu/quantization/matmul_nbits.cc``). The forward keeps the node, which onnxruntime runs;
the VJP is standard ONNX operators.

``Y = A @ W^T (+ bias)`` with ``A [..., K]`` and the logical weight ``W [N, K]`` dequantized block-wise along K:
``W[n, k] = (q[n, k] - zp[n, k // block_size]) * scales[n, k // block_size]``. ``B [N, k_blocks, blob_size]``
(uint8) holds ``q`` packed low bits first (``bits`` of 2, 4 or 8; ``8 / bits`` values a byte); ``zero_points``
are uint8 packed the same way along the blocks (``[N, ceil(k_blocks * bits / 8)]``), or of A's dtype
(``[N, k_blocks]``), or absent (``2^(bits - 1)``). K may stop inside the last block: ``W`` is cut to K columns.

The weight is frozen: ``B``, ``scales`` and ``zero_points`` receive no gradient (a LoRA adapter beside the node
is what trains; asking for the gradient of float scales or zero points is refused in one line), ``dA = dY @ W`` with
``W`` dequantized in the backward graph (``Div``/``Mod`` of the bytes, as integers; constant-folded by onnxruntime when
the weight is an initializer), and ``dbias = sum(dY)``. ``accuracy_level`` is the minimum precision of A's computation
(the docs): at 4 the CPU kernel quantizes A to int8 per block, and its forward differs from the exact product by about
1e-3 relative (measured on the genai builder's int4 LLaMA, whose gradients equal PyTorch's of the dequantized weights to
3e-7 at level 0). It is a precision setting, as TF32 products are, not a rounding in the model's math: the VJP is the
exact product's. Refused in one line: ``weight_prepacked`` (an execution provider's private layout), the deprecated
``g_idx``, ``bits`` other than 2, 4 and 8.
"""

from __future__ import annotations

import numpy as np

from ...errors import GraphError
from ...ir import Node
from ...ir.contrib_types import MS
from ..algebra import Val
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from ._common import optional_input

#: the weight widths whose packing the rule unpacks (the kernels' too)
BITS = (2, 4, 8)


def _unpack(e: Emitter, packed: str, bits: int, count: int, lead: list[int]) -> str:
    """The ``bits``-wide unsigned values packed low bits first along the last axis of the uint8 ``packed``
    (``lead + [bytes]``), as int32 of shape ``lead + [count]`` (the first ``count`` of them)."""
    b = e.op("Cast", [packed], to=6)  # int32: Div and Mod of the bytes as integers
    per = 8 // bits
    if per > 1:
        shifts = e.const(np.asarray([1 << (bits * i) for i in range(per)], np.int32))
        b = e.op("Mod", [e.op("Div", [e.op("Unsqueeze", [b, e.ints([-1])]), shifts]),
                         e.const(np.asarray(1 << bits, np.int32))])
        b = e.op("Reshape", [b, e.ints([*lead, -1])])
    return e.op("Slice", [b, e.ints([0]), e.ints([count]), e.ints([-1])])


def _as(e: Emitter, x: str, like: str) -> str:
    """``x`` in ``like``'s dtype (``CastLike`` when that dtype is unknown)."""
    to = e.onnx_dtype(like)
    return e.op("Cast", [x], to=to) if to is not None else e.op("CastLike", [x, like])


def dequantized(e: Emitter, node: Node) -> str:
    """``W [N, K]`` of a ``MatMulNBits`` node in the dtype of its scales (module doc), emitted in the backward
    graph."""
    a = node.attrs
    n, k, block, bits = int(a["N"]), int(a["K"]), int(a["block_size"]), int(a.get("bits", 4))
    blocks = -(-k // block)
    b, scales = node.inputs[1], node.inputs[2]
    zp = optional_input(node, 3)
    q = _as(e, _unpack(e, b, bits, block, [n, blocks]), scales)  # [N, blocks, block]
    if zp is None:
        zero = e.scalar(float(1 << (bits - 1)), scales)
    elif e.dtype(zp) == np.uint8:
        zero = e.op("Unsqueeze", [_as(e, _unpack(e, zp, bits, blocks, [n]), scales), e.ints([-1])])
    else:
        zero = e.op("Unsqueeze", [zp, e.ints([-1])])
    w = e.op("Mul", [e.op("Sub", [q, zero]), e.op("Unsqueeze", [scales, e.ints([-1])])])
    w = e.op("Reshape", [w, e.ints([n, blocks * block])])
    if blocks * block != k:
        w = e.op("Slice", [w, e.ints([0]), e.ints([k]), e.ints([1])])
    return w


def _check(e: Emitter, node: Node) -> None:
    """Refuse the attributes and inputs the rule does not cover, in one line naming the node."""
    a = node.attrs
    for attr in ("N", "K", "block_size"):
        if attr not in a:
            raise GraphError(f"{node.label()}: MatMulNBits needs the attribute {attr}")
    bits = int(a.get("bits", 4))
    if bits not in BITS:
        raise GraphError(f"{node.label()}: MatMulNBits with bits={bits} is not supported (bits 2, 4 or 8)")
    if int(a.get("weight_prepacked", 0)):
        raise GraphError(f"{node.label()}: MatMulNBits with weight_prepacked={a['weight_prepacked']} (an execution "
                         "provider's private layout) cannot be dequantized; export with weight_prepacked=0")
    if optional_input(node, 4) is not None:
        raise GraphError(f"{node.label()}: MatMulNBits with the deprecated g_idx input is not supported")
    if e.dtype(node.inputs[1]) not in (None, np.dtype(np.uint8)):
        raise GraphError(f"{node.label()}: MatMulNBits needs a uint8 B, got {e.dtype(node.inputs[1])}")


@vjp("MatMulNBits", domain=MS, bounded=True, finite=True, reads=(1, 2, 3), mixing=True)
def matmul_nbits(ctx: Ctx, node: Node, cts: list) -> list:
    """``A @ dequantize(B)^T + bias`` (module doc): ``dA = dY @ W``, ``dbias = sum(dY)``; the packed weight,
    scales and zero points are frozen (no gradient)."""
    e, g = ctx.e, cts[0]
    _check(e, node)
    x = node.inputs[0]
    bias = optional_input(node, 5)

    def da() -> str:
        dims = e.dims(node.inputs[1])
        if dims is not None and 0 in dims:  # an omitted projection: Y is the bias alone
            return e.zeros_like(x)
        return e.op("MatMul", [g, dequantized(e, node)], like=x)

    grads = [da, None, frozen(node, 2, "scales"), frozen(node, 3, "zero_points"), None,
             None if bias is None else lambda: Val(ctx, g).reduce_to(bias)]
    return grads[:len(node.inputs)]


def frozen(node: Node, i: int, what: str):
    """The cotangent of a frozen float input ``i`` of a quantized product: asking for it is refused in one line
    (the backward pass calls this only when that input is differentiated)."""

    def refuse() -> None:
        raise GraphError(f"{node.label()}: {node.op_type} is a frozen base: its {what} ({node.inputs[i]!r}) get no "
                         "gradient; leave them out of the parameters (--freeze) and train a LoRA adapter beside the "
                         "node (--lora)")

    return refuse
