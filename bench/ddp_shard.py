"""ZeRO-2 (``--shard gradients``) against unsharded data-parallel training at 2 processes: throughput of the
models of bench/ddp.py (bench/ddp_models.py), with alternating turns.

    python bench/ddp_shard.py [--turns N] [--models mlp,transformer,...] [--shards none,gradients,gradients@REV]
                              [--json FILE] [--profile] [--bucket-mb MB] [--steps-scale S] [--commit REV]
                              [--rounds R]

Each configuration is a launch of bench/ddp_worker.py under torchrun (2 processes, 1 thread each, batch 64 per
process, Adam; 20 untimed warm-up steps, then the steps of bench/ddp.py's full run, scaled by ``--steps-scale``,
from a barrier to a barrier). Within a turn, for each model, the shard modes run one after the other, their order
reversed every turn (``--commit REV``: revgraph's ``src/`` as committed at REV; a mode ``gradients@REV``: that
mode with revgraph as committed at REV, in the same turns). Printed: per model and mode the
median samples/s over turns, the ratio of the medians (sharded / unsharded time per sample: above 1 is slower) and
the median over turns of the ratio of the two launches of one turn, and the load average before and after.
``--profile``: the engine's phase medians (``Trainer(profile=True)``: forward+backward, which for ZeRO-2 includes
the gradient reduction, exchange, and update, which includes starting the all-gather of the parameters: on the
CPU its wait falls before the next step, outside the phases), one more launch per configuration.

``--rounds R``: the modes are compared within one launch instead of across launches (whose speeds differ by up to
1.5x on this machine, for reasons of the launch: which cores, the load that minute). Per turn and model, one launch
builds a Trainer per mode in the same process group and runs ``R`` rounds, each mode training the timed steps in
turn (order reversed each round); printed: the median over all rounds of the within-round time ratio to the first
mode, with its quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ddp
import ddp_models


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--models", default="mlp,rnn,transformer,wide")
    parser.add_argument("--shards", default="none,gradients")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps-scale", type=float, default=1.0)
    parser.add_argument("--bucket-mb", type=float, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rounds", type=int, default=0, help="paired within a launch: each turn is one launch per "
                        "model running every mode of --shards (no @REV) in R alternating rounds "
                        "(bench/ddp_worker.py --rounds); the ratio is the median over all rounds of the two modes' "
                        "times in the same round")
    parser.add_argument("--json", default=None)
    parser.add_argument("--commit", default=None, help="revgraph as committed at REV (bench/ddp.py --commit)")
    args = parser.parse_args()
    import tempfile

    import numpy as np

    models, shards = args.models.split(","), args.shards.split(",")
    tmp = Path(tempfile.mkdtemp())
    env, code = ddp.revgraph_source(args.commit, tmp)
    envs = {}  # "gradients@REV" in --shards: that mode with revgraph as committed at REV, in the same turns
    for label in shards:
        if "@" in label:
            (tmp / label).mkdir()
            envs[label] = ddp.revgraph_source(label.split("@")[1], tmp / label)[0]
    data = {}
    for m in models:
        data[m] = tmp / f"{m}.npz"
        np.savez(data[m], **ddp_models.data(m, 50 * args.batch * 2, seed=1))
    log = open(tmp / "launch.log", "w")  # noqa: SIM115 - the failed launches' output, kept for the run
    out = {"code": code, "load_before": os.getloadavg(), "runs": {}, "machine": ddp.machine()}

    def worker(m: str, shard: str, extra: list[str]) -> list[str]:
        steps = max(50, round(ddp.FULL_STEPS[m][2] * args.steps_scale / 50) * 50)  # (the worker's multiple of 50)
        # (a REV from before bucket_mb=None was the default: its default, 25)
        bucket = ["--bucket-mb", str(args.bucket_mb or 25.0)] if args.bucket_mb or "@" in shard else []
        return ["--framework", "revgraph", "--model", m, "--mode", "ddp", "--batch", str(args.batch), "--steps",
                str(steps), "--data", str(data[m]), "--shard", shard.split("@", maxsplit=1)[0], *bucket, *extra]

    if args.rounds:
        return paired(args, models, shards, worker, env, log, out)
    for turn in range(args.turns):
        for m in models:
            for shard in (shards if turn % 2 == 0 else shards[::-1]):
                answer = ddp.launch(worker(m, shard, []), 2, envs.get(shard, env), 600, log)
                if answer:
                    out["runs"].setdefault(f"{m}/{shard}", []).append(answer["samples_per_s"])
                    print(f"turn {turn + 1} {m:12s} {shard:10s} {answer['samples_per_s']:10.0f} samples/s", flush=True)
    if args.profile:
        for m in models:
            for shard in shards:
                answer = ddp.launch(worker(m, shard, ["--shard-profile"]), 2, envs.get(shard, env), 600, log)
                if answer:
                    out.setdefault("phases", {})[f"{m}/{shard}"] = answer["phases_ms_per_step"]
    out["load_after"] = os.getloadavg()
    base = shards[0]
    print(f"load average before {out['load_before']}, after {out['load_after']}")
    for m in models:
        ref = out["runs"].get(f"{m}/{base}")
        for shard in shards:
            got = out["runs"].get(f"{m}/{shard}")
            if not got or not ref:
                continue
            line = f"{m:12s} {shard:10s} median {statistics.median(got):10.0f} samples/s"
            if shard != base and len(got) == len(ref):
                line += (f"  time ratio {statistics.median(ref) / statistics.median(got):.3f}x (per turn "
                         f"{statistics.median(r / g for r, g in zip(ref, got, strict=True)):.3f}x)")
            print(line)
            if "phases" in out and f"{m}/{shard}" in out["phases"]:
                ph = out["phases"][f"{m}/{shard}"]
                print("    " + ", ".join(f"{k[7:]} {v:.3f} ms" for k, v in ph.items() if k.startswith("median ")))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def paired(args, models, shards, worker, env, log, out) -> int:
    """``--rounds R``: per turn and model one launch running every mode in ``R`` alternating rounds; prints each
    mode's median seconds per round and, against the first mode, the median over rounds of the within-round time
    ratio with its quartiles."""
    if any("@" in s for s in shards):
        raise SystemExit("--rounds runs the modes in one process: no mode@REV")
    for turn in range(args.turns):
        for m in models:
            answer = ddp.launch([*worker(m, ",".join(shards), []), "--rounds", str(args.rounds)], 2, env, 1200, log)
            if answer:
                for s, times in answer["rounds"].items():
                    out["runs"].setdefault(f"{m}/{s}", []).extend(times)
                print(f"turn {turn + 1} {m:12s} " + ", ".join(
                    f"{s} {statistics.median(t) * 1e3:.1f} ms" for s, t in answer["rounds"].items()), flush=True)
    out["load_after"] = os.getloadavg()
    print(f"load average before {out['load_before']}, after {out['load_after']}")
    for m in models:
        ref = out["runs"].get(f"{m}/{shards[0]}")
        for s in shards[1:]:
            got = out["runs"].get(f"{m}/{s}")
            if ref and got:
                q = statistics.quantiles([g / r for g, r in zip(got, ref, strict=True)], n=4)
                print(f"{m:12s} {s:10s} time ratio per round: median {q[1]:.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f}x, "
                      f"{len(got)} rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
