"""``--device cpu|cuda[:i]`` (revgraph.runtime.devices): parsing, one-line errors, the CPU path, and the CUDA path.

The tests without a mark run everywhere, on the CPU; where onnxruntime has no CUDA provider (onnxruntime
rather than onnxruntime-gpu) they check that ``--device cuda`` fails in one line. The tests marked ``cuda``
need a GPU that onnxruntime-gpu can start, and (for training on the device and NCCL) a CUDA build of torch;
each one states in its skip message what is missing. ``bench/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

try:  # before onnxruntime: a CUDA torch loads the CUDA and cuDNN libraries that onnxruntime-gpu needs
    import torch
except ImportError:
    torch = None

import numpy as np
import onnxruntime as ort
import pytest
from kit.devices import ENV, F32, embedding_model, gpu_test, model_and_data, on_gpu, tolerance, train_cli
from kit.harness import one_line_error

import revgraph as rg
from revgraph.cli import main
from revgraph.runtime.devices import CUDA_HINT, Device, ortvalue_from_dlpack, torch_from_ortvalue
from revgraph.tools import demo
from revgraph.train import make_optimizer


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps at 80 columns when not on a terminal


@pytest.fixture
def no_cuda_provider(monkeypatch):
    """onnxruntime as the CPU package is: no CUDAExecutionProvider (also on a GPU machine)."""
    real = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: [p for p in real if p != "CUDAExecutionProvider"])


# ------------------------------------------------------------------------------------------ Device


@pytest.mark.parametrize("spec,kind,index", [("cpu", "cpu", 0), ("cuda", "cuda", 0), ("cuda:0", "cuda", 0),
                                             ("cuda:3", "cuda", 3), (" cuda:1 ", "cuda", 1), (None, "cpu", 0)])
def test_parse_good_specs(spec, kind, index):
    d = Device.parse(spec)
    assert (d.kind, d.index) == (kind, index)
    assert Device.parse(d) is d
    assert Device.parse(str(d)) == d
    assert d.torch() == ("cpu" if kind == "cpu" else f"cuda:{index}")


@pytest.mark.parametrize("spec", ["gpu", "cpu:1", "cpu:0", "cuda:", "cuda:-1", "cuda:x", "CUDA", "cuda:0:1", ""])
def test_parse_bad_specs_is_one_line_error(spec):
    with pytest.raises(rg.RevgraphError) as e:
        Device.parse(spec)
    assert "\n" not in str(e.value) and "use cpu, cuda or cuda:<index>" in str(e.value)


def test_bare_cuda_takes_the_local_rank():
    """Under torchrun each process on a machine gets its own GPU: cuda means cuda:<LOCAL_RANK>; an explicit
    index and the CPU stay as they are."""
    assert Device.parse("cuda", local_rank=1) == Device("cuda", 1)
    assert Device.parse("cuda:2", local_rank=1) == Device("cuda", 2)
    assert Device.parse("cpu", local_rank=1) == Device("cpu", 0)


def test_cpu_providers_and_no_op_synchronize():
    assert Device().providers() == ["CPUExecutionProvider"]
    Device().synchronize(None)  # nothing to wait for on the CPU (and torch is not needed)


def test_missing_cuda_provider_is_one_line_error(no_cuda_provider):
    with pytest.raises(rg.RevgraphError) as e:
        Device.parse("cuda:1").providers()
    text = str(e.value)
    assert "\n" not in text and "cuda:1" in text and "onnxruntime-gpu" in text and CUDA_HINT in text


def test_cuda_providers_pick_the_device_and_float32(monkeypatch):
    real = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    (name, options), cpu = Device.parse("cuda:2").providers()
    assert (name, cpu, options["device_id"]) == ("CUDAExecutionProvider", "CPUExecutionProvider", 2)
    assert options.get("use_tf32", 0) == 0  # no TF32: CUDA matmuls agree with the CPU's to float32 precision


def test_check_session_refuses_a_session_that_fell_back_to_the_cpu():
    class FellBack:
        def get_providers(self):
            return ["CPUExecutionProvider"]

    Device().check_session(FellBack())
    with pytest.raises(rg.RevgraphError, match="could not start its CUDA provider on cuda:0"):
        Device("cuda").check_session(FellBack())


def test_ortvalue_copies_the_array():
    a = np.arange(6, dtype=F32).reshape(2, 3)
    v = Device().ortvalue(a)
    v.update_inplace(np.zeros((2, 3), F32))
    np.testing.assert_array_equal(a, np.arange(6, dtype=F32).reshape(2, 3))
    assert v.device_name() == "cpu" and v.shape() == [2, 3]


def test_dlpack_helpers_share_memory_on_the_cpu():
    import torch as th
    t = th.arange(6, dtype=th.float32).reshape(2, 3)
    v = ortvalue_from_dlpack(t)
    assert v.shape() == [2, 3]
    t.add_(1)  # the OrtValue sees torch's writes ...
    np.testing.assert_array_equal(v.numpy(), np.arange(1, 7, dtype=F32).reshape(2, 3))
    back = torch_from_ortvalue(th, v)
    back.mul_(2)  # ... and torch sees the same buffer through the OrtValue
    np.testing.assert_array_equal(t.numpy(), 2 * np.arange(1, 7, dtype=F32).reshape(2, 3))


# ------------------------------------------------------------------------------------------ Session, CPU


def test_session_on_cpu_equals_the_default():
    g = demo.mlp_model(hidden=16)
    x = {"x": np.random.default_rng(0).random((5, 8, 8), dtype=F32)}
    want = rg.Session(g).run(x)["logits"]
    for device in ("cpu", Device("cpu")):
        s = rg.Session(g, device=device)
        assert s.device == Device("cpu")
        np.testing.assert_array_equal(s.run(x)["logits"], want)
    np.testing.assert_allclose(rg.Session(g, backend="reference", device="cpu").run(x)["logits"], want, rtol=1e-5,
                               atol=1e-6)


def test_session_bad_device_or_reference_on_cuda_is_one_line_error():
    g = demo.mlp_model(hidden=16)
    with pytest.raises(rg.RevgraphError, match="unknown device 'gpu'"):
        rg.Session(g, device="gpu")
    with pytest.raises(rg.RevgraphError, match="reference backend runs on the CPU only"):
        rg.Session(g, backend="reference", device="cuda")


def test_session_cuda_without_cuda_provider_is_one_line_error(no_cuda_provider):
    with pytest.raises(rg.RevgraphError) as e:
        rg.Session(demo.mlp_model(hidden=16), device="cuda")
    assert "\n" not in str(e.value) and "onnxruntime-gpu" in str(e.value)


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="simulates onnxruntime-gpu without a usable GPU, which needs the CPU-only onnxruntime")
def test_session_that_loses_the_cuda_provider_is_one_line_error(monkeypatch):
    """onnxruntime-gpu lists CUDAExecutionProvider even where it cannot start it, and then runs on the CPU;
    here the CPU package is told to use a provider it lacks, which it drops the same way."""
    real = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    with warnings.catch_warnings(), pytest.raises(rg.RevgraphError, match="could not start its CUDA provider"):
        warnings.simplefilter("ignore")
        rg.Session(demo.mlp_model(hidden=16), device="cuda")


# ------------------------------------------------------------------------------------------ CLI, CPU


@pytest.fixture
def files(tmp_path):
    g, data = model_and_data("mlp", 40)
    rg.save(g, tmp_path / "model.onnx")
    np.savez(tmp_path / "data.npz", **data)
    np.savez(tmp_path / "inputs.npz", x=data["x"][:3])
    return tmp_path


def test_run_device_cpu_equals_the_default(files, capsys):
    model, inputs = str(files / "model.onnx"), str(files / "inputs.npz")
    assert main(["run", model, "--inputs", inputs, "-o", str(files / "a.npz")]) == 0
    assert main(["run", model, "--inputs", inputs, "--device", "cpu", "-o", str(files / "b.npz")]) == 0
    a, b = np.load(files / "a.npz"), np.load(files / "b.npz")
    np.testing.assert_array_equal(a["logits"], b["logits"])


@pytest.mark.parametrize("device,fragment", [("gpu", "unknown device 'gpu'"), ("cpu:1", "unknown device 'cpu:1'"),
                                             ("cuda:x", "unknown device 'cuda:x'")])
@pytest.mark.parametrize("command", ["run", "train"])
def test_bad_device_exits_2_with_one_line(files, capsys, command, device, fragment):
    args = [command, str(files / "model.onnx"), "--device", device]
    if command == "train":
        args += ["--data", str(files / "data.npz"), "--loss", "cross-entropy", "--epochs", "1",
                 "-o", str(files / "out.onnx")]
    code = main(args)
    one_line_error(code, capsys.readouterr().err, fragment)


@pytest.mark.parametrize("command", ["run", "train"])
def test_cuda_without_onnxruntime_gpu_exits_2_with_one_line(files, capsys, no_cuda_provider, command):
    """Also before anything else is printed (run's note on random inputs) or trained."""
    args = [command, str(files / "model.onnx"), "--device", "cuda"]
    if command == "train":
        args += ["--data", str(files / "data.npz"), "--loss", "cross-entropy", "--epochs", "1",
                 "-o", str(files / "out.onnx")]
    code = main(args)
    one_line_error(code, capsys.readouterr().err, "--device cuda:0 needs onnxruntime's CUDAExecutionProvider",
                   "onnxruntime-gpu")
    assert not (files / "out.onnx").exists()


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="checks the real absence of the CUDA provider; this onnxruntime has it")
def test_cuda_here_exits_2_in_a_fresh_process(files):
    """The installed command, without monkeypatching: this onnxruntime has no CUDA provider."""
    r = subprocess.run([sys.executable, "-m", "revgraph", "run", str(files / "model.onnx"), "--device", "cuda"],
                       capture_output=True, text=True, env={**ENV, "COLUMNS": "250"}, timeout=120)
    one_line_error(r.returncode, r.stderr, "onnxruntime-gpu")


def test_trainer_cuda_without_provider_fails_before_building(no_cuda_provider):
    with pytest.raises(rg.RevgraphError, match="onnxruntime-gpu"):
        rg.Trainer(demo.mlp_model(hidden=16), device="cuda")


# ------------------------------------------------------------------------------------------ CUDA (GPU only)


@gpu_test
@pytest.mark.parametrize("name", ["mlp", "rnn", "embedding"])
def test_session_on_cuda_equals_cpu(name):
    g = {"mlp": demo.mlp_model(hidden=64), "rnn": demo.rnn_model(hidden=32), "embedding": embedding_model()}[name]
    feeds = {"x": model_and_data(name, 16)[1]["x"]}
    s = rg.Session(g, device="cuda")
    assert s._sess.get_providers()[0] == "CUDAExecutionProvider"
    np.testing.assert_allclose(s.run(feeds)["logits"], rg.Session(g).run(feeds)["logits"], rtol=1e-4, atol=1e-5)


@gpu_test
@pytest.mark.parametrize("name,optimizer", [("mlp", "adam"), ("mlp", "sgd"), ("embedding", "adam")])
def test_trainer_on_cuda_matches_cpu(name, optimizer):
    """The demo MLP on digits (and an embedding table, updated row by row) trained a few steps on the GPU: the
    parameters, optimizer state, losses and evaluation of a CPU Trainer."""
    g, data = model_and_data(name, 200)
    opt = make_optimizer(optimizer, lr=0.01, momentum=0.9 if optimizer == "sgd" else None)
    gpu, cpu = (rg.Trainer(g, "cross-entropy", opt, device=d) for d in ("cuda", "cpu"))
    for t in (gpu, cpu):
        t.fit(data, epochs=2, batch_size=64, seed=1, progress=False)
    assert gpu.steps == cpu.steps == 8
    tol = tolerance(optimizer)
    for name_, value in cpu.parameters.items():
        np.testing.assert_allclose(gpu.parameters[name_], value, err_msg=name_, **tol)
    for name_, value in cpu.state.items():
        np.testing.assert_allclose(gpu.state[name_], value, err_msg=name_, **tol)
    np.testing.assert_allclose(gpu.losses, cpu.losses, rtol=1e-4)
    ev_gpu, ev_cpu = gpu.evaluate(data), cpu.evaluate(data)
    assert ev_gpu["accuracy"] == pytest.approx(ev_cpu["accuracy"], abs=0.01)
    assert ev_gpu["loss"] == pytest.approx(ev_cpu["loss"], rel=1e-4)


@gpu_test
def test_trainer_on_cuda_resumes_from_a_checkpoint(tmp_path):
    """Loading a checkpoint writes the device buffers in place (OrtValue.update_inplace on CUDA memory)."""
    g, data = model_and_data("mlp", 200)
    whole = rg.Trainer(g, device="cuda")
    whole.fit(data, epochs=2, batch_size=64, progress=False)
    first = rg.Trainer(g, device="cuda")
    first.fit(data, epochs=1, batch_size=64, progress=False, checkpoint_dir=tmp_path)
    again = rg.Trainer(g, device="cuda")
    again.fit(data, epochs=2, batch_size=64, progress=False, checkpoint_dir=tmp_path)
    assert again.steps == whole.steps == 8
    for name, value in whole.parameters.items():
        np.testing.assert_allclose(again.parameters[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("name", ["mlp", "embedding"])
@pytest.mark.parametrize("nproc", [pytest.param(n, marks=on_gpu(torch_gpus=n), id=f"nproc{n}") for n in (1, 2)])
def test_nccl_training_matches_one_process(tmp_path, name, nproc):
    """``revgraph train --device cuda --nproc N --batch-size 16/N`` (torchrun, NCCL, gradients in device
    buckets shared with onnxruntime through DLPack, sparse rows all-gathered on the device) against one process
    on the GPU with --batch-size 16. With one GPU only N = 1 runs (the whole data-parallel path, a world of one)."""
    assert torch.distributed.is_nccl_available(), "a CUDA torch without NCCL"
    ref = train_cli(tmp_path, name, "single.onnx", "--device", "cuda", "--batch-size", "16")
    got = train_cli(tmp_path, name, "ddp.onnx", "--device", "cuda", "--nproc", str(nproc),
                    "--batch-size", str(16 // nproc))
    for key, value in ref.items():
        np.testing.assert_allclose(got[key], value, err_msg=key, **tolerance("adam"))
