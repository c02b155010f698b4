"""The pieces of the data-parallel gradient exchange
(:class:`revgraph.train.distributed.data_parallel.DistributedEngine`): the all-reduce buckets of the dense gradients,
and the packing of the sparse rows of all embedding tables into one byte buffer for one all-gather.

Buckets (as ``torch.nn.parallel.DistributedDataParallel`` builds them): the dense gradients in reverse
parameter order, the order in which the backward pass produces them, packed back to back into flat tensors of
at most ``bucket_mb`` MiB each (DDP's ``bucket_cap_mb``, default 25; the first at most 1 MiB as in DDP; a
gradient larger than the cap gets a bucket of its own) and one dtype per bucket. The last bucket may carry a
**tail** of float values that are summed over the ranks with it, saving collectives: this rank's share of the
loss, and in the slot of this rank the number of sparse rows of each table (zero in the other ranks' slots, so
the sum holds every rank's counts; float32 counts are exact below 2**24).

Reduced in bfloat16 (``reduce_dtype="bf16"``, as FSDP's ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``
and DDP's ``bf16_compress_hook``): each bucket's gradients are cast to a bfloat16 copy, all-reduced, and cast
back. bfloat16 keeps 8 significant bits (unit roundoff 2**-8, about 0.4%), so each exchanged gradient carries
a relative error of a few 2**-8 (the cast of each rank's share, the roundings of the ring's partial sums);
half the bytes go over the network. The tail is then exchanged apart, in float64 (a loss rounded to 8 bits
would be a wrong loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import InputError

BUCKET_MB = 25.0  #: DistributedDataParallel's bucket_cap_mb default
REDUCE_DTYPES = ("fp32", "bf16")
EXACT_COUNTS = 2**24  #: float32 holds every integer below this exactly
#: DDP's cap of the first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): the gradients the backward
#: pass produces first start their all-reduce early, before a whole bucket_cap_mb has been produced
FIRST_BUCKET = 2**20


def bucket_bytes(mb: float) -> int:
    """``mb`` MiB in bytes; :class:`InputError` (one line) unless it is a positive number."""
    try:
        ok = float(mb) > 0 and np.isfinite(float(mb))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InputError(f"the bucket size must be a positive number of MiB (--bucket-mb, bucket_mb=), got {mb!r}")
    return max(1, int(float(mb) * 2**20))


def check_reduce_dtype(name: str) -> str:
    if name not in REDUCE_DTYPES:
        raise InputError(f"the reduce dtype must be one of {', '.join(REDUCE_DTYPES)} (--reduce-dtype, reduce_dtype=), "
                         f"got {name!r}")
    return name


@dataclass
class Bucket:
    """A flat device tensor holding several dense gradients back to back: ``views`` by gradient name, ``grads``
    the part holding them, ``tail`` the values riding along (or ``None``), ``low`` the bfloat16 copy
    exchanged in its place (or ``None``), ``scratch`` a second flat tensor of the same layout that
    accumulated micro-batches write into (made when first needed)."""

    flat: object
    grads: object = None
    views: dict = field(default_factory=dict)
    tail: object = None
    low: object = None
    scratch: object = None


def bucket_groups(like: dict[str, np.ndarray], grads: list[str], cap: int, *, in_order: bool = False,
                  first: int | None = FIRST_BUCKET) -> list[list[str]]:
    """The gradient names of each bucket (module doc), in exchange order: ``grads`` (in parameter order) taken
    in reverse (``in_order``: as given), a new bucket when the dtype changes or the next gradient would pass
    ``cap`` bytes (the first bucket: ``first``, :data:`FIRST_BUCKET` as DDP; ``None``: ``cap``). A gradient
    larger than the cap gets a bucket of its own. The sharded engine's flat units are packed the same way."""
    groups: list[tuple[np.dtype, list[str], int]] = []
    for g in (grads if in_order else reversed(grads)):
        a = like[g]
        limit = min(cap, first) if first is not None and len(groups) == 1 else cap
        if not groups or groups[-1][0] != a.dtype or groups[-1][2] + a.nbytes > limit:
            groups.append((a.dtype, [], 0))
        dt, names, used = groups[-1]
        groups[-1] = (dt, [*names, g], used + a.nbytes)
    return [names for _, names, _ in groups]


def make_buckets(torch, like: dict[str, np.ndarray], grads: list[str], cap: int, tail: int, device,
                 low: bool) -> list[Bucket]:
    """Buckets (module doc) of the gradients ``grads`` (in parameter order; ``like[g]`` has ``g``'s dtype and
    shape), at most ``cap`` bytes each, the last one with ``tail`` extra elements; ``low``: with bfloat16
    copies. On ``device`` (a ``torch.device``)."""
    groups = bucket_groups(like, grads, cap)
    buckets = []
    for j, names in enumerate(groups):
        dt = like[names[0]].dtype
        size = sum(like[g].size for g in names)
        extra = tail if j == len(groups) - 1 else 0
        flat = torch.zeros(size + extra, dtype=torch_dtype(torch, dt), device=device)
        bucket, at = Bucket(flat, flat[:size], tail=flat[size:] if extra else None), 0
        for g in names:
            bucket.views[g] = flat[at:at + like[g].size].view(like[g].shape)
            at += like[g].size
        if low:
            bucket.low = torch.empty(size, dtype=torch.bfloat16, device=device)
        buckets.append(bucket)
    return buckets


def torch_dtype(torch, dtype):
    return torch.from_numpy(np.zeros(1, dtype=np.dtype(dtype))).dtype


def read_from(torch, array: np.ndarray):
    """A torch tensor over ``array`` (C-contiguous, not copied) that revgraph only reads from (``copy_`` out of it).
    ``torch.from_numpy`` warns once per process for a read-only array, and the initializers of a model loaded from a
    file are read-only (numpy views of the file's bytes): the warning is silenced here instead of the array copied,
    as nothing writes through the tensor."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(array))


def _padded(n: int) -> int:
    return -(-n // 8) * 8  # every piece starts at a multiple of 8 bytes, so an int64 or float view of it is aligned


def pack_rows(torch, rows: list[tuple[object, object]], size: int, device):
    """The sparse gradients ``rows`` (``(indices int64 [K], rows [K, ...])`` per table, in table order) as one
    uint8 tensor of ``size`` bytes (at least :func:`packed_size`): per table the indices' bytes, then the rows'
    bytes, each piece padded to 8 bytes."""
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    at = 0
    for idx, vals in rows:
        for t in (idx, vals):
            b = t.contiguous().view(-1).view(torch.uint8)
            buf[at:at + b.numel()] = b
            at += _padded(b.numel())
    return buf


def packed_size(counts: list[int], row_bytes: list[int]) -> int:
    """Bytes :func:`pack_rows` needs for ``counts[t]`` rows of ``row_bytes[t]`` bytes in table ``t``."""
    return sum(_padded(8 * c) + _padded(c * rb) for c, rb in zip(counts, row_bytes, strict=True))


def unpack_rows(torch, bufs: list, counts: list[list[int]], like: list) -> list[tuple[object, object]]:
    """Every rank's packed rows (``bufs[r]``, with ``counts[r][t]`` rows of table ``t``; ``like[t]`` an empty
    rows tensor of the table's dtype and row shape), concatenated in rank order: ``(indices, rows)`` per table."""
    pieces: list[tuple[list, list]] = [([], []) for _ in like]
    for buf, cs in zip(bufs, counts, strict=True):
        at = 0
        for t, (c, ref) in enumerate(zip(cs, like, strict=True)):
            pieces[t][0].append(buf[at:at + 8 * c].view(torch.int64))
            at += _padded(8 * c)
            nbytes = c * ref.element_size() * int(np.prod(ref.shape[1:], dtype=np.int64))
            pieces[t][1].append(buf[at:at + nbytes].view(ref.dtype).view(c, *ref.shape[1:]))
            at += _padded(nbytes)
    return [(torch.cat(i).contiguous(), torch.cat(v).contiguous()) for i, v in pieces]


def refused_combination(shard: str, sync_batchnorm: bool, reduce_dtype: str, accumulate_steps: int,
                        buffers: str = "one", *, precision: str = "fp32", world_size: int = 1) -> str | None:
    """The one line refusing data-parallel options that do not combine, or ``None``: sharding reduce-scatters
    in the gradients' own dtype, one micro-batch per step, and has no collectives inside the backward;
    synchronized batch normalization runs one micro-batch per step; accumulation needs one buffer set; the fp16
    loss scale (:mod:`revgraph.train.precision`) is carried by the unsharded engine without synchronized statistics."""
    if precision == "fp16" and world_size > 1 and (shard != "none" or sync_batchnorm):
        what = f"--shard {shard}" if shard != "none" else "--sync-batchnorm"
        return (f"--precision fp16 (precision='fp16') does not combine with {what}: its loss scaling is in the step "
                "graph, which that engine does not run; train with --precision bf16, or without " + what)
    if shard != "none" and reduce_dtype != "fp32":
        return (f"--reduce-dtype {reduce_dtype} (reduce_dtype=) does not combine with --shard {shard}: the gradients "
                "are reduce-scattered in their own dtype")
    if shard != "none" and sync_batchnorm:
        return f"--sync-batchnorm (sync_batchnorm=) does not combine with --shard {shard}: leave one of them out"
    if accumulate_steps > 1:
        if shard not in ("none", "parameters"):  # (ZeRO-3 reduce-scatters each micro-batch, summed into the shards)
            return (f"--accumulate-steps {accumulate_steps} (accumulate_steps=) does not combine with --shard {shard}: "
                    "train unsharded, or with a larger batch")
        if sync_batchnorm:
            return (f"--accumulate-steps {accumulate_steps} (accumulate_steps=) does not combine with "
                    "--sync-batchnorm: train with a larger batch")
        if buffers == "two":
            return (f"--accumulate-steps {accumulate_steps} (accumulate_steps=) needs --buffers one (buffers='one'): "
                    "the fused step graph of two buffer sets updates after every batch")
    return None
