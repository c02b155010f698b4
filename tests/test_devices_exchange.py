"""The data-parallel exchange options of issue 25 on CUDA with NCCL (``cuda`` tests; bench/gpu_check.sh runs them):
``revgraph train --device cuda --nproc 2`` with small buckets (the grad graph in segments, each bucket's NCCL
all-reduce started while the next segment runs on onnxruntime's stream; torch's stream is synchronised before
onnxruntime reads what torch wrote), without overlap, with accumulated micro-batches, and with bfloat16 buckets,
each against one process on the GPU with the same global batch. Skipped, with the reason, without 2 GPUs."""

from __future__ import annotations

import numpy as np
import pytest
from kit.devices import on_gpu, tolerance, torch, train_cli

OPTIONS = {"buckets-overlapped": ["--bucket-mb", "0.001"],
           "buckets-not-overlapped": ["--bucket-mb", "0.001", "--overlap", "off"],
           "accumulate2": ["--accumulate-steps", "2"],
           "accumulate2-buckets-overlapped": ["--accumulate-steps", "2", "--bucket-mb", "0.001"],
           "bf16-reduce": ["--reduce-dtype", "bf16"]}


@pytest.mark.parametrize("name", ["mlp", "embedding"])
@pytest.mark.parametrize("what", list(OPTIONS))
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=on_gpu(torch_gpus=2), id="nproc2")])
def test_nccl_exchange_options_match_one_process(tmp_path, name, what, nproc):
    assert torch.distributed.is_nccl_available(), "a CUDA torch without NCCL"
    option = OPTIONS[what]
    accumulate = 2 if "--accumulate-steps" in option else 1
    ref = train_cli(tmp_path, name, "single.onnx", "--device", "cuda", "--batch-size", "16")
    got = train_cli(tmp_path, name, "ddp.onnx", "--device", "cuda", "--nproc", str(nproc),
                    "--batch-size", str(16 // nproc // accumulate), *option)
    # bf16: each exchanged gradient keeps 8 significant bits; Adam (lr 1e-3) turns a gradient's relative error
    # into at most about one lr per step where the ranks' shares nearly cancel: 14 steps here
    tol = {"rtol": 0.0, "atol": 14 * 1e-3} if what == "bf16-reduce" else tolerance("adam")
    for key, value in ref.items():
        np.testing.assert_allclose(got[key], value, err_msg=key, **tol)
