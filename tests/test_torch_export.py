"""The default trainable set is the module's parameters (issue 38, item 2): ``revgraph.export_torch`` records them
(``metadata_props`` ``revgraph.torch_parameters`` / ``revgraph.torch_buffers`` / ``revgraph.torch_state_dict``),
a plain dynamo export carries the exporter's own per-initializer record, and a TorchScript export falls back to
names and sizes. Tiny LLaMA (grouped-query attention, rotary ``inv_freq`` buffer), GPT-2 (tied LM head) and BERT
from transformers configs, each exported the three ways; what trains by default is compared with
``module.named_parameters()``, and ``inv_freq`` never trains."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from kit import torch_models as tm  # (tests/ is on sys.path)
from kit.harness import one_line_error

import revgraph as rg
from revgraph.cli import main
from revgraph.onnx_io.torch_names import BUFFERS, EXPORTER_KINDS, PARAMETERS, STATE_DICT
from revgraph.train.selection import buffer_name, left_out, select

MODELS = ("llama", "gpt2", "bert")
EXPORTS = ("export_torch", "dynamo", "torchscript")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(module, path)`` of a model exported one way, each built and exported once for the module."""
    cache, modules = {}, {}
    root = tmp_path_factory.mktemp("torch_export")

    def get(name: str, how: str):
        if name not in modules:
            modules[name] = tm.build(name)
        if (name, how) not in cache:
            path = root / f"{name}.{how}.onnx"
            tm.export(modules[name], how, path)
            cache[name, how] = path
        return modules[name], cache[name, how]

    return get


def _initializers(path) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("how", EXPORTS)
@pytest.mark.parametrize("name", MODELS)
def test_the_default_trainable_set_is_the_modules_parameters(exported, name, how):
    """Every parameter trains once (a tied weight under one of its names), with its own value, and nothing else:
    not the rotary ``inv_freq`` (LLaMA), not an exporter constant. The TorchScript export (no constant folding)
    has no record: names and sizes decide, and give the same set."""
    module, path = exported(name, how)
    g = rg.load(path)
    trained = select(g)
    groups = tm.alias_groups(module)
    owner = {n: i for i, names in enumerate(groups) for n in names}
    assert [k for k in trained if k not in owner] == []
    assert sorted(owner[k] for k in trained) == list(range(len(groups)))  # each parameter once
    params = dict(module.named_parameters(remove_duplicate=False))
    for k in trained:
        np.testing.assert_array_equal(np.asarray(g.initializers[k]), params[k].detach().numpy(), err_msg=k)
    assert not any("inv_freq" in k for k in trained)
    if name == "llama" and how != "torchscript":  # (the TorchScript exporter writes inv_freq as a Constant node)
        assert left_out(g) == {"model.rotary_emb.inv_freq": "buffers"}
        # the heuristic alone would have trained it: it is a float initializer of 4 elements
        assert np.asarray(g.initializers["model.rotary_emb.inv_freq"]).shape == (4,)
    elif how != "torchscript":
        assert left_out(g) == {}


@pytest.mark.parametrize("name", MODELS)
def test_a_folded_torchscript_export_trains_the_parameters_values(exported, tmp_path, name):
    """The TorchScript exporter's default (``do_constant_folding=True``) stores each linear weight transposed
    under a new name (``onnx::MatMul_N``): names cannot match, values can. Every trained tensor is a parameter or
    its transpose, every parameter is trained; GPT-2's tied weight is trained twice (the embedding and the
    folded transpose for the LM head are two initializers: the export untied them)."""
    module, _ = exported(name, "torchscript")
    path = tmp_path / "folded.onnx"
    tm.export(module, "torchscript-folded", path)
    g = rg.load(path)
    values = [(n, p.detach().numpy()) for n, p in module.named_parameters()]
    hits: dict[str, list[str]] = {}
    for k in select(g):
        a = np.asarray(g.initializers[k])
        same = [n for n, v in values if (v.shape == a.shape and np.array_equal(v, a))
                or (v.ndim == 2 and v.T.shape == a.shape and np.array_equal(v.T, a))]
        assert len(same) == 1, (k, same)
        hits.setdefault(same[0], []).append(k)
    assert sorted(hits) == sorted(n for n, _ in values)
    twice = {n: ks for n, ks in hits.items() if len(ks) > 1}
    assert twice == ({"transformer.wte.weight": twice["transformer.wte.weight"]} if name == "gpt2" else {})


@pytest.mark.parametrize("name", MODELS)
def test_export_torch_records_parameters_buffers_and_the_state_dict(exported, name):
    module, path = exported(name, "export_torch")
    meta = {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}
    inits = _initializers(path)
    params = meta[PARAMETERS]
    assert sorted(params) == sorted(n for n, _ in module.named_parameters(remove_duplicate=False))
    for names in tm.alias_groups(module):  # a tied weight: each name, one initializer
        assert len({params[n] for n in names}) == 1
    for n, p in module.named_parameters(remove_duplicate=False):
        np.testing.assert_array_equal(inits[params[n]], p.detach().numpy())
    buffers = dict(module.named_buffers())
    used = {n: b for n, b in buffers.items() if n in meta[BUFFERS]}
    for n, init in meta[BUFFERS].items():
        np.testing.assert_array_equal(inits[init], buffers[n].numpy())
    want = {"llama": ["model.rotary_emb.inv_freq"], "gpt2": [],
            "bert": ["bert.embeddings.position_ids", "bert.embeddings.token_type_ids"]}[name]
    assert sorted(used) == want  # (LLaMA's original_inv_freq is not read: the exporter dropped it)
    state = module.state_dict()
    assert sorted(meta[STATE_DICT]) == sorted(k for k in state if k in params or k in meta[BUFFERS])
    assert not set(want) & set(meta[STATE_DICT])  # these buffers are non-persistent: not in the state dict


def test_the_dynamo_exporters_record_survives_load_and_save(exported, tmp_path):
    """A plain dynamo export has no revgraph keys; ``load`` keeps the exporter's per-initializer kinds as the
    metadata key ``revgraph.exporter_kinds``, so the model revgraph writes (a trained one) keeps them."""
    module, path = exported("llama", "dynamo")
    g = rg.load(path)
    kinds = json.loads(g.metadata[EXPORTER_KINDS])
    assert kinds["model.rotary_emb.inv_freq"] == "buffer"
    assert sorted(k for k, v in kinds.items() if v == "parameter") == sorted(n for n, _ in module.named_parameters())
    rg.save(g, tmp_path / "again.onnx")
    back = rg.load(tmp_path / "again.onnx")
    assert back.metadata == g.metadata and "model.rotary_emb.inv_freq" not in select(back)
    _, mine = exported("llama", "export_torch")
    assert EXPORTER_KINDS not in rg.load(mine).metadata  # revgraph's own record is there: no second one


class _Odd(torch.nn.Module):
    """A tied weight, BatchNorm (running statistics and an int64 counter), a non-persistent buffer, a frozen
    parameter, an unused one, a learnable one-element scale, and a Dropout (train mode shows in the export)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.bn, self.drop = torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.1)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
        self.frozen = torch.nn.Parameter(torch.full((4,), 3.0), requires_grad=False)
        self.unused = torch.nn.Parameter(torch.ones(4))
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))
        with torch.no_grad():
            self.bn.running_mean.add_(0.5)
            self.bn.running_var.mul_(2.0)

    def forward(self, x):
        h = self.drop(self.emb(x)) * self.scale + self.frozen
        return self.head(self.bn(h.transpose(1, 2)).transpose(1, 2)) * self.temperature


def test_export_torch_records_a_modules_odd_tensors_and_keeps_its_modes(tmp_path):
    """The frozen parameter is in the state dict and not trained; the unused one is dropped; the one-element
    parameter trains (the record says it is one); the BatchNorm statistics and the non-persistent buffer do
    not. The module's modes (eval with one submodule in train) and flags are as they were."""
    m = _Odd().eval()
    m.drop.train()
    before = [x.training for x in m.modules()]
    record = rg.export_torch(m, torch.randint(0, 10, (2, 3)), tmp_path / "odd.onnx")
    assert [x.training for x in m.modules()] == before and not m.frozen.requires_grad
    assert record["parameters"] == {"emb.weight": "head.weight", "head.weight": "head.weight", "bn.weight": "bn.weight",
                                    "bn.bias": "bn.bias", "temperature": "temperature"}
    assert record["buffers"] == {"scale": "scale", "bn.running_mean": "bn.running_mean",
                                 "bn.running_var": "bn.running_var"}
    assert sorted(record["state_dict"]) == sorted(["frozen", "emb.weight", "head.weight", "bn.weight", "bn.bias",
                                                   "bn.running_mean", "bn.running_var", "temperature"])
    g = rg.load(tmp_path / "odd.onnx")
    assert any(n.op_type == "Dropout" for n in g.nodes)  # the submodule in train mode was exported so
    assert select(g) == [k for k in g.initializers if k in {"head.weight", "bn.weight", "bn.bias", "temperature"}]
    assert left_out(g) == {"frozen": "parameters with requires_grad=False", "scale": "buffers",
                           "bn.running_mean": "buffers", "bn.running_var": "buffers"}
    tr = rg.Trainer(g, "mse", "sgd")
    assert sorted(tr.parameters) == ["bn.bias", "bn.weight", "head.weight", "temperature"]


def test_buffer_names_without_a_record():
    """No record (TorchScript, tf2onnx, a hand-built graph): a float initializer named as a buffer is left out."""
    assert all(map(buffer_name, ["model.rotary_emb.inv_freq", "bn1.running_mean", "layer.0.bn.running_var",
                                 "bn/moving_variance:0", "embeddings.position_ids"]))
    assert not any(map(buffer_name, ["model.layers.0.mlp.up_proj.weight", "running", "inv_freq_scale.weight"]))
    w, x = np.ones((3, 3), np.float32), onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    nodes = [onnx.helper.make_node("MatMul", ["x", "W"], ["h"]),
             onnx.helper.make_node("BatchNormalization", ["h", "g", "b", "bn.running_mean", "bn.running_var"], ["y"])]
    inits = {"W": w, "g": np.ones(3, np.float32), "b": np.zeros(3, np.float32),
             "bn.running_mean": np.zeros(3, np.float32), "bn.running_var": np.ones(3, np.float32)}
    graph = onnx.helper.make_graph(nodes, "bn", [x], [onnx.helper.make_tensor_value_info("y", 1, [2, 3])],
                                   [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    g = rg.load(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))
    assert select(g) == ["W", "g", "b"]
    assert left_out(g) == {"bn.running_mean": "buffers (by name)", "bn.running_var": "buffers (by name)"}
    assert select(g, ["bn.*"]) == ["bn.running_mean", "bn.running_var"]  # named, they train


def test_export_torch_refuses_in_one_line(tmp_path):
    def one_line(match, *a, **k):
        with pytest.raises(rg.RevgraphError) as info:
            rg.export_torch(*a, **k)
        assert "\n" not in str(info.value) and match in str(info.value), str(info.value)

    x = torch.zeros(2, 3)
    one_line("module= must be a torch.nn.Module, got function", lambda t: t, x, tmp_path / "m.onnx")
    one_line("names a safetensors file", torch.nn.Linear(3, 2), x, tmp_path / "m.safetensors")
    one_line("sets optimize= itself", torch.nn.Linear(3, 2), x, tmp_path / "m.onnx", optimize=True)
    one_line("give a file path", torch.nn.Linear(3, 2), x, 3)

    class Broken(torch.nn.Module):
        def forward(self, t):
            raise ValueError("no forward here\nsecond line")

    one_line("torch.onnx.export(dynamo=True) of Broken failed: ValueError: no forward here", Broken(), x,
             tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_record_that_is_not_a_json_object_of_names_is_one_line(exported):
    _, path = exported("gpt2", "export_torch")
    g = rg.load(path)
    g.metadata[PARAMETERS] = "[1, 2]"
    with pytest.raises(rg.RevgraphError, match=r"'revgraph\.torch_parameters' is not a JSON object of names"):
        select(g)


def test_train_prints_what_it_trains_and_the_buffers_it_left_out(exported, tmp_path, capsys, monkeypatch):
    """``revgraph train`` always prints the count; on LLaMA exported by export_torch it names inv_freq as a
    buffer left out; with --train/--freeze it names nothing left out."""
    module, path = exported("llama", "export_torch")
    monkeypatch.chdir(tmp_path)
    np.savez("tokens.npz", input_ids=tm.tokens(8))
    argv = ["train", str(path), "--data", "tokens.npz", "--loss", "causal-lm", "--epochs", "1", "--batch-size", "4",
            "-o", "out.onnx"]
    assert main(argv) == 0
    n = sum(p.numel() for p in module.parameters())
    lines = capsys.readouterr().out.splitlines()
    assert (f"parameters: {n:,} trainable in 21 tensors ({100 * n / (n + 4):.3g}%), 4 frozen in 1 tensor; left out "
            "by default (--train NAME trains one): buffers: model.rotary_emb.inv_freq") in lines
    assert main([*argv, "--freeze", "lm_head.weight"]) == 0
    m = module.lm_head.weight.numel()
    assert any(line.startswith(f"parameters: {n - m:,} trainable in 20 tensors") and "left out" not in line
               for line in capsys.readouterr().out.splitlines())
    one_line_error(main([*argv, "--train", "nothing*"]), capsys.readouterr().err, "--train", "nothing*")
