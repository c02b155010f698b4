"""Data-parallel training launched by Ray Train, for clusters that Ray manages (``pip install "revgraph[ray]"``).

:func:`train_with_ray` starts ``num_workers`` Ray Train workers with ``ray.train.torch.TorchTrainer``, which
sets up the same ``torch.distributed`` process group as ``torchrun`` (gloo on the CPU, nccl with GPUs) and
the ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` variables; each worker builds ``revgraph.Trainer(...,
distributed=True)``, which joins that group (:mod:`revgraph.train.distributed.data_parallel`), and calls
:meth:`Trainer.fit`. Rank 0 then hands the trained model back as a Ray checkpoint (so it also reaches a driver on
another machine). Ray and torch are imported only when :func:`train_with_ray` runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ...errors import RevgraphError
from ...ir import Graph
from ...onnx_io import load, read_model, save, to_onnx
from ...runtime import _first_line
from ..graphs import Optimizer, training_graph
from ..trainer import Data, Trainer


@dataclass
class RayTraining:
    """What :func:`train_with_ray` returns: the trained ``model`` (a :class:`Graph` whose initializers hold
    the trained ``parameters``), the loss of each step and the mean loss of each epoch (over all workers), and
    where the last attempt resumed from (:attr:`Trainer.resumed`; ``None`` when it started afresh)."""

    model: Graph
    parameters: dict[str, np.ndarray]
    losses: list[float]
    epoch_means: list[float]
    resumed: str | None = None


def _imports():
    try:
        import ray.train
        import ray.train.torch
    except ImportError:
        raise RevgraphError('training with Ray needs Ray Train and PyTorch: pip install "revgraph[ray]"') from None
    return ray


def _worker(config: dict) -> None:
    """One Ray Train worker: join the process group Ray set up, train, and report (rank 0 with the model)."""
    import ray.train
    import ray.train.torch

    device = str(ray.train.torch.get_device()) if config["use_gpu"] else "cpu"  # the GPU Ray gave this worker
    tr = Trainer(config["model"], config["loss"], config["optimizer"], output=config["output"],
                 params=config["params"], threads=config["threads"], device=device, distributed=True)
    means = tr.fit(config["data"], **config["fit"])
    with tempfile.TemporaryDirectory() as tmp:  # every rank reports (Ray waits for all); rank 0 with the model
        checkpoint = None
        if tr.is_main:
            tr.export(Path(tmp) / "model.onnx")
            record = {"losses": tr.losses, "epoch_means": means, "resumed": tr.resumed}
            (Path(tmp) / "record.json").write_text(json.dumps(record))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"loss": means[-1]}, checkpoint=checkpoint)


def _check_local_resources(ray, num_workers: int, cpus_per_worker: int, use_gpu: bool) -> None:
    """Ray Train waits for missing CPUs or GPUs until the cluster grows (autoscaling), retrying every minute.
    Without a connected cluster, Ray starts a local one with this machine's CPUs and GPUs, which never grows:
    raise :class:`RevgraphError` when the workers need more than that, instead of waiting forever."""
    if ray.is_initialized():
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if num_workers * cpus_per_worker > cpus:
        raise RevgraphError(f"num_workers {num_workers} x cpus_per_worker {cpus_per_worker} = "
                            f"{num_workers * cpus_per_worker} CPUs, and the local Ray cluster would have {cpus}; use "
                            "fewer workers, or connect to a larger cluster first (ray.init(address=...))")
    if use_gpu:
        import torch

        if torch.cuda.device_count() < num_workers:
            raise RevgraphError(f"use_gpu with num_workers {num_workers} needs {num_workers} GPUs and torch sees "
                                f"{torch.cuda.device_count()} here; use fewer workers, or connect to a cluster with "
                                "GPUs first (ray.init(address=...))")


def _one_line(exc: BaseException) -> RevgraphError:
    """A failed run as one line: the first worker's own error (a RevgraphError keeps its message)."""
    failures = getattr(exc, "worker_failures", None) or {}
    cause = failures[min(failures)] if failures else exc
    cause = getattr(cause, "cause", None) or cause  # a RayTaskError wraps the worker's exception
    if isinstance(cause, RevgraphError):
        return RevgraphError(_first_line(cause))
    return RevgraphError(f"training with Ray failed: {type(cause).__name__}: {_first_line(cause)[:300]}")


def train_with_ray(model: Graph | onnx.ModelProto | str | os.PathLike, data: Data, *, num_workers: int,
                   loss: str = "cross-entropy", optimizer: Optimizer | str = "adam", epochs: int = 1,
                   batch_size: int = 32, seed: int = 0, shuffle: bool = True, output: str | None = None,
                   params: Iterable[str] | None = None, cpus_per_worker: int = 1, use_gpu: bool = False,
                   checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int = 0, max_failures: int = 0,
                   storage_path: str | None = None, save_to: str | os.PathLike | None = None) -> RayTraining:
    """Train ``model`` data-parallel on ``num_workers`` Ray Train workers, as :class:`revgraph.Trainer` with
    ``distributed=True`` does under torchrun: ``batch_size`` is per worker (global batch ``batch_size *
    num_workers``) and the result equals one process trained with the global batch (same ``seed``).

    ``model``, ``loss``, ``optimizer``, ``output``, ``params``: as for :class:`revgraph.Trainer` (a path is
    read here, so workers need no copy of it). ``data``: as for :meth:`Trainer.fit`; it is shipped to every
    worker. ``epochs``, ``batch_size``, ``seed``, ``shuffle``, ``checkpoint_dir``, ``checkpoint_every``: as for
    :meth:`Trainer.fit`; ``checkpoint_dir`` must be reachable from every machine (rank 0 writes it and, after
    a failure, the restarted workers resume from it; Ray restarts them up to ``max_failures`` times). Each
    worker reserves ``cpus_per_worker`` CPUs and runs onnxruntime with as many threads; ``use_gpu`` gives it
    one GPU (nccl). ``storage_path``: Ray's storage for the run (default ``~/ray_results``; shared storage on
    a cluster of several machines). Uses the Ray cluster this process is connected to (``ray.init``), where
    Ray waits until it has the CPUs and GPUs asked for (autoscaling), else starts a local one of this machine's
    size. Writes the trained model to ``save_to`` when given. Returns a :class:`RayTraining`.

    Raises :class:`RevgraphError` (one line) without Ray, for bad arguments or a model revgraph cannot train
    (before any worker starts), and for a failed run (a worker's own error message).
    """
    _check_arguments(num_workers=num_workers, cpus_per_worker=cpus_per_worker, epochs=epochs, batch_size=batch_size,
                     checkpoint_every=checkpoint_every, max_failures=max_failures, seed=seed, shuffle=shuffle,
                     use_gpu=use_gpu, checkpoint_dir=checkpoint_dir)
    proto = model if isinstance(model, onnx.ModelProto) else (
        to_onnx(model) if isinstance(model, Graph) else read_model(model))
    params = None if params is None else list(params)
    trained = training_graph(proto, loss, optimizer, output=output, params=params).params  # fails here, once
    ray = _imports()
    _check_local_resources(ray, num_workers, cpus_per_worker, use_gpu)
    with _local_cluster(ray, storage_path) as storage:
        return _run(ray, proto, data, trained, num_workers, loss, optimizer, epochs, batch_size, seed, shuffle,
                    output, params, cpus_per_worker, use_gpu, checkpoint_dir, checkpoint_every, max_failures,
                    storage, save_to)


def _check_arguments(**given) -> None:
    """:func:`train_with_ray`'s numbers and flags, checked on the caller's side before Ray starts (issue 40: an
    ``epochs=1.5`` or ``batch_size=nan`` started a cluster and was refused minutes later inside a worker)."""
    least = {"num_workers": 1, "cpus_per_worker": 1, "epochs": 1, "batch_size": 1, "checkpoint_every": 0,
             "max_failures": -1, "seed": 0}  # Ray's max_failures=-1: restart without limit
    for name, low in least.items():
        value = given[name]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise RevgraphError(f"{name} must be an integer >= {low}, got {value!r}")
        if value < low:
            raise RevgraphError(f"{name} must be at least {low}, got {value}")
    for name in ("shuffle", "use_gpu"):
        if not isinstance(given[name], bool):
            raise RevgraphError(f"{name} must be True or False, got {given[name]!r}")
    if given["checkpoint_every"] and given["checkpoint_dir"] is None:
        raise RevgraphError("checkpoint_every has no effect without checkpoint_dir: give the directory, or leave "
                            "checkpoint_every out")


@contextlib.contextmanager
def _local_cluster(ray, storage_path: str | None):
    """Where no Ray cluster is connected, a local one started for this call alone, its session files in a
    temporary directory, shut down and removed afterwards (a later call checks the machine's size again instead
    of meeting a cluster left behind); ``storage_path`` defaults to a temporary directory too, not
    ``~/ray_results``. Yields the storage path to use. A cluster the caller connected to is used as it is."""
    with contextlib.ExitStack() as stack:
        if not ray.is_initialized():
            temp = stack.enter_context(tempfile.TemporaryDirectory(prefix="revgraph-ray-"))
            ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=temp)
            stack.callback(ray.shutdown)
            if storage_path is None:
                storage_path = stack.enter_context(tempfile.TemporaryDirectory(prefix="revgraph-ray-results-"))
        yield storage_path


def _run(ray, proto, data, trained, num_workers, loss, optimizer, epochs, batch_size, seed, shuffle, output, params,
         cpus_per_worker, use_gpu, checkpoint_dir, checkpoint_every, max_failures, storage_path,
         save_to) -> RayTraining:
    """The Ray Train run of :func:`train_with_ray`, its arguments checked."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    fit = {"epochs": epochs, "batch_size": batch_size, "seed": seed, "shuffle": shuffle, "progress": False,
           "checkpoint_every": checkpoint_every}
    fit["checkpoint_dir"] = None if checkpoint_dir is None else str(checkpoint_dir)
    config = {"model": proto, "data": data, "loss": loss, "optimizer": optimizer, "output": output, "params": params,
              "threads": cpus_per_worker, "use_gpu": use_gpu, "fit": fit}
    trainer = TorchTrainer(
        _worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(storage_path=storage_path, failure_config=FailureConfig(max_failures=max_failures)))
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as exc:
        raise _one_line(exc) from None
    with result.checkpoint.as_directory() as where:
        graph = load(Path(where) / "model.onnx")
        record = json.loads((Path(where) / "record.json").read_text())
    if save_to is not None:
        save(graph, save_to)
    return RayTraining(graph, {n: np.asarray(graph.initializers[n]) for n in trained}, record["losses"],
                       record["epoch_means"], record["resumed"])
