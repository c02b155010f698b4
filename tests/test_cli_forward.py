"""`revgraph jvp`, `hvp`, `jacobian` and `hessian`: the written graphs run under onnxruntime and agree with
torch.func.jvp / torch.autograd.functional.hvp, jacobian and hessian in float64; bad input exits 2 with one line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import DATA_DIR

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "forward-mode.md"
W = np.array([[0.3, -0.7, 0.5], [0.9, 0.2, -0.4]])  # the initializer "W" [2, 3]
X = np.array([0.6, -1.3])
COMMANDS = ("jvp", "hvp", "jacobian", "hessian")


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")


@pytest.fixture
def model(tmp_path):
    """x [2] (input), W [2, 3] (initializer): h = tanh(x @ W), y = h * h [3], loss = sum(exp(y) * h) (scalar),
    n = Shape(x) (int64), all float64."""
    g = Graph(
        [
            Node("MatMul", ["x", "W"], ["z"], name="mm"),
            Node("Tanh", ["z"], ["h"], name="tanh"),
            Node("Mul", ["h", "h"], ["y"], name="square"),
            Node("Exp", ["y"], ["e"], name="exp"),
            Node("Mul", ["e", "h"], ["p"], name="mul"),
            Node("ReduceSum", ["p"], ["loss"], {"keepdims": 0}, name="sum"),
            Node("Shape", ["x"], ["n"], name="shape"),
        ],
        [ValueInfo("x", np.float64, (2,))],
        [ValueInfo("loss", np.float64, ()), ValueInfo("y", np.float64, (3,)), ValueInfo("n", np.int64, (1,))],
        {"W": W},
    )
    path = tmp_path / "model.onnx"
    rg.save(g, path)
    return path


def _torch_f(x, w):
    h = torch.tanh(x @ w)
    y = h * h
    return (torch.exp(y) * h).sum(), y


def _t(*arrays):
    return tuple(torch.tensor(a, dtype=torch.float64) for a in arrays)


def _run(path, feeds):
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def _close(got, want, name):
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
    assert got.shape == want.shape, (name, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=name)


def _one_line(capsys, *fragments):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and err.startswith("revgraph: error:"), err
    for f in fragments:
        assert f in err, (f, err)
    return err


# ----------------------------------------------------------------------------------------------- values


def test_jvp_against_torch_func_jvp(model, tmp_path, capsys):
    out = tmp_path / "jvp.onnx"
    assert main(["jvp", str(model), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 tangent input(s): x_tangent, W_tangent; 2 tangent output(s): loss_tangent, y_tangent" in printed
    assert re.search(r"wrote .*jvp\.onnx: \d+ forward \+ \d+ tangent nodes", printed), printed
    rng = np.random.default_rng(0)
    tx, tw = rng.standard_normal(2), rng.standard_normal((2, 3))
    res = _run(out, {"x": X, "x_tangent": tx, "W_tangent": tw})
    (loss, _), (t_loss, t_y) = torch.func.jvp(_torch_f, _t(X, W), _t(tx, tw))
    _close(res["loss"], loss, "loss")
    _close(res["loss_tangent"], t_loss, "loss_tangent")
    _close(res["y_tangent"], t_y, "y_tangent")
    # --checkpoint would do nothing in forward mode: refused (issue 40); and in forward-mode jacobian
    assert main(["jvp", str(model), "-o", str(out), "--checkpoint", "sqrt"]) == 2
    assert "--checkpoint has no effect on jvp" in capsys.readouterr().err
    assert main(["jacobian", str(model), "-o", str(out), "--mode", "forward", "--memory-budget", "0.5"]) == 2
    assert "--memory-budget has no effect in forward mode, which builds no gradient" in capsys.readouterr().err
    # one output and one input; --opset writes another opset
    assert main(["jvp", str(model), "-o", str(out), "--outputs", "y", "--inputs", "x", "--opset", "18"]) == 0
    assert "1 tangent input(s): x_tangent; 1 tangent output(s): y_tangent" in capsys.readouterr().out
    assert [o.version for o in onnx.load(str(out)).opset_import if o.domain == ""] == [18]
    res = _run(out, {"x": X, "x_tangent": tx})
    _, t_y = torch.func.jvp(lambda x: _torch_f(x, torch.tensor(W))[1], _t(X), _t(tx))
    _close(res["y_tangent"], t_y, "y_tangent along x")


def test_hvp_against_torch_autograd_functional_hvp(model, tmp_path, capsys):
    out = tmp_path / "hvp.onnx"
    assert main(["hvp", str(model), "-o", str(out), "--loss", "loss"]) == 0
    printed = capsys.readouterr().out
    assert "2 tangent input(s): x_tangent, W_tangent; 4 gradient and HVP output(s): x_grad, W_grad, x_hvp, W_hvp" \
        in printed
    rng = np.random.default_rng(1)
    tx, tw = rng.standard_normal(2), rng.standard_normal((2, 3))
    res = _run(out, {"x": X, "x_tangent": tx, "W_tangent": tw})
    xt, wt = (t.requires_grad_() for t in _t(X, W))
    grads = torch.autograd.grad(_torch_f(xt, wt)[0], (xt, wt))
    _, (h_x, h_w) = torch.autograd.functional.hvp(lambda x, w: _torch_f(x, w)[0], _t(X, W), _t(tx, tw))
    for name, want in (("x_grad", grads[0]), ("W_grad", grads[1]), ("x_hvp", h_x), ("W_hvp", h_w)):
        _close(res[name], want, name)


def test_jacobian_modes_against_torch_autograd_functional_jacobian(model, tmp_path, capsys):
    jac = torch.autograd.functional.jacobian(lambda x, w: _torch_f(x, w)[1], _t(X, W))  # dy/dx [3, 2], dy/dW [3, 2, 3]
    for mode, note in (("forward", "(forward mode)"), ("reverse", "(reverse mode)"),
                       ("auto", "(reverse mode, chosen by --mode auto)")):  # 8 input elements > 3 output elements
        out = tmp_path / f"jacobian_{mode}.onnx"
        assert main(["jacobian", str(model), "-o", str(out), "--outputs", "y", "--mode", mode]) == 0
        assert f"{note}; 2 Jacobian output(s): y_jacobian_x, y_jacobian_W" in capsys.readouterr().out
        res = _run(out, {"x": X})
        _close(res["y_jacobian_x"], jac[0], f"{mode} y_jacobian_x")
        _close(res["y_jacobian_W"], jac[1], f"{mode} y_jacobian_W")
    out = tmp_path / "jacobian_x.onnx"  # 2 input elements <= 3 + 1 output elements: forward
    assert main(["jacobian", str(model), "-o", str(out), "--inputs", "x", "--checkpoint", "recompute"]) == 2
    assert "--checkpoint has no effect in forward mode (chosen by --mode auto)" in capsys.readouterr().err
    assert main(["jacobian", str(model), "-o", str(out), "--inputs", "x"]) == 0
    assert "(forward mode, chosen by --mode auto); 2 Jacobian output(s): loss_jacobian_x, y_jacobian_x" \
        in capsys.readouterr().out
    res = _run(out, {"x": X})
    full = torch.autograd.functional.jacobian(lambda x: _torch_f(x, torch.tensor(W)), torch.tensor(X))
    _close(res["loss_jacobian_x"], full[0], "loss_jacobian_x")
    _close(res["y_jacobian_x"], full[1], "y_jacobian_x")


def test_hessian_against_torch_autograd_functional_hessian(model, tmp_path, capsys):
    out = tmp_path / "hessian.onnx"
    assert main(["hessian", str(model), "-o", str(out), "--loss", "loss", "--wrt", "x", "W"]) == 0
    assert "x_hessian, x_hessian_W, W_hessian_x, W_hessian" in capsys.readouterr().out
    res = _run(out, {"x": X})
    hes = torch.autograd.functional.hessian(lambda x, w: _torch_f(x, w)[0], _t(X, W))
    blocks = {"x_hessian": hes[0][0], "x_hessian_W": hes[0][1], "W_hessian_x": hes[1][0], "W_hessian": hes[1][1]}
    for name, want in blocks.items():
        _close(res[name], want, name)


def test_taken_tangent_name_gets_a_suffix_and_is_printed(tmp_path, capsys):
    g = Graph([Node("Sin", ["x"], ["x_tangent"], name="sin"), Node("Mul", ["x_tangent", "x"], ["y"], name="mul")],
              [ValueInfo("x", np.float64, (3,))], [ValueInfo("y", np.float64, (3,))])
    rg.save(g, tmp_path / "m.onnx")
    assert main(["jvp", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "j.onnx")]) == 0
    assert "1 tangent input(s): x_tangent_1; 1 tangent output(s): y_tangent" in capsys.readouterr().out
    x, t = np.array([0.1, 1.2, -2.0]), np.array([1.0, -0.5, 2.0])
    res = _run(tmp_path / "j.onnx", {"x": x, "x_tangent_1": t})
    _close(res["y_tangent"], (np.cos(x) * x + np.sin(x)) * t, "y_tangent")


def test_unconnected_output_gets_a_zero_tangent_and_a_warning_line(tmp_path, capsys):
    g = Graph([Node("Exp", ["x"], ["y"], name="exp"), Node("Sin", ["z"], ["w"], name="sin")],
              [ValueInfo("x", np.float64, (2,)), ValueInfo("z", np.float64, (2,))],
              [ValueInfo("y", np.float64, (2,)), ValueInfo("w", np.float64, (2,))])
    rg.save(g, tmp_path / "m.onnx")
    assert main(["jvp", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "j.onnx"), "--inputs", "x"]) == 0
    assert capsys.readouterr().err.strip() == "warning: no path from the inputs to 'w'; their tangents are zero"
    x, z, t = np.array([0.5, -1.0]), np.array([2.0, 3.0]), np.array([1.5, -0.25])
    res = _run(tmp_path / "j.onnx", {"x": x, "z": z, "x_tangent": t})
    _close(res["y_tangent"], np.exp(x) * t, "y_tangent")
    _close(res["w_tangent"], np.zeros(2), "w_tangent")


def test_loop_hvp_with_sqrt_checkpoints_and_loop_jvp(tmp_path, capsys):
    from kit.loops import body, graph, loop, n

    b = body([n("Mul", ["s_in", "x"], "s_out"), n("Sin", ["s_out"], "y")], [("s_in", "s_out")], scan=["y"],
             types={"s_in": (3,), "s_out": (3,)})
    g = graph([loop(b, "M", ["s0"], ["s", "Y"]), n("ReduceSum", ["Y"], "loss", keepdims=0)],
              {"x": (3,), "s0": (3,)}, ["loss"], {"M": np.array(9, np.int64)})
    rg.save(g, tmp_path / "loop.onnx")

    def f(x, s0):
        s, total = s0, 0
        for _ in range(9):
            s = s * x
            total = total + torch.sin(s).sum()
        return total

    x, s0 = np.array([0.9, 1.1, -0.5]), np.array([0.3, 0.2, 0.1])
    rng = np.random.default_rng(2)
    tx, ts = rng.standard_normal(3), rng.standard_normal(3)
    feeds = {"x": x, "s0": s0, "x_tangent": tx, "s0_tangent": ts}
    counts = {}
    for policy in ("store", "sqrt"):  # the policy reaches the gradient: sqrt adds the checkpointing loops
        out = tmp_path / f"loop.hvp.{policy}.onnx"
        assert main(["hvp", str(tmp_path / "loop.onnx"), "-o", str(out), "--checkpoint", policy]) == 0
        counts[policy] = int(re.search(r"(\d+) derivative nodes", capsys.readouterr().out).group(1))
    assert counts["sqrt"] > counts["store"], counts
    res = _run(out, feeds)
    _, (h_x, h_s) = torch.autograd.functional.hvp(f, _t(x, s0), _t(tx, ts))
    _close(res["x_hvp"], h_x, "x_hvp")
    _close(res["s0_hvp"], h_s, "s0_hvp")
    assert main(["jvp", str(tmp_path / "loop.onnx"), "-o", str(tmp_path / "loop.jvp.onnx")]) == 0
    res = _run(tmp_path / "loop.jvp.onnx", feeds)
    _, t_loss = torch.func.jvp(f, _t(x, s0), _t(tx, ts))
    _close(res["loss_tangent"], t_loss, "loss_tangent")
    capsys.readouterr()


# -------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_name_exits_2_with_one_line(command, model, tmp_path, capsys):
    out = tmp_path / "o.onnx"
    flag = "--outputs" if command in ("jvp", "jacobian") else "--loss"
    assert main([command, str(model), "-o", str(out), flag, "los"]) == 2
    _one_line(capsys, "'los'", "did you mean 'loss'")
    flag = "--inputs" if command in ("jvp", "jacobian") else "--wrt"
    assert main([command, str(model), "-o", str(out), *(["--loss", "loss"] if "hess" in command or command == "hvp"
                                                          else []), flag, "V"]) == 2
    _one_line(capsys, "'V'")
    assert not out.exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_integer_output_exits_2(command, model, tmp_path, capsys):
    flag = "--outputs" if command in ("jvp", "jacobian") else "--loss"
    assert main([command, str(model), "-o", str(tmp_path / "o.onnx"), flag, "n"]) == 2
    _one_line(capsys, "'n'")
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_output_path_equal_to_the_model_exits_2(command, model, capsys):
    before = model.read_bytes()
    assert main([command, str(model), "-o", str(model)]) == 2
    _one_line(capsys, "is the same file as the model")
    assert model.read_bytes() == before


def test_usage_errors_exit_2(model, tmp_path, capsys):
    out = str(tmp_path / "o.onnx")
    assert main(["jacobian", str(model), "-o", out, "--mode", "sideways"]) == 2
    _one_line(capsys, "--mode", "'sideways'", "'auto'", "'forward'", "'reverse'")
    assert main(["jvp", str(model), "-o", out, "--checkpoint", "often"]) == 2
    _one_line(capsys, "unknown checkpoint policy 'often'")
    assert main(["jacobian", str(model), "-o", out, "--mode", "forward", "--checkpoint", "0"]) == 2
    _one_line(capsys, "unknown checkpoint policy '0'")
    assert main(["hessian", str(model), "-o", out, "--opset", "99"]) == 2
    _one_line(capsys, "argument --opset", "'99'", "from 7 to")  # (refused at parse time: revgraph.cli.numeric)
    assert main(["hvp", str(model)]) == 2
    _one_line(capsys, "-o")
    assert not (tmp_path / "o.onnx").exists()


# ------------------------------------------------------------------------------------------------ guide


def test_guide_section_runs_as_printed(tmp_path, monkeypatch, capsys):
    """Each command in the forward-mode guide (docs/guides/forward-mode.md) prints what its comment says."""
    text = GUIDE.read_text()
    section = text[text.index("# Forward mode, Hessian-vector products, Jacobians and Hessians"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL).group(1)
    mm = DATA_DIR / "pytorch-operator" / "test_operator_mm" / "model.onnx"
    monkeypatch.chdir(tmp_path)
    commands = [ln for ln in block.splitlines() if ln.startswith("revgraph ")]
    assert [shlex.split(c)[1] for c in commands] == list(COMMANDS)
    for line, said in zip(commands, [ln for ln in block.splitlines() if ln.startswith("# wrote")], strict=True):
        argv = [str(mm) if a == "$M" else a for a in shlex.split(line.split("#")[0])]
        assert main(argv[1:]) == 0, line
        assert capsys.readouterr().out.strip() == said.removeprefix("# "), line
