"""``offload="optimizer"`` / ``--offload optimizer`` (revgraph.train.offload): the optimizer state and the update in
host memory, the forward and backward on the device.

On the CPU the option is a no-op that warns; the tests force the offloaded path there with the internal switch
``REVGRAPH_OFFLOAD_ON_CPU=1`` (host buffer sets, a separate device mirror of the parameters that the grad graph
reads, gradients copied to host buffers, the update in its own session, new parameters copied back), and check
it against the plain engine trained on the same batches: parameters, the full optimizer state (Adam's m and v,
the step) and the losses bitwise equal, the same nodes running on the same values. The reference is the plain
engine, itself checked against torch in tests/test_train*.py. The CUDA test checks where each buffer lives.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from kit.devices import gpu_test, model_and_data, tolerance
from kit.distributed import ENV, run_command

import revgraph as rg
from revgraph.errors import NonFiniteError
from revgraph.tools import demo
from revgraph.train.offload import FORCE_ENV

F32 = np.float32


@pytest.fixture
def forced(monkeypatch):
    """The offloaded path on the CPU (the module's internal switch)."""
    monkeypatch.setenv(FORCE_ENV, "1")


def _pair(model, optimizer="adam", **how):
    """The plain and the offloaded Trainer of ``model`` (built twice: a Graph is not shared between trainers)."""
    plain = rg.Trainer(model(), "cross-entropy", optimizer, threads=1, **how)
    off = rg.Trainer(model(), "cross-entropy", optimizer, threads=1, offload="optimizer", **how)
    assert plain._engine.offload is None and off._engine.offload is not None
    return plain, off


def _same(plain: rg.Trainer, off: rg.Trainer) -> None:
    assert off.steps == plain.steps > 0
    np.testing.assert_array_equal(off.losses, plain.losses)
    mine, theirs = {**off.parameters, **off.state}, {**plain.parameters, **plain.state}
    assert sorted(mine) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)


def _digits(n=80):
    train, _ = demo.digits()
    return {"x": train["x"][:n], "labels": train["labels"][:n]}


@pytest.mark.parametrize("optimizer", ["adam", "adamw", rg.train.sgd(lr=0.05, momentum=0.9)], ids=str)
def test_offloaded_steps_equal_plain_steps(forced, optimizer):
    """Two epochs of 5 shuffled batches (the last one short): weights, m, v, step and losses bitwise equal; the
    device holds the parameters' mirror and the gradients, the host the rest (held() counts the buffers)."""
    plain, off = _pair(lambda: demo.mlp_model(hidden=13), optimizer)
    for tr in (plain, off):
        tr.fit(_digits(), 2, 17, seed=4, progress=False)
    _same(plain, off)
    held, ref = off._engine.held(), plain._engine.held()
    params = sum(a.nbytes for a in plain.parameters.values())
    assert held["state"] == params and held["gradients"] == ref["gradients"] == params
    assert held["host_state"] == ref["state"] > 2 * params and held["host_gradients"] == params
    np.testing.assert_array_equal(off.evaluate(_digits(30))["loss"], plain.evaluate(_digits(30))["loss"])


def test_offloaded_lora_accumulation_and_clipping(forced):
    """LoRA adapters (the base frozen), AdamW, 3 micro-batches per step and global-norm clipping that cuts."""
    def lora():
        return rg.lora.add_adapters(demo.mlp_model(hidden=16), rank=2)

    plain, off = _pair(lora, rg.train.adamw(lr=0.02), clip_grad_norm=0.05)
    assert all("lora" in p for p in off.spec.params)
    for tr in (plain, off):
        tr.fit(_digits(), 2, 8, seed=1, progress=False, accumulate_steps=3)
    _same(plain, off)
    assert off._engine.grad_norm == plain._engine.grad_norm > 0.05  # (the clip acted)


def test_offloaded_copies_through_torch(forced):
    """The gradients' copy of a CUDA run (a torch view of the device buffer through DLPack, copied into the host
    array in one call), here between CPU buffers: the same numbers."""
    import torch

    plain, off = _pair(lambda: demo.mlp_model(hidden=9))
    off._engine.offload.torch = torch
    for tr in (plain, off):
        tr.fit(_digits(), 1, 16, seed=6, progress=False)
    _same(plain, off)


def test_offloaded_sparse_embedding_rows(forced):
    """An embedding table read by Gather: its gradient is rows (the update's sparse inputs, copied to the host)."""
    _, data = model_and_data("embedding", 60)
    plain, off = _pair(lambda: model_and_data("embedding")[0])
    assert off.spec.sparse
    for tr in (plain, off):
        tr.fit(data, 2, 16, seed=2, progress=False)
    _same(plain, off)


def test_offloaded_undo_and_resume(forced, tmp_path):
    """A last update that overflows is undone (keep_previous: the host sets return, the mirror with them); a
    snapshot of an offloaded run resumes (load writes the host values and the mirror) and ends where an
    uninterrupted plain run ends."""
    for tr in _pair(lambda: demo.mlp_model(hidden=8), rg.train.sgd(lr=1e38)):
        before = tr.parameters
        with pytest.raises(NonFiniteError):
            tr.fit({"x": _digits(16)["x"] * F32(1e6), "labels": _digits(16)["labels"]}, 1, 16, progress=False)
        for name, value in before.items():
            np.testing.assert_array_equal(tr.parameters[name], value, err_msg=name)
        assert tr.steps == 0
    plain, off = _pair(lambda: demo.mlp_model(hidden=8))
    off.fit(_digits(), 1, 16, seed=5, progress=False, snapshot_dir=tmp_path / "snap", snapshot_every=2)
    resumed = rg.Trainer(demo.mlp_model(hidden=8), "cross-entropy", "adam", threads=1, offload="optimizer")
    resumed.fit(_digits(), 3, 16, seed=5, progress=False, snapshot_dir=tmp_path / "snap")
    assert resumed.resumed
    plain.fit(_digits(), 3, 16, seed=5, progress=False)
    for name, value in {**plain.parameters, **plain.state}.items():
        np.testing.assert_array_equal({**resumed.parameters, **resumed.state}[name], value, err_msg=name)
    np.testing.assert_array_equal(resumed.evaluate(_digits(30))["loss"], plain.evaluate(_digits(30))["loss"])


def test_offload_on_cpu_is_a_no_op_that_says_so(monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    with pytest.warns(UserWarning, match="does nothing on --device cpu"):
        tr = rg.Trainer(demo.mlp_model(hidden=4), offload="optimizer")
    assert tr._engine.offload is None


@pytest.mark.parametrize("how,words", [({"buffers": "two"}, "needs --buffers one"),
                                       ({"offload": "params"}, "offload")])
def test_offload_refusals_are_one_line(how, words):
    with pytest.raises(rg.RevgraphError, match=words) as e:
        rg.Trainer(demo.mlp_model(hidden=4), **{"offload": "optimizer", **how})
    assert "\n" not in str(e.value)


def _cli(tmp_path, *args: str, env=ENV, nproc=None) -> subprocess.CompletedProcess:
    if not (tmp_path / "m.onnx").exists():
        np.savez(tmp_path / "d.npz", x=_digits(90)["x"], y=_digits(90)["labels"])
        rg.save(demo.mlp_model(hidden=11), tmp_path / "m.onnx")
    cmd = [sys.executable, "-m", "revgraph", "train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"),
           "--loss", "cross-entropy", "--threads", "1", "--epochs", "2", *args]
    if nproc:
        return run_command([*cmd, "--nproc", str(nproc)], env=env)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("args,words", [
    (("--buffers", "two"), "--offload optimizer (offload='optimizer') needs --buffers one"),
    (("--nproc", "2", "--shard", "parameters"), "does not combine with --shard parameters"),
    (("--nproc", "2", "--sync-batchnorm"), "does not combine with --sync-batchnorm")])
def test_cli_refuses_what_does_not_compose_in_one_line(tmp_path, args, words):
    """Refused before any worker starts: exit 2, one line, no model written."""
    r = _cli(tmp_path, "--offload", "optimizer", "-o", str(tmp_path / "o.onnx"), *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert words in r.stderr and not (tmp_path / "o.onnx").exists()


def test_cli_on_cpu_warns_in_one_line(tmp_path):
    r = _cli(tmp_path, "--offload", "optimizer", "-o", str(tmp_path / "o.onnx"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        ("warning: --offload optimizer (offload='optimizer') does nothing on --device cpu: the optimizer state and "
         "update are in host memory already")]


def test_cli_data_parallel_offloaded_equals_plain(tmp_path):
    """`--nproc 2` with the offloaded path forced on the CPU writes the weights of `--nproc 2` without it: AdamW,
    2 micro-batches per step, clipping (gloo sums the same buckets in the same order)."""
    common = ("--batch-size", "8", "--accumulate-steps", "2", "--optimizer", "adamw", "--lr", "0.01",
              "--clip-grad-norm", "0.5", "--quiet")
    _cli(tmp_path, *common, "-o", str(tmp_path / "plain.onnx"), nproc=2)
    r = _cli(tmp_path, *common, "--offload", "optimizer", "-o", str(tmp_path / "off.onnx"), nproc=2,
             env={**ENV, FORCE_ENV: "1"})
    assert "does nothing" not in r.stderr, r.stderr  # (the workers saw the switch: the offloaded engine ran)
    plain, off = rg.load(tmp_path / "plain.onnx").initializers, rg.load(tmp_path / "off.onnx").initializers
    assert sorted(plain) == sorted(off)
    for name, value in plain.items():
        np.testing.assert_array_equal(off[name], value, err_msg=name)


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_offloaded_sharded_engine_equals_sharded(forced, world_of_one, mode, model):
    """ZeRO-1/2 with the optimizer offloaded (revgraph.train.offload_sharded), the engines themselves in a world of
    one (shard = everything; 2 units of 1 KiB buckets, clipping that cuts; the embedding's table replicated and
    updated by rows): steps, the gathered state, an undone keep_previous step and a load equal ShardedEngine's
    bitwise, and the device holds no optimizer state (world_of_one: tests/conftest.py)."""
    from distributed_worker import trainer

    from revgraph.runtime.devices import Device
    from revgraph.train.distributed.sharding import ShardedEngine
    from revgraph.train.offload import HostUpdate
    from revgraph.train.offload_sharded import OffloadedShardedEngine

    tr, data = trainer(model, "adam", 48, False, 13, clip_grad_norm=0.3)
    spec, how = tr.spec, {"mode": mode, "bucket_bytes": 1024}
    feeds = {n: data[n if n in data else "labels"][:16] for n in [*spec.inputs, spec.labels]}
    ref = ShardedEngine(spec, 1, Device(), world_of_one, **how)
    eng = OffloadedShardedEngine(spec, 1, Device(), world_of_one, offload=HostUpdate(Device()), **how)
    assert len(eng.units) >= (2 if model == "mlp" else 1) and eng._pairs
    for _ in range(3):
        assert eng.step(feeds, 16, 16) == ref.step(feeds, 16, 16)
    assert ref._clip_squares is not None and float(ref._clip_squares) > 0.3 ** 2  # (the clip acted)
    mine = eng.read(eng.names)
    for name, value in ref.read(ref.names).items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)
    for e in (eng, ref):
        e.step(feeds, 16, 16, keep_previous=True)
        e.undo()
        e.step(feeds, 16, 16)
    for e in (eng, ref):
        e.load(mine)
        e.step(feeds, 16, 16)
    mine = eng.read(eng.names)
    for name, value in ref.read(ref.names).items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)
    held, theirs = eng.held(), ref.held()
    assert held["optimizer"] == 0 and theirs["optimizer"] > 0 and held["gradients"] == theirs["gradients"]
    # the device: the parameters alone (no state, no step, no scratch); the host: the state, the step and scratch,
    # the master copies of the parameter shards and the copies of the gradient shards
    assert held["state"] == held["parameters"] == theirs["parameters"]
    assert held["host_state"] == theirs["state"] - theirs["parameters"] + sum(h.numel() * h.element_size()
                                                                              for _, h, _ in eng._pairs)


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_cli_sharded_offloaded_equals_sharded(tmp_path, shard):
    """`--nproc 2 --shard optimizer|gradients --offload optimizer` (forced on the CPU) writes the weights of the
    same run without --offload (Adam, clipping, 2 units)."""
    common = ("--batch-size", "8", "--clip-grad-norm", "0.5", "--bucket-mb", "0.001", "--shard", shard, "--quiet")
    _cli(tmp_path, *common, "-o", str(tmp_path / "plain.onnx"), nproc=2)
    r = _cli(tmp_path, *common, "--offload", "optimizer", "-o", str(tmp_path / "off.onnx"), nproc=2,
             env={**ENV, FORCE_ENV: "1"})
    assert "does nothing" not in r.stderr, r.stderr
    plain, off = rg.load(tmp_path / "plain.onnx").initializers, rg.load(tmp_path / "off.onnx").initializers
    for name, value in plain.items():
        np.testing.assert_array_equal(off[name], value, err_msg=name)


@gpu_test(torch_gpus=1)
@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
def test_cuda_offloaded_sharded_engine(cuda_world_of_one, mode):
    """ZeRO-1/2 offloaded on cuda:0 (NCCL, a world of one): the state shards, the step and the update's copies
    are host (pinned) tensors, the units on the GPU; the steps and the gathered state match ShardedEngine's on the
    GPU (the update on the CPU rounds as the CPU does)."""
    from distributed_worker import trainer

    from revgraph.runtime.devices import Device
    from revgraph.train.distributed.sharding import ShardedEngine
    from revgraph.train.offload import HostUpdate
    from revgraph.train.offload_sharded import OffloadedShardedEngine

    tr, data = trainer("mlp", "adam", 48, False, 13, clip_grad_norm=0.3)
    spec, how, cuda = tr.spec, {"mode": mode, "bucket_bytes": 1024}, Device("cuda")
    feeds = {spec.inputs[0]: data["x"][:16], spec.labels: data["labels"][:16]}
    ref = ShardedEngine(spec, 1, cuda, cuda_world_of_one, **how)
    eng = OffloadedShardedEngine(spec, 1, cuda, cuda_world_of_one, offload=HostUpdate(cuda), **how)
    assert all(t.device.type == "cpu" and t.is_pinned() for u in eng.units for t in u.state)
    assert all(h.device.type == "cpu" and t.device.type == "cuda" for t, h, _ in eng._pairs)
    assert all(u.param.device.type == "cuda" for u in eng.units) and eng.held()["optimizer"] == 0
    for _ in range(3):
        np.testing.assert_allclose(eng.step(feeds, 16, 16), ref.step(feeds, 16, 16), rtol=1e-4)
    mine = eng.read(eng.names)
    for name, value in ref.read(ref.names).items():
        np.testing.assert_allclose(mine[name], value, err_msg=name, **tolerance("adam"))


@gpu_test
def test_cuda_offload_keeps_no_optimizer_state_on_the_device():
    """On cuda:0 the optimizer state, the step and the update's gradients are host (CPU) buffers, the device
    holds the parameters' mirror and the gradients only; torch sees no allocation of the state either, and the
    weights after 3 Adam steps match the plain CUDA run's (the update on the CPU rounds as the CPU does)."""
    import torch

    batch = _digits(64)
    plain = rg.Trainer(demo.mlp_model(hidden=256), "cross-entropy", "adam", device="cuda")
    cuda_torch = torch.cuda.is_available()  # (a CPU build of torch: no pinned memory, plain host arrays)
    before = torch.cuda.memory_allocated(0) if cuda_torch else 0
    off = rg.Trainer(demo.mlp_model(hidden=256), "cross-entropy", "adam", device="cuda", offload="optimizer")
    engine = off._engine
    assert engine.offload is not None and engine.offload.home.pinned == cuda_torch
    for tr in (plain, off):
        for _ in range(3):
            tr.step(batch)
    if cuda_torch:  # the copies through torch (DLPack views, pinned host memory) allocate nothing on the GPU
        assert torch.cuda.memory_allocated(0) == before
    for name, value in engine._sets[engine._current].items():  # parameters, m, v, step: host memory
        assert value.device_name().lower() == "cpu", name
    assert all(v.device_name().lower() == "cuda" for v in engine.offload.mirror.values())
    assert all(v.device_name().lower() == "cuda" for v in engine._grad_values.values())
    assert all(v.device_name().lower() == "cpu" for v in engine._update_grads.values())
    params = sum(a.nbytes for a in off.parameters.values())
    held = engine.held()
    assert held["state"] == held["gradients"] == params and held["host_state"] > 3 * params
    for name, value in plain.parameters.items():
        np.testing.assert_allclose(off.parameters[name], value, err_msg=name, **tolerance("adam"))
