"""Back to the Hugging Face world (issue 38, item 5): the trained weights as a PyTorch state dict in safetensors
(``Trainer.save_state_dict``, ``train --save-safetensors``) and LoRA adapters in PEFT's format (``lora extract
--format peft``, ``lora apply BASE.onnx PEFT_DIR``), on a tiny transformers LLaMA exported by
``torch.onnx.export(dynamo=True, optimize=False, opset_version=23)``. Every comparison is against PyTorch itself
(the module with the state dict loaded, ``peft.PeftModel``) to 1e-5; a PEFT directory is untrusted input, and
every bad one is a one-line refusal (exit 2)."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch
from kit.harness import one_line_error
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load_file

import revgraph as rg
from revgraph.cli import main
from revgraph.errors import RevgraphError
from revgraph.train import hf_io, lora, peft_io
from revgraph.train.optimizers import make_optimizer

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TARGETS = ["*q_proj*", "*v_proj*"]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def llama(seed: int = 0, causal_lm: bool = False, **overrides):
    """A ``LlamaForCausalLM`` of :data:`CONFIG` with seeded random weights; unless ``causal_lm``, a subclass whose
    ``forward(input_ids)`` returns the logits alone (what the ONNX model computes; same parameter names)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class LogitsOnly(LlamaForCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    config = LlamaConfig(**{**CONFIG, "tie_word_embeddings": False, "attn_implementation": "eager", **overrides})
    torch.manual_seed(seed)
    return (LlamaForCausalLM if causal_lm else LogitsOnly)(config).eval()


def logits(module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = module(torch.as_tensor(ids))
    return (out if isinstance(out, torch.Tensor) else out.logits).numpy()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``llama.onnx`` (the export of ``llama(0)``), ``tokens.npz`` (16 x 8 ids) and ``ids`` to compare on."""
    d = tmp_path_factory.mktemp("hf")
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(llama(0), (ids,), str(d / "llama.onnx"), input_names=["input_ids"],
                          output_names=["logits"], opset_version=23, dynamo=True, optimize=False,
                          dynamic_shapes=({0: torch.export.Dim("B"), 1: torch.export.Dim("T", max=64)},),
                          external_data=False, verbose=False)
    rng = np.random.default_rng(0)
    np.savez(d / "tokens.npz", input_ids=rng.integers(0, CONFIG["vocab_size"], (16, 8)).astype(np.int64))
    return d, rng.integers(0, CONFIG["vocab_size"], (3, 8)).astype(np.int64)


def trained(d, **lora_options) -> rg.Trainer:
    """A Trainer on ``llama.onnx`` after 8 Adam steps (lr 1e-2): the full model (``inv_freq``, a buffer, frozen),
    or LoRA adapters with ``lora_options`` (``rank``, ``alpha``)."""
    g = rg.load(d / "llama.onnx")
    if lora_options:
        g = lora.add_adapters(g, lora_options["rank"], lora_options["alpha"], TARGETS)
    tr = rg.Trainer(g, "causal-lm", make_optimizer("adam", lr=1e-2), threads=1,
                    freeze=None if lora_options else ["*inv_freq"])
    tr.fit(dict(np.load(d / "tokens.npz")), epochs=2, batch_size=4, progress=False)
    return tr


# ------------------------------------------------------------------------------------------- state dict


def test_state_dict_of_a_full_fine_tune_loads_into_the_module(setup, tmp_path):
    """(a) Trainer.save_state_dict -> safetensors.torch.load_file -> load_state_dict: the module computes the
    trained model's logits. Without export_torch's record (the dynamo exporter's kinds only) the parameters and
    buffers are written under their own names, the non-persistent buffer inv_freq among them: strict=False."""
    d, ids = setup
    tr = trained(d)
    assert tr.save_state_dict(tmp_path / "w.safetensors")[0] == 22
    sd = load_file(tmp_path / "w.safetensors")
    module = llama(seed=1)  # other weights: the file must set every one of them
    assert np.abs(logits(module, ids) - tr.predict(ids)).max() > 1e-2
    result = module.load_state_dict(sd, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["model.rotary_emb.inv_freq"]
    np.testing.assert_allclose(logits(module, ids), tr.predict(ids), **TOL)
    base = llama(0)  # the weights trained: the file holds the trained values, not the exported ones
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(sd[up], base.state_dict()[up])


def test_state_dict_of_lora_holds_the_merged_weights(setup, tmp_path):
    """(a) With LoRA adapters not merged: the state dict holds the base model's parameters with the adapters
    merged into q_proj and v_proj (PEFT's merge_and_unload), and no adapter tensor."""
    d, ids = setup
    tr = trained(d, rank=4, alpha=8.0)
    adapted = tr.predict(ids)
    assert np.abs(adapted - logits(llama(0), ids)).max() > 1e-3  # the adapters changed the model
    tr.save_state_dict(tmp_path / "w.safetensors")
    sd = load_file(tmp_path / "w.safetensors")
    assert not [k for k in sd if "lora" in k]
    module = llama(seed=1)
    module.load_state_dict(sd, strict=False)
    np.testing.assert_allclose(logits(module, ids), adapted, **TOL)


def test_train_save_safetensors(setup, tmp_path, capsys):
    """train --save-safetensors writes the state dict of the trained -o model, and says so."""
    d, ids = setup
    out = tmp_path / "t.onnx"
    code = main(["train", str(d / "llama.onnx"), "--data", str(d / "tokens.npz"), "--loss", "causal-lm",
                 "--epochs", "1", "--batch-size", "8", "--lr", "0.01", "--freeze", "*inv_freq", "-o", str(out),
                 "--save-safetensors", str(tmp_path / "t.safetensors")])
    assert code == 0, capsys.readouterr().err
    assert f"wrote {tmp_path / 't.safetensors'}: the PyTorch state dict (22 tensors" in capsys.readouterr().out
    module = llama(seed=1)
    module.load_state_dict(load_file(tmp_path / "t.safetensors"), strict=False)
    want = rg.Session(rg.load(out)).run({"input_ids": ids})["logits"]
    np.testing.assert_allclose(logits(module, ids), want, **TOL)


@pytest.mark.parametrize("name", ["w.bin", "w.pt", "w.onnx", "w"])
def test_a_state_dict_is_safetensors(setup, tmp_path, capsys, name):
    """(d) --save-safetensors with another suffix: one line before training (no -o written); the API refuses too."""
    d, _ = setup
    out = tmp_path / "t.onnx"
    code = main(["train", str(d / "llama.onnx"), "--data", str(d / "tokens.npz"), "--loss", "causal-lm",
                 "--epochs", "1", "-o", str(out), "--save-safetensors", str(tmp_path / name)])
    one_line_error(code, capsys.readouterr().err, f"--save-safetensors {str(tmp_path / name)!r}", ".safetensors")
    assert not out.exists()
    with pytest.raises(RevgraphError, match=r"ending in \.safetensors"):
        hf_io.save_state_dict(tmp_path / name, rg.load(d / "llama.onnx"))


def test_recorded_names_tied_and_buffers(setup, tmp_path):
    """With a state-dict record (what rg.export_torch writes: ``revgraph.torch_state_dict``), exactly its keys
    are written, a tied initializer under each of its names; a record naming a missing initializer is one line."""
    d, _ = setup
    g = rg.load(d / "llama.onnx")
    record = {k: k for k in llama(0).state_dict()}
    record["tied.copy.weight"] = "lm_head.weight"
    g.metadata["revgraph.torch_state_dict"] = json.dumps(record)
    hf_io.save_state_dict(tmp_path / "w.safetensors", g)
    sd = np_load_file(tmp_path / "w.safetensors")
    assert sorted(sd) == sorted(record)  # inv_freq, a non-persistent buffer, is not in state_dict(): left out
    np.testing.assert_array_equal(sd["tied.copy.weight"], g.initializers["lm_head.weight"])
    g.metadata["revgraph.torch_state_dict"] = json.dumps({"x.weight": "nope"})
    with pytest.raises(RevgraphError, match="names initializer 'nope', which the model does not have"):
        hf_io.save_state_dict(tmp_path / "w2.safetensors", g)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """``tied.onnx``: rg.export_torch of a LLaMA whose LM head is its token embedding (one initializer, two
    state-dict keys), with its record of the module's names."""
    d = tmp_path_factory.mktemp("tied")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rg.export_torch(llama(0, tie_word_embeddings=True), (torch.randint(0, 64, (2, 8)),), d / "tied.onnx",
                        input_names=["input_ids"], output_names=["logits"],
                        dynamic_shapes=({0: torch.export.Dim("B"), 1: torch.export.Dim("T", max=64)},))
    return d / "tied.onnx"


def test_export_torch_record_gives_a_strict_state_dict(setup, tied, tmp_path):
    """(a) With rg.export_torch's record: load_state_dict(strict=True) takes the file (both names of the tied
    weight, no inv_freq), after a full fine-tune (the default set: the parameters) and after LoRA (merged);
    the module computes revgraph's logits."""
    d, ids = setup
    g = rg.load(tied)
    assert len(g.initializers) == 21  # (the tied weight is one initializer, inv_freq another)
    for adapters in (False, True):
        model = lora.add_adapters(g, 4, 8.0, TARGETS) if adapters else g
        tr = rg.Trainer(model, "causal-lm", make_optimizer("adam", lr=1e-2), threads=1)
        tr.fit(dict(np.load(d / "tokens.npz")), epochs=2, batch_size=4, progress=False)
        tr.save_state_dict(tmp_path / "w.safetensors")
        sd = load_file(tmp_path / "w.safetensors")
        module = llama(1, tie_word_embeddings=True)
        assert sorted(sd) == sorted(module.state_dict())
        module.load_state_dict(sd, strict=True)
        np.testing.assert_allclose(logits(module, ids), tr.predict(ids), **TOL)
        assert np.abs(tr.predict(ids) - logits(llama(0, tie_word_embeddings=True), ids)).max() > 1e-3


def test_export_torch_record_names_the_peft_modules(setup, tied, tmp_path):
    """(b) extract --format peft of a model with the record: the modules are the torch ones, PEFT computes the
    adapted logits; an adapter on the tied weight is refused in one line (PEFT adapts one module at a time)."""
    from peft import PeftModel

    _, ids = setup
    g = lora.add_adapters(rg.load(tied), 4, 8.0, TARGETS)
    rng = np.random.default_rng(2)
    for a in lora.config(g)["adapters"]:
        g.initializers[a["B"]] = rng.normal(0, 0.2, g.initializers[a["B"]].shape).astype(np.float32)
    peft_io.save_peft(tmp_path / "peft", g)
    model = PeftModel.from_pretrained(llama(0, tie_word_embeddings=True), str(tmp_path / "peft")).eval()
    np.testing.assert_allclose(logits(model, ids), rg.Session(g).run({"input_ids": ids})["logits"], **TOL)
    with pytest.raises(RevgraphError, match=r"weight 'lm_head\.weight' is the tied parameters "
                                            r"'model\.embed_tokens\.weight', 'lm_head\.weight'"):
        peft_io.save_peft(tmp_path / "p2", lora.add_adapters(rg.load(tied), 4, 8.0, ["lm_head.weight"]))


# ------------------------------------------------------------------------------------------------- PEFT


def peft_logits(base, directory, ids):
    from peft import PeftModel

    return logits(PeftModel.from_pretrained(base, str(directory)).eval(), ids)


def test_extract_peft_loads_in_peft(setup, tmp_path, capsys):
    """(b) lora extract --format peft -> PeftModel.from_pretrained(fresh base, DIR): PEFT computes revgraph's
    adapted logits; the configuration says what a PEFT user would write."""
    d, ids = setup
    tr = trained(d, rank=4, alpha=8.0)
    tr.export(tmp_path / "lora.onnx")
    out = tmp_path / "peft"
    assert main(["lora", "extract", str(tmp_path / "lora.onnx"), "--format", "peft", "-o", str(out),
                 "--task-type", "CAUSAL_LM"]) == 0
    assert "4 adapters in PEFT's format (8 tensors" in capsys.readouterr().out
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"], config["task_type"]) \
        == ("LORA", 4, 8, ["q_proj", "v_proj"], "CAUSAL_LM")
    base = llama(0, causal_lm=True)  # PeftModelForCausalLM (task_type) over the plain transformers class
    np.testing.assert_allclose(peft_logits(base, out, ids), tr.predict(ids), **TOL)
    assert np.abs(tr.predict(ids) - logits(llama(0), ids)).max() > 1e-3


def test_peft_adapters_apply_in_revgraph(setup, tmp_path, capsys):
    """(c) Adapters made by peft itself (random non-zero B, use_rslora), saved with save_pretrained ->
    lora apply: revgraph's logits equal PEFT's, as separate adapters and merged; the API gives the same."""
    from peft import LoraConfig, get_peft_model

    d, ids = setup
    model = get_peft_model(llama(0), LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0, use_rslora=True))
    torch.manual_seed(5)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(str(tmp_path / "peft"))
    want = logits(model.eval(), ids)
    assert np.abs(want - logits(llama(0), ids)).max() > 1e-2
    for merge in ([], ["--merge"]):
        out = tmp_path / f"o{len(merge)}.onnx"
        assert main(["lora", "apply", str(d / "llama.onnx"), str(tmp_path / "peft"), "-o", str(out), *merge]) == 0
        assert "4 PEFT adapters (r 4, scaling 3)" in capsys.readouterr().out  # 6 / sqrt(4)
        np.testing.assert_allclose(rg.Session(rg.load(out)).run({"input_ids": ids})["logits"], want, **TOL)
    g = peft_io.apply_peft(rg.load(d / "llama.onnx"), tmp_path / "peft")
    assert len(lora.config(g)["adapters"]) == 4
    np.testing.assert_allclose(rg.Session(g).run({"input_ids": ids})["logits"], want, **TOL)


def test_peft_round_trip_on_weights_stored_in_out(tmp_path):
    """GPT-2's Conv1D stores its weight [in, out] and the exporter reads it as is (no Transpose): PEFT's
    lora_A/lora_B are still the transposes of revgraph's A and B, and fan_in_fan_out is set (PEFT's merge);
    PEFT's logits, merged and not, equal revgraph's, and applying the directory back gives them too."""
    from peft import PeftModel
    from transformers import GPT2Config, GPT2LMHeadModel

    class LogitsOnly(GPT2LMHeadModel):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    def gpt2():
        torch.manual_seed(0)
        return LogitsOnly(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, bos_token_id=0,
                                     eos_token_id=0, attn_implementation="eager")).eval()

    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(gpt2(), (ids,), str(tmp_path / "gpt2.onnx"), input_names=["input_ids"],
                          output_names=["logits"], opset_version=23, dynamo=True, optimize=False,
                          external_data=False, verbose=False)
    g = lora.add_adapters(rg.load(tmp_path / "gpt2.onnx"), 4, 8.0, ["*c_attn*", "*c_fc*"])
    rng = np.random.default_rng(1)
    for a in lora.config(g)["adapters"]:
        assert not a["transposed"]  # stored [in, out]
        g.initializers[a["B"]] = rng.normal(0, 0.2, g.initializers[a["B"]].shape).astype(np.float32)
    peft_io.save_peft(tmp_path / "peft", g)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    want = rg.Session(g).run({"input_ids": ids.numpy()})["logits"]
    assert np.abs(want - logits(gpt2(), ids.numpy())).max() > 1e-2
    model = PeftModel.from_pretrained(gpt2(), str(tmp_path / "peft")).eval()
    np.testing.assert_allclose(logits(model, ids.numpy()), want, **TOL)
    np.testing.assert_allclose(logits(model.merge_and_unload(), ids.numpy()), want, **TOL)
    back = peft_io.apply_peft(rg.load(tmp_path / "gpt2.onnx"), tmp_path / "peft", merge=True)
    np.testing.assert_allclose(rg.Session(back).run({"input_ids": ids.numpy()})["logits"], want, **TOL)


@pytest.fixture(scope="module")
def peft_dir(setup, tmp_path_factory):
    """A PEFT directory revgraph wrote (r 4 on q_proj, v_proj; B non-zero), to break in the tests below."""
    d, _ = setup
    g = lora.add_adapters(rg.load(d / "llama.onnx"), 4, 8.0, TARGETS)
    for a in lora.config(g)["adapters"]:
        g.initializers[a["B"]] = np.full(g.initializers[a["B"]].shape, 0.1, np.float32)
    out = tmp_path_factory.mktemp("peft") / "ok"
    peft_io.save_peft(out, g)
    return out


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
V_B = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"


def _rename(t, old, new):
    t[new] = t.pop(old)


BAD_TENSORS = {  # case: (change the tensors in place, what the one line says)
    "wrong shape": (lambda t: t.update({V_B: np.zeros((32, 4), np.float32)}),
                    (f"{V_B} has shape [32, 4]; weight 'model.layers.0.self_attn.v_proj.weight' of the base model needs"
                     " [16, 4]")),
    "transposed": (lambda t: t.update({Q_A: t[Q_A].T.copy()}), "of rank 32; adapter_config.json says r = 4"),
    "integers": (lambda t: t.update({Q_A: t[Q_A].astype(np.int32)}), "is int32 [4, 32], not a 2-D floating-point"),
    "1-d": (lambda t: t.update({Q_A: t[Q_A][0]}), "is float32 [32], not a 2-D floating-point"),
    "nan": (lambda t: t.update({Q_A: np.full_like(t[Q_A], np.nan)}), "holds NaN or infinite values"),
    "missing B": (lambda t: t.pop(V_B), f"{V_B} is missing (module 'model.layers.0.self_attn.v_proj' has only"),
    "not LoRA": (lambda t: t.update({"base_model.model.lm_head.weight": np.zeros((64, 32), np.float32)}),
                 "tensor 'base_model.model.lm_head.weight' is not a LoRA weight of PEFT's form"),
    "not targeted": (lambda t: _rename(t, Q_A, Q_A.replace("self_attn.q_proj", "mlp.up_proj")),
                     "adapts module 'model.layers.0.mlp.up_proj', which target_modules"),
    "no such module": (lambda t: (_rename(t, Q_A, Q_A.replace("layers.0", "layers.7")),
                                  _rename(t, Q_A.replace("lora_A", "lora_B"),
                                          Q_A.replace("lora_A", "lora_B").replace("layers.0", "layers.7"))),
                       "module 'model.layers.7.self_attn.q_proj' has no weight in the base model"),
    "empty": (lambda t: t.clear(), "holds no tensors"),
}


def _refused(setup, tmp_path, capsys, directory, *fragments):
    d, _ = setup
    out = tmp_path / "o.onnx"
    code = main(["lora", "apply", str(d / "llama.onnx"), str(directory), "-o", str(out)])
    one_line_error(code, capsys.readouterr().err, *fragments)
    assert not out.exists()


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_peft_tensors_are_one_line(setup, peft_dir, tmp_path, capsys, case):
    """(d) A tensor of a wrong shape, rank, dtype, name or module: one line naming the weights file."""
    bad = tmp_path / "bad"
    shutil.copytree(peft_dir, bad)
    tensors = dict(np_load_file(bad / "adapter_model.safetensors"))
    BAD_TENSORS[case][0](tensors)
    np_save_file(tensors, bad / "adapter_model.safetensors")
    _refused(setup, tmp_path, capsys, bad, f"{str(bad / 'adapter_model.safetensors')!r}", BAD_TENSORS[case][1])


BAD_CONFIGS = {  # case: (change the configuration in place, what the one line says)
    "rank": (lambda c: c.update(r=8), "of rank 4; adapter_config.json says r = 8"),
    "r zero": (lambda c: c.update(r=0), "r is 0, not an integer >= 1"),
    "r too large": (lambda c: c.update(r=100), "r 100 exceeds min(in, out) of every 2-D weight"),
    "alpha": (lambda c: c.update(lora_alpha="8"), "lora_alpha is '8', not a finite non-zero number"),
    "prefix tuning": (lambda c: c.update(peft_type="PREFIX_TUNING"), "peft_type is 'PREFIX_TUNING'"),
    "dora": (lambda c: c.update(use_dora=True), "use_dora is True; revgraph applies plain LoRA adapters"),
    "rank pattern": (lambda c: c.update(rank_pattern={"q_proj": 8}), "rank_pattern is {'q_proj': 8}"),
    "bias": (lambda c: c.update(bias="all"), "bias is 'all'"),
    "kasa": (lambda c: c.update(kasa_config={"x": 1}), "kasa_config is {'x': 1}; revgraph applies plain LoRA"),
    "targets": (lambda c: c.update(target_modules=["k_proj"]), "which target_modules ['k_proj'] of"),
    "no peft_type": (lambda c: c.pop("peft_type"), "peft_type is None"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_peft_configs_are_one_line(setup, peft_dir, tmp_path, capsys, case):
    """(d) A rank that does not match the tensors, a configuration revgraph cannot compute: one line."""
    bad = tmp_path / "bad"
    shutil.copytree(peft_dir, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    BAD_CONFIGS[case][0](config)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    _refused(setup, tmp_path, capsys, bad, BAD_CONFIGS[case][1])


def test_bad_peft_files_are_one_line(setup, peft_dir, tmp_path, capsys):
    """(d) A truncated or oversized weights file, a configuration that is not JSON or missing, a pickle."""
    bad = tmp_path / "bad"
    shutil.copytree(peft_dir, bad)
    weights = bad / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-10])
    _refused(setup, tmp_path, capsys, bad, f"{str(weights)!r} is not a whole safetensors file")
    weights.write_bytes(data[:6])
    _refused(setup, tmp_path, capsys, bad, "is not a whole safetensors file")
    np_save_file({"x": np.zeros(1 << 19, np.float32)}, weights)  # 2 MiB: more than r-4 adapters of this base take
    _refused(setup, tmp_path, capsys, bad, "2,097,", "bytes, more than the")
    weights.write_bytes(data)
    (bad / "adapter_config.json").write_text("{not json")
    _refused(setup, tmp_path, capsys, bad, "adapter_config.json' is not JSON")
    (bad / "adapter_config.json").unlink()
    _refused(setup, tmp_path, capsys, bad, "adapter_config.json': no such file")
    shutil.copy(peft_dir / "adapter_config.json", bad)
    weights.rename(bad / "adapter_model.bin")
    _refused(setup, tmp_path, capsys, bad, "holds adapter_model.bin (a pickle)")


def test_extract_peft_refusals(setup, tmp_path, capsys):
    """lora extract --format peft onto a file, of a model without adapters, --task-type without --format peft,
    --format contradicting -o: one line each."""
    d, _ = setup
    (tmp_path / "f").write_text("")
    for argv, fragment in (([str(d / "llama.onnx"), "--format", "peft", "-o", str(tmp_path / "f")],
                            "is a file; --format peft writes a directory"),
                           ([str(d / "llama.onnx"), "--format", "peft", "-o", str(tmp_path / "p")],
                            "the model has no LoRA adapters"),
                           ([str(d / "llama.onnx"), "--task-type", "CAUSAL_LM", "-o", str(tmp_path / "a.npz")],
                            "--task-type goes with --format peft"),
                           ([str(d / "llama.onnx"), "--format", "onnx", "-o", str(tmp_path / "a.npz")],
                            "does not end in .onnx")):
        one_line_error(main(["lora", "extract", *argv]), capsys.readouterr().err, fragment)
