"""The default unit (bucket) size of ZeRO-2 (``shard="gradients"``,
revgraph.train.distributed.shard_plan.default_unit_groups): a rank never keeps more gradient bytes than unsharded
training, which keeps every dense gradient (``G``, the dense parameters' bytes, counted here from the model's
arrays), for a small MLP (``G`` = 4 KB, far below DDP's 25 MiB bucket), a larger one (``G`` = 34 MB, its first
weight alone above 25 MiB) and a small RNN (an ONNX ``Loop``, whose backward writes several gradients at once, so
that gradients can be carried past their segment: ``gradients_peak``), at 2 and 3 processes; an explicit bucket
size is kept.

The engine is built for rank 0 of a world of ``W`` without a process group: building runs no collective, and
``engine.held()`` counts the bytes of the buffers it made (the shards, the bucket, and the most bytes of
gradients a segment carries to a later reduce-scatter)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import revgraph as rg
from revgraph.runtime.devices import Device
from revgraph.tools import demo
from revgraph.train.distributed.exchange import BUCKET_MB
from revgraph.train.distributed.sharding import ShardedEngine

MODELS = {"small": (demo.mlp_model, {"hidden": 13}),
          "large": (demo.mlp_model, {"hidden": 8192, "rows": 32, "width": 32}),
          "loop": (demo.rnn_model, {"hidden": 13})}


def _spec(model: str):
    make, kw = MODELS[model]
    return rg.Trainer(make(**kw), "cross-entropy", "adam", threads=1).spec


def _engine(spec, world: int, **kw) -> ShardedEngine:
    comm = SimpleNamespace(torch=torch, dist=torch.distributed, world_size=world, rank=0, tdevice=torch.device("cpu"))
    return ShardedEngine(spec, 1, Device(), comm, mode="gradients", **kw)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("model", ["small", "large", "loop"])
def test_default_bucket_holds_no_more_gradient_bytes_than_unsharded(model, world):
    spec = _spec(model)
    dense = [p for p in spec.params if p not in spec.sparse]
    full = sum(np.asarray(spec.initial[p]).nbytes for p in dense)  # G: unsharded, every gradient whole
    eng = _engine(spec, world)
    held = eng.held()
    # (both also keep the loss in one float32 after the last bucket's gradients, summed with them on the CPU)
    assert held["gradients"] <= full + 4 and held["gradients_peak"] <= full + 4
    # the arithmetic of the units: float32 shards of ceil(used / W) elements for every unit but the last, which is
    # reduce-scattered in place in the bucket, and the bucket of the largest padded unit (the last one and the loss)
    used = [sum(int(np.prod(spec.initial[p].shape)) for p in u.names) for u in eng.units]
    padded = [-(-n // world) * world for n in used]
    assert sorted(p for u in eng.units for p in u.names) == sorted(dense)
    assert held["gradients"] == 4 * sum(-(-n // world) for n in used[:-1]) + 4 * max([*padded[:-1], padded[-1] + 1])
    assert eng.units[-1].gshard.data_ptr() == eng.bucket.data_ptr() + 4 * eng.units[-1].lo
    if model == "large":  # W1 alone is above 25 MiB: the default's cap stays DDP's, W1 a unit of its own
        assert 4 * max(used) > BUCKET_MB * 2**20 and held["gradients"] < full
        assert all(len(u.names) == 1 or 4 * n <= BUCKET_MB * 2**20 for u, n in zip(eng.units, used, strict=True))


def test_explicit_bucket_is_kept():
    """An explicit size (``--bucket-mb``, here 25 MiB on the small MLP) is kept even where it holds more than
    unsharded: one unit, padded to a multiple of W = 3, reduce-scattered in place."""
    spec = _spec("small")
    used = sum(int(np.prod(spec.initial[p].shape)) for p in spec.params)
    eng = _engine(spec, 3, bucket_bytes=int(BUCKET_MB * 2**20))
    assert len(eng.units) == 1 and used % 3
    assert eng.held()["gradients"] == 4 * (-(-used // 3) * 3 + 1) > 4 * (used + 1)
    small = _engine(spec, 3, bucket_bytes=1024)
    assert all(len(u.names) == 1 or 4 * u.used <= 1024 for u in small.units) and len(small.units) >= 2
