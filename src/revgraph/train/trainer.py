"""Train a model with its training-step graphs: :class:`Trainer` (``rg.Trainer``), in one process or many.

The step itself runs in an engine (:mod:`revgraph.train.engines`: the fused step graph in one process;
:mod:`revgraph.train.distributed.data_parallel`: the step cut in two around a gradient all-reduce, one process per rank
under ``torchrun``). This module holds what both share: the data checks, the order of the samples and each rank's
share of it (:func:`shard`), the loop over epochs with its progress bar, evaluation, checkpoints and resuming.

Data-parallel semantics. With ``W`` processes and ``batch_size`` ``B``, each step trains on a global batch of
``B * W`` samples: the next ``B * W`` samples of the epoch's order (the same order on every rank, from
``seed + epoch``), of which rank ``r`` takes every ``W``-th starting at ``r``, as
``torch.utils.data.DistributedSampler`` deals them. The last global batch of an epoch may be smaller and split
unevenly (a rank may even get no sample); the gradients are weighted by each rank's share, so that every step
equals the single-process step on the same global batch, with no sample repeated or dropped.

Gradient accumulation (``fit(accumulate_steps=K)``): a step takes the next ``K * B * W`` samples of the
epoch's order, as ``K`` global micro-batches of ``B * W`` consecutive samples, each dealt over the ranks as
above. Every micro-batch's mean gradient is weighted by its sample count over the step's count and summed, so
the step equals one step with batch size ``K * B`` (per process) on the same order, and one process with
batch ``K * B * W``, also for the shorter last step of an epoch (its micro-batches may be short or empty).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

import numpy as np
import onnx

from .. import validate as V
from ..autodiff.memory.budget import BUDGET
from ..autodiff.policies import POLICY, CheckpointPolicy
from ..errors import InputError, NonFiniteError, RevgraphError
from ..ir import Graph
from ..ir.arguments import MODEL
from ..onnx_io import save
from ..runtime.devices import Device
from ..runtime.options import TRAINING_DEFAULT, RuntimeOptions, check_runtime
from . import data as datasets
from . import fit_loop, run_record
from .engine_choice import EngineSettings, create_engine
from .fit_loop import epoch_order, shard  # noqa: F401 (their home was here)
from .graphs import Optimizer, TrainingGraph, training_graph
from .losses import loss_kind, weighs_by_targets
from .optimizers import configure, make_optimizer
from .precision import check_combination, make_precision
from .progress_bar import Bar
from .steptimes import StepTimes

Data = Mapping[str, np.ndarray] | tuple


def _profile(name: str, value):
    return value if value is True or value is False or (value == "timeline" and isinstance(value, str)) else \
        V.one_of(name, value, (True, False, "timeline"))


def _optional(rule):
    """``rule``, letting ``None`` (the argument's default) through."""
    return lambda name, value: value if value is None else rule(name, value)


#: :class:`Trainer`'s argument rules (the registries' choices, the loss and the schedule are checked by the code
#: that owns them, each in one line; params and freeze by revgraph.train.selection, as glob patterns).
TRAINER_RULES = {"model": MODEL, "loss": V.TEXT, "optimizer": V.OPTIMIZER, "output": V.NAME, "threads": V.THREADS,
                 "checkpoint": POLICY, "distributed": V.FLAG, "memory": BUDGET, "bucket_mb": _optional(V.POSITIVE),
                 "profile": _profile, "overlap": V.choice(True, False, "auto"), "sync_batchnorm": V.FLAG,
                 "timeout": V.OPTIONAL_POSITIVE, "clip_grad_norm": V.OPTIONAL_POSITIVE, "straight_through": V.FLAG,
                 "offload": V.choice("none", "optimizer")}
#: :meth:`Trainer.fit`'s argument rules.
FIT_RULES = {"epochs": _optional(V.POSITIVE_INT), "max_steps": _optional(V.POSITIVE_INT),
             "eval_every": _optional(V.POSITIVE_INT), "eval_batch_size": _optional(V.POSITIVE_INT),
             "batch_size": V.POSITIVE_INT, "shuffle": V.FLAG, "seed": V.SEED, "progress": V.FLAG,
             "description": V.rule(V.text, empty=True), "checkpoint_dir": V.OPTIONAL_PATH,
             "checkpoint_every": V.NON_NEGATIVE_INT, "snapshot_dir": V.OPTIONAL_PATH,
             "snapshot_every": _optional(V.NON_NEGATIVE_INT), "nonfinite": V.choice("stop", "continue"),
             "accumulate_steps": V.POSITIVE_INT, "override": V.OPTIONAL_NAMES}


class Trainer:
    """Train ``model`` with ``loss`` and ``optimizer`` (see :mod:`revgraph.train` for the formulas).

    ``model`` is a :class:`Graph`, an ``onnx.ModelProto`` or a path; ``loss`` one of
    :data:`revgraph.train.losses.LOSSES` (``"cross-entropy"``, ``"mse"``, ``"bce"``, ``"causal-lm"``, ``"output:NAME"``)
    and ``loss_options`` its options (``ignore_index``, ``label_smoothing``, ``class_weights``, ``labels_from``;
    :func:`revgraph.train.losses.loss_graph`); ``optimizer`` an :class:`revgraph.train.Optimizer` or a name of
    :data:`revgraph.train.OPTIMIZERS` (``"sgd"``, ``"adam"``, ``"adamw"``, with PyTorch's defaults). ``output`` picks
    the model output the loss reads (default: the only one), ``params`` the initializers to train (names or fnmatch
    globs; default: the LoRA adapters of a model that has them, :mod:`revgraph.train.lora`, else every floating-point
    one) and ``freeze`` globs of initializers not to train (:func:`revgraph.train.trainable`). ``threads`` is
    onnxruntime's intra-op thread count (0: its default). ``device`` is ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"``
    (:mod:`revgraph.runtime.devices`). ``runtime``: onnxruntime's memory settings (:class:`revgraph.RuntimeOptions`;
    a setting left ``None`` takes :data:`revgraph.runtime.options.TRAINING_DEFAULT`: memory pattern off, arena
    on). ``buffers``: ``"one"`` (default) keeps parameters and optimizer state in one buffer set that the update
    overwrites where :mod:`revgraph.ir.inplace` finds it safe, ``"two"`` in two sets swapped every step (the fused
    step graph; :mod:`revgraph.train.engines`); the numbers are the same. ``distributed=True`` trains data-parallel with
    the other processes of a
    ``torchrun`` launch (:mod:`revgraph.train.distributed.data_parallel`; needs ``pip install
    "revgraph[distributed]"``): every rank builds the same Trainer and calls :meth:`fit` with the same data and
    arguments. ``shard`` (with ``distributed``): ``"none"`` (default), ``"optimizer"`` (ZeRO-1: each rank keeps the
    optimizer state of its shard of the parameters), ``"gradients"`` (ZeRO-2: and its shard of the gradients), see
    :mod:`revgraph.train.distributed.sharding`, or ``"parameters"`` (ZeRO-3: and only its shard of the parameters,
    :mod:`revgraph.train.distributed.param_sharding`); a world of one process trains unsharded. Sharded,
    :attr:`state` (and with ``"parameters"``, :attr:`parameters` and :meth:`evaluate`) is a collective (every rank
    calls it). ``memory`` is the
    budget of the residuals the step's backward keeps (:func:`revgraph.gradient`: a fraction of the default's
    bytes, a byte count, or a ``revgraph.Budget`` sizing the batch dimension); the plan is
    ``trainer.spec.graph.memory_plan``. Data-parallel gradient exchange (:mod:`revgraph.train.distributed.exchange`):
    ``bucket_mb`` the all-reduce bucket size in MiB (DDP's ``bucket_cap_mb``, default 25; ``shard="gradients"``:
    no more than keeps gradient memory within the unsharded one), ``reduce_dtype``
    ``"fp32"`` (default: the gradients' dtype) or ``"bf16"`` (buckets all-reduced in bfloat16), ``overlap``
    starts each bucket's all-reduce while the rest of the backward pass runs (:mod:`revgraph.train.distributed.overlap`;
    one bucket: no cut); ``"auto"`` (default): on CUDA, not on the CPU, where gloo's all-reduce competes with the
    backward for the same cores. ``precision``: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (or a
    :class:`revgraph.train.precision.Precision` with the fp16 loss-scaling options): matrix products and convolutions in
    the low precision with float32 master weights, fp16 with dynamic loss scaling (:mod:`revgraph.train.precision`;
    a 16-bit step needs a CUDA device; fp16 does not combine with ``shard`` or ``sync_batchnorm``). ``profile=True``
    times the phases of every step
    (:attr:`times`, :mod:`revgraph.train.steptimes`; ``"timeline"`` also records each segment and all-reduce).
    ``sync_batchnorm=True`` (data-parallel only): training-mode
    ``BatchNormalization`` nodes normalize with the statistics of the global batch, all-reduced inside the step
    (:mod:`revgraph.train.distributed.sync_batchnorm`; without it each rank normalizes over its share and rank 0 warns).
    ``straight_through=True``: quantization-aware training, ``QuantizeLinear -> DequantizeLinear`` pairs
    differentiated with the straight-through estimator (:func:`revgraph.gradient`'s option; refused without it).
    ``offload="optimizer"``: the optimizer state and the update in host memory, on the CPU, while the forward and
    backward run on ``device`` (:mod:`revgraph.train.offload`; a CUDA device then holds parameters and gradients
    only; on the CPU it warns and changes nothing).
    ``timeout`` (seconds, with ``distributed``; default
    :data:`revgraph.train.distributed.launch.DEFAULT_TIMEOUT`) bounds joining the process group and every collective, so
    a rank that stopped fails the others with one line instead of a hang; the loss, the optimizer and its
    hyperparameters are compared across ranks here, before any step. ``schedule`` (a
    :class:`revgraph.train.schedules.Schedule`), ``clip_grad_norm`` (the global-norm threshold) and ``no_decay``
    (``"default"``: no weight decay on biases and 1-D parameters; ``"none"``; name patterns; a predicate
    ``(name, array) -> bool``) replace those of ``optimizer`` when given (:mod:`revgraph.train.schedules`; the
    excluded parameters are ``trainer.spec.no_decay``). Raises
    :class:`RevgraphError` (one line) for bad names, a model revgraph cannot differentiate, a missing device,
    or a process group that cannot be joined.

    Data (for :meth:`step`, :meth:`fit`, :meth:`evaluate`): a mapping with an array per model input (by
    name) and ``"labels"``, or ``{"x": ..., "y": ...}`` / a tuple ``(x, y)`` for a model with one input.
    Arrays share their first (sample) axis. Float inputs are cast to the declared dtype; labels are int64
    class indices for cross-entropy and floats of the output's shape for ``mse`` and ``bce``; ``output:NAME``
    and causal-lm on the input ids take no labels. ``data`` may also be a directory of ``.npy`` files, read
    memory-mapped; ``static=`` gives inputs fed whole to every step (:mod:`revgraph.train.data`).
    """

    @V.arguments(**TRAINER_RULES)
    def __init__(self, model: Graph | onnx.ModelProto | str | os.PathLike, loss: str = "cross-entropy",
                 optimizer: Optimizer | str = "adam", *, output: str | None = None, params: Iterable[str] | None = None,
                 threads: int = 0, checkpoint: str | int | CheckpointPolicy = "store", device: str | Device = "cpu",
                 distributed: bool = False, runtime: RuntimeOptions | None = None, buffers: str = "one",
                 memory=None, bucket_mb: float | None = None, reduce_dtype: str = "fp32", overlap: bool | str = "auto",
                 profile: bool = False, shard: str = "none",
                 sync_batchnorm: bool = False, timeout: float | None = None, loss_options: dict | None = None,
                 schedule=None, clip_grad_norm: float | None = None, no_decay=None, precision="fp32",
                 freeze: Iterable[str] | None = None, straight_through: bool = False, offload: str = "none"):
        settings = EngineSettings(buffers, bucket_mb, reduce_dtype, overlap, shard, sync_batchnorm, distributed,
                                  offload)
        self._settings = settings  # (fit refuses accumulation with some of them)
        # settings left None take the training default (memory pattern off, arena on)
        self.runtime: RuntimeOptions = (check_runtime(runtime) or RuntimeOptions()).over(TRAINING_DEFAULT)
        local_rank = int(os.environ.get("LOCAL_RANK", "0")) if distributed else None
        self.device = Device.parse(device, local_rank=local_rank)  # a bare "cuda" is the local rank's GPU
        self.device.providers()  # a missing CUDA provider fails here, before the graphs are built
        precision = make_precision(precision)  # (mixed precision: revgraph.train.precision)
        self.losses: list[float] = []  # one per step of this trainer, in order (the global batch's when distributed)
        self.taken_before = 0  # steps a resumed snapshot's run took before this trainer's first (run_record.resume)
        self.last_evaluation: dict | None = None  # fit's latest evaluation of eval_data (evaluate's result)
        self.resumed: str | None = None  # set by fit when it resumed from a checkpoint: where from
        self.comm = None
        if distributed:
            from .distributed.data_parallel import Collective, threads_per_process

            self.comm = Collective(self.device, timeout)
            threads = threads or threads_per_process()
            settings.refuse(precision=precision.kind, world_size=self.comm.world_size)
        settings.resolve_overlap(self.device.kind)
        synced = None
        if sync_batchnorm and self.comm and self.comm.world_size > 1:
            from .distributed.sync_batchnorm import synchronized

            original, model, synced = synchronized(model)  # BatchNormalization around all-reduce placeholders
        optimizer = configure(make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer,
                              schedule=schedule, clip_grad_norm=clip_grad_norm, no_decay=no_decay)
        self.spec: TrainingGraph = training_graph(model, loss, optimizer, output=output, params=params,
                                                  checkpoint=checkpoint, memory=memory, loss_seed=bool(synced),
                                                  loss_options=loss_options, precision=precision, freeze=freeze,
                                                  straight_through=straight_through)
        check_combination(precision, self.device.kind, self.spec.graph)
        if self.comm:  # before anything runs: a rank with another --lr would train other weights
            self.comm.check_same({"loss": self.spec.loss.settings, "model output": self.spec.loss.output,
                                  **run_record.rank_settings(self.spec), "trained parameters": self.spec.params,
                                  **settings.agreement()},
                                 "training settings", "give every rank the same loss, optimizer and hyperparameters "
                                 "(--loss, --optimizer, --lr, --momentum, --weight-decay, --lr-schedule, "
                                 "--clip-grad-norm...) and the same data-parallel "
                                 "options (--buffers, --shard, --sync-batchnorm, --bucket-mb, --reduce-dtype, "
                                 "--overlap)")
        if synced and weighs_by_targets(self.spec.loss):
            # a rank whose rows count no target is skipped (weight 0), and its rows would then be missing
            # from the global batch statistics that synchronized BatchNormalization all-reduces
            raise InputError("--sync-batchnorm (sync_batchnorm=) does not combine with a loss that counts targets "
                             "(ignore_index, class weights, causal-lm): train without one of them")
        if synced:
            self.spec.model = original  # evaluation, prediction and export use the model as given
            self.spec.inputs = list(original.input_names)  # (the rewrite's shifts are fed by the engine)
        self._engine = create_engine(self.spec, settings, threads, self.device, self.runtime, self.comm, synced)
        if profile:
            self._engine.times = StepTimes(timeline=profile == "timeline")
        if self.comm:  # (what every engine starts from: read back, a parameter-sharded engine would gather it)
            self.comm.check_replicas({p: self.spec.initial[p] for p in self.spec.params}, "initial parameters")
        if hasattr(self._engine, "keep_for_writing"):  # ZeRO-3: no rank keeps the values it does not own
            from .distributed.param_sharding import drop_initial_values

            drop_initial_values(self.spec)
        if self.world_size > 1 and self.is_main and not sync_batchnorm:
            from .distributed.sync_batchnorm import warn_per_rank_statistics

            warn_per_rank_statistics(self.spec.model, self.world_size)

    # ------------------------------------------------------------------------------------------ state

    @property
    def rank(self) -> int:
        """This process's rank (0 without ``distributed``)."""
        return self.comm.rank if self.comm else 0

    @property
    def world_size(self) -> int:
        """How many processes train together (1 without ``distributed``)."""
        return self.comm.world_size if self.comm else 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that prints and writes files."""
        return self.rank == 0

    @property
    def times(self) -> StepTimes | None:
        """The per-phase timings of every step when built with ``profile``
        (:class:`revgraph.train.steptimes.StepTimes`)."""
        return self._engine.times

    @property
    def steps(self) -> int:
        """How many optimizer steps have been taken."""
        return self._engine.steps

    @property
    def steps_taken(self) -> int:
        """Batches trained in this run: this trainer's (:attr:`losses`, one per step) and, when it resumed from a
        snapshot, those of the run before it (whose per-step losses are in its ``--log`` file, not in the
        snapshot). Equal to :attr:`steps` but with fp16 loss scaling, whose skipped steps do not count there."""
        return self.taken_before + len(self.losses)

    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """The current parameters (copies), by initializer name. With ``shard="parameters"``, gathered: a
        collective (every rank reads them)."""
        return self._engine.read(self.spec.params)

    def _written(self) -> dict[str, np.ndarray]:
        """The parameters to write a model or state dict from: :attr:`parameters`; with ``shard="parameters"``
        after ``fit``, those ``fit`` gathered to rank 0 (read-only; rank 0 writes, no collective:
        :meth:`revgraph.train.distributed.param_sharding.ParameterShardedEngine.written`)."""
        written = getattr(self._engine, "written", None)
        return written(self.spec.params) if written else self.parameters

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The current optimizer state (copies), by state input name (``<param>.momentum``, ``.m``, ``.v``).
        Sharded (``shard=``), the whole state is gathered from every rank: a collective, read it on every rank."""
        return self._engine.read([s for p in self.spec.params for s in self.spec.state[p]])

    # ------------------------------------------------------------------------------------------ data

    def arrays(self, data: Data, static: Mapping[str, np.ndarray] | None = None) -> datasets.Dataset:
        """``data`` and ``static`` checked against the training graph (:func:`revgraph.train.data.prepare`): a
        :class:`revgraph.train.data.Dataset`. Raises :class:`InputError` (one line) for missing arrays, different
        lengths, a static array that does not match its input, or labels that do not fit the loss."""
        return datasets.prepare(self.spec, data, static, self._classes())

    @property
    def fixed_batch(self) -> int | None:
        """The batch size the model's inputs declare as a static first dimension (models exported with a
        fixed batch), or ``None`` when it is symbolic."""
        dims = [v.shape[0] for v in self.spec.model.inputs if v.shape and isinstance(v.shape[0], int)]
        return dims[0] if dims else None

    def _check_fixed_batch(self, batch_size: int, n: int, d: int | None) -> None:
        w = self.world_size
        if d is not None and (batch_size != d or n % (d * w)):
            each = f" on each of {w} processes" if w > 1 else ""
            raise InputError(f"the model's inputs have a fixed first dimension {d}: train with batch size {d}{each} "
                             f"(--batch-size {d}) on a multiple of {d * w} samples (got batch size {batch_size}, "
                             f"{n} samples)")

    def _classes(self) -> int | None:
        """The number of classes (the logits' last dimension) when it is static."""
        vi = next((v for v in self.spec.model.outputs if v.name == self.spec.loss.output), None)
        d = vi.shape[-1] if vi is not None and vi.shape else None
        return d if isinstance(d, int) else None

    def _feeds(self, ds: datasets.Dataset, rows) -> dict[str, np.ndarray]:
        return ds.feeds(rows)

    # ------------------------------------------------------------------------------------------ training

    def step(self, batch: Data, static: Mapping[str, np.ndarray] | None = None) -> float:
        """One optimizer step on ``batch`` (all of it; with ``distributed``, this rank's part of the global
        batch, which is the union of every rank's ``batch``); returns the loss of the global batch before the
        update."""
        if self.spec.total and not int(self._engine.read([self.spec.total])[self.spec.total]):
            raise InputError(f"the {self.spec.optimizer.schedule.kind} schedule needs its total steps: give "
                             "Schedule(total_steps=N), or train with fit(), which counts them")
        ds = self.arrays(batch, static)
        feeds, count = ds.feeds(slice(None)), ds.weight(slice(None))
        total = self.comm.sum([count])[0] if self.comm else count
        if not total:  # no counted target anywhere: the loss is 0 with zero gradient, weigh by samples
            count = ds.n
            total = self.comm.sum([count])[0] if self.comm else count
        loss = self._engine.step(feeds, count, total)
        self.losses.append(loss)
        return loss

    @V.checked_inside(**FIT_RULES)
    def fit(self, data: Data, epochs: int | None = None, batch_size: int = 32, *, shuffle: bool = True,
            seed: int = 0, progress: bool = True, console=None, description: str = "training",
            checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int = 0,
            nonfinite: str = "stop", accumulate_steps: int = 1,
            static: Mapping[str, np.ndarray] | None = None, override=(),
            snapshot_dir: str | os.PathLike | None = None, snapshot_every: int | None = None,
            max_steps: int | None = None, eval_data: Data | None = None, eval_every: int | None = None,
            eval_batch_size: int | None = None, callbacks: Iterable = ()) -> list[float]:
        """Train for ``epochs`` passes over ``data`` (default 1), or for ``max_steps`` optimizer steps (as many
        epochs as they need, the last cut short; not both), in batches of ``batch_size`` per process (module
        doc: the global batch is ``batch_size * world_size``; the last batch of an epoch may be smaller).
        ``eval_data`` (the same forms as ``data``) is evaluated every ``eval_every`` steps and at the end, in
        batches of ``eval_batch_size`` (default ``batch_size``): :meth:`evaluate`. ``callbacks``: callables that
        rank 0 calls after every step with the step's record, a dict of ``step``, ``epoch``, ``loss``, ``lr``,
        ``grad_norm``, ``samples_per_s``, ``samples`` and, after an evaluation, ``eval_loss`` and
        ``eval_accuracy`` (:mod:`revgraph.train.fit_loop`; writers: :mod:`revgraph.train.runlog`).
        ``accumulate_steps`` ``K``: each optimizer step runs forward and backward on ``K`` micro-batches, sums
        their gradients (weighted by sample counts) and exchanges and updates once (module doc: the step equals
        one step with ``batch_size * K``, in the same data order). ``shuffle``:
        each epoch visits the samples in the order of ``numpy.random.default_rng(seed + epoch).permutation(n)``
        (epochs counted from 0 per call), else in order. ``progress`` shows a rich progress bar (on rank 0)
        with the loss and the throughput (samples/s over all ranks) on ``console`` (a ``rich.console.Console``).

        ``snapshot_dir`` (also spelt ``checkpoint_dir``, its name before the loop policy and the training snapshot
        got one word each) and ``snapshot_every`` (``checkpoint_every``): rank 0 saves the parameters, optimizer state,
        step and data position there (:mod:`revgraph.train.snapshots`) every ``checkpoint_every`` steps (0: at the end
        of each epoch) and at the end; and when the directory already holds a checkpoint of this run, training resumes
        from it (on every rank; only rank 0 reads the file), so a restarted run reaches the weights of an
        uninterrupted one. It resumes at any world size whose global batch (``batch_size * world_size``)
        equals the checkpoint's, sharded or not (the data order and the steps are the same; elastic resume).
        A checkpoint records every hyperparameter (:mod:`revgraph.train.run_record`); resuming with another value of
        one is refused unless ``override`` names it (a list of recorded names: ``"lr"``, ``"weight_decay"``,
        ``"lr_schedule"``, ``"total_steps"``...), which trains on with the new value and says so.
        A linear or cosine schedule without ``total_steps`` decays over the steps of this call:
        ``epochs * ceil(samples / (batch_size * world_size * accumulate_steps))``, counted by the trainer's step
        counter from its first step (a second ``fit`` on the same trainer continues past the end, at ``min_lr``,
        unless ``Schedule(total_steps=)`` plans for both).

        ``nonfinite="stop"`` (the default) stops at the first step whose loss is NaN or infinite, and at the end
        when the last update left a parameter NaN or infinite, raising :class:`NonFiniteError` that names the
        step; the trainer keeps the parameters and state from before that step (nothing of it is checkpointed).
        ``"continue"`` trains on regardless. Raises :class:`InputError`
        for bad data or sizes, :class:`RevgraphError` for a checkpoint of another run or a damaged or edited one
        (every field is checked before a step: :mod:`revgraph.train.snapshot_checks`). Returns the mean loss of each
        epoch (a last epoch cut short by ``max_steps``: of its batches trained). ``data`` may be a directory
        of ``.npy`` files (memory-mapped); ``static`` maps inputs to arrays fed whole to every step
        (:mod:`revgraph.train.data`). A loss that is a mean over counted targets (``ignore_index``, class weights)
        weighs each micro-batch and rank by its counted targets, so a step is the mean over the global batch's.

        With ``distributed``, every argument (and whether ``checkpoint_dir`` is given) and the data are compared
        across ranks before the first step, and a rank that refuses its data makes every rank stop with one line.
        A deterministic failure (any :class:`RevgraphError` but a failed collective) is recorded for torchrun's
        ``--max-restarts``, and a restarted attempt stops at once with the same message
        (:func:`revgraph.train.distributed.launch.recorded_failure`).
        """
        V.check(Trainer.fit, locals())  # (the rules' checks, here rather than in a wrapper: one frame fewer)
        if snapshot_dir is not None or snapshot_every is not None:
            if checkpoint_dir is not None or checkpoint_every:
                raise InputError("give snapshot_dir/snapshot_every or their old names checkpoint_dir/checkpoint_every, "
                                 "not both")
            checkpoint_dir, checkpoint_every = snapshot_dir, snapshot_every or 0
        if checkpoint_every and checkpoint_dir is None:  # (issue 40: it was accepted and saved nothing)
            raise InputError("snapshot_every has no effect without snapshot_dir: give the directory, or leave "
                             "snapshot_every out")
        more = {"max_steps": max_steps, "eval_data": eval_data, "eval_every": eval_every,
                "eval_batch_size": eval_batch_size, "callbacks": list(callbacks or ())}
        # the steps run here, not in a helper: every batch's path from the caller to the session is as short as
        # it can be (tests/test_train_frames.py counts its frames)
        with self._failure_recorded(checkpoint_dir):
            if self.comm:  # an earlier attempt of this torchrun run failed deterministically: fail alike, at once
                from .distributed.launch import recorded_failure

                recorded_failure(self.comm, checkpoint_dir)
            try:
                plan, arrays = fit_loop.plan(self, data, epochs, batch_size, shuffle, seed, checkpoint_every,
                                             nonfinite, accumulate_steps, static, more)
                eval_data, callbacks = more.get("eval_data"), more.get("callbacks", [])
                refused = None
            except InputError as exc:
                if not self.comm:
                    raise
                refused, plan, arrays, eval_data, callbacks = str(exc), None, None, None, []
            if self.comm:  # different data or arguments on some rank would deadlock or train wrongly: refuse
                self.comm.refuse_together(refused, "its data or fit arguments")
                fit_loop.agree(self, plan, arrays, checkpoint_dir, checkpoint_every, nonfinite)
            schedule, stop = self.spec.optimizer.schedule, nonfinite == "stop"
            total_steps = (schedule.total_steps or plan.steps) if self.spec.total else None
            if schedule is not None and schedule.warmup_steps > (total_steps or plan.steps) and self.is_main:
                run_record.note(console, f"warning: the warmup ({schedule.warmup_steps} steps, --warmup-steps) is "
                                         f"longer than the run ({total_steps or plan.steps} steps): the peak "
                                         "learning rate is never reached")
            pos = run_record.resume(self, checkpoint_dir, plan.run, total_steps, override, console,
                                    epochs=plan.epochs, finite=stop) \
                if checkpoint_dir is not None else run_record.Position()
            run_record.set_total(self, total_steps)
            bar = Bar(progress and self.is_main, console, description, plan.steps,
                      done=min(pos.done(plan.per_epoch), plan.steps))
            evaluation = fit_loop.Evaluation(self, eval_data, static, plan.eval_every, plan.eval_batch_size)
            loop = fit_loop.Loop(self, plan, arrays, pos, stop=stop, total_steps=total_steps,
                                 checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, bar=bar,
                                 description=description, evaluation=evaluation, callbacks=callbacks)
            with bar:
                for args, how in loop:  # (the loop yields each step's arguments; the engine is called here)
                    loop.took(self._engine.step(*args, **how))
            stepped = loop.stepped
            sharded = hasattr(self._engine, "nonfinite")  # (ZeRO-3: tested on the shards, written from rank 0)
            final = {} if sharded else self.parameters
            bad = (self._engine.nonfinite() if sharded else
                   next((p for p, a in final.items() if not np.isfinite(a).all()), None)) if stop and stepped else None
            if bad:
                done = pos.done(plan.per_epoch) - 1
                self._reject_step(f"parameter {bad!r} became NaN or infinite", done // plan.per_epoch,
                                  done % plan.per_epoch)
            self._engine.release()  # the values from before the last step are no longer needed
            if self.comm:  # (a sharded engine's state is gathered, the same on every rank: reading it would only
                # make every rank hold the whole state, which sharding avoids)
                state = {} if getattr(self._engine, "gathers", False) else self.state
                self.comm.check_replicas({**final, **state}, "parameters or optimizer state")
            if sharded:  # (a collective) the trained parameters on rank 0 alone, which writes the model
                self._engine.keep_for_writing()
            if pos.batch:  # a last epoch cut short by max_steps: the mean over its batches
                return [*pos.means, pos.total / min(pos.batch * plan.group, plan.n)]
            return list(pos.means)

    @contextmanager
    def _failure_recorded(self, checkpoint_dir):
        """Record a deterministic failure (any :class:`RevgraphError` but a failed collective) of a distributed
        fit for torchrun's ``--max-restarts`` (:func:`revgraph.train.distributed.launch.recorded_failure`): a
        restart would fail again."""
        try:
            yield
        except RevgraphError as exc:
            from .distributed.data_parallel import CollectiveError

            if self.comm and not isinstance(exc, CollectiveError):
                from .distributed.launch import record_failure

                record_failure(str(exc), self.rank, checkpoint_dir)
            raise

    def _reject_step(self, what: str, epoch: int, batch: int, applied: bool = True) -> None:
        """Undo the last step (unless it was not ``applied``) and raise :class:`NonFiniteError` naming it (every
        rank sees the same global loss and parameters, so every rank stops at the same step)."""
        step = self.steps + (0 if applied else 1)
        if applied:
            self._engine.undo()
        self.losses.pop()
        raise NonFiniteError(f"{what} at step {step} (epoch {epoch + 1}, batch {batch + 1}); the trainer keeps the "
                             "parameters from before it: lower the learning rate or look for NaN or infinite values "
                             "in the data (--allow-nonfinite, or fit(nonfinite='continue'), trains on regardless)")

    @V.arguments(batch_size=V.POSITIVE_INT)  # (data, static: revgraph.train.data)
    def evaluate(self, data: Data, batch_size: int = 32,
                 static: Mapping[str, np.ndarray] | None = None) -> dict[str, float | None]:
        """The mean loss over ``data`` with the current parameters (over the counted targets for a loss with
        ``ignore_index`` or class weights; the mean of the model's own loss output for ``output:NAME``), and the
        accuracy for classification: ``argmax(logits) == label`` for cross-entropy (the next token for
        causal-lm), ``(logit > 0) == (label > 0.5)`` for bce, ``None`` for mse and ``output:NAME``, and
        ``None`` too when any output is NaN or infinite (``nonfinite`` counts those outputs). With
        ``distributed``, each rank evaluates its share and the sums are all-reduced. ``batch_size`` samples per
        run (per rank), as :meth:`fit`'s default: a larger batch holds more logits at once. Returns
        ``{"loss": float, "accuracy": float | None, "samples": int, "nonfinite": int}``."""
        arrays = self.arrays(data, static)
        n = arrays.n
        fixed = arrays.fixed_batch()
        batch_size = fixed or batch_size
        if fixed:
            self._check_fixed_batch(batch_size, n, fixed)
        mine = shard(np.arange(n), self.rank, self.world_size)
        if hasattr(self._engine, "gather_for_evaluation"):  # (ZeRO-3: on every rank, before their uneven shares)
            self._engine.gather_for_evaluation()
        sums = np.zeros(5)  # loss * weight, weight, correct answers, answers, non-finite outputs
        for start in range(0, len(mine), batch_size):
            rows = mine[start:start + batch_size]
            feeds = self._feeds(arrays, rows)
            loss, out = self._engine.evaluate(feeds)
            sums += datasets.score(self.spec, feeds, loss, out, arrays.weight(rows))
        if self.comm:
            sums = self.comm.sum(sums)
        # an argmax or sign of NaN outputs is no answer: no accuracy is computed from them
        no_accuracy = loss_kind(self.spec.loss.kind).accuracy is None
        accuracy = None if no_accuracy or sums[4] else float(sums[2] / max(sums[3], 1))
        # Python numbers, not numpy scalars (they print as np.float64(...) and json.dumps refuses them)
        return {"loss": float(sums[0] / sums[1]) if sums[1] else 0.0, "accuracy": accuracy, "samples": int(n),
                "nonfinite": int(sums[4])}

    @V.arguments(inputs=V.FEEDS, static=V.STATIC)
    def predict(self, inputs: Mapping[str, np.ndarray] | np.ndarray,
                static: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """The model output the loss reads, for ``inputs`` (an array for a one-input model, or arrays by
        input name), with the current parameters; training-mode ``BatchNormalization`` normalizes with its
        running statistics, as in :meth:`evaluate`; ``static`` inputs are fed as given. Raises :class:`RevgraphError` if
        onnxruntime fails."""
        from ..runtime import Session
        from .distributed.sync_batchnorm import inference_batchnorms

        static = dict(static or {})
        if not isinstance(inputs, Mapping):
            inputs = {next(n for n in self.spec.inputs if n not in static): inputs}
        inputs = {**inputs, **static}
        model = self.spec.model.copy()
        inference_batchnorms(model)
        model.initializers.update(self._written())
        types = {v.name: v.dtype for v in model.inputs}
        feeds = {k: np.asarray(v).astype(types.get(k), copy=False) for k, v in inputs.items()}
        return Session(model, device=self.device).run(feeds, [self.spec.loss.output])[self.spec.loss.output]

    # ------------------------------------------------------------------------------------------ output

    @V.arguments(path=V.PATH)
    def export(self, path: str | os.PathLike) -> Graph:
        """Write the inference model with the current parameters as its initializers; return that graph."""
        model = self.spec.model.copy()
        model.initializers.update(self._written())
        save(model, path)
        return model

    @V.arguments(path=V.PATH)
    def save_state_dict(self, path: str | os.PathLike) -> tuple[int, int]:
        """Write the current parameters as the PyTorch state dict of the module the model was exported from, a
        ``.safetensors`` file that ``module.load_state_dict(safetensors.torch.load_file(path))`` loads (names,
        buffers, LoRA adapters merged: :mod:`revgraph.train.hf_io`); returns ``(tensors, elements)``. Raises
        :class:`RevgraphError` for another suffix and a path that cannot be written."""
        from .hf_io import save_state_dict

        model = self.spec.model.copy()
        model.initializers.update(self._written())
        return save_state_dict(path, model)

    @V.arguments(path=V.PATH)
    def save_training_graph(self, path: str | os.PathLike) -> None:
        """Write the training-step graph (module doc of :mod:`revgraph.train`), with no initial values."""
        save(self.spec.graph, path)
