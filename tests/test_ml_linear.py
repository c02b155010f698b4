"""``ai.onnx.ml`` ``LinearClassifier``, ``LinearRegressor`` and ``Normalizer`` (issue 41, item 8): onnxruntime's
forward of each node against the closed form written here in PyTorch float64 (onnxruntime's kernels:
linearclassifier.cc, linearregressor.cc, normalizer.cc), and revgraph's gradients of ``sum(out * u)`` with respect
to the input against float64 autograd of that closed form; the coefficients' gradients after
``lift_constants`` rewrote the linear nodes into standard operators reading initializers; refusals; and
skl2onnx's own files (LogisticRegression, LinearRegression, Normalizer pipelines) against central differences."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as h

import revgraph as rg
from revgraph.autodiff.lift import lift_constants
from revgraph.autodiff.lift_ml import lower_ml_operators

ML = "ai.onnx.ml"
F64 = torch.float64
rng = np.random.default_rng(0)


def _model(op: str, attrs: dict, x: np.ndarray, outs: list[str], opset: int = 17) -> onnx.ModelProto:
    """One ``op`` node of ``ai.onnx.ml`` over input ``x``, and ``loss = sum(out * out_u)`` over its float output."""
    node = h.make_node(op, ["x"], outs, domain=ML, name="m", **attrs)
    z = outs[-1]
    xt = onnx.helper.np_dtype_to_tensor_dtype(x.dtype)
    nodes = [node, h.make_node("Mul", [z, f"{z}_u"], ["zu"]), h.make_node("ReduceSum", ["zu"], ["loss"], keepdims=0)]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", xt, x.shape),
                                  h.make_tensor_value_info(f"{z}_u", TP.FLOAT, None)],
                     [h.make_tensor_value_info("loss", TP.FLOAT, [])]
                     + [h.make_tensor_value_info(o, TP.FLOAT if o == z else TP.STRING if "classlabels_strings" in attrs
                                                 else TP.INT64, None) for o in outs])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset), h.make_opsetid(ML, 3)])


def _check(op: str, attrs: dict, x: np.ndarray, fn, outs: list[str], *, lift: bool = False, tol: float = 1e-5):
    """Forward of onnxruntime (and of the lifted rewrite) against ``fn(x, W, b)`` (float64), and revgraph's
    gradient of the loss w.r.t. ``x`` (and, with ``lift``, the coefficients and intercepts) against autograd."""
    m = _model(op, attrs, x, outs)
    g = rg.load(m)
    plain = rg.Session(g).run({"x": x, f"{outs[-1]}_u": np.zeros((1,), np.float32)})
    z = plain[outs[-1]]
    u = rng.standard_normal(z.shape).astype(np.float32)
    feeds = {"x": x, f"{outs[-1]}_u": u}
    coef = np.asarray(attrs.get("coefficients", [0.0]), np.float64)
    w = torch.tensor(coef.reshape(len(attrs.get("intercepts", [])) or attrs.get("targets", 1), -1) if
                     op != "Normalizer" else coef, dtype=F64, requires_grad=True)
    icpt = attrs.get("intercepts")
    b = torch.tensor(np.asarray(icpt if icpt is not None else [0.0], np.float64), dtype=F64, requires_grad=True)
    xt = torch.tensor(x.astype(np.float64), requires_grad=x.dtype.kind == "f")
    label, want = fn(xt, w, b)
    np.testing.assert_allclose(z, want.detach().numpy(), rtol=tol, atol=tol, err_msg=f"{op} forward")
    if label is not None:
        np.testing.assert_array_equal(plain[outs[0]], label)
    (want * torch.tensor(u, dtype=F64)).sum().backward()
    lowered = rg.Session(lower_ml_operators(g)).run(feeds)  # (the form revgraph check runs in float64)
    for o in outs[:-1]:
        np.testing.assert_array_equal(lowered[o], plain[o])
    np.testing.assert_allclose(lowered[outs[-1]], z, rtol=1e-6, atol=1e-6)
    wrt = ["x"] if x.dtype.kind == "f" else []
    if lift:
        g, names = lift_constants(g)
        assert not any(n.domain == ML for n in g.nodes) and names == ["m.coefficients", "m.intercepts"][:len(names)]
        lifted = rg.Session(g).run(feeds)
        for o in outs[:-1]:  # (the label)
            np.testing.assert_array_equal(lifted[o], plain[o])
        np.testing.assert_allclose(lifted[outs[-1]], z, rtol=1e-6, atol=1e-6)
        wrt += names
    gg = rg.gradient(g, loss="loss", wrt=wrt)
    got = rg.Session(gg).run(feeds)
    refs = {"x": xt.grad, "m.coefficients": w.grad, "m.intercepts": b.grad}
    for n in wrt:
        ref = refs[n].numpy()
        assert got[f"{n}_grad"].shape == ref.shape and got[f"{n}_grad"].dtype == (x.dtype if n == "x" else np.float32)
        np.testing.assert_allclose(got[f"{n}_grad"], ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()),
                                   err_msg=f"{op} d{n}")
    return gg


def _softmax_zero(s: torch.Tensor) -> torch.Tensor:
    kept = s.detach().abs() > 1e-7
    m = s.max(1, keepdim=True).values
    e = torch.where(kept, (s - m).exp(), s * (-m).exp())
    return e / torch.where(kept, e, torch.zeros_like(e)).sum(1, keepdim=True)


TRANSFORMS = {"NONE": lambda s: s, "LOGISTIC": torch.sigmoid, "SOFTMAX": lambda s: s.softmax(1),
              "SOFTMAX_ZERO": _softmax_zero}


def _scores(x, w, b):
    return x.reshape(-1, w.shape[1]) @ w.T + b


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("labels", ["ints", "strings"])
def test_linear_classifier_multiclass(transform, labels):
    x = rng.standard_normal((5, 4)).astype(np.float32)
    x[0] = 0  # with intercept 0 the first score of row 0 is exactly 0: SOFTMAX_ZERO's other branch
    w, b = rng.standard_normal((3, 4)), np.array([0.0, -0.4, 0.3])
    names = ["a", "b", "c"]
    attrs = {"coefficients": w.ravel().tolist(), "intercepts": b.tolist(), "post_transform": transform,
             "multi_class": 1, **({"classlabels_ints": [4, 5, 6]} if labels == "ints" else
                                  {"classlabels_strings": names})}

    def fn(xt, wt, bt):
        s = _scores(xt, wt, bt)
        idx = s.detach().argmax(1).numpy()
        return (np.array([4, 5, 6])[idx] if labels == "ints" else np.array(names, dtype=object)[idx]), \
            TRANSFORMS[transform](s)

    _check("LinearClassifier", attrs, x, fn, ["label", "scores"], lift=True)


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_linear_classifier_one_target_two_labels(transform):
    """One coefficient row and two labels: ``[1 - p, p]`` with ``p = sigmoid(s)`` under LOGISTIC, else ``s``."""
    x = rng.standard_normal((6, 3)).astype(np.float32)
    w, b = rng.standard_normal((1, 3)), np.array([0.2])
    attrs = {"coefficients": w.ravel().tolist(), "intercepts": b.tolist(), "post_transform": transform,
             "classlabels_ints": [3, 7]}

    def fn(xt, wt, bt):
        s = _scores(xt, wt, bt)
        p = torch.sigmoid(s) if transform == "LOGISTIC" else s
        return np.where(s.detach().numpy()[:, 0] > 0, 7, 3), torch.cat([1 - p, p], 1)

    _check("LinearClassifier", attrs, x, fn, ["label", "scores"], lift=True)


def test_linear_classifier_one_target_without_labels_and_skl2onnx_binary_form():
    x = rng.standard_normal((4, 3)).astype(np.float32)
    w, b = rng.standard_normal((1, 3)), np.array([-0.1])
    one = {"coefficients": w.ravel().tolist(), "intercepts": b.tolist(), "post_transform": "LOGISTIC"}
    _check("LinearClassifier", one, x, lambda xt, wt, bt: (None, _scores(xt, wt, bt)), ["label", "scores"], lift=True)
    # skl2onnx's binary LogisticRegression: rows [w, -w], intercepts [c, -c], LOGISTIC per score
    two = {"coefficients": np.concatenate([w, -w]).ravel().tolist(), "intercepts": [0.1, -0.1],
           "post_transform": "LOGISTIC", "classlabels_ints": [0, 1]}
    _check("LinearClassifier", two, x, lambda xt, wt, bt: (None, torch.sigmoid(_scores(xt, wt, bt))),
           ["label", "scores"], lift=True)


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_linear_classifier_inputs_of_other_types_and_one_row(dtype):
    """onnxruntime casts a double or integer ``X`` to float (the gradient of a double ``X`` is double; an
    integer one has none), and a 1-D ``X`` is one row."""
    w, b = rng.standard_normal((3, 4)), np.array([0.1, 0.2, -0.3])
    attrs = {"coefficients": w.ravel().tolist(), "intercepts": b.tolist(), "post_transform": "SOFTMAX",
             "classlabels_ints": [0, 1, 2]}
    x = (rng.standard_normal((3, 4)) * 3).astype(dtype)
    fn = lambda xt, wt, bt: (None, _scores(xt, wt, bt).softmax(1))
    _check("LinearClassifier", attrs, x, fn, ["label", "scores"], lift=True)
    _check("LinearClassifier", attrs, rng.standard_normal(4).astype(np.float32), fn, ["label", "scores"], lift=True)


@pytest.mark.parametrize("targets, transform, intercepts", [(1, "NONE", True), (1, "LOGISTIC", True),
                                                            (3, "NONE", False), (3, "SOFTMAX", True),
                                                            (3, "LOGISTIC", True)])
def test_linear_regressor(targets, transform, intercepts):
    """``X W^T + b``; the post-transform applies to more than one target only (onnxruntime)."""
    x = rng.standard_normal((5, 4)).astype(np.float32)
    w, b = rng.standard_normal((targets, 4)), rng.standard_normal(targets)
    attrs = {"coefficients": w.ravel().tolist(), "targets": targets, "post_transform": transform,
             **({"intercepts": b.tolist()} if intercepts else {})}

    def fn(xt, wt, bt):
        s = xt @ wt.T + (bt if intercepts else 0)
        return None, (TRANSFORMS[transform](s) if targets > 1 else s)

    _check("LinearRegressor", attrs, x, fn, ["y"], lift=True)


def _normalize(norm):
    def fn(xt, _w, _b):
        if norm == "MAX":
            z = xt.amax(-1, keepdim=True)  # (torch splits a tie's gradient equally, as ReduceMax's rule)
        elif norm == "L1":
            z = xt.abs().sum(-1, keepdim=True)
        else:
            ss = (xt * xt).sum(-1, keepdim=True)
            z = torch.where(ss == 0, torch.ones_like(ss), ss).sqrt() * (ss != 0)
        nz = z != 0
        return None, torch.where(nz, xt / torch.where(nz, z, torch.ones_like(z)), xt)
    return fn


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer(norm):
    x = rng.standard_normal((5, 4)).astype(np.float32)
    x[1] = 0  # z == 0: y = x
    x[2] = [0.0, -1.0, -2.0, -0.5]  # MAX: a maximum of 0
    x[3] = [2.0, 2.0, 1.0, -3.0]  # MAX: a tie
    _check("Normalizer", {"norm": norm}, x, _normalize(norm), ["y"])
    _check("Normalizer", {"norm": norm}, x[4], _normalize(norm), ["y"])
    _check("Normalizer", {"norm": norm}, x.astype(np.float64), _normalize(norm), ["y"])


@pytest.mark.parametrize("op, attrs, message", [
    ("LinearClassifier", {"coefficients": [1.0, 2.0, 3.0, 4.0], "intercepts": [0.0, 1.0], "post_transform": "PROBIT",
                          "classlabels_ints": [0, 1]}, "post_transform 'PROBIT' is not supported"),
    ("LinearRegressor", {"coefficients": [1.0, 2.0, 3.0], "targets": 2}, "3 coefficients do not make 2 target rows"),
    ("Normalizer", {"norm": "L3"}, "norm 'L3' is not supported"),
])
def test_refusals_name_the_node(op, attrs, message):
    x = np.ones((2, 2), np.float32)
    g = rg.load(_model(op, attrs, x, ["label", "z"] if op == "LinearClassifier" else ["y"]))
    with pytest.raises(rg.RevgraphError) as info:
        rg.gradient(g, loss="loss", wrt=["x"])
    assert message in str(info.value) and "'m'" in str(info.value) and "\n" not in str(info.value)
    if op != "Normalizer":
        with pytest.raises(rg.RevgraphError, match=message):
            lift_constants(g)


def test_rules_state_their_facts_and_are_listed():
    from revgraph.autodiff import registry

    for op in ("LinearClassifier", "LinearRegressor", "Normalizer"):
        assert registry.DOMAIN_FACTS[(ML, op)].undeclared() == []
        assert f"{ML}.{op}" in registry.contrib_operators()


# ---------------------------------------------------------------------------------------------- skl2onnx's files


def _sklearn_cases():
    from sklearn.linear_model import LinearRegression, LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import Normalizer

    x = rng.standard_normal((40, 4))
    y3 = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 0.5)
    return x, {
        "binary": (LogisticRegression().fit(x, x[:, 0] > 0.2), "predict_proba"),
        "multiclass": (LogisticRegression().fit(x, y3), "predict_proba"),
        "l1-pipeline": (make_pipeline(Normalizer("l1"), LogisticRegression()).fit(x, y3), "predict_proba"),
        "regression": (LinearRegression().fit(x, x @ rng.standard_normal((4, 2))), "predict"),
        "l2-pipeline": (make_pipeline(Normalizer("l2"), LinearRegression()).fit(x, x[:, 0] - x[:, 3]), "predict"),
        "max-pipeline": (make_pipeline(Normalizer("max"), LinearRegression()).fit(x, x[:, 1]), "predict"),
    }


def _skl2onnx_file(model, method: str, x: np.ndarray):
    """skl2onnx's ModelProto of ``model`` (no ZipMap where ``method`` is ``predict_proba``), at opset 17, ML 3."""
    from skl2onnx import to_onnx

    head = model.steps[-1][1] if hasattr(model, "steps") else model
    options = {id(head): {"zipmap": False}} if method == "predict_proba" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return to_onnx(model, x[:1].astype(np.float32), options=options, target_opset={"": 17, ML: 3})


@pytest.mark.parametrize("case", ["binary", "multiclass", "l1-pipeline", "regression", "l2-pipeline",
                                  "max-pipeline"])
def test_skl2onnx_models_have_the_central_differences_of_sklearn(case):
    """skl2onnx's file of a scikit-learn model (no ZipMap): revgraph's gradient of ``sum(out * u)`` w.r.t. the
    input equals float64 central differences of scikit-learn's own ``predict_proba``/``predict``."""
    from kit.contrib_cases import with_loss

    x, cases = _sklearn_cases()
    model, method = cases[case]
    onx = _skl2onnx_file(model, method, x)
    assert {n.op_type for n in onx.graph.node if n.domain == ML} & {"LinearClassifier", "LinearRegressor"}
    g = rg.load(onx)
    out = [o for o in g.output_names if o != "label"]
    assert len(out) == 1
    xs = x[:5].astype(np.float32)
    if case == "max-pipeline":  # scikit-learn divides by max |x|, ONNX-ML's MAX (skl2onnx writes it) by max x:
        # equal where the element of largest magnitude is positive, so each row is made so
        xs *= np.sign(xs[np.arange(5), np.abs(xs).argmax(1)])[:, None]
    fwd = rg.Session(g).run({"X": xs} if g.inputs[0].name == "X" else {g.inputs[0].name: xs})
    name = g.inputs[0].name
    f = getattr(model, method)
    want_out = f(xs.astype(np.float64)).reshape(fwd[out[0]].shape)
    np.testing.assert_allclose(fwd[out[0]], want_out, rtol=1e-5, atol=1e-5)
    u = rng.standard_normal(fwd[out[0]].shape).astype(np.float32)
    gg = rg.gradient(with_loss(g, fwd, out), loss="loss", wrt=[name])
    got = rg.Session(gg).run({name: xs, f"{out[0]}_u": u})[f"{name}_grad"]
    eps, want = 1e-6, np.zeros(xs.shape)
    base = xs.astype(np.float64)
    for i in np.ndindex(xs.shape):
        hi, lo = base.copy(), base.copy()
        hi[i] += eps
        lo[i] -= eps
        want[i] = ((f(hi) - f(lo)).reshape(u.shape) * u).sum() / (2 * eps)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_cli_grad_lift_constants_gives_skl2onnx_coefficients_their_gradients(tmp_path, monkeypatch):
    """``revgraph grad --lift-constants --seed input`` on skl2onnx's multiclass LogisticRegression: the
    coefficients and intercepts get gradients, equal to float64 autograd of ``softmax(X W^T + b)`` (then its L1
    normalization, which skl2onnx appends) with scikit-learn's ``coef_`` and ``intercept_``."""
    from skl2onnx import to_onnx

    from revgraph.cli import main

    x, cases = _sklearn_cases()
    model = cases["multiclass"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx.save(to_onnx(model, x[:1].astype(np.float32), options={id(model): {"zipmap": False}},
                          target_opset={"": 17, ML: 3}), tmp_path / "lr.onnx")
    monkeypatch.chdir(tmp_path)
    assert main(["grad", "lr.onnx", "-o", "lr.grad.onnx", "--lift-constants", "--loss", "probabilities",
                 "--seed", "input"]) == 0
    gg = rg.load(tmp_path / "lr.grad.onnx")
    assert not any(n.domain == ML and n.op_type == "LinearClassifier" for n in gg.nodes)
    xs = x[:6].astype(np.float32)
    u = rng.standard_normal((6, 3)).astype(np.float32)
    got = rg.Session(gg).run({"X": xs, "probabilities_grad": u})
    w = torch.tensor(model.coef_, dtype=F64, requires_grad=True)
    b = torch.tensor(model.intercept_, dtype=F64, requires_grad=True)
    xt = torch.tensor(xs.astype(np.float64), requires_grad=True)
    p = (xt @ w.T + b).softmax(1)
    ((p / p.abs().sum(1, keepdim=True)) * torch.tensor(u, dtype=F64)).sum().backward()
    for name, ref in [("X_grad", xt.grad), ("LinearClassifier.coefficients_grad", w.grad),
                      ("LinearClassifier.intercepts_grad", b.grad)]:
        np.testing.assert_allclose(got[name], ref.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("case", ["l1-pipeline", "l2-pipeline"])
def test_forward_mode_through_skl2onnx_models(case):
    """``rg.jvp`` through Normalizer and LinearClassifier/LinearRegressor: the tangent of the output equals
    float64 central differences of scikit-learn's own function along the input tangent."""
    from skl2onnx import to_onnx

    x, cases = _sklearn_cases()
    model, method = cases[case]
    head = model.steps[-1][1]
    options = {id(head): {"zipmap": False}} if method == "predict_proba" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = rg.load(to_onnx(model, x[:1].astype(np.float32), options=options, target_opset={"": 17, ML: 3}))
    out = next(o for o in g.output_names if o != "label")
    jg = rg.jvp(g, outputs=[out], inputs=["X"])
    xs, t = x[:5].astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    got = rg.Session(jg).run({"X": xs, "X_tangent": t})[f"{out}_tangent"]
    f, eps, base = getattr(model, method), 1e-6, xs.astype(np.float64)
    want = ((f(base + eps * t) - f(base - eps * t)) / (2 * eps)).reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_trainer_fits_lifted_skl2onnx_coefficients_like_torch():
    """``rg.Trainer`` on skl2onnx's LinearRegression after ``lift_constants``: 5 full-batch SGD steps of the
    mean squared error move the coefficients and intercepts as ``torch.optim.SGD`` moves them in float64."""
    from skl2onnx import to_onnx

    from revgraph.train import sgd

    x, cases = _sklearn_cases()
    model = cases["regression"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = rg.load(to_onnx(model, x[:1].astype(np.float32), target_opset={"": 17, ML: 3}))
    g, names = lift_constants(g)
    assert names == ["LinearRegressor.coefficients", "LinearRegressor.intercepts"]
    xs = x[:16].astype(np.float32)
    ys = (xs @ rng.standard_normal((4, 2)) + 1).astype(np.float32)  # (other targets than the fit's)
    trainer = rg.Trainer(g, "mse", sgd(lr=0.1))
    assert sorted(trainer.parameters) == sorted(names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit({"X": xs, "labels": ys}, epochs=5, batch_size=16, shuffle=False, progress=False)
    w = torch.tensor(model.coef_, dtype=F64, requires_grad=True)
    b = torch.tensor(model.intercept_, dtype=F64, requires_grad=True)
    opt = torch.optim.SGD([w, b], lr=0.1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = ((torch.tensor(xs, dtype=F64) @ w.T + b - torch.tensor(ys, dtype=F64)) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(trainer.losses, losses, rtol=1e-5)
    np.testing.assert_allclose(trainer.parameters["LinearRegressor.coefficients"], w.detach().numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(trainer.parameters["LinearRegressor.intercepts"], b.detach().numpy(), rtol=1e-5,
                               atol=1e-6)


def test_a_zipmap_file_is_refused_in_one_line_saying_what_to_do(tmp_path, capsys):
    """skl2onnx's default classifier output is ZipMap's sequence of maps, which no gradient reaches: one line
    saying how to convert without it (item 8 covers ZipMap-free scorers)."""
    from skl2onnx import to_onnx

    from revgraph.cli import main

    x, cases = _sklearn_cases()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx.save(to_onnx(cases["multiclass"][0], x[:1].astype(np.float32), target_opset={"": 17, ML: 3}),
                  tmp_path / "zipmap.onnx")
    assert main(["grad", str(tmp_path / "zipmap.onnx"), "-o", str(tmp_path / "g.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ZipMap's output" in err and "'zipmap': False" in err


@pytest.mark.parametrize("case", ["l1-pipeline", "max-pipeline", "binary"])
def test_check_gradients_runs_skl2onnx_files_in_float64(case):
    """``revgraph check`` (``check_gradients``) runs onnxruntime's float32-only ML operators in their
    standard-operator form in float64, and revgraph's gradients (coefficients lifted) agree with its central
    differences."""
    from revgraph.tools.check import check_gradients

    x, cases = _sklearn_cases()
    model, method = cases[case]
    g = rg.load(_skl2onnx_file(model, method, x))
    out = next(o for o in g.output_names if o != "label")
    g, names = lift_constants(g)
    report = check_gradients(g, loss=out, inputs={"X": x[:4].astype(np.float32)})
    assert report.ok and {r.name for r in report.rows} >= {"X", *names}, report
    # (the note where an ML operator is left after lifting: the pipelines' Normalizer)
    assert any("standard-operator form" in n for n in report.notes) == any(n.domain == ML for n in g.nodes)
