"""Forward mode: revgraph's JVP graphs against its VJP graphs, PyTorch's torch.func.jvp and JAX's jax.jvp.

For three models (float32, CPU, one thread):

- **mlp**: ``h = tanh(h W_i + b_i)``, 4 layers of width 512, batch 64; output the last ``h``.
- **transformer**: one post-norm encoder block, batch 8, sequence 64, width 256, 4 heads, feed-forward 1024:
  attention written with ``MatMul``/``Softmax`` (no ``Attention`` node), out projection, residual,
  ``LayerNormalization``, ``Relu`` MLP, residual, ``LayerNormalization``; output the block's output.
- **rnn**: bench/loop_memory.py's ONNX ``Loop`` (``h_t = tanh(h_{t-1} W + x_t U + b)``, hidden 256, batch 8,
  input 32) over T = 100 steps (``--rnn-steps``); output ``h_T``.

each with the tangent on the inputs only (``input``: x, or xs and h0) and on the inputs and every parameter
(``all``), revgraph builds ``rg.jvp(g, outputs, inputs)`` (the primal outputs and ``J t``) and the VJP graph
``rg.gradient(g, y, inputs, seed="input")`` (the outputs and ``J^T u``), and times on onnxruntime (one
intra-op and one inter-op thread, sequential, default optimizations): the forward graph alone, the JVP graph,
the VJP graph; against ``torch.func.jvp`` (eager, ``torch.set_num_threads(1)``) and
``jax.jit(lambda p, t: jax.jvp(f, p, t))`` in bench/envs.py's JAX environment (a worker process with
``XLA_FLAGS`` for one thread). The JAX column is left out, with the reason, when that environment cannot be
made. Every side computes the primal output and its tangent; each float32 tangent is checked against
``torch.func.jvp`` in float64 (largest error over the largest entry; the transformer's ``Relu`` makes a
float32 side that rounds a pre-activation across 0 differ by ~1e-2 there).

Each turn times one side for ``--seconds`` (mean of its runs); turns alternate between the sides (the order
rotates each turn), and the table reports the median of ``--turns`` turns and the ratios of those medians.
Node counts are revgraph's (top-level nodes plus those of loop bodies) and onnxruntime's after its graph
optimizations. ``--profile`` adds onnxruntime's per-operator time of the JVP graph.

    python bench/jvp.py [--quick] [--turns 5] [--seconds 0.3] [--models mlp transformer rnn] [--profile]
                        [--rnn-steps 100] [--no-jax]

Writes ``bench/results/jvp.json`` (``--quick``: ``jvp-quick.json``) and markdown tables to stdout. Not part
of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from attention import _mean_time  # bench/ is the script's directory, so on sys.path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MLP_BATCH, MLP_WIDTH, MLP_LAYERS = 64, 512, 4
TF_BATCH, TF_SEQ, TF_WIDTH, TF_HEADS, TF_FF = 8, 64, 256, 4, 1024
RNN_T = 100
MODELS = ("mlp", "transformer", "rnn")
MODES = ("input", "all")


# ------------------------------------------------------------------------------------------ the models


def _rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def model_data(model: str, seed: int = 0) -> tuple[dict, dict]:
    """(inputs, parameters) of ``model`` as float32 arrays, in the order the functions below take them."""
    rng = np.random.default_rng(seed)
    if model == "mlp":
        x = {"x": _rand(rng, (MLP_BATCH, MLP_WIDTH))}
        p = {}
        for i in range(MLP_LAYERS):
            p[f"W{i}"] = _rand(rng, (MLP_WIDTH, MLP_WIDTH), MLP_WIDTH**-0.5)
            p[f"b{i}"] = _rand(rng, (MLP_WIDTH,), 0.1)
        return x, p
    if model == "transformer":
        d, f = TF_WIDTH, TF_FF
        x = {"x": _rand(rng, (TF_BATCH, TF_SEQ, d))}
        p = {}
        for n in ("q", "k", "v", "o"):
            p[f"W{n}"], p[f"b{n}"] = _rand(rng, (d, d), d**-0.5), _rand(rng, (d,), 0.1)
        p["g1"], p["be1"] = 1 + _rand(rng, (d,), 0.1), _rand(rng, (d,), 0.1)
        p["W1"], p["b1"] = _rand(rng, (d, f), d**-0.5), _rand(rng, (f,), 0.1)
        p["W2"], p["b2"] = _rand(rng, (f, d), f**-0.5), _rand(rng, (d,), 0.1)
        p["g2"], p["be2"] = 1 + _rand(rng, (d,), 0.1), _rand(rng, (d,), 0.1)
        return x, p
    if model == "rnn":
        from loop_memory import BATCH, HIDDEN, INPUT

        x = {"xs": _rand(rng, (RNN_T, BATCH, INPUT)), "h0": _rand(rng, (BATCH, HIDDEN), 0.1)}
        p = {"W": _rand(rng, (HIDDEN, HIDDEN), HIDDEN**-0.5), "U": _rand(rng, (INPUT, HIDDEN), INPUT**-0.5),
             "b": _rand(rng, (HIDDEN,), 0.1)}
        return x, p
    raise ValueError(f"unknown model {model!r}; expected one of {', '.join(MODELS)}")


def rg_graph(model: str):
    """``model`` as a revgraph IR graph with its parameters as initializers; returns (graph, output name)."""
    from revgraph.ir import Graph, Node, ValueInfo

    f32 = np.dtype(np.float32)
    xs, ps = model_data(model)
    if model == "rnn":
        import loop_memory

        g = loop_memory.rnn_graph(RNN_T)
        g.nodes = [n for n in g.nodes if n.op_type == "Loop"]
        g.outputs = [ValueInfo("h", f32, xs["h0"].shape)]
        g.initializers.update(ps)
        return g, "h"
    nodes: list[Node] = []

    def op(kind, ins, attrs=None):
        out = f"v{len(nodes)}"
        nodes.append(Node(kind, ins, [out], attrs or {}, f"n{len(nodes)}_{kind}"))
        return out

    def linear(h, w, b):
        return op("Add", [op("MatMul", [h, w]), b])

    inits = dict(ps)
    if model == "mlp":
        h = "x"
        for i in range(MLP_LAYERS):
            h = op("Tanh", [linear(h, f"W{i}", f"b{i}")])
    else:
        b, s, d, nh = TF_BATCH, TF_SEQ, TF_WIDTH, TF_HEADS
        inits["heads_shape"] = np.array([b, s, nh, d // nh], np.int64)
        inits["model_shape"] = np.array([b, s, d], np.int64)
        inits["scale"] = np.array((d // nh) ** -0.5, np.float32)

        def heads(w, bias, perm):
            return op("Transpose", [op("Reshape", [linear("x", w, bias), "heads_shape"])], {"perm": perm})

        q, kt, v = heads("Wq", "bq", [0, 2, 1, 3]), heads("Wk", "bk", [0, 2, 3, 1]), heads("Wv", "bv", [0, 2, 1, 3])
        att = op("Softmax", [op("Mul", [op("MatMul", [q, kt]), "scale"])], {"axis": -1})
        o = op("Reshape", [op("Transpose", [op("MatMul", [att, v])], {"perm": [0, 2, 1, 3]}), "model_shape"])
        n1 = op("LayerNormalization", [op("Add", ["x", linear(o, "Wo", "bo")]), "g1", "be1"],
                {"axis": -1, "epsilon": 1e-5})
        ff = linear(op("Relu", [linear(n1, "W1", "b1")]), "W2", "b2")
        h = op("LayerNormalization", [op("Add", [n1, ff]), "g2", "be2"], {"axis": -1, "epsilon": 1e-5})
    nodes.append(Node("Identity", [h], ["y"], name="y"))
    out_shape = xs["x"].shape
    return Graph(nodes, [ValueInfo("x", f32, out_shape)], [ValueInfo("y", f32, out_shape)], inits,
                 opsets={"": 21}, name=model), "y"


def torch_function(model: str):
    """``f(*inputs, *parameters)`` in PyTorch, the same math as :func:`rg_graph`."""
    import torch

    F = torch.nn.functional
    if model == "mlp":
        def f(x, *p):
            for i in range(MLP_LAYERS):
                x = torch.tanh(x @ p[2 * i] + p[2 * i + 1])
            return x
    elif model == "transformer":
        def f(x, wq, bq, wk, bk, wv, bv, wo, bo, g1, be1, w1, b1, w2, b2, g2, be2):
            b, s, d, nh = TF_BATCH, TF_SEQ, TF_WIDTH, TF_HEADS
            q, k, v = ((x @ w + c).reshape(b, s, nh, d // nh).transpose(1, 2)
                       for w, c in ((wq, bq), (wk, bk), (wv, bv)))
            att = torch.softmax(q @ k.transpose(2, 3) * (d // nh) ** -0.5, dim=-1)
            o = (att @ v).transpose(1, 2).reshape(b, s, d)
            n1 = F.layer_norm(x + o @ wo + bo, (d,), g1, be1, 1e-5)
            return F.layer_norm(n1 + torch.relu(n1 @ w1 + b1) @ w2 + b2, (d,), g2, be2, 1e-5)
    else:
        def f(xs, h, w, u, b):
            for t in range(xs.shape[0]):
                h = torch.tanh(h @ w + xs[t] @ u + b)
            return h
    return f


def jax_function(model: str):
    """``f(*inputs, *parameters)`` in JAX (the RNN as ``lax.scan``)."""
    import jax
    import jax.numpy as jnp

    def layer_norm(x, g, b):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b

    if model == "mlp":
        def f(x, *p):
            for i in range(MLP_LAYERS):
                x = jnp.tanh(x @ p[2 * i] + p[2 * i + 1])
            return x
    elif model == "transformer":
        def f(x, wq, bq, wk, bk, wv, bv, wo, bo, g1, be1, w1, b1, w2, b2, g2, be2):
            b, s, d, nh = TF_BATCH, TF_SEQ, TF_WIDTH, TF_HEADS
            q, k, v = ((x @ w + c).reshape(b, s, nh, d // nh).transpose(0, 2, 1, 3)
                       for w, c in ((wq, bq), (wk, bk), (wv, bv)))
            att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) * np.float32((d // nh) ** -0.5), axis=-1)
            o = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
            n1 = layer_norm(x + o @ wo + bo, g1, be1)
            return layer_norm(n1 + jax.nn.relu(n1 @ w1 + b1) @ w2 + b2, g2, be2)
    else:
        def f(xs, h, w, u, b):
            def step(h, x_t):
                return jnp.tanh(h @ w + x_t @ u + b), None

            return jax.lax.scan(step, h, xs)[0]
    return f


def tangents_of(model: str, seed: int = 1) -> dict:
    """A tangent for every input and parameter of ``model`` (float32, standard normal)."""
    xs, ps = model_data(model)
    rng = np.random.default_rng(seed)
    return {k: _rand(rng, v.shape) for k, v in {**xs, **ps}.items()}


# ------------------------------------------------------------------------------------------ JAX worker

_JAX: dict = {}


def jax_prepare(model: str, mode: str, rnn_steps: int = RNN_T) -> dict:
    """In the JAX worker: compile ``jit(jvp(f))`` for (model, mode); returns versions, compile time and the
    tangent output (as a list) for the agreement check."""
    import jax

    global RNN_T
    RNN_T = rnn_steps

    xs, ps = model_data(model)
    ts = tangents_of(model)
    f = jax_function(model)
    names = [*xs, *ps]
    n_in = len(xs) if mode == "input" else len(names)
    vals = [jax.numpy.asarray(v) for v in (*xs.values(), *ps.values())]
    tans = [jax.numpy.asarray(ts[k]) for k in names[:n_in]]

    @jax.jit
    def run(vals, tans):
        return jax.jvp(lambda *a: f(*a, *vals[n_in:]), tuple(vals[:n_in]), tuple(tans))

    t0 = time.perf_counter()
    _, tangent = jax.block_until_ready(run(vals, tans))
    compile_s = time.perf_counter() - t0
    _JAX["run"] = lambda: jax.block_until_ready(run(vals, tans))
    return {"compile_s": compile_s, "tangent": np.asarray(tangent).tolist(), "jax": jax.__version__}


def jax_time(seconds: float) -> float:
    return _mean_time(_JAX["run"], seconds)


# ------------------------------------------------------------------------------------------ revgraph side


def _session(graph, threads: int = 1, profile: str | None = None, optimized: str | None = None):
    import onnxruntime as ort

    import revgraph as rg

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    if profile:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile
    if optimized:
        opts.optimized_model_filepath = optimized
    return ort.InferenceSession(rg.to_onnx(graph).SerializeToString(), opts, providers=["CPUExecutionProvider"])


def node_counts(graph) -> dict:
    """Top-level nodes, nodes with subgraphs' nodes, and the histogram of operator types (all levels)."""
    ops = Counter(node.op_type for _, node in graph.walk())
    return {"top": len(graph.nodes), "all": sum(ops.values()), "ops": dict(ops.most_common())}


def ort_node_count(graph) -> int:
    """The number of nodes (with subgraphs') onnxruntime runs after its graph optimizations."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "opt.onnx")
        _session(graph, optimized=path)
        m = onnx.load(path)
    stack, n = [m.graph], 0
    while stack:
        g = stack.pop()
        n += len(g.node)
        stack += [a.g for node in g.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    return n


def ort_profile(graph, feeds: dict, runs: int) -> list[tuple[str, float, int]]:
    """onnxruntime's profiler on ``graph``: (operator type, share of the kernel time, node count), largest first.
    The nodes of loop bodies are counted themselves; ``Loop`` and ``If`` (whose time is their bodies') are not."""
    with tempfile.TemporaryDirectory() as tmp:
        sess = _session(graph, profile=os.path.join(tmp, "p"))
        for _ in range(runs):
            sess.run(None, feeds)
        with open(sess.end_profiling()) as fh:
            events = json.load(fh)
    per, names = Counter(), {}
    for ev in events:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            op = ev["args"]["op_name"]
            if op in ("Loop", "If", "Scan"):
                continue
            per[op] += ev["dur"]
            names.setdefault(op, set()).add(ev["name"])
    total = sum(per.values()) or 1
    return [(op, t / total, len(names[op])) for op, t in per.most_common()]


def case(model: str, mode: str, turns: int, seconds: float, jx, profile_runs: int = 0) -> dict:
    import torch

    import revgraph as rg

    g, y = rg_graph(model)
    xs, ps = model_data(model)
    ts = tangents_of(model)
    names = [*xs, *ps]
    wrt = list(xs) if mode == "input" else names
    t0 = time.perf_counter()
    jg = rg.jvp(g, outputs=[y], inputs=wrt)
    build_jvp = time.perf_counter() - t0
    t0 = time.perf_counter()
    vg = rg.gradient(g, loss=y, wrt=wrt, seed="input")
    build_vjp = time.perf_counter() - t0
    s_fwd, s_jvp, s_vjp = _session(g), _session(jg), _session(vg)
    f_feeds = dict(xs)
    j_feeds = {**xs, **{f"{k}_tangent": ts[k] for k in wrt}}
    out_shape = xs["h0" if model == "rnn" else "x"].shape
    v_feeds = {**xs, f"{y}_grad": np.random.default_rng(2).standard_normal(out_shape).astype(np.float32)}
    j_names = [o.name for o in s_jvp.get_outputs()]

    f = torch_function(model)
    tx = [torch.from_numpy(v) for v in (*xs.values(), *ps.values())]
    tt = [torch.from_numpy(ts[k]) for k in wrt]
    n_in = len(wrt)

    def torch_jvp():
        return torch.func.jvp(lambda *a: f(*a, *tx[n_in:]), tuple(tx[:n_in]), tuple(tt))

    runners = {"forward": lambda: s_fwd.run(None, f_feeds), "rg_jvp": lambda: s_jvp.run(None, j_feeds),
               "rg_vjp": lambda: s_vjp.run(None, v_feeds), "torch_jvp": torch_jvp}
    got = dict(zip(j_names, runners["rg_jvp"](), strict=True))
    with torch.no_grad():  # the reference: torch.func.jvp in float64
        t64 = [t.double() for t in tx]
        want_y, want_t = (t.numpy() for t in torch.func.jvp(lambda *a: f(*a, *t64[n_in:]), tuple(t64[:n_in]),
                                                             tuple(t.double() for t in tt)))

    def rel(a):
        return float(np.abs(np.asarray(a, np.float64) - want_t).max() / np.abs(want_t).max())

    err = {"primal": float(np.abs(got[y] - want_y).max() / np.abs(want_y).max()),
           "tangent": rel(got[jg.output_names[-1]]), "tangent_torch": rel(torch_jvp()[1].numpy())}
    out = {"model": model, "mode": mode, "wrt": wrt, "build_s": {"jvp": build_jvp, "vjp": build_vjp},
           "nodes": {k: node_counts(gr) for k, gr in (("forward", g), ("jvp", jg), ("vjp", vg))},
           "ort_nodes": {k: ort_node_count(gr) for k, gr in (("forward", g), ("jvp", jg), ("vjp", vg))}}
    if jx is not None:
        try:
            prep = jx.call("jvp:jax_prepare", model=model, mode=mode, rnn_steps=RNN_T, timeout=600)
            err["tangent_jax"] = rel(prep["tangent"])
            out["jax_compile_s"] = prep["compile_s"]
            runners["jax_jvp"] = lambda: jx.call("jvp:jax_time", seconds=seconds)
        except Exception as exc:  # noqa: BLE001 - reported, the column is left out
            out["jax_error"] = getattr(exc, "error", f"{type(exc).__name__}: {exc}")
    for run in runners.values():  # warm up
        run()
    times: dict[str, list[float]] = {n: [] for n in runners}
    order = list(runners)
    for r in range(turns):
        for name in order[r % len(order):] + order[: r % len(order)]:
            if name == "jax_jvp":
                times[name].append(runners[name]())
            else:
                times[name].append(_mean_time(runners[name], seconds))
    med = {n: float(np.median(t)) for n, t in times.items()}
    out.update(seconds=med, turns={n: [float(x) for x in t] for n, t in times.items()}, max_rel_diff=err)
    if profile_runs:
        out["jvp_profile"] = ort_profile(jg, j_feeds, profile_runs)
    return out


# ------------------------------------------------------------------------------------------ report


def _ms(x):
    return "-" if x is None else f"{1e3 * x:.2f}" if x < 0.1 else f"{1e3 * x:.1f}"


def _ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


def tables(rows: list[dict], jax_note: str | None) -> str:
    has_jax = any("jax_jvp" in r["seconds"] for r in rows)
    head = ["model", "tangent on", "nodes fwd / JVP / VJP", "ORT nodes fwd / JVP / VJP", "forward ms", "rg JVP ms",
            "rg VJP ms", "torch.func.jvp ms"] + (["jax.jvp ms"] if has_jax else []) + \
           ["JVP / torch"] + (["JVP / jax"] if has_jax else []) + \
           ["JVP / VJP", "JVP / forward", "tangent error rg / torch" + (" / jax" if has_jax else "")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":--", ":--"] + ["--:"] * (len(head) - 2)) + "|"]
    for r in rows:
        s, n, o = r["seconds"], r["nodes"], r["ort_nodes"]
        jv = s.get("jax_jvp")
        cells = [r["model"], "inputs" if r["mode"] == "input" else "inputs + parameters",
                 f"{n['forward']['all']} / {n['jvp']['all']} / {n['vjp']['all']}",
                 f"{o['forward']} / {o['jvp']} / {o['vjp']}",
                 _ms(s["forward"]), _ms(s["rg_jvp"]), _ms(s["rg_vjp"]), _ms(s["torch_jvp"])]
        cells += [_ms(jv)] if has_jax else []
        cells += [_ratio(s["rg_jvp"], s["torch_jvp"])] + ([_ratio(s["rg_jvp"], jv)] if has_jax else [])
        cells += [_ratio(s["rg_jvp"], s["rg_vjp"]), _ratio(s["rg_jvp"], s["forward"]),
                  " / ".join(f"{r['max_rel_diff'][k]:.0e}" for k in ("tangent", "tangent_torch", "tangent_jax")
                             if k in r["max_rel_diff"])]
        lines.append("| " + " | ".join(cells) + " |")
    if jax_note:
        lines += ["", f"JAX column left out: {jax_note}"]
    lines += ["", "| model | tangent on | operators of the JVP graph (all levels) beyond the forward's |",
              "|:--|:--|:--|"]
    for r in rows:
        fwd, jvp = Counter(r["nodes"]["forward"]["ops"]), Counter(r["nodes"]["jvp"]["ops"])
        extra = ", ".join(f"{op} {k}" for op, k in (jvp - fwd).most_common())
        lines.append(f"| {r['model']} | {r['mode']} | {extra} |")
    if any("jvp_profile" in r for r in rows):
        lines += ["", "| model | tangent on | onnxruntime kernel time of the JVP graph by operator (share, nodes) |",
                  "|:--|:--|:--|"]
        for r in rows:
            top = ", ".join(f"{op} {100 * sh:.0f}% ({k})" for op, sh, k in r.get("jvp_profile", [])[:8])
            lines.append(f"| {r['model']} | {r['mode']} | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 turns of 0.15 s (default 5 of 0.3 s)")
    p.add_argument("--turns", type=int)
    p.add_argument("--seconds", type=float, help="time per turn and side")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--profile", action="store_true", help="onnxruntime's profiler on each JVP graph")
    p.add_argument("--no-jax", action="store_true", help="leave JAX out")
    p.add_argument("--rnn-steps", type=int, default=100, help="T of the rnn model")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    global RNN_T
    RNN_T = args.rnn_steps
    turns = args.turns or (3 if args.quick else 5)
    seconds = args.seconds or (0.15 if args.quick else 0.3)
    output = args.output or RESULTS / ("jvp-quick.json" if args.quick else "jvp.json")
    import onnxruntime as ort
    import torch

    torch.set_num_threads(1)
    jx, jax_note, jax_version = None, None, None
    if args.no_jax:
        jax_note = "--no-jax"
    else:
        import envs
        from run import jax_env
        from workers import Worker

        try:
            python = envs.ensure("jax", log=lambda m: print(m, file=sys.stderr))
            jx = Worker("jax-jvp", python, Path(tempfile.gettempdir()), env=jax_env(1))
        except Exception as exc:  # noqa: BLE001 - the column is left out with the reason
            jax_note = str(exc).splitlines()[0]
    load_before = os.getloadavg()
    rows = []
    try:
        for model in args.models:
            for mode in args.modes:
                print(f"{model}, tangent on {mode}...", file=sys.stderr, flush=True)
                rows.append(case(model, mode, turns, seconds, jx, 20 if args.profile else 0))
                if "jax_error" in rows[-1]:
                    jax_note = rows[-1]["jax_error"]
        if jx is not None:
            jax_version = jx.call("jax_tasks:versions")
    finally:
        if jx is not None:
            jx.close()
    out = {"what": "JVP (primal + tangent) step time: revgraph's JVP graph on onnxruntime vs its VJP graph, the "
                   "forward graph, torch.func.jvp eager and jax.jit(jax.jvp); CPU, 1 thread, float32; medians of "
                   "alternating turns",
           "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                       "onnxruntime": ort.__version__, "torch": torch.__version__, "jax": jax_version,
                       "load_average_before_after": [load_before[0], os.getloadavg()[0]]},
           "turns": turns, "seconds_per_turn": seconds, "rnn_steps": RNN_T, "jax_note": jax_note, "cases": rows}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(out, indent=1) + "\n")
    print(tables(rows, jax_note))
    print(f"\nload average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}; {turns} turns of {seconds} s")
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
