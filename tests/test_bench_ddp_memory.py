"""bench/ddp_memory.py gives revgraph the bucket size it gives DDP (issue 43, item 6: it once set a module attribute
that no longer existed, so revgraph ran at its 25 MiB default where DDP ran at the bench's 4)."""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import pytest

import revgraph as rg
from revgraph.train.engine_choice import EngineSettings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import ddp_memory  # (bench/ is not a package: on the path above)


@pytest.mark.parametrize(("bucket_mb", "shard"), [(4.0, "gradients"), (1.5, "optimizer"), (25.0, "none")])
def test_the_bench_passes_its_bucket_to_the_trainer(bucket_mb, shard):
    options = ddp_memory.trainer_options(argparse.Namespace(bucket_mb=bucket_mb, shard=shard))
    assert set(options) <= set(inspect.signature(rg.Trainer).parameters)  # real keyword arguments, not attributes
    settings = EngineSettings(bucket_mb=options["bucket_mb"], shard=options["shard"], distributed=True)
    assert settings.bucket_bytes == int(bucket_mb * 2**20) and settings.shard == shard
