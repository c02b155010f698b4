"""Frozen weights are held once by a training engine on the CPU (revgraph.runtime.shared_initializers): every session
reads the graph's own array as a bound input, where onnxruntime used to copy, fold and prepack each initializer
into each session (a LoRA MLP with 96 MiB of frozen weights: 765 MB added by building the Trainer).

- Training is unchanged: with ``frozen_weights="shared"`` (the default) and ``"constants"`` (the old way) the losses
  and trained parameters agree, for a LoRA MLP, an MLP with a frozen layer and an RNN whose frozen weights a
  ``Loop`` body reads from the outer scope; each in both buffer layouts (the grad graph, the fused step graph) and
  evaluation.
- The sessions read the graph's array in place (its data pointer), and two sessions share one ``OrtValue``.
- Which initializers are shared: large float ones; not those onnxruntime wants constant (quantized weights and
  their scales, convolution weights), small ones, integer ones, non-contiguous ones, graph outputs.
- Memory, in fresh processes: building a LoRA Trainer adds less than a quarter of a byte per byte of frozen weights
  (shared), against more than three with ``"constants"``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.runtime.shared_initializers import SHARE_BYTES, FrozenInputs, SharedInitializers
from revgraph.tools import demo
from revgraph.train.lora import add_adapters

D = 96


def _lora_mlp(d: int = D, layers: int = 3, seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], {}, "x"
    for i in range(layers):
        inits[f"W{i}"] = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
        nodes += [Node("MatMul", [x, f"W{i}"], [f"h{i}"], name=f"mm{i}"),
                  Node("Relu", [f"h{i}"], [f"a{i}"], name=f"relu{i}")]
        x = f"a{i}"
    inits["Wo"] = (rng.standard_normal((d, 10)) * 0.1).astype(np.float32)
    nodes.append(Node("MatMul", [x, "Wo"], ["logits"], name="head"))
    g = Graph(nodes, [ValueInfo("x", np.float32, ["N", d])], [ValueInfo("logits", np.float32, ["N", 10])], inits)
    return add_adapters(g, 4, targets=[f"W{i}" for i in range(layers)])


def _data(shape: tuple, n: int = 48, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, *shape)).astype(np.float32),
            "labels": rng.integers(0, 10, n).astype(np.int64)}


CASES = {  # model, its data's sample shape, the trainable parameters (None: the LoRA adapters)
    "lora-mlp": (_lora_mlp, (D,), None),
    "mlp-frozen-layer": (lambda: demo.mlp_model(hidden=64), (8, 8), ["W2", "b2"]),
    "rnn-frozen-in-loop": (lambda: demo.rnn_model(hidden=32), (8, 8), ["V", "c"]),
}


def _train(case: str, frozen: str, buffers: str):
    make, shape, params = CASES[case]
    tr = rg.Trainer(make(), "cross-entropy", "adamw", threads=1, params=params, buffers=buffers,
                    runtime=rg.RuntimeOptions(frozen_weights=frozen))
    data = _data(shape)
    losses = tr.fit(data, 2, 16, progress=False, seed=0)
    ev = tr.evaluate(data)
    return tr, losses, [ev["loss"], ev["accuracy"]], tr.parameters


@pytest.mark.parametrize("buffers", ["one", "two"])
@pytest.mark.parametrize("case", list(CASES))
def test_training_with_shared_frozen_weights_equals_constants(case, buffers):
    shared, losses, ev, params = _train(case, "shared", buffers)
    _, ref_losses, ref_ev, ref_params = _train(case, "constants", buffers)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    np.testing.assert_allclose(ev, ref_ev, rtol=1e-6)
    assert params.keys() == ref_params.keys()
    for name in params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-7, err_msg=name)
    eng = shared._engine
    sessions = [eng._eval, getattr(eng, "_grad", None) or eng._sess]
    assert all(isinstance(s, FrozenInputs) for s in sessions)  # (both read the frozen weights as bound inputs)


def test_sessions_read_the_graph_array_in_place_one_ortvalue_for_both():
    tr = rg.Trainer(_lora_mlp(), "cross-entropy", "adamw", threads=1)
    eng = tr._engine
    grad, ev = eng._grad, eng._eval
    values = eng._initializers._values
    arrays = {name: arr for (name, _), (arr, _) in values.items()}
    assert {"W0", "W1", "W2", "Wo"} <= set(arrays)
    for name in ("W0", "W1", "W2", "Wo"):
        assert grad._values[name] is ev._values[name]  # one OrtValue for the two sessions
        assert grad._values[name].data_ptr() == arrays[name].ctypes.data  # over the graph's own array
    assert arrays["W0"] is tr.spec.model.initializers["W0"]


def _graph_with(kinds: dict[str, tuple[str, np.ndarray]]) -> Graph:
    """One node per initializer: ``name -> (op reading it, array)``."""
    nodes = []
    for name, (op, _) in kinds.items():
        if op == "DequantizeLinear":
            nodes.append(Node(op, ["q", name], [f"o_{name}"]))
        elif op == "Conv":
            nodes.append(Node(op, ["img", name], [f"o_{name}"]))
        elif op == "output":
            continue
        else:
            nodes.append(Node(op, ["x", name], [f"o_{name}"]))
    outs = [ValueInfo(n.outputs[0], np.float32, None) for n in nodes] + [
        ValueInfo(name, np.float32, None) for name, (op, _) in kinds.items() if op == "output"]
    return Graph(nodes, [ValueInfo("x", np.float32, [32, 32])], outs, {n: a for n, (_, a) in kinds.items()})


def test_which_initializers_are_shared():
    big = np.ones((32, 32), np.float32)
    g = _graph_with({
        "matmul": ("MatMul", big),
        "half": ("MatMul", np.ones((32, 32), np.float16)),
        "scale": ("DequantizeLinear", np.ones(SHARE_BYTES, np.float32)),  # (quantization wants it constant)
        "conv": ("Conv", np.ones((8, 8, 3, 3), np.float32)),  # (the NCHWc layout wants it constant)
        "small": ("Add", np.ones(SHARE_BYTES // 4 - 1, np.float32)),
        "ints": ("Add", np.ones(1024, np.int64)),
        "strided": ("Add", np.ones((64, 32), np.float32)[::2]),
        "output": ("output", big.copy()),
    })
    shared = SharedInitializers()
    written, values = shared.split(g)
    assert sorted(values) == ["half", "matmul"]
    assert set(written.initializers) == {"scale", "conv", "small", "ints", "strided", "output"}
    assert [v.name for v in written.inputs] == ["x", "matmul", "half"]
    assert list(written.type_of("matmul").shape) == [32, 32] and "matmul" in g.initializers  # (g is not changed)
    _, values2 = shared.split(g)
    assert values2["matmul"] is values["matmul"]  # the same array: the same OrtValue
    other = _graph_with({"matmul": ("MatMul", big.copy())})
    assert shared.split(other)[1]["matmul"] is not values["matmul"]  # another array of the name: its own
    none = _graph_with({"small": ("Add", np.ones(4, np.float32))})
    assert shared.split(none) == (none, {})  # (nothing shared: the graph itself)


_MEMORY = """
import json, sys, numpy as np
sys.path.insert(0, {tests!r})
from test_shared_initializers import _lora_mlp
import revgraph as rg, onnxruntime
g = _lora_mlp(2048, {layers})
frozen = sum(g.initializers[f"W{{i}}"].nbytes for i in range({layers}))
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
before = rss()
tr = rg.Trainer(g, "cross-entropy", "adamw", threads=1, runtime=rg.RuntimeOptions(frozen_weights={frozen!r}))
tr.evaluate({{"x": np.zeros((2, 2048), np.float32), "labels": np.zeros(2, np.int64)}})
print(json.dumps({{"added": rss() - before, "frozen": frozen}}))
"""


@pytest.mark.parametrize("frozen", ["shared", "constants"])
def test_building_a_lora_trainer_holds_the_frozen_weights_once(frozen):
    """Fresh processes: the resident set a LoRA Trainer (and its evaluation session) adds, over 2 and over 4 frozen
    2048 x 2048 weights (32 and 64 MiB) that the graph already holds; per byte of frozen weights (the difference:
    the trainer's fixed costs cancel)."""
    from pathlib import Path

    def added(layers: int) -> dict:
        code = _MEMORY.format(tests=str(Path(__file__).parent), frozen=frozen, layers=layers)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    two, four = added(2), added(4)
    per_byte = (four["added"] - two["added"]) / (four["frozen"] - two["frozen"])
    if frozen == "shared":
        assert per_byte < 0.25, (two, four)
    else:  # (the measurement sees the copies: onnxruntime's, in each of the two sessions)
        assert per_byte > 3, (two, four)


def test_cli_frozen_weights_shared_and_constants_write_the_same_model(tmp_path):
    """``revgraph train --lora 2`` (the base frozen) with ``--frozen-weights shared`` (the default) and
    ``constants`` writes the same trained adapters; a value outside the choices exits 2 with one line."""
    rg.save(demo.mlp_model(hidden=64), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **_data((8, 8), 40))
    common = ["train", "m.onnx", "--data", "d.npz", "--loss", "cross-entropy", "--optimizer", "adamw", "--epochs",
              "2", "--batch-size", "8", "--threads", "1", "--lora", "2"]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "revgraph", *common, *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, check=False)

    for name, extra in (("shared", []), ("constants", ["--frozen-weights", "constants"])):
        r = cli(*extra, "-o", f"{name}.onnx")
        assert r.returncode == 0, r.stderr
    a, b = rg.load(tmp_path / "shared.onnx"), rg.load(tmp_path / "constants.onnx")
    adapters = [n for n in a.initializers if "lora" in n]
    assert adapters and a.initializers.keys() == b.initializers.keys()
    for name in a.initializers:
        np.testing.assert_allclose(a.initializers[name], b.initializers[name], rtol=1e-5, atol=1e-7, err_msg=name)
    b_factors = [n for n in adapters if "lora_B" in n]
    assert b_factors and all(np.abs(a.initializers[n]).max() > 0 for n in b_factors)  # (trained from B = 0)
    r = cli("--frozen-weights", "copies", "-o", "x.onnx")
    assert r.returncode == 2 and "--frozen-weights" in r.stderr and "Traceback" not in r.stderr
