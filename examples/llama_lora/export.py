"""A tiny LLaMA for the LoRA walkthrough: built from ``transformers.LlamaConfig`` (random weights, no download),
exported to ONNX with ``rg.export_torch`` (``torch.onnx.export(dynamo=True)``), and a token dataset to
fine-tune it on.

    python examples/llama_lora/export.py -o llama   # llama/llama.onnx, tokens.npz, heldout.npz, config.json

``llama.onnx``: ``input_ids`` int64 ``[B, T]`` -> ``logits`` float32 ``[B, T, vocab]``, opset 18, the weights under
their PyTorch names (``model.layers.0.self_attn.q_proj.weight``, ...). The exporter runs with ``optimize=False``:
its optimizer folds each ``nn.Linear``'s ``Transpose(weight)`` into a new constant named ``val_<k>``, and the
LoRA targets could then be chosen by no recognisable name; unoptimized, each projection is
``MatMul(x, Transpose(<module>.weight))``, which :mod:`revgraph.train.lora` adapts under the module's name.
``tokens.npz``: ``input_ids`` int64 ``[N, T]``, sequences counting up by a step of 1 to 3 from a random start
(modulo the vocabulary), a pattern a causal language model learns in a few hundred steps. ``heldout.npz``: 32
more such sequences (another seed), to evaluate on.
``config.json``: the ``LlamaConfig`` (``LlamaConfig(**json.load(f))`` rebuilds the model the file came from, with
the ONNX initializers as its state dict).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import numpy as np

#: The walkthrough's model: hidden 64, 2 layers, vocabulary 256 (about 0.1 M parameters).
DEFAULTS = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
#: The names of LLaMA's projections, PEFT's usual LoRA targets for it (``target_modules``).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_config(**overrides):
    """The ``transformers.LlamaConfig`` of the walkthrough (:data:`DEFAULTS` updated by ``overrides``)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**DEFAULTS, "tie_word_embeddings": False, "attn_implementation": "eager", **overrides})


def logits_model(config, seed: int = 0):
    """A ``LlamaForCausalLM`` of ``config`` with seeded random weights whose ``forward(input_ids)`` returns the
    logits alone, without a KV cache (what the ONNX model computes)."""
    import torch
    from transformers import LlamaForCausalLM

    class LogitsOnly(LlamaForCausalLM):
        def forward(self, input_ids):  # (a subclass, so the weights keep the names of LlamaForCausalLM)
            return super().forward(input_ids=input_ids, use_cache=False).logits

    torch.manual_seed(seed)
    return LogitsOnly(config).eval()


def export(model, path: str | os.PathLike, opset: int = 18, example_length: int = 16) -> None:
    """``rg.export_torch`` of ``model`` to ``path`` (``torch.onnx.export(dynamo=True, optimize=False)`` and the record
    of the module's parameter and state-dict names: ``revgraph train`` trains exactly ``model.parameters()`` and
    ``--save-safetensors`` writes a state dict that loads strictly): ``input_ids`` ``[B, T]`` -> ``logits``
    ``[B, T, V]``, both dimensions dynamic."""
    import torch

    import revgraph as rg

    ids = torch.randint(0, model.config.vocab_size, (2, example_length))
    batch, length = torch.export.Dim("B"), torch.export.Dim("T", max=model.config.max_position_embeddings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rg.export_torch(model, (ids,), path, input_names=["input_ids"], output_names=["logits"],
                        dynamic_shapes=({0: batch, 1: length},), opset_version=opset, external_data=False)


def token_data(samples: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    """``input_ids`` int64 ``[samples, length]``: ``(start + step * t) % vocab``, start and step (1 to 3) random."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, (samples, 1))
    step = rng.integers(1, 4, (samples, 1))
    return ((start + step * np.arange(length)) % vocab).astype(np.int64)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", default="llama", help="directory to write llama.onnx, tokens.npz, config.json")
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden_size"])
    p.add_argument("--layers", type=int, default=DEFAULTS["num_hidden_layers"])
    p.add_argument("--vocab", type=int, default=DEFAULTS["vocab_size"])
    p.add_argument("--samples", type=int, default=256, help="token sequences in tokens.npz (default 256)")
    p.add_argument("--length", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    config = llama_config(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                          vocab_size=args.vocab)
    export(logits_model(config, args.seed), out / "llama.onnx", args.opset)
    np.savez(out / "tokens.npz", input_ids=token_data(args.samples, args.length, args.vocab, args.seed))
    np.savez(out / "heldout.npz", input_ids=token_data(32, args.length, args.vocab, args.seed + 1))
    keep = {k: v for k, v in config.to_dict().items() if k in {*DEFAULTS, "tie_word_embeddings", "rms_norm_eps",
                                                                  "rope_theta", "attn_implementation"}}
    (out / "config.json").write_text(json.dumps(keep, indent=1) + "\n")
    n = sum(p.numel() for p in logits_model(config, args.seed).parameters())
    print(f"wrote {out / 'llama.onnx'} ({n:,} parameters), {out / 'tokens.npz'} ({args.samples} x {args.length} "
          f"tokens), {out / 'heldout.npz'} (32 x {args.length}), {out / 'config.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
