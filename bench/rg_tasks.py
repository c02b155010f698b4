"""revgraph's side of bench/run.py: build timing, training steps on onnxruntime, profiles, graph audits.

Runs in a worker process in the project's virtual environment (bench/_worker.py). Every function takes and
returns plain JSON values. Build timing starts from a parsed ``onnx.ModelProto`` and ends with the gradient
``ModelProto``, as onnxruntime-training's side does (ort_training_tasks.py); parameters become graph inputs
(as in a training graph, and as onnxruntime-training does), and for the classifiers the cross-entropy loss is
appended by ``revgraph.train.loss_graph``.
"""

from __future__ import annotations

import contextlib
import copy
import cProfile
import io
import json
import os
import pstats
import time
from collections import Counter, defaultdict

import numpy as np
import onnx

_MODELS: dict[str, onnx.ModelProto] = {}
_STEPS: dict[str, dict] = {}


def versions() -> dict:
    import onnxruntime
    import torch

    import revgraph

    return {"revgraph": getattr(revgraph, "__version__", "0.1.0"), "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "numpy": np.__version__, "torch": torch.__version__}


def _model(path: str) -> onnx.ModelProto:
    if path not in _MODELS:
        _MODELS[path] = onnx.load(path)
    return _MODELS[path]


def forget(path: str) -> bool:
    _MODELS.pop(path, None)
    return True


# ----------------------------------------------------------------------------------------------- building


def gradient_graph(proto: onnx.ModelProto, params: list[str], loss_kind: str, accumulate: str = "sum",
                   phases: dict | None = None):
    """The gradient graph (an ``rg.Graph``) of a forward model: loss, then the gradient of every param.

    ``loss_kind`` ``"cross-entropy"`` appends revgraph's cross-entropy to the only output; ``"output"`` takes
    the model's only output as the loss. Parameters are graph inputs. ``phases`` receives the seconds of
    each phase (``load``, ``gradient``)."""
    import revgraph as rg
    from revgraph.train import loss_graph, params_as_inputs

    t0 = time.perf_counter()
    g = rg.load(proto)
    if loss_kind == "cross-entropy":
        g, spec = loss_graph(g, "cross-entropy")
        g.outputs = g.outputs[:1]
        loss = spec.loss
    else:
        loss = g.output_names[0]
    params_as_inputs(g, params)
    t1 = time.perf_counter()
    gg = rg.gradient(g, loss, params, accumulate=accumulate)
    t2 = time.perf_counter()
    if phases is not None:
        phases.update(load=t1 - t0, gradient=t2 - t1)
    return gg


def build(path: str, params: list[str], loss_kind: str, stats: bool = False, save_to: str | None = None) -> dict:
    """One build from the parsed model to the gradient ``ModelProto``: seconds (total and by phase)."""
    import revgraph as rg

    proto = copy.deepcopy(_model(path))
    phases: dict = {}
    t0 = time.perf_counter()
    gg = gradient_graph(proto, params, loss_kind, phases=phases)
    t1 = time.perf_counter()
    model = rg.to_onnx(gg)
    t2 = time.perf_counter()
    out = {"seconds": t2 - t0, "load": phases["load"], "gradient": phases["gradient"], "to_onnx": t2 - t1}
    if stats:
        out.update(graph_stats(model))
    if save_to:
        onnx.save(model, save_to)
    return out


def graph_stats(model: onnx.ModelProto) -> dict:
    ops: Counter = Counter()
    stack, total = list(model.graph.node), 0
    while stack:
        node = stack.pop()
        total += 1
        ops[node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"] += 1
        for a in node.attribute:
            stack.extend(n for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs) for n in g.node)
    return {"nodes": total, "initializers": len(model.graph.initializer), "inputs": len(model.graph.input),
            "outputs": len(model.graph.output), "ops": dict(ops.most_common())}


def graph_stats_file(path: str) -> dict:
    return graph_stats(onnx.load(path, load_external_data=False))


def profile_build(path: str, params: list[str], loss_kind: str, top: int = 15) -> dict:
    """cProfile of one build (:func:`build`'s pipeline): the functions with the most own time, and the
    cumulative time of revgraph's own functions."""
    import revgraph as rg

    proto = copy.deepcopy(_model(path))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    gg = gradient_graph(proto, params, loss_kind)
    rg.to_onnx(gg)
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"function": _where(file, line, func), "calls": nc, "tottime": tt, "cumtime": ct})
    by_tot = sorted(rows, key=lambda r: -r["tottime"])[:top]
    own = [r for r in rows if "revgraph/" in r["function"]]
    by_cum = sorted(own, key=lambda r: -r["cumtime"])[:top]
    return {"wall": wall, "by_tottime": by_tot, "revgraph_by_cumtime": by_cum}


def _where(file: str, line: int, func: str) -> str:
    if file == "~":
        return func
    for marker in ("/src/revgraph/", "/site-packages/"):
        if marker in file:
            file = file.split(marker, 1)[1]
            if marker == "/src/revgraph/":
                file = "revgraph/" + file
            break
    return f"{file}:{line}({func})"


# --------------------------------------------------------------------------------------- training steps


def _session(model_bytes: bytes, threads: int, level: str = "all", profile: str | None = None,
             optimized_path: str | None = None, spinning: bool = True):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile
    if optimized_path:
        opts.optimized_model_filepath = optimized_path
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def _bind(sess, feeds: dict[str, np.ndarray]):
    import onnxruntime as ort

    binding = sess.io_binding()
    keep = []
    for name, arr in feeds.items():
        value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr))
        keep.append(value)
        binding.bind_ortvalue_input(name, value)
    for o in sess.get_outputs():
        binding.bind_output(o.name, "cpu")
    return binding, keep


def prepare_step(key: str, info: dict, threads: int = 2, mode: str = "grad") -> dict:
    """Build the step graph of a model of models.write_step_model and an onnxruntime session for it.

    ``mode="grad"``: forward, cross-entropy and the gradients of the parameters (what ``loss.backward()``
    computes), run through an IO binding (inputs bound once; onnxruntime allocates the outputs every step,
    as PyTorch allocates ``.grad``). ``mode="adam"``: a whole ``rg.Trainer`` step (gradients and Adam update;
    parameters and state stay in onnxruntime buffers). Returns the loss and gradient norms (checks), the
    build time and the graph's size."""
    from models import load_npz

    import revgraph as rg

    state, data = load_npz(info["npz"])
    t0 = time.perf_counter()
    if mode == "update":
        return _prepare_update(key, info, threads, t0)
    if mode == "adam":
        from revgraph.train.trainer import Trainer

        tr = Trainer(info["path"], "cross-entropy", "adam", params=info["params"], threads=threads)
        for p, arr in tr.spec.initial.items():  # the exported values (the same as PyTorch's state)
            assert np.array_equal(arr, state[p])
        feeds = {tr.spec.inputs[0]: data["x"], tr.spec.labels: data["labels"]}
        n = len(data["labels"])
        _STEPS[key] = {"run": lambda: tr._engine.step(feeds, n, n), "trainer": tr}
        loss = tr._engine.step(feeds, n, n)
        return {"build_seconds": time.perf_counter() - t0, "loss": loss}
    gg = gradient_graph(_model(info["path"]), info["params"], "cross-entropy")
    model = rg.to_onnx(gg)
    build = time.perf_counter() - t0
    sess = _session(model.SerializeToString(), threads)
    inputs = {v.name for v in sess.get_inputs()}
    feeds = {"x": data["x"], **{p: state[p] for p in info["params"]}}
    feeds.update({k: data["labels"] for k in inputs if k.startswith("labels")})
    binding, keep = _bind(sess, feeds)
    _STEPS[key] = {"run": lambda: sess.run_with_iobinding(binding), "binding": binding, "keep": keep,
                   "model": model, "feeds": feeds, "sess": sess}
    sess.run_with_iobinding(binding)
    outs = binding.copy_outputs_to_cpu()
    names = [o.name for o in sess.get_outputs()]
    grads = dict(zip(names[1:], outs[1:], strict=True))
    return {"build_seconds": build, "loss": float(outs[0]),
            "grad_sq": {p: float(np.sum(np.square(grads[f"{p}_grad"], dtype=np.float64))) for p in info["params"]},
            **graph_stats(model)}


def _prepare_update(key: str, info: dict, threads: int, t0: float) -> dict:
    """The optimizer update alone: the update half of the Trainer's step graph (``revgraph.train.split_step``,
    what a data-parallel step runs after its all-reduce), Adam on fixed random gradients, with parameters and
    state swapped between two buffer sets through IO bindings as ``rg.Trainer`` does."""
    import onnxruntime as ort

    import revgraph as rg
    from revgraph.train import split_step, training_graph

    spec = training_graph(info["path"], "cross-entropy", rg.train.adam(), params=info["params"])
    _, update = split_step(spec)
    sess = _session(rg.to_onnx(update).SerializeToString(), threads)
    start = spec.initial_state()
    sets = [{i: ort.OrtValue.ortvalue_from_numpy(start[i]) for i, _ in spec.carried()},
            {i: ort.OrtValue.ortvalue_from_numpy(np.empty_like(start[i])) for i, _ in spec.carried()}]
    rng = np.random.default_rng(0)
    grads = {spec.grads[p][0]: ort.OrtValue.ortvalue_from_numpy(
        (1e-2 * rng.standard_normal(spec.initial[p].shape)).astype(spec.initial[p].dtype)) for p in spec.params}
    bindings = []
    for k in range(2):
        b = sess.io_binding()
        for i, o in spec.carried():
            b.bind_ortvalue_input(i, sets[k][i])
            b.bind_ortvalue_output(o, sets[1 - k][i])
        for g, v in grads.items():
            b.bind_ortvalue_input(g, v)
        bindings.append(b)
    turn = [0]

    def run():
        sess.run_with_iobinding(bindings[turn[0]])
        turn[0] = 1 - turn[0]

    _STEPS[key] = {"run": run, "keep": (sess, sets, grads, bindings)}
    run()
    return {"build_seconds": time.perf_counter() - t0, "nodes": len(update.nodes)}


def step_time(key: str, seconds: float = 0.5, min_iters: int = 3) -> dict:
    """Run the prepared step repeatedly for about ``seconds``: mean seconds per step and the count."""
    run = _STEPS[key]["run"]
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    iters = max(min_iters, int(seconds / max(first, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    return {"mean": (time.perf_counter() - t0) / iters, "iters": iters}


def drop_step(key: str) -> bool:
    _STEPS.pop(key, None)
    return True


# --------------------------------------------------------------------------------- onnxruntime's profiler


def _category(name: str) -> str:
    for prefix in ("grad/", "accum/", "seed/", "loss/", "optim/", "train/"):
        if name.startswith(prefix):
            return prefix.rstrip("/")
    return "forward" if name else "unnamed"


def ort_profile(key: str, steps: int = 20, threads: int = 2, top: int = 12) -> dict:
    """onnxruntime's profiler over ``steps`` runs of a prepared ``grad`` step: kernel time per operator
    type and per kind of node (forward, grad/, accum/, ...), the slowest nodes, the share of the step
    spent outside kernels, and the node counts before and after onnxruntime's graph optimisations."""
    import tempfile

    st = _STEPS[key]
    model = st["model"]
    with tempfile.TemporaryDirectory() as d:
        sess = _session(model.SerializeToString(), threads, profile=os.path.join(d, "prof"),
                        optimized_path=os.path.join(d, "opt.onnx"))
        binding, _keep = _bind(sess, st["feeds"])
        for _ in range(3):
            sess.run_with_iobinding(binding)
        t0 = time.perf_counter()
        for _ in range(steps):
            sess.run_with_iobinding(binding)
        wall = (time.perf_counter() - t0) / steps
        prof_file = sess.end_profiling()
        with open(prof_file) as f:
            events = json.load(f)
        optimized = onnx.load(os.path.join(d, "opt.onnx"), load_external_data=False)
    # the last `steps` model runs only: drop the warm-up runs
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    start = runs[-steps] if len(runs) >= steps else 0
    by_op, by_cat, by_node = Counter(), Counter(), Counter()
    count_op = Counter()
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < start:
            continue
        op = e.get("args", {}).get("op_name", "?")
        node = e["name"][: -len("_kernel_time")]
        by_op[op] += e["dur"]
        count_op[op] += 1
        by_cat[_category(node)] += e["dur"]
        by_node[(node, op)] += e["dur"]
    kernel = sum(by_op.values()) / steps / 1e6
    ops_opt = Counter(n.op_type for n in optimized.graph.node)
    cat_before = Counter(_category(n.name) for n in model.graph.node)
    cat_after = Counter(_category(n.name) for n in optimized.graph.node)
    return {
        "wall": wall, "kernel": kernel,
        "by_op": [{"op": k, "ms": v / steps / 1e3, "calls": count_op[k] // steps} for k, v in by_op.most_common(top)],
        "by_category": {k: v / steps / 1e3 for k, v in by_cat.most_common()},
        "slowest_nodes": [{"node": n, "op": o, "ms": v / steps / 1e3} for (n, o), v in by_node.most_common(top)],
        "nodes_before": len(model.graph.node), "nodes_after": len(optimized.graph.node),
        "ops_after": dict(ops_opt.most_common()),
        "nodes_by_kind_before": dict(cat_before), "nodes_by_kind_after": dict(cat_after),
    }


def session_variants(key: str, seconds: float = 0.4, rounds: int = 3, threads: int = 2) -> dict:
    """Step time of a prepared ``grad`` step under other session options, side by side in turns: graph
    optimisation levels, one intra-op thread, no spinning, and feeding numpy arrays to ``run`` instead of
    an IO binding. Medians of ``rounds`` turns."""
    st = _STEPS[key]
    data = st["model"].SerializeToString()
    runners = {}
    for name, kw in {"default (all, 2 threads, IO binding)": {}, "optimisation basic": {"level": "basic"},
                     "optimisation disabled": {"level": "disable"}, "no spinning": {"spinning": False},
                     "1 thread": {"threads": 1}}.items():
        sess = _session(data, kw.pop("threads", threads), **kw)
        binding, keep = _bind(sess, st["feeds"])
        runners[name] = (lambda s=sess, b=binding: s.run_with_iobinding(b), keep)
    sess = _session(data, threads)
    feeds = st["feeds"]
    runners["sess.run with numpy feeds"] = (lambda s=sess: s.run(None, feeds), None)
    times = defaultdict(list)
    for _ in range(rounds):
        for name, (run, _keep) in runners.items():
            run()
            t0 = time.perf_counter()
            n = 0
            while time.perf_counter() - t0 < seconds or n < 3:
                run()
                n += 1
            times[name].append((time.perf_counter() - t0) / n)
    return {k: float(np.median(v)) for k, v in times.items()}


# ------------------------------------------------------------------------------------------ graph audit


def audit(path: str) -> dict:
    """Redundancy in a saved gradient graph (top-level graph and loop bodies): dead nodes, repeated
    subexpressions (same operator, attributes and inputs after merging earlier repeats), Shape nodes and
    those over values of static shape, nodes computable at build time (every input a constant), arithmetic
    whose floating-point operand is known to be zero, Transpose-Transpose and Reshape-Reshape pairs, and
    Identity nodes. Each finding is counted for nodes the backward pass emitted (names ``grad/``, ``accum/``,
    ``seed/``; for other tools' graphs, every node) and for the rest."""
    model = onnx.load(path, load_external_data=False)
    with contextlib.suppress(Exception):  # shape inference is only used to find static shapes
        model = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    ours = model.producer_name == "revgraph"
    report: dict[str, Counter] = defaultdict(Counter)
    examples: dict[str, list[str]] = defaultdict(list)
    inits = {t.name: t for t in model.graph.initializer}
    _audit_graph(model.graph, report, examples, shapes, inits, [o.name for o in model.graph.output], ours)
    # backward Where nodes by the forward operator whose VJP wrote them (names grad/<forward node>/...)
    ops_by_name = {}
    stack = list(model.graph.node)
    while stack:
        n = stack.pop()
        ops_by_name[n.name] = n.op_type
        for a in n.attribute:
            stack.extend(x for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs) for x in g.node)
    where: Counter = Counter()
    for name, op in ops_by_name.items():
        if op == "Where" and name.startswith("grad/"):
            fwd = name[len("grad/"):].rsplit("/", 1)[0]
            where[ops_by_name.get(fwd, "?")] += 1
    return {"counts": {k: dict(v) for k, v in report.items()}, "examples": {k: v[:5] for k, v in examples.items()},
            "nodes": graph_stats(model)["nodes"], "where_origins": dict(where.most_common())}


_ZERO_PROPAGATING = {"Expand", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Cast", "Identity", "Neg", "Flatten",
                     "Slice", "Tile"}
_ZERO_ARITH = {"Add", "Sub", "Mul", "Div", "Sum", "MatMul", "Gemm", "ReduceSum", "ReduceMean", "Neg", "Concat", "Pad",
               "Expand", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Slice", "Tile", "Cast"}
_PAIRS = {("Transpose", "Transpose"), ("Reshape", "Reshape"), ("Unsqueeze", "Squeeze"), ("Squeeze", "Unsqueeze"),
          ("Flatten", "Reshape"), ("Reshape", "Flatten"), ("Cast", "Cast")}


def _is_zero_tensor(t: onnx.TensorProto) -> bool:
    try:
        arr = onnx.numpy_helper.to_array(t)
    except Exception:  # noqa: BLE001
        return False
    return arr.size > 0 and arr.dtype.kind == "f" and not np.any(arr)


def _side(node, ours: bool) -> str:
    if not ours:
        return "all"
    return "backward" if node.name.startswith(("grad/", "accum/", "seed/")) else "forward"


def _audit_graph(graph, report, examples, shapes, inits, outputs, ours):
    def note(finding, node, side):
        report[finding][side] += 1
        examples[finding].append(f"{node.op_type} {node.name}")

    nodes = list(graph.node)
    # dead nodes: no output reaches a graph output (names read by subgraphs count as reads)
    used = set(outputs)
    live = [False] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if any(o in used for o in node.output if o):
            live[i] = True
            used.update(node.input)
            for a in node.attribute:
                for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                    used.update(_free_names(g))
    for node, ok in zip(nodes, live, strict=True):
        if not ok:
            note("dead nodes", node, _side(node, ours))
    graph_inputs = {i.name for i in graph.input}
    const = {n for n in inits if n not in graph_inputs}
    zero = {n for n, t in inits.items() if n not in graph_inputs and _is_zero_tensor(t)}
    canon: dict[str, str] = {}
    seen: dict[tuple, list[str]] = {}
    producer = {}
    for node in nodes:
        side = _side(node, ours)
        op = node.op_type
        ins = [canon.get(x, x) for x in node.input]
        subs = [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]
        if op == "Identity":
            note("Identity nodes", node, side)
        if op == "Shape":
            note("Shape nodes", node, side)
            dims = shapes.get(node.input[0])
            if dims is not None and all(d is not None and d > 0 for d in dims):
                note("Shape nodes over static shapes", node, side)
                const.update(node.output)
        if op == "Constant":
            const.update(node.output)
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and _is_zero_tensor(value):
                zero.update(node.output)
        elif op == "ConstantOfShape":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is None or _is_zero_tensor(value):
                zero.update(node.output)
                note("zero tensors materialised (ConstantOfShape of 0)", node, side)
            if all(x in const for x in node.input if x):
                const.update(node.output)
        elif not subs and node.input and op != "Shape" and all(x in const for x in node.input if x):
            note("nodes with only constant inputs (foldable at build time)", node, side)
            const.update(node.output)
        real = [x for x in node.input if x]
        zin = [x for x in real if x in zero]
        if zin and op in _ZERO_ARITH:
            note("arithmetic on known zeros", node, side)
            if (op in _ZERO_PROPAGATING and node.input[0] in zero) or op in ("Mul", "MatMul", "Gemm", "Div") or (
                    op in ("Add", "Sum", "Concat") and len(zin) == len(real)):
                zero.update(node.output)
        first = producer.get(node.input[0]) if node.input else None
        if first is not None and (first.op_type, op) in _PAIRS:
            note(f"{first.op_type} -> {op} pairs", node, side)
        if not subs and op != "Constant":
            key = (node.domain, op, tuple(ins), tuple(a.SerializeToString() for a in node.attribute),
                   len(node.output))
            if key in seen:
                note("repeated subexpressions", node, side)
                report[f"repeated {op}"][side] += 1
                for o, prev in zip(node.output, seen[key], strict=True):
                    canon[o] = prev
            else:
                seen[key] = [canon.get(o, o) for o in node.output]
        for o in node.output:
            producer[o] = node
        for g in subs:
            report["nodes in loop bodies"][side] += len(g.node)
            _audit_graph(g, report, examples, shapes, {t.name: t for t in g.initializer},
                         [o.name for o in g.output], ours)


def _free_names(graph) -> set[str]:
    """Names a subgraph reads (its nodes' inputs, nested ones included): a superset of its captures."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                names.update(_free_names(g))
    return names


def save_step_graph(key: str, path: str) -> str:
    onnx.save(_STEPS[key]["model"], path)
    return path


# ------------------------------------------------------------------------------- accumulation memory


def accumulation_graph(fan: int = 64, batch: int = 64, width: int = 4096):
    """``h = tanh(x W)`` ([batch, width]) read by ``fan`` consumers ``c_i = h * w_i`` (``w_i`` [width], graph
    inputs, so that nothing in the backward pass is constant-folded when the session is created); the loss is
    the sum of ``ReduceSum(c_i)``. The gradient of ``h`` gets ``fan`` contributions ``w_i`` broadcast to h's
    size, and no consumer needs a residual of that size."""
    from revgraph.ir import Graph, Node, ValueInfo

    rng = np.random.default_rng(0)
    nodes = [Node("MatMul", ["x", "W"], ["xw"], name="xw"), Node("Tanh", ["xw"], ["h"], name="h")]
    inits = {"W": (rng.standard_normal((64, width)) / 8).astype(np.float32)}
    for i in range(fan):
        nodes.append(Node("Mul", ["h", f"w{i}"], [f"c{i}"], name=f"c{i}"))
        nodes.append(Node("ReduceSum", [f"c{i}"], [f"s{i}"], {"keepdims": 0}, f"s{i}"))
    nodes.append(Node("Sum", [f"s{i}" for i in range(fan)], ["loss"], name="loss"))
    inputs = [ValueInfo("x", np.float32, (batch, 64)), *[ValueInfo(f"w{i}", np.float32, (width,)) for i in range(fan)]]
    return Graph(nodes, inputs, [ValueInfo("loss", np.float32, ())], inits)


def _accum_measure(strategy: str, fan: int, order: str, queue) -> None:
    import onnxruntime as ort
    from loop_memory import _peak_rss, _reset_peak_rss

    import revgraph as rg

    g = accumulation_graph(fan)
    gg = rg.gradient(g, "loss", ["W", *[f"w{i}" for i in range(fan)]], accumulate=strategy)
    opts = ort.SessionOptions()
    opts.enable_cpu_mem_arena = False
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    opts.execution_order = getattr(ort.ExecutionOrder, order)
    sess = ort.InferenceSession(rg.to_onnx(gg).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((64, 64)).astype(np.float32),
             **{f"w{i}": rng.standard_normal(4096).astype(np.float32) for i in range(fan)}}
    before = _reset_peak_rss()
    sess.run(None, feeds)
    peak = _peak_rss()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    queue.put({"peak_mb": (peak - before) / 1024, "time_s": float(np.median(times)),
               "checksum": float(np.abs(out[1]).sum()), "nodes": len(gg.nodes)})


def accumulation_memory(strategy: str, fan: int = 64, order: str = "DEFAULT") -> dict:
    """Peak memory (resident-size growth during the first run, arena off) and median time of forward plus
    backward of :func:`accumulation_graph` with ``accumulate=strategy``, in a fresh process, with
    onnxruntime's ``ExecutionOrder`` ``order`` (``DEFAULT`` or ``PRIORITY_BASED``)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_accum_measure, args=(strategy, fan, order, queue))
    proc.start()
    result = queue.get(timeout=600)
    proc.join()
    return result


def loop_memory(steps: int, policy: str) -> dict:
    """bench/loop_memory.py's measurement of one (T, policy) in a fresh process."""
    import loop_memory as lm

    return lm.measure(steps, policy)
