"""A full fine-tune of onnxruntime's transformer optimizer's output equals the fine-tune of the unoptimized export
of the same weights (issue 41, item 3): 20 steps of ``rg.Trainer`` (AdamW, ``shuffle=False``) on both files, the
per-step losses equal to 1e-4 and the trained weights equal, mapped through the optimizer's renames.

What the optimizer fuses here (onnxruntime's ``transformers.optimizer`` with transformers 5, tiny configs of
tests/kit/torch_models.py, the TorchScript exporter at opset 17):

- BERT (a sequence classifier): ``EmbedLayerNormalization``, ``Attention`` (its Q, K and V weights and biases
  merged into one ``Attention_<i>_qkv_weight``/``_qkv_bias`` per layer), ``SkipLayerNormalization``,
  ``BiasGelu``: every fusion the optimizer has for BERT.
- GPT-2 (a causal LM): ``SkipLayerNormalization`` and ``FastGelu`` only; the optimizer does not fuse GPT-2's
  attention of this export (its pattern matcher finds no ``Attention`` subgraph), so that is what is tested.

AdamW is elementwise and its global quantities (none here: no clipping) are sums over all elements, so the
merged Q|K|V weight trained as one tensor equals the concatenation of the three trained separately; the
weights that are the export's own keep their names.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from kit import torch_models as tm

import revgraph as rg
from revgraph.train import adamw

MS = "com.microsoft"
STEPS, BATCH = 20, 4


def _files(name: str, tmp_path):
    from onnxruntime.transformers import optimizer
    plain, fused = tmp_path / "plain.onnx", tmp_path / "fused.onnx"
    tm.export(tm.build(name), "torchscript-folded", plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer.optimize_model(str(plain), model_type=name, num_heads=4,
                                 hidden_size=32).save_model_to_file(str(fused))
    return plain, fused


def _merged(plain: dict[str, np.ndarray], fused: dict[str, np.ndarray]) -> dict[str, list[str]]:
    """The fused file's weights that are not the export's: each the concatenation (last axis) of three of the
    export's (the optimizer's merged Q|K|V), found by value."""
    merged = {}
    for name, a in fused.items():
        if name in plain:
            continue
        parts = np.split(a, 3, axis=-1) if a.shape[-1] % 3 == 0 else []
        found = [next((n for n, b in plain.items() if b.shape == p.shape and np.array_equal(b, p)), None)
                 for p in parts]
        assert parts and all(found), f"the optimizer's {name} {a.shape} is no merge of the export's weights"
        merged[name] = found
    return merged


def _fine_tune(path, loss: str, data: dict[str, np.ndarray]) -> tuple[list[float], dict[str, np.ndarray]]:
    trainer = rg.Trainer(str(path), loss, adamw(lr=1e-3, weight_decay=0.01))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(data, epochs=STEPS * BATCH // len(data["input_ids"]), batch_size=BATCH, shuffle=False,
                    progress=False)
    return trainer.losses, trainer.parameters  # (fit returns one loss an epoch; .losses one a step)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_optimized_file_fine_tunes_like_the_export(name, tmp_path):
    plain, fused = _files(name, tmp_path)
    ops = {nd.op_type for nd in onnx.load(str(fused)).graph.node if nd.domain == MS}
    want_ops = {"EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu"} if name == "bert" \
        else {"SkipLayerNormalization", "FastGelu"}
    assert ops == want_ops
    rng = np.random.default_rng(3)
    data = {"input_ids": tm.tokens(8, seed=2)}  # 8 samples, batches of 4: 20 steps are 10 epochs
    if name == "bert":
        data["labels"] = rng.integers(0, 3, 8).astype(np.int64)
    loss = "cross-entropy" if name == "bert" else "causal-lm"
    want_losses, want = _fine_tune(plain, loss, data)
    got_losses, got = _fine_tune(fused, loss, data)
    assert len(want_losses) == len(got_losses) == STEPS
    assert want_losses[-1] < want_losses[0]  # (it trains)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4, atol=1e-4)

    initial = {p: {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(p)).graph.initializer}
               for p in (plain, fused)}
    merged = _merged({n: initial[plain][n] for n in want}, {n: initial[fused][n] for n in got})
    assert len(merged) == (4 if name == "bert" else 0)  # 2 layers: a Q|K|V weight and bias each
    assert set(got) == (set(want) - {p for parts in merged.values() for p in parts}) | set(merged)
    for n, parts in merged.items():
        want[n] = np.concatenate([want[p] for p in parts], axis=-1)
    for n, a in got.items():
        assert not np.array_equal(a, initial[fused][n]), n  # (every parameter moved)
        b = want[n]
        if n.endswith(("qkv_bias", "attn.c_attn.bias")):  # (BERT's merged and GPT-2's own Q|K|V biases)
            # the key bias's gradient is 0 in exact arithmetic (softmax ignores a shift along the keys), so Adam's
            # m / sqrt(v) turns float32 rounding into full-size steps either way: compared as unchanged but for
            # those lr-sized steps, not with the export's
            a, b, key = a.copy(), b.copy(), slice(a.size // 3, 2 * a.size // 3)
            drift = np.abs(a[key] - initial[fused][n][key]).max()
            assert drift <= STEPS * 1e-3 * 1.01, (n, drift)
            a[key] = b[key] = 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()), err_msg=n)
