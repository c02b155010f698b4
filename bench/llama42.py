"""Issue 42's LLaMA and its AdamW training step in revgraph, PyTorch (eager, per-layer checkpointing,
``torch.compile``) and JAX: what bench/compile_anchor.py and bench/max_batch.py run, one configuration per process.

The model: ``transformers.LlamaForCausalLM(LlamaConfig(**LLAMA))``: hidden 256, 4 layers, 4 heads, 2 key/value
heads, vocabulary 8000, intermediate 688, untied LM head (7.0M parameters), sequences of :data:`SEQ` = 128 tokens,
seeded random weights (``torch.manual_seed(0)``) written once by :func:`prepare`: ``llama42.onnx``
(``rg.export_torch`` of the module's logits, symbolic batch) and ``llama42.npz`` (the ``state_dict`` and the rotary
``inv_freq``), which every side reads, so all start from the same weights and the same batch (:func:`tokens`).

A step is the causal-LM loss (position t predicts token t + 1, mean over the ``B x 127`` predictions), its
backward and one ``AdamW(lr=1e-3, weight_decay=0.01)`` update of every parameter (decay on all of them, as
``torch.optim.AdamW``):

- ``rg``, ``rg-<F>``: ``rg.Trainer("llama42.onnx", "causal-lm", rg.train.adamw(), no_decay="none",
  threads=N[, memory=F])`` and ``trainer.step({"input_ids": ids})`` (``F``: 0.5 is a fraction of what the default
  keeps, 0 the byte count "keep only what cannot be recomputed");
- ``pt``: eager, ``model(input_ids=ids, labels=ids).loss.backward()`` and ``torch.optim.AdamW.step()`` (PyTorch's
  CPU default, the single-tensor loop); ``pt-ckpt``: the same with ``model.gradient_checkpointing_enable(
  {"use_reentrant": False})`` (transformers' ``torch.utils.checkpoint`` around every decoder layer);
  ``pt-compile``: the same with ``torch.compile(model)`` (inductor, default mode: forward and, through
  AOTAutograd, backward compiled to C++; the optimizer stays eager); the first step includes the compilation;
- ``jax``: ``jax.jit`` of ``value_and_grad`` and ``optax.adamw(1e-3, weight_decay=0.01)``, parameters and state
  donated (bench/memory_jax.py's LLaMA function on these weights).

Threads: ``torch.set_num_threads(N)``, onnxruntime's intra-op pool ``threads=N``, XLA's Eigen pool; the caller
sets :func:`thread_env` in the process's environment too (OpenMP, MKL, OpenBLAS, XLA_FLAGS).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from pathlib import Path

import numpy as np

LLAMA = {"vocab_size": 8000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "tie_word_embeddings": False}
SEQ = 128
CONFIGS = ("rg", "rg-0.5", "rg-0", "pt", "pt-ckpt", "pt-compile", "jax")


def thread_env(threads: int) -> dict:
    """Environment variables that hold every library of a worker to ``threads`` intra-op threads."""
    n = str(threads)
    xla = ("--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" if threads == 1 else
           f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={n}")
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "XLA_FLAGS": xla,
            "TF_CPP_MIN_LOG_LEVEL": "3", "TOKENIZERS_PARALLELISM": "false"}


def tokens(batch: int, seed: int = 0) -> np.ndarray:
    """Uniform random token ids, int64 ``[batch, SEQ]`` (seeded: every side steps on the same batch)."""
    return np.random.default_rng(seed).integers(0, LLAMA["vocab_size"], (batch, SEQ)).astype(np.int64)


def _config():
    import transformers as tf

    cfg = tf.LlamaConfig(**LLAMA, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def prepare(cache: str) -> dict:
    """Write ``llama42.onnx``, ``llama42.npz`` and ``llama42.json`` into ``cache`` (module doc) unless they exist;
    returns the JSON (file paths, parameter names, export seconds)."""
    import torch
    import transformers as tf
    from finetune_worker import export_logits

    base = Path(cache)
    info_path = base / "llama42.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    base.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_config()).eval()

    export_s = export_logits(model, tokens(2), base / "llama42.onnx")
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    np.savez(base / "llama42.npz", **state,
             inv_freq=model.model.rotary_emb.inv_freq.detach().numpy().copy())  # (a buffer outside the state_dict)
    info = {"onnx": str(base / "llama42.onnx"), "npz": str(base / "llama42.npz"),
            "params": [k for k, _ in model.named_parameters()], "rms_norm_eps": model.config.rms_norm_eps,
            "parameters": sum(p.numel() for p in model.parameters()), "export_s": export_s}
    info_path.write_text(json.dumps(info))
    return info


def framework_import(config: str) -> None:
    """Import ``config``'s framework and run a toy step (bench/memory_worker.py's, so that one-time initialisation
    is done before a limit is set or a clock starts); ``pt-compile`` also compiles a toy function."""
    import memory_worker

    memory_worker._import("jax" if config == "jax" else config.replace("-compile", ""), "llama")
    if config == "pt-compile":
        import torch

        torch.compile(lambda x: x.sin() + 1)(torch.ones(3))
    gc.collect()


class Step:
    """``config``'s training step at ``batch`` with ``threads`` threads, on the files of :func:`prepare`.
    ``step()`` runs one step and returns its loss (a float); ``build_s`` is the construction's seconds."""

    def __init__(self, config: str, batch: int, threads: int, info: dict):
        if config not in CONFIGS:
            raise ValueError(f"unknown configuration {config!r}; choose from {', '.join(CONFIGS)}")
        t0 = time.perf_counter()
        self.config, self.ids = config, tokens(batch)
        if config.startswith("rg"):
            self._run = self._revgraph(config, threads, info)
        elif config.startswith("pt"):
            self._run = self._torch(config, threads, info)
        else:
            self._run = self._jax(info)
        self.build_s = time.perf_counter() - t0

    def step(self) -> float:
        return self._run()

    def _revgraph(self, config, threads, info):
        import revgraph as rg

        kw = {} if config == "rg" else {"memory": 0 if config == "rg-0" else float(config[3:])}
        tr = rg.Trainer(info["onnx"], "causal-lm", rg.train.adamw(), params=info["params"], no_decay="none",
                        threads=threads, **kw)
        data = {"input_ids": self.ids}
        return lambda: float(tr.step(data))

    def _torch(self, config, threads, info):
        import torch
        import transformers as tf

        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # already set (the pool starts with the first parallel op)
            torch.set_num_interop_threads(1)
        model = tf.LlamaForCausalLM(_config())
        with np.load(info["npz"]) as f:
            model.load_state_dict({k: torch.from_numpy(f[k]) for k in f.files if k != "inv_freq"}, strict=True)
        model.train()
        if config == "pt-ckpt":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        forward = torch.compile(model) if config == "pt-compile" else model
        x = torch.from_numpy(self.ids)

        def run():
            model.zero_grad(set_to_none=True)
            loss = forward(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            return float(loss.detach())

        return run

    def _jax(self, info):
        import functools

        import jax
        import jax.numpy as jnp
        import memory_jax
        import optax

        memory_jax.LLAMA = LLAMA  # its LLaMA function reads the configuration from this module global
        with np.load(info["npz"]) as f:
            params = {"m." + k: jnp.asarray(f[k]) for k in info["params"]}  # (memory_jax's wrapper prefix "m.")
            inv_freq = jnp.asarray(f["inv_freq"])
        forward = functools.partial(memory_jax._llama, inv_freq=inv_freq, eps=info["rms_norm_eps"], remat=False)
        x = jnp.asarray(self.ids, jnp.int32)
        y = x[:, 1:]
        opt = optax.adamw(1e-3, weight_decay=0.01)

        def loss_fn(p):
            logp = jax.nn.log_softmax(forward(p, x), axis=-1)  # logits [B, 127, V]
            return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()

        def update(p, s):
            loss, g = jax.value_and_grad(loss_fn)(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        f = jax.jit(update, donate_argnums=(0, 1))
        state = [params, opt.init(params)]

        def run():
            p, s, loss = jax.block_until_ready(f(*state))
            state[:] = [p, s]
            return float(loss)

        return run


def common_options(parser, json_name: str, timeout: float) -> None:
    """The options bench/compile_anchor.py and bench/max_batch.py share: ``--json`` (default
    bench/results/``json_name``), ``--cache``, ``--timeout`` (seconds per worker call or probe), ``--render``
    and ``--no-snapshot``."""
    import tempfile

    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / json_name))
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "revgraph-bench-llama42"),
                        help="model files and logs")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per worker call or probe")
    parser.add_argument("--render", metavar="JSON", help="no measurement: print the table of saved results")
    parser.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                        help="run the working tree's src/revgraph instead of a copy made at the start")


def save_results(res: dict, json_path: str, cache: str, table) -> None:
    """End a run of bench/compile_anchor.py or bench/max_batch.py: paths made portable, ``res`` written to
    ``json_path``, its ``table(res)`` printed."""
    import tempfile

    from report_format import portable

    root = str(Path(__file__).resolve().parent.parent)
    res = portable(res, {root: "<repo>", str(Path(cache)): "<cache>", tempfile.gettempdir(): "<tmp>"})
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {json_path} ({res['seconds']:.0f} s; load {res['load_start']} -> {res['load_end']})", flush=True)
    print(table(res))


# ------------------------------------------------------------------------ worker functions (bench/_worker.py)

def build(config: str, batch: int, threads: int, cache: str) -> dict:
    """In a worker: import, build and run the first step (timed apart: for ``pt-compile`` and ``jax`` it compiles),
    then a second step; keeps the step for ``memory_worker.time_steps``."""
    t0 = time.perf_counter()
    framework_import(config)
    import_s = time.perf_counter() - t0
    info = json.loads((Path(cache) / "llama42.json").read_text())
    s = Step(config, batch, threads, info)
    t0 = time.perf_counter()
    loss = s.step()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    s.step()
    second_s = time.perf_counter() - t0
    import memory_worker

    memory_worker._TASK[:] = [s]  # what memory_worker.time_steps runs (bench/memory.py's turns)
    return {"import_s": import_s, "build_s": s.build_s, "first_step_s": first_s, "second_step_s": second_s,
            "loss": loss}

