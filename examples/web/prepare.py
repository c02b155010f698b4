"""Write what the page trains with (examples/web/README.md): the training-step graph of revgraph's demo MLP, its
initial state and the data batches, into ``data/``.

1. The demo MLP (``revgraph.tools.demo.mlp_model``: ``logits = relu(flatten(x) W1 + b1) W2 + b2``, x float32
   ``[N, 8, 8]``) and scikit-learn's digits (``revgraph.tools.demo.digits``, no download) are written as
   ``data/mlp.onnx`` and ``data/digits.npz``.
2. ``revgraph train ... --save-training-graph data/mlp.train.onnx`` writes the training-step graph (one
   standard ONNX graph: inputs the batch, ``labels``, the parameters, the optimizer state and ``step``; outputs
   ``loss``, the new parameters ``<p>.new``, the new state ``<s>.new`` and ``step.new``). ``--lr-schedule
   linear|cosine`` (with ``--warmup-steps``, ``--min-lr``) and ``--clip-grad-norm`` are passed on: a linear or
   cosine schedule adds the int64 scalar input ``total_steps`` (the run's total, which the decay reads; carried
   unchanged as ``total_steps.new``).
3. ``data/state.bin`` holds the first step's carried inputs: the parameters as the model file holds them
   (before training), the optimizer state zero, ``step`` 0 and ``total_steps`` = ``--steps`` (the page's run is
   the schedule's run) -- what ``TrainingGraph.initial_state()`` feeds. Any other input is refused.
4. ``data/batches.bin`` holds ``--steps`` batches of ``--batch-size`` images and labels, drawn in a shuffled
   order (``--seed``) without replacement, full batches only.
5. ``data/manifest.json`` says where each array lies in the two files (name, dtype, shape, byte offset) and
   which output feeds which input at the next step (``carried``: the ``.new`` naming convention of
   ``revgraph.train``, the pairs of ``TrainingGraph.carried()``).

``python prepare.py --check`` also runs the steps with Python onnxruntime and prints its losses
(:func:`python_losses`; the test compares them with the page's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64"}


def _append(blob: bytearray, entries: dict, name: str, array: np.ndarray) -> None:
    """Append ``array`` to ``blob`` (little-endian, 8-byte aligned so the page can view it as a typed array)."""
    blob.extend(b"\0" * (-len(blob) % 8))
    entries[name] = {"dtype": array.dtype.name, "shape": list(array.shape), "offset": len(blob),
                     "bytes": array.nbytes}
    blob.extend(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


def _declared(vi: onnx.ValueInfoProto) -> tuple[str, list[int]]:
    t = vi.type.tensor_type
    if t.elem_type not in DTYPES or any(not d.HasField("dim_value") for d in t.shape.dim):
        raise SystemExit(f"state input {vi.name!r} has no static float32/int64 type in the training graph")
    return DTYPES[t.elem_type], [d.dim_value for d in t.shape.dim]


def prepare(out: Path, steps: int = 40, batch_size: int = 32, seed: int = 0, lr: float = 0.003,
            schedule: tuple[str, int, float] = ("constant", 0, 0.0), clip: float | None = None) -> dict:
    """Write ``out/`` (module doc) and return the manifest; ``schedule`` is ``(--lr-schedule, --warmup-steps,
    --min-lr)``, ``clip`` ``--clip-grad-norm``."""
    import revgraph as rg
    from revgraph.tools import demo

    if steps < 1 or batch_size < 1:  # 0 steps would write a page that trains nothing
        raise SystemExit(f"--steps {steps} and --batch-size {batch_size} must be at least 1")
    out.mkdir(parents=True, exist_ok=True)
    train, _ = demo.digits(seed)
    model = demo.mlp_model(seed=seed)
    rg.save(model, out / "mlp.onnx")
    np.savez(out / "digits.npz", **train)
    # The CLI writes the graph (one epoch of training in Python as a side effect; the page starts from the
    # untrained weights of mlp.onnx).
    cmd = [sys.executable, "-m", "revgraph", "train", str(out / "mlp.onnx"), "--data", str(out / "digits.npz"),
           "--loss", "cross-entropy", "--optimizer", "adam", "--lr", str(lr), "--epochs", "1",
           "--batch-size", str(batch_size), "--save-training-graph", str(out / "mlp.train.onnx"),
           "-o", str(out / "mlp.trained.onnx"), "--lr-schedule", schedule[0], "--warmup-steps", str(schedule[1]),
           "--min-lr", str(schedule[2]), *(["--clip-grad-norm", str(clip)] if clip else [])]
    done = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if done.returncode:  # revgraph's own one-line error (a bad --lr-schedule, --min-lr ...), not a traceback
        raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                         f"revgraph train exited {done.returncode}")

    graph = onnx.load(out / "mlp.train.onnx").graph
    outputs = [o.name for o in graph.output]
    batch_names = {"x", "labels"}
    carried = [[i.name, f"{i.name}.new"] for i in graph.input if i.name not in batch_names]
    missing = [o for _, o in carried if o not in outputs]
    extra = [o for o in outputs if o == "grad_norm"]  # (with --clip-grad-norm: the norm before clipping, not carried)
    if missing or outputs[0] != "loss" or len(outputs) != len(carried) + 1 + len(extra):
        raise SystemExit(f"unexpected training graph outputs {outputs} (no output {missing})")

    state_blob, state = bytearray(), {}
    params = {vi.name for vi in graph.input if vi.name in model.initializers}
    for vi in graph.input:
        if vi.name in batch_names:
            continue
        dtype, shape = _declared(vi)
        if vi.name in model.initializers:  # a parameter: its initial value
            value = np.asarray(model.initializers[vi.name])
        elif vi.name == "total_steps":  # a linear/cosine schedule's total: this run's steps (0 would end the decay)
            value = np.array(steps, np.int64)
        elif vi.name == "step" or vi.name.rpartition(".")[0] in params:  # the step counter, optimizer state: zero
            value = np.zeros(shape, dtype)
        else:  # (an input this script does not know, e.g. the fp16 loss scale: zeros would silently be wrong)
            raise SystemExit(f"training graph input {vi.name!r}: prepare.py does not know its first value")
        if list(value.shape) != shape or value.dtype.name != dtype:
            raise SystemExit(f"{vi.name!r}: {value.dtype}{list(value.shape)} does not fit the graph's {dtype}{shape}")
        _append(state_blob, state, vi.name, value)

    order = np.random.default_rng(seed).permutation(len(train["labels"]))
    if steps * batch_size > len(order):
        raise SystemExit(f"--steps {steps} x --batch-size {batch_size} is more than the {len(order)} samples")
    batch_blob, batches = bytearray(), []
    for k in range(steps):
        rows = order[k * batch_size:(k + 1) * batch_size]
        entries: dict = {}
        _append(batch_blob, entries, "x", train["x"][rows])
        _append(batch_blob, entries, "labels", train["labels"][rows])
        batches.append(entries)
    (out / "state.bin").write_bytes(bytes(state_blob))
    (out / "batches.bin").write_bytes(bytes(batch_blob))
    manifest = {"graph": "mlp.train.onnx", "loss": "loss", "state_file": "state.bin", "state": state,
                "batch_file": "batches.bin", "batches": batches, "carried": carried, "steps": steps,
                "batch_size": batch_size, "optimizer": "adam", "lr": lr, "lr_schedule": schedule[0],
                "warmup_steps": schedule[1], "min_lr": schedule[2], "clip_grad_norm": clip}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _view(blob: bytes, entry: dict) -> np.ndarray:
    arr = np.frombuffer(blob, np.dtype(entry["dtype"]).newbyteorder("<"), offset=entry["offset"],
                        count=int(np.prod(entry["shape"], dtype=np.int64)))
    return arr.reshape(entry["shape"]).astype(entry["dtype"])


def python_losses(data: Path) -> list[float]:
    """The losses of the manifest's steps run by Python onnxruntime (CPU) on the same graph and feeds as the
    page: each step's carried outputs are the next step's inputs."""
    import onnxruntime as ort

    manifest = json.loads((data / "manifest.json").read_text())
    state_blob, batch_blob = (data / manifest["state_file"]).read_bytes(), (data / manifest["batch_file"]).read_bytes()
    feeds = {k: _view(state_blob, e) for k, e in manifest["state"].items()}
    sess = ort.InferenceSession(str(data / manifest["graph"]), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    losses = []
    for entries in manifest["batches"]:
        feeds.update({k: _view(batch_blob, e) for k, e in entries.items()})
        result = dict(zip(names, sess.run(None, feeds), strict=True))
        losses.append(float(result[manifest["loss"]]))
        feeds.update({i: result[o] for i, o in manifest["carried"]})
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE / "data"), help="output directory (default: data/ next to this file)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.003, help="Adam's learning rate (default 0.003, the demo's)")
    from revgraph.train.schedules import SCHEDULES

    p.add_argument("--lr-schedule", default="constant", choices=list(SCHEDULES), help="revgraph train's --lr-schedule "
                   "(default constant); the schedule's total steps are --steps")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--clip-grad-norm", type=float)
    p.add_argument("--check", action="store_true", help="also print the losses of Python onnxruntime")
    args = p.parse_args()
    m = prepare(Path(args.out), args.steps, args.batch_size, args.seed, args.lr,
                (args.lr_schedule, args.warmup_steps, args.min_lr), args.clip_grad_norm)
    print(f"wrote {args.out}: {m['graph']}, {len(m['carried'])} carried values, {m['steps']} batches of "
          f"{m['batch_size']}")
    if args.check:
        print("onnxruntime (Python) losses:", " ".join(f"{v:.6f}" for v in python_losses(Path(args.out))))


if __name__ == "__main__":
    main()
