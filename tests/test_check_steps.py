"""Issue 28, part 5 (``check``): correct gradients were reported as mismatches, and values the check cannot
judge must say so ("not checked: ...") instead of failing.

- A weight of 1e12: a step of 1e-6 is below its float64 resolution (1.2e-4), ``w + h == w``, and the
  difference was 0. Each element now moves by ``h * max(1, |x_i|)``.
- A model whose output is its input (no node between): the perturbation was added after the graph's
  output was taken, so the difference was 0. The moved value is now the output.
- A loss of 1e30 plus a small term: its change under any step is below its resolution; reported as not
  checked ("resolution"), not as a disagreement. A loss that is NaN next to the inputs: not checked.
- A real error is still found, at ordinary and at huge magnitudes (a gradient corrupted by 1%): exit 1.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Node
from revgraph.tools import check


def save(path, nodes, inputs, outputs, inits=()) -> str:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return str(path)


def vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def big_weight_model(path, big: float = 1e12) -> str:
    """``loss = sum(w * x * w)`` with ``w = [big, 2, -3]`` (an initializer) and input ``x`` [3]."""
    w = numpy_helper.from_array(np.array([big, 2.0, -3.0], np.float32), "w")
    nodes = [helper.make_node("Mul", ["w", "x"], ["p"], name="p"), helper.make_node("Mul", ["p", "w"], ["q"], name="q"),
             helper.make_node("ReduceSum", ["q"], ["loss"], name="s", keepdims=0)]
    return save(path, nodes, [vi("x", [3])], [vi("loss", [])], [w])


def identity_model(path) -> str:
    """The output is the input ``x`` itself: no node."""
    return save(path, [], [vi("x", [3])], [vi("x", [3])])


def test_a_weight_of_1e12_agrees(tmp_path, capsys):
    """The example: exit 1 "mismatch" before; every value agrees now, and the gradient is the exact one."""
    m = big_weight_model(tmp_path / "m.onnx")
    code = main(["check", m, "--wrt", "w", "x"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all 2 gradients agree" in out
    report = rg.check_gradients(rg.load(m), wrt=["w", "x"])
    assert [(r.name, r.status) for r in report.rows] == [("w", "agree"), ("x", "agree")]


def test_the_steps_follow_each_elements_magnitude():
    """The directions ``_compare`` moves a value along: ``h * max(1, |x_i|) * v_i``, above each element's
    resolution (a value of 1e12 moves by about 1e6, one of 1e-8 by about 1e-6)."""
    x = np.array([1e12, 1e-8, -5.0])
    seen = []

    def loss_at(delta):
        seen.append(delta)
        return np.asarray(float(np.sum(x + delta)))

    row = check._compare("x", np.ones(3), loss_at, np.asarray(1.0), np.asarray(float(np.sum(x))),
                         np.random.default_rng(0), 2, 1e-6, 1e-4, 1e-6, x)
    assert row.status == "agree"
    for delta in seen:
        assert np.all(x + delta != x)  # every element really moved
        ratio = np.abs(delta) / (1e-6 * np.maximum(1.0, np.abs(x)))
        assert np.all(ratio < 6)  # |v_i| < 6 for a standard normal draw of 3


def test_an_output_that_is_its_input_agrees(tmp_path, capsys):
    m = identity_model(tmp_path / "m.onnx")
    code = main(["check", m])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all 1 gradients agree" in out
    report = rg.check_gradients(rg.load(m))
    assert report.rows[0].status == "agree" and report.rows[0].max_abs < 1e-8


def test_an_output_that_is_its_input_beside_another_output(tmp_path):
    """The loss is another output; the input is also returned as is: its gradient (from the loss) still agrees."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"], name="sq"),
             helper.make_node("ReduceSum", ["sq"], ["loss"], name="s", keepdims=0)]
    m = save(tmp_path / "m.onnx", nodes, [vi("x", [3])], [vi("loss", []), vi("x", [3])])
    report = rg.check_gradients(rg.load(m), loss="loss")
    assert [r.status for r in report.rows] == ["agree"]


def test_a_change_below_the_losss_resolution_is_not_checked(tmp_path, capsys):
    """``loss = 1e30 + sum(x * x)``: moving x changes the loss by ~1e-6, below 1e30's float64 resolution
    (1.4e14): the difference is 0. Reported as not checked, never as a disagreement; with nothing else to
    check, the command exits 2 (nothing verified is no success)."""
    big = numpy_helper.from_array(np.array(1e30, np.float32), "big")
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"], name="sq"),
             helper.make_node("ReduceSum", ["sq"], ["s"], name="s", keepdims=0),
             helper.make_node("Add", ["s", "big"], ["loss"], name="add")]
    m = save(tmp_path / "m.onnx", nodes, [vi("x", [3])], [vi("loss", [])], [big])
    code = main(["check", m, "--wrt", "x"])
    out, error = capsys.readouterr()
    assert code == 2, out
    assert "x: not checked: the loss's change under the step" in out and "within float64's rounding" in out
    assert "none of the 1 values could be checked numerically" in error and len(error.strip().splitlines()) == 1
    report = rg.check_gradients(rg.load(m), wrt=["x"])
    assert report.ok and report.rows[0].status == "resolution"


def test_a_loss_that_is_not_finite_is_not_checked(tmp_path, capsys):
    """``Log`` of a negative input: NaN. Not checked (with the hint to pass inputs inside the domain); nothing
    else to check: exit 2."""
    nodes = [helper.make_node("Log", ["x"], ["l"], name="log"),
             helper.make_node("ReduceSum", ["l"], ["loss"], name="s", keepdims=0)]
    m = save(tmp_path / "m.onnx", nodes, [vi("x", [3])], [vi("loss", [])])
    np.savez(tmp_path / "in.npz", x=np.array([-1.0, 2.0, 3.0], np.float32))
    code = main(["check", m, "--inputs", str(tmp_path / "in.npz")])
    out, error = capsys.readouterr()
    assert code == 2, out
    assert "x: not checked: the loss is not finite" in out and "NaN or infinite values" in out
    assert "could be checked" in error and "--inputs" in error


def test_a_weight_holding_inf_is_not_checked(tmp_path):
    w = numpy_helper.from_array(np.array([np.inf, 2.0, -3.0], np.float32), "w")
    nodes = [helper.make_node("Mul", ["w", "x"], ["p"], name="p"),
             helper.make_node("ReduceSum", ["p"], ["loss"], name="s", keepdims=0)]
    m = save(tmp_path / "m.onnx", nodes, [vi("x", [3])], [vi("loss", [])], [w])
    rows = {r.name: r for r in rg.check_gradients(rg.load(m), wrt=["w"]).rows}
    assert rows["w"].status == "not finite" and rows["w"].note.startswith("not checked:") and rows["w"].ok


def corrupted(real, factor: float = 1.01):
    """``revgraph.gradient`` whose last gradient output is multiplied by ``factor``: a wrong rule."""
    def gradient(*args, **kwargs):
        gg = real(*args, **kwargs)
        last = gg.outputs[-1]
        gg.initializers["corrupt/factor"] = np.asarray(factor, np.float64)
        gg.nodes.append(Node("Mul", [last.name, "corrupt/factor"], [f"{last.name}/corrupt"], name="corrupt"))
        gg.outputs[-1] = type(last)(f"{last.name}/corrupt", last.dtype, last.shape)
        return gg
    return gradient


@pytest.mark.parametrize("big", [1.0, 1e12], ids=["ordinary weights", "a weight of 1e12"])
def test_a_wrong_gradient_is_still_found(tmp_path, capsys, monkeypatch, big):
    """A 1% error in the gradient of ``x`` (the last wrt value): exit 1, "x" disagrees, "w" agrees."""
    m = big_weight_model(tmp_path / "m.onnx", big)
    monkeypatch.setattr(check, "gradient", corrupted(check.gradient))
    code = main(["check", m, "--wrt", "w", "x"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "1 of 2 values disagree" in out
    rows = {r.name: r for r in rg.check_gradients(rg.load(m), wrt=["w", "x"]).rows}
    assert rows["w"].status == "agree" and rows["x"].status == "mismatch" and not rows["x"].ok


def test_a_wrong_gradient_of_an_output_that_is_its_input_is_found(tmp_path, monkeypatch):
    m = identity_model(tmp_path / "m.onnx")
    monkeypatch.setattr(check, "gradient", corrupted(check.gradient, 1.5))
    report = rg.check_gradients(rg.load(m))
    assert report.rows[0].status == "mismatch" and not report.ok


def test_a_computed_wrt_value_of_1e12_agrees(tmp_path):
    """A wrt value computed by a node (``p = w * x``, about 1e12 in its first element): its step comes from its
    value in the base run."""
    m = big_weight_model(tmp_path / "m.onnx")
    report = rg.check_gradients(rg.load(m), wrt=["p"], inputs={"x": np.array([1.0, 2.0, 3.0], np.float32)})
    assert [(r.name, r.status) for r in report.rows] == [("p", "agree")]
