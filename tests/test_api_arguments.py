"""The Python API's arguments (issue 28, part 7): every public function checks what it is given and raises a
one-line RevgraphError naming the function and the argument, instead of numpy's TypeError, an OverflowError, an
endless loop, or nothing at all.

A table of (callable, arguments) that must be refused; and a walk over the public API (``revgraph.__all__``,
``revgraph.train.lora``, ``revgraph.train``, ``revgraph.autodiff``, the Trainer's methods) checking that each
parameter of each public function is covered: by a rule of :func:`revgraph.validate.arguments` on the function,
by a row of the table, or by the short list of parameters that are not checked (with the reason)."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import onnx
import pytest

import revgraph as rg
import revgraph.autodiff
import revgraph.train
import revgraph.train.lora
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.validate import ArgumentError


def _graph() -> Graph:
    """``y = sum(x @ w)``: x float32 [4, 3], w [3, 2]."""
    return Graph(nodes=[Node("MatMul", ["x", "w"], ["h"], {}, "mm"),
                        Node("ReduceSum", ["h"], ["y"], {"keepdims": 0}, "s")],
                 inputs=[ValueInfo("x", np.float32, (4, 3))], outputs=[ValueInfo("y", np.float32, ())],
                 initializers={"w": np.ones((3, 2), np.float32)})


def _model() -> Graph:
    """``y = x @ w`` with a batch axis: a model to train with mse."""
    return Graph(nodes=[Node("MatMul", ["x", "w"], ["y"], {}, "mm")],
                 inputs=[ValueInfo("x", np.float32, ("N", 3))], outputs=[ValueInfo("y", np.float32, ("N", 2))],
                 initializers={"w": np.ones((3, 2), np.float32)})


G, M = _graph(), _model()
DATA = {"x": np.ones((8, 3), np.float32), "labels": np.ones((8, 2), np.float32)}
_TRAINER = {}


def _linear():
    import torch

    return torch.nn.Linear(3, 2)


def trainer():
    if "t" not in _TRAINER:
        _TRAINER["t"] = rg.Trainer(M, "mse")
    return _TRAINER["t"]


def fit(**kw):
    return trainer().fit(DATA, **{"progress": False, **kw})


#: (label, call, argument named in the message). The issue's examples first.
CASES = [
    ("hessian wrt=[]", lambda: rg.hessian(G, wrt=[]), "wrt"),
    ("fit batch_size=2.5", lambda: fit(batch_size=2.5), "batch_size"),
    ("fit seed=-1", lambda: fit(seed=-1), "seed"),
    ("Trainer optimizer=42", lambda: rg.Trainer(M, "mse", optimizer=42), "optimizer"),
    ("check_gradients rtol='1e-3'", lambda: rg.check_gradients(G, rtol="1e-3"), "rtol"),
    ("load 'a\\x00b'", lambda: rg.load("a\x00b"), "model"),
    # the siblings: every derivative function's graph, names and options
    *[(f"{f.__name__} graph=5", (lambda f=f: f(5)), "graph") for f in
      (rg.gradient, rg.hessian, rg.hvp, rg.jacobian, rg.jvp, rg.to_onnx, rg.to_ssa, rg.is_ssa, rg.analyze_ssa,
       rg.plan_memory, rg.saved_bytes, rg.check_gradients, rg.lora.merge_adapters, rg.lora.extract, rg.lora.config,
       revgraph.autodiff.expand_gradient_ops, revgraph.train.graph_size)],
    *[(f"{f.__name__} {k}={v!r}", (lambda f=f, k=k, v=v: f(G, **{k: v})), k) for f in (rg.gradient, rg.hessian, rg.hvp)
      for k, v in [("wrt", []), ("wrt", 5), ("wrt", ["w", 3]), ("wrt", "a\x00"), ("loss", 5), ("loss", ""),
                   ("checkpoint", 0), ("checkpoint", 2**63), ("checkpoint", 2.5), ("memory", "x"), ("memory", -1)]],
    *[(f"{f.__name__} {k}={v!r}", (lambda f=f, k=k, v=v: f(G, **{k: v})), k) for f in (rg.jacobian, rg.jvp)
      for k, v in [("outputs", []), ("outputs", 5), ("inputs", []), ("inputs", [None])]],
    ("jacobian mode='x'", lambda: rg.jacobian(G, mode="x"), "mode"),
    ("jacobian checkpoint=-1", lambda: rg.jacobian(G, checkpoint=-1), "checkpoint"),
    ("jacobian memory=2.0", lambda: rg.jacobian(G, memory=2.0), "memory"),
    ("jvp tangent_names=5", lambda: rg.jvp(G, tangent_names=5), "tangent_names"),
    ("jvp output_names=[1]", lambda: rg.jvp(G, output_names=[1]), "output_names"),
    ("jvp wrt=", lambda: rg.jvp(G, wrt=["x"]), "wrt"),
    *[(f"gradient {k}={v!r}", (lambda k=k, v=v: rg.gradient(G, **{k: v})), k) for k, v in [
        ("seed", "x"), ("seed", 1), ("unconnected", "warn"), ("sparse", "x"), ("sparse", 1), ("accumulate", "max"),
        ("lift_constants", None), ("straight_through", "yes"), ("memory", float("nan")), ("finite_inputs", 5),
        ("finite_inputs", [3])]],
    ("gradient finite_inputs names no input", lambda: rg.gradient(G, finite_inputs=["w_typo"]), "finite_inputs"),
    ("backward graph=5", lambda: rg.backward(5, ["y"]), "graph"),
    ("backward wrt=[]", lambda: rg.backward(G, ["y"], []), "wrt"),
    ("backward accumulate=1", lambda: rg.backward(G, ["y"], accumulate=1), "accumulate"),
    ("backward without ys", lambda: rg.backward(G), "ys"),
    *[(f"check_gradients {k}={v!r}", (lambda k=k, v=v: rg.check_gradients(G, **{k: v})), k) for k, v in [
        ("rtol", -1), ("rtol", float("nan")), ("atol", float("inf")), ("atol", None), ("seed", -1), ("seed", 2**64),
        ("seed", 1.5), ("directions", 0), ("directions", 2.5), ("step", 0), ("step", "1e-6"), ("backend", "torch"),
        ("inputs", 5), ("loss", 3), ("wrt", [])]],
    # files and models
    ("load 5", lambda: rg.load(5), "model"),
    ("load ''", lambda: rg.load(""), "model"),
    ("load b'a\\x00b' path", lambda: rg.load(__import__("pathlib").Path("a\x00b")), "model"),
    ("load opset=-1", lambda: rg.load(onnx.ModelProto(), opset=-1), "opset"),
    ("load opset=2.5", lambda: rg.load(onnx.ModelProto(), opset=2.5), "opset"),
    ("load base_dir=5", lambda: rg.load(onnx.ModelProto(), base_dir=5), "base_dir"),
    ("save graph=5", lambda: rg.save(5, "x.onnx"), "graph"),
    ("to_onnx producer=5", lambda: rg.to_onnx(G, producer=5), "producer"),
    ("saved_bytes dims=5", lambda: rg.saved_bytes(G, dims=5), "dims"),
    ("plan_memory budget=0.5", lambda: rg.plan_memory(G, 0.5), "budget"),
    # Session
    ("Session graph=5", lambda: rg.Session(5), "graph"),
    ("Session backend='torch'", lambda: rg.Session(G, backend="torch"), "backend"),
    ("Session threads=-1", lambda: rg.Session(G, threads=-1), "threads"),
    ("Session threads=2.5", lambda: rg.Session(G, threads=2.5), "threads"),
    ("Session threads=10**6", lambda: rg.Session(G, threads=10**6), "threads"),
    ("Session device='gpu'", lambda: rg.Session(G, device="gpu"), "device"),
    ("Session runtime=5", lambda: rg.Session(G, runtime=5), "runtime"),
    ("Session session_options=5", lambda: rg.Session(G, session_options=5), "session_options"),
    # Trainer
    *[(f"Trainer {k}={v!r}", (lambda k=k, v=v: rg.Trainer(M, "mse", **{k: v})), k) for k, v in [
        ("optimizer", None), ("output", 5), ("params", []), ("params", 5), ("threads", -1), ("threads", True),
        ("checkpoint", "often"), ("device", 0), ("distributed", "no"), ("runtime", {}), ("buffers", 2),
        ("memory", "lots"), ("bucket_mb", 0), ("bucket_mb", float("inf")), ("reduce_dtype", "fp8"), ("overlap", 1),
        ("profile", "yes"), ("shard", True), ("sync_batchnorm", "on"), ("timeout", float("nan")), ("timeout", -1),
        ("loss_options", 5), ("loss_options", {"nope": 1}), ("schedule", "cosine"), ("clip_grad_norm", 0),
        ("clip_grad_norm", "1"), ("no_decay", 5), ("precision", "fp8"), ("freeze", 5)]],
    ("Trainer model=5", lambda: rg.Trainer(5, "mse"), "model"),
    ("Trainer model=''", lambda: rg.Trainer("", "mse"), "model"),
    ("Trainer loss=5", lambda: rg.Trainer(M, 5), "loss"),
    ("Trainer loss='hinge'", lambda: rg.Trainer(M, "hinge"), "hinge"),
    *[(f"fit {k}={v!r}", (lambda k=k, v=v: fit(**{k: v})), k) for k, v in [
        ("epochs", 0), ("epochs", 1.5), ("epochs", True), ("epochs", 10**20), ("batch_size", 0), ("batch_size", -2),
        ("batch_size", "32"), ("seed", 2**70), ("seed", 0.5), ("shuffle", "no"), ("progress", 2),
        ("description", 5), ("checkpoint_dir", 5), ("checkpoint_dir", "a\x00b"), ("checkpoint_every", -1),
        ("checkpoint_every", 1.5), ("nonfinite", "skip"), ("accumulate_steps", 0), ("accumulate_steps", 2.0),
        ("static", 5), ("override", 5), ("override", [5]), ("max_steps", 0), ("max_steps", 1.5),
        ("eval_every", 0), ("eval_batch_size", -1)]],
    ("fit data=5", lambda: trainer().fit(5, progress=False), "data"),
    ("fit eval_data=5", lambda: fit(eval_data=5), "eval_data"),
    ("fit callbacks=[3]", lambda: fit(callbacks=[3]), "callbacks"),
    ("evaluate batch_size=0", lambda: trainer().evaluate(DATA, batch_size=0), "batch_size"),
    ("evaluate batch_size=2.5", lambda: trainer().evaluate(DATA, batch_size=2.5), "batch_size"),
    ("evaluate static=5", lambda: trainer().evaluate(DATA, static=5), "static"),
    ("evaluate data=5", lambda: trainer().evaluate(5), "data"),
    ("predict static=5", lambda: trainer().predict(DATA["x"], static=5), "static"),
    ("predict inputs=5", lambda: trainer().predict(5), "input"),
    ("step batch=5", lambda: trainer().step(5), "data"),
    ("step static=5", lambda: trainer().step(DATA, static=5), "static"),
    ("arrays data=5", lambda: trainer().arrays(5), "data"),
    ("Session.run feeds=5", lambda: rg.Session(G).run(5), "feeds"),
    ("Session.run outputs=5", lambda: rg.Session(G).run({"x": np.ones((4, 3), np.float32)}, 5), "outputs"),
    ("Session.run outputs=['z']", lambda: rg.Session(G).run({"x": np.ones((4, 3), np.float32)}, ["z"]), "'z'"),
    ("check_rank rank=0", lambda: rg.lora.check_rank(0, None), "rank"),
    ("check_rank rank=2.5", lambda: rg.lora.check_rank(2.5, None), "rank"),
    ("check_rank alpha='x'", lambda: rg.lora.check_rank(1, "x"), "alpha"),
    ("adapter_names graph=5", lambda: rg.lora.adapter_names(5), "graph"),
    ("export path=5", lambda: trainer().export(5), "path"),
    ("export path='a\\x00b'", lambda: trainer().export("a\x00b"), "path"),
    ("save_training_graph path=None", lambda: trainer().save_training_graph(None), "path"),
    # revgraph.train and the optimizers
    *[(f"make_optimizer {k}={v!r}", (lambda k=k, v=v: revgraph.train.make_optimizer(**{"name": "sgd", k: v})), k)
      for k, v in [("name", 5), ("lr", "0.1"), ("lr", 0), ("lr", float("nan")),
                   ("momentum", -0.5), ("momentum", 1.0), ("weight_decay", -1), ("weight_decay", "0"),
                   ("schedule", 5), ("no_decay", 5)]],
    ("make_optimizer name='rmsprop'", lambda: revgraph.train.make_optimizer("rmsprop"), "rmsprop"),
    ("make_optimizer clip_grad_norm=-1", lambda: revgraph.train.make_optimizer("sgd", clip_grad_norm=-1), "clip"),
    *[(f"{f.__name__} {k}={v!r}", (lambda f=f, k=k, v=v: f(**{k: v})), k)
      for f in (revgraph.train.sgd, revgraph.train.adam, revgraph.train.adamw)
      for k, v in [("lr", "x"), ("lr", -1.0), ("weight_decay", float("inf"))]],
    ("sgd momentum='x'", lambda: revgraph.train.sgd(momentum="x"), "momentum"),
    ("adam betas=0.9", lambda: revgraph.train.adam(betas=0.9), "betas"),
    ("adam betas=(1, 0.9)", lambda: revgraph.train.adam(betas=(1.0, 0.9)), "betas"),
    ("adam eps=0", lambda: revgraph.train.adam(eps=0.0), "eps"),
    *[(f"training_graph {k}={v!r}", (lambda k=k, v=v: revgraph.train.training_graph(M, "mse", **{k: v})), k)
      for k, v in [("optimizer", 42), ("output", 5), ("params", []), ("checkpoint", 0), ("memory", -1),
                   ("loss_seed", "x"), ("loss_options", 5), ("precision", 16), ("freeze", 5)]],
    ("training_graph model=5", lambda: revgraph.train.training_graph(5), "model"),
    ("training_graph loss=5", lambda: revgraph.train.training_graph(M, 5), "loss"),
    ("trainable model=5", lambda: revgraph.train.trainable(5), "model"),
    ("trainable params=[]", lambda: revgraph.train.trainable(M, []), "params"),
    ("trainable freeze=5", lambda: revgraph.train.trainable(M, freeze=5), "freeze"),
    ("loss_graph model=5", lambda: revgraph.train.loss_graph(5), "model"),
    ("loss_graph loss=5", lambda: revgraph.train.loss_graph(M, 5), "loss"),
    ("loss_graph output=5", lambda: revgraph.train.loss_graph(M, "mse", output=5), "output"),
    ("loss_graph options", lambda: revgraph.train.loss_graph(M, "mse", colour=1), "colour"),
    ("resolve_output model=5", lambda: revgraph.train.resolve_output(5, None), "model"),
    ("resolve_output output=5", lambda: revgraph.train.resolve_output(M, 5), "output"),
    ("params_as_inputs g=5", lambda: revgraph.train.params_as_inputs(5, []), "g"),
    ("params_as_inputs params=5", lambda: revgraph.train.params_as_inputs(M.copy(), 5), "params"),
    ("eval_graph tg=5", lambda: revgraph.train.eval_graph(5), "tg"),
    ("split_step tg=5", lambda: revgraph.train.split_step(5), "tg"),
    # LoRA
    *[(f"add_adapters {k}={v!r}", (lambda k=k, v=v: rg.lora.add_adapters(**{"graph": M, "rank": 1, k: v})), k)
      for k, v in [("graph", 5), ("rank", 0), ("rank", 2.5), ("rank", True), ("rank", 10**20), ("alpha", 0),
                   ("alpha", float("nan")), ("alpha", "1"), ("targets", []), ("targets", 5), ("seed", -1),
                   ("seed", "0")]],
    ("apply base=5", lambda: rg.lora.apply(5, {}, {}), "base"),
    ("apply arrays=5", lambda: rg.lora.apply(M, 5, {}), "lora.apply:"),  # (the configuration is read first)
    ("apply configuration=5", lambda: rg.lora.apply(M, {}, 5), "configuration"),
    ("apply merge='yes'", lambda: rg.lora.apply(M, {}, {}, merge="yes"), "merge"),
    ("save_adapters path=5", lambda: rg.lora.save_adapters(5, M), "path"),
    ("save_adapters graph=5", lambda: rg.lora.save_adapters("a.npz", 5), "graph"),
    ("load_adapters path=5", lambda: rg.lora.load_adapters(5), "path"),
    # revgraph.export_torch (the module is checked before PyTorch is asked anything)
    ("export_torch module=5", lambda: rg.export_torch(5, (), "m.onnx"), "module"),
    ("export_torch path=5", lambda: rg.export_torch(_linear(), (), 5), "path"),
    ("export_torch kwargs=5", lambda: rg.export_torch(_linear(), (), "m.onnx", kwargs=5), "kwargs"),
    ("export_torch input_names=[1]", lambda: rg.export_torch(_linear(), (), "m.onnx", input_names=[1]), "input_names"),
    ("export_torch output_names=5", lambda: rg.export_torch(_linear(), (), "m.onnx", output_names=5), "output_names"),
    ("export_torch opset_version=0", lambda: rg.export_torch(_linear(), (), "m.onnx", opset_version=0),
     "opset_version"),
    # the value classes of the API
    ("Budget fraction='0.5'", lambda: rg.Budget(fraction="0.5"), "fraction"),
    ("Budget bytes=2**64", lambda: rg.Budget(bytes=2**64), "byte"),
    ("Budget dims", lambda: rg.Budget(fraction=0.5, dims={"N": 0}), "dims"),
    ("RuntimeOptions arena=5", lambda: rg.RuntimeOptions(arena=5), "arena"),
    ("RuntimeOptions memory_pattern='on'", lambda: rg.RuntimeOptions(memory_pattern="on"), "memory"),
    ("RuntimeOptions execution_order=5", lambda: rg.RuntimeOptions(execution_order=5), "execution"),
    # issue 40, item 5
    *[(f"Schedule {k}={v!r}", (lambda k=k, v=v: revgraph.train.Schedule(**{k: v})), f) for k, v, f in [
        ("min_lr", "0", "min-lr"), ("min_lr", None, "min-lr"), ("warmup_steps", True, "warmup-steps"),
        ("total_steps", True, "total_steps"), ("total_steps", 2.5, "total_steps")]],
    ("Trainer loss_options ignore_index=2**70",
     lambda: rg.Trainer(M, "cross-entropy", loss_options={"ignore_index": 2**70}), "ignore-index"),
    ("fit snapshot_every without a directory", lambda: fit(snapshot_every=2), "snapshot_dir"),
]


@pytest.mark.parametrize("label,call,argument", CASES, ids=[c[0] for c in CASES])
def test_public_functions_refuse_bad_arguments_in_one_line(label, call, argument, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (nothing may be written: a refused call writes no file)
    with pytest.raises(rg.RevgraphError) as caught:
        call()
    message = str(caught.value)
    assert message and "\n" not in message, message
    assert argument in message, (argument, message)
    assert not list(tmp_path.iterdir())


def test_argument_errors_are_also_python_type_and_value_errors():
    """Code that caught Python's own ``TypeError`` or ``ValueError`` for a bad argument still does."""
    for call in (lambda: rg.gradient(G, sparse="x"), lambda: fit(batch_size=2.5)):
        with pytest.raises(TypeError):
            call()
        with pytest.raises(ValueError):
            call()
    assert issubclass(ArgumentError, rg.RevgraphError)


def test_fit_with_a_huge_or_negative_batch_does_not_train():
    """``batch_size=-2`` trained 6 steps instead of 2 (and 10**9 looped forever in a checkpoint's hands): no step
    is taken, and the parameters are those from before."""
    t = rg.Trainer(M, "mse")
    before = {k: v.copy() for k, v in t.parameters.items()}
    for bad in (-2, 0, 2**63):
        with pytest.raises(rg.RevgraphError, match="batch_size"):
            t.fit(DATA, batch_size=bad, progress=False)
    assert t.steps == 0 and all(np.array_equal(before[k], v) for k, v in t.parameters.items())


# ------------------------------------------------------------------------------------------ coverage

#: Parameters no rule checks, and why (each is still exercised above where a wrong value could reach it).
UNCHECKED = {
    "console": "any object with print(); a Rich console",
    "emitter": "internal: the rules' emitter, for revgraph's own callers",
    "types": "internal: the value types backward() is given by gradient()",
    "options": "internal: gradient()'s options for backward()",
    "settings": "sgd/adam/adamw's schedule settings: passed to configure(), which checks them (rows above)",
    "args": "export_torch: the module's inputs, any pytree torch.export takes; its refusal is one line "
            "(tests/test_torch_export.py)",
    "dynamic_shapes": "export_torch: torch.export's dynamic shapes; its refusal is one line",
    "export_options": "export_torch: torch.onnx.export's other options (f, dynamo, optimize refused in one line)",
}
#: Parameters checked by the code that owns them (registries, loaders), each with a row in CASES.
OWNED = {"data", "batch", "inputs", "feeds", "ys", "device", "runtime", "buffers", "reduce_dtype", "overlap", "shard",
         "schedule", "no_decay", "precision", "session_options", "loss", "name", "lr", "momentum", "weight_decay",
         "betas", "eps", "clip_grad_norm", "fraction", "bytes", "dims", "arena", "memory_pattern", "execution_order",
         "path", "graph", "options", "output", "static", "rank", "alpha", "outputs", "targets", "params", "freeze",
         "loss_options", "arrays", "configuration", "eval_data", "callbacks"}


def _public_callables():
    """Every public function and method of the documented modules: name -> callable."""
    found = {}
    for n in rg.__all__:
        obj = getattr(rg, n)
        if inspect.isfunction(obj):
            found[f"revgraph.{n}"] = obj
    for mod in (revgraph.train.lora, revgraph.train, revgraph.autodiff):
        for n in getattr(mod, "__all__", None) or [k for k in vars(mod) if not k.startswith("_")]:
            obj = getattr(mod, n)
            # (functions defined there: lora imports fresh_name and is_float_dtype from the IR; vjp registers rules)
            defined = getattr(obj, "__module__", "") == mod.__name__ or (mod is not revgraph.train.lora and
                getattr(obj, "__module__", "").startswith("revgraph"))
            if inspect.isfunction(obj) and defined and n != "vjp":
                found[f"{mod.__name__}.{n}"] = obj
    for cls in (rg.Session, rg.Trainer):
        found[f"{cls.__name__}.__init__"] = cls.__init__
        for n, obj in vars(cls).items():
            if inspect.isfunction(obj) and not n.startswith("_"):
                found[f"{cls.__name__}.{n}"] = obj
    return found


def test_every_parameter_of_every_public_function_is_covered():
    """Each parameter has a rule (``validate.arguments`` on the function), or a row in CASES for its function's
    name, or is owned by checking code (and has a row), or is listed in UNCHECKED with the reason."""
    rows = " ".join(label for label, _, _ in CASES)
    missing = []
    callables = _public_callables()
    assert len(callables) > 40, sorted(callables)  # (the walk found the API)
    for where, fn in callables.items():
        rules = getattr(fn, "__revgraph_rules__", {})
        # the step of every batch and Session.run are hot paths: their data is checked by arrays()/run()
        for p in list(inspect.signature(fn).parameters)[(1 if "." in where and where.split(".")[0] in
                                                         ("Session", "Trainer") else 0):]:
            if p in rules or p in UNCHECKED:
                continue
            short = where.rsplit(".", 1)[-1].replace("__init__", where.split(".")[0])
            if p in OWNED and (f"{p}=" in rows or f"{short} {p}" in rows or f"{short} " in rows):
                continue
            missing.append(f"{where}({p})")
    assert not missing, f"parameters neither checked nor in the table: {missing}"


def _takes_an_argument(fn) -> bool:
    params = list(inspect.signature(fn).parameters)
    return bool(params[1:] if fn.__qualname__.split(".")[0] in ("Session", "Trainer") else params)


@pytest.mark.parametrize("where", sorted(w for w, f in _public_callables().items() if _takes_an_argument(f)))
def test_each_public_function_refuses_an_object_of_the_wrong_kind(where):
    """The generic rule: every public function given ``object()`` for each of its required parameters (a graph, a
    model, a path, names, a rank) raises a one-line RevgraphError, never an AttributeError or a TypeError from
    deep inside."""
    fn = _public_callables()[where]
    owner = fn.__qualname__.split(".")[0]
    params = list(inspect.signature(fn).parameters.values())[1 if owner in ("Session", "Trainer") else 0:]
    required = [object() for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                                 p.POSITIONAL_OR_KEYWORD)] or [object()]
    if owner == "Session":
        call = (lambda: rg.Session(*required)) if fn.__name__ == "__init__" else \
            (lambda: getattr(rg.Session(G), fn.__name__)(*required))
    elif owner == "Trainer":
        call = (lambda: rg.Trainer(*required)) if fn.__name__ == "__init__" else \
            (lambda: getattr(trainer(), fn.__name__)(*required))
    else:
        call = lambda: fn(*required)
    with pytest.raises(rg.RevgraphError) as caught:
        call()
    assert str(caught.value) and "\n" not in str(caught.value)


# ---------------------------------------------------------------- warnings name the caller's line, not revgraph's


def _caught(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if issubclass(w.category, UserWarning)]


def _unconnected() -> Graph:
    g = _graph()
    g.initializers["unused"] = np.ones(2, np.float32)
    return g


def _integer_pow() -> tuple[Graph, dict]:
    """``y = Pow(b, p)`` with b int32 and its types: the Pow rule warns (no gradient flows through an integer)."""
    inputs = [ValueInfo("b", np.int32, (3,)), ValueInfo("p", np.float32, (3,))]
    g = Graph([Node("Pow", ["b", "p"], ["y"], name="pow")], inputs, [ValueInfo("y", np.int32, (3,))])
    return g, {v.name: v for v in inputs}


def _scatter_at_run_time() -> Graph:
    """ScatterElements (reduction none) with indices fed at run time: its rule warns about repeats."""
    return Graph([Node("ScatterElements", ["d", "i", "u"], ["s"], {"axis": 1}, "scatter"),
                  Node("ReduceSum", ["s"], ["loss"], {"keepdims": 0}, "sum")],
                 [ValueInfo("d", np.float32, (2, 4)), ValueInfo("i", np.int64, (2, 3)),
                  ValueInfo("u", np.float32, (2, 3))],
                 [ValueInfo("loss", np.float32, ())])


def _noisy() -> Graph:
    """A random draw that is never recomputed: a budget of 10 bytes cannot be met (the planner warns)."""
    return Graph([Node("Tanh", ["x"], ["h"], name="t"), Node("RandomNormalLike", ["h"], ["n"], {"seed": 3.0}, "noise"),
                  Node("Mul", ["h", "n"], ["m"], name="mul"), Node("ReduceSum", ["m"], ["loss"], {"keepdims": 0}, "s")],
                 [ValueInfo("x", np.float32, (4, 8))], [ValueInfo("loss", np.float32, ())])


def _no_product() -> Graph:
    return Graph([Node("Mul", ["x", "w"], ["logits"], name="mul")], [ValueInfo("x", np.float32, ("N", 3))],
                 [ValueInfo("logits", np.float32, ("N", 3))], {"w": np.ones(3, np.float32)})


WARNING_CALLS = {  # what: (the call, a fragment of the warning); each goes through a function of V.arguments
    "gradient, unconnected": (lambda: rg.gradient(_unconnected(), wrt=["w", "unused"]), "no path from 'unused'"),
    "jvp, unconnected": (lambda: rg.jvp(_unconnected(), outputs=["y"], inputs=["unused"]), "their tangents are zero"),
    "hvp, unconnected": (lambda: rg.hvp(_unconnected(), wrt=["w", "unused"]), "no path from 'unused'"),
    "a rule (Pow of an integer)": (lambda: rg.backward(_integer_pow()[0], {"y": None}, ["p"], types=_integer_pow()[1]),
                                   "an integer, so no gradient"),
    "a rule (ScatterElements)": (lambda: rg.gradient(_scatter_at_run_time(), wrt=["u"]), "reduction='none'"),
    "the memory planner": (lambda: rg.gradient(_noisy(), memory=10), "cannot be met"),
    "Trainer, precision": (lambda: rg.Trainer(_no_product(), "cross-entropy", "sgd", precision="bf16"),
                           "no float32 MatMul"),
}


@pytest.mark.parametrize("what", list(WARNING_CALLS))
def test_a_warning_names_the_callers_file_and_line(what):
    """Issue 28 round 3: a warning raised through a public function decorated with ``@V.arguments`` named
    validate.py (the decorator's wrapper, a fixed stacklevel) or another revgraph file as its location. Every
    revgraph warning (:func:`revgraph.warn.warn`) names the first frame outside revgraph: here, this file, at
    the line of the lambda that called revgraph."""
    call, fragment = WARNING_CALLS[what]
    caught = [w for w in _caught(call) if fragment in str(w.message)]
    assert caught, [str(w.message) for w in _caught(call)]
    for w in caught:
        assert w.filename == __file__, (w.filename, w.lineno, str(w.message))
        assert w.lineno == call.__code__.co_firstlineno, (w.lineno, call.__code__.co_firstlineno)


def test_no_revgraph_module_warns_past_the_helper():
    """Every warning revgraph raises goes through revgraph.warn.warn (a bare warnings.warn would guess a
    stacklevel that the decorators' frames make wrong)."""
    import pathlib
    import re

    src = pathlib.Path(rg.__file__).resolve().parent
    bare = [str(p.relative_to(src)) for p in src.rglob("*.py")
            if p.name != "warn.py" and re.search(r"\bwarnings\.warn\(", p.read_text())]
    assert bare == []
