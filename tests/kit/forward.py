"""Helpers for the forward-mode tests (test_forward.py): run ``rg.jvp`` / ``rg.hvp`` / ``rg.jacobian`` /
``rg.hessian`` graphs on both runtimes, the PyTorch references (``torch.func.jvp``, ``torch.autograd.functional``),
the structural check that a loop's JVP stores no residuals, and the light-model check (central differences
and the dot-product identity)."""

from __future__ import annotations

import numpy as np
import onnx
import torch

import revgraph as rg
from kit.light_models import lifted
from revgraph.autodiff.arguments import used_names
from revgraph.autodiff.loops.lower import lower_to_loops
from revgraph.ir import Graph, Node
from revgraph.ir.ssa import to_ssa
from revgraph.tools.check import to_float64

BACKENDS = ("onnxruntime", "reference")


def run_both(g: Graph, feeds: dict[str, np.ndarray], backends=BACKENDS, rtol=1e-10,
             atol=1e-12) -> dict[str, np.ndarray]:
    """``g`` checked by ``onnx.checker`` (full check) and run on each backend; the backends must agree
    (float64, to ``rtol``/``atol``). Returns the first backend's outputs by name."""
    onnx.checker.check_model(rg.to_onnx(g), full_check=True)
    results = [rg.Session(g, backend=b).run(feeds) for b in backends]
    for b, other in zip(backends[1:], results[1:], strict=True):
        for k, v in results[0].items():
            np.testing.assert_allclose(other[k], v, rtol=rtol, atol=atol, err_msg=f"{backends[0]} vs {b}: {k}")
    return results[0]


def jvp_run(g: Graph, feeds: dict[str, np.ndarray], tangents: dict[str, np.ndarray], outputs: list[str],
            backends=BACKENDS) -> tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``rg.jvp(g, outputs, inputs=list(tangents))`` run at ``feeds`` along ``tangents`` (by value name):
    ``(the JVP graph, {y: primal}, {y: J t})``."""
    jg = rg.jvp(g, outputs=outputs, inputs=list(tangents))
    assert jg.input_names[-len(tangents):] == [f"{x}_tangent" for x in tangents]
    assert jg.output_names[-len(outputs):] == [f"{y}_tangent" for y in outputs]
    out = run_both(jg, {**feeds, **{f"{x}_tangent": t for x, t in tangents.items()}}, backends)
    return jg, {y: out[y] for y in outputs}, {y: out[f"{y}_tangent"] for y in outputs}


def _tensors(values: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(np.asarray(v, np.float64)) for v in values.values())


def torch_jvp(fn, feeds: dict[str, np.ndarray], tangents: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """``torch.func.jvp`` of ``fn(**feeds)`` (a tensor or a tuple of tensors) in float64; inputs without a
    tangent get zeros. Returns the tangents of the outputs as numpy arrays."""
    names = list(feeds)
    t = {k: tangents.get(k, np.zeros_like(np.asarray(feeds[k], np.float64))) for k in names}
    _, out = torch.func.jvp(lambda *a: fn(**dict(zip(names, a, strict=True))), _tensors(feeds), _tensors(t))
    return tuple(o.numpy() for o in (out if isinstance(out, tuple) else (out,)))


def close(ours, theirs, rtol=1e-9, atol=1e-11, what=""):
    np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=atol, err_msg=what)


# ---------------------------------------------------------------------------------------------- structure


def lowered(g: Graph) -> Graph:
    """``g`` in SSA form with its ``Scan`` nodes rewritten as ``Loop`` (what ``rg.jvp`` differentiates)."""
    g = to_ssa(g)
    lower_to_loops(g, None, used_names(g))
    return g


def loop_named(g: Graph, name: str) -> Node:
    """The top-level Loop node named ``name`` (exactly one)."""
    loops = [node for node in g.nodes if node.op_type == "Loop"]
    found = [node for node in loops if node.name == name]
    assert len(found) == 1, f"{len(found)} top-level Loops named {name!r}: {[node.name for node in loops]}"
    return found[0]


def assert_loop_jvp_stores_nothing(g: Graph, jg: Graph, name: str, carried_tangents: int, scan_tangents: int,
                                   wrt: list[str], loss: str = "loss") -> None:
    """The JVP of the top-level Loop ``name`` of ``g`` adds exactly ``carried_tangents`` carried values and
    ``scan_tangents`` scan outputs (the tangents) to the forward Loop, and nothing else: no stacked
    residuals, no trip counter. The gradient of the same graph under ``checkpoint="store"`` does stack
    residuals in its forward Loop (the contrast that shows the count means something)."""
    fwd = loop_named(lowered(g), name)
    jl = loop_named(jg, name)
    assert len(jl.outputs) == len(fwd.outputs) + carried_tangents + scan_tangents, (fwd.outputs, jl.outputs)
    assert len(jl.inputs) == len(fwd.inputs) + carried_tangents
    assert jl.inputs[: len(fwd.inputs)] == fwd.inputs
    # body outputs: condition, carried, carried tangents, scans, scan tangents (the names of the Loop's own
    # outputs may change: simplify folds an Identity that renames one into it)
    body, fwd_body = jl.attrs["body"], fwd.attrs["body"]
    assert len(body.outputs) == len(fwd_body.outputs) + carried_tangents + scan_tangents
    assert len(body.inputs) == len(fwd_body.inputs) + carried_tangents
    gg = rg.gradient(g, loss, wrt=wrt, checkpoint="store")
    stored = loop_named(gg, name)
    assert len(stored.outputs) > len(fwd.outputs), "the gradient's forward loop was expected to stack residuals"


def taylor_sin(x):
    """sin(x) by its Taylor series, stopping once a term is below 1e-12 (the ONNX while loop, unrolled)."""
    term, total, k = x, x, 0
    while abs(term.detach().item()) >= 1e-12:
        term = -term * x * x / ((2 * k + 2) * (2 * k + 3))
        total, k = total + term, k + 1
    return total


def loop_body(g: Graph, name: str) -> Graph:
    """The body of the top-level Loop ``name``."""
    return next(nd for nd in g.nodes if nd.op_type == "Loop" and nd.name == name).attrs["body"]


# ---------------------------------------------------------------------------------------------- HVP, Jacobian, Hessian


def hvp_run(g, feeds, values, v, loss="loss", checkpoint="store"):
    """``rg.hvp`` of ``loss`` w.r.t. ``values`` (name -> array, initializers or graph inputs) along ``v``: the
    gradients and the HVPs by name."""
    wrt = list(values)
    hg = rg.hvp(g, loss, wrt, checkpoint=checkpoint)
    assert hg.output_names[-2 * len(wrt):] == [f"{w}_grad" for w in wrt] + [f"{w}_hvp" for w in wrt]
    out = run_both(hg, {**feeds, **{f"{w}_tangent": v[w] for w in wrt}})
    return {w: out[f"{w}_grad"] for w in wrt}, {w: out[f"{w}_hvp"] for w in wrt}


def torch_hvp(f, values, v):
    """``torch.autograd.functional.hvp`` and, as a second reference, ``torch.func.jvp`` of ``torch.func.grad``
    (forward-over-reverse, as rg.hvp does); they must agree. Returns (gradients, HVPs)."""
    primals = tuple(torch.tensor(a) for a in values.values())
    tangents = tuple(torch.tensor(v[k]) for k in values)
    _, hv = torch.autograd.functional.hvp(f, primals, tangents)
    argnums = tuple(range(len(primals)))
    grads, hv2 = torch.func.jvp(torch.func.grad(f, argnums=argnums), primals, tangents)
    for a, b in zip(hv, hv2, strict=True):
        close(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
    return ({k: t.numpy() for k, t in zip(values, grads, strict=True)},
            {k: t.numpy() for k, t in zip(values, hv, strict=True)})


def jacobian_run(g, feeds, ys, xs, mode, checkpoint="store"):
    """``rg.jacobian`` run on both backends: ``(graph, {(y, x): <y>_jacobian_<x> of shape y.shape + x.shape})``."""
    jg = rg.jacobian(g, outputs=ys, inputs=xs, mode=mode, checkpoint=checkpoint)
    names = [f"{y}_jacobian_{x}" for y in ys for x in xs]
    assert jg.output_names[-len(names):] == names
    out = run_both(jg, feeds)
    return jg, {(y, x): out[f"{y}_jacobian_{x}"] for y in ys for x in xs}


def assert_jacobians(ours, fn, feeds, ys, xs, rtol=1e-9):
    """``ours`` (from :func:`jacobian_run`) equals ``torch.autograd.functional.jacobian`` of ``fn(*xs)`` (float64),
    block by block, shapes included."""
    theirs = torch.autograd.functional.jacobian(fn, tuple(torch.tensor(feeds[x]) for x in xs))
    theirs = theirs if isinstance(theirs[0], tuple) else (theirs,)
    for i, y in enumerate(ys):
        for j, x in enumerate(xs):
            assert ours[(y, x)].shape == tuple(theirs[i][j].shape), (y, x)
            close(ours[(y, x)], theirs[i][j].numpy(), rtol=rtol, what=f"d{y}/d{x}")


def basis_trips(jg: Graph) -> int:
    """The trip count of the basis Loop of a ``rg.jacobian``/``rg.hessian`` graph (a constant)."""
    (basis,) = [nd for nd in jg.nodes if nd.op_type == "Loop" and nd.name.startswith("basis/")]
    consts = {nd.outputs[0]: nd.attrs["value"] for nd in jg.nodes if nd.op_type == "Constant"}
    return int(np.asarray({**consts, **jg.initializers}[basis.inputs[0]]))


def hessian_run(g, feeds, wrt, loss="loss", checkpoint="store"):
    """``rg.hessian`` run on both backends: ``{(a, b): d^2 loss / (da db)}`` of shape a.shape + b.shape, read from
    ``<a>_hessian`` and the cross blocks ``<a>_hessian_<b>``."""
    hg = rg.hessian(g, loss, wrt, checkpoint=checkpoint)
    names = {(a, b): f"{a}_hessian" if a == b else f"{a}_hessian_{b}" for a in wrt for b in wrt}
    assert set(names.values()) <= set(hg.output_names)
    out = run_both(hg, feeds)
    return {k: out[v] for k, v in names.items()}


def assert_hessians(ours, f, feeds, wrt, rtol=1e-9):
    """``ours`` (from :func:`hessian_run`) equals ``torch.autograd.functional.hessian`` of ``f(*wrt)``, every block."""
    theirs = torch.autograd.functional.hessian(f, tuple(torch.tensor(feeds[w]) for w in wrt))
    for i, a in enumerate(wrt):
        for j, b in enumerate(wrt):
            assert ours[(a, b)].shape == tuple(theirs[i][j].shape), (a, b)
            close(ours[(a, b)], theirs[i][j].numpy(), rtol=rtol, what=f"d2/d{a}d{b}")


# ---------------------------------------------------------------------------------------------- light models


def light_check(name: str, step: float = 1e-8):
    """J t of the light model ``name`` (its float32 [1, 3, 224, 224] input and three weight tensors, tangents
    scaled like the values) against float64 central differences ``(f(p + h t) - f(p - h t)) / 2h`` with
    ``h = step`` (a small step: a larger one moves ReLU pre-activations across their kink), and the
    dot-product identity ``<u, J t> = sum_w <(J^T u)_w, t_w>`` with the VJP of ``rg.gradient(seed="input")``;
    the float32 JVP graph under onnxruntime agrees with the float64 one to float32 accuracy."""
    g, names = lifted(name)
    x = g.inputs[0].name
    y = g.output_names[0]
    wrt = [x, names[len(names) // 2], names[-3], names[-1]]  # conv1 moves too many ReLU kinks (test_light_models)
    rng = np.random.default_rng(11)
    feeds = {x: rng.standard_normal(g.inputs[0].shape)}
    values = {**feeds, **{w: np.asarray(g.initializers[w], np.float64) for w in wrt[1:]}}
    tangents = {w: float(np.std(v)) * rng.standard_normal(v.shape) for w, v in values.items()}
    jg = rg.jvp(g, outputs=[y], inputs=wrt)
    assert jg.output_names == [y, f"{y}_tangent"]
    fed = {**feeds, **{f"{w}_tangent": t for w, t in tangents.items()}}
    jt = rg.Session(to_float64(jg), backend="reference").run(fed)[f"{y}_tangent"]
    # float64 central differences along the tangents (all at once)
    g64 = to_float64(g)
    side = []
    for sign in (1, -1):
        moved = g64.copy()
        for w in wrt[1:]:
            moved.initializers[w] = values[w] + sign * step * tangents[w]
        side.append(rg.Session(moved, backend="reference").run({x: feeds[x] + sign * step * tangents[x]})[y])
    fd = (side[0] - side[1]) / (2 * step)
    scale = float(np.abs(jt).max())
    assert scale > 0
    np.testing.assert_allclose(jt, fd, rtol=1e-4, atol=1e-5 * scale)
    # <u, J t> = sum_w <(J^T u)_w, t_w>
    gg = rg.gradient(g, y, wrt, seed="input")
    u = rng.standard_normal(jt.shape)
    vjp = rg.Session(to_float64(gg), backend="reference").run({**feeds, gg.inputs[-1].name: u})
    lhs = float(np.sum(u * jt))
    rhs = sum(float(np.sum(vjp[k] * tangents[w])) for w, k in zip(wrt, gg.output_names[-len(wrt):], strict=True))
    close(lhs, rhs, rtol=1e-9, atol=1e-12 * float(np.abs(u).sum()) * scale)
    # the float32 JVP graph under onnxruntime (no float64 Conv there)
    ort = rg.Session(jg).run({k: v.astype(np.float32) for k, v in fed.items()})
    np.testing.assert_allclose(ort[f"{y}_tangent"], jt, rtol=1e-3, atol=1e-4 * scale)
