"""Where graphs run: ``--device cpu|cuda[:i]`` as onnxruntime execution providers and device buffers.

``cpu`` is onnxruntime's ``CPUExecutionProvider``. ``cuda[:i]`` is its ``CUDAExecutionProvider`` on device
``i`` (default 0), with the CPU provider behind it for the operators CUDA lacks; it needs the
``onnxruntime-gpu`` package (``pip install "revgraph[cuda]"``). Buffers that live across runs (parameters,
optimizer state, gradients) are ``OrtValue``s allocated on the device, so a training step copies only the
batch in and the loss out. Nothing here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .errors import RevgraphError

CUDA_HINT = 'install onnxruntime-gpu in place of onnxruntime (pip install "revgraph[cuda]") on a machine with a CUDA GPU'


@dataclass(frozen=True)
class Device:
    """A device for onnxruntime: ``kind`` ``"cpu"`` or ``"cuda"``, ``index`` the CUDA device ordinal (0 on CPU)."""

    kind: str = "cpu"
    index: int = 0

    @classmethod
    def parse(cls, spec: str | Device | None) -> Device:
        """``"cpu"``, ``"cuda"`` or ``"cuda:<i>"`` (a :class:`Device` passes through; ``None`` is the CPU).
        Raises :class:`RevgraphError` (one line) for anything else."""
        if spec is None:
            return cls()
        if isinstance(spec, Device):
            return spec
        m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", str(spec).strip())
        if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
            raise RevgraphError(f"unknown device {spec!r}; use cpu, cuda or cuda:<index>")
        return cls(m.group(1), int(m.group(2) or 0))

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def ort_type(self) -> str:
        """The device name onnxruntime's ``OrtValue`` and ``IOBinding`` take."""
        return self.kind

    def providers(self) -> list:
        """The ``providers`` argument of ``onnxruntime.InferenceSession``. Raises :class:`RevgraphError` when
        the installed onnxruntime has no CUDA provider."""
        if self.kind == "cpu":
            return ["CPUExecutionProvider"]
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RevgraphError(f"--device {self} needs onnxruntime's CUDAExecutionProvider, which this onnxruntime "
                                f"lacks (it has {', '.join(ort.get_available_providers())}): {CUDA_HINT}")
        return [("CUDAExecutionProvider", {"device_id": self.index}), "CPUExecutionProvider"]

    def ortvalue(self, array: np.ndarray):
        """A new ``OrtValue`` on this device holding a copy of ``array`` (on the CPU it wraps a fresh copy,
        so the caller's array is never written)."""
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(np.array(array, order="C"), self.ort_type, self.index)

    def torch(self) -> str:
        """The matching ``torch.device`` string (``"cpu"``, ``"cuda:<i>"``), for collectives on device buffers."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"
