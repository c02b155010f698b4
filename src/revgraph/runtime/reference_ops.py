"""Corrections to kernels of ``onnx.reference`` (onnx 1.23) that disagree with the ONNX operator spec or lose
precision, passed to ``ReferenceEvaluator(new_ops=...)`` by :class:`revgraph.Session`. ``revgraph check`` falls
back to this evaluator where onnxruntime has no float64 kernel, so every kernel here must be exact in float64.
``Loop`` and ``LRN`` keep onnx's implementation and change only what the spec says differently; the others are
written from the spec:

* ``Loop``: an omitted condition input means "no condition" (onnx's kernel runs no iteration); scan outputs
  are stacked on a new axis 0 (onnx's kernel concatenates per-iteration outputs of rank >= 2 along their
  own axis 0); a loop that runs no iteration returns empty scan outputs of shape ``[0, ...]`` (onnx's kernel
  fails with "need at least one array to concatenate").
* ``LRN``: the sum of squares runs over the channels around each channel (onnx's kernel loops over the batch
  axis instead).
* ``Erf``: computed in the input's precision (onnx's kernel rounds every value to float32, so float64 central
  differences of a graph with ``Erf`` measured float32 noise: ~1e-7 / 1e-6 = 10% errors); ``Gelu``, whose
  onnx implementation is its function body (an ``Erf``, or float32 constants for ``approximate="tanh"``), is
  the spec formula in the input's precision too. Both use ``math.erf`` (correctly rounded to ~1 ulp in float64).
* ``OneHot``: a non-integer ``depth`` or ``indices`` is cast to int64 before use, as the spec says (onnx's kernel
  makes ``np.arange(depth)`` classes, 11 for a depth of 10.000001, and matches float indices exactly).
* ``Resize`` with ``coordinate_transformation_mode="align_corners"`` and ``scales``: ``length_resized`` is the
  length of the resized tensor, ``floor(length_original * scale)``, as the spec defines it and onnxruntime
  computes it (onnx's kernel uses the fractional ``length_original * scale``: for a scale of 0.8 on 4 pixels,
  output positions 0, 1.36, 2.73 instead of 0, 1.5, 3).
* ``GatherElements``: ``indices`` may be smaller than ``data`` along every axis, not only ``axis`` (the output
  has the shape of ``indices``; onnx's kernel requires equal sizes outside ``axis`` and, through
  ``np.choose``, at most 64 entries along it: BERT's 512 positions failed).
* ``Attention`` without a ``scale``: the default ``1/sqrt(head_size)`` in float32, as the spec's function body
  and onnxruntime compute it (onnx's kernel computes it in float64, so float64 models ran another forward on
  each runtime, 1e-7 apart: issue 27); the factor applied to Q and K is its square root in float32, cast to
  Q's dtype, as both do with an explicit ``scale`` (a float32 attribute).
* ``ReduceLogSumExp``: a group that is all ``-inf`` gives ``log(0) = -inf`` (onnx's kernel subtracts the
  maximum, ``-inf - -inf``, and gives NaN: a fully masked row); computed as ``m + log(sum(exp(x - m)))`` with
  ``m`` the group's maximum where it is finite, 0 elsewhere (+inf and NaN propagate as the spec's formula).
* ``Unique`` with ``sorted=0``: the unique values in the order of their first occurrence in the flattened input
  (or along ``axis``) for any number of outputs (onnx's kernel sorts them when only ``Y`` is asked for, and
  reads them along axis 0 of the unflattened input otherwise); reproduction in :class:`Unique`.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_attention import Attention_23 as _OnnxAttention
from onnx.reference.ops.op_loop import Loop as _OnnxLoop
from onnx.reference.ops.op_lrn import LRN as _OnnxLRN
from onnx.reference.ops.op_resize import Resize as _OnnxResize


class Loop(_OnnxLoop):
    op_domain = ""

    def _empty_scan_output(self, k: int) -> np.ndarray:
        """A stacked scan output of zero iterations: shape [0, *declared per-iteration shape]."""
        body = next(a.g for a in self.onnx_node.attribute if a.name == "body")
        t = body.output[1 + self.N + k].type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type) if t.elem_type else np.float32
        return np.empty((0, *dims), dtype=dtype)

    def _run(self, M, cond, *args, context=None, body=None, attributes=None, bindings=None):
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


class Erf(OpRun):
    op_domain = ""

    def _run(self, x):
        return (_erf(x),)


class Gelu(OpRun):
    op_domain = ""

    def _run(self, x, approximate=None):
        """ONNX "Gelu" (opset 20): ``0.5 x (1 + erf(x / sqrt(2)))``, or with ``approximate="tanh"``
        ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``, with the constants in the input's precision."""
        if (approximate or "none") == "tanh":
            y = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
        else:
            y = 0.5 * x * (1 + _erf(x / math.sqrt(2)))
        return (np.asarray(y, dtype=x.dtype),)


def _erf(x: np.ndarray) -> np.ndarray:
    """The error function elementwise, in the precision of ``x`` (``math.erf`` works in float64)."""
    x = np.asarray(x)
    return np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype) if x.size else x.copy()


class GatherElements(OpRun):
    op_domain = ""

    def _run(self, data, indices, axis=None):
        """ONNX "GatherElements": ``out[i][j][k] = data[indices[i][j][k]][j][k]`` for ``axis = 0`` (and
        likewise for other axes), for every position of ``indices``; negative indices count from the end."""
        axis = (axis or 0) % data.ndim
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + data.shape[axis], idx)
        window = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(idx.shape))
        return (np.take_along_axis(data[window], idx, axis=axis),)


class Resize(_OnnxResize):
    op_domain = ""

    def _run(self, X, roi, scales=None, sizes=None, **attrs):
        if (attrs.get("coordinate_transformation_mode") == "align_corners" and scales is not None
                and np.size(scales) and not attrs.get("antialias")):
            axes = attrs.get("axes") or range(X.ndim)
            lengths = np.array([X.shape[a] for a in axes], dtype=np.float64)
            # the output lengths the spec gives (floor(length * scale)), passed as sizes so that onnx's kernel
            # uses them as length_resized
            sizes = np.floor(lengths * np.asarray(scales, dtype=np.float64)).astype(np.int64)
            scales = None
        return super()._run(X, roi, scales, sizes, **attrs)


class OneHot(OpRun):
    op_domain = ""

    def _run(self, indices, depth, values, axis=None):
        """ONNX "OneHot": ``values[1]`` where the class along the new axis ``axis`` equals the index (negative
        indices count from ``depth``; others outside ``[-depth, depth)`` give a row of ``values[0]``)."""
        depth = int(np.asarray(depth).reshape(-1)[0])
        idx = np.asarray(indices).astype(np.int64)
        idx = np.where(idx < 0, idx + depth, idx)
        axis = -1 if axis is None else axis
        axis = axis + idx.ndim + 1 if axis < 0 else axis
        classes = np.arange(depth).reshape((-1,) + (1,) * (idx.ndim - axis))
        hot = np.expand_dims(idx, axis) == classes
        off, on = values[0], values[1]
        return (np.where(hot, on, off).astype(values.dtype),)


class Attention(_OnnxAttention):
    op_domain = ""

    def _run(self, Q, K, V, *args, scale=None, q_num_heads=None, **attrs):
        """ONNX "Attention" (opsets 23-25) with the default scale computed as the spec's function body does
        (module doc); everything else is onnx's kernel (its opset-23 checks)."""
        if scale is None:
            head = Q.shape[-1] if Q.ndim == 4 else Q.shape[-1] // int(q_num_heads)
            scale = np.float32(1.0) / np.sqrt(np.float32(head))
        return super()._run(Q, K, V, *args, scale=scale, q_num_heads=q_num_heads, **attrs)


class ReduceLogSumExp(OpRun):
    op_domain = ""

    def _run(self, data, axes=None, keepdims=1, noop_with_empty_axes=0):
        """ONNX "ReduceLogSumExp" (``axes`` an input since opset 18, an attribute before): ``log(sum(exp(x)))``
        over ``axes`` (every axis when none are given, unless ``noop_with_empty_axes``), stable and exact at
        ``-inf`` groups (module doc)."""
        axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        if not axes:
            if noop_with_empty_axes:
                return (data,)
            axes = list(range(data.ndim))
        tax = tuple(a + data.ndim if a < 0 else a for a in axes)
        if data.size == 0:
            shape = [1 if i in tax else d for i, d in enumerate(data.shape)]
            out = np.full(shape, -np.inf, data.dtype)
        else:
            top = np.max(data, axis=tax, keepdims=True)
            shift = np.where(np.isfinite(top), top, 0).astype(data.dtype)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                out = (np.log(np.sum(np.exp(data - shift), axis=tax, keepdims=True)) + shift).astype(data.dtype)
        return (out if keepdims else np.squeeze(out, axis=tax),)


class Unique(OpRun):
    """ONNX "Unique" with ``sorted=0`` as the spec (and onnxruntime) define it; onnx 1.23.2's kernel
    (``onnx/reference/ops/op_unique.py``) has two bugs there, reported with this reproduction::

        import numpy as np
        from onnx import TensorProto, helper as h
        from onnx.reference import ReferenceEvaluator

        x = np.array([[2.0, 1.0], [2.0, 3.0]], np.float32)

        def unique(outputs, **attrs):
            node = h.make_node("Unique", ["x"], outputs, sorted=0, **attrs)
            graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                                 [h.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs])
            return ReferenceEvaluator(h.make_model(graph)).run(None, {"x": x})

        unique(["y"])       # [1, 2, 3]: sorted=0 is ignored with one output (expected [2, 1, 3])
        unique(["y", "i"])  # IndexError: index 3 is out of bounds for axis 0 with size 2 (expected
                            # [2, 1, 3], [0, 1, 3]): the values are read with np.take(x, indices, axis=0)
                            # from the unflattened x (and along axis 0, not ``axis``, when ``axis`` is given)

    Here: ``np.unique`` of the flattened ``x`` (``axis`` absent) or of its slices along ``axis``, then, for
    ``sorted=0``, the unique values reordered by first occurrence (``indices`` ascending, ``inverse_indices``
    renumbered, ``counts`` permuted alike) and read from the same flattened ``x`` or along the same ``axis``."""

    op_domain = ""

    def _run(self, x, axis=None, sorted=1):
        data, ax = (x.reshape(-1), 0) if axis is None else (x, int(axis))
        y, indices, inverse, counts = np.unique(data, return_index=True, return_inverse=True,
                                                return_counts=True, axis=None if axis is None else ax)
        inverse = inverse.reshape(-1)  # (numpy 2 shapes it like the input)
        if not sorted:
            order = np.argsort(indices, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            indices, counts, inverse = indices[order], counts[order], rank[inverse]
            y = np.take(data, indices, axis=ax)
        out = (y, *(np.asarray(a, dtype=np.int64) for a in (indices, inverse, counts)))
        return out[:len(self.onnx_node.output)]


FIXED_OPS = [Loop, LRN, Erf, Gelu, GatherElements, OneHot, Resize, ReduceLogSumExp, Attention, Unique]
