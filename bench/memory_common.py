"""What the sides of bench/memory.py share: the LLaMA's configuration and files, the batches, the RNN's block
length, and the readings of /proc/self/status (resident set size and its peak, VmHWM)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

#: The LLaMA of issue 24 (intermediate 688 = 256 x 11008 / 4096, transformers' default ratio).
LLAMA = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128}
SEQ = 128


def llama_files(cache: str) -> dict:
    key = "llama_" + "_".join(f"{v}" for v in LLAMA.values()) + f"_s{SEQ}"
    base = Path(cache) / key
    return {"onnx": str(base.with_suffix(".onnx")), "npz": str(base.with_suffix(".npz")),
            "json": str(base.with_suffix(".json"))}


def llama_batch(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids ``[batch, SEQ]`` and next-token labels ``[batch, SEQ - 1]`` (int64)."""
    ids = np.random.default_rng(seed).integers(0, LLAMA["vocab_size"], (batch, SEQ)).astype(np.int64)
    return {"input_ids": ids, "labels": np.ascontiguousarray(ids[:, 1:])}


def rnn_segment(steps: int) -> int:
    """The RNN's checkpointed block: the divisor of ``steps`` nearest sqrt(steps) (25 for T = 1000). A block of
    one step would keep as much as no checkpoint (its input ``h`` is what the step saves)."""
    divisors = [d for d in range(1, steps + 1) if steps % d == 0]
    return min(divisors, key=lambda d: (abs(d - math.sqrt(steps)), d))


def status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_mb() -> float:
    return status_kb("VmRSS") / 1024


def peak_mb() -> float:
    """The peak resident set size (VmHWM) since the start or the last :func:`reset_peak`, in MB."""
    return status_kb("VmHWM") / 1024


def reset_peak() -> float:
    """Reset VmHWM to the current RSS (write 5 to /proc/self/clear_refs) and return that RSS in MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_mb()
