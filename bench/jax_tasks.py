"""JAX's side of the training-step comparison: ``jax.jit(jax.value_and_grad(loss))`` on the CPU.

Runs in its own virtual environment (envs.py) as a worker of bench/run.py. The models are those of
models.py written with ``jax.numpy`` and ``jax.lax`` (NCHW convolutions, batch norm with batch statistics,
PyTorch's ``TransformerEncoderLayer`` with post-norm and ReLU, the RNN as ``lax.scan``), reading the
parameters PyTorch exported under their ``state_dict`` names, so the loss and gradients can be compared with
the other frameworks'. One step is a call of the compiled function and ``block_until_ready``.
"""

from __future__ import annotations

import time

import numpy as np

_STEPS: dict[str, dict] = {}


def versions() -> dict:
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__,
            "devices": [str(d) for d in jax.devices()]}


def _load(npz: str):
    with np.load(npz) as f:
        state = {k[6:]: f[k] for k in f.files if k.startswith("param:")}
        data = {k: f[k] for k in f.files if not k.startswith("param:")}
    return state, data


def _models():
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
        w = p[f"{name}.weight"].reshape(1, -1, 1, 1)
        b = p[f"{name}.bias"].reshape(1, -1, 1, 1)
        return (x - mean) * lax.rsqrt(var + eps) * w + b

    def layer_norm(p, name, x, eps=1e-5):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"]

    def mlp(p, x):
        h = jax.nn.relu(linear(p, "l1", x))
        return linear(p, "l3", jax.nn.relu(linear(p, "l2", h)))

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
        def step(h, x_t):
            return jnp.tanh(h @ p["W"] + x_t @ p["U"] + p["b"]), None

        h, _ = lax.scan(step, jnp.zeros((xs.shape[1], p["W"].shape[0]), xs.dtype), xs)
        return linear(p, "fc", h)

    return {"mlp": mlp, "cnn": cnn, "transformer": transformer, "rnn": rnn}


def prepare_step(key: str, info: dict, threads: int = 2, mode: str = "grad") -> dict:
    import jax
    import jax.numpy as jnp

    if mode != "grad":
        raise ValueError("only forward plus backward is measured for JAX")
    state, data = _load(info["npz"])
    forward = _models()[info["model"]]
    params = {k: jnp.asarray(state[k]) for k in info["params"]}
    x, y = jnp.asarray(data["x"]), jnp.asarray(data["labels"])

    def loss_fn(p, x, y):
        logits = forward(p, x)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, y[:, None], axis=-1).mean()

    f = jax.jit(jax.value_and_grad(loss_fn))
    t0 = time.perf_counter()
    loss, grads = jax.block_until_ready(f(params, x, y))
    compile_s = time.perf_counter() - t0

    def run():
        return jax.block_until_ready(f(params, x, y))

    _STEPS[key] = {"run": run}
    return {"loss": float(loss), "compile_seconds": compile_s,
            "grad_sq": {k: float(np.sum(np.square(np.asarray(v, np.float64)))) for k, v in grads.items()}}


def step_time(key: str, seconds: float = 0.5, min_iters: int = 3) -> dict:
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
