"""PyTorch's side of bench/memory.py: the LLaMA and the bench models in eager mode, with and without
``torch.utils.checkpoint`` on every block, and the bytes autograd saves for the backward pass.

Also writes the LLaMA's ONNX file (``torch.onnx.export(dynamo=True, optimize=False, opset_version=23)``) and
its weights, which revgraph and JAX read (:func:`export_llama`, run once in a process of its own).

A step is ``zero_grad(set_to_none=True)``, the loss, ``loss.backward()`` and, for an Adam step,
``torch.optim.Adam(lr=1e-3).step()`` (PyTorch's default single-tensor implementation on the CPU).

Saved bytes (:meth:`TorchTask.saved`): one more step under ``torch.autograd.graph.saved_tensors_hooks``; every
tensor autograd packs is counted once per storage (``untyped_storage().data_ptr()``, the whole storage's
``nbytes``, since a saved view keeps its storage alive), leaving out the parameters' and the batch's storages
(alive anyway; revgraph's count leaves out graph inputs too). Under non-reentrant checkpointing autograd packs
nothing inside a block (the checkpoint's own hooks take the tensors and recompute them in the backward), and what
the checkpoint keeps, the block's tensor arguments, is counted by the wrapper that calls it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np
from memory_common import LLAMA, SEQ, llama_batch, llama_files, rnn_segment


def _llama_module():
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(**LLAMA, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)

    class LM(torch.nn.Module):
        """Logits of every position but the last: position t predicts token t + 1 (labels = ids[:, 1:])."""

        def __init__(self):
            super().__init__()
            self.m = tf.LlamaForCausalLM(cfg)

        def forward(self, input_ids):
            return self.m(input_ids=input_ids).logits[:, :-1, :]

    return LM(), cfg


def export_llama(cache: str) -> dict:
    """Write the LLaMA's ONNX file (symbolic batch ``batch``), its weights (npz, under the wrapper's ``state_dict``
    names, which are the ONNX initializers') and a JSON of what the others need; skip what exists."""
    import torch

    files = llama_files(cache)
    if all(os.path.exists(f) for f in files.values()):
        return json.loads(Path(files["json"]).read_text())
    os.makedirs(cache, exist_ok=True)
    module, cfg = _llama_module()
    module.eval()  # no dropout in LLaMA anyway; eval keeps the exporter from tracing training-only branches
    ids = torch.randint(0, LLAMA["vocab_size"], (2, SEQ))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (ids,), dynamo=True, optimize=False, opset_version=23,
                                    input_names=["input_ids"], output_names=["logits"],
                                    dynamic_shapes={"input_ids": {0: "batch"}}, verbose=False)
    tmp = files["onnx"] + ".tmp"
    program.save(tmp)
    os.replace(tmp, files["onnx"])
    state = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
    buffers = {f"buffer:{k}": v.detach().numpy().copy() for k, v in module.named_buffers() if k not in state}
    np.savez(files["npz"], **state, **buffers)  # rotary inv_freq is not in the state_dict (not persistent)
    info = {**files, "params": [k for k, _ in module.named_parameters()], "batch_dim": "batch",
            "export_seconds": time.perf_counter() - t0, "rms_norm_eps": cfg.rms_norm_eps,
            "rope": dict(cfg.rope_parameters or {}), "config": LLAMA, "seq": SEQ}
    Path(files["json"]).write_text(json.dumps(info))
    return info


class _Saved:
    """Counts the storages autograd saves (module doc); active only while ``counting`` is set."""

    def __init__(self):
        self.counting = False
        self.exclude: set[int] = set()
        self.storages: dict[int, int] = {}

    def add(self, t) -> None:
        import torch

        if not self.counting or not isinstance(t, torch.Tensor):
            return
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr and ptr not in self.exclude:
            self.storages[ptr] = max(self.storages.get(ptr, 0), s.nbytes())

    def add_all(self, values) -> None:
        for v in values:
            if isinstance(v, (tuple, list)):
                self.add_all(v)
            else:
                self.add(v)


SAVED = _Saved()


def checkpointed(fn, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)``, counting what it keeps."""
    import torch.utils.checkpoint as cp

    SAVED.add_all(args)
    SAVED.add_all(kwargs.values())
    SAVED.add_all(getattr(fn, "keywords", {}).values())  # a functools.partial's bound tensors (transformers)
    return cp.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _wrap_forward(module) -> None:
    """Checkpoint ``module``'s forward (an instance attribute: parameter names and attributes stay)."""
    inner = module.forward
    module.forward = lambda *a, **k: checkpointed(inner, *a, **k)


class TorchTask:
    """One configuration's training step (module doc). ``config``: ``"pt"`` (eager) or ``"pt-ckpt"``."""

    def __init__(self, spec: dict):
        import torch

        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        self.spec = spec
        model, ckpt, B = spec["model"], spec["config"] == "pt-ckpt", spec["batch"]
        F = torch.nn.functional
        if model == "llama":
            module, _ = _llama_module()
            with np.load(spec["files"]["npz"]) as f:
                state = {k: f[k] for k in f.files if not k.startswith("buffer:")}
            module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
            data = llama_batch(B)
            x, y = torch.from_numpy(data["input_ids"]), torch.from_numpy(data["labels"])
            if ckpt:  # transformers' own mechanism, with our counting wrapper as the checkpoint function
                for layer in module.m.model.layers:
                    layer.gradient_checkpointing = True
                    layer._gradient_checkpointing_func = checkpointed
            vocab = LLAMA["vocab_size"]
            self.loss_fn = lambda: F.cross_entropy(module(x).reshape(-1, vocab), y.reshape(-1))
        else:
            import models

            module = models.torch_module(model)
            state, data = models.load_npz(spec["files"]["npz"])
            module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True)
            x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["labels"])
            if model == "rnn" and ckpt:
                forward = _rnn_forward(module, rnn_segment(x.shape[0]))
            else:
                if ckpt:  # the CNN's residual blocks, the Transformer's encoder layers
                    blocks = module.blocks if model == "cnn" else module.encoder.layers
                    for b in blocks:
                        _wrap_forward(b)
                forward = module
            self.loss_fn = lambda: F.cross_entropy(forward(x), y)
        module.train()
        self.module = module
        self.opt = torch.optim.Adam(module.parameters(), lr=1e-3) if spec["step"] == "adam" else None
        SAVED.exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
        SAVED.exclude |= {t.untyped_storage().data_ptr() for t in (x, y)}
        self.params = sum(p.numel() for p in module.parameters())

    def step(self) -> float:
        self.module.zero_grad(set_to_none=True)
        loss = self.loss_fn()
        loss.backward()
        if self.opt is not None:
            self.opt.step()
        return float(loss.detach())

    def saved(self) -> dict:
        """One more step, counting the saved storages (module doc)."""
        import torch

        SAVED.storages, SAVED.counting = {}, True

        def pack(t):
            SAVED.add(t)
            return t

        try:
            self.module.zero_grad(set_to_none=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = self.loss_fn()
            SAVED.counting = False
            loss.backward()
        finally:
            SAVED.counting = False
        self.module.zero_grad(set_to_none=True)
        return {"saved_bytes": sum(SAVED.storages.values()), "saved_tensors": len(SAVED.storages),
                "saved_method": "saved_tensors_hooks, unique storages, parameters and batch left out"}


def _rnn_forward(module, segment: int):
    """The bench RNN's forward (models.torch_module("rnn")) with every ``segment`` steps checkpointed as one block."""
    import torch

    def run(h, xs):
        for t in range(xs.shape[0]):
            h = torch.tanh(h @ module.W + xs[t] @ module.U + module.b)
        return h

    def forward(xs):
        h = torch.zeros(xs.shape[1], module.W.shape[0])
        for s in range(0, xs.shape[0], segment):
            h = checkpointed(run, h, xs[s:s + segment])
        return module.fc(h)

    return forward
