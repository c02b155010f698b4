"""Where graphs run: ``--device cpu|cuda[:i]`` as onnxruntime execution providers and device buffers.

``cpu`` is onnxruntime's ``CPUExecutionProvider``. ``cuda[:i]`` is its ``CUDAExecutionProvider`` on device
``i`` (default 0), with the CPU provider behind it for the operators CUDA lacks; it needs the
``onnxruntime-gpu`` package (``pip install "revgraph[cuda]"``, see :data:`CUDA_HINT`). Buffers that live
across runs (parameters, optimizer state, gradients) are ``OrtValue``s allocated on the device, so a training
step copies only the batch in and the loss out.

Three things onnxruntime does on CUDA that the callers here must not trip over:

- ``get_available_providers()`` lists ``CUDAExecutionProvider`` whenever onnxruntime-gpu is installed, even
  with no GPU or without the CUDA and cuDNN libraries; a session then drops the CUDA provider with a logged
  warning (which revgraph's log level hides) and runs on the CPU. :meth:`Device.check_session` turns that
  into an error.
- onnxruntime runs CUDA kernels on a stream of its own, and a run does not wait for work that torch queued on
  its stream; it synchronises only at the end of the run. Buffers that torch writes and onnxruntime reads
  (all-reduced gradients, gathered rows) need :meth:`Device.synchronize` between the two.
- The public ``OrtValue.from_dlpack`` and ``OrtValue.__dlpack__`` are recent; :func:`ortvalue_from_dlpack`
  and :func:`torch_from_ortvalue` fall back to the binding underneath on older releases.

Nothing here imports torch (the functions that need it take the module as an argument).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import RevgraphError

CUDA_HINT = ('install onnxruntime-gpu in place of onnxruntime on a machine with a CUDA GPU: pip install '
             '"revgraph[cuda]", then pip uninstall -y onnxruntime and pip install --force-reinstall --no-deps '
             'onnxruntime-gpu (the two packages write the same files)')


@dataclass(frozen=True)
class Device:
    """A device for onnxruntime: ``kind`` ``"cpu"`` or ``"cuda"``, ``index`` the CUDA device ordinal (0 on CPU)."""

    kind: str = "cpu"
    index: int = 0

    @classmethod
    def parse(cls, spec: str | Device | None, *, local_rank: int | None = None) -> Device:
        """``"cpu"``, ``"cuda"`` or ``"cuda:<i>"`` (a :class:`Device` passes through; ``None`` is the CPU).
        ``local_rank``: this process's rank on its machine (torchrun's ``LOCAL_RANK``) when it is one of several
        processes there; a bare ``"cuda"`` then means ``cuda:<local_rank>``, one GPU per process, as NCCL
        needs. Raises :class:`RevgraphError` (one line) for anything else."""
        if spec is None:
            return cls()
        if isinstance(spec, Device):
            return spec
        m = re.fullmatch(r"(cpu|cuda)(?::([0-9]{1,9}))?", str(spec).strip())  # (an index onnxruntime's int holds)
        if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
            raise RevgraphError(f"unknown device {spec!r}; use cpu, cuda or cuda:<index>")
        if m.group(1) == "cuda" and m.group(2) is None and local_rank is not None:
            return cls("cuda", int(local_rank))
        return cls(m.group(1), int(m.group(2) or 0))

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def ort_type(self) -> str:
        """The device name onnxruntime's ``OrtValue`` and ``IOBinding`` take."""
        return self.kind

    def providers(self) -> list:
        """The ``providers`` argument of ``onnxruntime.InferenceSession``. Raises :class:`RevgraphError` when
        the installed onnxruntime has no CUDA provider.

        On CUDA, TF32 is turned off (``use_tf32``, an option since onnxruntime 1.18, whose default is on):
        MatMul, Gemm and Conv then compute in float32 as on the CPU (and as PyTorch's matmul does by default),
        not with the 10-bit mantissa of TF32 on Ampere and later GPUs."""
        if self.kind == "cpu":
            return ["CPUExecutionProvider"]
        import onnxruntime as ort

        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise RevgraphError(f"--device {self} needs onnxruntime's CUDAExecutionProvider, which this onnxruntime "
                                f"lacks (it has {', '.join(available)}): {CUDA_HINT}")
        options = {"device_id": self.index}
        if _version(ort.__version__) >= (1, 18):  # older releases refuse options they do not know
            options["use_tf32"] = 0
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]

    def check_session(self, session) -> None:
        """Raise :class:`RevgraphError` unless the ``onnxruntime.InferenceSession`` ``session`` (made with
        :meth:`providers`) really runs on this device: onnxruntime-gpu drops a CUDA provider it cannot create
        (no GPU, a wrong device index, missing CUDA or cuDNN libraries) and quietly runs on the CPU."""
        if self.kind == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise RevgraphError(f"onnxruntime could not start its CUDA provider on {self} and would run on the CPU; "
                                "check that the GPU exists (nvidia-smi) and that the CUDA and cuDNN libraries that "
                                "this onnxruntime-gpu was built for are installed (importing torch first provides "
                                "them when its CUDA version matches)")

    def ortvalue(self, array: np.ndarray):
        """A new ``OrtValue`` on this device holding a copy of ``array`` (on the CPU it wraps a fresh copy,
        so the caller's array is never written). Raises :class:`RevgraphError` when the device has no memory
        to give (no such GPU, or out of memory)."""
        import onnxruntime as ort

        try:
            return ort.OrtValue.ortvalue_from_numpy(np.array(array, order="C"), self.ort_type, self.index)
        except Exception as exc:  # noqa: BLE001 - torch's device errors, reported in one line
            text = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise RevgraphError(f"cannot allocate a {list(np.shape(array))} buffer on {self}: {text}") from None

    def torch(self) -> str:
        """The matching ``torch.device`` string (``"cpu"``, ``"cuda:<i>"``), for collectives on device buffers."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    def synchronize(self, torch) -> None:
        """Wait until the work torch queued on this device is done (its current stream: kernels, and the
        collectives it waits for). Call it before an onnxruntime run reads a buffer that torch wrote since the
        last run: onnxruntime's CUDA stream does not wait for torch's. Nothing to do on the CPU, where torch's
        ops and ``Work.wait()`` return when done."""
        if self.kind == "cuda":
            torch.cuda.current_stream(self.torch()).synchronize()


def ortvalue_from_dlpack(tensor):
    """An ``onnxruntime.OrtValue`` sharing the memory of ``tensor`` (a torch tensor, on the CPU or a GPU) through
    DLPack, without a copy. Raises :class:`RevgraphError` when this onnxruntime has no DLPack support (its
    regular builds have it since early 2025, about 1.21; before that only onnxruntime-training had it)."""
    import onnxruntime as ort

    if hasattr(ort.OrtValue, "from_dlpack"):
        return ort.OrtValue.from_dlpack(tensor)
    from onnxruntime.capi import _pybind_state as C

    if not hasattr(C.OrtValue, "from_dlpack"):
        raise RevgraphError(f"this onnxruntime ({ort.__version__}) cannot share buffers with torch through DLPack; "
                            "data-parallel training needs a newer onnxruntime (or onnxruntime-gpu)")
    try:
        value = C.OrtValue.from_dlpack(tensor.__dlpack__())
    except TypeError:  # older bindings also ask whether the tensor is boolean
        value = C.OrtValue.from_dlpack(tensor.__dlpack__(), str(tensor.dtype) == "torch.bool")
    return ort.OrtValue(value, tensor)  # the tensor stays referenced as long as the OrtValue


def torch_from_ortvalue(torch, value):
    """A torch tensor sharing the memory of the ``onnxruntime.OrtValue`` ``value`` (on the CPU or a GPU) through
    DLPack, without a copy; ``torch`` is the torch module. The OrtValue's buffer stays alive with the tensor."""
    if hasattr(type(value), "__dlpack__"):
        return torch.from_dlpack(value)
    c_value = value._ortvalue  # releases whose public OrtValue lacks the protocol: the binding has it
    capsule = c_value.__dlpack__() if hasattr(c_value, "__dlpack__") else c_value.to_dlpack()
    return torch.utils.dlpack.from_dlpack(capsule)


def _version(text: str) -> tuple[int, ...]:
    """``"1.18.1"`` -> ``(1, 18)``; a part that is not a number counts as 0."""
    return tuple(int(p) if p.isdigit() else 0 for p in text.split(".")[:2])
