"""Gradient checking for tests, independent of revgraph's own checker.

For a one-node (or small) graph built with the IR, :func:`check_rule` checks revgraph's gradient three ways:
1. float64 central differences of ``f(x) = sum(u * y(x))`` along random directions (the forward graph run
   by onnxruntime), against the VJP that the gradient graph computes (run by onnxruntime and by the
   reference evaluator, which must agree);
2. PyTorch autograd on the same function (``torch_fn``), with the same cotangent ``u``;
3. second order: the gradient of ``s(x) = sum_i <grad_i(x), v_i>`` (a Hessian-vector product, built by
   differentiating the gradient graph) against central differences of the gradient graph along ``v``;
4. forward mode: the JVP graph ``rg.jvp(g, outputs, wrt)`` (run by onnxruntime and by the reference evaluator,
   which must agree) at random tangents ``t``, against ``torch.func.jvp`` of ``torch_fn``, against central
   differences of the forward graph along ``t``, and against the VJP of 1. by the dot-product identity
   ``<J t, u> = <t, J^T u>``; and no tangent may depend on the value of a cotangent placeholder (the zeros
   forward.py names ``jvp/zero_cotangent``, which the transposition of a VJP not linear in its cotangent would
   read, so that its JVP could be wrong). Reads of the placeholder's shape only are allowed: with unknown
   dimensions a transposed VJP reads the shapes of values computed from it (``Shape``, ``Size``, ``CastLike``'s
   type input, ``SequenceLength``).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.ir.ssa import captured_names

H = 1e-6


def one_node_graph(op_type: str, inputs: dict[str, np.ndarray], attrs: dict | None = None, n_out: int = 1,
                   float_inputs: list[str] | None = None, domain: str = "") -> Graph:
    """A graph with one node: floating arrays become graph inputs, others initializers."""
    float_inputs = [k for k, v in inputs.items() if v.dtype.kind == "f"] if float_inputs is None else float_inputs
    outs = [f"y{i}" for i in range(n_out)]
    return Graph(
        nodes=[Node(op_type, list(inputs), outs, dict(attrs or {}), "op", domain)],
        inputs=[ValueInfo(k, v.dtype, v.shape) for k, v in inputs.items() if k in float_inputs],
        outputs=[ValueInfo(o) for o in outs],
        initializers={k: v for k, v in inputs.items() if k not in float_inputs},
    )


def ort_runner(model_graph: Graph):
    """Run with onnxruntime; where it has no float64 kernel for an op (Erf, Conv, ...), with the reference
    evaluator instead (both are checked against each other on the gradient graph when both can run it)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        sess = ort.InferenceSession(rg.to_onnx(model_graph).SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
    except Exception as exc:
        if "NOT_IMPLEMENTED" not in str(exc):
            raise
        ref = rg.Session(model_graph, backend="reference")
        return ref.run
    names = [o.name for o in sess.get_outputs()]
    # copies: onnxruntime may write an in-place output (BatchNormalization's running statistics) into a fed array
    return lambda feeds: dict(zip(names, sess.run(None, {k: np.array(v) for k, v in feeds.items()}), strict=True))


def with_loss(g: Graph, fwd: dict[str, np.ndarray], outputs: list[str] | None = None) -> tuple[Graph, list[str]]:
    """``g`` plus inputs ``<y>_u`` and a scalar output ``loss = sum_y sum(y * <y>_u)``."""
    g = g.copy()
    outputs = outputs or g.output_names
    parts = []
    for y in outputs:
        u = f"{y}_u"
        g.inputs.append(ValueInfo(u, fwd[y].dtype, fwd[y].shape))
        g.nodes.append(Node("Mul", [y, u], [f"{y}_uy"], name=f"loss/{y}/mul"))
        g.nodes.append(Node("ReduceSum", [f"{y}_uy"], [f"{y}_s"], {"keepdims": 0}, name=f"loss/{y}/sum"))
        parts.append(f"{y}_s")
    g.nodes.append(Node("Sum", parts, ["loss"], name="loss/sum"))
    g.outputs = [ValueInfo("loss")]
    return g, outputs


def double_backward(gg: Graph, wrt: list[str], feeds: dict[str, np.ndarray], dtype=None) -> Graph:
    """Hessian-vector products by reverse-over-reverse: the gradient with respect to ``wrt`` of
    ``s = sum_w <w_grad, w_v>`` over the gradient graph ``gg`` (outputs ``<w>_grad``), which gets inputs ``<w>_v``
    of each feed's shape (and dtype, or ``dtype``). Its last ``len(wrt)`` outputs are ``H v`` (zeros, without a
    warning, where ``s`` has no path: a linear function)."""
    hv = gg.copy()
    parts = []
    for w in wrt:
        hv.inputs.append(ValueInfo(f"{w}_v", np.dtype(dtype or feeds[w].dtype), feeds[w].shape))
        hv.nodes += [Node("Mul", [f"{w}_grad", f"{w}_v"], [f"{w}_gv"], name=f"hv/{w}/mul"),
                     Node("ReduceSum", [f"{w}_gv"], [f"{w}_gvs"], {"keepdims": 0}, name=f"hv/{w}/sum")]
        parts.append(f"{w}_gvs")
    hv.nodes.append(Node("Sum", parts, ["hv/s"], name="hv/sum"))  # not "s": an input of that name would shadow it
    hv.outputs = [ValueInfo("hv/s")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rg.gradient(hv, loss="hv/s", wrt=wrt, unconnected="zero")


def check_rule(g: Graph, feeds: dict[str, np.ndarray], torch_fn=None, *, wrt: list[str] | None = None,
               outputs: list[str] | None = None, seed: int = 0, rtol: float = 1e-5, atol: float = 1e-7,
               second_order: bool = True, fd_with_torch: bool = False, no_jvp: str | None = None,
               no_torch_jvp: str | None = None, torch_jvp_by_vjp: str | None = None) -> dict[str, np.ndarray]:
    """Check revgraph's gradients of ``g`` at ``feeds`` four ways (module doc); return the gradients.

    ``fd_with_torch``: take the central differences of ``torch_fn`` instead of the ONNX forward graph, for
    ops whose only float64 ONNX implementation is not float64-accurate (the reference ``Erf`` rounds to
    float32 and onnxruntime has no float64 ``Erf``). ``no_jvp``: the reason forward mode (check 4) is not
    checked; ``no_torch_jvp``: the reason its comparison with ``torch.func.jvp`` is left out (the other
    three comparisons stay); ``torch_jvp_by_vjp``: the reason PyTorch's JVP is taken by double backward
    (``torch.autograd.functional.jvp``) instead of its forward-mode AD."""
    rng = np.random.default_rng(seed)
    feeds = {k: np.asarray(v) for k, v in feeds.items()}
    run_fwd = ort_runner(g)
    fwd = run_fwd(feeds)
    lg, outputs = with_loss(g, fwd, outputs)
    us = {f"{y}_u": rng.standard_normal(np.shape(fwd[y])).astype(fwd[y].dtype) for y in outputs}
    wrt = wrt or [v.name for v in g.inputs if feeds[v.name].dtype.kind == "f"]
    gg = rg.gradient(lg, loss="loss", wrt=wrt)
    run_grad = ort_runner(gg)
    grads_ort = run_grad({**feeds, **us})
    ref = rg.Session(gg, backend="reference").run({**feeds, **us})
    grads = {w: grads_ort[f"{w}_grad"] for w in wrt}
    for w in wrt:
        assert grads[w].shape == feeds[w].shape, (w, grads[w].shape, feeds[w].shape)
        np.testing.assert_allclose(ref[f"{w}_grad"], grads[w], rtol=1e-6, atol=1e-9, err_msg=f"ORT vs reference, {w}")

    # 1. central differences along random directions
    run_loss = ort_runner(lg)
    if fd_with_torch:
        def run_loss(f):
            outs = torch_fn(**{k: torch.tensor(f[k]) for k in feeds})
            outs = outs if isinstance(outs, (tuple, list)) else [outs]
            return {"loss": sum(float((t * torch.tensor(f[f"{y}_u"])).sum())
                                for y, t in zip(outputs, outs, strict=False))}
    for _ in range(2):
        v = {w: rng.standard_normal(feeds[w].shape) for w in wrt}
        plus = {**feeds, **us, **{w: feeds[w] + H * v[w] for w in wrt}}
        minus = {**feeds, **us, **{w: feeds[w] - H * v[w] for w in wrt}}
        numeric = (run_loss(plus)["loss"] - run_loss(minus)["loss"]) / (2 * H)
        analytic = sum(float(np.sum(grads[w] * v[w])) for w in wrt)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-6, err_msg="central differences")

    # 2. PyTorch autograd
    if torch_fn is not None:
        tin = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
        tout = torch_fn(**tin)
        tout = tout if isinstance(tout, (tuple, list)) else [tout]
        for y, t in zip(outputs, tout, strict=False):
            np.testing.assert_allclose(t.detach().numpy(), fwd[y], rtol=1e-6, atol=1e-9,
                                       err_msg=f"forward {y} vs torch")
        total = sum((t * torch.tensor(us[f"{y}_u"])).sum() for y, t in zip(outputs, tout, strict=False))
        tg = torch.autograd.grad(total, [tin[w] for w in wrt], allow_unused=True)
        for w, t in zip(wrt, tg, strict=True):
            expected = np.zeros_like(feeds[w]) if t is None else t.numpy()
            np.testing.assert_allclose(grads[w], expected, rtol=rtol, atol=atol, err_msg=f"torch autograd, {w}")

    # 3. second order: Hessian-vector product against differences of the gradient graph
    if second_order:
        vs = {f"{w}_v": rng.standard_normal(feeds[w].shape) for w in wrt}
        hvp = double_backward(gg, wrt, feeds)  # a linear function has a zero Hessian: no path, zeros
        got = ort_runner(hvp)({**feeds, **us, **vs})
        got = dict(zip(wrt, (got[n] for n in hvp.output_names[-len(wrt):]), strict=True))
        v = {w: vs[f"{w}_v"] for w in wrt}
        plus = run_grad({**feeds, **us, **{w: feeds[w] + H * v[w] for w in wrt}})
        minus = run_grad({**feeds, **us, **{w: feeds[w] - H * v[w] for w in wrt}})
        for w in wrt:
            numeric = (plus[f"{w}_grad"] - minus[f"{w}_grad"]) / (2 * H)
            np.testing.assert_allclose(got[w], numeric, rtol=1e-4, atol=1e-5, err_msg=f"second order, {w}")

    # 4. forward mode
    if no_jvp is None:
        check_jvp(g, feeds, torch_fn, wrt=wrt, outputs=outputs, grads=grads, us={y: us[f"{y}_u"] for y in outputs},
                  run_fwd=run_fwd, fwd=fwd, rng=rng, rtol=rtol, atol=atol, fd_with_torch=fd_with_torch,
                  against_torch=no_torch_jvp is None, torch_by_vjp=torch_jvp_by_vjp is not None)
    return grads


#: inputs of which only the shape, dtype or length is read (by position): such a read of a cotangent placeholder
#: is harmless, as the placeholder has the primal's shape and dtype
SHAPE_ONLY = {"Shape": {0}, "Size": {0}, "CastLike": {1}, "SequenceLength": {0}}


def _cotangent_taint(graph: Graph, tainted: set[str], readers: list[str]) -> set[str]:
    """The values of ``graph`` whose *values* depend on a placeholder cotangent of forward.py (zeros named
    ``jvp/zero_cotangent/...``: only a VJP not linear in its cotangent makes the transposition read one), or
    on ``tainted`` (captured or fed ones); reads of only a shape or dtype (:data:`SHAPE_ONLY`) do not count.
    Loop and If outputs are followed one by one (a Loop's carried values to a fixpoint). ``readers`` gains the
    nodes computing such values."""
    tainted = set(tainted)
    for node in graph.nodes:
        if "jvp/zero_cotangent" in (node.name or "") and node.op_type in ("ConstantOfShape", "CastLike"):
            tainted.update(node.outputs)
            continue
        skip = SHAPE_ONLY.get(node.op_type, set()) if not node.domain else set()
        fed = [bool(i) and i in tainted and k not in skip for k, i in enumerate(node.inputs)]
        if node.op_type == "Loop" and not node.domain:
            body = node.attrs["body"]
            n = len(node.inputs) - 2
            carried = [fed[2 + j] for j in range(n)]
            while True:
                ins = {b for b, t in zip(body.input_names[2:], carried, strict=True) if t}
                inner = _cotangent_taint(body, tainted | ins, [])
                grown = [c or o in inner for c, o in zip(carried, body.output_names[1 : 1 + n], strict=True)]
                if grown == carried:
                    break
                carried = grown
            _cotangent_taint(body, tainted | ins, readers)
            hit = [c or any(fed[:2]) for c in carried] + [o in inner or any(fed[:2])
                                                           for o in body.output_names[1 + n :]]
        elif node.op_type == "If" and not node.domain:
            inners = [_cotangent_taint(node.attrs[k], tainted, readers) for k in ("then_branch", "else_branch")]
            hit = [fed[0] or any(node.attrs[k].output_names[m] in inner
                                 for k, inner in zip(("then_branch", "else_branch"), inners, strict=True))
                   for m in range(len(node.outputs))]
        else:
            any_hit = any(fed) or any(c in tainted for sg in node.subgraphs.values() for c in captured_names(sg))
            hit = [any_hit] * len(node.outputs)
        if any(hit):
            readers.append(f"{node.op_type} {node.name}")
            tainted.update(o for o, h in zip(node.outputs, hit, strict=True) if o and h)
    return tainted


def _torch_jvp(torch_fn, feeds: dict[str, np.ndarray], wrt: list[str], tangents: dict[str, np.ndarray],
               by_vjp: bool = False) -> list:
    """``J t`` of ``torch_fn`` (called with every feed; ``wrt`` varies) by ``torch.func.jvp``, or by
    ``torch.autograd.functional.jvp`` (double backward: the VJP of the VJP) when ``by_vjp``."""
    consts = {k: torch.tensor(v) for k, v in feeds.items() if k not in wrt}

    def f(*xs):
        outs = torch_fn(**consts, **dict(zip(wrt, xs, strict=True)))
        return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)

    primals = tuple(torch.tensor(feeds[w]) for w in wrt)
    dirs = tuple(torch.tensor(tangents[w]) for w in wrt)
    try:
        if by_vjp:
            raise NotImplementedError
        _, jt = torch.func.jvp(f, primals, dirs)
    except NotImplementedError:
        # an op without a forward-mode AD formula in torch: the double-backward trick of
        # torch.autograd.functional.jvp computes the same J t from torch's VJPs
        _, jt = torch.autograd.functional.jvp(f, primals, dirs)
    except RuntimeError as exc:
        if "functorch transform" not in str(exc):
            raise
        # torch.nn's RNN modules write parameters through .data (flatten_parameters), which torch.func refuses
        _, jt = torch.autograd.functional.jvp(f, primals, dirs)
    return [t.detach().numpy() for t in jt]


def check_jvp(g: Graph, feeds: dict[str, np.ndarray], torch_fn, *, wrt: list[str], outputs: list[str],
              grads: dict[str, np.ndarray], us: dict[str, np.ndarray], run_fwd, fwd: dict[str, np.ndarray],
              rng: np.random.Generator, rtol: float, atol: float, fd_with_torch: bool = False,
              against_torch: bool = True, torch_by_vjp: bool = False) -> None:
    """Check 4 of :func:`check_rule` (module doc). ``grads``: the VJP ``J^T u`` at the cotangents ``us``
    (one per output); ``run_fwd``, ``fwd``: the forward graph's runner and its outputs at ``feeds``;
    ``fd_with_torch``: central differences of ``torch_fn`` instead (as check 1); ``against_torch``: compare
    with PyTorch's JVP (when ``torch_fn`` is given), by double backward when ``torch_by_vjp``."""
    jg = rg.jvp(g, outputs=outputs, inputs=wrt)
    readers: list[str] = []
    tainted = _cotangent_taint(jg, set(), readers)
    left = [y for y in jg.output_names if y in tainted]
    assert not left, (f"the JVP's values depend on a cotangent placeholder (a VJP rule not linear in its "
                      f"cotangent?): {left} through {readers[:12]}")
    t_names = [v.name for v in jg.inputs[len(jg.inputs) - len(wrt):]]
    y_names = jg.output_names[len(jg.output_names) - len(outputs):]
    ts = {w: rng.standard_normal(feeds[w].shape).astype(feeds[w].dtype) for w in wrt}
    jfeeds = {**feeds, **{n: ts[w] for n, w in zip(t_names, wrt, strict=True)}}
    got = ort_runner(jg)(jfeeds)
    ref = rg.Session(jg, backend="reference").run(jfeeds)
    jt = {y: got[n] for y, n in zip(outputs, y_names, strict=True)}
    for y, n in zip(outputs, y_names, strict=True):
        assert jt[y].shape == np.shape(fwd[y]) and jt[y].dtype == fwd[y].dtype, (y, jt[y].shape, jt[y].dtype)
        np.testing.assert_allclose(ref[n], jt[y], rtol=1e-6, atol=1e-9, err_msg=f"JVP: ORT vs reference, {y}")
        if y in got:
            np.testing.assert_allclose(got[y], fwd[y], rtol=1e-6, atol=1e-9, err_msg=f"JVP graph's forward {y}")

    # the dot-product identity against the VJP of check 1
    lhs = sum(float(np.sum(jt[y].astype(np.float64) * us[y])) for y in outputs)
    rhs = sum(float(np.sum(ts[w].astype(np.float64) * grads[w])) for w in wrt)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=1e-6, err_msg="JVP: <J t, u> vs <t, J^T u>")

    # float64 central differences of the forward graph along t
    plus = {**feeds, **{w: feeds[w] + H * ts[w] for w in wrt}}
    minus = {**feeds, **{w: feeds[w] - H * ts[w] for w in wrt}}
    if fd_with_torch:  # the ONNX forward is not float64-accurate (see check_rule)
        def run_y(f):
            outs = torch_fn(**{k: torch.tensor(f[k]) for k in feeds})
            outs = outs if isinstance(outs, (tuple, list)) else [outs]
            return {y: t.detach().numpy() for y, t in zip(outputs, outs, strict=False)}
    else:
        run_y = run_fwd
    yp, ym = run_y(plus), run_y(minus)
    for y in outputs:
        numeric = (yp[y].astype(np.float64) - ym[y].astype(np.float64)) / (2 * H)
        np.testing.assert_allclose(jt[y], numeric, rtol=1e-5, atol=1e-6, err_msg=f"JVP vs central differences, {y}")

    # PyTorch's forward mode
    if torch_fn is not None and against_torch:
        expected = _torch_jvp(torch_fn, feeds, wrt, ts, torch_by_vjp)
        for y, e in zip(outputs, expected, strict=False):
            np.testing.assert_allclose(jt[y], e, rtol=rtol, atol=atol, err_msg=f"JVP vs PyTorch's, {y}")


def one_line_error(code: int, err: str, *fragments: str) -> None:
    """A command's bad-input failure as the contract has it: exit 2, one line ``revgraph: error: ...`` holding
    every fragment, and no traceback."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("revgraph: error:"), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def crash_after(trainer, steps: int) -> None:
    """Make ``trainer`` die (``KeyboardInterrupt``, as a killed run) when it is about to take step ``steps + 1``:
    a run interrupted after its checkpoints up to there, for the resume tests."""
    real = trainer._engine.step

    def step(*args, **kwargs):
        if trainer.steps == steps:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    trainer._engine.step = step


# --------------------------------------------------- output paths: full disks and device nodes (as root)


def mount_tmpfs(d, *options: str) -> bool:
    """Mount a 64 KiB tmpfs on ``d`` (made if missing); False without root or where mounting is not allowed."""
    if os.geteuid() != 0:
        return False
    d.mkdir(exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(["size=64k", *options]), "tmpfs", str(d)],
                          check=False, capture_output=True, timeout=20).returncode == 0


def umount(d) -> None:
    """Unmount what :func:`mount_tmpfs` mounted on ``d``."""
    subprocess.run(["umount", "-l", str(d)], check=False, capture_output=True, timeout=20)


def fill_disk(d) -> None:
    """Fill the file system of ``d`` to the last byte."""
    with open(d / "filler", "wb", buffering=0) as f:  # (unbuffered: nothing left to flush at close)
        for size in (4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def char_device(d, name: str, minor: int):
    """A private copy of /dev/null (minor 3) or /dev/full (minor 7): a broken write would replace it, never the
    system's. Without root (no mknod), the system's own, which only root could replace."""
    if os.geteuid() != 0:
        return Path("/dev/null" if minor == 3 else "/dev/full")
    path = d / name
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    return path
#: Runs ``python -m revgraph ARGS`` under the address-space limit ``REVGRAPH_TEST_AS`` and writes its peak
#: resident memory (``VmHWM``, this process image only) in KiB to the file ``REVGRAPH_TEST_PEAK``.
_LIMITED_RUNNER = """
import atexit, os, resource, runpy, sys
limit = int(os.environ["REVGRAPH_TEST_AS"])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
def peak():
    with open("/proc/self/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith("VmHWM"))
    with open(os.environ["REVGRAPH_TEST_PEAK"], "w") as f:
        f.write(kb)
atexit.register(peak)
sys.argv[0] = "revgraph"
runpy.run_module("revgraph", run_name="__main__", alter_sys=True)
"""


def cli_under_limit(*args, address_space: int = 3 << 30, cwd=None, timeout: float = 240) -> tuple[int, int, str, str]:
    """Run ``python -m revgraph ARGS`` in a fresh process (working directory ``cwd``) under an address-space
    limit (``RLIMIT_AS``) of ``address_space`` bytes; return its exit code, its peak resident memory in MiB,
    its stdout and its stderr. The child gets this process's environment (``PYTHONPATH`` included)."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        peak_file = os.path.join(tmp, "peak")
        env = {**os.environ, "REVGRAPH_TEST_AS": str(address_space), "REVGRAPH_TEST_PEAK": peak_file}
        try:
            proc = subprocess.run([sys.executable, "-c", _LIMITED_RUNNER, *map(str, args)], capture_output=True,
                                  text=True, errors="replace", env=env, timeout=timeout, cwd=cwd, check=False)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"revgraph {args[0]} did not finish within {timeout} s") from None
        peak_mb = -1  # the child died before its exit handler (a signal)
        if os.path.exists(peak_file):
            with open(peak_file) as f:
                peak_mb = int(f.read()) // 1024
    return proc.returncode, peak_mb, proc.stdout, proc.stderr
