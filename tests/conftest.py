"""Shared fixtures and helpers: the ONNX backend test data, reading its .pb files, comparing outputs."""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

#: The models shipped with the onnx wheel (onnx/backend/test/data).
DATA_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data"
MODEL_GROUPS = ("light", "pytorch-converted", "pytorch-operator", "simple")
RTOL = 1e-5


def shipped_models() -> list[str]:
    """Every shipped model as a path relative to DATA_DIR: ``<group>/<test>/model.onnx`` or ``light/<name>.onnx``."""
    found = []
    for group in MODEL_GROUPS:
        found += [str(p.relative_to(DATA_DIR)) for p in sorted((DATA_DIR / group).glob("*/model.onnx"))]
        found += [str(p.relative_to(DATA_DIR)) for p in sorted((DATA_DIR / group).glob("*.onnx"))]
    return found


def model_id(rel: str) -> str:
    """Readable test id: the relative path without the ``/model.onnx`` suffix."""
    return rel.removesuffix("/model.onnx")


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller must feed (inputs that are not initializers), in declaration order."""
    init = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in init]


def read_pb(path: Path, type_proto: onnx.TypeProto):
    """A shipped ``input_k.pb`` / ``output_k.pb`` as numpy (a list of arrays for a sequence type)."""
    data = Path(path).read_bytes()
    if type_proto.WhichOneof("value") == "sequence_type":
        seq = onnx.SequenceProto()
        seq.ParseFromString(data)
        return numpy_helper.to_list(seq)
    tensor = onnx.TensorProto()
    tensor.ParseFromString(data)
    return numpy_helper.to_array(tensor)


def _numbered(directory: Path, prefix: str) -> list[Path]:
    return sorted(directory.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[-1]))


def shipped_test_data(rel: str) -> tuple[dict[str, object], list[object]] | None:
    """``(feeds by input name, expected outputs in output order)`` from ``test_data_set_0``, or ``None``."""
    directory = (DATA_DIR / rel).parent / "test_data_set_0"
    if not directory.is_dir():
        return None
    model = onnx.load(str(DATA_DIR / rel))
    ins, outs = _numbered(directory, "input"), _numbered(directory, "output")
    declared = graph_inputs(model)
    assert len(ins) == len(declared), f"{rel}: {len(ins)} input files for {len(declared)} inputs"
    assert len(outs) == len(model.graph.output)
    feeds = {vi.name: read_pb(p, vi.type) for vi, p in zip(declared, ins, strict=True)}
    expected = [read_pb(p, vi.type) for vi, p in zip(model.graph.output, outs, strict=True)]
    return feeds, expected


def assert_proto_ssa(model: onnx.ModelProto) -> None:
    """Every value name of ``model`` is written once: graph inputs, initializers and node outputs are
    distinct, and no subgraph writes a name that its enclosing graphs already define (checked directly on
    the protobuf, independently of revgraph)."""
    stack = [(model.graph, frozenset())]
    while stack:
        graph, outer = stack.pop()
        written = [i.name for i in graph.input] + [
            t.name for t in graph.initializer if t.name not in {i.name for i in graph.input}
        ]
        for node in graph.node:
            for attr in node.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                stack.extend((sub, outer | set(written)) for sub in subs)
            written += [o for o in node.output if o]
        repeated = {n for n, k in Counter(written).items() if k > 1} | (set(written) & outer)
        assert not repeated, f"graph {graph.name!r} writes {sorted(repeated)} more than once"


def assert_same_values(actual, expected, rtol: float = RTOL, what: str = "") -> None:
    """Equal shape and dtype, and values within ``rtol`` relative (NaN equals NaN).

    Elements near zero are compared with an absolute tolerance of ``rtol`` times the largest finite magnitude
    of ``expected`` (a purely elementwise relative test fails on values that cancel to ~1e-8 in a Conv).
    Strings, integers and booleans must be equal. A list (an ONNX sequence) is compared element by element.
    """
    if isinstance(expected, list):
        assert isinstance(actual, list), f"{what}: expected a sequence, got {type(actual).__name__}"
        assert len(actual) == len(expected), f"{what}: sequence length {len(actual)} != {len(expected)}"
        for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_values(a, e, rtol, f"{what}[{k}]")
        return
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if expected.dtype.kind in "OUS":
        assert actual.astype(str).tolist() == expected.astype(str).tolist(), what
        return
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.dtype.kind in "iub":
        np.testing.assert_array_equal(actual, expected, err_msg=what)
        return
    finite = np.abs(expected[np.isfinite(expected)])
    scale = float(finite.max()) if finite.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, equal_nan=True, err_msg=what)


def random_weights(g, seed: int):
    """``g`` (an ``rg.Graph``) with weights of a sensible scale, in place: N(0, 1/fan_in) for kernels and
    matrices, 1 + N(0, 0.1) for per-channel vectors (batch-norm scales and variances stay positive). The light
    models' constant 0.02 weights drive their activations to 1e9-1e31; with these they stay O(1)."""
    rng = np.random.default_rng(seed)
    for name, w in list(g.initializers.items()):
        if w.dtype.kind != "f" or w.size <= 1:
            continue
        if w.ndim >= 2:
            fan_in = int(np.prod(w.shape[1:]))
            g.initializers[name] = (rng.standard_normal(w.shape) / np.sqrt(fan_in)).astype(w.dtype)
        else:
            g.initializers[name] = (1 + 0.1 * rng.standard_normal(w.shape)).astype(w.dtype)
    return g


def random_feeds(inputs, seed: int) -> dict[str, np.ndarray]:
    """Random arrays for ``(name, dtype, shape)`` triples (floats N(0,1), ints in [0, 3))."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, dtype, shape in inputs:
        dtype = np.dtype(dtype)
        if dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.random(shape) < 0.5
        else:
            feeds[name] = rng.integers(0, 3, shape).astype(dtype)
    return feeds


@pytest.fixture(scope="session", autouse=True)
def en_us_utf8_locale(tmp_path_factory):
    """onnxruntime's StringNormalizer (simple/test_strnorm_*) needs the en_US.UTF-8 locale. When the machine
    lacks it, compile it into a temporary directory and point glibc at it with LOCPATH (read at each
    newlocale call, so setting it in-process works even after onnxruntime is imported)."""
    listed = subprocess.run(["locale", "-a"], capture_output=True, text=True, check=False).stdout.split()
    if any(name.lower().replace("-", "") == "en_us.utf8" for name in listed):
        yield
        return
    directory = tmp_path_factory.mktemp("locales")
    # localedef exits 1 for mere warnings; what matters is that the compiled locale exists afterwards.
    result = subprocess.run(
        ["localedef", "-i", "en_US", "-f", "UTF-8", str(directory / "en_US.UTF-8")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (directory / "en_US.UTF-8" / "LC_CTYPE").exists(), f"localedef failed: {result.stderr.strip()}"
    old = os.environ.get("LOCPATH")
    os.environ["LOCPATH"] = str(directory)
    yield
    if old is None:
        os.environ.pop("LOCPATH", None)
    else:
        os.environ["LOCPATH"] = old


@pytest.fixture
def world_of_one(monkeypatch):
    """A gloo process group of one process in this test process (destroyed afterwards), for engine-level tests
    (tests/test_sharding.py, tests/test_offload.py)."""
    yield from _world_of_one(monkeypatch, "cpu")


@pytest.fixture
def cuda_world_of_one(monkeypatch):
    """:func:`world_of_one` on cuda:0 with NCCL (GPU tests only)."""
    yield from _world_of_one(monkeypatch, "cuda")


def _world_of_one(monkeypatch, device: str):
    import torch
    import torch.distributed as dist
    from kit.distributed import free_port

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        from revgraph.runtime.devices import Device
        from revgraph.train.distributed.data_parallel import Collective

        yield Collective(Device.parse(device))
    finally:
        dist.destroy_process_group()
