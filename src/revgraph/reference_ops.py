"""Corrections to kernels of ``onnx.reference`` (onnx 1.23) that disagree with the ONNX operator spec, passed to
``ReferenceEvaluator(new_ops=...)`` by :class:`revgraph.Session`. Each class keeps onnx's implementation and
changes only what the spec says differently:

* ``Loop``: an omitted condition input means "no condition" (onnx's kernel runs no iteration); scan outputs
  are stacked on a new axis 0 (onnx's kernel concatenates per-iteration outputs of rank >= 2 along their
  own axis 0); a loop that runs no iteration returns empty scan outputs of shape ``[0, ...]`` (onnx's kernel
  fails with "need at least one array to concatenate").
* ``LRN``: the sum of squares runs over the channels around each channel (onnx's kernel loops over the batch
  axis instead).
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper
from onnx.reference.ops.op_loop import Loop as _OnnxLoop
from onnx.reference.ops.op_lrn import LRN as _OnnxLRN


class Loop(_OnnxLoop):
    op_domain = ""

    def _empty_scan_output(self, k: int) -> np.ndarray:
        """A stacked scan output of zero iterations: shape [0, *declared per-iteration shape]."""
        body = next(a.g for a in self.onnx_node.attribute if a.name == "body")
        t = body.output[1 + self.N + k].type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type) if t.elem_type else np.float32
        return np.empty((0, *dims), dtype=dtype)

    def _run(self, M, cond, *args, context=None, body=None, attributes=None, bindings=None):  # noqa: ARG002
        body = self.body
        names = body.input_names
        inputs = dict.fromkeys(names)
        for name, value in zip(names[2:], args, strict=False):
            inputs[name] = value
        if context is not None:
            inputs.update({k: v for k, v in context.items() if k not in names})
        cond = np.array(True) if cond is None else cond
        scans: list[list[np.ndarray]] = [[] for _ in range(self.K)]
        carried = list(args[: self.N])
        it = 0
        while bool(cond) and (M is None or it < int(M)):
            inputs[names[0]] = np.array(it, dtype=np.int64)
            inputs[names[1]] = np.array(cond)
            outputs = self._run_body(inputs, attributes=attributes, bindings=bindings)
            cond = outputs[0]
            carried = list(outputs[1 : 1 + self.N])
            for k in range(self.K):
                scans[k].append(np.asarray(outputs[1 + self.N + k]))
            for name, value in zip(names[2:], carried, strict=True):
                inputs[name] = value
            it += 1
        stacked = [np.stack(s) if s else self._empty_scan_output(k) for k, s in enumerate(scans)]
        return tuple(carried + stacked)


class LRN(_OnnxLRN):
    op_domain = ""

    def _run(self, x, alpha=None, beta=None, bias=None, size=None):
        square_sum = np.zeros(x.shape, dtype=x.dtype)
        channels = x.shape[1]
        before, after = math.floor((size - 1) / 2), math.ceil((size - 1) / 2) + 1
        for c in range(channels):
            lo, hi = max(0, c - before), min(channels, c + after)
            square_sum[:, c] = np.sum(x[:, lo:hi] ** 2, axis=1)
        return ((x / (bias + (alpha / size) * square_sum) ** beta).astype(x.dtype),)


FIXED_OPS = [Loop, LRN]
