"""JAX's side of bench/memory.py: ``jax.jit`` of the whole step, with and without ``jax.checkpoint`` per block.

- The LLaMA in ``jax.numpy``, the function of transformers' ``LlamaForCausalLM`` (RMSNorm in float32, rotary
  embeddings from the exported ``inv_freq``, grouped-query attention with a causal mask and softmax in
  float32, SwiGLU MLP, untied ``lm_head``), on the weights PyTorch exported (memory_torch.export_llama); its
  loss is checked against PyTorch's in every run (bench/memory.py compares the first-step losses).
- The bench models: ``jax_tasks._models()`` (bench/run.py's JAX side) without checkpoints; with checkpoints the
  same functions written here with ``jax.checkpoint`` around each CNN residual block, each Transformer encoder
  layer, and each RNN segment of memory_common.rnn_segment steps (a nested ``lax.scan``).

An Adam step is ``jax.jit(step, donate_argnums=(0, 1))`` of ``value_and_grad`` and ``optax.adam(1e-3)`` (PyTorch's
defaults; a hand-written Adam with the same formulas if optax is not installed), parameters and state donated, as
a careful JAX user writes it; forward plus backward is ``jax.jit(jax.value_and_grad(loss))``. Each call ends
with ``block_until_ready``. Saved bytes: ``jax._src.ad_checkpoint.saved_residuals`` of the loss (the residuals
of the jaxpr, before XLA's own fusion and scheduling), arguments (parameters, batch) left out; next to it the
compiled step's ``memory_analysis()`` (XLA's temporary buffer, which holds every intermediate of the step).
"""

from __future__ import annotations

import functools

import numpy as np
from memory_common import LLAMA, llama_batch, rnn_segment


def _llama(p, ids, inv_freq, eps, remat):
    import jax
    import jax.numpy as jnp

    H, nh, nkv = LLAMA["hidden_size"], LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"]
    hd = H // nh
    B, T = ids.shape

    def rms(x, w):
        return w * (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps))

    freqs = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], -1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)  # [T, hd]

    def rotate(x):  # x [B, heads, T, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + jnp.concatenate([-x2, x1], -1) * sin

    mask = jnp.tril(jnp.ones((T, T), bool))

    def layer(x, q_w, k_w, v_w, o_w, gate_w, up_w, down_w, ln1, ln2):
        h = rms(x, ln1)
        q = (h @ q_w.T).reshape(B, T, nh, hd).transpose(0, 2, 1, 3)
        k = (h @ k_w.T).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        v = (h @ v_w.T).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        q, k = rotate(q), rotate(k)
        k, v = jnp.repeat(k, nh // nkv, axis=1), jnp.repeat(v, nh // nkv, axis=1)  # repeat_kv
        s = (q @ k.transpose(0, 1, 3, 2)) * (hd ** -0.5)
        att = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, H)
        x = x + o @ o_w.T
        h = rms(x, ln2)
        return x + (jax.nn.silu(h @ gate_w.T) * (h @ up_w.T)) @ down_w.T

    step = jax.checkpoint(layer) if remat else layer
    x = p["m.model.embed_tokens.weight"][ids]
    for i in range(LLAMA["num_hidden_layers"]):
        pre = f"m.model.layers.{i}."
        x = step(x, *(p[pre + n] for n in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
            "post_attention_layernorm.weight")))
    x = rms(x, p["m.model.norm.weight"])
    return (x @ p["m.lm_head.weight"].T)[:, :-1, :]


def _remat_models():
    """jax_tasks' CNN, Transformer and RNN with ``jax.checkpoint`` per block (module doc)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def linear(p, name, x):
        return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    def conv(p, name, x, stride, pad):
        return lax.conv_general_dilated(x, p[f"{name}.weight"], (stride, stride), ((pad, pad), (pad, pad)),
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))

    def bn(p, name, x, eps=1e-5):
        mean = x.mean((0, 2, 3), keepdims=True)
        var = jnp.square(x - mean).mean((0, 2, 3), keepdims=True)
        return (x - mean) * lax.rsqrt(var + eps) * p[f"{name}.weight"].reshape(1, -1, 1, 1) + \
            p[f"{name}.bias"].reshape(1, -1, 1, 1)

    def layer_norm(p, name, x, eps=1e-5):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"]

    @functools.partial(jax.checkpoint, static_argnums=(1, 3, 4))
    def block(p, name, x, stride, down):
        h = jax.nn.relu(bn(p, f"{name}.bn1", conv(p, f"{name}.conv1", x, stride, 1)))
        h = bn(p, f"{name}.bn2", conv(p, f"{name}.conv2", h, 1, 1))
        sc = bn(p, f"{name}.down.1", conv(p, f"{name}.down.0", x, stride, 0)) if down else x
        return jax.nn.relu(h + sc)

    def cnn(p, x):
        h = jax.nn.relu(bn(p, "bn", conv(p, "conv", x, 1, 1)))
        h = block(p, "blocks.0", h, 1, False)
        h = block(p, "blocks.1", h, 2, True)
        h = block(p, "blocks.2", h, 2, True)
        return linear(p, "fc", h.mean((2, 3)))

    @functools.partial(jax.checkpoint, static_argnums=(1,))
    def encoder_layer(p, name, x, heads=4):
        b, s, d = x.shape
        qkv = x @ p[f"{name}.self_attn.in_proj_weight"].T + p[f"{name}.self_attn.in_proj_bias"]
        q, k, v = (t.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3) for t in jnp.split(qkv, 3, axis=-1))
        att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads).astype(np.float32), axis=-1)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        x = layer_norm(p, f"{name}.norm1", x + linear(p, f"{name}.self_attn.out_proj", o))
        ff = linear(p, f"{name}.linear2", jax.nn.relu(linear(p, f"{name}.linear1", x)))
        return layer_norm(p, f"{name}.norm2", x + ff)

    def transformer(p, x):
        for i in range(2):
            x = encoder_layer(p, f"encoder.layers.{i}", x)
        return linear(p, "fc", x.mean(1))

    def rnn(p, xs):
        seg = rnn_segment(xs.shape[0])

        def step(h, x_t):
            return jnp.tanh(h @ p["W"] + x_t @ p["U"] + p["b"]), None

        @jax.checkpoint
        def segment(h, x_seg):
            return lax.scan(step, h, x_seg)[0], None

        h0 = jnp.zeros((xs.shape[1], p["W"].shape[0]), xs.dtype)
        h, _ = lax.scan(segment, h0, xs.reshape(xs.shape[0] // seg, seg, *xs.shape[1:]))
        return linear(p, "fc", h)

    return {"cnn": cnn, "transformer": transformer, "rnn": rnn}


def _adam(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    """``optax.adam`` (``init``, ``update``, ``apply``), or the same formulas by hand without optax."""
    import jax
    import jax.numpy as jnp

    try:
        import optax

        opt = optax.adam(lr, b1, b2, eps)
        return opt.init, opt.update, optax.apply_updates, f"optax {optax.__version__}"
    except ImportError:
        pass

    def init(p):
        zeros = jax.tree.map(jnp.zeros_like, p)
        return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, p), "t": jnp.zeros((), jnp.int32)}

    def update(g, s, p=None):
        t = s["t"] + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, s["m"], g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, s["v"], g)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        u = jax.tree.map(lambda m, v: -lr * (m / c1) / (jnp.sqrt(v / c2) + eps), m, v)
        return u, {"m": m, "v": v, "t": t}

    return init, update, lambda p, u: jax.tree.map(jnp.add, p, u), "hand-written"


class JaxTask:
    """One configuration's step (module doc). ``config``: ``"jax"`` or ``"jax-ckpt"``."""

    def __init__(self, spec: dict):
        import jax
        import jax.numpy as jnp

        self.spec = spec
        model, remat = spec["model"], spec["config"] == "jax-ckpt"
        if model == "llama":
            state = dict(np.load(spec["files"]["npz"]))
            names = spec["files"]["params"]
            inv_freq = jnp.asarray(state["buffer:m.model.rotary_emb.inv_freq"])
            eps = spec["files"]["rms_norm_eps"]
            data = llama_batch(spec["batch"])
            x, y = jnp.asarray(data["input_ids"], jnp.int32), jnp.asarray(data["labels"], jnp.int32)
            forward = functools.partial(_llama, inv_freq=inv_freq, eps=eps, remat=remat)
        else:
            import jax_tasks
            import models

            state, data = models.load_npz(spec["files"]["npz"])
            names = spec["files"]["params"]
            x, y = jnp.asarray(data["x"]), jnp.asarray(data["labels"], jnp.int32)
            forward = (_remat_models() if remat else jax_tasks._models())[model]
        params = {k: jnp.asarray(state[k]) for k in names}

        def loss_fn(p, x, y):
            logits = forward(p, x)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()

        self.loss_fn, self.x, self.y = loss_fn, x, y
        if spec["step"] == "adam":
            init, update, apply, self.adam = _adam()

            def step(p, s, x, y):
                loss, g = jax.value_and_grad(loss_fn)(p, x, y)
                u, s = update(g, s, p)
                return apply(p, u), s, loss

            self.state = [params, init(params)]
            f = jax.jit(step, donate_argnums=(0, 1))
            self._lower = lambda: f.lower(*self.state, x, y)

            def run():
                p, s, loss = jax.block_until_ready(f(*self.state, x, y))
                self.state = [p, s]
                return float(loss)
        else:
            self.adam = None
            self.state = [params]
            g = jax.jit(jax.value_and_grad(loss_fn))
            self._lower = lambda: g.lower(params, x, y)

            def run():
                loss, _ = jax.block_until_ready(g(params, x, y))
                return float(loss)
        self._run = run
        self.params = sum(int(np.prod(v.shape)) for v in params.values())

    def step(self) -> float:
        return self._run()

    def saved(self) -> dict:
        from jax._src.ad_checkpoint import saved_residuals

        res = saved_residuals(self.loss_fn, self.state[0], self.x, self.y)
        kept = [(a, why) for a, why in res if not why.startswith("from the argument")]
        total = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a, _ in kept)
        out = {"saved_bytes": total, "saved_tensors": len(kept),
               "saved_method": "jax saved_residuals of the loss (jaxpr level), arguments left out"}
        try:  # what XLA's buffer assignment allocates for the compiled step (compiles it once more)
            ma = self._lower().compile().memory_analysis()
            out["xla_temp_bytes"] = int(ma.temp_size_in_bytes)
            out["xla_argument_bytes"] = int(ma.argument_size_in_bytes)
            out["xla_output_bytes"] = int(ma.output_size_in_bytes)
            out["xla_alias_bytes"] = int(ma.alias_size_in_bytes)
        except Exception as exc:  # noqa: BLE001 - optional
            out["xla_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return out
