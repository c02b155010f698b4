"""onnxruntime-genai's model builder for tests: a tiny random LLaMA written by the builder (no downloads), the
4-bit ``MatMulNBits`` weights dequantized in numpy from onnxruntime's definition, and the token data
``revgraph train --loss causal-lm`` reads for the builder's inputs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

HEADS, KV_HEADS, HIDDEN, HEAD = 4, 2, 64, 16


def genai_llama(tmp_path, precision: str = "int4", vocab: int = 256):
    """``(model.onnx path, transformers LlamaForCausalLM)``: a 2-layer LLaMA (hidden 64, 4 heads of 16, 2 KV heads,
    MLP 128, random weights, seed 0) written by ``python -m onnxruntime_genai.models.builder -p precision -e cpu``.
    ``vocab`` must differ from the MLP's width 128 (the builder then takes the MLP's weight for the LM head).
    onnxruntime-genai is in the test extra."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert vocab != 128
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(hf)
    out = tmp_path / precision
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p",
                    precision, "-e", "cpu", "-c", str(tmp_path / "cache")], check=True, capture_output=True)
    return out / "model.onnx", model


def empty_past(batch: int, layers: int = 2) -> dict[str, np.ndarray]:
    """The builder's ``past_key_values.{i}.key|value`` inputs for a prompt without a cache: ``[B, kv heads, 0, 16]``."""
    return {f"past_key_values.{i}.{kv}": np.zeros((batch, KV_HEADS, 0, HEAD), np.float32)
            for i in range(layers) for kv in ("key", "value")}


def token_data(ids: np.ndarray) -> dict[str, np.ndarray]:
    """What ``revgraph train --loss causal-lm --data`` needs for the builder's model: ``input_ids``, an all-ones
    ``attention_mask`` and the empty past, one row per sequence."""
    return {"input_ids": ids.astype(np.int64), "attention_mask": np.ones(ids.shape, np.int64), **empty_past(len(ids))}


def unpack(b: np.ndarray, bits: int = 4) -> np.ndarray:
    """The ``bits``-wide unsigned values packed low bits first in the bytes of ``b`` along its last axis."""
    b = b.astype(np.int64)
    return np.stack([(b >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)], -1).reshape(*b.shape[:-1], -1)


def dequantize(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, K: int, N: int,
               block_size: int, bits: int = 4) -> np.ndarray:
    """``W`` ``[N, K]`` float64 of ``MatMulNBits`` (onnxruntime docs/ContribOperators.md): ``(q - zp) * scale`` per
    block of ``block_size`` along K; ``q`` from ``b`` ``[N, blocks, blob]``, ``zp`` packed uint8 ``[N, ...]`` or
    absent (``2^(bits-1)``); ``scales`` ``[N, blocks]`` (or flat)."""
    blocks = -(-K // block_size)
    q = unpack(b, bits)[..., :block_size].reshape(N, blocks, block_size).astype(np.float64)
    z = np.full((N, blocks), float(1 << (bits - 1))) if zero_points is None else \
        unpack(zero_points.reshape(N, -1), bits)[:, :blocks].astype(np.float64)
    s = np.asarray(scales, np.float64).reshape(N, blocks)
    return ((q - z[..., None]) * s[..., None]).reshape(N, -1)[:, :K]
