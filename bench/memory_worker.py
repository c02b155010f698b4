"""One cell of bench/memory.py in a process of its own: the functions a bench/_worker.py process runs for it.

bench/memory.py starts a fresh worker (bench/workers.py) per cell and calls :func:`measure` once (the cell:
model, batch, configuration, files), then :func:`time_steps` in turns with the other cells' workers, then closes
it. :func:`prepare` (in a worker of its own, with torch) writes the model files first.

The measurement (all in MB = 2^20 bytes, from /proc/self/status):

1. ``start``: VmRSS when the worker starts (Python, the standard library, numpy and this file);
2. the framework is imported (revgraph, onnx and onnxruntime; torch, and transformers' LLaMA for the LLaMA; jax,
   jax.numpy and optax) and runs a toy step (a 4 x 4 matrix: gradient and session in revgraph; forward, backward
   and Adam in PyTorch, through ``torch.utils.checkpoint`` when the configuration checkpoints; ``jit`` of
   ``value_and_grad``, under ``jax.checkpoint`` likewise, and an optax update in JAX), so that lazy imports and
   one-time initialisation (``torch.utils.checkpoint``'s first call imports torch._dynamo and sympy, ~80 MB;
   onnxruntime's environment; XLA's CPU client) are not charged to the model; ``gc.collect()``; ``import`` = VmRSS
   now (the baseline of *total*);
3. setup: the model is built (exported file loaded, step graph built, session created; module built and weights
   loaded; parameters on the device, the step traced), the batch made, ``gc.collect()``; ``build_peak`` = VmHWM,
   VmHWM reset, ``built`` = VmRSS; then one warm-up step (JAX compiles, onnxruntime plans, PyTorch's Adam creates
   its state), ``warmup_peak`` = VmHWM (``first_step`` = ``warmup_peak - built``: the first step's peak over the
   built model), ``gc.collect()``, ``setup_rss`` = VmRSS (what the process keeps after it);
4. VmHWM is reset (5 into /proc/self/clear_refs), ``before`` = VmRSS, one step, ``step_peak`` = VmHWM;
5. **over setup** = ``step_peak - before``; **total** = ``max(build_peak, warmup_peak, step_peak) - import``:
   everything the model, its step and the framework's work on them (compilation, sessions, arenas, caches) cost
   the process beyond the imported framework, at the highest point of its life so far.

Every framework runs one intra-op thread (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS``
= 1 in the environment, ``torch.set_num_threads(1)`` and ``set_num_interop_threads(1)``, XLA's
``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``, onnxruntime ``threads=1``); the CPU time
over wall time of the timed steps is reported to check it (with the kernel's share, and the minor page
faults per step: memory given back to the system between steps is faulted in, and zeroed, again).
"""

from __future__ import annotations

import gc
import os
import resource
import time

from memory_common import peak_mb, reset_peak, rss_mb

THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
              "TF_CPP_MIN_LOG_LEVEL": "3", "TOKENIZERS_PARALLELISM": "false"}


def framework(config: str) -> str:
    return {"rg": "revgraph", "pt": "pytorch", "jax": "jax"}[config.split("-", maxsplit=1)[0]]


def _import(config: str, model: str) -> None:
    """Import the framework and run a toy step through it (module doc, step 2)."""
    import numpy as np

    fw, ckpt = framework(config), config.endswith("-ckpt")
    if fw == "revgraph":
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401

        import revgraph as rg
        import revgraph.train
        from revgraph.ir import Graph, Node, ValueInfo

        g = Graph([Node("MatMul", ["x", "w"], ["y"], name="mm"), Node("ReduceSum", ["y"], ["loss"], name="sum")],
                  [ValueInfo("x", np.float32, (2, 4))], [ValueInfo("loss", np.float32, ())],
                  {"w": np.ones((4, 4), np.float32)})
        rg.Session(rg.gradient(g, "loss", ["w"]), threads=1).run({"x": np.ones((2, 4), np.float32)})
    elif fw == "pytorch":
        import torch
        import torch.utils.checkpoint as cp

        torch.set_num_threads(1)
        if model == "llama":
            from transformers import LlamaForCausalLM  # noqa: F401
        lin = torch.nn.Linear(4, 4)
        opt = torch.optim.Adam(lin.parameters())
        x = torch.ones(2, 4)
        (cp.checkpoint(lin, x, use_reentrant=False) if ckpt else lin(x)).sum().backward()
        opt.step()
    else:
        import jax
        import jax.numpy as jnp

        try:
            import optax

            opt = optax.adam(1e-3)
            w = jnp.ones((4, 4))
            opt.update(w, opt.init(w), w)
        except ImportError:
            pass
        f = (lambda w, x: jnp.sum(jnp.tanh(x @ w)))
        jax.block_until_ready(jax.jit(jax.value_and_grad(jax.checkpoint(f) if ckpt else f))(
            jnp.ones((4, 4)), jnp.ones((2, 4))))


def _task(spec: dict):
    fw = framework(spec["config"])
    if fw == "revgraph":
        from memory_rg import RgTask

        return RgTask(spec)
    if fw == "pytorch":
        from memory_torch import TorchTask

        return TorchTask(spec)
    from memory_jax import JaxTask

    return JaxTask(spec)


_TASK: list = []


def measure(spec: dict) -> dict:
    """Steps 2-5 of the module doc for the cell ``spec`` (keeps the step for :func:`time_steps`)."""
    from memory_rg import NotAvailable

    out: dict = {"start": rss_mb()}
    t0 = time.perf_counter()
    _import(spec["config"], spec["model"])
    gc.collect()
    out["import"] = rss_mb()
    out["import_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        task = _task(spec)
    except NotAvailable as exc:
        return {**out, "status": "n/a", "why": str(exc).splitlines()[0][:300]}
    out["setup_seconds"] = time.perf_counter() - t0
    gc.collect()
    out["build_peak"] = peak_mb()
    out["built"] = reset_peak()
    t0 = time.perf_counter()
    out["loss"] = task.step()
    out["warmup_seconds"] = time.perf_counter() - t0
    out["warmup_peak"] = peak_mb()
    gc.collect()
    out["setup_rss"] = rss_mb()
    out["setup_peak"] = max(out["build_peak"], out["warmup_peak"])
    out["before"] = reset_peak()
    t0, c0, r0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    out["loss_after"] = task.step()
    out["step_seconds"] = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out["step_cpu"] = (time.process_time() - c0) / max(out["step_seconds"], 1e-9)
    out["step_sys_seconds"] = r1.ru_stime - r0.ru_stime
    out["step_page_faults"] = r1.ru_minflt - r0.ru_minflt
    out["step_peak"] = peak_mb()
    out["after"] = rss_mb()
    out["over_setup"] = out["step_peak"] - out["before"]
    out["first_step"] = out["warmup_peak"] - out["built"]
    out["total"] = max(out["setup_peak"], out["step_peak"]) - out["import"]
    out["params"] = getattr(task, "params", None)
    out["how"] = getattr(task, "how", None)
    if spec.get("saved", True):
        try:
            out.update(task.saved())
        except Exception as exc:  # noqa: BLE001 - a missing count leaves the memory figures valid
            out["saved_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    out["status"] = "ok"
    _TASK[:] = [task]
    return out


def time_steps(seconds: float, min_steps: int = 1) -> dict:
    """Steps for about ``seconds`` (at least ``min_steps``): the mean step time and CPU time over wall time."""
    task = _TASK[0]
    t0, r0, n = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), 0
    while n < min_steps or time.perf_counter() - t0 < seconds:
        task.step()
        n += 1
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return {"mean": wall / n, "steps": n, "cpu": (user + system) / wall, "sys": system / wall,
            "page_faults": (r1.ru_minflt - r0.ru_minflt) / n}


def prepare(spec: dict) -> dict:
    """Write the model files every cell reads (in a process with torch): the LLaMA's ONNX file and weights, and
    the bench models' files at the rows' batches (the RNN at its T, in a directory of its own)."""
    import models
    from memory_torch import export_llama

    files = {}
    for row in spec["rows"]:
        if row["model"] == "llama":
            files[row["id"]] = export_llama(spec["cache"])
        else:
            out = spec["cache"]
            if row["model"] == "rnn":
                models.RNN_T = row["steps"]
                out = os.path.join(spec["cache"], f"rnn_T{row['steps']}")
            os.makedirs(out, exist_ok=True)
            files[row["id"]] = models.write_step_model(row["model"], row["batch"], out)
    return files


def versions() -> dict:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in ("numpy", "onnx", "onnxruntime", "torch", "transformers", "jax", "jaxlib", "optax"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    import revgraph

    out["revgraph"] = getattr(revgraph, "__version__", None)
    out["revgraph_path"] = os.path.dirname(revgraph.__file__)
    out["RuntimeOptions"] = hasattr(revgraph, "RuntimeOptions")
    return out
