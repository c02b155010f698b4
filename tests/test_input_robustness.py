"""Inputs revgraph takes, or refuses in one line: model-local functions, memory and resource bombs, the Python
API's errors, bfloat16 models and integer losses (issue 12, sections 1, 3, 6 and 8).

The command-line tests of sections 1 and 3 run ``python -m revgraph`` in a fresh process: another import must not
mask a missing one (``onnx.inliner``), and the memory a command takes is measured for that process alone (its
peak resident size, under an address-space limit), not only its exit code. The
section 2 catalogue of bad inputs is in tests/test_bad_input.py.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import onnx
import pytest
from kit.harness import cli_under_limit
from onnx import TensorProto, helper, numpy_helper

import revgraph as rg
from revgraph.autodiff.lift import lift_constants
from revgraph.ir import Graph, Node, ValueInfo, is_float_dtype
from revgraph.limits import MAX_PROPAGATED_ELEMENTS, data_propagation_is_bounded

#: The address space a command may take (the interpreter, numpy, onnx and onnxruntime need about 1 GiB of it).
ADDRESS_SPACE = 2 << 30
#: Peak resident memory a command may reach on the bombs below: what it takes on a tiny model, plus a margin
#: (the 168-byte Range model took 3.8 GB before the fix).
PEAK_MB = 400


def revgraph_cli(*args, timeout: float = 180) -> tuple[int, int, str, str]:
    """Run ``python -m revgraph ARGS`` in a fresh process under an address-space limit of :data:`ADDRESS_SPACE`;
    return its exit code, its peak resident memory in MB, its stdout and stderr (harness.cli_under_limit)."""
    return cli_under_limit(*args, address_space=ADDRESS_SPACE, timeout=timeout)


def one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def write(model: onnx.ModelProto, path) -> str:
    model.ir_version = 10
    onnx.save(model, str(path))
    return str(path)


def vi(name, elem=TensorProto.FLOAT, shape=(3,)):
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


# ------------------------------------------------------------------------ section 1: model-local functions

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("local", 1)]


def function_model(path, functions, call="Sq"):
    """Graph ``call(x) -> y -> ReduceSum -> loss`` with the model-local ``functions`` of domain ``local``."""
    g = helper.make_graph([helper.make_node(call, ["x"], ["y"], domain="local", name="call"),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum")], "g",
                          [vi("x")], [vi("loss", shape=())])
    return write(helper.make_model(g, opset_imports=OPSETS, functions=functions), path)


def fn(name, nodes, opsets=OPSETS):
    return helper.make_function("local", name, ["a"], ["b"], nodes, opsets)


SQ = fn("Sq", [helper.make_node("Mul", ["a", "a"], ["b"])])


@pytest.mark.parametrize("functions", [
    [SQ],
    # a function that calls another function
    [fn("Sq", [helper.make_node("Twice", ["a"], ["b"], domain="local")]),
     fn("Twice", [helper.make_node("Mul", ["a", "a"], ["b"])])],
    # a function written at an older opset (ReduceSum with an axes attribute), converted when inlined
    [fn("Sq", [helper.make_node("Mul", ["a", "a"], ["m"]), helper.make_node("Unsqueeze", ["m"], ["u"], axes=[0]),
               helper.make_node("ReduceSum", ["u"], ["b"], axes=[0], keepdims=0)],
        [helper.make_opsetid("", 11)])],
], ids=["Sq", "nested", "old-opset"])
def test_model_local_functions_in_a_fresh_process(tmp_path, functions):
    path = function_model(tmp_path / "f.onnx", functions)
    code, _, out, err = revgraph_cli("info", path)
    assert code == 0, err
    assert "Mul" in out and "; also" not in out  # inlined, and the function domain is gone
    code, _, _, err = revgraph_cli("grad", path, "-o", tmp_path / "g.onnx")
    assert code == 0, err
    x = np.array([1.5, -2.0, 3.0], np.float32)
    got = rg.Session(rg.load(tmp_path / "g.onnx")).run({"x": x})
    np.testing.assert_allclose(got["loss"], np.sum(x * x), rtol=1e-6)
    np.testing.assert_allclose(got["x_grad"], 2 * x, rtol=1e-6)  # d/dx sum(x^2) = 2x
    code, _, out, err = revgraph_cli("check", path)
    assert code == 0 and "all 1 gradients agree" in out, (out, err)


@pytest.mark.parametrize("functions,cycle", [
    ([fn("Sq", [helper.make_node("Sq", ["a"], ["b"], domain="local")])], "local::Sq -> local::Sq"),
    ([fn("Sq", [helper.make_node("G", ["a"], ["b"], domain="local")]),
      fn("G", [helper.make_node("Sq", ["a"], ["b"], domain="local")])], "local::Sq"),
], ids=["self", "mutual"])
def test_recursive_functions_are_refused(tmp_path, functions, cycle):
    path = function_model(tmp_path / "f.onnx", functions)
    for command in (["info"], ["grad", "-o", tmp_path / "g.onnx"]):
        code, _, _, err = revgraph_cli(command[0], path, *command[1:])
        assert code == 2
        one_error_line(err, "local functions", "recursive", cycle)
    assert not (tmp_path / "g.onnx").exists()


# ------------------------------------------------------------------- section 3: memory and resource bombs


def range_bomb(path) -> str:
    """``Range(0, 1e12, 1)`` feeding a ``Mul``: ONNX data propagation would materialise the range."""
    c = lambda name, v: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(v, np.float32)))
    g = helper.make_graph([c("a", 0.0), c("b", 1e12), c("d", 1.0), helper.make_node("Range", ["a", "b", "d"], ["r"]),
                           helper.make_node("Mul", ["r", "x"], ["y"])], "g",
                          [vi("x", shape=(1,))], [vi("y", shape=None)])
    return write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)


def shape_bomb(path) -> str:
    """A declared input of [10^12, 2] whose length becomes a ``ConstantOfShape``'s shape, then feeds a ``Mul``:
    the long vector appears only during data propagation (its length is unknown without it)."""
    i0 = numpy_helper.from_array(np.array([0], np.int64))
    g = helper.make_graph([helper.make_node("Shape", ["x"], ["s"]),
                           helper.make_node("Constant", [], ["i"], value=i0),
                           helper.make_node("Gather", ["s", "i"], ["n"]),
                           helper.make_node("ConstantOfShape", ["n"], ["c"]),
                           helper.make_node("Mul", ["c", "c"], ["y"])], "g",
                          [vi("x", shape=(10**12, 2))], [vi("y", shape=None)])
    return write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)


@pytest.mark.parametrize("build", [range_bomb, shape_bomb])
def test_info_and_grad_do_not_materialise_numbers_written_in_the_model(tmp_path, build):
    path = build(tmp_path / "bomb.onnx")
    if build is range_bomb:
        assert os.path.getsize(path) < 200
    for command in (["info"], ["grad", "-o", tmp_path / "g.onnx", "--wrt", "x"]):
        code, peak, _, err = revgraph_cli(command[0], path, *command[1:])
        assert code == 0, err
        assert peak < PEAK_MB, f"{command[0]} took {peak} MB"


def test_running_the_range_bomb_fails_in_one_line_without_memory(tmp_path):
    path = range_bomb(tmp_path / "bomb.onnx")
    for command in ("run", "check"):
        code, peak, _, err = revgraph_cli(command, path)
        assert code == 2
        assert "Range" in err and "Traceback" not in err, err
        assert peak < PEAK_MB, f"{command} took {peak} MB"


def test_data_propagation_is_bounded_by_the_lengths_it_would_represent():
    def model(length):
        g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "g", [vi("x", shape=length)],
                              [vi("y", shape=None)])
        return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]))

    assert data_propagation_is_bounded(model((4,)))
    assert data_propagation_is_bounded(model((2, 10**9)))  # rank 2: data propagation does not represent it
    assert not data_propagation_is_bounded(model((MAX_PROPAGATED_ELEMENTS + 1,)))
    assert not data_propagation_is_bounded(model(("N",)))  # a length unknown here may be static there
    assert not data_propagation_is_bounded(model(None))


@pytest.mark.parametrize("shape,needles", [
    ((10**5, 10**5, 10**5), ["input 'x'", "PiB", "at most 2.0 GiB"]),  # 10^15 elements
    ((1,) * 65, ["input 'x'", "rank 65", "at most 64"]),
])
def test_random_inputs_are_bounded(tmp_path, shape, needles):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x", shape=shape)], [vi("y", shape=shape)])
    path = write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    for command in ("run", "check"):
        code, peak, _, err = revgraph_cli(command, path)
        assert code == 2
        one_error_line(err, *needles)
        assert peak < PEAK_MB
    with pytest.raises(rg.InputError, match="input 'x'"):
        rg.runtime.random_inputs(rg.load(path))


def test_lift_constants_is_bounded(tmp_path):
    shape = numpy_helper.from_array(np.array([10**6, 10**6], np.int64))
    g = helper.make_graph([helper.make_node("Constant", [], ["s"], value=shape),
                           helper.make_node("ConstantOfShape", ["s"], ["w"], name="weights",
                                            value=numpy_helper.from_array(np.ones(1, np.float32))),
                           helper.make_node("ReduceSum", ["w"], ["r"], keepdims=0),
                           helper.make_node("Mul", ["x", "r"], ["y"])], "g", [vi("x")], [vi("y")])
    path = write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    code, peak, _, err = revgraph_cli("grad", path, "--lift-constants", "-o", tmp_path / "g.onnx")
    assert code == 2
    one_error_line(err, "'w'", "node 'weights' (ConstantOfShape)", "3.6 TiB", "--lift-constants")
    assert peak < PEAK_MB and not (tmp_path / "g.onnx").exists()
    # a small one is lifted as before
    small = lift_constants(Graph([Node("ConstantOfShape", ["s"], ["w"], {"value": np.ones(1, np.float32)})],
                                         [], [ValueInfo("w", np.float32, (2, 3))], {"s": np.array([2, 3])}))
    np.testing.assert_array_equal(small[0].initializers["w"], np.ones((2, 3), np.float32))


def test_model_paths_and_inputs_that_are_not_regular_files(tmp_path):
    model = write(helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi("x")],
                                                      [vi("y")]), opset_imports=[helper.make_opsetid("", 21)]),
                  tmp_path / "m.onnx")
    os.mkfifo(tmp_path / "fifo")  # reading it would wait for a writer forever
    os.symlink("/dev/zero", tmp_path / "zero.onnx")  # reading it would never end
    for bad, kind in ((tmp_path / "fifo", "FIFO"), (tmp_path / "zero.onnx", "character device")):
        code, peak, _, err = revgraph_cli("info", bad, timeout=60)
        assert code == 2
        one_error_line(err, "not a regular file", kind)
        code, peak, _, err = revgraph_cli("run", model, "--inputs", bad, timeout=60)
        assert code == 2
        one_error_line(err, "not a regular file", kind)
        assert peak < PEAK_MB


def test_model_file_over_the_protobuf_limit_is_refused_before_reading(tmp_path):
    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:
        f.truncate(2**31 + 1)  # sparse: no disk space, and nothing to read
    code, peak, _, err = revgraph_cli("info", big)
    assert code == 2
    one_error_line(err, "2,147,483,649 bytes", "protobuf", "external data")
    assert peak < PEAK_MB


# ---------------------------------------------------------------------------- section 6: the Python API


@pytest.fixture
def square_graph(tmp_path):
    g = Graph([Node("Mul", ["x", "x"], ["y"], name="sq"), Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", np.float32, (3,))], [ValueInfo("loss", np.float32, ())])
    rg.save(g, tmp_path / "sq.onnx")
    return rg.load(tmp_path / "sq.onnx")


@pytest.mark.parametrize("call,error,needle", [
    (lambda g, d: rg.load(b"garbage"), rg.RevgraphError, "not a readable ONNX model"),
    (lambda g, d: rg.load(None), rg.RevgraphError, "cannot load a model from NoneType"),
    (lambda g, d: rg.load(d / "sq.onnx", opset=99), rg.RevgraphError,
     "opset=99: give None (the model's own, at least 21) or a whole number from 21 to"),
    (lambda g, d: rg.Session(b"garbage"), rg.RevgraphError, "not a readable ONNX model"),
    (lambda g, d: rg.Session(g, threads=-1), rg.RevgraphError, "threads must be"),
    (lambda g, d: rg.save(g, d), rg.RevgraphError, "is a directory"),
    (lambda g, d: rg.save(g, None), rg.RevgraphError, "save writes to a path"),
    (lambda g, d: rg.save("sq.onnx", d / "x.onnx"), rg.RevgraphError, "save takes a revgraph.Graph"),
    (lambda g, d: rg.to_onnx("sq.onnx"), rg.RevgraphError, "to_onnx takes a revgraph.Graph"),
    (lambda g, d: rg.gradient(g, wrt=[None]), rg.RevgraphError, "wrt holds None"),
    (lambda g, d: rg.gradient(g, wrt=3), rg.RevgraphError, "wrt must be a value name"),
    (lambda g, d: rg.gradient(g, loss=3), rg.RevgraphError, "loss must be a value name"),
    # (a path, a ModelProto or a Graph is a model: tests/test_model_arguments.py; a missing file is one line)
    (lambda g, d: rg.gradient(str(d / "missing.onnx"), loss="loss"), rg.RevgraphError, "missing.onnx': no such file"),
    (lambda g, d: rg.backward(g, ys=None), rg.RevgraphError, "ys must be"),
    (lambda g, d: rg.backward(g, ys={"loss": 1}), rg.RevgraphError, "the seed of 'loss' is int"),
    (lambda g, d: rg.check_gradients(d / "missing.onnx"), rg.RevgraphError, "missing.onnx': no such file"),
    (lambda g, d: rg.check_gradients(g, seed=-1), rg.RevgraphError, "seed must be an int >= 0"),
    (lambda g, d: rg.to_ssa("sq.onnx"), rg.RevgraphError, "to_ssa takes a revgraph.Graph"),
    (lambda g, d: rg.Session(g).run([np.ones(3, np.float32)]), rg.InputError, "feeds must map input names"),
    (lambda g, d: rg.Session(g).run({1: np.ones(3, np.float32)}), rg.InputError, "keyed by input name"),
    (lambda g, d: rg.Session(g).run({"x": np.ones(3, np.float32)}, outputs=["nope"]), rg.InputError,
     "unknown output(s) 'nope'"),
])
def test_public_functions_raise_one_line_revgraph_errors(square_graph, tmp_path, call, error, needle):
    with pytest.raises(error) as info:
        call(square_graph, tmp_path)
    assert needle in str(info.value) and "\n" not in str(info.value)


def external_data_model(directory) -> onnx.ModelProto:
    g = Graph([Node("Mul", ["x", "w"], ["y"], name="mul")], [ValueInfo("x", np.float32, (256,))],
              [ValueInfo("y", np.float32, (256,))], {"w": np.arange(256, dtype=np.float32)})
    onnx.save_model(rg.to_onnx(g), str(directory / "m.onnx"), save_as_external_data=True, location="m.data",
                    size_threshold=0)
    return onnx.load(str(directory / "m.onnx"), load_external_data=False)


def test_bytes_and_protos_with_external_data_need_base_dir(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    proto = external_data_model(tmp_path / "model")
    data = proto.SerializeToString()
    decoy = tmp_path / "cwd"
    decoy.mkdir()
    (decoy / "m.data").write_bytes(np.full(256, 7, np.float32).tobytes())  # never read: not the model's directory
    monkeypatch.chdir(decoy)
    for model in (data, proto):
        with pytest.raises(rg.RevgraphError, match="base_dir"):
            rg.load(model)
        g = rg.load(model, base_dir=tmp_path / "model")
        np.testing.assert_array_equal(g.initializers["w"], np.arange(256, dtype=np.float32))
    assert proto.graph.initializer[0].data_location == TensorProto.EXTERNAL  # the caller's proto is unchanged
    with pytest.raises(rg.RevgraphError, match="does not exist"):
        rg.load(data, base_dir=tmp_path)
    with pytest.raises(rg.RevgraphError, match="base_dir applies to bytes"):
        rg.load(tmp_path / "model" / "m.onnx", base_dir=tmp_path)


# ------------------------------------------------------------------- section 8: bfloat16 and integer losses

BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_matmul_model(path) -> str:
    w = np.array([[1, 2, 0, -1], [0.5, 1, 1, 1], [2, -2, 1, 0]], np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
                           helper.make_node("Tanh", ["y"], ["t"], name="tanh"),
                           helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0, name="sum")], "g",
                          [vi("x", TensorProto.BFLOAT16, (2, 3))], [vi("loss", TensorProto.BFLOAT16, ())],
                          [helper.make_tensor("w", TensorProto.BFLOAT16, [3, 4], w.ravel().tolist())])
    return write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)


def test_bfloat16_is_floating_point():
    assert np.dtype(ml_dtypes.bfloat16).kind == "V"  # what numpy says; revgraph knows better
    assert is_float_dtype(ml_dtypes.bfloat16) and ValueInfo("w", ml_dtypes.bfloat16, (3, 4)).is_float
    assert not is_float_dtype(ml_dtypes.float8_e4m3fn) and not is_float_dtype(np.int64)


def test_bfloat16_model_gradients(tmp_path, capsys):
    from revgraph.cli import main

    path = bf16_matmul_model(tmp_path / "m.onnx")
    assert main(["grad", path, "-o", str(tmp_path / "g.onnx")]) == 0
    assert "x_grad, w_grad" in capsys.readouterr().out
    gg = rg.load(tmp_path / "g.onnx")
    assert {v.name: str(v.dtype) for v in gg.outputs} == {"loss": "bfloat16", "x_grad": "bfloat16",
                                                         "w_grad": "bfloat16"}
    x = np.array([[0.5, -1, 0.25], [1, 0.5, -0.5]], np.float32)
    got = rg.Session(gg, backend="reference").run({"x": x.astype(BF16)})
    # float64 by hand: loss = sum(tanh(x w)); dL/dx = (1 - tanh^2) w^T, dL/dw = x^T (1 - tanh^2)
    w = np.array([[1, 2, 0, -1], [0.5, 1, 1, 1], [2, -2, 1, 0]], np.float64)
    d = 1 - np.tanh(x.astype(np.float64) @ w) ** 2
    for name, want in (("x_grad", d @ w.T), ("w_grad", x.T.astype(np.float64) @ d)):
        np.testing.assert_allclose(got[name].astype(np.float64), want, rtol=0.05, atol=0.02)  # bfloat16: 8 bits
    # onnxruntime's CPU build has no bfloat16 MatMul: the error says which node and what to do
    assert main(["run", path]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert all(s in err for s in ("MatMul", "'mm'", "bfloat16", "--backend reference")), err


def test_run_makes_up_bfloat16_inputs(tmp_path, capsys):
    from revgraph.cli import main

    path = bf16_matmul_model(tmp_path / "m.onnx")
    assert main(["run", path, "--backend", "reference"]) == 0
    captured = capsys.readouterr()
    assert "x bfloat16[2, 3]" in captured.err and "bfloat16" in captured.out
    feeds = rg.runtime.random_inputs(rg.load(path), seed=3)
    assert feeds["x"].dtype == BF16 and np.std(feeds["x"].astype(np.float32)) > 0.3


def test_mixed_precision_cast_passes_gradients():
    g = Graph([Node("Cast", ["x"], ["xf"], {"to": TensorProto.FLOAT}, "up"),
               Node("Mul", ["xf", "xf"], ["y"], name="sq"),
               Node("ReduceSum", ["y"], ["loss"], {"keepdims": 0}, "sum")],
              [ValueInfo("x", BF16, (3,))], [ValueInfo("loss", np.float32, ())])
    gg = rg.gradient(g)
    x = np.array([1.5, -2, 0.25], np.float32)
    got = rg.Session(gg, backend="reference").run({"x": x.astype(BF16)})
    np.testing.assert_array_equal(got["x_grad"].astype(np.float32), 2 * x)  # exact in bfloat16


def test_integer_loss_is_refused(tmp_path, capsys):
    from revgraph.cli import main

    g = Graph([Node("Mul", ["x", "x"], ["s"], name="sq"), Node("ReduceSum", ["s"], ["f"], {"keepdims": 0}, "sum"),
               Node("Cast", ["f"], ["loss"], {"to": TensorProto.INT64}, "to_int")],
              [ValueInfo("x", np.float32, (3,))], [ValueInfo("loss", np.int64, ())])
    rg.save(g, tmp_path / "m.onnx")
    for command in (["grad", "-o", str(tmp_path / "g.onnx")], ["check"]):
        assert main([command[0], str(tmp_path / "m.onnx"), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "'loss' is int64[]" in err and "not floating point" in err
    with pytest.raises(rg.RevgraphError, match="not floating point"):
        rg.gradient(g)
    with pytest.raises(rg.RevgraphError, match="not floating point"):
        rg.backward(rg.to_ssa(g), ["loss"])
    gg = rg.gradient(g, loss="f")  # the float value before the cast is differentiated as before
    np.testing.assert_allclose(rg.Session(gg).run({"x": np.array([1, 2, 3], np.float32)})["x_grad"], [2, 4, 6])
