"""revgraph's side of bench/memory.py: the training step as a user writes it.

- An Adam step (LLaMA, Transformer, CNN): ``rg.Trainer(model, "cross-entropy", "adam", params=..., threads=1)``
  and ``trainer.step({input: x, "labels": y})``; the LLaMA's cross-entropy reads its ``[B, 127, 2048]`` logits
  and ``[B, 127]`` labels (``loss_graph`` takes the last axis as the classes).
- Forward plus backward (the RNN): ``revgraph.train.loss_graph`` (cross-entropy), the parameters made graph
  inputs, ``rg.gradient(graph, loss, params)``, run by ``rg.Session(..., threads=1).run(feeds)`` (onnxruntime
  allocates the gradients each step, as PyTorch allocates ``.grad``).

Configurations: ``rg`` (every default), ``rg-<F>`` (``memory=F``: 1.0 and 0.5 as fractions of what the default
saves, 0 as a byte count: keep only what cannot be recomputed), ``rg-ort`` (``rg.RuntimeOptions(arena=True,
memory_pattern=True)``, onnxruntime's own defaults) and ``rg-lean`` (arena and memory pattern off). Keywords
this revgraph does not take raise :class:`NotAvailable` (the cell reads "n/a"); without ``rg.RuntimeOptions``,
``rg-lean`` sets the two options by wrapping ``onnxruntime.SessionOptions`` in the worker process.

Saved bytes: :func:`revgraph.autodiff.memory.saved_bytes` of the step graph (the forward values its backward
nodes read), with the exported symbolic batch dimension set to the batch.
"""

from __future__ import annotations

import inspect

import numpy as np
from memory_common import llama_batch


class NotAvailable(Exception):
    """This revgraph has no such option (yet): the cell is "n/a"."""


def _runtime_keyword(fn) -> str | None:
    """The name of ``fn``'s parameter that takes an ``rg.RuntimeOptions``, if it has one."""
    for name, p in inspect.signature(fn).parameters.items():
        if "RuntimeOptions" in str(p.annotation) or name in ("runtime", "runtime_options"):
            return name
    return None


def _options(config: str, fn) -> tuple[dict, str]:
    """Keyword arguments of ``fn`` (``rg.Trainer``, ``rg.gradient`` or ``rg.Session``) for ``config``."""
    import revgraph as rg

    if config == "rg":
        return {}, "defaults"
    if config in ("rg-ort", "rg-lean"):
        on = config == "rg-ort"
        if hasattr(rg, "RuntimeOptions"):
            kw = _runtime_keyword(fn)
            if kw is None:
                raise NotAvailable(f"{fn.__name__} takes no RuntimeOptions")
            return {kw: rg.RuntimeOptions(arena=on, memory_pattern=on)}, (f"{kw}=RuntimeOptions(arena={on}, "
                                                                          f"memory_pattern={on})")
        if on:
            raise NotAvailable("no rg.RuntimeOptions (revgraph's default is onnxruntime's: arena on, pattern on)")
        import onnxruntime as ort

        original = ort.SessionOptions

        def lean(*a, **k):
            o = original(*a, **k)
            o.enable_cpu_mem_arena = False
            o.enable_mem_pattern = False
            return o

        ort.SessionOptions = lean
        return {}, "onnxruntime.SessionOptions wrapped: enable_cpu_mem_arena = enable_mem_pattern = False"
    budget = config[3:]
    value = 0 if budget == "0" else float(budget)
    if "memory" not in inspect.signature(fn).parameters:
        raise NotAvailable(f"{getattr(fn, '__qualname__', fn)} takes no memory= budget")
    return {"memory": value}, f"memory={value!r}"


class RgTask:
    def __init__(self, spec: dict):
        import revgraph as rg

        self.spec = spec
        model, B, files, config = spec["model"], spec["batch"], spec["files"], spec["config"]
        budget = config[3:4].isdigit()
        if spec["step"] == "adam":
            kw, self.how = _options(config, rg.Trainer.__init__)
            path = files["onnx"] if model == "llama" else files["path"]
            try:
                tr = rg.Trainer(path, "cross-entropy", "adam", params=files["params"], threads=1, **kw)
            except TypeError as exc:
                raise NotAvailable(str(exc)) from None
            if model == "llama":
                data = llama_batch(B)
            else:
                import models

                _, d = models.load_npz(files["npz"])
                data = {tr.spec.inputs[0]: d["x"], "labels": d["labels"]}
            self.graph = tr.spec.graph
            self._run = lambda: tr.step(data)
            self.feeds = lambda: {**tr.spec.initial_state(), **{tr.spec.labels if k == "labels" else k: v
                                                                for k, v in data.items()}}
        else:
            import models

            from revgraph.train import loss_graph, params_as_inputs

            kw_grad, self.how = _options(config, rg.gradient) if budget else ({}, "")
            kw_sess, how = ({}, "") if budget else _options(config, rg.Session.__init__)
            self.how = self.how or how
            g, ls = loss_graph(rg.load(files["path"]), "cross-entropy")
            g.outputs = g.outputs[:1]
            params = files["params"]
            state, d = models.load_npz(files["npz"])
            params_as_inputs(g, params)
            try:
                gg = rg.gradient(g, ls.loss, params, **kw_grad)
                sess = rg.Session(gg, threads=1, **kw_sess)
            except TypeError as exc:
                raise NotAvailable(str(exc)) from None
            feeds = {g.inputs[0].name: d["x"], ls.labels: d["labels"], **{p: state[p] for p in params}}
            self.graph, self.feeds = gg, lambda: feeds
            self._run = lambda: float(sess.run(feeds)[ls.loss])
        self.params = sum(int(np.prod(v.shape)) for v in self.graph.inputs if v.name in set(files["params"]))

    def step(self) -> float:
        return self._run()

    def saved(self) -> dict:
        """``saved_bytes`` of the step graph; residuals whose types leave a dimension unknown (``?``: behind a
        Loop, a Reshape to a computed shape) are sized by running the graph once more with them as outputs."""
        import revgraph as rg
        from revgraph.autodiff.memory import residual_sizes, saved_bytes
        from revgraph.ir import ValueInfo

        dims = {self.spec["files"].get("batch_dim", "batch"): self.spec["batch"]}
        sizes = residual_sizes(self.graph, dims)
        out = {"saved_tensors": len(sizes), "nodes": len(self.graph.nodes), "how": self.how,
               "saved_method": "revgraph.autodiff.memory.saved_bytes of the step graph"}
        unknown = [n for n, b in sizes.items() if b is None]
        if unknown:
            g = self.graph.copy()
            g.outputs = [*g.outputs, *(ValueInfo(n) for n in unknown)]
            values = rg.Session(g, threads=1).run(self.feeds(), outputs=unknown)
            sizes.update({n: int(values[n].nbytes) for n in unknown})
            out["saved_sized_by_running"] = unknown
            out["saved_bytes"] = sum(sizes.values())
        else:
            out["saved_bytes"] = saved_bytes(self.graph, dims=dims)
        return out
