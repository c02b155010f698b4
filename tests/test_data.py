"""Data layouts of issue 26 (revgraph.train.data): static inputs fed whole to every step (against PyTorch), a
full-graph GNN, directories of .npy files read memory-mapped (bit for bit the .npz run, never copied whole),
and the one-line errors of bad data."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit.lossdata_models import gnn_data, gnn_model, static_data, static_model

import revgraph as rg
from revgraph.errors import InputError
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.train import make_optimizer
from revgraph.train.data import read_dir, read_static


def torch_params(g):
    return {k: torch.tensor(v, requires_grad=True) for k, v in g.initializers.items()}


def test_static_inputs_train_as_pytorch():
    """A per-sample x with a mixing matrix and a scalar gain given once (static=): 2 epochs of Adam on batches
    of 16 (shuffled) equal torch.optim.Adam with the same batches; evaluate and predict take the static too."""
    data, static = static_data()
    tr = rg.Trainer(static_model(), "cross-entropy", make_optimizer("adam", lr=0.01), threads=1)
    tr.fit(data, epochs=2, batch_size=16, seed=3, progress=False, static=static)
    p = torch_params(static_model())
    opt = torch.optim.Adam(p.values(), lr=0.01)
    adj, gain = torch.tensor(static["adj"]), torch.tensor(static["gain"])

    def logits(x):
        return ((x @ adj) @ p["W"] + p["b"]) * gain

    x, y = torch.tensor(data["x"]), torch.tensor(data["labels"])
    for epoch in range(2):
        order = np.random.default_rng(3 + epoch).permutation(len(x))
        for j in range(0, len(x), 16):
            rows = order[j:j + 16]
            opt.zero_grad()
            F.cross_entropy(logits(x[rows]), y[rows]).backward()
            opt.step()
    for k, v in tr.parameters.items():
        np.testing.assert_allclose(v, p[k].detach().numpy(), rtol=2e-5, atol=1e-6, err_msg=k)
    with torch.no_grad():
        want = logits(x).numpy()
        ref = F.cross_entropy(logits(x), y)
    np.testing.assert_allclose(tr.predict(data["x"], static=static), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tr.evaluate(data, static=static)["loss"], float(ref), rtol=1e-5)


def test_full_graph_gnn_with_every_input_static():
    """x, edge_index [2, E] and the labels all static: each epoch is one step on the whole graph, as PyTorch's
    full-batch training of the same message passing (index_add_)."""
    d = gnn_data()
    tr = rg.Trainer(gnn_model(), "cross-entropy", make_optimizer("sgd", lr=0.2, momentum=0.9), threads=1)
    assert tr.arrays({}, static=d).n == 1
    tr.fit({}, epochs=3, batch_size=4, progress=False, static=d)
    assert tr.steps == 3
    p = torch_params(gnn_model())
    opt = torch.optim.SGD(p.values(), lr=0.2, momentum=0.9)
    x, e, y = (torch.tensor(d[k]) for k in ("x", "edge_index", "labels"))
    for _ in range(3):
        opt.zero_grad()
        h = x @ p["W1"]
        agg = torch.zeros_like(h).index_add_(0, e[1], h[e[0]])
        F.cross_entropy(torch.relu(agg + h) @ p["W2"], y).backward()
        opt.step()
    for k, v in tr.parameters.items():
        np.testing.assert_allclose(v, p[k].detach().numpy(), rtol=2e-5, atol=1e-6, err_msg=k)


def _write_dir(path, arrays):
    path.mkdir()
    for k, v in arrays.items():
        np.save(path / f"{k}.npy", v)
    return path


def test_npy_directory_trains_bit_for_bit_as_npz_and_stays_memory_mapped(tmp_path):
    data, static = static_data()
    npz = tmp_path / "data.npz"
    np.savez(npz, **data)
    d = _write_dir(tmp_path / "data", data)
    runs = []
    for source in (dict(np.load(npz)), str(d)):
        tr = rg.Trainer(static_model(), "cross-entropy", make_optimizer("adam", lr=0.01), threads=1)
        tr.fit(source, epochs=2, batch_size=10, seed=5, progress=False, static=static)
        runs.append((tr.parameters, tr.losses, tr.evaluate(source, static=static)))
    for k in runs[0][0]:
        np.testing.assert_array_equal(runs[1][0][k], runs[0][0][k], err_msg=k)
    assert runs[1][1] == runs[0][1] and runs[1][2] == runs[0][2]
    ds = tr.arrays(str(d), static=static)
    assert all(isinstance(a, np.memmap) for a in ds.arrays.values())


def test_a_large_memory_mapped_array_is_never_read_whole(tmp_path):
    """x float64 [4096, 64] (2 MiB, cast to float32 batch by batch): while training and evaluating from the
    directory, Python allocates far less than the array (tracemalloc sees numpy's allocations, not the mapped
    file's pages): each batch is gathered from the memmap, nothing converts it whole."""
    n, k = 4096, 64
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, k))
    _write_dir(tmp_path / "big", {"x": x, "labels": (x.sum(1) > 0).astype(np.int64)})
    g = Graph([Node("MatMul", ["x", "W"], ["logits"], {}, "lin")], [ValueInfo("x", np.float32, ("N", k))],
              [ValueInfo("logits", np.float32, ("N", 2))], {"W": np.zeros((k, 2), np.float32)})
    tr = rg.Trainer(g, "cross-entropy", "sgd", threads=1)
    tracemalloc.start()
    try:
        tr.fit(str(tmp_path / "big"), epochs=1, batch_size=256, progress=False)
        tr.evaluate(str(tmp_path / "big"), batch_size=256)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < x.nbytes / 4, (peak, x.nbytes)
    assert tr.steps == 16


def test_bad_data_layouts_are_one_line_errors(tmp_path):
    data, static = static_data(10)
    tr = rg.Trainer(static_model(), "cross-entropy", "sgd", threads=1)
    uneven = _write_dir(tmp_path / "uneven", {"x": data["x"], "labels": data["labels"][:7]})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.npy").write_bytes(b"not a numpy file")
    cases = [
        (data, {**static, "adj": np.eye(3, dtype=np.float32)}, ("static array 'adj' has shape [3, 3]; input 'adj' is "
         "declared float32[4,4]")),
        (data, {**static, "gain": np.ones(2, np.float32)}, "static array 'gain' has shape [2]"),
        (data, {**static, "mask": np.ones(2)}, "--static mask: the model has no input 'mask'"),
        (data, {"adj": static["adj"]}, "the data lacks 'gain'"),
        ({**data, "gain": np.ones(10, np.float32)}, {"adj": static["adj"]}, "array 'gain' has shape [10]"),
        ({**data, "adj": static["adj"]}, static, "given both as data and as a static input"),
        (str(uneven), static, "arrays differ in length: x 10, labels 7"),
        (str(tmp_path / "bad"), static, "x.npy' is not a readable .npy file (ValueError)"),
        (str(tmp_path / "none"), static, "is not a directory of .npy files"),
    ]
    for d, s, message in cases:
        with pytest.raises(InputError) as info:
            tr.arrays(d, static=s)
        assert message in str(info.value) and "\n" not in str(info.value), (message, str(info.value))
    with pytest.raises(InputError, match=r"write NAME=FILE\.npy"):
        read_static(["adj"])
    np.savez(tmp_path / "s.npz", a=static["adj"])
    with pytest.raises(InputError, match="has no member 'b'"):
        read_static([f"adj={tmp_path / 's.npz'}:b"])
    assert np.array_equal(read_static([f"adj={tmp_path / 's.npz'}:a"])["adj"], static["adj"])
    with pytest.raises(InputError, match=r"holds no \.npy files"):
        read_dir(_write_dir(tmp_path / "empty", {}))
