"""A training snapshot (``<dir>/checkpoint.npz``, :mod:`revgraph.train.snapshots`) is untrusted input: reading it and
checking every field before a step is trained on it.

:func:`read` opens the archive with bounds: the members must be exactly ``meta`` and ``a0`` ... ``a{k-1}`` (no
other, none twice), each array member's ``.npy`` header must declare the dtype and shape this run holds for the
name in that place (checked before its data is read, so a header declaring terabytes allocates nothing), and the
metadata's text is bounded (:data:`META_CHARS` characters, plus :data:`CHARS_PER_STEP` per step of the step
counter). A damaged archive (truncated, a flipped bit: the CRC) is refused, as is trailing data in a member.

:func:`check_meta` checks the metadata's fields, each for its type and range, then against this run: ``format``,
``names`` (this run's carried names in order) and ``optimizer``; ``batch_size``, ``world_size`` and
``accumulate_steps`` (positive integers whose product is this run's global batch: elastic resume, also at another
accumulation); ``seed``, ``shuffle``, ``samples`` (equal to this run's); ``epoch`` (0 to the run's epochs) and ``batch``
(0 to the batches per epoch - 1; 0 at the end); ``steps_taken`` (the steps of the run and of its trainer's earlier fits:
at least the batches up to the position); ``epoch_means`` (one per finished epoch) and ``epoch_loss_sum``: numbers,
finite unless the run allows non-finite values. (A snapshot written before issue 38 holds the per-step ``losses``
instead of ``steps_taken``: the means and the sum must be those of the losses, recomputed bit for bit, as many as
``earlier_losses`` (of a trainer's earlier fits) and the batches up to the position. The history grew without
bound, 67 KB at 720 steps: it is the ``--log`` file's now.) ``hyperparameters`` (an object of the recorded names, each
of its type; differences are :mod:`revgraph.train.run_record`'s). An unknown field is refused. :func:`check_arrays`
checks the values: parameters and optimizer state finite (unless allowed), Adam's second moments >= 0, the step counter
(``steps_taken``, fewer with fp16's skipped steps), a schedule's total steps >= 0, the fp16 loss scale finite
and > 0 and its count of good steps >= 0. Every refusal is one :class:`RevgraphError` line naming the file and
the field. Nothing else is stored: the data order is ``default_rng(seed + epoch)``'s, from the checked fields.
"""

from __future__ import annotations

import json
import lzma
import math
import struct
import zipfile
import zlib

import numpy as np

from ..errors import RevgraphError
from .optimizers import setting_types

FORMAT = "revgraph-checkpoint-1"  # (the metadata's "format"; revgraph.train.snapshots writes it)
#: characters the metadata may hold whatever the run (names, the record, the run's settings) ...
META_CHARS = 1 << 20
#: ... and per step of the step counter (a loss and an epoch mean, as JSON numbers, with room to spare)
CHARS_PER_STEP = 64
#: how deep the metadata's JSON may nest (the record's loss settings are 3 levels down)
MAX_DEPTH = 16
#: bytes an array member may hold besides its data: the ``.npy`` header
HEADER_BYTES = 1 << 16
#: the fields :func:`revgraph.train.run_record.save` writes (``accumulate_steps`` and ``hyperparameters`` may be
#: missing: checkpoints written before they existed)
FIELDS = ("format", "names", "batch_size", "world_size", "seed", "shuffle", "samples", "accumulate_steps", "epoch",
          "batch", "epoch_loss_sum", "epoch_means", "steps_taken", "optimizer", "hyperparameters", "losses",
          "earlier_losses")
#: (``losses`` and ``earlier_losses``: the per-step history and its count of earlier fits, in snapshots written
#: before issue 38 moved the history out, to ``--log``; ``steps_taken`` replaced their count)
OPTIONAL = ("accumulate_steps", "hyperparameters", "losses", "earlier_losses", "steps_taken")
_READ_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
                RuntimeError, struct.error, zlib.error, lzma.LZMAError, UnicodeError, OverflowError, MemoryError)
_AGAIN = "; move it away to start afresh"


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _bad(where: str, field: str, what: str) -> RevgraphError:
    return RevgraphError(f"{where}: {field} {what}{_AGAIN}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def expected(spec) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``name -> (shape, dtype)`` of every carried value of the training graph ``spec`` (what a snapshot of it
    holds: parameters, optimizer state of each parameter's shape and dtype, the int64 step counter, a schedule's
    total steps, the fp16 loss scale and its count of good steps), without allocating them."""
    out = {}
    for p in spec.params:
        a = spec.initial[p]
        out[p] = (tuple(a.shape), np.dtype(a.dtype))
        out.update((s, out[p]) for s in spec.state[p])
    out[spec.step] = ((), np.dtype(np.int64))
    if spec.total:
        out[spec.total] = ((), np.dtype(np.int64))
    if spec.scaling is not None:
        out[spec.scaling.scale] = ((), np.dtype(spec.scaling.dtype))
        out[spec.scaling.growth] = ((), np.dtype(np.int64))
    return out


# --------------------------------------------------------------------------------------------- the archive


def _header(f, where: str, member: str):
    """``(shape, fortran_order, dtype)`` of the ``.npy`` member open as ``f``; refuses another format or an
    object (pickled) dtype."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise _bad(where, f"member {member!r}", f"is a .npy of version {version}, not 1.0 or 2.0")
    if dtype.hasobject:
        raise _bad(where, f"member {member!r}", "holds Python objects (pickle), which a snapshot never does")
    return shape, fortran, dtype


def _data(f, shape, fortran: bool, dtype: np.dtype, where: str, member: str) -> np.ndarray:
    count = math.prod(shape)
    raw = f.read(count * dtype.itemsize)
    if len(raw) != count * dtype.itemsize:
        raise _bad(where, f"member {member!r}", f"is truncated ({len(raw)} of {count * dtype.itemsize} bytes)")
    if f.read(1):  # (reading to the end also makes zipfile check the member's CRC)
        raise _bad(where, f"member {member!r}", "has data after its array")
    return np.frombuffer(raw, dtype).reshape(shape, order="F" if fortran else "C").copy()


def read(target, like: dict | None = None, order: list[str] | None = None, step: str | None = None,
         check=None) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, meta)`` of the snapshot file ``target`` (module doc). ``like``: ``name -> (shape, dtype)`` this
    run holds and ``order`` its names in the snapshot's order (the array members are checked against them before
    their data is read; ``None``: no such check, for reading a snapshot to look at it); ``step``: the name of the
    step counter (it bounds the metadata's length); ``check``: called with the metadata before the arrays are
    read (:func:`check_meta` and the record's differences: a snapshot of another run is named as such before its
    arrays are compared). Raises :class:`RevgraphError` naming the file and the member
    or field for anything else than a snapshot of this run."""
    where = str(target)
    try:
        with zipfile.ZipFile(target) as z:
            return _read(z, where, like, order, step, check)
    except RevgraphError:
        raise
    except RecursionError:
        raise _bad(where, "the metadata", "nests too deeply to be a snapshot's") from None
    except _READ_ERRORS as exc:
        text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise RevgraphError(f"{where} is not a readable revgraph checkpoint ({text}){_AGAIN}") from None


def _read(z: zipfile.ZipFile, where: str, like, order, step, check) -> tuple[dict[str, np.ndarray], dict]:
    infos = z.infolist()
    seen: set[str] = set()
    for info in infos:
        if info.filename in seen:
            raise _bad(where, f"member {info.filename!r}", "appears twice")
        seen.add(info.filename)
    members = {i.filename.removesuffix(".npy"): i for i in infos}
    if "meta" not in members:
        raise _bad(where, "member 'meta'", "(the metadata) is missing")
    numbered = {int(k[1:]) for k in members if k[:1] == "a" and k[1:].isdigit() and str(int(k[1:])) == k[1:]}
    unknown = [k for k in members if k != "meta" and not (k[:1] == "a" and k[1:].isdigit() and int(k[1:]) in numbered
                                                           and str(int(k[1:])) == k[1:])]
    if unknown:
        raise _bad(where, f"member {unknown[0]!r}", "is not part of a snapshot (meta, a0, a1, ...)")
    arrays_n = max(numbered, default=-1) + 1
    if len(numbered) != arrays_n:
        raise _bad(where, f"member 'a{min(set(range(arrays_n)) - numbered)}'", "is missing")
    if order is not None and arrays_n != len(order):
        raise RevgraphError(f"{where} holds the state of another model or optimizer ({arrays_n} arrays, this run "
                            f"has {len(order)}); move it away or choose another checkpoint directory")

    def array(k: int, expect=None) -> np.ndarray:
        member = f"a{k}"
        info = members[member]
        name = order[k] if order is not None else member
        if expect is not None:
            shape, dtype = expect
            if info.file_size > math.prod(shape) * dtype.itemsize + HEADER_BYTES:
                raise _bad(where, f"member {member!r} ({name!r})", f"declares {info.file_size} bytes; this run's "
                           f"{name!r} is {list(shape)} {dtype}")
        with z.open(info) as f:
            got = _header(f, where, member)
            if expect is not None and (tuple(got[0]) != tuple(expect[0]) or got[2] != expect[1]):
                raise RevgraphError(f"{where} cannot be resumed: {name!r} has shape {list(got[0])} and dtype "
                                    f"{got[2]}; this training run needs shape {list(expect[0])} and dtype "
                                    f"{expect[1]}{_AGAIN}")
            return _data(f, *got, where, member)

    limit = META_CHARS
    with z.open(members["meta"]) as f:
        shape, fortran, dtype = _header(f, where, "meta")
        if dtype.kind != "U" or shape != ():
            raise _bad(where, "member 'meta'", f"is {dtype} {list(shape)}, not a text")
        chars = dtype.itemsize // 4
        if chars > limit and like is not None and step in (order or []):
            counter = array(order.index(step), like[step])  # the step counter bounds the losses' length
            limit += CHARS_PER_STEP * max(int(counter), 0)
        if chars > limit:
            raise _bad(where, "member 'meta'", f"declares {chars} characters, more than a snapshot's metadata "
                       f"holds ({limit})")
        text = str(_data(f, shape, fortran, dtype, where, "meta")[()])
    meta = json.loads(text)
    if not isinstance(meta, dict):
        raise _bad(where, "the metadata", f"is a JSON {type(meta).__name__}, not an object")
    if _depth(meta) > MAX_DEPTH:  # (comparing or printing deeper values would recurse past Python's limit)
        raise _bad(where, "the metadata", f"nests deeper than {MAX_DEPTH} levels, which a snapshot's never does")
    if meta.get("format") != FORMAT:
        raise _bad(where, "field 'format'", f"is {_short(meta.get('format'))}, not {FORMAT!r}")
    names = meta.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _bad(where, "field 'names'", f"is {_short(names)}, not a list of names")
    if len(names) != arrays_n or len(set(names)) != len(names):
        raise _bad(where, "field 'names'", f"lists {len(names)} names ({len(set(names))} distinct) for {arrays_n} "
                   "arrays")
    if order is not None and names != order:
        raise RevgraphError(f"{where} holds the state of another model or optimizer; move it away or choose "
                            "another checkpoint directory")
    if check is not None:
        check(meta)
    arrays = {n: array(k, None if like is None else like[n]) for k, n in enumerate(names)}
    return arrays, meta


def _depth(value) -> int:
    """How deep ``value`` (parsed JSON) nests, counted iteratively."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict | list) and d <= MAX_DEPTH:
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


# ----------------------------------------------------------------------------------------------- the fields


def _numbers(where: str, field: str, v, n: int | None, finite: bool, what: str) -> None:
    if not isinstance(v, list) or not all(_is_number(x) for x in v):
        raise _bad(where, f"field {field!r}", f"is {_short(v)}, not a list of numbers")
    if n is not None and len(v) != n:
        raise _bad(where, f"field {field!r}", f"holds {len(v)} numbers; {what} {n}")
    if finite and not all(math.isfinite(x) for x in v):
        raise _bad(where, f"field {field!r}", "holds NaN or infinite numbers (a run that stops at them never "
                   "saves them; --allow-nonfinite trains on regardless)")


#: the types of the recorded hyperparameters (revgraph.train.run_record.record), by name
_NUM = (int, float)
RECORD_TYPES = {**setting_types(), "no_decay": (list,), "total_steps": (int, type(None)), "loss": (dict, str),
                "precision": (str,), "straight_through": (bool,), "growth_factor": _NUM, "backoff_factor": _NUM,
                "growth_interval": _NUM}


def check_meta(meta: dict, where: str, run: dict, names: list[str], optimizer: str, epochs: int | None,
               finite: bool) -> None:
    """Check every field of a snapshot's metadata ``meta`` (module doc) against this run: ``run`` (the fields
    :meth:`revgraph.Trainer.fit` records: batch size, world size, seed, shuffling, samples, accumulation),
    ``names`` (the carried names), ``optimizer`` (its kind), ``epochs`` (of this fit; ``None``: unknown) and
    ``finite`` (losses must be finite: the run stops at non-finite ones). Raises :class:`RevgraphError`."""
    unknown = [k for k in meta if k not in FIELDS]
    if unknown:
        raise _bad(where, f"field {unknown[0]!r}", "is not a field of a snapshot's metadata")
    missing = [k for k in FIELDS if k not in meta and k not in OPTIONAL]
    if not missing and "losses" not in meta and "steps_taken" not in meta:
        missing = ["steps_taken"]
    if missing:
        raise _bad(where, f"field {missing[0]!r}", "is missing")
    if not isinstance(meta["optimizer"], str):
        raise _bad(where, "field 'optimizer'", f"is {_short(meta['optimizer'])}, not an optimizer's name")
    for k in ("batch_size", "world_size", "samples", "accumulate_steps"):
        v = meta.get(k, 1)
        if not _is_int(v) or v < 1:
            raise _bad(where, f"field {k!r}", f"is {_short(v)}, not a positive integer")
    for k in ("earlier_losses", "steps_taken"):
        if not _is_int(meta.get(k, 0)) or meta.get(k, 0) < 0:
            raise _bad(where, f"field {k!r}", f"is {_short(meta[k])}, not an integer >= 0")
    for k, ok, what in (("seed", _is_int, "an integer"), ("shuffle", lambda v: isinstance(v, bool), "true or false"),
                        ("epoch", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
                        ("batch", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
                        ("epoch_loss_sum", _is_number, "a number")):
        if not ok(meta[k]):
            raise _bad(where, f"field {k!r}", f"is {_short(meta[k])}, not {what}")
    hp = meta.get("hyperparameters")
    if "hyperparameters" in meta:  # (absent in snapshots older than the record; present, it must be one)
        if not isinstance(hp, dict):
            raise _bad(where, "field 'hyperparameters'", f"is {_short(hp)}, not an object")
        for k, v in hp.items():
            types = RECORD_TYPES.get(k, (str, type(None)) if k.startswith("revgraph.") else None)
            if types is None:
                raise _bad(where, f"field 'hyperparameters.{k}'", "is not a recorded setting")
            if not isinstance(v, types) or (isinstance(v, bool) and types != (bool,)):
                raise _bad(where, f"field 'hyperparameters.{k}'", f"is {_short(v)}, not of its type")
    # against this run: the model, the optimizer, the global batch and the settings the data order depends on
    if meta["names"] != names or meta["optimizer"] != optimizer:
        raise RevgraphError(f"{where} holds the state of another model or optimizer; move it away or choose "
                            "another checkpoint directory")
    # the global batch (processes x batch size x accumulated micro-batches) is what a step trains on: a run may
    # resume at another split of it (issue 38: --accumulate-steps 2 --batch-size 4 of a snapshot at batch 8)
    was = (meta["world_size"], meta["batch_size"], meta.get("accumulate_steps", 1))
    is_ = (run["world_size"], run["batch_size"], run.get("accumulate_steps", 1))
    if math.prod(was) != math.prod(is_):
        raise RevgraphError(f"{where} was written by a run with global batch {_global(*was)} (now "
                            f"{_global(*is_)}); resume with the same global batch (--batch-size x processes x "
                            "--accumulate-steps), or move it away to start afresh")
    differ = [f"{k} {meta.get(k)!r} (now {v!r})" for k, v in run.items()
              if k not in ("world_size", "batch_size", "accumulate_steps") and meta.get(k) != v]
    if differ:
        raise RevgraphError(f"{where} was written by a run with {', '.join(differ)}; resume with the same "
                            "settings, or move it away to start afresh")
    # the position in the data, in this run's epochs and batches
    group = run["batch_size"] * run["world_size"] * run.get("accumulate_steps", 1)
    per_epoch = -(-run["samples"] // group)
    epoch, batch = meta["epoch"], meta["batch"]
    if epochs is not None and epoch > epochs:
        raise RevgraphError(f"{where}: field 'epoch' is {epoch}, past the end of this run ({epochs} epochs): "
                            f"train for {epoch} epochs or more to resume it, or move it away to start afresh")
    if batch >= per_epoch or (epochs is not None and epoch == epochs and batch):
        raise _bad(where, "field 'batch'", f"is {batch}, not a batch of this run's epochs (0 to {per_epoch - 1}, "
                   f"0 at the end)")
    if finite and not math.isfinite(meta["epoch_loss_sum"]):
        raise _bad(where, "field 'epoch_loss_sum'", "is not finite (--allow-nonfinite trains on regardless)")
    _numbers(where, "epoch_means", meta["epoch_means"], epoch, finite, "the epoch (field 'epoch') is")
    if "losses" in meta:  # (a snapshot from before issue 38: its history is checked against the position)
        _numbers(where, "losses", meta["losses"], None, finite, "")
        _sums_of_the_losses(meta, where, run, per_epoch, group)
    elif meta["steps_taken"] < epoch * per_epoch + batch:
        raise _bad(where, "field 'steps_taken'", f"is {meta['steps_taken']}, fewer than the "
                   f"{epoch * per_epoch + batch} batches to epoch {epoch}, batch {batch} (fields 'epoch', 'batch')")


def _sums_of_the_losses(meta: dict, where: str, run: dict, per_epoch: int, group: int) -> None:
    """The epoch means and the sum of the epoch so far are the losses' of this run's batches (its last
    ``epoch * per_epoch + batch`` losses), each times its batch's size, added in the trainer's order: recomputed
    here they must be equal, bit for bit (JSON keeps a float exactly)."""
    epoch, batch, losses, n = meta["epoch"], meta["batch"], meta["losses"], run["samples"]
    done = epoch * per_epoch + batch
    if len(losses) < done:  # (a trainer's earlier fits may add losses before this fit's)
        raise _bad(where, "field 'losses'", f"holds {len(losses)} losses, fewer than the {done} batches to epoch "
                   f"{epoch}, batch {batch} (fields 'epoch', 'batch')")
    earlier = meta.get("earlier_losses")  # (missing in snapshots written before it was recorded)
    if earlier is not None and len(losses) != earlier + done:
        raise _bad(where, "field 'losses'", f"holds {len(losses)} losses; the {earlier} of earlier fits (field "
                   f"'earlier_losses') and the {done} batches to epoch {epoch}, batch {batch} make {earlier + done}")
    mine = losses[len(losses) - done:]

    def same(a, b) -> bool:
        return a == b or (math.isnan(a) and math.isnan(b))

    for e in range(epoch + 1):
        total = 0.0
        for b in range(per_epoch if e < epoch else batch):
            total += mine[e * per_epoch + b] * min(group, n - b * group)
        if e < epoch and not same(total / n, meta["epoch_means"][e]):
            raise _bad(where, "field 'epoch_means'", f"gives epoch {e + 1} the mean {meta['epoch_means'][e]!r}; its "
                       f"losses (field 'losses') give {total / n!r}")
        if e == epoch and not same(total, meta["epoch_loss_sum"]):
            raise _bad(where, "field 'epoch_loss_sum'", f"is {meta['epoch_loss_sum']!r}; the losses of the epoch's "
                       f"first {batch} batches (field 'losses') give {total!r}")


def steps_taken(meta: dict) -> int:
    """The steps (batches) a snapshot's run and its trainer's earlier fits took: ``steps_taken``, or the length of
    the per-step history of a snapshot written before issue 38."""
    return meta["steps_taken"] if "steps_taken" in meta else len(meta["losses"])


def check_arrays(arrays: dict[str, np.ndarray], meta: dict, where: str, spec, run: dict, finite: bool) -> None:
    """Check the values of a snapshot's ``arrays`` (module doc) of the training graph ``spec``, after
    :func:`check_meta`: finite parameters and state (when ``finite``), Adam's second moments >= 0, the step
    counter against the position and the losses, a schedule's total, the fp16 loss scale. Raises
    :class:`RevgraphError` naming the file and the array."""
    steps, taken = int(arrays[spec.step]), steps_taken(meta)
    # one step per batch trained; fp16 loss scaling skips the update of an overflowing batch without counting it
    if steps < 0 or (steps > taken if spec.scaling is not None else steps != taken):
        field = "steps_taken" if "steps_taken" in meta else "losses"
        raise _bad(where, f"the step counter {spec.step!r}", f"is {steps} for {taken} steps taken (field {field!r})")
    if spec.total and int(arrays[spec.total]) < 0:
        raise _bad(where, f"the schedule's total steps {spec.total!r}", f"is {int(arrays[spec.total])}, below 0")
    if spec.scaling is not None:
        scale, good = arrays[spec.scaling.scale], int(arrays[spec.scaling.growth])
        if not (np.isfinite(scale) and scale > 0):
            raise _bad(where, f"the fp16 loss scale {spec.scaling.scale!r}", f"is {scale}, not a finite number > 0")
        if good < 0:
            raise _bad(where, f"the count of good steps {spec.scaling.growth!r}", f"is {good}, below 0")
    # the slots the optimizer keeps >= 0 (Adam's second moment), by position in each parameter's state
    slots, nonnegative = spec.optimizer.slots, spec.optimizer.method.nonnegative
    for p in spec.params:
        for k, name in enumerate([p, *spec.state[p]]):
            a = arrays[name]
            what = "parameter" if k == 0 else "optimizer state"
            if finite and a.dtype.kind in "fc" and not np.isfinite(a).all():
                raise _bad(where, f"{what} {name!r}", "holds NaN or infinite values (a run that stops at them "
                           "never saves them; --allow-nonfinite trains on regardless)")
            slot = slots[k - 1] if 0 < k <= len(slots) else None
            if slot in nonnegative and a.dtype.kind == "f" and (a < 0).any():
                raise _bad(where, f"optimizer state {name!r}", f"({nonnegative[slot]}) holds negative values")


def _global(world, batch, accumulate=1) -> str:
    """``"2 x 16 = 32"``: processes x batch size (x accumulated micro-batches, where more than one) = global
    batch."""
    parts = [world, batch, *([accumulate] if accumulate != 1 else [])]
    text = " x ".join(map(str, parts))
    return f"{text} = {math.prod(parts)}" if all(isinstance(p, int) and p > 0 for p in parts) else text
