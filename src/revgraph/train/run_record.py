"""What a checkpoint records about its run, and resuming from it: :func:`record`, :func:`save`, :func:`resume`.

A checkpoint (:mod:`revgraph.train.snapshots`) holds the parameters, the optimizer state, the step counter (and a
schedule's total steps) and, in its metadata, the position in the data and what that position depends on
(batch size, world size, seed, shuffling, samples, accumulation), plus ``"hyperparameters"``, the record of
every setting that changes the numbers a step computes (:func:`record`): the optimizer kind, ``lr``,
``momentum``, ``betas``, ``eps``, ``weight_decay`` and the parameters it skips (``no_decay``), the schedule
(``lr_schedule``, ``warmup_steps``, ``min_lr``, ``total_steps``), ``clip_grad_norm``, the loss settings
(``loss``: ``LossSpec.settings``), the precision and every ``revgraph.*`` entry of the model's metadata (the
LoRA configuration ``revgraph.lora``).

Resuming with a different value of a recorded setting is refused with one line naming each (the checkpoint's
value, then now's), unless it is named in ``override`` (``fit(override=[...])``, ``--override NAME``): then the
run trains on with the new value and says so in one line. A checkpoint written before the record existed
resumes as before: its missing settings count as their defaults (:data:`OLD_DEFAULTS`: no schedule, no
clipping, decay on every parameter, fp32); those it never recorded (the learning rate...) cannot be compared.
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import RevgraphError
from ..warn import warn
from . import snapshot_checks, snapshots

#: The recorded settings' values for checkpoints that do not record them (written before the record existed).
OLD_DEFAULTS = {"lr_schedule": "constant", "warmup_steps": 0, "min_lr": 0.0, "total_steps": None,
                "clip_grad_norm": None, "no_decay": [], "precision": "fp32", "embedding_update": "lazy",
                "straight_through": False}


def record(spec, total: int | None = None) -> dict:
    """The JSON-able record of ``spec``'s hyperparameters (module doc); ``total``: the schedule's total steps of
    this run (recorded for linear and cosine schedules only)."""
    rec = {**spec.optimizer.settings(), "no_decay": list(spec.no_decay), "total_steps": total if spec.total else None,
           "loss": getattr(spec.loss, "settings", {"kind": spec.loss.kind, "output": spec.loss.output}),
           "precision": getattr(spec, "precision", "fp32")}
    if not getattr(spec, "sparse", None):  # (only a table updated from gradient rows has a choice of update)
        rec.pop("embedding_update", None)
    if getattr(spec, "straight_through", False):  # (recorded where used: older snapshots compare as without it)
        rec["straight_through"] = True
    scaling = getattr(spec, "scaling", None)
    if scaling is not None:  # fp16: GradScaler's options (the scale itself is carried state, in the arrays:
        # its initial value does not matter once resumed)
        p = scaling.precision
        rec.update(growth_factor=p.growth_factor, backoff_factor=p.backoff_factor, growth_interval=p.growth_interval)
    metadata = getattr(spec.model, "metadata", None) or {}
    rec.update((k, metadata[k]) for k in sorted(metadata) if k.startswith("revgraph."))
    return json.loads(json.dumps(rec))  # as it reads back from the file (tuples as lists)


def rank_settings(spec) -> dict:
    """The record of ``spec`` as data-parallel ranks compare it before the first step
    (``Collective.check_same``; the loss settings under ``"loss settings"``, beside the loss's name)."""
    rec = record(spec)
    rec["loss settings"] = rec.pop("loss")
    return rec


def differences(then: dict | None, now: dict) -> list[tuple[str, object, object]]:
    """``(name, checkpoint's value, now's value)`` for each recorded setting that differs; ``then`` ``None``
    for a checkpoint without a record (only :data:`OLD_DEFAULTS` can be compared)."""
    keys = list(OLD_DEFAULTS) if then is None else list(dict.fromkeys([*now, *then]))
    then = OLD_DEFAULTS if then is None else then
    out = []
    for k in keys:
        a, b = then.get(k, OLD_DEFAULTS.get(k)), now.get(k, OLD_DEFAULTS.get(k))
        if a != b:
            out.append((k, a, b))
    return out


def check_overrides(override, now: dict) -> list[str]:
    """``override`` as a list of recorded names. Raises :class:`RevgraphError` for a name the record lacks."""
    names = [override] if isinstance(override, str) else list(override or [])
    for n in names:
        if n not in now and n not in OLD_DEFAULTS:
            raise RevgraphError(f"--override {n}: not a recorded setting; the checkpoint records "
                                f"{', '.join(now)}")
    return names


def save(trainer, directory, run: dict, pos, total: int | None) -> None:
    """Rank 0 writes a checkpoint of the trainer's current state at ``pos`` (the next batch to train); a sharded
    engine gathers the state on every rank first (:mod:`revgraph.train.distributed.sharding`), so the file is the
    same."""
    engine = trainer._engine
    gathers = getattr(engine, "gathers", False)
    if not trainer.is_main and not gathers:
        return
    values = engine.read(engine.names, root_only=True) if gathers else engine.read(engine.names)
    if not trainer.is_main:
        return
    meta = {**run, "epoch": pos.epoch, "batch": pos.batch, "epoch_loss_sum": pos.total,
            "steps_taken": trainer.steps_taken, "epoch_means": pos.means, "optimizer": trainer.spec.optimizer.kind,
            "hyperparameters": record(trainer.spec, total)}
    snapshots.save(directory, values, meta)


class Position:
    """Where training stands: the epoch, the next batch in it, the loss sum of the epoch so far (over global
    batches, each loss times its size) and the mean losses of the finished epochs."""

    def __init__(self, epoch: int = 0, batch: int = 0, total: float = 0.0, means: list | None = None):
        self.epoch, self.batch, self.total, self.means = epoch, batch, total, means or []

    def done(self, per_epoch: int) -> int:
        """The steps of the run before this position (``per_epoch`` steps an epoch)."""
        return self.epoch * per_epoch + self.batch


def resume(trainer, directory, run: dict, total: int | None, override=(), console=None, *, epochs: int | None = None,
           finite: bool = False) -> Position:
    """Load the checkpoint in ``directory`` into the trainer's engine (on every rank; rank 0 reads the file and
    checks every field of it, :mod:`revgraph.train.snapshot_checks`, before anything is loaded) and return its position
    in the data (the start when there is none); set the trainer's ``taken_before`` and ``resumed`` (the per-step
    losses are not in a snapshot: ``trainer.losses`` holds this process's). ``epochs``: of this
    fit; ``finite``: the run stops at non-finite values, so the snapshot may hold none. Raises
    :class:`RevgraphError` (one line naming the file and the field, on every rank) for a damaged or edited
    snapshot, one of another model, optimizer, global batch or run, and for a recorded hyperparameter that
    differs from now's unless ``override`` names it (module doc)."""
    now = record(trainer.spec, total)
    names_ok = check_overrides(override, now)
    engine = trainer._engine
    names = engine.names
    where = str(snapshots.path_in(directory))
    found, refused = None, None
    if trainer.is_main:
        try:
            found = _checked(trainer.spec, directory, where, run, names, now, names_ok, epochs, finite)
        except RevgraphError as exc:
            refused = str(exc)
    if trainer.comm:  # every rank refuses with rank 0 (the others would wait for its broadcast)
        trainer.comm.refuse_together(refused, "the checkpoint")
    elif refused:
        raise RevgraphError(refused)
    text = json.dumps(found[1]) if found else None
    if trainer.comm:
        text = trainer.comm.broadcast_text(text)
    if text is None:
        return Position()
    meta = json.loads(text)
    arrays = found[0] if found else None
    if trainer.comm:
        # the receiving ranks' shapes and dtypes from the graph: reading the engine's values would gather every
        # sharded one on every rank (--shard parameters: the whole model and its state at once)
        like = {n: np.broadcast_to(np.zeros((), dtype), shape)
                for n, (shape, dtype) in snapshot_checks.expected(trainer.spec).items()}
        if getattr(engine, "gathers", False):  # sharded: one array at a time, each rank keeping its slices of it
            for n in names:
                engine.load(trainer.comm.broadcast_arrays(arrays, [n], like))
        else:
            engine.load(trainer.comm.broadcast_arrays(arrays, names, like))
    else:
        engine.load(arrays)
    changed = differences(meta.get("hyperparameters"), now)
    if changed and trainer.is_main:
        note(console, f"resuming {where} with " + ", ".join(_change(k, a, b, "instead of") for k, a, b in changed)
             + " (overridden)")
    trainer.taken_before = snapshot_checks.steps_taken(meta) - len(trainer.losses)  # (losses: of this process)
    trainer.resumed = f"{where} (epoch {meta['epoch'] + 1}, step {trainer.steps})"
    return Position(meta["epoch"], meta["batch"], meta["epoch_loss_sum"], list(meta["epoch_means"]))


def _checked(spec, directory, where: str, run: dict, names: list[str], now: dict, names_ok, epochs,
             finite: bool) -> tuple[dict, dict] | None:
    """Rank 0's reading of the snapshot, every field checked (:func:`resume`): ``(arrays, meta)`` or ``None``."""
    def check(meta: dict) -> None:  # before the arrays are read: another run is named as such
        snapshot_checks.check_meta(meta, where, run, names, spec.optimizer.kind, epochs, finite)
        refused = [(k, a, b) for k, a, b in differences(meta.get("hyperparameters"), now) if k not in names_ok]
        if refused:
            said = ", ".join(_change(k, a, b) for k, a, b in refused)
            flags = " ".join(f"--override {k}" for k, _, _ in refused)
            raise RevgraphError(f"{where} was written with {said}; resume with the same value, or give {flags} "
                                "(fit(override=[...])) to train on with the new one, or move it away to start afresh")

    found = snapshots.load(directory, snapshot_checks.expected(spec), names, spec.step, check)
    if found is None:
        return None
    arrays, meta = found
    snapshot_checks.check_arrays(arrays, meta, where, spec, run, finite)
    return found


def _change(k: str, a, b, how: str = "now") -> str:
    """``"lr 0.003 (now 0.006)"``; a JSON record (``revgraph.lora``) shows only its entries that differ, as
    ``"revgraph.lora rank 4 (now 8)"``, not the whole configuration (kilobytes of adapter sites)."""
    def parsed(v):
        try:
            v = json.loads(v) if isinstance(v, str) else None
        except (ValueError, RecursionError):  # (a snapshot's text: not necessarily JSON)
            return None
        return v if isinstance(v, dict) else None

    def r(v) -> str:  # (a snapshot's value may be a megabyte of text)
        text = repr(v)
        return text if len(text) <= 400 else text[:397] + "..."

    ja, jb = parsed(a), parsed(b)
    if ja is None or jb is None:
        return f"{k} {r(b)} instead of {r(a)}" if how != "now" else f"{k} {r(a)} (now {r(b)})"
    parts = []
    for x in dict.fromkeys([*ja, *jb]):
        va, vb = ja.get(x), jb.get(x)
        if va != vb:
            short = len(repr(va)) + len(repr(vb)) < 120
            parts.append((f"{x} {vb!r} instead of {va!r}" if how != "now" else f"{x} {va!r} (now {vb!r})")
                         if short else f"other {x}")
    return f"{k} " + ", ".join(parts)


def note(console, text: str) -> None:
    """Say ``text`` in one line: on ``console`` (a ``rich.console.Console``) when given, else as a warning."""
    if console is not None:
        console.print(text, soft_wrap=True, markup=False)
    else:
        warn(text)


def set_total(trainer, total: int | None) -> None:
    """Feed the schedule's total steps (linear and cosine) to the engine: the carried ``TrainingGraph.total``."""
    if trainer.spec.total and total:
        trainer._engine.load({trainer.spec.total: np.array(total, dtype=np.int64)})
