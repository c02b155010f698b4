#!/usr/bin/env bash
# revgraph on a CUDA GPU (--device cuda, issue 16): run the GPU-only tests and a short step-time benchmark,
# and print them with the GPU's name; with 2 GPUs also the data-parallel exchange options on NCCL (issue 25). For a machine with an NVIDIA GPU, onnxruntime-gpu in place of onnxruntime
# (pip install "revgraph[cuda]"; see the comment in pyproject.toml) and, for the data-parallel tests, a CUDA
# build of torch (revgraph[distributed]). Needs no network; takes under 9 minutes (with 2 GPUs up to 20 more for
# the data-parallel exchange options).
#
#   bench/gpu_check.sh                 # GPU 0
#   DEVICE=cuda:1 bench/gpu_check.sh   # the benchmark on another GPU (the tests use cuda:0, and two GPUs for NCCL)
#   PYTHON=/path/to/python bench/gpu_check.sh
#
# Exits 1 when onnxruntime cannot run on the GPU here, otherwise with pytest's status.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # torchrun's workers in the tests share the cores

echo "== GPU"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
else
    echo "(no nvidia-smi on PATH)"
fi

echo "== software"
DEVICE=$DEVICE "$PYTHON" - <<'EOF'
import os
import sys

try:  # first: a CUDA torch loads the CUDA and cuDNN libraries that onnxruntime-gpu also needs
    import torch
except ImportError:
    torch = None
import onnxruntime as ort

import revgraph as rg
from revgraph.tools import demo

print(f"python {sys.version.split()[0]}, revgraph {rg.__version__}, onnxruntime {ort.__version__} "
      f"({', '.join(ort.get_available_providers())})")
if torch is None:
    print("torch: not installed (the NCCL tests will be skipped)")
else:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs seen by torch: {', '.join(gpus) or 'none'}")
device = os.environ["DEVICE"]
try:
    rg.Session(demo.mlp_model(hidden=4), device=device)
except rg.RevgraphError as exc:
    sys.exit(f"gpu_check: onnxruntime cannot run on {device} here: {exc}")
print(f"onnxruntime runs on {device}")
EOF

echo "== GPU tests (pytest -m cuda tests/test_devices.py tests/test_sharding.py tests/test_sync_batchnorm.py tests/test_precision.py tests/test_offload.py)"
status=0
# -o addopts='' drops the default -m "not slow"; -rs prints why a test was skipped (e.g. one GPU: no 2-process NCCL).
# tests/test_sharding.py: --shard gradients on 2 GPUs (units, shards, bucket, reduce-scatter, all-gather on NCCL)
# tests/test_offload.py: --offload optimizer (issue 43): optimizer state, step and the update's gradients in host
# memory, only the parameters and gradients on the GPU, the weights those of the plain GPU run; and sharded
# (ZeRO-1/2 offloaded, NCCL in a world of one)
timeout 360 "$PYTHON" -m pytest -q -o addopts='' -rs -m cuda -p no:cacheprovider tests/test_devices.py \
    tests/test_sharding.py tests/test_sync_batchnorm.py tests/test_precision.py tests/test_offload.py || status=$?

echo "== data-parallel exchange on the GPU (issue 25: --bucket-mb with overlap, --overlap off, --accumulate-steps, --reduce-dtype bf16)"
# one table row per option and model: pytest's verdict (passed / failed / skipped with its reason)
timeout 1200 "$PYTHON" -m pytest -q -o addopts='' -rA -m cuda -p no:cacheprovider tests/test_devices_exchange.py 2>&1 \
    | awk '/^(PASSED|FAILED|SKIPPED|ERROR)/ {print}' \
    | sed -E 's/^(PASSED|FAILED|ERROR) tests\/test_devices_exchange.py::test_nccl_exchange_options_match_one_process\[nproc2-([^]]*)\].*/\1  \2/' \
    | column -t -s ' ' || status=$?
echo "== GPU tests of launching and failing (pytest -m cuda tests/test_distributed_launch.py)"
timeout 240 "$PYTHON" -m pytest -q -o addopts='' -rs -m cuda -p no:cacheprovider tests/test_distributed_launch.py || status=$?

echo "== step time (ms per Trainer.step with Adam, after 3 warm-up steps; median of up to 2 s of steps; --precision rows: bf16/fp16 on the GPU)"
DEVICE=$DEVICE timeout 240 "$PYTHON" - <<'EOF'
import os
import sys
import tempfile
import time

try:
    import torch
except ImportError:
    torch = None
import numpy as np

import revgraph as rg
from revgraph.tools import demo

DEVICE = os.environ["DEVICE"]


def timed(trainer, batch, seconds=2.0, most=300):
    for _ in range(3):  # kernels loaded, cuDNN/cuBLAS choices made, memory arena grown
        trainer.step(batch)
    times, start = [], time.perf_counter()
    while len(times) < most and time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        trainer.step(batch)  # returns the loss as a float: the step has finished on the device
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), trainer


def row(name, make, batch):
    cpu_s, cpu = timed(make("cpu"), batch)
    gpu_s, gpu = timed(make(DEVICE), batch)
    agree = abs(cpu.losses[0] - gpu.losses[0]) <= 1e-4 * max(1.0, abs(cpu.losses[0]))
    print(f"{name:<44} {cpu_s * 1e3:10.2f} {gpu_s * 1e3:10.2f} {cpu_s / gpu_s:8.2f}x   "
          f"{'yes' if agree else 'NO: %.6g vs %.6g' % (cpu.losses[0], gpu.losses[0])}", flush=True)


print(f"{'model':<44} {'cpu ms':>10} {DEVICE + ' ms':>10} {'speed-up':>9}   first loss agrees")
train, _ = demo.digits()
digits = {"x": train["x"][:64], "labels": train["labels"][:64]}
row("demo MLP (64 hidden), batch 64", lambda d: rg.Trainer(demo.mlp_model(hidden=64), device=d), digits)
row("demo RNN (ONNX Loop, 128 hidden), batch 64", lambda d: rg.Trainer(demo.rnn_model(hidden=128), device=d), digits)

if torch is None:
    print("(torch not installed: no exported MLP and Transformer from bench/models.py)")
    sys.exit(0)
sys.path.insert(0, "bench")
from models import load_npz, write_step_model  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    for name, label in [("mlp", "MLP 784-512-512-10, batch 64"),
                        ("transformer", "Transformer (2 layers, width 128), batch 64")]:
        info = write_step_model(name, 64, tmp)  # torch.onnx.export, no network
        _, data = load_npz(info["npz"])
        batch = {"x": data["x"], "labels": data["labels"]}
        row(label, lambda d: rg.Trainer(info["path"], "cross-entropy", "adam", params=info["params"], device=d),
            batch)
        # mixed precision (issue 26, --precision): the same step with bf16/fp16 products, on the GPU only (the
        # CPU provider has no 16-bit MatMul); its first loss next to fp32's (they differ by the 8/11-bit rounding)
        fp32_s, fp32 = timed(rg.Trainer(info["path"], "cross-entropy", "adam", params=info["params"], device=DEVICE),
                             batch)
        for kind in ("bf16", "fp16"):
            try:
                low_s, low = timed(rg.Trainer(info["path"], "cross-entropy", "adam", params=info["params"],
                                              device=DEVICE, precision=kind), batch)
            except rg.RevgraphError as exc:
                print(f"{label + ', ' + kind:<44} refused: {exc}", flush=True)
                continue
            print(f"{label + ', --precision ' + kind:<44} {'':>10} {low_s * 1e3:10.2f} {fp32_s / low_s:8.2f}x   "
                  f"(speed-up over fp32 on {DEVICE}; first loss {low.losses[0]:.5g}, fp32 {fp32.losses[0]:.5g})",
                  flush=True)
EOF

exit $status
