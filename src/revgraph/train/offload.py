"""``offload="optimizer"`` (``--offload optimizer``): the optimizer state and the update on the host, the forward
and backward on the device, as the optimizer half of ZeRO-Offload (Ren et al., 2021) and DeepSpeed's
``offload_optimizer``.

Where each buffer lives (:class:`HostUpdate`, attached to a :class:`revgraph.train.engines.SplitEngine` or the
unsharded data-parallel engine; with ``--shard optimizer|gradients``, ZeRO-Offload's layout, see
:mod:`revgraph.train.offload_sharded`):

- **host** (pinned memory on CUDA, so that the copies are DMA transfers): every carried value of the step, the
  engine's buffer sets themselves: the fp32 master copy of each parameter, the optimizer state (Adam's ``m``,
  ``v``), the step counter, a schedule's total; and one buffer per dense gradient. The update graph runs in a
  CPU onnxruntime session on these buffers, in place where :func:`revgraph.ir.inplace.inplace_pairs` finds it
  safe, exactly as it runs on the device without offload (the same graph, the same sharing and swapping, undo
  and ``keep_previous``);
- **device**: the parameters the grad graph and the evaluation graph read (a mirror of the host's current
  values: :attr:`HostUpdate.mirror`) and the gradients the grad graph writes (or the data-parallel buckets).

A step: the grad graph runs on the device (and the gradients are all-reduced there when data-parallel); the
dense gradients are copied to their host buffers (:meth:`HostUpdate.pull`, also the sparse rows); the update
graph runs on the host; the new parameters are copied to the device mirror (:meth:`HostUpdate.push`, also after
:meth:`~revgraph.train.engines.Engine.load` and :meth:`~revgraph.train.engines.Engine.undo`). The device thus
holds parameters and gradients (2P for fp32) instead of 4P with Adam; each step moves the gradients down and the
parameters up (2P bytes over PCIe).

On a CPU run there is nothing to move: ``offload="optimizer"`` warns and trains as without it, unless the
environment variable :data:`FORCE_ENV` is ``1`` (an internal switch for the tests: the same host buffers, mirror
and copies on the CPU, so that a CPU test checks the offloaded step against the plain one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..runtime.devices import Device
from ..warn import warn

#: ``offload=`` of :class:`revgraph.Trainer` and ``--offload`` of ``revgraph train``.
OFFLOADS = ("none", "optimizer")
#: internal: ``1`` runs the offloaded step (host buffers, mirror, copies) on a CPU device too (the tests' switch)
FORCE_ENV = "REVGRAPH_OFFLOAD_ON_CPU"


def refused_offload(offload: str, buffers: str = "one", shard: str = "none", sync_batchnorm: bool = False,
                    precision: str = "fp32") -> str | None:
    """The one line refusing ``offload`` with options it does not combine with, or ``None``."""
    if offload == "none":
        return None
    if offload not in OFFLOADS:
        return f"offload must be one of {', '.join(OFFLOADS)}, got {offload!r}"
    opt = f"--offload {offload} (offload={offload!r})"
    if buffers == "two":
        return f"{opt} needs --buffers one (buffers='one'): the host keeps the one buffer set the update writes"
    if shard == "parameters":
        return (f"{opt} does not combine with --shard parameters yet: use --shard gradients (ZeRO-2) with "
                "--offload, or --shard parameters without it")
    if sync_batchnorm:
        return f"{opt} does not combine with --sync-batchnorm: leave one of them out"
    if precision == "fp16":
        return (f"{opt} does not combine with --precision fp16 (its loss scale is carried on the device): "
                "use --precision bf16, or leave --offload out")
    return None


def host_update(offload: str, spec, device: Device) -> HostUpdate | None:
    """The :class:`HostUpdate` of a run of ``spec`` on ``device`` with ``offload`` (:data:`OFFLOADS`), or ``None``:
    with ``"none"``, and on a CPU device (with a warning: the state is already in host memory) unless
    :data:`FORCE_ENV` is set. Raises :class:`InputError` (one line) for the models it does not combine with (fp16
    loss scaling, running statistics of training-mode BatchNormalization among the parameters)."""
    if offload == "none":
        return None
    if device.kind == "cpu" and os.environ.get(FORCE_ENV) != "1":
        warn(f"--offload {offload} (offload={offload!r}) does nothing on --device cpu: the optimizer state and "
             "update are in host memory already")
        return None
    from .distributed.sync_batchnorm import running_statistics

    problem = refused_offload(offload, precision="fp16" if spec.scaling is not None else "fp32")
    if problem is None and running_statistics(spec.model, spec.params):
        problem = (f"--offload {offload} (offload={offload!r}) does not combine with training-mode "
                   "BatchNormalization (its running statistics are written on the device): leave --offload out")
    if problem:
        raise InputError(problem)
    return HostUpdate(device)


@dataclass(frozen=True)
class HostDevice(Device):
    """The CPU as the home of an offloaded step's buffers: a :class:`Device` of kind ``"cpu"`` whose
    :meth:`ortvalue` allocates page-locked (pinned) memory when ``pinned`` (through torch: onnxruntime's Python API
    has no pinned allocation), so that copies to and from the GPU are DMA transfers without a staging copy."""

    pinned: bool = False

    def array(self, like: np.ndarray) -> np.ndarray:
        """A new host array holding a copy of ``like`` (in pinned memory when :attr:`pinned`)."""
        a = np.asarray(like)
        if not self.pinned:
            return np.array(a, order="C")
        import torch

        host = torch.empty(a.shape, dtype=torch.from_numpy(np.zeros(0, a.dtype)).dtype, pin_memory=True).numpy()
        host[...] = a  # (the array keeps its torch tensor, and so the pinned memory, alive)
        return host

    def ortvalue(self, array: np.ndarray):
        """A CPU ``OrtValue`` holding a copy of ``array`` (in pinned memory when :attr:`pinned`)."""
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(self.array(array))  # (it shares the array's memory and keeps it)


class HostUpdate:
    """The host side of an offloaded step on ``device`` (module doc): :attr:`home` (where the engine allocates its
    buffer sets and runs its update session), the device :attr:`mirror` of the values the grad graph reads, and the
    host copies of the gradients. The engine calls :meth:`attach`, :meth:`gradients`, :meth:`pull` before each
    update and :meth:`push` whenever its current host values change."""

    def __init__(self, device: Device):
        self.device = device
        self.torch = _cuda_torch() if device.kind == "cuda" else None
        self.home = HostDevice("cpu", 0, pinned=self.torch is not None)
        self.mirror: dict = {}
        self.host_grads: dict = {}

    def attach(self, engine) -> None:
        """Allocate the device mirror of ``engine``'s parameters (and whatever else its backward reads), holding
        their current host values."""
        self._names = list(engine.spec.backward_reads())
        self.mirror = {n: self.device.ortvalue(engine.value(n).numpy()) for n in self._names}

    def gradients(self, device_grads: dict, like: dict) -> dict:
        """Host buffers for the dense gradients ``device_grads`` (``{name: OrtValue}`` on the device), of the
        dtypes and shapes of ``like`` (the parameters' arrays by gradient name); the update graph reads them."""
        import onnxruntime as ort

        self.device_grads = device_grads
        self._arrays = {g: self.home.array(np.zeros_like(like[g])) for g in device_grads}
        self.host_grads = {g: ort.OrtValue.ortvalue_from_numpy(a) for g, a in self._arrays.items()}  # (shared memory)
        return self.host_grads

    def pull(self, inputs: dict) -> dict:
        """Copy this step's dense gradients from the device into their host buffers, and return the update's
        other inputs ``inputs`` (sparse rows, ``{name: OrtValue}``) as host values."""
        for g, src in self.device_grads.items():
            self._to_host(src, g)
        return host_values(inputs)

    def _to_host(self, src, g: str) -> None:
        if self.torch is not None:  # device to pinned host memory in one DMA copy
            from ..runtime.devices import torch_from_ortvalue

            self.torch.from_numpy(self._arrays[g]).copy_(torch_from_ortvalue(self.torch, src))
        else:
            np.copyto(self._arrays[g], src.numpy())

    def push(self, engine) -> None:
        """Copy ``engine``'s current host values of the mirrored names (the new parameters) to the device."""
        for n in self._names:
            self.mirror[n].update_inplace(np.ascontiguousarray(engine.value(n).numpy()))

    def held(self, host: dict) -> dict:
        """:meth:`revgraph.train.engines.Engine.held` of an offloaded engine from its ``host`` counts: on the device
        ``"state"`` (the parameters' mirror) and ``"gradients"``; in host memory ``"host_state"`` (parameters,
        optimizer state, step) and ``"host_gradients"``."""
        from .engines import _nbytes

        return {"state": sum(_nbytes(v) for v in self.mirror.values()), "gradients": host["gradients"],
                "host_state": host["state"], "host_gradients": sum(_nbytes(v) for v in self.host_grads.values())}


def host_values(values: dict) -> dict:
    """Host copies (CPU ``OrtValue``s) of ``values`` (``{name: OrtValue}`` on any device): the sparse rows a step
    hands the update, whose sizes change from step to step."""
    import onnxruntime as ort

    return {n: ort.OrtValue.ortvalue_from_numpy(np.array(v.numpy())) for n, v in values.items()}


def _cuda_torch():
    """torch when it is installed with CUDA (for pinned host buffers and DMA copies), else ``None``."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None
