"""``--offload optimizer`` (issue 43, item 2): the bytes each Adam trainer keeps on the device and in host memory
(``engine.held()``: the engine's own buffers, counted from their types) and the time of a step, with and without
offloading, for the step benchmark's MLP and Transformer (bench/models.py, batch 64) and the demo MLP at width
4096 (64-4096-10 on the digits, 0.3 M parameters).

On ``--device cpu`` offloading is a no-op; this script sets the internal switch (``REVGRAPH_OFFLOAD_ON_CPU=1``) so
that the offloaded step runs there too (host buffer sets, a separate copy of the parameters for the backward,
the gradients and the parameters copied every step): what it costs over the plain step is the copies' time and
the update's separate session. On ``--device cuda`` the copies cross the bus. Step time: the median of up to
``--seconds`` of steps after 3 warm-up steps, the two trainers alternating in rounds.

    python bench/offload.py [--device cpu|cuda] [--threads 1] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

import revgraph as rg
from revgraph.tools import demo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (bench/models.py)


def _models(tmp: str):
    from models import load_npz, write_step_model

    for name in ("mlp", "transformer"):
        info = write_step_model(name, 64, tmp)
        _, data = load_npz(info["npz"])
        yield f"{name} (batch 64)", lambda info=info: (info["path"], info["params"]), {"x": data["x"],
                                                                                      "labels": data["labels"]}
    train, _ = demo.digits()
    yield "demo MLP 4096 (batch 64)", lambda: (demo.mlp_model(hidden=4096), None), {"x": train["x"][:64],
                                                                                  "labels": train["labels"][:64]}


def _held(tr) -> tuple[int, int]:
    h = tr._engine.held()
    return h["state"] + h["gradients"], h.get("host_state", 0) + h.get("host_gradients", 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    os.environ["REVGRAPH_OFFLOAD_ON_CPU"] = "1"  # (read when a Trainer is built)
    print(f"{'model':<26} {'device MB plain':>15} {'device MB offl.':>15} {'host MB offl.':>13} "
          f"{'plain ms':>9} {'offl. ms':>9} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, make, batch in _models(tmp):
            trainers = []
            for offload in ("none", "optimizer"):
                model, params = make()
                trainers.append(rg.Trainer(model, "cross-entropy", "adam", params=params, device=args.device,
                                           threads=args.threads, offload=offload))
            for tr in trainers:
                for _ in range(3):
                    tr.step(batch)
            times = [[], []]
            start = time.perf_counter()
            while time.perf_counter() - start < args.seconds and len(times[1]) < 200:
                for k, tr in enumerate(trainers):
                    t0 = time.perf_counter()
                    tr.step(batch)
                    times[k].append(time.perf_counter() - t0)
            assert trainers[0].losses == trainers[1].losses or args.device != "cpu", "the losses differ"
            (dev0, _), (dev1, host1) = _held(trainers[0]), _held(trainers[1])
            plain, off = (float(np.median(t)) * 1e3 for t in times)
            print(f"{label:<26} {dev0 / 2**20:15.2f} {dev1 / 2**20:15.2f} {host1 / 2**20:13.2f} {plain:9.2f} "
                  f"{off:9.2f} {off / plain:6.2f}", flush=True)


if __name__ == "__main__":
    main()
