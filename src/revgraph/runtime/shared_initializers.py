"""One buffer per frozen weight for every onnxruntime session of a training engine on the CPU: held once, not once
per session.

Why: onnxruntime copies a model's initializers into each session it makes, and prepacks them (and, with graph
optimizations on, folds expressions of them) into more copies. A training engine makes several sessions: the grad
graph or the fused step graph, the evaluation graph, and under ``--shard`` or overlap one per segment of the
backward. The trainable parameters are graph inputs bound to the engine's buffers, so they were never copied; the
initializers (a LoRA fine-tune's frozen base weights, any frozen layer) were. Measured on a LoRA MLP with 96 MiB of
frozen weights (``python bench/frozen_memory.py``): building the Trainer added 765 MB of resident memory, 8 times
the weights (the evaluation session 423 MB, the grad graph's 257 MB: the serialized model, onnxruntime's parsed
copy, its own tensors, its prepacked ``MatMul`` operands).

How: such an initializer becomes a graph input of the session's model (:meth:`SharedInitializers.split`), bound on
every run to an ``OrtValue`` over the graph's own numpy array (``OrtValue.ortvalue_from_numpy`` wraps a C-contiguous
CPU array without copying it), as the parameters are: :class:`FrozenInputs` hands out IO bindings with them bound
already. Every session reads the one array, which the graph held anyway. onnxruntime's other ways were measured
and copy: ``SessionOptions.add_external_initializers`` copies each tensor into the session (one copy per session
even with prepacking and every optimization off), and ``add_initializer`` over an initializer of the model is
folded from the model's bytes first (a ``Transpose`` of it computed from the old values).

What is shared: top-level float initializers of at least :data:`SHARE_BYTES` bytes that no node reads as an input
onnxruntime wants constant for its kernels (:data:`KEEP_CONSTANT`: quantized weights and their scales, for the
fused ``MatMulNBits``; convolution weights, for the NCHWc layout). The cost: onnxruntime no longer prepacks these
``MatMul`` operands, as it never did the parameters' (1.03x the step time at 64 rows a batch, 1.15x at 8:
bench/frozen_memory.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ir import ValueInfo

#: Initializers of at least this many bytes are shared (smaller ones cost less than their binding).
SHARE_BYTES = 1024
#: Operators whose initializer inputs onnxruntime's kernels or fusions need constant (module doc): such an
#: initializer stays one.
KEEP_CONSTANT = frozenset({
    "DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear", "MatMulNBits", "GatherBlockQuantized",
    "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul", "QLinearConv", "ConvInteger",
    "Conv", "ConvTranspose", "FusedConv", "QAttention", "QOrderedMatMul",
})


class SharedInitializers:
    """The ``OrtValue`` of each shared initializer array, made once per array for all the sessions of an engine."""

    def __init__(self):
        self._values: dict[tuple[str, int], tuple[np.ndarray, object]] = {}

    def split(self, graph):
        """``(graph with its shared initializers as inputs, {name: OrtValue})`` (module doc): ``graph`` itself and
        ``{}`` when none is shared. An array is wrapped once: two graphs holding the same array object share its
        ``OrtValue``; another array of the same name gets its own."""
        import onnxruntime as ort

        constant = {r for _, node in graph.walk() if node.op_type in KEEP_CONSTANT for r in node.inputs}
        outputs = set(graph.output_names)
        shared = {}
        for name, arr in graph.initializers.items():
            if (name in constant or name in outputs or not isinstance(arr, np.ndarray) or arr.nbytes < SHARE_BYTES
                    or arr.dtype.kind != "f" or not arr.flags.c_contiguous):  # (a broadcast placeholder is not)
                continue
            key = (name, id(arr))
            if key not in self._values:  # (the array is kept with its OrtValue: its id stays its own)
                self._values[key] = (arr, ort.OrtValue.ortvalue_from_numpy(arr))
            shared[name] = self._values[key][1]
        if not shared:
            return graph, {}
        declared = set(graph.input_names)
        inputs = [*graph.inputs, *(ValueInfo(n, graph.initializers[n].dtype, list(graph.initializers[n].shape))
                                   for n in shared if n not in declared)]
        rest = {n: a for n, a in graph.initializers.items() if n not in shared}
        return dataclasses.replace(graph, inputs=inputs, initializers=rest), shared


class FrozenInputs:
    """An ``onnxruntime.InferenceSession`` whose :meth:`io_binding` comes with the shared initializers bound
    (``values``: name -> ``OrtValue``); everything else is the session's."""

    def __init__(self, session, values: dict):
        self._session, self._values = session, values

    def io_binding(self):
        binding = self._session.io_binding()
        for name, value in self._values.items():
            binding.bind_ortvalue_input(name, value)
        return binding

    def __getattr__(self, name):
        return getattr(self._session, name)
