"""Issue 28, part 5: sparse tensors reported wrongly as success.

- ``run -o`` with a sparse output wrote the string ``<...SparseTensor object at 0x...>`` into the .npz: sparse
  outputs are densified (zeros where the tensor has no value; :func:`revgraph.runtime.dense_output`), in the
  .npz and in ``Session.run``; a dense form over 2 GiB is refused in one line.
- A sparse ``Constant``'s external data was read from the process's working directory (onnx's
  ``load_external_data_for_model`` skips sparse tensors, and ``numpy_helper.to_array`` then reads the file
  relative to the working directory): it is read from the model's directory with the rules of all external
  data (inside that directory, no ``..``, no symbolic link, offset and length within the file, exactly the
  bytes the dims say). The siblings: sparse ``values`` and ``indices``, sparse constants in ``If`` / ``Loop``
  bodies, sparse initializers (refused, but their data is not read from the working directory either), bytes
  and ``ModelProto`` models with ``base_dir``, and output paths naming a sparse tensor's data file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from kit.harness import one_line_error
from onnx import TensorProto, helper, numpy_helper

import revgraph as rg
from revgraph.cli import main
from revgraph.errors import InputError, RevgraphError
from revgraph.ir.constants import constant_value
from revgraph.onnx_io.npz import read_outputs
from revgraph.runtime import dense_output

VALUES = np.array([1.5, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], np.float32)
INDICES = np.arange(0, 16, 2, dtype=np.int64)  # linear indices into [4, 4]
DENSE = np.zeros(16, np.float32)
DENSE[INDICES] = VALUES
DENSE = DENSE.reshape(4, 4)
DECOY = np.full(8, 99.0, np.float32)


def external(t: TensorProto, location: str, offset: int, length: int) -> TensorProto:
    """``t`` with its data moved to the file ``location`` (written by the caller), in place."""
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def sparse(location: str | None = "w.bin", indices_location: str | None = None, dims=(4, 4), coords: bool = False):
    """The sparse tensor of :data:`VALUES` at :data:`INDICES` in ``dims``, its values (and indices) external."""
    vals = numpy_helper.from_array(VALUES, "v")
    idx = np.stack(np.unravel_index(INDICES, dims), axis=1) if coords else INDICES
    ind = numpy_helper.from_array(idx, "i")
    if location is not None:
        external(vals, location, 0, VALUES.nbytes)
    if indices_location is not None:
        external(ind, indices_location, 0, idx.nbytes)
    return helper.make_sparse_tensor(vals, ind, list(dims))


def save(m: onnx.ModelProto, path) -> str:
    m.ir_version = 10
    onnx.save(m, str(path))
    return str(path)


def constant_model(path, sp, where: str = "top") -> str:
    """``y = Identity(c)`` with ``c`` the sparse ``Constant`` ``sp``, at the top level or inside an ``If``
    branch (``where="if"``, both branches holding it)."""
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])
    if where == "top":
        nodes = [helper.make_node("Constant", [], ["c"], name="c", sparse_value=sp),
                 helper.make_node("Identity", ["c"], ["y"], name="id")]
        g = helper.make_graph(nodes, "g", [], [out])
    elif where == "loop":  # a Loop body returning the constant as a scan output, one iteration
        body = helper.make_graph(
            [helper.make_node("Constant", [], ["k"], name="body_c", sparse_value=sp),
             helper.make_node("Identity", ["cond"], ["cond_out"], name="body_id")], "body",
            [helper.make_tensor_value_info("i", TensorProto.INT64, []),
             helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("k", TensorProto.FLOAT, [4, 4])])
        trip = helper.make_tensor_value_info("n", TensorProto.INT64, [])
        go = helper.make_tensor_value_info("go", TensorProto.BOOL, [])
        nodes = [helper.make_node("Loop", ["n", "go"], ["ys"], name="loop", body=body)]
        g = helper.make_graph(nodes, "g", [trip, go],
                              [helper.make_tensor_value_info("ys", TensorProto.FLOAT, [None, 4, 4])])
    else:
        def branch(name):
            constant = helper.make_node("Constant", [], [f"{name}_c"], name=f"{name}_c", sparse_value=sp)
            return helper.make_graph([constant], name, [],
                                     [helper.make_tensor_value_info(f"{name}_c", TensorProto.FLOAT, [4, 4])])
        cond = helper.make_tensor_value_info("b", TensorProto.BOOL, [])
        nodes = [helper.make_node("If", ["b"], ["y"], name="if", then_branch=branch("then"),
                                  else_branch=branch("else"))]
        g = helper.make_graph(nodes, "g", [cond], [out])
    return save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)


def cli_in(cwd, *args) -> subprocess.CompletedProcess:
    """``python -m revgraph ARGS`` with the working directory ``cwd`` (this process's PYTHONPATH)."""
    return subprocess.run([sys.executable, "-m", "revgraph", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env=os.environ.copy(), check=False)


@pytest.fixture
def dirs(tmp_path):
    """``model/`` (the model's directory, holding ``w.bin`` = :data:`VALUES`) and ``cwd/`` (a decoy ``w.bin``)."""
    model_dir, cwd = tmp_path / "model", tmp_path / "cwd"
    model_dir.mkdir()
    cwd.mkdir()
    (model_dir / "w.bin").write_bytes(VALUES.tobytes())
    (cwd / "w.bin").write_bytes(DECOY.tobytes())
    (model_dir / "i.bin").write_bytes(INDICES.tobytes())
    (cwd / "i.bin").write_bytes(np.arange(8, dtype=np.int64).tobytes())
    return model_dir, cwd


# ------------------------------------------------------------------------------------------ sparse outputs


@pytest.mark.parametrize("coords", [False, True], ids=["linear indices", "coordinates"])
def test_run_writes_a_sparse_output_dense(tmp_path, capsys, coords):
    """The example: the .npz held a string. Now the dense value, float32 [4, 4], zeros off the indices."""
    vals = numpy_helper.from_array(VALUES, "v")
    idx = np.stack(np.unravel_index(INDICES, (4, 4)), axis=1) if coords else INDICES
    sp = helper.make_sparse_tensor(vals, numpy_helper.from_array(idx, "i"), [4, 4])
    m = constant_model(tmp_path / "m.onnx", sp)
    assert main(["run", m, "-o", str(tmp_path / "o.npz")]) == 0
    got = read_outputs(tmp_path / "o.npz")["y"]
    assert got.dtype == np.float32 and np.array_equal(got, DENSE)
    with np.load(tmp_path / "o.npz", allow_pickle=False) as z:  # a plain numeric member, no pickle, no string
        assert z["y"].dtype == np.float32
    # the Python API gives the same dense array
    assert np.array_equal(rg.Session(rg.load(m)).run({})["y"], DENSE)


def test_a_sparse_graph_output_without_a_node_between(tmp_path):
    """The sparse Constant's output is the graph output itself (what the issue's probe did)."""
    sp = helper.make_sparse_tensor(numpy_helper.from_array(VALUES, "v"), numpy_helper.from_array(INDICES, "i"), [4, 4])
    g = helper.make_graph([helper.make_node("Constant", [], ["y"], name="c", sparse_value=sp)], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    m = save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    assert main(["run", m, "-o", str(tmp_path / "o.npz")]) == 0
    assert np.array_equal(read_outputs(tmp_path / "o.npz")["y"], DENSE)


BACKENDS = ["onnxruntime", "reference"]
FEEDS = {"top": {}, "output": {}, "if": {"b": np.array(True)}, "loop": {"n": np.array(2), "go": np.array(True)}}


def sparse_output_model(path, where: str, coords: bool = False) -> str:
    """:data:`DENSE` as a sparse ``Constant``: the graph output itself (``where="output"``), through an
    ``Identity`` (``"top"``), in both branches of an ``If`` or as a ``Loop``'s scan output (2 iterations)."""
    vals = numpy_helper.from_array(VALUES, "v")
    idx = np.stack(np.unravel_index(INDICES, (4, 4)), axis=1) if coords else INDICES
    sp = helper.make_sparse_tensor(vals, numpy_helper.from_array(idx, "i"), [4, 4])
    if where != "output":
        return constant_model(path, sp, where)
    g = helper.make_graph([helper.make_node("Constant", [], ["y"], name="c", sparse_value=sp)], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    return save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)


def expected_dense(where: str) -> np.ndarray:
    return np.stack([DENSE, DENSE]) if where == "loop" else DENSE


@pytest.mark.parametrize("coords", [False, True], ids=["linear", "coords"])
@pytest.mark.parametrize("where", ["output", "top", "if", "loop"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_and_path_densifies_a_sparse_output(tmp_path, capsys, backend, where, coords):
    """Issue 28 round 3: ``run --backend reference`` failed on a sparse output (onnx.reference returns its own
    ``SparseTensor`` object) and onnxruntime failed on a sparse ``Constant`` in an ``If`` or ``Loop`` body.
    Now ``Session.run``, ``run -o`` and ``run``'s printed table give the dense tensor on both backends."""
    m = sparse_output_model(tmp_path / "m.onnx", where, coords)
    want = expected_dense(where)
    name = "ys" if where == "loop" else "y"
    got = rg.Session(rg.load(m), backend=backend).run(FEEDS[where])[name]
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and np.array_equal(got, want)
    inputs = []
    if FEEDS[where]:
        np.savez(tmp_path / "in.npz", **FEEDS[where])
        inputs = ["--inputs", str(tmp_path / "in.npz")]
    assert main(["run", m, "--backend", backend, *inputs, "-o", str(tmp_path / "o.npz")]) == 0
    assert np.array_equal(read_outputs(tmp_path / "o.npz")[name], want)
    capsys.readouterr()
    assert main(["run", m, "--backend", backend, *inputs]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == [name])
    assert f"{want.min():g}" in row and f"{want.max():g}" in row and f"{want.mean():.4g}" in row, row


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_huge_sparse_output_is_refused_not_densified(tmp_path, capsys, backend):
    """Two values in a [10^6, 10^6] tensor: its dense form (4 TB) is refused in one line, on both backends."""
    sp = helper.make_sparse_tensor(numpy_helper.from_array(VALUES[:2], "v"),
                                   numpy_helper.from_array(np.array([0, 5], np.int64), "i"), [10**6, 10**6])
    g = helper.make_graph([helper.make_node("Constant", [], ["y"], name="c", sparse_value=sp)], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10**6, 10**6])])
    m = save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    code = main(["run", m, "--backend", backend, "-o", str(tmp_path / "o.npz")])
    one_line_error(code, capsys.readouterr().err, "sparse output 'y' of node 'c' (Constant) would take 3.6 TiB")
    assert not (tmp_path / "o.npz").exists()


class _Coo:
    def indices(self):
        return np.array([0, 5], np.int64)


class _Sparse:
    """What onnxruntime returns for a sparse output (its ``SparseTensor``'s methods that dense_output reads)."""
    format = "OrtSparseFormat.ORT_SPARSE_COO"

    def __init__(self, shape):
        self.shape = shape

    def dense_shape(self):
        return list(self.shape)

    def values(self):
        return np.array([1.0, 2.0], np.float32)

    def get_coo_data(self):
        return _Coo()


def test_dense_output_bounds_the_dense_form():
    assert np.array_equal(dense_output("y", _Sparse((2, 3))), np.array([[1, 0, 0], [0, 0, 2]], np.float32))
    with pytest.raises(InputError, match=r"sparse output 'y' would take 3.6 TiB \(float32\[1000000, 1000000\]\)"):
        dense_output("y", _Sparse((10**6, 10**6)))


# ------------------------------------------------------------------------------- sparse external data


@pytest.mark.parametrize("which", ["values", "values and indices"])
def test_sparse_constant_data_comes_from_the_models_directory(dirs, which):
    """The example: with a decoy ``w.bin`` in the working directory, the model's own ``w.bin`` is read."""
    model_dir, cwd = dirs
    m = constant_model(model_dir / "m.onnx", sparse("w.bin", "i.bin" if which != "values" else None))
    proc = cli_in(cwd, "run", m, "-o", cwd / "o.npz")
    assert proc.returncode == 0, proc.stderr
    assert np.array_equal(read_outputs(cwd / "o.npz")["y"], DENSE)


@pytest.mark.parametrize("where", ["if", "loop"])
@pytest.mark.parametrize("which", ["values", "values and indices"])
def test_sparse_constants_in_subgraphs_read_the_models_directory(dirs, monkeypatch, which, where):
    """A sparse ``Constant`` in both branches of an ``If`` and in a ``Loop`` body (onnxruntime cannot run one
    there: the loaded value is compared), with the decoys in the working directory."""
    model_dir, cwd = dirs
    m = constant_model(model_dir / "m.onnx", sparse("w.bin", "i.bin" if which != "values" else None), where)
    monkeypatch.chdir(cwd)
    g = rg.load(m)
    bodies = list(g.nodes[0].subgraphs.values())
    assert len(bodies) == (2 if where == "if" else 1)
    for body in bodies:
        assert np.array_equal(constant_value(body.nodes[0]), DENSE)


def test_a_file_only_in_the_working_directory_is_not_used(dirs):
    model_dir, cwd = dirs
    (model_dir / "w.bin").unlink()
    m = constant_model(model_dir / "m.onnx", sparse("w.bin"))
    proc = cli_in(cwd, "run", m, "-o", cwd / "o.npz")
    one_line_error(proc.returncode, proc.stderr, "tensor 'v'", "external data file 'w.bin' does not exist")
    assert not (cwd / "o.npz").exists()


@pytest.mark.parametrize("bad", ["dotdot", "absolute", "symlink", "length", "offset"])
def test_sparse_external_data_follows_the_rules_of_all_external_data(dirs, bad):
    model_dir, cwd = dirs
    location, length, offset = "w.bin", VALUES.nbytes, 0
    if bad == "dotdot":
        location = "../cwd/w.bin"
    elif bad == "absolute":
        location = str(cwd / "w.bin")
    elif bad == "symlink":
        os.symlink(cwd / "w.bin", model_dir / "link.bin")
        location = "link.bin"
    elif bad == "length":
        length = VALUES.nbytes - 4
    else:
        offset = 16
    sp = sparse(None)
    external(sp.values, location, offset, length)
    m = constant_model(model_dir / "m.onnx", sp)
    proc = cli_in(cwd, "run", m, "-o", cwd / "o.npz")
    expected = {"dotdot": "points outside the directory", "absolute": "should be a relative path",
                "symlink": "is a symbolic link", "length": "needs 32 bytes; its external data holds 28",
                "offset": "reaches past the end of 'w.bin'"}[bad]
    one_line_error(proc.returncode, proc.stderr, "v", expected)
    assert not (cwd / "o.npz").exists()


def test_a_sparse_initializers_data_is_not_read_from_the_working_directory(dirs):
    """Sparse initializers are refused (store them dense); with external data, that data is checked against
    the model's directory, never read from the working directory."""
    model_dir, cwd = dirs
    sp = sparse("w.bin")
    sp.values.name = "s"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
    g = helper.make_graph([helper.make_node("Add", ["x", "s"], ["y"], name="add")], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])], sparse_initializer=[sp])
    m = save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), model_dir / "m.onnx")
    proc = cli_in(cwd, "info", m)
    one_line_error(proc.returncode, proc.stderr, "sparse initializers")
    (model_dir / "w.bin").unlink()  # only the decoy left: refused for the missing file, not read from cwd
    proc = cli_in(cwd, "info", m)
    one_line_error(proc.returncode, proc.stderr, "external data file 'w.bin' does not exist")


def test_bytes_and_model_proto_read_sparse_data_from_base_dir(dirs, monkeypatch):
    model_dir, cwd = dirs
    m = constant_model(model_dir / "m.onnx", sparse("w.bin", "i.bin"))
    monkeypatch.chdir(cwd)  # the decoys are in the working directory
    with open(m, "rb") as f:
        data = f.read()
    for given in (data, onnx.load(m, load_external_data=False)):
        with pytest.raises(RevgraphError, match="external data files; load it from its path, or pass"):
            rg.load(given)
        assert np.array_equal(rg.Session(rg.load(given, base_dir=model_dir)).run({})["y"], DENSE)
    assert np.array_equal(rg.Session(rg.load(m)).run({})["y"], DENSE)


def test_an_output_may_not_be_a_sparse_tensors_data_file(dirs, capsys):
    """The sparse tensor's data file is one of the model's input files: ``-o`` naming it is refused, the file kept."""
    model_dir, _ = dirs
    m = constant_model(model_dir / "m.onnx", sparse("w.bin"))
    code = main(["run", m, "-o", str(model_dir / "w.bin")])
    one_line_error(code, capsys.readouterr().err, "w.bin")
    assert (model_dir / "w.bin").read_bytes() == VALUES.tobytes()


# --------------------------------------------------------------------------- sparse indices ONNX forbids

_C = np.stack(np.unravel_index(INDICES, (4, 4)), axis=1)  # [8, 2] coordinates of INDICES
BAD_INDICES = {  # name: (indices, what the message says)
    "duplicate": (np.array([0, 2, 4, 4, 8, 10, 12, 14]), "has index 4 (entry 3) that repeats index 4 (entry 2)"),
    "unsorted": (np.array([0, 2, 6, 4, 8, 10, 12, 14]), "has index 4 (entry 3) that comes after index 6 (entry 2)"),
    "out of range": (np.array([0, 2, 4, 6, 8, 10, 12, 16]), "has index 16 (entry 7) outside its dense shape [4, 4]"),
    "negative": (np.array([-1, 2, 4, 6, 8, 10, 12, 14]), "has index -1 (entry 0) outside its dense shape [4, 4]"),
    "short": (np.array([0, 2, 4, 6, 8, 10, 12]), "has indices of shape [7] for 8 values"),
    "rank 3": (INDICES.reshape(8, 1, 1), "has indices of shape [8, 1, 1] for 8 values"),
    "int32": (INDICES.astype(np.int32), "has int32 indices; ONNX requires int64"),
    "coords duplicate": (np.concatenate([_C[:3], _C[2:3], _C[4:]]),
                         "has coordinate [1, 0] (entry 3) that repeats coordinate [1, 0] (entry 2)"),
    "coords unsorted": (_C[[0, 1, 3, 2, 4, 5, 6, 7]], "has coordinate [1, 0] (entry 3) that comes after coordinate"),
    "coords out of range": (np.concatenate([_C[:7], [[3, 4]]]), "has coordinate [3, 4] (entry 7) outside its dense"),
    "coords negative": (np.concatenate([[[0, -1]], _C[1:]]), "has coordinate [0, -1] (entry 0) outside its dense"),
    "coords wrong rank": (np.concatenate([_C, _C[:, :1]], axis=1), "has indices of shape [8, 3] for 8 values"),
    "coords short": (_C[:7], "has indices of shape [7, 2] for 8 values"),
}


def bad_sparse(case: str) -> TensorProto:
    idx, _ = BAD_INDICES[case]
    dtype = idx.dtype if idx.dtype == np.int32 else np.int64
    return helper.make_sparse_tensor(numpy_helper.from_array(VALUES, "v"),
                                     numpy_helper.from_array(np.asarray(idx, dtype), "i"), [4, 4])


@pytest.mark.parametrize("where", ["top", "if", "loop"])
@pytest.mark.parametrize("case", list(BAD_INDICES))
def test_sparse_indices_onnx_forbids_are_refused(tmp_path, capsys, case, where):
    """Issue 28 round 3: a sparse ``Constant`` with a repeated index ran (one of the two values silently
    lost); one with unsorted indices ran on one runtime. Every index ONNX's SparseTensorProto forbids is a
    one-line GraphError at load naming the tensor and its node, at the top level and in subgraphs."""
    m = constant_model(tmp_path / "m.onnx", bad_sparse(case), where)
    fragment = BAD_INDICES[case][1]
    nodes = {"top": ["'c'"], "if": ["'then_c'", "'else_c'"], "loop": ["'body_c'"]}[where]  # (either If branch)
    with pytest.raises(rg.GraphError, match=re.escape(fragment)) as err:
        rg.load(m)
    assert any(f"sparse tensor 'v' (attribute 'sparse_value' of node {n} (Constant))" in str(err.value) for n in nodes)
    assert "\n" not in str(err.value)
    for args in (["run", m], ["info", m], ["grad", m, "-o", str(tmp_path / "g.onnx")]):
        code = main(args)
        one_line_error(code, capsys.readouterr().err, "sparse tensor 'v'", fragment)
    assert not (tmp_path / "g.onnx").exists()


def test_the_refusals_say_what_to_do(tmp_path):
    for case, what in (("duplicate", "sort them and merge repeated entries"), ("out of range", "fix or drop it"),
                       ("short", "ONNX takes indices of shape [8] (linear indices) or [8, 2] (coordinates)")):
        with pytest.raises(rg.GraphError, match=re.escape(what)):
            rg.load(constant_model(tmp_path / f"{case}.onnx", bad_sparse(case)))


def test_valid_sparse_indices_stay_accepted(tmp_path):
    """The checks refuse only what ONNX forbids: an empty sparse tensor, and both index forms, load and run."""
    empty = helper.make_sparse_tensor(numpy_helper.from_array(np.zeros(0, np.float32), "v"),
                                      numpy_helper.from_array(np.zeros(0, np.int64), "i"), [4, 4])
    m = constant_model(tmp_path / "e.onnx", empty)
    assert np.array_equal(rg.Session(rg.load(m)).run({})["y"], np.zeros((4, 4), np.float32))
    for coords in (False, True):
        m = sparse_output_model(tmp_path / f"{coords}.onnx", "top", coords)
        assert np.array_equal(rg.Session(rg.load(m), backend="reference").run({})["y"], DENSE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_graph_built_in_python_is_checked_when_it_runs(tmp_path, backend):
    """A sparse attribute put into a Graph by hand (not through load) is checked by the Session that runs it."""
    g = rg.load(constant_model(tmp_path / "m.onnx", sparse(None)))
    g.nodes[0].attrs["sparse_value"] = helper.make_attribute("sparse_value", bad_sparse("duplicate"))
    with pytest.raises(rg.GraphError, match=re.escape(BAD_INDICES["duplicate"][1])):
        rg.Session(g, backend=backend)
