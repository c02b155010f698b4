"""Tiny transformers models built from configs (random weights, no downloads) whose ``forward(input_ids)``
returns the logits alone, and the three ways of exporting them that tests/test_torch_export.py compares:
``revgraph.export_torch``, plain ``torch.onnx.export(dynamo=True, optimize=False, opset_version=23)`` and the
TorchScript exporter (``dynamo=False``)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch

import revgraph as rg

VOCAB, T = 64, 16
#: token ids inside the tiny vocabulary (transformers warns about GPT-2's default 50256), and no pad token: a
#: ``pad_token_id`` makes the embedding ``nn.Embedding(padding_idx=...)``, whose row torch never updates (ONNX
#: ``Gather`` has no such row: docs/guides/differentiate.md, "A model exported from PyTorch")
QUIET = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}


def _logits_only(cls):
    """A subclass (the weights keep the names of ``cls``) that returns the logits of ``input_ids`` alone: no KV
    cache, and an all-ones attention mask (without one, LLaMA's mask builder looks for packed sequences with
    ``aten::diff``, which the TorchScript exporter cannot convert)."""

    class LogitsOnly(cls):
        def forward(self, input_ids):
            mask = torch.ones_like(input_ids)
            extra = {} if cls.__name__.startswith("Bert") else {"use_cache": False}
            return super().forward(input_ids=input_ids, attention_mask=mask, **extra).logits

    LogitsOnly.__name__ = cls.__name__
    return LogitsOnly


def build(name: str, seed: int = 0, perturb: bool = True) -> torch.nn.Module:
    """``llama`` (hidden 32, 2 layers, grouped-query attention: 4 heads, 2 key/value heads), ``gpt2`` (its LM
    head tied to the token embedding) or ``bert`` (a sequence classifier), in eval mode, eager attention (the
    TorchScript exporter cannot convert SDPA with grouped-query attention). ``perturb``: every parameter plus
    0.1 N(0, 1), so that no two are equal (the TorchScript exporter merges equal initializers: zero biases,
    unit norm weights)."""
    import transformers as tf

    torch.manual_seed(seed)
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **QUIET)
        cls = tf.LlamaForCausalLM
    elif name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, **QUIET)
        cls = tf.GPT2LMHeadModel
    else:
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, num_labels=3, **QUIET)
        cls = tf.BertForSequenceClassification
    cfg._attn_implementation = "eager"
    model = _logits_only(cls)(cfg).eval()
    if perturb:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def example(batch: int = 2) -> tuple[torch.Tensor]:
    return (torch.randint(3, VOCAB, (batch, T), generator=torch.Generator().manual_seed(1)),)


def export(model: torch.nn.Module, how: str, path) -> None:
    """Write ``model`` to ``path``: ``how`` is ``export_torch``, ``dynamo`` (plain torch.onnx.export),
    ``torchscript`` (``do_constant_folding=False``: the initializers are the parameters, untransposed) or
    ``torchscript-folded`` (the TorchScript exporter's default: folds each linear weight's transpose into a new
    initializer ``onnx::MatMul_N``). The batch dimension is dynamic."""
    names = {"input_names": ["input_ids"], "output_names": ["logits"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "export_torch":
            rg.export_torch(model, example(), path, dynamic_shapes={"input_ids": {0: "batch"}}, **names)
        elif how == "dynamo":
            torch.onnx.export(model, example(), str(path), dynamo=True, optimize=False, opset_version=23,
                              dynamic_shapes={"input_ids": {0: "batch"}}, verbose=False, **names)
        else:
            buf = io.BytesIO()
            torch.onnx.export(model, example(), buf, dynamo=False, opset_version=17,
                              do_constant_folding=how == "torchscript-folded",
                              dynamic_axes={"input_ids": {0: "batch"}}, **names)
            with open(path, "wb") as f:
                f.write(buf.getvalue())


def alias_groups(model: torch.nn.Module) -> list[set[str]]:
    """The parameters with ``requires_grad``, each as the set of its names (a tied weight has several)."""
    groups: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            groups.setdefault(id(p), set()).add(n)
    return list(groups.values())


def tokens(samples: int, seed: int = 0) -> np.ndarray:
    """``input_ids`` int64 ``[samples, T]`` counting up by 1 to 3 from a random start (modulo the vocabulary),
    a pattern a causal language model learns."""
    rng = np.random.default_rng(seed)
    start, step = rng.integers(0, VOCAB, (samples, 1)), rng.integers(1, 4, (samples, 1))
    return ((start + step * np.arange(T)) % VOCAB).astype(np.int64)
