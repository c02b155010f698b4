"""The loop of :meth:`revgraph.Trainer.fit`: :class:`FitPlan` (the arguments checked and the sizes they imply),
:func:`agree` (the data-parallel ranks compare them) and :class:`Loop` (epochs, steps, snapshots, evaluation and
the per-step record handed to callbacks; fit runs each step it yields).

A run's length: ``epochs`` passes over the data, or ``max_steps`` optimizer steps (as many epochs as they need,
the last one cut short; ``transformers.TrainingArguments.max_steps``), counted from the start of the run, so a
run resumed from a snapshot stops where the uninterrupted one would. Evaluation (``eval_every`` steps, and at
the end when ``eval_data`` is given) reads ``eval_data`` in batches of ``eval_batch_size`` (default: the training
batch size), so it never holds more than a training step of the same batch.

Every step, rank 0 calls each callback with the step's record (:data:`RECORD_FIELDS`): ``step`` (the batches
the run has trained, this one included: :attr:`revgraph.Trainer.steps_taken`, which fp16's skipped updates
advance too), ``epoch`` (1-based), ``loss``, ``lr`` (the rate the step used, schedule applied), ``grad_norm`` (with
clipping, the gradients' global L2 norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it;
``None`` without clipping, and with ZeRO sharding), ``samples_per_s`` (over all ranks, since the run started) and
``samples`` (the step's global batch); a step after which the evaluation ran also holds ``eval_loss`` and
``eval_accuracy``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError, InternalError
from . import run_record
from .progress_bar import Bar

#: The fields of the record each callback gets per step (module doc); the evaluation's are added after it ran.
RECORD_FIELDS = ("step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "samples")
EVAL_FIELDS = ("eval_loss", "eval_accuracy")


@dataclass
class FitPlan:
    """The checked arguments of one :meth:`revgraph.Trainer.fit` and the sizes they imply (module doc of
    :mod:`revgraph.train.trainer`): ``micro`` samples per global micro-batch, ``group`` per step, ``per_epoch``
    steps per epoch, ``steps`` of the whole run and ``total_steps`` of the schedule (``None``: none needed)."""

    n: int
    epochs: int
    batch_size: int
    world: int
    accumulate: int = 1
    shuffle: bool = True
    seed: int = 0
    max_steps: int | None = None
    eval_every: int = 0
    eval_batch_size: int | None = None
    micro: int = field(init=False)
    group: int = field(init=False)
    per_epoch: int = field(init=False)
    steps: int = field(init=False)

    def __post_init__(self) -> None:
        self.micro = self.batch_size * self.world  # a global micro-batch; a step takes `accumulate` of them
        self.group = self.micro * self.accumulate
        self.per_epoch = -(-self.n // self.group)
        if self.max_steps is not None:
            self.epochs = -(-self.max_steps // self.per_epoch)
        self.steps = self.max_steps if self.max_steps is not None else self.epochs * self.per_epoch
        self.eval_batch_size = self.eval_batch_size or self.batch_size

    @property
    def run(self) -> dict:
        """What a snapshot's position depends on (checked on resume: :mod:`revgraph.train.snapshot_checks`)."""
        return {"batch_size": self.batch_size, "world_size": self.world, "seed": self.seed, "shuffle": self.shuffle,
                "samples": self.n, "accumulate_steps": self.accumulate}


def check_length(epochs, max_steps, eval_every, eval_batch_size, eval_data) -> tuple[int, int | None]:
    """``(epochs, max_steps)`` of a fit: ``epochs`` (default 1) or ``max_steps``, not both. Raises
    :class:`InputError` (one line) for both, for non-positive values, and for ``eval_every`` or
    ``eval_batch_size`` without ``eval_data``."""
    def positive(name: str, v) -> None:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1):
            raise InputError(f"{name} must be a positive integer, got {v!r}")

    for name, v in (("epochs (--epochs)", epochs), ("max_steps (--max-steps)", max_steps),
                    ("eval_every (--eval-every)", eval_every),
                    ("eval_batch_size (--eval-batch-size)", eval_batch_size)):
        positive(name, v)
    if epochs is not None and max_steps is not None:
        raise InputError("give epochs (--epochs) or max_steps (--max-steps), not both: max_steps trains that many "
                         "steps, over as many epochs as they need")
    if eval_data is None and (eval_every or eval_batch_size):
        raise InputError("eval_every and eval_batch_size (--eval-every, --eval-batch-size) evaluate eval_data: give "
                         "eval_data (--eval-data FILE), or leave them out")
    return (1 if epochs is None and max_steps is None else epochs), max_steps


def plan(trainer, data, epochs, batch_size, shuffle, seed, checkpoint_every, nonfinite, accumulate_steps, static,
         more: dict):
    """``(FitPlan, Dataset)`` of one :meth:`revgraph.Trainer.fit` (``more``: its ``max_steps``, ``eval_data``,
    ``eval_every``, ``eval_batch_size`` and ``callbacks``), every argument and the data checked (the evaluation
    data too: bad evaluation data fails before the first step, not after it). Raises :class:`InputError` (one
    line) for the first bad one."""
    if nonfinite not in ("stop", "continue"):
        raise InputError(f"nonfinite must be 'stop' or 'continue', got {nonfinite!r}")
    epochs, max_steps = check_length(epochs, more.get("max_steps"), more.get("eval_every"),
                                     more.get("eval_batch_size"), more.get("eval_data"))
    if batch_size < 1 or checkpoint_every < 0:
        raise InputError(f"batch size must be positive and checkpoint_every >= 0, got {batch_size} and "
                         f"{checkpoint_every}")
    if not isinstance(accumulate_steps, int | np.integer) or accumulate_steps < 1:
        raise InputError(f"accumulate_steps (--accumulate-steps) must be a positive integer, got {accumulate_steps!r}")
    callbacks = more.get("callbacks", [])
    if not all(callable(c) for c in callbacks):
        raise InputError("callbacks must be callables taking the step's record (a dict), got "
                         f"{next(c for c in callbacks if not callable(c))!r}")
    trainer._settings.refuse(int(accumulate_steps))
    arrays = trainer.arrays(data, static)
    if arrays.n == 0:
        raise InputError("the training data holds no samples")
    trainer._check_fixed_batch(batch_size, arrays.n, arrays.fixed_batch())
    if more.get("eval_data") is not None:
        try:
            trainer.arrays(more["eval_data"], static)
        except InputError as exc:
            raise InputError(f"eval_data (--eval-data): {exc}") from None
    return FitPlan(arrays.n, epochs, batch_size, trainer.world_size, int(accumulate_steps), bool(shuffle), seed,
                   max_steps, more.get("eval_every") or 0, more.get("eval_batch_size")), arrays


def agree(trainer, plan: FitPlan, arrays, checkpoint_dir, checkpoint_every: int, nonfinite: str) -> None:
    """Every data-parallel rank must fit the same data with the same arguments (else a collective would
    deadlock or the ranks would train different weights): compared here, before the first step."""
    comm = trainer.comm
    comm.check_same({"epochs": plan.epochs, "batch size": plan.batch_size, "shuffle": bool(plan.shuffle),
                     "seed": plan.seed, "checkpoint interval": checkpoint_every, "nonfinite": nonfinite,
                     "accumulate steps": plan.accumulate, "max steps": plan.max_steps, "eval every": plan.eval_every,
                     "eval batch size": plan.eval_batch_size,
                     "checkpoint directory given": checkpoint_dir is not None}, "fit arguments",
                    "give every rank the same epochs or max steps, batch size, seed, shuffling, evaluation, "
                    "checkpoint interval and nonfinite mode (--allow-nonfinite), and a --checkpoint-dir on every "
                    "rank or none")
    args = np.array([plan.epochs, plan.batch_size, plan.shuffle, plan.seed, checkpoint_every, plan.accumulate,
                     plan.max_steps or 0], np.int64)
    comm.check_replicas({**arrays.hashed(), "fit arguments": args}, "training data or fit arguments",
                        "give every rank the same data and the same epochs, batch size, seed, accumulation and "
                        "checkpoint interval")


def epoch_order(n: int, shuffle: bool, seed: int) -> np.ndarray:
    """The order in which an epoch visits ``n`` samples: ``default_rng(seed).permutation(n)``, or ``arange(n)``."""
    return np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)


def shard(rows: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s share of ``rows``: every ``world_size``-th entry from position ``rank`` (how
    ``torch.utils.data.DistributedSampler`` deals an epoch, batch by batch). The shares of all ranks together
    are ``rows``, each exactly once; their sizes differ by at most one."""
    return rows[rank::world_size]


def learning_rate(trainer, step: int, total: int | None) -> float:
    """The learning rate of the step taken at step counter ``step`` (0-based), as the graph computes it
    (:func:`revgraph.train.schedules.learning_rate`)."""
    opt = trainer.spec.optimizer
    return opt.lr if opt.schedule is None else opt.lr * opt.schedule.factor(step, total, opt.lr)


class Evaluation:
    """``eval_data`` evaluated every ``every`` steps of the run (0: only at the end) in batches of ``batch_size``
    (:meth:`revgraph.Trainer.evaluate`, on every rank: it all-reduces); :attr:`last` holds the latest result."""

    def __init__(self, trainer, data, static, every: int, batch_size: int):
        self.trainer, self.data, self.static, self.every, self.batch_size = trainer, data, static, every, batch_size
        self.last: dict | None = None

    def __call__(self) -> dict:
        self.last = self.trainer.last_evaluation = self.trainer.evaluate(self.data, self.batch_size, static=self.static)
        return self.last

    def due(self, done: int) -> bool:
        return self.data is not None and bool(self.every) and done % self.every == 0


class Loop:
    """The steps of ``plan`` from position ``pos`` (a :class:`revgraph.train.run_record.Position`, updated in
    place). Iterating yields each step's arguments of :meth:`revgraph.train.engines.Engine.step`, ``(args,
    kwargs)``; the caller runs the step and hands its loss to :meth:`took`, which does the step's bookkeeping:
    the losses, the non-finite check, the bar, snapshots, evaluation and the callbacks' record (module doc).
    :attr:`stepped`: whether a step ran.

    The caller (:meth:`revgraph.Trainer.fit`), not the loop, calls the engine, as a training loop calls its
    step for each batch a data loader yields: every frame between ``fit`` and the session is on the path of
    every batch (tests/test_train_frames.py), and a suspended generator's frame is not."""

    def __init__(self, trainer, plan: FitPlan, arrays, pos, *, stop: bool, total_steps: int | None, checkpoint_dir,
                 checkpoint_every: int, bar: Bar, description: str, evaluation: Evaluation, callbacks):
        self.trainer, self.plan, self.arrays, self.pos, self.stop = trainer, plan, arrays, pos, stop
        self.total_steps, self.checkpoint_dir, self.checkpoint_every = total_steps, checkpoint_dir, checkpoint_every
        self.bar, self.description, self.evaluation, self.callbacks = bar, description, evaluation, callbacks
        self.stepped, self._chunk, self._counter, self._last = False, None, 0, False
        self._seen, self._started = 0, time.perf_counter()

    def __iter__(self):
        trainer, plan, pos = self.trainer, self.plan, self.pos
        self._seen, self._started = 0, time.perf_counter()
        while pos.epoch < plan.epochs and pos.done(plan.per_epoch) < plan.steps:
            order = epoch_order(plan.n, plan.shuffle, plan.seed + pos.epoch)
            while pos.batch < plan.per_epoch:
                chunk = order[pos.batch * plan.group:(pos.batch + 1) * plan.group]
                # with "stop", a step with a non-finite loss is not applied, and the last step keeps the
                # values from before it (the check of the parameters below may have to return to them)
                last = pos.done(plan.per_epoch) + 1 == plan.steps
                self._chunk, self._counter = chunk, trainer.steps
                yield (_shares(self.arrays, chunk, plan.micro, plan.accumulate, trainer.rank, trainer.world_size),
                       {"accept": _finite if self.stop else None, "keep_previous": self.stop and last})
                if self._chunk is not None:
                    raise InternalError("a step of fit's loop ran without its loss handed to Loop.took")
                if self._last:
                    break

    def took(self, loss: float) -> None:
        """The bookkeeping after the step just yielded, whose global batch's loss is ``loss`` (class doc)."""
        trainer, plan, pos, chunk = self.trainer, self.plan, self.pos, self._chunk
        self._chunk = None
        trainer.losses.append(loss)
        self.stepped = True
        if self.stop and not np.isfinite(loss):
            trainer._reject_step(f"the loss is {loss}", pos.epoch, pos.batch, applied=False)
        pos.total += loss * len(chunk)
        pos.batch += 1
        self._seen += len(chunk)
        rate = self._seen / max(time.perf_counter() - self._started, 1e-9)
        self.bar.advance(f"{self.description} epoch {pos.epoch + 1}/{plan.epochs}", loss, rate)
        # (the batches taken: fp16 loss scaling's skipped updates do not advance trainer.steps)
        record = {"step": trainer.steps_taken, "epoch": pos.epoch + 1, "loss": float(loss),
                  "lr": learning_rate(trainer, self._counter, self.total_steps),
                  "grad_norm": getattr(trainer._engine, "grad_norm", None),
                  "samples_per_s": rate, "samples": len(chunk)}
        ended = pos.batch == plan.per_epoch
        if ended:
            pos.means.append(pos.total / plan.n)
            pos.epoch, pos.batch, pos.total = pos.epoch + 1, 0, 0.0
        done, evaluation = pos.done(plan.per_epoch), self.evaluation
        if evaluation.due(done) or (evaluation.data is not None and done == plan.steps):
            ev = evaluation()
            record.update(eval_loss=ev["loss"], eval_accuracy=ev["accuracy"])
        every = self.checkpoint_every
        if self.checkpoint_dir is not None and (
                (trainer.steps % every == 0 if every else ended) or done == plan.steps):
            run_record.save(trainer, self.checkpoint_dir, plan.run, pos, self.total_steps)
        if trainer.is_main:
            for callback in self.callbacks:
                callback(dict(record))
        self._last = ended or done == plan.steps


def _shares(arrays, chunk, micro: int, accumulate: int, rank: int, world: int) -> tuple:
    """The arguments ``(feeds, count, total)`` of :meth:`revgraph.train.engines.Engine.step` for the global batch
    ``chunk``: this rank's share of it (``accumulate`` micro-batches: a list of ``(feeds, count)``)."""
    # each share weighs by what its loss is a mean over (samples, or counted targets)
    total = arrays.weight(chunk)
    size = arrays.weight if total else len  # (nothing counted: the loss is 0, zero gradient)
    total = total or len(chunk)
    if accumulate == 1:
        rows = shard(chunk, rank, world)
        return arrays.feeds(rows), size(rows), total
    # K global micro-batches of `micro` samples, each dealt over the ranks
    parts = [shard(chunk[j:j + micro], rank, world) for j in range(0, len(chunk), micro)]
    feeds = [(arrays.feeds(r), size(r)) for r in parts]
    return feeds, sum(c for _, c in feeds), total


def _finite(loss: float) -> bool:
    return bool(np.isfinite(loss))
